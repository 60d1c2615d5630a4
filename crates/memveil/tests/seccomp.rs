//! Each daemon's seccomp allowlist holds: with `MEMVEIL_SECCOMP_SELFTEST`
//! a thread that ran before the filter calls `personality(2)`, outside
//! every list, and the daemon dies of `SIGSYS`; with `--no-seccomp` (the
//! positive control) the same call is harmless and the daemon serves on.
//! And the vault's `mseal`: its code and key memory refuse `mprotect`.

use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use memveil_testkit::{skip, Need};

const BIN: &str = env!("CARGO_BIN_EXE_memveil");

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("memveil-seccomp-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch");
        Scratch(d)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // A disk server killed (by the filter, or by a failing test's guard)
        // leaves its FUSE mount dead: detach it before removing the files.
        let _ = memveil_sys::mount::unmount(&self.0.join("m"), true);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A daemon started by a test: killed on drop; stderr in a file.
struct Daemon {
    child: Child,
    err: PathBuf,
    ready: String,
}

impl Daemon {
    /// Starts `memveil ARGS` with `env`; `ready` is its first stdout line
    /// (empty when it died first, or when `line` says it prints none).
    fn start_with(args: &[&str], env: &[(&str, &str)], err: &Path, line: bool) -> Self {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(if line { Stdio::piped() } else { Stdio::null() })
            .stderr(std::fs::File::create(err).expect("stderr file"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn memveil");
        let ready = match child.stdout.take() {
            Some(out) => memveil_testkit::first_line(out, Duration::from_secs(60)),
            None => String::new(),
        };
        Daemon {
            child,
            err: err.to_owned(),
            ready,
        }
    }

    fn start(args: &[&str], env: &[(&str, &str)], err: &Path) -> Self {
        Self::start_with(args, env, err, true)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Its exit status, waiting up to `limit`.
    fn exited(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t0 = Instant::now();
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if t0.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits up to `limit` for `text` in its stderr.
    fn says(&self, text: &str, limit: Duration) -> bool {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if self.log().contains(text) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const SELFTEST: (&str, &str) = ("MEMVEIL_SECCOMP_SELFTEST", "1");

/// The proof for one daemon: `args` with the self-test dies of SIGSYS
/// after saying its filter is installed; `args --no-seccomp` with the
/// self-test survives the call, prints `ready` (a daemon that prints no
/// ready line: `None`), and is still running.
fn killed_outside_its_list(s: &Scratch, tag: &str, args: &[&str], ready: Option<&str>) {
    let env = [SELFTEST];
    let line = ready.is_some();
    let mut d = Daemon::start_with(args, &env, &s.0.join(format!("{tag}.err")), line);
    let status = d.exited(Duration::from_secs(30));
    let log = d.log();
    assert_eq!(
        status.and_then(|s| s.signal()),
        Some(libc::SIGSYS),
        "{tag}: {status:?}\n{log}"
    );
    assert!(log.contains("seccomp: allowlist of "), "{tag}: {log}");
    assert!(!log.contains("not killed"), "{tag}: {log}");

    // Positive control: no filter, the same call, the daemon serves on.
    let mut off = args.to_vec();
    off.push("--no-seccomp");
    let mut d = Daemon::start_with(&off, &env, &s.0.join(format!("{tag}-off.err")), line);
    assert!(
        d.ready.starts_with(ready.unwrap_or_default()),
        "{tag}: {:?}\n{}",
        d.ready,
        d.log()
    );
    assert!(
        d.says("not killed", Duration::from_secs(10)),
        "{tag}: {}",
        d.log()
    );
    assert!(
        d.log().contains("WARNING: seccomp: OFF"),
        "{tag}: {}",
        d.log()
    );
    assert_eq!(
        d.exited(Duration::from_millis(200)),
        None,
        "{tag}: {}",
        d.log()
    );
}

fn vault(s: &Scratch, extra: &[&str]) -> Daemon {
    let sock = s.path("vault.sock");
    let mut args = vec![
        "vault",
        "serve",
        "--socket",
        &sock,
        "--allow-level",
        "locked",
    ];
    args.extend_from_slice(extra);
    let d = Daemon::start(&args, &[], &s.0.join("vault.err"));
    assert!(
        d.ready.starts_with("memveil-vault ready"),
        "{:?}\n{}",
        d.ready,
        d.log()
    );
    d
}

#[test]
fn the_vault_dies_of_a_call_outside_its_list() {
    let s = Scratch::new("vault");
    let sock = s.path("v.sock");
    killed_outside_its_list(
        &s,
        "vault",
        &[
            "vault",
            "serve",
            "--socket",
            &sock,
            "--allow-level",
            "locked",
        ],
        Some("memveil-vault ready"),
    );
    // Without the self-test the filtered vault serves its clients.
    let v = vault(&s, &[]);
    assert!(
        v.says("seccomp: allowlist of ", Duration::from_secs(10)),
        "{}",
        v.log()
    );
    let o = Command::new(BIN)
        .args(["vault", "status", "--socket", &s.path("vault.sock")])
        .output()
        .expect("vault status");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn the_vault_seals_its_code_and_key_memory() {
    let s = Scratch::new("mseal");
    let sock = s.path("vault.sock");
    let mut d = Daemon::start(
        &[
            "vault",
            "serve",
            "--socket",
            &sock,
            "--allow-level",
            "locked",
        ],
        &[("MEMVEIL_MSEAL_SELFTEST", "1")],
        &s.0.join("vault.err"),
    );
    assert!(
        d.ready.starts_with("memveil-vault ready"),
        "{:?}\n{}",
        d.ready,
        d.log()
    );
    // Sealing follows the ready line, the filter follows sealing.
    assert!(d.says("seccomp: ", Duration::from_secs(10)), "{}", d.log());
    let log = d.log();
    if log.contains("mseal unavailable") {
        skip(Need::HostSetting("Linux 6.10+ (mseal)"), log);
        return;
    }
    let line = log
        .lines()
        .find(|l| l.contains("mseal self-test: "))
        .unwrap_or_else(|| panic!("no self-test line:\n{log}"));
    // "... EPERM on A of B code mappings and C of D secret-memory mappings"
    let n: Vec<usize> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(n.len(), 4, "{line}");
    assert!(
        n[1] > 0 && n[0] == n[1],
        "every code mapping sealed: {line}"
    );
    if log.contains("level=secret") {
        assert!(n[3] >= 2 && n[2] == n[3], "every key region sealed: {line}");
    } else {
        skip(
            Need::MemfdSecret,
            "the secret-memory half of the mseal test",
        );
    }
    assert_eq!(d.exited(Duration::from_millis(100)), None, "{}", d.log());
}

#[test]
fn the_agent_dies_of_a_call_outside_its_list() {
    let s = Scratch::new("agent");
    let _v = vault(&s, &[]);
    let vsock = s.path("vault.sock");
    let asock = s.path("agent.sock");
    killed_outside_its_list(
        &s,
        "agent",
        &[
            "agent",
            "--socket",
            &asock,
            "--vault",
            &vsock,
            "--allow-level",
            "locked",
        ],
        Some("SSH_AUTH_SOCK="),
    );
}

#[test]
fn rng_serve_dies_of_a_call_outside_its_list() {
    let s = Scratch::new("rng");
    let sock = s.path("egd.sock");
    let stats = s.path("egd.stats");
    killed_outside_its_list(
        &s,
        "rng",
        &[
            "rng",
            "serve",
            "--unix",
            &sock,
            "--stats",
            &stats,
            "--source",
            "getrandom",
        ],
        None,
    );
}

#[test]
fn probe_serve_dies_of_a_call_outside_its_list() {
    let s = Scratch::new("probe");
    killed_outside_its_list(
        &s,
        "probe",
        &["probe", "--serve", "127.0.0.1:0", "--no-vault"],
        Some("memveil probe: serving http://"),
    );
}

#[test]
fn disk_serve_dies_of_a_call_outside_its_list() {
    if memveil_sys::probe::euid() != 0 {
        skip(Need::Root, "mounting FUSE needs root");
        return;
    }
    if let Err(e) = memveil_disk::host::check(false) {
        skip(Need::HostSetting("FUSE"), e);
        return;
    }
    let s = Scratch::new("disk");
    let img = s.path("p.img");
    let o = Command::new(BIN)
        .args(["disk", "create", &img, "--size", "1M", "--plain"])
        .output()
        .expect("disk create");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mnt = s.path("m");
    std::fs::create_dir_all(&mnt).expect("mount dir");
    killed_outside_its_list(
        &s,
        "disk",
        &["disk", "serve", &img, "--mount", &mnt, "--no-loop"],
        Some("memveil-disk ready"),
    );
    // The killed server left its FUSE mount dead, which the positive
    // control's server recovered; the one it leaves goes with `s`.
}
