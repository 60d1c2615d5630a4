//! The programs the bench starts: finding them (`memveil`, tools in
//! `PATH`), starting them pinned, waiting for them, their logs and scratch
//! directories. Shared by the parts that run real programs (shield, nginx,
//! workloads, vault), so none of them imports another for these.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Waits up to `within` for `child` to exit, looking every 20 ms; whether
/// it did (it is reaped then).
pub(crate) fn exited_within(child: &mut std::process::Child, within: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < within {
        if let Ok(Some(_)) = child.try_wait() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The file name of the shield's loader of Go and static programs (what
/// `/proc/PID/exe` names for a program `memveil run` started through it).
pub(crate) const SHIELD_LOADER: &str = "memveil-shield-loader";

/// Where the `memveil` executable is: this executable when it is `memveil`,
/// else a `memveil` beside it.
pub(crate) fn memveil_exe() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    if exe.file_name().is_some_and(|n| n == "memveil") {
        return Some(exe);
    }
    let dir = exe.parent()?;
    [dir.join("memveil"), dir.join("../memveil")]
        .into_iter()
        .find(|p| p.is_file())
}

pub(crate) fn in_path(prog: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

pub(crate) fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(6)..].join(" | ")
}

/// `program`, or `taskset -c N program` when pinned to CPU N.
pub(crate) fn pinned_command(program: &Path, cpu: Option<usize>) -> Command {
    match cpu {
        Some(n) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(n.to_string()).arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// A fresh temporary directory name for one part of the bench.
pub(crate) fn scratch_dir(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "memveil-bench-{what}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    ))
}

/// The first line a daemon prints on `out` (its ready line), or "" when
/// none comes within `limit`; the rest is read and dropped on a thread of
/// its own, so the daemon never blocks writing it.
pub(crate) fn ready_line(out: std::process::ChildStdout, limit: Duration) -> String {
    use std::io::{BufRead as _, BufReader};
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(out);
        let mut line = String::new();
        let _ = r.read_line(&mut line);
        let _ = tx.send(line);
        let mut sink = String::new();
        while r.read_line(&mut sink).is_ok_and(|n| n > 0) {
            sink.clear();
        }
    });
    rx.recv_timeout(limit).unwrap_or_default()
}
