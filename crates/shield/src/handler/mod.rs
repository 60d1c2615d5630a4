//! The fault path: the handler thread reads faults from the userfaultfd,
//! makes room in the window (neighbouring victims leave in one move), brings
//! pages in (a run of them when the fault continues a sequential stream),
//! and only then, with the lock released, wakes the faulting threads.
//!
//! Waking last matters: a thread woken on the handler's CPU preempts a
//! `SCHED_IDLE` handler at once, and a handler preempted while holding the
//! lock would stall every other thread that needs it (a `free` in the
//! program, the watchdog).

mod budget;
mod guard;
mod hold;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use memveil_cipher::Xts;
use memveil_secmem::{Level, SecretBox, SecretPool};
use memveil_sys::process::{SchedPolicy, ThreadStat};
use memveil_sys::stack_thread::{self, StackThread};
use memveil_sys::uffd::{self, Fault, Uffd};

use crate::policy::{Streams, Window, RUN_MAX};
use crate::state::{zeroize_page, State, EVICTED, PINNED, RDONLY, RESIDENT, STATE_MASK};
use crate::sweep::{Budget, Sweep};
use crate::zeropool::ZeroPool;
use crate::{
    mechanism_of, nanos, open_uffd, os, Config, HandlerCpu, Mechanism, ShieldError, StatsFile,
    FOLLOW_EVERY, KEYIDS, PAGE, START_HOOK,
};

/// Source of zeros for never-written pages (read-only data, outside any
/// protected range): a run of them is filled with one `UFFDIO_COPY`.
static ZEROS: [u8; RUN_MAX * PAGE] = [0; RUN_MAX * PAGE];

/// Stack of the handler and watchdog threads.
const HANDLER_STACK: usize = 256 * 1024;

pub(crate) struct Inner {
    pub(crate) uffd: Uffd,
    pub(crate) mechanism: Mechanism,
    batch: usize,
    spin: std::time::Duration,
    handler_cpu: Option<usize>,
    /// [`HandlerCpu::Follow`], and the kernel reports faulting threads.
    follow: bool,
    readahead: bool,
    pub(crate) level: Level,
    state: Mutex<State>,
    pub(crate) stats: StatsFile,
    stop: AtomicBool,
    /// A registered page that is never filled except to stop the handler:
    /// [`Threads::stop`] touches it, so a handler asleep in `read(2)` wakes,
    /// maps zeros there (releasing the toucher) and sees `stop`.
    doorbell: usize,
    pool: SecretPool,
    /// Zeroed frames for never-written pages, filled ahead (Move mechanism
    /// and more than one CPU; see [`crate::zeropool`]).
    zeros: Option<Arc<ZeroPool>>,
    /// The host KeyID's key (`memveil run --keyid`).
    pub(crate) page_key: Option<Arc<crate::PageKey>>,
    /// The cost budget, when one is in force.
    pub(crate) budget: Option<Budget>,
    /// Ranges are registered chunk by chunk as the sweep needs them (a
    /// budget without a plaintext bound; see `state::Chunks`).
    pub(crate) lazy: bool,
    /// The handler thread's id, for the watchdog.
    pub(crate) handler_tid: AtomicU32,
    /// The CPU the handler follows the program's faulting thread to
    /// ([`HandlerCpu::Follow`]; `usize::MAX`: none known): the watchdog
    /// sweeps from it, or from the other CPUs when the program keeps it busy (see `guard::Side`).
    pub(crate) handler_on: AtomicUsize,
    /// The CPU time of the shield's threads (the budget counts it).
    pub(crate) cpu: crate::cpu::ShieldCpu,
    /// The program's wait for a CPU behind the watchdog and the filler.
    pub(crate) contention: crate::loss::Contention,
    /// The watchdog's view of progress: incremented when the handler takes
    /// a batch of faults in hand and again when it has woken their threads,
    /// so it is odd while a batch is in hand.
    pub(crate) progress: AtomicU64,
    /// The watchdog's sleep, cut short by [`Threads::stop`] or a poke.
    pub(crate) guard_stop: Mutex<bool>,
    pub(crate) guard_wake: Condvar,
    /// When the watchdog (the sweep) wakes next, ms since the shield
    /// started.
    pub(crate) guard_at: AtomicU64,
    /// Set by [`Inner::poke_guard`]: the watchdog looks again at once.
    pub(crate) poked: AtomicBool,
    /// When the shield started (for `guard_at`, without the lock).
    epoch: Instant,
    /// This shield's share of the host's budget (`Config::host_fd`); only
    /// the watchdog takes the lock.
    pub(crate) host: Option<Mutex<crate::host::HostShare>>,
    /// Whether the host's bucket had room at the last sweep step (the
    /// scan registers chunks only then).
    pub(crate) host_open: AtomicBool,
}

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
pub(crate) struct HandlerStack {
    base: *mut u8,
    len: usize,
}

// SAFETY: the stack is an owned mapping with no thread affinity.
unsafe impl Send for HandlerStack {}

impl HandlerStack {
    pub(crate) fn new() -> Result<Box<Self>, ShieldError> {
        Ok(Box::new(HandlerStack {
            base: uffd::map_stack_direct(HANDLER_STACK).map_err(os("mmap handler stack"))?,
            len: HANDLER_STACK,
        }))
    }
}

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

/// The shield's threads: the fault handler and, when it has work, the
/// watchdog; the filler of the zero pool; the thread that holds the
/// userfaultfd out of the program's reach ([`hold`]).
pub(crate) struct Threads {
    handler: StackThread<HandlerStack>,
    guard: Option<StackThread<HandlerStack>>,
    zeros: Option<StackThread<HandlerStack>>,
    hold: Option<hold::Hold>,
}

impl Threads {
    /// Stops and joins both threads.
    pub(crate) fn stop(self, inner: &Inner) {
        if let (Some(t), Some(z)) = (self.zeros, inner.zeros.as_ref()) {
            z.stop();
            drop(t.join());
        }
        if let Some(g) = self.guard {
            *inner
                .guard_stop
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = true;
            inner.guard_wake.notify_all();
            drop(g.join());
        }
        inner.stop.store(true, Ordering::SeqCst);
        let bell = inner.doorbell as *const u8;
        // SAFETY: the doorbell is a page of our own, registered missing: the
        // read faults and waits until the handler maps zeros there, which
        // wakes a handler asleep in read(2) (one that is busy finds the
        // fault on its next read).
        let _ = unsafe { bell.read_volatile() };
        drop(self.handler.join());
        if let Some(h) = self.hold {
            h.stop();
        }
    }
}

/// The one thread that took every fault of `faults` (`None`: several, or
/// the kernel does not say).
fn single_thread(faults: &[Fault]) -> Option<u32> {
    let tid = faults.first()?.tid;
    (tid != 0 && faults.iter().all(|f| f.tid == tid)).then_some(tid)
}

/// Source of the zeros mapped at the doorbell.
fn doorbell_zeros() -> &'static [u8] {
    &ZEROS[..PAGE]
}

/// Creates the shield's state and starts its threads.
pub(crate) fn start(cfg: &Config, stats: StatsFile) -> Result<(Arc<Inner>, Threads), ShieldError> {
    let fd = open_uffd()?;
    let offered = Uffd::offered_features().map_err(os("UFFDIO_API"))?;
    let mechanism = mechanism_of(offered, cfg.force_write_protect)?;
    if mechanism == Mechanism::WriteProtect
        && offered & uffd::FEATURE_MOVE == 0
        && !cfg.accept_unwiped_free
    {
        return Err(ShieldError::UnwipedEviction);
    }
    // Nothing to follow, and no placement to win with SCHED_IDLE, when the
    // process (its main thread) may run on one CPU only (`memveil run --cpu
    // N`, taskset): a look costs a system call.
    let many_cpus = memveil_sys::process::allowed_cpus(std::process::id()).is_none_or(|n| n > 1);
    let follow = cfg.handler_cpu == HandlerCpu::Follow
        && offered & uffd::FEATURE_THREAD_ID != 0
        && many_cpus;
    fd.handshake(
        uffd::FEATURE_PAGEFAULT_FLAG_WP | if follow { uffd::FEATURE_THREAD_ID } else { 0 },
    )
    .map_err(os("UFFDIO_API"))?;
    let window = Window::new(cfg.window, cfg.max_plaintext);
    let bounded = cfg.window != crate::UNBOUNDED || cfg.max_plaintext.is_some();
    if !bounded && cfg.budget.is_none() {
        return Err(ShieldError::NoGuarantee);
    }
    let min_window = cfg.window.max(1);
    let batch = cfg.evict_batch.clamp(1, (min_window / 4).max(1));
    let pool = SecretPool::new(64 * 1024, cfg.policy)?;
    let epoch = Instant::now();
    let level = pool.level();
    let bounce = pool.alloc_bytes(PAGE)?;
    let doorbell = uffd::map_anonymous_direct(PAGE).map_err(os("mmap doorbell"))?;
    fd.register(doorbell as u64, PAGE as u64, uffd::MODE_MISSING)
        .map_err(os("UFFDIO_REGISTER doorbell"))?;
    let c = stats.counters();
    // No bound: the window and its bound read 0 ("none").
    let shown = |n: usize| if bounded { n as u64 } else { 0 };
    c.window.store(shown(window.size(0)), Ordering::Relaxed);
    c.bound.store(shown(window.limit(0)), Ordering::Relaxed);
    if let Some(b) = cfg.budget {
        c.budget_percent
            .store(u64::from(b.as_percent()), Ordering::Relaxed);
        c.fault_floor_ns.store(b.fault_ns, Ordering::Relaxed);
    }
    c.lazy.store(u64::from(!bounded), Ordering::Relaxed);
    c.adaptive
        .store(u64::from(window.adaptive()), Ordering::Relaxed);
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
    let adaptive = window.adaptive();
    // The host's budget, with a budget of its own only. A ledger that
    // cannot be mapped (garbage, another kind of file) leaves the process
    // on its own budget, and says so.
    let host = cfg.budget.and(cfg.host_fd).and_then(|fd| {
        // SAFETY: the descriptor is the inherited ledger's (memveil run's
        // MEMVEIL_SHIELD_HOST_FD), open for the life of the process; it is
        // only borrowed for the mapping.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        match crate::host::HostShare::join(fd) {
            Ok(h) => Some(Mutex::new(h)),
            Err(e) => {
                eprintln!(
                    "memveil-shield: cannot join the host's budget ({e}): this process keeps its \
                     own budget only"
                );
                None
            }
        }
    });
    c.host_joined
        .store(u64::from(host.is_some()), Ordering::Relaxed);
    // Best effort: without the pool, never-written pages are copied in.
    let zeros = (cfg.zero_pool && mechanism == Mechanism::Move && many_cpus)
        .then(ZeroPool::new)
        .and_then(Result::ok)
        .map(Arc::new);
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
        readahead: cfg.readahead,
        level,
        state: Mutex::new(State {
            ranges: Vec::new(),
            queues: crate::state::Queues::default(),
            resident: 0,
            evicted: 0,
            window,
            streams: Streams::default(),
            evictions: 0,
            keys: (0..KEYIDS).map(|_| None).collect(),
            bounce,
            frozen: false,
            bounded,
            sweep: cfg.budget.map(|b| Sweep::new(b, 0)),
            epoch,
            wake_at: u64::MAX,
            unseen: 0,
        }),
        stats,
        stop: AtomicBool::new(false),
        doorbell: doorbell as usize,
        pool,
        zeros,
        page_key: cfg.page_key.clone(),
        budget: cfg.budget,
        lazy: !bounded,
        handler_tid: AtomicU32::new(0),
        handler_on: AtomicUsize::new(usize::MAX),
        cpu: crate::cpu::ShieldCpu::default(),
        contention: crate::loss::Contention::default(),
        progress: AtomicU64::new(0),
        guard_stop: Mutex::new(false),
        guard_wake: Condvar::new(),
        guard_at: AtomicU64::new(u64::MAX),
        poked: AtomicBool::new(false),
        epoch,
        host,
        host_open: AtomicBool::new(true),
    });
    // First, so that no fault is ever read before the file is held: from
    // then on a close of its number behind the shield's back leaves the
    // ranges registered and the faulting threads blocked (see `hold`).
    let hold = match hold::Hold::start(inner.uffd.raw_fd()) {
        Ok(h) => Some(h),
        Err(e) => {
            eprintln!(
                "memveil-shield: cannot hold the userfaultfd out of the program's reach ({e}): a \
                 raw close or close_range system call on its descriptor could let the program \
                 read zeros in place of evicted pages before the shield ends it"
            );
            None
        }
    };
    let worker = Arc::clone(&inner);
    // A thread started directly on its stack runs our code first: no
    // runtime prologue allocates before the start hook has run.
    let handler = stack_thread::spawn(HandlerStack::new()?, move || worker.serve())
        .map_err(os("spawn handler thread"))?;
    let idle = cfg.idle_handler && many_cpus && cfg.spin.is_zero();
    let guard = if idle || adaptive || cfg.budget.is_some() {
        let g = Arc::clone(&inner);
        let spawned = stack_thread::spawn(HandlerStack::new()?, move || guard::run(&g, idle));
        match spawned {
            Ok(t) => Some(t),
            Err(e) => {
                Threads {
                    handler,
                    guard: None,
                    zeros: None,
                    hold,
                }
                .stop(&inner);
                return Err(os("spawn watchdog thread")(e));
            }
        }
    } else {
        None
    };
    // No filler, no pool: `front` on a pool nobody fills stays empty.
    let zeros = inner.zeros.as_ref().and_then(|z| {
        let (z, i) = (Arc::clone(z), Arc::clone(&inner));
        let stack = HandlerStack::new().ok()?;
        stack_thread::spawn(stack, move || {
            i.cpu.enter(crate::cpu::Worker::Zeros);
            z.fill();
        })
        .ok()
    });
    inner.stats.counters().pool_pages.store(
        if zeros.is_some() {
            crate::zeropool::POOL_PAGES as u64
        } else {
            0
        },
        Ordering::Relaxed,
    );
    Ok((
        inner,
        Threads {
            handler,
            guard,
            zeros,
            hold,
        },
    ))
}

/// Why a page is brought in: it is reported in different counters.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Why {
    /// The page a thread faulted on.
    Fault,
    /// A page after it in the same run (readahead).
    Ahead,
    /// Brought back wholesale (before fork, on unprotect).
    Restore,
}

/// Ranges to wake once the lock is released: `(address, bytes)`.
type Wakes = Vec<(u64, u64)>;

impl Inner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lock, if nobody holds it.
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    pub(crate) fn ensure_key(&self, st: &mut State, keyid: u16) -> Result<(), ShieldError> {
        let slot = usize::from(keyid);
        if st.keys[slot].is_some() {
            return Ok(());
        }
        st.keys[slot] = Some(match &self.page_key {
            Some(k) if k.keyid() == keyid => k.xts(&self.pool)?,
            _ => random_xts(&self.pool)?,
        });
        Ok(())
    }

    fn serve(&self) {
        if let Some(hook) = START_HOOK.get() {
            hook();
        }
        self.handler_tid
            .store(memveil_sys::process::gettid(), Ordering::Release);
        self.cpu.enter(crate::cpu::Worker::Handler);
        let _ = memveil_sys::process::set_thread_name("memveil-fault");
        let mut on = self.handler_cpu;
        if let Some(cpu) = on {
            if let Err(e) = memveil_sys::process::pin_to_cpu(cpu) {
                eprintln!("memveil-shield: cannot pin the fault handler to CPU {cpu}: {e}");
                on = None;
            }
        }
        let pid = std::process::id();
        let mut until_look = FOLLOW_EVERY;
        let mut stat: Option<ThreadStat> = None;
        let mut faults = [Fault {
            address: 0,
            flags: 0,
            tid: 0,
        }; 64];
        let mut wakes: Wakes = Vec::with_capacity(64);
        let mut last = Instant::now();
        // Without a spin the handler sleeps in poll(2) when no fault waits;
        // the descriptor stays non-blocking, so the read that comes first
        // says whether a fault was waiting (`WaitSplit::before_read`). A
        // blocking descriptor (the handler slept in read(2)) answered every
        // poll with POLLERR, so that question, the handler's before each
        // read and the watchdog's before each sweep step, was its `fdinfo`
        // read as text: 3.5-4.3 us a time here against 0.8 us for a read
        // that finds nothing, on the path of every fault (the handler runs
        // on the faulting thread's CPU).
        let sleeps = self.spin.is_zero();
        // The run delay faults wait for (see `crate::cpu::WaitSplit`); not
        // for a handler that spins between faults, runnable all along.
        let own = self
            .spin
            .is_zero()
            .then(crate::cpu::SchedFile::own)
            .flatten();
        self.cpu.note_file(crate::cpu::FileSlot::Own, own.as_ref());
        let mut split = crate::cpu::WaitSplit::default();
        // The faulting thread's schedstat, kept open while it faults alone
        // (read as each of its batches is read: it waits in its fault).
        let mut faulter: Option<crate::cpu::SchedFile> = None;
        let mut last_tid = 0;
        // The thread the last batch woke alone, and its schedstat then.
        let mut one_before: Option<(u32, crate::cpu::Sched)> = None;
        while !self.stop.load(Ordering::Relaxed) {
            let delay = own
                .as_ref()
                .and_then(crate::cpu::SchedFile::read)
                .map(|d| d.delay);
            let mut n = self.read_batch(&mut faults);
            if let Some(d) = delay {
                split.before_read(d, n > 0);
            }
            if n == 0 && sleeps {
                if let Err(e) = self.uffd.wait(None, -1) {
                    eprintln!("memveil-shield: poll failed: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                n = self.read_batch(&mut faults);
            }
            if n > 0 {
                let mut one = None;
                if own.is_some() {
                    let tid = single_thread(&faults[..n]);
                    // Opened when the same thread faults twice in a row:
                    // threads taking turns cost no open each.
                    if tid.is_some_and(|t| {
                        t == last_tid && faulter.as_ref().is_none_or(|f| f.tid != t)
                    }) {
                        let new = crate::cpu::SchedFile::of(last_tid);
                        self.cpu
                            .note_file(crate::cpu::FileSlot::Faulter, new.as_ref());
                        faulter = new;
                    }
                    last_tid = tid.unwrap_or(0);
                    let now = faulter
                        .as_ref()
                        .filter(|f| Some(f.tid) == tid)
                        .and_then(crate::cpu::SchedFile::read);
                    // The same thread as the last batch's, woken then:
                    // its wait for a CPU since (`sweep::HeldLog`).
                    if let (Some((t, then)), Some(t2), Some(now)) = (one_before, tid, now) {
                        if t == t2 {
                            self.cpu
                                .add_woken_wait(crate::cpu::post_wake_wait(then, now));
                        }
                    }
                    one = tid.zip(now);
                    let at = nanos(self.epoch.elapsed());
                    self.cpu.add_handler_wait(split.after_read(tid, now, at));
                }
                // Odd while a batch is in hand (see `progress`).
                self.progress.fetch_add(1, Ordering::Release);
                one_before = one;
                let cpu = self.handle(&faults[..n], &mut wakes, &mut || {
                    if let Some(d) = own.as_ref().and_then(crate::cpu::SchedFile::read) {
                        let at = nanos(self.epoch.elapsed());
                        self.cpu
                            .add_handler_wait(split.before_wake(d.delay, at, one));
                    }
                });
                self.progress.fetch_add(1, Ordering::Release);
                if self.follow {
                    if let Some(cpu) = cpu {
                        on = self.move_to(cpu, on);
                    } else {
                        until_look = until_look.saturating_sub(n as u64);
                        if until_look == 0 {
                            until_look = FOLLOW_EVERY;
                            on = self.follow_thread(faults[n - 1].tid, pid, &mut stat, on);
                        }
                    }
                    self.handler_on
                        .store(on.unwrap_or(usize::MAX), Ordering::Relaxed);
                }
                last = Instant::now();
                continue;
            }
            if sleeps {
                continue;
            }
            if last.elapsed() < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if let Err(e) = self.uffd.wait(None, 100) {
                eprintln!("memveil-shield: poll failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        // Its files close as it returns: a fork from now on has none to close.
        self.cpu.note_file(crate::cpu::FileSlot::Own, None);
        self.cpu.note_file(crate::cpu::FileSlot::Faulter, None);
        // Stopped before the doorbell rang (or before the fault was read):
        // fill it now, which releases a toucher already waiting and spares
        // one still to come the fault.
        let _ = self.served(self.uffd.copy(self.doorbell as u64, doorbell_zeros()));
    }

    /// Reads the faults waiting (none: 0 at once; the descriptor is
    /// non-blocking) into `faults`.
    fn read_batch(&self, faults: &mut [Fault]) -> usize {
        match self.served(self.uffd.read_faults(faults)) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("memveil-shield: reading faults failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
                0
            }
        }
    }

    /// Ends the program ([`lost_uffd`]) when `res` failed because the
    /// userfaultfd's number was closed behind the shield's back (`EBADF`;
    /// every use of the number goes through here: read, register, copy,
    /// move, wake, write-protect):
    /// the thread a failed copy, move or wake was for stays blocked in its
    /// fault (the file is held, see [`hold`]) and never goes on without its
    /// page. Other errors are the caller's.
    pub(super) fn served<T>(&self, res: io::Result<T>) -> io::Result<T> {
        if let Err(e) = &res {
            if e.raw_os_error() == Some(libc::EBADF) {
                lost_uffd(self.uffd.raw_fd());
            }
        }
        res
    }

    /// Resolves a batch of faults, makes room, then wakes the faulting
    /// threads with the lock released. Returns the CPU of the last faulting
    /// thread when it registered where it runs (see [`crate::threads`]).
    fn handle(
        &self,
        faults: &[Fault],
        wakes: &mut Wakes,
        before_wake: &mut dyn FnMut(),
    ) -> Option<usize> {
        let t0 = Instant::now();
        wakes.clear();
        let cpu = {
            let mut st = self.lock();
            // The faults wait while the watchdog holds the lock (its CPU
            // then is theirs: the loss in `Inner::cost_parts`).
            self.stats
                .counters()
                .handler_lock_ns
                .fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
            if let Some(sw) = st.sweep.as_mut() {
                sw.held.set(self.held_ns());
            }
            let mut handoffs = 0;
            for f in faults {
                if usize::try_from(f.address).is_ok_and(|a| a & !(PAGE - 1) == self.doorbell) {
                    let _ = self.served(self.uffd.copy(self.doorbell as u64, doorbell_zeros()));
                    continue;
                }
                handoffs += 1;
                self.resolve(&mut st, f, wakes);
            }
            self.stats
                .counters()
                .handoffs
                .fetch_add(handoffs, Ordering::Relaxed);
            if !st.frozen && st.resident > st.window_size() {
                // Only when victims were pinned when room was made.
                self.shrink_to_window(&mut st);
            } else {
                self.publish(&st);
            }
            let due = std::mem::replace(&mut st.wake_at, u64::MAX);
            if due < self.guard_at.load(Ordering::Acquire) {
                self.poke_guard();
            }
            // The thread is blocked in the fault just resolved (it is woken
            // below), so its rseq area exists.
            let tid = faults.last().map_or(0, |f| f.tid);
            (self.follow && tid != 0)
                .then(|| crate::threads::cpu_of(tid, |a| st.find(a).is_some()))
                .flatten()
        };
        // The clock stops before the wakes: a woken thread may preempt the
        // handler inside UFFDIO_WAKE, and its run is not the handler's time.
        self.stats
            .counters()
            .handler_ns
            .fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
        before_wake();
        for &(a, len) in wakes.iter() {
            let _ = self.served(self.uffd.wake(a, len));
        }
        cpu
    }

    /// Publishes the window and page counts to the statistics.
    pub(crate) fn publish(&self, st: &State) {
        let c = self.stats.counters();
        let data = st.data_pages() + st.unseen;
        if st.bounded {
            let w = st.window_size() as u64;
            c.window.store(w, Ordering::Relaxed);
            c.max_window.fetch_max(w, Ordering::Relaxed);
            c.bound
                .store(st.window.limit(st.data_pages()) as u64, Ordering::Relaxed);
        }
        let resident = (st.resident + st.unseen) as u64;
        c.resident.store(resident, Ordering::Relaxed);
        c.evicted.store(st.evicted as u64, Ordering::Relaxed);
        c.max_resident.fetch_max(resident, Ordering::Relaxed);
        c.max_data.fetch_max(data as u64, Ordering::Relaxed);
        if let Some(sw) = st.sweep.as_ref() {
            c.quick_swept.store(sw.quiet_swept, Ordering::Relaxed);
            c.quick_back.store(sw.quick_back, Ordering::Relaxed);
        }
    }

    /// Moves the handler to the CPU thread `tid` last ran on when that is
    /// not `on` (the handler's CPU); returns the handler's CPU. `stat`
    /// caches the open stat file of the last thread looked at.
    fn follow_thread(
        &self,
        tid: u32,
        pid: u32,
        stat: &mut Option<ThreadStat>,
        on: Option<usize>,
    ) -> Option<usize> {
        if stat.as_ref().is_none_or(|s| s.tid() != tid) {
            *stat = ThreadStat::open(pid, tid);
        }
        match stat.as_ref().and_then(ThreadStat::read) {
            Some((cpu, _)) => self.move_to(cpu, on),
            None => on,
        }
    }

    /// Moves the handler to `cpu` when it is not there (`on`); returns the
    /// handler's CPU.
    fn move_to(&self, cpu: usize, on: Option<usize>) -> Option<usize> {
        if on == Some(cpu) || memveil_sys::process::pin_to_cpu(cpu).is_err() {
            return on;
        }
        self.stats
            .counters()
            .handler_moves
            .fetch_add(1, Ordering::Relaxed);
        Some(cpu)
    }

    fn resolve(&self, st: &mut State, f: &Fault, wakes: &mut Wakes) {
        let addr = usize::try_from(f.address).unwrap_or(usize::MAX) & !(PAGE - 1);
        let c = self.stats.counters();
        let Some((pos, i)) = st.find(addr) else {
            // Not ours (a scratch page cannot fault): wake so the thread retries.
            c.spurious.fetch_add(1, Ordering::Relaxed);
            wakes.push((addr as u64, PAGE as u64));
            return;
        };
        if !st.ranges[pos].registered(i) {
            // A chunk unregistered since the fault was read (all its pages
            // went back to the kernel): the kernel serves the retry.
            c.spurious.fetch_add(1, Ordering::Relaxed);
            wakes.push((addr as u64, PAGE as u64));
            return;
        }
        let s = st.ranges[pos].state(i) & STATE_MASK;
        if s == RESIDENT {
            // Resolved meanwhile (a run brought it in, or another thread's
            // fault), or a write-protect fault on a page that was being
            // evicted and came back: let the faulting thread go on.
            c.spurious.fetch_add(1, Ordering::Relaxed);
            if f.flags & uffd::PAGEFAULT_FLAG_WP != 0 {
                let _ = self.served(self.uffd.write_protect(addr as u64, PAGE as u64, false));
            } else {
                wakes.push((addr as u64, PAGE as u64));
            }
            return;
        }
        let want = if self.readahead {
            let cap = (st.window_size() / 8).clamp(1, RUN_MAX);
            st.streams.plan(addr, cap)
        } else {
            1
        };
        // Room first, so that plaintext never exceeds the window, not even
        // for the time of one eviction (at least a batch, so that the next
        // faults find room).
        let window = st.window_size();
        if st.resident + want > window && !st.frozen {
            let need = (st.resident + want - window).max(self.batch);
            self.evict(st, need);
        }
        match self.bring_in(st, pos, i, want, Why::Fault) {
            Ok(n) => {
                st.streams.ran(addr, n);
                wakes.push((addr as u64, (n * PAGE) as u64));
            }
            Err(e) => {
                eprintln!("memveil-shield: cannot map page {addr:#x}: {e}");
                wakes.push((addr as u64, PAGE as u64));
            }
        }
    }

    /// Brings page `i` of range `pos` (ZERO or EVICTED) in as plaintext,
    /// and up to `want - 1` pages after it that are also missing, without
    /// waking anyone; returns how many pages from `i` are now resident.
    /// Runs of never-written pages take one `UFFDIO_COPY` of zeros, runs of
    /// evicted pages (Move mechanism) one `UFFDIO_MOVE` home from their
    /// slots, decrypted there in place.
    fn bring_in(
        &self,
        st: &mut State,
        pos: usize,
        i: usize,
        want: usize,
        why: Why,
    ) -> io::Result<usize> {
        let t0 = Instant::now();
        let end = {
            let r = &st.ranges[pos];
            let mut end = i + 1;
            let stop = (i.saturating_add(want)).min(r.pages);
            while end < stop {
                let s = r.state(end);
                // A run stays inside what the userfaultfd covers: a copy
                // that reaches an unregistered chunk fails whole (ENOENT).
                if s & PINNED != 0 || s & STATE_MASK == RESIDENT || !r.registered(end) {
                    break;
                }
                end += 1;
            }
            end
        };
        let mut k = i;
        while k < end {
            let kind = st.ranges[pos].state(k) & STATE_MASK;
            let mut e = k + 1;
            while e < end && st.ranges[pos].state(e) & STATE_MASK == kind {
                e += 1;
            }
            let res = self.served(match kind {
                EVICTED if self.mechanism == Mechanism::Move => self.move_in(st, pos, k, e),
                EVICTED => self.copy_in(st, pos, k).map(|()| 1),
                _ => self.zero_in(st, pos, k, e),
            });
            let done = match res {
                Ok(d) => d,
                Err(err) if k == i => return Err(err),
                Err(_) => 0,
            };
            for p in k..k + done {
                let w = if p == i { why } else { why.ahead() };
                self.book_in(st, pos, p, w);
            }
            if k + done < e {
                // Stopped part-way: the rest of the run stays missing.
                let c = self.stats.counters();
                c.copy_ns.fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
                return Ok(k + done - i);
            }
            k = e;
        }
        let c = self.stats.counters();
        c.copy_ns.fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
        Ok(end - i)
    }

    /// Books page `i` of range `pos`, just mapped, as resident.
    fn book_in(&self, st: &mut State, pos: usize, i: usize, why: Why) {
        let s = st.ranges[pos].state(i);
        let evicted = s & STATE_MASK == EVICTED;
        let c = self.stats.counters();
        if evicted && s & crate::state::SWEPT != 0 {
            c.swept_back.fetch_add(1, Ordering::Relaxed);
            let away =
                crate::sweep::since(st.now_ms(), crate::sweep::tick_of(st.ranges[pos].time(i)));
            c.back_away_ms.fetch_add(away, Ordering::Relaxed);
        }
        match why {
            Why::Fault => {
                let age = evicted.then(|| st.age(pos, i));
                let data = st.data_pages();
                if st.window.fault(age, data) {
                    c.near_misses.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(age) = age {
                    c.faults_in.fetch_add(1, Ordering::Relaxed);
                    c.refault_ages[crate::age_bucket(age)].fetch_add(1, Ordering::Relaxed);
                } else {
                    c.zero_fills.fetch_add(1, Ordering::Relaxed);
                }
            }
            Why::Ahead if evicted => {
                c.readahead.fetch_add(1, Ordering::Relaxed);
            }
            Why::Ahead => {
                c.prefill.fetch_add(1, Ordering::Relaxed);
            }
            Why::Restore => {}
        }
        let now = st.now_ms();
        st.mark_resident(pos, i, s, now);
    }

    /// Fills never-written pages `[a, b)` of range `pos` with zeros (one
    /// `UFFDIO_COPY` per [`RUN_MAX`] pages); returns how many from `a`.
    fn zero_in(&self, st: &State, pos: usize, a: usize, b: usize) -> io::Result<usize> {
        let r = &st.ranges[pos];
        // A move needs the destination's protection to match the pool's.
        let pool = self.zeros.as_ref().filter(|_| r.state(a) & RDONLY == 0);
        let mut k = a;
        while k < b {
            let n = (b - k).min(RUN_MAX);
            if let Some(z) = pool {
                let (src, m) = z.front(n);
                if m > 0 {
                    let (bytes, res) =
                        self.uffd
                            .move_run(r.addr(k) as u64, src, (m * PAGE) as u64, false);
                    let got = usize::try_from(bytes).unwrap_or(0) / PAGE;
                    z.took(got);
                    if got == 0 && res.is_err_and(|e| e.raw_os_error() == Some(libc::EINVAL)) {
                        // The areas do not match (the program locked its
                        // memory with mlockall after the pool was made):
                        // copy from now on rather than fail a move each time.
                        z.turn_off();
                    }
                    if got > 0 {
                        self.stats
                            .counters()
                            .pool_fills
                            .fetch_add(got as u64, Ordering::Relaxed);
                        k += got;
                        continue;
                    }
                }
            }
            let (bytes, res) = self
                .uffd
                .copy_run(r.addr(k) as u64, &ZEROS[..n * PAGE], false);
            let got = usize::try_from(bytes).unwrap_or(0) / PAGE;
            if let Some(z) = pool {
                z.copied(got);
            }
            k += got;
            match res {
                Ok(()) => {}
                // Present already (a page the kernel filled before the range
                // was registered): it holds what it holds, count it in.
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => k += 1,
                Err(e) if k == a => return Err(e),
                Err(_) => break,
            }
        }
        Ok(k.min(b) - a)
    }

    /// Brings evicted pages `[a, b)` of range `pos` home (Move mechanism):
    /// their frames, in the store slots, are decrypted in place and moved to
    /// the pages' addresses with one `UFFDIO_MOVE`. The plaintext exists
    /// only in frames that become the program's pages. When the move stops
    /// at a page (its protection differs from the store's after
    /// `mprotect`), that page's frame is copied in with `UFFDIO_COPY` and
    /// its slot wiped and dropped, and the frames after it are encrypted
    /// again (they stay evicted). Returns how many pages from `a` came in.
    fn move_in(&self, st: &mut State, pos: usize, a: usize, b: usize) -> io::Result<usize> {
        let State { ranges, keys, .. } = &mut *st;
        let r = &mut ranges[pos];
        let key = keys[usize::from(r.keyid)]
            .as_ref()
            .ok_or_else(|| io::Error::other("no key for the range's KeyID"))?;
        for k in a..b {
            // The page is EVICTED, so its slot holds a frame: touching it
            // does not fault.
            let addr = r.addr(k);
            key.decrypt_unit(addr as u128, r.store_page(k))
                .map_err(|e| io::Error::other(e.to_string()))?;
        }
        let len = ((b - a) * PAGE) as u64;
        let (bytes, res) = self
            .uffd
            .move_run(r.addr(a) as u64, r.slot_ptr(a) as u64, len, false);
        if res.is_ok() {
            return Ok(b - a);
        }
        let moved = usize::try_from(bytes).unwrap_or(0) / PAGE;
        let k = a + moved;
        let addr = r.addr(k);
        let copied = match self.uffd.copy_run(addr as u64, r.store_page(k), false).1 {
            Ok(()) => true,
            Err(e) => e.raw_os_error() == Some(libc::EEXIST),
        };
        let first_out = if copied { k + 1 } else { k };
        if copied {
            // SAFETY: the slot is a present page of the store owned by this
            // range, and the page's contents now live at `addr`.
            unsafe { release_slot(r.slot_ptr(k)) };
        }
        for j in first_out..b {
            // Still evicted: back to ciphertext (4096 bytes: always a valid
            // XTS unit).
            let addr = r.addr(j);
            let _ = key.encrypt_unit(addr as u128, r.store_page(j));
        }
        if first_out == a {
            return res.map(|()| 0);
        }
        Ok(first_out - a)
    }

    /// Brings evicted page `i` of range `pos` back through the bounce page
    /// (write-protect mechanism: the store holds ciphertext, not frames).
    fn copy_in(&self, st: &mut State, pos: usize, i: usize) -> io::Result<()> {
        let State {
            ranges,
            keys,
            bounce,
            ..
        } = &mut *st;
        let r = &mut ranges[pos];
        let addr = r.addr(i);
        bounce.copy_from_slice(r.store_page(i));
        let key = keys[usize::from(r.keyid)]
            .as_ref()
            .ok_or_else(|| io::Error::other("no key for the range's KeyID"))?;
        let res = key
            .decrypt_unit(addr as u128, bounce)
            .map_err(|e| io::Error::other(e.to_string()))
            .and_then(|()| self.uffd.copy_run(addr as u64, bounce, false).1);
        bounce.fill(0);
        match res {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            r => r,
        }
    }

    /// Evicts until at most the window's pages are resident (or nothing more
    /// can be evicted: every resident page pinned).
    pub(crate) fn shrink_to_window(&self, st: &mut State) {
        while st.resident > st.window_size() {
            let over = st.resident - st.window_size();
            if self.evict(st, over) == 0 {
                break;
            }
        }
        self.publish(st);
    }

    /// Evicts up to `n` of the resident pages; returns how many. With
    /// `UFFDIO_MOVE` each run of neighbouring victims is moved out of the
    /// program's view into its store slots in one call and encrypted there:
    /// the frames themselves become the ciphertext, and no plaintext frame
    /// is ever freed.
    fn evict(&self, st: &mut State, n: usize) -> usize {
        let victims = st.victims(n);
        self.evict_list(st, &victims, false)
    }

    /// Evicts `victims` (sorted by address), by the sweep (`swept`) or to
    /// make room in the window; returns how many left.
    pub(crate) fn evict_list(
        &self,
        st: &mut State,
        victims: &[(usize, usize)],
        swept: bool,
    ) -> usize {
        let t0 = Instant::now();
        let now = st.now_ms();
        let mut done = 0;
        let mut k = 0;
        while k < victims.len() {
            let (pos, a) = victims[k];
            let mut e = k + 1;
            while e < victims.len() && victims[e] == (pos, a + (e - k)) {
                e += 1;
            }
            let b = a + (e - k);
            // The run [a, b): moved where UFFDIO_MOVE takes the pages; a
            // page it refuses (shared with a forked child) goes by
            // write-protection, gathered with the refused pages next to it
            // into one write-protect run (`wp_from..p`), and the move is
            // tried again on the rest: a page the program owns alone is
            // moved, so its frame is never freed unwiped. Without
            // UFFDIO_MOVE the whole run goes by write-protection.
            // A run the move refuses for another reason than sharing (it may
            // cross the edge of a mapping: chunks registered one by one) is
            // tried again page by page; a page refused alone (shared, or
            // read-only) goes by write-protection.
            let mut p = a;
            let mut wp_from: Option<usize> = None;
            let mut single = false;
            while p < b {
                let (moved, busy) = if self.mechanism == Mechanism::Move {
                    let to = if single { p + 1 } else { b };
                    self.move_out(st, pos, p, to, swept, now)
                } else {
                    (0, true)
                };
                if moved > 0 {
                    if let Some(f) = wp_from.take() {
                        done += self.evict_wp_or_requeue(st, pos, f, p, swept, now);
                    }
                    p += moved;
                    done += moved;
                }
                if p >= b {
                    break;
                }
                if self.mechanism != Mechanism::Move {
                    wp_from.get_or_insert(p);
                    p = b;
                } else if busy || single {
                    wp_from.get_or_insert(p);
                    p += 1;
                } else {
                    single = true;
                }
            }
            if let Some(f) = wp_from {
                done += self.evict_wp_or_requeue(st, pos, f, b, swept, now);
            }
            k = e;
        }
        let c = self.stats.counters();
        c.evictions.fetch_add(done as u64, Ordering::Relaxed);
        c.evict_ns.fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
        done
    }

    /// Moves the pages `[a, b)` of range `pos` (as many as `UFFDIO_MOVE`
    /// takes, from `a`) out of the program's view into their store slots,
    /// encrypts them there and marks them evicted; returns how many, and
    /// whether the move stopped at a page shared with another process.
    fn move_out(
        &self,
        st: &mut State,
        pos: usize,
        a: usize,
        b: usize,
        swept: bool,
        now: u64,
    ) -> (usize, bool) {
        let r = &st.ranges[pos];
        let len = ((b - a) * PAGE) as u64;
        let (bytes, res) = self
            .uffd
            .move_run(r.slot_ptr(a) as u64, r.addr(a) as u64, len, false);
        // A number closed behind the shield's back: the window could no
        // longer be held.
        let res = self.served(res);
        let moved = usize::try_from(bytes).unwrap_or(0) / PAGE;
        // EBUSY: the page is shared (with a forked child).
        let busy = res.is_err_and(|e| e.raw_os_error() == Some(libc::EBUSY));
        self.stats
            .counters()
            .evict_moves
            .fetch_add(1, Ordering::Relaxed);
        for j in a..a + moved {
            let State { ranges, keys, .. } = &mut *st;
            let r = &mut ranges[pos];
            let addr = r.addr(j);
            encrypt_page(keys, r.keyid, addr, r.store_page(j));
            st.mark_evicted(pos, j, swept, now);
        }
        (moved, busy)
    }

    /// [`Inner::evict_wp_run`] over `[a, b)`; what it could not evict is
    /// queued again (the main queue, the sweep). Returns how many were
    /// evicted.
    fn evict_wp_or_requeue(
        &self,
        st: &mut State,
        pos: usize,
        a: usize,
        b: usize,
        swept: bool,
        now: u64,
    ) -> usize {
        let n = self.evict_wp_run(st, pos, a, b, swept, now);
        for p in a + n..b {
            st.requeue(pos, p, now);
        }
        n
    }

    /// Write-protect eviction of the run of pages `[a, b)` of range `pos`;
    /// returns how many were evicted (a prefix of the run). The run's
    /// writers wait while it is encrypted and dropped, then fault it back
    /// in. The ciphertext goes to the store slots by `UFFDIO_COPY` when the
    /// store is registered (Move mechanism: touching an empty slot would
    /// fault on this very thread). One write-protect, one drop and one
    /// release for the whole run: each is a TLB shootdown, and per page
    /// they made a fork of a 128 MiB heap take 2.3 s.
    fn evict_wp_run(
        &self,
        st: &mut State,
        pos: usize,
        a: usize,
        b: usize,
        swept: bool,
        now: u64,
    ) -> usize {
        let start = st.ranges[pos].addr(a);
        let len = ((b - a) * PAGE) as u64;
        if self
            .served(self.uffd.write_protect(start as u64, len, true))
            .is_err()
        {
            return 0;
        }
        let mut saved = a;
        {
            let State {
                ranges,
                keys,
                bounce,
                ..
            } = &mut *st;
            let r = &mut ranges[pos];
            while saved < b {
                let addr = r.addr(saved);
                // SAFETY: the page is resident and readable (not pinned)
                // and, being write-protected, nobody changes it while it
                // is read.
                bounce.copy_from_slice(unsafe {
                    std::slice::from_raw_parts(addr as *const u8, PAGE)
                });
                encrypt_page(keys, r.keyid, addr, bounce);
                let ok = if self.mechanism == Mechanism::Move {
                    self.uffd.copy(r.slot_ptr(saved) as u64, bounce).is_ok()
                } else {
                    r.store_page(saved).copy_from_slice(bounce);
                    true
                };
                bounce.fill(0);
                if !ok {
                    break;
                }
                saved += 1;
            }
        }
        // SAFETY: the pages' contents are saved as ciphertext; dropping them
        // makes the next access fault them back in.
        let dropped = saved > a
            && unsafe {
                uffd::madvise_direct(start as *mut u8, (saved - a) * PAGE, libc::MADV_DONTNEED)
            }
            .is_ok();
        // Clear the write-protect markers and release waiting writers: they
        // fault on the now-missing pages and wait for them to come back.
        let _ = self.uffd.write_protect(start as u64, len, false);
        if !dropped {
            // Still resident: their store slots go empty again.
            for i in a..saved {
                let slot = st.ranges[pos].slot_ptr(i);
                // SAFETY: the slot was just filled and is owned by the range.
                unsafe { release_slot(slot) };
            }
            return 0;
        }
        for i in a..saved {
            st.mark_evicted(pos, i, swept, now);
        }
        self.stats
            .counters()
            .wp_evictions
            .fetch_add((saved - a) as u64, Ordering::Relaxed);
        saved - a
    }

    /// Decrypts every evicted page of range `pos` back into place (runs of
    /// neighbours in one move each) and wakes any thread waiting on them.
    pub(crate) fn restore_range(&self, st: &mut State, pos: usize) -> Result<(), ShieldError> {
        let pages = st.ranges[pos].pages;
        let mut i = 0;
        while i < pages {
            if st.ranges[pos].state(i) & STATE_MASK != EVICTED {
                i += 1;
                continue;
            }
            let mut e = i + 1;
            while e < pages && st.ranges[pos].state(e) & STATE_MASK == EVICTED {
                e += 1;
            }
            let n = self
                .bring_in(st, pos, i, e - i, Why::Restore)
                .map_err(os("UFFDIO_MOVE/UFFDIO_COPY"))?
                .max(1);
            let addr = st.ranges[pos].addr(i);
            let _ = self.served(self.uffd.wake(addr as u64, (n * PAGE) as u64));
            i += n;
        }
        self.publish(st);
        Ok(())
    }
}

impl Why {
    /// The reason for the pages after the first of a run.
    fn ahead(self) -> Self {
        match self {
            Why::Fault | Why::Ahead => Why::Ahead,
            Why::Restore => Why::Restore,
        }
    }
}

/// Sets the handler thread's scheduling policy (the watchdog's lever).
pub(crate) fn set_handler_policy(inner: &Inner, policy: SchedPolicy) -> io::Result<()> {
    match inner.handler_tid.load(Ordering::Acquire) {
        0 => Err(io::Error::other("handler not started")),
        tid => memveil_sys::process::set_sched_policy(tid, policy),
    }
}

/// A fresh random AES-128-XTS key in `pool` (its raw bytes too live there
/// only while it is made).
pub(crate) fn random_xts(pool: &SecretPool) -> Result<SecretBox<Xts>, ShieldError> {
    let mut raw = pool.alloc_bytes(32)?;
    memveil_sys::getrandom(&mut raw).map_err(os("getrandom"))?;
    Ok(pool.alloc(|| Xts::new(&raw[..16], &raw[16..]).expect("distinct random halves"))?)
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

/// The userfaultfd was closed behind the shield's back (a raw `close` or
/// `close_range` system call, which neither the preload's wrappers nor the
/// loader's filter saw). The shield cannot serve faults any more; the file
/// is still held ([`hold`]), so its ranges are registered and the faulting
/// threads blocked, but without the hold every page it had evicted would
/// read back as zeros. The program is ended at once rather than let it run
/// on without its pages.
pub(crate) fn lost_uffd(fd: i32) -> ! {
    eprintln!(
        "memveil-shield: the shield's userfaultfd (descriptor {fd}) was closed behind its back \
         (a raw close or close_range system call): the pages it had evicted would read back as \
         zeros; ending the program (exit 125) rather than let it run on with lost data. Close \
         descriptors through the C library (close, closefrom, close_range), whose wrappers leave \
         the shield's own open"
    );
    // SAFETY: _exit ends the process at once; nothing of this process runs
    // on with the lost pages.
    unsafe { libc::_exit(125) }
}
