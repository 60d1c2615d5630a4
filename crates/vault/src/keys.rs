//! Key material in secret memory and the key table (owners, ACLs, versions).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use memveil_cipher::{Aes, Xts};

use crate::gcm::VaultGcm;
use memveil_secmem::{SecmemError, SecretBox, SecretPool};

use crate::proto::{perm, KeyInfo, KeyKind, Mode};
use crate::ring::{status, Entry, Op};

/// Expanded key objects, each built straight into secret memory. An AES
/// key is one [`VaultGcm`], whose AES schedule also serves ECB, CBC and CTR.
pub(crate) enum Material {
    Aes(SecretBox<Option<VaultGcm>>),
    Xts(SecretBox<Option<Xts>>),
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
            KeyKind::Xts128 | KeyKind::Xts256 => {
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

    /// A fresh random key generated inside secret memory.
    pub(crate) fn random(
        pool: &SecretPool,
        kind: KeyKind,
        keep_raw: bool,
    ) -> Result<Version, MaterialError> {
        let mut buf = pool.alloc_bytes(kind.key_len())?;
        loop {
            memveil_sys::getrandom(&mut buf).map_err(MaterialError::Random)?;
            match Version::from_bytes(pool, kind, &buf, keep_raw) {
                Err(MaterialError::Cipher(memveil_cipher::CipherError::EqualXtsHalves)) => {}
                other => return other,
            }
        }
    }

    pub(crate) fn raw(&self) -> Option<&[u8]> {
        self.raw.as_deref()
    }

    /// Bytes of the secret pool a version of `kind` takes (what the per-uid
    /// pool share is charged), with the raw key kept when `keep_raw`.
    pub(crate) fn pool_bytes(kind: KeyKind, keep_raw: bool) -> usize {
        let material = match kind {
            KeyKind::Aes128 | KeyKind::Aes256 => {
                memveil_secmem::pool_footprint(std::mem::size_of::<Option<VaultGcm>>())
            }
            KeyKind::Xts128 | KeyKind::Xts256 => {
                memveil_secmem::pool_footprint(std::mem::size_of::<Option<Xts>>())
            }
        };
        let raw = if keep_raw {
            memveil_secmem::pool_footprint(kind.key_len())
        } else {
            0
        };
        material + raw
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

    /// Bytes of the secret pool this key's versions take.
    pub(crate) fn pool_bytes(&self) -> usize {
        self.versions.len() * Version::pool_bytes(self.kind, self.persistent)
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
