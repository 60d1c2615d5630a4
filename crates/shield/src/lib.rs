//! Transparent protection of a program's memory from user space: the
//! software analogue of the `encrypt_mprotect(addr, len, prot, keyid)` call
//! proposed for Linux MKTME.
//!
//! A protected range is registered with a userfaultfd. At most `window` of
//! its pages are plaintext at any time; the others are missing from the page
//! tables and held as AES-XTS ciphertext (tweak = page address, key per
//! KeyID, key schedules in `memfd_secret` memory) in a store of ordinary
//! memory. Any access to a missing page, by the program or by the kernel on
//! its behalf (`read(2)` into it, `write(2)` from it), stops the accessing
//! thread until a handler thread decrypts the page and maps it back; the
//! victims are chosen by a 2Q policy (see `Queues`).
//!
//! Eviction is race-free against other threads of the program:
//! - with `UFFDIO_MOVE` (Linux 6.8+) the page's frame is moved atomically
//!   out of the program's view into the page's slot in the store and
//!   encrypted in place there, so the frame itself holds the ciphertext;
//!   bringing the page back decrypts the frame in its slot and moves it
//!   home. Frames circulate between the program and the store: none is
//!   allocated, copied or freed per fault, and none leaves with plaintext;
//! - otherwise (or when a page is shared after `fork`) it is write-protected
//!   with `UFFDIO_WRITEPROTECT`, encrypted, and dropped; the frame is then
//!   freed unwiped, which [`Config::accept_unwiped_free`] must accept.
//!
//! What this crate refuses to do: protect memory without a userfaultfd that
//! also sees kernel-side faults (a user-mode-only descriptor would make
//! system calls on protected buffers fail with EFAULT), or run the weaker
//! eviction without the caller accepting it.

mod stats;

pub use stats::{Counters, Snapshot, StatsFile};

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use memveil_cipher::Xts;
use memveil_secmem::{Level, Policy, SecretBox, SecretPool};
use memveil_sys::stack_thread::{self, StackThread};
use memveil_sys::uffd::{self, Fault, Uffd};

/// Page size the shield works in (x86-64 base pages).
pub const PAGE: usize = 4096;
/// Number of KeyIDs (6 KeyID bits, as the engine's default).
pub const KEYIDS: u16 = 64;
/// Default plaintext window in pages (16 MiB).
pub const DEFAULT_WINDOW: usize = 4096;

const ZERO: u8 = 0;
const RESIDENT: u8 = 1;
const EVICTED: u8 = 2;
const STATE_MASK: u8 = 3;
/// Page may not be read by the handler (the program made it unreadable):
/// it is never evicted while the flag is set.
const PINNED: u8 = 0x80;
/// Page was evicted recently (it is in the ghost queue): if it faults back
/// soon, it is hot and joins the main queue.
const GHOST: u8 = 0x40;

/// How evicted pages leave the program's view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    /// `UFFDIO_MOVE` to a scratch page, encrypted there, freed as ciphertext.
    Move,
    /// `UFFDIO_WRITEPROTECT`, encrypt, `MADV_DONTNEED`: frame freed unwiped.
    WriteProtect,
}

impl Mechanism {
    /// Short name for reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Move => "uffd-move",
            Mechanism::WriteProtect => "uffd-wp",
        }
    }
}

/// Settings of a [`Shield`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Most pages kept as plaintext at once (at least 1).
    pub window: usize,
    /// How long the handler thread polls for the next fault before it sleeps
    /// in `poll(2)`. Zero by default: measured by hand with the faultcost
    /// example, a handler spinning 50 µs made each fault about 80-90 µs
    /// against 15-25 µs for a sleeping one on the program's CPU.
    pub spin: Duration,
    /// Accepted protection level of the key schedules.
    pub policy: Policy,
    /// Accept the write-protect eviction (frames freed unwiped) when the
    /// kernel lacks `UFFDIO_MOVE`.
    pub accept_unwiped_free: bool,
    /// Use the write-protect eviction even when `UFFDIO_MOVE` exists (tests).
    pub force_write_protect: bool,
    /// Pages evicted at once when the window is full (amortises the system
    /// calls; at most `window / 4`).
    pub evict_batch: usize,
    /// CPU the handler thread is pinned to. The default,
    /// [`HandlerCpu::Follow`], keeps the fault hand-off on one CPU — waking
    /// a thread on another, idle CPU costs tens of microseconds on a
    /// virtual machine — and moves with the thread that faults.
    pub handler_cpu: HandlerCpu,
}

/// Where the fault handler thread runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerCpu {
    /// Not pinned: the scheduler decides.
    Any,
    /// The CPU the shield was created on.
    Current,
    /// This CPU.
    Cpu(usize),
    /// Starts as [`HandlerCpu::Current`]; every [`FOLLOW_EVERY`] faults it
    /// looks up the CPU the faulting thread last ran on and moves there
    /// when it differs (the scheduler moves unpinned programs about).
    Follow,
}

/// Faults between two looks at the faulting thread's CPU under
/// [`HandlerCpu::Follow`] (a look is a `pread` of `/proc/PID/task/TID/stat`,
/// a few µs; the file stays open while the same thread faults).
pub const FOLLOW_EVERY: u64 = 8;

impl Default for Config {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            spin: Duration::ZERO,
            policy: Policy::secret_only(),
            accept_unwiped_free: false,
            force_write_protect: false,
            evict_batch: 32,
            handler_cpu: HandlerCpu::Follow,
        }
    }
}

/// Errors of the shield.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShieldError {
    /// No userfaultfd that sees kernel-side faults may be created.
    #[error(
        "userfaultfd not permitted ({syscall}; /dev/userfaultfd: {dev}): with \
         vm.unprivileged_userfaultfd=0 only root (CAP_SYS_PTRACE) may handle faults \
         taken inside system calls{umo}. Fix one of: run as root; \
         `sysctl vm.unprivileged_userfaultfd=1`; or give your group access to \
         /dev/userfaultfd (Linux 6.1+: `chgrp GROUP /dev/userfaultfd; chmod 660 /dev/userfaultfd`)"
    )]
    NotPermitted {
        /// Error of the system call.
        syscall: String,
        /// Error opening the device node.
        dev: String,
        /// Note on the user-mode-only variant.
        umo: &'static str,
    },
    /// The kernel lacks a needed userfaultfd feature.
    #[error(
        "userfaultfd on this kernel lacks {0}; Linux 5.7+ is required (6.8+ for wiped eviction)"
    )]
    Unsupported(&'static str),
    /// Only the weaker eviction exists and it was not accepted.
    #[error(
        "this kernel lacks UFFDIO_MOVE (Linux 6.8+): evicted frames would return to the \
         kernel unwiped (plaintext until reused). Boot with init_on_free=1 and pass \
         --accept-unwiped-free (Config::accept_unwiped_free) to accept it, or upgrade the kernel"
    )]
    UnwipedEviction,
    /// A range that is not page-aligned, empty, or overlaps a protected one.
    #[error("bad range {addr:#x}+{len:#x}: {why}")]
    BadRange {
        /// Start address.
        addr: usize,
        /// Length in bytes.
        len: usize,
        /// Why it was refused.
        why: &'static str,
    },
    /// A KeyID outside the table.
    #[error("KeyID {0} out of range: 0..{KEYIDS}")]
    BadKeyId(u16),
    /// Secret memory for the keys.
    #[error(transparent)]
    Secmem(#[from] memveil_secmem::SecmemError),
    /// A system call failed.
    #[error("{op}: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
}

fn os(op: &'static str) -> impl FnOnce(io::Error) -> ShieldError {
    move |source| ShieldError::Os { op, source }
}

/// Checks that this process may create a userfaultfd serving kernel-side
/// faults, and which eviction mechanism the kernel allows.
///
/// # Errors
/// [`ShieldError::NotPermitted`] or [`ShieldError::Unsupported`].
pub fn check() -> Result<Mechanism, ShieldError> {
    let fd = open_uffd()?;
    let offered = fd.handshake(0).map_err(os("UFFDIO_API"))?;
    mechanism_of(offered, false)
}

fn open_uffd() -> Result<Uffd, ShieldError> {
    Uffd::open().map_err(|e| ShieldError::NotPermitted {
        syscall: e.syscall.to_string(),
        dev: e.dev.to_string(),
        umo: if e.user_mode_only_allowed {
            " (a user-mode-only descriptor is allowed, but it cannot serve read(2)/write(2) \
             on protected buffers, so it is not used)"
        } else {
            ""
        },
    })
}

fn mechanism_of(offered: u64, force_wp: bool) -> Result<Mechanism, ShieldError> {
    if offered & uffd::FEATURE_PAGEFAULT_FLAG_WP == 0 {
        return Err(ShieldError::Unsupported(
            "write-protect faults on anonymous memory",
        ));
    }
    if offered & uffd::FEATURE_MOVE != 0 && !force_wp {
        Ok(Mechanism::Move)
    } else {
        Ok(Mechanism::WriteProtect)
    }
}

/// A protected range and its ciphertext store.
struct Range {
    base: usize,
    pages: usize,
    keyid: u16,
    /// One state byte per page (direct mapping, not the program's heap).
    states: *mut u8,
    /// Ciphertext, page `i` at `store + i * PAGE`. With the Move mechanism
    /// the store is registered with the userfaultfd (a move's destination
    /// must be) and slot `i` holds a frame exactly while page `i` is
    /// evicted; the handler touches a slot only then, so it never faults on
    /// one.
    store: *mut u8,
}

impl Range {
    fn state(&self, i: usize) -> u8 {
        debug_assert!(i < self.pages);
        // SAFETY: `states` holds `pages` bytes owned by this range; i < pages.
        unsafe { self.states.add(i).read() }
    }
    fn set_state(&mut self, i: usize, s: u8) {
        debug_assert!(i < self.pages);
        // SAFETY: as in `state`; `&mut self` gives exclusive access.
        unsafe { self.states.add(i).write(s) }
    }
    fn store_page(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: the store holds `pages * PAGE` bytes owned by this range,
        // i < pages, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.store.add(i * PAGE), PAGE) }
    }
    fn end(&self) -> usize {
        self.base + self.pages * PAGE
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        // SAFETY: both mappings were made by `Range`'s creator for this range
        // alone and nothing refers to them after drop.
        unsafe {
            let _ = uffd::unmap_direct(self.states, self.pages.next_multiple_of(PAGE));
            let _ = uffd::unmap_direct(self.store, self.pages * PAGE);
        }
    }
}

/// Resident pages in two FIFO queues (2Q): pages enter `probation`; a page
/// that faults back while its address is still in `ghosts` (evicted
/// recently) is hot and enters `main`. Eviction takes from `probation`
/// while it holds more than [`PROBATION_SHARE`] of the window, else from
/// `main`, so a hot set (hash tables, allocator metadata) survives a stream
/// of cold pages. Entries may be stale (page discarded or evicted): the page
/// state is checked when an entry is popped.
#[derive(Default)]
struct Queues {
    probation: VecDeque<usize>,
    main: VecDeque<usize>,
    ghosts: VecDeque<usize>,
}

/// The window is divided by this for the pages probation may hold before
/// victims come from it (and for the ghosts remembered, see
/// [`ghost_capacity`]). The 2Q paper's 1/4 and a ghost list as long as the
/// window let a large set touched uniformly at random (redis's values)
/// return to `main` as often as the hot set does, and push the hot set out:
/// redis-benchmark `-r 100000 -d 512` took 1.12 faults per GET and 0.72 per
/// SET. With 1/8 for both it takes 0.92 and 0.60; values alone would need
/// 0.87 a GET (BENCHMARKS.md, "Shield").
const PROBATION_SHARE: usize = 8;

/// How many evicted pages' addresses the ghost queue remembers: a page is
/// hot when it faults back within this many evictions.
fn ghost_capacity(window: usize) -> usize {
    (window / PROBATION_SHARE).max(4)
}

struct State {
    ranges: Vec<Range>,
    queues: Queues,
    resident: usize,
    evicted: usize,
    window: usize,
    keys: Vec<Option<SecretBox<Xts>>>,
    bounce: SecretBox<[u8]>,
    /// Eviction is suspended (around fork).
    frozen: bool,
}

// SAFETY: the raw pointers in `Range` refer to mappings owned by the State
// and are only dereferenced under the State's mutex.
unsafe impl Send for State {}

struct Inner {
    uffd: Uffd,
    mechanism: Mechanism,
    batch: usize,
    spin: Duration,
    handler_cpu: Option<usize>,
    /// [`HandlerCpu::Follow`], and the kernel reports faulting threads.
    follow: bool,
    level: Level,
    state: Mutex<State>,
    stats: StatsFile,
    stop: AtomicBool,
    /// A registered page that is never filled except to stop the handler:
    /// [`Shield`]'s drop touches it, so a handler asleep in `read(2)` wakes,
    /// maps zeros there (releasing the toucher) and sees `stop`.
    doorbell: usize,
    pool: SecretPool,
}

/// Source of the zeros mapped at the doorbell (read-only data, outside any
/// protected range).
static ZEROS: [u8; PAGE] = [0; PAGE];

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: the last reference is gone, so the handler has stopped and
        // nothing uses the doorbell page any more.
        let _ = unsafe { uffd::unmap_direct(self.doorbell as *mut u8, PAGE) };
    }
}

/// The handler thread's stack: locked, not dumped, and private, not secret
/// memory — after `fork` the C library rewrites the control block of every
/// thread in the child, which lives at the top of this stack, so the child
/// must inherit a copy (a `memfd_secret` mapping is shared or, with
/// `MADV_DONTFORK`, missing). Pages and keys the thread handles stay in
/// secret memory (the bounce page, the key schedules).
struct HandlerStack {
    base: *mut u8,
    len: usize,
}

// SAFETY: the stack is an owned mapping with no thread affinity.
unsafe impl Send for HandlerStack {}

impl AsMut<[u8]> for HandlerStack {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `base` is a mapping of `len` bytes owned by this value.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }
}

impl Drop for HandlerStack {
    fn drop(&mut self) {
        // SAFETY: the thread that ran on it has been joined (StackThread
        // hands the stack back only after join).
        let _ = unsafe { uffd::unmap_direct(self.base, self.len) };
    }
}

/// Stack of the handler thread.
const HANDLER_STACK: usize = 256 * 1024;

/// The shield: one userfaultfd, one handler thread, the key table and the
/// plaintext window shared by all protected ranges.
pub struct Shield {
    inner: Arc<Inner>,
    handler: Option<StackThread<HandlerStack>>,
}

impl Shield {
    /// Creates a shield with its handler thread. Counters go to `stats`
    /// (a shared file [`StatsFile::create`] or [`StatsFile::private`]).
    ///
    /// # Errors
    /// [`ShieldError::NotPermitted`], [`ShieldError::Unsupported`],
    /// [`ShieldError::UnwipedEviction`], or secret memory errors.
    pub fn new(cfg: &Config, stats: StatsFile) -> Result<Self, ShieldError> {
        let fd = open_uffd()?;
        let offered = Uffd::offered_features().map_err(os("UFFDIO_API"))?;
        let mechanism = mechanism_of(offered, cfg.force_write_protect)?;
        if mechanism == Mechanism::WriteProtect
            && offered & uffd::FEATURE_MOVE == 0
            && !cfg.accept_unwiped_free
        {
            return Err(ShieldError::UnwipedEviction);
        }
        // Nothing to follow when the process (its main thread) may run on
        // one CPU only (`memveil run --cpu N`, taskset): a look costs a
        // system call.
        let follow = cfg.handler_cpu == HandlerCpu::Follow
            && offered & uffd::FEATURE_THREAD_ID != 0
            && memveil_sys::process::allowed_cpus(std::process::id()).is_none_or(|n| n > 1);
        fd.handshake(
            uffd::FEATURE_PAGEFAULT_FLAG_WP | if follow { uffd::FEATURE_THREAD_ID } else { 0 },
        )
        .map_err(os("UFFDIO_API"))?;
        let window = cfg.window.max(1);
        let batch = cfg.evict_batch.clamp(1, (window / 4).max(1));
        let pool = SecretPool::new(64 * 1024, cfg.policy)?;
        let level = pool.level();
        let bounce = pool.alloc_bytes(PAGE)?;
        let doorbell = uffd::map_anonymous_direct(PAGE).map_err(os("mmap doorbell"))?;
        fd.register(doorbell as u64, PAGE as u64, uffd::MODE_MISSING)
            .map_err(os("UFFDIO_REGISTER doorbell"))?;
        let c = stats.counters();
        c.window.store(window as u64, Ordering::Relaxed);
        c.mechanism.store(
            match mechanism {
                Mechanism::Move => 1,
                Mechanism::WriteProtect => 2,
            },
            Ordering::Relaxed,
        );
        c.level.store(
            match level {
                Level::Secret => 1,
                _ => 2,
            },
            Ordering::Relaxed,
        );
        let inner = Arc::new(Inner {
            uffd: fd,
            mechanism,
            batch,
            spin: cfg.spin,
            handler_cpu: match cfg.handler_cpu {
                HandlerCpu::Any => None,
                HandlerCpu::Current | HandlerCpu::Follow => memveil_sys::process::current_cpu(),
                HandlerCpu::Cpu(n) => Some(n),
            },
            follow,
            level,
            state: Mutex::new(State {
                ranges: Vec::new(),
                queues: Queues::default(),
                resident: 0,
                evicted: 0,
                window,
                keys: (0..KEYIDS).map(|_| None).collect(),
                bounce,
                frozen: false,
            }),
            stats,
            stop: AtomicBool::new(false),
            doorbell: doorbell as usize,
            pool,
        });
        let worker = Arc::clone(&inner);
        // A thread started directly on its stack runs our code first: no
        // runtime prologue allocates before the start hook has run.
        let stack = Box::new(HandlerStack {
            base: uffd::map_stack_direct(HANDLER_STACK).map_err(os("mmap handler stack"))?,
            len: HANDLER_STACK,
        });
        let handler = stack_thread::spawn(stack, move || worker.serve())
            .map_err(os("spawn handler thread"))?;
        Ok(Self {
            inner,
            handler: Some(handler),
        })
    }

    /// The eviction mechanism in use.
    #[must_use]
    pub fn mechanism(&self) -> Mechanism {
        self.inner.mechanism
    }

    /// Protection level of the key schedules.
    #[must_use]
    pub fn level(&self) -> Level {
        self.inner.level
    }

    /// The counters.
    #[must_use]
    pub fn stats(&self) -> Snapshot {
        self.inner.stats.snapshot()
    }

    /// The analogue of `encrypt_mprotect(addr, len, prot, keyid)`: from now on
    /// `[addr, addr+len)` is kept as ciphertext under `keyid` outside the
    /// plaintext window, and `prot` is applied. Present pages keep their
    /// contents; pages beyond the window are evicted at once.
    ///
    /// # Safety
    /// The range must be anonymous private memory owned by the caller, and
    /// from now until [`Shield::unprotect`] (or drop) it may only be
    /// unmapped, remapped or `madvise`d through this shield.
    ///
    /// # Errors
    /// [`ShieldError::BadRange`] for unaligned, empty or overlapping ranges,
    /// [`ShieldError::BadKeyId`], or the kernel's refusal to register it.
    pub unsafe fn encrypt_mprotect(
        &self,
        addr: *mut u8,
        len: usize,
        prot: libc::c_int,
        keyid: u16,
    ) -> Result<(), ShieldError> {
        let base = addr as usize;
        let bad = |why| ShieldError::BadRange {
            addr: base,
            len,
            why,
        };
        if len == 0 || !base.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) {
            return Err(bad("not a non-empty page-aligned range"));
        }
        if keyid >= KEYIDS {
            return Err(ShieldError::BadKeyId(keyid));
        }
        let mut st = self.inner.lock();
        if st
            .ranges
            .iter()
            .any(|r| base < r.end() && r.base < base + len)
        {
            return Err(bad("overlaps a protected range"));
        }
        self.inner.ensure_key(&mut st, keyid)?;
        let pages = len / PAGE;
        let states = uffd::map_anonymous_direct(pages.next_multiple_of(PAGE))
            .map_err(os("mmap page states"))?;
        let store = uffd::map_anonymous_direct(len).map_err(os("mmap ciphertext store"))?;
        let range = Range {
            base,
            pages,
            keyid,
            states,
            store,
        };
        if self.inner.mechanism == Mechanism::Move {
            // Evicted frames are moved into their slots, which the kernel
            // allows only into a range registered here. The handler touches
            // a slot only while it holds a frame, so it never faults on one.
            // On failure `range` unmaps both mappings as it drops.
            self.inner
                .uffd
                .register(store as u64, len as u64, uffd::MODE_MISSING)
                .map_err(os("UFFDIO_REGISTER store"))?;
        }
        // Which pages already hold data: mincore writes 1 per resident page,
        // which is exactly RESIDENT; 0 is ZERO.
        // SAFETY: `states` holds `pages` bytes owned by `range`.
        let states_slice = unsafe { std::slice::from_raw_parts_mut(states, pages) };
        uffd::resident_pages(base, len, states_slice).map_err(os("mincore"))?;
        for b in states_slice.iter_mut() {
            *b &= 1;
        }
        self.inner
            .uffd
            .register(base as u64, len as u64, uffd::MODE_MISSING | uffd::MODE_WP)
            .map_err(os("UFFDIO_REGISTER"))?;
        if prot != libc::PROT_READ | libc::PROT_WRITE {
            // SAFETY: the caller owns the range (function contract).
            unsafe { uffd::mprotect_direct(addr, len, prot) }.map_err(os("mprotect"))?;
        }
        let mut fresh = 0;
        for (i, s) in states_slice.iter().enumerate() {
            if *s == RESIDENT {
                st.queues.probation.push_back(base + i * PAGE);
                fresh += 1;
            }
        }
        st.resident += fresh;
        let pos = st.ranges.partition_point(|r| r.base < base);
        st.ranges.insert(pos, range);
        if prot & libc::PROT_READ == 0 {
            st.set_flags(base, len, PINNED, true);
        }
        let c = self.inner.stats.counters();
        c.pages_protected.fetch_add(pages as u64, Ordering::Relaxed);
        c.resident.store(st.resident as u64, Ordering::Relaxed);
        self.inner.shrink_to_window(&mut st);
        Ok(())
    }

    /// Stops protecting `[addr, addr+len)` (a whole range previously passed to
    /// [`Shield::encrypt_mprotect`]): evicted pages are decrypted back into
    /// place and the range is unregistered.
    ///
    /// # Errors
    /// [`ShieldError::BadRange`] when it is not a protected range.
    pub fn unprotect(&self, addr: *mut u8, len: usize) -> Result<(), ShieldError> {
        let base = addr as usize;
        let mut st = self.inner.lock();
        let Some(pos) = st
            .ranges
            .iter()
            .position(|r| r.base == base && r.pages * PAGE == len)
        else {
            return Err(ShieldError::BadRange {
                addr: base,
                len,
                why: "not a protected range",
            });
        };
        self.inner.restore_range(&mut st, pos)?;
        let r = st.ranges.remove(pos);
        let _ = self.inner.uffd.unregister(base as u64, len as u64);
        let c = self.inner.stats.counters();
        c.pages_protected
            .fetch_sub(r.pages as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Whether `addr` lies in a protected range.
    #[must_use]
    pub fn contains(&self, addr: usize) -> bool {
        self.inner.lock().find(addr).is_some()
    }

    /// Drops the contents of the protected pages in `[addr, addr+len)` (the
    /// `munmap`/`MADV_DONTNEED` of protected memory): plaintext pages are
    /// wiped before their frames go back to the kernel, ciphertext is
    /// dropped, and the pages read as zeros afterwards.
    ///
    /// # Safety
    /// No live object may be in the range (its bytes become zero).
    pub unsafe fn discard(&self, addr: usize, len: usize) {
        let mut st = self.inner.lock();
        st.discard(addr, len, &self.inner.stats);
    }

    /// Marks pages the program made unreadable (`pinned`: never evicted, as
    /// the handler could not read them) or readable again.
    pub fn set_unreadable(&self, addr: usize, len: usize, unreadable: bool) {
        let mut st = self.inner.lock();
        st.set_flags(addr, len, PINNED, unreadable);
    }

    /// Brings every evicted page back as plaintext and suspends eviction
    /// until [`Shield::thaw`]: called before `fork(2)`, since a child does
    /// not inherit the userfaultfd and would read zeros where pages were
    /// evicted.
    ///
    /// # Errors
    /// The error of `UFFDIO_COPY`.
    pub fn freeze(&self) -> Result<(), ShieldError> {
        let mut st = self.inner.lock();
        st.frozen = true;
        for pos in 0..st.ranges.len() {
            self.inner.restore_range(&mut st, pos)?;
        }
        Ok(())
    }

    /// Resumes eviction after [`Shield::freeze`], and evicts at once down to
    /// the window: the handler evicts only when a page faults, so without
    /// this the whole heap [`Shield::freeze`] brought back would stay
    /// plaintext until the program next touched an evicted page. After a
    /// `fork` the pages the child still shares go by write-protection.
    pub fn thaw(&self) {
        let mut st = self.inner.lock();
        st.frozen = false;
        self.inner.shrink_to_window(&mut st);
    }
}

impl Drop for Shield {
    fn drop(&mut self) {
        let _ = self.freeze();
        self.inner.stop.store(true, Ordering::SeqCst);
        let bell = self.inner.doorbell as *const u8;
        // SAFETY: the doorbell is a page of our own, registered missing: the
        // read faults and waits until the handler maps zeros there, which
        // wakes a handler asleep in read(2) (one that is busy finds the
        // fault on its next read).
        let _ = unsafe { bell.read_volatile() };
        if let Some(h) = self.handler.take() {
            drop(h.join());
        }
        let mut st = self.inner.lock();
        for r in &st.ranges {
            let _ = self
                .inner
                .uffd
                .unregister(r.base as u64, (r.pages * PAGE) as u64);
        }
        st.ranges.clear();
    }
}

impl State {
    /// Books page `i` of range `pos` as evicted (its ciphertext is in its
    /// store slot) and remembers it in the ghost queue.
    fn mark_evicted(&mut self, pos: usize, i: usize) {
        let r = &mut self.ranges[pos];
        let addr = r.base + i * PAGE;
        let s = r.state(i);
        r.set_state(i, EVICTED | GHOST | (s & PINNED));
        self.resident -= 1;
        self.evicted += 1;
        self.queues.ghosts.push_back(addr);
        if self.queues.ghosts.len() > ghost_capacity(self.window) {
            if let Some(old) = self.queues.ghosts.pop_front() {
                if let Some((p, k)) = self.find(old) {
                    let r = &mut self.ranges[p];
                    let s = r.state(k);
                    r.set_state(k, s & !GHOST);
                }
            }
        }
    }

    fn find(&self, addr: usize) -> Option<(usize, usize)> {
        let pos = self.ranges.partition_point(|r| r.base <= addr);
        let r = self.ranges.get(pos.checked_sub(1)?)?;
        (addr < r.end()).then(|| (pos - 1, (addr - r.base) / PAGE))
    }

    fn set_flags(&mut self, addr: usize, len: usize, flag: u8, on: bool) {
        let end = addr.saturating_add(len);
        for r in &mut self.ranges {
            let lo = addr.max(r.base);
            let hi = end.min(r.end());
            if lo >= hi {
                continue;
            }
            for i in (lo - r.base) / PAGE..(hi - r.base).div_ceil(PAGE) {
                let s = r.state(i);
                r.set_state(i, if on { s | flag } else { s & !flag });
            }
        }
    }

    fn discard(&mut self, addr: usize, len: usize, stats: &StatsFile) {
        let end = addr.saturating_add(len);
        let (mut dropped_res, mut dropped_ev) = (0, 0);
        for r in &mut self.ranges {
            let lo = addr.max(r.base).next_multiple_of(PAGE);
            let hi = end.min(r.end());
            if lo >= hi {
                continue;
            }
            let first = (lo - r.base) / PAGE;
            let last = (hi - r.base) / PAGE;
            for i in first..last {
                let s = r.state(i);
                match s & STATE_MASK {
                    RESIDENT => {
                        let p = (r.base + i * PAGE) as *mut u8;
                        if s & PINNED == 0 {
                            // SAFETY: the page is resident (present, readable
                            // and writable: pinned pages are skipped) and the
                            // caller of `discard` owns its contents.
                            unsafe { zeroize_page(p) };
                        }
                        // SAFETY: as above; the contents are being dropped.
                        let _ = unsafe { uffd::madvise_direct(p, PAGE, libc::MADV_DONTNEED) };
                        dropped_res += 1;
                    }
                    EVICTED => {
                        // SAFETY: the store page belongs to this range.
                        let sp = unsafe { r.store.add(i * PAGE) };
                        // SAFETY: ciphertext store owned by the range.
                        let _ = unsafe { uffd::madvise_direct(sp, PAGE, libc::MADV_DONTNEED) };
                        dropped_ev += 1;
                    }
                    _ => {}
                }
                r.set_state(i, ZERO | (s & PINNED));
            }
        }
        self.resident -= dropped_res;
        self.evicted -= dropped_ev;
        let c = stats.counters();
        c.resident.store(self.resident as u64, Ordering::Relaxed);
        c.evicted.store(self.evicted as u64, Ordering::Relaxed);
        c.discards
            .fetch_add((dropped_res + dropped_ev) as u64, Ordering::Relaxed);
        let limit = 2 * self.window + 1024;
        let ranges = &self.ranges;
        let live = |a: &usize| {
            let pos = ranges.partition_point(|r| r.base <= *a);
            pos > 0 && {
                let r = &ranges[pos - 1];
                *a < r.end() && r.state((*a - r.base) / PAGE) & STATE_MASK == RESIDENT
            }
        };
        for q in [&mut self.queues.probation, &mut self.queues.main] {
            if q.len() > limit {
                q.retain(live);
            }
        }
    }
}

/// Zeroes one page with writes the optimiser keeps.
///
/// # Safety
/// `p` must be a writable, present page no Rust object lives in.
unsafe fn zeroize_page(p: *mut u8) {
    use zeroize::Zeroize as _;
    // SAFETY: the caller promises the page is writable and owned.
    unsafe { std::slice::from_raw_parts_mut(p, PAGE) }.zeroize();
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ensure_key(&self, st: &mut State, keyid: u16) -> Result<(), ShieldError> {
        let slot = usize::from(keyid);
        if st.keys[slot].is_some() {
            return Ok(());
        }
        let mut raw = self.pool.alloc_bytes(32)?;
        memveil_sys::getrandom(&mut raw).map_err(os("getrandom"))?;
        let xts = self
            .pool
            .alloc(|| Xts::new(&raw[..16], &raw[16..]).expect("distinct random halves"))?;
        st.keys[slot] = Some(xts);
        Ok(())
    }

    fn serve(&self) {
        if let Some(hook) = START_HOOK.get() {
            hook();
        }
        let mut on = self.handler_cpu;
        if let Some(cpu) = on {
            if let Err(e) = memveil_sys::process::pin_to_cpu(cpu) {
                eprintln!("memveil-shield: cannot pin the fault handler to CPU {cpu}: {e}");
                on = None;
            }
        }
        let pid = std::process::id();
        let mut until_look = FOLLOW_EVERY;
        let mut stat: Option<memveil_sys::process::ThreadStat> = None;
        let mut faults = [Fault {
            address: 0,
            flags: 0,
            tid: 0,
        }; 64];
        let mut last = Instant::now();
        // Without a spin the handler sleeps in read(2) itself: one system
        // call per wake-up instead of read, poll and read again.
        let blocking = self.spin.is_zero() && self.uffd.set_blocking(true).is_ok();
        while !self.stop.load(Ordering::Relaxed) {
            let n = match self.uffd.read_faults(&mut faults) {
                Ok(n) => n,
                Err(e) => {
                    eprintln!("memveil-shield: reading faults failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    0
                }
            };
            if n > 0 {
                let t0 = Instant::now();
                let mut st = self.lock();
                for f in &faults[..n] {
                    if usize::try_from(f.address).is_ok_and(|a| a & !(PAGE - 1) == self.doorbell) {
                        let _ = self.uffd.copy(self.doorbell as u64, &ZEROS);
                        continue;
                    }
                    self.resolve(&mut st, f);
                }
                drop(st);
                let c = self.stats.counters();
                c.handler_ns
                    .fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
                if self.follow {
                    until_look = until_look.saturating_sub(n as u64);
                    if until_look == 0 {
                        until_look = FOLLOW_EVERY;
                        on = self.follow_thread(faults[n - 1].tid, pid, &mut stat, on);
                    }
                }
                last = Instant::now();
                continue;
            }
            if blocking {
                continue;
            }
            if last.elapsed() < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if let Err(e) = self.uffd.wait(None, 100) {
                eprintln!("memveil-shield: poll failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // Stopped before the doorbell rang (or before the fault was read):
        // fill it now, which releases a toucher already waiting and spares
        // one still to come the fault.
        let _ = self.uffd.copy(self.doorbell as u64, &ZEROS);
    }

    /// Moves the handler to the CPU thread `tid` last ran on when that is
    /// not `on` (the handler's CPU); returns the handler's CPU. `stat`
    /// caches the open stat file of the last thread looked at.
    fn follow_thread(
        &self,
        tid: u32,
        pid: u32,
        stat: &mut Option<memveil_sys::process::ThreadStat>,
        on: Option<usize>,
    ) -> Option<usize> {
        if stat.as_ref().is_none_or(|s| s.tid() != tid) {
            *stat = memveil_sys::process::ThreadStat::open(pid, tid);
        }
        let Some((cpu, _)) = stat
            .as_ref()
            .and_then(memveil_sys::process::ThreadStat::read)
        else {
            return on;
        };
        if on == Some(cpu) || memveil_sys::process::pin_to_cpu(cpu).is_err() {
            return on;
        }
        self.stats
            .counters()
            .handler_moves
            .fetch_add(1, Ordering::Relaxed);
        Some(cpu)
    }

    fn resolve(&self, st: &mut State, f: &Fault) {
        let addr = usize::try_from(f.address).unwrap_or(usize::MAX) & !(PAGE - 1);
        let c = self.stats.counters();
        let Some((pos, i)) = st.find(addr) else {
            // Not ours (a scratch page cannot fault): wake so the thread retries.
            c.spurious.fetch_add(1, Ordering::Relaxed);
            let _ = self.uffd.wake(addr as u64, PAGE as u64);
            return;
        };
        let s = st.ranges[pos].state(i) & STATE_MASK;
        if s == RESIDENT {
            // Resolved meanwhile, or a write-protect fault on a page that was
            // being evicted and came back: let the writer go on.
            c.spurious.fetch_add(1, Ordering::Relaxed);
            if f.flags & uffd::PAGEFAULT_FLAG_WP != 0 {
                let _ = self.uffd.write_protect(addr as u64, PAGE as u64, false);
            } else {
                let _ = self.uffd.wake(addr as u64, PAGE as u64);
            }
            return;
        }
        // Wake the faulting thread first, then make room: the window is
        // exceeded by at most this one page, for the time of one eviction.
        if let Err(e) = self.bring_in(st, pos, i) {
            eprintln!("memveil-shield: cannot map page {addr:#x}: {e}");
            let _ = self.uffd.wake(addr as u64, PAGE as u64);
        }
        if st.resident > st.window && !st.frozen {
            let need = st.resident - st.window;
            self.evict(st, need.max(self.batch));
        }
    }

    /// Maps page `i` of range `pos` (ZERO or EVICTED) as plaintext and wakes
    /// the threads waiting on it. With `UFFDIO_MOVE`, an evicted page's
    /// frame waits in its store slot: it is decrypted there and moved back,
    /// so no frame is allocated, copied or freed (see [`Inner::move_in`]).
    /// A page never written, and every page under the write-protect
    /// mechanism, is built in the bounce page and mapped by `UFFDIO_COPY`.
    fn bring_in(&self, st: &mut State, pos: usize, i: usize) -> io::Result<()> {
        let c = self.stats.counters();
        let (addr, s) = {
            let r = &st.ranges[pos];
            (r.base + i * PAGE, r.state(i))
        };
        let evicted = s & STATE_MASK == EVICTED;
        let t0 = Instant::now();
        let res = if evicted && self.mechanism == Mechanism::Move {
            self.move_in(st, pos, i)
        } else {
            let State {
                ranges,
                keys,
                bounce,
                ..
            } = &mut *st;
            plaintext_into(&ranges[pos], i, keys, bounce).and_then(|()| {
                let r = self.uffd.copy(addr as u64, bounce);
                bounce.fill(0);
                r
            })
        };
        match res {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let _ = self.uffd.wake(addr as u64, PAGE as u64);
            }
            Err(e) => return Err(e),
        }
        c.copy_ns.fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
        if evicted {
            st.evicted -= 1;
            c.faults_in.fetch_add(1, Ordering::Relaxed);
        } else {
            c.zero_fills.fetch_add(1, Ordering::Relaxed);
        }
        st.ranges[pos].set_state(i, RESIDENT | (s & PINNED));
        if s & GHOST != 0 {
            st.queues.main.push_back(addr);
        } else {
            st.queues.probation.push_back(addr);
        }
        st.resident += 1;
        c.resident.store(st.resident as u64, Ordering::Relaxed);
        c.evicted.store(st.evicted as u64, Ordering::Relaxed);
        c.max_resident
            .fetch_max(st.resident as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Brings evicted page `i` of range `pos` back (Move mechanism): its
    /// frame, in the store slot, is decrypted in place and moved to the
    /// page's address with `UFFDIO_MOVE`, which wakes the waiting threads.
    /// The plaintext exists only in the frame that becomes the program's
    /// page. When the move is refused (the page's protection differs from
    /// the store's after `mprotect`), the frame is copied in with
    /// `UFFDIO_COPY`, then wiped and dropped; if that fails too, it is
    /// encrypted again so the page stays evicted.
    fn move_in(&self, st: &mut State, pos: usize, i: usize) -> io::Result<()> {
        let State { ranges, keys, .. } = &mut *st;
        let r = &mut ranges[pos];
        let addr = r.base + i * PAGE;
        let key = keys[usize::from(r.keyid)]
            .as_ref()
            .ok_or_else(|| io::Error::other("no key for the range's KeyID"))?;
        // The page is EVICTED, so its slot holds a frame: touching it does
        // not fault.
        let slot = r.store_page(i);
        key.decrypt_unit(addr as u128, slot)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let src = slot.as_ptr() as u64;
        if self
            .uffd
            .move_pages(addr as u64, src, PAGE as u64, true)
            .is_ok()
        {
            return Ok(());
        }
        let copied = self.uffd.copy(addr as u64, slot);
        match &copied {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(_) => {
                // Still evicted: back to ciphertext (4096 bytes: always a
                // valid XTS unit).
                let _ = key.encrypt_unit(addr as u128, slot);
                return copied;
            }
        }
        // SAFETY: the slot is a present page of the store owned by this
        // range, and the page's contents now live at `addr`.
        unsafe { release_slot(slot.as_mut_ptr()) };
        copied
    }

    /// Evicts until at most `window` pages are resident (or nothing more
    /// can be evicted: every resident page pinned).
    fn shrink_to_window(&self, st: &mut State) {
        while st.resident > st.window {
            let over = st.resident - st.window;
            if self.evict(st, over) == 0 {
                break;
            }
        }
    }

    /// Picks up to `n` resident, evictable pages (2Q order, see [`Queues`]).
    fn victims(st: &mut State, n: usize) -> Vec<(usize, usize)> {
        let mut victims: Vec<(usize, usize)> = Vec::with_capacity(n);
        let mut pinned = Vec::new();
        let probation_max = st.window / PROBATION_SHARE;
        while victims.len() < n {
            let from_probation =
                st.queues.probation.len() > probation_max || st.queues.main.is_empty();
            let q = if from_probation {
                &mut st.queues.probation
            } else {
                &mut st.queues.main
            };
            let Some(a) = q.pop_front().or_else(|| st.queues.main.pop_front()) else {
                break;
            };
            let Some((pos, i)) = st.find(a) else { continue };
            let s = st.ranges[pos].state(i);
            if s & STATE_MASK != RESIDENT || victims.contains(&(pos, i)) {
                continue;
            }
            if s & PINNED != 0 {
                pinned.push(a);
                continue;
            }
            victims.push((pos, i));
        }
        // Unreadable pages stay resident; they go back to the main queue.
        st.queues.main.extend(pinned);
        victims
    }

    /// Evicts up to `n` (at most one batch) of the resident pages; returns
    /// how many. With `UFFDIO_MOVE` each victim's frame is moved out of the
    /// program's view into its store slot and encrypted there: the frame
    /// itself becomes the ciphertext, and no plaintext frame is ever freed.
    fn evict(&self, st: &mut State, n: usize) -> usize {
        let t0 = Instant::now();
        let victims = Self::victims(st, n.min(self.batch));
        let mut done = 0;
        for &(pos, i) in &victims {
            let r = &mut st.ranges[pos];
            let addr = r.base + i * PAGE;
            if self.mechanism == Mechanism::Move {
                let slot = r.store_page(i).as_mut_ptr();
                if self
                    .uffd
                    .move_pages(slot as u64, addr as u64, PAGE as u64, false)
                    .is_ok()
                {
                    let State { ranges, keys, .. } = &mut *st;
                    let r = &mut ranges[pos];
                    encrypt_page(keys, r.keyid, addr, r.store_page(i));
                    st.mark_evicted(pos, i);
                    done += 1;
                    continue;
                }
            }
            // No UFFDIO_MOVE, or the page is shared with a forked child.
            if self.evict_wp(st, pos, i).is_ok() {
                done += 1;
            } else {
                st.queues.main.push_back(addr);
            }
        }
        let c = self.stats.counters();
        c.evictions.fetch_add(done as u64, Ordering::Relaxed);
        c.evict_ns.fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
        c.resident.store(st.resident as u64, Ordering::Relaxed);
        c.evicted.store(st.evicted as u64, Ordering::Relaxed);
        done
    }

    /// Write-protect eviction: the writers of the page wait while it is
    /// encrypted and dropped, then fault it back in. The ciphertext goes to
    /// the store slot by `UFFDIO_COPY` when the store is registered (Move
    /// mechanism: touching its empty slot would fault on this very thread).
    fn evict_wp(&self, st: &mut State, pos: usize, i: usize) -> io::Result<()> {
        let addr = st.ranges[pos].base + i * PAGE;
        self.uffd.write_protect(addr as u64, PAGE as u64, true)?;
        let saved = {
            let State {
                ranges,
                keys,
                bounce,
                ..
            } = &mut *st;
            let r = &mut ranges[pos];
            // SAFETY: the page is resident and readable (not pinned) and,
            // being write-protected, nobody changes it while it is read.
            bounce.copy_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, PAGE) });
            encrypt_page(keys, r.keyid, addr, bounce);
            let saved = if self.mechanism == Mechanism::Move {
                self.uffd.copy(r.store_page(i).as_ptr() as u64, bounce)
            } else {
                r.store_page(i).copy_from_slice(bounce);
                Ok(())
            };
            bounce.fill(0);
            saved
        };
        saved.inspect_err(|_| {
            let _ = self.uffd.write_protect(addr as u64, PAGE as u64, false);
        })?;
        // SAFETY: the page's contents are saved as ciphertext; dropping it
        // makes the next access fault it back in.
        let dropped = unsafe { uffd::madvise_direct(addr as *mut u8, PAGE, libc::MADV_DONTNEED) };
        // Clear any write-protect marker and release waiting writers: they
        // fault on the now-missing page and wait for it to come back.
        let _ = self.uffd.write_protect(addr as u64, PAGE as u64, false);
        if let Err(e) = dropped {
            // Still resident: its store slot goes empty again.
            let slot = st.ranges[pos].store_page(i).as_mut_ptr();
            // SAFETY: the slot was just filled and is owned by the range.
            unsafe { release_slot(slot) };
            return Err(e);
        }
        st.mark_evicted(pos, i);
        self.stats
            .counters()
            .wp_evictions
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Decrypts every evicted page of range `pos` back into place.
    fn restore_range(&self, st: &mut State, pos: usize) -> Result<(), ShieldError> {
        for i in 0..st.ranges[pos].pages {
            if st.ranges[pos].state(i) & STATE_MASK == EVICTED {
                self.bring_in(st, pos, i).map_err(os("UFFDIO_COPY"))?;
            }
        }
        Ok(())
    }
}

/// Encrypts the plaintext `page` at `addr` in place under `keyid`'s key
/// (the page's address is the tweak).
fn encrypt_page(keys: &[Option<SecretBox<Xts>>], keyid: u16, addr: usize, page: &mut [u8]) {
    if let Some(key) = &keys[usize::from(keyid)] {
        // A 4096-byte unit is always a valid XTS length.
        let _ = key.encrypt_unit(addr as u128, page);
    }
}

/// Wipes a store slot and hands its frame back to the kernel: the slot is
/// empty again (Move mechanism: a slot holds a frame only while its page is
/// evicted).
///
/// # Safety
/// `slot` must be a present, writable store page that no Rust object lives
/// in and whose contents are no longer needed.
unsafe fn release_slot(slot: *mut u8) {
    // SAFETY: the caller's contract.
    unsafe {
        zeroize_page(slot);
        let _ = uffd::madvise_direct(slot, PAGE, libc::MADV_DONTNEED);
    }
}

/// Writes the plaintext of page `i` of `r` into `dst`: the decrypted
/// ciphertext of an evicted page, or zeros.
fn plaintext_into(
    r: &Range,
    i: usize,
    keys: &[Option<SecretBox<Xts>>],
    dst: &mut [u8],
) -> io::Result<()> {
    if r.state(i) & STATE_MASK != EVICTED {
        dst.fill(0);
        return Ok(());
    }
    // SAFETY: the store holds `pages * PAGE` bytes owned by the range and
    // i < pages; nothing writes it meanwhile (the State is borrowed).
    dst.copy_from_slice(unsafe { std::slice::from_raw_parts(r.store.add(i * PAGE), PAGE) });
    let key = keys[usize::from(r.keyid)]
        .as_ref()
        .ok_or_else(|| io::Error::other("no key for the range's KeyID"))?;
    key.decrypt_unit((r.base + i * PAGE) as u128, dst)
        .map_err(|e| io::Error::other(e.to_string()))
}

static START_HOOK: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Sets a function the handler thread runs first (once per process): a
/// preload library uses it to mark the thread as its own, so that what the
/// C library allocates for that thread stays outside protected memory.
pub fn set_thread_start_hook(f: fn()) {
    let _ = START_HOOK.set(f);
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
