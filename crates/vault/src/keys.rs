//! Key material in secret memory and the key table (owners, ACLs, versions).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use memveil_cipher::{Aes, Xts};

use crate::gcm::VaultGcm;
use crate::limits::Resource;
use memveil_secmem::{SecmemError, SecretBox, SecretPool};

use memveil_asym::hash::{hmac, hmac_verify, Hasher};
use memveil_asym::{Algorithm, AsymError, DecryptScheme, Hash, PrivateKey, SignScheme};

use crate::proto::{perm, KeyInfo, KeyKind, Mode, PublicParts};
use crate::ring::{status, Entry, Op};

/// Expanded key objects, each built straight into secret memory. An AES
/// key is one [`VaultGcm`], whose AES schedule also serves ECB, CBC and CTR.
/// An asymmetric key's object sits in the pool and its aws-lc parts in the
/// secret heap (`memveil_asym::use_secret_heap`, at start). A generic
/// secret is its bytes in the pool. A certificate is public bytes.
pub(crate) enum Material {
    Aes(SecretBox<Option<VaultGcm>>),
    Xts(SecretBox<Option<Xts>>),
    Asym(SecretBox<Option<PrivateKey>>),
    Secret(SecretBox<[u8]>),
    Cert(Vec<u8>),
    Data(Vec<u8>),
}

/// What the secret heap holds for one asymmetric key, about (aws-lc's
/// objects, Montgomery contexts, blinding), charged to the owner's share of
/// the heap (`--uid-asym-heap-kib`).
fn heap_estimate(a: Algorithm) -> usize {
    match a {
        // Measured with aws-lc 0.47 (key, Montgomery contexts, one
        // blinding): 5.1, 7.0 and 8.7 KiB; EC keys 0.4 KiB.
        Algorithm::Rsa2048 => 6 << 10,
        Algorithm::Rsa3072 => 8 << 10,
        Algorithm::Rsa4096 => 10 << 10,
        Algorithm::P256 | Algorithm::P384 => 1 << 10,
        Algorithm::Ed25519 => 0,
    }
}

/// Maps a failed asymmetric operation to its ring status.
fn asym_status(e: &AsymError) -> u32 {
    match e {
        AsymError::BadInput(_) | AsymError::ShortOutput { .. } => status::BAD_LENGTH,
        AsymError::WrongKey { .. } => status::WRONG_MODE,
        AsymError::Rejected(_) => status::BAD_CIPHERTEXT,
        _ => status::FAILED,
    }
}

/// One version of a key: its schedules and, for persistent keys, the raw
/// bytes needed to seal it again (also in secret memory).
pub(crate) struct Version {
    material: Material,
    raw: Option<SecretBox<[u8]>>,
}

/// Failure to build key material.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MaterialError {
    #[error("secret memory: {0}")]
    Secmem(#[from] SecmemError),
    #[error("{0}")]
    Cipher(#[from] memveil_cipher::CipherError),
    #[error("random source: {0}")]
    Random(std::io::Error),
    #[error("{0}")]
    Asym(#[from] AsymError),
    #[error("a certificate or data object is imported, not generated")]
    Generate,
    #[error("a generic secret of {0} bytes: {min} to {max} expected", min = crate::proto::MIN_SECRET, max = crate::proto::MAX_SECRET)]
    SecretLength(usize),
}

impl Version {
    /// Expands `key` (which the caller keeps in secret memory) into schedules
    /// in secret memory; keeps a secret copy of the bytes when `keep_raw`.
    pub(crate) fn from_bytes(
        pool: &SecretPool,
        kind: KeyKind,
        key: &[u8],
        keep_raw: bool,
    ) -> Result<Version, MaterialError> {
        if let Some(alg) = kind.asym() {
            return Version::asym(pool, alg, keep_raw, || {
                PrivateKey::from_components(alg, key)
            });
        }
        if matches!(kind, KeyKind::Cert | KeyKind::Data) {
            let raw = if keep_raw {
                let mut r = pool.alloc_bytes(key.len())?;
                r.copy_from_slice(key);
                Some(r)
            } else {
                None
            };
            let material = if kind == KeyKind::Cert {
                Material::Cert(key.to_vec())
            } else {
                Material::Data(key.to_vec())
            };
            return Ok(Version { material, raw });
        }
        if kind == KeyKind::Secret {
            if !kind.import_len_ok(key.len()) {
                return Err(MaterialError::SecretLength(key.len()));
            }
            let copy = |pool: &SecretPool| -> Result<SecretBox<[u8]>, SecmemError> {
                let mut r = pool.alloc_bytes(key.len())?;
                r.copy_from_slice(key);
                Ok(r)
            };
            let raw = if keep_raw { Some(copy(pool)?) } else { None };
            return Ok(Version {
                material: Material::Secret(copy(pool)?),
                raw,
            });
        }
        if key.len() != kind.key_len() {
            return Err(MaterialError::Cipher(
                memveil_cipher::CipherError::BadKeyLength {
                    algorithm: kind.name(),
                    got: key.len(),
                    expected: "the kind's key length",
                },
            ));
        }
        // Constructors run inside the pool (`Option` keeps the value in
        // place); their only failure modes are checked up front.
        let material = match kind {
            KeyKind::Aes128 | KeyKind::Aes256 => {
                let gcm = pool.alloc(|| VaultGcm::new(key).ok())?;
                if gcm.is_none() {
                    return Err(MaterialError::Cipher(
                        Aes::new(&[])
                            .err()
                            .unwrap_or(memveil_cipher::CipherError::EqualXtsHalves),
                    ));
                }
                Material::Aes(gcm)
            }
            _ => {
                let half = key.len() / 2;
                if key[..half] == key[half..] {
                    return Err(MaterialError::Cipher(
                        memveil_cipher::CipherError::EqualXtsHalves,
                    ));
                }
                let x = pool.alloc(|| Xts::from_combined(key).ok())?;
                if x.is_none() {
                    return Err(MaterialError::Cipher(
                        memveil_cipher::CipherError::EqualXtsHalves,
                    ));
                }
                Material::Xts(x)
            }
        };
        let raw = if keep_raw {
            let mut r = pool.alloc_bytes(key.len())?;
            r.copy_from_slice(key);
            Some(r)
        } else {
            None
        };
        Ok(Version { material, raw })
    }

    /// An asymmetric key built by `make` straight into the pool (the stack
    /// is scrubbed after), with its components kept when `keep_raw`.
    fn asym(
        pool: &SecretPool,
        alg: Algorithm,
        keep_raw: bool,
        make: impl FnOnce() -> Result<PrivateKey, AsymError>,
    ) -> Result<Version, MaterialError> {
        let mut err = None;
        let key = pool.alloc(|| match make() {
            Ok(k) => Some(k),
            Err(e) => {
                err = Some(e);
                None
            }
        })?;
        let Some(k) = key.as_ref() else {
            return Err(MaterialError::Asym(
                err.unwrap_or(AsymError::Backend(format!("{alg:?} key not built"))),
            ));
        };
        let raw = if keep_raw {
            let mut buf = pool.alloc_bytes(k.components_len())?;
            let n = k.components(&mut buf)?;
            let mut r = pool.alloc_bytes(n)?;
            r.copy_from_slice(&buf[..n]);
            Some(r)
        } else {
            None
        };
        Ok(Version {
            material: Material::Asym(key),
            raw,
        })
    }

    /// A fresh random key generated inside secret memory.
    pub(crate) fn random(
        pool: &SecretPool,
        kind: KeyKind,
        keep_raw: bool,
    ) -> Result<Version, MaterialError> {
        if let Some(alg) = kind.asym() {
            return Version::asym(pool, alg, keep_raw, || PrivateKey::generate(alg));
        }
        if matches!(kind, KeyKind::Cert | KeyKind::Data) {
            return Err(MaterialError::Generate);
        }
        let mut buf = pool.alloc_bytes(kind.key_len())?;
        loop {
            memveil_sys::getrandom(&mut buf).map_err(MaterialError::Random)?;
            match Version::from_bytes(pool, kind, &buf, keep_raw) {
                Err(MaterialError::Cipher(memveil_cipher::CipherError::EqualXtsHalves)) => {}
                other => return other,
            }
        }
    }

    /// A fresh random generic secret of `len` bytes, generated inside
    /// secret memory.
    pub(crate) fn random_secret(
        pool: &SecretPool,
        len: usize,
        keep_raw: bool,
    ) -> Result<Version, MaterialError> {
        if !KeyKind::Secret.import_len_ok(len) {
            return Err(MaterialError::SecretLength(len));
        }
        let mut buf = pool.alloc_bytes(len)?;
        memveil_sys::getrandom(&mut buf).map_err(MaterialError::Random)?;
        Version::from_bytes(pool, KeyKind::Secret, &buf, keep_raw)
    }

    pub(crate) fn raw(&self) -> Option<&[u8]> {
        self.raw.as_deref()
    }

    /// What a version of `kind` is charged to its owner (with the raw key
    /// kept when `keep_raw`): its pool bytes, and for an asymmetric key the
    /// estimate of its aws-lc objects in the secret heap.
    pub(crate) fn charge(kind: KeyKind, keep_raw: bool) -> Resource {
        Resource::Key {
            pool: Version::pool_bytes(kind, keep_raw),
            heap: kind.asym().map_or(0, heap_estimate),
        }
    }

    /// Bytes of the secret pool a version of `kind` takes (what the per-uid
    /// pool share is charged), with the raw key kept when `keep_raw`.
    pub(crate) fn pool_bytes(kind: KeyKind, keep_raw: bool) -> usize {
        let fp = memveil_secmem::pool_footprint;
        let (material, raw) = match kind {
            KeyKind::Aes128 | KeyKind::Aes256 => {
                (fp(std::mem::size_of::<Option<VaultGcm>>()), kind.key_len())
            }
            KeyKind::Xts128 | KeyKind::Xts256 => {
                (fp(std::mem::size_of::<Option<Xts>>()), kind.key_len())
            }
            KeyKind::Cert | KeyKind::Data => (0, crate::proto::MAX_CERT),
            KeyKind::Secret => (fp(crate::proto::MAX_SECRET), crate::proto::MAX_SECRET),
            k => {
                let a = k.asym().unwrap_or(Algorithm::Rsa4096);
                (
                    fp(std::mem::size_of::<Option<PrivateKey>>()),
                    8 * 2 + a.max_output() * 4 + 8,
                )
            }
        };
        material + if keep_raw { fp(raw) } else { 0 }
    }

    /// Runs one checked entry over `data` (in place). `aad` is the GCM
    /// associated data; `tag_out` receives the GCM tag on encryption.
    pub(crate) fn apply(
        &self,
        e: &Entry,
        data: &mut [u8],
        aad: &[u8],
        tag_out: &mut [u8; 16],
    ) -> Result<(), u32> {
        let bad = |_| status::BAD_LENGTH;
        let gone = status::NO_KEY;
        match (&self.material, e.mode) {
            (Material::Aes(g), Mode::Ecb) => match (g.as_ref().ok_or(gone)?.aes(), e.op) {
                (a, Op::Encrypt) => a.ecb_encrypt(data).map_err(bad),
                (a, Op::Decrypt) => a.ecb_decrypt(data).map_err(bad),
            },
            (Material::Aes(g), Mode::Cbc) => match (g.as_ref().ok_or(gone)?.aes(), e.op) {
                (a, Op::Encrypt) => a.cbc_encrypt(&e.iv, data).map_err(bad),
                (a, Op::Decrypt) => a.cbc_decrypt(&e.iv, data).map_err(bad),
            },
            (Material::Aes(g), Mode::Ctr) => {
                g.as_ref().ok_or(gone)?.aes().ctr_apply(&e.iv, data);
                Ok(())
            }
            (Material::Aes(gcm), Mode::Gcm) => {
                let gcm = gcm.as_ref().ok_or(gone)?;
                let mut nonce = [0u8; 12];
                nonce.copy_from_slice(&e.iv[..12]);
                match e.op {
                    Op::Encrypt => {
                        *tag_out = gcm.seal(&nonce, aad, data).map_err(bad)?;
                        Ok(())
                    }
                    Op::Decrypt => gcm
                        .open(&nonce, aad, data, &e.tag)
                        .map_err(|_| status::AUTH_FAILED),
                }
            }
            (Material::Aes(g), Mode::Cmac) => {
                let aes = g.as_ref().ok_or(gone)?.aes();
                match e.op {
                    Op::Encrypt => {
                        *tag_out = crate::cmac::cmac(aes, data);
                        Ok(())
                    }
                    Op::Decrypt if crate::cmac::verify(aes, data, &e.tag) => Ok(()),
                    Op::Decrypt => Err(status::AUTH_FAILED),
                }
            }
            (Material::Xts(x), Mode::Xts) => {
                // Unit 0: the whole entry is one data unit under the IV.
                // Otherwise units of `unit` bytes from sequence number IV
                // on, `step` apart (ring module doc). One path for both.
                let unit = match e.unit {
                    0 => data.len(),
                    u => usize::try_from(u).map_err(|_| status::BAD_LENGTH)?,
                };
                let (first, step) = (e.unit_seq(0), u128::from(e.step));
                match (x.as_ref().ok_or(gone)?, e.op) {
                    (x, Op::Encrypt) => x.encrypt_units(first, step, unit, data).map_err(bad),
                    (x, Op::Decrypt) => x.decrypt_units(first, step, unit, data).map_err(bad),
                }
            }
            _ => Err(status::WRONG_MODE),
        }
    }

    /// Runs one checked asymmetric entry: `input` (a private copy) in,
    /// the result into `out`; returns its length.
    pub(crate) fn apply_asym(&self, e: &Entry, input: &[u8], out: &mut [u8]) -> Result<usize, u32> {
        if let Material::Secret(key) = &self.material {
            return secret_op(e, key, input, out);
        }
        let Material::Asym(k) = &self.material else {
            return Err(status::WRONG_MODE);
        };
        let k = k.as_ref().ok_or(status::NO_KEY)?;
        let p = e.asym_params();
        let hash = |c| Hash::from_code(c).ok_or(status::BAD_PARAMS);
        let r = match (e.mode, e.op) {
            (Mode::RsaPkcs1, Op::Encrypt) => k.sign(SignScheme::Pkcs1, input, out),
            (Mode::RsaPkcs1, Op::Decrypt) => k.decrypt(DecryptScheme::Pkcs1, input, out),
            (Mode::RsaPss, Op::Encrypt) => {
                let s = SignScheme::Pss {
                    hash: hash(p.hash)?,
                    mgf1: hash(p.mgf1)?,
                    salt: p.len,
                };
                k.sign(s, input, out)
            }
            (Mode::RsaRaw, Op::Encrypt) => k.sign(SignScheme::Raw, input, out),
            (Mode::RsaRaw, Op::Decrypt) => k.decrypt(DecryptScheme::Raw, input, out),
            (Mode::RsaOaep, Op::Decrypt) => {
                let at = usize::try_from(p.len).map_err(|_| status::BAD_LENGTH)?;
                let (label, ct) = input.split_at_checked(at).ok_or(status::BAD_LENGTH)?;
                let s = DecryptScheme::Oaep {
                    hash: hash(p.hash)?,
                    mgf1: hash(p.mgf1)?,
                    label,
                };
                k.decrypt(s, ct, out)
            }
            (Mode::Ecdsa, Op::Encrypt) => k.sign(SignScheme::Ecdsa, input, out),
            (Mode::EdDsa, Op::Encrypt) => k.sign(SignScheme::Ed25519, input, out),
            _ => return Err(status::WRONG_MODE),
        };
        r.map_err(|err| {
            let s = asym_status(&err);
            if s == status::FAILED {
                crate::server::log_failure(&err);
            }
            s
        })
    }

    /// ECDH with this (EC) key: the shared secret into `out`.
    pub(crate) fn ecdh(&self, peer: &[u8], out: &mut [u8]) -> Result<usize, AsymError> {
        match &self.material {
            Material::Asym(k) => k
                .as_ref()
                .ok_or(AsymError::BadInput("key gone"))?
                .ecdh(peer, out),
            _ => Err(AsymError::BadInput("ECDH needs a P-256 or P-384 key")),
        }
    }

    /// The public half of an asymmetric key, or a certificate.
    pub(crate) fn public(&self) -> Option<PublicParts> {
        match &self.material {
            Material::Asym(k) => k.as_ref().map(|k| PublicParts::Key(k.public())),
            Material::Cert(der) => Some(PublicParts::Cert(der.clone())),
            Material::Data(d) => Some(PublicParts::Data(d.clone())),
            Material::Secret(k) => Some(PublicParts::SecretLen(
                u32::try_from(k.len()).unwrap_or(u32::MAX),
            )),
            _ => None,
        }
    }
}

/// The longest generic secret [`Mode::KeyDigest`] hashes: SHA-1's and
/// SHA-256's block. HMAC replaces a longer key by its digest, so digesting
/// one would hand out the HMAC key.
pub(crate) const MAX_DIGESTIBLE: usize = 64;

/// HMAC ([`Mode::Hmac`]) and a digest over the key ([`Mode::KeyDigest`])
/// with a generic secret `key`. The keyed hash state is on this thread's
/// stack (the workers' stacks are secret memory) and in aws-lc's heap (the
/// secret heap); the MAC to check is compared in constant time.
fn secret_op(e: &Entry, key: &[u8], input: &[u8], out: &mut [u8]) -> Result<usize, u32> {
    let p = e.asym_params();
    let h = Hash::from_code(p.hash).ok_or(status::BAD_PARAMS)?;
    match (e.mode, e.op) {
        (Mode::Hmac, Op::Encrypt) => match hmac(h, key, input, out) {
            0 => Err(status::BAD_LENGTH),
            n => Ok(n),
        },
        (Mode::Hmac, Op::Decrypt) => {
            let at = input.len().checked_sub(h.len()).ok_or(status::BAD_LENGTH)?;
            let (msg, mac) = input.split_at(at);
            if hmac_verify(h, key, msg, mac) {
                Ok(0)
            } else {
                Err(status::AUTH_FAILED)
            }
        }
        (Mode::KeyDigest, Op::Encrypt) => {
            // A key longer than a hash block is hashed by HMAC before use:
            // its digest would be the HMAC key itself. Refused.
            if key.len() > MAX_DIGESTIBLE {
                return Err(status::WRONG_MODE);
            }
            let at = usize::try_from(p.len).map_err(|_| status::BAD_LENGTH)?;
            let (before, after) = input.split_at_checked(at).ok_or(status::BAD_LENGTH)?;
            let mut d = Hasher::new(h).ok_or(status::NO_MEMORY)?;
            d.update(before);
            d.update(key);
            d.update(after);
            match d.finish_into(out) {
                0 => Err(status::BAD_LENGTH),
                n => Ok(n),
            }
        }
        _ => Err(status::WRONG_MODE),
    }
}

/// A named key with its owner, ACL and versions.
pub(crate) struct KeyEntry {
    pub(crate) id: u32,
    pub(crate) name: String,
    pub(crate) kind: KeyKind,
    pub(crate) owner: u32,
    pub(crate) persistent: bool,
    pub(crate) acl: BTreeMap<u32, u8>,
    pub(crate) versions: Vec<Arc<Version>>,
}

impl KeyEntry {
    /// Whether `uid` holds every bit of `need`.
    pub(crate) fn allows(&self, uid: u32, need: u8) -> bool {
        uid == self.owner || self.acl.get(&uid).is_some_and(|p| p & need == need)
    }

    /// Whether `uid` may see the key in listings.
    pub(crate) fn visible_to(&self, uid: u32) -> bool {
        uid == self.owner || self.acl.contains_key(&uid)
    }

    pub(crate) fn info(&self) -> KeyInfo {
        KeyInfo {
            id: self.id,
            name: self.name.clone(),
            kind: self.kind,
            owner: self.owner,
            versions: u32::try_from(self.versions.len()).unwrap_or(u32::MAX),
            persistent: self.persistent,
            acl: self.acl.iter().map(|(u, p)| (*u, *p)).collect(),
        }
    }

    /// What this key's versions are charged to its owner.
    pub(crate) fn charge(&self) -> Resource {
        Version::charge(self.kind, self.persistent).times(self.versions.len())
    }

    /// The version for a request (0 = newest).
    pub(crate) fn version(&self, v: u32) -> Option<&Arc<Version>> {
        if v == 0 {
            return self.versions.last();
        }
        self.versions.get(usize::try_from(v - 1).ok()?)
    }
}

/// Every key the vault holds.
#[derive(Default)]
pub(crate) struct KeyTable {
    pub(crate) next_id: u32,
    pub(crate) by_id: BTreeMap<u32, KeyEntry>,
    pub(crate) by_name: BTreeMap<String, u32>,
}

impl KeyTable {
    pub(crate) fn get(&self, name: &str) -> Option<&KeyEntry> {
        self.by_name.get(name).and_then(|id| self.by_id.get(id))
    }

    pub(crate) fn get_mut(&mut self, name: &str) -> Option<&mut KeyEntry> {
        let id = *self.by_name.get(name)?;
        self.by_id.get_mut(&id)
    }

    pub(crate) fn insert(&mut self, e: KeyEntry) {
        self.next_id = self.next_id.max(e.id.saturating_add(1));
        self.by_name.insert(e.name.clone(), e.id);
        self.by_id.insert(e.id, e);
    }

    pub(crate) fn remove(&mut self, name: &str) -> Option<KeyEntry> {
        let id = self.by_name.remove(name)?;
        self.by_id.remove(&id)
    }

    pub(crate) fn alloc_id(&mut self) -> u32 {
        let id = self.next_id.max(1);
        self.next_id = id.saturating_add(1);
        id
    }

    /// Keys `uid` owns, and the versions they hold in all.
    pub(crate) fn owned_by(&self, uid: u32) -> (usize, usize) {
        self.by_id
            .values()
            .filter(|k| k.owner == uid)
            .fold((0, 0), |(n, v), k| (n + 1, v + k.versions.len()))
    }

    /// Permission check for a data request; returns the version to use.
    pub(crate) fn for_request(&self, uid: u32, e: &Entry) -> Result<Arc<Version>, u32> {
        let k = self.by_id.get(&e.key).ok_or(status::NO_KEY)?;
        let need = match e.op {
            Op::Encrypt => perm::ENCRYPT,
            Op::Decrypt => perm::DECRYPT,
        };
        if !k.allows(uid, need) {
            return Err(status::DENIED);
        }
        if !k.kind.serves(e.mode) {
            return Err(status::WRONG_MODE);
        }
        k.version(e.version).cloned().ok_or(status::NO_KEY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::AsymParams;

    fn entry(mode: Mode, op: Op) -> Entry {
        let p = AsymParams {
            hash: Hash::Sha256.code(),
            mgf1: 0,
            len: 0,
        };
        Entry::asym(op, mode, 1, 0, (0, 0), (0, 64), p)
    }

    #[test]
    fn a_secret_longer_than_a_block_is_not_digested_and_macs_are_checked() {
        let mut out = [0u8; 64];
        let long = [7u8; 65];
        let digest = entry(Mode::KeyDigest, Op::Encrypt);
        // HMAC-SHA256 keys with SHA-256(long): its digest is refused.
        assert_eq!(
            secret_op(&digest, &long, b"", &mut out),
            Err(status::WRONG_MODE)
        );
        assert_eq!(secret_op(&digest, &long[..64], b"", &mut out), Ok(32));
        let n = secret_op(&entry(Mode::Hmac, Op::Encrypt), &long, b"m", &mut out).expect("mac");
        let mut input = b"m".to_vec();
        input.extend_from_slice(&out[..n]);
        let check = entry(Mode::Hmac, Op::Decrypt);
        assert_eq!(secret_op(&check, &long, &input, &mut out), Ok(0));
        input[1] ^= 1;
        assert_eq!(
            secret_op(&check, &long, &input, &mut out),
            Err(status::AUTH_FAILED)
        );
        assert_eq!(
            secret_op(&check, &long, b"short", &mut out),
            Err(status::BAD_LENGTH)
        );
    }
}
