//! How a memveil test that cannot run here says so. Test-only (every crate
//! takes it as a dev-dependency); it has no dependencies and no `unsafe`.
//!
//! A test missing a prerequisite calls [`skip`] with what it lacks, then
//! returns. [`skip`] writes one line,
//!
//! ```text
//! SKIP <test>: <reason>: <detail>
//! ```
//!
//! where `<test>` is the test's name (the harness names each test's thread
//! after it), `<reason>` the [`Need`]'s fixed wording (no `:` in it, so the
//! lines can be counted by reason) and `<detail>` one line of the caller's
//! explanation. The line goes straight to the process's standard error, not
//! through `eprintln!`, which the test harness captures and shows only for
//! failing tests: a skip shows in the output of a passing run. When
//! `MEMVEIL_SKIP_LOG` names a file, the line is appended to it as well;
//! `scripts/test.sh` ends with the count of those lines by reason.
//!
//! Under `CI=true`, a skip for want of something the project's own scripts
//! provide ([`Need::Installed`]: a package of `scripts/packages.txt`, an
//! artefact of `scripts/install.d/`, a binary `scripts/test.sh` builds)
//! panics instead: CI installs all of them, so such a skip means a broken
//! installation, not a test that passed. What no script can provide (root,
//! `memfd_secret`, userfaultfd rights, a CPU feature, a second CPU, a
//! hypervisor, a host setting) stays a skip under CI, and is still counted.

use std::fmt;
use std::io::Write as _;

/// What a test lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Need {
    /// A program, library or artefact that `scripts/install.sh` installs or
    /// builds, or that `scripts/test.sh` builds before the tests (its name:
    /// `"gcore"`, `"redis-server"`, `"build/guest"`). Fails the run under
    /// `CI=true`.
    Installed(&'static str),
    /// Root (effective uid 0).
    Root,
    /// `memfd_secret(2)` (Linux 5.14+, not booted with `secretmem.enable=0`).
    MemfdSecret,
    /// userfaultfd, as far as the test needs it.
    Userfaultfd,
    /// A CPU feature (`"RDRAND"`, `"RDSEED"`, `"AES-NI"`).
    Cpu(&'static str),
    /// A second CPU.
    SecondCpu,
    /// Running under a hypervisor.
    Hypervisor,
    /// A host setting other than the one found (a sysctl, a device's mode,
    /// a directory another user cannot reach).
    HostSetting(&'static str),
}

impl Need {
    /// Whether the project's scripts provide it (so CI must have it).
    #[must_use]
    pub fn provided_by_scripts(self) -> bool {
        matches!(self, Need::Installed(_))
    }
}

impl fmt::Display for Need {
    /// The reason as counted: fixed wording, never a `:`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Need::Installed(what) => write!(f, "{what} not installed"),
            Need::Root => f.write_str("not root"),
            Need::MemfdSecret => f.write_str("no memfd_secret"),
            Need::Userfaultfd => f.write_str("no userfaultfd"),
            Need::Cpu(feature) => write!(f, "CPU lacks {feature}"),
            Need::SecondCpu => f.write_str("one CPU"),
            Need::Hypervisor => f.write_str("no hypervisor"),
            Need::HostSetting(s) => write!(f, "host setting {s}"),
        }
    }
}

/// Whether this is a CI run (`CI=true`, as CI services set it, or `CI=1`).
#[must_use]
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// Says that the calling test skips (all of it, or the part `detail`
/// names) for want of `need`; the caller returns afterwards.
///
/// # Panics
/// Under `CI=true` when `need` is something the project's scripts provide,
/// so that the run fails rather than passing without the test.
#[track_caller]
pub fn skip(need: Need, detail: impl fmt::Display) {
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    if fails_the_run(need, ci()) {
        panic!(
            "{test}: {need} ({}), under CI=true: scripts/install.sh provides it, \
             so this test must run, not skip (run scripts/install.sh --deps)",
            one_line(&detail.to_string())
        );
    }
    let line = line(&test, need, &detail.to_string());
    // Straight to the descriptor: `eprintln!` would land in the harness's
    // capture buffer, shown only for failing tests.
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os("MEMVEIL_SKIP_LOG") {
        // One write of a short line to an O_APPEND file: lines of tests
        // running in parallel (and in other test binaries) do not mix.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// Whether a skip for want of `need` fails the run instead.
fn fails_the_run(need: Need, ci: bool) -> bool {
    ci && need.provided_by_scripts()
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The SKIP line for `test`, newline included.
fn line(test: &str, need: Need, detail: &str) -> String {
    format!("SKIP {test}: {need}: {}\n", one_line(detail))
}

/// The first line a daemon under test prints on `out` (its "ready" line),
/// or "" when none comes within `limit`. The rest of its output is read and
/// dropped on a thread of its own, so the daemon never blocks writing it.
#[must_use]
pub fn first_line(out: std::process::ChildStdout, limit: std::time::Duration) -> String {
    use std::io::BufRead as _;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut r = std::io::BufReader::new(out);
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

/// A `memveil vault serve` started by a test on a socket of its own, killed
/// (and its scratch directory removed) on drop.
pub struct VaultProcess {
    child: std::process::Child,
    bin: String,
    /// Scratch directory (socket, stderr log, files the test writes).
    pub dir: std::path::PathBuf,
    /// The control socket.
    pub socket: String,
}

impl VaultProcess {
    /// Starts `bin vault serve --vault DIR/vault.sock EXTRA...` in a fresh
    /// scratch directory named after `tag`, and waits for its ready line.
    ///
    /// # Panics
    /// When the vault does not start (its stderr is in the message).
    #[must_use]
    pub fn start(bin: &str, tag: &str, extra: &[&str]) -> Self {
        use std::process::{Command, Stdio};
        let dir = std::env::temp_dir().join(format!("memveil-vault-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch");
        let socket = dir.join("vault.sock").display().to_string();
        let err = dir.join("vault.err");
        let mut child = Command::new(bin)
            .args(["vault", "serve", "--vault", &socket])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&err).expect("stderr file"))
            .spawn()
            .expect("spawn vault");
        let out = child.stdout.take().expect("stdout");
        let line = first_line(out, std::time::Duration::from_secs(60));
        let v = Self {
            child,
            bin: bin.to_owned(),
            dir,
            socket,
        };
        assert!(
            line.starts_with("memveil-vault ready"),
            "{line:?}\n{}",
            v.log()
        );
        v
    }

    /// What the vault wrote to stderr so far (its audit log).
    #[must_use]
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("vault.err")).unwrap_or_default()
    }

    /// Runs `memveil key ARGS --vault` on this vault (stdin closed).
    ///
    /// # Panics
    /// When the binary cannot be started.
    #[must_use]
    pub fn key(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new(&self.bin)
            .arg("key")
            .args(args)
            .args(["--vault", &self.socket])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run memveil key")
    }

    /// The vault's pid.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for VaultProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The readable mappings of process `pid` (`"self"` for this one), as
/// `[start, end)` address ranges from `/proc/PID/maps`, without `[vvar]` and
/// `[vsyscall]` (which `/proc/PID/mem` cannot read). For tests that search
/// a process's memory for what should not be there.
///
/// # Panics
/// When the maps cannot be read (a broken `/proc`, a process gone).
#[must_use]
pub fn readable_mappings(pid: &str) -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            if !perms.starts_with('r') || l.contains("[vvar") || l.contains("[vsyscall]") {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect()
}

/// Runs `f` on a fresh thread 64 KiB deep in its stack, then returns a copy
/// of that thread's whole stack mapping, read through `/proc/self/mem`
/// while the thread waits at the top (so nothing it does after `f` can
/// overwrite what `f` left below). For stack-hygiene tests: what an
/// operation leaves on an ordinary stack is what a memory dump would see.
///
/// # Panics
/// When the stack mapping cannot be found or read (a broken `/proc`).
pub fn stack_after(f: impl FnOnce() + Send) -> Vec<u8> {
    use std::hint::black_box;
    use std::os::unix::fs::FileExt as _;
    use std::sync::mpsc;
    #[inline(never)]
    fn deep(n: usize, f: &mut Option<Box<dyn FnOnce() + Send + '_>>) {
        let mut pad = [0u8; 4096];
        black_box(&mut pad);
        if n == 0 {
            if let Some(f) = f.take() {
                f();
            }
        } else {
            deep(n - 1, f);
        }
        black_box(&pad);
    }
    let (tx, rx) = mpsc::channel::<usize>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let mut f: Option<Box<dyn FnOnce() + Send + '_>> = Some(Box::new(f));
            deep(16, &mut f);
            let here = 0u8;
            tx.send(std::ptr::from_ref(black_box(&here)) as usize)
                .expect("send");
            let _ = done_rx.recv();
        });
        let sp = rx.recv().expect("thread ran");
        let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
        let (lo, hi) = maps
            .lines()
            .filter_map(|l| {
                let r = l.split_whitespace().next()?;
                let (a, b) = r.split_once('-')?;
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            })
            .find(|(a, b)| (*a..*b).contains(&sp))
            .expect("the thread's stack mapping");
        let mut buf = vec![0u8; hi - lo];
        std::fs::File::open("/proc/self/mem")
            .expect("/proc/self/mem")
            .read_exact_at(&mut buf, lo as u64)
            .expect("read the stack");
        done_tx.send(()).expect("release");
        buf
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Need; 8] = [
        Need::Installed("redis-server"),
        Need::Root,
        Need::MemfdSecret,
        Need::Userfaultfd,
        Need::Cpu("RDSEED"),
        Need::SecondCpu,
        Need::Hypervisor,
        Need::HostSetting("vm.unprivileged_userfaultfd"),
    ];

    #[test]
    fn the_line_splits_into_test_reason_and_detail_on_colon_space() {
        for need in ALL {
            let l = line("tests::a_test", need, "why\n  on two lines");
            let fields: Vec<&str> = l.trim_end().splitn(3, ": ").collect();
            assert_eq!(
                fields,
                ["SKIP tests::a_test", &need.to_string(), "why on two lines"]
            );
            assert!(!need.to_string().contains(':'), "{need}");
            assert!(l.ends_with('\n') && l.matches('\n').count() == 1);
        }
    }

    #[test]
    fn under_ci_only_what_the_scripts_install_fails_the_run() {
        for need in ALL {
            assert!(!fails_the_run(need, false), "{need}");
            assert_eq!(
                fails_the_run(need, true),
                need == Need::Installed("redis-server"),
                "{need}"
            );
        }
    }

    /// Runs this test binary's `child` test with `need` (by index in ALL)
    /// and `ci`; its exit status, its stderr, its stdout (where the harness
    /// reports a failure) and the skip log it wrote.
    fn run_child(need: usize, ci: bool) -> (bool, String, String, String) {
        let log = std::env::temp_dir().join(format!(
            "memveil-testkit-{}-{need}-{ci}.log",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&log);
        let mut cmd = std::process::Command::new(std::env::current_exe().expect("exe"));
        cmd.args(["tests::child", "--exact", "--test-threads=1"])
            .env("MEMVEIL_TESTKIT_CHILD", need.to_string())
            .env("MEMVEIL_SKIP_LOG", &log)
            .env_remove("CI");
        if ci {
            cmd.env("CI", "true");
        }
        let out = cmd.output().expect("run the test binary");
        let logged = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            logged,
        )
    }

    /// Not a test of its own: what `run_child` runs in a child process.
    #[test]
    fn child() {
        if let Some(i) = std::env::var("MEMVEIL_TESTKIT_CHILD")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
        {
            skip(ALL[i], "from the child");
        }
    }

    #[test]
    fn a_skip_shows_through_capture_is_logged_and_fails_under_ci_only_if_installable() {
        // A machine property: a skip under CI too, printed although the
        // harness captures the passing test's output, and logged.
        let (ok, err, _, log) = run_child(5, true);
        let want = "SKIP tests::child: one CPU: from the child\n";
        assert!(ok, "{err}");
        assert!(err.contains(want), "not on stderr: {err}");
        assert_eq!(log, want);
        // Installable, outside CI: a counted skip.
        let (ok, err, _, log) = run_child(0, false);
        assert!(ok, "{err}");
        assert_eq!(
            log,
            "SKIP tests::child: redis-server not installed: from the child\n"
        );
        // Installable, under CI: the test fails, nothing is counted as skipped.
        let (ok, err, out, log) = run_child(0, true);
        assert!(!ok, "an installable skip passed under CI=true: {err}");
        assert!(
            out.contains("redis-server not installed (from the child), under CI=true"),
            "{out}"
        );
        assert!(!err.contains("SKIP"), "{err}");
        assert_eq!(log, "");
    }
}
