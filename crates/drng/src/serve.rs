//! `memveil rng serve`: an EGD daemon for many consumers at once.
//!
//! # Data flow
//!
//! ```text
//!  raw source ──health tests──► conditioner ──► seed producer(s) ──► fair dispatcher
//!  (rdrand|rdseed|getrandom)    (512:1 for RDRAND)  (P threads)      (round robin, 16-byte quanta)
//!                                                                      │        │
//!                                          output=seed: seeds go straight to the consumer
//!                                          output=drbg: seeds (re)seed the consumer's own
//!                                                       CTR_DRBG, which produces its bytes
//! ```
//!
//! Every connection (Unix socket or loopback TCP) is one consumer with its
//! own thread, its own counters and, in `drbg` mode, its own SP 800-90A
//! CTR_DRBG instance (AES-256 with df, personalised with the consumer id),
//! instantiated and reseeded only from seeds the dispatcher gave to that
//! consumer alone. No seed is ever given to two consumers.
//!
//! # Fairness
//!
//! When the source is the bottleneck, consumers waiting for seed bytes sit in
//! one round-robin queue; every seed a producer finishes goes to the head of
//! the queue (16 bytes, or fewer when that finishes its request), which then
//! moves to the back. Seeds are buffered (a few, [`SEED_BUFFER`]) only while
//! nobody waits. This is deficit round robin with a quantum of one seed, so
//! backlogged consumers get equal byte rates whatever their request sizes.
//! Per-consumer rate limits (token bucket) are applied before a consumer
//! joins the queue, so a limited consumer never holds a slot it cannot use.
//!
//! # Defined outcomes
//!
//! - Bad EGD input: see [`crate::egd`]; the offending connection is closed
//!   and logged, all others continue.
//! - A consumer that disconnects mid-read: the write fails (EPIPE/ECONNRESET)
//!   or the read sees EOF; the bytes generated for it are wiped, never given
//!   to anyone else, counted as `bytes_discarded`, and the consumer is marked
//!   closed with the reason.
//! - A source that starts failing (health-test quarantine or exhausted
//!   retries): it is quarantined for the life of the daemon, logged, shown in
//!   the stats; seeds it produced that were not yet served (buffered, or
//!   partial requests) are wiped, and every DRBG is reseeded from the next
//!   source before it produces another byte. With a fallback source
//!   configured (`--fallback`) serving continues from it; without one, no
//!   byte is served any more: blocking reads get the connection closed
//!   ("no healthy entropy source"), non-blocking reads get 0 bytes, the
//!   entropy level is 0, and the daemon keeps running and answering stats.
//! - RDRAND absent at start: the primary source fails to open with the error
//!   naming the CPUID bit; the daemon moves to the fallback if one was given
//!   (and says so), or refuses to start.
//! - Consumers beyond `max_consumers`: accepted and closed at once, logged.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use zeroize::{Zeroize, Zeroizing};

use crate::condition::{Conditioner, SEED_BYTES};
use crate::drbg::{DirectInput, Drbg, EntropyInput};
use crate::egd::{self, Decoder, Limits, Request};
use crate::health::{HealthChecked, HealthConfig};
use crate::source::{RawSource, SourceKind};
use crate::DrngError;

/// Seeds kept ready while no consumer waits (1 KiB).
pub const SEED_BUFFER: usize = 64;

/// Closed consumers kept in the stats.
pub const CLOSED_KEPT: usize = 64;

/// Bytes of served output a test may record per consumer
/// ([`ServeConfig::record_served`]).
pub const RECORD_LIMIT: usize = 1 << 20;

/// How long a write to a consumer may block before it is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Poll period of blocking waits (shutdown checks).
const TICK: Duration = Duration::from_millis(100);

/// What consumers receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Output {
    /// Each consumer's own CTR_DRBG stream, seeded from the pool.
    Drbg,
    /// Seed-grade bytes straight from the pool (the source is the bottleneck).
    Seed,
}

impl std::str::FromStr for Output {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "drbg" => Ok(Output::Drbg),
            "seed" => Ok(Output::Seed),
            o => Err(format!("unknown output {o:?}; outputs are drbg, seed")),
        }
    }
}

impl std::fmt::Display for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Output::Drbg => "drbg",
            Output::Seed => "seed",
        })
    }
}

/// Opens the raw source of a custom [`SeedSpec`] (tests inject faults here).
pub type RawFactory = Arc<dyn Fn() -> Result<Box<dyn RawSource>, DrngError> + Send + Sync>;

/// One entropy source the seed producers can draw on.
#[derive(Clone)]
pub struct SeedSpec {
    kind: SourceKind,
    custom: Option<RawFactory>,
    health: HealthConfig,
}

impl std::fmt::Debug for SeedSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeedSpec")
            .field("kind", &self.kind)
            .field("custom", &self.custom.is_some())
            .finish_non_exhaustive()
    }
}

impl SeedSpec {
    /// A real source: RDRAND is conditioned 512:1 (the `seed` stream);
    /// RDSEED and `getrandom(2)` are seed grade and used directly.
    #[must_use]
    pub fn real(kind: SourceKind) -> Self {
        Self {
            kind,
            custom: None,
            health: HealthConfig::for_source(kind),
        }
    }

    /// A source opened by `factory`, treated like `kind` (RDRAND-like input is
    /// conditioned 512:1).
    #[must_use]
    pub fn custom(kind: SourceKind, factory: RawFactory) -> Self {
        Self {
            kind,
            custom: Some(factory),
            health: HealthConfig::for_source(kind),
        }
    }

    /// Parses the command-line name: `seed` (RDRAND 512:1), `rdseed`,
    /// `getrandom`.
    ///
    /// # Errors
    /// An unknown name, with the list.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "seed" => Ok(Self::real(SourceKind::Rdrand)),
            "rdseed" => Ok(Self::real(SourceKind::Rdseed)),
            "getrandom" => Ok(Self::real(SourceKind::Getrandom)),
            o => Err(format!(
                "unknown seed source {o:?}; sources are seed (RDRAND conditioned 512:1), \
                 rdseed, getrandom"
            )),
        }
    }

    /// Whether the source is conditioned 512:1 before use.
    #[must_use]
    pub fn conditioned(&self) -> bool {
        self.kind == SourceKind::Rdrand
    }

    /// The source kind.
    #[must_use]
    pub fn kind(&self) -> SourceKind {
        self.kind
    }

    /// Opens the health-tested pipeline of this source.
    ///
    /// # Errors
    /// The source's failure to open (e.g. RDRAND absent).
    pub fn open(&self) -> Result<Box<dyn EntropyInput>, DrngError> {
        let raw = match &self.custom {
            Some(f) => f()?,
            None => self.kind.open()?,
        };
        let checked = HealthChecked::new(raw, self.health);
        Ok(if self.conditioned() {
            Box::new(Conditioner::new(checked))
        } else {
            Box::new(DirectInput(checked))
        })
    }
}

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Listen {
    /// A Unix stream socket at this path.
    Unix(PathBuf),
    /// TCP (loopback unless [`ServeConfig::allow_remote`]); port 0 picks one.
    Tcp(SocketAddr),
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
            Listen::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// A log sink (the CLI prints to stderr).
pub type LogFn = Arc<dyn Fn(&str) + Send + Sync>;

/// Renders the counters for the stats socket.
pub type StatsFormat = Arc<dyn Fn(&ServerStats) -> String + Send + Sync>;

/// Configuration of a [`Server`].
#[derive(Clone)]
pub struct ServeConfig {
    /// Listening endpoints (at least one).
    pub listen: Vec<Listen>,
    /// Accept TCP binds on non-loopback addresses (EGD has no
    /// authentication: anyone who can connect can drain entropy).
    pub allow_remote: bool,
    /// Permission bits of Unix sockets (default 0o600).
    pub unix_mode: u32,
    /// Seed sources: the first is used, the others are fallbacks in order.
    pub sources: Vec<SeedSpec>,
    /// What consumers receive.
    pub output: Output,
    /// DRBG: reseed before every request.
    pub prediction_resistance: bool,
    /// DRBG reseed interval in requests (at most the SP 800-90A limit).
    pub reseed_interval: u64,
    /// Per-consumer cap in bytes per second.
    pub rate_limit: Option<u64>,
    /// Per-consumer caps for the consumers of one endpoint, keyed by its
    /// name as shown in the stats (`unix:/run/vm1.sock`, `tcp:127.0.0.1:7070`);
    /// they override `rate_limit` (one socket per VM gives per-VM limits).
    pub listener_rate_limits: Vec<(String, u64)>,
    /// Connections served at once.
    pub max_consumers: usize,
    /// Per-request cap of the EGD reads.
    pub limits: Limits,
    /// Seed producer threads.
    pub producers: usize,
    /// A Unix socket that answers every connection with the stats as JSON.
    pub stats_socket: Option<PathBuf>,
    /// Period of the one-line stats summary in the log (None: off).
    pub stats_interval: Option<Duration>,
    /// Where log lines go.
    pub log: LogFn,
    /// How the stats socket renders the counters (the CLI passes JSON; the
    /// default is the one-line [`summary`]).
    pub stats_format: StatsFormat,
    /// Test hook: keep a copy of every byte served per consumer (up to
    /// [`RECORD_LIMIT`]), readable through [`Server::recorded`]. Never set by
    /// the command line: served entropy must not be kept.
    #[doc(hidden)]
    pub record_served: bool,
}

impl std::fmt::Debug for ServeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeConfig")
            .field("listen", &self.listen)
            .field("output", &self.output)
            .field("sources", &self.sources)
            .finish_non_exhaustive()
    }
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: Vec::new(),
            allow_remote: false,
            unix_mode: 0o600,
            sources: vec![SeedSpec::real(SourceKind::Rdrand)],
            output: Output::Drbg,
            prediction_resistance: false,
            reseed_interval: crate::drbg::DEFAULT_RESEED_INTERVAL,
            rate_limit: None,
            listener_rate_limits: Vec::new(),
            max_consumers: 256,
            limits: Limits::default(),
            producers: 1,
            stats_socket: None,
            stats_interval: None,
            log: Arc::new(|m| eprintln!("memveil rng serve: {m}")),
            stats_format: Arc::new(|s| summary(s) + "\n"),
            record_served: false,
        }
    }
}

/// Errors of starting the server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// Nothing to listen on.
    #[error("no listening endpoint: give --unix PATH and/or --tcp 127.0.0.1:PORT")]
    NoListener,
    /// A non-loopback TCP address without `allow_remote`.
    #[error(
        "refusing to listen on {0}: not a loopback address, and EGD has no authentication \
         (anyone who can connect can drain entropy); use 127.0.0.1/::1, or pass \
         --allow-remote to accept this"
    )]
    RemoteRefused(SocketAddr),
    /// Binding failed.
    #[error("cannot listen on {what}: {source}")]
    Bind {
        /// The endpoint.
        what: String,
        /// The cause.
        source: io::Error,
    },
    /// A live daemon already serves on the socket path.
    #[error("{0} is in use by a running server (connect succeeded); stop it or pick another path")]
    SocketInUse(PathBuf),
    /// The path exists and is not a socket.
    #[error(
        "{0} exists and is not a socket; refusing to replace it (remove it or pick another path)"
    )]
    NotASocket(PathBuf),
    /// No source could be opened.
    #[error("no usable entropy source: {0}")]
    NoSource(String),
    /// A bad option value.
    #[error("bad configuration: {0}")]
    Config(String),
}

/// State of a seed source as the stats report it.
#[derive(Debug, Clone, Serialize)]
pub struct SourceStatus {
    /// Name (`seed(rdrand 512:1 AES-CBC-MAC)`, `rdseed`, ...).
    pub name: String,
    /// `standby`, `active`, `quarantined`, `unavailable`.
    pub state: String,
    /// Why it was quarantined or could not be opened.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Counters of one consumer.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerStats {
    /// Consumer number (1, 2, ... in order of connection).
    pub id: u64,
    /// The endpoint it connected to (`unix:/path`, `tcp:127.0.0.1:7070`).
    pub listener: String,
    /// Peer address (TCP) or `unix`.
    pub peer: String,
    /// `open` or `closed`.
    pub state: String,
    /// Why it closed (EOF, disconnect, protocol error, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub close_reason: Option<String>,
    /// Seconds since it connected (until it closed).
    pub seconds: f64,
    /// Bytes delivered (written to the socket in full).
    pub bytes_served: u64,
    /// `bytes_served / seconds`.
    pub rate_bytes_per_s: f64,
    /// Bytes generated for it but not delivered (it went away); wiped.
    pub bytes_discarded: u64,
    /// Blocking reads (0x02) answered.
    pub blocking_reads: u64,
    /// Non-blocking reads (0x01) answered.
    pub nonblocking_reads: u64,
    /// Entropy-level queries (0x00).
    pub level_queries: u64,
    /// PID queries (0x04).
    pub pid_queries: u64,
    /// Entropy writes (0x03), bytes discarded uncredited.
    pub bytes_written_ignored: u64,
    /// Seed bytes drawn from the pool (instantiate/reseed in drbg mode).
    pub seed_bytes: u64,
    /// Time spent waiting for the rate limit, seconds.
    pub rate_limited_seconds: f64,
    /// This consumer's rate limit, bytes/s.
    pub rate_limit: Option<u64>,
}

/// The daemon's counters.
#[derive(Debug, Clone, Serialize)]
pub struct ServerStats {
    /// Process id.
    pub pid: u32,
    /// Seconds since start.
    pub uptime_seconds: f64,
    /// What consumers receive.
    pub output: Output,
    /// Name of the stream each consumer receives.
    pub stream: String,
    /// The source in use, if any is healthy.
    pub active_source: Option<String>,
    /// Every configured source and its state.
    pub sources: Vec<SourceStatus>,
    /// Seeds produced (16 bytes each).
    pub seeds_produced: u64,
    /// Seed bytes wiped because their source failed before they were served.
    pub seed_bytes_wiped: u64,
    /// Bytes served to all consumers.
    pub bytes_served: u64,
    /// Consumers connected now.
    pub consumers_open: u64,
    /// Consumers ever connected.
    pub consumers_total: u64,
    /// Connections refused over `max_consumers`.
    pub consumers_refused: u64,
    /// Per-consumer rate limit, bytes/s.
    pub rate_limit: Option<u64>,
    /// Open consumers and the last closed ones.
    pub consumers: Vec<ConsumerStats>,
}

// ---------------------------------------------------------------------------
// The fair dispatcher.

struct Demand {
    want: usize,
    got: Zeroizing<Vec<u8>>,
    /// Woken when this demand is complete (one condvar per waiter, so a
    /// completion wakes one thread, not all of them).
    done: Arc<Condvar>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Health {
    Serving,
    /// No healthy source left.
    Failed,
}

struct Pool {
    queue: VecDeque<u64>,
    demands: HashMap<u64, Demand>,
    buffer: Zeroizing<Vec<u8>>,
    health: Health,
    /// Index into `sources` of the source in use.
    active: usize,
    /// Bumped whenever a source is quarantined.
    epoch: u64,
    statuses: Vec<SourceStatus>,
    seeds: u64,
    wiped: u64,
}

struct Shared {
    cfg: ServeConfig,
    pool: Mutex<Pool>,
    /// Producers wait here for demand or buffer space.
    wanted: Condvar,
    shutdown: AtomicBool,
    started: Instant,
    consumers: Mutex<Consumers>,
    next_id: AtomicU64,
    refused: AtomicU64,
    served_total: AtomicU64,
    stream_name: Mutex<String>,
}

#[derive(Default)]
struct Consumers {
    open: Vec<Arc<Consumer>>,
    closed: VecDeque<Arc<Consumer>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why a consumer could not get bytes.
#[derive(Debug)]
enum Starved {
    NoSource,
    Shutdown,
}

impl Shared {
    fn new(cfg: ServeConfig, statuses: Vec<SourceStatus>) -> Self {
        Self {
            pool: Mutex::new(Pool {
                queue: VecDeque::new(),
                demands: HashMap::new(),
                buffer: Zeroizing::new(Vec::with_capacity(SEED_BUFFER * SEED_BYTES)),
                health: Health::Serving,
                active: 0,
                epoch: 0,
                statuses,
                seeds: 0,
                wiped: 0,
            }),
            wanted: Condvar::new(),
            shutdown: AtomicBool::new(false),
            started: Instant::now(),
            consumers: Mutex::new(Consumers::default()),
            next_id: AtomicU64::new(1),
            refused: AtomicU64::new(0),
            served_total: AtomicU64::new(0),
            stream_name: Mutex::new(String::new()),
            cfg,
        }
    }

    fn log(&self, m: &str) {
        (self.cfg.log)(m);
    }

    fn epoch(&self) -> u64 {
        lock(&self.pool).epoch
    }

    /// Takes exactly `out.len()` seed bytes for consumer `id`, waiting in the
    /// round-robin queue.
    fn take(&self, id: u64, out: &mut [u8]) -> Result<(), Starved> {
        let mut p = lock(&self.pool);
        if p.health == Health::Failed {
            return Err(Starved::NoSource);
        }
        let mut got = Zeroizing::new(Vec::with_capacity(out.len()));
        if p.queue.is_empty() {
            let n = out.len().min(p.buffer.len());
            let start = p.buffer.len() - n;
            got.extend_from_slice(&p.buffer[start..]);
            p.buffer[start..].zeroize();
            p.buffer.truncate(start);
            if n > 0 {
                self.wanted.notify_all();
            }
        }
        if got.len() == out.len() {
            out.copy_from_slice(&got);
            return Ok(());
        }
        let wake = Arc::new(Condvar::new());
        p.demands.insert(
            id,
            Demand {
                want: out.len(),
                got,
                done: Arc::clone(&wake),
            },
        );
        p.queue.push_back(id);
        self.wanted.notify_all();
        loop {
            let done = p.demands.get(&id).is_some_and(|d| d.got.len() == d.want);
            if done {
                if let Some(d) = p.demands.remove(&id) {
                    out.copy_from_slice(&d.got);
                }
                return Ok(());
            }
            let stop = if p.health == Health::Failed {
                Some(Starved::NoSource)
            } else if self.shutdown.load(Ordering::Relaxed) {
                Some(Starved::Shutdown)
            } else {
                None
            };
            if let Some(s) = stop {
                p.demands.remove(&id);
                p.queue.retain(|&q| q != id);
                return Err(s);
            }
            p = wake
                .wait_timeout(p, TICK)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Takes what is buffered now, at most `max` bytes, without waiting
    /// (never ahead of consumers already queued).
    fn try_take(&self, max: usize) -> Zeroizing<Vec<u8>> {
        let mut p = lock(&self.pool);
        let mut v = Zeroizing::new(Vec::new());
        if p.health == Health::Failed || !p.queue.is_empty() {
            return v;
        }
        let n = max.min(p.buffer.len());
        let start = p.buffer.len() - n;
        v.extend_from_slice(&p.buffer[start..]);
        p.buffer[start..].zeroize();
        p.buffer.truncate(start);
        self.wanted.notify_all();
        v
    }

    fn buffered_bits(&self) -> u32 {
        let p = lock(&self.pool);
        if p.health == Health::Failed {
            return 0;
        }
        u32::try_from(p.buffer.len() * 8).unwrap_or(u32::MAX)
    }

    fn healthy(&self) -> bool {
        lock(&self.pool).health == Health::Serving
    }

    /// Hands one fresh seed out: to the head of the queue, or to the buffer.
    fn deliver(&self, seed: &[u8]) {
        let mut p = lock(&self.pool);
        p.seeds += 1;
        let mut rest = seed;
        while !rest.is_empty() {
            let Some(id) = p.queue.pop_front() else {
                let room = (SEED_BUFFER * SEED_BYTES).saturating_sub(p.buffer.len());
                let n = room.min(rest.len());
                p.buffer.extend_from_slice(&rest[..n]);
                break;
            };
            let Some(d) = p.demands.get_mut(&id) else {
                continue;
            };
            let n = (d.want - d.got.len()).min(rest.len());
            d.got.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            if d.got.len() < d.want {
                p.queue.push_back(id);
            } else {
                d.done.notify_one();
            }
        }
    }

    /// Quarantines source `idx` (if still active) and moves on.
    fn source_failed(&self, idx: usize, err: &DrngError) {
        let mut p = lock(&self.pool);
        if p.active != idx || p.health == Health::Failed {
            return;
        }
        p.statuses[idx].state = "quarantined".into();
        p.statuses[idx].error = Some(err.to_string());
        // Nothing produced near the failure may be served: wipe the buffer and
        // every partly filled request.
        let mut wiped = p.buffer.len() as u64;
        p.buffer.zeroize();
        p.buffer.clear();
        for d in p.demands.values_mut() {
            wiped += d.got.len() as u64;
            d.got.zeroize();
            d.got.clear();
        }
        // A request completed just before the failure but not yet collected
        // by its consumer has left the queue; wiped, it must wait again.
        let waiting: Vec<u64> = p
            .demands
            .keys()
            .copied()
            .filter(|id| !p.queue.contains(id))
            .collect();
        p.queue.extend(waiting);
        p.wiped += wiped;
        p.epoch += 1;
        let name = p.statuses[idx].name.clone();
        drop(p);
        self.log(&format!(
            "source {name} quarantined: {err}; {wiped} unserved seed bytes wiped, every DRBG \
             will reseed before its next byte"
        ));
        self.activate_from(idx + 1);
    }

    /// Opens sources from `start` on until one works; marks the rest.
    fn activate_from(&self, start: usize) {
        let n = self.cfg.sources.len();
        for i in start..n {
            match self.cfg.sources[i].open() {
                Ok(input) => {
                    let name = input.name();
                    drop(input);
                    let mut p = lock(&self.pool);
                    p.active = i;
                    p.statuses[i].name.clone_from(&name);
                    p.statuses[i].state = "active".into();
                    drop(p);
                    if i > 0 {
                        self.log(&format!(
                            "serving from fallback source {name} (source {} of {n} configured)",
                            i + 1
                        ));
                    }
                    self.wanted.notify_all();
                    return;
                }
                Err(e) => {
                    let mut p = lock(&self.pool);
                    p.statuses[i].state = "unavailable".into();
                    p.statuses[i].error = Some(e.to_string());
                    drop(p);
                    self.log(&format!(
                        "source {} unavailable: {e}",
                        self.cfg.sources[i].kind().name()
                    ));
                }
            }
        }
        let mut p = lock(&self.pool);
        p.health = Health::Failed;
        p.active = n;
        for d in p.demands.values() {
            d.done.notify_one();
        }
        drop(p);
        self.log(
            "no healthy entropy source left: no byte will be served; blocking readers are \
             disconnected; restart the daemon once the source is fixed",
        );
    }

    fn producer(self: &Arc<Self>) {
        let mut current: Option<(usize, Box<dyn EntropyInput>)> = None;
        let mut seed = Zeroizing::new([0u8; SEED_BYTES]);
        loop {
            // Wait for work: demand, or room in the buffer.
            let active = {
                let mut p = lock(&self.pool);
                loop {
                    if self.shutdown.load(Ordering::Relaxed) || p.health == Health::Failed {
                        return;
                    }
                    if !p.queue.is_empty()
                        || p.buffer.len() + SEED_BYTES <= SEED_BUFFER * SEED_BYTES
                    {
                        break;
                    }
                    p = self
                        .wanted
                        .wait_timeout(p, TICK)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                p.active
            };
            if current.as_ref().is_none_or(|(i, _)| *i != active) {
                current = match self.cfg.sources[active].open() {
                    Ok(inp) => Some((active, inp)),
                    Err(e) => {
                        self.source_failed(active, &e);
                        continue;
                    }
                };
            }
            let Some((idx, input)) = current.as_mut() else {
                continue;
            };
            match input.get(&mut seed[..]) {
                Ok(()) => {
                    // A quarantine decided meanwhile by another producer
                    // makes this seed suspect too.
                    if lock(&self.pool).active == *idx {
                        self.deliver(&seed[..]);
                    }
                }
                Err(e) => {
                    let i = *idx;
                    current = None;
                    self.source_failed(i, &e);
                }
            }
            seed.zeroize();
        }
    }
}

/// The DRBG's entropy input: seeds for one consumer from the dispatcher.
struct PoolInput {
    shared: Arc<Shared>,
    consumer: Arc<Consumer>,
}

impl EntropyInput for PoolInput {
    fn name(&self) -> String {
        let p = lock(&self.shared.pool);
        match p.statuses.get(p.active) {
            Some(s) => format!("pool({})", s.name),
            None => "pool(no healthy source)".into(),
        }
    }

    fn get(&mut self, out: &mut [u8]) -> Result<(), DrngError> {
        match self.shared.take(self.consumer.id, out) {
            Ok(()) => {
                self.consumer
                    .seed_bytes
                    .fetch_add(out.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(_) => Err(DrngError::Exhausted {
                name: "pool (no healthy entropy source)".into(),
                attempts: 0,
            }),
        }
    }
}

// ---------------------------------------------------------------------------
// Consumers.

struct Consumer {
    id: u64,
    listener: String,
    rate_limit: Option<u64>,
    peer: String,
    connected: Instant,
    closed_after: Mutex<Option<(Duration, String)>>,
    bytes_served: AtomicU64,
    bytes_discarded: AtomicU64,
    blocking_reads: AtomicU64,
    nonblocking_reads: AtomicU64,
    level_queries: AtomicU64,
    pid_queries: AtomicU64,
    bytes_written_ignored: AtomicU64,
    seed_bytes: AtomicU64,
    limited_ns: AtomicU64,
    recorded: Mutex<Vec<u8>>,
}

impl Consumer {
    fn stats(&self) -> ConsumerStats {
        let closed = lock(&self.closed_after).clone();
        let secs = closed
            .as_ref()
            .map_or_else(|| self.connected.elapsed(), |(d, _)| *d)
            .as_secs_f64();
        let served = self.bytes_served.load(Ordering::Relaxed);
        #[allow(clippy::cast_precision_loss)]
        let rate = if secs > 0.0 {
            served as f64 / secs
        } else {
            0.0
        };
        #[allow(clippy::cast_precision_loss)]
        let limited = self.limited_ns.load(Ordering::Relaxed) as f64 / 1e9;
        ConsumerStats {
            id: self.id,
            listener: self.listener.clone(),
            peer: self.peer.clone(),
            state: if closed.is_some() { "closed" } else { "open" }.into(),
            close_reason: closed.map(|(_, r)| r),
            seconds: secs,
            bytes_served: served,
            rate_bytes_per_s: rate,
            bytes_discarded: self.bytes_discarded.load(Ordering::Relaxed),
            blocking_reads: self.blocking_reads.load(Ordering::Relaxed),
            nonblocking_reads: self.nonblocking_reads.load(Ordering::Relaxed),
            level_queries: self.level_queries.load(Ordering::Relaxed),
            pid_queries: self.pid_queries.load(Ordering::Relaxed),
            bytes_written_ignored: self.bytes_written_ignored.load(Ordering::Relaxed),
            seed_bytes: self.seed_bytes.load(Ordering::Relaxed),
            rate_limited_seconds: limited,
            rate_limit: self.rate_limit,
        }
    }
}

trait Conn: Read + Write + Send {
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()>;
}

impl Conn for UnixStream {
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(read))?;
        self.set_write_timeout(Some(write))
    }
}

impl Conn for TcpStream {
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.set_nodelay(true)?;
        self.set_read_timeout(Some(read))?;
        self.set_write_timeout(Some(write))
    }
}

/// Token bucket of one consumer.
struct Bucket {
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(rate: u64) -> Self {
        #[allow(clippy::cast_precision_loss)]
        let rate = rate as f64;
        Self {
            rate,
            // Start with a full second of burst.
            tokens: rate,
            last: Instant::now(),
        }
    }

    /// Waits until `n` bytes may be sent; false on shutdown.
    fn acquire(&mut self, n: usize, shared: &Shared, c: &Consumer) -> bool {
        #[allow(clippy::cast_precision_loss)]
        let need = n as f64;
        let burst = self.rate.max(egd::MAX_COUNT as f64);
        loop {
            let now = Instant::now();
            self.tokens =
                (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(burst);
            self.last = now;
            if self.tokens >= need {
                self.tokens -= need;
                return true;
            }
            if shared.shutdown.load(Ordering::Relaxed) {
                return false;
            }
            let wait = Duration::from_secs_f64(((need - self.tokens) / self.rate).min(0.1));
            std::thread::sleep(wait);
            #[allow(clippy::cast_possible_truncation)]
            let ns = wait.as_nanos().min(u128::from(u64::MAX)) as u64;
            c.limited_ns.fetch_add(ns, Ordering::Relaxed);
        }
    }
}

enum Gen {
    Drbg { drbg: Box<Drbg>, epoch: u64 },
    Seed,
}

struct Session<'a> {
    shared: &'a Arc<Shared>,
    c: &'a Arc<Consumer>,
    gen: Option<Gen>,
    bucket: Option<Bucket>,
}

/// Outcome of serving one request.
enum Step {
    Continue,
    Close(String),
}

impl Session<'_> {
    /// Produces exactly `out.len()` bytes of this consumer's stream.
    fn produce(&mut self, out: &mut [u8]) -> Result<(), String> {
        if self.gen.is_none() {
            self.gen = Some(match self.shared.cfg.output {
                Output::Seed => Gen::Seed,
                Output::Drbg => {
                    let epoch = self.shared.epoch();
                    let input = PoolInput {
                        shared: Arc::clone(self.shared),
                        consumer: Arc::clone(self.c),
                    };
                    let pers = format!(
                        "memveil-egd consumer {} pid {}",
                        self.c.id,
                        std::process::id()
                    );
                    let mut d = Drbg::new(
                        Box::new(input),
                        self.shared.cfg.prediction_resistance,
                        pers.as_bytes(),
                    )
                    .map_err(|e| format!("DRBG instantiation failed: {e}"))?;
                    d.set_reseed_interval(self.shared.cfg.reseed_interval);
                    Gen::Drbg {
                        drbg: Box::new(d),
                        epoch,
                    }
                }
            });
        }
        match self.gen.as_mut() {
            Some(Gen::Seed) => match self.shared.take(self.c.id, out) {
                Ok(()) => {
                    self.c
                        .seed_bytes
                        .fetch_add(out.len() as u64, Ordering::Relaxed);
                    Ok(())
                }
                Err(Starved::NoSource) => Err("no healthy entropy source".into()),
                Err(Starved::Shutdown) => Err("daemon shutting down".into()),
            },
            Some(Gen::Drbg { drbg, epoch }) => {
                let now = self.shared.epoch();
                if now != *epoch {
                    drbg.reseed(b"source quarantined")
                        .map_err(|_| "no healthy entropy source".to_string())?;
                    *epoch = now;
                }
                if !self.shared.healthy() {
                    return Err("no healthy entropy source".into());
                }
                drbg.fill(out)
                    .map_err(|_| "no healthy entropy source".to_string())
            }
            None => Err("internal: no generator".into()),
        }
    }

    fn send(&mut self, conn: &mut dyn Conn, bytes: &[u8], payload: usize) -> Step {
        match conn.write_all(bytes) {
            Ok(()) => {
                self.c
                    .bytes_served
                    .fetch_add(payload as u64, Ordering::Relaxed);
                self.shared
                    .served_total
                    .fetch_add(payload as u64, Ordering::Relaxed);
                if self.shared.cfg.record_served {
                    let mut r = lock(&self.c.recorded);
                    let room = RECORD_LIMIT.saturating_sub(r.len());
                    let p = &bytes[bytes.len() - payload..];
                    r.extend_from_slice(&p[..room.min(p.len())]);
                }
                Step::Continue
            }
            Err(e) => {
                self.c
                    .bytes_discarded
                    .fetch_add(payload as u64, Ordering::Relaxed);
                Step::Close(format!(
                    "consumer went away mid-read ({e}); {payload} bytes wiped"
                ))
            }
        }
    }

    fn handle(&mut self, conn: &mut dyn Conn, req: Request) -> Step {
        let mut reply = Zeroizing::new(Vec::with_capacity(egd::MAX_COUNT + 1));
        match req {
            Request::EntropyLevel => {
                self.c.level_queries.fetch_add(1, Ordering::Relaxed);
                let bits = match self.shared.cfg.output {
                    Output::Seed => self.shared.buffered_bits(),
                    Output::Drbg if self.shared.healthy() => {
                        u32::try_from(8 * egd::MAX_COUNT).unwrap_or(0)
                    }
                    Output::Drbg => 0,
                };
                egd::encode_entropy_level(bits, &mut reply);
                self.send(conn, &reply, 0)
            }
            Request::ReportPid => {
                self.c.pid_queries.fetch_add(1, Ordering::Relaxed);
                egd::encode_pid(std::process::id(), &mut reply);
                self.send(conn, &reply, 0)
            }
            Request::WriteEntropy { mut data, .. } => {
                self.c
                    .bytes_written_ignored
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                data.zeroize();
                Step::Continue
            }
            Request::ReadBlocking { len } => {
                let n = match self.shared.cfg.limits.admit_read(len, true) {
                    Ok(n) => usize::from(n),
                    Err(e) => return Step::Close(e.to_string()),
                };
                if let Some(b) = self.bucket.as_mut() {
                    if !b.acquire(n, self.shared, self.c) {
                        return Step::Close("daemon shutting down".into());
                    }
                }
                reply.resize(n, 0);
                if let Err(why) = self.produce(&mut reply) {
                    return Step::Close(why);
                }
                self.c.blocking_reads.fetch_add(1, Ordering::Relaxed);
                self.send(conn, &reply, n)
            }
            Request::ReadNonBlocking { len } => {
                let cap = usize::from(self.shared.cfg.limits.admit_read(len, false).unwrap_or(0));
                let mut data = match self.shared.cfg.output {
                    Output::Seed => self.shared.try_take(cap),
                    Output::Drbg => {
                        let mut v = Zeroizing::new(vec![0u8; cap]);
                        if self.shared.healthy() && self.produce(&mut v).is_ok() {
                            v
                        } else {
                            Zeroizing::new(Vec::new())
                        }
                    }
                };
                if let Some(b) = self.bucket.as_mut() {
                    if !b.acquire(data.len(), self.shared, self.c) {
                        return Step::Close("daemon shutting down".into());
                    }
                }
                let n = data.len();
                if egd::encode_nonblocking(&data, &mut reply).is_err() {
                    return Step::Close("internal: non-blocking answer too long".into());
                }
                data.zeroize();
                self.c.nonblocking_reads.fetch_add(1, Ordering::Relaxed);
                self.send(conn, &reply, n)
            }
        }
    }
}

fn serve_conn(shared: &Arc<Shared>, c: &Arc<Consumer>, conn: &mut dyn Conn) -> String {
    if let Err(e) = conn.set_timeouts(TICK, WRITE_TIMEOUT) {
        return format!("socket setup failed: {e}");
    }
    let mut s = Session {
        shared,
        c,
        gen: None,
        bucket: c.rate_limit.map(Bucket::new),
    };
    let mut dec = Decoder::new();
    let mut buf = [0u8; 512];
    let mut reqs = Vec::new();
    loop {
        if shared.shutdown.load(Ordering::Relaxed) {
            return "daemon shutting down".into();
        }
        let n = match conn.read(&mut buf) {
            Ok(0) => {
                return match dec.finish() {
                    Ok(()) => "consumer closed the connection".into(),
                    Err(e) => e.to_string(),
                };
            }
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return format!("consumer went away ({e})"),
        };
        let fed = dec.feed(&buf[..n], &mut reqs);
        buf[..n].zeroize();
        for req in reqs.drain(..) {
            if let Step::Close(why) = s.handle(conn, req) {
                return why;
            }
        }
        if let Err(e) = fed {
            return e.to_string();
        }
    }
}

// ---------------------------------------------------------------------------
// The server.

/// A running daemon. Dropping it stops every thread and removes its sockets.
pub struct Server {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    tcp_addrs: Vec<SocketAddr>,
    unix_paths: Vec<PathBuf>,
}

enum Bound {
    Unix(UnixListener, String),
    Tcp(TcpListener, String),
}

fn bind_unix(path: &Path, mode: u32) -> Result<UnixListener, ServeError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(ServeError::SocketInUse(path.to_path_buf()));
            }
            std::fs::remove_file(path).map_err(|source| ServeError::Bind {
                what: format!("unix:{} (removing the stale socket)", path.display()),
                source,
            })?;
        }
        Ok(_) => return Err(ServeError::NotASocket(path.to_path_buf())),
        Err(_) => {}
    }
    let l = UnixListener::bind(path).map_err(|source| ServeError::Bind {
        what: format!("unix:{}", path.display()),
        source,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|source| {
        ServeError::Bind {
            what: format!("unix:{} (chmod {mode:o})", path.display()),
            source,
        }
    })?;
    Ok(l)
}

impl Server {
    /// Checks the configuration, opens the first usable source, binds every
    /// endpoint and starts serving.
    ///
    /// # Errors
    /// [`ServeError`] naming the endpoint or source and the fix.
    pub fn start(cfg: ServeConfig) -> Result<Server, ServeError> {
        if cfg.listen.is_empty() {
            return Err(ServeError::NoListener);
        }
        if cfg.sources.is_empty() {
            return Err(ServeError::Config("no seed source given".into()));
        }
        if cfg.producers == 0 || cfg.producers > 64 {
            return Err(ServeError::Config(format!(
                "--producers {} (1..=64)",
                cfg.producers
            )));
        }
        if cfg.max_consumers == 0 {
            return Err(ServeError::Config("--max-consumers 0".into()));
        }
        if cfg.limits.max_read == 0 {
            return Err(ServeError::Config("--max-request 0 (1..=255)".into()));
        }
        if cfg.rate_limit == Some(0) {
            return Err(ServeError::Config(
                "--rate-limit 0: leave it out for no limit".into(),
            ));
        }
        let names: Vec<String> = cfg.listen.iter().map(ToString::to_string).collect();
        for (l, r) in &cfg.listener_rate_limits {
            if *r == 0 {
                return Err(ServeError::Config(format!(
                    "--rate-limit-on {l}=0: leave it out for no limit"
                )));
            }
            if !names.contains(l) {
                return Err(ServeError::Config(format!(
                    "--rate-limit-on {l}: no such endpoint; endpoints are {}",
                    names.join(", ")
                )));
            }
        }
        if cfg.reseed_interval == 0 || cfg.reseed_interval > crate::drbg::MAX_RESEED_INTERVAL {
            return Err(ServeError::Config(format!(
                "reseed interval {} (1..=2^48 requests, SP 800-90A)",
                cfg.reseed_interval
            )));
        }
        for l in &cfg.listen {
            if let Listen::Tcp(a) = l {
                if !a.ip().is_loopback() && !cfg.allow_remote {
                    return Err(ServeError::RemoteRefused(*a));
                }
            }
        }
        let statuses = cfg
            .sources
            .iter()
            .map(|s| SourceStatus {
                name: s.kind().name().into(),
                state: "standby".into(),
                error: None,
            })
            .collect();
        let shared = Arc::new(Shared::new(cfg, statuses));
        shared.activate_from(0);
        {
            let p = lock(&shared.pool);
            if p.health == Health::Failed {
                let why: Vec<String> = p
                    .statuses
                    .iter()
                    .map(|s| format!("{}: {}", s.name, s.error.as_deref().unwrap_or("?")))
                    .collect();
                return Err(ServeError::NoSource(why.join("; ")));
            }
            let src = p.statuses[p.active].name.clone();
            *lock(&shared.stream_name) = match shared.cfg.output {
                Output::Seed => format!("seed-grade bytes from {src}"),
                Output::Drbg => format!(
                    "CTR_DRBG AES-256 df per consumer{}, seeded from {src}",
                    if shared.cfg.prediction_resistance {
                        " with prediction resistance"
                    } else {
                        ""
                    }
                ),
            };
        }

        let mut bound = Vec::new();
        let mut tcp_addrs = Vec::new();
        let mut unix_paths = Vec::new();
        let cleanup = |paths: &[PathBuf]| {
            for p in paths {
                drop(std::fs::remove_file(p));
            }
        };
        for l in &shared.cfg.listen {
            match l {
                Listen::Unix(p) => match bind_unix(p, shared.cfg.unix_mode) {
                    Ok(u) => {
                        unix_paths.push(p.clone());
                        bound.push(Bound::Unix(u, l.to_string()));
                    }
                    Err(e) => {
                        cleanup(&unix_paths);
                        return Err(e);
                    }
                },
                Listen::Tcp(a) => match TcpListener::bind(a) {
                    Ok(t) => {
                        let local = t.local_addr().unwrap_or(*a);
                        if !local.ip().is_loopback() {
                            shared.log(&format!(
                                "WARNING: listening on non-loopback {local} (--allow-remote): EGD has \
                                 no authentication; anyone who can connect can drain entropy"
                            ));
                        }
                        tcp_addrs.push(local);
                        bound.push(Bound::Tcp(t, format!("tcp:{local}")));
                    }
                    Err(source) => {
                        cleanup(&unix_paths);
                        return Err(ServeError::Bind {
                            what: l.to_string(),
                            source,
                        });
                    }
                },
            }
        }
        let mut stats_listener = None;
        if let Some(p) = &shared.cfg.stats_socket {
            match bind_unix(p, shared.cfg.unix_mode) {
                Ok(u) => {
                    unix_paths.push(p.clone());
                    stats_listener = Some(u);
                }
                Err(e) => {
                    cleanup(&unix_paths);
                    return Err(e);
                }
            }
        }

        let mut threads = Vec::new();
        for i in 0..shared.cfg.producers {
            let s = Arc::clone(&shared);
            threads.push(spawn(&format!("egd-producer-{i}"), move || s.producer()));
        }
        for b in bound {
            let s = Arc::clone(&shared);
            threads.push(spawn("egd-accept", move || accept_loop(&s, b)));
        }
        if let Some(u) = stats_listener {
            let s = Arc::clone(&shared);
            threads.push(spawn("egd-stats", move || stats_loop(&s, &u)));
        }
        if let Some(iv) = shared.cfg.stats_interval {
            let s = Arc::clone(&shared);
            threads.push(spawn("egd-stats-log", move || {
                let mut last = Instant::now();
                while !s.shutdown.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    if last.elapsed() >= iv {
                        last = Instant::now();
                        s.log(&summary(&stats_of(&s)));
                    }
                }
            }));
        }
        let names: Vec<String> = shared.cfg.listen.iter().map(ToString::to_string).collect();
        shared.log(&format!(
            "serving {} on {} (pid {}, max {} consumers{})",
            lock(&shared.stream_name),
            names.join(", "),
            std::process::id(),
            shared.cfg.max_consumers,
            shared
                .cfg
                .rate_limit
                .map(|r| format!(", {r} B/s per consumer"))
                .unwrap_or_default()
        ));
        Ok(Server {
            shared,
            threads,
            tcp_addrs,
            unix_paths,
        })
    }

    /// The bound TCP addresses (to learn a port picked with `:0`).
    #[must_use]
    pub fn tcp_addrs(&self) -> &[SocketAddr] {
        &self.tcp_addrs
    }

    /// The counters now.
    #[must_use]
    pub fn stats(&self) -> ServerStats {
        stats_of(&self.shared)
    }

    /// Bytes served to consumer `id` (only with the `record_served` test hook).
    #[must_use]
    pub fn recorded(&self, id: u64) -> Option<Vec<u8>> {
        let all = lock(&self.shared.consumers);
        all.open
            .iter()
            .chain(all.closed.iter())
            .find(|c| c.id == id)
            .map(|c| lock(&c.recorded).clone())
    }

    /// Blocks until [`Server::shutdown`] is called from another thread.
    pub fn wait(&self) {
        while !self.shared.shutdown.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Blocks until `stop` is raised (e.g. by [`stop_on_signals`]) or the
    /// server is shut down, polling every 100 ms.
    pub fn wait_until(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) && !self.shared.shutdown.load(Ordering::Relaxed) {
            std::thread::sleep(TICK);
        }
    }

    /// Stops accepting, closes every consumer and joins the threads.
    pub fn shutdown(&mut self) {
        if self.shared.shutdown.swap(true, Ordering::SeqCst) {
            return;
        }
        for d in lock(&self.shared.pool).demands.values() {
            d.done.notify_one();
        }
        self.shared.wanted.notify_all();
        for p in &self.unix_paths {
            drop(UnixStream::connect(p));
        }
        for a in &self.tcp_addrs {
            let a = if a.ip().is_unspecified() {
                SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), a.port())
            } else {
                *a
            };
            drop(TcpStream::connect_timeout(&a, Duration::from_millis(200)));
        }
        for t in self.threads.drain(..) {
            drop(t.join());
        }
        for p in &self.unix_paths {
            drop(std::fs::remove_file(p));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .unwrap_or_else(|e| {
            // Thread creation fails only under resource exhaustion; run inline
            // is impossible here, so report and continue without it.
            eprintln!("memveil rng serve: cannot start thread {name}: {e}");
            std::thread::spawn(|| {})
        })
}

fn accept_loop(shared: &Arc<Shared>, b: Bound) {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    loop {
        let accepted: io::Result<(Box<dyn Conn>, String)> = match &b {
            Bound::Unix(l, _) => l
                .accept()
                .map(|(s, _)| (Box::new(s) as Box<dyn Conn>, "unix".to_string())),
            Bound::Tcp(l, _) => l
                .accept()
                .map(|(s, a)| (Box::new(s) as Box<dyn Conn>, a.to_string())),
        };
        if shared.shutdown.load(Ordering::Relaxed) {
            break;
        }
        conns.retain(|h| !h.is_finished());
        let (mut conn, peer) = match accepted {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                shared.log(&format!("accept failed: {e}"));
                std::thread::sleep(TICK);
                continue;
            }
        };
        let listener = match &b {
            Bound::Unix(_, n) | Bound::Tcp(_, n) => n.clone(),
        };
        let open = lock(&shared.consumers).open.len();
        if open >= shared.cfg.max_consumers {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            shared.log(&format!(
                "refused a consumer on {listener} from {peer}: {open} consumers connected, the \
                 limit (--max-consumers {})",
                shared.cfg.max_consumers
            ));
            drop(conn);
            continue;
        }
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let rate_limit = shared
            .cfg
            .listener_rate_limits
            .iter()
            .find(|(l, _)| *l == listener)
            .map(|(_, r)| *r)
            .or(shared.cfg.rate_limit);
        let c = Arc::new(Consumer {
            id,
            listener,
            rate_limit,
            peer,
            connected: Instant::now(),
            closed_after: Mutex::new(None),
            bytes_served: AtomicU64::new(0),
            bytes_discarded: AtomicU64::new(0),
            blocking_reads: AtomicU64::new(0),
            nonblocking_reads: AtomicU64::new(0),
            level_queries: AtomicU64::new(0),
            pid_queries: AtomicU64::new(0),
            bytes_written_ignored: AtomicU64::new(0),
            seed_bytes: AtomicU64::new(0),
            limited_ns: AtomicU64::new(0),
            recorded: Mutex::new(Vec::new()),
        });
        lock(&shared.consumers).open.push(Arc::clone(&c));
        let s = Arc::clone(shared);
        conns.push(spawn(&format!("egd-consumer-{id}"), move || {
            let why = serve_conn(&s, &c, conn.as_mut());
            drop(conn);
            *lock(&c.closed_after) = Some((c.connected.elapsed(), why.clone()));
            s.log(&format!(
                "consumer {} ({} {}) closed after {} bytes: {why}",
                c.id,
                c.listener,
                c.peer,
                c.bytes_served.load(Ordering::Relaxed)
            ));
            let mut all = lock(&s.consumers);
            all.open.retain(|o| o.id != c.id);
            all.closed.push_back(c);
            while all.closed.len() > CLOSED_KEPT {
                all.closed.pop_front();
            }
        }));
    }
    for h in conns {
        drop(h.join());
    }
}

fn stats_loop(shared: &Arc<Shared>, l: &UnixListener) {
    for s in l.incoming() {
        if shared.shutdown.load(Ordering::Relaxed) {
            break;
        }
        if let Ok(mut s) = s {
            drop(s.set_write_timeout(Some(Duration::from_secs(2))));
            let st = stats_of(shared);
            let text = (shared.cfg.stats_format)(&st);
            drop(s.write_all(text.as_bytes()));
        }
    }
}

fn stats_of(shared: &Shared) -> ServerStats {
    let (active, sources, seeds, wiped) = {
        let p = lock(&shared.pool);
        let active = (p.health == Health::Serving)
            .then(|| p.statuses.get(p.active).map(|s| s.name.clone()))
            .flatten();
        (active, p.statuses.clone(), p.seeds, p.wiped)
    };
    let all = lock(&shared.consumers);
    let consumers: Vec<ConsumerStats> = all
        .closed
        .iter()
        .chain(all.open.iter())
        .map(|c| c.stats())
        .collect();
    let mut sorted = consumers;
    sorted.sort_by_key(|c| c.id);
    let bytes_served = shared.served_total.load(Ordering::Relaxed);
    ServerStats {
        pid: std::process::id(),
        uptime_seconds: shared.started.elapsed().as_secs_f64(),
        output: shared.cfg.output,
        stream: lock(&shared.stream_name).clone(),
        active_source: active,
        sources,
        seeds_produced: seeds,
        seed_bytes_wiped: wiped,
        bytes_served,
        consumers_open: all.open.len() as u64,
        consumers_total: shared.next_id.load(Ordering::Relaxed) - 1,
        consumers_refused: shared.refused.load(Ordering::Relaxed),
        rate_limit: shared.cfg.rate_limit,
        consumers: sorted,
    }
}

/// A flag raised by SIGINT or SIGTERM, so the daemon can shut down cleanly
/// (close consumers, remove its sockets, print its counters). `None` when
/// the handlers cannot be installed.
#[must_use]
pub fn stop_on_signals() -> Option<&'static AtomicBool> {
    memveil_sys::stopflag::stop_on_interrupt().ok()
}

/// One log line of the counters.
#[must_use]
pub fn summary(s: &ServerStats) -> String {
    let mut line = format!(
        "stats: source {} | {} open / {} total consumers | {} bytes served | {} seeds",
        s.active_source
            .as_deref()
            .unwrap_or("NONE (no healthy source)"),
        s.consumers_open,
        s.consumers_total,
        s.bytes_served,
        s.seeds_produced
    );
    for c in s.consumers.iter().filter(|c| c.state == "open") {
        line.push_str(&format!(
            " | #{} {} {:.0} B/s",
            c.id, c.bytes_served, c.rate_bytes_per_s
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egd::Client;
    use crate::source::TestPattern;

    fn quiet() -> LogFn {
        Arc::new(|_| {})
    }

    fn sock(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!(
            "memveil-egd-unit-{}-{name}.sock",
            std::process::id()
        ))
    }

    fn pattern_spec() -> SeedSpec {
        SeedSpec::custom(
            SourceKind::Getrandom,
            Arc::new(|| Ok(Box::new(TestPattern::new(42)) as Box<dyn RawSource>)),
        )
    }

    #[test]
    fn remote_bind_refused_without_flag() {
        let cfg = ServeConfig {
            listen: vec![Listen::Tcp("0.0.0.0:0".parse().expect("addr"))],
            sources: vec![pattern_spec()],
            log: quiet(),
            ..ServeConfig::default()
        };
        let e = Server::start(cfg).err().expect("refused");
        assert!(matches!(e, ServeError::RemoteRefused(_)), "{e}");
        assert!(e.to_string().contains("--allow-remote"));
    }

    #[test]
    fn not_a_socket_is_not_replaced() {
        let p = sock("regular");
        std::fs::write(&p, b"keep me").expect("write");
        let cfg = ServeConfig {
            listen: vec![Listen::Unix(p.clone())],
            sources: vec![pattern_spec()],
            log: quiet(),
            ..ServeConfig::default()
        };
        let e = Server::start(cfg).err().expect("refused");
        assert!(matches!(e, ServeError::NotASocket(_)), "{e}");
        assert_eq!(std::fs::read(&p).expect("still there"), b"keep me");
        std::fs::remove_file(&p).expect("cleanup");
    }

    #[test]
    fn bad_configuration_is_named() {
        let base = || ServeConfig {
            listen: vec![Listen::Unix(sock("cfg"))],
            sources: vec![pattern_spec()],
            log: quiet(),
            ..ServeConfig::default()
        };
        let cases: Vec<(ServeConfig, &str)> = vec![
            (
                ServeConfig {
                    listen: vec![],
                    ..base()
                },
                "--unix PATH",
            ),
            (
                ServeConfig {
                    producers: 0,
                    ..base()
                },
                "--producers 0",
            ),
            (
                ServeConfig {
                    rate_limit: Some(0),
                    ..base()
                },
                "--rate-limit 0",
            ),
            (
                ServeConfig {
                    limits: Limits { max_read: 0 },
                    ..base()
                },
                "--max-request 0",
            ),
            (
                ServeConfig {
                    reseed_interval: 0,
                    ..base()
                },
                "reseed interval 0",
            ),
        ];
        for (cfg, want) in cases {
            let e = Server::start(cfg).err().expect("refused");
            assert!(e.to_string().contains(want), "{e} lacks {want}");
        }
        let e = Server::start(ServeConfig {
            listen: vec![Listen::Unix(PathBuf::from("/nonexistent-dir/x.sock"))],
            ..base()
        })
        .err()
        .expect("refused");
        assert!(e.to_string().contains("/nonexistent-dir/x.sock"), "{e}");
    }

    #[test]
    fn live_socket_refused_stale_socket_replaced() {
        let p = sock("live");
        let cfg = || ServeConfig {
            listen: vec![Listen::Unix(p.clone())],
            sources: vec![pattern_spec()],
            log: quiet(),
            ..ServeConfig::default()
        };
        let first = Server::start(cfg()).expect("first");
        let e = Server::start(cfg()).err().expect("in use");
        assert!(matches!(e, ServeError::SocketInUse(_)), "{e}");
        drop(first);
        // A stale socket file (no listener) is replaced.
        let stale = std::os::unix::net::UnixListener::bind(&p).expect("bind");
        drop(stale);
        assert!(p.exists());
        let again = Server::start(cfg()).expect("stale socket replaced");
        drop(again);
        assert!(!p.exists(), "socket removed at shutdown");
    }

    /// Regression: a request completed just before a source failure (not yet
    /// collected, so no longer queued) was wiped and then never refilled,
    /// leaving its consumer blocked for good (seen once under CPU stress in
    /// `failing_source_is_quarantined_and_fallback_serves`).
    #[test]
    fn completed_but_uncollected_request_wiped_by_failure_is_requeued() {
        let p = sock("requeue");
        let srv = Server::start(ServeConfig {
            listen: vec![Listen::Unix(p)],
            sources: vec![pattern_spec(), pattern_spec()],
            output: Output::Seed,
            log: quiet(),
            ..ServeConfig::default()
        })
        .expect("start");
        let sh = &srv.shared;
        let wake = Arc::new(Condvar::new());
        {
            let mut pool = lock(&sh.pool);
            pool.demands.insert(
                999,
                Demand {
                    want: 16,
                    got: Zeroizing::new(vec![0xaa; 16]),
                    done: Arc::clone(&wake),
                },
            );
        }
        sh.source_failed(
            0,
            &DrngError::Exhausted {
                name: "test".into(),
                attempts: 1,
            },
        );
        let t = Instant::now();
        loop {
            let pool = lock(&sh.pool);
            let d = pool.demands.get(&999).expect("still there");
            if d.got.len() == 16 {
                assert_ne!(&d.got[..], &[0xaa; 16], "refilled from the fallback");
                break;
            }
            drop(pool);
            assert!(t.elapsed() < Duration::from_secs(5), "never refilled");
            std::thread::sleep(Duration::from_millis(10));
        }
        lock(&sh.pool).demands.remove(&999);
    }

    /// The dispatcher alone (no producer threads, no sockets): four backlogged
    /// consumers of different request sizes, seeds delivered one by one, each
    /// tagged; round robin gives every consumer every fourth seed.
    #[test]
    fn round_robin_hands_each_backlogged_consumer_every_nth_seed() {
        let sh = Arc::new(Shared::new(ServeConfig::default(), Vec::new()));
        let sizes = [160usize, 160, 160, 160];
        let mut hs = Vec::new();
        for (id, &n) in sizes.iter().enumerate() {
            let sh = Arc::clone(&sh);
            hs.push(std::thread::spawn(move || {
                let mut out = vec![0u8; n];
                sh.take(id as u64, &mut out).map(|()| out).ok()
            }));
        }
        let t = Instant::now();
        while lock(&sh.pool).queue.len() < sizes.len() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "consumers never queued"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let order: Vec<u64> = lock(&sh.pool).queue.iter().copied().collect();
        for i in 0..40u8 {
            sh.deliver(&[i; SEED_BYTES]);
        }
        for (id, h) in hs.into_iter().enumerate() {
            let got = h.join().expect("join").expect("served");
            let pos = order.iter().position(|&q| q == id as u64).expect("queued");
            let tags: Vec<u8> = got.chunks(SEED_BYTES).map(|c| c[0]).collect();
            let want: Vec<u8> = (0..10u8)
                .map(|k| k * 4 + u8::try_from(pos).unwrap_or(0))
                .collect();
            assert_eq!(tags, want, "consumer {id} (queue position {pos})");
        }
        assert!(lock(&sh.pool).buffer.is_empty());
    }

    #[test]
    fn seed_mode_serves_over_unix_and_counts() {
        let p = sock("seed");
        let cfg = ServeConfig {
            listen: vec![Listen::Unix(p.clone())],
            sources: vec![pattern_spec()],
            output: Output::Seed,
            log: quiet(),
            ..ServeConfig::default()
        };
        let srv = Server::start(cfg).expect("start");
        let mut c = Client::new(UnixStream::connect(&p).expect("connect"));
        let mut out = vec![0u8; 1000];
        c.read_blocking(&mut out).expect("read");
        assert!(out.iter().any(|&b| b != 0));
        let pid = c.pid().expect("pid");
        assert_eq!(pid, std::process::id().to_string());
        let st = srv.stats();
        assert_eq!(st.consumers[0].bytes_served, 1000);
        assert_eq!(st.consumers[0].pid_queries, 1);
        assert!(st.seeds_produced >= 1000 / 16);
    }
}
