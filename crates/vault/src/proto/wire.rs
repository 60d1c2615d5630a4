//! The field readers and writers every message uses, the message tags,
//! and the checks of names and frame lengths.
#![forbid(unsafe_code)]

use memveil_engine::{Algorithm, KeyIdMode, KeyIdState};

use super::{DecodeError, KeyKind, MAX_KEY_FIELD, MAX_NAME};

/// Appends little-endian fields to a body.
#[derive(Default)]
pub(super) struct W(pub(super) Vec<u8>);

impl W {
    pub(super) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub(super) fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn str(&mut self, s: &str) -> &mut Self {
        let b = s.as_bytes();
        let n = u16::try_from(b.len()).unwrap_or(u16::MAX);
        self.u16(n);
        self.0.extend_from_slice(&b[..usize::from(n)]);
        self
    }
    /// A byte string with a `u16` length (at most 65535 bytes are kept).
    pub(super) fn bytes(&mut self, b: &[u8]) -> &mut Self {
        let n = u16::try_from(b.len()).unwrap_or(u16::MAX);
        self.u16(n);
        self.0.extend_from_slice(&b[..usize::from(n)]);
        self
    }
    pub(super) fn frame(self) -> Vec<u8> {
        let n = u32::try_from(self.0.len()).unwrap_or(u32::MAX);
        let mut out = Vec::with_capacity(self.0.len() + 4);
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&self.0);
        out
    }
}

/// Reads little-endian fields from a body, never past its end.
pub(super) struct R<'a> {
    pub(super) b: &'a [u8],
}

impl<'a> R<'a> {
    pub(super) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.b.len() < n {
            return Err(DecodeError::Truncated {
                what,
                needed: n - self.b.len(),
            });
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    pub(super) fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    pub(super) fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        let s = self.take(2, what)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    pub(super) fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    pub(super) fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        let s = self.take(4, what)?;
        Ok(i32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    pub(super) fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let s = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    pub(super) fn bool(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::BadValue {
                field: what,
                value: u64::from(v),
            }),
        }
    }
    pub(super) fn str(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let n = self.u16(what)?;
        let s = self.take(usize::from(n), what)?;
        String::from_utf8(s.to_vec()).map_err(|_| DecodeError::BadUtf8)
    }
    /// A byte string with a `u16` length, borrowed.
    pub(super) fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let n = self.u16(what)?;
        self.take(usize::from(n), what)
    }
    pub(super) fn name(&mut self) -> Result<String, DecodeError> {
        let s = self.str("key name")?;
        if valid_name(&s) {
            Ok(s)
        } else {
            Err(DecodeError::BadName)
        }
    }
    pub(super) fn kind(&mut self) -> Result<KeyKind, DecodeError> {
        let c = self.u8("key kind")?;
        KeyKind::from_code(c).ok_or(DecodeError::BadValue {
            field: "key kind",
            value: u64::from(c),
        })
    }
    pub(super) fn key_field_len(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let n = self.u8(what)?;
        if usize::from(n) > MAX_KEY_FIELD {
            return Err(DecodeError::BadValue {
                field: what,
                value: u64::from(n),
            });
        }
        Ok(usize::from(n))
    }
    pub(super) fn keyid_state(&mut self) -> Result<KeyIdState, DecodeError> {
        let keyid = self.u16("keyid")?;
        let code = self.u8("keyid mode")?;
        let bits = self.u16("keyid algorithm")?;
        let generation = self.u64("generation")?;
        let programmed_by = if self.bool("programmed-by present")? {
            Some(self.u32("programmed-by uid")?)
        } else {
            None
        };
        let alg = Algorithm::from_bits(bits);
        let bad = |field| DecodeError::BadValue {
            field,
            value: u64::from(bits),
        };
        let mode = match (code, alg, bits) {
            (mode_code::CLEAR, _, 0) => KeyIdMode::Clear,
            (mode_code::NO_ENCRYPT, _, 0) => KeyIdMode::NoEncrypt,
            (mode_code::RANDOM, Some(a), _) => KeyIdMode::Random(a),
            (mode_code::DIRECT, Some(a), _) => KeyIdMode::Direct(a),
            (mode_code::PLATFORM, Some(a), _) => KeyIdMode::Platform(a),
            (mode_code::CLEAR..=mode_code::PLATFORM, _, _) => return Err(bad("keyid algorithm")),
            _ => {
                return Err(DecodeError::BadValue {
                    field: "keyid mode",
                    value: u64::from(code),
                })
            }
        };
        Ok(KeyIdState {
            keyid,
            mode,
            generation,
            programmed_by,
        })
    }
    pub(super) fn end(&self) -> Result<(), DecodeError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Trailing(self.b.len()))
        }
    }
}

/// Whether `s` is an acceptable key name: 1–64 characters of `[A-Za-z0-9._-]`.
#[must_use]
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

/// Reads a frame header: the body length, checked against `max`.
///
/// # Errors
/// [`DecodeError::TooLong`] or [`DecodeError::Empty`].
pub fn frame_len(header: [u8; 4], max: usize) -> Result<usize, DecodeError> {
    let n = usize::try_from(u32::from_le_bytes(header)).unwrap_or(usize::MAX);
    if n == 0 {
        return Err(DecodeError::Empty);
    }
    if n > max {
        return Err(DecodeError::TooLong { got: n, max });
    }
    Ok(n)
}

/// Wire values of [`KeyIdMode`].
pub(super) mod mode_code {
    pub const CLEAR: u8 = 0;
    pub const RANDOM: u8 = 1;
    pub const DIRECT: u8 = 2;
    pub const NO_ENCRYPT: u8 = 3;
    pub const PLATFORM: u8 = 4;
}

pub(super) fn put_keyid_state(w: &mut W, s: &KeyIdState) {
    let (code, alg) = match s.mode {
        KeyIdMode::Clear => (mode_code::CLEAR, None),
        KeyIdMode::Random(a) => (mode_code::RANDOM, Some(a)),
        KeyIdMode::Direct(a) => (mode_code::DIRECT, Some(a)),
        KeyIdMode::NoEncrypt => (mode_code::NO_ENCRYPT, None),
        KeyIdMode::Platform(a) => (mode_code::PLATFORM, Some(a)),
    };
    w.u16(s.keyid)
        .u8(code)
        .u16(alg.map_or(0, Algorithm::bits))
        .u64(s.generation);
    match s.programmed_by {
        Some(uid) => w.u8(1).u32(uid),
        None => w.u8(0),
    };
}

pub(crate) mod tag {
    pub const HELLO: u8 = 1;
    pub const STATUS: u8 = 2;
    pub const CREATE: u8 = 3;
    pub const IMPORT: u8 = 4;
    pub const LIST: u8 = 5;
    pub const INFO: u8 = 6;
    pub const ROTATE: u8 = 7;
    pub const DESTROY: u8 = 8;
    pub const GRANT: u8 = 9;
    pub const REVOKE: u8 = 10;
    pub const SHM: u8 = 11;
    pub const BUF: u8 = 12;
    pub const UNBUF: u8 = 13;
    pub const LANE: u8 = 14;
    pub const UNLANE: u8 = 15;
    pub const KEYID_PROGRAM: u8 = 16;
    pub const KEYID_STATUS: u8 = 17;
    pub const KEYID_TENANT: u8 = 18;
    pub const KEYID_TENANTS: u8 = 19;
    pub const PUBKEY: u8 = 20;
    pub const DERIVE: u8 = 21;
    pub const CREATE_SECRET: u8 = 22;

    pub const R_WELCOME: u8 = 0x81;
    pub const R_STATUS: u8 = 0x82;
    pub const R_KEY: u8 = 0x83;
    pub const R_KEYS: u8 = 0x84;
    pub const R_DONE: u8 = 0x85;
    pub const R_ID: u8 = 0x86;
    pub const R_PROGRAMMED: u8 = 0x87;
    pub const R_KEYIDS: u8 = 0x88;
    pub const R_TENANT_KEY: u8 = 0x89;
    pub const R_TENANT_STOP: u8 = 0x8A;
    pub const R_KEYID_TENANTS: u8 = 0x8B;
    pub const R_PUBLIC: u8 = 0x8C;
    pub const R_ERROR: u8 = 0xFF;
}
