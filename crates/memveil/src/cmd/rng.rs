//! `memveil rng`: entropy streams and the FIPS 140-2 battery.
//!
//! One enum of verbs, one function per verb.

use std::io::{IsTerminal as _, Read, Write};
use std::path::PathBuf;

use anyhow::Context as _;
use memveil_drng::fips::{run_rngtest, RngTestEnd, RngTestOptions, TEST_NAMES};
use memveil_drng::{DrngError, SourceKind, Stream, StreamKind, StreamOptions};

#[path = "rng_serve.rs"]
mod serve_cmd;

pub(crate) use serve_cmd::read_stats;

/// `memveil rng --help`, after the verbs.
const AFTER_LONG_HELP: &str = "\
Examples:
  memveil rng read --bytes 10M --source drbg | rngtest          # Debian's rngtest
  memveil rng read --bytes 10M --source seed | memveil rng test  # the same battery
  memveil rng serve --unix /run/memveil-egd.sock --stats /run/memveil-egd.stats &
  memveil rng feed-kernel --once --json                          # one batch into the pool

See docs/rng.md.";

/// Flags of `memveil rng`.
#[derive(clap::Args)]
#[command(after_long_help = AFTER_LONG_HELP)]
pub struct Args {
    #[command(subcommand)]
    verb: Verb,
}

/// The verbs of `memveil rng`.
#[derive(clap::Subcommand)]
enum Verb {
    /// Write an entropy stream to stdout (binary), for any tool to test
    Read(ReadArgs),
    /// Run the FIPS 140-2 battery on a stream exactly as rngtest does
    ///
    /// Run the FIPS 140-2 battery on a stream exactly as rngtest does
    /// (statistics on stderr, rngtest's exit codes).
    #[command(verbatim_doc_comment)]
    Test(TestArgs),
    /// Serve entropy to many consumers over EGD (Unix socket, loopback TCP)
    ///
    /// Serve entropy to many consumers over the EGD protocol (Unix socket,
    /// loopback TCP), each its own stream, fair shares, counters.
    #[command(verbatim_doc_comment)]
    Serve(serve_cmd::ServeArgs),
    /// Feed seed-grade entropy into the kernel pool, as rngd does
    ///
    /// Feed seed-grade entropy into the kernel pool (RNDADDENTROPY), as rngd
    /// does, with a conservative credit policy.
    #[command(verbatim_doc_comment)]
    FeedKernel(serve_cmd::FeedArgs),
}

/// `memveil rng read --help`, after the options.
const READ_EXAMPLES: &str = "\
Examples:
  memveil rng read --bytes 10M --source drbg | rngtest
  memveil rng read --bytes 1M --source rdrand > rdrand.bin      # raw, health-tested
  memveil rng read --source seed --input getrandom | head -c 64 | xxd
  memveil rng read --bytes 4K --prediction-resistance > key-material.bin";

/// Flags of `memveil rng read`.
#[derive(clap::Args)]
#[command(after_long_help = READ_EXAMPLES)]
struct ReadArgs {
    /// Bytes to write (K, M, G suffixes); default: until stdout closes
    ///
    /// Bytes to write (suffixes K, M, G = 2^10, 2^20, 2^30); without it the
    /// stream runs until stdout is closed.
    #[arg(long, value_name = "N", value_parser = parse_size, verbatim_doc_comment)]
    bytes: Option<u64>,
    /// The stream: rdrand, rdseed, seed, drbg, getrandom
    ///
    /// The stream: rdrand, rdseed (raw, health-tested), seed (RDRAND reduced
    /// 512:1 by AES-CBC-MAC), drbg (CTR_DRBG AES-256), getrandom.
    #[arg(long, default_value = "drbg", value_parser = parse_stream, verbatim_doc_comment)]
    source: StreamKind,
    /// Raw source of seed and drbg
    ///
    /// The raw source under `seed` and `drbg`: rdrand (conditioned 512:1),
    /// rdseed or getrandom (used directly).
    #[arg(long, default_value = "rdrand", value_parser = parse_source, verbatim_doc_comment)]
    input: SourceKind,
    /// Reseed the DRBG from its input before every 64 KiB request
    #[arg(long)]
    prediction_resistance: bool,
    /// Write binary data even when stdout is a terminal
    #[arg(long)]
    force: bool,
    /// Do not print the source name and byte count on stderr
    #[arg(long, short)]
    quiet: bool,
}

/// `memveil rng test --help`, after the options.
const TEST_EXAMPLES: &str = "\
Exit status, as rngtest's: 0 every block passed; 1 a block failed, or none was
tested; 10 --json with --pipe; 11 the input or output failed.

Examples:
  memveil rng read --bytes 2500000 | memveil rng test           # 1000 blocks
  memveil rng test -c 100 --json rdrand.bin                     # counters as JSON
  memveil rng read --bytes 1M | memveil rng test -p > passed.bin # keep the passing blocks";

/// Flags of `memveil rng test`.
#[derive(clap::Args)]
#[command(after_long_help = TEST_EXAMPLES)]
struct TestArgs {
    /// Input file (default: stdin)
    file: Option<PathBuf>,
    /// Stop after this many 20000-bit blocks (rngtest -c)
    #[arg(long, short = 'c', value_name = "N", default_value_t = 0)]
    blockcount: u64,
    /// Pipe mode (rngtest -p): copy passing blocks to stdout, no banner
    #[arg(long, short = 'p')]
    pipe: bool,
    /// Print the counters as JSON on stdout (not with --pipe)
    #[arg(long)]
    json: bool,
}

fn parse_stream(s: &str) -> Result<StreamKind, String> {
    s.parse()
}

fn parse_source(s: &str) -> Result<SourceKind, String> {
    s.parse()
}

pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1u64 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1u64 << 30),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 4096, 64K, 10M)"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Runs `memveil rng`.
pub fn run(args: Args) -> anyhow::Result<u8> {
    match args.verb {
        Verb::Read(a) => read(a),
        Verb::Test(a) => test(a),
        Verb::Serve(a) => serve_cmd::serve(a),
        Verb::FeedKernel(a) => serve_cmd::feed_kernel(a),
    }
}

fn read(a: ReadArgs) -> anyhow::Result<u8> {
    let mut stdout = std::io::stdout().lock();
    if stdout.is_terminal() && !a.force {
        anyhow::bail!(
            "refusing to write binary random data to a terminal; redirect stdout \
             (e.g. `| rngtest` or `> file`) or pass --force"
        );
    }
    let opts = StreamOptions {
        input: a.input,
        prediction_resistance: a.prediction_resistance,
        ..StreamOptions::default()
    };
    let mut stream = Stream::open(a.source, &opts).map_err(|e| with_fix(e, a.source))?;
    let name = stream.name().to_owned();
    let mut buf = vec![0u8; 1 << 16];
    let mut left = a.bytes;
    let mut written = 0u64;
    loop {
        let n = match left {
            Some(0) => break,
            Some(l) => usize::try_from(l.min(buf.len() as u64)).unwrap_or(buf.len()),
            None => buf.len(),
        };
        if let Err(e) = stream.fill(&mut buf[..n]) {
            anyhow::bail!("{e} (after {written} bytes of {name})");
        }
        match stdout.write_all(&buf[..n]) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => break,
            Err(e) => return Err(e).context("writing to stdout"),
        }
        written += n as u64;
        if let Some(l) = left.as_mut() {
            *l -= n as u64;
        }
    }
    match stdout.flush() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            return Err(e).context("writing to stdout")
        }
        _ => {}
    }
    if !a.quiet {
        eprintln!("memveil rng read: {written} bytes from {name}");
    }
    Ok(0)
}

fn with_fix(e: DrngError, kind: StreamKind) -> anyhow::Error {
    match (&e, kind) {
        (DrngError::Unavailable { .. }, StreamKind::Seed | StreamKind::Drbg) => anyhow::anyhow!(
            "{e}, or keep --source {kind} and pass --input getrandom to draw its entropy from the kernel"
        ),
        _ => e.into(),
    }
}

const PREFIX: &str = "memveil rng test: ";

fn test(a: TestArgs) -> anyhow::Result<u8> {
    if a.json && a.pipe {
        eprintln!("{PREFIX}--json and --pipe both want stdout; pick one");
        return Ok(memveil_drng::fips::EXIT_USAGE);
    }
    let mut input: Box<dyn Read> = match &a.file {
        Some(p) => match std::fs::File::open(p) {
            Ok(f) => Box::new(std::io::BufReader::with_capacity(1 << 16, f)),
            Err(e) => {
                eprintln!("{PREFIX}cannot open {}: {e}", p.display());
                return Ok(memveil_drng::fips::EXIT_IOERR);
            }
        },
        None => Box::new(std::io::stdin().lock()),
    };
    if !a.pipe {
        eprintln!("memveil rng test: FIPS 140-2 battery as rngtest (rng-tools 5) runs it\n");
        eprintln!("{PREFIX}starting FIPS tests...");
    }
    // Like rngtest: SIGINT/SIGTERM end the run with the statistics so far.
    let stop = memveil_drng::fips::interrupt_flag();
    let opts = RngTestOptions {
        blockcount: a.blockcount,
        pipe: a.pipe,
        stop,
    };
    let mut stdout = std::io::stdout().lock();
    let out = if a.pipe {
        run_rngtest(&mut input, Some(&mut stdout), opts)
    } else {
        run_rngtest(&mut input, None, opts)
    };
    match &out.end {
        RngTestEnd::Drained | RngTestEnd::TooShort if !a.pipe => {
            eprintln!("{PREFIX}entropy source drained");
        }
        RngTestEnd::ReadError(e) | RngTestEnd::BootstrapReadError(e) => {
            eprintln!("{PREFIX}error reading input: {e}");
        }
        RngTestEnd::WriteError(e) => eprintln!("{PREFIX}error writing to output: {e}"),
        _ => {}
    }
    if !matches!(
        out.end,
        RngTestEnd::TooShort | RngTestEnd::BootstrapReadError(_)
    ) {
        let c = &out.counters;
        eprintln!("{PREFIX}bits received from input: {}", c.bits_received);
        if a.pipe {
            eprintln!("{PREFIX}bits sent to output: {}", c.bits_sent);
        }
        eprintln!("{PREFIX}FIPS 140-2 successes: {}", c.successes);
        eprintln!("{PREFIX}FIPS 140-2 failures: {}", c.failures);
        for (name, n) in TEST_NAMES.iter().zip(c.per_test) {
            eprintln!("{PREFIX}{name}: {n}");
        }
        let blocks = c.successes + c.failures;
        if blocks > 0 && !out.test_time.is_zero() {
            #[allow(clippy::cast_precision_loss)]
            let mibit = (blocks * 20_000) as f64 / out.test_time.as_secs_f64() / 1_048_576.0;
            eprintln!("{PREFIX}FIPS tests speed: {mibit:.3} Mibits/s");
        }
        eprintln!(
            "{PREFIX}Program run time: {} microseconds",
            out.run_time.as_micros()
        );
    }
    if a.json {
        let v = serde_json::json!({
            "bits_received": out.counters.bits_received,
            "successes": out.counters.successes,
            "failures": out.counters.failures,
            "per_test": TEST_NAMES.iter().zip(out.counters.per_test)
                .map(|(n, c)| serde_json::json!({"test": n, "failures": c}))
                .collect::<Vec<_>>(),
            "end": out.end,
            "exit_code": out.exit_code,
        });
        println!("{v}");
    }
    Ok(out.exit_code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("10M"), Ok(10 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999999G").is_err());
    }
}
