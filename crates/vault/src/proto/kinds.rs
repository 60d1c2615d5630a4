//! What the vault holds and does: key kinds, cipher modes, permission bits.
#![forbid(unsafe_code)]

use std::fmt;

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
}

impl KeyKind {
    /// Bytes of key material.
    #[must_use]
    pub fn key_len(self) -> usize {
        match self {
            KeyKind::Aes128 => 16,
            KeyKind::Aes256 | KeyKind::Xts128 => 32,
            KeyKind::Xts256 => 64,
        }
    }
    /// Wire value.
    #[must_use]
    pub fn code(self) -> u8 {
        match self {
            KeyKind::Aes128 => 1,
            KeyKind::Aes256 => 2,
            KeyKind::Xts128 => 3,
            KeyKind::Xts256 => 4,
        }
    }
    /// From a wire value.
    #[must_use]
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => KeyKind::Aes128,
            2 => KeyKind::Aes256,
            3 => KeyKind::Xts128,
            4 => KeyKind::Xts256,
            _ => return None,
        })
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
        Ok(match s {
            "aes128" => KeyKind::Aes128,
            "aes256" => KeyKind::Aes256,
            "xts128" => KeyKind::Xts128,
            "xts256" => KeyKind::Xts256,
            _ => {
                return Err(format!(
                    "unknown key kind {s:?}: aes128, aes256, xts128 or xts256"
                ))
            }
        })
    }
}

/// Cipher modes.
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
}

impl Mode {
    /// Wire value.
    #[must_use]
    pub fn code(self) -> u8 {
        match self {
            Mode::Ecb => 1,
            Mode::Cbc => 2,
            Mode::Ctr => 3,
            Mode::Xts => 4,
            Mode::Gcm => 5,
            Mode::Cmac => 6,
        }
    }
    /// From a wire value.
    #[must_use]
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => Mode::Ecb,
            2 => Mode::Cbc,
            3 => Mode::Ctr,
            4 => Mode::Xts,
            5 => Mode::Gcm,
            6 => Mode::Cmac,
            _ => return None,
        })
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
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "ecb" => Mode::Ecb,
            "cbc" => Mode::Cbc,
            "ctr" => Mode::Ctr,
            "xts" => Mode::Xts,
            "gcm" => Mode::Gcm,
            "cmac" => Mode::Cmac,
            _ => {
                return Err(format!(
                    "unknown mode {s:?}: ecb, cbc, ctr, xts, gcm or cmac"
                ))
            }
        })
    }
}

/// Permission bits in an ACL entry.
pub mod perm {
    /// May encrypt with the key.
    pub const ENCRYPT: u8 = 1;
    /// May decrypt with the key.
    pub const DECRYPT: u8 = 2;
    /// May rotate, destroy, grant and revoke.
    pub const ADMIN: u8 = 4;
    /// All bits.
    pub const ALL: u8 = 7;
}
