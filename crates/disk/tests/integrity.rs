//! Issue 32, defects 9 and 10: concurrent writes over one sector end as one
//! order or the other, and a failed write-back of the image reaches the
//! `fsync` that asks for it, whoever's `close()` came first.

mod common;

use std::fs::File;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::Duration;

#[test]
fn child() {
    common::child_main();
}

const SS: usize = 512;

/// Two threads write the FUSE file at once, one a whole sector, the other
/// 100 bytes inside it; the sector must end as one order or the other. The
/// server used to serialise only the partial (read-modify-write) writes, so
/// the whole-sector write could land between the partial write's read and
/// its store, and the store put the sector's old bytes back around its 100.
#[test]
fn a_partial_write_never_reverts_a_concurrent_full_sector_write() {
    if !common::root_or_skip() || !common::devices_or_skip(false) {
        return;
    }
    let dir = common::scratch("race");
    let _v = common::vault(&dir);
    let sock = dir.join("vault.sock");
    let image = dir.join("disk.img");
    memveil_disk::create(&common::image_opts(&image, &sock, "race", 1 << 20)).expect("create");
    let fuse = dir.join("fuse");
    let mut srv = common::disk(&image, &fuse, Some(&sock), false);
    let path = PathBuf::from(srv.field("file"));
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open the served file")
    };
    let (full_f, part_f, check_f) = (open(), open(), open());
    let sector: u64 = 7 * SS as u64;
    let (old, full, part) = ([0x11u8; SS], [0xaau8; SS], [0xbbu8; 100]);
    let mut full_then_part = full;
    full_then_part[200..300].copy_from_slice(&part);
    let rounds = 3000;
    let go = Arc::new(Barrier::new(3));
    let t_full = {
        let go = go.clone();
        std::thread::spawn(move || {
            for _ in 0..rounds {
                go.wait();
                full_f.write_all_at(&full, sector).expect("full write");
                go.wait();
            }
        })
    };
    let t_part = {
        let go = go.clone();
        std::thread::spawn(move || {
            for _ in 0..rounds {
                go.wait();
                part_f
                    .write_all_at(&part, sector + 200)
                    .expect("partial write");
                go.wait();
            }
        })
    };
    let (mut orders, mut mixed) = ([0u32; 2], Vec::new());
    let mut got = [0u8; SS];
    for i in 0..rounds {
        check_f.write_all_at(&old, sector).expect("reset");
        go.wait();
        go.wait();
        check_f.read_exact_at(&mut got, sector).expect("read back");
        if got == full {
            orders[0] += 1;
        } else if got == full_then_part {
            orders[1] += 1;
        } else if mixed.len() < 3 {
            mixed.push((i, got[0], got[200], got[511]));
        } else {
            mixed.push((i, 0, 0, 0));
        }
    }
    t_full.join().expect("full writer");
    t_part.join().expect("partial writer");
    eprintln!(
        "{rounds} rounds: partial then full {}, full then partial {}, mixed {}",
        orders[0],
        orders[1],
        mixed.len()
    );
    assert!(
        mixed.is_empty(),
        "{} of {rounds} rounds ended in neither order (round, byte 0, byte 200, byte 511 \
         of the first): {:?}",
        mixed.len(),
        &mixed[..mixed.len().min(3)]
    );
    let st = srv.term(Duration::from_secs(30)).expect("server stops");
    assert!(st.success(), "{st}: {}", srv.stderr());
}

/// Mounts, loop devices and the like, taken down in reverse on drop.
struct Stack(Vec<Box<dyn FnOnce()>>);

impl Stack {
    fn push(&mut self, f: impl FnOnce() + 'static) {
        self.0.push(Box::new(f));
    }

    /// A tmpfs of `size` mounted at `at`.
    fn tmpfs(&mut self, at: PathBuf, size: &str) -> PathBuf {
        std::fs::create_dir_all(&at).expect("mkdir");
        common::run(
            Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
                .arg(&at),
        );
        let p = at.clone();
        self.push(move || umount(&p));
        at
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        while let Some(f) = self.0.pop() {
            f();
        }
    }
}

fn umount(p: &Path) {
    let _ = Command::new("umount").arg(p).status();
}

/// The image's write-back fails for real: the image lives on ext4 on a
/// loop device over a sparse file on a 24 MiB tmpfs, so ext4 accepts 48 MiB
/// into its page cache and the write-back runs out of space (ENOSPC under
/// the lower loop device, EIO in ext4). Linux tells the image's one open
/// file of it once: the `flush` of an unrelated `close()` of the served
/// file took the error, and the loop device's `fsync` then succeeded over
/// lost writes. Now every handle of the served file open when the error was
/// found hears it at its next sync: the loop device's `fsync` fails, and so
/// does that of a handle opened on the served file before.
///
/// (With the image directly on the small tmpfs there is no write-back:
/// tmpfs refuses the server's `pwrite` at once and the write itself fails.)
#[test]
fn a_writeback_error_reaches_the_loop_devices_fsync_after_another_close_took_it() {
    if !common::root_or_skip()
        || !common::devices_or_skip(true)
        || !common::tool_or_skip("mkfs.ext4", "e2fsprogs")
    {
        return;
    }
    let dir = common::scratch("wberr");
    let mut stack = Stack(Vec::new());
    let small = stack.tmpfs(dir.join("small"), "24m");
    let lower = dir.join("lower");
    std::fs::create_dir_all(&lower).expect("mkdir");
    let backing = small.join("lower.img");
    File::create(&backing)
        .and_then(|f| f.set_len(256 << 20))
        .expect("sparse backing file");
    let ldev = common::run(
        Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&backing),
    )
    .trim()
    .to_owned();
    stack.push({
        let d = ldev.clone();
        move || {
            let _ = Command::new("losetup").args(["-d", &d]).status();
        }
    });
    common::run(Command::new("mkfs.ext4").args(["-q", "-F", "-O", "^has_journal", &ldev]));
    common::run(Command::new("mount").arg(&ldev).arg(&lower));
    stack.push({
        let p = lower.clone();
        move || umount(&p)
    });

    let _v = common::vault(&dir);
    let sock = dir.join("vault.sock");
    let image = lower.join("disk.img");
    memveil_disk::create(&common::image_opts(&image, &sock, "wberr", 64 << 20)).expect("create");
    let mut srv = common::disk(&image, &dir.join("fuse"), Some(&sock), true);
    let served = PathBuf::from(srv.field("file"));
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(srv.field("device"))
        .expect("open the loop device");
    let early = File::open(&served).expect("open the served file");

    // 48 MiB through the device: every write acknowledged (it is in ext4's
    // page cache), more than the tmpfs under ext4 can take.
    let chunk = 1 << 20;
    let mut v = vec![0x5au8; chunk + 4096];
    let at = v.as_ptr().align_offset(4096);
    let buf = &mut v[at..at + chunk];
    for i in 0..48u64 {
        dev.write_all_at(buf, i * chunk as u64)
            .expect("write through the device");
    }
    // Someone opens and closes the served file: the close's flush syncs
    // the image and Linux hands the write-back error to that sync.
    let closed = File::open(&served).and_then(|f| {
        let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
        // The close's result is what the flush said.
        close_reporting(fd)
    });
    eprintln!("close of another handle: {closed:?}");
    let dev_sync = dev.sync_all();
    let early_sync = early.sync_all();
    let again = dev.sync_all();
    let err = srv.stderr();
    drop(dev);
    drop(early);
    let _ = srv.term(Duration::from_secs(30));
    assert!(
        closed.is_err(),
        "the write-back did not fail (no ENOSPC under ext4?): {err}"
    );
    assert!(
        dev_sync.is_err(),
        "fsync of the loop device succeeded over lost writes: {err}"
    );
    assert!(
        early_sync.is_err(),
        "fsync of a handle open since before the error succeeded: {err}"
    );
    // Told once, as Linux tells each open file.
    assert!(again.is_ok(), "{again:?}");
    eprintln!("fsync through the device: {dev_sync:?}; older handle: {early_sync:?}");
    drop(srv);
    drop(stack);
}

/// `close(2)` with its result (std's `File` drops it).
fn close_reporting(fd: std::os::fd::RawFd) -> std::io::Result<()> {
    // SAFETY: `fd` came from `into_raw_fd` of a `File` this function's
    // caller owned; nothing else closes or uses it.
    if unsafe { libc::close(fd) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The first idea, the image itself on a small tmpfs: there is no
/// write-back under the server (tmpfs refuses the `pwrite` at once), so the
/// server's reply carries the error: a write through the served file fails
/// itself, and buffered writes through the loop device fail the device's
/// `fsync` (the kernel's write-back of the device gets the write's error).
/// This held before the handle-tracking of write-back errors too; the test
/// above needs ext4 under the image for a write-back that can fail.
#[test]
fn the_image_on_a_full_tmpfs_fails_the_write_or_the_devices_fsync() {
    if !common::root_or_skip() || !common::devices_or_skip(true) {
        return;
    }
    let dir = common::scratch("tmpfsfull");
    let mut stack = Stack(Vec::new());
    let small = stack.tmpfs(dir.join("small"), "8m");
    let _v = common::vault(&dir);
    let sock = dir.join("vault.sock");
    let image = small.join("disk.img");
    memveil_disk::create(&common::image_opts(&image, &sock, "full", 32 << 20)).expect("create");
    let mut srv = common::disk(&image, &dir.join("fuse"), Some(&sock), true);
    let chunk = vec![0x5au8; 1 << 20];
    let served = std::fs::OpenOptions::new()
        .write(true)
        .open(srv.field("file"))
        .expect("open the served file");
    let direct = (0..32u64).try_for_each(|i| served.write_all_at(&chunk, i << 20));
    assert!(direct.is_err(), "32 MiB written onto an 8 MiB tmpfs");
    let dev = std::fs::OpenOptions::new()
        .write(true)
        .open(srv.field("device"))
        .expect("open the loop device");
    let buffered = (0..32u64).try_for_each(|i| dev.write_all_at(&chunk, i << 20));
    let synced = dev.sync_all();
    eprintln!("served file: {direct:?}; device: write {buffered:?}, fsync {synced:?}");
    assert!(
        buffered.is_err() || synced.is_err(),
        "the device took 32 MiB onto an 8 MiB tmpfs and its fsync succeeded"
    );
    drop((served, dev));
    let _ = srv.term(Duration::from_secs(30));
    drop(srv);
    drop(stack);
}
