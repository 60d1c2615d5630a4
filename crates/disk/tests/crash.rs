//! Crash behaviour (issue 18): fio writes with `--verify=crc32c` over ext4
//! on the device, the server is killed with SIGKILL mid-run, a new server
//! starts (cleaning up the dead one's loop device and mounts), the
//! filesystem is mounted again, and `fio --verify_only` with the state fio
//! saved when its writes failed checks every write fio saw completed.
//!
//! The file is laid out and synced before the crash run: fio's writes are
//! `O_DIRECT` overwrites, which need no metadata to be durable; a file
//! created during the run would not survive a crash on any device until the
//! journal commits it (seen here: killed within ext4's 5 s commit interval
//! of the layout, the file was gone).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn child() {
    common::child_main();
}

fn fio(dir: &Path, aux: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new("fio");
    c.current_dir(dir)
        .args([
            "--name=crash",
            "--rw=randwrite",
            "--bs=4k",
            "--size=48M",
            "--direct=1",
            "--ioengine=libaio",
            "--iodepth=8",
            "--fallocate=none",
            "--verify=crc32c",
            "--randseed=18",
        ])
        .arg(format!("--aux-path={}", aux.display()))
        .args(extra);
    c
}

#[test]
fn sigkill_of_the_server_under_fio_loses_no_acknowledged_write() {
    if !common::root_or_skip()
        || !common::devices_or_skip(true)
        || !common::tool_or_skip("mkfs.ext4", "e2fsprogs")
        || !common::tool_or_skip("fio", "fio")
    {
        return;
    }
    let dir = common::scratch("crash");
    let _v = common::vault(&dir);
    let sock = dir.join("vault.sock");
    let image = dir.join("disk.img");
    memveil_disk::create(&common::image_opts(&image, &sock, "crash", 128 << 20)).expect("create");
    let fuse = dir.join("fuse");
    let mnt = dir.join("ext4");
    let aux = dir.join("aux");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    std::fs::create_dir_all(&aux).expect("mkdir");

    let mut srv = common::disk(&image, &fuse, Some(&sock), true);
    let dev = srv.field("device");
    common::run(Command::new("mkfs.ext4").args(["-q", "-F", &dev]));
    common::run(Command::new("mount").arg(&dev).arg(&mnt));
    // fio's own layout would happen inside the crash run, so lay the file
    // out here (fio's name for it) and sync it.
    let f = std::fs::File::create(mnt.join("crash.0.0")).expect("create");
    f.set_len(0).expect("len");
    std::io::Write::write_all(&mut &f, &vec![0x5a; 48 << 20]).expect("lay out");
    f.sync_all().expect("fsync");
    drop(f);
    common::run(Command::new("sync").arg("-f").arg(&mnt));

    // The write phase, killed under it.
    let log = dir.join("fio-write.out");
    let mut w = fio(
        &mnt,
        &aux,
        &[
            "--do_verify=0",
            "--verify_state_save=1",
            "--time_based",
            "--runtime=120",
        ],
    )
    .stdout(std::fs::File::create(&log).expect("log"))
    .stderr(Stdio::null())
    .spawn()
    .expect("fio");
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        w.try_wait().expect("fio").is_none(),
        "fio ended before the kill: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    srv.kill();
    let t0 = Instant::now();
    let st = loop {
        if let Some(st) = w.try_wait().expect("fio") {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "fio still running a minute after the server died"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!st.success(), "fio's writes did not fail: {out}");
    assert!(out.contains("err= 5"), "fio did not see EIO: {out}");
    let state = std::fs::read_dir(&aux)
        .expect("aux")
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with("verify.state"));
    assert!(state, "fio saved no verify state: {out}");

    // A new server cleans up after the dead one; the filesystem mounts again.
    let mut srv = common::disk(&image, &fuse, Some(&sock), true);
    let err = srv.stderr();
    assert!(err.contains("left by a dead server"), "{err}");
    assert!(err.contains("dead server's FUSE mount"), "{err}");
    common::run(Command::new("mount").arg(srv.field("device")).arg(&mnt));
    let v = fio(&mnt, &aux, &["--verify_only", "--verify_state_load=1"])
        .output()
        .expect("fio verify");
    let vo = String::from_utf8_lossy(&v.stdout);
    assert!(
        v.status.success() && vo.contains("err= 0"),
        "verify failed after the crash:\n{vo}{}\nwrite phase:\n{out}",
        String::from_utf8_lossy(&v.stderr)
    );
    // It verified something: fio's read count is the writes it replayed.
    let reads: u64 = vo
        .split("issued rwts: total=")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(reads > 1000, "fio verified only {reads} blocks:\n{vo}");

    let st = srv.term(Duration::from_secs(30)).expect("server stops");
    assert!(st.success(), "{st}: {}", srv.stderr());
    assert!(!common::mounted(&mnt) && !common::mounted(&fuse));
}
