//! The vault's import format for private keys: a list of fields, each a
//! `u16` little-endian length and that many bytes.
//!
//! | key | fields |
//! |---|---|
//! | RSA | `n`, `e`, `d`, `p`, `q`, `dp`, `dq`, `qinv` (big-endian integers); `dp`, `dq`, `qinv` may be empty (the vault computes them: ssh-agent's format has no `dp`/`dq`) |
//! | P-256, P-384 | the private scalar (big-endian, at most the field's bytes) |
//! | Ed25519 | the 32-byte seed (RFC 8032's private key) |
//!
//! Clients build it from PKCS#8, PKCS#1, SEC 1 and OpenSSH key files, from
//! ssh-agent messages and from PKCS#11 templates, in memory they wipe; the
//! vault receives it into secret memory. Sans-IO, no `unsafe`.
#![forbid(unsafe_code)]

/// Fields of an RSA key.
pub const RSA_FIELDS: usize = 8;
/// Longest encoding accepted (an RSA-4096 key with every field, padded).
pub const MAX_LEN: usize = 3072;

/// Why a component list did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ComponentsError {
    /// A length runs past the end.
    #[error("truncated key components")]
    Truncated,
    /// Too many fields or bytes.
    #[error("key components too long")]
    TooLong,
}

/// Bytes [`encode_into`] needs for `fields`.
#[must_use]
pub fn encoded_len(fields: &[&[u8]]) -> usize {
    fields.iter().map(|f| 2 + f.len()).sum()
}

/// Writes `fields` into `out`; returns the bytes written, or `None` when
/// `out` is too short or a field is longer than 65535 bytes.
#[must_use]
pub fn encode_into(fields: &[&[u8]], out: &mut [u8]) -> Option<usize> {
    let mut at = 0usize;
    for f in fields {
        let n = u16::try_from(f.len()).ok()?;
        out.get_mut(at..at + 2)?.copy_from_slice(&n.to_le_bytes());
        at += 2;
        out.get_mut(at..at + f.len())?.copy_from_slice(f);
        at += f.len();
    }
    Some(at)
}

/// The fields of an encoding, borrowed.
///
/// # Errors
/// [`ComponentsError`] for a truncated or overlong list.
pub fn decode(b: &[u8]) -> Result<Vec<&[u8]>, ComponentsError> {
    if b.len() > MAX_LEN {
        return Err(ComponentsError::TooLong);
    }
    let mut out = Vec::new();
    let mut rest = b;
    while !rest.is_empty() {
        if out.len() >= RSA_FIELDS {
            return Err(ComponentsError::TooLong);
        }
        let (len, tail) = rest.split_at_checked(2).ok_or(ComponentsError::Truncated)?;
        let n = usize::from(u16::from_le_bytes([len[0], len[1]]));
        let (f, tail) = tail.split_at_checked(n).ok_or(ComponentsError::Truncated)?;
        out.push(f);
        rest = tail;
    }
    Ok(out)
}

/// One secret value of a key, as a key finder looks for it.
pub struct SecretPart {
    /// What it is ("RSA prime p", "Ed25519 scalar").
    pub what: &'static str,
    /// Its bytes (wiped on drop).
    pub value: zeroize::Zeroizing<Vec<u8>>,
    /// A big-endian number (looked for in both byte orders), or bytes as
    /// they are.
    pub number: bool,
}

/// The secret values a memory scan looks for in a key of `alg` given by its
/// components: RSA's `d`, `p` and `q`; an EC scalar; Ed25519's seed and the
/// halves of SHA-512(seed) — the clamped scalar and the nonce prefix —
/// which an Ed25519 implementation keeps while it signs. For proofs
/// (`memveil keyfind --private-key`, the tests), never for a key in use.
///
/// # Errors
/// Components that do not fit the algorithm.
pub fn secret_parts(alg: crate::Algorithm, b: &[u8]) -> Result<Vec<SecretPart>, ComponentsError> {
    let f = decode(b)?;
    let part = |what, v: &[u8], number| SecretPart {
        what,
        value: zeroize::Zeroizing::new(v.to_vec()),
        number,
    };
    Ok(match (alg.rsa_bits(), alg.curve(), f.as_slice()) {
        (Some(_), _, [_, _, d, p, q, ..]) => vec![
            part("RSA private exponent d", d, true),
            part("RSA prime p", p, true),
            part("RSA prime q", q, true),
        ],
        (_, Some(_), [s]) => vec![part("EC private scalar", s, true)],
        (None, None, [seed]) => {
            let mut h = zeroize::Zeroizing::new(crate::hash::digest(crate::Hash::Sha512, seed));
            if h.len() == 64 {
                h[0] &= 248;
                h[31] &= 127;
                h[31] |= 64;
            }
            vec![
                part("Ed25519 seed", seed, false),
                part("Ed25519 scalar", h.get(..32).unwrap_or_default(), true),
                part(
                    "Ed25519 nonce prefix",
                    h.get(32..).unwrap_or_default(),
                    false,
                ),
            ]
        }
        _ => return Err(ComponentsError::Truncated),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_refusals() {
        let f: [&[u8]; 3] = [b"abc", b"", &[0; 300]];
        let mut buf = vec![0u8; encoded_len(&f)];
        assert_eq!(encode_into(&f, &mut buf), Some(buf.len()));
        assert_eq!(decode(&buf).expect("decode"), f.to_vec());
        assert_eq!(encode_into(&f, &mut buf[..10]), None);
        assert_eq!(
            decode(&buf[..buf.len() - 1]),
            Err(ComponentsError::Truncated)
        );
        assert_eq!(decode(&[1]), Err(ComponentsError::Truncated));
        assert_eq!(decode(&[0; 18]), Err(ComponentsError::TooLong));
        assert_eq!(decode(&[]).expect("empty"), Vec::<&[u8]>::new());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = decode(&b);
        }
    }
}
