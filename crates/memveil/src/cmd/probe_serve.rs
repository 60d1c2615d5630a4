//! `memveil probe --serve`, `--textfile` and `--prometheus` (included by
//! `probe.rs`): the facts plus the vault's and the entropy service's live
//! counters, served to Prometheus or written for node_exporter.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use memveil_probe::fleet::{self, RngCounters, VaultCounters};
use memveil_probe::{collect, decode, http, CollectOptions, Report};
use memveil_vault::Client;

/// How long the vault may take to answer each request of a scrape.
const VAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the entropy service's stats socket may take to answer.
const RNG_STATS_TIMEOUT: Duration = Duration::from_secs(2);

/// The facts of one collection and when it happened.
pub(super) struct Collected {
    report: Report,
    unix_time: f64,
    seconds: f64,
}

impl Collected {
    /// The report just decoded from facts gathered since `started`.
    pub(super) fn now(report: Report, started: Instant) -> Self {
        Self {
            report,
            unix_time: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            seconds: started.elapsed().as_secs_f64(),
        }
    }
}

/// The daemons whose counters are exported besides the facts.
pub(super) struct Sources {
    vault: Option<PathBuf>,
    rng: Option<PathBuf>,
    /// The last reason each could not be read, to log changes only.
    last_error: Mutex<[Option<String>; 2]>,
}

impl Sources {
    pub(super) fn of(a: &super::Args) -> Self {
        Self {
            vault: (!a.no_vault).then(|| {
                a.vault_socket
                    .clone()
                    .unwrap_or_else(memveil_vault::cli::default_socket)
            }),
            rng: a.rng_stats.clone(),
            last_error: Mutex::new([None, None]),
        }
    }

    /// The exposition of `c` and the daemons' counters read now.
    pub(super) fn exposition(&self, c: &Collected) -> String {
        let vault = self
            .vault
            .as_deref()
            .map(|p| self.logged(0, p, vault_counters(p)));
        let rng = self
            .rng
            .as_deref()
            .map(|p| self.logged(1, p, rng_counters(p)));
        let shield = super::super::shield::fleet_view();
        fleet::exposition(&fleet::Scrape {
            report: &c.report,
            vault: vault.as_ref(),
            rng: rng.as_ref(),
            shield: Some(&shield),
            facts_time: c.unix_time,
            facts_seconds: c.seconds,
        })
    }

    /// `r`, with a line on stderr when source `i`'s error changes.
    fn logged<T>(&self, i: usize, path: &Path, r: Result<T, String>) -> Result<T, String> {
        let mut last = self
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = r.as_ref().err().cloned();
        if last[i] != now {
            match &now {
                Some(e) => eprintln!("memveil probe: {}: {e}", path.display()),
                None => eprintln!("memveil probe: {} answers again", path.display()),
            }
            last[i] = now;
        }
        r
    }
}

/// The vault's counters through its control socket (what `memveil vault
/// status` and `memveil key status` read).
fn vault_counters(socket: &Path) -> Result<VaultCounters, String> {
    let mut c = Client::connect_timeout(socket, VAULT_TIMEOUT).map_err(|e| e.to_string())?;
    let s = c.status().map_err(|e| e.to_string())?;
    let t = c.keyid_status().map_err(|e| e.to_string())?;
    let tenants = c.keyid_tenants().map_err(|e| e.to_string())?;
    Ok(VaultCounters {
        level: s.level,
        // "vaes256: memveil VAES kernels ..." -> "vaes256": a short label.
        backend: s.backend.split(':').next().unwrap_or_default().to_owned(),
        keys: s.keys.into(),
        clients: s.clients.into(),
        durable: s.durable,
        uptime_s: s.uptime_s,
        max_keyid: t.max_keyid.into(),
        keyids_programmed: u64::try_from(t.programmed()).unwrap_or(u64::MAX),
        tenants: tenants.map(|n| {
            t.entries
                .iter()
                .filter(|e| e.keyid != 0 && e.generation > 0)
                .map(|e| {
                    let count = super::super::key::tenants_of(Some(&n), e.keyid).unwrap_or(0);
                    (e.keyid, u64::from(count))
                })
                .collect()
        }),
    })
}

/// The entropy service's counters through its stats socket.
fn rng_counters(path: &Path) -> Result<RngCounters, String> {
    let s = super::super::rng::read_stats(path, RNG_STATS_TIMEOUT).map_err(|e| format!("{e:#}"))?;
    Ok(RngCounters {
        source_healthy: s.active_source.is_some(),
        seeds_produced: s.seeds_produced,
        bytes_served: s.bytes_served,
        consumers_open: s.consumers_open,
        consumers_total: s.consumers_total,
        consumers_refused: s.consumers_refused,
        uptime_s: s.uptime_seconds,
    })
}

/// Writes `text` to `path` through a temporary file in the same directory,
/// synced, then renamed over it: a reader sees the old file or the new one.
pub(super) fn write_atomically(path: &Path, text: &str) -> anyhow::Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("--textfile {}: give a file name", path.display()))?;
    // Not ending in .prom: node_exporter skips it while it is written.
    let tmp = path.with_file_name(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        anyhow::anyhow!("cannot write the metrics to {}: {e}", path.display())
    })
}

/// How `--serve` collects the facts again.
pub(super) struct Refresh {
    /// Every `--refresh` seconds.
    pub(super) period: Duration,
    /// As the first collection, but without programs under seccomp.
    pub(super) opts: CollectOptions,
    /// The first collection's kernel log: kept when a refresh that may run
    /// no program cannot read a whole one from /dev/kmsg.
    pub(super) kernel_log: memveil_probe::facts::KernelLog,
}

/// Serves the metrics at `addr` until killed; with `refresh`, collects the
/// facts again at that period on a thread of its own. The seccomp filter
/// goes on once the socket is bound and the refresh thread runs.
pub(super) fn serve(
    addr: SocketAddr,
    first: Collected,
    refresh: Option<Refresh>,
    sources: Sources,
    no_seccomp: bool,
) -> anyhow::Result<u8> {
    let facts = Arc::new(Mutex::new(Arc::new(first)));
    let sources = Arc::new(sources);
    let metrics: http::Metrics = {
        let facts = Arc::clone(&facts);
        Arc::new(move || {
            let c = Arc::clone(&facts.lock().unwrap_or_else(PoisonError::into_inner));
            sources.exposition(&c)
        })
    };
    let server = http::Server::bind(addr, metrics)?;
    let bound = server.local_addr().context("the address bound")?;
    if let Some(r) = refresh {
        std::thread::Builder::new()
            .name("probe-refresh".to_owned())
            .spawn(move || loop {
                std::thread::sleep(r.period);
                let started = Instant::now();
                let mut f = collect(&r.opts);
                if !r.opts.run_commands && (f.kernel_log.lines.is_none() || f.kernel_log.wrapped) {
                    f.kernel_log = r.kernel_log.clone();
                }
                let c = Collected::now(decode(&f), started);
                *facts.lock().unwrap_or_else(PoisonError::into_inner) = Arc::new(c);
            })
            .context("starting the refresh thread")?;
    }
    super::super::lock_down(
        "memveil probe",
        memveil_probe::seccomp::PROBE_SERVE,
        no_seccomp,
    )?;
    println!("memveil probe: serving http://{bound}/metrics");
    let _ = std::io::stdout().flush();
    server.serve(&AtomicBool::new(false));
    Ok(0)
}
