//! Proof of protection (issue 18): with fio running over ext4 on the
//! device, `gcore` dumps of the disk server and of the vault hold no AES key
//! schedule and not the key's bytes, by `memveil keyfind`'s scanner and by
//! Debian's `aeskeyfind`. Positive control, in the same test: `gocryptfs`
//! under the same fio job, mounted with a master key chosen here; the same
//! two scans of its dump find its content key and its file name key, both
//! derived from that master key by gocryptfs's HKDF-SHA256, which the test
//! computes itself.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memveil_disk::{CreateOpts, KeySource};
use memveil_keyfind::{contains, read_core, scan_image};
use memveil_testkit::{skip, Need};
use openssl::hash::MessageDigest;
use openssl::pkey::PKey;
use openssl::sign::Signer;

#[test]
fn child() {
    common::child_main();
}

/// What the scans found in one dump.
struct Scan {
    /// Keys `memveil_keyfind` found (hex).
    keyfind: Vec<String>,
    /// Keys `aeskeyfind` printed (hex).
    aeskeyfind: Vec<String>,
    /// Whether one of the `needles` occurs as bytes.
    raw: bool,
}

/// `gcore`s `pid` into `dir` and scans the dump; `None` when gcore is
/// missing (the skip is said).
fn dump_and_scan(pid: u32, dir: &Path, tag: &str, needles: &[&[u8]]) -> Option<Scan> {
    let base = dir.join(format!("core-{tag}"));
    let o = match Command::new("gcore")
        .arg("-o")
        .arg(&base)
        .arg(pid.to_string())
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            skip(Need::Installed("gdb"), format!("gcore not runnable: {e}"));
            return None;
        }
    };
    let path = PathBuf::from(format!("{}.{pid}", base.display()));
    assert!(
        o.status.success() && path.exists(),
        "gcore of {tag}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let t0 = Instant::now();
    let size = std::fs::metadata(&path).map_or(0, |m| m.len());
    // aeskeyfind runs beside memveil's scan (two CPUs).
    let a = Command::new("aeskeyfind")
        .arg("-q")
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("aeskeyfind");
    let img = read_core(&path).expect("parse core");
    let keyfind = scan_image(&img, 8)
        .iter()
        .map(|f| hex::encode(&f.key))
        .collect();
    let raw = needles.iter().any(|n| contains(&img, n));
    drop(img);
    let a = a.wait_with_output().expect("aeskeyfind");
    let _ = std::fs::remove_file(&path);
    eprintln!("{tag}: core of {size} bytes, scanned in {:?}", t0.elapsed());
    let aeskeyfind = String::from_utf8_lossy(&a.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_owned)
        .collect();
    Some(Scan {
        keyfind,
        aeskeyfind,
        raw,
    })
}

/// A program killed and reaped on drop: on a failed assertion or an early
/// return too (fio runs for minutes otherwise, holding the mount).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// gocryptfs serving `mnt`: unmounted, then (its `Proc` dropped) killed.
struct Gocryptfs {
    proc: Proc,
    mnt: PathBuf,
}

impl Drop for Gocryptfs {
    fn drop(&mut self) {
        let _ = memveil_sys::mount::unmount(&self.mnt, false);
    }
}

/// fio's load: the same job on the disk and on gocryptfs.
fn load(dir: &Path) -> Proc {
    Proc(
        Command::new("fio")
            .current_dir(dir)
            .args([
                "--name=load",
                "--rw=randrw",
                "--bs=64k",
                "--size=16M",
                "--direct=1",
                "--ioengine=psync",
                "--time_based",
                "--runtime=120",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("fio"),
    )
}

/// Waits until fio has started its I/O (its file exists at full size).
fn wait_loaded(dir: &Path, fio: &mut Child) {
    let t0 = Instant::now();
    loop {
        assert!(fio.try_wait().expect("fio").is_none(), "fio ended early");
        if std::fs::metadata(dir.join("load.0.0")).is_ok_and(|m| m.len() == 16 << 20) {
            std::thread::sleep(Duration::from_millis(500));
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "fio never started");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// HKDF-SHA256 with no salt, 32 bytes (gocryptfs's `hkdfDerive`).
fn hkdf(key: &[u8], info: &[u8]) -> Vec<u8> {
    let hmac = |k: &[u8], parts: &[&[u8]]| {
        let k = PKey::hmac(k).expect("hmac key");
        let mut s = Signer::new(MessageDigest::sha256(), &k).expect("hmac");
        for p in parts {
            s.update(p).expect("hmac");
        }
        s.sign_to_vec().expect("hmac")
    };
    let prk = hmac(&[0u8; 32], &[key]);
    hmac(&prk, &[info, &[1u8]])
}

#[test]
fn key_is_not_in_dumps_of_the_disk_server_or_vault_but_gocryptfs_key_is_found() {
    if !common::root_or_skip()
        || !common::devices_or_skip(true)
        || !common::tool_or_skip("mkfs.ext4", "e2fsprogs")
        || !common::tool_or_skip("fio", "fio")
        || !common::tool_or_skip("gdb", "gdb")
        || !common::tool_or_skip("gocryptfs", "gocryptfs")
    {
        return;
    }
    if Command::new("aeskeyfind").arg("-h").output().is_err() {
        skip(Need::Installed("aeskeyfind"), "aeskeyfind not runnable");
        return;
    }
    let dir = common::scratch("proof");
    let v = common::vault(&dir);
    if v.field("level") != "secret" {
        skip(
            Need::MemfdSecret,
            format!(
                "the vault runs at level {} (its keys are readable by root without memfd_secret)",
                v.field("level")
            ),
        );
        return;
    }
    let sock = dir.join("vault.sock");
    let mut key = [0u8; 32];
    memveil_sys::getrandom(&mut key).expect("random");
    let keyfile = dir.join("key");
    std::fs::write(&keyfile, key).expect("key file");
    let image = dir.join("disk.img");
    memveil_disk::create(&CreateOpts {
        source: KeySource::Import(keyfile.clone()),
        ..common::image_opts(&image, &sock, "proof", 128 << 20)
    })
    .expect("create");
    std::fs::remove_file(&keyfile).expect("rm key");
    let needles: [&[u8]; 2] = [&key[..16], &key[16..]];

    let fuse = dir.join("fuse");
    let mnt = dir.join("ext4");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let srv = common::disk(&image, &fuse, Some(&sock), true);
    let dev = srv.field("device");
    common::run(Command::new("mkfs.ext4").args(["-q", "-F", &dev]));
    common::run(Command::new("mount").arg(&dev).arg(&mnt));
    let mut fio = load(&mnt);
    wait_loaded(&mnt, &mut fio.0);
    let Some(disk) = dump_and_scan(srv.pid(), &dir, "disk", &needles) else {
        return;
    };
    let Some(vault) = dump_and_scan(v.pid(), &dir, "vault", &needles) else {
        return;
    };
    assert!(
        fio.0.try_wait().expect("fio").is_none(),
        "fio ended before the dumps were taken"
    );
    drop(fio);
    for (who, s) in [("disk server", &disk), ("vault", &vault)] {
        assert!(
            s.keyfind.is_empty(),
            "keyfind found keys in the {who}: {:?}",
            s.keyfind
        );
        assert!(
            s.aeskeyfind.is_empty(),
            "aeskeyfind found keys in the {who}: {:?}",
            s.aeskeyfind
        );
        assert!(!s.raw, "the key's bytes are in the {who}'s dump");
    }

    // The positive control: gocryptfs, same load, same scans.
    let cipher_dir = dir.join("gocryptfs.cipher");
    let plain_dir = dir.join("gocryptfs.plain");
    std::fs::create_dir_all(&cipher_dir).expect("mkdir");
    std::fs::create_dir_all(&plain_dir).expect("mkdir");
    common::run(
        Command::new("gocryptfs")
            .args(["-init", "-q", "-extpass", "echo pw", "-scryptn", "10"])
            .arg(&cipher_dir),
    );
    let mut master = [0u8; 32];
    memveil_sys::getrandom(&mut master).expect("random");
    let g = Command::new("gocryptfs")
        .args(["-fg", "-q"])
        .arg(format!("-masterkey={}", hex::encode(master)))
        .arg(&cipher_dir)
        .arg(&plain_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("gocryptfs");
    let mut g = Gocryptfs {
        proc: Proc(g),
        mnt: plain_dir.clone(),
    };
    let t0 = Instant::now();
    while !common::mounted(&plain_dir) {
        assert!(
            g.proc.0.try_wait().expect("gocryptfs").is_none(),
            "gocryptfs exited"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "gocryptfs never mounted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut fio = load(&plain_dir);
    wait_loaded(&plain_dir, &mut fio.0);
    let content = hkdf(&master, b"AES-GCM file content encryption");
    let names = hkdf(&master, b"EME filename encryption");
    let got = dump_and_scan(g.proc.0.id(), &dir, "gocryptfs", &[&content]);
    drop(fio);
    drop(g);
    let Some(got) = got else { return };
    for (what, k) in [("content key", &content), ("file name key", &names)] {
        let k = hex::encode(k);
        assert!(
            got.keyfind.contains(&k),
            "control: keyfind missed gocryptfs's {what}: {:?}",
            got.keyfind
        );
        assert!(
            got.aeskeyfind.contains(&k),
            "control: aeskeyfind missed gocryptfs's {what}: {:?}",
            got.aeskeyfind
        );
    }
    assert!(
        got.raw,
        "control: the content key's bytes are not in gocryptfs's dump"
    );
}
