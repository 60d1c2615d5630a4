//! The daemon: socket, connections, lanes and their workers.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use memveil_engine::{Command, EngineError, KeyProgram, Status as PconfigStatus};
use memveil_secmem::{Level, Policy, SecmemError, SecretPool, SecretRegion};
use memveil_sys::ipc::{self, Control, PeerCred, SharedMap, ShmError};
use memveil_sys::stack_thread::{self, StackThread};

use crate::keys::{KeyEntry, KeyTable, Version};
use crate::keystore::{KdfParams, KekSource, Keystore, KeystoreError, SealKey};
pub use crate::limits::Quotas;
use crate::limits::{Ledger, Resource};
use crate::proto::{self, perm, ErrorCode, KeyKind, Reply, Request};
use crate::ring::{self, status, Buffers, Entry, ENTRY_BYTES};

/// Daemon configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Control socket path.
    pub socket: PathBuf,
    /// State directory (keystore); `None` = no persistent keys.
    pub state: Option<PathBuf>,
    /// Where the keystore KEK comes from.
    pub kek: Option<KekSource>,
    /// Argon2id cost for a new keystore.
    pub kdf: KdfParams,
    /// Weakest protection accepted.
    pub policy: Policy,
    /// Per-uid limits.
    pub quotas: Quotas,
    /// Secret pool for key objects, bytes.
    pub pool_bytes: usize,
    /// Permission bits of the socket file.
    pub socket_mode: u32,
    /// How long a lane worker spins before sleeping.
    pub spin: Duration,
    /// KeyID bits of the host key table: KeyIDs `1..=2^bits-1` (1..=15;
    /// hardware sets it at boot, 6 on Ice Lake servers).
    pub keyid_bits: u32,
    /// Uids besides the vault's own and root that may program and clear
    /// KeyIDs (`--key-admin`).
    pub key_admins: Vec<u32>,
    /// Bytes of the secret heap for aws-lc (asymmetric keys and their
    /// operations' temporaries; `--asym-heap-kib`).
    pub asym_heap_bytes: usize,
}

impl Config {
    /// Defaults for `socket`.
    #[must_use]
    pub fn new(socket: PathBuf) -> Self {
        Self {
            socket,
            state: None,
            kek: None,
            kdf: KdfParams::default(),
            policy: Policy::secret_only(),
            quotas: Quotas::default(),
            pool_bytes: 2 << 20,
            socket_mode: 0o666,
            spin: Duration::from_micros(50),
            keyid_bits: memveil_engine::Config::default().keyid_bits,
            key_admins: Vec::new(),
            asym_heap_bytes: 2 << 20,
        }
    }
}

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VaultError {
    /// Secret memory refused (unavailable or `RLIMIT_MEMLOCK`).
    #[error("secret memory: {0}")]
    Secmem(#[from] SecmemError),
    /// The keystore could not be opened.
    #[error("keystore: {0}")]
    Keystore(#[from] KeystoreError),
    /// Socket trouble.
    #[error("socket {path}: {source}{hint}")]
    Socket {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
        /// A fix.
        hint: &'static str,
    },
    /// Something other than a stale socket is at the socket's path: left
    /// as it is.
    #[error(
        "socket {path}: {what}; refusing to replace it (remove it yourself if nothing needs \
             it, or choose another --vault)"
    )]
    PathTaken {
        /// The path.
        path: PathBuf,
        /// What is there.
        what: ipc::BindError,
    },
    /// A configuration mistake.
    #[error("configuration: {0}")]
    Config(String),
    /// The host key table could not be set up.
    #[error("host key table: {0}")]
    KeyTable(#[from] EngineError),
    /// Hardening the process failed.
    #[error("{what}: {source}")]
    Harden {
        /// What.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
}

/// A thread stack in secret memory.
struct SecretStack(SecretRegion);

impl AsMut<[u8]> for SecretStack {
    fn as_mut(&mut self) -> &mut [u8] {
        self.0.bytes()
    }
}

const CONN_STACK: usize = 256 * 1024;
const LANE_STACK: usize = 128 * 1024;
/// The name of every lane worker thread (`/proc/PID/task/TID/comm`).
pub const LANE_THREAD_NAME: &str = "vault-lane";

pub(crate) struct Shared {
    cfg: Config,
    pub(crate) pool: SecretPool,
    level: Level,
    /// What each uid holds (lock order: `keys` before `ledger`).
    ledger: Ledger,
    pub(crate) keys: RwLock<KeyTable>,
    keystore: Option<Keystore>,
    /// The host's TME-MK key table (docs/vault.md, "Host key table").
    keyids: memveil_engine::KeyTable,
    /// The uid the vault runs as: it, root and `cfg.key_admins` may program KeyIDs.
    owner: u32,
    /// Processes running under host KeyIDs (`memveil run --keyid`).
    tenants: crate::tenants::Tenants,
    clients: AtomicU32,
    started: Instant,
}

impl Shared {
    fn may_program_keyids(&self, uid: u32) -> bool {
        uid == 0 || uid == self.owner || self.cfg.key_admins.contains(&uid)
    }
}

fn spawn_secret(
    shared: &Shared,
    bytes: usize,
    f: impl FnOnce() + Send + 'static,
) -> io::Result<StackThread<SecretStack>> {
    let region = SecretRegion::new(bytes, shared.cfg.policy).map_err(io::Error::other)?;
    stack_thread::spawn(Box::new(SecretStack(region)), f)
}

fn log(msg: std::fmt::Arguments<'_>) {
    let _ = writeln!(io::stderr().lock(), "memveil-vault: {msg}");
}

/// The secret heap's use, as a log or reply suffix.
fn heap_note() -> String {
    memveil_asym::heap_stats()
        .map(|h| {
            format!(
                " (secret heap: {} of {} KiB in use, {} allocations refused: --asym-heap-kib)",
                h.in_use / 1024,
                h.size / 1024,
                h.failures
            )
        })
        .unwrap_or_default()
}

/// Allocations the secret heap has refused so far.
fn heap_failures() -> usize {
    memveil_asym::heap_stats().map_or(0, |h| h.failures)
}

/// Logs an asymmetric operation that failed inside aws-lc (the lane's
/// client sees `status::FAILED`).
pub(crate) fn log_failure(e: &memveil_asym::AsymError) {
    log(format_args!(
        "asymmetric operation failed: {e}{}",
        heap_note()
    ));
}

/// The reply to a key that could not be built: a full secret heap (it
/// refused an allocation since `failures_before`) is a quota the operator
/// can raise, anything else the request's fault or the pool's.
fn build_failed(e: &crate::keys::MaterialError, failures_before: usize) -> Reply {
    if heap_failures() > failures_before {
        err(
            ErrorCode::Quota,
            format!(
                "the vault's secret heap for asymmetric keys is full: {e}{}",
                heap_note()
            ),
        )
    } else {
        err(ErrorCode::Invalid, pool_hint(e.to_string()))
    }
}

fn audit(cred: &PeerCred, op: &str, key: &str, result: &str) {
    log(format_args!(
        "audit op={op} key={key} uid={} pid={} result={result}",
        cred.uid, cred.pid
    ));
}

/// A bound, ready daemon.
pub struct Server {
    shared: Arc<Shared>,
    listener: UnixListener,
    /// The socket path's lock, held while the vault listens there.
    _socket_lock: memveil_sys::ipc::PathLock,
}

impl Server {
    /// Hardens the process, allocates secret memory, opens the keystore and
    /// binds the socket. Key loading runs on a secret-memory stack.
    ///
    /// # Errors
    /// [`VaultError`] naming the cause and the fix.
    pub fn start(cfg: Config) -> Result<Server, VaultError> {
        memveil_sys::process::set_dumpable(false).map_err(|source| VaultError::Harden {
            what: "prctl(PR_SET_DUMPABLE, 0)",
            source,
        })?;
        memveil_sys::process::disable_core_dumps().map_err(|source| VaultError::Harden {
            what: "setrlimit(RLIMIT_CORE, 0)",
            source,
        })?;
        // Before anything can make aws-lc allocate: every one of its blocks
        // (asymmetric keys, their operations' temporaries, its per-thread
        // DRBG state) then lives in secret memory.
        let heap = memveil_asym::use_secret_heap(cfg.asym_heap_bytes, cfg.policy)
            .map_err(|e| VaultError::Config(format!("{e} (the vault's --asym-heap-kib)")))?;
        if cfg.state.is_some() != cfg.kek.is_some() {
            return Err(VaultError::Config(
                "--state needs --passphrase-file, --key-file or --kmip-kek (and they need --state)"
                    .into(),
            ));
        }
        let pool = SecretPool::new(cfg.pool_bytes, cfg.policy)?;
        let level = pool.level();
        // Probe that thread stacks can be had at this level too (fails
        // early on RLIMIT_MEMLOCK rather than at the first client).
        drop(SecretRegion::new(CONN_STACK, cfg.policy)?);
        let (keystore, table) = match (&cfg.state, &cfg.kek) {
            (Some(dir), Some(kek)) => {
                std::fs::create_dir_all(dir).map_err(|e| {
                    VaultError::Config(format!("state directory {}: {e}", dir.display()))
                })?;
                let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
                let (dir, kek, kdf, p) = (dir.clone(), kek.clone(), cfg.kdf, pool.clone());
                let region = SecretRegion::new(CONN_STACK, cfg.policy)?;
                let (tx, rx) = std::sync::mpsc::channel();
                let t = stack_thread::spawn(Box::new(SecretStack(region)), move || {
                    let r = load(&dir, &kek, kdf, &p);
                    let _ = tx.send(r);
                })
                .map_err(|source| VaultError::Harden {
                    what: "starting the loader thread",
                    source,
                })?;
                let r = rx
                    .recv()
                    .map_err(|_| VaultError::Config("keystore loader died".into()))?;
                drop(t);
                let (ks, table) = r?;
                (Some(ks), table)
            }
            _ => (None, KeyTable::default()),
        };
        // Like hardware at reset: a fresh platform key, every other KeyID
        // unprogrammed (nothing of the table survives a restart).
        let keyids = memveil_engine::KeyTable::new(
            cfg.keyid_bits,
            memveil_engine::Algorithm::AesXts128,
            cfg.policy,
            Box::new(memveil_engine::cpu_entropy),
        )?;
        let (listener, socket_lock) = bind(&cfg.socket, cfg.socket_mode)?;
        let n = table.by_id.len();
        let ledger = Ledger::new(
            cfg.quotas,
            pool.size(),
            heap.size - memveil_asym::heap_reserve(heap.size),
        );
        for k in table.by_id.values() {
            ledger.take_unchecked(k.owner, k.charge());
        }
        let shared = Arc::new(Shared {
            cfg,
            pool,
            level,
            ledger,
            keys: RwLock::new(table),
            keystore,
            keyids,
            owner: memveil_sys::probe::euid(),
            tenants: crate::tenants::Tenants::default(),
            clients: AtomicU32::new(0),
            started: Instant::now(),
        });
        log(format_args!(
            "level={level} backend={:?} asym-heap={} KiB ({}) persistent keys loaded={n} keyids=1..={} ({} KiB of secret memory) programmed by: uid {} (the vault's own), root{}",
            memveil_cipher::backend(),
            heap.size / 1024,
            heap.level,
            shared.keyids.max_keyid(),
            shared.keyids.secret_bytes() / 1024,
            shared.owner,
            shared
                .cfg
                .key_admins
                .iter()
                .map(|u| format!(", uid {u}"))
                .collect::<String>()
        ));
        Ok(Server {
            shared,
            listener,
            _socket_lock: socket_lock,
        })
    }

    /// Seals the code and the life-long secret memory (`mseal`) and
    /// installs the seccomp allowlist on every thread (`crate::seccomp`);
    /// with `no_seccomp`, says loudly that it installs none. Call it after
    /// [`Server::start`] and [`Server::announce`], before [`Server::run`].
    ///
    /// # Errors
    /// [`VaultError::Config`] when the filter cannot be installed.
    pub fn lock_down(&self, no_seccomp: bool) -> Result<(), VaultError> {
        crate::seccomp::lock_down(&self.shared.pool, &self.shared.keyids, no_seccomp)
    }

    /// The protection level in use.
    #[must_use]
    pub fn level(&self) -> Level {
        self.shared.level
    }

    /// Announces readiness: a line on stdout and, under systemd
    /// (`NOTIFY_SOCKET`), `READY=1`.
    pub fn announce(&self) {
        let mut out = io::stdout().lock();
        let _ = writeln!(
            out,
            "memveil-vault ready socket={} level={} pid={}",
            self.shared.cfg.socket.display(),
            self.shared.level,
            std::process::id()
        );
        let _ = out.flush();
        if let Some(path) = std::env::var_os("NOTIFY_SOCKET") {
            let msg = format!(
                "READY=1\nSTATUS=level={}\nMAINPID={}",
                self.shared.level,
                std::process::id()
            );
            let r = sd_notify(&path, msg.as_bytes());
            if let Err(e) = r {
                log(format_args!("sd_notify failed: {e}"));
            }
        }
    }

    /// Accepts clients until the process ends.
    ///
    /// # Errors
    /// Only when `accept(2)` fails persistently.
    pub fn run(self) -> Result<(), VaultError> {
        let mut conns: Vec<StackThread<SecretStack>> = Vec::new();
        for stream in self.listener.incoming() {
            conns.retain(|t| !t.finished());
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    log(format_args!("accept: {e}"));
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let cred = match ipc::peer_cred(&stream) {
                Ok(c) => c,
                Err(e) => {
                    log(format_args!("SO_PEERCRED: {e}; dropping connection"));
                    continue;
                }
            };
            if let Err(msg) = self.shared.ledger.take(cred.uid, Resource::Connection) {
                refuse(&stream, &cred, ErrorCode::Quota, &msg);
                continue;
            }
            // The stack first: if secret memory is exhausted the client
            // gets a reply saying so instead of a bare hang-up.
            let region = match SecretRegion::new(CONN_STACK, self.shared.cfg.policy) {
                Ok(r) => r,
                Err(e) => {
                    self.shared.ledger.give_back(cred.uid, Resource::Connection);
                    let msg = format!("the vault cannot serve another client now: {e}");
                    refuse(&stream, &cred, ErrorCode::Internal, &msg);
                    continue;
                }
            };
            let sh = Arc::clone(&self.shared);
            match stack_thread::spawn(Box::new(SecretStack(region)), move || {
                // A tenant's connection gave its slot back when it became one.
                if !serve_conn(&sh, stream, cred) {
                    sh.ledger.give_back(cred.uid, Resource::Connection);
                }
            }) {
                Ok(t) => conns.push(t),
                Err(e) => {
                    self.shared.ledger.give_back(cred.uid, Resource::Connection);
                    log(format_args!(
                        "cannot start a connection thread for uid={} pid={}: {e}",
                        cred.uid, cred.pid
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Answers a connection the vault will not serve with one error reply and
/// closes it. Whatever the client already sent is read first (without
/// waiting), so closing does not reset the connection before the client
/// has read the reply.
fn refuse(stream: &UnixStream, cred: &PeerCred, code: ErrorCode, msg: &str) {
    log(format_args!(
        "refusing uid={} pid={}: {msg}",
        cred.uid, cred.pid
    ));
    let mut s = stream;
    let _ = s.write_all(&proto::encode_reply(&err(code, msg)));
    if stream.set_nonblocking(true).is_ok() {
        // Bounded: a client that keeps sending must not hold this thread.
        let mut sink = [0u8; 1024];
        for _ in 0..8 {
            if !matches!(io::Read::read(&mut s, &mut sink), Ok(n) if n > 0) {
                break;
            }
        }
    }
}

fn sd_notify(path: &std::ffi::OsStr, msg: &[u8]) -> io::Result<()> {
    use std::os::linux::net::SocketAddrExt as _;
    use std::os::unix::ffi::OsStrExt as _;
    let sock = std::os::unix::net::UnixDatagram::unbound()?;
    let b = path.as_bytes();
    if let Some(name) = b.strip_prefix(b"@") {
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(msg, &addr)?;
    } else {
        sock.send_to(msg, Path::new(path))?;
    }
    Ok(())
}

/// The vault's runtime directory, holding the default socket
/// (`/run/memveil/vault.sock`); the vault makes it, mode 0755, when missing
/// (after a boot `/run` is empty; systemd's `RuntimeDirectory=memveil` makes
/// it for the unit).
pub const RUNTIME_DIR: &str = "/run/memveil";

/// Makes `runtime_dir` (mode 0755: clients must reach the socket, whose own
/// mode says who may connect) when `socket` lives in it and it is missing.
/// Other directories are the caller's to make.
///
/// # Errors
/// The directory cannot be made or given its mode.
pub fn make_runtime_dir(socket: &Path, runtime_dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    if socket.parent() != Some(runtime_dir) || runtime_dir.exists() {
        return Ok(());
    }
    match std::fs::DirBuilder::new().mode(0o755).create(runtime_dir) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
        r => r?,
    }
    // The umask may have taken bits off.
    std::fs::set_permissions(runtime_dir, std::fs::Permissions::from_mode(0o755))
}

/// Binds the socket under its path's lock, taken before the check for a
/// live vault and held while it listens ([`memveil_sys::ipc::bind_socket`]):
/// a stale socket file is replaced, anything else at the path is refused.
fn bind(path: &Path, mode: u32) -> Result<(UnixListener, ipc::PathLock), VaultError> {
    use ipc::BindError;
    let err = |source, hint| VaultError::Socket {
        path: path.to_owned(),
        source,
        hint,
    };
    make_runtime_dir(path, Path::new(RUNTIME_DIR)).map_err(|e| {
        err(
            e,
            ": cannot make the vault's runtime directory /run/memveil",
        )
    })?;
    ipc::bind_socket(path, mode).map_err(|e| match e {
        BindError::Held => err(
            io::Error::from(io::ErrorKind::AddrInUse),
            ": another vault is listening there (or starting on it); stop it or choose another \
             --vault",
        ),
        BindError::Listening => err(
            io::Error::from(io::ErrorKind::AddrInUse),
            ": another vault (or program) is listening there; stop it or choose another --vault",
        ),
        BindError::Io { what, source } => err(
            io::Error::new(source.kind(), format!("{what}: {source}")),
            ": check that the directory exists and is writable (or choose another --vault)",
        ),
        what => VaultError::PathTaken {
            path: path.to_owned(),
            what,
        },
    })
}

type Loaded = Result<(Keystore, KeyTable), VaultError>;

fn load(dir: &Path, kek: &KekSource, kdf: KdfParams, pool: &SecretPool) -> Loaded {
    let (ks, stored) = Keystore::open(dir, kek, kdf, pool)?;
    let mut t = KeyTable::default();
    for s in stored {
        let mut versions = Vec::new();
        for v in &s.versions {
            let ver = Version::from_bytes(pool, s.kind, v, true).map_err(|e| {
                VaultError::Config(format!("key {:?} in the keystore: {e}", s.name))
            })?;
            versions.push(Arc::new(ver));
        }
        t.insert(KeyEntry {
            id: s.id,
            name: s.name,
            kind: s.kind,
            owner: s.owner,
            persistent: true,
            acl: s.acl.into_iter().collect(),
            versions,
        });
    }
    Ok((ks, t))
}

// ------------------------------------------------------------ connections

struct Lane {
    stop: Arc<AtomicBool>,
    control: Arc<Control>,
    thread: Option<StackThread<SecretStack>>,
}

impl Lane {
    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = self.control.word(ring::OFF_SUBMIT) {
            ipc::futex_wake(w, i32::MAX);
        }
        drop(self.thread.take());
    }
}

struct Conn {
    cred: PeerCred,
    areas: Arc<RwLock<Vec<Option<Arc<SharedMap>>>>>,
    buffers: Arc<RwLock<Buffers>>,
    lanes: BTreeMap<u32, Lane>,
    next_lane: u32,
    pending_fd: Option<OwnedFd>,
}

pub(crate) fn err(code: ErrorCode, message: impl Into<String>) -> Reply {
    Reply::Error {
        code,
        message: message.into(),
    }
}

/// Reads exactly `buf.len()` bytes, keeping any descriptor that arrives.
fn read_exact_fd(s: &UnixStream, buf: &mut [u8], fd: &mut Option<OwnedFd>) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let (n, f) = ipc::recv_with_fd(s, &mut buf[got..])?;
        if f.is_some() {
            *fd = f;
        }
        if n == 0 {
            return if got == 0 {
                Ok(false)
            } else {
                Err(io::Error::from(io::ErrorKind::UnexpectedEof))
            };
        }
        got += n;
    }
    Ok(true)
}

/// Bytes of the secret pool a connection's request buffer takes.
fn frame_pool_bytes() -> usize {
    memveil_secmem::pool_footprint(proto::MAX_REQUEST)
}

/// Serves one connection; `true` when it became a tenant's (and gave its
/// connection slot back then).
fn serve_conn(sh: &Arc<Shared>, stream: UnixStream, cred: PeerCred) -> bool {
    // Request frames (import carries key bytes) land in secret memory,
    // counted against this uid's share of the pool.
    if let Err(msg) = sh.ledger.take(cred.uid, Resource::Pool(frame_pool_bytes())) {
        refuse(&stream, &cred, ErrorCode::Quota, &msg);
        return false;
    }
    let frame = match sh.pool.alloc_bytes(proto::MAX_REQUEST) {
        Ok(b) => b,
        Err(e) => {
            let msg = format!("vault out of secret memory: {e} (the vault's --pool-kib)");
            refuse(&stream, &cred, ErrorCode::Internal, &msg);
            sh.ledger
                .give_back(cred.uid, Resource::Pool(frame_pool_bytes()));
            return false;
        }
    };
    sh.clients.fetch_add(1, Ordering::SeqCst);
    log(format_args!(
        "client connected uid={} pid={}",
        cred.uid, cred.pid
    ));
    let tenant = serve_frames(sh, stream, cred, frame);
    sh.ledger
        .give_back(cred.uid, Resource::Pool(frame_pool_bytes()));
    sh.clients.fetch_sub(1, Ordering::SeqCst);
    log(format_args!(
        "client gone uid={} pid={}",
        cred.uid, cred.pid
    ));
    tenant
}

fn serve_frames(
    sh: &Arc<Shared>,
    mut stream: UnixStream,
    cred: PeerCred,
    mut frame: memveil_secmem::SecretBox<[u8]>,
) -> bool {
    let mut tenant = false;
    let mut c = Conn {
        cred,
        areas: Arc::default(),
        buffers: Arc::default(),
        lanes: BTreeMap::new(),
        next_lane: 1,
        pending_fd: None,
    };
    loop {
        let mut hdr = [0u8; 4];
        match read_exact_fd(&stream, &mut hdr, &mut c.pending_fd) {
            Ok(true) => {}
            Ok(false) | Err(_) => break,
        }
        let n = match proto::frame_len(hdr, proto::MAX_REQUEST) {
            Ok(n) => n,
            Err(e) => {
                // The stream's framing cannot be trusted any more.
                let _ = stream.write_all(&proto::encode_reply(&err(
                    ErrorCode::Malformed,
                    format!("{e}; closing the connection"),
                )));
                break;
            }
        };
        if !matches!(
            read_exact_fd(&stream, &mut frame[..n], &mut c.pending_fd),
            Ok(true)
        ) {
            break;
        }
        let reply = match proto::decode_request(&frame[..n]) {
            Ok(Request::TenantKey { keyid }) => match tenant_key(sh, &c.cred, &mut stream, keyid) {
                Ok(Some(id)) => {
                    // Tenants do not count against the operator's connection
                    // limit: 64 running tenants must not lock `memveil key
                    // clear` out (only KeyID administrators become tenants).
                    sh.ledger.give_back(cred.uid, Resource::Connection);
                    tenant = true;
                    hold_tenant(sh, &stream, id);
                    break;
                }
                // The key went out half-way: the framing is lost.
                Ok(None) => break,
                Err(reply) => reply,
            },
            Ok(req) => handle(sh, &mut c, req),
            Err(e) => err(ErrorCode::Malformed, e.to_string()),
        };
        zeroize::Zeroize::zeroize(&mut frame[..n]);
        if stream.write_all(&proto::encode_reply(&reply)).is_err() {
            break;
        }
    }
    for (_, mut l) in std::mem::take(&mut c.lanes) {
        l.stop();
        sh.ledger.give_back(cred.uid, Resource::Lane);
    }
    let buffers = c
        .buffers
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .count();
    for _ in 0..buffers {
        sh.ledger.give_back(cred.uid, Resource::Buffer);
    }
    let areas = std::mem::take(&mut *c.areas.write().unwrap_or_else(PoisonError::into_inner));
    for m in areas.into_iter().flatten() {
        sh.ledger
            .give_back(cred.uid, Resource::Area(m.len() as u64));
    }
    tenant
}

fn seal_all(sh: &Shared, t: &KeyTable) -> Result<(), Reply> {
    let Some(ks) = &sh.keystore else {
        return Ok(());
    };
    let keys: Vec<SealKey<'_>> = t
        .by_id
        .values()
        .filter(|k| k.persistent)
        .map(|k| SealKey {
            id: k.id,
            name: &k.name,
            kind: k.kind,
            owner: k.owner,
            acl: k.acl.iter().map(|(u, p)| (*u, *p)).collect(),
            versions: k.versions.iter().filter_map(|v| v.raw()).collect(),
        })
        .collect();
    ks.save(&keys).map_err(|e| {
        err(
            ErrorCode::Internal,
            format!("keystore write failed (old keystore kept): {e}"),
        )
    })
}

/// Adds the flag to a message about an exhausted secret pool.
fn pool_hint(msg: String) -> String {
    if msg.contains("pool") {
        format!("{msg} (the vault's whole pool is full: --pool-kib)")
    } else {
        msg
    }
}

/// Where a new key's bytes come from.
enum Make<'a> {
    /// Random, the kind's length.
    Random,
    /// A random generic secret of this many bytes.
    Secret(usize),
    /// The caller's bytes (an import, or a derived key).
    Bytes(&'a [u8]),
}

fn add_key(
    sh: &Shared,
    c: &Conn,
    op: &str,
    name: String,
    kind: KeyKind,
    persistent: bool,
    key: Make<'_>,
) -> Reply {
    if persistent && sh.keystore.is_none() {
        audit(&c.cred, op, &name, "not-durable");
        return err(
            ErrorCode::NotDurable,
            "persistent keys need a keystore: start the vault with --state DIR and --passphrase-file or --key-file",
        );
    }
    let mut t = sh.keys.write().unwrap_or_else(PoisonError::into_inner);
    if t.by_name.contains_key(&name) {
        audit(&c.cred, op, &name, "exists");
        return err(ErrorCode::Exists, format!("a key named {name:?} exists"));
    }
    let (keys, versions) = t.owned_by(c.cred.uid);
    if let Err(msg) = sh.ledger.check_keys(c.cred.uid, keys, versions, 1, 1) {
        audit(&c.cred, op, &name, "quota");
        return err(ErrorCode::Quota, msg);
    }
    let charge = Version::charge(kind, persistent);
    if let Err(msg) = sh.ledger.take(c.cred.uid, charge) {
        audit(&c.cred, op, &name, "quota");
        return err(ErrorCode::Quota, msg);
    }
    let failures = heap_failures();
    let v = match key {
        Make::Bytes(k) => Version::from_bytes(&sh.pool, kind, k, persistent),
        Make::Random => Version::random(&sh.pool, kind, persistent),
        Make::Secret(n) => Version::random_secret(&sh.pool, n, persistent),
    };
    let v = match v {
        Ok(v) => v,
        Err(e) => {
            sh.ledger.give_back(c.cred.uid, charge);
            let r = build_failed(&e, failures);
            let code = if matches!(
                r,
                Reply::Error {
                    code: ErrorCode::Quota,
                    ..
                }
            ) {
                "heap-full"
            } else {
                "invalid"
            };
            audit(&c.cred, op, &name, code);
            return r;
        }
    };
    let id = t.alloc_id();
    let e = KeyEntry {
        id,
        name: name.clone(),
        kind,
        owner: c.cred.uid,
        persistent,
        acl: BTreeMap::new(),
        versions: vec![Arc::new(v)],
    };
    let info = e.info();
    t.insert(e);
    if persistent {
        if let Err(r) = seal_all(sh, &t) {
            t.remove(&name);
            sh.ledger.give_back(c.cred.uid, charge);
            audit(&c.cred, op, &name, "disk-error");
            return r;
        }
    }
    audit(
        &c.cred,
        op,
        &name,
        &format!("ok id={id} kind={kind} persistent={persistent}"),
    );
    Reply::Key(info)
}

fn handle(sh: &Arc<Shared>, c: &mut Conn, req: Request<'_>) -> Reply {
    let uid = c.cred.uid;
    match req {
        Request::Hello { version } => {
            if version != proto::VERSION {
                return err(
                    ErrorCode::Invalid,
                    format!(
                        "protocol version {version} not supported; this vault speaks {}",
                        proto::VERSION
                    ),
                );
            }
            Reply::Welcome {
                version: proto::VERSION,
                level: sh.level.to_string(),
                uid,
                pid: c.cred.pid,
                vault_pid: std::process::id(),
            }
        }
        Request::Status => {
            let keys = sh
                .keys
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .by_id
                .len();
            Reply::Status(proto::Status {
                version: proto::VERSION,
                level: sh.level.to_string(),
                backend: memveil_cipher::backend().to_owned(),
                keys: u32::try_from(keys).unwrap_or(u32::MAX),
                clients: sh.clients.load(Ordering::SeqCst),
                durable: sh.keystore.is_some(),
                uptime_s: sh.started.elapsed().as_secs(),
                pid: std::process::id(),
            })
        }
        Request::CreateKey {
            name,
            kind,
            persistent,
        } => add_key(sh, c, "create", name, kind, persistent, Make::Random),
        Request::CreateSecret {
            name,
            len,
            persistent,
        } => add_key(
            sh,
            c,
            "create",
            name,
            KeyKind::Secret,
            persistent,
            Make::Secret(usize::from(len)),
        ),
        Request::ImportKey {
            name,
            kind,
            persistent,
            key,
        } => add_key(sh, c, "import", name, kind, persistent, Make::Bytes(key)),
        Request::ListKeys => {
            let t = sh.keys.read().unwrap_or_else(PoisonError::into_inner);
            Reply::Keys(
                t.by_id
                    .values()
                    .filter(|k| k.visible_to(uid))
                    .map(KeyEntry::info)
                    .collect(),
            )
        }
        Request::KeyInfo { name } => {
            let t = sh.keys.read().unwrap_or_else(PoisonError::into_inner);
            match t.get(&name) {
                Some(k) if k.visible_to(uid) => Reply::Key(k.info()),
                _ => err(
                    ErrorCode::NotFound,
                    format!("no key {name:?} visible to uid {uid}"),
                ),
            }
        }
        Request::RotateKey { name } => admin(sh, c, "rotate", &name, |sh, k, owned| {
            if !k.kind.is_symmetric() {
                let why = if k.kind == KeyKind::Secret {
                    "its users hold MACs made with it"
                } else {
                    "its public key is known to others"
                };
                return Err(err(
                    ErrorCode::Invalid,
                    format!(
                        "a {} key is not rotated ({why}): create a new key and switch to it",
                        k.kind
                    ),
                ));
            }
            // The new version belongs to the key's owner, and counts there.
            sh.ledger
                .check_keys(k.owner, 0, owned, 0, 1)
                .map_err(|m| err(ErrorCode::Quota, m))?;
            let charge = Version::charge(k.kind, k.persistent);
            sh.ledger
                .take(k.owner, charge)
                .map_err(|m| err(ErrorCode::Quota, m))?;
            match Version::random(&sh.pool, k.kind, k.persistent) {
                Ok(v) => k.versions.push(Arc::new(v)),
                Err(e) => {
                    sh.ledger.give_back(k.owner, charge);
                    return Err(err(ErrorCode::Internal, pool_hint(e.to_string())));
                }
            }
            Ok(Reply::Key(k.info()))
        }),
        Request::PublicKey { name } => public_key(sh, uid, &name),
        Request::DeriveKey {
            name,
            kind,
            persistent,
            base,
            kdf,
            peer,
            shared,
        } => match crate::derive::derive(sh, uid, &base, kind, kdf, peer, shared) {
            Ok(bytes) => add_key(sh, c, "derive", name, kind, persistent, Make::Bytes(&bytes)),
            Err(reply) => {
                audit(&c.cred, "derive", &name, &format!("refused base={base}"));
                reply
            }
        },
        Request::Grant {
            name,
            uid: who,
            perms,
        } => admin(
            sh,
            c,
            &format!("grant uid={who} perms={perms}"),
            &name,
            |_, k, _| {
                k.acl.insert(who, perms);
                Ok(Reply::Key(k.info()))
            },
        ),
        Request::Revoke { name, uid: who } => {
            admin(sh, c, &format!("revoke uid={who}"), &name, |_, k, _| {
                k.acl.remove(&who);
                Ok(Reply::Key(k.info()))
            })
        }
        Request::DestroyKey { name } => {
            let mut t = sh.keys.write().unwrap_or_else(PoisonError::into_inner);
            match t.get(&name) {
                Some(k) if k.allows(uid, perm::ADMIN) => {}
                Some(k) if k.visible_to(uid) => {
                    audit(&c.cred, "destroy", &name, "denied");
                    return err(
                        ErrorCode::Denied,
                        format!("uid {uid} may not destroy {name:?}"),
                    );
                }
                _ => {
                    audit(&c.cred, "destroy", &name, "not-found");
                    return err(
                        ErrorCode::NotFound,
                        format!("no key {name:?} visible to uid {uid}"),
                    );
                }
            }
            let Some(k) = t.remove(&name) else {
                return err(ErrorCode::NotFound, format!("no key {name:?}"));
            };
            if k.persistent {
                if let Err(r) = seal_all(sh, &t) {
                    t.insert(k);
                    audit(&c.cred, "destroy", &name, "disk-error");
                    return r;
                }
            }
            sh.ledger.give_back(k.owner, k.charge());
            drop(k); // wipes every version (in-flight requests hold their own reference)
            audit(&c.cred, "destroy", &name, "ok");
            Reply::Done
        }
        Request::RegisterShm { len } => register_shm(sh, c, len),
        Request::RegisterBuffer { shm, offset, len } => {
            let areas = c.areas.read().unwrap_or_else(PoisonError::into_inner);
            let Some(Some(map)) = usize::try_from(shm).ok().and_then(|i| areas.get(i)) else {
                return err(ErrorCode::NotFound, format!("no shared area {shm}"));
            };
            let mut b = c.buffers.write().unwrap_or_else(PoisonError::into_inner);
            if let Err(m) = sh.ledger.take(uid, Resource::Buffer) {
                return err(ErrorCode::Quota, m);
            }
            match b.register(shm, map.len(), offset, len) {
                Ok(id) => Reply::Id(id),
                Err(m) => {
                    sh.ledger.give_back(uid, Resource::Buffer);
                    err(ErrorCode::Invalid, m)
                }
            }
        }
        Request::UnregisterBuffer { buffer } => {
            if c.buffers
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .unregister(buffer)
            {
                sh.ledger.give_back(uid, Resource::Buffer);
                Reply::Done
            } else {
                err(ErrorCode::NotFound, format!("no buffer {buffer}"))
            }
        }
        Request::OpenLane { shm, offset } => open_lane(sh, c, shm, offset),
        Request::CloseLane { lane } => match c.lanes.remove(&lane) {
            Some(mut l) => {
                l.stop();
                sh.ledger.give_back(uid, Resource::Lane);
                Reply::Done
            }
            None => err(ErrorCode::NotFound, format!("no lane {lane}")),
        },
        Request::ProgramKeyId(p) => program_keyid(sh, &c.cred, &p),
        Request::TenantKey { .. } => err(
            ErrorCode::Internal,
            "TenantKey is answered before the request table",
        ),
        Request::KeyIdStatus => Reply::KeyIds(proto::KeyIdTable {
            max_keyid: sh.keyids.max_keyid(),
            level: sh.keyids.level().to_string(),
            entries: sh.keyids.states(),
        }),
        Request::KeyIdTenants => Reply::KeyIdTenants(sh.tenants.counts(sh.keyids.max_keyid())),
    }
}

/// One PCONFIG request on the host key table, from an authorized uid; the
/// engine's checks give the status. Audited whatever the outcome.
fn program_keyid(sh: &Shared, cred: &PeerCred, req: &KeyProgram<'_>) -> Reply {
    let uid = cred.uid;
    let command = Command::from_code(req.command)
        .map_or_else(|| format!("unknown({})", req.command), |c| c.to_string());
    let audit = |result: &str| {
        log(format_args!(
            "audit op=keyid-program command={command} keyid={} uid={uid} pid={} result={result}",
            req.keyid, cred.pid
        ));
    };
    if !sh.may_program_keyids(uid) {
        audit("denied");
        return err(
            ErrorCode::Denied,
            format!(
                "uid {uid} may not program or clear KeyIDs: only the vault's owner (uid {}), root, or a uid the vault was started with `--key-admin UID` may (anyone may read the table: `memveil key status`)",
                sh.owner
            ),
        );
    }
    match sh.keyids.program(req, Some(uid)) {
        Ok(state) => {
            // The tenants' copies of the old key die with their processes.
            let stopped = sh.tenants.stop(
                req.keyid,
                state.generation,
                &format!(
                    "KeyID {} was {} by uid {uid} (its key is gone: crypto-erase)",
                    req.keyid,
                    if state.mode == memveil_engine::KeyIdMode::Clear {
                        "cleared".to_owned()
                    } else {
                        format!("programmed again ({})", state.mode.name())
                    }
                ),
                crate::tenants::STOP_WAIT,
            );
            audit(&format!(
                "{} mode={} generation={} tenants_stopped={} tenants_unconfirmed={}",
                PconfigStatus::ProgSuccess,
                state.mode.name(),
                state.generation,
                stopped.confirmed,
                stopped.unconfirmed.len()
            ));
            Reply::Programmed {
                status: PconfigStatus::ProgSuccess,
                message: format!(
                    "{}{}",
                    PconfigStatus::ProgSuccess,
                    stopped.describe(req.keyid)
                ),
                state: Some(state),
            }
        }
        Err(e) => {
            audit(&e.status().to_string());
            Reply::Programmed {
                status: e.status(),
                message: e.to_string(),
                state: None,
            }
        }
    }
}

/// `TenantKey`: derives the KeyID's page key into secret memory, sends it,
/// and registers the connection as the tenant's. `Ok(Some(id))`: a tenant
/// now; `Ok(None)`: the reply could not be sent whole (the caller closes the
/// connection); `Err`: the refusal to send.
fn tenant_key(
    sh: &Shared,
    cred: &PeerCred,
    stream: &mut UnixStream,
    keyid: u16,
) -> Result<Option<u64>, Reply> {
    let uid = cred.uid;
    let audit = |result: &str| {
        log(format_args!(
            "audit op=keyid-tenant keyid={keyid} uid={uid} pid={} result={result}",
            cred.pid
        ));
    };
    if !sh.may_program_keyids(uid) {
        audit("denied");
        return Err(err(
            ErrorCode::Denied,
            format!(
                "uid {uid} may not run programs under host KeyIDs: only the vault's owner (uid {}), \
                 root, or a uid the vault was started with `--key-admin UID` may (run the \
                 program with `memveil run --keyid N --user USER` as one of them)",
                sh.owner
            ),
        ));
    }
    let mut key = sh
        .pool
        .alloc_bytes(proto::TENANT_KEY_LEN)
        .map_err(|e| err(ErrorCode::Internal, pool_hint(e.to_string())))?;
    let derived = sh.tenants.add(cred.pid, stream, || {
        let out: &mut [u8; proto::TENANT_KEY_LEN] = (&mut key[..])
            .try_into()
            .map_err(|_| err(ErrorCode::Internal, "page key buffer"))?;
        let state = match sh.keyids.derive_page_key(keyid, out) {
            Ok(st) => st,
            Err(memveil_engine::DeriveError::NoEncrypt(_)) => {
                out.fill(0);
                sh.keyids
                    .state(keyid)
                    .ok_or_else(|| err(ErrorCode::Internal, "state of a no-encrypt KeyID"))?
            }
            Err(e @ memveil_engine::DeriveError::NotProgrammed(_)) => {
                return Err(err(ErrorCode::NotFound, e.to_string()))
            }
            Err(e) => return Err(err(ErrorCode::Invalid, e.to_string())),
        };
        Ok((keyid, state.generation, state))
    });
    let (id, state) = derived.inspect_err(|_| audit("refused"))?;
    if id == 0 {
        // No second handle on the connection: it could never be told to
        // stop, so it gets no key.
        audit("no-handle");
        return Err(err(
            ErrorCode::Internal,
            "the vault could not keep a handle on this connection to stop the tenant later (out of descriptors?); no key given, retry",
        ));
    }
    let frame = proto::encode_reply(&Reply::TenantKey(state));
    let sent = crate::client::write_all_vectored(
        stream,
        &mut [io::IoSlice::new(&frame), io::IoSlice::new(&key)],
    );
    drop(key);
    if sent.is_err() {
        sh.tenants.remove(id);
        audit("connection-lost");
        return Ok(None);
    }
    audit(&format!(
        "ok mode={} generation={} tenant={id}",
        state.mode.name(),
        state.generation
    ));
    Ok(Some(id))
}

/// A tenant's connection: it carries nothing more; once the tenant closes it
/// (stopped, or exited) the tenant is forgotten.
fn hold_tenant(sh: &Shared, stream: &UnixStream, id: u64) {
    let mut b = [0u8; 64];
    loop {
        match (&*stream).read(&mut b) {
            Ok(0) | Err(_) => break,
            // A tenant has nothing to say: anything it sends is dropped.
            Ok(_) => {}
        }
    }
    sh.tenants.remove(id);
}

fn public_key(sh: &Shared, uid: u32, name: &str) -> Reply {
    let t = sh.keys.read().unwrap_or_else(PoisonError::into_inner);
    match t.get(name) {
        Some(k) if k.visible_to(uid) => match k.version(0).and_then(|v| v.public()) {
            Some(p) => Reply::Public(p),
            None => err(
                ErrorCode::Invalid,
                format!("{name:?} is a {} key: it has no public half", k.kind),
            ),
        },
        _ => err(
            ErrorCode::NotFound,
            format!("no key {name:?} visible to uid {uid}"),
        ),
    }
}

fn admin(
    sh: &Shared,
    c: &Conn,
    op: &str,
    name: &str,
    f: impl FnOnce(&Shared, &mut KeyEntry, usize) -> Result<Reply, Reply>,
) -> Reply {
    let uid = c.cred.uid;
    let mut t = sh.keys.write().unwrap_or_else(PoisonError::into_inner);
    // Versions held by the keys of this key's owner.
    let owned = t.get(name).map_or(0, |k| t.owned_by(k.owner).1);
    let Some(k) = t.get_mut(name) else {
        audit(&c.cred, op, name, "not-found");
        return err(
            ErrorCode::NotFound,
            format!("no key {name:?} visible to uid {uid}"),
        );
    };
    if !k.allows(uid, perm::ADMIN) {
        let vis = k.visible_to(uid);
        audit(&c.cred, op, name, "denied");
        return if vis {
            err(
                ErrorCode::Denied,
                format!("uid {uid} lacks the admin permission on {name:?}"),
            )
        } else {
            err(
                ErrorCode::NotFound,
                format!("no key {name:?} visible to uid {uid}"),
            )
        };
    }
    let persistent = k.persistent;
    let r = match f(sh, k, owned) {
        Ok(r) => r,
        Err(r) => {
            audit(&c.cred, op, name, "failed");
            return r;
        }
    };
    if persistent {
        if let Err(e) = seal_all(sh, &t) {
            audit(&c.cred, op, name, "disk-error (in memory only)");
            return e;
        }
    }
    audit(&c.cred, op, name, "ok");
    r
}

fn register_shm(sh: &Shared, c: &mut Conn, len: u64) -> Reply {
    let Some(fd) = c.pending_fd.take() else {
        return err(
            ErrorCode::Invalid,
            "RegisterShm needs a memfd attached with SCM_RIGHTS",
        );
    };
    let Ok(ulen) = usize::try_from(len) else {
        return err(ErrorCode::Invalid, "length too large");
    };
    if ulen == 0 || ulen % ring::LANE_BYTES != 0 {
        return err(
            ErrorCode::Invalid,
            format!(
                "shared area length {len} must be a positive multiple of {}",
                ring::LANE_BYTES
            ),
        );
    }
    // A peer that could shrink the file could make our accesses SIGBUS.
    match ipc::seals(fd.as_fd()) {
        Ok(s) if ipc::seals_forbid_shrink(s) => {}
        Ok(_) => return err(ErrorCode::Invalid, "the memfd must carry F_SEAL_SHRINK"),
        Err(_) => return err(ErrorCode::Invalid, "the descriptor is not a sealable memfd"),
    }
    let file = std::fs::File::from(fd);
    match file.metadata() {
        Ok(m) if m.len() >= len => {}
        _ => {
            return err(
                ErrorCode::Invalid,
                format!("the memfd is smaller than {len} bytes"),
            )
        }
    }
    if let Err(m) = sh.ledger.take(c.cred.uid, Resource::Area(len)) {
        return err(ErrorCode::Quota, m);
    }
    let map = match SharedMap::map(file.as_fd(), ulen) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            sh.ledger.give_back(c.cred.uid, Resource::Area(len));
            return err(ErrorCode::Invalid, format!("mapping the memfd: {e}"));
        }
    };
    let mut areas = c.areas.write().unwrap_or_else(PoisonError::into_inner);
    let id = match areas.iter().position(Option::is_none) {
        Some(i) => {
            areas[i] = Some(map);
            i
        }
        None => {
            areas.push(Some(map));
            areas.len() - 1
        }
    };
    Reply::Id(u32::try_from(id).unwrap_or(u32::MAX))
}

fn open_lane(sh: &Arc<Shared>, c: &mut Conn, shm: u32, offset: u64) -> Reply {
    let map = {
        let areas = c.areas.read().unwrap_or_else(PoisonError::into_inner);
        match usize::try_from(shm).ok().and_then(|i| areas.get(i)) {
            Some(Some(m)) => Arc::clone(m),
            _ => return err(ErrorCode::NotFound, format!("no shared area {shm}")),
        }
    };
    let off = match ring::check_lane(map.len(), offset) {
        Ok(o) => o,
        Err(m) => return err(ErrorCode::Invalid, m),
    };
    // The lane's page is reached only through atomics from now on; no data
    // request may touch it (a buffer over it gets BUSY), nor a second lane.
    let control = match map.control(off, ring::LANE_BYTES) {
        Ok(l) => Arc::new(l),
        Err(ShmError::Busy) => {
            return err(
                ErrorCode::Invalid,
                format!("a lane already runs at offset {off}, or a request is using that page"),
            )
        }
        Err(e) => return err(ErrorCode::Invalid, format!("lane at {off}: {e}")),
    };
    if let Err(m) = sh.ledger.take(c.cred.uid, Resource::Lane) {
        return err(ErrorCode::Quota, m);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let w = Worker {
        sh: Arc::clone(sh),
        uid: c.cred.uid,
        lane: Arc::clone(&control),
        areas: Arc::clone(&c.areas),
        buffers: Arc::clone(&c.buffers),
        stop: Arc::clone(&stop),
    };
    let t = match spawn_secret(sh, LANE_STACK, move || w.run()) {
        Ok(t) => t,
        Err(e) => {
            sh.ledger.give_back(c.cred.uid, Resource::Lane);
            return err(
                ErrorCode::Internal,
                format!("cannot start the lane worker: {e}"),
            );
        }
    };
    let id = c.next_lane;
    c.next_lane += 1;
    c.lanes.insert(
        id,
        Lane {
            stop,
            control,
            thread: Some(t),
        },
    );
    Reply::Id(id)
}

// ------------------------------------------------------------ lane worker

/// GCM scratch a lane worker keeps between requests; a larger one (up to
/// `--max-gcm-mib`) is wiped and freed after its request.
const SCRATCH_KEEP: usize = 8 << 20;

struct Worker {
    sh: Arc<Shared>,
    uid: u32,
    lane: Arc<Control>,
    areas: Arc<RwLock<Vec<Option<Arc<SharedMap>>>>>,
    buffers: Arc<RwLock<Buffers>>,
    stop: Arc<AtomicBool>,
}

/// The ring status for a refused shared-memory access.
fn shm_status(e: ShmError) -> u32 {
    match e {
        ShmError::Busy => status::BUSY,
        _ => status::OUT_OF_BOUNDS,
    }
}

impl Worker {
    fn run(self) {
        // Shown by `top -H`; `memveil bench` finds the lane worker by it.
        let _ = memveil_sys::process::set_thread_name(LANE_THREAD_NAME);
        let lane = &self.lane;
        let (Some(submit), Some(complete), Some(sleeping), Some(waiting)) = (
            lane.word(ring::OFF_SUBMIT),
            lane.word(ring::OFF_COMPLETE),
            lane.word(ring::OFF_VAULT_SLEEPING),
            lane.word(ring::OFF_CLIENT_WAITING),
        ) else {
            return;
        };
        // Private memory for GCM open (vault heap; it holds the client's
        // ciphertext and, once authenticated, its plaintext).
        let mut scratch: Vec<u8> = Vec::new();
        // A fresh lane starts at sequence 0 (the client's memfd is zeroed);
        // the client may submit before this thread runs.
        let mut last = 0u32;
        let spin = self.sh.cfg.spin;
        'outer: loop {
            // Bounded spin, then sleep on the futex.
            let t0 = Instant::now();
            let mut i = 0u32;
            let seq = loop {
                let s = submit.load(Ordering::Acquire);
                if s != last {
                    break s;
                }
                if self.stop.load(Ordering::Relaxed) {
                    break 'outer;
                }
                i = i.wrapping_add(1);
                if i.is_multiple_of(128) && t0.elapsed() > crate::client::PURE_SPIN {
                    // Let a client that shares this CPU run (loaded machine).
                    std::thread::yield_now();
                }
                if i.is_multiple_of(128) && t0.elapsed() > spin {
                    sleeping.store(1, Ordering::SeqCst);
                    if submit.load(Ordering::SeqCst) == last {
                        ipc::futex_wait(submit, last, Duration::from_millis(100));
                    }
                    sleeping.store(0, Ordering::SeqCst);
                } else {
                    std::hint::spin_loop();
                }
            };
            self.batch(&mut scratch);
            last = seq;
            complete.store(seq, Ordering::SeqCst);
            if waiting.load(Ordering::SeqCst) != 0 {
                ipc::futex_wake(complete, 1);
            }
        }
        zeroize::Zeroize::zeroize(&mut scratch);
    }

    fn batch(&self, scratch: &mut Vec<u8>) {
        let mut cb = [0u8; 4];
        if self.lane.read(ring::OFF_COUNT, &mut cb).is_err() {
            return;
        }
        let n = match ring::check_count(u32::from_le_bytes(cb)) {
            Ok(n) => n,
            Err(s) => {
                let _ = self
                    .lane
                    .write(ring::OFF_ENTRIES + ring::ENTRY_STATUS, &s.to_le_bytes());
                return;
            }
        };
        let areas = self.areas.read().unwrap_or_else(PoisonError::into_inner);
        let bufs = self.buffers.read().unwrap_or_else(PoisonError::into_inner);
        for i in 0..n {
            let at = ring::OFF_ENTRIES + i * ENTRY_BYTES;
            // One copy of the entry (IV included) onto this secret stack.
            let mut raw = [0u8; ENTRY_BYTES];
            if self.lane.read(at, &mut raw).is_err() {
                return;
            }
            let mut tag = [0u8; 16];
            let mut out_len = None;
            let st = match self.one(&areas, &bufs, &raw, &mut tag, scratch, &mut out_len) {
                Ok(gcm_enc) => {
                    if gcm_enc {
                        let _ = self.lane.write(at + ring::ENTRY_TAG, &tag);
                    }
                    status::OK
                }
                Err(s) => s,
            };
            if let Some(n) = out_len {
                let _ = self.lane.write(at + ring::ENTRY_OUT_LEN, &n.to_le_bytes());
            }
            zeroize::Zeroize::zeroize(&mut raw);
            let _ = self.lane.write(at + ring::ENTRY_STATUS, &st.to_le_bytes());
        }
    }

    /// Processes one entry; `Ok(true)` when a GCM or CMAC tag was produced.
    ///
    /// Every shared byte is fetched once: the entry was copied out by the
    /// caller, the AAD is copied out here, and the data range is claimed for
    /// this request alone ([`SharedMap::claim`]; an overlapping request of
    /// the same client gets `BUSY`). GCM open copies the message into
    /// vault-private memory once, authenticates and decrypts that copy, and
    /// writes the plaintext back only when the tag matched; the other modes
    /// run in place (docs/vault.md, "A client racing its own buffers").
    fn one(
        &self,
        areas: &[Option<Arc<SharedMap>>],
        bufs: &Buffers,
        raw: &[u8; ENTRY_BYTES],
        tag: &mut [u8; 16],
        scratch: &mut Vec<u8>,
        out_len: &mut Option<u32>,
    ) -> Result<bool, u32> {
        let e = Entry::parse(raw)?;
        e.check_length()?;
        if e.mode.is_asym() {
            *out_len = Some(self.one_asym(areas, bufs, &e)?);
            return Ok(false);
        }
        let span = bufs.check(e.buffer, e.offset, e.len)?;
        if e.mode == proto::Mode::Gcm && span.len > self.sh.cfg.quotas.gcm_bytes {
            return Err(status::TOO_LONG);
        }
        let aad = if e.aad_len > 0 {
            let a = bufs.check(e.buffer, e.aad_offset, e.aad_len)?;
            let m = area(areas, a.shm)?;
            let mut v = vec![0u8; a.len];
            m.read(a.start, &mut v).map_err(shm_status)?;
            v
        } else {
            Vec::new()
        };
        let version = self
            .sh
            .keys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .for_request(self.uid, &e)?;
        let m = area(areas, span.shm)?;
        let mut claim = m.claim(span.start, span.len).map_err(shm_status)?;
        if e.mode == proto::Mode::Gcm && e.op == ring::Op::Decrypt {
            // One fetch into private memory; the tag is checked over that
            // copy before any of it is decrypted, and only then does the
            // plaintext go back. (One whole-range copy each way: faster
            // here than chunked copies into the scratch, 0.71-0.76 vs
            // 0.47-0.49 of in-place open at 4 MiB.)
            if scratch.len() < span.len {
                scratch
                    .try_reserve_exact(span.len - scratch.len())
                    .map_err(|_| status::NO_MEMORY)?;
                scratch.resize(span.len, 0);
            }
            let private = &mut scratch[..span.len];
            claim.read(0, private).map_err(shm_status)?;
            let r = version.apply(&e, private, &aad, tag);
            if r.is_ok() {
                claim.write(0, private).map_err(shm_status)?;
            }
            if scratch.len() > SCRATCH_KEEP {
                zeroize::Zeroize::zeroize(scratch);
                *scratch = Vec::new();
            }
            r?;
            return Ok(false);
        }
        version.apply(&e, claim.bytes(), &aad, tag)?;
        Ok(matches!(e.mode, proto::Mode::Gcm | proto::Mode::Cmac) && e.op == ring::Op::Encrypt)
    }
}

impl Worker {
    /// One asymmetric entry: the input range copied out once into private
    /// memory, the key used (on this thread's secret stack; aws-lc's
    /// temporaries in the secret heap), the result (at most 512 bytes, on
    /// the secret stack) written into the output range, claimed for this
    /// request alone. Returns the result's length.
    fn one_asym(
        &self,
        areas: &[Option<Arc<SharedMap>>],
        bufs: &Buffers,
        e: &Entry,
    ) -> Result<u32, u32> {
        let input = bufs.check(e.buffer, e.offset, e.len)?;
        let output = bufs.check(e.buffer, e.aad_offset, e.aad_len)?;
        let version = self
            .sh
            .keys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .for_request(self.uid, e)?;
        let mut data = vec![0u8; input.len];
        area(areas, input.shm)?
            .read(input.start, &mut data)
            .map_err(shm_status)?;
        let mut out = [0u8; 512];
        let r = version.apply_asym(e, &data, &mut out);
        zeroize::Zeroize::zeroize(&mut data);
        let n = match r {
            Ok(n) => n,
            Err(s) => {
                zeroize::Zeroize::zeroize(&mut out);
                return Err(s);
            }
        };
        let written = if n > output.len {
            Err(status::BAD_LENGTH)
        } else {
            let m = area(areas, output.shm)?;
            let mut claim = m.claim(output.start, n.max(1)).map_err(shm_status)?;
            claim.write(0, &out[..n]).map_err(shm_status)
        };
        zeroize::Zeroize::zeroize(&mut out);
        written?;
        u32::try_from(n).map_err(|_| status::BAD_LENGTH)
    }
}

fn area(areas: &[Option<Arc<SharedMap>>], shm: u32) -> Result<&SharedMap, u32> {
    usize::try_from(shm)
        .ok()
        .and_then(|i| areas.get(i))
        .and_then(Option::as_deref)
        .ok_or(status::OUT_OF_BOUNDS)
}

#[cfg(test)]
mod runtime_dir_tests {
    use super::*;

    /// Issue 35: `memveil vault serve` at its default socket failed after a
    /// boot because `/run/memveil` did not exist.
    #[test]
    fn the_runtime_dir_is_made_0755_for_a_socket_in_it_and_no_other() {
        let base = std::env::temp_dir().join(format!("memveil-rundir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir(&base).expect("temp dir");
        let run = base.join("memveil");
        make_runtime_dir(&base.join("elsewhere/vault.sock"), &run).expect("no-op");
        assert!(!run.exists() && !base.join("elsewhere").exists());
        make_runtime_dir(&run.join("vault.sock"), &run).expect("made");
        let mode = std::fs::metadata(&run).expect("made").permissions().mode() & 0o7777;
        // Twice is fine (a restart).
        make_runtime_dir(&run.join("vault.sock"), &run).expect("again");
        std::fs::remove_dir_all(&base).expect("cleanup");
        assert_eq!(mode, 0o755);
    }
}
