//! Shared anonymous memory (`MAP_SHARED|MAP_ANONYMOUS`) kept as ciphertext
//! for every process that maps it.
//!
//! A private range belongs to one address space, so one userfaultfd and one
//! handler see every access to it. Shared anonymous memory is reached from
//! the process that mapped it (the *creator*) and from every process it
//! forks, each through its own page tables, and the pages themselves live in
//! one shmem file. This module keeps such a mapping protected for the whole
//! tree of processes:
//!
//! - The mapping is a `memfd` mapped `MAP_SHARED` (what the kernel makes of
//!   `MAP_SHARED|MAP_ANONYMOUS` anyway), registered for missing and
//!   write-protect faults with a userfaultfd opened with
//!   `UFFD_FEATURE_EVENT_FORK`: when a process of the tree forks, the child's
//!   view stays registered and its new descriptor comes to the creator's
//!   handler thread, which from then on serves the faults of every view and
//!   can write-protect every view.
//! - Eviction write-protects the pages in **every** view first (so no
//!   process can change them meanwhile; a writer waits in a write-protect
//!   fault), reads them through the memfd, encrypts them into the creator's
//!   store (AES-XTS, the page address as tweak, a key of this handler in
//!   secret memory) and punches them out of the shmem file, which removes
//!   them from every view at once. The frames go back to the kernel unwiped
//!   (nothing in user space can wipe a shmem frame another process may be
//!   reading), so this needs the same acceptance as the write-protect
//!   eviction of private memory.
//! - A missing fault in any view decrypts the page and maps it with
//!   `UFFDIO_COPY` through that view's descriptor, which puts it back in the
//!   shmem file for all views; a fault whose page another view brought back
//!   meanwhile finds it present (`EEXIST`) and is only woken; a write to a
//!   page still write-protected in a view is let through by clearing the
//!   protection in that view.
//! - At most `window` pages of all the creator's shared mappings are
//!   plaintext at once; victims are taken in address order round a clock
//!   hand (no reference bits are visible across views).
//!
//! The handler allocates nothing while it runs: a `fork` in another thread
//! holds the C library's allocator locks while the kernel waits for the
//! handler to read the fork event.
//!
//! What it does not do: protect memfds or System V segments (any process
//! may attach those, outside the tree and its userfaultfds), or survive its
//! creator: when the creator unmaps a mapping or exits normally the pages
//! are decrypted back into the shmem file first (the remaining views see
//! plaintext from then on, and are no longer protected); if the creator dies
//! otherwise, [`SharedShield::released`] stays false and the views' processes
//! must stop (the preload's watchdog does), since their evicted pages are
//! gone with the creator's keys.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use memveil_cipher::Xts;
use memveil_secmem::{Policy, SecretBox, SecretPool};
use memveil_sys::stack_thread::{self, StackThread};
use memveil_sys::uffd::{self, Fault, Message, Uffd};

use crate::handler::{random_xts, HandlerStack, Inner};
use crate::{open_uffd, os, ShieldError, PAGE, START_HOOK};

/// Views (the creator and its descendants) one handler serves at most.
pub const MAX_VIEWS: usize = 1024;
/// Protected shared mappings per creator at most.
pub const MAX_MAPPINGS: usize = 64;
/// Pages written back or evicted per system call at most.
const RUN: usize = 16;

const HOLE: u8 = 0;
const RESIDENT: u8 = 1;
const EVICTED: u8 = 2;

static ZEROS: [u8; PAGE] = [0; PAGE];

/// Kinds of shared memory, for the messages.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SharedKind {
    /// `MAP_SHARED|MAP_ANONYMOUS`.
    Anonymous,
    /// A shared mapping of a `memfd_create` file.
    Memfd,
    /// A System V segment (`shmat`).
    SysV,
}

impl SharedKind {
    /// Words for messages.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Anonymous => "shared anonymous mapping (MAP_SHARED|MAP_ANONYMOUS)",
            Self::Memfd => "shared mapping of a memfd_create file",
            Self::SysV => "System V shared memory segment (shmat)",
        }
    }
}

/// What `memveil run --shared-memory` does with one kind of shared memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SharedMode {
    /// `ENOMEM` with a message.
    Refuse,
    /// Kept as ciphertext ([`SharedShield`]; anonymous memory only).
    Protect,
    /// Let through as plaintext, counted.
    Plaintext,
}

/// Parses `MODE[,KIND=MODE...]` (docs/shield.md) into the modes of
/// (anonymous, memfd, sysv), indexed by [`SharedKind`].
///
/// # Errors
/// Words naming the bad part.
pub fn parse_shared_policy(setting: &str) -> Result<[SharedMode; 3], String> {
    let word = |w: &str| match w {
        "refuse" => Ok(SharedMode::Refuse),
        "protected" => Ok(SharedMode::Protect),
        "unprotected" => Ok(SharedMode::Plaintext),
        _ => Err(format!(
            "unknown shared-memory mode {w:?} (refuse, protected or unprotected)"
        )),
    };
    let mut parts = setting.split(',');
    let first = word(parts.next().unwrap_or("refuse").trim())?;
    let mut modes = [first; 3];
    if first == SharedMode::Protect {
        modes[SharedKind::Memfd as usize] = SharedMode::Refuse;
        modes[SharedKind::SysV as usize] = SharedMode::Refuse;
    }
    for p in parts {
        let (k, m) = p
            .split_once('=')
            .ok_or_else(|| format!("{p:?}: expected KIND=MODE (anonymous, memfd or sysv)"))?;
        let kind = match k.trim() {
            "anonymous" => SharedKind::Anonymous,
            "memfd" => SharedKind::Memfd,
            "sysv" => SharedKind::SysV,
            other => {
                return Err(format!(
                    "unknown kind of shared memory {other:?} (anonymous, memfd or sysv)"
                ))
            }
        };
        let m = word(m.trim())?;
        if m == SharedMode::Protect && kind != SharedKind::Anonymous {
            return Err(format!(
                "{} cannot be protected: any process may attach it, outside the userfaultfds \
                 of this program's processes; choose refuse or unprotected for it",
                kind.name()
            ));
        }
        modes[kind as usize] = m;
    }
    Ok(modes)
}

/// Settings of a [`SharedShield`].
#[derive(Debug, Clone, Copy)]
pub struct SharedConfig {
    /// Most plaintext pages of all the creator's shared mappings at once.
    pub window: usize,
    /// Pages evicted at once when the window is full.
    pub batch: usize,
    /// Accepted protection level of the key.
    pub policy: Policy,
}

/// One protected shared mapping.
struct Mapping {
    base: usize,
    pages: usize,
    memfd: OwnedFd,
    /// Ciphertext of evicted pages, one slot per page: the creator's
    /// private memory, not inherited by children and not dumped.
    store: *mut u8,
    states: Vec<u8>,
}

// SAFETY: `store` is an owned mapping with no thread affinity.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the store is this mapping's own and nothing refers to it.
        let _ = unsafe { uffd::unmap_direct(self.store, self.pages * PAGE) };
    }
}

impl Mapping {
    fn slot(&self, i: usize) -> &[u8] {
        // SAFETY: `i < pages` (callers index `states` first); the store has
        // `pages` slots and is written only by eviction, under the state
        // lock the callers hold.
        unsafe { std::slice::from_raw_parts(self.store.add(i * PAGE), PAGE) }
    }
}

struct State {
    views: [Option<Uffd>; MAX_VIEWS],
    mappings: Vec<Mapping>,
    resident: usize,
    /// Clock hand: index of a mapping and a page in it.
    hand: (usize, usize),
}

impl State {
    fn find(&self, addr: usize) -> Option<(usize, usize)> {
        self.mappings.iter().enumerate().find_map(|(m, r)| {
            (addr >= r.base && addr < r.base + r.pages * PAGE).then(|| (m, (addr - r.base) / PAGE))
        })
    }

    fn live_views(&self) -> u64 {
        self.views.iter().filter(|v| v.is_some()).count() as u64
    }
}

struct Shared {
    state: Mutex<State>,
    key: SecretBox<Xts>,
    bounce: Mutex<SecretBox<[u8]>>,
    window: usize,
    batch: usize,
    /// The private shield, for its counters.
    owner: Arc<Inner>,
    stop: AtomicBool,
    bell: OwnedFd,
    /// Descriptor numbers this process holds for the shield (views, memfds,
    /// the bell), readable without the lock: a forked child closes its
    /// copies of them.
    fds: [AtomicI32; MAX_VIEWS + MAX_MAPPINGS + 1],
    /// A shared page: 1 once every mapping was written back in plaintext
    /// (the creator unmapped them or is exiting normally).
    released: *const AtomicU32,
    creator: u32,
    /// Set when a view could not be taken in (more than [`MAX_VIEWS`]):
    /// every page was written back and nothing is evicted any more.
    degraded: AtomicBool,
    /// A page could not be written back (see [`Shared::write_back`]).
    lost: AtomicBool,
    /// The handler is reading fork events (see `serve`).
    reading: AtomicBool,
    said_emfile: AtomicBool,
    said_degraded: AtomicBool,
    /// A descriptor kept open to be closed when a fork event finds none
    /// free (a single-threaded creator at its limit has no other way out).
    reserve: AtomicI32,
    _pool: SecretPool,
}

// SAFETY: `released` points into a shared page that lives as long as the
// process and is only accessed atomically.
unsafe impl Send for Shared {}
// SAFETY: as above; everything else is Sync.
unsafe impl Sync for Shared {}

/// Protected shared anonymous memory of one creator process, with its
/// handler thread.
pub struct SharedShield {
    inner: Arc<Shared>,
    thread: Option<StackThread<HandlerStack>>,
    /// Mapping ranges, readable without the lock (a forked child reads them
    /// while the lock may be held by a thread that does not exist there).
    ranges: [(AtomicUsize, AtomicUsize); MAX_MAPPINGS],
}

fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// Runs `f` on a thread of its own (a [`HandlerStack`], started through the
/// start hook) once process `pid` has ended, watched through a pidfd.
/// Returns `false`, starting nothing, when `pid` is already gone.
///
/// # Errors
/// `pidfd_open` or the thread could not be started.
pub(crate) fn when_gone(
    pid: u32,
    what: &'static str,
    f: impl FnOnce() + Send + 'static,
) -> Result<bool, ShieldError> {
    let Some(fd) = memveil_sys::process::PidFd::open(pid).map_err(os("pidfd_open"))? else {
        return Ok(false);
    };
    let t = stack_thread::spawn(HandlerStack::new()?, move || {
        if let Some(hook) = START_HOOK.get() {
            hook();
        }
        while !fd.wait(None) {}
        f();
    })
    .map_err(os(what))?;
    // The watchdog lives as long as the process.
    std::mem::forget(t);
    Ok(true)
}

impl crate::Shield {
    /// Starts protection of shared anonymous memory created by this process
    /// (see [`SharedShield`]), counted in this shield's statistics.
    ///
    /// # Errors
    /// [`ShieldError::Unsupported`] when the kernel does not write-protect
    /// shared memory, [`ShieldError::NotPermitted`] when fork events are not
    /// allowed (they need `CAP_SYS_PTRACE`), or the errors of secret memory.
    pub fn shared_memory(&self, cfg: &SharedConfig) -> Result<SharedShield, ShieldError> {
        SharedShield::start(cfg, Arc::clone(&self.inner))
    }
}

impl SharedShield {
    fn start(cfg: &SharedConfig, owner: Arc<Inner>) -> Result<Self, ShieldError> {
        let fd = open_uffd()?;
        let want = uffd::FEATURE_EVENT_FORK
            | uffd::FEATURE_MISSING_SHMEM
            | uffd::FEATURE_WP_HUGETLBFS_SHMEM
            | uffd::FEATURE_PAGEFAULT_FLAG_WP;
        check_no_shmem_thp()?;
        let offered = Uffd::offered_features().map_err(os("UFFDIO_API"))?;
        if offered & uffd::FEATURE_WP_HUGETLBFS_SHMEM == 0 {
            return Err(ShieldError::Unsupported(
                "write-protection of shared memory (Linux 5.19+)",
            ));
        }
        if let Err(e) = fd.handshake(want) {
            return Err(ShieldError::NotPermitted {
                syscall: format!("UFFDIO_API with UFFD_FEATURE_EVENT_FORK: {e}"),
                dev: "not tried".into(),
                umo: " (fork events, which keep a forked child's view of shared memory \
                       registered, need CAP_SYS_PTRACE: run as root, or give the program \
                       CAP_SYS_PTRACE as an ambient capability)",
            });
        }
        let pool = SecretPool::new(16 * 1024, cfg.policy)?;
        // A tenant's shared memory is under its KeyID's key, as its heap.
        let key = match &owner.page_key {
            Some(k) => k.xts(&pool)?,
            None => random_xts(&pool)?,
        };
        let bounce = pool.alloc_bytes(PAGE)?;
        // SAFETY: eventfd takes an initial value and flags, returns a new fd.
        let bell = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if bell < 0 {
            return Err(os("eventfd")(io::Error::last_os_error()));
        }
        // SAFETY: `bell` was just created and is owned by nobody else.
        let bell = unsafe { OwnedFd::from_raw_fd(bell) };
        let released = map_shared_flag()?;
        let fds: [AtomicI32; MAX_VIEWS + MAX_MAPPINGS + 1] =
            std::array::from_fn(|_| AtomicI32::new(-1));
        fds[0].store(fd.raw_fd(), Ordering::Relaxed);
        fds[MAX_VIEWS + MAX_MAPPINGS].store(bell.as_raw_fd(), Ordering::Relaxed);
        let mut views: [Option<Uffd>; MAX_VIEWS] = std::array::from_fn(|_| None);
        views[0] = Some(fd);
        let inner = Arc::new(Shared {
            state: Mutex::new(State {
                views,
                mappings: Vec::with_capacity(MAX_MAPPINGS),
                resident: 0,
                hand: (0, 0),
            }),
            key,
            bounce: Mutex::new(bounce),
            window: cfg.window.max(1),
            batch: cfg.batch.clamp(1, RUN),
            owner,
            stop: AtomicBool::new(false),
            bell,
            fds,
            released,
            creator: std::process::id(),
            degraded: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            reading: AtomicBool::new(false),
            said_emfile: AtomicBool::new(false),
            said_degraded: AtomicBool::new(false),
            reserve: AtomicI32::new(open_reserve()),
            _pool: pool,
        });
        inner
            .owner
            .stats
            .counters()
            .shared_views
            .store(1, Ordering::Relaxed);
        let worker = Arc::clone(&inner);
        let thread = stack_thread::spawn(HandlerStack::new()?, move || worker.serve())
            .map_err(os("spawn shared-memory handler thread"))?;
        Ok(Self {
            inner,
            thread: Some(thread),
            ranges: std::array::from_fn(|_| (AtomicUsize::new(0), AtomicUsize::new(0))),
        })
    }

    /// Maps `len` bytes of protected shared anonymous memory, as
    /// `mmap(addr, len, prot, MAP_SHARED|MAP_ANONYMOUS|flags, -1, 0)` would
    /// (`flags` may add `MAP_FIXED`, `MAP_NORESERVE`, `MAP_POPULATE` is
    /// ignored). Its pages read as zeros until written.
    ///
    /// # Safety
    /// As `mmap(2)`: a `MAP_FIXED` address replaces what was there.
    ///
    /// # Errors
    /// [`ShieldError::BadRange`] when the creator has [`MAX_MAPPINGS`]
    /// already, or the system calls' errors.
    pub unsafe fn map(
        &self,
        addr: *mut libc::c_void,
        len: usize,
        prot: libc::c_int,
        flags: libc::c_int,
    ) -> Result<*mut u8, ShieldError> {
        let len = len.next_multiple_of(PAGE);
        let pages = len / PAGE;
        // Everything that allocates happens before the lock is taken (see
        // the module docs: a fork elsewhere may hold the allocator).
        let states = vec![HOLE; pages];
        // SAFETY: memfd_create takes a NUL-terminated name and flags.
        let fd = unsafe { libc::memfd_create(c"memveil-shared".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os("memfd_create")(io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just created and is owned by nobody else.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own descriptor.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(os("ftruncate shared memfd")(io::Error::last_os_error()));
        }
        let store = uffd::map_anonymous_direct(len).map_err(os("mmap shared store"))?;
        // Not inherited by children, not dumped.
        // SAFETY: advice on our own fresh mapping.
        unsafe {
            let _ = uffd::madvise_direct(store, len, libc::MADV_DONTFORK);
            let _ = uffd::madvise_direct(store, len, libc::MADV_DONTDUMP);
        }
        let mut m = Mapping {
            base: 0,
            pages,
            memfd,
            store,
            states,
        };
        let fixed = flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE);
        let extra = flags & libc::MAP_NORESERVE;
        // SAFETY: the caller's mmap contract; our own memfd.
        let p =
            unsafe { uffd::mmap_direct(addr, len, prot, libc::MAP_SHARED | fixed | extra, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(os("mmap shared memfd")(io::Error::last_os_error()));
        }
        m.base = p as usize;
        // Large folios would defeat the per-page punch (see
        // `check_no_shmem_thp`); children inherit the advice.
        // SAFETY: advice on the mapping just made.
        let _ = unsafe { uffd::madvise_direct(p.cast(), len, libc::MADV_NOHUGEPAGE) };
        let mut st = self.inner.lock();
        let undo = |e: ShieldError| {
            // SAFETY: the mapping was made above and never handed out.
            let _ = unsafe { uffd::unmap_direct(p.cast(), len) };
            e
        };
        let Some(slot) = (0..MAX_MAPPINGS).find(|&i| self.ranges[i].1.load(Ordering::Relaxed) == 0)
        else {
            drop(st);
            return Err(undo(ShieldError::BadRange {
                addr: p as usize,
                len,
                why: "too many protected shared mappings",
            }));
        };
        let view = st.views[0].as_ref().expect("the creator's view");
        if let Err(e) = view.register(p as u64, len as u64, uffd::MODE_MISSING | uffd::MODE_WP) {
            drop(st);
            return Err(undo(os("UFFDIO_REGISTER shared mapping")(e)));
        }
        self.ranges[slot].0.store(p as usize, Ordering::Relaxed);
        self.ranges[slot].1.store(len, Ordering::Release);
        self.inner.fds[MAX_VIEWS + slot].store(fd, Ordering::Relaxed);
        st.mappings.push(m);
        let c = self.inner.owner.stats.counters();
        c.shared_protected.fetch_add(len as u64, Ordering::Relaxed);
        Ok(p.cast())
    }

    /// Whether `[addr, addr+len)` overlaps a protected shared mapping of
    /// this creator (lock-free; also right in a forked child).
    #[must_use]
    pub fn overlaps(&self, addr: usize, len: usize) -> bool {
        self.ranges.iter().any(|(b, l)| {
            let n = l.load(Ordering::Acquire);
            let b = b.load(Ordering::Relaxed);
            n != 0 && addr < b + n && b < addr.saturating_add(len)
        })
    }

    /// Stops protecting every mapping that overlaps `[addr, addr+len)`
    /// (the creator unmaps or remaps it): evicted pages are decrypted back
    /// into the shmem file, so views in other processes keep their data, in
    /// plaintext from now on.
    ///
    /// When other live processes still map a mapping it writes back, this
    /// process says so on stderr before it goes on: the views' own watchdogs
    /// learn of it only when this process has exited, and a view that
    /// exits first would never say it (the message raced the view's exit).
    pub fn release(&self, addr: usize, len: usize) {
        let mut gone = Vec::with_capacity(MAX_MAPPINGS);
        {
            let mut st = self.inner.lock();
            let mut others = None;
            let mut i = 0;
            while i < st.mappings.len() {
                let m = &st.mappings[i];
                if addr < m.base + m.pages * PAGE && m.base < addr.saturating_add(len) {
                    // Counted once, before the first write-back: views of
                    // processes gone are dropped first (their probe needs a
                    // mapping still known).
                    let others = *others.get_or_insert_with(|| {
                        self.inner.reap(&mut st);
                        st.views.iter().skip(1).flatten().count()
                    });
                    let m = &st.mappings[i];
                    if others > 0 {
                        eprintln!(
                            "memveil-shield: process {} wrote back the shared memory at {:#x} \
                             ({} pages) it protected, which {others} other process(es) still \
                             map: that memory is plaintext from now on",
                            std::process::id(),
                            m.base,
                            m.pages
                        );
                    }
                    let plain = m.states.iter().filter(|&&s| s == RESIDENT).count();
                    self.inner.write_back(&mut st, i);
                    st.resident = st.resident.saturating_sub(plain);
                    let c = self.inner.owner.stats.counters();
                    c.shared_resident
                        .store(st.resident as u64, Ordering::Relaxed);
                    let m = st.mappings.swap_remove(i);
                    // Every view lets go of it: the views in other
                    // processes keep the (now plaintext) pages without the
                    // handler, which no longer knows the range (and might
                    // map something else at that address).
                    for v in st.views.iter().flatten() {
                        unregister_split(v, m.base, m.pages * PAGE);
                    }
                    self.forget_range(m.base, m.memfd.as_raw_fd());
                    gone.push(m);
                } else {
                    i += 1;
                }
            }
        }
        // Freed outside the lock (see the module docs).
        drop(gone);
    }

    /// [`SharedShield::release`] of every mapping, and the mark that the
    /// creator let its views go in order: before the creator exits.
    pub fn release_all(&self) {
        self.release(0, usize::MAX);
        if self.inner.lost.load(Ordering::SeqCst) {
            eprintln!(
                "memveil-shield: some evicted pages of shared memory could not be written back; \
                 the processes that map it will be stopped when this one exits"
            );
            return;
        }
        // SAFETY: `released` points into a live shared page.
        unsafe { &*self.inner.released }.store(1, Ordering::Release);
    }

    fn forget_range(&self, base: usize, memfd: RawFd) {
        for (i, (b, l)) in self.ranges.iter().enumerate() {
            if b.load(Ordering::Relaxed) == base && l.load(Ordering::Relaxed) != 0 {
                l.store(0, Ordering::Release);
                let _ = self.inner.fds[MAX_VIEWS + i].compare_exchange(
                    memfd,
                    -1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
        }
    }

    /// Whether the creator let its views go in order (see
    /// [`SharedShield::release_all`]); read by its descendants.
    #[must_use]
    pub fn released(&self) -> bool {
        self.inner.released()
    }

    /// The creator's process id.
    #[must_use]
    pub fn creator(&self) -> u32 {
        self.inner.creator
    }

    /// In a forked child (after [`SharedShield::abandon_in_forked_child`]
    /// for its parent's own shield): starts a thread that stops this
    /// process, with a message and exit status 125, if the creator dies
    /// without having written its pages back ([`SharedShield::released`]):
    /// this view's evicted pages died with the creator's keys, and the
    /// process must not read zeros where its data was.
    ///
    /// # Errors
    /// `pidfd_open` or the thread could not be started.
    pub fn watch_creator(&self) -> Result<(), ShieldError> {
        let inner = Arc::clone(&self.inner);
        let gone = Arc::clone(&self.inner);
        if !when_gone(self.inner.creator, "shared-memory watchdog", move || {
            inner.creator_gone();
        })? {
            gone.creator_gone();
        }
        Ok(())
    }

    /// In a child after `fork`: closes the child's copies of the
    /// creator's descriptors (its views' userfaultfds, the memfds, the
    /// bell). The shield must not be used afterwards except for
    /// [`SharedShield::overlaps`], [`SharedShield::released`] and
    /// [`SharedShield::creator`]; the child's view stays served by the
    /// creator's handler.
    ///
    /// # Safety
    /// Only in a forked child, on a shield made before the fork, never
    /// dropped afterwards (the descriptor numbers may be reused).
    pub unsafe fn abandon_in_forked_child(&self) {
        for fd in &self.inner.fds {
            let n = fd.swap(-1, Ordering::Relaxed);
            if n >= 0 {
                // SAFETY: the caller promises the shield never uses or
                // closes these numbers again.
                let _ = unsafe { libc::close(n) };
            }
        }
        let reserve = self.inner.reserve.swap(-1, Ordering::SeqCst);
        if reserve >= 0 {
            // SAFETY: the creator's reserve, a copy nothing here uses.
            let _ = unsafe { libc::close(reserve) };
        }
        if self.inner.reading.load(Ordering::SeqCst) {
            // The fork came while the handler was taking in a view: the
            // kernel may have installed its descriptor before the handler
            // recorded it. Held here it would keep a sibling's view
            // registered with nobody to serve it. This process has no
            // userfaultfd of its own yet (its shield comes after), so every
            // one left is the creator's.
            close_inherited_userfaultfds();
        }
    }
}

impl Drop for SharedShield {
    fn drop(&mut self) {
        self.release_all();
        self.inner.stop.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: an 8-byte write to our eventfd.
        let _ = unsafe {
            libc::write(
                self.inner.bell.as_raw_fd(),
                std::ptr::from_ref(&one).cast(),
                8,
            )
        };
        if let Some(t) = self.thread.take() {
            drop(t.join());
        }
    }
}

/// Opens `/dev/null` as the reserve descriptor (-1 when it cannot).
fn open_reserve() -> RawFd {
    // SAFETY: open(2) of a NUL-terminated literal path.
    unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) }
}

/// Unregisters `[addr, addr+len)` in a view; where the kernel refuses the
/// whole range (`EINVAL`: a mapping there that cannot take a userfaultfd,
/// such as a file the process mapped over part of it), halves it until
/// each registered part is let go of.
fn unregister_split(v: &Uffd, addr: usize, len: usize) {
    match v.unregister(addr as u64, len as u64) {
        Err(e) if errno_of(&e) == libc::EINVAL && len > PAGE => {
            let half = (len / PAGE / 2) * PAGE;
            unregister_split(v, addr, half);
            unregister_split(v, addr + half, len - half);
        }
        _ => {}
    }
}

/// Closes every userfaultfd descriptor of this process (see
/// [`SharedShield::abandon_in_forked_child`]).
fn close_inherited_userfaultfds() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    for e in dir.flatten() {
        let Some(n) = e.file_name().to_str().and_then(|n| n.parse::<RawFd>().ok()) else {
            continue;
        };
        if std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:[userfaultfd]") {
            // SAFETY: a descriptor of the creator's, which nothing in this
            // process uses (see the caller).
            let _ = unsafe { memveil_sys::fdguard::close_held(n) };
        }
    }
}

/// Refuses shared memory in large folios: a punch that cannot split one
/// zeroes the range instead of removing it, which would leave a page
/// present as zeros where the handler counts it evicted.
fn check_no_shmem_thp() -> Result<(), ShieldError> {
    let mut files = vec![std::path::PathBuf::from(
        "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
    )];
    if let Ok(d) = std::fs::read_dir("/sys/kernel/mm/transparent_hugepage") {
        files.extend(
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("hugepages-"))
                .map(|e| e.path().join("shmem_enabled")),
        );
    }
    for f in files {
        let Ok(t) = std::fs::read_to_string(&f) else {
            continue;
        };
        let on = ["[always]", "[within_size]", "[force]"];
        if on.iter().any(|w| t.contains(w)) {
            return Err(ShieldError::Unsupported(
                "shared memory in small pages: transparent huge pages are on for shmem \
                 (/sys/kernel/mm/transparent_hugepage/*shmem_enabled); set them to advise or never",
            ));
        }
    }
    Ok(())
}

/// A shared anonymous page for the `released` flag, mapped directly.
fn map_shared_flag() -> Result<*const AtomicU32, ShieldError> {
    // SAFETY: a fresh anonymous shared mapping; no address given.
    let p = unsafe {
        uffd::mmap_direct(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os("mmap shared flag")(io::Error::last_os_error()));
    }
    Ok(p.cast::<AtomicU32>().cast_const())
}

impl Shared {
    fn released(&self) -> bool {
        // SAFETY: `released` points into a live shared page.
        unsafe { &*self.released }.load(Ordering::Acquire) == 1
    }

    fn creator_gone(&self) {
        // Released: the creator said so itself when it wrote the memory
        // back (see `SharedShield::release`); nothing is left to do.
        if !self.released() {
            eprintln!(
                "memveil-shield: process {} died holding the keys of shared memory this \
                 process maps; its evicted pages are lost, so this process is stopped \
                 (exit status 125) rather than left reading zeros where its data was",
                self.creator
            );
            // SAFETY: _exit ends the process at once; nothing to unwind.
            unsafe { libc::_exit(125) };
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn serve(&self) {
        if let Some(hook) = START_HOOK.get() {
            hook();
        }
        // Only live views are polled (poll(2) refuses more descriptors
        // than RLIMIT_NOFILE, however many are -1), `which` maps back.
        let mut fds = [libc::pollfd {
            fd: -1,
            events: libc::POLLIN,
            revents: 0,
        }; MAX_VIEWS + 1];
        let mut which = [0usize; MAX_VIEWS];
        while !self.stop.load(Ordering::SeqCst) {
            let mut n = 0;
            {
                let st = self.lock();
                for (i, v) in st.views.iter().enumerate() {
                    if let Some(v) = v {
                        fds[n] = libc::pollfd {
                            fd: v.raw_fd(),
                            events: libc::POLLIN,
                            revents: 0,
                        };
                        which[n] = i;
                        n += 1;
                    }
                }
            }
            fds[n] = libc::pollfd {
                fd: self.bell.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: the first n+1 entries of `fds` are valid pollfd structs.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), (n + 1) as libc::nfds_t, -1) };
            if r < 0 {
                // EINTR; anything else cannot happen with valid descriptors
                // below the limit, but must not spin either.
                std::thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            let mut st = self.lock();
            for (p, &i) in fds[..n].iter().zip(which.iter()) {
                if p.revents == 0 {
                    continue;
                }
                let mut forks: [Option<Uffd>; 16] = std::array::from_fn(|_| None);
                let mut faults = [None::<Fault>; 16];
                let Some(v) = st.views[i].as_ref() else {
                    continue;
                };
                let (mut nf, mut nk) = (0, 0);
                // A fork elsewhere in this process copies the descriptor
                // table: between the kernel installing a fork event's
                // descriptor here and `add_view` recording it, a child
                // would inherit one it does not know it must close.
                self.reading.store(true, Ordering::SeqCst);
                let r = v.read_messages(|m| match m {
                    Message::Fault(f) => {
                        faults[nf] = Some(f);
                        nf += 1;
                    }
                    Message::Fork(u) => {
                        forks[nk] = Some(u);
                        nk += 1;
                    }
                });
                for u in forks.iter_mut().filter_map(Option::take) {
                    self.add_view(&mut st, u);
                }
                self.reading.store(false, Ordering::SeqCst);
                if r.is_err() {
                    // EMFILE: no descriptor for a fork event's view; the
                    // event stays queued (the fork waits). The reserve
                    // descriptor is given up first, then views of gone
                    // processes give theirs back; the reserve is taken
                    // again once a view has been taken in.
                    let reserve = self.reserve.swap(-1, Ordering::SeqCst);
                    if reserve >= 0 {
                        // SAFETY: the reserve is ours (see `start`).
                        unsafe { libc::close(reserve) };
                    } else if self.reap(&mut st) == 0 {
                        if !self.said_emfile.swap(true, Ordering::Relaxed) {
                            // No formatting: that would allocate, and a
                            // fork holds the allocator while it waits.
                            let msg: &[u8] = b"memveil-shield: no free descriptor for a forked \
                                process's view of protected shared memory; the fork waits until \
                                one is free (raise the open-files limit)\n";
                            // SAFETY: a write of a static buffer to stderr.
                            let _ = unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
                        }
                        drop(st);
                        std::thread::sleep(std::time::Duration::from_millis(1));
                        st = self.lock();
                    }
                } else if nk > 0 && self.reserve.load(Ordering::SeqCst) < 0 {
                    self.reserve.store(open_reserve(), Ordering::SeqCst);
                }
                for f in faults.iter().flatten() {
                    self.resolve(&mut st, i, f);
                }
            }
        }
    }

    /// Drops the views of processes that exited or exec'd (their
    /// descriptors report nothing: a write-protect probe answers `ESRCH`);
    /// returns how many.
    fn reap(&self, st: &mut State) -> usize {
        let probe = st.mappings.first().map(|m| m.base);
        let mut n = 0;
        for i in 1..MAX_VIEWS {
            let dead = match (st.views[i].as_ref(), probe) {
                (None, _) => false,
                // Nothing protected any more: no view is needed.
                (Some(_), None) => true,
                // Clearing write-protection is harmless here: the handler,
                // the only one that sets it, is not evicting now.
                (Some(v), Some(a)) => v
                    .write_protect(a as u64, PAGE as u64, false)
                    .is_err_and(|e| errno_of(&e) == libc::ESRCH),
            };
            if dead {
                self.drop_view(st, i);
                n += 1;
            }
        }
        n
    }

    fn add_view(&self, st: &mut State, u: Uffd) {
        // Short-lived children (a server forking per connection) leave
        // views that report nothing when they go: look for them here.
        self.reap(st);
        match st.views.iter().position(Option::is_none) {
            Some(k) => {
                self.fds[k].store(u.raw_fd(), Ordering::Relaxed);
                st.views[k] = Some(u);
            }
            // No room: the child's view cannot be served, and dropping its
            // descriptor unregisters it, where evicted pages would read as
            // zeros. So every page is written back first and nothing is
            // evicted from now on (counted: shared_evicted stays 0).
            None => {
                self.degraded.store(true, Ordering::SeqCst);
                for m in 0..st.mappings.len() {
                    let back = self.write_back(st, m);
                    st.resident += back;
                }
                drop(u);
                // Allocates (stderr), once; rare enough.
                if !self.said_degraded.swap(true, Ordering::Relaxed) {
                    eprintln!(
                        "memveil-shield: more than {MAX_VIEWS} processes map protected shared \
                         memory at once: it was written back and is plaintext from now on"
                    );
                }
            }
        }
        self.owner
            .stats
            .counters()
            .shared_views
            .fetch_max(st.live_views(), Ordering::Relaxed);
    }

    fn drop_view(&self, st: &mut State, i: usize) {
        if i == 0 {
            return;
        }
        if let Some(v) = st.views[i].take() {
            let _ =
                self.fds[i].compare_exchange(v.raw_fd(), -1, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    fn resolve(&self, st: &mut State, view: usize, f: &Fault) {
        let a = usize::try_from(f.address).unwrap_or(0) & !(PAGE - 1);
        let found = st.find(a);
        if f.flags & uffd::PAGEFAULT_FLAG_WP != 0 {
            // A write to a page still protected in this view since an
            // eviction: the page is back (or the write faults again as
            // missing); clearing the protection wakes the writer.
            if let Some(v) = st.views[view].as_ref() {
                if v.write_protect(a as u64, PAGE as u64, false).is_err() {
                    let _ = v.wake(a as u64, PAGE as u64);
                }
            }
            return;
        }
        if let Some((m, i)) = found {
            if st.mappings[m].states[i] != RESIDENT && st.resident >= self.window {
                self.evict(st, self.batch);
            }
        }
        let c = self.owner.stats.counters();
        let mut bounce = self.bounce.lock().unwrap_or_else(PoisonError::into_inner);
        let (src, was): (&[u8], u8) = match found {
            Some((m, i)) if st.mappings[m].states[i] == EVICTED => {
                self.decrypt_slot(&st.mappings[m], i, &mut bounce);
                (&bounce[..], EVICTED)
            }
            // Never written, or present (another view brought it back since
            // this fault was queued: the copy then finds it, EEXIST, and the
            // thread is only woken), or removed behind the handler's back
            // (a raw MADV_REMOVE): zeros.
            Some((m, i)) => (&ZEROS[..], st.mappings[m].states[i]),
            // Not a page of any protected mapping: a view of a range this
            // shield let go of. Filling it could fill a page of another
            // registration at that address (the kernel does not check whose
            // range a descriptor acts on), and only waking would fault
            // forever: the view lets go of the page, and the kernel serves
            // it from the shmem file from now on.
            None => {
                drop(bounce);
                if let Some(v) = st.views[view].as_ref() {
                    let _ = v.unregister(a as u64, PAGE as u64);
                    let _ = v.wake(a as u64, PAGE as u64);
                }
                return;
            }
        };
        let r = match st.views[view].as_ref() {
            Some(v) => v.copy(a as u64, src),
            None => return,
        };
        drop(bounce);
        match r {
            Ok(()) => {
                if let Some((m, i)) = found {
                    st.mappings[m].states[i] = RESIDENT;
                    if was != RESIDENT {
                        st.resident += 1;
                    }
                    if was == EVICTED {
                        c.shared_faults_in.fetch_add(1, Ordering::Relaxed);
                        c.shared_evicted.fetch_sub(1, Ordering::Relaxed);
                    }
                    c.shared_resident
                        .store(st.resident as u64, Ordering::Relaxed);
                }
            }
            Err(e) if errno_of(&e) == libc::ESRCH => self.drop_view(st, view),
            // Present already (another view brought it back, or the fault
            // was resolved meanwhile), or the mappings changed under the
            // call: wake the thread, which faults again if it must.
            Err(_) => {
                if let Some(v) = st.views[view].as_ref() {
                    let _ = v.wake(a as u64, PAGE as u64);
                }
            }
        }
    }

    /// Evicts up to `n` plaintext pages, taken round the clock hand.
    fn evict(&self, st: &mut State, n: usize) {
        let mut left = n;
        let total: usize = st.mappings.iter().map(|m| m.pages).sum();
        let mut scanned = 0;
        if self.degraded.load(Ordering::Relaxed) {
            return;
        }
        while left > 0 && scanned < total && !st.mappings.is_empty() {
            let (mut m, mut i) = st.hand;
            if m >= st.mappings.len() {
                (m, i) = (0, 0);
            }
            if i >= st.mappings[m].pages {
                st.hand = ((m + 1) % st.mappings.len(), 0);
                continue;
            }
            // A run of resident pages from the hand.
            let map = &st.mappings[m];
            let mut k = 0;
            while k < left.min(RUN) && i + k < map.pages && map.states[i + k] == RESIDENT {
                k += 1;
            }
            if k == 0 {
                st.hand = (m, i + 1);
                scanned += 1;
                continue;
            }
            st.hand = (m, i + k);
            scanned += k;
            if self.evict_run(st, m, i, k).is_err() {
                return;
            }
            left -= k;
        }
    }

    /// Evicts pages `i..i+k` of mapping `m`: write-protected in every view,
    /// read, encrypted into the store, punched out of the shmem file.
    fn evict_run(&self, st: &mut State, m: usize, i: usize, k: usize) -> Result<(), ()> {
        let (addr, bytes) = (st.mappings[m].base + i * PAGE, k * PAGE);
        for v in 0..MAX_VIEWS {
            match self.protect_in_view(st, v, addr, k) {
                Ok(()) => {}
                Err(()) => {
                    self.unprotect_all(st, addr, bytes);
                    return Err(());
                }
            }
        }
        let map = &st.mappings[m];
        let off = i * PAGE;
        // SAFETY: the store has `pages` slots; i+k <= pages.
        let dst = unsafe { std::slice::from_raw_parts_mut(map.store.add(off), bytes) };
        if read_full(map.memfd.as_raw_fd(), dst, off).is_err() {
            self.unprotect_all(st, addr, bytes);
            return Err(());
        }
        for (j, page) in dst.chunks_exact_mut(PAGE).enumerate() {
            let _ = self.key.encrypt_unit((addr + j * PAGE) as u128, page);
        }
        // SAFETY: fallocate on our own memfd, within its size.
        let r = unsafe {
            libc::fallocate(
                map.memfd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off as libc::off_t,
                bytes as libc::off_t,
            )
        };
        if r != 0 {
            self.unprotect_all(st, addr, bytes);
            return Err(());
        }
        let map = &mut st.mappings[m];
        map.states[i..i + k].fill(EVICTED);
        st.resident = st.resident.saturating_sub(k);
        let c = self.owner.stats.counters();
        c.shared_evictions.fetch_add(k as u64, Ordering::Relaxed);
        c.shared_evicted.fetch_add(k as u64, Ordering::Relaxed);
        c.shared_resident
            .store(st.resident as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Write-protects pages `addr..addr+k*PAGE` in view `v`. A gone view is
    /// dropped; pages that view does not map (`ENOENT`: unmapped there, or
    /// another mapping in the middle of the range, where the kernel stops
    /// at the first such page) are skipped page by page; any other refusal
    /// (`EAGAIN` while a fork is being set up) is an error: no exclusion.
    fn protect_in_view(&self, st: &mut State, v: usize, addr: usize, k: usize) -> Result<(), ()> {
        let r = match st.views[v].as_ref() {
            Some(view) => view.write_protect(addr as u64, (k * PAGE) as u64, true),
            None => return Ok(()),
        };
        match r {
            Ok(()) => Ok(()),
            Err(e) if errno_of(&e) == libc::ESRCH => {
                self.drop_view(st, v);
                Ok(())
            }
            Err(e) if errno_of(&e) == libc::ENOENT && k > 1 => {
                for j in 0..k {
                    self.protect_in_view(st, v, addr + j * PAGE, 1)?;
                }
                Ok(())
            }
            Err(e) if errno_of(&e) == libc::ENOENT => Ok(()),
            Err(_) => Err(()),
        }
    }

    fn unprotect_all(&self, st: &State, addr: usize, bytes: usize) {
        for view in st.views.iter().flatten() {
            let _ = view.write_protect(addr as u64, bytes as u64, false);
        }
    }

    /// The plaintext of evicted page `i` of `map` (its slot decrypted under
    /// the page's address) into `out`.
    fn decrypt_slot(&self, map: &Mapping, i: usize, out: &mut [u8]) {
        out.copy_from_slice(map.slot(i));
        // A 4096-byte unit is always a valid XTS length.
        let _ = self.key.decrypt_unit((map.base + i * PAGE) as u128, out);
    }

    /// Writes every evicted page of mapping `m` back into its shmem file,
    /// decrypted; returns how many (they are plaintext from now on). A page
    /// that cannot be written back marks the shield `lost`: its creator
    /// then never says it released its views, so their watchdogs stop
    /// them instead of letting them read zeros there.
    fn write_back(&self, st: &mut State, m: usize) -> usize {
        let mut bounce = self.bounce.lock().unwrap_or_else(PoisonError::into_inner);
        let c = self.owner.stats.counters();
        let map = &mut st.mappings[m];
        let mut back = 0;
        for i in 0..map.pages {
            if map.states[i] != EVICTED {
                continue;
            }
            self.decrypt_slot(map, i, &mut bounce);
            // SAFETY: a write of one page from our bounce buffer to our memfd.
            let w = unsafe {
                libc::pwrite(
                    map.memfd.as_raw_fd(),
                    bounce.as_ptr().cast(),
                    PAGE,
                    (i * PAGE) as libc::off_t,
                )
            };
            if w == PAGE as isize {
                map.states[i] = RESIDENT;
                back += 1;
                c.shared_evicted.fetch_sub(1, Ordering::Relaxed);
            } else {
                self.lost.store(true, Ordering::SeqCst);
            }
        }
        bounce.fill(0);
        back
    }
}

fn read_full(fd: RawFd, buf: &mut [u8], off: usize) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: reads into the rest of `buf`, which we own exclusively.
        let r = unsafe {
            libc::pread(
                fd,
                buf[done..].as_mut_ptr().cast(),
                buf.len() - done,
                (off + done) as libc::off_t,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            // A hole past the end cannot happen within the size; zeros.
            buf[done..].fill(0);
            return Ok(());
        }
        done += usize::try_from(r).unwrap_or(0);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{parse_shared_policy as parse, SharedKind as K, SharedMode as M};

    #[test]
    fn shared_memory_settings_parse_as_documented() {
        assert_eq!(parse("refuse"), Ok([M::Refuse; 3]));
        assert_eq!(parse("unprotected"), Ok([M::Plaintext; 3]));
        // `protected` protects anonymous memory and refuses the kinds other
        // processes may attach unless overridden.
        assert_eq!(parse("protected"), Ok([M::Protect, M::Refuse, M::Refuse]));
        let m = parse("protected,sysv=unprotected").expect("ok");
        assert_eq!(m[K::SysV as usize], M::Plaintext);
        assert_eq!(m[K::Memfd as usize], M::Refuse);
        assert_eq!(m[K::Anonymous as usize], M::Protect);
        assert_eq!(
            parse("refuse,anonymous=protected").expect("ok")[K::Anonymous as usize],
            M::Protect
        );
        for bad in [
            "",
            "on",
            "protected,sysv=protected",
            "protected,memfd=protected",
            "refuse,sysv",
            "refuse,disk=refuse",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
        assert!(parse("protected,sysv=protected")
            .expect_err("refused")
            .contains("cannot be protected"));
    }
}
