//! The `rng` part: single-source rates of the entropy pipeline.
//!
//! - raw RDRAND, one thread, through memveil's retry loop (and with the
//!   SP 800-90B health tests on every sample);
//! - RDSEED, one thread and one per CPU at once, with the measured failure
//!   rate of single attempts (what the retry budget is designed by);
//! - the 512:1 conditioned seed rate (Kibit/s) against the ceiling the raw
//!   RDRAND rate allows;
//! - CTR_DRBG (AES-256, df) output of one consumer as a ratio to
//!   `openssl speed -evp aes-256-ctr` measured in the same run (headline
//!   `rng.drbg_vs_openssl_ctr`, target >= 1.0), and with prediction
//!   resistance.
//!
//! The many-consumer Secure Key experiment is a separate module
//! (`rng_share`), appended to this section where marked below.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use memveil_drng::health::{HealthChecked, HealthConfig};
use memveil_drng::source::{RawSource, Rdrand, Rdseed, SourceStats};
use memveil_drng::{Conditioner, SourceKind, Stream, StreamKind, StreamOptions};

use crate::timing::{best_of, openssl_speed};
use crate::{BenchError, BenchOpts, Figure, Section};

fn err(msg: impl Into<String>) -> BenchError {
    BenchError::Part {
        part: "rng",
        msg: msg.into(),
    }
}

#[allow(clippy::cast_precision_loss)]
fn per_sec(units: u64, d: Duration) -> f64 {
    units as f64 / d.as_secs_f64().max(1e-9)
}

/// Best-of-`reps` MB/s (10^6) of filling `words` 64-bit samples from `src`.
fn source_rate<S: RawSource>(src: &mut S, words: usize, reps: usize) -> Result<f64, BenchError> {
    let mut buf = vec![0u64; 4096];
    let mut failed = None;
    let d = best_of(reps, || {
        let mut left = words;
        while left > 0 {
            let n = left.min(buf.len());
            if let Err(e) = src.fill(&mut buf[..n]) {
                failed = Some(e.to_string());
                return;
            }
            left -= n;
        }
    });
    if let Some(e) = failed {
        return Err(err(format!("{}: {e}", src.name())));
    }
    Ok(per_sec(8 * words as u64, d) / 1e6)
}

/// RDSEED on `threads` threads at once for `per_thread` samples each:
/// (aggregate MB/s, stats summed over threads).
fn rdseed_run(threads: usize, per_thread: usize) -> Result<(f64, SourceStats), BenchError> {
    let t0 = Instant::now();
    let results: Vec<Result<SourceStats, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    let mut r = Rdseed::new().map_err(|e| e.to_string())?;
                    let mut buf = vec![0u64; 1024];
                    let mut left = per_thread;
                    while left > 0 {
                        let n = left.min(buf.len());
                        r.fill(&mut buf[..n]).map_err(|e| e.to_string())?;
                        left -= n;
                    }
                    Ok(r.stats())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    let d = t0.elapsed();
    let mut sum = SourceStats::default();
    for r in results {
        let s = r.map_err(err)?;
        sum.samples += s.samples;
        sum.attempts += s.attempts;
        sum.failed_attempts += s.failed_attempts;
        sum.exhausted += s.exhausted;
    }
    Ok((per_sec(8 * sum.samples, d) / 1e6, sum))
}

/// Runs the `rng` workloads.
///
/// # Errors
/// `BenchError::Part` when RDRAND is absent (the figures are about it) or a
/// source fails.
pub fn run(opts: &BenchOpts) -> Result<Section, BenchError> {
    let mut figures = Vec::new();
    let mut md = String::new();
    let reps = opts.pick(3, 5);

    // Raw RDRAND.
    opts.say("rng: raw RDRAND, one thread");
    let words = opts.pick(1 << 20, 1 << 23);
    let mut rd = Rdrand::new().map_err(|e| err(e.to_string()))?;
    let raw = source_rate(&mut rd, words, reps)?;
    let rd_stats = rd.stats();
    let mut checked = HealthChecked::new(
        Rdrand::new().map_err(|e| err(e.to_string()))?,
        HealthConfig::default(),
    );
    let tested = source_rate(&mut checked, words, reps)?;
    figures.push(
        Figure::plain(
            "rng.rdrand_raw_mbps",
            raw,
            "MB/s",
            "RDRAND, one thread, 64-bit steps through the 10-retry loop (published: ~73 MB/s per thread)",
        ),
    );
    figures.push(Figure::vs(
        "rng.rdrand_health_tested_mbps",
        tested,
        raw,
        "MB/s",
        "RDRAND with the 90B RCT+APT on every sample; ratio = cost of the health tests",
    ));

    // RDSEED: single attempts fail often; measure how often.
    opts.say("rng: RDSEED, one thread and one per CPU");
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let per = opts.pick(20_000, 200_000);
    let rdseed = match (rdseed_run(1, per), rdseed_run(cpus, per)) {
        (Ok(one), Ok(all)) => Some((one, all)),
        (Err(e), _) | (_, Err(e)) => {
            let _ = writeln!(md, "RDSEED not measured: {e}\n");
            None
        }
    };
    if let Some(((r1, s1), (rn, sn))) = rdseed {
        figures.push(Figure::plain(
            "rng.rdseed_mbps",
            r1,
            "MB/s",
            "RDSEED, one thread, retry loop with pause",
        ));
        figures.push(Figure::plain(
            "rng.rdseed_fail_rate_1t",
            s1.failure_rate(),
            "fraction",
            "share of single RDSEED attempts that failed (CF=0), one thread",
        ));
        figures.push(Figure::plain(
            &format!("rng.rdseed_fail_rate_{cpus}t"),
            sn.failure_rate(),
            "fraction",
            "share of single RDSEED attempts that failed, one thread per CPU at once",
        ));
        let _ = writeln!(
            md,
            "RDSEED: {r1:.1} MB/s on one thread with {:.1}% of attempts failing; {rn:.1} MB/s \
             aggregate on {cpus} threads with {:.1}% failing (longest budget used: {} retries \
             allowed, {} samples exhausted it). RDRAND: {} of {} attempts failed.\n",
            100.0 * s1.failure_rate(),
            100.0 * sn.failure_rate(),
            memveil_drng::source::RDSEED_RETRIES,
            s1.exhausted + sn.exhausted,
            rd_stats.failed_attempts,
            rd_stats.attempts,
        );
    }

    // Conditioned seeds.
    opts.say("rng: 512:1 conditioned seeds");
    let seeds = opts.pick(2_000u64, 20_000);
    let mut cond = Conditioner::new(HealthChecked::new(
        Rdrand::new().map_err(|e| err(e.to_string()))?,
        HealthConfig::default(),
    ));
    let mut seed_err = None;
    let d = best_of(reps, || {
        for _ in 0..seeds {
            if let Err(e) = cond.seed() {
                seed_err = Some(e.to_string());
                return;
            }
        }
    });
    if let Some(e) = seed_err {
        return Err(err(e));
    }
    let kibit = per_sec(seeds * 128, d) / 1024.0;
    let ceiling = raw * 1e6 * 8.0 / 1024.0 / 512.0;
    figures.push(Figure::vs(
        "rng.seed_kibits",
        kibit,
        ceiling,
        "Kibit/s",
        "seed-grade output (512x128-bit RDRAND -> AES-CBC-MAC), one consumer; baseline = raw RDRAND rate / 512 (published: ~1168 Kibit/s)",
    ));

    // DRBG vs OpenSSL AES-256-CTR.
    opts.say("rng: CTR_DRBG vs openssl speed -evp aes-256-ctr");
    // Interleaved rounds, best of each side, so a noisy neighbour hurts
    // both measurements alike.
    let total = opts.pick(64usize << 20, 256 << 20);
    let mut s = Stream::open(StreamKind::Drbg, &StreamOptions::default())
        .map_err(|e| err(e.to_string()))?;
    let mut buf = vec![0u8; 1 << 16];
    let mut d = Duration::MAX;
    let mut ossl = 0.0f64;
    for _ in 0..opts.pick(4, 6) {
        let t = Instant::now();
        for _ in 0..total / buf.len() {
            s.fill(&mut buf).map_err(|e| err(e.to_string()))?;
        }
        d = d.min(t.elapsed());
        ossl = ossl.max(openssl_speed("aes-256-ctr", 16384, 1).map_err(err)? / 1e9);
    }
    let drbg = per_sec(total as u64, d) / 1e9;
    figures.push(
        Figure::vs(
            "rng.drbg_vs_openssl_ctr",
            drbg,
            ossl,
            "GB/s",
            &format!("one consumer's CTR_DRBG (AES-256, df, 64 KiB requests, reseeds from 512:1 seeds every 1024 requests; AES path {}) vs `openssl speed -evp aes-256-ctr -bytes 16384`, best of interleaved rounds each", memveil_cipher::path()),
        )
        .target(">= 1.0"),
    );
    let reseeds = s.reseeds();

    opts.say("rng: CTR_DRBG with prediction resistance");
    let pr_total = opts.pick(4usize << 20, 32 << 20);
    let mut pr = Stream::open(
        StreamKind::Drbg,
        &StreamOptions {
            prediction_resistance: true,
            ..StreamOptions::default()
        },
    )
    .map_err(|e| err(e.to_string()))?;
    let t = Instant::now();
    for _ in 0..pr_total / buf.len() {
        pr.fill(&mut buf).map_err(|e| err(e.to_string()))?;
    }
    let pr_rate = per_sec(pr_total as u64, t.elapsed()) / 1e6;
    figures.push(Figure::plain(
        "rng.drbg_pr_mbps",
        pr_rate,
        "MB/s",
        "CTR_DRBG with prediction resistance: 256 bits of 512:1 seed before every 64 KiB request",
    ));

    opts.say("rng: getrandom(2)");
    let mut g = HealthChecked::new(
        SourceKind::Getrandom
            .open()
            .map_err(|e| err(e.to_string()))?,
        HealthConfig::default(),
    );
    let gr = source_rate(&mut g, words, reps)?;
    figures.push(Figure::plain(
        "rng.getrandom_mbps",
        gr,
        "MB/s",
        "getrandom(2), one thread, 32 KiB calls, health-tested (the fallback source)",
    ));

    let _ = writeln!(
        md,
        "Published (Intel Secure Key article): ~73 MB/s of RDRAND per thread, ~1168 Kibit/s of \
         512:1 seed per consumer. Here: {raw:.1} MB/s raw RDRAND ({tested:.1} MB/s health-tested), \
         {kibit:.0} Kibit/s of seed, DRBG {drbg:.2} GB/s against OpenSSL AES-256-CTR {ossl:.2} GB/s \
         ({reseeds} reseeds during the run), {pr_rate:.1} MB/s with prediction resistance.\n"
    );

    // The many-consumer Secure Key experiment (rng_share.rs) appends its
    // figures, plots and text to this section here.
    let share = crate::rng_share::run(opts)?;
    figures.extend(share.figures);
    md.push_str(&share.markdown);

    Ok(Section {
        part: "rng".into(),
        title: "Entropy service (rng)".into(),
        markdown: md,
        figures,
        plots: share.plots,
    })
}
