//! Shared memory: refused, or let through unprotected when the user said so.
//!
//! A shield keeps one process's pages; memory two processes share would need
//! both to agree on every page's state (one evicting while the other writes
//! would lose the write), which userfaultfd, one per process, does not give.
//! So shared anonymous memory (`MAP_SHARED|MAP_ANONYMOUS`), `memfd_create`
//! mappings and System V segments (`shmat`) are refused (`ENOMEM`, with a
//! message naming the fix) unless `memveil run --shared-memory unprotected`
//! (`MEMVEIL_SHIELD_SHARED=unprotected`) accepted them as plaintext; their
//! size is then counted in the statistics and the summary.
//! Shared mappings of other files (`shm_open`'s `/dev/shm`, any file) are
//! file mappings and are not covered either way: docs/shield.md lists them.

use std::ffi::c_int;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Kinds of shared memory, for the messages.
#[derive(Clone, Copy)]
pub enum Kind {
    Anonymous,
    Memfd,
    SysV,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Anonymous => "shared anonymous mapping (MAP_SHARED|MAP_ANONYMOUS)",
            Self::Memfd => "shared mapping of a memfd_create file",
            Self::SysV => "System V shared memory segment (shmat)",
        }
    }
}

/// 0 unread, 1 refuse, 2 let through.
static POLICY: AtomicU8 = AtomicU8::new(0);
static SAID: [AtomicBool; 3] = [
    AtomicBool::new(false),
    AtomicBool::new(false),
    AtomicBool::new(false),
];

fn let_through() -> bool {
    let mut p = POLICY.load(Ordering::Relaxed);
    if p == 0 {
        p = if crate::env_str(c"MEMVEIL_SHIELD_SHARED").as_deref() == Some("unprotected") {
            2
        } else {
            1
        };
        POLICY.store(p, Ordering::Relaxed);
    }
    p == 2
}

/// Whether shared memory of `kind`, `bytes` long, may be mapped: `false`
/// (and a message, once per kind) when refused. Only while a shield runs
/// and for the program's own calls.
pub fn admit(kind: Kind, bytes: u64) -> bool {
    let Some(shield) = crate::shield() else {
        return true;
    };
    if crate::internal() {
        return true;
    }
    if let_through() {
        shield.note_shared_unprotected(bytes);
        return true;
    }
    if !SAID[kind as usize].swap(true, Ordering::Relaxed) {
        eprintln!(
            "memveil-shield: refused a {} of {bytes} bytes (ENOMEM): memory shared between processes \
             cannot be kept encrypted by a per-process shield; rerun with memveil run \
             --shared-memory unprotected to let it through as plaintext (the summary reports how much)",
            kind.name()
        );
    }
    false
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
