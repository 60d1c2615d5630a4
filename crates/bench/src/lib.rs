//! memveil's benchmark suite: the workloads of every part and the report.
//!
//! Each part (`cipher`, `engine`, `vault`, `pkcs11`, `rng`, `shield`, `exposure`, `disk`, `probe`, and `workloads`
//! and `coldserver`,
//! which only `--only` runs) has a module with
//! `run(&BenchOpts) -> Result<Section, BenchError>`. Every figure is measured
//! against a baseline taken in the same run, because the machines this runs on
//! are shared and noisy; the report records value, baseline and ratio.
//!
//! The report is written as `report.md` (with SVG plots beside it) and
//! `report.json` (one record per figure, stable ids) into a folder.

mod agent;
pub mod cipher;
pub mod disk;
pub mod engine;
pub mod nginx;
pub mod pkcs11;
pub mod probe;
pub(crate) mod procs;
pub mod report;
pub mod rng;
pub mod rng_share;
pub mod sheet;
pub mod shield;
pub mod timing;
pub mod vault;
pub mod vault_kmip;
pub mod vault_tls;
pub mod workloads;

pub use report::{write_report, Figure, Plot, Section, Series};

use std::time::Instant;

/// How big a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    /// The default: every workload at a size that finishes in a few minutes.
    Small,
    /// The sizes the issues name (e.g. 1024 requests of 4 MiB).
    Full,
}

/// Options shared by every part.
pub struct BenchOpts {
    /// Run size.
    pub size: Size,
    /// Where progress lines go (stderr in the CLI).
    pub progress: Box<dyn Fn(&str) + Send + Sync>,
    /// The workloads part runs only these (all when empty; then the
    /// cipher table too).
    pub workloads: Vec<String>,
    started: Instant,
}

impl BenchOpts {
    /// Options with progress printed through `progress`.
    pub fn new(size: Size, progress: Box<dyn Fn(&str) + Send + Sync>) -> Self {
        Self {
            size,
            progress,
            workloads: Vec::new(),
            started: Instant::now(),
        }
    }

    /// Prints one progress line with the elapsed time.
    pub fn say(&self, msg: &str) {
        (self.progress)(&format!(
            "[{:6.1}s] {msg}",
            self.started.elapsed().as_secs_f64()
        ));
    }

    /// Picks the small or the full value.
    #[must_use]
    pub fn pick<T>(&self, small: T, full: T) -> T {
        match self.size {
            Size::Small => small,
            Size::Full => full,
        }
    }
}

/// Errors of a benchmark part.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A part could not run its workload (missing tool, failed setup).
    #[error("{part}: {msg}")]
    Part {
        /// The part.
        part: &'static str,
        /// What failed and what to do.
        msg: String,
    },
    /// Writing the report failed.
    #[error("writing the report to {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// The parts a run without `--only` runs, in run order.
pub const PARTS: &[&str] = &[
    "cipher", "engine", "vault", "pkcs11", "rng", "shield", "exposure", "disk", "probe",
];

/// Parts only `--only` runs: `workloads` (the articles' workloads with real
/// tools, plain against `memveil run`: about 10 minutes at the default size)
/// and `coldserver` (a server with a 1 GiB cold heap, plain against `memveil
/// run`: about 7 minutes).
pub const EXTRA_PARTS: &[&str] = &["workloads", "coldserver"];

/// Runs one part by name.
///
/// # Errors
/// `BenchError::Part` for an unknown part or a workload that cannot run.
pub fn run_part(name: &str, opts: &BenchOpts) -> Result<Section, BenchError> {
    match name {
        "cipher" => cipher::run(opts),
        "engine" => engine::run(opts),
        "vault" => vault::run(opts),
        "pkcs11" => pkcs11::run(opts),
        "rng" => rng::run(opts),
        "shield" => shield::run(opts),
        "exposure" => shield::suite::exposure::part(opts),
        "coldserver" => shield::suite::exposure::server_part(opts),
        "disk" => disk::run(opts),
        "probe" => probe::run(opts),
        "workloads" => workloads::run(opts),
        other => Err(BenchError::Part {
            part: "bench",
            msg: format!(
                "unknown part {other:?}; parts are: {}",
                PARTS
                    .iter()
                    .chain(EXTRA_PARTS)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

/// This host's CPU model name (from `/proc/cpuinfo`) and logical CPUs.
#[must_use]
pub fn cpu_model() -> (String, usize) {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get);
    (cpu, cores)
}

/// The report's opening lines: host, CPU, size, date, so figures can be read
/// against the machine they came from.
#[must_use]
pub fn host_header(size: Size) -> String {
    let (cpu, cores) = cpu_model();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "Host: {cpu}, {cores} logical CPUs, kernel {}. Size: {size:?}. AES path: {}{}. Every ratio is against a baseline measured in the same run.",
        kernel.trim(),
        memveil_cipher::path().describe(),
        memveil_cipher::path_note().map_or(String::new(), |n| format!(" ({n})")),
    )
}
