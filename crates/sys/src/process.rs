//! Process-wide settings: dumpability, resource limits, capabilities.

use std::io;

/// Sets `PR_SET_DUMPABLE`: with `false`, no core dump is written and other
/// unprivileged processes of the same user can no longer ptrace this one or
/// read its `/proc/PID/mem`.
///
/// # Errors
/// The error of `prctl(2)`.
pub fn set_dumpable(dumpable: bool) -> io::Result<()> {
    // SAFETY: PR_SET_DUMPABLE takes an integer argument and touches no memory.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_DUMPABLE,
            libc::c_ulong::from(dumpable),
            0,
            0,
            0,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `PR_SET_IO_FLUSHER`: marks the process as part of the I/O path of a
/// block device or filesystem (a FUSE server under a loop device), so its
/// memory allocations never wait for writeback to that same device. The
/// mark is per thread and inherited by threads created afterwards: call it
/// before starting them.
///
/// # Errors
/// The error of `prctl(2)`: `EPERM` without `CAP_SYS_RESOURCE`, `EINVAL` on
/// kernels before 5.6.
pub fn set_io_flusher() -> io::Result<()> {
    /// `include/uapi/linux/prctl.h` (Linux 5.6); the `libc` crate names it
    /// for Android only.
    const PR_SET_IO_FLUSHER: libc::c_int = 57;
    // SAFETY: PR_SET_IO_FLUSHER takes an integer argument and touches no
    // memory.
    let r = unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The soft and hard `RLIMIT_MEMLOCK` in bytes (`u64::MAX` for unlimited).
///
/// # Errors
/// The error of `getrlimit(2)`.
pub fn memlock_limit() -> io::Result<(u64, u64)> {
    rlimit(libc::RLIMIT_MEMLOCK)
}

/// Sets `RLIMIT_CORE` to zero (no core files for this process).
///
/// # Errors
/// The error of `setrlimit(2)`.
pub fn disable_core_dumps() -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for the duration of the call.
    let r = unsafe { libc::setrlimit(libc::RLIMIT_CORE, &lim) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn rlimit(res: libc::__rlimit_resource_t) -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out pointer for the duration of the call.
    let r = unsafe { libc::getrlimit(res, &mut lim) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// Whether the effective capability set holds `CAP_IPC_LOCK` (bit 14), which
/// lifts `RLIMIT_MEMLOCK`. Read from `/proc/self/status`.
#[must_use]
pub fn has_cap_ipc_lock() -> bool {
    effective_caps().is_some_and(|c| c & (1 << 14) != 0)
}

/// The effective capability mask from `/proc/self/status`, if readable.
#[must_use]
pub fn effective_caps() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()
}

/// Sends `sig` to process `pid` (`kill(2)`).
///
/// # Errors
/// ESRCH when the process is gone, EPERM without the right to signal it.
pub fn send_signal(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: kill takes plain integers and touches no memory of ours.
    if unsafe { libc::kill(pid, sig) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sends `sig` to every process of the process group `pgid` (`kill(2)` of
/// `-pgid`): a daemon started as the leader of a group of its own
/// (`CommandExt::process_group(0)`) with every process it forked since,
/// which a signal to its pid alone would leave running.
///
/// # Errors
/// `InvalidInput` for 0 and 1 (0 is the caller's own group, and `kill(-1)`
/// every process it may signal); ESRCH when the group is empty.
pub fn signal_group(pgid: u32, sig: libc::c_int) -> io::Result<()> {
    let pgid = libc::pid_t::try_from(pgid)
        .ok()
        .filter(|p| *p > 1)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "process group out of range"))?;
    // SAFETY: kill takes plain integers and touches no memory of ours; the
    // group is at least 2, never 0 (our own) nor -1 (everyone).
    if unsafe { libc::kill(-pgid, sig) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the program `cmd` starts receive `sig` when the thread that
/// spawns it ends, however it ends (`PR_SET_PDEATHSIG`): a helper daemon
/// never outlives a starter that was killed or aborted. Spawning fails
/// with ESRCH if the starter is already gone when the child sets it.
pub fn die_with_parent(cmd: &mut std::process::Command, sig: libc::c_int) {
    use std::os::unix::process::CommandExt as _;
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(libc::pid_t::MAX);
    // SAFETY: the closure runs in the child between fork and exec; it calls
    // only prctl and getppid, both async-signal-safe, allocates nothing and
    // takes no lock.
    unsafe {
        cmd.pre_exec(move || {
            let sig = libc::c_ulong::try_from(sig).unwrap_or(0);
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The starter may have ended before the prctl: no signal then.
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// A process watched through a pidfd (`pidfd_open(2)`, Linux 5.3+): it
/// becomes readable when the process ends, so a waiter wakes at once
/// instead of finding out at its next poll.
#[derive(Debug)]
pub struct PidFd(std::os::fd::OwnedFd);

impl PidFd {
    /// Opens a pidfd on process `pid`; `Ok(None)` when it is already gone.
    ///
    /// # Errors
    /// The error of `pidfd_open(2)` other than ESRCH (ENOSYS before Linux
    /// 5.3).
    pub fn open(pid: u32) -> io::Result<Option<Self>> {
        use std::os::fd::FromRawFd as _;
        let pid = libc::pid_t::try_from(pid)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ESRCH) => Ok(None),
                _ => Err(e),
            };
        }
        let fd = std::os::fd::RawFd::try_from(fd)
            .map_err(|_| io::Error::other("pidfd_open returned an out-of-range descriptor"))?;
        // SAFETY: a descriptor the kernel just returned, owned by nobody else.
        Ok(Some(Self(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })))
    }

    /// Waits until the process has ended or `timeout` has passed (`None`:
    /// forever); returns whether it has ended. An interrupted wait returns
    /// early with what is known then.
    pub fn wait(&self, timeout: Option<std::time::Duration>) -> bool {
        use std::os::fd::AsFd as _;
        wait_readable(&[self.0.as_fd()], timeout)
    }
}

impl std::os::fd::AsFd for PidFd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// A close-on-exec pipe: (read end, write end).
///
/// # Errors
/// The error of `pipe2(2)`.
pub fn pipe() -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd as _;
    let mut fds = [0 as std::os::fd::RawFd; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given, which
    // has room for exactly two.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just opened by pipe2 and belong to
    // nobody else.
    Ok(unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    })
}

/// Waits until one of `fds` is readable (a pidfd: its process has ended;
/// a pipe: written to or closed) or `timeout` has passed (`None`:
/// forever); returns whether one is. A signal ends the wait early (false).
#[must_use]
pub fn wait_readable(
    fds: &[std::os::fd::BorrowedFd<'_>],
    timeout: Option<std::time::Duration>,
) -> bool {
    use std::os::fd::AsRawFd as _;
    let ms = timeout.map_or(-1, |t| {
        libc::c_int::try_from(t.as_millis()).unwrap_or(libc::c_int::MAX)
    });
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let Ok(n) = libc::nfds_t::try_from(p.len()) else {
        return false;
    };
    // SAFETY: `p` holds `n` valid pollfd structs for the duration of the
    // call.
    let r = unsafe { libc::poll(p.as_mut_ptr(), n, ms) };
    r > 0
        && p.iter()
            .any(|q| q.revents & (libc::POLLIN | libc::POLLHUP) != 0)
}

/// Names the calling thread (`PR_SET_NAME`, shown by `top -H` and in
/// `/proc/PID/task/TID/comm`); longer names are cut to 15 bytes.
///
/// # Errors
/// `InvalidInput` for a name with a NUL byte; the error of `prctl(2)`.
pub fn set_thread_name(name: &str) -> io::Result<()> {
    let mut buf = [0u8; 16];
    let n = name.len().min(15);
    buf[..n].copy_from_slice(&name.as_bytes()[..n]);
    if buf[..n].contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "thread name has a NUL byte",
        ));
    }
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16
    // bytes; `buf` is 16 bytes and its last byte is always 0.
    let r = unsafe { libc::prctl(libc::PR_SET_NAME, buf.as_ptr(), 0, 0, 0) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What `/proc/PID/task/TID/stat` says of a thread: the CPU it last ran on
/// (field 39) and the CPU time it used, user plus system, in clock ticks
/// (fields 14 and 15). None when the thread is gone or the file unreadable.
#[must_use]
pub fn thread_cpu(pid: u32, tid: u32) -> Option<(usize, u64)> {
    ThreadStat::open(pid, tid)?.read()
}

/// `/proc/PID/task/TID/stat`, kept open to be read again cheaply (a
/// `pread`, no path lookup): see [`thread_cpu`]. Reads into a stack buffer,
/// so it is safe in threads that must not allocate from the program's heap.
pub struct ThreadStat {
    file: std::fs::File,
    tid: u32,
}

impl ThreadStat {
    /// Opens the stat file of thread `tid` of process `pid`.
    #[must_use]
    pub fn open(pid: u32, tid: u32) -> Option<Self> {
        let file = std::fs::File::open(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
        Some(Self { file, tid })
    }

    /// The thread this reads.
    #[must_use]
    pub fn tid(&self) -> u32 {
        self.tid
    }

    /// (CPU last run on, CPU time in ticks), as [`thread_cpu`].
    #[must_use]
    pub fn read(&self) -> Option<(usize, u64)> {
        use std::os::unix::fs::FileExt as _;
        let mut buf = [0u8; 1024];
        let n = loop {
            match self.file.read_at(&mut buf, 0) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        };
        let text = std::str::from_utf8(&buf[..n]).ok()?;
        // The command name (field 2) may hold spaces and parentheses: the
        // fields that follow start after its last ')', at field 3.
        let (_, rest) = text.rsplit_once(')')?;
        let mut fields = rest.split_whitespace();
        let mut at = 3;
        let mut field = |k: usize| -> Option<u64> {
            let v = fields.nth(k - at)?.parse().ok();
            at = k + 1;
            v
        };
        let utime = field(14)?;
        let stime = field(15)?;
        let cpu = field(39)?;
        Some((usize::try_from(cpu).ok()?, utime + stime))
    }
}

/// The CPU the calling thread runs on now (`sched_getcpu(3)`), if known.
#[must_use]
pub fn current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu takes no arguments and touches no memory of ours.
    let c = unsafe { libc::sched_getcpu() };
    usize::try_from(c).ok()
}

/// How many CPUs thread `tid` may run on (`sched_getaffinity(2)`; 0: the
/// calling thread, the process id: the main thread); `None` when the kernel
/// does not say.
#[must_use]
pub fn allowed_cpus(tid: u32) -> Option<usize> {
    let tid = libc::pid_t::try_from(tid).ok()?;
    // SAFETY: cpu_set_t is plain old data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
    let r =
        unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return None;
    }
    // SAFETY: `set` was filled in by the kernel.
    usize::try_from(unsafe { libc::CPU_COUNT(&set) }).ok()
}

/// Pins the calling thread to one CPU (`sched_setaffinity(2)`).
///
/// # Errors
/// EINVAL for a CPU outside the allowed set.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    if cpu >= 1024 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "CPU number too large",
        ));
    }
    // SAFETY: cpu_set_t is plain old data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` < 1024 = the number of bits in a cpu_set_t (checked).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Gives the calling thread the CPUs the process's main thread may use
/// (undoing [`pin_to_cpu`] on a thread that inherited a pin).
///
/// # Errors
/// The error of `sched_getaffinity(2)` or `sched_setaffinity(2)`.
pub fn unpin() -> io::Result<()> {
    let pid = libc::pid_t::try_from(std::process::id())
        .map_err(|_| io::Error::other("process id out of range"))?;
    // SAFETY: cpu_set_t is plain old data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
    if unsafe { libc::sched_getaffinity(pid, size, &mut set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    if unsafe { libc::sched_setaffinity(0, size, &set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A local account, as `getpwnam(3)` finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
}

/// Looks up the account `name` (`getpwnam_r(3)`: `/etc/passwd` or whatever
/// NSS is configured); `Ok(None)` when there is none.
///
/// # Errors
/// `InvalidInput` for a name with a NUL byte; the error of `getpwnam_r`.
pub fn lookup_user(name: &str) -> io::Result<Option<User>> {
    let cname = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "user name has a NUL byte"))?;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // SAFETY: passwd is plain old data; all-zero is a valid value that
        // getpwnam_r fills in.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call: the NUL-terminated
        // name, the passwd record, the scratch buffer of the length passed
        // (the record's strings point into it) and the result pointer.
        let r = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pw,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut found,
            )
        };
        if r == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        return Ok((!found.is_null()).then(|| User {
            name: name.to_owned(),
            uid: pw.pw_uid,
            gid: pw.pw_gid,
        }));
    }
}

/// `CAP_SYS_PTRACE`: lets `userfaultfd(2)` serve faults taken inside
/// system calls although `vm.unprivileged_userfaultfd=0`.
pub const CAP_SYS_PTRACE: u32 = 19;

/// The number of threads of this process (`Threads:` of `/proc/self/status`).
#[must_use]
pub fn thread_count() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find_map(|l| l.strip_prefix("Threads:"))?;
    line.trim().parse().ok()
}

/// Becomes `user` for good, as root: its supplementary groups
/// (`initgroups(3)`), its group and user id (real, effective and saved),
/// and of all capabilities only `keep` (a `CAP_*` number), which stays
/// effective, permitted, inheritable and ambient, so that a program this
/// process executes holds it too; with `keep` `None`, none at all.
///
/// Capabilities belong to each thread, so the process must still have one
/// thread only (refused otherwise): a thread left behind would keep root's.
///
/// # Errors
/// `Other` when the process has more than one thread; EPERM when not root;
/// the error of the failing call otherwise (the process may then be left
/// half-switched: callers exit on error).
pub fn become_user(user: &User, keep: Option<u32>) -> io::Result<()> {
    match thread_count() {
        Some(1) => {}
        n => {
            return Err(io::Error::other(format!(
                "switching users needs a single-threaded process (threads: {n:?})"
            )))
        }
    }
    let cname = std::ffi::CString::new(user.name.as_str())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "user name has a NUL byte"))?;
    // SAFETY: a NUL-terminated name and a plain gid.
    cvt(unsafe { libc::initgroups(cname.as_ptr(), user.gid) })?;
    // SAFETY: plain integer arguments.
    cvt(unsafe { libc::setresgid(user.gid, user.gid, user.gid) })?;
    // Keep the permitted set across the uid change, to pick `keep` from it.
    // SAFETY: PR_SET_KEEPCAPS takes an integer and touches no memory.
    cvt(unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) })?;
    // SAFETY: plain integer arguments.
    cvt(unsafe { libc::setresuid(user.uid, user.uid, user.uid) })?;
    let mask = keep.map_or(0, |c| 1u32 << c);
    set_caps(mask)?;
    if let Some(cap) = keep {
        // SAFETY: PR_CAP_AMBIENT takes integers and touches no memory.
        cvt(unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_RAISE,
                libc::c_ulong::from(cap),
                0,
                0,
            )
        })?;
    }
    // SAFETY: as above.
    cvt(unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0) })?;
    Ok(())
}

/// Sets the calling thread's effective, permitted and inheritable
/// capabilities to `mask` (capabilities 0 to 31; `capset(2)`).
fn set_caps(mask: u32) -> io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let none = Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    };
    let data = [
        Data {
            effective: mask,
            permitted: mask,
            inheritable: mask,
        },
        none,
    ];
    // SAFETY: capset reads a version-3 header and two data records (the
    // layout of `struct __user_cap_header_struct` and
    // `struct __user_cap_data_struct[2]`), both valid for the call.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn cvt(r: libc::c_int) -> io::Result<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The calling thread's id (`gettid(2)`).
#[must_use]
pub fn gettid() -> u32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    u32::try_from(unsafe { libc::gettid() }).unwrap_or(0)
}

/// CPU time thread `tid` of this process has used so far, in ns: its
/// thread CPU clock (`clock_gettime(2)` on the clock id Linux derives from
/// a thread id, `MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)`), readable from
/// any thread of the same process, the thread itself included.
///
/// # Errors
/// EINVAL when no thread `tid` of this process exists (it exited).
pub fn thread_cpu_ns(tid: u32) -> io::Result<u64> {
    let tid = i32::try_from(tid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "thread id out of range"))?;
    // CPUCLOCK_PERTHREAD_MASK (4) | CPUCLOCK_SCHED (2), the complement of
    // the id shifted past them (include/linux/posix-timers_types.h).
    let clock: libc::clockid_t = ((!tid) << 3) | 6;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes it.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    Ok(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
}

/// Time thread `tid` of this process has spent runnable but waiting for a
/// CPU, in ns: the second field of the thread's `schedstat` (`run_delay`).
/// `None` when the kernel keeps no such statistics (`CONFIG_SCHED_INFO`
/// off) or the thread is gone.
///
/// Read as `/proc/TID/schedstat` (the thread's own entry, which `/proc`
/// finds though it does not list it), never as `/proc/self/task/TID/...`:
/// a lookup there leaves the kernel a cached entry under the process's
/// `/proc/TGID`, and when the process ends its last thread, having woken
/// the parent, still tears down its `task/TID` while the parent's `wait4`
/// tears down `/proc/TGID` around it: the parent spins in
/// `shrink_dcache_parent` until the thread is done (on 2 busy vCPUs 18% of
/// the CPU of 18 short protected python3 jobs went there).
#[must_use]
pub fn run_delay_ns(tid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{tid}/schedstat")).ok()?;
    parse_schedstat(&text).map(|(_, delay)| delay)
}

/// The first two fields of a `schedstat` line (`on-CPU run-delay slices`):
/// the time on a CPU and the time runnable off one (the run delay), in ns.
#[must_use]
pub fn parse_schedstat(text: &str) -> Option<(u64, u64)> {
    let mut it = text.split_ascii_whitespace().map(str::parse::<u64>);
    Some((it.next()?.ok()?, it.next()?.ok()?))
}

/// Scheduling classes a thread of ours may be given (`sched_setscheduler(2)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedPolicy {
    /// `SCHED_OTHER`: the default, fair share.
    Normal,
    /// `SCHED_IDLE`: runs only when nothing else wants the CPU. A CPU that
    /// runs only such threads counts as idle when the scheduler places a
    /// woken thread, so a thread woken by one stays on that CPU.
    Idle,
    /// `SCHED_FIFO` at priority 1: woken, it preempts a thread of the two
    /// policies above on its CPU at once (needs root or `RLIMIT_RTPRIO`).
    RealTime,
}

/// Sets the scheduling policy of thread `tid` of this process (0: the
/// calling thread).
///
/// # Errors
/// The error of `sched_setscheduler(2)`: EPERM when leaving `SCHED_IDLE`
/// without `CAP_SYS_NICE` (or `RLIMIT_NICE` room), ESRCH for no such thread.
pub fn set_sched_policy(tid: u32, policy: SchedPolicy) -> io::Result<()> {
    let tid = libc::pid_t::try_from(tid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "thread id out of range"))?;
    let (p, priority) = match policy {
        SchedPolicy::Normal => (libc::SCHED_OTHER, 0),
        SchedPolicy::Idle => (libc::SCHED_IDLE, 0),
        SchedPolicy::RealTime => (libc::SCHED_FIFO, 1),
    };
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: `param` is a valid sched_param; the call reads it only.
    let r = unsafe { libc::sched_setscheduler(tid, p, &param) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes any panic in this process abort it at once, after the usual
/// message: what `panic = "abort"` gives, for programs built in a profile
/// that unwinds (the workspace's release profile unwinds so that the
/// PKCS#11 module can turn a panic into `CKR_GENERAL_ERROR` instead of
/// killing its host; the daemons keep aborting through this hook, so no
/// thread unwinds past state it holds).
pub fn abort_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        std::process::abort();
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_delay_is_the_second_schedstat_field_and_grows_for_a_waiting_thread() {
        assert_eq!(
            parse_schedstat("5313 2784 17\n").map(|(_, d)| d),
            Some(2784)
        );
        assert_eq!(parse_schedstat("5313\n").map(|(_, d)| d), None);
        assert_eq!(parse_schedstat("a b c").map(|(_, d)| d), None);
        // SAFETY: gettid takes no arguments.
        let tid = u32::try_from(unsafe { libc::gettid() }).unwrap_or(0);
        if std::path::Path::new("/proc/self/schedstat").exists() {
            assert!(run_delay_ns(tid).is_some(), "schedstat of this thread");
        } else {
            println!(
                "SKIP: no schedstat (CONFIG_SCHED_INFO off): the watchdog keeps its progress rule"
            );
        }
        assert_eq!(run_delay_ns(u32::MAX), None);
    }

    #[test]
    fn thread_cpu_ns_reads_another_threads_work_and_refuses_a_gone_one() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            let mut x = 0u64;
            let start = std::time::Instant::now();
            while start.elapsed() < std::time::Duration::from_millis(30) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            tx.send(gettid()).expect("send");
            let _ = done_rx.recv();
        });
        let tid = rx.recv().expect("tid");
        let busy = thread_cpu_ns(tid).expect("a live thread's clock");
        let me = thread_cpu_ns(gettid()).expect("our own clock");
        assert!(busy >= 10_000_000, "the spinning thread used {busy} ns");
        assert!(me > 0);
        done_tx.send(()).expect("send");
        t.join().expect("join");
        // The join returns at the exiting thread's CLEARTID wake (in
        // exit_mm), before the kernel releases its id (release_task): its
        // clock is refused from then on, not at once (CI saw it still read
        // right after the join, on a loaded host).
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while thread_cpu_ns(tid).is_ok() {
            assert!(
                std::time::Instant::now() < until,
                "an exited thread has no clock"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    #[test]
    fn signal_group_reaches_a_grandchild_and_refuses_our_group_and_everyone() {
        use std::os::unix::process::CommandExt as _;
        for bad in [0, 1] {
            let e = signal_group(bad, 0).expect_err("refused");
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}");
        }
        // A shell whose child (a grandchild of ours) a kill of its pid
        // alone would leave running.
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 60 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("sh");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(sh.stdout.take().expect("stdout")),
            &mut line,
        )
        .expect("the grandchild's pid");
        let grandchild: u32 = line.trim().parse().expect("a pid");
        signal_group(sh.id(), libc::SIGKILL).expect("kill the group");
        let _ = sh.wait();
        let gone = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z'))
            })
        };
        let t = std::time::Instant::now();
        while !gone(grandchild) && t.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(
            gone(grandchild),
            "the grandchild {grandchild} outlived the group's kill"
        );
    }

    #[test]
    fn lookup_user_finds_root_and_not_a_made_up_name() {
        let root = lookup_user("root")
            .expect("getpwnam_r")
            .expect("root exists");
        assert_eq!((root.uid, root.gid), (0, 0));
        assert_eq!(
            lookup_user("memveil-no-such-user").expect("getpwnam_r"),
            None
        );
        assert!(lookup_user("a\0b").is_err());
    }

    #[test]
    fn become_user_refuses_a_process_with_a_second_thread() {
        // A second thread for sure (the harness may run this on the main one).
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            let _ = rx.recv();
        });
        let nobody = User {
            name: "nobody".to_owned(),
            uid: 65534,
            gid: 65534,
        };
        let e = become_user(&nobody, None).expect_err("a second thread would keep root");
        assert!(e.to_string().contains("single-threaded"), "{e}");
        // SAFETY: getuid takes no arguments and cannot fail.
        let uid = unsafe { libc::getuid() };
        assert_ne!(uid, 65534, "the refusal changed the user");
        drop(tx);
        t.join().expect("thread");
    }

    #[test]
    fn io_flusher_is_set_or_refused_for_a_documented_reason() {
        // In a thread of its own: the mark stays with the thread.
        let r = std::thread::spawn(set_io_flusher).join().expect("thread");
        if let Err(e) = r {
            assert!(
                matches!(e.raw_os_error(), Some(libc::EPERM | libc::EINVAL)),
                "{e}"
            );
        }
    }

    #[test]
    fn allowed_cpus_counts_the_affinity_mask() {
        let n = allowed_cpus(0).expect("sched_getaffinity");
        assert!(n >= 1);
        let cpu = current_cpu().expect("sched_getcpu");
        std::thread::spawn(move || {
            pin_to_cpu(cpu).expect("pin");
            assert_eq!(allowed_cpus(0), Some(1));
            // The main thread is not pinned by this.
            assert_eq!(allowed_cpus(std::process::id()), Some(n));
            // And unpinning gives the thread the main thread's CPUs back.
            unpin().expect("unpin");
            assert_eq!(allowed_cpus(0), Some(n));
        })
        .join()
        .expect("thread");
    }

    #[test]
    fn a_thread_goes_idle_and_back() {
        std::thread::spawn(|| {
            // SAFETY: sched_getscheduler of the calling thread.
            let now = || unsafe { libc::sched_getscheduler(0) };
            set_sched_policy(0, SchedPolicy::Idle).expect("SCHED_IDLE is always allowed");
            assert_eq!(now(), libc::SCHED_IDLE);
            match set_sched_policy(gettid(), SchedPolicy::Normal) {
                Ok(()) => assert_eq!(now(), libc::SCHED_OTHER),
                // Unprivileged with RLIMIT_NICE 0: leaving SCHED_IDLE is refused.
                Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EPERM)),
            }
        })
        .join()
        .expect("thread");
        assert!(set_sched_policy(u32::MAX, SchedPolicy::Normal).is_err());
    }

    #[test]
    fn thread_cpu_reads_this_thread_and_follows_a_pin() {
        let tid = gettid();
        let pid = std::process::id();
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let (_, time) = thread_cpu(pid, tid).expect("own stat");
        let target = cpus - 1;
        if pin_to_cpu(target).is_ok() {
            // Burn a little time so the stat file shows where we ran.
            let t = std::time::Instant::now();
            while t.elapsed() < std::time::Duration::from_millis(5) {
                std::hint::spin_loop();
            }
            let (cpu, later) = thread_cpu(pid, tid).expect("own stat");
            assert_eq!(cpu, target);
            assert!(later >= time);
        }
        assert_eq!(thread_cpu(pid, u32::MAX), None, "no such thread");
        // Kept open, it reads again.
        let st = ThreadStat::open(pid, tid).expect("open");
        assert_eq!(st.tid(), tid);
        assert!(st.read().is_some() && st.read().is_some());
    }
}
