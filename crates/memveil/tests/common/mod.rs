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

/// Calls `f` on every non-zero page `pid` has readable, as `/proc/PID/mem`
/// gives it: in 1 MiB chunks, page by page where a chunk cannot be read (an
/// evicted page of the protected region), so that every page the process
/// holds in plaintext is seen (gcore instead writes zeros for a whole chunk
/// when one page in it cannot be read). Returns the pages that could not be
/// read.
pub fn each_page(pid: u32, mut f: impl FnMut(&[u8])) -> u64 {
    use std::os::unix::fs::FileExt as _;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("open /proc/PID/mem");
    let mut unreadable = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        if !perms.starts_with('r') || line.contains("[vvar") || line.contains("[vsyscall]") {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let mut at = a;
        while at < b {
            let n = usize::try_from((b - at).min(1 << 20)).expect("chunk");
            let chunk = &mut buf[..n];
            if mem.read_exact_at(chunk, at).is_ok() {
                chunk
                    .chunks(4096)
                    .filter(|p| p.iter().any(|&x| x != 0))
                    .for_each(&mut f);
            } else {
                for (i, p) in chunk.chunks_mut(4096).enumerate() {
                    let off = at + u64::try_from(i * 4096).expect("offset");
                    if mem.read_exact_at(p, off).is_err() {
                        unreadable += 1;
                    } else if p.iter().any(|&x| x != 0) {
                        f(p);
                    }
                }
            }
            at += u64::try_from(n).expect("chunk");
        }
    }
    unreadable
}

/// The program's path when it is on PATH (or an absolute path that exists).
pub fn which(prog: &str) -> Option<std::path::PathBuf> {
    let p = std::path::Path::new(prog);
    if p.is_absolute() {
        return p.is_file().then(|| p.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

/// Whether this process may use userfaultfd the way the shield needs (root);
/// prints why the test is skipped otherwise.
pub fn root(test: &str) -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    memveil_testkit::skip(
        memveil_testkit::Need::Root,
        format!("{test}: memveil run needs userfaultfd for kernel-side faults"),
    );
    false
}

/// A directory removed with everything in it when dropped.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("memveil-shield-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }

    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
