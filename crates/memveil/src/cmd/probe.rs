//! `memveil probe`: what memory protection this host really offers.

use std::path::PathBuf;

use anyhow::Context as _;
use memveil_probe::{collect, decode, render, CollectOptions, HostFacts};

/// `memveil probe --help`, after the options.
const AFTER_LONG_HELP: &str = "\
Each item says how it was known (CPUID leaf and bit, MSR field, file, kernel log
line) or why it is unknown.

Exit status: 0 no check failed (warnings allowed); 3 at least one check failed; 2 usage
error; 1 the probe could not run (an unreadable or invalid --replay file, an
unwritable --record file).

Examples:
  memveil probe                           # the report for people
  memveil probe --json | jq .             # the same report as JSON
  memveil probe --prometheus > /var/lib/node_exporter/textfile/memveil.prom.$$ &&
      mv /var/lib/node_exporter/textfile/memveil.prom.$$ /var/lib/node_exporter/textfile/memveil.prom
  memveil probe --load-msr                # may run `modprobe msr` (root)
  memveil probe --record facts.json       # also save the raw facts, for a bug report
  memveil probe --replay facts.json       # decode saved facts instead of probing

See docs/probe.md.";

/// Flags of `memveil probe`.
///
/// Exit status: 0 when no check failed (warnings allowed), 3 when at least
/// one check failed, 2 for a usage error, 1 when the probe itself could not run (an
/// unreadable or invalid --replay file, an unwritable --record file).
#[derive(clap::Args)]
#[command(after_long_help = AFTER_LONG_HELP)]
pub struct Args {
    /// Print the report as JSON
    #[arg(long, conflicts_with = "prometheus")]
    json: bool,
    /// Print the report in the Prometheus text format
    ///
    /// Print the report in the Prometheus text format (for node_exporter's
    /// textfile collector: write to a temporary file, then rename to *.prom).
    #[arg(long, verbatim_doc_comment)]
    prometheus: bool,
    /// Load the msr module if needed, to read TME and SYSCFG (root)
    ///
    /// Run `modprobe msr` if /dev/cpu/0/msr is missing, so the TME and SYSCFG
    /// registers can be read (needs root). Without it the probe never loads a
    /// module.
    #[arg(long, verbatim_doc_comment)]
    load_msr: bool,
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
    let facts = match &args.replay {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read recorded facts {}", p.display()))?;
            HostFacts::from_json(&text).with_context(|| format!("in {}", p.display()))?
        }
        None => collect(&CollectOptions {
            load_msr: args.load_msr,
            rng_samples: usize::try_from(args.rng_samples).unwrap_or(4096),
        }),
    };
    if let Some(p) = &args.record {
        std::fs::write(p, facts.to_json() + "\n")
            .with_context(|| format!("cannot write recorded facts to {}", p.display()))?;
    }
    let report = decode(&facts);
    let out = if args.json {
        render::json(&report) + "\n"
    } else if args.prometheus {
        render::prometheus(&report)
    } else {
        render::human(&report)
    };
    print!("{out}");
    Ok(report.exit_code())
}
