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

/// The CPU the calling thread runs on now (`sched_getcpu(3)`), if known.
#[must_use]
pub fn current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu takes no arguments and touches no memory of ours.
    let c = unsafe { libc::sched_getcpu() };
    usize::try_from(c).ok()
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
