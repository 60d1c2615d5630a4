//! The device in use (issue 18): `mkfs.ext4` on the loop device, mount,
//! write a tree of files, unmount, stop the server, start it again, remount,
//! compare. SIGTERM with the filesystem still mounted takes everything down
//! (the filesystem, the loop device, the FUSE mount).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::Rng;

#[test]
fn child() {
    common::child_main();
}

/// Writes a tree of files of random sizes and contents; their contents.
fn write_tree(root: &Path, rng: &mut Rng) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    for d in 0..6 {
        let dir = root.join(format!("d{d}")).join(format!("sub{}", d % 3));
        std::fs::create_dir_all(&dir).expect("mkdir");
        for f in 0..12 {
            let len = match rng.next() % 4 {
                0 => (rng.next() % 100) as usize,
                1 => (rng.next() % 5000) as usize,
                2 => (rng.next() % 200_000) as usize,
                _ => (rng.next() % (2 << 20)) as usize,
            };
            let mut data = vec![0u8; len];
            rng.fill(&mut data);
            let p = dir.join(format!("f{f}.bin"));
            std::fs::write(&p, &data).expect("write file");
            files.insert(p.strip_prefix(root).expect("under root").to_owned(), data);
        }
    }
    files
}

fn compare_tree(root: &Path, files: &BTreeMap<PathBuf, Vec<u8>>) {
    for (p, want) in files {
        let got = std::fs::read(root.join(p)).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(got == *want, "{} differs after remount", p.display());
    }
}

#[test]
fn mkfs_mount_write_tree_remount_compare_and_sigterm_cleans_up() {
    if !common::root_or_skip()
        || !common::devices_or_skip(true)
        || !common::tool_or_skip("mkfs.ext4", "e2fsprogs")
    {
        return;
    }
    let dir = common::scratch("fs");
    let _v = common::vault(&dir);
    let sock = dir.join("vault.sock");
    let image = dir.join("disk.img");
    memveil_disk::create(&common::image_opts(&image, &sock, "fs", 64 << 20)).expect("create");
    let fuse = dir.join("fuse");
    let mnt = dir.join("ext4");
    std::fs::create_dir_all(&mnt).expect("mkdir");

    let mut srv = common::disk(&image, &fuse, Some(&sock), true);
    let dev = srv.field("device");
    assert!(dev.starts_with("/dev/loop"), "{}", srv.ready);
    common::run(Command::new("mkfs.ext4").args(["-q", "-F", &dev]));
    common::run(Command::new("mount").arg(&dev).arg(&mnt));
    let mut rng = Rng(18);
    let files = write_tree(&mnt, &mut rng);
    let total: usize = files.values().map(Vec::len).sum();
    assert!(total > 8 << 20, "tree of {total} bytes");
    common::run(Command::new("umount").arg(&mnt));
    let st = srv.term(Duration::from_secs(30)).expect("server stops");
    assert!(st.success(), "{st}: {}", srv.stderr());
    assert_eq!(common::loops_under(&fuse), 0, "loop device left behind");
    assert!(!common::mounted(&fuse), "FUSE mount left behind");
    // The plaintext is not on the backing file (a 4 KiB piece of a file).
    let img = std::fs::read(&image).expect("image");
    let probe = files.values().find(|d| d.len() > 8192).expect("a big file");
    assert!(
        !img.windows(64).any(|w| w == &probe[4096..4160]),
        "plaintext found in the image"
    );

    // A new server, the same image: remount and compare.
    let mut srv = common::disk(&image, &fuse, Some(&sock), true);
    let dev = srv.field("device");
    common::run(Command::new("mount").arg(&dev).arg(&mnt));
    compare_tree(&mnt, &files);

    // SIGTERM with the filesystem mounted: the server unmounts it first.
    let st = srv.term(Duration::from_secs(30)).expect("server stops");
    let err = srv.stderr();
    assert!(st.success(), "{st}: {err}");
    assert!(!common::mounted(&mnt), "ext4 left mounted: {err}");
    assert!(!common::mounted(&fuse), "FUSE left mounted: {err}");
    assert_eq!(common::loops_under(&fuse), 0, "loop device left: {err}");
    // fsck agrees the filesystem was left clean.
    let o = Command::new("e2fsck")
        .args(["-f", "-n"])
        .arg(&image)
        .output()
        .expect("e2fsck");
    // The image is ciphertext; e2fsck of it must fail (it is no ext4 as is).
    assert!(!o.status.success(), "the backing file reads as ext4");
    let mut srv = common::disk(&image, &fuse, Some(&sock), true);
    let o = Command::new("e2fsck")
        .args(["-f", "-n"])
        .arg(srv.field("device"))
        .output()
        .expect("e2fsck");
    assert!(
        o.status.success(),
        "e2fsck after SIGTERM: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    srv.term(Duration::from_secs(30));
}
