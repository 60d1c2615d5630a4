//! Go and statically linked programs under `memveil run` (issue 34): three
//! Go programs built here (`encoding/json`, `compress/flate`, a map-heavy
//! one on four goroutines, `CGO_ENABLED=0`), Debian's static busybox
//! sorting the suite's text file, and the Go canary's exposure, each
//! against the same program run plainly in the same rounds.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::exposure::{self, Period};
use super::{geomean, run_once, spread, text_file, Mode, Program, Row, RunStats, ROUNDS};
use crate::procs::in_path;
use crate::timing::median;
use crate::{BenchError, BenchOpts, Figure};

/// The Go programs (name, source).
const GO_PROGRAMS: [(&str, &str, &str); 3] = [
    (
        "json",
        include_str!("go/json.go"),
        "encoding/json of 150,000 records and back",
    ),
    (
        "compress",
        include_str!("go/compress.go"),
        "compress/flate level 6 of 16 MiB of text and back",
    ),
    (
        "maps",
        include_str!("go/maps.go"),
        "a map cache on four goroutines: 600,000 inserts, lookups and deletes each",
    ),
];

/// The Go toolchain: `go` on the PATH or Debian's (golang-go) or upstream's
/// usual place.
pub(crate) fn go_tool() -> Option<PathBuf> {
    in_path("go").or_else(|| {
        ["/usr/lib/go/bin/go", "/usr/local/go/bin/go"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
    })
}

/// Builds the Go program `src` (saved as `NAME.go` in `dir`) as a static
/// executable (`CGO_ENABLED=0`), with the toolchain found here (never one
/// downloaded: `GOTOOLCHAIN=local`).
///
/// # Errors
/// No Go toolchain (install golang-go: scripts/install.sh does), or the
/// build failed (its output in the message).
pub(crate) fn build_go(dir: &Path, name: &str, src: &str) -> Result<PathBuf, String> {
    let go = go_tool().ok_or(
        "no Go toolchain (go not in PATH, /usr/lib/go or /usr/local/go): install Debian's golang-go \
         (scripts/install.sh installs it)",
    )?;
    let file = dir.join(format!("{name}.go"));
    std::fs::write(&file, src).map_err(|e| format!("{}: {e}", file.display()))?;
    let exe = dir.join(format!("{name}-go"));
    let out = Command::new(&go)
        .arg("build")
        .arg("-o")
        .arg(&exe)
        .arg(&file)
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local")
        .env("GO111MODULE", "off")
        .current_dir(dir)
        .output()
        .map_err(|e| format!("running {}: {e}", go.display()))?;
    if !out.status.success() {
        return Err(format!(
            "go build {name}.go failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(exe)
}

/// Builds the Go canary of `shield.go_canary_*` (the C canary's protocol).
///
/// # Errors
/// As [`build_go`].
pub(crate) fn build_go_canary(dir: &Path) -> Result<PathBuf, String> {
    build_go(dir, "canary", include_str!("go/canary.go"))
}

/// Debian's statically linked busybox (package busybox-static): the
/// `busybox` on the PATH when its ELF program headers name no interpreter
/// (`PT_INTERP`).
fn static_busybox() -> Option<PathBuf> {
    const PT_INTERP: u32 = 3;
    let b = in_path("busybox")?;
    let data = std::fs::read(&b).ok()?;
    let le = |at: usize, n: usize| -> Option<u64> {
        let bytes = data.get(at..at + n)?;
        Some(bytes.iter().rev().fold(0u64, |v, x| v << 8 | u64::from(*x)))
    };
    if data.get(..4)? != b"\x7fELF" {
        return None;
    }
    let phoff = usize::try_from(le(0x20, 8)?).ok()?;
    let (entsize, num) = (
        usize::try_from(le(0x36, 2)?).ok()?,
        usize::try_from(le(0x38, 2)?).ok()?,
    );
    let interp = (0..num).any(|i| le(phoff + i * entsize, 4) == Some(u64::from(PT_INTERP)));
    (!interp).then_some(b)
}

/// The programs of this piece (the static one alone with `only_static`),
/// and the ones that cannot run here with why.
fn programs(
    opts: &BenchOpts,
    dir: &Path,
    only_static: bool,
) -> Result<(Vec<Program>, Vec<String>), BenchError> {
    let (mut progs, mut missing) = (Vec::new(), Vec::new());
    let go = if only_static {
        &[][..]
    } else {
        &GO_PROGRAMS[..]
    };
    for &(name, src, what) in go {
        match build_go(dir, name, src) {
            Ok(exe) => progs.push(Program {
                name,
                what: format!("Go ({what}; built here, CGO_ENABLED=0: a static executable)"),
                argv: vec![exe.into()],
                env: vec![],
                fresh: None,
            }),
            Err(e) => missing.push(format!("go {name}: {e}")),
        }
    }
    match static_busybox() {
        Some(bb) => {
            let text = dir.join("static-text.txt");
            let mb = opts.pick(16, 64);
            text_file(&text, mb << 20)?;
            progs.push(Program {
                name: "static_sort",
                what: format!(
                    "Debian's busybox-static (glibc, statically linked) sorting {mb} MiB of 64-byte lines"
                ),
                argv: vec![bb.into(), OsString::from("sort"), text.into()],
                env: vec![("LC_ALL", "C")],
                fresh: None,
            });
        }
        None => missing.push(
            "static_sort: no statically linked busybox in PATH (Debian package busybox-static)"
                .into(),
        ),
    }
    Ok((progs, missing))
}

/// Runs the piece: the programs' figures and the Go canary's into `figs`,
/// their table into `md`; with `only_static`, the static C program's figure
/// alone (no Go program, canary or path cost).
///
/// # Errors
/// A program that failed or whose output differed from the plain run's is
/// reported in its figure; an error here is a setup failure.
pub(crate) fn run(
    opts: &BenchOpts,
    memveil: &Path,
    dir: &Path,
    only_static: bool,
    figs: &mut Vec<Figure>,
    md: &mut String,
) -> Result<(), BenchError> {
    let (progs, missing) = programs(opts, dir, only_static)?;
    let (rows, pairs): (Vec<Row>, Vec<usize>) = progs
        .iter()
        .map(|p| run_paired(opts, memveil, dir, p))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .unzip();
    report(&rows, &pairs, &missing, figs, md);
    if only_static {
        return Ok(());
    }
    canary(opts, memveil, dir, figs, md);
    match path_cost(opts, memveil, dir) {
        Ok(f) => figs.extend(f),
        Err(e) => {
            let _ = writeln!(md, "\n**path cost figures failed**: {e}.");
        }
    }
    Ok(())
}

/// Rounds of this piece's program figures (`shield.static_c_vs_plain`,
/// `shield.go_*_vs_plain`, `shield.go_suite_geomean_vs_plain`): each figure
/// is the median of the rounds' ratios. Seven, not the suite's five: with
/// five, one slow plain run (0.92-1.20 s for the same Go program within
/// one quiet-lock hold) moved the median by 0.05.
pub(crate) const GO_ROUNDS: usize = 7;

/// The plain time a round gathers at least, in seconds: a program whose
/// plain run is shorter runs in several pairs per round (up to
/// [`MAX_PAIRS`]), and the round's ratio is the plain runs' total time over
/// the protected runs' total, as of one longer run. `memveil run`'s fixed
/// start and end stay in every protected run: the figure still measures
/// one run of the program. 3 s and 8 pairs, not 1.2 s and 4: the static
/// sort's (0.3-0.5 s plain) pairs alone read 0.63-1.16 of plain in one
/// quiet-lock hold (30 pairs, standard deviation 0.15, the plain runs
/// themselves 0.34-0.58 s), which left the median of 7 rounds of 3-4 pairs
/// within 0.81-0.93 nine times in ten (resampled), with 8 within 0.83-0.91.
const ROUND_SECS: f64 = 3.0;

/// At most this many pairs a round.
const MAX_PAIRS: usize = 8;

/// Runs `p` plainly and under `memveil run` at its defaults in [`GO_ROUNDS`]
/// rounds of paired runs (after one pair that is not counted: it warms the
/// page cache and the host's budget ledger). Within a round the two
/// alternate, the first of each pair changing from pair to pair and round
/// to round (ABBA), so a drift in the machine's speed favours neither.
/// Output and exit status are compared with the plain run's in every pair.
///
/// The row, and the pairs a round took.
///
/// # Errors
/// A run that could not start (a failed or different run is the row's
/// `problem`).
fn run_paired(
    opts: &BenchOpts,
    memveil: &Path,
    dir: &Path,
    p: &Program,
) -> Result<(Row, usize), BenchError> {
    let (pl, de) = (Mode::Plain, Mode::Default);
    let mut times: [Vec<f64>; 5] = Default::default();
    let mut ratios: [Vec<f64>; 5] = Default::default();
    // One cost per round, beside its ratio (`Row::costs`): the round's
    // protected runs' summary costs weighted by their times, `None` when a
    // run of the round wrote no statistics.
    let mut costs: [Vec<Option<f64>>; 5] = Default::default();
    let mut stats: [RunStats; 5] = Default::default();
    let mut problem = None;
    opts.say(&format!("shield go: {} (warm-up pair)", p.name));
    let warm = run_once(p, pl, memveil, dir)?;
    let _ = run_once(p, de, memveil, dir)?;
    let pairs = if warm.secs > 0.0 {
        // A whole number from 1 to 64 before the clamp.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let n = (ROUND_SECS / warm.secs).ceil().clamp(1.0, 64.0) as usize;
        n.clamp(1, MAX_PAIRS)
    } else {
        1
    };
    'rounds: for round in 0..GO_ROUNDS {
        opts.say(&format!(
            "shield go: {}, round {}/{GO_ROUNDS} ({pairs} pair(s))",
            p.name,
            round + 1
        ));
        let (mut plain_sum, mut prot_sum) = (0.0, 0.0);
        let mut cost_secs = Some(0.0);
        for k in 0..pairs {
            let order = if (round + k) % 2 == 0 {
                [pl, de]
            } else {
                [de, pl]
            };
            let mut got: [Option<super::Outcome>; 2] = [None, None];
            for m in order {
                got[usize::from(m == de)] = Some(run_once(p, m, memveil, dir)?);
            }
            let [Some(a), Some(b)] = got else {
                continue;
            };
            if a.code != Some(0) {
                problem = Some(format!(
                    "the plain run failed (exit {:?}); see {}.err",
                    a.code, p.name
                ));
                break 'rounds;
            }
            if b.code != a.code || b.out_hash != a.out_hash {
                problem = Some(format!(
                    "{} differs from the plain run: exit {:?} vs {:?}, output {} (see {}.err in the \
                     bench directory)",
                    de.name(),
                    b.code,
                    a.code,
                    if b.out_hash == a.out_hash { "same" } else { "DIFFERENT" },
                    p.name
                ));
                break 'rounds;
            }
            plain_sum += a.secs;
            prot_sum += b.secs;
            times[pl.index()].push(a.secs);
            times[de.index()].push(b.secs);
            let cost = b.stats.as_ref().and_then(|st| st.cost_fraction);
            cost_secs = cost_secs.zip(cost).map(|(sum, c)| sum + c * b.secs);
            if let Some(st) = b.stats {
                stats[de.index()] = st;
            }
        }
        if prot_sum > 0.0 {
            ratios[de.index()].push(plain_sum / prot_sum);
            costs[de.index()].push(cost_secs.map(|c| c / prot_sum));
        }
    }
    let row = Row::from_rounds(p, times, ratios, costs, stats, problem);
    Ok((row, pairs))
}

/// What one `pathcost` run printed: ns per random access, ns per mmap
/// cycle, ns of each cycle in its `mmap` and `munmap` calls alone, and the
/// run's fault count (protected runs).
struct PathCost {
    access_ns: f64,
    mmap_ns: f64,
    calls_ns: f64,
    faults: u64,
}

/// Runs `pathcost` (`exe`), plainly or under `memveil run --window 4096`.
fn path_run(
    exe: &Path,
    memveil: Option<&Path>,
    dir: &Path,
    args: &[String],
) -> Result<PathCost, String> {
    let json = dir.join("pathcost.json");
    let _ = std::fs::remove_file(&json);
    let mut c = match memveil {
        Some(m) => {
            let mut c = Command::new(m);
            c.args(["run", "--quiet", "--window", "4096", "--stats-json"])
                .arg(&json)
                .arg("--")
                .arg(exe);
            c
        }
        None => Command::new(exe),
    };
    let out = c
        .args(args)
        .output()
        .map_err(|e| format!("running {}: {e}", exe.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let f: Vec<&str> = text.split_whitespace().collect();
    let num = |k: usize| f.get(k).and_then(|v| v.parse::<f64>().ok());
    let (Some(access_ns), Some(mmap_ns), Some(calls_ns)) = (num(1), num(3), num(6)) else {
        return Err(format!(
            "pathcost ({}) said {:?}: {}",
            out.status,
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    };
    let faults = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|j| j.get("faults").and_then(serde_json::Value::as_u64))
        .unwrap_or(0);
    Ok(PathCost {
        access_ns,
        mmap_ns,
        calls_ns,
        faults,
    })
}

/// `shield.loader_random_fault_us` beside `shield.preload_random_fault_us`,
/// `shield.loader_mmap_us` and `shield.loader_mmap_calls_us`: the same C
/// program (`pathcost.c`) built dynamically (the preload's path) and static
/// (the loader's), reading one byte of a random page of a 256 MiB heap
/// through a fixed window of 4096 pages (15 of 16 reads fault), and mapping,
/// touching and unmapping 64 KiB; each against the plain run of the same
/// build (the calls: the preload's) in the same round. The cycle runs under
/// the same `--window 4096`, so its 16 first touches are faults the handler
/// serves (about 5.5 a cycle, with read-ahead runs): they, not the agent's
/// two round trips, are most of `shield.loader_mmap_us` (docs/shield.md,
/// "What the bench's mmap figure times").
fn path_cost(opts: &BenchOpts, memveil: &Path, dir: &Path) -> Result<Vec<Figure>, String> {
    let src = include_str!("pathcost.c");
    let dynamic = super::compile(dir, "pathcost", src)?;
    let file = dir.join("pathcost.c");
    let fixed = dir.join("pathcost-static");
    let out = Command::new("cc")
        .args(["-O2", "-static", "-o"])
        .arg(&fixed)
        .arg(&file)
        .output()
        .map_err(|e| format!("cc: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cc -static failed (the C library's static archive, libc6-dev): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let (mib, accesses, mmaps) = (256u32, opts.pick(200_000u32, 1_000_000), 2000u32);
    let args = [mib.to_string(), accesses.to_string(), mmaps.to_string()];
    let pages = f64::from(mib) * 256.0;
    // Uniform reads through a window of 4096 pages: the share that faults.
    let miss = 1.0 - 4096.0 / pages;
    let (mut pre, mut load, mut mm, mut mm_plain) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut calls, mut calls_pre) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        opts.say(&format!(
            "shield go: path cost round {}/{ROUNDS}",
            round + 1
        ));
        let plain_dyn = path_run(&dynamic, None, dir, &args)?;
        let plain_static = path_run(&fixed, None, dir, &args)?;
        let p = path_run(&dynamic, Some(memveil), dir, &args)?;
        let l = path_run(&fixed, Some(memveil), dir, &args)?;
        if p.faults == 0 || l.faults == 0 {
            return Err("a protected run reported no faults (no --stats-json?)".into());
        }
        pre.push((p.access_ns - plain_dyn.access_ns) / miss / 1000.0);
        load.push((l.access_ns - plain_static.access_ns) / miss / 1000.0);
        mm.push(l.mmap_ns / 1000.0);
        mm_plain.push(plain_static.mmap_ns / 1000.0);
        calls.push(l.calls_ns / 1000.0);
        calls_pre.push(p.calls_ns / 1000.0);
    }
    let m = |v: &[f64]| median(&mut v.to_vec());
    let note = |path: &str| {
        format!(
            "µs per fault of a random read of a 256 MiB heap through a fixed window of 4096 pages ({path}): the read's              time under `memveil run --window 4096` minus the plain run's of the same build, over the share of reads              that fault ({miss:.3}); median of {ROUNDS} rounds"
        )
    };
    Ok(vec![
        Figure::plain(
            "shield.preload_random_fault_us",
            m(&pre),
            "µs",
            &format!("{}; spread {}", note("dynamic build: the preload"), spread(&pre)),
        )
        .rounds(&pre),
        Figure::vs(
            "shield.loader_random_fault_us",
            m(&load),
            m(&pre),
            "µs",
            &format!(
                "{}; beside the preload's (the baseline) measured in the same rounds; spread {}",
                note("static build: the loader"),
                spread(&load)
            ),
        )
        .rounds(&load),
        Figure::vs(
            "shield.loader_mmap_us",
            m(&mm),
            m(&mm_plain),
            "µs",
            &format!(
                "an anonymous 64 KiB mmap, a write to each of its 16 pages and munmap by a static program under \
                 `memveil run --window 4096` with a 256 MiB heap beyond the window (each call served by the \
                 loader's agent through a seccomp notification; the 16 first touches are faults the handler \
                 serves, about 5.5 a cycle with read-ahead runs, and most of the time) against the same program \
                 plain; median of {ROUNDS} rounds, spread {}",
                spread(&mm)
            ),
        )
        .rounds(&mm),
        Figure::vs(
            "shield.loader_mmap_calls_us",
            m(&calls),
            m(&calls_pre),
            "µs",
            &format!(
                "the mmap and munmap calls alone of the cycle of `shield.loader_mmap_us` (its touches left out): \
                 the loader's two round trips to its agent and the region's work, beside the same calls through \
                 the preload (the baseline: the region's work in the caller) in the same rounds; median of \
                 {ROUNDS} rounds, spread {}",
                spread(&calls)
            ),
        )
        .rounds(&calls),
    ])
}

fn report(
    rows: &[Row],
    pairs: &[usize],
    missing: &[String],
    figs: &mut Vec<Figure>,
    md: &mut String,
) {
    let (p, d) = (Mode::Plain.index(), Mode::Default.index());
    let mut table = String::new();
    let go: Vec<&Row> = rows.iter().filter(|r| r.name != "static_sort").collect();
    for (r, pairs) in rows.iter().zip(pairs) {
        let rd = r.ratio(Mode::Default);
        let (id, target) = if r.name == "static_sort" {
            ("shield.static_c_vs_plain".to_owned(), ">= 0.85")
        } else {
            (format!("shield.go_{}_vs_plain", r.name), "reported")
        };
        let sd = &r.stats[d];
        figs.push(
            Figure::vs(
                &id,
                r.secs[d],
                r.secs[p],
                "s",
                &format!(
                    "{}: wall time plain / under `memveil run` at its defaults (through the shield's loader), median \
                     of {} round(s) of {} interleaved pair(s) each (a round's ratio: its plain runs' total time over \
                     its protected runs'), spread {}; output and exit status compared with the plain run's; the \
                     summary's cost {}{}",
                    r.what,
                    r.ratios[d].len(),
                    pairs,
                    r.spread(Mode::Default),
                    sd.cost_fraction
                        .map_or("n/a".into(), |c| format!("{:.1}%", c * 100.0)),
                    r.problem
                        .as_deref()
                        .map_or(String::new(), |e| format!("; FAILED: {e}"))
                ),
            )
            .with_ratio(rd)
            .target(target)
            .rounds(&r.ratios[d]),
        );
        let _ = writeln!(
            table,
            "| {} | {:.3} s | {:.3} s | **{rd:.3}** ({}) | {} | {} |",
            r.name,
            r.secs[p],
            r.secs[d],
            r.spread(Mode::Default),
            sd.faults,
            r.problem.as_deref().unwrap_or("ok"),
        );
    }
    if !go.is_empty() {
        let rounds: Vec<f64> = (0..GO_ROUNDS)
            .map(|k| {
                geomean(
                    &go.iter()
                        .map(|r| r.round_ratio(Mode::Default, k))
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        let g = median(&mut rounds.clone());
        figs.push(
            Figure::plain(
                "shield.go_suite_geomean_vs_plain",
                g,
                "ratio",
                &format!(
                    "geometric mean over the {} Go programs ({}) of plain / protected wall time, `memveil run` at \
                     its defaults: the median over {GO_ROUNDS} rounds of each round's geometric mean, spread {}",
                    go.len(),
                    go.iter().map(|r| r.name).collect::<Vec<_>>().join(", "),
                    spread(&rounds)
                ),
            )
            .with_ratio(g)
            .target(">= 0.85")
            .rounds(&rounds),
        );
    }
    let _ = writeln!(
        md,
        "\nGo and static programs under `memveil run` (issue 34; through the shield's loader), {GO_ROUNDS} rounds \
         of 1-{MAX_PAIRS} interleaved pairs (a round's ratio: its plain runs' total time over its protected runs'):\n\n| program | plain | protected | plain / protected (spread) | faults (last round) | outcome \
         |\n|---|---|---|---|---|---|\n{table}"
    );
    for m in missing {
        let _ = writeln!(md, "\n**not run**: {m}.");
    }
}

/// `shield.go_canary_idle_encrypted_fraction`: the Go canary's secret,
/// written once and never read again, sampled from outside; the plain run
/// is the positive control (`shield.go_canary_plain_encrypted_fraction`).
fn canary(opts: &BenchOpts, memveil: &Path, dir: &Path, figs: &mut Vec<Figure>, md: &mut String) {
    let exe = match build_go_canary(dir) {
        Ok(e) => e,
        Err(e) => {
            let _ = writeln!(md, "\n**Go canary not run**: {e}.");
            return;
        }
    };
    let wrap = exposure::wrap_default(memveil);
    let (warm, run) = (
        Duration::from_secs(5),
        Duration::from_secs(opts.pick(10, 30)),
    );
    let (mut plain, mut idle) = (Vec::new(), Vec::new());
    for round in 0..exposure::ROUNDS {
        opts.say(&format!(
            "shield go: canary round {}/{}",
            round + 1,
            exposure::ROUNDS
        ));
        for (w, period, into) in [
            (&[][..], Period::EveryMs(1000), &mut plain),
            (&wrap[..], Period::Once, &mut idle),
        ] {
            match exposure::measure(&exe, w, 256, period, warm, run) {
                Ok(e) => into.push(e.encrypted_fraction()),
                Err(e) => {
                    let _ = writeln!(md, "\n**Go canary failed**: {e}.");
                    return;
                }
            }
        }
    }
    for (id, v, target, what) in [
        (
            "plain",
            &plain,
            "== 0",
            "the positive control: the Go canary run plainly, its secret read every second; the sampler must find it \
             in every sample",
        ),
        (
            "idle",
            &idle,
            ">= 0.99",
            "the Go canary (256 MiB heap, a quarter touched continuously) under `memveil run` at its defaults, its \
             64-byte secret written once and never read again: the share of samples in which /proc/PID/mem did not \
             show it",
        ),
    ] {
        let m = median(&mut v.clone());
        figs.push(
            Figure::plain(
                &format!("shield.go_canary_{id}_encrypted_fraction"),
                m,
                "fraction",
                &format!("{what}; median of {} rounds ({})", v.len(), spread(v)),
            )
            .target(target)
            .rounds(v),
        );
    }
}
