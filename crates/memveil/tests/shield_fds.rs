// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! The shield's own descriptors survive a program that closes every
//! descriptor it did not open (`memveil_sys::fdguard`): `closefrom(3)` and
//! a `dup2` onto every number leave the userfaultfd (and the loader's
//! listener) open, through the preload's wrappers and through the loader's
//! seccomp filter alike; the program's output equals its plain run's and
//! its evicted pages come back (decrypt faults: the array, evicted under a
//! plaintext bound while it was filled, is read back after the closes). A raw
//! `close_range` system call, which no wrapper sees, ends a dynamic
//! program with exit status 125 and the reason, instead of letting it run
//! on with pages that would read back as zeros (what happened before).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::{root, which, TempDir};

const MEMVEIL: &str = env!("CARGO_BIN_EXE_memveil");
const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/close_all.c");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `close_all` built with gcc (`-static` when `stat`); None after saying
/// why when gcc is missing.
fn build(dir: &TempDir, stat: bool) -> Option<PathBuf> {
    if which("gcc").is_none() {
        memveil_testkit::skip(
            memveil_testkit::Need::Installed("gcc"),
            "the test program is C",
        );
        return None;
    }
    let exe = dir.path(if stat {
        "close_all_static"
    } else {
        "close_all"
    });
    let mut cmd = Command::new("gcc");
    cmd.args(["-O2", "-o"]).arg(&exe).arg(SOURCE);
    if stat {
        cmd.arg("-static");
    }
    let o = cmd.output().expect("gcc");
    assert!(o.status.success(), "gcc: {}", text(&o.stderr));
    Some(exe)
}

/// The program under `memveil run --window 4096`: a plaintext bound of 16 MiB
/// evicts most of its 64 MiB array while it fills it, whatever the load, so
/// that reading the array back after the closes must decrypt pages. (Under
/// the default cost budget the sweep had evicted nothing by then now and then
/// on a loaded host, its steps held back for the host's other programs, and
/// the check proved nothing.)
fn protected(exe: &Path, args: &[&str]) -> Output {
    Command::new(MEMVEIL)
        .args(["run", "--window", "4096", "--"])
        .arg(exe)
        .args(args)
        .output()
        .expect("memveil run")
}

/// The decrypting faults the summary counts ("faults N decrypt").
/// The summary's decrypt faults (`faults N decrypt + M zero-fill`): evicted
/// pages that came back. The array's pages evicted while it was filled come
/// back only when it is read, after the closes; first touches are zero-fill.
fn decrypt_faults(stderr: &str) -> u64 {
    stderr
        .split("faults ")
        .nth(1)
        .and_then(|t| t.split(" decrypt").next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no decrypt fault count in the summary: {stderr}"))
}

fn survives(stat: bool) {
    if !root("shield_fds") {
        return;
    }
    let dir = TempDir::new("fds");
    let Some(exe) = build(&dir, stat) else {
        return;
    };
    let plain = Command::new(&exe).output().expect("plain run");
    assert!(plain.status.success());
    assert!(
        text(&plain.stderr).contains("dup2 refused 0"),
        "{}",
        text(&plain.stderr)
    );
    let o = protected(&exe, &[]);
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(text(&o.stdout), text(&plain.stdout), "{err}");
    // The shield's descriptors were there to refuse (the userfaultfd at
    // least), and the closes did not take them.
    assert!(!err.contains("dup2 refused 0"), "{err}");
    assert!(
        !err.contains("reading faults failed") && !err.contains("cannot register"),
        "{err}"
    );
    assert!(
        decrypt_faults(&err) > 0,
        "no evicted page came back after the closes: {err}"
    );
}

#[test]
fn a_dynamic_program_that_closes_every_descriptor_keeps_its_shield() {
    survives(false);
}

#[test]
fn a_static_program_that_closes_every_descriptor_keeps_its_shield() {
    survives(true);
}

#[test]
fn a_raw_close_range_through_the_loader_keeps_the_shield_too() {
    if !root("shield_fds") {
        return;
    }
    let dir = TempDir::new("fds-raw");
    let Some(exe) = build(&dir, true) else {
        return;
    };
    let plain = Command::new(&exe).arg("raw").output().expect("plain run");
    let o = protected(&exe, &["raw"]);
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(text(&o.stdout), text(&plain.stdout), "{err}");
    assert!(
        decrypt_faults(&err) > 0,
        "no evicted page came back after the close_range: {err}"
    );
}

#[test]
fn a_raw_close_range_in_a_dynamic_program_ends_it_loudly() {
    if !root("shield_fds") {
        return;
    }
    let dir = TempDir::new("fds-raw-dyn");
    let Some(exe) = build(&dir, false) else {
        return;
    };
    let o = protected(&exe, &["raw"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(125), "{err}");
    assert!(err.contains("closed behind its back"), "{err}");
    assert!(o.stdout.is_empty(), "it ran on: {}", text(&o.stdout));
}
