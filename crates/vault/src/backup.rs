//! Key backups kept by a KMIP server (docs/kmip.md, "Backup"): a key made
//! for the vault is wrapped with AES-256-GCM under a KMIP-held key (the
//! backup KEK) and registered as Secret Data; any host whose certificate
//! may Get both objects restores it into its own vault.
//!
//! Wrapped form: magic `MVKMIPB1` (8), key kind (1), nonce (12), the
//! encrypted key (the kind's length), tag (16); the associated data is the
//! magic, the kind and the key's name, so a backup restores only under the
//! name it was made for.
#![forbid(unsafe_code)]

use memveil_secmem::{SecretBox, SecretPool};

use crate::gcm::VaultGcm;
use crate::proto::KeyKind;

const MAGIC: &[u8; 8] = b"MVKMIPB1";
const HEAD: usize = 8 + 1 + 12;

/// Why a backup could not be made or opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackupError {
    /// Not a memveil backup, or cut short.
    #[error("KMIP object is not a memveil key backup ({0})")]
    Format(&'static str),
    /// The KEK or the name does not open it.
    #[error("the backup does not open with this backup key under the name {0:?} (another --kmip-kek, another name, or altered)")]
    WrongKey(String),
    /// Secret memory.
    #[error("secret memory: {0}")]
    Secmem(#[from] memveil_secmem::SecmemError),
    /// The cipher refused the key.
    #[error("backup key: {0}")]
    Cipher(String),
}

fn aad(kind: KeyKind, name: &str) -> Vec<u8> {
    let mut a = MAGIC.to_vec();
    a.push(kind.code());
    a.extend_from_slice(name.as_bytes());
    a
}

/// Wraps `key` (of `kind`) for `name` under `kek` (32 bytes).
///
/// # Errors
/// [`BackupError`].
pub fn wrap(
    pool: &SecretPool,
    kek: &[u8],
    kind: KeyKind,
    name: &str,
    key: &[u8],
) -> Result<SecretBox<[u8]>, BackupError> {
    let gcm = VaultGcm::new(kek).map_err(|e| BackupError::Cipher(e.to_string()))?;
    let mut out = pool.alloc_bytes(HEAD + key.len() + 16)?;
    out[..8].copy_from_slice(MAGIC);
    out[8] = kind.code();
    let mut nonce = [0u8; 12];
    memveil_sys::getrandom(&mut nonce).map_err(|e| BackupError::Cipher(e.to_string()))?;
    out[9..HEAD].copy_from_slice(&nonce);
    let end = HEAD + key.len();
    out[HEAD..end].copy_from_slice(key);
    let tag = gcm
        .seal(&nonce, &aad(kind, name), &mut out[HEAD..end])
        .map_err(|e| BackupError::Cipher(e.to_string()))?;
    out[end..].copy_from_slice(&tag);
    Ok(out)
}

/// Opens a backup made for `name`: its kind and the key, in secret memory.
///
/// # Errors
/// [`BackupError`].
pub fn unwrap(
    pool: &SecretPool,
    kek: &[u8],
    name: &str,
    blob: &[u8],
) -> Result<(KeyKind, SecretBox<[u8]>), BackupError> {
    if blob.len() < HEAD + 16 || &blob[..8] != MAGIC {
        return Err(BackupError::Format("no MVKMIPB1 header"));
    }
    let kind = KeyKind::from_code(blob[8]).ok_or(BackupError::Format("unknown key kind"))?;
    if blob.len() != HEAD + kind.key_len() + 16 {
        return Err(BackupError::Format("length does not match the key kind"));
    }
    let gcm = VaultGcm::new(kek).map_err(|e| BackupError::Cipher(e.to_string()))?;
    let mut nonce = [0u8; 12];
    nonce.copy_from_slice(&blob[9..HEAD]);
    let end = HEAD + kind.key_len();
    let mut key = pool.alloc_bytes(kind.key_len())?;
    key.copy_from_slice(&blob[HEAD..end]);
    gcm.open(&nonce, &aad(kind, name), &mut key, &blob[end..])
        .map_err(|_| BackupError::WrongKey(name.to_owned()))?;
    Ok((kind, key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use memveil_secmem::{Level, Policy};

    #[test]
    fn wraps_and_refuses_other_names_and_keys() {
        let pool = SecretPool::new(1 << 16, Policy::allow(Level::Locked)).expect("pool");
        let kek = [3u8; 32];
        let key = [9u8; 64];
        let b = wrap(&pool, &kek, KeyKind::Xts256, "disk0", &key).expect("wrap");
        assert!(!b.windows(64).any(|w| w == key), "key in the clear");
        let (kind, k) = unwrap(&pool, &kek, "disk0", &b).expect("unwrap");
        assert_eq!(kind, KeyKind::Xts256);
        assert!(k[..] == key[..]);
        assert!(matches!(
            unwrap(&pool, &kek, "disk1", &b),
            Err(BackupError::WrongKey(_))
        ));
        assert!(matches!(
            unwrap(&pool, &[4u8; 32], "disk0", &b),
            Err(BackupError::WrongKey(_))
        ));
        assert!(matches!(
            unwrap(&pool, &kek, "disk0", &b[..40]),
            Err(BackupError::Format(_))
        ));
    }
}
