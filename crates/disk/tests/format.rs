//! Format compatibility (issue 18): the image is dm-crypt's
//! `aes-xts-plain64`. Sectors written through the disk server decrypt with
//! OpenSSL's AES-XTS and the sector number as tweak, and sectors OpenSSL
//! encrypts into the image read back through the server as the plaintext.
//! The tweak is computed here, from dm-crypt's definition, not by the crate.

#![allow(clippy::cast_possible_truncation)] // sizes of a 1 MiB test image

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::time::Duration;

use common::Rng;
use memveil_disk::{CreateOpts, KeySource};
use memveil_vault::proto::KeyKind;
use openssl::symm::{Cipher as Ossl, Crypter, Mode as OsslMode};

#[test]
fn child() {
    common::child_main();
}

/// dm-crypt's plain64 tweak of the sector at byte `offset`.
fn tweak(offset: u64, ss: u64, large: bool) -> [u8; 16] {
    let n = if large { offset / ss } else { offset / 512 };
    let mut t = [0u8; 16];
    t[..8].copy_from_slice(&n.to_le_bytes());
    t
}

fn xts(key: &[u8], mode: OsslMode, tweak: &[u8; 16], data: &[u8]) -> Vec<u8> {
    let c = if key.len() == 64 {
        Ossl::aes_256_xts()
    } else {
        Ossl::aes_128_xts()
    };
    let mut cr = Crypter::new(c, mode, key, Some(tweak)).expect("openssl xts");
    cr.pad(false);
    let mut out = vec![0u8; data.len() + 32];
    let n = cr.update(data, &mut out).expect("update");
    let m = cr.finalize(&mut out[n..]).expect("finalize");
    out.truncate(n + m);
    out
}

/// Applies OpenSSL's XTS sector by sector over a whole image, the tweaks
/// `skew` sectors off (0 for the right ones; 1 for the control).
fn image_xts(key: &[u8], mode: OsslMode, ss: u64, large: bool, data: &[u8], skew: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len());
    for (i, s) in data.chunks(ss as usize).enumerate() {
        let off = (i as u64 + skew) * ss;
        out.extend(xts(key, mode, &tweak(off, ss, large), s));
    }
    out
}

/// Writes `data` through the served file in pieces of odd sizes (whole and
/// partial sectors both), then fsyncs.
fn write_odd(f: &File, data: &[u8], rng: &mut Rng) {
    let mut at = 0usize;
    while at < data.len() {
        let n = ((rng.next() % 20_000) as usize + 1).min(data.len() - at);
        f.write_all_at(&data[at..at + n], at as u64).expect("write");
        at += n;
    }
    f.sync_all().expect("fsync through FUSE");
}

/// One image of `kind`, `ss`-byte sectors (`large`: iv_large_sectors),
/// served with `lanes` vault lanes per worker (2 cuts a request of 128 KiB
/// or more into two ring entries computed in parallel).
fn one_geometry(
    dir: &Path,
    sock: &Path,
    (kind, ss, large): (KeyKind, u32, bool),
    lanes: usize,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let tag = format!("{}-{ss}-{large}-{lanes}", kind);
    let mut key = vec![0u8; kind.key_len()];
    rng.fill(&mut key);
    let keyfile = dir.join(format!("{tag}.key"));
    std::fs::write(&keyfile, &key).expect("key file");
    let image = dir.join(format!("{tag}.img"));
    let size = 1u64 << 20;
    let b = memveil_disk::create(&CreateOpts {
        source: KeySource::Import(keyfile.clone()),
        key_kind: kind,
        sector_size: ss,
        iv_large_sectors: large,
        ..common::image_opts(&image, sock, &format!("k{seed}"), size)
    })
    .expect("create");
    std::fs::remove_file(&keyfile).expect("rm key file");
    assert_eq!(b.key_kind, kind);

    let mount = dir.join(format!("{tag}.mnt"));
    let mut srv = common::try_disk_lanes(&image, &mount, Some(sock), false, lanes)
        .unwrap_or_else(|e| panic!("{e}"));
    let served = File::options()
        .read(true)
        .write(true)
        .open(srv.field("file"))
        .expect("open served file");
    let ssz = u64::from(ss);

    // Through the disk, then OpenSSL over the backing file.
    let mut plain = vec![0u8; size as usize];
    rng.fill(&mut plain);
    write_odd(&served, &plain, &mut rng);
    let on_disk = std::fs::read(&image).expect("read image");
    assert_ne!(
        on_disk[..4096],
        plain[..4096],
        "{tag}: the image is not encrypted"
    );
    let dec = image_xts(&key, OsslMode::Decrypt, ssz, large, &on_disk, 0);
    assert!(
        dec == plain,
        "{tag}: OpenSSL's aes-xts-plain64 does not decrypt what the disk wrote"
    );
    // Control: one sector off in the tweak, and nothing matches.
    let off = image_xts(&key, OsslMode::Decrypt, ssz, large, &on_disk, 1);
    assert_ne!(off[..ss as usize], plain[..ss as usize], "{tag}: control");

    // The reverse: OpenSSL writes the image, the disk reads it.
    let mut q = vec![0u8; size as usize];
    rng.fill(&mut q);
    let enc = image_xts(&key, OsslMode::Encrypt, ssz, large, &q, 0);
    let img = File::options().write(true).open(&image).expect("image");
    img.write_all_at(&enc, 0).expect("write image");
    img.sync_all().expect("sync image");
    let mut back = vec![0u8; size as usize];
    served.read_exact_at(&mut back, 0).expect("read served");
    assert!(
        back == q,
        "{tag}: the disk does not decrypt what OpenSSL wrote"
    );
    // Reads of whole runs (cut across lanes with 2 lanes) and unaligned
    // reads give the same bytes.
    for n in [128usize << 10, 256 << 10, 1 << 20] {
        let at = (rng.next() % (size - n as u64 + 1)) / ssz * ssz;
        let mut part = vec![0u8; n];
        served.read_exact_at(&mut part, at).expect("read run");
        assert!(
            part == q[at as usize..at as usize + n],
            "{tag} run at {at}+{n}"
        );
    }
    for _ in 0..50 {
        let at = rng.next() % size;
        let n = ((rng.next() % 9000) + 1).min(size - at) as usize;
        let mut part = vec![0u8; n];
        served.read_exact_at(&mut part, at).expect("read part");
        assert_eq!(part, q[at as usize..at as usize + n], "{tag} at {at}+{n}");
    }
    drop(served);
    let st = srv
        .term(Duration::from_secs(20))
        .expect("server exits on SIGTERM");
    assert!(st.success(), "{tag}: {st}: {}", srv.stderr());
    assert!(!common::mounted(&mount), "{tag}: FUSE mount left behind");
}

#[test]
fn sectors_written_through_the_disk_decrypt_with_openssl_and_back() {
    if !common::root_or_skip() || !common::devices_or_skip(false) {
        return;
    }
    let dir = common::scratch("format");
    let _v = common::vault(&dir);
    let sock = dir.join("vault.sock");
    one_geometry(&dir, &sock, (KeyKind::Xts128, 512, false), 1, 1);
    one_geometry(&dir, &sock, (KeyKind::Xts128, 512, false), 2, 4);
    one_geometry(&dir, &sock, (KeyKind::Xts256, 4096, false), 2, 2);
    one_geometry(&dir, &sock, (KeyKind::Xts128, 4096, true), 1, 3);
}

#[test]
fn a_recreated_key_of_the_same_name_is_refused() {
    if !common::root_or_skip() || !common::devices_or_skip(false) {
        return;
    }
    let dir = common::scratch("wrongkey");
    let _v = common::vault(&dir);
    let sock = dir.join("vault.sock");
    let image = dir.join("d.img");
    memveil_disk::create(&common::image_opts(&image, &sock, "same", 1 << 20)).expect("create");
    let mount = dir.join("m");
    // Positive control: the bound key serves.
    let mut srv = common::disk(&image, &mount, Some(&sock), false);
    srv.term(Duration::from_secs(20)).expect("stops");
    let mut c = memveil_vault::Client::connect(&sock).expect("connect");
    c.destroy_key("same").expect("destroy");
    c.create_key("same", KeyKind::Xts128, false)
        .expect("create again");
    let e = common::try_disk(&image, &mount, Some(&sock), false)
        .err()
        .expect("a server with the wrong key started");
    assert!(e.contains("check value differs"), "{e}");
    assert!(!common::mounted(&mount));
}
