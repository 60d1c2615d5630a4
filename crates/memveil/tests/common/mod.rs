//! Helpers of the asymmetric-key end-to-end tests (`asym_nginx.rs`,
//! `asym_ssh.rs`): a `gcore` dump, a process's uid.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// A `gcore` dump of `pid` in `dir` (the caller removes it).
pub fn gcore(dir: &Path, pid: u32) -> PathBuf {
    let prefix = dir.join("core");
    let g = Command::new("gcore")
        .arg("-o")
        .arg(&prefix)
        .arg(pid.to_string())
        .output()
        .expect("gcore");
    let core = PathBuf::from(format!("{}.{pid}", prefix.display()));
    assert!(
        core.exists(),
        "gcore of {pid} wrote nothing: {}",
        String::from_utf8_lossy(&g.stderr)
    );
    core
}

/// The real uid of `pid`.
pub fn uid_of(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Whether this test runs as root.
pub fn is_root() -> bool {
    uid_of(std::process::id()) == Some(0)
}
