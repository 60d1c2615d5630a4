//! `memveil rng serve`: an EGD daemon for many consumers at once.
//!
//! This module holds the configuration, the errors and the statistics;
//! `dispatch` the seed pool, its producers and the fair queue; `consumer`
//! each connection's session; `server` the sockets, the threads and their
//! end; `tests` the unit tests.
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

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::condition::Conditioner;
use crate::drbg::{DirectInput, EntropyInput};
use crate::egd::Limits;
use crate::health::{HealthChecked, HealthConfig};
use crate::source::{RawSource, SourceKind};
use crate::DrngError;

mod consumer;
mod dispatch;
mod server;
#[cfg(test)]
mod tests;

pub use server::{stop_on_signals, summary, Server};

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Something other than a socket is at the path (what, in words): left
    /// as it is.
    #[error(
        "socket {0}: {1} is there, not a socket; refusing to replace it (remove it yourself if \
         nothing needs it, or choose another --unix path)"
    )]
    NotASocket(PathBuf, &'static str),
    /// No source could be opened.
    #[error("no usable entropy source: {0}")]
    NoSource(String),
    /// A bad option value.
    #[error("bad configuration: {0}")]
    Config(String),
}

/// State of a seed source as the stats report it.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
#[derive(Debug, Clone, Serialize, Deserialize)]
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
#[derive(Debug, Clone, Serialize, Deserialize)]
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
