//! The guardian of a cgroup v2: a small process that, when the process that
//! started it ends, however it ends (SIGKILL included), kills every process
//! in the cgroup (`cgroup.kill`), waits for them to go and removes the
//! cgroup's directory (and any cgroup below it).
//!
//! A process killed with SIGKILL runs no code of its own, but the kernel
//! closes its descriptors. The guardian blocks reading a pipe whose only
//! write end belongs to its starter (close-on-exec: the programs the starter
//! runs never hold it), and acts when the read ends. A starter that ends
//! normally ([`Guardian::finish`], or dropping the [`Guardian`]) writes one
//! byte first, so the guardian knows it was not killed; otherwise the
//! guardian writes the starter's epitaph to its standard error.
//!
//! The guardian leaves its starter's session (`setsid`), so the terminal's
//! signals do not reach it, and ignores SIGINT, SIGTERM, SIGHUP, SIGQUIT and
//! SIGPIPE, so what stops its starter (Ctrl-C, `timeout`, a hang-up) does not
//! stop it first. Only SIGKILL of the guardian itself defeats it. It keeps
//! no descriptor of its starter's but the pipe and standard error (standard
//! input and output are `/dev/null`), and none of its starter's secret
//! memory (mapped `MADV_DONTFORK`).
//!
//! Between `fork` and `_exit` the guardian makes only async-signal-safe
//! system calls, on memory prepared before the fork, so starting it from a
//! process with threads is sound.

use std::ffi::{CStr, CString};
use std::io::{self, Write as _};
use std::os::fd::{AsRawFd as _, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

/// What a starter that ends normally writes before it closes its end.
const DONE: u8 = b'x';
/// Rounds of [`PAUSE`] the guardian waits for the killed processes to leave
/// the cgroup before it removes the directory (10 s).
const EMPTY_ROUNDS: u32 = 1000;
/// One round of that wait, in nanoseconds (10 ms).
const PAUSE: libc::c_long = 10_000_000;
/// How deep the guardian looks for cgroups below its own (a nested
/// starter's) when the directory will not go.
const NESTING: u32 = 8;

/// A running guardian (see the module's documentation).
#[derive(Debug)]
pub struct Guardian {
    pid: libc::pid_t,
    /// The pipe's write end: closing it wakes the guardian.
    tx: Option<OwnedFd>,
}

/// What the guardian needs, prepared before the fork.
struct Plan {
    kill: CString,
    events: CString,
    dir: CString,
    /// Written to standard error when the starter was killed.
    epitaph: Vec<u8>,
    /// Written to standard error when the directory would not go.
    stuck: Vec<u8>,
}

impl Guardian {
    /// Starts the guardian of the cgroup directory `dir`, which it removes in
    /// the end. `epitaph` (one line) goes to standard error if this process
    /// ends without [`Guardian::finish`] or dropping the guardian: killed.
    ///
    /// # Errors
    /// A path with a NUL byte; the errors of `open("/dev/null")`, `pipe2` and
    /// `fork`.
    pub fn start(dir: &Path, epitaph: &str) -> io::Result<Self> {
        let c = |p: &Path| {
            CString::new(p.as_os_str().as_bytes()).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidInput, "cgroup path with a NUL byte")
            })
        };
        let plan = Plan {
            kill: c(&dir.join("cgroup.kill"))?,
            events: c(&dir.join("cgroup.events"))?,
            dir: c(dir)?,
            epitaph: format!("{epitaph}\n").into_bytes(),
            stuck: format!(
                "memveil: cgroup {} still holds processes {} s after cgroup.kill (in \
                 uninterruptible sleep?): remove it with rmdir once they are gone\n",
                dir.display(),
                u64::from(EMPTY_ROUNDS) * 10 / 1000
            )
            .into_bytes(),
        };
        let null: OwnedFd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?
            .into();
        let (rx, tx) = crate::process::pipe()?;
        // SAFETY: fork takes no arguments. The child runs `guard`, which
        // makes only async-signal-safe system calls on `plan`, `rx` and
        // `null` (prepared above, never freed in the child) and leaves with
        // `_exit`, never returning into this process's code.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => guard(rx.as_raw_fd(), null.as_raw_fd(), &plan),
            pid => Ok(Self { pid, tx: Some(tx) }),
        }
    }

    /// The guardian's process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        u32::try_from(self.pid).unwrap_or(0)
    }

    /// This process ends normally: the guardian removes the cgroup once it
    /// is empty (what the program left running goes on). Waits up to `wait`
    /// for that; `true` when the guardian finished (and removed the cgroup)
    /// in time.
    #[must_use]
    pub fn finish(mut self, wait: Duration) -> bool {
        self.release();
        let end = Instant::now() + wait;
        // Woken the moment it exits (polling every 2 ms kept memveil run
        // about a millisecond past it on average); without a pidfd, polled.
        let exited = u32::try_from(self.pid)
            .ok()
            .and_then(|p| crate::process::PidFd::open(p).ok().flatten());
        loop {
            let mut status = 0;
            // SAFETY: waitpid on this process's own child, the guardian,
            // with a status word this frame owns.
            let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
            if r == self.pid {
                return libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
            }
            if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return false;
            }
            let now = Instant::now();
            if now >= end {
                return false;
            }
            match &exited {
                Some(fd) => {
                    fd.wait(Some(end - now));
                }
                None => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }

    /// This process ends normally and has removed the cgroup's directory
    /// itself ([`remove_dir`]): the guardian, told of a normal end, finds
    /// it gone and exits, without this process waiting for it (its wake,
    /// removal and exit took 0.5-10 ms of the starter's end on 2 vCPUs,
    /// the most when the CPUs were busy).
    pub fn removed(mut self) {
        self.release();
    }

    /// Says "ended normally" and closes the pipe.
    fn release(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = std::fs::File::from(tx).write_all(&[DONE]);
        }
    }
}

impl Drop for Guardian {
    /// Ends normally without waiting: the guardian cleans up on its own.
    fn drop(&mut self) {
        self.release();
    }
}

/// The guardian, after the fork: waits for the pipe to close, kills the
/// cgroup, waits for it to empty, removes it and exits.
fn guard(rx: RawFd, null: RawFd, plan: &Plan) -> ! {
    // SAFETY: setsid, signal, fcntl, dup2, close_range and prctl take
    // integers (and, for prctl, a NUL-terminated string literal) and touch
    // no memory of ours; all are async-signal-safe.
    let pipe = unsafe {
        libc::setsid();
        for sig in [
            libc::SIGINT,
            libc::SIGTERM,
            libc::SIGHUP,
            libc::SIGQUIT,
            libc::SIGPIPE,
        ] {
            libc::signal(sig, libc::SIG_IGN);
        }
        libc::prctl(libc::PR_SET_NAME, c"memveil-guard".as_ptr(), 0, 0, 0);
        // The pipe on the lowest free descriptor from 3, /dev/null as
        // standard input and output, everything else closed (the starter's
        // sockets, key files, the pipe's write end). Without a free
        // descriptor the guardian keeps them all, and still acts.
        match u32::try_from(libc::fcntl(rx, libc::F_DUPFD, 3)) {
            Ok(fd) if fd >= 3 => {
                libc::dup2(null, 0);
                libc::dup2(null, 1);
                if fd > 3 {
                    libc::close_range(3, fd - 1, 0);
                }
                libc::close_range(fd + 1, u32::MAX, 0);
                RawFd::try_from(fd).unwrap_or(rx)
            }
            _ => rx,
        }
    };
    let mut done = false;
    loop {
        let mut b = [0u8; 1];
        // SAFETY: read into a one-byte buffer this frame owns.
        let n = unsafe { libc::read(pipe, b.as_mut_ptr().cast(), 1) };
        match n {
            1 => done |= b[0] == DONE,
            0 => break,
            _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            _ => break,
        }
    }
    if done {
        // A normal end: what the program left running (a daemon) goes on;
        // the cgroup is removed once it is empty, looked at once a second.
        while populated(&plan.events) {
            let pause = libc::timespec {
                tv_sec: 1,
                tv_nsec: 0,
            };
            // SAFETY: nanosleep reads the request this frame owns.
            unsafe { libc::nanosleep(&pause, std::ptr::null_mut()) };
        }
    } else {
        write_all(2, &plan.epitaph);
        write_file(&plan.kill, b"1");
        for _ in 0..EMPTY_ROUNDS {
            if !populated(&plan.events) {
                break;
            }
            let pause = libc::timespec {
                tv_sec: 0,
                tv_nsec: PAUSE,
            };
            // SAFETY: nanosleep reads the request this frame owns; no remainder.
            unsafe { libc::nanosleep(&pause, std::ptr::null_mut()) };
        }
    }
    let removed = remove(libc::AT_FDCWD, &plan.dir, NESTING);
    if !removed {
        write_all(2, &plan.stuck);
    }
    // SAFETY: _exit ends the process without running this process's
    // destructors or atexit handlers (they belong to the starter).
    unsafe { libc::_exit(i32::from(!removed)) }
}

/// `write(2)` of all of `bytes` to `fd`, giving up on an error.
fn write_all(fd: RawFd, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: write reads `bytes.len()` bytes of a slice we borrow.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        match usize::try_from(n) {
            Ok(n) if n > 0 => bytes = &bytes[n.min(bytes.len())..],
            _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            _ => return,
        }
    }
}

/// Opens `path` for writing and writes `bytes` into it.
fn write_file(path: &CStr, bytes: &[u8]) {
    // SAFETY: open reads a NUL-terminated path we borrow.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd >= 0 {
        write_all(fd, bytes);
        // SAFETY: closes the descriptor opened just above.
        unsafe { libc::close(fd) };
    }
}

/// Whether `cgroup.events` (at `events`) still says `populated 1`; `false`
/// when it cannot be read (the cgroup is gone).
fn populated(events: &CStr) -> bool {
    // SAFETY: open reads a NUL-terminated path we borrow.
    let fd = unsafe { libc::open(events.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    let mut buf = [0u8; 256];
    // SAFETY: read into a buffer this frame owns, at most its length.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    // SAFETY: closes the descriptor opened just above.
    unsafe { libc::close(fd) };
    let text = &buf[..usize::try_from(n).unwrap_or(0).min(buf.len())];
    text.windows(11).any(|w| w == b"populated 1")
}

/// Removes the cgroup directory `dir` now, and any cgroup below it (a
/// nested starter's); `true` when it is gone (or was already). A cgroup
/// that still holds processes stays (`EBUSY`).
#[must_use]
pub fn remove_dir(dir: &Path) -> bool {
    CString::new(dir.as_os_str().as_bytes()).is_ok_and(|c| remove(libc::AT_FDCWD, &c, NESTING))
}

/// Removes the directory `name` (relative to the directory `at`), and when
/// it will not go, first the directories below it, deepest first, down to
/// `depth` levels: the cgroups a nested starter left. A directory already
/// gone (its starter removed it: [`Guardian::removed`]) counts as removed.
fn remove(at: RawFd, name: &CStr, depth: u32) -> bool {
    // SAFETY: unlinkat reads a NUL-terminated name we borrow.
    if unsafe { libc::unlinkat(at, name.as_ptr(), libc::AT_REMOVEDIR) } == 0 {
        return true;
    }
    // Read at once, before any other call can change errno.
    if io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT) {
        return true;
    }
    if depth == 0 {
        return false;
    }
    // SAFETY: openat reads a NUL-terminated name we borrow.
    let dir = unsafe {
        libc::openat(
            at,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if dir < 0 {
        return false;
    }
    let mut buf = [0u8; 2048];
    loop {
        // SAFETY: getdents64 fills at most `buf.len()` bytes of a buffer
        // this frame owns with whole `linux_dirent64` records.
        let n = unsafe { libc::syscall(libc::SYS_getdents64, dir, buf.as_mut_ptr(), buf.len()) };
        let Ok(n) = usize::try_from(n) else { break };
        if n == 0 {
            break;
        }
        for_each_subdir(&buf[..n.min(buf.len())], |sub| {
            remove(dir, sub, depth - 1);
        });
    }
    // SAFETY: closes the descriptor opened just above.
    unsafe { libc::close(dir) };
    // SAFETY: as the first unlinkat.
    unsafe { libc::unlinkat(at, name.as_ptr(), libc::AT_REMOVEDIR) == 0 }
}

/// Calls `f` with the name of each directory (but `.` and `..`) among the
/// `linux_dirent64` records in `records`: inode (8 bytes), offset (8),
/// record length (2), type (1), then the NUL-terminated name. A malformed
/// record ends the walk.
fn for_each_subdir(records: &[u8], mut f: impl FnMut(&CStr)) {
    let mut off = 0;
    while let Some(head) = records.get(off..off + 19) {
        let len = usize::from(u16::from_ne_bytes([head[16], head[17]]));
        let Some(name) = records.get(off + 19..off + len) else {
            return;
        };
        if head[18] == libc::DT_DIR {
            if let Ok(name) = CStr::from_bytes_until_nul(name) {
                if name != c"." && name != c".." {
                    f(name);
                }
            }
        }
        if len == 0 {
            return;
        }
        off += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, kind: u8) -> Vec<u8> {
        let mut r = vec![0u8; 19];
        r.extend_from_slice(name.as_bytes());
        r.push(0);
        while !r.len().is_multiple_of(8) {
            r.push(0);
        }
        let len = u16::try_from(r.len()).expect("short record");
        r[16..18].copy_from_slice(&len.to_ne_bytes());
        r[18] = kind;
        r
    }

    #[test]
    fn directory_records_yield_subdirectories_only_and_stop_at_a_bad_one() {
        let mut buf = Vec::new();
        for (n, k) in [
            (".", libc::DT_DIR),
            ("..", libc::DT_DIR),
            ("cgroup.procs", libc::DT_REG),
            ("memveil-run-7", libc::DT_DIR),
            ("b", libc::DT_DIR),
        ] {
            buf.extend(record(n, k));
        }
        let mut seen = Vec::new();
        for_each_subdir(&buf, |n| seen.push(n.to_str().expect("utf-8").to_owned()));
        assert_eq!(seen, ["memveil-run-7", "b"]);
        // A record claiming more bytes than there are ends the walk.
        let mut bad = record("c", libc::DT_DIR);
        bad[16..18].copy_from_slice(&999u16.to_ne_bytes());
        let mut seen = 0;
        for_each_subdir(&bad, |_| seen += 1);
        for_each_subdir(&bad[..10], |_| seen += 1);
        assert_eq!(seen, 0);
    }

    /// A fresh directory `memveil-guard-TAG-PID` in the temporary
    /// directory, with the path `below` made under it.
    fn scratch(tag: &str, below: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("memveil-guard-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join(below)).expect("dirs");
        dir
    }

    #[test]
    fn the_guardian_removes_a_plain_directory_and_exits_when_told() {
        // Not a cgroup: cgroup.kill cannot be opened (nothing to kill) and
        // cgroup.events neither (not populated); the directory and one
        // below it are removed.
        let dir = scratch("plain", "nested/deeper");
        let g = Guardian::start(&dir, "never printed").expect("guardian");
        assert!(g.pid() > 0);
        assert!(g.finish(Duration::from_secs(10)), "the guardian finished");
        assert!(!dir.exists(), "{} removed", dir.display());
    }

    #[test]
    fn a_directory_its_starter_removed_ends_the_guardian_quietly() {
        // The starter removes the directory itself (`remove_dir`) and says
        // so (`removed`): the guardian finds it gone, and exits 0 without
        // its "still holds processes" line (it exited 1 with it when only
        // it removed the directory and took a missing one for a stuck one).
        let dir = scratch("gone", "nested");
        let g = Guardian::start(&dir, "never printed").expect("guardian");
        let pid = g.pid;
        assert!(
            remove_dir(&dir),
            "{} removed with the one below it",
            dir.display()
        );
        assert!(!dir.exists(), "{} removed", dir.display());
        assert!(
            remove_dir(&dir),
            "a directory already gone counts as removed"
        );
        g.removed();
        let mut status = 0;
        // SAFETY: waitpid on this process's own child, the guardian, with a
        // status word this frame owns.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid, "the guardian was waited for");
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the guardian exited 0 (status {status:#x})"
        );
        // Positive control: a directory that will not go (a file in it, as
        // processes in a cgroup) is not taken for removed.
        let kept = scratch("kept", "");
        std::fs::write(kept.join("file"), b"x").expect("file");
        assert!(!remove_dir(&kept), "{} is not empty", kept.display());
        assert!(kept.exists());
        let _ = std::fs::remove_dir_all(&kept);
    }
}

/// A program started by [`spawn_into`]: its process id, and waiting for it.
#[derive(Debug)]
pub struct Spawned {
    pid: libc::pid_t,
    status: Option<std::process::ExitStatus>,
}

impl Spawned {
    /// The program's process id.
    #[must_use]
    pub fn id(&self) -> u32 {
        u32::try_from(self.pid).unwrap_or(0)
    }

    fn wait_flags(&mut self, flags: libc::c_int) -> io::Result<Option<std::process::ExitStatus>> {
        use std::os::unix::process::ExitStatusExt as _;
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        let mut status = 0;
        loop {
            // SAFETY: waitpid on this process's own child, with a status
            // word this frame owns.
            let r = unsafe { libc::waitpid(self.pid, &mut status, flags) };
            if r == self.pid {
                let s = std::process::ExitStatus::from_raw(status);
                self.status = Some(s);
                return Ok(Some(s));
            }
            if r == 0 {
                return Ok(None);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// The program's status if it has ended (`waitpid` with `WNOHANG`).
    ///
    /// # Errors
    /// The error of `waitpid(2)`.
    pub fn try_wait(&mut self) -> io::Result<Option<std::process::ExitStatus>> {
        self.wait_flags(libc::WNOHANG)
    }

    /// Waits for the program to end.
    ///
    /// # Errors
    /// The error of `waitpid(2)`.
    pub fn wait(&mut self) -> io::Result<std::process::ExitStatus> {
        self.wait_flags(0)?
            .ok_or_else(|| io::Error::other("waitpid returned no status"))
    }
}

/// `struct clone_args` of `clone3(2)` (the fields up to `cgroup`).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// Starts `path` with `argv` and `envp` as a child born in the cgroup whose
/// directory is open as `cgroup` (`clone3` with `CLONE_INTO_CGROUP`, Linux
/// 5.7+), inheriting this process's standard streams and working directory,
/// with an empty signal mask and `SIGPIPE` at its default. No process moves
/// between cgroups: moving one costs a `synchronize_rcu` the first time,
/// 8-16 ms on this VM, on every `memveil run`.
///
/// # Errors
/// `clone3`'s error (ENOSYS before 5.3, EINVAL without `CLONE_INTO_CGROUP`
/// or for a cgroup that cannot take processes: the caller falls back), or
/// the child's `execve` error.
pub fn spawn_into(
    cgroup: std::os::fd::BorrowedFd<'_>,
    path: &CStr,
    argv: &[CString],
    envp: &[CString],
) -> io::Result<Spawned> {
    let mut av: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    av.push(std::ptr::null());
    let mut ev: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
    ev.push(std::ptr::null());
    let (rx, tx) = crate::process::pipe()?;
    let args = CloneArgs {
        flags: CLONE_INTO_CGROUP,
        exit_signal: u64::try_from(libc::SIGCHLD).unwrap_or(17),
        cgroup: u64::try_from(std::os::fd::AsRawFd::as_raw_fd(&cgroup)).unwrap_or(0),
        ..CloneArgs::default()
    };
    // SAFETY: clone3 reads `args` (this frame's, of the size given). The
    // child, a copy of this process, runs only `exec_child`, which makes
    // async-signal-safe calls on memory prepared above and never returns.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            std::ptr::from_ref(&args),
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if pid == 0 {
        exec_child(tx.as_raw_fd(), path, &av, &ev);
    }
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::other("clone3: bad pid"))?;
    drop(tx);
    // The write end closes at the child's exec: nothing read means it ran.
    let mut errno = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        // SAFETY: read into the rest of a buffer this frame owns.
        let n = unsafe { libc::read(rx.as_raw_fd(), errno[got..].as_mut_ptr().cast(), 4 - got) };
        match n {
            0 => break,
            n if n > 0 => got += usize::try_from(n).unwrap_or(0),
            _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            _ => break,
        }
    }
    let mut child = Spawned { pid, status: None };
    if got == 4 {
        let _ = child.wait();
        return Err(io::Error::from_raw_os_error(i32::from_ne_bytes(errno)));
    }
    Ok(child)
}

/// The child of [`spawn_into`]: resets the signal mask and `SIGPIPE`, then
/// `execve`; on failure writes `errno` to `report` and exits 127.
fn exec_child(
    report: RawFd,
    path: &CStr,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
) -> ! {
    // SAFETY: async-signal-safe calls only, on memory the parent prepared
    // before clone3 (a copy of it in this child); `_exit` never returns.
    unsafe {
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr());
        let e = *libc::__errno_location();
        let b = e.to_ne_bytes();
        libc::write(report, b.as_ptr().cast(), b.len());
        libc::_exit(127)
    }
}
