//! One module per subcommand; each has `Args` (clap) and `run(Args) -> anyhow::Result<u8>`
//! returning the process exit code.

pub mod agent;
pub mod bench;
pub mod disk;
pub mod key;
pub mod keyfind;
pub mod package_files;
pub mod probe;
pub mod rng;
pub mod run;
pub mod run_calibrate;
pub mod run_cgroup;
mod run_go;
pub mod run_keyid;
pub mod run_report;
pub mod shield;
pub mod vault;

/// A daemon's seccomp lock-down once it is started: `list` (besides
/// `memveil_sys::seccomp::BASE`) on every thread, or with `no_seccomp` a
/// loud warning and no filter. Logged as `<who>: seccomp: ...` on stderr.
///
/// # Errors
/// The filter cannot be installed (the message names `--no-seccomp`).
pub(crate) fn lock_down(
    who: &str,
    list: &[memveil_sys::seccomp::Syscall],
    no_seccomp: bool,
) -> anyhow::Result<()> {
    use memveil_sys::seccomp;
    let mode = seccomp::mode(no_seccomp)?;
    seccomp::lock_down(who, &[seccomp::BASE, list], mode)?;
    Ok(())
}
