//! `memveil bench`: runs the benchmark parts and writes the report.

use anyhow::Context as _;
use memveil_bench::{BenchOpts, Size, PARTS};
use std::path::PathBuf;

/// `memveil bench --help`, after the options.
const AFTER_LONG_HELP: &str = "\
Every figure is measured against a baseline in the same run; the report folder holds
report.md (with SVG plots) and report.json. Exit status: 0 every part ran; 1 a part
failed (the others still report).

Examples:
  memveil bench                                        # every part at the small size
  memveil bench --only engine --json engine.json       # one part, figures also as JSON
  memveil bench --only shield --full                   # the sizes the issues name
  memveil bench --only workloads --workload redis --out report-redis
  memveil bench --sheet docs/figures/*.json            # the current figure sheet, Markdown

See BENCHMARKS.md.";

/// Flags of `memveil bench`.
#[derive(clap::Args)]
#[command(after_long_help = AFTER_LONG_HELP)]
pub struct Args {
    /// Run only this part (repeatable)
    ///
    /// Run only this part (repeatable). Parts: cipher, engine, vault, pkcs11,
    /// rng, shield, disk, probe (the default run: all of these), and workloads (only
    /// when named: the TME-MK and AMD SME articles' workloads, fio, iperf3,
    /// HPL, redis, nginx TLS, Tesseract, STREAM, plain against `memveil run`
    /// and `--window 4096`, and a cryptsetup-style cipher table; about 10
    /// minutes).
    #[arg(long, value_name = "PART", verbatim_doc_comment)]
    only: Vec<String>,
    /// With --only workloads or shield: run only this workload (repeatable)
    ///
    /// With `--only workloads`: run only this workload (repeatable; without it
    /// all of them and the cipher table). Workloads: fio_randread,
    /// fio_randwrite, iperf3, hpl, redis, nginx_tls, tesseract, stream,
    /// tenants18 (18 copies of a python3 job at once, as 18 tenants of their
    /// own KeyIDs of a vault started for it). With `--only shield`: run only
    /// these pieces of the shield part: faults (in-process fault costs),
    /// redis, suite (the program suite; with redis for its geometric mean),
    /// nginx, fork, go (Go and static programs, the Go canary, the per-fault
    /// and per-mmap cost of the loader's path), static (of those, the static
    /// C program's figure alone: shield.static_c_vs_plain), etcd.
    #[arg(long, value_name = "NAME", verbatim_doc_comment)]
    workload: Vec<String>,
    /// Use the full sizes the issues name instead of the default small run
    #[arg(long)]
    full: bool,
    /// Also write the JSON figures to this file
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Report folder (default: `bench-report-<unix time>` here)
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Print the figure sheet of these --json files instead of running
    ///
    /// Run nothing: print, as one Markdown table, every figure the given
    /// `--json` files hold (oldest first: a figure measured again by a later
    /// file takes that value), with its target, whether it is met, and which
    /// run (date, commit, machine) measured it. BENCHMARKS.md's table is
    /// this output (scripts/figures.sh).
    #[arg(long, value_name = "JSON", num_args = 1.., verbatim_doc_comment, conflicts_with_all = ["only", "json", "out"])]
    sheet: Vec<PathBuf>,
    /// With --sheet: the files they replaced (names moves beyond the spread)
    #[arg(long, value_name = "JSON", num_args = 1.., requires = "sheet")]
    previous: Vec<PathBuf>,
}

/// Runs `memveil bench`.
pub fn run(args: Args) -> anyhow::Result<u8> {
    if !args.sheet.is_empty() {
        let read = |paths: &[PathBuf]| -> anyhow::Result<Vec<(String, String)>> {
            paths
                .iter()
                .map(|p| {
                    std::fs::read_to_string(p)
                        .with_context(|| format!("reading {}", p.display()))
                        .map(|text| (p.display().to_string(), text))
                })
                .collect()
        };
        let md = memveil_bench::sheet::markdown(&read(&args.sheet)?, &read(&args.previous)?)
            .map_err(anyhow::Error::msg)?;
        print!("{md}");
        return Ok(0);
    }
    let size = if args.full { Size::Full } else { Size::Small };
    let mut opts = BenchOpts::new(size, Box::new(|m| eprintln!("{m}")));
    opts.workloads.clone_from(&args.workload);
    let parts: Vec<String> = if args.only.is_empty() {
        PARTS.iter().map(|s| (*s).to_owned()).collect()
    } else {
        args.only.clone()
    };
    let mut sections = Vec::new();
    let mut failed = Vec::new();
    for p in &parts {
        opts.say(&format!("part {p}: starting"));
        match memveil_bench::run_part(p, &opts) {
            Ok(s) => sections.push(s),
            Err(e) => {
                eprintln!("memveil bench: part {p} failed: {e}");
                failed.push(p.clone());
            }
        }
    }
    let dir = args.out.unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from(format!("bench-report-{t}"))
    });
    let header = memveil_bench::host_header(size);
    memveil_bench::write_report(&dir, &sections, &header)?;
    if let Some(j) = &args.json {
        let v = serde_json::json!({
            "run": memveil_bench::sheet::RunInfo::here(size),
            "figures": memveil_bench::report::to_json(&sections),
        });
        std::fs::write(j, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", j.display()))?;
    }
    for s in &sections {
        for f in &s.figures {
            let ratio = f
                .ratio
                .map_or_else(String::new, |r| format!("  ratio {r:.3}"));
            println!("{:<40} {:>12.3} {}{}", f.figure, f.value, f.unit, ratio);
        }
    }
    println!("report written to {}", dir.display());
    if failed.is_empty() {
        Ok(0)
    } else {
        eprintln!("memveil bench: parts failed: {}", failed.join(", "));
        Ok(1)
    }
}
