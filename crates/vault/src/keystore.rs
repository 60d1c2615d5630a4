//! The sealed keystore on disk: persistent keys under AES-256-GCM with a
//! key-encryption key (KEK) from a passphrase (Argon2id) or a key file.
//!
//! File layout (`keys.vault` in the state directory), all little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 8  | magic `MVVAULT1` |
//! | 1  | KEK source: 1 = Argon2id passphrase, 2 = key file, 3 = KMIP key |
//! | 12 | Argon2id m (KiB), t, p (u32 each; zero for a key file) |
//! | 16 | salt |
//! | 12 | GCM nonce (fresh for every write) |
//! | 8  | ciphertext length |
//! | n  | ciphertext |
//! | 16 | tag (the header above is the associated data) |
//!
//! The plaintext (built and opened only in secret memory) is a `u32` count
//! and, per key: id u32, name (u16 length + bytes), kind u8, owner u32,
//! ACL (u16 count × (uid u32, perms u8)), versions (u16 count × (u16 length
//! + key bytes)).
//!
//! An asymmetric key's "key bytes" are its private components
//! (`memveil_asym::components`), a certificate's its DER.
//!
//! Writes are atomic: write `keys.vault.tmp`, fsync it, rename over
//! `keys.vault`, fsync the directory. A crash at any point leaves either the
//! old or the new file. For tests, `MEMVEIL_VAULT_CRASH_AT=partial|written|renamed`
//! aborts the process at that point of the next write.
#![forbid(unsafe_code)]

use std::fs::{self, File, OpenOptions};
use std::io::{Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use crate::gcm::VaultGcm as Gcm;
use memveil_secmem::{Policy, SecmemError, SecretBox, SecretPool};

use crate::proto::KeyKind;

const MAGIC: &[u8; 8] = b"MVVAULT1";
const HEADER: usize = 8 + 1 + 12 + 16 + 12 + 8;
/// File name of the keystore inside the state directory.
pub const FILE: &str = "keys.vault";
/// The passphrase-sealed copy of a KMIP-sealed keystore (`--kmip-fallback`).
pub const FALLBACK_FILE: &str = "keys.vault.fallback";

/// Where the key-encryption key comes from.
#[derive(Debug, Clone)]
pub enum KekSource {
    /// A passphrase read from this file (trailing newline removed), stretched with Argon2id.
    PassphraseFile(PathBuf),
    /// 32 raw bytes, or 64 hex digits, in this file.
    KeyFile(PathBuf),
    /// An AES-256 key held by a KMIP server, fetched (Get) into secret
    /// memory at every start and never written anywhere (docs/kmip.md).
    Kmip {
        /// The server and this host's certificates.
        config: memveil_kmip::Config,
        /// The key's Unique Identifier on the server.
        uid: String,
        /// A passphrase file that also seals a copy of the keystore
        /// ([`FALLBACK_FILE`]), for when the KMS is gone for good.
        fallback: Option<PathBuf>,
    },
}

/// Argon2id cost.
#[derive(Debug, Clone, Copy)]
pub struct KdfParams {
    /// Memory in KiB.
    pub m_kib: u32,
    /// Iterations.
    pub t: u32,
    /// Lanes.
    pub p: u32,
}

impl Default for KdfParams {
    fn default() -> Self {
        Self {
            m_kib: 64 * 1024,
            t: 3,
            p: 1,
        }
    }
}

/// Keystore errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeystoreError {
    /// Reading or writing a file failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not a keystore or is cut short.
    #[error("{path} is not a valid keystore ({why}); restore it from a backup or move it away to start empty")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The KEK did not open the keystore.
    #[error("{path}: the keystore does not open with this {source_kind} (wrong passphrase/key file, or the file was altered)")]
    WrongKey {
        /// The file.
        path: PathBuf,
        /// "passphrase" or "key file".
        source_kind: &'static str,
    },
    /// Another vault holds the state directory.
    #[error("{0}: another vault uses this state directory (its keystore is that vault's to write); stop it, or give this one another --state")]
    InUse(PathBuf),
    /// The keystore was sealed with the other KEK source.
    #[error("{path} was sealed with a {sealed}; pass --{flag}")]
    SourceMismatch {
        /// The file.
        path: PathBuf,
        /// What it was sealed with.
        sealed: &'static str,
        /// The flag to pass.
        flag: &'static str,
    },
    /// A key file of the wrong shape.
    #[error("key file {0}: expected 32 raw bytes or 64 hex digits")]
    BadKeyFile(PathBuf),
    /// An empty passphrase.
    #[error("passphrase file {0} is empty")]
    EmptyPassphrase(PathBuf),
    /// Argon2 refused its parameters.
    #[error("Argon2id: {0}")]
    Kdf(String),
    /// Secret memory ran out.
    #[error("secret memory: {0}")]
    Secmem(#[from] SecmemError),
    /// The KMIP server did not hand over the key-encryption key.
    #[error(
        "the keystore stays closed: its key-encryption key could not be fetched from KMIP: {0}"
    )]
    Kmip(#[from] memveil_kmip::KmipError),
}

/// One stored key, its bytes in secret memory.
pub(crate) struct StoredKey {
    pub id: u32,
    pub name: String,
    pub kind: KeyKind,
    pub owner: u32,
    pub acl: Vec<(u32, u8)>,
    pub versions: Vec<SecretBox<[u8]>>,
}

/// A key to seal (borrowed from the live table).
pub(crate) struct SealKey<'a> {
    pub id: u32,
    pub name: &'a str,
    pub kind: KeyKind,
    pub owner: u32,
    pub acl: Vec<(u32, u8)>,
    pub versions: Vec<&'a [u8]>,
}

/// An open keystore: its path and the KEK (a GCM key object in secret memory).
pub struct Keystore {
    dir: PathBuf,
    path: PathBuf,
    source: u8,
    params: KdfParams,
    salt: [u8; 16],
    kek: SecretBox<Option<Gcm>>,
    pool: SecretPool,
    /// The passphrase-sealed copy kept beside a KMIP-sealed keystore.
    fallback: Option<Box<Keystore>>,
    /// The state directory, open and `flock`ed for this vault's life (the
    /// outer keystore's; its fallback lives in the same directory).
    _lock: Option<File>,
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> KeystoreError + 'a {
    move |source| KeystoreError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

fn read_secret_file(pool: &SecretPool, path: &Path) -> Result<SecretBox<[u8]>, KeystoreError> {
    let mut f = File::open(path).map_err(io("opening", path))?;
    let len = f.metadata().map_err(io("reading", path))?.len();
    let len = usize::try_from(len).unwrap_or(usize::MAX).min(4096);
    let mut buf = pool.alloc_bytes(len.max(1))?;
    let mut got = 0;
    while got < len {
        let n = f.read(&mut buf[got..len]).map_err(io("reading", path))?;
        if n == 0 {
            break;
        }
        got += n;
    }
    let mut out = pool.alloc_bytes(got.max(1))?;
    out[..got].copy_from_slice(&buf[..got]);
    if got == 0 {
        return pool.alloc_bytes(0).map_err(Into::into);
    }
    Ok(out)
}

fn hexval(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Argon2id (version 0x13) of `pass` and `salt` into `out`: the keystore's
/// passphrase KDF. Its working memory (`m_kib` KiB, 64 MiB by default, the
/// output one hash away from its last blocks) is allocated here and zeroed
/// before it is freed; `argon2::Argon2::hash_password_into` hands it back
/// to the allocator as it is. (The crate's `zeroize` feature wipes its own
/// smaller intermediates.)
///
/// # Errors
/// [`KeystoreError::Kdf`] when Argon2 refuses the parameters or lengths.
pub fn argon2id(
    pass: &[u8],
    salt: &[u8],
    params: KdfParams,
    out: &mut [u8],
) -> Result<(), KeystoreError> {
    let kdf = |e: argon2::Error| KeystoreError::Kdf(e.to_string());
    let prm =
        argon2::Params::new(params.m_kib, params.t, params.p, Some(out.len())).map_err(kdf)?;
    let mut memory = zeroize::Zeroizing::new(vec![argon2::Block::default(); prm.block_count()]);
    argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, prm)
        .hash_password_into_with_memory(pass, salt, out, &mut memory[..])
        .map_err(kdf)
}

/// Derives the KEK into secret memory.
fn derive_kek(
    pool: &SecretPool,
    source: &KekSource,
    params: KdfParams,
    salt: &[u8; 16],
) -> Result<SecretBox<[u8]>, KeystoreError> {
    let mut kek = pool.alloc_bytes(32)?;
    match source {
        KekSource::PassphraseFile(p) => {
            let pass = read_secret_file(pool, p)?;
            let mut n = pass.len();
            while n > 0 && matches!(pass[n - 1], b'\n' | b'\r') {
                n -= 1;
            }
            if n == 0 {
                return Err(KeystoreError::EmptyPassphrase(p.clone()));
            }
            argon2id(&pass[..n], salt, params, &mut kek)?;
        }
        KekSource::KeyFile(p) => {
            let raw = read_secret_file(pool, p)?;
            let mut n = raw.len();
            while n > 0 && matches!(raw[n - 1], b'\n' | b'\r') {
                n -= 1;
            }
            if raw.len() == 32 {
                kek.copy_from_slice(&raw[..32]);
            } else if n == 64 {
                for i in 0..32 {
                    let (Some(h), Some(l)) = (hexval(raw[2 * i]), hexval(raw[2 * i + 1])) else {
                        return Err(KeystoreError::BadKeyFile(p.clone()));
                    };
                    kek[i] = h << 4 | l;
                }
            } else {
                return Err(KeystoreError::BadKeyFile(p.clone()));
            }
        }
        KekSource::Kmip { config, uid, .. } => {
            let client = memveil_kmip::Client::new(config.clone(), Policy::allow(pool.level()))?;
            let key = client.get_key_len(uid, 32, "the keystore's key-encryption key (AES-256)")?;
            kek.copy_from_slice(&key);
        }
    }
    Ok(kek)
}

fn source_code(s: &KekSource) -> u8 {
    match s {
        KekSource::PassphraseFile(_) => 1,
        KekSource::KeyFile(_) => 2,
        KekSource::Kmip { .. } => 3,
    }
}

fn source_name(c: u8) -> (&'static str, &'static str) {
    match c {
        1 => ("passphrase", "passphrase-file"),
        3 => ("KMIP key", "kmip-kek"),
        _ => ("key file", "key-file"),
    }
}

/// Little-endian reader over the opened plaintext.
struct Rd<'a> {
    b: &'a [u8],
}

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Some(h)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u16(&mut self) -> Option<u16> {
        let s = self.take(2)?;
        Some(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        let s = self.take(4)?;
        Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
}

impl Keystore {
    /// Opens (or prepares) the keystore in `dir` and returns the keys it holds.
    ///
    /// # Errors
    /// [`KeystoreError`] naming the file and the fix.
    pub(crate) fn open(
        dir: &Path,
        source: &KekSource,
        params: KdfParams,
        pool: &SecretPool,
    ) -> Result<(Keystore, Vec<StoredKey>), KeystoreError> {
        // One vault to a state directory, held before anything in it is
        // read, removed or written: a second vault on it would remove the
        // first's `keys.vault.tmp` under its write, and each would seal
        // only the keys it holds over the other's.
        let lock = File::open(dir).map_err(io("opening", dir))?;
        if !memveil_sys::ipc::try_lock_exclusive(std::os::fd::AsFd::as_fd(&lock))
            .map_err(io("locking", dir))?
        {
            return Err(KeystoreError::InUse(dir.to_owned()));
        }
        let (mut ks, keys) = Self::open_locked(dir, source, params, pool)?;
        ks._lock = Some(lock);
        Ok((ks, keys))
    }

    /// [`Keystore::open`] once the state directory is this vault's.
    fn open_locked(
        dir: &Path,
        source: &KekSource,
        params: KdfParams,
        pool: &SecretPool,
    ) -> Result<(Keystore, Vec<StoredKey>), KeystoreError> {
        let fb_path = dir.join(FALLBACK_FILE);
        let sealed_by_kmip = fs::read(dir.join(FILE)).is_ok_and(|f| f.get(8) == Some(&3));
        if let (KekSource::PassphraseFile(_), true, true) =
            (source, sealed_by_kmip, fb_path.exists())
        {
            // The KMS is gone: the passphrase copy becomes the keystore.
            let (mut ks, keys) = Self::open_file(dir, FALLBACK_FILE, source, params, pool)?;
            ks.path = dir.join(FILE);
            ks.save(&seal_keys(&keys))?;
            let _ = fs::remove_file(&fb_path);
            eprintln!(
                "memveil-vault: {} was sealed by a KMIP key; opened its passphrase copy {} and sealed the keystore with the passphrase from now on",
                ks.path.display(),
                fb_path.display()
            );
            return Ok((ks, keys));
        }
        let (mut ks, keys) = Self::open_file(dir, FILE, source, params, pool)?;
        if let KekSource::Kmip {
            fallback: Some(p), ..
        } = source
        {
            let fb = KekSource::PassphraseFile(p.clone());
            let (f, _) = Self::open_file(dir, FALLBACK_FILE, &fb, params, pool)?;
            // In step with the keystore from the start.
            f.save(&seal_keys(&keys))?;
            ks.fallback = Some(Box::new(f));
        }
        Ok((ks, keys))
    }

    fn open_file(
        dir: &Path,
        file: &str,
        source: &KekSource,
        params: KdfParams,
        pool: &SecretPool,
    ) -> Result<(Keystore, Vec<StoredKey>), KeystoreError> {
        let path = dir.join(file);
        let _ = fs::remove_file(dir.join(format!("{file}.tmp")));
        let existing = match fs::read(&path) {
            Ok(b) => Some(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io("reading", &path)(e)),
        };
        let Some(file) = existing else {
            let mut salt = [0u8; 16];
            memveil_sys::getrandom(&mut salt).map_err(io("getrandom for", &path))?;
            let kek = derive_kek(pool, source, params, &salt)?;
            let kek = pool.alloc(|| Gcm::new(&kek).ok())?;
            let ks = Keystore {
                dir: dir.to_owned(),
                path,
                source: source_code(source),
                params,
                salt,
                kek,
                pool: pool.clone(),
                fallback: None,
                _lock: None,
            };
            return Ok((ks, Vec::new()));
        };
        let corrupt = |why: &str| KeystoreError::Corrupt {
            path: path.clone(),
            why: why.to_owned(),
        };
        if file.len() < HEADER + 16 || &file[..8] != MAGIC {
            return Err(corrupt("bad magic or too short"));
        }
        let src = file[8];
        if src != source_code(source) {
            let (sealed, flag) = source_name(src);
            return Err(KeystoreError::SourceMismatch { path, sealed, flag });
        }
        let u32_at =
            |o: usize| u32::from_le_bytes([file[o], file[o + 1], file[o + 2], file[o + 3]]);
        let stored = KdfParams {
            m_kib: u32_at(9),
            t: u32_at(13),
            p: u32_at(17),
        };
        let mut salt = [0u8; 16];
        salt.copy_from_slice(&file[21..37]);
        let mut nonce = [0u8; 12];
        nonce.copy_from_slice(&file[37..49]);
        let mut l8 = [0u8; 8];
        l8.copy_from_slice(&file[49..57]);
        let ct_len = usize::try_from(u64::from_le_bytes(l8)).unwrap_or(usize::MAX);
        if file.len() != HEADER.saturating_add(ct_len).saturating_add(16) {
            return Err(corrupt("length field does not match the file size"));
        }
        let kek = derive_kek(pool, source, stored, &salt)?;
        let kek = pool.alloc(|| Gcm::new(&kek).ok())?;
        let mut pt = pool.alloc_bytes(ct_len.max(1))?;
        pt[..ct_len].copy_from_slice(&file[HEADER..HEADER + ct_len]);
        let tag = &file[HEADER + ct_len..];
        let (source_kind, _) = source_name(src);
        let Some(gcm) = kek.as_ref() else {
            return Err(KeystoreError::Kdf("KEK rejected by GCM".into()));
        };
        gcm.open(&nonce, &file[..HEADER], &mut pt[..ct_len], tag)
            .map_err(|_| KeystoreError::WrongKey {
                path: path.clone(),
                source_kind,
            })?;
        let keys = parse_plain(pool, &pt[..ct_len]).ok_or_else(|| corrupt("bad records"))?;
        Ok((
            Keystore {
                dir: dir.to_owned(),
                path,
                source: src,
                params: stored,
                salt,
                kek,
                pool: pool.clone(),
                fallback: None,
                _lock: None,
            },
            keys,
        ))
    }

    /// Seals `keys` and replaces the keystore atomically.
    ///
    /// # Errors
    /// [`KeystoreError::Io`] or secret memory exhaustion; the old file stays.
    pub(crate) fn save(&self, keys: &[SealKey<'_>]) -> Result<(), KeystoreError> {
        self.save_one(keys)?;
        if let Some(f) = &self.fallback {
            f.save_one(keys)?;
        }
        Ok(())
    }

    fn save_one(&self, keys: &[SealKey<'_>]) -> Result<(), KeystoreError> {
        let mut n = 4usize;
        for k in keys {
            n += 4 + 2 + k.name.len() + 1 + 4 + 2 + 5 * k.acl.len() + 2;
            n += k.versions.iter().map(|v| 2 + v.len()).sum::<usize>();
        }
        let mut pt = self.pool.alloc_bytes(n)?;
        let mut at = 0usize;
        let mut put = |b: &[u8]| {
            pt[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        let c16 = |x: usize| u16::try_from(x).unwrap_or(u16::MAX).to_le_bytes();
        put(&u32::try_from(keys.len()).unwrap_or(u32::MAX).to_le_bytes());
        for k in keys {
            put(&k.id.to_le_bytes());
            put(&c16(k.name.len()));
            put(k.name.as_bytes());
            put(&[k.kind.code()]);
            put(&k.owner.to_le_bytes());
            put(&c16(k.acl.len()));
            for (u, p) in &k.acl {
                put(&u.to_le_bytes());
                put(&[*p]);
            }
            put(&c16(k.versions.len()));
            for v in &k.versions {
                put(&c16(v.len()));
                put(v);
            }
        }
        let mut header = Vec::with_capacity(HEADER);
        header.extend_from_slice(MAGIC);
        header.push(self.source);
        for v in [self.params.m_kib, self.params.t, self.params.p] {
            header.extend_from_slice(&v.to_le_bytes());
        }
        header.extend_from_slice(&self.salt);
        let mut nonce = [0u8; 12];
        memveil_sys::getrandom(&mut nonce).map_err(io("getrandom for", &self.path))?;
        header.extend_from_slice(&nonce);
        header.extend_from_slice(&(n as u64).to_le_bytes());
        let Some(gcm) = self.kek.as_ref() else {
            return Err(KeystoreError::Kdf("KEK rejected by GCM".into()));
        };
        let tag = gcm
            .seal(&nonce, &header, &mut pt[..n])
            .map_err(|e| KeystoreError::Kdf(e.to_string()))?;
        let mut file = header;
        file.extend_from_slice(&pt[..n]);
        file.extend_from_slice(&tag);
        drop(pt);
        self.write_atomic(&file)
    }

    fn write_atomic(&self, bytes: &[u8]) -> Result<(), KeystoreError> {
        let crash = std::env::var("MEMVEIL_VAULT_CRASH_AT").ok();
        let crash_at = |p: &str| {
            if crash.as_deref() == Some(p) {
                eprintln!("memveil-vault: crash point {p} reached (MEMVEIL_VAULT_CRASH_AT)");
                std::process::abort();
            }
        };
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io("creating", &tmp))?;
        let half = bytes.len() / 2;
        f.write_all(&bytes[..half]).map_err(io("writing", &tmp))?;
        crash_at("partial");
        f.write_all(&bytes[half..]).map_err(io("writing", &tmp))?;
        f.sync_all().map_err(io("syncing", &tmp))?;
        drop(f);
        crash_at("written");
        fs::rename(&tmp, &self.path).map_err(io("renaming onto", &self.path))?;
        crash_at("renamed");
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing directory", &self.dir))?;
        Ok(())
    }
}

/// Stored keys as keys to seal.
fn seal_keys(keys: &[StoredKey]) -> Vec<SealKey<'_>> {
    keys.iter()
        .map(|k| SealKey {
            id: k.id,
            name: &k.name,
            kind: k.kind,
            owner: k.owner,
            acl: k.acl.clone(),
            versions: k.versions.iter().map(|v| &v[..]).collect(),
        })
        .collect()
}

fn parse_plain(pool: &SecretPool, pt: &[u8]) -> Option<Vec<StoredKey>> {
    let mut r = Rd { b: pt };
    let n = r.u32()?;
    let mut out = Vec::new();
    for _ in 0..n {
        let id = r.u32()?;
        let nl = r.u16()?;
        let name = String::from_utf8(r.take(usize::from(nl))?.to_vec()).ok()?;
        let kind = KeyKind::from_code(r.u8()?)?;
        let owner = r.u32()?;
        let na = r.u16()?;
        let mut acl = Vec::new();
        for _ in 0..na {
            acl.push((r.u32()?, r.u8()?));
        }
        let nv = r.u16()?;
        let mut versions = Vec::new();
        for _ in 0..nv {
            let l = r.u16()?;
            let b = r.take(usize::from(l))?;
            if !kind.import_len_ok(b.len()) {
                return None;
            }
            let mut s = pool.alloc_bytes(b.len()).ok()?;
            s.copy_from_slice(b);
            versions.push(s);
        }
        out.push(StoredKey {
            id,
            name,
            kind,
            owner,
            acl,
            versions,
        });
    }
    if !r.b.is_empty() {
        return None;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use memveil_secmem::{Level, Policy};

    fn pool() -> SecretPool {
        SecretPool::new(1 << 20, Policy::allow(Level::Locked)).expect("pool")
    }

    fn fast() -> KdfParams {
        KdfParams {
            m_kib: 64,
            t: 1,
            p: 1,
        }
    }

    #[test]
    fn seal_and_reopen() {
        let d = std::env::temp_dir().join(format!("mv-ks-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).expect("dir");
        let pass = d.join("pass");
        fs::write(&pass, "correct horse\n").expect("pass");
        let p = pool();
        let src = KekSource::PassphraseFile(pass.clone());
        let (ks, keys) = Keystore::open(&d, &src, fast(), &p).expect("open");
        assert!(keys.is_empty());
        let k1 = [1u8; 32];
        ks.save(&[SealKey {
            id: 4,
            name: "a",
            kind: KeyKind::Aes256,
            owner: 1000,
            acl: vec![(5, 1)],
            versions: vec![&k1, &k1],
        }])
        .expect("save");
        let raw = fs::read(d.join(FILE)).expect("file");
        assert!(
            !raw.windows(32).any(|w| w == k1),
            "key in plaintext on disk"
        );
        // One keystore open on a directory at a time.
        drop(ks);
        let (_, keys) = Keystore::open(&d, &src, fast(), &p).expect("reopen");
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].name, "a");
        assert_eq!(keys[0].versions.len(), 2);
        assert_eq!(&keys[0].versions[1][..], &k1);
        fs::write(&pass, "wrong\n").expect("pass");
        let e = Keystore::open(&d, &src, fast(), &p)
            .err()
            .expect("wrong pass");
        assert!(matches!(e, KeystoreError::WrongKey { .. }), "{e}");
        let kf = d.join("kf");
        fs::write(&kf, [9u8; 32]).expect("kf");
        let e = Keystore::open(&d, &KekSource::KeyFile(kf), fast(), &p)
            .err()
            .expect("mismatch");
        assert!(e.to_string().contains("--passphrase-file"), "{e}");
        let mut cut = raw.clone();
        cut.truncate(raw.len() - 1);
        fs::write(d.join(FILE), &cut).expect("cut");
        let e = Keystore::open(&d, &src, fast(), &p).err().expect("corrupt");
        assert!(matches!(e, KeystoreError::Corrupt { .. }), "{e}");
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_state_directory_is_one_keystores_until_it_is_dropped() {
        let d = std::env::temp_dir().join(format!("mv-ks-one-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).expect("dir");
        let pass = d.join("pass");
        fs::write(&pass, "correct horse\n").expect("pass");
        let p = pool();
        let src = KekSource::PassphraseFile(pass);
        let (ks, _) = Keystore::open(&d, &src, fast(), &p).expect("open");
        let k1 = [1u8; 32];
        let key = |name| SealKey {
            id: 4,
            name,
            kind: KeyKind::Aes256,
            owner: 1000,
            acl: Vec::new(),
            versions: vec![&k1],
        };
        ks.save(&[key("a")]).expect("save");
        // A write under way: the second opener must not remove it.
        fs::write(d.join(format!("{FILE}.tmp")), b"in flight").expect("tmp");
        let e = Keystore::open(&d, &src, fast(), &p)
            .err()
            .expect("a second keystore on the directory");
        assert!(matches!(e, KeystoreError::InUse(_)), "{e}");
        assert!(
            d.join(format!("{FILE}.tmp")).exists(),
            "the refused opener removed the holder's write under way"
        );
        ks.save(&[key("a"), key("b")]).expect("save");
        drop(ks);
        let (_, keys) = Keystore::open(&d, &src, fast(), &p).expect("free once dropped");
        assert_eq!(keys.len(), 2);
        let _ = fs::remove_dir_all(&d);
    }
}
