// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! The summary's cost counts what the preload's allocator takes beyond the
//! C library's (issue 33, item 4: the cost is what the program loses against
//! a plain run). `tests/data/alloc_pairs.c` makes 900 pairs of rounds of
//! 2,000 allocations, one round through `malloc`/`free` (the preload's
//! allocator) and beside it one through glibc's own `__libc_malloc`/
//! `__libc_free`, in one process, and prints the median of the pairs'
//! differences: what the allocator cost it. Before, no part of `cost_ns`
//! counted it (python3 lost about 5% of its time there). The comparison is
//! in picoseconds, with no slack below: at the allocator's 0.5-2 ns a call
//! beyond glibc's, a bound of a factor of two and 1 ns either way on whole
//! ns passed a counter of nothing (40 of 40 runs, branch mo1).

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::{root, which, TempDir};

const MEMVEIL: &str = env!("CARGO_BIN_EXE_memveil");
const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/alloc_pairs.c");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `alloc_pairs` built with gcc; None after saying why when gcc is missing.
fn build(dir: &TempDir) -> Option<PathBuf> {
    if which("gcc").is_none() {
        memveil_testkit::skip(
            memveil_testkit::Need::Installed("gcc"),
            "the test program is C",
        );
        return None;
    }
    let exe = dir.path("alloc_pairs");
    let o = Command::new("gcc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(SOURCE)
        .output()
        .expect("gcc");
    assert!(o.status.success(), "gcc: {}", text(&o.stderr));
    Some(exe)
}

/// A number of the statistics.
fn num(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"))
}

/// The program's own report: (median difference of a pair ns, calls of a
/// round, pairs).
fn report(stdout: &str) -> (i64, u64, u64) {
    let w: Vec<&str> = stdout.split_whitespace().collect();
    let at = |k: &str| -> i64 {
        w.iter()
            .position(|x| *x == k)
            .and_then(|i| w.get(i + 1))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {stdout:?}"))
    };
    let count = |k: &str| u64::try_from(at(k)).unwrap_or_else(|_| panic!("{k} in {stdout:?}"));
    (at("diff"), count("calls"), count("pairs"))
}

fn protected(exe: &Path, json: &Path) -> (String, serde_json::Value) {
    let o = Command::new(MEMVEIL)
        .args(["run", "--stats-json"])
        .arg(json)
        .arg("--")
        .arg(exe)
        .output()
        .expect("memveil run");
    assert!(o.status.success(), "{:?}: {}", o.status, text(&o.stderr));
    let v =
        serde_json::from_str(&std::fs::read_to_string(json).expect("stats json")).expect("json");
    (text(&o.stdout), v)
}

#[test]
fn the_allocators_time_beyond_glibcs_is_in_the_cost() {
    if !root("the_allocators_time_beyond_glibcs_is_in_the_cost") {
        return;
    }
    let dir = TempDir::new("alloc-cost");
    let Some(exe) = build(&dir) else { return };
    let (out, v) = protected(&exe, &dir.path("s.json"));
    let (diff, calls, pairs) = report(&out);
    // Every call was counted (the rounds through malloc and free; batches
    // of 4096 per thread: all but the last).
    assert!(
        num(&v, "alloc_calls") + 4096 >= pairs * calls,
        "calls {}, counted {}: {v}",
        pairs * calls,
        num(&v, "alloc_calls")
    );
    assert!(
        num(&v, "alloc_ns") <= num(&v, "cost_ns") && num(&v, "cost_ns") <= num(&v, "host_cost_ns"),
        "{v}"
    );
    // Per call, in ps: what the program lost (the median pair) against
    // what the cost counted over all its calls: at least half of it (no
    // slack: a counter of nothing reads 0) and at most twice it and 1 ns
    // (the bound before, as the counter reads more beside a build, where
    // its pairs are few against the program's 900). Measured (AMD EPYC, 2
    // vCPUs, branch mo1): lost 0.48-2.10 ns a call; counted/lost 0.97-1.79
    // in 15 quiet runs, 0.70-1.96 in 15 beside two busy loops, 1.17-2.71
    // (at most 0.57 ns over twice) in 15 beside a build.
    #[allow(clippy::cast_precision_loss)]
    let lost = diff as f64 * 1000.0 / calls as f64;
    #[allow(clippy::cast_precision_loss)]
    let counted = num(&v, "alloc_ns") as f64 * 1000.0 / num(&v, "alloc_calls").max(1) as f64;
    // The lower bound needs the program to lose something measurable, or
    // nothing tells a counter from none: on a host where memveil's
    // allocator costs under 0.25 ns a call more than glibc's, only the
    // upper bound is checked, and the test says so (never seen here: lost
    // 0.48 ns a call at the least in 55 runs).
    if lost < 250.0 {
        memveil_testkit::skip(
            memveil_testkit::Need::HostSetting(
                "memveil's allocator 0.25 ns a call or more slower than glibc's (lower bound not checked)",
            ),
            format!(
                "the program lost {lost:.0} ps a call (median of {pairs} pairs), too little to \
                 tell the counter ({counted:.0} ps) from a counter of nothing; the upper bound is \
                 checked"
            ),
        );
        assert!(
            counted <= lost.max(0.0) * 2.0 + 1000.0,
            "the allocator cost the program {lost:.0} ps a call; the cost counted \
             {counted:.0} ps a call: {out}"
        );
        return;
    }
    assert!(
        counted >= lost / 2.0 && counted <= lost * 2.0 + 1000.0,
        "the allocator cost the program {lost:.0} ps a call (median of {pairs} pairs of rounds of \
         {calls} calls); the cost counted {counted:.0} ps a call over {} calls: {out}",
        num(&v, "alloc_calls")
    );
}
