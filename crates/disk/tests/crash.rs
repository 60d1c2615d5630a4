//! Crash behaviour (issues 18 and 32): writers in this test write a file on
//! ext4 on the device, the server is killed with SIGKILL under them, a new
//! server starts (cleaning up the dead one's loop device and mounts), the
//! filesystem is mounted again, and every write a writer saw completed is
//! checked.
//!
//! What "completed" promises (docs/disk.md, "Crash behaviour"): the server
//! `pwrite`s a write to the image before it answers, so a write the
//! device acknowledged survives the server's death (not the host's: that
//! takes an `fsync`). The writers therefore use `O_DIRECT` writes (the
//! device's acknowledgement is the write's return) and no `fsync`.
//!
//! Why not fio (the first version): run time-based with its default
//! `randrepeat`, fio writes the same bytes to the same offsets every pass,
//! so after the first pass a lost write is invisible; and fio before 3.41
//! verifies writes that never completed at iodepth > 1. Here every write is
//! unique: each 512-byte sector carries a header (block, write number,
//! sector) and a checksum over it and its pseudo-random payload, and each
//! writer keeps, per block, the last write it saw complete and the one in
//! flight. After the restart every sector of the file must hold its last
//! completed write, or (the write in flight at the kill) that write's
//! sector.
//!
//! The file is laid out (write number 0) and synced before the crash run:
//! the writes are `O_DIRECT` overwrites, which need no metadata to be
//! durable; a file created during the run would not survive a crash on any
//! device until the journal commits it. ext4 is made without lazy
//! initialisation and mounted `lazytime`, so while the writers run the
//! only writes the server receives are theirs (which lets the test switch
//! below pick one of them by number).
//!
//! `MEMVEIL_CRASH_KILLS=N` (stress mode, not CI) kills the server N times
//! in a row, each after a random time, checking everything after each kill.

mod common;

use std::fs::File;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Proc, Rng, Scratch};

#[test]
fn child() {
    common::child_main();
}

const SECTOR: usize = 512;
const BLOCK: usize = 4096;
const PER_BLOCK: usize = BLOCK / SECTOR;
const FILE_BYTES: u64 = 48 << 20;
const BLOCKS: u64 = FILE_BYTES / BLOCK as u64;
const WRITERS: u64 = 4;
const MAGIC: &[u8; 8] = b"MVCRASH1";
const FILE: &str = "crash.dat";

/// FNV-1a, the sectors' checksum.
fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &c| {
        (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Sector `idx` of block `block` as write `seq` writes it (0: the layout).
fn fill_sector(block: u64, seq: u64, idx: u64, out: &mut [u8]) {
    out[..8].copy_from_slice(MAGIC);
    out[8..16].copy_from_slice(&block.to_le_bytes());
    out[16..24].copy_from_slice(&seq.to_le_bytes());
    out[24..32].copy_from_slice(&idx.to_le_bytes());
    Rng(block.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seq.rotate_left(32) ^ idx)
        .fill(&mut out[32..SECTOR - 8]);
    let sum = checksum(&out[..SECTOR - 8]);
    out[SECTOR - 8..SECTOR].copy_from_slice(&sum.to_le_bytes());
}

fn fill_block(block: u64, seq: u64, out: &mut [u8]) {
    for (i, s) in out.chunks_mut(SECTOR).enumerate() {
        fill_sector(block, seq, i as u64, s);
    }
}

/// What a sector read back holds, in words.
fn describe(s: &[u8]) -> String {
    let word = |r: std::ops::Range<usize>| u64::from_le_bytes(s[r].try_into().expect("8 bytes"));
    if &s[..8] != MAGIC {
        return "no sector of this test (garbage or zeros)".into();
    }
    if checksum(&s[..SECTOR - 8]) != word(SECTOR - 8..SECTOR) {
        return format!(
            "a torn sector (header of block {} write {})",
            word(8..16),
            word(16..24)
        );
    }
    format!(
        "sector {} of block {} as write {}",
        word(24..32),
        word(8..16),
        word(16..24)
    )
}

/// A buffer aligned for `O_DIRECT`.
struct Aligned {
    v: Vec<u8>,
    at: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Self {
        let v = vec![0u8; len + 4096];
        let at = v.as_ptr().align_offset(4096);
        assert!(at < 4096);
        Self { v, at, len }
    }
    fn buf(&mut self) -> &mut [u8] {
        &mut self.v[self.at..self.at + self.len]
    }
}

/// The expected state of the file: per sector, the write it must hold.
struct Expect {
    sector: Vec<u64>,
    /// Write numbers handed out so far.
    next: u64,
}

/// What one writer did: the writes it saw complete, and the one it had
/// issued when its writes began to fail.
#[derive(Default)]
struct Done {
    acked: Vec<(u64, u64)>,
    in_flight: Option<(u64, u64)>,
    error: Option<std::io::Error>,
}

/// One writer: its own blocks (those `b % WRITERS == id`) in a random
/// order per pass, `O_DIRECT`, each write with a number of its own, until
/// a write fails or `stop` is raised.
fn writer(
    path: &Path,
    id: u64,
    first_seq: u64,
    seed: u64,
    acked: &AtomicU64,
    stop: &AtomicBool,
) -> Done {
    let mut done = Done::default();
    let f = match std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => f,
        Err(e) => {
            done.error = Some(e);
            return done;
        }
    };
    let mut rng = Rng(seed ^ id);
    let mut mine: Vec<u64> = (0..BLOCKS).filter(|b| b % WRITERS == id).collect();
    let mut buf = Aligned::new(BLOCK);
    let mut seq = first_seq + id;
    loop {
        for i in (1..mine.len()).rev() {
            let j = usize::try_from(rng.next() % (i as u64 + 1)).expect("index");
            mine.swap(i, j);
        }
        for &b in &mine {
            if stop.load(Ordering::Relaxed) {
                return done;
            }
            fill_block(b, seq, buf.buf());
            done.in_flight = Some((b, seq));
            if let Err(e) = f.write_all_at(buf.buf(), b * BLOCK as u64) {
                done.error = Some(e);
                return done;
            }
            done.in_flight = None;
            done.acked.push((b, seq));
            acked.fetch_add(1, Ordering::Relaxed);
            seq += WRITERS;
        }
    }
}

/// A sector that does not hold what it must.
#[derive(Debug)]
struct Lost {
    block: u64,
    sector: usize,
    want: u64,
    found: String,
}

/// Reads the whole file back (`O_DIRECT`) and checks every sector against
/// `e` (or the write in flight over it); updates `e` to what was found.
fn check(path: &Path, e: &mut Expect, in_flight: &[(u64, u64)]) -> Vec<Lost> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open for the check");
    let chunk = 1 << 20;
    let mut buf = Aligned::new(chunk);
    let mut want = vec![0u8; SECTOR];
    let mut lost = Vec::new();
    for at in (0..FILE_BYTES).step_by(chunk) {
        f.read_exact_at(buf.buf(), at).expect("read back");
        for (i, s) in buf.buf().chunks(SECTOR).enumerate() {
            let n = usize::try_from(at).expect("offset") / SECTOR + i;
            let block = (n / PER_BLOCK) as u64;
            let idx = (n % PER_BLOCK) as u64;
            fill_sector(block, e.sector[n], idx, &mut want);
            if s == want.as_slice() {
                continue;
            }
            let flying = in_flight.iter().find(|(b, _)| *b == block).map(|f| f.1);
            if let Some(seq) = flying {
                fill_sector(block, seq, idx, &mut want);
                if s == want.as_slice() {
                    e.sector[n] = seq;
                    continue;
                }
            }
            lost.push(Lost {
                block,
                sector: n % PER_BLOCK,
                want: e.sector[n],
                found: describe(s),
            });
        }
    }
    lost
}

/// The vault, the image, ext4 on the device and the laid-out file.
struct Rig {
    srv: Proc,
    _vault: Proc,
    image: PathBuf,
    fuse: PathBuf,
    mnt: PathBuf,
    sock: PathBuf,
    // Last: dropped after the servers.
    _dir: Scratch,
}

impl Rig {
    fn file(&self) -> PathBuf {
        self.mnt.join(FILE)
    }

    /// The layout's server stopped, a new one with `env` serving.
    fn stop_and_restart(&mut self, env: &[(&str, String)]) {
        self.srv
            .term(Duration::from_secs(30))
            .expect("server stops");
        self.restart(env);
    }

    /// A new server (cleaning up after a dead one), ext4 mounted.
    fn restart(&mut self, env: &[(&str, String)]) {
        self.srv = common::try_disk_env(&self.image, &self.fuse, Some(&self.sock), true, 1, env)
            .unwrap_or_else(|e| panic!("{e}"));
        common::run(
            Command::new("mount")
                .args(["-o", "noatime,lazytime"])
                .arg(self.srv.field("device"))
                .arg(&self.mnt),
        );
    }
}

fn rig_or_skip(tag: &str) -> Option<(Rig, Expect)> {
    if !common::root_or_skip()
        || !common::devices_or_skip(true)
        || !common::tool_or_skip("mkfs.ext4", "e2fsprogs")
    {
        return None;
    }
    let dir = common::scratch(tag);
    let vault = common::vault(&dir);
    let sock = dir.join("vault.sock");
    let image = dir.join("disk.img");
    memveil_disk::create(&common::image_opts(&image, &sock, "crash", 128 << 20)).expect("create");
    let fuse = dir.join("fuse");
    let mnt = dir.join("ext4");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let srv = common::disk(&image, &fuse, Some(&sock), true);
    let dev = srv.field("device");
    common::run(Command::new("mkfs.ext4").args([
        "-q",
        "-F",
        "-b",
        "4096",
        "-E",
        "lazy_itable_init=0,lazy_journal_init=0",
        &dev,
    ]));
    common::run(Command::new("mount").arg(&dev).arg(&mnt));
    let rig = Rig {
        srv,
        _vault: vault,
        image,
        fuse,
        mnt,
        sock,
        _dir: dir,
    };
    let mut all = vec![0u8; usize::try_from(FILE_BYTES).expect("size")];
    for (b, blk) in all.chunks_mut(BLOCK).enumerate() {
        fill_block(b as u64, 0, blk);
    }
    let f = File::create(rig.file()).expect("create");
    std::io::Write::write_all(&mut &f, &all).expect("lay out");
    f.sync_all().expect("fsync");
    drop(f);
    common::run(Command::new("sync").arg("-f").arg(&rig.mnt));
    let e = Expect {
        sector: vec![0; usize::try_from(FILE_BYTES).expect("size") / SECTOR],
        next: 1,
    };
    Some((rig, e))
}

/// When to kill the server.
enum KillAt {
    After(Duration),
    Acked(u64),
}

/// One crash: writers run, the server is killed, a new one (with `env`)
/// starts, ext4 is mounted again and every sector is checked. The lost
/// sectors, and how many writes completed before the kill.
fn crash_round(rig: &mut Rig, e: &mut Expect, kill: &KillAt, seed: u64) -> (Vec<Lost>, u64) {
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let first = e.next;
    let workers: Vec<_> = (0..WRITERS)
        .map(|id| {
            let (path, acked, stop) = (rig.file(), acked.clone(), stop.clone());
            std::thread::spawn(move || writer(&path, id, first, seed, &acked, &stop))
        })
        .collect();
    let t0 = Instant::now();
    loop {
        let enough = match kill {
            KillAt::After(d) => t0.elapsed() >= *d,
            KillAt::Acked(n) => acked.load(Ordering::Relaxed) >= *n,
        };
        if enough || workers.iter().any(std::thread::JoinHandle::is_finished) {
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            stop.store(true, Ordering::SeqCst);
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let early = workers.iter().any(std::thread::JoinHandle::is_finished);
    rig.srv.kill();
    let t1 = Instant::now();
    while !workers.iter().all(std::thread::JoinHandle::is_finished) {
        if t1.elapsed() > Duration::from_secs(60) {
            // The writers would block the test's end: say so.
            panic!("writers still running a minute after the server died");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let done: Vec<Done> = workers
        .into_iter()
        .map(|w| w.join().expect("writer"))
        .collect();
    assert!(
        !early && !stop.load(Ordering::SeqCst),
        "a writer stopped before the kill: {:?}",
        done.iter().map(|d| d.error.as_ref()).collect::<Vec<_>>()
    );
    for d in &done {
        assert!(d.error.is_some(), "a writer saw no failure after the kill");
    }
    let mut count = 0;
    let mut in_flight = Vec::new();
    for d in &done {
        for &(b, seq) in &d.acked {
            let s0 = usize::try_from(b).expect("block") * PER_BLOCK;
            e.sector[s0..s0 + PER_BLOCK].fill(seq);
            e.next = e.next.max(seq + 1);
        }
        count += d.acked.len() as u64;
        if let Some(f) = d.in_flight {
            e.next = e.next.max(f.1 + 1);
            in_flight.push(f);
        }
    }
    // Write numbers stay unique across rounds.
    e.next += WRITERS;

    rig.restart(&[]);
    let err = rig.srv.stderr();
    assert!(err.contains("left by a dead server"), "{err}");
    assert!(err.contains("dead server's FUSE mount"), "{err}");
    (check(&rig.file(), e, &in_flight), count)
}

/// Where block `block` of `file` lies on its device, from `filefrag -v`'s
/// extents (in the filesystem's blocks, which it names).
fn device_offset(file: &Path, block: u64) -> Option<u64> {
    let out = common::run(Command::new("filefrag").arg("-v").arg(file));
    // "File size of crash.dat is 50331648 (12288 blocks of 4096 bytes)"
    let fs_block: u64 = out
        .split(" blocks of ")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    let want = block * BLOCK as u64 / fs_block;
    for l in out.lines() {
        // "   0:        0..   12287:      34816..     47103:  12288: ..."
        let f: Vec<&str> = l.split(':').map(str::trim).collect();
        if f.len() < 4 || f[0].parse::<u64>().is_err() {
            continue;
        }
        let range = |s: &str| -> Option<(u64, u64)> {
            let (a, b) = s.split_once("..")?;
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        };
        let ((l0, l1), (p0, _)) = (range(f[1])?, range(f[2])?);
        if (l0..=l1).contains(&want) {
            return Some((p0 + want - l0) * fs_block);
        }
    }
    None
}

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_secs() ^ u64::from(d.subsec_nanos()))
}

fn finish(mut rig: Rig) {
    let st = rig.srv.term(Duration::from_secs(30)).expect("server stops");
    assert!(st.success(), "{st}: {}", rig.srv.stderr());
    assert!(!common::mounted(&rig.mnt) && !common::mounted(&rig.fuse));
    drop(rig);
}

#[test]
fn sigkill_of_the_server_under_writers_loses_no_acknowledged_write() {
    let Some((mut rig, mut e)) = rig_or_skip("crash") else {
        return;
    };
    // The writing server starts as the switch test's does.
    rig.stop_and_restart(&[]);
    let kills: u32 = std::env::var("MEMVEIL_CRASH_KILLS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    let seed = seed();
    let mut rng = Rng(seed);
    let t0 = Instant::now();
    let mut failed = Vec::new();
    let mut total = 0;
    for k in 0..kills {
        let at = if kills == 1 {
            Duration::from_secs(3)
        } else {
            Duration::from_millis(200 + rng.next() % 2800)
        };
        let (lost, n) = crash_round(&mut rig, &mut e, &KillAt::After(at), seed ^ u64::from(k));
        total += n;
        eprintln!(
            "kill {}/{kills} after {at:?}: {n} writes completed, {} sectors lost",
            k + 1,
            lost.len()
        );
        if kills == 1 {
            assert!(n > 1000, "only {n} writes completed before the kill");
        }
        if !lost.is_empty() {
            failed.push((k + 1, lost));
        }
    }
    eprintln!(
        "{kills} kills, {total} writes completed, every sector checked after each kill; {} kills lost writes; {:?} (seed {seed})",
        failed.len(),
        t0.elapsed()
    );
    assert!(
        failed.is_empty(),
        "acknowledged writes lost (seed {seed}): {:?}",
        failed
            .iter()
            .map(|(k, l)| (k, l.len(), l.iter().take(4).collect::<Vec<_>>()))
            .collect::<Vec<_>>()
    );
    finish(rig);
}

/// The positive control of the test above: a server that acknowledges one
/// write and drops it (the test-only switch) must be caught.
#[test]
fn the_crash_check_finds_an_acknowledged_write_the_server_dropped() {
    let Some((mut rig, mut e)) = rig_or_skip("crash-drop") else {
        return;
    };
    // Write 300 of this server: ext4's mount writes a few blocks, then only
    // the writers write. Killed well within their first pass, no block is
    // written twice, so nothing can overwrite the dropped write.
    rig.stop_and_restart(&[(common::DROP_WRITE, "300".into())]);
    let dropper = rig.srv.errlog.clone();
    let (lost, n) = crash_round(&mut rig, &mut e, &KillAt::Acked(2000), seed());
    let said = std::fs::read_to_string(&dropper).unwrap_or_default();
    let line = said
        .lines()
        .find(|l| l.contains("TEST SWITCH"))
        .unwrap_or_else(|| panic!("the server dropped no write: {said}"));
    assert!(line.contains("(4096 bytes)"), "{line}");
    assert!(
        n < BLOCKS / 2,
        "{n} writes: some block may be written twice"
    );
    // Exactly one block is lost, whole: it still holds the layout.
    let blocks: std::collections::BTreeSet<u64> = lost.iter().map(|l| l.block).collect();
    assert_eq!(
        blocks.len(),
        1,
        "want the dropped write ({line}) found as one lost block, got {lost:?}"
    );
    let sectors: std::collections::BTreeSet<usize> = lost.iter().map(|l| l.sector).collect();
    assert_eq!(sectors.len(), PER_BLOCK, "{lost:?}");
    assert!(
        lost.iter()
            .all(|l| l.want > 0 && l.found.ends_with("as write 0")),
        "{lost:?}"
    );
    // And it is the block the server dropped: the write's byte offset on
    // the device is where ext4 keeps that block of the file.
    let at: u64 = line
        .split("at byte ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no offset in {line}"));
    assert_eq!(
        Some(at),
        device_offset(&rig.file(), lost[0].block),
        "the lost block is not the dropped write ({line})"
    );
    eprintln!("found the dropped write ({line}): {:?}", lost[0]);
    finish(rig);
}
