//! ECDH into a new AES key: the shared secret and the key made from it
//! exist only in secret memory, and only the new key's name comes back.
#![forbid(unsafe_code)]

use std::sync::PoisonError;

use memveil_asym::hash::Hasher;
use memveil_asym::Hash;
use memveil_secmem::SecretBox;

use crate::proto::{perm, ErrorCode, KeyKind, Reply};
use crate::server::{err, Shared};

/// The key bytes for a new `kind` key from ECDH between the EC key `base`
/// (the caller needs its `d` permission) and `peer`: the shared secret's
/// leading bytes (`kdf` 0, PKCS#11's `CKD_NULL`) or ANSI X9.63's KDF with the
/// hash of code `kdf` over the secret, a 32-bit counter from 1 and `shared`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn derive(
    sh: &Shared,
    uid: u32,
    base: &str,
    kind: KeyKind,
    kdf: u8,
    peer: &[u8],
    shared: &[u8],
) -> Result<SecretBox<[u8]>, Reply> {
    if !matches!(kind, KeyKind::Aes128 | KeyKind::Aes256) {
        return Err(err(
            ErrorCode::Invalid,
            format!("ECDH derives aes128 or aes256 keys, not {kind}"),
        ));
    }
    let version = {
        let t = sh.keys.read().unwrap_or_else(PoisonError::into_inner);
        match t.get(base) {
            Some(k)
                if k.allows(uid, perm::DECRYPT)
                    && matches!(k.kind, KeyKind::P256 | KeyKind::P384) =>
            {
                k.version(0).cloned()
            }
            Some(k) if k.allows(uid, perm::DECRYPT) => {
                return Err(err(
                    ErrorCode::Invalid,
                    format!("ECDH needs a p256 or p384 key; {base:?} is {}", k.kind),
                ))
            }
            Some(k) if k.visible_to(uid) => {
                return Err(err(
                    ErrorCode::Denied,
                    format!(
                        "uid {uid} lacks the d permission on {base:?} (ECDH derivation needs it)"
                    ),
                ))
            }
            _ => None,
        }
    }
    .ok_or_else(|| {
        err(
            ErrorCode::NotFound,
            format!("no key {base:?} visible to uid {uid}"),
        )
    })?;
    let secmem = |e: memveil_secmem::SecmemError| {
        err(
            ErrorCode::Internal,
            format!("vault out of secret memory: {e} (--pool-kib)"),
        )
    };
    let mut z = sh.pool.alloc_bytes(48).map_err(secmem)?;
    let zn = version
        .ecdh(peer, &mut z)
        .map_err(|e| err(ErrorCode::Invalid, e.to_string()))?;
    let n = kind.key_len();
    let mut key = sh.pool.alloc_bytes(n).map_err(secmem)?;
    if kdf == 0 {
        key.copy_from_slice(&z[..n]);
        return Ok(key);
    }
    let hash = Hash::from_code(kdf).ok_or_else(|| {
        err(
            ErrorCode::Invalid,
            format!("unknown KDF {kdf}: 0 (none) or a hash code 1-5"),
        )
    })?;
    let mut block = sh.pool.alloc_bytes(64).map_err(secmem)?;
    let mut at = 0;
    let mut counter = 1u32;
    while at < n {
        let mut h = Hasher::new(hash)
            .ok_or_else(|| err(ErrorCode::Internal, "aws-lc could not allocate a digest"))?;
        h.update(&z[..zn]);
        h.update(&counter.to_be_bytes());
        h.update(shared);
        let got = h.finish_into(&mut block);
        let take = got.min(n - at);
        key[at..at + take].copy_from_slice(&block[..take]);
        at += take;
        counter += 1;
    }
    Ok(key)
}
