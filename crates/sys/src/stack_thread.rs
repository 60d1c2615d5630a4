//! Threads that run on a stack the caller provides (e.g. `memfd_secret`
//! memory), so that whatever the thread's code spills to its stack — key
//! schedules, IVs, counters — never lands in ordinary memory.
//!
//! glibc places the thread descriptor and static TLS at the top of a
//! caller-provided stack, so they live in that memory too. The kernel's
//! futex wake at thread exit cannot reach `memfd_secret` pages (they refuse
//! `get_user_pages`, and glibc's `pthread_join` aborts on the resulting
//! EFAULT), so [`StackThread::join`] polls with `pthread_tryjoin_np`, which
//! only reads the thread id the kernel clears with an ordinary user write.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

type Job = Box<dyn FnOnce() + Send + 'static>;

struct Start {
    job: Job,
    done: Arc<AtomicBool>,
}

extern "C" fn trampoline(arg: *mut libc::c_void) -> *mut libc::c_void {
    // SAFETY: `arg` is the `Box<Start>` leaked by `spawn` for exactly this
    // thread, reclaimed once here.
    let start = unsafe { Box::from_raw(arg.cast::<Start>()) };
    let Start { job, done } = *start;
    // A panic must not unwind into C; the process aborts on panic in
    // release builds anyway.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
    done.store(true, Ordering::Release);
    std::ptr::null_mut()
}

/// A running thread on a caller-provided stack `S`; joined (and the stack
/// released) on [`StackThread::join`] or drop.
pub struct StackThread<S: AsMut<[u8]> + Send + 'static> {
    thread: libc::pthread_t,
    done: Arc<AtomicBool>,
    stack: Option<Box<S>>,
    joined: bool,
}

/// Spawns `f` on a new thread whose whole stack is `stack.as_mut()` (page
/// aligned, at least 64 KiB). The stack object is kept alive, untouched,
/// until the thread has exited.
///
/// The thread starts with every signal blocked, so a signal sent to the
/// process goes to one of the program's own threads: its handler never runs
/// on this stack, and a program that blocks a signal everywhere to `sigwait`
/// for it still gets it, instead of the signal's default action taking
/// place on this thread.
///
/// # Errors
/// `InvalidInput` for a stack that is too small or unaligned; the error of
/// `pthread_create(3)`.
pub fn spawn<S, F>(mut stack: Box<S>, f: F) -> io::Result<StackThread<S>>
where
    S: AsMut<[u8]> + Send + 'static,
    F: FnOnce() + Send + 'static,
{
    let (base, len) = {
        let s: &mut [u8] = (*stack).as_mut();
        (s.as_mut_ptr(), s.len())
    };
    if len < 64 * 1024 || !(base as usize).is_multiple_of(crate::page_size()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "thread stack must be page-aligned and at least 64 KiB",
        ));
    }
    let done = Arc::new(AtomicBool::new(false));
    let start = Box::into_raw(Box::new(Start {
        job: Box::new(f),
        done: Arc::clone(&done),
    }));
    // SAFETY: all-zero is a valid placeholder; pthread_attr_init overwrites it.
    let mut attr: libc::pthread_attr_t = unsafe { std::mem::zeroed() };
    // SAFETY: attr is a valid out pointer; init/setstack/destroy follow the
    // documented protocol. The stack range belongs to `stack`, which we keep
    // (boxed, never moved or touched) until the thread has exited.
    let r = unsafe {
        libc::pthread_attr_init(&mut attr);
        let r = libc::pthread_attr_setstack(&mut attr, base.cast(), len);
        if r != 0 {
            libc::pthread_attr_destroy(&mut attr);
            drop(Box::from_raw(start));
            return Err(io::Error::from_raw_os_error(r));
        }
        let mut t: libc::pthread_t = 0;
        // The new thread inherits the creator's mask: block everything
        // around the create, then restore the creator's.
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        let r = libc::pthread_create(&mut t, &attr, trampoline, start.cast());
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        libc::pthread_attr_destroy(&mut attr);
        if r != 0 {
            drop(Box::from_raw(start));
            return Err(io::Error::from_raw_os_error(r));
        }
        t
    };
    Ok(StackThread {
        thread: r,
        done,
        stack: Some(stack),
        joined: false,
    })
}

impl<S: AsMut<[u8]> + Send + 'static> StackThread<S> {
    /// Whether the thread's function has returned.
    #[must_use]
    pub fn finished(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Waits for the thread to exit and returns its stack.
    pub fn join(mut self) -> Option<Box<S>> {
        self.join_inner();
        self.stack.take()
    }

    fn join_inner(&mut self) {
        if self.joined {
            return;
        }
        // Never block in a futex on the thread descriptor (it may sit in
        // secret memory); poll instead.
        while !self.done.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_micros(200));
        }
        loop {
            // SAFETY: `thread` is a joinable thread we created and have not
            // joined or detached; tryjoin reads its tid without a futex.
            let r = unsafe { libc::pthread_tryjoin_np(self.thread, std::ptr::null_mut()) };
            if r != libc::EBUSY {
                break;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        self.joined = true;
    }
}

impl<S: AsMut<[u8]> + Send + 'static> Drop for StackThread<S> {
    fn drop(&mut self) {
        self.join_inner();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Stack(crate::Mapping);
    impl AsMut<[u8]> for Stack {
        fn as_mut(&mut self) -> &mut [u8] {
            // SAFETY: the whole mapping is read-write and owned by `self`.
            unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr(), self.0.len()) }
        }
    }

    #[test]
    fn runs_on_the_given_stack() {
        let m = crate::Mapping::anonymous(128 * 1024, crate::Protection::ReadWrite).expect("map");
        let (lo, hi) = (m.as_ptr() as usize, m.as_ptr() as usize + m.len());
        let (tx, rx) = std::sync::mpsc::channel();
        let t = spawn(Box::new(Stack(m)), move || {
            let local = 0u8;
            tx.send(std::ptr::from_ref(&local) as usize).expect("send");
        })
        .expect("spawn");
        let addr = rx.recv().expect("recv");
        assert!(t.join().is_some());
        assert!((lo..hi).contains(&addr), "{addr:x} not in {lo:x}..{hi:x}");
    }

    /// The calling thread's blocked-signal mask.
    fn blocked() -> libc::sigset_t {
        // SAFETY: all-zero is a valid sigset_t; pthread_sigmask with a null
        // new set only reads the mask into `cur`.
        unsafe {
            let mut cur: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut cur);
            cur
        }
    }

    fn is_blocked(set: &libc::sigset_t, sig: libc::c_int) -> bool {
        // SAFETY: `set` is a valid, initialised sigset_t.
        unsafe { libc::sigismember(set, sig) == 1 }
    }

    #[test]
    fn thread_blocks_every_signal_and_the_creator_keeps_its_mask() {
        let before = blocked();
        assert!(
            !is_blocked(&before, libc::SIGTERM),
            "test thread blocks SIGTERM already"
        );
        let m = crate::Mapping::anonymous(128 * 1024, crate::Protection::ReadWrite).expect("map");
        let (tx, rx) = std::sync::mpsc::channel();
        let t = spawn(Box::new(Stack(m)), move || {
            let mask = blocked();
            let sigs = [
                libc::SIGTERM,
                libc::SIGINT,
                libc::SIGUSR1,
                libc::SIGCHLD,
                libc::SIGALRM,
            ];
            tx.send(sigs.iter().all(|&s| is_blocked(&mask, s)))
                .expect("send");
        })
        .expect("spawn");
        assert!(
            rx.recv().expect("recv"),
            "the new thread must block every signal"
        );
        assert!(t.join().is_some());
        assert!(
            !is_blocked(&blocked(), libc::SIGTERM),
            "creator's mask changed"
        );
    }

    struct SecretStack(crate::Mapping);
    impl AsMut<[u8]> for SecretStack {
        fn as_mut(&mut self) -> &mut [u8] {
            // SAFETY: pages [1, len-1) of the mapping are memfd_secret pages
            // mapped read-write and owned by `self`.
            unsafe {
                std::slice::from_raw_parts_mut(
                    self.0.as_ptr().add(crate::page_size()),
                    self.0.len() - 2 * crate::page_size(),
                )
            }
        }
    }

    /// Regression: glibc's pthread_join aborted ("The futex facility returned
    /// an unexpected error code") when the descriptor lived in secret memory.
    #[test]
    fn joins_a_thread_on_a_memfd_secret_stack() {
        let Ok(fd) = crate::memfd_secret() else {
            memveil_testkit::skip(
                memveil_testkit::Need::MemfdSecret,
                "no secret stack to join on",
            );
            return;
        };
        let ps = crate::page_size();
        let len = 128 * 1024;
        let f = std::fs::File::from(fd);
        f.set_len(len as u64).expect("size");
        let mut m = crate::Mapping::anonymous(len + 2 * ps, crate::Protection::None).expect("map");
        m.map_fd_at(ps, len, std::os::fd::AsFd::as_fd(&f))
            .expect("map secret");
        let t = spawn(Box::new(SecretStack(m)), || {
            let v: Vec<u32> = (0..1000).collect();
            std::hint::black_box(v);
        })
        .expect("spawn");
        assert!(t.join().is_some());
    }

    #[test]
    fn small_stack_is_refused() {
        let m = crate::Mapping::anonymous(4096, crate::Protection::ReadWrite).expect("map");
        assert!(spawn(Box::new(Stack(m)), || ()).is_err());
    }
}
