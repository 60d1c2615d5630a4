//! SP 800-90B §4.4 continuous health tests on raw samples: the Repetition
//! Count Test (§4.4.1) and the Adaptive Proportion Test (§4.4.2).
//!
//! Cutoffs follow from the claimed min-entropy per sample `H` and the false
//! positive probability α = 2^-20 that 90B recommends:
//!
//! - RCT: `C = 1 + ceil(20 / H)`. A run of `C` identical consecutive samples
//!   fails.
//! - APT: window `W` = 512 samples for non-binary sources (1024 for binary);
//!   the first sample `A` of each window is counted (`B = 1`) and every later
//!   sample of the window equal to `A` increments `B`; `B >= C` fails, with
//!   `C = 1 + CRITBINOM(W, 2^-H, 1 - α)`, the smallest `C` such that a source
//!   with exactly `H` bits per sample reaches `C` matches with probability at
//!   most α. [`critbinom`] computes the binomial critical value exactly (tail
//!   sums in log space); the unit tests check it against 90B Table 2.
//!   For large `H` the formula gives `C = 1`, which would fail every window;
//!   `C` is then raised to 2 (any recurrence of `A` in the window fails).
//!
//! What memveil claims: samples are 64-bit words. The claim is
//! [`DEFAULT_H_BITS`] = 32 bits per 64-bit sample for RDRAND, RDSEED and
//! getrandom — half of the full entropy Intel and the kernel claim, so the
//! tests never fire on a healthy source (a false alarm needs two equal 64-bit
//! words, about 2^-64 per pair) yet fire at once on a stuck source (RCT, C=2),
//! a source cycling through fewer than 512 values (APT, C=2), or a source
//! whose entropy collapsed to about 20 bits or fewer per sample.
//!
//! [`HealthChecked`] applies both tests to every sample of a source before any
//! of it leaves: a batch in which a test fails is wiped, the source is
//! quarantined for good (every later call fails with
//! [`DrngError::Quarantined`], naming the source and the failure), and no
//! byte of it is ever served.

use serde::Serialize;

use crate::source::{RawSource, SourceKind, SourceStats};
use crate::DrngError;

/// -log2(α): the false-positive probability of each test is 2^-20.
pub const ALPHA_LOG2: u32 = 20;

/// APT window for non-binary samples (90B §4.4.2).
pub const APT_WINDOW: u32 = 512;

/// APT window for binary samples (90B §4.4.2).
pub const APT_WINDOW_BINARY: u32 = 1024;

/// Claimed min-entropy, in bits, of one 64-bit raw sample.
pub const DEFAULT_H_BITS: f64 = 32.0;

/// The Repetition Count Test cutoff `C = 1 + ceil(alpha_log2 / H)`.
///
/// # Panics
/// Never for `h > 0`; `h <= 0` is clamped to a tiny positive value.
#[must_use]
pub fn rct_cutoff(h: f64, alpha_log2: u32) -> u32 {
    let h = h.max(1e-9);
    let c = (f64::from(alpha_log2) / h).ceil();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let c = c.min(f64::from(u32::MAX - 1)) as u32;
    1 + c
}

/// `CRITBINOM(n, p, 1 - 2^-alpha_log2)`: the smallest `k` such that
/// `P(X <= k) >= 1 - α` for `X ~ Binomial(n, p)`, computed as the smallest
/// `k` with upper tail `P(X > k) <= α` (tail sums from the top, in log space,
/// so no precision is lost near 1).
#[must_use]
pub fn critbinom(n: u32, p: f64, alpha_log2: u32) -> u32 {
    let alpha = (-f64::from(alpha_log2)).exp2();
    if p <= 0.0 {
        return 0;
    }
    if p >= 1.0 {
        return n;
    }
    let nf = f64::from(n);
    let (lp, lq) = (p.ln(), (-p).ln_1p());
    // log pmf(i) built by the ratio pmf(i+1)/pmf(i) = (n-i)/(i+1) * p/q.
    let mut logpmf = Vec::with_capacity(n as usize + 1);
    let mut l = nf * lq;
    logpmf.push(l);
    for i in 0..n {
        let fi = f64::from(i);
        l += ((nf - fi) / (fi + 1.0)).ln() + lp - lq;
        logpmf.push(l);
    }
    // tail[k] = P(X > k), summed from the top down.
    let mut tail = 0.0f64;
    let mut k = n;
    loop {
        // Here tail = P(X > k).
        if tail > alpha {
            return k + 1;
        }
        if k == 0 {
            return 0;
        }
        tail += logpmf[k as usize].exp();
        k -= 1;
    }
}

/// The Adaptive Proportion Test cutoff `C = 1 + CRITBINOM(W, 2^-H, 1 - α)`,
/// at least 2.
#[must_use]
pub fn apt_cutoff(h: f64, window: u32, alpha_log2: u32) -> u32 {
    (1 + critbinom(window, (-h).exp2(), alpha_log2)).max(2)
}

/// Parameters of the two tests.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HealthConfig {
    /// Claimed min-entropy per sample, bits.
    pub h_bits: f64,
    /// -log2(α).
    pub alpha_log2: u32,
    /// APT window in samples.
    pub apt_window: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            h_bits: DEFAULT_H_BITS,
            alpha_log2: ALPHA_LOG2,
            apt_window: APT_WINDOW,
        }
    }
}

impl HealthConfig {
    /// The claim memveil makes for `kind` (64-bit samples, see the module docs).
    #[must_use]
    pub fn for_source(kind: SourceKind) -> Self {
        let _ = kind;
        Self::default()
    }

    /// RCT cutoff for this configuration.
    #[must_use]
    pub fn rct_cutoff(&self) -> u32 {
        rct_cutoff(self.h_bits, self.alpha_log2)
    }

    /// APT cutoff for this configuration.
    #[must_use]
    pub fn apt_cutoff(&self) -> u32 {
        apt_cutoff(self.h_bits, self.apt_window, self.alpha_log2)
    }
}

/// Which test failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum HealthTestKind {
    /// SP 800-90B §4.4.1.
    RepetitionCount,
    /// SP 800-90B §4.4.2.
    AdaptiveProportion,
}

impl std::fmt::Display for HealthTestKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HealthTestKind::RepetitionCount => "Repetition Count Test (SP 800-90B 4.4.1)",
            HealthTestKind::AdaptiveProportion => "Adaptive Proportion Test (SP 800-90B 4.4.2)",
        })
    }
}

/// A health-test failure.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HealthFailure {
    /// The test.
    pub test: HealthTestKind,
    /// The count that reached the cutoff (run length or matches in window).
    pub count: u32,
    /// The cutoff.
    pub cutoff: u32,
    /// 1-based index of the sample at which it failed.
    pub at_sample: u64,
    /// The claimed entropy per sample the cutoff came from.
    pub h_bits: f64,
}

impl std::fmt::Display for HealthFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.test {
            HealthTestKind::RepetitionCount => "identical consecutive samples",
            HealthTestKind::AdaptiveProportion => "repeats of the window's first sample",
        };
        write!(
            f,
            "{} failed: {} {what} at sample {} (cutoff C={} for H={} bits/sample, alpha=2^-{})",
            self.test, self.count, self.at_sample, self.cutoff, self.h_bits, ALPHA_LOG2
        )
    }
}

/// The running state of both tests over one stream of samples.
#[derive(Debug, Clone)]
pub struct HealthTests {
    cfg: HealthConfig,
    rct_c: u32,
    apt_c: u32,
    last: u64,
    run: u32,
    apt_a: u64,
    apt_b: u32,
    apt_i: u32,
    samples: u64,
    longest_run: u32,
    highest_apt: u32,
}

impl HealthTests {
    /// Fresh tests with the cutoffs of `cfg`.
    #[must_use]
    pub fn new(cfg: HealthConfig) -> Self {
        Self {
            rct_c: cfg.rct_cutoff(),
            apt_c: cfg.apt_cutoff(),
            cfg,
            last: 0,
            run: 0,
            apt_a: 0,
            apt_b: 0,
            apt_i: 0,
            samples: 0,
            longest_run: 0,
            highest_apt: 0,
        }
    }

    /// Feeds one sample through both tests.
    ///
    /// # Errors
    /// The first test that fails on this sample.
    pub fn feed(&mut self, x: u64) -> Result<(), HealthFailure> {
        self.samples += 1;
        // Repetition Count Test.
        if self.run > 0 && x == self.last {
            self.run += 1;
        } else {
            self.last = x;
            self.run = 1;
        }
        self.longest_run = self.longest_run.max(self.run);
        if self.run >= self.rct_c {
            return Err(self.failure(HealthTestKind::RepetitionCount, self.run, self.rct_c));
        }
        // Adaptive Proportion Test.
        if self.apt_i == 0 {
            self.apt_a = x;
            self.apt_b = 1;
            self.apt_i = 1;
        } else {
            if x == self.apt_a {
                self.apt_b += 1;
            }
            self.apt_i += 1;
            self.highest_apt = self.highest_apt.max(self.apt_b);
            if self.apt_b >= self.apt_c {
                return Err(self.failure(
                    HealthTestKind::AdaptiveProportion,
                    self.apt_b,
                    self.apt_c,
                ));
            }
            if self.apt_i >= self.cfg.apt_window {
                self.apt_i = 0;
            }
        }
        Ok(())
    }

    fn failure(&self, test: HealthTestKind, count: u32, cutoff: u32) -> HealthFailure {
        HealthFailure {
            test,
            count,
            cutoff,
            at_sample: self.samples,
            h_bits: self.cfg.h_bits,
        }
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> HealthConfig {
        self.cfg
    }

    /// (RCT cutoff, APT cutoff).
    #[must_use]
    pub fn cutoffs(&self) -> (u32, u32) {
        (self.rct_c, self.apt_c)
    }

    /// Samples tested so far.
    #[must_use]
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Longest run of identical samples seen.
    #[must_use]
    pub fn longest_run(&self) -> u32 {
        self.longest_run
    }

    /// Highest APT count `B` seen in any window.
    #[must_use]
    pub fn highest_apt_count(&self) -> u32 {
        self.highest_apt
    }
}

/// A source whose every sample passes both health tests before it is
/// released; a failure quarantines the source for good.
pub struct HealthChecked<S: RawSource = Box<dyn RawSource>> {
    inner: S,
    tests: HealthTests,
    failure: Option<HealthFailure>,
}

impl<S: RawSource> HealthChecked<S> {
    /// Wraps `inner` with the tests of `cfg`.
    pub fn new(inner: S, cfg: HealthConfig) -> Self {
        Self {
            inner,
            tests: HealthTests::new(cfg),
            failure: None,
        }
    }

    /// Why the source is quarantined, if it is.
    #[must_use]
    pub fn quarantined(&self) -> Option<&HealthFailure> {
        self.failure.as_ref()
    }

    /// The running tests (counters, cutoffs).
    #[must_use]
    pub fn tests(&self) -> &HealthTests {
        &self.tests
    }
}

impl<S: RawSource> RawSource for HealthChecked<S> {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn fill(&mut self, out: &mut [u64]) -> Result<(), DrngError> {
        if let Some(f) = &self.failure {
            return Err(DrngError::Quarantined {
                name: self.inner.name(),
                failure: f.clone(),
            });
        }
        self.inner.fill(out)?;
        for i in 0..out.len() {
            if let Err(f) = self.tests.feed(out[i]) {
                zeroize::Zeroize::zeroize(out);
                self.failure = Some(f.clone());
                return Err(DrngError::Quarantined {
                    name: self.inner.name(),
                    failure: f,
                });
            }
        }
        Ok(())
    }

    fn stats(&self) -> SourceStats {
        self.inner.stats()
    }
}

/// The result of a short live sample of one source through both tests.
#[derive(Debug, Clone, Serialize)]
pub struct HealthReport {
    /// Source name.
    pub source: String,
    /// Whether the source could be opened here.
    pub available: bool,
    /// Why not, or the error that stopped sampling.
    pub error: Option<String>,
    /// Samples tested.
    pub samples: u64,
    /// Bits per sample.
    pub sample_bits: u32,
    /// Claimed min-entropy per sample.
    pub h_bits: f64,
    /// -log2(α).
    pub alpha_log2: u32,
    /// RCT cutoff.
    pub rct_cutoff: u32,
    /// APT window.
    pub apt_window: u32,
    /// APT cutoff.
    pub apt_cutoff: u32,
    /// Longest run of identical samples seen.
    pub longest_run: u32,
    /// Highest APT count seen.
    pub highest_apt_count: u32,
    /// The failure, if a test failed.
    pub failure: Option<HealthFailure>,
    /// Source counters (attempts, failed attempts).
    pub stats: SourceStats,
    /// True when the source was available, delivered every sample and both
    /// tests passed.
    pub passed: bool,
}

/// Takes `samples` live 64-bit samples from `kind` through both tests (for
/// `memveil probe`).
#[must_use]
pub fn sample_source(kind: SourceKind, samples: usize) -> HealthReport {
    let cfg = HealthConfig::for_source(kind);
    let mut report = HealthReport {
        source: kind.name().to_owned(),
        available: false,
        error: None,
        samples: 0,
        sample_bits: 64,
        h_bits: cfg.h_bits,
        alpha_log2: cfg.alpha_log2,
        rct_cutoff: cfg.rct_cutoff(),
        apt_window: cfg.apt_window,
        apt_cutoff: cfg.apt_cutoff(),
        longest_run: 0,
        highest_apt_count: 0,
        failure: None,
        stats: SourceStats::default(),
        passed: false,
    };
    let src = match kind.open() {
        Ok(s) => s,
        Err(e) => {
            report.error = Some(e.to_string());
            return report;
        }
    };
    report.available = true;
    let mut checked = HealthChecked::new(src, cfg);
    sample_into(&mut checked, samples, &mut report);
    report
}

/// Runs `samples` samples of an already opened source through `checked` and
/// fills `report` (shared by [`sample_source`] and the fault tests).
pub fn sample_into<S: RawSource>(
    checked: &mut HealthChecked<S>,
    samples: usize,
    report: &mut HealthReport,
) {
    let mut buf = [0u64; 256];
    let mut left = samples;
    let mut err = None;
    while left > 0 {
        let n = left.min(buf.len());
        if let Err(e) = checked.fill(&mut buf[..n]) {
            err = Some(e);
            break;
        }
        left -= n;
    }
    zeroize::Zeroize::zeroize(&mut buf);
    let t = checked.tests();
    report.source = checked.name();
    report.samples = t.samples();
    report.longest_run = t.longest_run();
    report.highest_apt_count = t.highest_apt_count();
    report.failure = checked.quarantined().cloned();
    report.stats = checked.stats();
    report.passed = err.is_none() && report.failure.is_none();
    report.error = err.map(|e| e.to_string());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{Fault, FaultControl, FaultySource, TestPattern};

    #[test]
    fn rct_cutoffs_match_the_formula() {
        // 90B 4.4.1 example: H = 2 → C = 1 + ceil(20/2) = 11.
        assert_eq!(rct_cutoff(2.0, 20), 11);
        assert_eq!(rct_cutoff(1.0, 20), 21);
        assert_eq!(rct_cutoff(8.0, 20), 4);
        assert_eq!(rct_cutoff(0.5, 20), 41);
        assert_eq!(rct_cutoff(32.0, 20), 2);
        assert_eq!(rct_cutoff(64.0, 20), 2);
    }

    #[test]
    fn apt_cutoffs_match_90b_table_2() {
        // SP 800-90B (Jan 2018) Table 2, α = 2^-20.
        // Non-binary, W = 512.
        for (h, c) in [(0.5, 410), (1.0, 311), (2.0, 177), (4.0, 62), (8.0, 13)] {
            assert_eq!(apt_cutoff(h, APT_WINDOW, 20), c, "W=512 H={h}");
        }
        // Binary, W = 1024: computed independently with exact integer
        // binomial coefficients (Python `math.comb`), same α.
        for (h, c) in [(0.2, 941), (0.4, 840), (0.6, 748), (0.8, 664), (1.0, 589)] {
            assert_eq!(apt_cutoff(h, APT_WINDOW_BINARY, 20), c, "W=1024 H={h}");
        }
    }

    #[test]
    fn apt_cutoff_is_at_least_two() {
        assert_eq!(apt_cutoff(32.0, APT_WINDOW, 20), 2);
        assert_eq!(apt_cutoff(64.0, APT_WINDOW, 20), 2);
        assert_eq!(HealthConfig::default().rct_cutoff(), 2);
        assert_eq!(HealthConfig::default().apt_cutoff(), 2);
    }

    #[test]
    fn healthy_pattern_passes_a_million_samples() {
        let mut c = HealthChecked::new(TestPattern::new(7), HealthConfig::default());
        let mut buf = vec![0u64; 4096];
        for _ in 0..256 {
            c.fill(&mut buf).expect("healthy");
        }
        assert!(c.quarantined().is_none());
        assert_eq!(c.tests().longest_run(), 1);
    }

    #[test]
    fn stuck_source_is_quarantined_and_wiped() {
        let ctl = FaultControl::new();
        let mut c = HealthChecked::new(
            FaultySource::new(TestPattern::new(3), ctl.clone()),
            HealthConfig::default(),
        );
        let mut buf = [0u64; 64];
        c.fill(&mut buf).expect("healthy first");
        ctl.set(Fault::Stuck(0xdead_beef));
        let e = c.fill(&mut buf).expect_err("stuck must fail");
        assert!(buf.iter().all(|&x| x == 0), "failed batch must be wiped");
        let DrngError::Quarantined { name, failure } = &e else {
            panic!("unexpected {e}");
        };
        assert_eq!(name, "faulty(test-pattern)");
        assert_eq!(failure.test, HealthTestKind::RepetitionCount);
        // Healing the source does not lift the quarantine.
        ctl.set(Fault::None);
        assert!(matches!(
            c.fill(&mut buf),
            Err(DrngError::Quarantined { .. })
        ));
        assert!(e.to_string().contains("Repetition Count"), "{e}");
    }

    #[test]
    fn short_cycle_is_caught_by_apt() {
        let ctl = FaultControl::new();
        let mut c = HealthChecked::new(
            FaultySource::new(TestPattern::new(5), ctl.clone()),
            HealthConfig::default(),
        );
        let mut buf = [0u64; 300];
        c.fill(&mut buf).expect("healthy first");
        ctl.set(Fault::Repeat { period: 300 });
        let mut big = [0u64; 1024];
        let e = c.fill(&mut big).expect_err("cycle must fail");
        let DrngError::Quarantined { failure, .. } = e else {
            panic!("unexpected {e}");
        };
        assert_eq!(failure.test, HealthTestKind::AdaptiveProportion);
    }

    #[test]
    fn collapsed_entropy_is_caught() {
        // 8 bits per sample is far below the 32 claimed: repeats within a
        // 512-sample window are certain.
        let ctl = FaultControl::new();
        ctl.set(Fault::LowBits { bits: 8 });
        let mut c = HealthChecked::new(
            FaultySource::new(TestPattern::new(9), ctl),
            HealthConfig::default(),
        );
        let mut big = [0u64; 4096];
        assert!(c.fill(&mut big).is_err());
    }

    #[test]
    fn sample_source_reports_live_rdrand_or_why_not() {
        let r = sample_source(SourceKind::Rdrand, 4096);
        if r.available {
            assert!(r.passed, "{r:?}");
            assert_eq!(r.samples, 4096);
        } else {
            memveil_testkit::skip(
                memveil_testkit::Need::Cpu("RDRAND"),
                format!("the rdrand sample: {:?}", r.error),
            );
            assert!(r.error.is_some());
        }
        let g = sample_source(SourceKind::Getrandom, 1024);
        assert!(g.passed && g.available, "{g:?}");
    }
}
