//! `memveil rng serve` and `memveil rng feed-kernel` (included by `rng.rs`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use memveil_drng::egd::Limits;
use memveil_drng::kernel::{FeedError, FeedPolicy, Feeder};
use memveil_drng::serve::{Listen, Output, SeedSpec, ServeConfig, Server, ServerStats};
use memveil_drng::SourceKind;

/// `memveil rng serve --help`, after the options.
const SERVE_EXAMPLES: &str = "\
Examples:
  memveil rng serve --unix /run/memveil-egd.sock --stats /run/memveil-egd.stats &
  qemu-system-x86_64 ... -chardev socket,id=c0,path=/run/memveil-egd.sock \\
      -object rng-egd,id=rng0,chardev=c0 -device virtio-rng-pci,rng=rng0
  memveil rng serve --unix /run/vm1.sock --unix /run/vm2.sock --rate-limit 64K
  memveil rng serve --tcp 127.0.0.1:7070 --source rdseed --fallback seed
  memveil rng serve --unix /tmp/egd.sock --duration 10      # counters as JSON at the end
  socat - UNIX-CONNECT:/run/memveil-egd.stats               # the counters while it runs";

/// Flags of `memveil rng serve`.
#[derive(clap::Args)]
#[command(after_long_help = SERVE_EXAMPLES)]
pub(super) struct ServeArgs {
    /// Serve EGD on a Unix socket at PATH (repeatable)
    ///
    /// Serve EGD on a Unix socket at PATH (repeatable). QEMU:
    /// `-chardev socket,id=c0,path=PATH -object rng-egd,id=rng0,chardev=c0
    /// -device virtio-rng-pci,rng=rng0`.
    #[arg(long, value_name = "PATH", verbatim_doc_comment)]
    unix: Vec<PathBuf>,
    /// Serve EGD on TCP ADDR:PORT (repeatable; loopback only)
    ///
    /// Serve EGD on TCP ADDR:PORT (repeatable; loopback only unless
    /// --allow-remote).
    #[arg(long, value_name = "ADDR:PORT", verbatim_doc_comment)]
    tcp: Vec<SocketAddr>,
    /// Accept non-loopback TCP (EGD has no authentication)
    ///
    /// Accept non-loopback TCP addresses. EGD has no authentication: anyone
    /// who can connect can drain entropy.
    #[arg(long, verbatim_doc_comment)]
    allow_remote: bool,
    /// Permission bits of the Unix sockets, octal
    #[arg(long, value_name = "MODE", default_value = "600", value_parser = parse_mode)]
    unix_mode: u32,
    /// Seed source: seed, rdseed, getrandom
    ///
    /// Seed source: seed (RDRAND reduced 512:1 by AES-CBC-MAC), rdseed,
    /// getrandom.
    #[arg(long, default_value = "seed", value_parser = SeedSpec::parse, verbatim_doc_comment)]
    source: SeedSpec,
    /// Fallback seed source (repeatable, in order)
    ///
    /// Fallback seed source used if the previous one is unavailable or gets
    /// quarantined (repeatable, in order). Without it a failed source stops
    /// serving.
    #[arg(long, value_name = "SOURCE", value_parser = SeedSpec::parse, verbatim_doc_comment)]
    fallback: Vec<SeedSpec>,
    /// What consumers get: drbg or seed
    ///
    /// What consumers get: drbg (own CTR_DRBG AES-256 stream each, seeded
    /// from the pool) or seed (seed-grade bytes straight from the pool).
    #[arg(long, default_value = "drbg", verbatim_doc_comment)]
    output: Output,
    /// Reseed each consumer's DRBG before every request
    #[arg(long)]
    prediction_resistance: bool,
    /// DRBG reseed interval, in requests
    #[arg(long, value_name = "N", default_value_t = 1024)]
    reseed_interval: u64,
    /// Per-consumer rate limit in bytes per second (suffixes K, M)
    #[arg(long, value_name = "BYTES", value_parser = super::parse_size)]
    rate_limit: Option<u64>,
    /// Rate limit for the consumers of one endpoint (repeatable)
    ///
    /// Rate limit for the consumers of one endpoint, overriding --rate-limit:
    /// `unix:/run/vm1.sock=64K` or `tcp:127.0.0.1:7070=1M` (repeatable; one
    /// socket per VM gives per-VM limits).
    #[arg(long, value_name = "ENDPOINT=BYTES", value_parser = parse_listener_rate,
          verbatim_doc_comment)]
    rate_limit_on: Vec<(String, u64)>,
    /// Consumers served at once (more are closed)
    ///
    /// Consumers served at once; more are accepted and closed.
    #[arg(long, value_name = "N", default_value_t = 256, verbatim_doc_comment)]
    max_consumers: usize,
    /// Largest read per EGD command (1..=255)
    ///
    /// Largest blocking read served per EGD command (1..=255).
    #[arg(
        long,
        value_name = "BYTES",
        default_value_t = 255,
        verbatim_doc_comment
    )]
    max_request: u8,
    /// Seed producer threads
    #[arg(long, value_name = "N", default_value_t = 1)]
    producers: usize,
    /// Unix socket that answers each connection with the counters
    ///
    /// Unix socket that answers every connection with the counters as JSON
    /// (e.g. `socat - UNIX-CONNECT:PATH`).
    #[arg(long, value_name = "PATH", verbatim_doc_comment)]
    stats: Option<PathBuf>,
    /// Counters on stderr every SECS s (0: off)
    ///
    /// Print a one-line counter summary on stderr every SECS seconds (0: off).
    #[arg(long, default_value_t = 60, value_name = "SECS", verbatim_doc_comment)]
    stats_interval: u64,
    /// Stop after SECS seconds and print the counters as JSON
    ///
    /// Stop after SECS seconds and print the counters as JSON on stdout
    /// (default: serve until killed).
    #[arg(long, value_name = "SECS", verbatim_doc_comment)]
    duration: Option<f64>,
    /// Install no seccomp allowlist (debugging only; logged loudly)
    #[arg(long)]
    no_seccomp: bool,
}

fn parse_listener_rate(s: &str) -> Result<(String, u64), String> {
    let (l, r) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("{s:?}: expected ENDPOINT=BYTES, e.g. unix:/run/vm1.sock=64K"))?;
    if !(l.starts_with("unix:") || l.starts_with("tcp:")) {
        return Err(format!("{l:?}: an endpoint is unix:PATH or tcp:ADDR:PORT"));
    }
    Ok((l.to_owned(), super::parse_size(r)?))
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal mode like 600 or 660"))
}

/// The counters as the `--stats` socket writes them: pretty JSON.
fn stats_json(s: &ServerStats) -> String {
    let mut j = serde_json::to_string_pretty(s).unwrap_or_default();
    j.push('\n');
    j
}

/// Reads the counters of a running `memveil rng serve` from its `--stats`
/// socket (what [`stats_json`] wrote), waiting at most `timeout`.
pub(crate) fn read_stats(path: &Path, timeout: Duration) -> anyhow::Result<ServerStats> {
    use std::io::Read as _;
    let s = std::os::unix::net::UnixStream::connect(path).with_context(|| {
        format!(
            "cannot reach the entropy service's stats socket {} (memveil rng serve --stats {0})",
            path.display()
        )
    })?;
    s.set_read_timeout(Some(timeout))?;
    let mut text = String::new();
    // The service writes the counters and closes; a bounded read keeps a
    // wrong socket from feeding us forever.
    s.take(1 << 20)
        .read_to_string(&mut text)
        .with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{} did not answer with memveil rng serve's JSON counters",
            path.display()
        )
    })
}

pub(super) fn serve(a: ServeArgs) -> anyhow::Result<u8> {
    let mut listen: Vec<Listen> = a.unix.into_iter().map(Listen::Unix).collect();
    listen.extend(a.tcp.into_iter().map(Listen::Tcp));
    let mut sources = vec![a.source];
    sources.extend(a.fallback);
    if let Some(d) = a.duration {
        if !(d.is_finite() && d > 0.0) {
            anyhow::bail!("--duration {d}: give a positive number of seconds");
        }
    }
    let cfg = ServeConfig {
        listen,
        allow_remote: a.allow_remote,
        unix_mode: a.unix_mode,
        sources,
        output: a.output,
        prediction_resistance: a.prediction_resistance,
        reseed_interval: a.reseed_interval,
        rate_limit: a.rate_limit,
        listener_rate_limits: a.rate_limit_on,
        max_consumers: a.max_consumers,
        limits: Limits {
            max_read: a.max_request,
        },
        producers: a.producers,
        stats_socket: a.stats,
        stats_interval: (a.stats_interval > 0).then(|| Duration::from_secs(a.stats_interval)),
        stats_format: Arc::new(stats_json),
        ..ServeConfig::default()
    };
    let stop = memveil_drng::serve::stop_on_signals();
    let mut srv = Server::start(cfg)?;
    super::super::lock_down(
        "memveil rng serve",
        memveil_drng::seccomp::RNG_SERVE,
        a.no_seccomp,
    )?;
    match a.duration {
        Some(d) => {
            let end = std::time::Instant::now() + Duration::from_secs_f64(d);
            while std::time::Instant::now() < end
                && !stop.is_some_and(|s| s.load(Ordering::Relaxed))
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            let st = srv.stats();
            srv.shutdown();
            println!("{}", serde_json::to_string_pretty(&st)?);
        }
        None => {
            let never = AtomicBool::new(false);
            srv.wait_until(stop.unwrap_or(&never));
            let st = srv.stats();
            srv.shutdown();
            eprintln!(
                "memveil rng serve: stopped by signal; final {}",
                memveil_drng::serve::summary(&st)
            );
        }
    }
    Ok(0)
}

/// `memveil rng feed-kernel --help`, after the options.
const FEED_EXAMPLES: &str = "\
Examples:
  memveil rng feed-kernel                              # 64 bytes a minute, 4 bits a byte
  memveil rng feed-kernel --once --json                # one batch, the report as JSON
  memveil rng feed-kernel --source rdseed --credit-bits-per-byte 0   # mix, credit nothing";

/// Flags of `memveil rng feed-kernel`.
#[derive(clap::Args)]
#[command(after_long_help = FEED_EXAMPLES)]
pub(super) struct FeedArgs {
    /// Seed-grade input: seed (RDRAND 512:1) or rdseed
    ///
    /// Seed-grade input: seed (RDRAND 512:1) or rdseed. getrandom is refused
    /// (it is the kernel pool: circular).
    #[arg(long, default_value = "seed", value_parser = parse_feed_source, verbatim_doc_comment)]
    source: SourceKind,
    /// Bytes per batch (16..=4096)
    #[arg(long, value_name = "N", default_value_t = 64)]
    bytes: usize,
    /// Bits credited per byte (0..=8; 0: mix only)
    ///
    /// Bits credited per byte fed (0..=8; 0 mixes without crediting).
    #[arg(long, value_name = "BITS",
          default_value_t = memveil_drng::kernel::DEFAULT_CREDIT_BITS_PER_BYTE,
          verbatim_doc_comment)]
    credit_bits_per_byte: u32,
    /// Seconds between batches
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    interval: f64,
    /// Feed one batch and exit
    #[arg(long)]
    once: bool,
    /// The kernel's random device
    #[arg(long, value_name = "PATH", default_value = "/dev/random")]
    device: PathBuf,
    /// Print the report as JSON on stdout at exit
    #[arg(long)]
    json: bool,
}

fn parse_feed_source(s: &str) -> Result<SourceKind, String> {
    match s {
        "seed" => Ok(SourceKind::Rdrand),
        "rdseed" => Ok(SourceKind::Rdseed),
        "getrandom" => Ok(SourceKind::Getrandom),
        o => Err(format!(
            "unknown source {o:?}; feed-kernel takes seed or rdseed"
        )),
    }
}

pub(super) fn feed_kernel(a: FeedArgs) -> anyhow::Result<u8> {
    if !(a.interval.is_finite() && a.interval > 0.0) {
        anyhow::bail!(
            "--interval {}: give a positive number of seconds",
            a.interval
        );
    }
    let policy = FeedPolicy {
        source: a.source,
        batch_bytes: a.bytes,
        credit_bits_per_byte: a.credit_bits_per_byte,
        device: a.device,
    };
    let mut f = Feeder::open(policy)?;
    let log = |m: &str| eprintln!("memveil rng feed-kernel: {m}");
    eprintln!(
        "memveil rng feed-kernel: {} start-up samples passed the health tests; feeding {} \
         with {} bits credited per byte",
        f.report().startup_samples,
        f.report().source,
        f.report().credit_bits_per_byte
    );
    let r: Result<(), FeedError> = if a.once {
        f.feed_once().map(|b| {
            log(&format!(
                "fed {} bytes, credited {} bits; kernel entropy count {} -> {}",
                b.bytes,
                b.bits_credited,
                count(b.entropy_before),
                count(b.entropy_after)
            ));
        })
    } else {
        let never = AtomicBool::new(false);
        let stop = memveil_drng::serve::stop_on_signals().unwrap_or(&never);
        f.run(Duration::from_secs_f64(a.interval), stop, &log)
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(f.report())?);
    }
    r?;
    Ok(0)
}

fn count(c: Option<i32>) -> String {
    c.map_or_else(|| "?".into(), |n| n.to_string())
}
