//! The control protocol: a sans-IO codec (bytes in, messages out) for the
//! Unix control socket.
//!
//! A frame is a little-endian `u32` body length followed by the body; the
//! body starts with a one-byte message tag. Requests are at most
//! [`MAX_REQUEST`] bytes; anything malformed decodes to a [`DecodeError`]
//! (never a panic), which the server answers with an error reply before
//! carrying on. No reply type has a field that could carry key bytes.
#![forbid(unsafe_code)]

use std::fmt;

use memveil_engine::{Algorithm, KeyIdMode, KeyIdState, KeyProgram, Status as PconfigStatus};

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

/// A control request. `ImportKey` borrows its key bytes from the frame
/// buffer (which the vault keeps in secret memory).
#[derive(PartialEq, Eq)]
#[non_exhaustive]
pub enum Request<'a> {
    /// First message: protocol version.
    Hello {
        /// Client's protocol version.
        version: u16,
    },
    /// Vault status.
    Status,
    /// Generate a random key inside the vault.
    CreateKey {
        /// Name.
        name: String,
        /// Kind.
        kind: KeyKind,
        /// Sealed to disk and reloaded at restart.
        persistent: bool,
    },
    /// Import a key (one way: no verb ever returns it).
    ImportKey {
        /// Name.
        name: String,
        /// Kind.
        kind: KeyKind,
        /// Sealed to disk and reloaded at restart.
        persistent: bool,
        /// Key bytes (length = `kind.key_len()`).
        key: &'a [u8],
    },
    /// Keys visible to the caller.
    ListKeys,
    /// One key's public facts.
    KeyInfo {
        /// Name.
        name: String,
    },
    /// Add a new random version; encryption uses the newest.
    RotateKey {
        /// Name.
        name: String,
    },
    /// Wipe every version of a key.
    DestroyKey {
        /// Name.
        name: String,
    },
    /// Give `uid` the permission bits `perms` on a key.
    Grant {
        /// Name.
        name: String,
        /// User id.
        uid: u32,
        /// Bits of [`perm`].
        perms: u8,
    },
    /// Remove `uid` from a key's ACL.
    Revoke {
        /// Name.
        name: String,
        /// User id.
        uid: u32,
    },
    /// Map the memfd attached to this frame (`SCM_RIGHTS`), `len` bytes.
    RegisterShm {
        /// Bytes to map.
        len: u64,
    },
    /// Register `[offset, offset+len)` of a shared area as a data buffer.
    RegisterBuffer {
        /// Shared area id.
        shm: u32,
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Forget a buffer.
    UnregisterBuffer {
        /// Buffer id.
        buffer: u32,
    },
    /// Start a lane (a request ring served by its own worker) at `offset` of a shared area.
    OpenLane {
        /// Shared area id.
        shm: u32,
        /// Start of the lane (page aligned).
        offset: u64,
    },
    /// Stop a lane.
    CloseLane {
        /// Lane id.
        lane: u32,
    },
    /// Program a KeyID of the host key table: one PCONFIG
    /// `MKTME_KEY_PROGRAM` request (clear included: command 2), fields raw
    /// as software writes them, so a malformed request reaches the engine's
    /// checks and gets their status. Each key field is at most
    /// [`MAX_KEY_FIELD`] bytes; both travel at the end of the frame,
    /// received straight into the vault's secret memory.
    ProgramKeyId(KeyProgram<'a>),
    /// The host key table: every KeyID's state (never key bytes).
    KeyIdStatus,
    /// The page key of a tenant that runs under a KeyID (`memveil run
    /// --keyid`), derived from the KeyID's key (never the key itself), for
    /// a uid that may program KeyIDs. Answered with [`Reply::TenantKey`];
    /// from then on the connection is the tenant's: it carries no other
    /// request, and the vault sends [`Reply::TenantStop`] on it when the
    /// KeyID is cleared or programmed again, then waits for the tenant to
    /// stop and close it.
    TenantKey {
        /// The KeyID.
        keyid: u16,
    },
    /// How many tenants run under each KeyID (`memveil key status`): a
    /// request of its own, so that a vault that predates it refuses it as
    /// an unknown tag and the table's reply stays what older clients read.
    /// Answered with [`Reply::KeyIdTenants`].
    KeyIdTenants,
}

impl fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Request::ImportKey {
                name,
                kind,
                persistent,
                key,
            } => write!(
                f,
                "ImportKey {{ name: {name:?}, kind: {kind}, persistent: {persistent}, key: <{} bytes> }}",
                key.len()
            ),
            Request::Hello { version } => write!(f, "Hello({version})"),
            Request::Status => f.write_str("Status"),
            Request::CreateKey {
                name,
                kind,
                persistent,
            } => write!(f, "CreateKey({name:?}, {kind}, persistent={persistent})"),
            Request::ListKeys => f.write_str("ListKeys"),
            Request::KeyInfo { name } => write!(f, "KeyInfo({name:?})"),
            Request::RotateKey { name } => write!(f, "RotateKey({name:?})"),
            Request::DestroyKey { name } => write!(f, "DestroyKey({name:?})"),
            Request::Grant { name, uid, perms } => write!(f, "Grant({name:?}, {uid}, {perms})"),
            Request::Revoke { name, uid } => write!(f, "Revoke({name:?}, {uid})"),
            Request::RegisterShm { len } => write!(f, "RegisterShm({len})"),
            Request::RegisterBuffer { shm, offset, len } => {
                write!(f, "RegisterBuffer({shm}, {offset}, {len})")
            }
            Request::UnregisterBuffer { buffer } => write!(f, "UnregisterBuffer({buffer})"),
            Request::OpenLane { shm, offset } => write!(f, "OpenLane({shm}, {offset})"),
            Request::CloseLane { lane } => write!(f, "CloseLane({lane})"),
            Request::ProgramKeyId(p) => write!(
                f,
                "ProgramKeyId {{ keyid: {}, command: {}, enc_alg: {:#x}, fields: <{} and {} bytes> }}",
                p.keyid,
                p.command,
                p.enc_alg,
                p.key_field_1.len(),
                p.key_field_2.len()
            ),
            Request::KeyIdStatus => f.write_str("KeyIdStatus"),
            Request::TenantKey { keyid } => write!(f, "TenantKey({keyid})"),
            Request::KeyIdTenants => f.write_str("KeyIdTenants"),
        }
    }
}

/// Public facts about a key. Deliberately has no field for key bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    /// Numeric id used in ring requests.
    pub id: u32,
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: KeyKind,
    /// Owner's uid.
    pub owner: u32,
    /// Number of versions (1 + rotations); the newest is `versions`.
    pub versions: u32,
    /// Sealed to disk.
    pub persistent: bool,
    /// ACL: (uid, permission bits).
    pub acl: Vec<(u32, u8)>,
}

/// Vault status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Protocol version.
    pub version: u16,
    /// Protection level of keys, stacks and IVs: "secret" or "locked".
    pub level: String,
    /// AES backend.
    pub backend: String,
    /// Keys held (all owners).
    pub keys: u32,
    /// Connected clients.
    pub clients: u32,
    /// Whether a keystore key is configured (persistent keys possible).
    pub durable: bool,
    /// Seconds since start.
    pub uptime_s: u64,
    /// The vault's pid.
    pub pid: u32,
}

/// The host key table: its size and every KeyID's state, KeyID 0 first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyIdTable {
    /// Highest KeyID (KeyIDs `1..=max_keyid` are programmable).
    pub max_keyid: u16,
    /// Protection level of the table's keys: "secret" or "locked".
    pub level: String,
    /// Every KeyID, `0..=max_keyid`.
    pub entries: Vec<KeyIdState>,
}

impl KeyIdTable {
    /// How many KeyIDs are programmed now (KeyID 0 and cleared ones not
    /// counted): what `memveil key status` and the probe's
    /// `memveil_vault_keyids_programmed` report.
    #[must_use]
    pub fn programmed(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| e.keyid != 0 && !matches!(e.mode, memveil_engine::KeyIdMode::Clear))
            .count()
    }
}

/// Error classes of replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The request did not decode.
    Malformed,
    /// No such key / buffer / lane.
    NotFound,
    /// The caller lacks the permission.
    Denied,
    /// A per-client quota is reached.
    Quota,
    /// The name is taken.
    Exists,
    /// A value is not acceptable (wrong key length, bad region, unsealed memfd…).
    Invalid,
    /// Persistence is not configured.
    NotDurable,
    /// An internal failure (secret memory exhausted, disk error).
    Internal,
}

impl ErrorCode {
    fn code(self) -> u16 {
        match self {
            ErrorCode::Malformed => 1,
            ErrorCode::NotFound => 2,
            ErrorCode::Denied => 3,
            ErrorCode::Quota => 4,
            ErrorCode::Exists => 5,
            ErrorCode::Invalid => 6,
            ErrorCode::NotDurable => 7,
            ErrorCode::Internal => 8,
        }
    }
    fn from_code(c: u16) -> Option<Self> {
        Some(match c {
            1 => ErrorCode::Malformed,
            2 => ErrorCode::NotFound,
            3 => ErrorCode::Denied,
            4 => ErrorCode::Quota,
            5 => ErrorCode::Exists,
            6 => ErrorCode::Invalid,
            7 => ErrorCode::NotDurable,
            8 => ErrorCode::Internal,
            _ => return None,
        })
    }
}

/// A control reply.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reply {
    /// Answer to `Hello`.
    Welcome {
        /// Vault protocol version.
        version: u16,
        /// Protection level.
        level: String,
        /// The caller's uid as the vault sees it.
        uid: u32,
        /// The caller's pid as the vault sees it.
        pid: i32,
        /// The vault's pid.
        vault_pid: u32,
    },
    /// Answer to `Status`.
    Status(Status),
    /// One key.
    Key(KeyInfo),
    /// Key list.
    Keys(Vec<KeyInfo>),
    /// Success without data.
    Done,
    /// A new id (shared area, buffer or lane).
    Id(u32),
    /// Answer to `ProgramKeyId` from an authorized caller: PCONFIG's status
    /// and, on success, the KeyID's new state.
    Programmed {
        /// The PCONFIG status code.
        status: PconfigStatus,
        /// The engine's words for it (what was wrong, what to do).
        message: String,
        /// The KeyID's new state (success only).
        state: Option<KeyIdState>,
    },
    /// Answer to `KeyIdStatus`.
    KeyIds(KeyIdTable),
    /// Answer to `KeyIdTenants`: the running tenants (`memveil run --keyid`
    /// connections) of each KeyID, indexed by KeyID, `0..=max_keyid`.
    KeyIdTenants(Vec<u32>),
    /// Answer to `TenantKey`: the KeyID's state, then [`TENANT_KEY_LEN`]
    /// bytes of page key that [`encode_reply`] leaves out (its length prefix
    /// counts them; the vault sends them from its secret memory right after,
    /// the client reads them into its own) and [`decode_reply`] skips. An
    /// AES-XTS-128 KeyID's key is the first 32 bytes; a no-encrypt KeyID's
    /// bytes are zeros.
    TenantKey(KeyIdState),
    /// Sent on a tenant's connection, unasked: stop every process under the
    /// KeyID now (its key is gone), then close the connection.
    TenantStop {
        /// The KeyID.
        keyid: u16,
        /// Its generation now.
        generation: u64,
        /// Who did what (for the tenant's message).
        message: String,
    },
    /// Failure.
    Error {
        /// Class.
        code: ErrorCode,
        /// What failed and what to do.
        message: String,
    },
}

// ---------------------------------------------------------------- encoding

/// Appends little-endian fields to a body.
#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        let b = s.as_bytes();
        let n = u16::try_from(b.len()).unwrap_or(u16::MAX);
        self.u16(n);
        self.0.extend_from_slice(&b[..usize::from(n)]);
        self
    }
    fn frame(self) -> Vec<u8> {
        let n = u32::try_from(self.0.len()).unwrap_or(u32::MAX);
        let mut out = Vec::with_capacity(self.0.len() + 4);
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&self.0);
        out
    }
}

/// Reads little-endian fields from a body, never past its end.
struct R<'a> {
    b: &'a [u8],
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
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
    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        let s = self.take(2, what)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        let s = self.take(4, what)?;
        Ok(i32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let s = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn bool(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::BadValue {
                field: what,
                value: u64::from(v),
            }),
        }
    }
    fn str(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let n = self.u16(what)?;
        let s = self.take(usize::from(n), what)?;
        String::from_utf8(s.to_vec()).map_err(|_| DecodeError::BadUtf8)
    }
    fn name(&mut self) -> Result<String, DecodeError> {
        let s = self.str("key name")?;
        if valid_name(&s) {
            Ok(s)
        } else {
            Err(DecodeError::BadName)
        }
    }
    fn kind(&mut self) -> Result<KeyKind, DecodeError> {
        let c = self.u8("key kind")?;
        KeyKind::from_code(c).ok_or(DecodeError::BadValue {
            field: "key kind",
            value: u64::from(c),
        })
    }
    fn key_field_len(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let n = self.u8(what)?;
        if usize::from(n) > MAX_KEY_FIELD {
            return Err(DecodeError::BadValue {
                field: what,
                value: u64::from(n),
            });
        }
        Ok(usize::from(n))
    }
    fn keyid_state(&mut self) -> Result<KeyIdState, DecodeError> {
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
    fn end(&self) -> Result<(), DecodeError> {
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
mod mode_code {
    pub const CLEAR: u8 = 0;
    pub const RANDOM: u8 = 1;
    pub const DIRECT: u8 = 2;
    pub const NO_ENCRYPT: u8 = 3;
    pub const PLATFORM: u8 = 4;
}

fn put_keyid_state(w: &mut W, s: &KeyIdState) {
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
    pub const R_ERROR: u8 = 0xFF;
}

/// Encodes a request as a frame, except the key bytes of `ImportKey` and
/// `ProgramKeyId`: for those the returned frame holds the header and fields,
/// and its length prefix already counts the key bytes the caller sends right
/// after (`key`, or `key_field_1` then `key_field_2`), so key bytes never
/// pass through an intermediate buffer.
#[must_use]
pub fn encode_request(req: &Request<'_>) -> Vec<u8> {
    let mut w = W::default();
    let mut extra = 0usize;
    match req {
        Request::Hello { version } => {
            w.u8(tag::HELLO).u16(*version);
        }
        Request::Status => {
            w.u8(tag::STATUS);
        }
        Request::CreateKey {
            name,
            kind,
            persistent,
        } => {
            w.u8(tag::CREATE)
                .str(name)
                .u8(kind.code())
                .u8(u8::from(*persistent));
        }
        Request::ImportKey {
            name,
            kind,
            persistent,
            key,
        } => {
            let n = u16::try_from(key.len()).unwrap_or(u16::MAX);
            w.u8(tag::IMPORT)
                .str(name)
                .u8(kind.code())
                .u8(u8::from(*persistent))
                .u16(n);
            extra = usize::from(n);
        }
        Request::ListKeys => {
            w.u8(tag::LIST);
        }
        Request::KeyInfo { name } => {
            w.u8(tag::INFO).str(name);
        }
        Request::RotateKey { name } => {
            w.u8(tag::ROTATE).str(name);
        }
        Request::DestroyKey { name } => {
            w.u8(tag::DESTROY).str(name);
        }
        Request::Grant { name, uid, perms } => {
            w.u8(tag::GRANT).str(name).u32(*uid).u8(*perms);
        }
        Request::Revoke { name, uid } => {
            w.u8(tag::REVOKE).str(name).u32(*uid);
        }
        Request::RegisterShm { len } => {
            w.u8(tag::SHM).u64(*len);
        }
        Request::RegisterBuffer { shm, offset, len } => {
            w.u8(tag::BUF).u32(*shm).u64(*offset).u64(*len);
        }
        Request::UnregisterBuffer { buffer } => {
            w.u8(tag::UNBUF).u32(*buffer);
        }
        Request::OpenLane { shm, offset } => {
            w.u8(tag::LANE).u32(*shm).u64(*offset);
        }
        Request::CloseLane { lane } => {
            w.u8(tag::UNLANE).u32(*lane);
        }
        Request::ProgramKeyId(p) => {
            let n1 = u8::try_from(p.key_field_1.len()).unwrap_or(u8::MAX);
            let n2 = u8::try_from(p.key_field_2.len()).unwrap_or(u8::MAX);
            w.u8(tag::KEYID_PROGRAM)
                .u16(p.keyid)
                .u8(p.command)
                .u16(p.enc_alg)
                .u8(n1)
                .u8(n2);
            extra = usize::from(n1) + usize::from(n2);
        }
        Request::KeyIdStatus => {
            w.u8(tag::KEYID_STATUS);
        }
        Request::TenantKey { keyid } => {
            w.u8(tag::KEYID_TENANT).u16(*keyid);
        }
        Request::KeyIdTenants => {
            w.u8(tag::KEYID_TENANTS);
        }
    }
    let mut f = w.frame();
    let n = u32::try_from(f.len() - 4 + extra).unwrap_or(u32::MAX);
    f[..4].copy_from_slice(&n.to_le_bytes());
    f
}

/// Decodes a request body (without the length prefix).
///
/// # Errors
/// A [`DecodeError`] for anything malformed.
pub fn decode_request(body: &[u8]) -> Result<Request<'_>, DecodeError> {
    if body.len() > MAX_REQUEST {
        return Err(DecodeError::TooLong {
            got: body.len(),
            max: MAX_REQUEST,
        });
    }
    let mut r = R { b: body };
    let t = r.u8("tag").map_err(|_| DecodeError::Empty)?;
    let req = match t {
        tag::HELLO => Request::Hello {
            version: r.u16("version")?,
        },
        tag::STATUS => Request::Status,
        tag::CREATE => Request::CreateKey {
            name: r.name()?,
            kind: r.kind()?,
            persistent: r.bool("persistent")?,
        },
        tag::IMPORT => {
            let name = r.name()?;
            let kind = r.kind()?;
            let persistent = r.bool("persistent")?;
            let n = r.u16("key length")?;
            if usize::from(n) != kind.key_len() {
                return Err(DecodeError::BadValue {
                    field: "key length",
                    value: u64::from(n),
                });
            }
            let key = r.take(usize::from(n), "key bytes")?;
            Request::ImportKey {
                name,
                kind,
                persistent,
                key,
            }
        }
        tag::LIST => Request::ListKeys,
        tag::INFO => Request::KeyInfo { name: r.name()? },
        tag::ROTATE => Request::RotateKey { name: r.name()? },
        tag::DESTROY => Request::DestroyKey { name: r.name()? },
        tag::GRANT => {
            let name = r.name()?;
            let uid = r.u32("uid")?;
            let perms = r.u8("permissions")?;
            if perms & !perm::ALL != 0 || perms == 0 {
                return Err(DecodeError::BadValue {
                    field: "permissions",
                    value: u64::from(perms),
                });
            }
            Request::Grant { name, uid, perms }
        }
        tag::REVOKE => Request::Revoke {
            name: r.name()?,
            uid: r.u32("uid")?,
        },
        tag::SHM => Request::RegisterShm {
            len: r.u64("length")?,
        },
        tag::BUF => Request::RegisterBuffer {
            shm: r.u32("shm id")?,
            offset: r.u64("offset")?,
            len: r.u64("length")?,
        },
        tag::UNBUF => Request::UnregisterBuffer {
            buffer: r.u32("buffer id")?,
        },
        tag::LANE => Request::OpenLane {
            shm: r.u32("shm id")?,
            offset: r.u64("offset")?,
        },
        tag::UNLANE => Request::CloseLane {
            lane: r.u32("lane id")?,
        },
        tag::KEYID_PROGRAM => {
            let keyid = r.u16("keyid")?;
            let command = r.u8("command")?;
            let enc_alg = r.u16("enc_alg")?;
            let n1 = r.key_field_len("key field 1 length")?;
            let n2 = r.key_field_len("key field 2 length")?;
            Request::ProgramKeyId(KeyProgram {
                keyid,
                command,
                enc_alg,
                key_field_1: r.take(n1, "key field 1")?,
                key_field_2: r.take(n2, "key field 2")?,
            })
        }
        tag::KEYID_STATUS => Request::KeyIdStatus,
        tag::KEYID_TENANT => Request::TenantKey {
            keyid: r.u16("keyid")?,
        },
        tag::KEYID_TENANTS => Request::KeyIdTenants,
        other => return Err(DecodeError::UnknownTag(other)),
    };
    r.end()?;
    Ok(req)
}

fn put_key(w: &mut W, k: &KeyInfo) {
    w.u32(k.id)
        .str(&k.name)
        .u8(k.kind.code())
        .u32(k.owner)
        .u32(k.versions)
        .u8(u8::from(k.persistent));
    let n = u16::try_from(k.acl.len()).unwrap_or(u16::MAX);
    w.u16(n);
    for (uid, p) in k.acl.iter().take(usize::from(n)) {
        w.u32(*uid).u8(*p);
    }
}

fn get_key(r: &mut R<'_>) -> Result<KeyInfo, DecodeError> {
    let id = r.u32("key id")?;
    let name = r.str("key name")?;
    let kind = r.kind()?;
    let owner = r.u32("owner")?;
    let versions = r.u32("versions")?;
    let persistent = r.bool("persistent")?;
    let n = r.u16("acl length")?;
    let mut acl = Vec::new();
    for _ in 0..n {
        acl.push((r.u32("acl uid")?, r.u8("acl perms")?));
    }
    Ok(KeyInfo {
        id,
        name,
        kind,
        owner,
        versions,
        persistent,
        acl,
    })
}

/// Encodes a reply as a frame.
#[must_use]
pub fn encode_reply(rep: &Reply) -> Vec<u8> {
    let mut w = W::default();
    match rep {
        Reply::Welcome {
            version,
            level,
            uid,
            pid,
            vault_pid,
        } => {
            w.u8(tag::R_WELCOME)
                .u16(*version)
                .str(level)
                .u32(*uid)
                .u32(u32::from_le_bytes(pid.to_le_bytes()))
                .u32(*vault_pid);
        }
        Reply::Status(s) => {
            w.u8(tag::R_STATUS)
                .u16(s.version)
                .str(&s.level)
                .str(&s.backend)
                .u32(s.keys)
                .u32(s.clients)
                .u8(u8::from(s.durable))
                .u64(s.uptime_s)
                .u32(s.pid);
        }
        Reply::Key(k) => {
            w.u8(tag::R_KEY);
            put_key(&mut w, k);
        }
        Reply::Keys(ks) => {
            w.u8(tag::R_KEYS);
            w.u32(u32::try_from(ks.len()).unwrap_or(u32::MAX));
            for k in ks {
                put_key(&mut w, k);
            }
        }
        Reply::Done => {
            w.u8(tag::R_DONE);
        }
        Reply::Id(id) => {
            w.u8(tag::R_ID).u32(*id);
        }
        Reply::Programmed {
            status,
            message,
            state,
        } => {
            w.u8(tag::R_PROGRAMMED).u8(*status as u8).str(message);
            match state {
                Some(s) => {
                    w.u8(1);
                    put_keyid_state(&mut w, s);
                }
                None => {
                    w.u8(0);
                }
            }
        }
        Reply::KeyIds(t) => {
            w.u8(tag::R_KEYIDS).u16(t.max_keyid).str(&t.level);
            w.u32(u32::try_from(t.entries.len()).unwrap_or(u32::MAX));
            for e in &t.entries {
                put_keyid_state(&mut w, e);
            }
        }
        Reply::KeyIdTenants(counts) => {
            w.u8(tag::R_KEYID_TENANTS)
                .u32(u32::try_from(counts.len()).unwrap_or(u32::MAX));
            for &n in counts {
                w.u32(n);
            }
        }
        Reply::TenantKey(state) => {
            w.u8(tag::R_TENANT_KEY);
            put_keyid_state(&mut w, state);
            let mut f = w.frame();
            let n = u32::try_from(f.len() - 4 + TENANT_KEY_LEN).unwrap_or(u32::MAX);
            f[..4].copy_from_slice(&n.to_le_bytes());
            return f;
        }
        Reply::TenantStop {
            keyid,
            generation,
            message,
        } => {
            w.u8(tag::R_TENANT_STOP)
                .u16(*keyid)
                .u64(*generation)
                .str(message);
        }
        Reply::Error { code, message } => {
            w.u8(tag::R_ERROR).u16(code.code()).str(message);
        }
    }
    w.frame()
}

/// Decodes the head of a [`Reply::TenantKey`] frame: the body without its
/// trailing [`TENANT_KEY_LEN`] key bytes.
///
/// # Errors
/// A [`DecodeError`] for anything malformed, or another reply's tag.
pub fn decode_tenant_key_head(head: &[u8]) -> Result<KeyIdState, DecodeError> {
    let mut r = R { b: head };
    match r.u8("tag").map_err(|_| DecodeError::Empty)? {
        tag::R_TENANT_KEY => {}
        other => return Err(DecodeError::UnknownTag(other)),
    }
    let state = r.keyid_state()?;
    r.end()?;
    Ok(state)
}

/// Decodes a reply body.
///
/// # Errors
/// A [`DecodeError`] for anything malformed.
pub fn decode_reply(body: &[u8]) -> Result<Reply, DecodeError> {
    let mut r = R { b: body };
    let t = r.u8("tag").map_err(|_| DecodeError::Empty)?;
    let rep = match t {
        tag::R_WELCOME => Reply::Welcome {
            version: r.u16("version")?,
            level: r.str("level")?,
            uid: r.u32("uid")?,
            pid: r.i32("pid")?,
            vault_pid: r.u32("vault pid")?,
        },
        tag::R_STATUS => Reply::Status(Status {
            version: r.u16("version")?,
            level: r.str("level")?,
            backend: r.str("backend")?,
            keys: r.u32("keys")?,
            clients: r.u32("clients")?,
            durable: r.bool("durable")?,
            uptime_s: r.u64("uptime")?,
            pid: r.u32("pid")?,
        }),
        tag::R_KEY => Reply::Key(get_key(&mut r)?),
        tag::R_KEYS => {
            let n = r.u32("key count")?;
            let mut v = Vec::new();
            for _ in 0..n {
                v.push(get_key(&mut r)?);
            }
            Reply::Keys(v)
        }
        tag::R_DONE => Reply::Done,
        tag::R_ID => Reply::Id(r.u32("id")?),
        tag::R_PROGRAMMED => {
            let c = r.u8("PCONFIG status")?;
            let status = PconfigStatus::from_code(c).ok_or(DecodeError::BadValue {
                field: "PCONFIG status",
                value: u64::from(c),
            })?;
            let message = r.str("message")?;
            let state = if r.bool("state present")? {
                Some(r.keyid_state()?)
            } else {
                None
            };
            Reply::Programmed {
                status,
                message,
                state,
            }
        }
        tag::R_KEYIDS => {
            let max_keyid = r.u16("max keyid")?;
            let level = r.str("level")?;
            let n = r.u32("keyid count")?;
            let mut entries = Vec::new();
            for _ in 0..n {
                entries.push(r.keyid_state()?);
            }
            Reply::KeyIds(KeyIdTable {
                max_keyid,
                level,
                entries,
            })
        }
        tag::R_KEYID_TENANTS => {
            let n = r.u32("keyid count")?;
            let mut counts = Vec::new();
            for _ in 0..n {
                counts.push(r.u32("tenant count")?);
            }
            Reply::KeyIdTenants(counts)
        }
        tag::R_TENANT_KEY => {
            let state = r.keyid_state()?;
            // The key bytes: skipped, never copied (Client::tenant_key reads
            // them into secret memory instead).
            r.take(TENANT_KEY_LEN, "page key")?;
            Reply::TenantKey(state)
        }
        tag::R_TENANT_STOP => Reply::TenantStop {
            keyid: r.u16("keyid")?,
            generation: r.u64("generation")?,
            message: r.str("message")?,
        },
        tag::R_ERROR => {
            let c = r.u16("error code")?;
            Reply::Error {
                code: ErrorCode::from_code(c).ok_or(DecodeError::BadValue {
                    field: "error code",
                    value: u64::from(c),
                })?,
                message: r.str("message")?,
            }
        }
        other => return Err(DecodeError::UnknownTag(other)),
    };
    r.end()?;
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn body(f: &[u8]) -> &[u8] {
        &f[4..]
    }

    fn proto_len(f: &[u8]) -> usize {
        u32::from_le_bytes([f[0], f[1], f[2], f[3]]) as usize
    }

    fn sample_requests() -> Vec<Request<'static>> {
        vec![
            Request::Hello { version: 1 },
            Request::Status,
            Request::CreateKey {
                name: "k1".into(),
                kind: KeyKind::Aes256,
                persistent: true,
            },
            Request::ListKeys,
            Request::KeyInfo {
                name: "a.b-c_d".into(),
            },
            Request::RotateKey { name: "x".into() },
            Request::DestroyKey { name: "x".into() },
            Request::Grant {
                name: "x".into(),
                uid: 1000,
                perms: perm::ENCRYPT,
            },
            Request::Revoke {
                name: "x".into(),
                uid: 7,
            },
            Request::RegisterShm { len: 1 << 20 },
            Request::RegisterBuffer {
                shm: 1,
                offset: 4096,
                len: 8192,
            },
            Request::UnregisterBuffer { buffer: 3 },
            Request::OpenLane { shm: 1, offset: 0 },
            Request::CloseLane { lane: 2 },
            Request::ProgramKeyId(KeyProgram::clear(5)),
            Request::KeyIdStatus,
            Request::TenantKey { keyid: 9 },
            Request::KeyIdTenants,
        ]
    }

    /// A `ProgramKeyId` frame with its key fields appended, as the client sends it.
    fn program_frame(keyid: u16, command: u8, enc_alg: u16, f1: &[u8], f2: &[u8]) -> Vec<u8> {
        let mut f = encode_request(&Request::ProgramKeyId(KeyProgram {
            keyid,
            command,
            enc_alg,
            key_field_1: f1,
            key_field_2: f2,
        }));
        f.extend_from_slice(f1);
        f.extend_from_slice(f2);
        f
    }

    fn states() -> Vec<KeyIdState> {
        let s = |keyid, mode, generation, programmed_by| KeyIdState {
            keyid,
            mode,
            generation,
            programmed_by,
        };
        vec![
            s(0, KeyIdMode::Platform(Algorithm::AesXts128), 0, None),
            s(1, KeyIdMode::Random(Algorithm::AesXts256), 3, Some(0)),
            s(2, KeyIdMode::Direct(Algorithm::AesXts128), 1, Some(1000)),
            s(3, KeyIdMode::NoEncrypt, 1, Some(7)),
            s(4, KeyIdMode::Clear, 2, Some(u32::MAX)),
            s(u16::MAX, KeyIdMode::Clear, u64::MAX, None),
        ]
    }

    #[test]
    fn program_carries_key_fields_after_the_header() {
        let (k1, k2) = ([0xA5u8; 32], [0x5Au8; 32]);
        let f = program_frame(9, 0, 4, &k1, &k2);
        let header = &f[..f.len() - 64];
        assert!(!header.windows(4).any(|w| w == [0xA5; 4] || w == [0x5A; 4]));
        let n = frame_len(f[..4].try_into().expect("4"), MAX_REQUEST).expect("len");
        assert_eq!(n, f.len() - 4);
        let r = decode_request(body(&f)).expect("decode");
        assert_eq!(
            r,
            Request::ProgramKeyId(KeyProgram::direct(9, Algorithm::AesXts256, &k1, &k2))
        );
        let dbg = format!("{r:?}");
        assert!(
            dbg.contains("32 and 32 bytes") && !dbg.contains("165"),
            "{dbg}"
        );
    }

    #[test]
    fn program_requests_stay_raw_for_the_engine_to_judge() {
        // Unknown commands, algorithms, KeyID 0 and short keys decode: the
        // engine's checks answer them with PCONFIG statuses, not the codec.
        for (keyid, cmd, alg, f1) in [(0u16, 0u8, 1u16, &[1u8; 3][..]), (70, 9, 2, &[][..])] {
            let f = program_frame(keyid, cmd, alg, f1, &[]);
            assert!(
                matches!(
                    decode_request(body(&f)),
                    Ok(Request::ProgramKeyId(p)) if (p.keyid, p.command, p.enc_alg) == (keyid, cmd, alg)
                ),
                "{keyid} {cmd} {alg}"
            );
        }
    }

    #[test]
    fn oversized_or_missing_key_fields_are_malformed() {
        let long = [1u8; MAX_KEY_FIELD + 1];
        let f = program_frame(1, 0, 1, &long, &[]);
        assert_eq!(
            decode_request(body(&f)),
            Err(DecodeError::BadValue {
                field: "key field 1 length",
                value: 65
            })
        );
        // Declared 16 + 16, sent 16.
        let mut f = encode_request(&Request::ProgramKeyId(KeyProgram::direct(
            1,
            Algorithm::AesXts128,
            &[2; 16],
            &[3; 16],
        )));
        f.extend_from_slice(&[2; 16]);
        assert!(matches!(
            decode_request(body(&f)),
            Err(DecodeError::Truncated {
                what: "key field 2",
                ..
            })
        ));
        // One byte too many.
        let mut f = program_frame(1, 0, 1, &[2; 16], &[3; 16]);
        f.push(0);
        assert_eq!(decode_request(body(&f)), Err(DecodeError::Trailing(1)));
    }

    #[test]
    fn keyid_replies_round_trip_and_reject_impossible_states() {
        for rep in [
            Reply::KeyIds(KeyIdTable {
                max_keyid: 63,
                level: "secret".into(),
                entries: states(),
            }),
            Reply::KeyIds(KeyIdTable {
                max_keyid: 1,
                level: "locked".into(),
                entries: Vec::new(),
            }),
            Reply::Programmed {
                status: PconfigStatus::ProgSuccess,
                message: "PROG_SUCCESS".into(),
                state: Some(states()[1]),
            },
            Reply::Programmed {
                status: PconfigStatus::InvalidKeyId,
                message: "INVALID_KEYID: KeyID 0".into(),
                state: None,
            },
            Reply::TenantStop {
                keyid: 5,
                generation: 3,
                message: "cleared by uid 0".into(),
            },
            Reply::KeyIdTenants(vec![0, 2, 0, u32::MAX]),
            Reply::KeyIdTenants(Vec::new()),
        ] {
            let f = encode_reply(&rep);
            assert_eq!(decode_reply(body(&f)).expect("decode"), rep);
        }
        // Tenant counts: one more announced than sent is truncated, one
        // byte more is trailing.
        let f = encode_reply(&Reply::KeyIdTenants(vec![1, 2]));
        let mut b = body(&f).to_vec();
        b[1] = 3;
        assert!(matches!(
            decode_reply(&b),
            Err(DecodeError::Truncated {
                what: "tenant count",
                ..
            })
        ));
        let mut b = body(&f).to_vec();
        b.push(0);
        assert_eq!(decode_reply(&b), Err(DecodeError::Trailing(1)));
        // A tenant key: the frame's length counts the key bytes sent after it.
        let rep = Reply::TenantKey(states()[1]);
        let mut f = encode_reply(&rep);
        let n = proto_len(&f);
        assert_eq!(n, f.len() - 4 + TENANT_KEY_LEN);
        assert!(matches!(
            decode_reply(body(&f)),
            Err(DecodeError::Truncated { .. })
        ));
        f.extend_from_slice(&[0xAB; TENANT_KEY_LEN]);
        assert_eq!(decode_reply(body(&f)).expect("decode"), rep);
        f.push(0);
        assert_eq!(decode_reply(body(&f)), Err(DecodeError::Trailing(1)));
        let ok = encode_reply(&Reply::Programmed {
            status: PconfigStatus::ProgSuccess,
            message: String::new(),
            state: Some(states()[1]),
        });
        let b = body(&ok).to_vec();
        // Layout: tag, status, message (u16 length 0), present, keyid (2), mode, alg (2).
        let (status_at, mode_at, alg_at) = (1, 7, 8);
        for (at, v, field) in [
            (status_at, 6u8, "PCONFIG status"),
            (mode_at, 5, "keyid mode"),
            (alg_at, 2, "keyid algorithm"),
            (alg_at, 0, "keyid algorithm"),
        ] {
            let mut bad = b.clone();
            bad[at] = v;
            assert!(
                matches!(decode_reply(&bad), Err(DecodeError::BadValue { field: f, .. }) if f == field),
                "{field}={v}: {:?}",
                decode_reply(&bad)
            );
        }
        // Clear and no-encrypt carry no algorithm.
        let mut bad = b.clone();
        bad[mode_at] = 0;
        assert!(decode_reply(&bad).is_err());
        // Positive control: the unmodified body decodes.
        assert!(decode_reply(&b).is_ok());
    }

    #[test]
    fn requests_round_trip() {
        for r in sample_requests() {
            let f = encode_request(&r);
            assert_eq!(
                frame_len(f[..4].try_into().expect("4"), MAX_REQUEST).expect("len"),
                f.len() - 4
            );
            assert_eq!(decode_request(body(&f)).expect("decode"), r, "{r:?}");
        }
    }

    #[test]
    fn import_carries_key_after_the_header() {
        let key = [7u8; 32];
        let r = Request::ImportKey {
            name: "imp".into(),
            kind: KeyKind::Aes256,
            persistent: false,
            key: &key,
        };
        let mut f = encode_request(&r);
        let n = frame_len(f[..4].try_into().expect("4"), MAX_REQUEST).expect("len");
        assert!(!f.windows(32).any(|w| w == key), "key bytes in the header");
        f.extend_from_slice(&key);
        assert_eq!(n, f.len() - 4);
        assert_eq!(decode_request(body(&f)).expect("decode"), r);
        assert!(!format!("{r:?}").contains("7, 7"));
    }

    #[test]
    fn import_with_wrong_key_length_is_refused() {
        let key = [7u8; 16];
        let mut f = encode_request(&Request::ImportKey {
            name: "imp".into(),
            kind: KeyKind::Aes256,
            persistent: false,
            key: &key,
        });
        f.extend_from_slice(&key);
        assert!(matches!(
            decode_request(body(&f)),
            Err(DecodeError::BadValue {
                field: "key length",
                ..
            })
        ));
    }

    #[test]
    fn malformed_inputs_are_errors() {
        assert_eq!(decode_request(&[]), Err(DecodeError::Empty));
        assert_eq!(decode_request(&[0xEE]), Err(DecodeError::UnknownTag(0xEE)));
        assert!(matches!(
            decode_request(&[tag::HELLO]),
            Err(DecodeError::Truncated { .. })
        ));
        assert_eq!(
            decode_request(&[tag::STATUS, 0]),
            Err(DecodeError::Trailing(1))
        );
        let mut bad_name = vec![tag::INFO, 3, 0];
        bad_name.extend_from_slice(b"a/b");
        assert_eq!(decode_request(&bad_name), Err(DecodeError::BadName));
        assert!(frame_len((u32::MAX).to_le_bytes(), MAX_REQUEST).is_err());
        assert!(frame_len(0u32.to_le_bytes(), MAX_REQUEST).is_err());
    }

    #[test]
    fn replies_round_trip() {
        let k = KeyInfo {
            id: 3,
            name: "k".into(),
            kind: KeyKind::Xts256,
            owner: 1000,
            versions: 2,
            persistent: false,
            acl: vec![(1001, perm::DECRYPT)],
        };
        for rep in [
            Reply::Welcome {
                version: 1,
                level: "secret".into(),
                uid: 0,
                pid: -1,
                vault_pid: 77,
            },
            Reply::Status(Status {
                version: 1,
                level: "locked".into(),
                backend: "b".into(),
                keys: 2,
                clients: 1,
                durable: true,
                uptime_s: 9,
                pid: 4,
            }),
            Reply::Key(k.clone()),
            Reply::Keys(vec![k.clone(), k]),
            Reply::Done,
            Reply::Id(5),
            Reply::Error {
                code: ErrorCode::Quota,
                message: "too many".into(),
            },
        ] {
            let f = encode_reply(&rep);
            assert_eq!(decode_reply(body(&f)).expect("decode"), rep);
        }
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode_request(&bytes);
            let _ = decode_reply(&bytes);
        }

        #[test]
        fn truncations_of_valid_frames_are_errors(i in 0usize..16, cut in 0usize..64) {
            let reqs = sample_requests();
            let f = encode_request(&reqs[i % reqs.len()]);
            let b = body(&f);
            if cut < b.len() {
                prop_assert!(decode_request(&b[..cut]).is_err());
            }
        }

        #[test]
        fn program_requests_round_trip(
            keyid: u16,
            command: u8,
            enc_alg: u16,
            f1 in proptest::collection::vec(any::<u8>(), 0..=MAX_KEY_FIELD),
            f2 in proptest::collection::vec(any::<u8>(), 0..=MAX_KEY_FIELD),
        ) {
            let f = program_frame(keyid, command, enc_alg, &f1, &f2);
            let want = Request::ProgramKeyId(KeyProgram { keyid, command, enc_alg, key_field_1: &f1, key_field_2: &f2 });
            prop_assert_eq!(decode_request(body(&f)).expect("decode"), want);
            for cut in 0..f.len() - 4 {
                prop_assert!(decode_request(&body(&f)[..cut]).is_err());
            }
        }

        #[test]
        fn keyid_tables_survive_any_corruption_without_panic(at in 0usize..200, v: u8) {
            for rep in [
                Reply::KeyIds(KeyIdTable {
                    max_keyid: 5,
                    level: "secret".into(),
                    entries: states(),
                }),
                Reply::KeyIdTenants(vec![0, 1, 2, 3, 0, 7]),
            ] {
                let f = encode_reply(&rep);
                let mut b = body(&f).to_vec();
                let i = at % b.len();
                b[i] = v;
                let _ = decode_reply(&b);
                let _ = decode_reply(&b[..i]);
            }
        }

        #[test]
        fn names_round_trip(name in "[A-Za-z0-9._-]{1,64}", uid: u32, perms in 1u8..8) {
            let r = Request::Grant { name, uid, perms };
            let f = encode_request(&r);
            prop_assert_eq!(decode_request(body(&f)).expect("decode"), r);
        }
    }
}
