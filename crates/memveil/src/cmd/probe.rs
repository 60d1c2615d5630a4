//! `memveil probe`: what memory protection this host really offers.

use std::path::PathBuf;

use anyhow::Context as _;
use memveil_probe::{collect, decode, render, CollectOptions, HostFacts};

#[path = "probe_serve.rs"]
mod serve;

/// `memveil probe --help`, after the options.
const AFTER_LONG_HELP: &str = "\
Each item says how it was known (CPUID leaf and bit, MSR field, file, kernel log
line) or why it is unknown.

--prometheus, --textfile and --serve export the same metrics: the probe's facts
(memveil_memory_encryption_active, memveil_cpu_feature, memveil_kernel_feature, ...)
and, read live, the vault's counters (memveil_vault_up, memveil_vault_keys,
memveil_vault_keyids_programmed, memveil_vault_tenants; --no-vault on a host without a
vault) and the entropy service's (--rng-stats).

Exit status: 0 no check failed (warnings allowed); 3 at least one check failed; 2 usage
error; 1 the probe could not run (an unreadable or invalid --replay file, an
unwritable --record or --textfile file, an address --serve cannot listen on).
--serve runs until killed.

Examples:
  memveil probe                           # the report for people
  memveil probe --json | jq .             # the same report as JSON
  memveil probe --serve 127.0.0.1:9464    # Prometheus scrapes http://127.0.0.1:9464/metrics
  memveil probe --serve 0.0.0.0:9464 --rng-stats /run/memveil-egd.stats
  memveil probe --textfile /var/lib/prometheus/node-exporter/memveil.prom   # atomic
  memveil probe --prometheus --no-vault   # the metrics on stdout
  memveil probe --load-msr                # may run `modprobe msr` (root)
  memveil probe --record facts.json       # also save the raw facts, for a bug report
  memveil probe --replay facts.json       # decode saved facts instead of probing

See docs/probe.md and docs/fleet.md.";

/// Flags of `memveil probe`.
///
/// Exit status: 0 when no check failed (warnings allowed), 3 when at least
/// one check failed, 2 for a usage error, 1 when the probe itself could not run (an
/// unreadable or invalid --replay file, an unwritable --record file).
#[derive(clap::Args)]
#[command(after_long_help = AFTER_LONG_HELP)]
pub struct Args {
    /// Print the report as JSON
    #[arg(long, conflicts_with_all = ["prometheus", "serve", "textfile"])]
    json: bool,
    /// Print the metrics in the Prometheus text format
    ///
    /// Print the metrics in the Prometheus text exposition format: the
    /// facts, the vault's counters (unless --no-vault) and the entropy
    /// service's (with --rng-stats). For node_exporter's textfile collector
    /// use --textfile, which writes atomically.
    #[arg(long, conflicts_with_all = ["serve", "textfile"], verbatim_doc_comment)]
    prometheus: bool,
    /// Serve the metrics over HTTP at ADDR:PORT/metrics for Prometheus
    ///
    /// Serve the metrics at http://ADDR:PORT/metrics until killed (port 0: a
    /// free port; the first line on stdout names the address). The facts
    /// are collected at start and every --refresh seconds; the vault's and
    /// the entropy service's counters are read on every scrape. No TLS and
    /// no authentication: bind loopback or a management network.
    #[arg(
        long,
        value_name = "ADDR:PORT",
        conflicts_with = "textfile",
        verbatim_doc_comment
    )]
    serve: Option<std::net::SocketAddr>,
    /// Write the metrics to FILE atomically (node_exporter textfile)
    ///
    /// Write the metrics to FILE through a temporary file in the same
    /// directory and a rename, so node_exporter's textfile collector never
    /// reads half a file (FILE should end in .prom; run it from a systemd
    /// timer, see docs/fleet.md).
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    textfile: Option<PathBuf>,
    /// With --serve: collect the facts again every SECS seconds
    #[arg(long, value_name = "SECS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..))]
    refresh: u64,
    /// The vault's socket, whose counters to export
    ///
    /// The vault's socket, whose counters to export (default:
    /// $MEMVEIL_VAULT_SOCKET or /run/memveil/vault.sock). A vault that does
    /// not answer is exported as memveil_vault_up 0.
    #[arg(
        long = "vault",
        alias = "vault-socket",
        value_name = "SOCKET",
        conflicts_with = "no_vault",
        verbatim_doc_comment
    )]
    vault_socket: Option<PathBuf>,
    /// This host runs no vault: export no vault metrics
    #[arg(long)]
    no_vault: bool,
    /// Stats socket of `memveil rng serve --stats` to export
    ///
    /// The `--stats` socket of a running `memveil rng serve` whose counters
    /// to export (memveil_rng_serve_*; 0 in memveil_rng_serve_up when it
    /// does not answer).
    #[arg(long, value_name = "PATH", verbatim_doc_comment)]
    rng_stats: Option<PathBuf>,
    /// Load the msr module if needed, to read TME and SYSCFG (root)
    ///
    /// Run `modprobe msr` if /dev/cpu/0/msr is missing, so the TME and SYSCFG
    /// registers can be read (needs root). Without it the probe never loads a
    /// module.
    #[arg(long, verbatim_doc_comment)]
    load_msr: bool,
    /// With --serve: install no seccomp allowlist (debugging; logged loudly)
    ///
    /// With --serve: install no seccomp allowlist (debugging only; a WARNING
    /// says so). With the filter, the refresh runs no programs (modprobe,
    /// dmesg, journalctl) and keeps the first collection's kernel log when
    /// /dev/kmsg alone cannot give it.
    #[arg(long, requires = "serve", verbatim_doc_comment)]
    no_seccomp: bool,
    /// Also write the raw facts gathered to FILE as JSON
    ///
    /// Also write the raw facts gathered (CPUID, MSRs, cpuinfo, kernel log,
    /// files, attempts) to FILE as JSON, to replay or attach to a bug report.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "replay",
        verbatim_doc_comment
    )]
    record: Option<PathBuf>,
    /// Decode facts recorded earlier instead of probing this host
    ///
    /// Decode facts recorded earlier (by --record, or a test fixture) instead
    /// of probing this host.
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    replay: Option<PathBuf>,
    /// RDRAND and RDSEED samples for the health tests
    ///
    /// 64-bit samples of RDRAND and RDSEED to run through the SP 800-90B
    /// health tests (64 to 16777216).
    #[arg(long, value_name = "N", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(64..=16_777_216), verbatim_doc_comment)]
    rng_samples: u32,
}

/// Runs `memveil probe`.
pub fn run(args: Args) -> anyhow::Result<u8> {
    let started = std::time::Instant::now();
    let facts = facts(&args)?;
    if let Some(p) = &args.record {
        std::fs::write(p, facts.to_json() + "\n")
            .with_context(|| format!("cannot write recorded facts to {}", p.display()))?;
    }
    let report = decode(&facts);
    let exported = serve::Sources::of(&args);
    if let Some(addr) = args.serve {
        let collected = serve::Collected::now(report, started);
        // Replayed facts do not change: nothing to collect again.
        let refresh = args.replay.is_none().then(|| serve::Refresh {
            period: std::time::Duration::from_secs(args.refresh),
            opts: CollectOptions {
                run_commands: args.no_seccomp,
                ..collect_options(&args)
            },
            kernel_log: facts.kernel_log.clone(),
        });
        return serve::serve(addr, collected, refresh, exported, args.no_seccomp);
    }
    let out = if args.json {
        render::json(&report) + "\n"
    } else if args.prometheus || args.textfile.is_some() {
        let collected = serve::Collected::now(report.clone(), started);
        exported.exposition(&collected)
    } else {
        render::human(&report)
    };
    match &args.textfile {
        Some(p) => serve::write_atomically(p, &out)?,
        None => print!("{out}"),
    }
    Ok(report.exit_code())
}

fn collect_options(args: &Args) -> CollectOptions {
    CollectOptions {
        load_msr: args.load_msr,
        rng_samples: usize::try_from(args.rng_samples).unwrap_or(4096),
        run_commands: true,
    }
}

/// The facts: recorded (`--replay`) or collected now.
fn facts(args: &Args) -> anyhow::Result<HostFacts> {
    Ok(match &args.replay {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read recorded facts {}", p.display()))?;
            HostFacts::from_json(&text).with_context(|| format!("in {}", p.display()))?
        }
        None => collect(&collect_options(args)),
    })
}
