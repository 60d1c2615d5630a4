//! Thread stacks in the protected region.
//!
//! glibc maps the stack of every thread a program creates with its own
//! internal `mmap`, which a preload cannot reach, so those stacks would stay
//! outside the shield. `pthread_create` is interposed: unless the caller
//! brings a stack of its own (which then already lives where the caller put
//! it: the region, if it came from `malloc`), the thread gets one from the
//! region's page half, below a `PROT_NONE` guard page, through
//! `pthread_attr_setstack` on a copy of the caller's attributes.
//!
//! glibc puts the thread's control block (`struct pthread`) at the top of a
//! stack it is given, its static TLS and then the thread's frames below.
//! The kernel writes the control block as the thread exits (it clears the
//! thread id that `pthread_join` waits on, and walks the robust futex list)
//! when a fault can no longer be waited for, so the page holding it is kept
//! resident ([`memveil_shield::Shield::keep_resident`]). That page holds
//! nothing else: the stack is given with its top just above a page
//! boundary, so the control block starts on the boundary and the TLS and
//! every frame lie in pages that leave the window like any other. How far
//! above is learnt once, from a thread created for that purpose at the first
//! `pthread_create` (glibc places the block `sizeof(struct pthread)` below
//! the top, rounded down to the TLS alignment).
//!
//! glibc never frees a stack it was given, so this module does: a stack is
//! reclaimed (wiped and returned to the region) once its thread is both
//! finished and detached or joined (`pthread_join` and friends,
//! `pthread_detach` are interposed to know), at the next thread creation.
//! Finished is glibc's own test: the kernel clears the thread id in the
//! control block as the thread exits (`CLONE_CHILD_CLEARTID`, what
//! `pthread_join` waits for; a join then writes -1 there). The field's offset is glibc's layout (0x2d0 on
//! x86-64 since glibc 2.26), checked at start-up against the main thread's
//! own control block; where it does not match, threads keep glibc's stacks
//! and a note says their stacks are not protected.
//!
//! No code of this library runs on a thread's stack below its start
//! routine: `pthread_exit` and cancellation unwind that stack, and an unwind
//! into a Rust frame aborts the process under `panic = "abort"`.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use memveil_shield::PAGE;

use memveil_shield::region::SpinLock;

/// Bytes from a thread's control block to the top of the stack glibc was
/// given (`struct pthread` is about 2.3 KiB on glibc 2.36), learnt by
/// [`calibrate`]; 0 until then, `usize::MAX` when it could not be learnt.
static TOP_ABOVE_BLOCK: AtomicUsize = AtomicUsize::new(0);

/// One stack this module gave a thread.
struct Given {
    /// The mapping: guard page(s) then the stack.
    base: usize,
    len: usize,
    thread: libc::pthread_t,
    detached: bool,
    joined: bool,
}

/// The stacks given, under [`GIVEN_LOCK`], which is held across `fork`
/// (taken in the prepare handler, released in parent and child) so that the
/// child never inherits it locked.
static GIVEN_LOCK: SpinLock = SpinLock::new();
static mut GIVEN: Vec<Given> = Vec::new();

/// Runs `f` on the stacks given, under their lock.
fn with_given<R>(f: impl FnOnce(&mut Vec<Given>) -> R) -> R {
    GIVEN_LOCK.lock();
    // SAFETY: GIVEN is only touched here, under GIVEN_LOCK.
    let r = f(unsafe { &mut *std::ptr::addr_of_mut!(GIVEN) });
    GIVEN_LOCK.unlock();
    r
}

/// A thread's start routine. `C-unwind`: `pthread_exit` and cancellation
/// unwind through it.
pub type StartFn = extern "C-unwind" fn(*mut c_void) -> *mut c_void;

type CreateFn = unsafe extern "C" fn(
    *mut libc::pthread_t,
    *const libc::pthread_attr_t,
    StartFn,
    *mut c_void,
) -> c_int;

static REAL_CREATE: AtomicUsize = AtomicUsize::new(0);

extern "C" {
    // POSIX; the libc crate lacks it. (Linux has one contention scope
    // only, so the scope attribute needs no copying.)
    fn pthread_attr_getdetachstate(attr: *const libc::pthread_attr_t, state: *mut c_int) -> c_int;
}

/// Offset of the thread id in glibc's `struct pthread` on x86-64.
const GLIBC_TID_OFFSET: usize = 0x2d0;

/// 1 when [`GLIBC_TID_OFFSET`] holds the main thread's id (checked once),
/// 2 when it does not (thread stacks are then left to glibc).
static TID_LAYOUT: AtomicUsize = AtomicUsize::new(0);

/// Address of the thread-id field of thread `t`'s control block.
fn tid_field(t: libc::pthread_t) -> *const i32 {
    usize::try_from(t)
        .unwrap_or(0)
        .wrapping_add(GLIBC_TID_OFFSET) as *const i32
}

/// Whether the thread-id field sits where this module reads it: checked on
/// the calling thread's own control block (glibc's, outside the region).
fn layout_known() -> bool {
    match TID_LAYOUT.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            // SAFETY: pthread_self is this thread's control block, mapped by
            // glibc and larger than the offset read (struct pthread is
            // about 2.3 KiB); an aligned i32 read of it.
            let id = unsafe { tid_field(libc::pthread_self()).read_volatile() };
            let ok = i64::from(id) == i64::from(memveil_sys::process::gettid());
            TID_LAYOUT.store(if ok { 1 } else { 2 }, Ordering::Relaxed);
            if !ok {
                eprintln!(
                    "memveil-shield: this C library's thread control block is not laid out as expected: \
                     threads keep the stacks the C library gives them, which are NOT protected"
                );
            }
            ok
        }
    }
}

/// Whether thread `t` (whose control block is at the top of a stack given
/// here, kept resident) has exited: the kernel cleared its id (0), or a join
/// marked the control block free (glibc writes -1 there).
fn finished(t: libc::pthread_t) -> bool {
    // SAFETY: `t` is a thread created with a stack this module gave and has
    // not reclaimed, so its control block is mapped (and kept resident: the
    // read cannot fault); the offset was checked by `layout_known`.
    unsafe { tid_field(t).read_volatile() <= 0 }
}

/// A copy of `attr` (or of the defaults) with the stack set to
/// `[stack, stack+size)`; the size and guard the caller asked for. `None`
/// when the caller brings a stack of its own.
///
/// # Safety
/// `attr` is null or points at an initialised attribute object.
unsafe fn attrs_with_stack(
    attr: *const libc::pthread_attr_t,
) -> Option<(libc::pthread_attr_t, usize, usize, bool)> {
    // SAFETY: all-zero is a valid placeholder; pthread_attr_init fills it.
    let mut a: libc::pthread_attr_t = unsafe { std::mem::zeroed() };
    // SAFETY: `a` is a valid out pointer.
    if unsafe { libc::pthread_attr_init(&mut a) } != 0 {
        return None;
    }
    // SAFETY: for the getters and setters below: `attr` is initialised
    // (caller's contract), `a` was initialised above, and every out pointer
    // is a local of the right type.
    unsafe {
        let src: *const libc::pthread_attr_t = if attr.is_null() { &a } else { attr };
        let (mut addr, mut size) = (std::ptr::null_mut::<c_void>(), 0usize);
        if !attr.is_null()
            && libc::pthread_attr_getstack(src, &mut addr, &mut size) == 0
            && !addr.is_null()
        {
            libc::pthread_attr_destroy(&mut a);
            return None;
        }
        let mut size = 0usize;
        libc::pthread_attr_getstacksize(src, &mut size);
        let mut guard = 0usize;
        libc::pthread_attr_getguardsize(src, &mut guard);
        let mut detach = 0;
        pthread_attr_getdetachstate(src, &mut detach);
        if !attr.is_null() {
            let mut v = 0;
            if libc::pthread_attr_getinheritsched(attr, &mut v) == 0 {
                libc::pthread_attr_setinheritsched(&mut a, v);
            }
            if libc::pthread_attr_getschedpolicy(attr, &mut v) == 0 {
                libc::pthread_attr_setschedpolicy(&mut a, v);
            }
            let mut p: libc::sched_param = std::mem::zeroed();
            if libc::pthread_attr_getschedparam(attr, &mut p) == 0 {
                libc::pthread_attr_setschedparam(&mut a, &p);
            }
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            let n = std::mem::size_of::<libc::cpu_set_t>();
            if libc::pthread_attr_getaffinity_np(attr, n, &mut set) == 0
                && libc::CPU_COUNT(&set) > 0
            {
                libc::pthread_attr_setaffinity_np(&mut a, n, &set);
            }
            copy_sigmask(attr, &mut a);
        }
        libc::pthread_attr_setdetachstate(&mut a, detach);
        Some((
            a,
            size.max(64 * 1024),
            guard,
            detach == libc::PTHREAD_CREATE_DETACHED,
        ))
    }
}

static GET_SIGMASK: AtomicUsize = AtomicUsize::new(0);
static SET_SIGMASK: AtomicUsize = AtomicUsize::new(0);

/// Copies the signal mask a new thread starts with (glibc 2.32+
/// `pthread_attr_{get,set}sigmask_np`, looked up at run time).
///
/// # Safety
/// Both attribute objects are initialised.
unsafe fn copy_sigmask(from: *const libc::pthread_attr_t, to: *mut libc::pthread_attr_t) {
    type Get = unsafe extern "C" fn(*const libc::pthread_attr_t, *mut libc::sigset_t) -> c_int;
    type Set = unsafe extern "C" fn(*mut libc::pthread_attr_t, *const libc::sigset_t) -> c_int;
    let (Some(g), Some(s)) = (
        crate::first_definition(c"pthread_attr_getsigmask_np", &GET_SIGMASK),
        crate::first_definition(c"pthread_attr_setsigmask_np", &SET_SIGMASK),
    ) else {
        return;
    };
    // SAFETY: the symbols are glibc's functions of these types; the sigset
    // is a local; a return of 0 means `from` has a mask set (-1: none).
    unsafe {
        let (g, s) = (
            std::mem::transmute::<usize, Get>(g),
            std::mem::transmute::<usize, Set>(s),
        );
        let mut set: libc::sigset_t = std::mem::zeroed();
        if g(from, &mut set) == 0 {
            s(to, &set);
        }
    }
}

/// `pthread_create` with the new thread's stack in the protected region.
///
/// # Safety
/// The `pthread_create(3)` contract.
pub unsafe fn create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: StartFn,
    arg: *mut c_void,
) -> c_int {
    let real = crate::next_definition(c"pthread_create", &REAL_CREATE);
    if real == 0 {
        return libc::EAGAIN;
    }
    // SAFETY: glibc's pthread_create has this type.
    let real = unsafe { std::mem::transmute::<usize, CreateFn>(real) };
    let shield = match crate::shield() {
        Some(s) if !crate::internal() && !thread.is_null() && layout_known() => s,
        // SAFETY: forwarded unchanged (the caller's contract).
        _ => return unsafe { real(thread, attr, start, arg) },
    };
    // SAFETY: the caller's attr is null or initialised.
    let Some((mut a, size, guard, detached)) = (unsafe { attrs_with_stack(attr) }) else {
        // SAFETY: forwarded unchanged: the caller brings its own stack.
        return unsafe { real(thread, attr, start, arg) };
    };
    reap();
    let Some(above) = calibrate(real) else {
        // SAFETY: `a` was initialised by attrs_with_stack.
        unsafe { libc::pthread_attr_destroy(&mut a) };
        // SAFETY: forwarded unchanged (the note was printed).
        return unsafe { real(thread, attr, start, arg) };
    };
    let guard = guard.next_multiple_of(PAGE).max(PAGE);
    let size = size.next_multiple_of(PAGE);
    let keep = above.next_multiple_of(PAGE);
    let len = guard + size + keep;
    let Some(base) = crate::region_made().and_then(|r| r.alloc(len)) else {
        // SAFETY: `a` was initialised by attrs_with_stack.
        unsafe { libc::pthread_attr_destroy(&mut a) };
        return libc::EAGAIN;
    };
    // The guard below the stack: an overflow faults, as with glibc's stacks.
    // SAFETY: pages of the region this module just took.
    unsafe { crate::mprotect(base as *mut c_void, guard, libc::PROT_NONE) };
    let block = base + guard + size;
    shield.keep_resident(block, keep, true);
    // SAFETY: `a` is initialised; the stack is ours, `size + above` bytes
    // from a page boundary, and stays mapped until the thread is reclaimed.
    let r = unsafe {
        libc::pthread_attr_setstack(&mut a, (base + guard) as *mut c_void, size + above);
        let r = real(thread, &a, start, arg);
        libc::pthread_attr_destroy(&mut a);
        r
    };
    if r != 0 {
        release(base, len);
        return r;
    }
    // SAFETY: pthread_create succeeded and wrote the thread's id.
    let thread = unsafe { *thread };
    let at = usize::try_from(thread).unwrap_or(0);
    if at != block {
        // The C library placed the block elsewhere (a library loaded since
        // raised the TLS alignment): keep the pages it spans instead.
        let from = at.min(block) & !(PAGE - 1);
        shield.keep_resident(from, base + len - from, true);
    }
    with_given(|g| {
        g.push(Given {
            base,
            len,
            thread,
            detached,
            joined: false,
        });
    });
    0
}

/// The start routine of the calibration thread.
extern "C-unwind" fn calibration_start(_: *mut c_void) -> *mut c_void {
    std::ptr::null_mut()
}

/// Learns [`TOP_ABOVE_BLOCK`] once: a thread is created on a stack of the
/// region with a page-aligned top and joined; its control block's distance
/// below that top is the distance every later stack's top is set above a
/// page boundary. `None` (and a note) when it cannot be learnt.
fn calibrate(real: CreateFn) -> Option<usize> {
    match TOP_ABOVE_BLOCK.load(Ordering::Relaxed) {
        0 => {}
        usize::MAX => return None,
        n => return Some(n),
    }
    let len = 16 * PAGE;
    let base = crate::region_made()?.alloc(len)?;
    let mut t: libc::pthread_t = 0;
    // SAFETY: `a` is initialised before use and destroyed after; the stack
    // is `len` bytes of the region this function took and keeps until the
    // thread is joined; `t` is a local out pointer.
    let created = unsafe {
        let mut a: libc::pthread_attr_t = std::mem::zeroed();
        libc::pthread_attr_init(&mut a);
        libc::pthread_attr_setstack(&mut a, base as *mut c_void, len);
        let r = real(&mut t, &a, calibration_start, std::ptr::null_mut());
        libc::pthread_attr_destroy(&mut a);
        r == 0 && libc::pthread_join(t, std::ptr::null_mut()) == 0
    };
    release(base, len);
    let above = (base + len).checked_sub(usize::try_from(t).unwrap_or(usize::MAX));
    let found = above.filter(|&n| created && n > 0 && n <= 4 * PAGE);
    TOP_ABOVE_BLOCK.store(found.unwrap_or(usize::MAX), Ordering::Relaxed);
    if found.is_none() {
        eprintln!(
            "memveil-shield: could not place a thread's control block on a stack of the region: \
             threads keep the stacks the C library gives them, which are NOT protected"
        );
    }
    found
}

/// Returns a stack's pages to the region: wiped (resident) or dropped
/// (ciphertext), no longer kept, readable again.
fn release(base: usize, len: usize) {
    if let Some(s) = crate::shield() {
        s.keep_resident(base, len, false);
    }
    // Readable and writable again, wiped or dropped, and free.
    if let Some(r) = crate::region() {
        let _ = r.mprotect(base, len, crate::RW);
        r.free(base, len);
    }
}

/// Reclaims the stacks of threads that are finished and detached or joined.
pub fn reap() {
    let mut done = Vec::new();
    with_given(|g| {
        g.retain(|s| {
            let free = (s.detached || s.joined) && finished(s.thread);
            if free {
                done.push((s.base, s.len));
            }
            !free
        });
    });
    for (b, l) in done {
        release(b, l);
    }
}

/// Books that `thread` was joined (its stack may go once it is gone).
pub fn joined(thread: libc::pthread_t) {
    mark(thread, |s| s.joined = true);
}

/// Books that `thread` was detached.
pub fn detached(thread: libc::pthread_t) {
    mark(thread, |s| s.detached = true);
}

fn mark(thread: libc::pthread_t, f: impl Fn(&mut Given)) {
    with_given(|g| {
        if let Some(s) = g.iter_mut().find(|s| s.thread == thread) {
            f(s);
        }
    });
}

/// Before `fork`: holds the stacks' lock across it.
pub fn fork_prepare() {
    GIVEN_LOCK.lock();
}

/// After `fork`, in the parent.
pub fn fork_parent() {
    GIVEN_LOCK.unlock();
}

/// After `fork`, in the child: only the forking thread exists. glibc marks
/// the others finished in the child (it clears their ids), so the stacks of
/// those already detached or joined are reclaimed at the next creation; the
/// others stay (the child might still join them).
pub fn fork_child() {
    GIVEN_LOCK.unlock();
}
