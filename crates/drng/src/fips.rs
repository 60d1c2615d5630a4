//! The FIPS 140-2 (errata 2001-10-10) statistical battery exactly as
//! rng-tools' `rngtest` runs it, counters and exit codes included.
//!
//! Written from a reading of rng-tools 5 (`fips.c`, `rngtest.c`, the version
//! Debian ships as `rng-tools5`), not copied. What "exactly" means here:
//!
//! - Input is cut into 20000-bit (2500-byte) blocks after 32 bootstrap bits
//!   that only seed the continuous test (in `--pipe` mode another 32 bits are
//!   discarded first). Bits are taken from each byte most significant first;
//!   the continuous test compares successive little-endian 32-bit words,
//!   across block boundaries.
//! - Monobit: fail unless 9725 < ones < 10275. Poker (4-bit nibbles, high
//!   nibble first): fail unless 1563176 <= sum(count^2) <= 1576928. Runs: each
//!   of the twelve run-length buckets (lengths 1..5 and 6+, for each bit
//!   value) within 2315..2685, 1114..1386, 527..723, 240..384, 103..209,
//!   103..209. Long run: a run of 26 or more bits.
//! - rngtest's run bookkeeping is reproduced bit for bit, quirks included,
//!   because its counts are what users compare against: a run is filed under
//!   the bit that *ends* it (the new bit), except the block's last run, filed
//!   under its own bit; the run carried across a block boundary is split, and
//!   when the new block starts with a different bit a bogus run of length 0 is
//!   filed at index `-1 + 6*bit` — for bit 1 the "six or more" bucket of the
//!   other value, for bit 0 one element before the array, which in rngtest's
//!   struct layout is the poker count of nibble 15.
//! - Counters: bits received (every byte read, partial blocks and bootstrap
//!   bytes included), successes, failures, failures per test. Exit status 0
//!   when no block failed and at least one passed, 1 otherwise (also when the
//!   input ends before the 32 bootstrap bits, which prints no statistics), 11
//!   on a read or write error.

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

/// Bytes per FIPS block (20000 bits).
pub const FIPS_BLOCK_BYTES: usize = 2500;

/// The five tests, in rngtest's order, with rngtest's names.
pub const TEST_NAMES: [&str; 5] = [
    "FIPS 140-2(2001-10-10) Monobit",
    "FIPS 140-2(2001-10-10) Poker",
    "FIPS 140-2(2001-10-10) Runs",
    "FIPS 140-2(2001-10-10) Long run",
    "FIPS 140-2(2001-10-10) Continuous run",
];

/// rngtest's exit status for a run with failed blocks or none passed.
pub const EXIT_FAIL: u8 = 1;
/// rngtest's exit status for bad usage.
pub const EXIT_USAGE: u8 = 10;
/// rngtest's exit status for an I/O error.
pub const EXIT_IOERR: u8 = 11;

/// The tests a block failed, as rngtest's bit mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct FipsResult(pub u8);

impl FipsResult {
    /// Monobit bit.
    pub const MONOBIT: u8 = 0x01;
    /// Poker bit.
    pub const POKER: u8 = 0x02;
    /// Runs bit.
    pub const RUNS: u8 = 0x04;
    /// Long run bit.
    pub const LONG_RUN: u8 = 0x08;
    /// Continuous run bit.
    pub const CONTINUOUS: u8 = 0x10;

    /// True when the block passed every test.
    #[must_use]
    pub fn passed(self) -> bool {
        self.0 == 0
    }

    /// Whether test `i` (index into [`TEST_NAMES`]) failed.
    #[must_use]
    pub fn failed(self, i: usize) -> bool {
        i < 5 && self.0 & (1 << i) != 0
    }
}

const RUN_BOUNDS: [(i32, i32); 6] = [
    (2315, 2685),
    (1114, 1386),
    (527, 723),
    (240, 384),
    (103, 209),
    (103, 209),
];

/// The running state of the battery (one per stream).
#[derive(Debug, Clone)]
pub struct FipsTester {
    poker: [i32; 16],
    runs: [i32; 12],
    ones: i32,
    /// Length of the current run minus one; -1 at the start of a block.
    rlength: i32,
    current_bit: i32,
    last_bit: i32,
    longrun: bool,
    last32: u32,
}

impl FipsTester {
    /// A tester whose continuous test starts from `last32` (rngtest's
    /// bootstrap word, little-endian).
    #[must_use]
    pub fn new(last32: u32) -> Self {
        Self {
            poker: [0; 16],
            runs: [0; 12],
            ones: 0,
            rlength: -1,
            current_bit: 0,
            last_bit: 0,
            longrun: false,
            last32,
        }
    }

    /// Files a finished run: rngtest's `runs[min(rlength,5) + 6*current_bit]++`,
    /// where index -1 lands on `poker[15]`.
    fn file_run(&mut self) {
        let idx = self.rlength.min(5) + 6 * self.current_bit;
        match usize::try_from(idx) {
            Ok(i) => self.runs[i] += 1,
            Err(_) => self.poker[15] += 1,
        }
    }

    fn store(&mut self, byte: u8) {
        self.poker[usize::from(byte >> 4)] += 1;
        self.poker[usize::from(byte & 15)] += 1;
        for j in (0..8).rev() {
            let bit = i32::from((byte >> j) & 1);
            self.current_bit = bit;
            self.ones += bit;
            if bit != self.last_bit {
                self.file_run();
                if self.rlength >= 25 {
                    self.longrun = true;
                }
                self.rlength = 0;
                self.last_bit = bit;
            } else {
                self.rlength += 1;
            }
        }
    }

    /// Runs the five tests on one 2500-byte block.
    pub fn test_block(&mut self, block: &[u8; FIPS_BLOCK_BYTES]) -> FipsResult {
        let mut r = 0u8;
        for w in block.chunks_exact(4) {
            let new32 = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            if new32 == self.last32 {
                r |= FipsResult::CONTINUOUS;
            }
            self.last32 = new32;
            for &b in w {
                self.store(b);
            }
        }
        // The block's last (possibly unfinished) run, filed under its own bit.
        if self.rlength < 5 {
            self.file_run();
        } else {
            self.runs[5 + 6 * usize::from(self.current_bit == 1)] += 1;
            if self.rlength >= 25 {
                r |= FipsResult::LONG_RUN;
            }
        }
        if self.longrun {
            r |= FipsResult::LONG_RUN;
            self.longrun = false;
        }
        if self.ones >= 10275 || self.ones <= 9725 {
            r |= FipsResult::MONOBIT;
        }
        let poker: i64 = self
            .poker
            .iter()
            .map(|&p| i64::from(p) * i64::from(p))
            .sum();
        if !(1_563_176..=1_576_928).contains(&poker) {
            r |= FipsResult::POKER;
        }
        let runs_bad = (0..12).any(|i| {
            let (lo, hi) = RUN_BOUNDS[i % 6];
            self.runs[i] < lo || self.runs[i] > hi
        });
        if runs_bad {
            r |= FipsResult::RUNS;
        }
        self.poker = [0; 16];
        self.runs = [0; 12];
        self.ones = 0;
        self.rlength = -1;
        self.current_bit = 0;
        FipsResult(r)
    }
}

/// rngtest's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FipsCounters {
    /// Bits read from the input (bootstrap and partial-block bytes included).
    pub bits_received: u64,
    /// Bits written in pipe mode.
    pub bits_sent: u64,
    /// Blocks that passed.
    pub successes: u64,
    /// Blocks that failed.
    pub failures: u64,
    /// Failed blocks per test, in [`TEST_NAMES`] order.
    pub per_test: [u64; 5],
}

impl FipsCounters {
    /// Counts one block's result.
    pub fn record(&mut self, r: FipsResult) {
        if r.passed() {
            self.successes += 1;
        } else {
            self.failures += 1;
            for (i, c) in self.per_test.iter_mut().enumerate() {
                if r.failed(i) {
                    *c += 1;
                }
            }
        }
    }
}

/// Options of an rngtest-style run.
#[derive(Debug, Clone, Copy, Default)]
pub struct RngTestOptions {
    /// Stop after this many blocks (0: until the input ends).
    pub blockcount: u64,
    /// Pipe mode: discard 32 more bits at start and copy passing blocks to
    /// the output.
    pub pipe: bool,
    /// Stop cleanly when this flag is raised (rngtest's SIGINT/SIGTERM
    /// handling): the run ends after the current read with the counters so
    /// far; during the bootstrap read it ends like a too-short input.
    pub stop: Option<&'static AtomicBool>,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RngTestEnd {
    /// The input ended ("entropy source drained").
    Drained,
    /// The input ended before the bootstrap bits; no statistics.
    TooShort,
    /// Reading the bootstrap bits failed (rngtest exits 1, no statistics).
    BootstrapReadError(String),
    /// `blockcount` blocks were tested.
    BlockCount,
    /// The stop flag was raised (SIGINT/SIGTERM).
    Stopped,
    /// Reading failed.
    ReadError(String),
    /// Writing (pipe mode) failed.
    WriteError(String),
}

/// A flag raised by SIGINT/SIGTERM (handlers installed on first call), for
/// [`RngTestOptions::stop`]; `None` if the handlers could not be installed.
#[must_use]
pub fn interrupt_flag() -> Option<&'static AtomicBool> {
    memveil_sys::stopflag::stop_on_interrupt().ok()
}

/// The result of an rngtest-style run.
#[derive(Debug, Clone, Serialize)]
pub struct RngTestOutcome {
    /// The counters.
    pub counters: FipsCounters,
    /// How it ended.
    pub end: RngTestEnd,
    /// rngtest's exit status for this run.
    pub exit_code: u8,
    /// Time spent in the tests.
    #[serde(skip)]
    pub test_time: Duration,
    /// Wall time of the run.
    #[serde(skip)]
    pub run_time: Duration,
}

enum ReadEnd {
    Full,
    Eof,
    Stopped,
    Err(io::Error),
}

fn stopped(stop: Option<&AtomicBool>) -> bool {
    stop.is_some_and(|s| s.load(Ordering::SeqCst))
}

fn xread(
    input: &mut dyn Read,
    buf: &mut [u8],
    counters: &mut FipsCounters,
    stop: Option<&AtomicBool>,
) -> ReadEnd {
    let mut off = 0;
    while off < buf.len() {
        match input.read(&mut buf[off..]) {
            Ok(0) => return ReadEnd::Eof,
            Ok(n) => {
                off += n;
                counters.bits_received += 8 * n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                if stopped(stop) {
                    return ReadEnd::Stopped;
                }
            }
            Err(e) => return ReadEnd::Err(e),
        }
    }
    ReadEnd::Full
}

/// Runs the battery over `input` the way `rngtest` does; in pipe mode passing
/// blocks go to `output`.
pub fn run_rngtest(
    input: &mut dyn Read,
    mut output: Option<&mut dyn Write>,
    opts: RngTestOptions,
) -> RngTestOutcome {
    let started = Instant::now();
    let mut counters = FipsCounters::default();
    let mut test_time = Duration::ZERO;
    let finish = |counters: FipsCounters, end: RngTestEnd, test_time: Duration| {
        let exit_code = match &end {
            RngTestEnd::TooShort | RngTestEnd::BootstrapReadError(_) => EXIT_FAIL,
            RngTestEnd::ReadError(_) | RngTestEnd::WriteError(_) => EXIT_IOERR,
            _ if counters.failures > 0 || counters.successes == 0 => EXIT_FAIL,
            _ => 0,
        };
        RngTestOutcome {
            counters,
            end,
            exit_code,
            test_time,
            run_time: started.elapsed(),
        }
    };
    let mut boot = [0u8; 4];
    if opts.pipe {
        match xread(input, &mut boot, &mut counters, opts.stop) {
            ReadEnd::Full => {}
            ReadEnd::Eof | ReadEnd::Stopped => {
                return finish(counters, RngTestEnd::TooShort, test_time)
            }
            ReadEnd::Err(e) => {
                return finish(
                    counters,
                    RngTestEnd::BootstrapReadError(e.to_string()),
                    test_time,
                )
            }
        }
    }
    match xread(input, &mut boot, &mut counters, opts.stop) {
        ReadEnd::Full => {}
        ReadEnd::Eof | ReadEnd::Stopped => {
            return finish(counters, RngTestEnd::TooShort, test_time)
        }
        ReadEnd::Err(e) => {
            return finish(
                counters,
                RngTestEnd::BootstrapReadError(e.to_string()),
                test_time,
            )
        }
    }
    let mut tester = FipsTester::new(u32::from_le_bytes(boot));
    let mut block = [0u8; FIPS_BLOCK_BYTES];
    let mut blocks = 0u64;
    loop {
        if stopped(opts.stop) {
            return finish(counters, RngTestEnd::Stopped, test_time);
        }
        match xread(input, &mut block, &mut counters, opts.stop) {
            ReadEnd::Full => {}
            ReadEnd::Eof => return finish(counters, RngTestEnd::Drained, test_time),
            ReadEnd::Stopped => return finish(counters, RngTestEnd::Stopped, test_time),
            ReadEnd::Err(e) => {
                return finish(counters, RngTestEnd::ReadError(e.to_string()), test_time)
            }
        }
        let t = Instant::now();
        let r = tester.test_block(&block);
        test_time += t.elapsed();
        counters.record(r);
        if r.passed() {
            if let Some(out) = output.as_deref_mut() {
                if let Err(e) = out.write_all(&block) {
                    return finish(counters, RngTestEnd::WriteError(e.to_string()), test_time);
                }
                counters.bits_sent += 8 * FIPS_BLOCK_BYTES as u64;
            }
        }
        blocks += 1;
        if opts.blockcount != 0 && blocks >= opts.blockcount {
            return finish(counters, RngTestEnd::BlockCount, test_time);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, mut s: u64) -> Vec<u8> {
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            v.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
        }
        v.truncate(n);
        v
    }

    #[test]
    fn good_data_mostly_passes() {
        let data = pattern(4 + 200 * FIPS_BLOCK_BYTES, 1);
        let o = run_rngtest(&mut &data[..], None, RngTestOptions::default());
        assert_eq!(o.end, RngTestEnd::Drained);
        assert_eq!(o.counters.successes + o.counters.failures, 200);
        assert!(o.counters.failures <= 3, "{o:?}");
        assert_eq!(o.counters.bits_received, 8 * data.len() as u64);
    }

    #[test]
    fn zeros_fail_everything_but_poker_runs_differently() {
        let data = vec![0u8; 4 + 3 * FIPS_BLOCK_BYTES];
        let o = run_rngtest(&mut &data[..], None, RngTestOptions::default());
        assert_eq!(o.counters.failures, 3);
        assert_eq!(o.counters.per_test, [3, 3, 3, 3, 3]);
        assert_eq!(o.exit_code, EXIT_FAIL);
    }

    #[test]
    fn too_short_is_exit_1_without_blocks() {
        let o = run_rngtest(&mut &[1u8, 2, 3][..], None, RngTestOptions::default());
        assert_eq!(o.end, RngTestEnd::TooShort);
        assert_eq!(o.exit_code, 1);
        let o = run_rngtest(&mut &[1u8, 2, 3, 4, 5][..], None, RngTestOptions::default());
        assert_eq!(o.end, RngTestEnd::Drained);
        assert_eq!(o.counters.bits_received, 40);
        assert_eq!(o.exit_code, 1, "no good block is a failure");
    }

    #[test]
    fn blockcount_and_pipe_mode() {
        let data = pattern(8 + 10 * FIPS_BLOCK_BYTES, 2);
        let mut out = Vec::new();
        let o = run_rngtest(
            &mut &data[..],
            Some(&mut out),
            RngTestOptions {
                blockcount: 4,
                pipe: true,
                stop: None,
            },
        );
        assert_eq!(o.end, RngTestEnd::BlockCount);
        assert_eq!(o.counters.successes + o.counters.failures, 4);
        assert_eq!(out.len() as u64 * 8, o.counters.bits_sent);
        assert_eq!(&out[..FIPS_BLOCK_BYTES], &data[8..8 + FIPS_BLOCK_BYTES]);
    }

    #[test]
    fn continuous_test_spans_blocks_and_bootstrap() {
        // Bootstrap word equals the first word of block 1.
        let mut data = pattern(4 + 2 * FIPS_BLOCK_BYTES, 3);
        let w: [u8; 4] = [data[4], data[5], data[6], data[7]];
        data[..4].copy_from_slice(&w);
        let mut t = FipsTester::new(u32::from_le_bytes(w));
        let mut b = [0u8; FIPS_BLOCK_BYTES];
        b.copy_from_slice(&data[4..4 + FIPS_BLOCK_BYTES]);
        assert!(t.test_block(&b).failed(4));
    }
}
