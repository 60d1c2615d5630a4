//! Seccomp allowlists for the daemons: after start-up (sockets bound, secret
//! memory and threads set up) a daemon calls [`lock_down`] with the system
//! calls it needs from then on; any other call kills the whole process
//! (`SECCOMP_RET_KILL_PROCESS`, the exit status says signal 31, `SIGSYS`,
//! and the kernel's audit log records the call's number as a `type=1326`
//! line). The filter is compiled by rust-vmm's `seccompiler` (the compiler
//! of Firecracker's jailer) and installed on every thread of the process at
//! once (`SECCOMP_FILTER_FLAG_TSYNC`); threads started later inherit it.
//!
//! Killing rather than failing the call with `EPERM` is deliberate: a daemon
//! that makes a call outside its list is either exploited or has met a path
//! its list was not measured on, and both should be loud (a dead daemon, a
//! supervisor restart, the audit line) rather than an error path that code
//! under an attacker's control can probe and step around.
//!
//! Each daemon keeps its list beside its code (`seccomp.rs` of the vault,
//! the agent, the disk server, the entropy service and the probe), built
//! from [`BASE`] (what every Rust thread, allocator and logger needs) and
//! the calls measured on its whole test suite. `MEMVEIL_SECCOMP=log`
//! installs the same filter with `SECCOMP_RET_LOG` instead (everything runs,
//! calls outside the list are audited) and `MEMVEIL_SECCOMP=measure` installs
//! [`BASE`] alone in that mode (every further call is audited:
//! `scripts/seccomp_measure.py` collects them, how each list was measured
//! and is measured again after a change); the daemons' `--no-seccomp`
//! installs nothing. Both say so on
//! stderr at start; neither is ever silent.

use std::fmt;
use std::io::{self, Write as _};

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

#[doc(hidden)]
pub use libc as __libc;

/// A system call of an allowlist: its name and its number on this
/// architecture (from `libc`'s `SYS_*` constants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Syscall {
    /// `SYS_read` and the like, as `libc` spells it.
    pub name: &'static str,
    /// The number.
    pub nr: libc::c_long,
    /// Allowed only when argument `.0` (from 0) equals `.1` (compared as
    /// 32 bits): `SYS_kill[1 = 0]`, the liveness probe `kill(pid, 0)`.
    pub only: Option<(u8, u32)>,
}

impl fmt::Display for Syscall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name.strip_prefix("SYS_").unwrap_or(self.name))
    }
}

/// An allowlist from `libc::SYS_*` names:
/// `syscalls![SYS_read, SYS_write, SYS_kill[1 = 0]]` is a
/// `&'static [Syscall]`; `[i = v]` allows the call only when its argument
/// `i` is `v`.
#[macro_export]
macro_rules! syscalls {
    ($($nr:ident $([$i:literal = $v:literal])?),* $(,)?) => {
        &[$($crate::seccomp::Syscall {
            name: stringify!($nr),
            nr: $crate::seccomp::__libc::$nr,
            only: {
                #[allow(unused_variables)]
                let only: Option<(u8, u32)> = None;
                $(let only = Some(($i, $v));)?
                only
            },
        }),*]
    };
}

/// What every memveil daemon needs once it serves, whatever it serves:
/// reading and writing its descriptors and logs, the allocator (`mmap`,
/// `munmap`, `madvise`, `mprotect` of glibc's arenas and thread stacks,
/// `brk`), threads (`clone3`/`clone` with `set_robust_list`, `rseq`,
/// `sigaltstack` and `prctl(PR_SET_NAME)` as Rust's `std::thread` and glibc
/// start one; `futex`, `sched_yield`; `exit`), clocks and sleeps, signal
/// masks, handlers' return and calls restarted after them, `getrandom`, and
/// leaving (`exit_group`; `abort` on a panic: `rt_sigaction`, `tgkill`).
pub const BASE: &[Syscall] = syscalls![
    SYS_read,
    SYS_write,
    SYS_writev,
    SYS_close,
    SYS_fcntl,
    SYS_mmap,
    SYS_munmap,
    SYS_mprotect,
    SYS_madvise,
    SYS_brk,
    SYS_clone3,
    SYS_clone,
    SYS_set_robust_list,
    SYS_rseq,
    SYS_sigaltstack,
    SYS_prctl,
    SYS_futex,
    SYS_sched_yield,
    SYS_sched_getaffinity,
    SYS_gettid,
    SYS_getpid,
    SYS_clock_gettime,
    SYS_clock_nanosleep,
    SYS_nanosleep,
    SYS_rt_sigprocmask,
    SYS_rt_sigaction,
    SYS_tgkill,
    SYS_rt_sigreturn,
    SYS_restart_syscall,
    SYS_getrandom,
    SYS_exit,
    SYS_exit_group,
];

/// How [`lock_down`] treats a call outside the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Kill the process (`SECCOMP_RET_KILL_PROCESS`): the default.
    Kill,
    /// Let it run and have the kernel audit it (`SECCOMP_RET_LOG`):
    /// `MEMVEIL_SECCOMP=log`, for measuring a list again.
    Log,
    /// [`BASE`] alone in log mode (`MEMVEIL_SECCOMP=measure`): every call
    /// beyond it is audited, which `scripts/seccomp_measure.py` collects
    /// into a daemon's list.
    Measure,
    /// Install nothing (`--no-seccomp`).
    Off,
}

/// A filter that could not be built or installed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SeccompError {
    /// `seccompiler` refused the list or this architecture.
    #[error("seccomp: cannot compile the allowlist: {0}")]
    Compile(String),
    /// `prctl(PR_SET_NO_NEW_PRIVS)` or `seccomp(2)` failed.
    #[error(
        "seccomp: cannot install the allowlist: {0} (a kernel without CONFIG_SECCOMP_FILTER, or \
         another filter that forbids seccomp(2); --no-seccomp runs without it)"
    )]
    Install(String),
    /// `MEMVEIL_SECCOMP` holds something else than `log`.
    #[error("MEMVEIL_SECCOMP={0:?}: the values are `log` (audit calls outside the allowlist instead of killing the daemon) and `measure` (audit every call beyond the base list); unset it for the default")]
    Env(String),
}

/// Compiles `lists` (concatenated; repeats are fine) into a BPF program for
/// this architecture: the listed calls are allowed, any other one gets
/// `miss`. Returns the program and the number of distinct calls.
///
/// # Errors
/// [`SeccompError::Compile`] on an architecture `seccompiler` lacks.
pub fn compile(lists: &[&[Syscall]], miss: Mode) -> Result<(BpfProgram, usize), SeccompError> {
    use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};
    let err = |e: seccompiler::BackendError| SeccompError::Compile(e.to_string());
    // Per call: `None` allows any arguments, else the rules (any may match).
    let mut calls: std::collections::BTreeMap<i64, Option<Vec<SeccompRule>>> =
        std::collections::BTreeMap::new();
    for s in lists.iter().flat_map(|l| l.iter()) {
        let entry = calls.entry(s.nr).or_insert_with(|| Some(Vec::new()));
        match (s.only, entry.as_mut()) {
            (None, _) => *entry = None,
            (Some((i, v)), Some(rules)) => rules.push(
                SeccompRule::new(vec![SeccompCondition::new(
                    i,
                    SeccompCmpArgLen::Dword,
                    SeccompCmpOp::Eq,
                    u64::from(v),
                )
                .map_err(err)?])
                .map_err(err)?,
            ),
            (Some(_), None) => {}
        }
    }
    let n = calls.len();
    let rules = calls
        .into_iter()
        .map(|(nr, r)| (nr, r.unwrap_or_default()))
        .collect();
    let arch = TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|e| SeccompError::Compile(e.to_string()))?;
    let miss = match miss {
        Mode::Kill => SeccompAction::KillProcess,
        Mode::Log | Mode::Measure => SeccompAction::Log,
        Mode::Off => SeccompAction::Allow,
    };
    let filter = SeccompFilter::new(rules, miss, SeccompAction::Allow, arch)
        .map_err(|e| SeccompError::Compile(e.to_string()))?;
    let prog = BpfProgram::try_from(filter).map_err(|e| SeccompError::Compile(e.to_string()))?;
    Ok((prog, n))
}

/// Installs `prog` on every thread of the process (`TSYNC`), after
/// `PR_SET_NO_NEW_PRIVS`.
///
/// # Errors
/// [`SeccompError::Install`] with the kernel's error.
pub fn install(prog: &BpfProgram) -> Result<(), SeccompError> {
    seccompiler::apply_filter_all_threads(prog).map_err(|e| SeccompError::Install(e.to_string()))
}

/// The mode asked for: `--no-seccomp` (`opt_out`) wins, then
/// `MEMVEIL_SECCOMP=log`, else [`Mode::Kill`].
///
/// # Errors
/// [`SeccompError::Env`] for another value of `MEMVEIL_SECCOMP`.
pub fn mode(opt_out: bool) -> Result<Mode, SeccompError> {
    if opt_out {
        return Ok(Mode::Off);
    }
    match std::env::var("MEMVEIL_SECCOMP") {
        Err(_) => Ok(Mode::Kill),
        Ok(v) if v == "log" => Ok(Mode::Log),
        Ok(v) if v == "measure" => Ok(Mode::Measure),
        Ok(v) => Err(SeccompError::Env(v)),
    }
}

/// The environment variable that makes [`lock_down`] prove its filter: a
/// thread started before the filter was installed calls `personality(2)`
/// (outside every daemon's list) right after it, so a test sees the daemon
/// die of `SIGSYS`, and with `--no-seccomp` sees it live on.
pub const SELFTEST_ENV: &str = "MEMVEIL_SECCOMP_SELFTEST";

/// The daemon's lock-down: compiles `lists`, installs them in `mode` on
/// every thread, and says so on stderr as `<who>: seccomp: ...`: "allowlist
/// of N syscalls installed", or loudly that there is none (`--no-seccomp`)
/// or that it only audits (`MEMVEIL_SECCOMP=log`).
///
/// # Errors
/// [`SeccompError`]; the daemon should refuse to start (its message names
/// `--no-seccomp`).
pub fn lock_down(who: &str, lists: &[&[Syscall]], mode: Mode) -> Result<usize, SeccompError> {
    let selftest = std::env::var_os(SELFTEST_ENV).map(|_| selftest_thread());
    let mut err = io::stderr().lock();
    let n = match mode {
        Mode::Off => {
            let _ = writeln!(
                err,
                "{who}: WARNING: seccomp: OFF (--no-seccomp): every system call is allowed; \
                 drop the flag once done debugging"
            );
            0
        }
        Mode::Kill | Mode::Log | Mode::Measure => {
            let lists = if mode == Mode::Measure {
                &[BASE]
            } else {
                lists
            };
            let (prog, n) = compile(lists, mode)?;
            install(&prog)?;
            let _ = writeln!(
                err,
                "{who}: seccomp: allowlist of {n} syscalls installed ({})",
                match mode {
                    Mode::Kill => "any other kills the process with SIGSYS",
                    Mode::Log => "WARNING: MEMVEIL_SECCOMP=log: others run and are only audited (dmesg, type=1326)",
                    _ => "WARNING: MEMVEIL_SECCOMP=measure: the base list only, every other call runs and is audited",
                }
            );
            n
        }
    };
    drop(err);
    if let Some(go) = selftest {
        let _ = go.send(());
    }
    Ok(n)
}

/// Starts the self-test's thread (before the filter, so the call also
/// proves that `TSYNC` reached threads that already ran); it waits for the
/// word, then makes the forbidden call.
fn selftest_thread() -> std::sync::mpsc::Sender<()> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let _ = std::thread::Builder::new()
        .name("seccomp-selftest".into())
        .spawn(move || {
            if rx.recv().is_ok() {
                let r = forbidden_call();
                let _ = writeln!(
                    io::stderr().lock(),
                    "seccomp self-test: personality(2) outside the allowlist returned {r}: not killed"
                );
            }
        });
    tx
}

/// `personality(0xffffffff)`: asks for the persona and changes nothing; on
/// no daemon's list.
#[must_use]
pub fn forbidden_call() -> libc::c_long {
    // SAFETY: personality with 0xffffffff only returns the current persona;
    // it takes no pointer and changes nothing.
    unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffff_u32) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt as _;
    use std::process::Command;

    /// Runs the test `name` of this binary in a child with `env` set.
    fn child(name: &str, env: &str) -> std::process::Output {
        Command::new(std::env::current_exe().expect("test binary"))
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env("MEMVEIL_SECCOMP_TEST_CHILD", env)
            .output()
            .expect("run the test binary")
    }

    fn role() -> Option<String> {
        std::env::var("MEMVEIL_SECCOMP_TEST_CHILD").ok()
    }

    #[test]
    fn names_print_without_the_prefix() {
        let l: &[Syscall] = syscalls![SYS_read, SYS_mseal, SYS_kill[1 = 0]];
        assert_eq!(l[0].to_string(), "read");
        assert_eq!(l[1].nr, libc::SYS_mseal);
        assert_eq!((l[0].only, l[2].only), (None, Some((1, 0))));
    }

    #[test]
    fn compile_counts_distinct_calls() {
        let (prog, n) =
            compile(&[BASE, syscalls![SYS_read, SYS_accept4]], Mode::Kill).expect("compile");
        assert_eq!(n, BASE.len() + 1);
        assert!(!prog.is_empty());
    }

    /// The child's part of the next test: a thread that already runs,
    /// the filter installed from another, then the thread's forbidden call.
    #[test]
    fn child_calls_outside_the_list() {
        let Some(role) = role() else { return };
        let mode = if role == "off" { Mode::Off } else { Mode::Kill };
        if role != "kill-arg" {
            std::env::set_var(SELFTEST_ENV, "1");
        }
        // What the test harness and this test need, and nothing else.
        let extra: &[Syscall] = syscalls![
            SYS_openat,
            SYS_statx,
            SYS_fstat,
            SYS_lseek,
            SYS_poll,
            SYS_ioctl,
            SYS_sched_setaffinity,
            SYS_wait4,
            SYS_kill[1 = 0]
        ];
        lock_down("test", &[BASE, extra], mode).expect("lock down");
        // An argument-conditioned entry: kill(self, 0) passes the filter.
        // SAFETY: signal 0 only checks that the process exists.
        assert_eq!(unsafe { libc::kill(libc::getpid(), 0) }, 0);
        if role == "kill-arg" {
            // The same call with another argument is outside the list.
            // SAFETY: SIGCONT to a running process of our own changes nothing.
            unsafe { libc::kill(libc::getpid(), libc::SIGCONT) };
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        println!("child survived");
    }

    #[test]
    fn a_call_outside_the_list_kills_the_process_from_a_thread_that_ran_before() {
        if role().is_some() {
            return;
        }
        let out = child("seccomp::tests::child_calls_outside_the_list", "kill");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGSYS),
            "{:?}\n{stderr}",
            out.status
        );
        assert!(stderr.contains("seccomp: allowlist of"), "{stderr}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("child survived"));
        // Positive control: the same call without the filter is harmless.
        let out = child("seccomp::tests::child_calls_outside_the_list", "off");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{:?}\n{stderr}", out.status);
        assert!(stderr.contains("seccomp: OFF"), "{stderr}");
        assert!(stderr.contains("not killed"), "{stderr}");
    }

    #[test]
    fn an_argument_outside_the_condition_kills() {
        if role().is_some() {
            return;
        }
        let out = child("seccomp::tests::child_calls_outside_the_list", "kill-arg");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGSYS),
            "{:?}\n{stderr}",
            out.status
        );
    }

    #[test]
    fn only_log_is_a_valid_environment_value() {
        assert_eq!(mode(true).expect("opt-out"), Mode::Off);
        // The variable is not set in the test's environment.
        if std::env::var_os("MEMVEIL_SECCOMP").is_none() {
            assert_eq!(mode(false).expect("default"), Mode::Kill);
        }
    }
}
