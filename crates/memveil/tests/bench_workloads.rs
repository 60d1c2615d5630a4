// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! Smoke test of `memveil bench --only workloads` (issue 19): one round of
//! the iperf3 workload (1 s a side) plainly, under `memveil run` and under
//! `memveil run --window 4096`, through the bench's own code, so the part
//! cannot rot between full runs. The full part is not in the test suite
//! (about 10 minutes); BENCHMARKS.md has its figures.

use std::path::Path;

use memveil_testkit::{skip, Need};

const MEMVEIL: &str = env!("CARGO_BIN_EXE_memveil");

#[test]
fn workloads_smoke_iperf3_runs_in_all_three_modes() {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        skip(
            Need::Root,
            "memveil run needs userfaultfd for kernel-side faults",
        );
        return;
    }
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("iperf3").is_file()));
    if !found {
        skip(
            Need::Installed("iperf3"),
            "the workloads smoke test drives iperf3 (scripts/install.sh --deps installs it)",
        );
        return;
    }
    let preload = Path::new(MEMVEIL)
        .parent()
        .expect("binary directory")
        .join("libmemveil_shield_preload.so");
    assert!(
        preload.is_file(),
        "{} is missing: build it with `cargo build --release -p memveil-shield-preload` (same CARGO_TARGET_DIR)",
        preload.display()
    );
    let opts =
        memveil_bench::BenchOpts::new(memveil_bench::Size::Small, Box::new(|m| eprintln!("{m}")));
    let (figs, skipped) =
        memveil_bench::workloads::smoke(&opts, Path::new(MEMVEIL), &["iperf3"]).expect("smoke run");
    assert_eq!(skipped, 0, "iperf3 is installed, nothing may skip");
    for id in [
        "workloads.iperf3_vs_plain",
        "workloads.iperf3_w4096_vs_plain",
    ] {
        let f = figs
            .iter()
            .find(|f| f.figure == id)
            .unwrap_or_else(|| panic!("no figure {id}"));
        let ratio = f.ratio.expect("a ratio");
        assert!(
            f.value > 0.0 && f.baseline.is_some_and(|b| b > 0.0) && ratio > 0.0,
            "{id} did not run in every mode: {f:?}"
        );
        assert!(!f.note.contains("FAILED"), "{id}: {}", f.note);
    }
    let geo = figs
        .iter()
        .find(|f| f.figure == "workloads.geomean_vs_plain")
        .expect("the geometric mean");
    assert!(geo.value > 0.0, "geomean {geo:?}");
}
