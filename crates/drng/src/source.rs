//! Raw entropy sources: RDRAND, RDSEED, `getrandom(2)`, and a fault-injection
//! wrapper for tests.
//!
//! A source yields 64-bit samples. RDRAND and RDSEED are detected by CPUID
//! (`memveil_sys::has_feature`) and driven one attempt at a time through
//! `memveil_sys::rdrand64`/`rdseed64`; the retry policy lives here:
//!
//! - RDRAND: at most [`RDRAND_RETRIES`] attempts per sample, as the Intel DRNG
//!   Software Implementation Guide recommends (its retry recommendations). An underflow that
//!   survives 10 retries means the DRNG is broken, not busy.
//! - RDSEED: the ENRNG refills slowly and fails often when several threads
//!   draw on it (measured on this machine: see `docs/rng.md`), so it gets
//!   [`RDSEED_RETRIES`] attempts with a `pause` between them.
//!
//! Every source has a name that is reported in every error, status and report.
//! Setting `MEMVEIL_DRNG_DISABLE=rdrand,rdseed` makes detection report the
//! instruction absent, to exercise the "CPU lacks RDRAND" path on machines
//! that have it (the error then says it was simulated).

use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};

use memveil_sys::CpuFeature;
use serde::Serialize;

use crate::DrngError;

/// RDRAND attempts per 64-bit sample before the source is declared failed
/// (Intel DRNG guide: "10 retries").
pub const RDRAND_RETRIES: u32 = 10;

/// RDSEED attempts per 64-bit sample, with a `pause` between attempts. About
/// 75% of attempts fail in a tight loop on this machine and more under
/// contention; 0.9^4096 is about 1e-187, so a healthy but busy ENRNG never
/// exhausts this, while a dead one is reported within a millisecond or so.
pub const RDSEED_RETRIES: u32 = 4096;

/// Environment variable that makes RDRAND/RDSEED detection report the
/// instruction absent (comma-separated names: `rdrand`, `rdseed`).
pub const DISABLE_ENV: &str = "MEMVEIL_DRNG_DISABLE";

/// The raw sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum SourceKind {
    /// The RDRAND instruction (output of the on-chip CTR_DRBG).
    Rdrand,
    /// The RDSEED instruction (output of the on-chip ENRNG, seed grade).
    Rdseed,
    /// The kernel's `getrandom(2)`.
    Getrandom,
}

impl SourceKind {
    /// All raw sources, in order of preference for seeding.
    pub const ALL: [SourceKind; 3] = [
        SourceKind::Rdrand,
        SourceKind::Rdseed,
        SourceKind::Getrandom,
    ];

    /// The name used in every report: `rdrand`, `rdseed`, `getrandom`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Rdrand => "rdrand",
            SourceKind::Rdseed => "rdseed",
            SourceKind::Getrandom => "getrandom",
        }
    }

    fn feature(self) -> Option<(CpuFeature, &'static str, &'static str)> {
        match self {
            SourceKind::Rdrand => Some((CpuFeature::Rdrand, "RDRAND", "CPUID.1:ECX[30]")),
            SourceKind::Rdseed => {
                Some((CpuFeature::Rdseed, "RDSEED", "CPUID.(EAX=7,ECX=0):EBX[18]"))
            }
            SourceKind::Getrandom => None,
        }
    }

    /// Whether this source can be used here (CPUID bit set and not disabled
    /// through [`DISABLE_ENV`]); `getrandom` is always considered present and
    /// reports its own error at first use (ENOSYS on kernels before 3.17).
    ///
    /// # Errors
    /// [`DrngError::Unavailable`] naming the instruction, the CPUID bit and
    /// the fix.
    pub fn check_available(self) -> Result<(), DrngError> {
        let Some((feature, insn, cpuid)) = self.feature() else {
            return Ok(());
        };
        if disabled_by_env(self) {
            return Err(DrngError::Unavailable {
                instruction: insn,
                cpuid,
                simulated: true,
            });
        }
        if !memveil_sys::has_feature(feature) {
            return Err(DrngError::Unavailable {
                instruction: insn,
                cpuid,
                simulated: false,
            });
        }
        Ok(())
    }

    /// Opens this source (without health tests; see
    /// [`crate::health::HealthChecked`]).
    ///
    /// # Errors
    /// [`DrngError::Unavailable`] when the CPU lacks the instruction.
    pub fn open(self) -> Result<Box<dyn RawSource>, DrngError> {
        self.check_available()?;
        Ok(match self {
            SourceKind::Rdrand => Box::new(Rdrand::new_unchecked()),
            SourceKind::Rdseed => Box::new(Rdseed::new_unchecked()),
            SourceKind::Getrandom => Box::new(Getrandom::new()),
        })
    }
}

impl std::fmt::Display for SourceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SourceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "rdrand" => Ok(SourceKind::Rdrand),
            "rdseed" => Ok(SourceKind::Rdseed),
            "getrandom" => Ok(SourceKind::Getrandom),
            other => Err(format!(
                "unknown source {other:?}; sources are rdrand, rdseed, getrandom"
            )),
        }
    }
}

fn disabled_by_env(kind: SourceKind) -> bool {
    std::env::var(DISABLE_ENV)
        .map(|v| {
            v.split(',')
                .any(|n| n.trim().eq_ignore_ascii_case(kind.name()))
        })
        .unwrap_or(false)
}

/// Counters of one source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SourceStats {
    /// 64-bit samples delivered.
    pub samples: u64,
    /// Instruction attempts (RDRAND/RDSEED) or system calls (getrandom).
    pub attempts: u64,
    /// Attempts that reported failure (CF=0).
    pub failed_attempts: u64,
    /// Samples for which every retry failed.
    pub exhausted: u64,
}

impl SourceStats {
    /// Fraction of attempts that failed, 0 when nothing was attempted.
    #[must_use]
    pub fn failure_rate(&self) -> f64 {
        if self.attempts == 0 {
            0.0
        } else {
            #[allow(clippy::cast_precision_loss)]
            let r = self.failed_attempts as f64 / self.attempts as f64;
            r
        }
    }
}

/// A raw source of 64-bit samples.
pub trait RawSource: Send {
    /// The name reported everywhere (`rdrand`, `faulty(rdrand)`, ...).
    fn name(&self) -> String;
    /// Fills `out` with samples.
    ///
    /// # Errors
    /// The source's failure; `out` then holds no sample of it.
    fn fill(&mut self, out: &mut [u64]) -> Result<(), DrngError>;
    /// The source's counters.
    fn stats(&self) -> SourceStats;
}

impl RawSource for Box<dyn RawSource> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn fill(&mut self, out: &mut [u64]) -> Result<(), DrngError> {
        (**self).fill(out)
    }
    fn stats(&self) -> SourceStats {
        (**self).stats()
    }
}

/// RDRAND with the DRNG guide's 10-retry loop.
#[derive(Debug, Default)]
pub struct Rdrand {
    stats: SourceStats,
}

impl Rdrand {
    /// Opens RDRAND.
    ///
    /// # Errors
    /// [`DrngError::Unavailable`] when CPUID does not report RDRAND.
    pub fn new() -> Result<Self, DrngError> {
        SourceKind::Rdrand.check_available()?;
        Ok(Self::new_unchecked())
    }

    fn new_unchecked() -> Self {
        Self::default()
    }
}

impl RawSource for Rdrand {
    fn name(&self) -> String {
        "rdrand".into()
    }

    fn fill(&mut self, out: &mut [u64]) -> Result<(), DrngError> {
        for slot in out.iter_mut() {
            let mut got = None;
            for _ in 0..RDRAND_RETRIES {
                self.stats.attempts += 1;
                if let Some(v) = memveil_sys::rdrand64() {
                    got = Some(v);
                    break;
                }
                self.stats.failed_attempts += 1;
            }
            let Some(v) = got else {
                self.stats.exhausted += 1;
                zeroize::Zeroize::zeroize(out);
                return Err(DrngError::Exhausted {
                    name: "rdrand".into(),
                    attempts: RDRAND_RETRIES,
                });
            };
            *slot = v;
            self.stats.samples += 1;
        }
        Ok(())
    }

    fn stats(&self) -> SourceStats {
        self.stats
    }
}

/// RDSEED with a long retry loop and a `pause` between attempts.
#[derive(Debug)]
pub struct Rdseed {
    stats: SourceStats,
    retries: u32,
}

impl Rdseed {
    /// Opens RDSEED with [`RDSEED_RETRIES`] attempts per sample.
    ///
    /// # Errors
    /// [`DrngError::Unavailable`] when CPUID does not report RDSEED.
    pub fn new() -> Result<Self, DrngError> {
        SourceKind::Rdseed.check_available()?;
        Ok(Self::new_unchecked())
    }

    fn new_unchecked() -> Self {
        Self {
            stats: SourceStats::default(),
            retries: RDSEED_RETRIES,
        }
    }

    /// Sets the attempts per sample (at least 1); for measurements.
    #[must_use]
    pub fn with_retries(mut self, retries: u32) -> Self {
        self.retries = retries.max(1);
        self
    }
}

impl RawSource for Rdseed {
    fn name(&self) -> String {
        "rdseed".into()
    }

    fn fill(&mut self, out: &mut [u64]) -> Result<(), DrngError> {
        for slot in out.iter_mut() {
            let mut got = None;
            for i in 0..self.retries {
                if i > 0 {
                    std::hint::spin_loop();
                }
                self.stats.attempts += 1;
                if let Some(v) = memveil_sys::rdseed64() {
                    got = Some(v);
                    break;
                }
                self.stats.failed_attempts += 1;
            }
            let Some(v) = got else {
                self.stats.exhausted += 1;
                zeroize::Zeroize::zeroize(out);
                return Err(DrngError::Exhausted {
                    name: "rdseed".into(),
                    attempts: self.retries,
                });
            };
            *slot = v;
            self.stats.samples += 1;
        }
        Ok(())
    }

    fn stats(&self) -> SourceStats {
        self.stats
    }
}

/// The kernel's `getrandom(2)` (blocking until the pool is initialised).
#[derive(Debug, Default)]
pub struct Getrandom {
    stats: SourceStats,
}

impl Getrandom {
    /// Opens `getrandom(2)`.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }
}

impl RawSource for Getrandom {
    fn name(&self) -> String {
        "getrandom".into()
    }

    fn fill(&mut self, out: &mut [u64]) -> Result<(), DrngError> {
        let mut bytes = vec![0u8; out.len() * 8];
        self.stats.attempts += 1;
        if let Err(e) = memveil_sys::getrandom(&mut bytes) {
            self.stats.failed_attempts += 1;
            return Err(DrngError::Getrandom(e));
        }
        for (slot, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            *slot = u64::from_le_bytes(b);
        }
        zeroize::Zeroize::zeroize(&mut bytes);
        self.stats.samples += out.len() as u64;
        Ok(())
    }

    fn stats(&self) -> SourceStats {
        self.stats
    }
}

/// A fault to inject into a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Fault {
    /// Pass the inner source through unchanged.
    #[default]
    None,
    /// Every sample is this value (a stuck-at fault).
    Stuck(u64),
    /// Replay the last `period` samples delivered, cyclically (a source that
    /// fell into a short cycle).
    Repeat {
        /// Cycle length in samples (at least 1).
        period: usize,
    },
    /// Every attempt fails, as RDRAND does when CF stays 0.
    Fail,
    /// Only `bits` low bits of each sample vary (the rest are zero): a source
    /// whose entropy collapsed.
    LowBits {
        /// Bits kept (0..=63).
        bits: u32,
    },
}

/// A handle that switches the fault of a [`FaultySource`] from any thread.
#[derive(Debug, Clone, Default)]
pub struct FaultControl(Arc<Mutex<Fault>>);

impl FaultControl {
    /// A handle with no fault set.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the fault applied from the next fill on.
    pub fn set(&self, fault: Fault) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = fault;
    }

    /// The fault in force.
    #[must_use]
    pub fn get(&self) -> Fault {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Wraps any source and makes it stuck, repeating, failing or low-entropy on
/// command (for tests of the health tests, quarantine and serving).
pub struct FaultySource<S: RawSource> {
    inner: S,
    ctl: FaultControl,
    history: VecDeque<u64>,
    replay: usize,
    stats: SourceStats,
}

/// Samples of history kept for [`Fault::Repeat`].
const FAULT_HISTORY: usize = 1 << 16;

impl<S: RawSource> FaultySource<S> {
    /// Wraps `inner`; the fault is switched through `ctl`.
    pub fn new(inner: S, ctl: FaultControl) -> Self {
        Self {
            inner,
            ctl,
            history: VecDeque::new(),
            replay: 0,
            stats: SourceStats::default(),
        }
    }
}

impl<S: RawSource> RawSource for FaultySource<S> {
    fn name(&self) -> String {
        format!("faulty({})", self.inner.name())
    }

    fn fill(&mut self, out: &mut [u64]) -> Result<(), DrngError> {
        let fault = self.ctl.get();
        self.stats.attempts += 1;
        match fault {
            Fault::None | Fault::LowBits { .. } => {
                self.inner.fill(out)?;
                if let Fault::LowBits { bits } = fault {
                    let mask = if bits >= 64 {
                        u64::MAX
                    } else {
                        (1u64 << bits) - 1
                    };
                    for x in out.iter_mut() {
                        *x &= mask;
                    }
                }
                for &x in out.iter() {
                    if self.history.len() == FAULT_HISTORY {
                        self.history.pop_front();
                    }
                    self.history.push_back(x);
                }
                self.replay = 0;
            }
            Fault::Stuck(v) => out.fill(v),
            Fault::Repeat { period } => {
                let period = period.clamp(1, FAULT_HISTORY);
                if self.history.is_empty() {
                    self.history.push_back(0);
                }
                let period = period.min(self.history.len());
                let start = self.history.len() - period;
                for x in out.iter_mut() {
                    *x = self.history[start + self.replay % period];
                    self.replay += 1;
                }
            }
            Fault::Fail => {
                self.stats.failed_attempts += 1;
                self.stats.exhausted += 1;
                return Err(DrngError::Exhausted {
                    name: self.name(),
                    attempts: RDRAND_RETRIES,
                });
            }
        }
        self.stats.samples += out.len() as u64;
        Ok(())
    }

    fn stats(&self) -> SourceStats {
        self.stats
    }
}

/// A deterministic source for tests: a 64-bit counter run through a mixing
/// function (SplitMix64), so it passes the health tests but is reproducible.
/// Never use it for anything but tests; its name says so.
#[derive(Debug, Clone)]
pub struct TestPattern {
    state: u64,
    stats: SourceStats,
}

impl TestPattern {
    /// Starts at `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self {
            state: seed,
            stats: SourceStats::default(),
        }
    }
}

impl RawSource for TestPattern {
    fn name(&self) -> String {
        "test-pattern".into()
    }

    fn fill(&mut self, out: &mut [u64]) -> Result<(), DrngError> {
        for x in out.iter_mut() {
            self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            *x = z ^ (z >> 31);
        }
        self.stats.samples += out.len() as u64;
        self.stats.attempts += out.len() as u64;
        Ok(())
    }

    fn stats(&self) -> SourceStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in SourceKind::ALL {
            assert_eq!(k.name().parse::<SourceKind>(), Ok(k));
        }
        assert!("rdrnd".parse::<SourceKind>().is_err());
    }

    #[test]
    fn rdrand_follows_cpuid() {
        match Rdrand::new() {
            Ok(mut r) => {
                let mut v = [0u64; 64];
                r.fill(&mut v).expect("rdrand fill");
                assert!(v.iter().any(|&x| x != 0));
                assert_eq!(r.stats().samples, 64);
            }
            Err(e) => {
                assert!(e.to_string().contains("CPUID.1:ECX[30]"), "{e}");
                memveil_testkit::skip(memveil_testkit::Need::Cpu("RDRAND"), e);
            }
        }
    }

    #[test]
    fn rdseed_delivers_with_retries() {
        match Rdseed::new() {
            Ok(mut r) => {
                let mut v = [0u64; 256];
                r.fill(&mut v).expect("rdseed fill");
                let s = r.stats();
                assert_eq!(s.samples, 256);
                assert!(s.attempts >= 256);
            }
            Err(e) => {
                assert!(
                    matches!(e, DrngError::Unavailable { .. }),
                    "only a CPU without RDSEED may skip: {e}"
                );
                memveil_testkit::skip(memveil_testkit::Need::Cpu("RDSEED"), e);
            }
        }
    }

    #[test]
    fn getrandom_fills() {
        let mut g = Getrandom::new();
        let mut v = [0u64; 16];
        g.fill(&mut v).expect("getrandom");
        assert!(v.iter().any(|&x| x != 0));
    }

    #[test]
    fn faults_switch_at_runtime() {
        let ctl = FaultControl::new();
        let mut f = FaultySource::new(TestPattern::new(1), ctl.clone());
        let mut v = [0u64; 8];
        f.fill(&mut v).expect("pass-through");
        let last4 = [v[4], v[5], v[6], v[7]];
        ctl.set(Fault::Repeat { period: 4 });
        let mut w = [0u64; 8];
        f.fill(&mut w).expect("repeat");
        assert_eq!(&w[..4], &last4);
        assert_eq!(&w[4..], &last4);
        ctl.set(Fault::Stuck(7));
        f.fill(&mut w).expect("stuck");
        assert!(w.iter().all(|&x| x == 7));
        ctl.set(Fault::Fail);
        assert!(matches!(f.fill(&mut w), Err(DrngError::Exhausted { .. })));
        ctl.set(Fault::LowBits { bits: 4 });
        f.fill(&mut w).expect("low bits");
        assert!(w.iter().all(|&x| x < 16));
        assert_eq!(f.name(), "faulty(test-pattern)");
    }
}
