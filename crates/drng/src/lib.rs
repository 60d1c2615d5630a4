//! Entropy for memveil: the model of Intel Secure Key on a virtualised host.
//!
//! The pipeline, each stage its own module:
//!
//! - [`source`]: raw 64-bit samples from RDRAND, RDSEED (CPUID-detected,
//!   bounded retry loops) and `getrandom(2)`; a fault-injection wrapper.
//! - [`health`]: SP 800-90B Repetition Count and Adaptive Proportion tests
//!   on every raw sample; a failing source is quarantined and nothing of it is
//!   served.
//! - [`condition`]: seed-grade output from RDRAND by the DRNG guide's method,
//!   512 128-bit samples reduced by AES-CBC-MAC under an ephemeral key to one
//!   128-bit seed.
//! - [`drbg`]: SP 800-90A CTR_DRBG (AES-256, with derivation function), one
//!   instance per consumer, prediction resistance on request.
//! - [`fips`]: the FIPS 140-2 battery exactly as `rngtest` (rng-tools) runs it.
//! - [`Stream`]: one consumer's byte stream of a chosen kind
//!   (`rdrand|rdseed|seed|drbg|getrandom`), the unit `memveil rng read` and the
//!   EGD server hand out.
//!
//! What this crate refuses to do: serve a byte from a source that failed a
//! health test; fall back silently from RDRAND to another source (a missing
//! instruction is an error that names the CPUID bit and the fix); serve DRBG
//! output past the SP 800-90A limits (requests over 2^19 bits, or past the
//! reseed interval without reseeding). It names the source of every byte it
//! reports on.
#![forbid(unsafe_code)]

pub mod condition;
pub mod drbg;
pub mod egd;
pub mod fips;
pub mod health;
pub mod kernel;
pub mod seccomp;
pub mod serve;
pub mod source;

use std::io;

pub use condition::Conditioner;
pub use drbg::{CtrDrbg, DfMode, Drbg};
pub use fips::{FipsCounters, FipsResult, FipsTester};
pub use health::{
    sample_source, HealthChecked, HealthConfig, HealthFailure, HealthReport, HealthTestKind,
};
pub use source::{Fault, FaultControl, FaultySource, RawSource, SourceKind, SourceStats};

/// Errors of the entropy pipeline.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DrngError {
    /// The CPU lacks the instruction (or it was disabled for a test).
    #[error(
        "{instruction} not available on this CPU ({cpuid}=0{}); use --source getrandom",
        if *simulated { ", simulated by MEMVEIL_DRNG_DISABLE" } else { "" }
    )]
    Unavailable {
        /// `RDRAND` or `RDSEED`.
        instruction: &'static str,
        /// The CPUID bit that reports it.
        cpuid: &'static str,
        /// True when [`source::DISABLE_ENV`] hid the instruction.
        simulated: bool,
    },
    /// Every retry of one sample failed.
    #[error(
        "{name}: {attempts} consecutive attempts failed (CF=0); the DRNG is broken or \
         starved: no output is served from it; retry later or use --source getrandom"
    )]
    Exhausted {
        /// The source.
        name: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The source failed a health test and is quarantined.
    #[error("source {name} quarantined: {failure}; no byte from it is served")]
    Quarantined {
        /// The source.
        name: String,
        /// The failure.
        failure: HealthFailure,
    },
    /// `getrandom(2)` failed.
    #[error("getrandom(2) failed: {0} (kernels before 3.17 lack it)")]
    Getrandom(#[source] io::Error),
    /// A DRBG request larger than SP 800-90A allows.
    #[error("DRBG request of {requested} bytes exceeds the SP 800-90A maximum of {max} bytes per request")]
    RequestTooLarge {
        /// Bytes asked for.
        requested: usize,
        /// The limit.
        max: usize,
    },
    /// The DRBG reached its reseed interval and must be reseeded first.
    #[error("DRBG reached its reseed interval of {interval} requests; reseed before generating")]
    ReseedRequired {
        /// The interval.
        interval: u64,
    },
    /// DRBG input of a length the chosen mode does not take.
    #[error("DRBG {what} of {got} bytes: {expected}")]
    BadInput {
        /// Which input.
        what: &'static str,
        /// Its length.
        got: usize,
        /// What the mode takes.
        expected: &'static str,
    },
    /// The AES layer refused (never expected with the fixed key lengths here).
    #[error("AES: {0}")]
    Cipher(#[from] memveil_cipher::CipherError),
}

/// What a [`Stream`] serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum StreamKind {
    /// Raw RDRAND words (health-tested).
    Rdrand,
    /// Raw RDSEED words (health-tested).
    Rdseed,
    /// 512:1 conditioned seeds from the input source (RDRAND by default).
    Seed,
    /// CTR_DRBG output seeded from the input source.
    Drbg,
    /// Raw `getrandom(2)` bytes (health-tested).
    Getrandom,
}

impl StreamKind {
    /// All kinds.
    pub const ALL: [StreamKind; 5] = [
        StreamKind::Rdrand,
        StreamKind::Rdseed,
        StreamKind::Seed,
        StreamKind::Drbg,
        StreamKind::Getrandom,
    ];

    /// The name used on the command line and in reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            StreamKind::Rdrand => "rdrand",
            StreamKind::Rdseed => "rdseed",
            StreamKind::Seed => "seed",
            StreamKind::Drbg => "drbg",
            StreamKind::Getrandom => "getrandom",
        }
    }
}

impl std::fmt::Display for StreamKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for StreamKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        StreamKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                format!("unknown stream {s:?}; streams are rdrand, rdseed, seed, drbg, getrandom")
            })
    }
}

/// How a [`Stream`] is built.
#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// The raw source under `seed` and `drbg` streams. RDRAND is conditioned
    /// 512:1; RDSEED and getrandom are seed grade and feed the DRBG directly
    /// (a `seed` stream conditions whatever it is given).
    pub input: SourceKind,
    /// Reseed the DRBG before every request.
    pub prediction_resistance: bool,
    /// DRBG personalization string (e.g. a consumer id).
    pub personalization: Vec<u8>,
    /// DRBG reseed interval in requests of up to 64 KiB.
    pub reseed_interval: u64,
    /// Health-test parameters.
    pub health: HealthConfig,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self {
            input: SourceKind::Rdrand,
            prediction_resistance: false,
            personalization: Vec::new(),
            reseed_interval: drbg::DEFAULT_RESEED_INTERVAL,
            health: HealthConfig::default(),
        }
    }
}

/// A health-tested raw source that remembers its quarantine, shareable
/// between the stream and the DRBG's entropy input so its state can be
/// reported.
type Checked = HealthChecked<Box<dyn RawSource>>;

enum Inner {
    Raw(Checked),
    Seed(Conditioner<Checked>),
    Drbg(Box<Drbg>),
}

/// One consumer's byte stream: raw, seed or DRBG, every raw sample under it
/// health-tested. Create one per consumer; it is `Send`.
pub struct Stream {
    kind: StreamKind,
    inner: Inner,
    name: String,
    bytes: u64,
    quarantine: Option<HealthFailure>,
}

impl Stream {
    /// Opens a stream of `kind` over the real sources.
    ///
    /// # Errors
    /// [`DrngError::Unavailable`] when the CPU lacks the instruction the
    /// stream needs (no silent fallback), or the source's first failure.
    pub fn open(kind: StreamKind, opts: &StreamOptions) -> Result<Self, DrngError> {
        let raw_kind = match kind {
            StreamKind::Rdrand => SourceKind::Rdrand,
            StreamKind::Rdseed => SourceKind::Rdseed,
            StreamKind::Getrandom => SourceKind::Getrandom,
            StreamKind::Seed | StreamKind::Drbg => opts.input,
        };
        let raw = raw_kind.open()?;
        Self::with_source(kind, raw, raw_kind, opts)
    }

    /// Builds a stream of `kind` over an arbitrary raw source (tests inject
    /// faults here); `raw_kind` says how to treat it (RDRAND-like input is
    /// conditioned 512:1 before the DRBG, seed-grade input is not).
    ///
    /// # Errors
    /// The source's first failure (DRBG instantiation draws entropy).
    pub fn with_source(
        kind: StreamKind,
        raw: Box<dyn RawSource>,
        raw_kind: SourceKind,
        opts: &StreamOptions,
    ) -> Result<Self, DrngError> {
        let checked = HealthChecked::new(raw, opts.health);
        let inner = match kind {
            StreamKind::Rdrand | StreamKind::Rdseed | StreamKind::Getrandom => Inner::Raw(checked),
            StreamKind::Seed => Inner::Seed(Conditioner::new(checked)),
            StreamKind::Drbg => {
                let input: Box<dyn drbg::EntropyInput> = if raw_kind == SourceKind::Rdrand {
                    Box::new(Conditioner::new(checked))
                } else {
                    Box::new(drbg::DirectInput(checked))
                };
                let mut d = Drbg::new(input, opts.prediction_resistance, &opts.personalization)?;
                d.set_reseed_interval(opts.reseed_interval);
                Inner::Drbg(Box::new(d))
            }
        };
        let name = match &inner {
            Inner::Raw(c) => c.name(),
            Inner::Seed(c) => c.name(),
            Inner::Drbg(d) => d.name(),
        };
        Ok(Self {
            kind,
            inner,
            name,
            bytes: 0,
            quarantine: None,
        })
    }

    /// What it serves.
    #[must_use]
    pub fn kind(&self) -> StreamKind {
        self.kind
    }

    /// The name reported everywhere, e.g.
    /// `drbg(CTR_DRBG AES-256 df, input seed(rdrand 512:1 AES-CBC-MAC))`.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes served so far.
    #[must_use]
    pub fn bytes_served(&self) -> u64 {
        self.bytes
    }

    /// Fills `out`. On error `out` is wiped and nothing of it may be served.
    ///
    /// # Errors
    /// The source's failure: unavailable, exhausted retries, quarantined.
    pub fn fill(&mut self, out: &mut [u8]) -> Result<(), DrngError> {
        let r = match &mut self.inner {
            Inner::Raw(c) => drbg::fill_bytes(c, out),
            Inner::Seed(c) => c.fill(out),
            Inner::Drbg(d) => d.fill(out),
        };
        if let Err(DrngError::Quarantined { failure, .. }) = &r {
            self.quarantine = Some(failure.clone());
        }
        r?;
        self.bytes += out.len() as u64;
        Ok(())
    }

    /// The health-test failure that quarantined this stream's source, if any.
    #[must_use]
    pub fn quarantined(&self) -> Option<&HealthFailure> {
        self.quarantine.as_ref()
    }

    /// Reseeds done (DRBG streams; 0 otherwise).
    #[must_use]
    pub fn reseeds(&self) -> u64 {
        match &self.inner {
            Inner::Drbg(d) => d.reseeds(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_is_send() {
        fn send<T: Send>() {}
        send::<Stream>();
    }

    #[test]
    fn every_stream_kind_over_an_injected_source() {
        for kind in StreamKind::ALL {
            let ctl = FaultControl::new();
            let raw = Box::new(FaultySource::new(source::TestPattern::new(1), ctl.clone()));
            let mut s =
                Stream::with_source(kind, raw, SourceKind::Rdrand, &StreamOptions::default())
                    .expect("open");
            let mut buf = vec![0u8; 1000];
            s.fill(&mut buf).expect("healthy");
            assert_eq!(s.bytes_served(), 1000);
            assert!(s.name().contains("faulty(test-pattern)"), "{}", s.name());
            ctl.set(Fault::Stuck(42));
            // A DRBG draws no entropy between reseeds; its stop on a fault is
            // shown with prediction resistance in the next test.
            if kind != StreamKind::Drbg {
                let e = s.fill(&mut buf).expect_err("stuck source must stop");
                assert!(matches!(e, DrngError::Quarantined { .. }), "{e}");
                assert!(s.quarantined().is_some());
                assert!(buf.iter().all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn drbg_stream_with_prediction_resistance_stops_on_fault() {
        let ctl = FaultControl::new();
        let raw = Box::new(FaultySource::new(source::TestPattern::new(2), ctl.clone()));
        let opts = StreamOptions {
            prediction_resistance: true,
            ..StreamOptions::default()
        };
        let mut s =
            Stream::with_source(StreamKind::Drbg, raw, SourceKind::Rdrand, &opts).expect("open");
        let mut buf = vec![0u8; 4096];
        s.fill(&mut buf).expect("healthy");
        ctl.set(Fault::Repeat { period: 100 });
        assert!(s.fill(&mut buf).is_err());
        assert!(s.quarantined().is_some());
        ctl.set(Fault::None);
        assert!(s.fill(&mut buf).is_err(), "quarantine is permanent");
    }
}
