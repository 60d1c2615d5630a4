//! The client library: control verbs over the Unix socket, and data
//! requests through shared-memory lanes.
//!
//! ```no_run
//! use memveil_vault::{Client, proto::{KeyKind, Mode}, client::Crypt};
//! let mut c = Client::connect("/run/memveil/vault.sock")?;
//! println!("protection level: {}", c.level());
//! let k = c.create_key("disk0", KeyKind::Aes256, false)?;
//! let mut data = b"sixteen byte msg".to_vec();
//! c.encrypt(&Crypt::new(k.id, Mode::Cbc).iv(&[0; 16]), &mut data)?;
//! # Ok::<(), memveil_vault::client::ClientError>(())
//! ```
//!
//! For zero-copy use, [`Client::session`] maps a shared area with one lane
//! per thread; callers place data in the area and submit batches of
//! [`Entry`]s on a [`LaneClient`].
#![forbid(unsafe_code)]

use std::io::{self, IoSlice, Read as _, Write as _};
use std::os::fd::AsFd as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memveil_sys::ipc::{self, Control, SharedMap, ShmError};

use memveil_engine::{KeyIdState, KeyProgram, Status as PconfigStatus};

use crate::proto::{
    self, DecodeError, ErrorCode, KeyIdTable, KeyInfo, KeyKind, Mode, PublicParts, Reply, Request,
    Status,
};
use crate::ring::{self, status, Entry, Op, ENTRY_BYTES, LANE_BYTES};

/// Client errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The socket could not be reached.
    #[error("cannot connect to the vault at {path}: {source} (is `memveil vault serve --vault {path}` running, and may this user open the socket?)")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
    /// The connection failed mid-way.
    #[error("vault connection lost: {0} (the vault stopped or restarted; reconnect)")]
    Io(#[from] io::Error),
    /// The vault's reply did not decode.
    #[error("bad reply from the vault: {0}")]
    Protocol(#[from] DecodeError),
    /// The vault refused.
    #[error("vault refused ({code:?}): {message}")]
    Refused {
        /// Class.
        code: ErrorCode,
        /// The vault's words.
        message: String,
    },
    /// The vault process is gone while a data request was in flight.
    #[error(
        "the vault (pid {0}) is gone while a request was in flight; reconnect once it is back"
    )]
    VaultGone(u32),
    /// A data request failed.
    #[error("request {index} failed: {}", status::describe(*code))]
    Request {
        /// Index in the batch.
        index: usize,
        /// Status code from the vault.
        code: u32,
    },
    /// Something the client library refuses before asking.
    #[error("{0}")]
    Usage(String),
}

/// A connection to the vault.
pub struct Client {
    sock: UnixStream,
    level: String,
    uid: u32,
    pid: i32,
    vault_pid: u32,
    scratch: Option<(Session, LaneClient)>,
}

/// Parameters of one encryption or decryption.
#[derive(Debug, Clone, Copy)]
pub struct Crypt<'a> {
    /// Key id.
    pub key: u32,
    /// Key version (0 = newest).
    pub version: u32,
    /// Mode.
    pub mode: Mode,
    /// IV / counter block / tweak; GCM nonce in the first 12 bytes.
    pub iv: [u8; 16],
    /// GCM associated data.
    pub aad: &'a [u8],
    /// GCM tag (decrypt).
    pub tag: [u8; 16],
    /// XTS data-unit size (0 = the data is one unit).
    pub unit: u32,
    /// XTS sequence-number step per unit.
    pub step: u32,
}

impl<'a> Crypt<'a> {
    /// Newest version of `key`, zero IV, no AAD.
    #[must_use]
    pub fn new(key: u32, mode: Mode) -> Self {
        Self {
            key,
            version: 0,
            mode,
            iv: [0; 16],
            aad: &[],
            tag: [0; 16],
            unit: 0,
            step: 0,
        }
    }
    /// Sets the IV (up to 16 bytes, zero-padded; GCM takes 12).
    #[must_use]
    pub fn iv(mut self, iv: &[u8]) -> Self {
        let n = iv.len().min(16);
        self.iv = [0; 16];
        self.iv[..n].copy_from_slice(&iv[..n]);
        self
    }
    /// Sets the GCM associated data.
    #[must_use]
    pub fn aad(mut self, aad: &'a [u8]) -> Self {
        self.aad = aad;
        self
    }
    /// Sets the GCM tag to verify (up to 16 bytes).
    #[must_use]
    pub fn tag(mut self, tag: &[u8]) -> Self {
        let n = tag.len().min(16);
        self.tag = [0; 16];
        self.tag[..n].copy_from_slice(&tag[..n]);
        self
    }
    /// Sets the key version.
    #[must_use]
    pub fn version(mut self, v: u32) -> Self {
        self.version = v;
        self
    }
    /// XTS only: the data is units of `unit` bytes, unit i under sequence
    /// number IV + i·`step` (`memveil_vault::ring`, module doc).
    #[must_use]
    pub fn units(mut self, unit: u32, step: u32) -> Self {
        self.unit = unit;
        self.step = step;
        self
    }
}

pub(crate) fn write_all_vectored(
    s: &mut UnixStream,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    while !bufs.is_empty() {
        let n = s.write_vectored(bufs)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

impl Client {
    /// Connects and says hello.
    ///
    /// # Errors
    /// [`ClientError::Connect`] when the socket cannot be reached, or the
    /// vault's refusal.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client, ClientError> {
        Self::connect_with(path.as_ref(), None)
    }

    /// Connects with `timeout` on every read and write of the control
    /// socket (the hello included), for callers that must not hang on a
    /// vault that accepts but does not answer (the probe's exporter).
    ///
    /// # Errors
    /// As [`Client::connect`]; a vault that does not answer in time is an
    /// I/O error (`WouldBlock`/`TimedOut`).
    pub fn connect_timeout(
        path: impl AsRef<Path>,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        Self::connect_with(path.as_ref(), Some(timeout))
    }

    fn connect_with(path: &Path, timeout: Option<Duration>) -> Result<Client, ClientError> {
        let sock = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.to_owned(),
            source,
        })?;
        if timeout.is_some() {
            sock.set_read_timeout(timeout)?;
            sock.set_write_timeout(timeout)?;
        }
        let mut c = Client {
            sock,
            level: String::new(),
            uid: 0,
            pid: 0,
            vault_pid: 0,
            scratch: None,
        };
        match c.call(&Request::Hello {
            version: proto::VERSION,
        })? {
            Reply::Welcome {
                level,
                uid,
                pid,
                vault_pid,
                ..
            } => {
                c.level = level;
                c.uid = uid;
                c.pid = pid;
                c.vault_pid = vault_pid;
                Ok(c)
            }
            other => Err(unexpected(&other)),
        }
    }

    /// The vault's protection level ("secret" or "locked").
    #[must_use]
    pub fn level(&self) -> &str {
        &self.level
    }

    /// The vault's process id.
    #[must_use]
    pub fn vault_pid(&self) -> u32 {
        self.vault_pid
    }

    /// Our uid as the vault sees it (`SO_PEERCRED`).
    #[must_use]
    pub fn uid(&self) -> u32 {
        self.uid
    }

    fn read_reply(&mut self) -> Result<Reply, ClientError> {
        match read_frame(&mut self.sock)? {
            Reply::Error { code, message } => Err(ClientError::Refused { code, message }),
            r => Ok(r),
        }
    }

    fn call(&mut self, req: &Request<'_>) -> Result<Reply, ClientError> {
        let frame = proto::encode_request(req);
        let sent = match req {
            Request::ImportKey { key, .. } => {
                // The key goes from the caller's buffer straight to the socket.
                write_all_vectored(
                    &mut self.sock,
                    &mut [IoSlice::new(&frame), IoSlice::new(key)],
                )
            }
            Request::ProgramKeyId(p) => write_all_vectored(
                &mut self.sock,
                &mut [
                    IoSlice::new(&frame),
                    IoSlice::new(p.key_field_1),
                    IoSlice::new(p.key_field_2),
                ],
            ),
            _ => self.sock.write_all(&frame),
        };
        if let Err(e) = sent {
            // A vault that refuses a connection (a per-uid limit) answers
            // and closes at once; its reason is still there to read.
            return match self.read_reply() {
                Err(r @ ClientError::Refused { .. }) => Err(r),
                _ => Err(e.into()),
            };
        }
        self.read_reply()
    }

    /// Sends raw bytes and reads one reply (for tests of malformed input).
    ///
    /// # Errors
    /// As the vault answers.
    pub fn call_raw(&mut self, bytes: &[u8]) -> Result<Reply, ClientError> {
        self.sock.write_all(bytes)?;
        self.read_reply()
    }

    /// Vault status.
    ///
    /// # Errors
    /// Connection errors.
    pub fn status(&mut self) -> Result<Status, ClientError> {
        match self.call(&Request::Status)? {
            Reply::Status(s) => Ok(s),
            o => Err(unexpected(&o)),
        }
    }

    fn key_reply(&mut self, req: &Request<'_>) -> Result<KeyInfo, ClientError> {
        match self.call(req)? {
            Reply::Key(k) => Ok(k),
            o => Err(unexpected(&o)),
        }
    }

    /// Generates a key inside the vault.
    ///
    /// # Errors
    /// The vault's refusal (name taken, quota, no keystore for a persistent key).
    pub fn create_key(
        &mut self,
        name: &str,
        kind: KeyKind,
        persistent: bool,
    ) -> Result<KeyInfo, ClientError> {
        check_name(name)?;
        self.key_reply(&Request::CreateKey {
            name: name.into(),
            kind,
            persistent,
        })
    }

    /// Generates a generic secret of `len` bytes inside the vault.
    ///
    /// # Errors
    /// A length outside [`proto::MIN_SECRET`]..=[`proto::MAX_SECRET`], or
    /// the vault's refusal (name taken, quota, no keystore for a persistent key).
    pub fn create_secret(
        &mut self,
        name: &str,
        len: usize,
        persistent: bool,
    ) -> Result<KeyInfo, ClientError> {
        check_name(name)?;
        let n = u16::try_from(len)
            .ok()
            .filter(|n| KeyKind::Secret.import_len_ok(usize::from(*n)))
            .ok_or_else(|| {
                ClientError::Usage(format!(
                    "a generic secret is {} to {} bytes, not {len}",
                    proto::MIN_SECRET,
                    proto::MAX_SECRET
                ))
            })?;
        self.key_reply(&Request::CreateSecret {
            name: name.into(),
            len: n,
            persistent,
        })
    }

    /// Imports a key. One way: nothing ever returns it.
    ///
    /// # Errors
    /// A wrong key length, or the vault's refusal.
    pub fn import_key(
        &mut self,
        name: &str,
        kind: KeyKind,
        persistent: bool,
        key: &[u8],
    ) -> Result<KeyInfo, ClientError> {
        check_name(name)?;
        if !kind.import_len_ok(key.len()) {
            return Err(ClientError::Usage(if kind.is_symmetric() {
                format!(
                    "a {kind} key is {} bytes, got {}",
                    kind.key_len(),
                    key.len()
                )
            } else {
                format!(
                    "{} bytes cannot be a {kind} import (private components up to {} bytes, a certificate up to {}, a generic secret {} to {})",
                    key.len(),
                    memveil_asym::components::MAX_LEN,
                    proto::MAX_CERT,
                    proto::MIN_SECRET,
                    proto::MAX_SECRET
                )
            }));
        }
        self.key_reply(&Request::ImportKey {
            name: name.into(),
            kind,
            persistent,
            key,
        })
    }

    /// The public half of an asymmetric key, or a certificate.
    ///
    /// # Errors
    /// [`ErrorCode::NotFound`], or [`ErrorCode::Invalid`] for a symmetric key.
    pub fn public_key(&mut self, name: &str) -> Result<PublicParts, ClientError> {
        check_name(name)?;
        match self.call(&Request::PublicKey { name: name.into() })? {
            Reply::Public(p) => Ok(p),
            o => Err(unexpected(&o)),
        }
    }

    /// ECDH between the vault's EC key `base` and `peer`, into a new AES key
    /// `name` (`kdf` as [`Request::DeriveKey`] says). The shared secret
    /// never leaves the vault.
    ///
    /// # Errors
    /// The vault's refusal (no such key, not EC, no `d` permission, a point
    /// off the curve, name taken).
    #[allow(clippy::too_many_arguments)]
    pub fn derive_key(
        &mut self,
        name: &str,
        kind: KeyKind,
        persistent: bool,
        base: &str,
        kdf: u8,
        peer: &[u8],
        shared: &[u8],
    ) -> Result<KeyInfo, ClientError> {
        check_name(name)?;
        check_name(base)?;
        self.key_reply(&Request::DeriveKey {
            name: name.into(),
            kind,
            persistent,
            base: base.into(),
            kdf,
            peer,
            shared,
        })
    }

    /// One asymmetric operation (sign with `Op::Encrypt`, decrypt with
    /// `Op::Decrypt`) through the client's scratch session; returns the
    /// result.
    ///
    /// # Errors
    /// The vault's per-request status or a lost vault.
    pub fn private_op(
        &mut self,
        op: Op,
        key: u32,
        mode: Mode,
        params: ring::AsymParams,
        input: &[u8],
    ) -> Result<Vec<u8>, ClientError> {
        let out_at = input.len().div_ceil(64) * 64;
        let out_len = 512usize;
        let (s, lane) = self.scratch(out_at + out_len)?;
        s.write(0, input)?;
        let e = Entry::asym(
            op,
            mode,
            key,
            s.buffer,
            (0, input.len() as u64),
            (out_at as u64, out_len as u64),
            params,
        );
        let o = lane.run(&[e])?[0];
        if o.status != status::OK {
            return Err(ClientError::Request {
                index: 0,
                code: o.status,
            });
        }
        let n = usize::try_from(o.out_len)
            .unwrap_or(usize::MAX)
            .min(out_len);
        let mut out = vec![0u8; n];
        s.read(out_at, &mut out)?;
        Ok(out)
    }

    /// Keys this uid owns or is granted.
    ///
    /// # Errors
    /// Connection errors.
    pub fn list_keys(&mut self) -> Result<Vec<KeyInfo>, ClientError> {
        match self.call(&Request::ListKeys)? {
            Reply::Keys(k) => Ok(k),
            o => Err(unexpected(&o)),
        }
    }

    /// One key's public facts.
    ///
    /// # Errors
    /// [`ErrorCode::NotFound`].
    pub fn key_info(&mut self, name: &str) -> Result<KeyInfo, ClientError> {
        check_name(name)?;
        self.key_reply(&Request::KeyInfo { name: name.into() })
    }

    /// Adds a new random version.
    ///
    /// # Errors
    /// The vault's refusal.
    pub fn rotate_key(&mut self, name: &str) -> Result<KeyInfo, ClientError> {
        check_name(name)?;
        self.key_reply(&Request::RotateKey { name: name.into() })
    }

    /// Wipes a key and all its versions.
    ///
    /// # Errors
    /// The vault's refusal.
    pub fn destroy_key(&mut self, name: &str) -> Result<(), ClientError> {
        check_name(name)?;
        self.call(&Request::DestroyKey { name: name.into() })
            .map(|_| ())
    }

    /// Grants `perms` ([`proto::perm`] bits) on a key to `uid`.
    ///
    /// # Errors
    /// The vault's refusal.
    pub fn grant(&mut self, name: &str, uid: u32, perms: u8) -> Result<KeyInfo, ClientError> {
        check_name(name)?;
        self.key_reply(&Request::Grant {
            name: name.into(),
            uid,
            perms,
        })
    }

    /// Removes `uid` from a key's ACL.
    ///
    /// # Errors
    /// The vault's refusal.
    pub fn revoke(&mut self, name: &str, uid: u32) -> Result<KeyInfo, ClientError> {
        check_name(name)?;
        self.key_reply(&Request::Revoke {
            name: name.into(),
            uid,
        })
    }

    /// Sends one PCONFIG `MKTME_KEY_PROGRAM` request (any command, clear
    /// included) to the vault's host key table. Key fields go from `req`
    /// straight to the socket. A request the engine refuses is not an
    /// error here: the answer carries its PCONFIG status.
    ///
    /// # Errors
    /// A key field over [`proto::MAX_KEY_FIELD`] bytes; the vault's refusal
    /// ([`ErrorCode::Denied`] for a uid that may not program KeyIDs); a
    /// vault that predates the table.
    pub fn program_keyid(&mut self, req: &KeyProgram<'_>) -> Result<Programmed, ClientError> {
        for (i, f) in [req.key_field_1, req.key_field_2].iter().enumerate() {
            if f.len() > proto::MAX_KEY_FIELD {
                return Err(ClientError::Usage(format!(
                    "key field {} is {} bytes; PCONFIG's key fields hold at most {}",
                    i + 1,
                    f.len(),
                    proto::MAX_KEY_FIELD
                )));
            }
        }
        let r = self.call(&Request::ProgramKeyId(*req));
        match predates_key_table(r)? {
            Reply::Programmed {
                status,
                message,
                state,
            } => Ok(Programmed {
                status,
                message,
                state,
            }),
            o => Err(unexpected(&o)),
        }
    }

    /// The host key table: every KeyID's mode, algorithm, generation and
    /// last programmer (never key bytes). Open to every uid.
    ///
    /// # Errors
    /// Connection errors; a vault that predates the table.
    pub fn keyid_status(&mut self) -> Result<KeyIdTable, ClientError> {
        match predates_key_table(self.call(&Request::KeyIdStatus))? {
            Reply::KeyIds(t) => Ok(t),
            o => Err(unexpected(&o)),
        }
    }

    /// How many tenants (`memveil run --keyid` processes' connections) run
    /// under each KeyID, indexed by KeyID; `None` from a vault that predates
    /// the question (it refuses the request as an unknown tag). Open to
    /// every uid.
    ///
    /// # Errors
    /// Connection errors.
    pub fn keyid_tenants(&mut self) -> Result<Option<Vec<u32>>, ClientError> {
        match self.call(&Request::KeyIdTenants) {
            Ok(Reply::KeyIdTenants(n)) => Ok(Some(n)),
            Err(ClientError::Refused {
                code: ErrorCode::Malformed,
                message,
            }) if message.starts_with("unknown message tag") => Ok(None),
            Ok(o) => Err(unexpected(&o)),
            Err(e) => Err(e),
        }
    }

    fn id_reply(&mut self, req: &Request<'_>) -> Result<u32, ClientError> {
        match self.call(req)? {
            Reply::Id(i) => Ok(i),
            o => Err(unexpected(&o)),
        }
    }

    /// Creates a shared area with `lanes` lanes and `data_bytes` of data
    /// (registered as one buffer), and starts the lanes.
    ///
    /// # Errors
    /// memfd errors or the vault's refusal (quotas).
    pub fn session(
        &mut self,
        data_bytes: usize,
        lanes: usize,
    ) -> Result<(Session, Vec<LaneClient>), ClientError> {
        if lanes == 0 {
            return Err(ClientError::Usage(
                "a session needs at least one lane".into(),
            ));
        }
        let data_bytes = data_bytes.max(1).div_ceil(LANE_BYTES) * LANE_BYTES;
        let data_off = lanes * LANE_BYTES;
        let total = data_off + data_bytes;
        let fd = ipc::memfd_sealed("memveil-vault-client", total as u64)?;
        let map = Arc::new(SharedMap::map(fd.as_fd(), total)?);
        let frame = proto::encode_request(&Request::RegisterShm { len: total as u64 });
        ipc::send_with_fd(&self.sock, &[IoSlice::new(&frame)], fd.as_fd())?;
        let shm = match self.read_reply()? {
            Reply::Id(i) => i,
            o => return Err(unexpected(&o)),
        };
        let buffer = self.id_reply(&Request::RegisterBuffer {
            shm,
            offset: data_off as u64,
            len: data_bytes as u64,
        })?;
        let mut ls = Vec::new();
        for i in 0..lanes {
            let id = self.id_reply(&Request::OpenLane {
                shm,
                offset: (i * LANE_BYTES) as u64,
            })?;
            ls.push(LaneClient {
                lane: map.control(i * LANE_BYTES, LANE_BYTES).map_err(shm_err)?,
                id,
                buffer,
                seq: 0,
                vault_pid: self.vault_pid,
                spin: Duration::from_micros(50),
            });
        }
        Ok((
            Session {
                map,
                data_off,
                data_len: data_bytes,
                buffer,
            },
            ls,
        ))
    }

    fn scratch(&mut self, need: usize) -> Result<&mut (Session, LaneClient), ClientError> {
        // `None` before the first request: an empty first request (GCM of
        // no bytes, CMAC of the empty message) still needs a session.
        let have = self.scratch.as_ref().map(|(s, _)| s.data_len);
        if have.is_none_or(|h| h < need) {
            let size = need.max(1 << 20).next_power_of_two();
            let (s, mut l) = self.session(size, 1)?;
            let lane = l.remove(0);
            self.scratch = Some((s, lane));
        }
        self.scratch
            .as_mut()
            .ok_or_else(|| ClientError::Usage("no session".into()))
    }

    fn crypt(&mut self, op: Op, p: &Crypt<'_>, data: &mut [u8]) -> Result<[u8; 16], ClientError> {
        let aad_at = data.len().div_ceil(64) * 64;
        let (s, lane) = self.scratch(aad_at + p.aad.len())?;
        s.write(0, data)?;
        s.write(aad_at, p.aad)?;
        let e = Entry {
            op,
            mode: p.mode,
            key: p.key,
            version: p.version,
            buffer: s.buffer,
            offset: 0,
            len: data.len() as u64,
            iv: p.iv,
            tag: p.tag,
            aad_offset: aad_at as u64,
            aad_len: p.aad.len() as u64,
            unit: p.unit,
            step: p.step,
        };
        let out = lane.run(&[e])?;
        let o = out[0];
        if o.status != status::OK {
            return Err(ClientError::Request {
                index: 0,
                code: o.status,
            });
        }
        s.read(0, data)?;
        Ok(o.tag)
    }

    /// Encrypts `data` in place (copied through the client's scratch
    /// session); returns the GCM tag (zeros for other modes).
    ///
    /// # Errors
    /// The vault's per-request status (denied, bad length…) or a lost vault.
    pub fn encrypt(&mut self, p: &Crypt<'_>, data: &mut [u8]) -> Result<[u8; 16], ClientError> {
        self.crypt(Op::Encrypt, p, data)
    }

    /// Decrypts `data` in place; for GCM verifies `p.tag`.
    ///
    /// # Errors
    /// As [`Client::encrypt`]; GCM authentication failure.
    pub fn decrypt(&mut self, p: &Crypt<'_>, data: &mut [u8]) -> Result<(), ClientError> {
        self.crypt(Op::Decrypt, p, data).map(|_| ())
    }
}

fn check_name(name: &str) -> Result<(), ClientError> {
    if proto::valid_name(name) {
        Ok(())
    } else {
        Err(ClientError::Usage(format!(
            "bad key name {name:?}: 1–64 characters from [A-Za-z0-9._-]"
        )))
    }
}

fn shm_err(e: ShmError) -> ClientError {
    ClientError::Usage(e.to_string())
}

/// The vault's answer to a KeyID programming request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Programmed {
    /// PCONFIG's status.
    pub status: PconfigStatus,
    /// What it means for this request (the engine's words).
    pub message: String,
    /// The KeyID's new state, on success.
    pub state: Option<KeyIdState>,
}

/// A tenant of the host key table (`memveil run --keyid`): its KeyID's page
/// key and the connection the vault's stop notice comes on.
pub struct Tenant {
    sock: UnixStream,
    state: KeyIdState,
    key: memveil_secmem::SecretBox<[u8]>,
}

/// Why a tenant must stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantStop {
    /// The KeyID was cleared or programmed again: the vault's words.
    KeyGone {
        /// The KeyID's generation now.
        generation: u64,
        /// Who did what.
        message: String,
    },
    /// The vault closed the connection (it exited or restarted): the table
    /// that governed the KeyID is gone, and nobody could clear it any more.
    VaultGone(String),
}

impl Tenant {
    /// The KeyID's state when its key was handed out.
    #[must_use]
    pub fn state(&self) -> KeyIdState {
        self.state
    }

    /// The page key: data key then tweak key (32 bytes for AES-XTS-128, 64
    /// for AES-XTS-256); empty for a no-encrypt KeyID.
    #[must_use]
    pub fn key(&self) -> &[u8] {
        let n = self.state.mode.algorithm().map_or(0, |a| 2 * a.key_len());
        match self.state.mode {
            memveil_engine::KeyIdMode::NoEncrypt => &[],
            _ => &self.key[..n],
        }
    }

    /// Wipes this process's copy of the page key (once it is handed on);
    /// [`Tenant::key`] is zeros from then on.
    pub fn wipe_key(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.key[..]);
    }

    /// Waits for the vault's stop notice (or its end).
    #[must_use]
    pub fn wait_stop(&mut self) -> TenantStop {
        match read_frame(&mut self.sock) {
            Ok(Reply::TenantStop {
                generation,
                message,
                ..
            }) => TenantStop::KeyGone {
                generation,
                message,
            },
            Ok(o) => TenantStop::VaultGone(format!("unexpected message from the vault: {o:?}")),
            Err(e) => TenantStop::VaultGone(e.to_string()),
        }
    }
}

impl Client {
    /// The page key of KeyID `keyid` for a tenant (`memveil run --keyid`),
    /// read into `pool`; the connection becomes the tenant's (see
    /// [`Tenant::wait_stop`]). Only a uid that may program KeyIDs gets one.
    ///
    /// # Errors
    /// The vault's refusal ([`ErrorCode::Denied`], [`ErrorCode::NotFound`]
    /// for a KeyID with no key), connection errors, secret memory errors.
    pub fn tenant_key(
        mut self,
        keyid: u16,
        pool: &memveil_secmem::SecretPool,
    ) -> Result<Tenant, ClientError> {
        let mut key = pool
            .alloc_bytes(proto::TENANT_KEY_LEN)
            .map_err(|e| ClientError::Usage(format!("secret memory for the page key: {e}")))?;
        self.sock
            .write_all(&proto::encode_request(&Request::TenantKey { keyid }))?;
        let mut h = [0u8; 4];
        self.sock.read_exact(&mut h)?;
        let n = proto::frame_len(h, proto::MAX_REPLY)?;
        let mut t = [0u8; 1];
        self.sock.read_exact(&mut t)?;
        if t[0] != proto::tag::R_TENANT_KEY || n < 1 + proto::TENANT_KEY_LEN {
            let mut b = vec![0u8; n.saturating_sub(1)];
            self.sock.read_exact(&mut b)?;
            b.insert(0, t[0]);
            let e = match proto::decode_reply(&b) {
                Ok(Reply::Error { code, message }) => ClientError::Refused { code, message },
                Ok(o) => unexpected(&o),
                Err(e) => e.into(),
            };
            return Err(predates_key_table(Err(e)).expect_err("an error stays an error"));
        }
        let mut head = vec![0u8; n - proto::TENANT_KEY_LEN];
        head[0] = t[0];
        self.sock.read_exact(&mut head[1..])?;
        let state = proto::decode_tenant_key_head(&head)?;
        self.sock.read_exact(&mut key)?;
        Ok(Tenant {
            sock: self.sock,
            state,
            key,
        })
    }
}

/// Reads one reply frame and decodes it (an `Error` reply stays a reply).
fn read_frame(sock: &mut UnixStream) -> Result<Reply, ClientError> {
    let mut h = [0u8; 4];
    sock.read_exact(&mut h)?;
    let n = proto::frame_len(h, proto::MAX_REPLY)?;
    let mut b = vec![0u8; n];
    sock.read_exact(&mut b)?;
    Ok(proto::decode_reply(&b)?)
}

/// A vault built before the host key table answers its requests as an
/// unknown tag; say that instead.
fn predates_key_table(r: Result<Reply, ClientError>) -> Result<Reply, ClientError> {
    match r {
        Err(ClientError::Refused {
            code: ErrorCode::Malformed,
            message,
        }) if message.starts_with("unknown message tag") => Err(ClientError::Usage(format!(
            "this vault has no host key table (it answered: {message}); upgrade and restart it"
        ))),
        r => r,
    }
}

fn unexpected(r: &Reply) -> ClientError {
    ClientError::Usage(format!("unexpected reply from the vault: {r:?}"))
}

/// A shared area: lanes at the front, then the data buffer.
pub struct Session {
    map: Arc<SharedMap>,
    data_off: usize,
    data_len: usize,
    buffer: u32,
}

impl Session {
    /// Bytes of the data buffer.
    #[must_use]
    pub fn len(&self) -> usize {
        self.data_len
    }

    /// Never true.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The registered buffer id (for [`Entry::buffer`]).
    #[must_use]
    pub fn buffer(&self) -> u32 {
        self.buffer
    }

    /// Copies `data` into the buffer at `off`.
    ///
    /// # Errors
    /// Out of range, or the range is in use by another thread of this
    /// process right now (`with_mut` or a `write` on overlapping bytes).
    pub fn write(&self, off: usize, data: &[u8]) -> Result<(), ClientError> {
        self.check(off, data.len())?;
        self.map.write(self.data_off + off, data).map_err(shm_err)
    }

    /// Copies bytes out of the buffer at `off`.
    ///
    /// # Errors
    /// As [`Session::write`].
    pub fn read(&self, off: usize, out: &mut [u8]) -> Result<(), ClientError> {
        self.check(off, out.len())?;
        self.map.read(self.data_off + off, out).map_err(shm_err)
    }

    /// Runs `f` on `[off, off+len)` of the buffer in place. The vault may
    /// be working on these bytes meanwhile (a request in flight): `f` sees
    /// whatever is there.
    ///
    /// # Errors
    /// As [`Session::write`].
    pub fn with_mut<R>(
        &self,
        off: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, ClientError> {
        self.check(off, len)?;
        self.map
            .with_mut(self.data_off + off, len, f)
            .map_err(shm_err)
    }

    fn check(&self, off: usize, len: usize) -> Result<(), ClientError> {
        match off.checked_add(len) {
            Some(e) if e <= self.data_len => Ok(()),
            _ => Err(ClientError::Usage(format!(
                "[{off}, +{len}) is outside the session buffer of {} bytes",
                self.data_len
            ))),
        }
    }
}

/// The result of one entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// [`ring::status`] code.
    pub status: u32,
    /// GCM tag (encrypt).
    pub tag: [u8; 16],
    /// Bytes of an asymmetric entry's result (in its output range).
    pub out_len: u32,
}

/// How long a waiter spins without yielding the CPU.
pub(crate) const PURE_SPIN: Duration = Duration::from_micros(4);

/// One lane, used by one thread at a time.
pub struct LaneClient {
    lane: Control,
    id: u32,
    buffer: u32,
    seq: u32,
    vault_pid: u32,
    spin: Duration,
}

impl LaneClient {
    /// The lane id.
    #[must_use]
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The session buffer this lane's entries refer to by default.
    #[must_use]
    pub fn buffer(&self) -> u32 {
        self.buffer
    }

    /// How long to spin for a completion before sleeping on the futex.
    pub fn set_spin(&mut self, d: Duration) {
        self.spin = d;
    }

    fn word(&self, at: usize) -> Result<&AtomicU32, ClientError> {
        self.lane
            .word(at)
            .ok_or_else(|| ClientError::Usage("lane outside its area".into()))
    }

    /// Submits a batch of up to 31 entries without waiting.
    ///
    /// # Errors
    /// An empty or oversized batch.
    pub fn submit(&mut self, entries: &[Entry]) -> Result<(), ClientError> {
        if entries.is_empty() || entries.len() > ring::MAX_BATCH {
            return Err(ClientError::Usage(format!(
                "a batch holds 1 to {} entries, got {}",
                ring::MAX_BATCH,
                entries.len()
            )));
        }
        for (i, e) in entries.iter().enumerate() {
            let at = ring::OFF_ENTRIES + i * ENTRY_BYTES;
            self.lane.write(at, &e.encode()).map_err(shm_err)?;
        }
        self.lane
            .write(
                ring::OFF_COUNT,
                &u32::try_from(entries.len()).unwrap_or(0).to_le_bytes(),
            )
            .map_err(shm_err)?;
        self.seq = self.seq.wrapping_add(1);
        let submit = self.word(ring::OFF_SUBMIT)?;
        submit.store(self.seq, Ordering::SeqCst);
        if self.word(ring::OFF_VAULT_SLEEPING)?.load(Ordering::SeqCst) != 0 {
            ipc::futex_wake(submit, 1);
        }
        Ok(())
    }

    /// Waits for the submitted batch and returns each entry's outcome.
    ///
    /// # Errors
    /// [`ClientError::VaultGone`] when the vault dies meanwhile.
    pub fn wait(&mut self, n: usize) -> Result<Vec<Outcome>, ClientError> {
        let complete = self.word(ring::OFF_COMPLETE)?;
        let waiting = self.word(ring::OFF_CLIENT_WAITING)?;
        let t0 = Instant::now();
        let mut i = 0u32;
        loop {
            if complete.load(Ordering::Acquire) == self.seq {
                break;
            }
            i = i.wrapping_add(1);
            if !i.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let waited = t0.elapsed();
            if waited < self.spin {
                // After a short pure spin, yield between checks: when the
                // vault's worker shares our CPU (a loaded machine), it runs
                // at once instead of after our time slice.
                if waited > PURE_SPIN {
                    std::thread::yield_now();
                }
                continue;
            }
            let seen = complete.load(Ordering::SeqCst);
            waiting.store(1, Ordering::SeqCst);
            if complete.load(Ordering::SeqCst) == seen && seen != self.seq {
                ipc::futex_wait(complete, seen, Duration::from_millis(100));
            }
            waiting.store(0, Ordering::SeqCst);
            if complete.load(Ordering::Acquire) != self.seq
                && !ipc::pid_alive(i32::try_from(self.vault_pid).unwrap_or(0))
            {
                return Err(ClientError::VaultGone(self.vault_pid));
            }
        }
        let mut out = Vec::with_capacity(n);
        for k in 0..n.min(ring::MAX_BATCH) {
            let at = ring::OFF_ENTRIES + k * ENTRY_BYTES;
            let mut st = [0u8; 4];
            let mut tag = [0u8; 16];
            let mut n = [0u8; 4];
            self.lane
                .read(at + ring::ENTRY_STATUS, &mut st)
                .map_err(shm_err)?;
            self.lane
                .read(at + ring::ENTRY_TAG, &mut tag)
                .map_err(shm_err)?;
            self.lane
                .read(at + ring::ENTRY_OUT_LEN, &mut n)
                .map_err(shm_err)?;
            out.push(Outcome {
                status: u32::from_le_bytes(st),
                tag,
                out_len: u32::from_le_bytes(n),
            });
        }
        Ok(out)
    }

    /// Submits and waits.
    ///
    /// # Errors
    /// As [`LaneClient::submit`] and [`LaneClient::wait`].
    pub fn run(&mut self, entries: &[Entry]) -> Result<Vec<Outcome>, ClientError> {
        self.submit(entries)?;
        self.wait(entries.len())
    }

    /// Writes raw bytes into this lane's page (tests of hostile clients);
    /// `at` and the length must be multiples of 4.
    pub fn poke(&self, at: usize, bytes: &[u8]) -> bool {
        at < LANE_BYTES && self.lane.write(at, bytes).is_ok()
    }

    /// Bumps `submit` without writing entries (tests of hostile clients).
    ///
    /// # Errors
    /// Never in practice.
    pub fn kick(&mut self) -> Result<(), ClientError> {
        self.seq = self.seq.wrapping_add(1);
        let submit = self.word(ring::OFF_SUBMIT)?;
        submit.store(self.seq, Ordering::SeqCst);
        ipc::futex_wake(submit, 1);
        Ok(())
    }
}
