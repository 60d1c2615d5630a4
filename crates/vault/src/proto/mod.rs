//! The control protocol: a sans-IO codec (bytes in, messages out) for the
//! Unix control socket.
//!
//! A frame is a little-endian `u32` body length followed by the body; the
//! body starts with a one-byte message tag. Requests are at most
//! [`MAX_REQUEST`] bytes; anything malformed decodes to a [`DecodeError`]
//! (never a panic), which the server answers with an error reply before
//! carrying on. No reply type has a field that could carry key bytes.
//!
//! Layout: `kinds` (key kinds, modes, permission bits), `request`
//! (requests and their codec), `reply` (replies, the facts they carry, and
//! their codec), `wire` (the field readers and writers, tags, limits).
#![forbid(unsafe_code)]

mod kinds;
mod reply;
mod request;
#[cfg(test)]
mod tests;
mod wire;

pub use kinds::{perm, KeyKind, Mode, KINDS, MAX_CERT, MAX_SECRET, MIN_SECRET};
pub use reply::{
    decode_reply, decode_tenant_key_head, encode_reply, ErrorCode, KeyIdTable, KeyInfo,
    PublicParts, Reply, Status,
};
pub use request::{decode_request, encode_request, Request};
pub(crate) use wire::tag;
pub use wire::{frame_len, valid_name};

/// Protocol version spoken by this build.
pub const VERSION: u16 = 1;
/// Largest request body accepted by the vault.
pub const MAX_REQUEST: usize = 4096;
/// Largest reply body accepted by the client.
pub const MAX_REPLY: usize = 16 << 20;
/// Bytes of page key after a [`Reply::TenantKey`] (the engine's
/// `PAGE_KEY_LEN`).
pub const TENANT_KEY_LEN: usize = memveil_engine::PAGE_KEY_LEN;
/// Longest key name.
pub const MAX_NAME: usize = 64;
/// Longest key field of a KeyID programming request (PCONFIG's
/// `KEY_FIELD_1` and `KEY_FIELD_2` are 64 bytes each).
pub const MAX_KEY_FIELD: usize = 64;

/// Why bytes did not decode to a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frame ended early.
    #[error("truncated frame: needed {needed} more bytes for {what}")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// How many bytes were missing.
        needed: usize,
    },
    /// The frame declares a body longer than allowed.
    #[error("frame of {got} bytes exceeds the limit of {max}")]
    TooLong {
        /// Declared length.
        got: usize,
        /// Limit.
        max: usize,
    },
    /// An empty body.
    #[error("empty frame")]
    Empty,
    /// An unknown message tag.
    #[error("unknown message tag {0:#04x}")]
    UnknownTag(u8),
    /// A field holds a value outside its range.
    #[error("bad {field}: {value}")]
    BadValue {
        /// Field name.
        field: &'static str,
        /// The value found.
        value: u64,
    },
    /// A key name that is empty, too long or has characters outside `[A-Za-z0-9._-]`.
    #[error("bad key name: 1–64 characters from [A-Za-z0-9._-] expected")]
    BadName,
    /// A string that is not UTF-8.
    #[error("string is not UTF-8")]
    BadUtf8,
    /// Bytes left over after the message.
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
}
