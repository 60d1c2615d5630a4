//! Test harness: starts a real `memveil-vault serve` process in a private
//! directory, waits for its ready line, and kills it (and removes the
//! directory) on drop, even when the test fails. Shared by the vault's
//! integration tests and the proof-of-protection tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use memveil_vault::Client;

/// The daemon binary built with this crate.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_memveil-vault"))
}

/// A fresh private directory under the system temp dir.
pub fn scratch_dir(tag: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "memveil-vault-test-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// A running vault.
pub struct Vault {
    pub child: Option<Child>,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub ready: String,
    keep_dir: bool,
}

/// How to start a vault.
#[derive(Clone, Default)]
pub struct Opts {
    /// Extra flags after `serve --socket S`.
    pub args: Vec<String>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// A command prefix (e.g. `setpriv … prlimit …`).
    pub wrapper: Vec<String>,
    /// Reuse this directory (keeps state across restarts).
    pub dir: Option<PathBuf>,
}

impl Opts {
    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.to_owned());
        self
    }
    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.env.push((k.to_owned(), v.to_owned()));
        self
    }
    pub fn dir(mut self, d: &Path) -> Self {
        self.dir = Some(d.to_owned());
        self
    }
}

impl Vault {
    /// Starts a vault with default flags, panicking if it does not come up.
    pub fn start() -> Vault {
        Vault::start_with(Opts::default()).unwrap_or_else(|e| panic!("vault did not start: {e}"))
    }

    /// Starts a vault; on failure returns its exit status and stderr.
    pub fn start_with(o: Opts) -> Result<Vault, String> {
        let (dir, keep_dir) = match &o.dir {
            Some(d) => (d.clone(), true),
            None => (scratch_dir("v"), false),
        };
        let socket = dir.join("vault.sock");
        let errlog = dir.join(format!(
            "stderr.{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        let mut cmd = if o.wrapper.is_empty() {
            Command::new(bin())
        } else {
            let mut c = Command::new(&o.wrapper[0]);
            c.args(&o.wrapper[1..]).arg(bin());
            c
        };
        cmd.arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(&o.args)
            .envs(o.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&errlog).expect("stderr log"));
        let mut child = cmd.spawn().map_err(|e| format!("spawn: {e}"))?;
        let out = child.stdout.take().expect("stdout");
        let line = memveil_testkit::first_line(out, Duration::from_secs(60));
        if !line.starts_with("memveil-vault ready") {
            let _ = child.kill();
            let st = child.wait().ok();
            let err = std::fs::read_to_string(&errlog).unwrap_or_default();
            if !keep_dir {
                let _ = std::fs::remove_dir_all(&dir);
            }
            return Err(format!("exit {st:?}; stderr:\n{err}"));
        }
        Ok(Vault {
            child: Some(child),
            dir,
            socket,
            ready: line,
            keep_dir,
        })
    }

    /// The vault's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// A connected client.
    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect")
    }

    /// Everything the vault wrote to stderr so far.
    pub fn stderr(&self) -> String {
        let mut s = String::new();
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            let mut names: Vec<_> = rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("stderr."))
                })
                .collect();
            names.sort();
            for n in names {
                s.push_str(&std::fs::read_to_string(n).unwrap_or_default());
            }
        }
        s
    }

    /// SIGKILLs the vault and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the vault to exit by itself (e.g. at a crash point).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    self.child = None;
                    return Some(st);
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

impl Drop for Vault {
    fn drop(&mut self) {
        self.kill();
        if !self.keep_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A small deterministic generator (no extra dependency).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn fill(&mut self, b: &mut [u8]) {
        for x in b {
            *x = self.next().to_le_bytes()[0];
        }
    }
}

/// Drops the calling thread (only) to `uid`:`uid` with no supplementary
/// groups: the raw `setresuid` system call, unlike the libc wrapper,
/// changes only this thread, so the vault sees it as another local user
/// through `SO_PEERCRED`. Needs root.
pub fn become_uid(uid: u32) {
    // SAFETY: raw system calls on the calling thread's own credentials with
    // plain integer arguments; a null list with count 0 clears the groups.
    let r = unsafe {
        [
            libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()),
            libc::syscall(libc::SYS_setresgid, uid, uid, uid),
            libc::syscall(libc::SYS_setresuid, uid, uid, uid),
        ]
    };
    assert_eq!(r, [0, 0, 0], "switching this thread to uid {uid}");
}

/// The effective uid of this process, from /proc (no unsafe needed).
pub fn euid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2))
                .and_then(|u| u.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

/// A `gcore` dump of `pid`, parsed (and the file removed); `None` after a
/// skip line when gdb is not installed.
pub fn gcore(pid: u32, tag: &str) -> Option<memveil_keyfind::Image> {
    let base = std::env::temp_dir().join(format!("proof-{tag}-{}", std::process::id()));
    match std::process::Command::new("gcore")
        .arg("-o")
        .arg(&base)
        .arg(pid.to_string())
        .output()
    {
        Ok(o) if o.status.success() => {
            let path = base.with_extension(pid.to_string());
            let img = memveil_keyfind::read_core(&path).expect("parse core");
            let _ = std::fs::remove_file(&path);
            Some(img)
        }
        Ok(o) => panic!(
            "gcore of {tag} failed: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            memveil_testkit::skip(
                memveil_testkit::Need::Installed("gcore"),
                format!("the gcore part of the proof: gcore not runnable ({e}); install gdb"),
            );
            None
        }
    }
}
