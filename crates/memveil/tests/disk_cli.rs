//! `memveil disk` through the binary: create/info and their refusals, and
//! `serve` with a real vault, a loop device, and the way down on SIGTERM.
//! The disk itself is tested in depth by `crates/disk/tests`.

use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use memveil_testkit::{skip, Need};

const BIN: &str = env!("CARGO_BIN_EXE_memveil");

fn memveil(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run memveil")
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memveil-disk-cli-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch");
    d
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn create_and_info_and_their_refusals() {
    let d = scratch("create");
    let img = d.join("p.img");
    let s = |p: &Path| p.display().to_string();
    let o = memveil(&["disk", "create", &s(&img), "--size", "1M", "--plain"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("cipher = plain"), "{}", text(&o));
    assert_eq!(std::fs::metadata(&img).expect("image").len(), 1 << 20);
    let o = memveil(&["disk", "info", &s(&img)]);
    assert!(
        o.status.success() && text(&o).contains("size = 1048576"),
        "{}",
        text(&o)
    );
    for (args, says) in [
        (vec!["disk", "create", &s(&img), "--plain"], "bound already"),
        (
            vec!["disk", "create", &s(&d.join("q.img")), "--size", "1M"],
            "--key NAME",
        ),
        (
            vec![
                "disk",
                "create",
                &s(&d.join("r.img")),
                "--size",
                "1000",
                "--plain",
            ],
            "not a positive multiple",
        ),
        (
            vec![
                "disk",
                "create",
                &s(&d.join("r.img")),
                "--size",
                "1M",
                "--plain",
                "--sector-size",
                "1024",
            ],
            "sector size 1024",
        ),
        (vec!["disk", "info", &s(&d.join("none.img"))], "not bound"),
    ] {
        let o = memveil(&args);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(text(&o).contains(says), "{args:?}: {}", text(&o));
    }
    let _ = std::fs::remove_dir_all(&d);
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `memveil ARGS` and returns it with its first stdout line that
/// starts with `want`.
fn spawn_ready(args: &[&str], want: &str, err: &Path) -> (Killed, String) {
    let mut c = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(err).expect("stderr file"))
        .spawn()
        .expect("spawn memveil");
    let out = c.stdout.take().expect("stdout");
    let line = memveil_testkit::first_line(out, Duration::from_secs(60));
    let c = Killed(c);
    assert!(
        line.starts_with(want),
        "{args:?}: {line:?}\n{}",
        std::fs::read_to_string(err).unwrap_or_default()
    );
    (c, line)
}

#[test]
fn serve_attaches_a_loop_device_and_sigterm_takes_it_down() {
    if memveil_sys::probe::euid() != 0 {
        skip(
            Need::Root,
            "mounting FUSE and attaching a loop device need root",
        );
        return;
    }
    if let Err(e) = memveil_disk::host::check(true) {
        skip(Need::HostSetting("FUSE or loop devices"), e);
        return;
    }
    let d = scratch("serve");
    let s = |p: &Path| p.display().to_string();
    let sock = d.join("vault.sock");
    let (_vault, _) = spawn_ready(
        &[
            "vault",
            "serve",
            "--socket",
            &s(&sock),
            "--allow-level",
            "locked",
        ],
        "memveil-vault ready",
        &d.join("vault.err"),
    );
    let img = d.join("e.img");
    let o = memveil(&[
        "disk",
        "create",
        &s(&img),
        "--size",
        "4M",
        "--vault",
        &s(&sock),
        "--key",
        "cli",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("cryptsetup open --type plain --cipher aes-xts-plain64"));
    let mnt = d.join("m");
    std::fs::create_dir_all(&mnt).expect("mount dir");
    let err = d.join("serve.err");
    let (mut srv, ready) = spawn_ready(
        &[
            "disk",
            "serve",
            &s(&img),
            "--vault",
            &s(&sock),
            "--mount",
            &s(&mnt),
        ],
        "memveil-disk ready",
        &err,
    );
    let field = |k: &str| {
        ready
            .split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{k}=")))
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(field("cipher"), "aes-xts-plain64", "{ready}");
    assert_eq!(field("key"), "cli", "{ready}");
    let dev = PathBuf::from(field("device"));
    // The device is a block device over the served file: bytes written to
    // it read back, and the image holds something else.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&dev)
        .expect("open device");
    let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    f.seek(SeekFrom::Start(8192)).expect("seek");
    f.write_all(&data).expect("write device");
    f.sync_all().expect("fsync device");
    let mut back = vec![0u8; data.len()];
    f.seek(SeekFrom::Start(8192)).expect("seek");
    f.read_exact(&mut back).expect("read device");
    assert_eq!(back, data);
    drop(f);
    let raw = std::fs::read(&img).expect("image");
    assert_ne!(
        &raw[8192..8192 + data.len()],
        &data[..],
        "plaintext on the image"
    );

    memveil_sys::process::send_signal(srv.0.id(), libc::SIGTERM).expect("SIGTERM");
    let t0 = Instant::now();
    let st = loop {
        if let Some(st) = srv.0.try_wait().expect("wait") {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "serve ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let said = std::fs::read_to_string(&err).unwrap_or_default();
    assert!(st.success(), "{st}: {said}");
    assert!(said.contains("loop detached: true"), "{said}");
    assert!(memveil_disk::host::loops_under(&mnt).is_empty(), "{said}");
    let still = memveil_disk::host::mounts()
        .expect("mountinfo")
        .iter()
        .any(|m| m.mount_point == mnt);
    assert!(!still, "FUSE left mounted: {said}");
    let _ = std::fs::remove_dir_all(&d);
}
