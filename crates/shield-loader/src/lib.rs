//! `memveil-shield-loader PROGRAM ARGS...`: runs a statically linked
//! program (Go, musl, glibc `-static`, static-pie) with its anonymous memory
//! under memveil-shield, where the preload library cannot reach (it needs a
//! dynamic loader and a C allocator to replace).
//!
//! The loader is the process: it maps the program's segments, reserves the
//! protected region and starts the shield (settings from the same
//! `MEMVEIL_SHIELD_*` environment the preload reads) and an agent thread,
//! installs a seccomp filter on its main thread that turns the program's
//! `mmap`, `munmap`, `mremap`, `brk`, `madvise`, `mprotect` and forks into
//! notifications the agent serves from the region, then builds the initial
//! stack an `execve` would have and jumps to the program's entry. Every
//! thread the loader starts keeps every signal blocked (a process-directed
//! signal delivered to a thread Go did not create kills a Go program);
//! threads the program starts inherit the filter.
//!
//! A dynamically linked program works too (its dynamic loader is mapped as
//! the kernel would, and entered with `AT_BASE` at it): `memveil run` sends
//! those to the preload library unless `--via loader` asks for this path.
//! It refuses forks of the program (`clone` without `CLONE_VM`: the child
//! would read zeros where pages are evicted; fails with EAGAIN and a line
//! on stderr).
//! Not covered: the program's `.data`/`.bss`, the initial thread's stack,
//! memory of programs it executes (they inherit the filter, whose calls are
//! let through), and `/proc/self/exe` names the loader. If the shield cannot
//! start the program is not run: exit status 125 and the reason on stderr.
//!
//! Children that outlive the program (a daemon started with `posix_spawn` or
//! `os/exec`) keep the filter: a keeper process, forked first, holds the
//! listener and lets their calls through once the loader has ended, until no
//! task uses the filter any more (see `keeper.rs`). Without it the kernel
//! would fail their notified calls with ENOSYS; if it cannot start, the
//! loader says so on stderr and runs the program.

use std::ffi::{c_char, c_int, CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt as _;
use std::path::PathBuf;

use memveil_shield::region::Region;

mod agent;
mod elf;
mod enter;
mod filter;
mod keeper;
mod load;

/// Where the region is reserved when that address is free: the Go
/// runtime's first arena hint on amd64, so that its heap arenas land in the
/// region where it asks for them.
const GO_ARENA_HINT: usize = 0xc0_0000_0000;

/// Reserves the region, starts the shield from the environment (the same
/// settings the preload reads) and hands it the whole region. On the main
/// thread with every signal blocked: the shield's threads inherit the mask.
fn protect() -> Result<&'static Region, String> {
    let len = memveil_shield::start::region_len();
    let region = Region::reserve(len, 0, Some(GO_ARENA_HINT)).map_err(|e| {
        format!(
            "cannot reserve the protected region ({} GiB): {e}",
            len >> 30
        )
    })?;
    let (_, keyid) = memveil_shield::start::config()?;
    let shield = memveil_shield::start::from_env()?;
    let (base, end) = region.bounds();
    // SAFETY: the region is this process's own fresh anonymous private
    // mapping, from now on reached only through the agent's calls on it.
    unsafe {
        shield.encrypt_mprotect(
            base as *mut u8,
            end - base,
            libc::PROT_READ | libc::PROT_WRITE,
            keyid,
        )
    }
    .map_err(|e| e.to_string())?;
    region.attach(shield);
    Ok(Box::leak(Box::new(region)))
}

/// The exit status when the loader cannot run the program protected.
const REFUSED: c_int = 125;

fn die(msg: &str) -> ! {
    eprintln!("memveil-shield-loader: {msg}");
    std::process::exit(REFUSED)
}

/// `PROGRAM` as `execvp` finds it: a name without a slash through PATH.
fn resolve(program: &OsStr) -> Option<PathBuf> {
    if program.as_bytes().contains(&b'/') {
        return Some(PathBuf::from(program));
    }
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn block_all_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, initialised by sigfillset/pthread_sigmask.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        old
    }
}

/// Starts the agent thread (inheriting the blocked mask), which waits for
/// the listener.
fn start_agent(
    region: &'static Region,
    program: String,
    seen: &'static keeper::Seen,
) -> std::sync::mpsc::Sender<memveil_sys::fdguard::Held> {
    let (tx, rx) = std::sync::mpsc::channel::<memveil_sys::fdguard::Held>();
    let spawned = std::thread::Builder::new()
        .name("memveil-agent".into())
        .spawn(move || {
            let Ok(listener) = rx.recv() else { return };
            let e = agent::serve(&listener, region, &program, seen);
            // The program's memory calls would wait forever: end it loudly.
            eprintln!("memveil-shield-loader: the agent cannot serve {program} any more: {e}");
            std::process::abort();
        });
    if let Err(e) = spawned {
        die(&format!("cannot start the agent thread: {e}"));
    }
    tx
}

/// Says, once, that the keeper could not start and what follows from it.
fn keeper_missing(program: &str, why: &str) {
    eprintln!(
        "memveil-shield-loader: cannot start the keeper ({why}): children {program} starts \
         (posix_spawn, os/exec) that outlive it will fail their memory calls (mmap, brk, \
         mprotect, execve, fork) with ENOSYS once it has ended"
    );
}

/// Loads and enters the program `argv[1]` (see the crate's documentation).
///
/// # Safety
/// `argv` and `envp` are the vectors the kernel gave this process (as C's
/// `main` receives them), `argc` the number of `argv`'s entries; called on
/// the initial thread, once, before any other thread exists.
pub unsafe fn run(argc: c_int, argv: *const *const c_char, envp: *const *const c_char) -> ! {
    if argc < 2 {
        eprintln!("usage: memveil-shield-loader PROGRAM [ARGS...] (started by `memveil run`)");
        std::process::exit(2);
    }
    // SAFETY: argv[1] exists (argc >= 2) and is a NUL-terminated string.
    let program = unsafe { CStr::from_ptr(*argv.add(1)) };
    let name = OsStr::from_bytes(program.to_bytes());
    let Some(path) = resolve(name) else {
        die(&format!(
            "{}: command not found in PATH",
            name.to_string_lossy()
        ));
    };
    let shown = path.display().to_string();
    // Before any thread exists (it forks).
    // SAFETY: the initial thread, alone (the caller's promise).
    let keeper = unsafe { keeper::Keeper::start() }
        .inspect_err(|e| keeper_missing(&shown, e))
        .ok();
    let mask = block_all_signals();
    let loaded = load::load(&path).unwrap_or_else(|e| die(&e));
    let region = match protect() {
        Ok(p) => p,
        Err(e) => die(&format!("refusing to run {shown} unprotected: {e}")),
    };
    let seen = keeper
        .as_ref()
        .map_or_else(keeper::no_keeper, keeper::Keeper::seen);
    let tx = start_agent(region, shown.clone(), seen);
    let (listener, nnp) = filter::install()
        .unwrap_or_else(|e| die(&format!("cannot install the seccomp filter: {e}")));
    // A kernel older than 6.6 lacks it: the agent then answers as fast as
    // an ordinary wake-up lets it.
    let _ = filter::sync_wake_up(&listener);
    // Out of the program's way (the filter keeps it from closing it).
    let listener = memveil_sys::fdguard::move_high(listener);
    if nnp {
        eprintln!(
            "memveil-shield-loader: no_new_privs set (the filter needs it without \
             CAP_SYS_ADMIN): setuid programs {shown} runs gain no privileges"
        );
    }
    // The keeper's copy first; the loader's end of its socket closes here
    // (no descriptor of the loader's reaches the program).
    let kept = keeper.is_some_and(|k| {
        k.hand(std::os::fd::AsFd::as_fd(&listener))
            .inspect_err(|e| keeper_missing(&shown, e))
            .is_ok()
    });
    if tx.send(listener).is_err() {
        die("the agent thread ended before it started serving");
    }
    // One notified call of the loader's own (let through), so that the
    // agent has recorded an id before the program runs: the keeper looks
    // for a notification left unanswered from the last one recorded.
    if kept {
        // SAFETY: madvise of an empty range touches no memory.
        unsafe { libc::syscall(libc::SYS_madvise, 0usize, 0usize, libc::MADV_NORMAL) };
    }
    let execfn: &'static CStr = Box::leak(
        CString::new(path.as_os_str().as_bytes())
            .unwrap_or_default()
            .into_boxed_c_str(),
    );
    // SAFETY: the vectors the kernel gave this process; argv has argc >= 2 entries.
    let words = unsafe { enter::initial_stack(argv, 1, envp, &loaded, execfn) };
    enter::unregister_rseq();
    // SAFETY: the entry of the program just mapped, and its initial stack.
    unsafe { enter::jump(&words, loaded.start(), &mask) }
}
