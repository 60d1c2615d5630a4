//! Transparent protection of a program's memory from user space: the
//! software analogue of the `encrypt_mprotect(addr, len, prot, keyid)` call
//! proposed for Linux MKTME.
//!
//! A protected range is registered with a userfaultfd. At most a window of
//! its pages is plaintext at any time; the others are missing from the page
//! tables and held as AES-XTS ciphertext (tweak = page address, key per
//! KeyID, key schedules in `memfd_secret` memory) in a store of ordinary
//! memory. Any access to a missing page, by the program or by the kernel on
//! its behalf (`read(2)` into it, `write(2)` from it), stops the accessing
//! thread until a handler thread decrypts the page and maps it back; the
//! victims are chosen by a 2Q policy (see `state::Queues`).
//!
//! What one fault costs decides what protection costs, so the fault path is
//! built to resolve as much as a fault allows:
//! - a fault that continues a sequential scan brings in a run of pages (1,
//!   2, 4, ... 64: `policy::Streams`), never-written and evicted pages alike,
//!   with one `UFFDIO_COPY` or `UFFDIO_MOVE` per run; victims that are
//!   neighbours leave in one move too;
//! - the window either stays fixed or adapts to the working set within a
//!   bound that is never exceeded ([`Bound`], `policy::Window`);
//! - the handler runs at `SCHED_IDLE` on the CPU the program faults from, so
//!   the scheduler puts the woken thread back on that CPU instead of the
//!   idle one (a wake-up across vCPUs costs tens of microseconds on a VM); a
//!   watchdog returns it to the normal policy when it is starved (see
//!   `guard`).
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
//! system calls on protected buffers fail with EFAULT), run the weaker
//! eviction without the caller accepting it, or let an adaptive window grow
//! past its bound.

mod cpu;
mod handler;
pub mod host;
mod loss;
mod pagekey;
mod policy;
mod queue;
pub mod region;
mod shared;
pub mod start;
mod state;
mod stats;
mod sweep;
mod threads;
mod zeropool;

pub use pagekey::{page_key_file, watch_supervisor, PageKey};
pub use policy::{Bound, RUN_MAX};
pub use shared::{
    parse_shared_policy, SharedConfig, SharedKind, SharedMode, SharedShield, MAX_MAPPINGS,
    MAX_VIEWS,
};
pub use stats::{age_bucket, age_bucket_end, Counters, Snapshot, StatsFile, AGE_BUCKETS};
pub use sweep::Budget;
pub use threads::{register_thread, reset_after_fork, unregister_thread};

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use memveil_secmem::{Level, Policy};
use memveil_sys::uffd::{self, Uffd};

use handler::{Inner, Threads};
use state::{Range, KEEP, PINNED, RDONLY};

/// Page size the shield works in (x86-64 base pages).
pub const PAGE: usize = 4096;
/// Number of KeyIDs (6 KeyID bits, as the engine's default).
pub const KEYIDS: u16 = 64;
/// Default plaintext window in pages (16 MiB), and the least an adaptive
/// window bounded by a percentage keeps.
pub const DEFAULT_WINDOW: usize = 4096;
/// [`Config::window`] for no plaintext bound: a cost budget alone
/// ([`Config::budget`]) decides what is encrypted.
pub const UNBOUNDED: usize = usize::MAX;

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

/// Settings of a [`Shield`]: a plaintext bound ([`Config::window`],
/// [`Config::max_plaintext`]), a cost budget ([`Config::budget`]), or both,
/// the bound then winning (it is never exceeded to meet the budget).
#[derive(Debug, Clone)]
pub struct Config {
    /// Most pages kept as plaintext at once (at least 1); with
    /// [`Config::max_plaintext`], the least an adaptive window keeps;
    /// [`UNBOUNDED`]: no bound (then a budget is required, and ranges are
    /// registered with the userfaultfd chunk by chunk as the sweep needs
    /// them, so that first touches of fresh memory stay the kernel's own
    /// page faults).
    pub window: usize,
    /// Sweep pages idle longer than their period within this budget of the
    /// program's time (see the crate docs); `None`: no sweep.
    pub budget: Option<Budget>,
    /// Adapt the window to the working set, up to this bound (`None`: the
    /// window stays at [`Config::window`]).
    pub max_plaintext: Option<Bound>,
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
    /// Run the handler at `SCHED_IDLE` while a watchdog sees it is not
    /// starved (see the crate docs). Only used when the process may run on
    /// more than one CPU and may leave `SCHED_IDLE` again (root, or
    /// `RLIMIT_NICE` room).
    pub idle_handler: bool,
    /// Bring in runs of pages on sequential faults (tests turn it off to
    /// count single-page faults).
    pub readahead: bool,
    /// Fill never-written pages from a pool of zeroed frames that a
    /// `SCHED_IDLE` thread populates ahead (Move mechanism, more than one
    /// CPU; tests turn it off to compare).
    pub zero_pool: bool,
    /// The key of the host KeyID this process runs under (`memveil run
    /// --keyid`): the heap under that KeyID and the shared memory use it
    /// instead of fresh random keys.
    pub page_key: Option<std::sync::Arc<PageKey>>,
    /// The host's ledger ([`host`]), open on this descriptor (`memveil run`
    /// leaves it to the program): the sweep then draws on the host's budget
    /// too. `None`: this process's own budget only.
    pub host_fd: Option<i32>,
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
    /// Starts as [`HandlerCpu::Current`] and moves to the CPU of the thread
    /// that faults when it differs (the scheduler moves unpinned programs
    /// about): on every fault for threads that called [`register_thread`]
    /// (their CPU is a memory read), every [`FOLLOW_EVERY`] faults for others.
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
            max_plaintext: None,
            budget: None,
            spin: Duration::ZERO,
            policy: Policy::secret_only(),
            accept_unwiped_free: false,
            force_write_protect: false,
            evict_batch: 32,
            handler_cpu: HandlerCpu::Follow,
            idle_handler: true,
            readahead: true,
            zero_pool: true,
            page_key: None,
            host_fd: None,
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
    /// Neither a plaintext bound nor a cost budget: nothing would ever be
    /// encrypted.
    #[error(
        "no guarantee: a shield needs a plaintext bound (window, max_plaintext) or a cost \
         budget, or it would never encrypt anything"
    )]
    NoGuarantee,
    /// The host KeyID's page key could not be had.
    #[error("{0}")]
    PageKey(String),
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

/// The shield: one userfaultfd, one handler thread (and its watchdog), the
/// key table and the plaintext window shared by all protected ranges.
pub struct Shield {
    inner: Arc<Inner>,
    threads: Option<Threads>,
}

impl Shield {
    /// Creates a shield with its handler thread. Counters go to `stats`
    /// (a shared file [`StatsFile::create`] or [`StatsFile::private`]).
    ///
    /// # Errors
    /// [`ShieldError::NotPermitted`], [`ShieldError::Unsupported`],
    /// [`ShieldError::UnwipedEviction`], or secret memory errors.
    pub fn new(cfg: &Config, stats: StatsFile) -> Result<Self, ShieldError> {
        let (inner, threads) = handler::start(cfg, stats)?;
        Ok(Self {
            inner,
            threads: Some(threads),
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
        if base.checked_add(len).is_none() {
            return Err(bad("wraps around the address space"));
        }
        if keyid >= KEYIDS {
            return Err(ShieldError::BadKeyId(keyid));
        }
        let inner = &self.inner;
        let mut st = inner.lock();
        if st
            .ranges
            .iter()
            .any(|r| base < r.end() && r.base < base + len)
        {
            return Err(bad("overlaps a protected range"));
        }
        inner.ensure_key(&mut st, keyid)?;
        let pages = len / PAGE;
        // On any failure below `range` unmaps its own mappings as it drops.
        let range =
            Range::map(base, pages, keyid, inner.lazy).map_err(os("mmap range bookkeeping"))?;
        if inner.mechanism == Mechanism::Move {
            // Evicted frames are moved into their slots, which the kernel
            // allows only into a range registered here. The handler touches
            // a slot only while it holds a frame, so it never faults on one.
            inner
                .uffd
                .register(range.store as u64, len as u64, uffd::MODE_MISSING)
                .map_err(os("UFFDIO_REGISTER store"))?;
        }
        // Registered first (eagerly: under a bound every page counts), then
        // the pages already holding data are found: a page touched meanwhile
        // faults to the handler, which waits for this lock. Lazily
        // registered ranges are left to the sweep's scan.
        let present = if inner.lazy {
            Vec::new()
        } else {
            inner
                .uffd
                .register(base as u64, len as u64, uffd::MODE_MISSING | uffd::MODE_WP)
                .map_err(os("UFFDIO_REGISTER"))?;
            match range.present(0, pages) {
                Ok(p) => p,
                Err(e) => {
                    let _ = inner.uffd.unregister(base as u64, len as u64);
                    return Err(os("mincore")(e));
                }
            }
        };
        if prot != libc::PROT_READ | libc::PROT_WRITE {
            // SAFETY: the caller owns the range (function contract).
            if let Err(e) = unsafe { uffd::mprotect_direct(addr, len, prot) } {
                if !inner.lazy {
                    let _ = inner.uffd.unregister(base as u64, len as u64);
                }
                return Err(os("mprotect")(e));
            }
        }
        let pos = st.ranges.partition_point(|r| r.base < base);
        st.ranges.insert(pos, range);
        let now = st.now_ms();
        for i in present {
            st.mark_found(pos, i, now);
        }
        if prot & libc::PROT_READ == 0 {
            st.set_flags(base, len, PINNED, true);
        } else if prot & libc::PROT_WRITE == 0 {
            st.set_flags(base, len, RDONLY, true);
        }
        let c = inner.stats.counters();
        c.pages_protected.fetch_add(pages as u64, Ordering::Relaxed);
        inner.shrink_to_window(&mut st);
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
        let t0 = std::time::Instant::now();
        let mut st = self.inner.lock();
        let (emptied, release) = st.discard(addr, len, &self.inner.stats);
        self.inner.unregister_empty(&mut st, &emptied);
        drop(st);
        self.inner.program_time_less(t0, release);
    }

    /// Counts `calls` calls of a preloaded allocator on the program's
    /// threads, `call_ps` picoseconds each beyond what the C library's
    /// allocator takes (measured by the caller in the process), as the
    /// shield's cost: the program loses that time against a plain run, as
    /// it loses the time of the shield's own work on its threads (issue 33,
    /// item 4). The figure is a fraction of a ns: whole ns floored 1.9 ns a
    /// call to 1.
    pub fn count_allocator(&self, calls: u64, call_ps: u64) {
        let c = self.inner.stats.counters();
        c.alloc_calls.fetch_add(calls, Ordering::Relaxed);
        c.alloc_ns
            .fetch_add(calls.saturating_mul(call_ps) / 1000, Ordering::Relaxed);
        c.alloc_call_ns
            .store(call_ps.saturating_add(500) / 1000, Ordering::Relaxed);
    }

    /// Called by the thread that serves a program's memory calls (the
    /// loader's agent: seccomp notifications) as it starts. Its CPU clock
    /// counts from then on as the shield's, in the host's CPU the budgets
    /// draw and in what the program loses (each caller waits for its
    /// answer, as a faulting thread waits for the handler), and its time
    /// in the shield's own calls is not counted again
    /// ([`crate::Counters::program_ns`]). The callers' side of each round
    /// trip (their entry, the filter, the switch to the agent and back) is
    /// on their own threads' clocks and is not counted.
    pub fn enter_agent(&self) {
        self.inner.cpu.enter_agent();
    }

    /// Counts `n` memory calls served by the agent
    /// ([`crate::Counters::served_calls`]).
    pub fn count_served(&self, n: u64) {
        self.inner
            .stats
            .counters()
            .served_calls
            .fetch_add(n, Ordering::Relaxed);
    }

    /// Counts the time since `t0` as the shield's work on a thread of the
    /// program (a preloaded allocator measuring itself).
    pub fn count_program_time(&self, t0: std::time::Instant) {
        self.inner.program_time(t0);
    }

    /// Records that the program's allocator handed out `[addr, addr+len)`
    /// (a lazily registered range's scan looks only at chunks so marked;
    /// without a budget alone, nothing to do).
    pub fn note_in_use(&self, addr: usize, len: usize) {
        if !self.inner.lazy || len == 0 {
            return;
        }
        let t0 = std::time::Instant::now();
        let mut st = self.inner.lock();
        let end = addr.saturating_add(len);
        for r in &mut st.ranges {
            let lo = addr.max(r.base);
            let hi = end.min(r.end());
            if lo >= hi {
                continue;
            }
            if let Some(c) = r.chunks.as_mut() {
                let first = (lo - r.base) / PAGE / state::CHUNK_PAGES;
                let last = (hi - r.base - 1) / PAGE / state::CHUNK_PAGES;
                c.in_use[first..=last].fill(true);
            }
        }
        drop(st);
        self.inner.program_time(t0);
    }

    /// How many chunks of the lazily registered ranges are marked in use
    /// ([`Shield::note_in_use`]): the chunks the budget's scan walks for
    /// data (tests).
    #[doc(hidden)]
    #[must_use]
    pub fn chunks_in_use(&self) -> usize {
        let st = self.inner.lock();
        st.ranges
            .iter()
            .filter_map(|r| r.chunks.as_ref())
            .map(|c| c.in_use.iter().filter(|u| **u).count())
            .sum()
    }

    /// Publishes what the shield has cost so far and the time it has
    /// protected the process, up to now (the watchdog does every tick):
    /// called as the process exits, so that the statistics cover its last
    /// moments too. The handler also leaves `SCHED_IDLE` then: the
    /// process's exit waits for every thread to die, and a `SCHED_IDLE`
    /// thread runs its exit only once no other thread wants its CPU (on a
    /// loaded host, many milliseconds), time a plain run does not wait.
    pub fn flush_stats(&self) {
        self.inner.integrate(true);
        let _ = handler::set_handler_policy(&self.inner, memveil_sys::process::SchedPolicy::Normal);
    }

    /// Records the protection the program gave pages (`mprotect`): pages it
    /// made unreadable are pinned (never evicted, as the handler could not
    /// read them), pages it made read-only are not wiped by a discard (they
    /// cannot be written); `PROT_READ|PROT_WRITE` clears both.
    pub fn set_protection(&self, addr: usize, len: usize, prot: libc::c_int) {
        let mut st = self.inner.lock();
        let readable = prot & libc::PROT_READ != 0;
        st.set_flags(addr, len, PINNED, !readable);
        st.set_flags(addr, len, RDONLY, readable && prot & libc::PROT_WRITE == 0);
    }

    /// Books `bytes` of shared memory the program mapped outside the shield,
    /// as the user accepted (reported in the statistics).
    pub fn note_shared_unprotected(&self, bytes: u64) {
        self.inner
            .stats
            .counters()
            .shared_unprotected
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Keeps the pages of `[addr, addr+len)` resident (`keep`) or lets them
    /// be evicted again: for a thread's control block, which the kernel
    /// writes as the thread exits (its id, cleared for `pthread_join`; its
    /// robust futex list), when a fault can no longer be waited for. Kept
    /// pages still count as plaintext, and are wiped when discarded; an
    /// evicted page comes back on its next touch and then stays.
    pub fn keep_resident(&self, addr: usize, len: usize, keep: bool) {
        let mut st = self.inner.lock();
        st.set_flags(addr, len, KEEP, keep);
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

    /// In a child after `fork`, on the shield the parent made: closes its
    /// userfaultfd, which the child inherited (its registrations, handler
    /// thread and secret-memory keys were not), so the child holds nothing of
    /// the parent's fault handling. The shield is dead from then on.
    ///
    /// # Safety
    /// Only in a forked child, on a shield made before the fork, and the
    /// shield must never be used or dropped afterwards (its descriptor number
    /// may be reused).
    pub unsafe fn abandon_in_forked_child(&self) {
        // SAFETY: the caller promises this shield is never used or dropped
        // again, so nothing reads or closes the descriptor after this.
        let _ = unsafe { memveil_sys::fdguard::close_held(self.inner.uffd.raw_fd()) };
        // SAFETY: as above; the handler that read these files is not in
        // the child.
        unsafe { self.inner.cpu.close_files_in_forked_child() };
        // The parent's ciphertext store is no use to the child (the fork
        // came after `freeze`, so the child's copy of every range is
        // plaintext in place): drop the child's copy of it, which would
        // otherwise double the address space it holds and put the
        // parent's ciphertext in the child's core dumps. Skipped if the
        // lock was held by a thread that did not survive the fork.
        if let Some(mut st) = self.inner.try_lock() {
            for r in &mut st.ranges {
                r.drop_store();
            }
        }
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
        if let Some(t) = self.threads.take() {
            t.stop(&self.inner);
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

static START_HOOK: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Sets a function the shield's threads run first (once per process): a
/// preload library uses it to mark them as its own, so that what the C
/// library allocates for them stays outside protected memory.
pub fn set_thread_start_hook(f: fn()) {
    let _ = START_HOOK.set(f);
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Measures what a fault's hand-off costs the faulting thread on this
/// machine beyond the handler's own work (entering the kernel, the two
/// thread switches, the wake-ups), in ns: the [`Budget::fault_ns`] a cost
/// budget counts per fault. A shield of its own with a 16-page window and
/// no readahead takes 512 faults on a 128-page range (about 10 ms here);
/// the mean time per fault seen by the touching thread, less the handler's
/// CPU time per fault (its thread clock, which the budget counts apart), is
/// the hand-off.
///
/// # Errors
/// The shield's errors (no userfaultfd, no secret memory...), or a
/// mapping that could not be made.
pub fn measure_handoff_ns() -> Result<u64, ShieldError> {
    const PAGES: usize = 128;
    let cfg = Config {
        window: 16,
        readahead: false,
        zero_pool: false,
        ..Config::default()
    };
    let shield = Shield::new(&cfg, StatsFile::private())?;
    let map = uffd::DirectMap::new(PAGES * PAGE).map_err(os("mmap calibration range"))?;
    let base = map.as_ptr();
    // SAFETY: a fresh anonymous private mapping owned by `map`, reached
    // only through the volatile accesses below until it is discarded and
    // unprotected, before `map` unmaps it.
    unsafe { shield.encrypt_mprotect(base, PAGES * PAGE, libc::PROT_READ | libc::PROT_WRITE, 1)? };
    let touch = |i: usize| {
        // SAFETY: page `i % PAGES` of the protected range, 8-aligned.
        unsafe {
            let p = base.add((i % PAGES) * PAGE).cast::<u64>();
            p.write_volatile(p.read_volatile().wrapping_add(1));
        }
    };
    for i in 0..PAGES {
        touch(i);
    }
    let before = shield.stats();
    let handler_before = shield.inner.cpu.handler_ns();
    let t = std::time::Instant::now();
    // A stride coprime with the range: every touch lands outside the
    // window, and no two in a row are neighbours.
    for k in 0..4 * PAGES {
        touch(k * 37);
    }
    let elapsed = nanos(t.elapsed());
    let after = shield.stats();
    let handler_cpu = shield.inner.cpu.handler_ns().saturating_sub(handler_before);
    // SAFETY: nothing lives in the range; its contents may become zero.
    unsafe { shield.discard(base as usize, PAGES * PAGE) };
    let _ = shield.unprotect(base, PAGES * PAGE);
    drop(shield);
    drop(map);
    let faults = after.handoffs.saturating_sub(before.handoffs).max(1);
    // The handler's CPU (its thread clock: reads and wake-ups included, as
    // the budget counts it), never less than its timed sections.
    let handler = after
        .handler_ns
        .saturating_sub(before.handler_ns)
        .max(handler_cpu);
    Ok(elapsed.saturating_sub(handler) / faults)
}
