//! The `shield` part: what keeping memory as ciphertext outside a bounded
//! plaintext window costs (memveil-shield, issue 5 "Figures").
//!
//! - Fault cost for windows of 16, 256 and 4096 pages: a sweep touching every
//!   page of a protected buffer 4x the window (every page faults), timed
//!   from the touching thread, against the first touch of fresh anonymous
//!   memory; the handler's eviction time per page; and, on one buffer of
//!   fixed size, the plaintext fraction over time and the throughput of a
//!   skewed random-access loop (RamCrypt's trade-off).
//! - STREAM triad with arrays totalling 8x the default window, against the
//!   AES bound of this core and against plain memory.
//! - redis-benchmark SET/GET against redis-server run plainly and under
//!   `memveil run`.
//!
//! Everything is measured in the same run as its baseline.

use std::fmt::Write as _;

use crate::procs::{memveil_exe, scratch_dir};
use crate::{BenchError, BenchOpts, Figure, Plot, Section, Series};
use inproc::{in_process, pinned, plain_fault_us};
use redis::{redis_rows, redis_tools, RedisRow};
use suite::RedisLarge;

pub mod etcd;
mod inproc;
pub mod redis;
pub mod suite;

pub(crate) fn err(msg: impl Into<String>) -> BenchError {
    BenchError::Part {
        part: "shield",
        msg: msg.into(),
    }
}

// ---------------------------------------------------------------------- run

/// The shield part's pieces, which `memveil bench --only shield --workload
/// NAME` runs alone (all of them without `--workload`): the in-process
/// fault costs, redis, the program suite, nginx TLS, the fork figure, Go
/// and static programs (with the Go canary), the static C program's figure
/// alone (`static`: a part of `go`) and etcd (the canary's exposure figures
/// are a part of their own, `exposure`).
const PIECES: [&str; 8] = [
    "faults", "redis", "suite", "nginx", "fork", "go", "static", "etcd",
];

/// Whether piece `name` of the shield part runs.
fn piece(opts: &BenchOpts, name: &str) -> bool {
    opts.workloads.is_empty() || opts.workloads.iter().any(|w| w == name)
}

/// Runs the shield workloads.
///
/// # Errors
/// When no shield can be created (userfaultfd not permitted, secret memory
/// unavailable) or memory cannot be mapped. Missing redis or `memveil run`
/// only skips the redis figures, with the reason in the report.
pub fn run(opts: &BenchOpts) -> Result<Section, BenchError> {
    let mechanism = memveil_shield::check().map_err(|e| err(e.to_string()))?;
    if !opts.workloads.is_empty() && !opts.workloads.iter().any(|w| PIECES.contains(&w.as_str())) {
        return Err(err(format!(
            "--workload {}: the shield part's pieces are {}",
            opts.workloads.join(", "),
            PIECES.join(", ")
        )));
    }
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let home = memveil_sys::process::current_cpu().unwrap_or(0);
    let other = (cpus > 1).then(|| (home + 1) % cpus);
    let mut md = format!(
        "Eviction mechanism: {}. The in-process workloads run on one thread pinned to CPU {home}, with the \
         shield's handler thread on the same CPU (the default `HandlerCpu::Current`, which pins it where the \
         shield starts: for a single-threaded program that stays on its CPU, one CPU does everything); the \
         fault cost is also measured with the handler on the other CPU (a program thread the scheduler moved \
         away). One shield per measurement, default `Config` otherwise (no spinning, eviction batches of up \
         to 32). redis-server runs under `memveil run` with its defaults, unpinned; in the large_pinned setting both \
         servers run on CPU 0 (`memveil run --cpu 0`; `taskset -c 0` for the plain one) and redis-benchmark on \
         CPU 1.\n\n",
        mechanism.name()
    );
    let (mut figs, mut plots) = (Vec::new(), Vec::new());
    if piece(opts, "faults") {
        let (f, more, p) = pinned(Some(home), || in_process(opts, home, other))?;
        (figs, plots) = (f, p);
        md.push_str(&more);
    }
    let redis = if piece(opts, "redis") {
        redis_part(opts, &mut figs, &mut md, &mut plots)
    } else {
        None
    };
    suite_part(opts, redis.as_ref(), &mut figs, &mut md);
    Ok(Section {
        part: "shield".into(),
        title: "Shield: unmodified programs' memory as ciphertext".into(),
        markdown: md,
        figures: figs,
        plots,
    })
}

/// The redis figures, or the reason they are missing, into the section;
/// returns redis large's ratios for the program suite.
fn redis_part(
    opts: &BenchOpts,
    figs: &mut Vec<Figure>,
    md: &mut String,
    plots: &mut Vec<Plot>,
) -> Option<RedisLarge> {
    let dir = scratch_dir("redis");
    if let Err(e) = std::fs::create_dir_all(&dir) {
        opts.say(&format!(
            "shield: redis figures SKIPPED: {}: {e}",
            dir.display()
        ));
        let _ = writeln!(
            md,
            "\n**redis figures skipped**: creating {}: {e}.\n",
            dir.display()
        );
        return None;
    }
    let result = redis_tools(&dir).map(|t| redis_rows(opts, &t, &dir));
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Err(why) => {
            opts.say(&format!("shield: redis figures SKIPPED: {why}"));
            let _ = writeln!(
                md,
                "\n**redis figures skipped**: {why}. The ids shield.redis_*_vs_plain are missing from this report.\n"
            );
            None
        }
        Ok(Err(e)) => {
            opts.say(&format!("shield: redis figures FAILED: {e}"));
            let _ = writeln!(
                md,
                "\n**redis figures failed**: {e}. The ids shield.redis_*_vs_plain are missing from this report.\n"
            );
            None
        }
        Ok(Ok(rows)) => {
            redis_figures(&rows, figs, md, plots);
            let ratio = |r: &RedisRow| r.median_ratio();
            let large = rows.iter().find(|r| r.setting == "large")?;
            Some(RedisLarge {
                default: ratio(large),
                fixed: rows.iter().find(|r| r.setting == "large_w4096").map(ratio),
                plaintext: large.plaintext,
            })
        }
    }
}

/// The program suite (see [`suite`]), or why it did not run.
fn suite_part(
    opts: &BenchOpts,
    redis: Option<&RedisLarge>,
    figs: &mut Vec<Figure>,
    md: &mut String,
) {
    let Some(memveil) = memveil_exe() else {
        let _ = writeln!(
            md,
            "\n**program suite skipped**: the memveil executable was not found (this program is not `memveil` and \
             none lies beside it). The ids shield.suite_* are missing from this report.\n"
        );
        return;
    };
    let dir = scratch_dir("suite");
    let made = std::fs::create_dir_all(&dir).map_err(|e| err(format!("{}: {e}", dir.display())));
    let result = piece(opts, "suite").then(|| made.and_then(|()| suite::run(opts, &memveil, &dir)));
    let mut extra = Vec::new();
    if piece(opts, "nginx") {
        extra.push((
            "nginx figures",
            "shield.nginx_tls_*",
            crate::nginx::figures(opts, &memveil, &dir.join("nginx")),
        ));
    }
    if piece(opts, "fork") {
        extra.push((
            "fork figure",
            "shield.fork_ms_per_gib",
            suite::fork_figure(opts, &memveil, &dir).map(|f| vec![f]),
        ));
    }
    if piece(opts, "go") || piece(opts, "static") {
        // `static` alone: the static C program's figure only.
        let only_static = !piece(opts, "go");
        let got = std::fs::create_dir_all(dir.join("go"))
            .map_err(|e| format!("{}: {e}", dir.display()))
            .and_then(|()| {
                let mut f = Vec::new();
                suite::gostatic::run(opts, &memveil, &dir.join("go"), only_static, &mut f, md)
                    .map_err(|e| e.to_string())?;
                Ok(f)
            });
        extra.push((
            "Go and static program figures",
            "shield.go_*, shield.static_c_vs_plain",
            got,
        ));
    }
    if piece(opts, "etcd") {
        extra.push((
            "etcd figures",
            "shield.etcd_*",
            etcd::figures(opts, &memveil, md),
        ));
    }
    for (what, ids, got) in extra {
        match got {
            Ok(f) => figs.extend(f),
            Err(e) => {
                opts.say(&format!("shield: {what} FAILED: {e}"));
                let _ = writeln!(md, "\n**{what} failed**: {e}. {ids} missing.\n");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    // Measured after the programs, under the load they ran in.
    let plain_fault = result.is_some().then(|| plain_fault_us().ok()).flatten();
    match result {
        None => {}
        Some(Ok((rows, missing))) => {
            suite::report(&rows, &missing, redis, plain_fault, figs, md);
        }
        Some(Err(e)) => {
            opts.say(&format!("shield: program suite FAILED: {e}"));
            let _ = writeln!(
                md,
                "\n**program suite failed**: {e}. The ids shield.suite_* are missing from this report.\n"
            );
        }
    }
}

fn redis_figures(
    rows: &[RedisRow],
    figs: &mut Vec<Figure>,
    md: &mut String,
    plots: &mut Vec<Plot>,
) {
    let mut table = String::new();
    for r in rows {
        let target = match r.setting {
            "small" => ">= 0.90",
            "large" => ">= 0.90",
            _ => "reported",
        };
        let frac = r
            .plaintext
            .map_or_else(|| "n/a".to_owned(), |p| format!("{p:.3}"));
        let (mid, spread) = (r.median_ratio(), r.spread());
        let (set_rounds, get_rounds): (Vec<f64>, Vec<f64>) = r.per_round.iter().copied().unzip();
        for (op, p, s, ratio, spread, rounds) in [
            ("set", r.plain.0, r.shield.0, mid.0, spread.0, &set_rounds),
            ("get", r.plain.1, r.shield.1, mid.1, spread.1, &get_rounds),
        ] {
            let mut note = format!(
                "redis-benchmark {} on a Unix socket: {} requests/s, redis-server under `memveil run` ({}) vs \
                 plain (--save \"\" --appendonly no); requests/s the best of {} round(s) each side, the ratio the \
                 median of the paired rounds' ratios (spread {spread})",
                r.args.join(" "),
                op.to_uppercase(),
                if r.setting == "large_w4096" {
                    "--window 4096: a fixed window"
                } else {
                    "its defaults: a cost budget of 10% of its time"
                },
                r.per_round.len()
            );
            if r.setting == "large_pinned" {
                note.push_str(
                    "; both servers pinned to CPU 0 (`memveil run --cpu 0`, `taskset -c 0` for the plain one), \
                     redis-benchmark on CPU 1",
                );
            }
            if r.setting.starts_with("large") {
                let _ = write!(
                    note,
                    "; plaintext fraction {frac} (time-weighted; {})",
                    r.stats_line
                );
            }
            figs.push(
                Figure::vs(
                    &format!("shield.redis_{}_{op}_vs_plain", r.setting),
                    s,
                    p,
                    "requests/s",
                    &note,
                )
                .with_ratio(ratio)
                .target(target)
                .rounds(rounds),
            );
        }
        if r.setting.starts_with("large") {
            if let Some(p) = r.plaintext {
                figs.push(Figure::plain(
                    &format!("shield.redis_{}_plaintext_fraction", r.setting),
                    p,
                    "fraction",
                    &format!(
                        "plaintext fraction of redis-server's heap, time-weighted over the run (at exit where the \
                         shield's watchdog did not measure it), {} setting ({})",
                        r.setting, r.stats_line
                    ),
                ));
            }
        }
        if r.setting == "large" && !r.samples.is_empty() {
            plots.push(Plot {
                file: "shield_redis_large_plaintext.svg".into(),
                title: "redis-server under memveil run, large setting".into(),
                x_label: "s".into(),
                y_label: "plaintext fraction".into(),
                series: vec![Series {
                    name: "plaintext fraction".into(),
                    points: r.samples.clone(),
                }],
            });
        }
        let _ = writeln!(
            table,
            "| {} (`{}`) | {:.0} / {:.0} | **{:.3}** | {:.0} / {:.0} | **{:.3}** | {} | {} | {} |",
            r.setting,
            r.args.join(" "),
            r.shield.0,
            r.plain.0,
            mid.0,
            r.shield.1,
            r.plain.1,
            mid.1,
            r.per_round
                .iter()
                .map(|(s, g)| format!("{s:.2}/{g:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
            frac,
            r.stats_line
        );
    }
    let _ = writeln!(
        md,
        "\nredis (requests/s, under `memveil run` / plain, best of the rounds (a plain then a protected server \
         each); the figures' ratios are the medians of the rounds' ratios; targets: small >= 0.90, large >= 0.90 \
         (large_w4096 is the suite's fixed-window figure); hardware \
         TME-MK keeps >= 0.98; rounds alternate which server goes first):\n\n\
         | setting | SET shield / plain (best of rounds) | ratio (median of rounds) | GET shield / plain | ratio | SET/GET ratio per round | plaintext fraction at exit | shield counters (last round) |\n\
         |---|---|---|---|---|---|---|---|\n{table}"
    );
}
