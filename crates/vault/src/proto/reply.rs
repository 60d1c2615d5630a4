//! Control replies, the public facts they carry, and their codec. No reply
//! has a field that could carry key bytes (a tenant's page key travels
//! after its frame, counted by its length but never encoded here).
#![forbid(unsafe_code)]

use memveil_asym::{Curve, Public};
use memveil_engine::{KeyIdState, Status as PconfigStatus};

use super::wire::{put_keyid_state, tag, R, W};
use super::{DecodeError, KeyKind, TENANT_KEY_LEN};

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
    /// Answer to `PublicKey`.
    Public(PublicParts),
    /// Failure.
    Error {
        /// Class.
        code: ErrorCode,
        /// What failed and what to do.
        message: String,
    },
}

/// What `PublicKey` gives out: the public half of an asymmetric key, a
/// certificate's bytes, or a generic secret's length. Never private parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublicParts {
    /// An RSA, EC or Ed25519 public key.
    Key(Public),
    /// A certificate (DER).
    Cert(Vec<u8>),
    /// A generic secret's length in bytes (its only public fact).
    SecretLen(u32),
    /// Public application data (kind `data`).
    Data(Vec<u8>),
}

mod public_code {
    pub const RSA: u8 = 1;
    pub const EC: u8 = 2;
    pub const ED25519: u8 = 3;
    pub const CERT: u8 = 4;
    pub const SECRET_LEN: u8 = 5;
    pub const DATA: u8 = 6;
    pub const P256: u8 = 1;
    pub const P384: u8 = 2;
}

fn put_public(w: &mut W, p: &PublicParts) {
    match p {
        PublicParts::Key(Public::Rsa { n, e }) => {
            w.u8(public_code::RSA).bytes(n).bytes(e);
        }
        PublicParts::Key(Public::Ec { curve, point }) => {
            let c = match curve {
                Curve::P256 => public_code::P256,
                Curve::P384 => public_code::P384,
            };
            w.u8(public_code::EC).u8(c).bytes(point);
        }
        PublicParts::Key(Public::Ed25519(pk)) => {
            w.u8(public_code::ED25519).bytes(pk);
        }
        PublicParts::Cert(der) => {
            w.u8(public_code::CERT).bytes(der);
        }
        PublicParts::SecretLen(n) => {
            w.u8(public_code::SECRET_LEN).u32(*n);
        }
        PublicParts::Data(d) => {
            w.u8(public_code::DATA).bytes(d);
        }
    }
}

fn get_public(r: &mut R<'_>) -> Result<PublicParts, DecodeError> {
    let bad = |field, v: u8| DecodeError::BadValue {
        field,
        value: u64::from(v),
    };
    Ok(match r.u8("public key type")? {
        public_code::RSA => PublicParts::Key(Public::Rsa {
            n: r.bytes("modulus")?.to_vec(),
            e: r.bytes("public exponent")?.to_vec(),
        }),
        public_code::EC => {
            let curve = match r.u8("curve")? {
                public_code::P256 => Curve::P256,
                public_code::P384 => Curve::P384,
                c => return Err(bad("curve", c)),
            };
            PublicParts::Key(Public::Ec {
                curve,
                point: r.bytes("point")?.to_vec(),
            })
        }
        public_code::ED25519 => {
            let pk = r.bytes("Ed25519 public key")?;
            let pk: [u8; 32] = pk.try_into().map_err(|_| DecodeError::BadValue {
                field: "Ed25519 public key length",
                value: pk.len() as u64,
            })?;
            PublicParts::Key(Public::Ed25519(pk))
        }
        public_code::CERT => PublicParts::Cert(r.bytes("certificate")?.to_vec()),
        public_code::SECRET_LEN => PublicParts::SecretLen(r.u32("secret length")?),
        public_code::DATA => PublicParts::Data(r.bytes("data")?.to_vec()),
        t => return Err(bad("public key type", t)),
    })
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
        Reply::Public(p) => {
            w.u8(tag::R_PUBLIC);
            put_public(&mut w, p);
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
        tag::R_PUBLIC => Reply::Public(get_public(&mut r)?),
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
