//! The vault's lock-down once it is started (`Server::lock_down`, called by
//! `vault serve` after `Server::start` and the ready line, before
//! `Server::run` accepts the first client): its code and
//! its life-long secret memory sealed with `mseal(2)`, then the seccomp
//! allowlist below on every thread (docs: SECURITY.md, "Seccomp and mseal").
//!
//! The list was measured on the vault's and its clients' test suites run
//! with `MEMVEIL_SECCOMP=measure` (only the base list, every other call
//! audited, collected by `scripts/seccomp_measure.py`): what a serving
//! vault calls after start-up. It holds no `execve`, `fork`, `ptrace`,
//! `socket` or `connect` (KMIP talks only at start; `sd_notify` is sent
//! before), no `mount`, `bpf`, `keyctl`, `io_uring`.

use memveil_engine::KeyTable;
use memveil_secmem::SecretPool;
use memveil_sys::seccomp::{self, Syscall, BASE};
use memveil_sys::syscalls;

use crate::VaultError;

/// What the vault calls after start-up, besides [`BASE`]: clients accepted
/// (`accept4`, `SO_PEERCRED` by `getsockopt`, timeouts by `setsockopt`),
/// requests and replies (`recvfrom`, `sendto`), shared areas passed as
/// descriptors (`recvmsg`; `statx` of them); a secret stack for every
/// connection and lane (`memfd_secret`, `ftruncate`; `mlock` at the
/// `locked` level, `prlimit64` for `RLIMIT_MEMLOCK` in its error);
/// the keystore rewritten atomically (`openat`, `newfstatat`, `fsync`,
/// `rename`); `ioctl(FIONBIO)` of a refused connection.
pub const VAULT: &[Syscall] = syscalls![
    SYS_accept4,
    SYS_getsockopt,
    SYS_setsockopt,
    SYS_recvfrom,
    SYS_sendto,
    SYS_recvmsg,
    SYS_memfd_secret,
    SYS_ftruncate,
    SYS_mlock,
    SYS_prlimit64,
    SYS_openat,
    SYS_newfstatat,
    SYS_statx,
    SYS_fsync,
    SYS_rename,
    SYS_ioctl,
];

/// The name in the vault's log lines.
const WHO: &str = "memveil-vault";

/// Seals the code and `regions` (`mseal`), then installs the allowlist
/// (or says loudly that it does not: `--no-seccomp`). With
/// `MEMVEIL_MSEAL_SELFTEST` set, tries to reprotect what it sealed and logs
/// how many refused (the vault's mseal test).
///
/// # Errors
/// [`VaultError::Harden`] when the filter cannot be installed.
pub(crate) fn lock_down(
    pool: &SecretPool,
    keyids: &KeyTable,
    no_seccomp: bool,
) -> Result<(), VaultError> {
    seal(pool, keyids);
    let mode = seccomp::mode(no_seccomp).map_err(|e| VaultError::Config(e.to_string()))?;
    seccomp::lock_down(WHO, &[BASE, VAULT], mode).map_err(|e| VaultError::Config(e.to_string()))?;
    Ok(())
}

fn log(msg: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "{WHO}: {msg}");
}

/// `mseal` of the code and of the secret memory that lives as long as the
/// vault: the key pool, aws-lc's secret heap, the host key table. The
/// connection and lane stacks come and go and stay unsealed.
fn seal(pool: &SecretPool, keyids: &KeyTable) {
    use memveil_sys::seal;
    let code = match seal::seal_code() {
        Ok(v) => v,
        Err(e) if seal::unavailable(&e) => {
            log(format_args!(
                "mseal unavailable: kernel older than 6.10; code and key memory stay unsealed"
            ));
            return;
        }
        Err(e) => {
            log(format_args!(
                "WARNING: mseal of the code failed: {e}; code stays unsealed"
            ));
            Vec::new()
        }
    };
    let mut keys = 0;
    let regions: [(&str, std::io::Result<()>); 3] = [
        ("key pool", pool.seal()),
        (
            "aws-lc secret heap",
            memveil_asym::seal_heap().unwrap_or(Ok(())),
        ),
        ("host key table", keyids.seal()),
    ];
    for (what, r) in regions {
        match r {
            Ok(()) => keys += 1,
            Err(e) => log(format_args!(
                "WARNING: mseal of the {what} failed: {e}; it stays unsealed"
            )),
        }
    }
    log(format_args!(
        "mseal: {} code mappings and {keys} key regions sealed",
        code.len()
    ));
    if std::env::var_os("MEMVEIL_MSEAL_SELFTEST").is_some() {
        selftest(&code);
    }
}

/// Tries `mprotect` (to the protection it has) on every sealed code
/// mapping and every `memfd_secret` mapping of the vault now, and logs how
/// many the kernel refused with `EPERM`.
fn selftest(code: &[memveil_sys::seal::MapEntry]) {
    use memveil_sys::seal;
    let refused = |m: &seal::MapEntry| {
        seal::reprotect_same(m).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied)
    };
    let secret: Vec<_> = seal::mappings()
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.path.as_os_str() == "/secretmem")
        .collect();
    log(format_args!(
        "mseal self-test: mprotect refused with EPERM on {} of {} code mappings and {} of {} secret-memory mappings",
        code.iter().filter(|m| refused(m)).count(),
        code.len(),
        secret.iter().filter(|m| refused(m)).count(),
        secret.len()
    ));
}
