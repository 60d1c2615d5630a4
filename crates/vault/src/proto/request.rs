//! Control requests and their codec.
#![forbid(unsafe_code)]

use std::fmt;

use memveil_engine::KeyProgram;

use super::wire::{tag, R, W};
use super::{perm, DecodeError, KeyKind, MAX_REQUEST};

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
    /// Generate a random generic secret of `len` bytes
    /// ([`KeyKind::Secret`], [`MIN_SECRET`](super::MIN_SECRET) to
    /// [`MAX_SECRET`](super::MAX_SECRET)) inside the vault.
    CreateSecret {
        /// Name.
        name: String,
        /// Bytes of the secret.
        len: u16,
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
    /// [`MAX_KEY_FIELD`](super::MAX_KEY_FIELD) bytes; both travel at the end of the frame,
    /// received straight into the vault's secret memory.
    ProgramKeyId(KeyProgram<'a>),
    /// The host key table: every KeyID's state (never key bytes).
    KeyIdStatus,
    /// The page key of a tenant that runs under a KeyID (`memveil run
    /// --keyid`), derived from the KeyID's key (never the key itself), for
    /// a uid that may program KeyIDs. Answered with [`Reply::TenantKey`](super::Reply::TenantKey);
    /// from then on the connection is the tenant's: it carries no other
    /// request, and the vault sends [`Reply::TenantStop`](super::Reply::TenantStop) on it when the
    /// KeyID is cleared or programmed again, then waits for the tenant to
    /// stop and close it.
    TenantKey {
        /// The KeyID.
        keyid: u16,
    },
    /// How many tenants run under each KeyID (`memveil key status`): a
    /// request of its own, so that a vault that predates it refuses it as
    /// an unknown tag and the table's reply stays what older clients read.
    /// Answered with [`Reply::KeyIdTenants`](super::Reply::KeyIdTenants).
    KeyIdTenants,
    /// The public half of an asymmetric key, or a certificate's bytes.
    PublicKey {
        /// Name.
        name: String,
    },
    /// ECDH with the EC key `base` and a peer's public point, into a new
    /// AES key (the shared secret never leaves the vault). Needs the `d`
    /// permission on `base`.
    DeriveKey {
        /// Name of the new key.
        name: String,
        /// Its kind: `aes128` or `aes256`.
        kind: KeyKind,
        /// Sealed to disk and reloaded at restart.
        persistent: bool,
        /// Name of the EC key.
        base: String,
        /// How the key comes from the shared secret: 0 its leading bytes
        /// (PKCS#11's `CKD_NULL`), else the ANSI X9.63 KDF with the hash
        /// of that code (`memveil_asym::Hash`: 3 = SHA-256).
        kdf: u8,
        /// The peer's public point (uncompressed or compressed).
        peer: &'a [u8],
        /// The KDF's shared info (empty for `CKD_NULL`).
        shared: &'a [u8],
    },
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
            Request::CreateSecret {
                name,
                len,
                persistent,
            } => write!(f, "CreateSecret({name:?}, {len} bytes, persistent={persistent})"),
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
            Request::PublicKey { name } => write!(f, "PublicKey({name:?})"),
            Request::DeriveKey {
                name,
                kind,
                persistent,
                base,
                kdf,
                peer,
                shared,
            } => write!(
                f,
                "DeriveKey({name:?}, {kind}, persistent={persistent}, base={base:?}, kdf={kdf}, peer: <{} bytes>, shared: <{} bytes>)",
                peer.len(),
                shared.len()
            ),
        }
    }
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
        Request::CreateSecret {
            name,
            len,
            persistent,
        } => {
            w.u8(tag::CREATE_SECRET)
                .str(name)
                .u16(*len)
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
        Request::PublicKey { name } => {
            w.u8(tag::PUBKEY).str(name);
        }
        Request::DeriveKey {
            name,
            kind,
            persistent,
            base,
            kdf,
            peer,
            shared,
        } => {
            w.u8(tag::DERIVE)
                .str(name)
                .u8(kind.code())
                .u8(u8::from(*persistent))
                .str(base)
                .u8(*kdf)
                .bytes(peer)
                .bytes(shared);
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
            if !kind.import_len_ok(usize::from(n)) {
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
        tag::CREATE_SECRET => {
            let name = r.name()?;
            let len = r.u16("secret length")?;
            if !KeyKind::Secret.import_len_ok(usize::from(len)) {
                return Err(DecodeError::BadValue {
                    field: "secret length",
                    value: u64::from(len),
                });
            }
            Request::CreateSecret {
                name,
                len,
                persistent: r.bool("persistent")?,
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
        tag::PUBKEY => Request::PublicKey { name: r.name()? },
        tag::DERIVE => Request::DeriveKey {
            name: r.name()?,
            kind: r.kind()?,
            persistent: r.bool("persistent")?,
            base: r.name()?,
            kdf: r.u8("kdf")?,
            peer: r.bytes("peer point")?,
            shared: r.bytes("shared info")?,
        },
        other => return Err(DecodeError::UnknownTag(other)),
    };
    r.end()?;
    Ok(req)
}
