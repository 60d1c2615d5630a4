// test.sh: alone (the shield under test: scripts/test.sh runs this file with nothing beside it)
//! Issue 14: the shield's fault-handler thread runs on an ordinary stack
//! (anonymous memory a `/proc/PID/mem` reader or a memory dump can see),
//! and it encrypts and decrypts pages all day. Nothing it leaves there may be
//! an AES key schedule.
//!
//! The test protects 4 MiB behind an 8-page window and has a thread write
//! through it, page after page, so the handler evicts (encrypts) and brings
//! back (decrypts) pages continuously; meanwhile it finds the handler thread
//! (the thread `Shield::new` names memveil-fault; its watchdog, memveil-guard,
//! is scanned the same way), its stack pointer (`/proc/self/task/TID/
//! syscall` while it sleeps in `read(2)`) and the stack mapping around it
//! (`/proc/self/maps`), reads the whole mapping through `/proc/self/mem`
//! again and again and runs the key finder over it. Positive control, same
//! run: an AES-128 schedule written into the deep end of that stack (which
//! the handler never reaches) through `/proc/self/mem` is found, then wiped.
//!
//! The shield's keys are random and in secret memory, so this looks for
//! whole schedules, as `aeskeyfind` does. The finer check (every single round
//! key, every XTS tweak mask and every intermediate AES state of known keys
//! and data, on every path) is memveil-cipher's `tests/stack_hygiene.rs`.
//!
//! Every cipher path this CPU runs is checked: the test runs itself again as
//! a child process per path with `MEMVEIL_CIPHER_PATH` set (the path is
//! chosen once per process). It needs userfaultfd for kernel faults (root):
//! without it, it says why it skips.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memveil_cipher::Path;
use memveil_shield::{Config, Shield, StatsFile, PAGE};

const CHILD: &str = "MEMVEIL_HANDLER_STACK_CHILD";

/// The name of thread `tid` of this process.
fn comm(tid: u32) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn tasks() -> BTreeSet<u32> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The stack pointer of thread `tid` while it sleeps in a system call
/// (`/proc/self/task/TID/syscall`: number, six arguments, sp, pc).
fn sleeping_sp(tid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")).ok()?;
    let f: Vec<&str> = s.split_whitespace().collect();
    if f.len() < 9 {
        return None; // "running": not in a system call right now
    }
    u64::from_str_radix(f[7].trim_start_matches("0x"), 16).ok()
}

/// The mapping of this process containing `addr`.
fn mapping_of(addr: u64) -> Option<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|l| {
        let (a, b) = l.split_whitespace().next()?.split_once('-')?;
        let (a, b) = (
            u64::from_str_radix(a, 16).ok()?,
            u64::from_str_radix(b, 16).ok()?,
        );
        (a..b).contains(&addr).then_some((a, b))
    })
}

fn read_mem(lo: u64, hi: u64) -> Vec<u8> {
    let mut buf = vec![0u8; usize::try_from(hi - lo).unwrap_or(0)];
    let f = File::open("/proc/self/mem").expect("/proc/self/mem");
    f.read_exact_at(&mut buf, lo)
        .expect("read the handler stack");
    buf
}

fn write_mem(at: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/mem")
        .expect("/proc/self/mem for writing");
    f.write_all_at(bytes, at)
        .expect("write into the handler stack");
}

/// The check itself, in a child process whose cipher path is set.
#[test]
#[ignore = "run by handler_stack_holds_no_key_schedule_on_every_path, as a child process per cipher path"]
fn handler_stack_child() {
    if std::env::var_os(CHILD).is_none() {
        println!(
            "SKIP: runs only as the child of handler_stack_holds_no_key_schedule_on_every_path"
        );
        return;
    }
    let want = std::env::var("MEMVEIL_CIPHER_PATH").unwrap_or_default();
    let path = memveil_cipher::path();
    assert_eq!(path.name(), want, "the child runs on the path asked for");

    let before = tasks();
    let shield = match Shield::new(
        &Config {
            window: 8,
            ..Config::default()
        },
        StatsFile::private(),
    ) {
        Ok(s) => s,
        Err(e) => {
            println!("SKIP: shield unavailable here: {e}");
            return;
        }
    };
    // The shield's threads, by name: the fault handler and its watchdog
    // (which encrypts too, when it ages an adaptive window).
    // (Each names itself as it starts: wait for the names.)
    let named = |new: &[(u32, String)]| new.iter().any(|(_, n)| n == "memveil-fault");
    let t0 = Instant::now();
    let mut new: Vec<(u32, String)> = Vec::new();
    while !named(&new) && t0.elapsed() < Duration::from_secs(2) {
        new = tasks().difference(&before).map(|&t| (t, comm(t))).collect();
        std::thread::sleep(Duration::from_millis(5));
    }
    let threads: Vec<u32> = new
        .iter()
        .filter(|(_, n)| n.starts_with("memveil-"))
        .map(|(t, _)| *t)
        .collect();
    let handler = new
        .iter()
        .find(|(_, n)| n == "memveil-fault")
        .map(|(t, _)| *t)
        .unwrap_or_else(|| panic!("no memveil-fault thread among the new ones: {new:?}"));

    let pages = 1024;
    let p = memveil_sys::uffd::map_anonymous_direct(pages * PAGE).expect("mmap");
    // SAFETY: a fresh private mapping of `pages` pages, used only through
    // the shield from here on and never unmapped (the test process ends).
    let buf: &'static mut [u8] = unsafe { std::slice::from_raw_parts_mut(p, pages * PAGE) };
    // SAFETY: `buf` is the mapping just made, used only through the shield.
    unsafe {
        shield.encrypt_mprotect(
            buf.as_mut_ptr(),
            buf.len(),
            libc::PROT_READ | libc::PROT_WRITE,
            1,
        )
    }
    .expect("encrypt_mprotect");

    // Heavy eviction: every page written, over and over, through an 8-page
    // window: each write faults a page in (decrypt) and pushes one out
    // (encrypt).
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let addr = buf.as_mut_ptr() as usize;
    let worker = {
        let (stop, rounds) = (Arc::clone(&stop), Arc::clone(&rounds));
        std::thread::spawn(move || {
            let mut r = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for i in 0..pages {
                    // SAFETY: within the protected mapping; only this thread
                    // writes it.
                    unsafe { ((addr + i * PAGE) as *mut u64).write_volatile(r ^ i as u64) };
                }
                r += 1;
                rounds.store(r, Ordering::Relaxed);
            }
        })
    };

    let mut ranges: Vec<Option<(u64, u64)>> = vec![None; threads.len()];
    let mut scans = 0u32;
    let deadline = Instant::now() + Duration::from_secs(4);
    let mut found = Vec::new();
    while Instant::now() < deadline {
        for (t, r) in threads.iter().zip(ranges.iter_mut()) {
            if r.is_none() {
                *r = sleeping_sp(*t).and_then(mapping_of);
            }
            if let Some((lo, hi)) = *r {
                let img = read_mem(lo, hi);
                found.extend(memveil_keyfind::scan(&img, lo, "shield thread stack", 8));
                if *t == handler {
                    scans += 1;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let range = threads
        .iter()
        .position(|t| *t == handler)
        .and_then(|i| ranges[i]);
    stop.store(true, Ordering::Relaxed);
    worker.join().expect("worker");
    let st = shield.stats();
    let (lo, hi) = range.expect("the handler's stack was located (it sleeps in read(2))");
    println!(
        "path {path}: handler thread {handler}, stack {lo:#x}-{hi:#x} ({} KiB); {scans} scans during {} passes over {pages} pages: {} faults in, {} evictions",
        (hi - lo) / 1024,
        rounds.load(Ordering::Relaxed),
        st.faults_in,
        st.evictions
    );
    assert!(
        scans >= 20 && st.evictions > 10_000,
        "not enough work or scans: {scans}, {st:?}"
    );
    let at: BTreeSet<u64> = found.iter().map(|f| f.address).collect();
    assert!(
        found.is_empty(),
        "key schedules on the shield handler's stack ({path}): {} finds over {scans} scans, at {at:x?} (AES-{} bits)",
        found.len(),
        found.first().map_or(0, |f| f.bits)
    );

    // Positive control: a schedule in the deep end of that stack is found.
    let key: [u8; 16] = std::array::from_fn(|i| u8::try_from(i * 29 + 3).unwrap_or(0));
    let sched = memveil_keyfind::expand(&key).expect("schedule");
    let at = lo + 2 * PAGE as u64;
    write_mem(at, &sched);
    let hits = memveil_keyfind::scan(&read_mem(lo, hi), lo, "handler stack", 8);
    write_mem(at, &vec![0u8; sched.len()]);
    assert!(
        hits.iter().any(|f| f.key == key && f.address == at),
        "positive control: a schedule planted on the handler's stack was not found: {hits:?}"
    );
    println!("positive control: the planted schedule was found at {at:#x}");
    shield
        .unprotect(buf.as_mut_ptr(), buf.len())
        .expect("unprotect");
}

#[test]
fn handler_stack_holds_no_key_schedule_on_every_path() {
    let exe = std::env::current_exe().expect("test binary");
    let mut ran = 0;
    for p in Path::ALL {
        if !p.supported() {
            println!(
                "path {p} NOT RUN: this CPU lacks {}",
                p.missing().join(", ")
            );
            continue;
        }
        let out = Command::new(&exe)
            .args([
                "--exact",
                "handler_stack_child",
                "--include-ignored",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .env("MEMVEIL_CIPHER_PATH", p.name())
            .output()
            .expect("run the child");
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "path {p}: the child failed");
        if text.contains("SKIP:") {
            println!("SKIP: the handler stack could not be checked on path {p} (see above)");
            return;
        }
        assert!(
            text.contains("positive control: the planted schedule was found"),
            "path {p}: the child did not run the check"
        );
        ran += 1;
    }
    assert!(ran > 0, "no path ran");
}
