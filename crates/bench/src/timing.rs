//! Small timing helpers shared by the workloads.

use std::time::{Duration, Instant};

/// Runs `f` `reps` times and returns the fastest duration (the least
/// disturbed by other tenants of a shared machine).
pub fn best_of<F: FnMut()>(reps: usize, mut f: F) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
    }
    best
}

/// Bytes per second as GB/s (10^9).
#[must_use]
pub fn gbps(bytes: usize, d: Duration) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let b = bytes as f64;
    b / d.as_secs_f64() / 1e9
}

/// Mean and a percentile (0..=100) of samples in nanoseconds.
#[must_use]
pub fn mean_and_percentile(samples: &mut [u64], pct: f64) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort_unstable();
    #[allow(clippy::cast_precision_loss)]
    let mean = samples.iter().map(|&s| s as f64).sum::<f64>() / samples.len() as f64;
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let idx = (((samples.len() - 1) as f64) * pct / 100.0).round() as usize;
    #[allow(clippy::cast_precision_loss)]
    let p = samples[idx.min(samples.len() - 1)] as f64;
    (mean, p)
}

/// Runs `openssl speed -evp ALG -bytes N -seconds S -mr` and returns the
/// bytes per second it reports (the `+F:` line of its machine-readable output).
///
/// # Errors
/// A message naming the missing `openssl` binary (package `openssl`) or the
/// output that could not be parsed.
pub fn openssl_speed(alg: &str, bytes: usize, seconds: u32) -> Result<f64, String> {
    let out = std::process::Command::new("openssl")
        .args([
            "speed",
            "-evp",
            alg,
            "-bytes",
            &bytes.to_string(),
            "-seconds",
            &seconds.to_string(),
            "-mr",
        ])
        .output()
        .map_err(|e| {
            format!("running `openssl speed`: {e} (install the Debian package `openssl`)")
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.starts_with("+F:"))
        .and_then(|l| l.rsplit(':').next())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .ok_or_else(|| format!("`openssl speed -evp {alg}` printed no +F: line: {text}"))
}

/// The median of `v` (sorted in place); 0 for none.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
