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
use super::{geomean, run_programs, spread, text_file, Mode, Program, Row, ROUNDS};
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
pub fn build_go_canary(dir: &Path) -> Result<PathBuf, String> {
    build_go(dir, "canary", include_str!("go/canary.go"))
}

/// Debian's statically linked busybox (package busybox-static).
fn static_busybox() -> Option<PathBuf> {
    let b = in_path("busybox")?;
    let data = std::fs::read(&b).ok()?;
    // A static executable has no PT_INTERP: no interpreter path in it.
    (!data.windows(b"ld-linux".len()).any(|w| w == b"ld-linux")).then_some(b)
}

/// The programs of this piece, and the ones that cannot run here with why.
fn programs(opts: &BenchOpts, dir: &Path) -> Result<(Vec<Program>, Vec<String>), BenchError> {
    let (mut progs, mut missing) = (Vec::new(), Vec::new());
    for (name, src, what) in GO_PROGRAMS {
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
/// their table into `md`.
///
/// # Errors
/// A program that failed or whose output differed from the plain run's is
/// reported in its figure; an error here is a setup failure.
pub(crate) fn run(
    opts: &BenchOpts,
    memveil: &Path,
    dir: &Path,
    figs: &mut Vec<Figure>,
    md: &mut String,
) -> Result<(), BenchError> {
    let (progs, missing) = programs(opts, dir)?;
    let rows = run_programs(opts, memveil, dir, &progs, &[Mode::Plain, Mode::Default])?;
    report(&rows, &missing, figs, md);
    canary(opts, memveil, dir, figs, md);
    Ok(())
}

fn report(rows: &[Row], missing: &[String], figs: &mut Vec<Figure>, md: &mut String) {
    let (p, d) = (Mode::Plain.index(), Mode::Default.index());
    let mut table = String::new();
    let go: Vec<&Row> = rows.iter().filter(|r| r.name != "static_sort").collect();
    for r in rows {
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
                     of {} paired round(s), spread {}; output and exit status compared with the plain run's; the \
                     summary's cost {}{}",
                    r.what,
                    r.ratios[d].len(),
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
        let rounds: Vec<f64> = (0..ROUNDS)
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
                     its defaults: the median over {ROUNDS} rounds of each round's geometric mean, spread {}",
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
        "\nGo and static programs under `memveil run` (issue 34; through the shield's loader), {ROUNDS} paired \
         rounds:\n\n| program | plain | protected | plain / protected (spread) | faults (last round) | outcome \
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
