// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! `memveil keyfind` as a program: a planted schedule is reported (exit 3)
//! with only its key check value unless --show-keys; a hostile core file is
//! a clear error (exit 1), never a panic; `--pid` on a program under
//! `memveil run` reads the protected region around its evicted pages.

use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use memveil_testkit::{skip, Need};

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_memveil"))
        .arg("keyfind")
        .args(args)
        .output()
        .expect("run memveil");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn planted_schedule_is_reported_and_bad_cores_are_errors() {
    let dir = std::env::temp_dir().join(format!("keyfind-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let key: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(29) ^ 0x3c).collect();
    let hexkey: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut img = vec![0u8; 1 << 16];
    let s = memveil_keyfind::expand(&key).expect("expand");
    img[8192..8192 + s.len()].copy_from_slice(&s);
    img[8192 + 100] ^= 0x04;
    let f = dir.join("img");
    std::fs::write(&f, &img).expect("write");
    let p = f.to_str().expect("utf8");

    let (code, out, err) = run(&[p]);
    assert_eq!(code, Some(3), "{out}{err}");
    assert!(out.contains("AES-256 at 0x2000"), "{out}");
    assert!(
        !out.contains(&hexkey),
        "key shown without --show-keys: {out}"
    );
    let (code, out, _) = run(&[p, "--show-keys", "--json"]);
    assert_eq!(code, Some(3));
    assert!(
        out.contains(&hexkey) && out.contains("\"bit_errors\""),
        "{out}"
    );

    // Nothing found: exit 0.
    std::fs::write(&f, vec![0u8; 4096]).expect("write");
    assert_eq!(run(&[p]).0, Some(0));

    // Hostile cores: clear errors, exit 1.
    let mut core = vec![0u8; 64];
    core[..4].copy_from_slice(b"\x7fELF");
    core[4] = 2;
    core[5] = 1;
    core[16] = 4;
    core[0x20] = 64;
    core[0x36] = 56;
    core[0x38] = 200;
    std::fs::write(&f, &core).expect("write");
    let (code, _, err) = run(&["--core", p]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not a usable ELF64 core file"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (code, _, err) = run(&["--core", "/nonexistent/core"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("/nonexistent/core"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A process group killed (and reaped) when dropped, passed or not.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        if let Ok(pgid) = i32::try_from(self.0.id()) {
            // SAFETY: kill(2) takes no pointers; the group's leader is our
            // child, not yet reaped, so its id names this group only.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
        let _ = self.0.wait();
    }
}

/// Regression: `keyfind --pid` on a program under `memveil run` read each
/// mapping in one piece, so the first evicted page (EIO through
/// /proc/PID/mem) made the whole protected region "unreadable": nothing of
/// it was scanned and the result still said "0 key schedules". Now only the
/// failing pages are skipped and counted; a schedule the program holds in
/// its plaintext window is found.
#[test]
fn pid_under_memveil_run_is_read_around_the_evicted_pages() {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        skip(
            Need::Root,
            "memveil run needs userfaultfd for kernel-side faults",
        );
        return;
    }
    let python = Path::new("/usr/bin/python3");
    if !python.is_file() {
        skip(Need::Installed("python3"), "/usr/bin/python3 missing");
        return;
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_memveil"));
    if !bin.with_file_name("libmemveil_shield_preload.so").is_file() {
        skip(
            Need::Installed("libmemveil_shield_preload.so"),
            "build it with `cargo build --release --workspace` (scripts/test.sh does)",
        );
        return;
    }
    let mut key = [0u8; 16];
    memveil_sys::getrandom(&mut key).expect("random key");
    let hexkey: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let schedule: String = memveil_keyfind::expand(&key)
        .expect("AES-128 schedule")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    // 16 MiB through a 256-page window, then the schedule, touched last.
    let script = "import os, sys\n\
                  fill = [bytearray(os.urandom(64)) * 64 for _ in range(4096)]\n\
                  sched = bytearray.fromhex(sys.argv[1])\n\
                  print(os.getpid(), sum(sched), flush=True)\n\
                  sys.stdin.read()\n";
    let mut child = Command::new(bin);
    child
        .args([
            "run",
            "--quiet",
            "--window",
            "256",
            "--region-gib",
            "1",
            "--",
        ])
        .arg(python)
        .args(["-c", script, &schedule])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .process_group(0);
    let mut group = Group(child.spawn().expect("memveil run"));
    let mut line = String::new();
    BufReader::new(group.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the program's pid");
    let pid = line
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned();
    assert!(
        pid.parse::<u32>().is_ok(),
        "no pid from the program: {line:?}"
    );

    let t = Instant::now();
    let (code, out, err) = run(&["--pid", &pid, "--json", "--show-keys"]);
    let took = t.elapsed();
    assert_eq!(code, Some(3), "{out}{err}");
    let j: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let keys = j["keys"].as_array().expect("keys");
    let ours: Vec<&serde_json::Value> = keys.iter().filter(|k| k["key"] == hexkey).collect();
    assert!(
        !ours.is_empty(),
        "the schedule the program holds in its window was not found ({} other schedules)",
        keys.len()
    );
    let skipped = j["bytes_skipped"].as_u64().expect("bytes_skipped");
    let scanned = j["bytes_scanned"].as_u64().expect("bytes_scanned");
    assert!(
        skipped > 0 && j["unreadable"].as_array().is_some_and(|u| !u.is_empty()),
        "the evicted pages are not reported: {skipped} bytes skipped"
    );
    let (_, text, _) = run(&["--pid", &pid]);
    assert!(
        text.contains("unreadable bytes in") && !text.contains("skipped 0 unreadable"),
        "the text output does not say how much was skipped: {text}"
    );
    eprintln!(
        "keyfind --pid under memveil run: {scanned} bytes read, {skipped} skipped, \
         {} copies of the schedule found, {took:.2?}",
        ours.len()
    );
}

/// Issue 35: `keyfind --pid` of a process that is not there told root to run
/// as root and printed its cause twice; with no source it exited 1 where its
/// help promises 2 (usage error).
#[test]
fn a_missing_process_is_named_once_and_no_source_is_a_usage_error() {
    // A PID above pid_max's default range that no process holds.
    let pid = (4_000_000..4_194_303u32)
        .rev()
        .find(|p| !Path::new(&format!("/proc/{p}")).exists())
        .expect("a free pid");
    let (code, _, err) = run(&["--pid", &pid.to_string()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("no process {pid}")), "{err}");
    assert!(!err.contains("run as root"), "{err}");
    assert_eq!(err.matches("(os error 2)").count(), 1, "{err}");
    let (code, _, err) = run(&[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--pid"), "{err}");
}
