//! `memveil rng feed-kernel`: what `rngd` does for the local kernel pool —
//! mix seed-grade bytes into `/dev/random` with `RNDADDENTROPY` and credit
//! entropy for them — under a conservative, explicit credit policy.
//!
//! # Credit policy
//!
//! 1. Only seed-grade input is credited: `seed` (RDRAND reduced 512:1 by
//!    AES-CBC-MAC, the DRNG guide's method) or `rdseed` (the ENRNG). DRBG
//!    output is never fed (it holds no fresh entropy beyond its seed), raw
//!    RDRAND is never fed (it is DRBG output), and `getrandom` is refused
//!    (it *is* the kernel pool: crediting it would be circular).
//! 2. At most [`FeedPolicy::credit_bits_per_byte`] bits per byte are
//!    credited (default [`DEFAULT_CREDIT_BITS_PER_BYTE`] = 4, half of what
//!    the construction claims, as a margin against a partly broken source;
//!    0 mixes without crediting; 8 is allowed only when asked for).
//! 3. Nothing is credited before the SP 800-90B start-up tests: the first
//!    [`STARTUP_SAMPLES`] raw samples pass both health tests and are
//!    discarded (for `seed` that is one conditioned seed's worth of input).
//! 4. A source that fails a health test or exhausts its retries is
//!    quarantined: feeding stops with an error, and nothing of the failing
//!    batch reaches the kernel (the core wipes it).
//!
//! `RNDADDENTROPY` needs `CAP_SYS_ADMIN`; without it the first batch fails
//! with [`FeedError::NotPermitted`], which names the capability.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use zeroize::Zeroizing;

use crate::drbg::EntropyInput;
use crate::serve::SeedSpec;
use crate::source::SourceKind;
use crate::DrngError;

/// Default credit, bits per byte fed.
pub const DEFAULT_CREDIT_BITS_PER_BYTE: u32 = 4;

/// Raw samples that must pass the health tests before anything is credited
/// (SP 800-90B §4.3 start-up testing: at least 1024 samples).
pub const STARTUP_SAMPLES: usize = 1024;

/// Largest batch (one ioctl).
pub const MAX_BATCH: usize = memveil_sys::rnd::MAX_ADD;

/// What to feed and how much to credit.
#[derive(Debug, Clone)]
pub struct FeedPolicy {
    /// `Rdrand` (conditioned 512:1: the `seed` stream) or `Rdseed`.
    pub source: SourceKind,
    /// Bytes per batch (16..=4096).
    pub batch_bytes: usize,
    /// Bits credited per byte (0..=8).
    pub credit_bits_per_byte: u32,
    /// The random device.
    pub device: PathBuf,
}

impl Default for FeedPolicy {
    fn default() -> Self {
        Self {
            source: SourceKind::Rdrand,
            batch_bytes: 64,
            credit_bits_per_byte: DEFAULT_CREDIT_BITS_PER_BYTE,
            device: PathBuf::from("/dev/random"),
        }
    }
}

/// Errors of feeding the kernel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FeedError {
    /// A policy value out of range or a source that must not be credited.
    #[error("refused: {0}")]
    Policy(String),
    /// Opening the device failed.
    #[error("cannot open {path} for writing: {source}")]
    Open {
        /// The device.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// `RNDADDENTROPY` was refused for lack of privilege.
    #[error(
        "RNDADDENTROPY on {path} refused (EPERM): adding entropy to the kernel pool needs \
         CAP_SYS_ADMIN; run as root, or grant the capability (systemd: \
         AmbientCapabilities=CAP_SYS_ADMIN)"
    )]
    NotPermitted {
        /// The device.
        path: PathBuf,
    },
    /// The ioctl failed otherwise (e.g. ENOTTY: not a random device).
    #[error("RNDADDENTROPY on {path} failed: {source} (is it the kernel's random device?)")]
    Ioctl {
        /// The device.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The source failed (unavailable, quarantined, exhausted).
    #[error("entropy source: {0}")]
    Source(#[from] DrngError),
}

/// One batch fed.
#[derive(Debug, Clone, Serialize)]
pub struct Batch {
    /// Bytes mixed in.
    pub bytes: usize,
    /// Bits credited.
    pub bits_credited: u32,
    /// `RNDGETENTCNT` before, bits (None if unreadable).
    pub entropy_before: Option<i32>,
    /// `RNDGETENTCNT` after, bits.
    pub entropy_after: Option<i32>,
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct FeedReport {
    /// The input's name, e.g. `seed(rdrand 512:1 AES-CBC-MAC)`.
    pub source: String,
    /// The device.
    pub device: PathBuf,
    /// Bits credited per byte.
    pub credit_bits_per_byte: u32,
    /// Raw samples discarded by the start-up tests.
    pub startup_samples: usize,
    /// Batches fed.
    pub batches: u64,
    /// Bytes fed.
    pub bytes: u64,
    /// Bits credited.
    pub bits_credited: u64,
    /// The last batch.
    pub last: Option<Batch>,
}

/// A kernel feeder: the health-tested input, the device and the policy.
pub struct Feeder {
    policy: FeedPolicy,
    input: Box<dyn EntropyInput>,
    dev: File,
    report: FeedReport,
}

impl FeedPolicy {
    /// Checks the policy.
    ///
    /// # Errors
    /// [`FeedError::Policy`] naming the value and the allowed range.
    pub fn check(&self) -> Result<(), FeedError> {
        match self.source {
            SourceKind::Rdrand | SourceKind::Rdseed => {}
            SourceKind::Getrandom => {
                return Err(FeedError::Policy(
                    "getrandom is the kernel pool itself: feeding it back and crediting it would \
                     be circular; use --source seed or rdseed"
                        .into(),
                ))
            }
        }
        if self.credit_bits_per_byte > 8 {
            return Err(FeedError::Policy(format!(
                "--credit-bits-per-byte {}: a byte holds at most 8 bits",
                self.credit_bits_per_byte
            )));
        }
        if !(16..=MAX_BATCH).contains(&self.batch_bytes) {
            return Err(FeedError::Policy(format!(
                "--bytes {}: a batch is 16..={MAX_BATCH} bytes",
                self.batch_bytes
            )));
        }
        Ok(())
    }

    /// Bits credited for a batch of `bytes`.
    #[must_use]
    pub fn credit(&self, bytes: usize) -> u32 {
        u32::try_from(bytes.min(MAX_BATCH)).unwrap_or(0) * self.credit_bits_per_byte.min(8)
    }
}

impl Feeder {
    /// Opens the device and the real source, and runs the start-up tests.
    ///
    /// # Errors
    /// [`FeedError`] naming the cause.
    pub fn open(policy: FeedPolicy) -> Result<Self, FeedError> {
        let spec = SeedSpec::real(policy.source);
        Self::with_spec(policy, &spec)
    }

    /// As [`Feeder::open`] over any source spec (tests inject faults here).
    ///
    /// # Errors
    /// [`FeedError`] naming the cause.
    pub fn with_spec(policy: FeedPolicy, spec: &SeedSpec) -> Result<Self, FeedError> {
        policy.check()?;
        let dev = open_device(&policy.device)?;
        let mut input = spec.open()?;
        // Start-up tests: STARTUP_SAMPLES raw 64-bit samples through the
        // health tests, discarded. A conditioned seed consumes 1024 samples.
        let discard = if spec.conditioned() {
            16
        } else {
            STARTUP_SAMPLES * 8
        };
        let mut junk = Zeroizing::new(vec![0u8; discard]);
        input.get(&mut junk)?;
        let report = FeedReport {
            source: input.name(),
            device: policy.device.clone(),
            credit_bits_per_byte: policy.credit_bits_per_byte,
            startup_samples: STARTUP_SAMPLES,
            batches: 0,
            bytes: 0,
            bits_credited: 0,
            last: None,
        };
        Ok(Self {
            policy,
            input,
            dev,
            report,
        })
    }

    /// Feeds one batch.
    ///
    /// # Errors
    /// The source's failure (nothing of the batch is fed) or the ioctl's.
    pub fn feed_once(&mut self) -> Result<Batch, FeedError> {
        let mut buf = Zeroizing::new(vec![0u8; self.policy.batch_bytes]);
        self.input.get(&mut buf)?;
        let bits = self.policy.credit(buf.len());
        let before = memveil_sys::rnd::entropy_count(&self.dev).ok();
        memveil_sys::rnd::add_entropy(&self.dev, &buf, bits).map_err(|e| {
            if e.raw_os_error() == Some(libc_eperm()) {
                FeedError::NotPermitted {
                    path: self.policy.device.clone(),
                }
            } else {
                FeedError::Ioctl {
                    path: self.policy.device.clone(),
                    source: e,
                }
            }
        })?;
        let after = memveil_sys::rnd::entropy_count(&self.dev).ok();
        let b = Batch {
            bytes: buf.len(),
            bits_credited: bits,
            entropy_before: before,
            entropy_after: after,
        };
        self.report.batches += 1;
        self.report.bytes += buf.len() as u64;
        self.report.bits_credited += u64::from(bits);
        self.report.last = Some(b.clone());
        Ok(b)
    }

    /// Feeds a batch every `interval` until `stop` is set (checked every
    /// 100 ms), logging each batch through `log`.
    ///
    /// # Errors
    /// The first failing batch.
    pub fn run(
        &mut self,
        interval: Duration,
        stop: &AtomicBool,
        log: &dyn Fn(&str),
    ) -> Result<(), FeedError> {
        loop {
            let b = self.feed_once()?;
            log(&format!(
                "fed {} bytes from {}, credited {} bits; kernel entropy count {} -> {}",
                b.bytes,
                self.report.source,
                b.bits_credited,
                fmt_count(b.entropy_before),
                fmt_count(b.entropy_after)
            ));
            let t = Instant::now();
            while t.elapsed() < interval {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(100).min(interval));
            }
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
        }
    }

    /// What was done so far.
    #[must_use]
    pub fn report(&self) -> &FeedReport {
        &self.report
    }
}

fn fmt_count(c: Option<i32>) -> String {
    c.map_or_else(|| "?".into(), |n| n.to_string())
}

/// EPERM (1 on Linux), without a libc dependency in this crate.
fn libc_eperm() -> i32 {
    1
}

fn open_device(path: &Path) -> Result<File, FeedError> {
    OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|source| FeedError::Open {
            path: path.to_path_buf(),
            source,
        })
}

/// The kernel's credited entropy now, bits (`/proc/sys/kernel/random/entropy_avail`).
#[must_use]
pub fn entropy_avail() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/random/entropy_avail")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{Fault, FaultControl, FaultySource, Getrandom, RawSource};
    use std::sync::Arc;

    fn is_root() -> bool {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Uid:"))
                    .map(|l| l.split_whitespace().nth(2) == Some("0"))
            })
            .unwrap_or(false)
    }

    #[test]
    fn policy_refuses_circular_and_non_seed_sources_and_over_credit() {
        let p = FeedPolicy {
            source: SourceKind::Getrandom,
            ..FeedPolicy::default()
        };
        let e = p.check().expect_err("getrandom refused");
        assert!(e.to_string().contains("circular"), "{e}");
        let p = FeedPolicy {
            credit_bits_per_byte: 9,
            ..FeedPolicy::default()
        };
        assert!(p.check().is_err());
        let p = FeedPolicy {
            batch_bytes: 8,
            ..FeedPolicy::default()
        };
        assert!(p.check().is_err());
        let p = FeedPolicy::default();
        p.check().expect("defaults are valid");
        assert_eq!(p.credit(64), 256);
        assert_eq!(
            FeedPolicy {
                credit_bits_per_byte: 0,
                ..FeedPolicy::default()
            }
            .credit(64),
            0
        );
    }

    #[test]
    fn feed_once_as_root_reaches_the_kernel() {
        if !is_root() {
            memveil_testkit::skip(
                memveil_testkit::Need::Root,
                "only root may add entropy (see the non-root test)",
            );
            return;
        }
        let policy = FeedPolicy {
            source: SourceKind::Rdrand,
            ..FeedPolicy::default()
        };
        let mut f = match Feeder::open(policy.clone()) {
            Ok(f) => f,
            Err(FeedError::Source(e @ DrngError::Unavailable { instruction, .. })) => {
                memveil_testkit::skip(memveil_testkit::Need::Cpu(instruction), e);
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let b = f.feed_once().expect("ioctl as root");
        assert_eq!(b.bytes, 64);
        assert_eq!(b.bits_credited, 256);
        assert!(b.entropy_after.is_some());
        assert!(entropy_avail().is_some());
        assert_eq!(f.report().batches, 1);
        assert!(f.report().source.contains("512:1"), "{}", f.report().source);
    }

    #[test]
    fn failing_source_feeds_nothing() {
        if !is_root() {
            memveil_testkit::skip(memveil_testkit::Need::Root, "only root may add entropy");
            return;
        }
        let ctl = FaultControl::new();
        let c2 = ctl.clone();
        let spec = SeedSpec::custom(
            SourceKind::Rdseed,
            Arc::new(move || {
                Ok(Box::new(FaultySource::new(Getrandom::new(), c2.clone())) as Box<dyn RawSource>)
            }),
        );
        let mut f = Feeder::with_spec(
            FeedPolicy {
                source: SourceKind::Rdseed,
                ..FeedPolicy::default()
            },
            &spec,
        )
        .expect("opens");
        f.feed_once().expect("healthy batch");
        ctl.set(Fault::Stuck(5));
        let e = f.feed_once().expect_err("quarantined");
        assert!(e.to_string().contains("quarantined"), "{e}");
        assert_eq!(f.report().batches, 1, "the failing batch was not fed");
        assert!(f.feed_once().is_err(), "stays quarantined");
    }

    /// Runs this test binary as `nobody` (through `setpriv`) so the
    /// non-root path is exercised on a root machine.
    #[test]
    fn non_root_gets_a_clear_error() {
        if std::env::var_os("MEMVEIL_KERNEL_NONROOT_CHILD").is_some() {
            let e = Feeder::open(FeedPolicy {
                source: SourceKind::Rdseed,
                ..FeedPolicy::default()
            })
            .and_then(|mut f| f.feed_once())
            .expect_err("nobody may not add entropy");
            println!("CHILD-ERROR: {e}");
            return;
        }
        if !is_root() {
            // We are the unprivileged user ourselves.
            match Feeder::open(FeedPolicy::default()).and_then(|mut f| f.feed_once()) {
                Err(FeedError::NotPermitted { .. }) => return,
                other => panic!("expected NotPermitted, got {other:?}"),
            }
        }
        let exe = std::env::current_exe().expect("exe");
        let out = std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&exe)
            .args([
                "kernel::tests::non_root_gets_a_clear_error",
                "--exact",
                "--nocapture",
            ])
            .env("MEMVEIL_KERNEL_NONROOT_CHILD", "1")
            .output();
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                memveil_testkit::skip(
                    memveil_testkit::Need::Installed("setpriv"),
                    format!("setpriv (util-linux) not runnable: {e}"),
                );
                return;
            }
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() && err.contains("failed to execute") {
            // The test binary lives where `nobody` cannot reach it (e.g. /root).
            memveil_testkit::skip(
                memveil_testkit::Need::HostSetting("test binary out of nobody's reach"),
                format!("nobody cannot run {}: {err}", exe.display()),
            );
            return;
        }
        assert!(
            out.status.success(),
            "child failed: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if text.contains("RDSEED not available") {
            memveil_testkit::skip(memveil_testkit::Need::Cpu("RDSEED"), "the child's feeder");
            return;
        }
        assert!(text.contains("CHILD-ERROR: RNDADDENTROPY"), "{text}");
        assert!(text.contains("CAP_SYS_ADMIN"), "{text}");
    }
}
