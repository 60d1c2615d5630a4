//! Shared memory: protected, refused, or let through unprotected, as
//! `memveil run --shared-memory` (`MEMVEIL_SHIELD_SHARED`) says.
//!
//! The setting is `MODE[,KIND=MODE...]`: the first word applies to every
//! kind, the rest override one kind (`anonymous`, `memfd`, `sysv`). Modes:
//! - `protected`: shared anonymous memory (`MAP_SHARED|MAP_ANONYMOUS`) is
//!   kept as ciphertext for this process and every process it forks
//!   ([`memveil_shield::SharedShield`]: the creator's handler serves every
//!   view). `memfd_create` mappings and System V segments cannot be (any
//!   process may attach them, outside the userfaultfds of this tree), so
//!   under `protected` they are refused unless a `KIND=unprotected`
//!   override lets them through.
//! - `refuse` (the default): `ENOMEM`, with a message naming the fix.
//! - `unprotected`: plaintext, counted in the statistics and the summary.
//!
//! Shared mappings of other files (`shm_open`'s `/dev/shm`, any file) are
//! file mappings and are not covered either way: docs/shield.md lists them.

use std::ffi::{c_int, c_void};
use std::io::Write as _;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, Ordering};
use std::sync::Mutex;

use memveil_shield::{SharedConfig, SharedShield};

pub use memveil_shield::{parse_shared_policy as parse, SharedKind as Kind, SharedMode as Mode};

/// 0 unread, else 1 + the modes packed two bits a kind.
static POLICY: AtomicU8 = AtomicU8::new(0);
static SAID: [AtomicBool; 4] = [
    AtomicBool::new(false),
    AtomicBool::new(false),
    AtomicBool::new(false),
    AtomicBool::new(false),
];

fn mode(kind: Kind) -> Mode {
    let mut p = POLICY.load(Ordering::Relaxed);
    if p == 0 {
        let modes = crate::env_str(c"MEMVEIL_SHIELD_SHARED")
            .map_or(Ok([Mode::Refuse; 3]), |s| parse(&s))
            .unwrap_or([Mode::Refuse; 3]);
        p = 1 + modes
            .iter()
            .enumerate()
            .map(|(i, m)| (*m as u8) << (2 * i))
            .sum::<u8>();
        POLICY.store(p, Ordering::Relaxed);
    }
    match ((p - 1) >> (2 * kind as u8)) & 3 {
        1 => Mode::Protect,
        2 => Mode::Plaintext,
        _ => Mode::Refuse,
    }
}

fn refused(kind: Kind, bytes: u64, why: &str) {
    if !SAID[kind as usize].swap(true, Ordering::Relaxed) {
        eprintln!(
            "memveil-shield: refused a {} of {bytes} bytes (ENOMEM): {why}",
            kind.name()
        );
    }
}

/// Whether shared memory of `kind`, `bytes` long, may be mapped as it is
/// (plaintext): `false` (and a message, once per kind) when refused. Only
/// while a shield runs and for the program's own calls. Anonymous memory
/// under `protected` goes to [`map_protected`] instead.
pub fn admit(kind: Kind, bytes: u64) -> bool {
    let Some(shield) = crate::shield() else {
        return true;
    };
    if crate::internal() {
        return true;
    }
    match mode(kind) {
        Mode::Plaintext => {
            shield.note_shared_unprotected(bytes);
            true
        }
        Mode::Protect => false,
        Mode::Refuse => {
            refused(
                kind,
                bytes,
                if kind == Kind::Anonymous {
                    "rerun with memveil run --shared-memory protected to keep it encrypted \
                     for this process and the processes it forks, or --shared-memory \
                     unprotected to let it through as plaintext (the summary reports how much)"
                } else {
                    "any process may attach this kind, so it cannot be kept encrypted; rerun \
                     with memveil run --shared-memory unprotected (or, with protected, \
                     --shared-memory protected,memfd=unprotected,sysv=unprotected) to let it \
                     through as plaintext (the summary reports how much)"
                },
            );
            false
        }
    }
}

/// Whether this `mmap` of shared anonymous memory is to be protected.
pub fn wants_protection(flags: c_int) -> bool {
    crate::shield().is_some()
        && !crate::internal()
        && mode(Kind::Anonymous) == Mode::Protect
        && flags & libc::MAP_ANONYMOUS != 0
}

/// This process's shield of the shared memory it created.
static OWN: AtomicPtr<SharedShield> = AtomicPtr::new(null_mut());
/// Shields of ancestors whose shared memory this process maps (after fork).
static INHERITED: [AtomicPtr<SharedShield>; 8] = [const { AtomicPtr::new(null_mut()) }; 8];
static START: Mutex<()> = Mutex::new(());

/// The shield `p` holds, if any.
fn loaded(p: &AtomicPtr<SharedShield>) -> Option<&'static SharedShield> {
    let p = p.load(Ordering::Acquire);
    // SAFETY: every pointer stored in OWN and INHERITED is a leaked Box,
    // never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

fn own() -> Result<&'static SharedShield, String> {
    if let Some(s) = loaded(&OWN) {
        return Ok(s);
    }
    let _g = START
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(s) = loaded(&OWN) {
        return Ok(s);
    }
    let shield = crate::shield().ok_or("no shield")?;
    if crate::env_usize(c"MEMVEIL_SHIELD_ACCEPT_UNWIPED") != Some(1) {
        return Err(
            "evicted pages of shared memory go back to the kernel unwiped (no process \
                    can wipe a frame another may be reading): pass memveil run \
                    --accept-unwiped-free (and boot with init_on_free=1) to accept it"
                .into(),
        );
    }
    let (cfg, _) = crate::config()?;
    let scfg = SharedConfig {
        // Shared memory keeps a plaintext bound even under a cost budget
        // alone: its handler has no sweep.
        window: if cfg.window == memveil_shield::UNBOUNDED {
            memveil_shield::DEFAULT_WINDOW
        } else {
            cfg.window
        },
        batch: 16,
        policy: cfg.policy,
    };
    crate::set_internal(true);
    let s = shield.shared_memory(&scfg);
    crate::set_internal(false);
    let s = Box::leak(Box::new(s.map_err(|e| e.to_string())?));
    OWN.store(s, Ordering::Release);
    // SAFETY: registering a plain extern "C" function.
    unsafe { libc::atexit(release_at_exit) };
    Ok(s)
}

extern "C" fn release_at_exit() {
    if let Some(s) = loaded(&OWN) {
        if s.creator() == std::process::id() {
            s.release_all();
        }
    }
}

/// Maps protected shared anonymous memory; `None` (with `errno` and a
/// message) when it cannot be protected.
pub fn map_protected(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
) -> Option<*mut c_void> {
    let bytes = len as u64;
    if flags & libc::MAP_HUGETLB != 0 {
        refused(Kind::Anonymous, bytes, "huge-page shared memory cannot be protected (the shield works in 4 KiB pages); the program may fall back to normal pages");
        return None;
    }
    let s = match own() {
        Ok(s) => s,
        Err(e) => {
            refused(
                Kind::Anonymous,
                bytes,
                &format!("it cannot be protected here: {e}"),
            );
            return None;
        }
    };
    // SAFETY: the caller's mmap contract.
    match unsafe { s.map(addr, len, prot, flags) } {
        Ok(p) => Some(p.cast()),
        Err(e) => {
            refused(Kind::Anonymous, bytes, &format!("cannot protect it: {e}"));
            None
        }
    }
}

/// Whether `[addr, addr+len)` touches protected shared memory this process
/// maps (its own or an ancestor's).
pub fn overlaps(addr: usize, len: usize) -> bool {
    shields().any(|s| s.overlaps(addr, len))
}

fn shields() -> impl Iterator<Item = &'static SharedShield> {
    std::iter::once(&OWN)
        .chain(INHERITED.iter())
        .filter_map(loaded)
}

/// Whether `[addr, addr+len)` touches protected shared memory this
/// process created.
pub fn owns(addr: usize, len: usize) -> bool {
    loaded(&OWN).is_some_and(|s| s.overlaps(addr, len))
}

/// `munmap` of this process's own protected shared memory: its pages are
/// written back in plaintext first, for the other processes that map it.
pub fn before_unmap(addr: usize, len: usize) {
    if let Some(s) = loaded(&OWN) {
        s.release(addr, len);
    }
}

/// In a forked child: the parent's shields are dead here (their handler
/// runs in the creator); their descriptors are closed, and a watchdog stops
/// this process if a creator dies without writing its pages back.
pub fn after_fork_child() {
    let p = OWN.swap(null_mut(), Ordering::AcqRel);
    if !p.is_null() {
        // SAFETY: a forked child, the parent's shield (leaked), never
        // dropped; only its lock-free parts are used from now on.
        unsafe { (*p).abandon_in_forked_child() };
        if let Some(slot) = INHERITED
            .iter()
            .find(|s| s.load(Ordering::Relaxed).is_null())
        {
            slot.store(p, Ordering::Release);
        }
    }
    for s in shields() {
        crate::set_internal(true);
        let r = s.watch_creator();
        crate::set_internal(false);
        if let Err(e) = r {
            eprintln!("memveil-shield: refusing to run a forked child unprotected: cannot watch the process holding its shared memory's keys: {e}");
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(125) };
        }
    }
}

/// The kind of shared memory an `mmap` with these flags makes, if any.
pub fn of_mmap(flags: c_int, fd: c_int) -> Option<Kind> {
    // The mapping type is a field, not bits: MAP_SHARED_VALIDATE (3)
    // shares a bit with MAP_PRIVATE (2).
    let kind = flags & 0x0f;
    if kind != libc::MAP_SHARED && kind != libc::MAP_SHARED_VALIDATE {
        return None;
    }
    if flags & libc::MAP_ANONYMOUS != 0 {
        return Some(Kind::Anonymous);
    }
    is_memfd(fd).then_some(Kind::Memfd)
}

/// Whether `fd` is a `memfd_create` file (its `/proc/self/fd` link reads
/// `/memfd:NAME (deleted)`); no allocation.
fn is_memfd(fd: c_int) -> bool {
    if fd < 0 {
        return false;
    }
    // "/proc/self/fd/N" and its NUL, formatted on the stack.
    let mut path = [0u8; 32];
    if write!(&mut path[..31], "/proc/self/fd/{fd}").is_err() {
        return false;
    }
    let mut link = [0u8; 7];
    // SAFETY: `path` is NUL-terminated (zero-filled beyond the digits);
    // readlink writes at most `link.len()` bytes into `link`.
    let got = unsafe { libc::readlink(path.as_ptr().cast(), link.as_mut_ptr().cast(), link.len()) };
    got == 7 && &link == b"/memfd:"
}

/// The size of System V segment `id`, or 0 when it cannot be read.
pub fn sysv_size(id: c_int) -> u64 {
    // SAFETY: all-zero is a valid shmid_ds; IPC_STAT fills it.
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: `ds` is a valid out pointer for IPC_STAT.
    if unsafe { libc::shmctl(id, libc::IPC_STAT, &mut ds) } == 0 {
        ds.shm_segsz as u64
    } else {
        0
    }
}
