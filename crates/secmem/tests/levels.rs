//! Protection levels, refusal without memfd_secret, RLIMIT_MEMLOCK exhaustion,
//! and what /proc/PID/mem can read, each checked in a child process.

use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::PathBuf;
use std::process::Command;

use memveil_secmem::{Level, Policy, SecretRegion};
use memveil_testkit::{skip, Need};

fn probe_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("exe");
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("examples")
        .join("secmem-probe")
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().expect("spawn");
    let s =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), s)
}

fn secretmem_here() -> bool {
    memveil_sys::memfd_secret().is_ok()
}

#[test]
fn strongest_level_is_used() {
    let r = SecretRegion::new(8192, Policy::allow(Level::Locked)).expect("region");
    if secretmem_here() {
        assert_eq!(r.level(), Level::Secret);
    } else {
        skip(
            Need::MemfdSecret,
            format!("the secret-level check (got {})", r.level()),
        );
        assert_eq!(r.level(), Level::Locked);
    }
}

#[test]
fn without_secretmem_refuses_unless_locked_is_accepted() {
    let (ok, out) = run(Command::new(probe_bin())
        .args(["4096", "secret"])
        .env("MEMVEIL_SECRETMEM", "off"));
    assert!(!ok, "must refuse: {out}");
    assert!(
        out.contains("memfd_secret unavailable") && out.contains("--allow-level=locked"),
        "{out}"
    );
    let (ok, out) = run(Command::new(probe_bin())
        .args(["4096", "locked"])
        .env("MEMVEIL_SECRETMEM", "off"));
    assert!(ok && out.contains("level=locked"), "{out}");
    // Positive control: with the hook off the same binary gets secret memory.
    if secretmem_here() {
        let (ok, out) = run(Command::new(probe_bin()).args(["4096", "secret"]));
        assert!(ok && out.contains("level=secret"), "{out}");
    }
}

fn as_nobody_with_memlock(limit: u64, args: &[&str], env_off: bool) -> Option<(bool, String)> {
    let have = |t: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {t}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let missing = if !nix_root() {
        Some(Need::Root)
    } else if !have("prlimit") {
        Some(Need::Installed("prlimit"))
    } else if !have("setpriv") {
        Some(Need::Installed("setpriv"))
    } else {
        None
    };
    if let Some(need) = missing {
        skip(
            need,
            "the memlock test runs as nobody under prlimit (util-linux)",
        );
        return None;
    }
    let mut c = Command::new("prlimit");
    c.arg(format!("--memlock={limit}:{limit}"))
        .args([
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(probe_bin())
        .args(args);
    if env_off {
        c.env("MEMVEIL_SECRETMEM", "off");
    }
    Some(run(&mut c))
}

fn nix_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
    })
}

#[test]
fn memlock_exhaustion_names_the_limit() {
    // Secret memory counts against RLIMIT_MEMLOCK: 64 KiB limit, 1 MiB asked.
    let Some((ok, out)) = as_nobody_with_memlock(65536, &["1048576", "secret"], false) else {
        return;
    };
    if secretmem_here() {
        assert!(!ok, "{out}");
        assert!(
            out.contains("RLIMIT_MEMLOCK")
                && out.contains("65536 bytes")
                && out.contains("ulimit -l"),
            "{out}"
        );
        // Positive control: within the limit the same user succeeds.
        let (ok, out) = as_nobody_with_memlock(65536, &["16384", "secret"], false).expect("tools");
        assert!(ok && out.contains("level=secret"), "{out}");
    }
    // The locked fallback hits the same limit through mlock.
    let (ok, out) = as_nobody_with_memlock(65536, &["1048576", "locked"], true).expect("tools");
    assert!(!ok && out.contains("RLIMIT_MEMLOCK"), "{out}");
}

/// Reads `len` bytes at `addr` through /proc/self/mem (the path a memory
/// disclosure through the kernel, or another process with ptrace rights, takes).
fn read_proc_mem(addr: usize, len: usize) -> std::io::Result<Vec<u8>> {
    let mut f = std::fs::File::open("/proc/self/mem")?;
    f.seek(SeekFrom::Start(addr as u64))?;
    let mut b = vec![0u8; len];
    f.read_exact(&mut b)?;
    Ok(b)
}

#[test]
fn secret_pages_are_unreadable_through_proc_mem() {
    let mut locked = SecretRegion::new(4096, Policy::allow(Level::Locked)).expect("region");
    locked.bytes()[..8].copy_from_slice(b"SECRET!!");
    if locked.level() == Level::Secret {
        let e = read_proc_mem(locked.as_ptr() as usize, 8);
        assert!(e.is_err(), "memfd_secret page was readable: {e:?}");
    } else {
        skip(
            Need::MemfdSecret,
            "the unreadability check (the positive control runs)",
        );
    }
    // Positive control: an ordinary heap buffer is readable the same way.
    let heap = b"SECRET!!".to_vec();
    assert_eq!(
        read_proc_mem(heap.as_ptr() as usize, 8).expect("heap readable"),
        b"SECRET!!"
    );
}
