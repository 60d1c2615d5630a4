//! What the vault holds and does: key kinds, cipher modes, permission bits.
#![forbid(unsafe_code)]

use std::fmt;

use memveil_asym::Algorithm;

/// Kinds of keys the vault holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    /// AES-128 (ECB, CBC, CTR, GCM, CMAC).
    Aes128,
    /// AES-256 (ECB, CBC, CTR, GCM, CMAC).
    Aes256,
    /// XTS-AES-128: two 128-bit keys.
    Xts128,
    /// XTS-AES-256: two 256-bit keys.
    Xts256,
    /// RSA, 2048-bit modulus (PKCS#1 v1.5, PSS, raw, OAEP).
    Rsa2048,
    /// RSA, 3072 bits.
    Rsa3072,
    /// RSA, 4096 bits.
    Rsa4096,
    /// ECDSA and ECDH over NIST P-256.
    P256,
    /// ECDSA and ECDH over NIST P-384.
    P384,
    /// Ed25519 signatures.
    Ed25519,
    /// An X.509 certificate (DER): public data kept beside the keys, for the
    /// PKCS#11 token's certificate objects; no operation uses it.
    Cert,
    /// A generic secret ([`MIN_SECRET`] to [`MAX_SECRET`] bytes): HMAC
    /// (SHA-1, SHA-2) and digests of the key (PKCS#11's `C_DigestKey`);
    /// never extractable, like every key.
    Secret,
    /// Public application data (the PKCS#11 token's `CKO_DATA` objects,
    /// up to [`MAX_CERT`] bytes with their attributes): kept, listed and
    /// given back like a certificate; no operation uses it.
    Data,
}

/// Every kind, in wire order.
pub const KINDS: [KeyKind; 13] = [
    KeyKind::Aes128,
    KeyKind::Aes256,
    KeyKind::Xts128,
    KeyKind::Xts256,
    KeyKind::Rsa2048,
    KeyKind::Rsa3072,
    KeyKind::Rsa4096,
    KeyKind::P256,
    KeyKind::P384,
    KeyKind::Ed25519,
    KeyKind::Cert,
    KeyKind::Secret,
    KeyKind::Data,
];

/// Shortest generic secret: 112 bits, the least key strength SP 800-107
/// and SP 800-131A allow for HMAC (a shorter key is refused, not padded).
pub const MIN_SECRET: usize = 14;
/// Longest generic secret (longer than any hash block: HMAC hashes it first).
pub const MAX_SECRET: usize = 256;

/// Longest certificate the vault keeps (what fits an import frame).
pub const MAX_CERT: usize = 3584;

impl KeyKind {
    /// Bytes of key material of a symmetric kind (what an import carries);
    /// 0 for the other kinds, whose imports vary in length
    /// ([`KeyKind::import_len_ok`]).
    #[must_use]
    pub fn key_len(self) -> usize {
        match self {
            KeyKind::Aes128 => 16,
            KeyKind::Aes256 | KeyKind::Xts128 => 32,
            KeyKind::Xts256 => 64,
            _ => 0,
        }
    }

    /// Whether an import of `n` bytes can be a key of this kind: the exact
    /// key length for AES and XTS, private components
    /// ([`memveil_asym::components`]) for the asymmetric kinds, a DER
    /// certificate up to [`MAX_CERT`] bytes.
    #[must_use]
    pub fn import_len_ok(self, n: usize) -> bool {
        match self {
            KeyKind::Cert | KeyKind::Data => (1..=MAX_CERT).contains(&n),
            KeyKind::Secret => (MIN_SECRET..=MAX_SECRET).contains(&n),
            k if k.asym().is_some() => (1..=memveil_asym::components::MAX_LEN).contains(&n),
            k => n == k.key_len(),
        }
    }

    /// The asymmetric algorithm of an asymmetric kind.
    #[must_use]
    pub fn asym(self) -> Option<Algorithm> {
        Some(match self {
            KeyKind::Rsa2048 => Algorithm::Rsa2048,
            KeyKind::Rsa3072 => Algorithm::Rsa3072,
            KeyKind::Rsa4096 => Algorithm::Rsa4096,
            KeyKind::P256 => Algorithm::P256,
            KeyKind::P384 => Algorithm::P384,
            KeyKind::Ed25519 => Algorithm::Ed25519,
            _ => return None,
        })
    }

    /// The kind of an asymmetric algorithm.
    #[must_use]
    pub fn of_algorithm(a: Algorithm) -> KeyKind {
        match a {
            Algorithm::Rsa2048 => KeyKind::Rsa2048,
            Algorithm::Rsa3072 => KeyKind::Rsa3072,
            Algorithm::Rsa4096 => KeyKind::Rsa4096,
            Algorithm::P256 => KeyKind::P256,
            Algorithm::P384 => KeyKind::P384,
            Algorithm::Ed25519 => KeyKind::Ed25519,
        }
    }

    /// AES or XTS: rotated, served by the block-cipher modes.
    #[must_use]
    pub fn is_symmetric(self) -> bool {
        self.key_len() != 0
    }

    /// Wire value.
    #[must_use]
    pub fn code(self) -> u8 {
        KINDS
            .iter()
            .position(|k| *k == self)
            .and_then(|i| u8::try_from(i + 1).ok())
            .unwrap_or(0)
    }

    /// From a wire value.
    #[must_use]
    pub fn from_code(c: u8) -> Option<Self> {
        KINDS.get(usize::from(c).checked_sub(1)?).copied()
    }

    /// Whether a key of this kind serves `mode`.
    #[must_use]
    pub fn serves(self, mode: Mode) -> bool {
        matches!(
            (self, mode),
            (
                KeyKind::Aes128 | KeyKind::Aes256,
                Mode::Ecb | Mode::Cbc | Mode::Ctr | Mode::Gcm | Mode::Cmac
            ) | (KeyKind::Xts128 | KeyKind::Xts256, Mode::Xts)
                | (
                    KeyKind::Rsa2048 | KeyKind::Rsa3072 | KeyKind::Rsa4096,
                    Mode::RsaPkcs1 | Mode::RsaPss | Mode::RsaRaw | Mode::RsaOaep
                )
                | (KeyKind::P256 | KeyKind::P384, Mode::Ecdsa)
                | (KeyKind::Ed25519, Mode::EdDsa)
                | (KeyKind::Secret, Mode::Hmac | Mode::KeyDigest)
        )
    }

    /// Name as used on the command line.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            KeyKind::Aes128 => "aes128",
            KeyKind::Aes256 => "aes256",
            KeyKind::Xts128 => "xts128",
            KeyKind::Xts256 => "xts256",
            KeyKind::Rsa2048 => "rsa2048",
            KeyKind::Rsa3072 => "rsa3072",
            KeyKind::Rsa4096 => "rsa4096",
            KeyKind::P256 => "p256",
            KeyKind::P384 => "p384",
            KeyKind::Ed25519 => "ed25519",
            KeyKind::Cert => "cert",
            KeyKind::Secret => "secret",
            KeyKind::Data => "data",
        }
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KeyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        KINDS
            .iter()
            .copied()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown key kind {s:?}: {}",
                    KINDS.map(KeyKind::name).join(", ")
                )
            })
    }
}

/// Cipher modes and, from 7 on, the asymmetric operations (whose ring
/// entries name an output range: `ring`'s module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Electronic codebook.
    Ecb,
    /// Cipher block chaining.
    Cbc,
    /// Counter (128-bit big-endian counter block).
    Ctr,
    /// XTS (IEEE 1619), 128-bit tweak.
    Xts,
    /// GCM, 96-bit nonce, 128-bit tag.
    Gcm,
    /// AES-CMAC (SP 800-38B): encrypt computes the 16-byte tag of the data
    /// (left unchanged), decrypt verifies the entry's tag against it.
    Cmac,
    /// RSA PKCS#1 v1.5: encrypt signs the input (a `DigestInfo`, at most
    /// k − 11 bytes), decrypt decrypts with implicit rejection.
    RsaPkcs1,
    /// RSA-PSS signature (encrypt only) over a digest.
    RsaPss,
    /// Raw RSA, the private operation on k bytes (encrypt: a signature,
    /// decrypt: a decryption; the same arithmetic, two permissions).
    RsaRaw,
    /// RSA-OAEP decryption (decrypt only).
    RsaOaep,
    /// ECDSA signature (encrypt only) over a digest; `r‖s` out.
    Ecdsa,
    /// Ed25519 signature (encrypt only) over the whole message.
    EdDsa,
    /// HMAC with a generic secret key, the hash in the entry's parameters:
    /// encrypt writes the MAC of the input; decrypt checks the input's
    /// last hash-length bytes (a full-length MAC) against the MAC of the
    /// rest, in constant time (`ring::status::AUTH_FAILED` when it differs).
    Hmac,
    /// The digest of the input's first `len` bytes (the parameters'), the
    /// generic secret key's bytes, then the rest of the input (encrypt
    /// only): PKCS#11's `C_DigestKey`. Refused (`WRONG_MODE`) for a key
    /// longer than 64 bytes, which HMAC would replace by its digest.
    KeyDigest,
}

/// Every mode, in wire order.
const MODES: [Mode; 14] = [
    Mode::Ecb,
    Mode::Cbc,
    Mode::Ctr,
    Mode::Xts,
    Mode::Gcm,
    Mode::Cmac,
    Mode::RsaPkcs1,
    Mode::RsaPss,
    Mode::RsaRaw,
    Mode::RsaOaep,
    Mode::Ecdsa,
    Mode::EdDsa,
    Mode::Hmac,
    Mode::KeyDigest,
];

impl Mode {
    /// Wire value.
    #[must_use]
    pub fn code(self) -> u8 {
        MODES
            .iter()
            .position(|m| *m == self)
            .and_then(|i| u8::try_from(i + 1).ok())
            .unwrap_or(0)
    }
    /// From a wire value.
    #[must_use]
    pub fn from_code(c: u8) -> Option<Self> {
        MODES.get(usize::from(c).checked_sub(1)?).copied()
    }
    /// Whether this is an asymmetric operation (input and output ranges).
    #[must_use]
    pub fn is_asym(self) -> bool {
        self.code() >= Mode::RsaPkcs1.code()
    }
    /// Whether the mode signs (encrypt) only, decrypts only, or both.
    #[must_use]
    pub fn directions(self) -> (bool, bool) {
        match self {
            Mode::RsaPss | Mode::Ecdsa | Mode::EdDsa | Mode::KeyDigest => (true, false),
            Mode::RsaOaep => (false, true),
            _ => (true, true),
        }
    }
    /// Lower-case name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ecb => "ecb",
            Mode::Cbc => "cbc",
            Mode::Ctr => "ctr",
            Mode::Xts => "xts",
            Mode::Gcm => "gcm",
            Mode::Cmac => "cmac",
            Mode::RsaPkcs1 => "rsa-pkcs1",
            Mode::RsaPss => "rsa-pss",
            Mode::RsaRaw => "rsa-raw",
            Mode::RsaOaep => "rsa-oaep",
            Mode::Ecdsa => "ecdsa",
            Mode::EdDsa => "eddsa",
            Mode::Hmac => "hmac",
            Mode::KeyDigest => "key-digest",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        MODES
            .iter()
            .copied()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown mode {s:?}: {}", MODES.map(Mode::name).join(", ")))
    }
}

/// Permission bits in an ACL entry. On an asymmetric key, `ENCRYPT` allows
/// signing and `DECRYPT` allows decryption and ECDH derivation.
pub mod perm {
    /// May encrypt with the key (sign with an asymmetric key).
    pub const ENCRYPT: u8 = 1;
    /// May decrypt with the key (decrypt or derive with an asymmetric key).
    pub const DECRYPT: u8 = 2;
    /// May rotate, destroy, grant and revoke.
    pub const ADMIN: u8 = 4;
    /// All bits.
    pub const ALL: u8 = 7;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for k in KINDS {
            assert_eq!(KeyKind::from_code(k.code()), Some(k));
            assert_eq!(k.name().parse::<KeyKind>(), Ok(k));
        }
        assert_eq!(KeyKind::Aes128.code(), 1);
        assert_eq!(KeyKind::Xts256.code(), 4);
        assert_eq!(KeyKind::from_code(0), None);
        assert_eq!(KeyKind::Secret.code(), 12);
        assert_eq!(KeyKind::Data.code(), 13);
        assert_eq!(KeyKind::from_code(14), None);
        assert!(KeyKind::Secret.import_len_ok(14) && !KeyKind::Secret.import_len_ok(13));
        assert!(!KeyKind::Secret.import_len_ok(257) && KeyKind::Secret.serves(Mode::Hmac));
        for m in MODES {
            assert_eq!(Mode::from_code(m.code()), Some(m));
            assert_eq!(m.name().parse::<Mode>(), Ok(m));
        }
        assert_eq!(Mode::Cmac.code(), 6);
        assert!(!Mode::Cmac.is_asym() && Mode::RsaPkcs1.is_asym());
        assert!(KeyKind::Rsa2048.import_len_ok(500) && !KeyKind::Aes128.import_len_ok(15));
        assert!(KeyKind::Cert.import_len_ok(2000) && !KeyKind::Cert.import_len_ok(0));
    }
}
