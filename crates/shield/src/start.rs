//! A program's shield from the settings `memveil run` leaves in its
//! environment: one reading of them for the preload (a dynamic program) and
//! the loader (a static or Go one), so both protect alike.
//!
//! `MEMVEIL_SHIELD_MAX_OVERHEAD` (the cost budget, a percentage of the
//! program's time) with `MEMVEIL_SHIELD_FAULT_NS` (the hand-off a fault
//! costs, measured by `memveil run`), `MEMVEIL_SHIELD_WINDOW` (pages: fixed,
//! or the least an adaptive window keeps; absent under a budget alone: no
//! bound), `MEMVEIL_SHIELD_MAX_PLAINTEXT` (an adaptive window's bound),
//! `MEMVEIL_SHIELD_KEYID`, `MEMVEIL_SHIELD_KEY_FD` (the inherited page-key
//! file of a host KeyID) with `MEMVEIL_SHIELD_SUPERVISOR` (the pid of that
//! `memveil run`: its end stops the process, exit 123),
//! `MEMVEIL_SHIELD_STATS_DIR` (one `PID.stats` file per process),
//! `MEMVEIL_SHIELD_HOST_FD` (the inherited ledger of the host's budget),
//! `MEMVEIL_SHIELD_SPIN_US`, `MEMVEIL_SHIELD_REGION_GIB`,
//! `MEMVEIL_SHIELD_ALLOW_LOCKED=1`, `MEMVEIL_SHIELD_ACCEPT_UNWIPED=1`,
//! `MEMVEIL_SHIELD_FORCE_WP=1`, `MEMVEIL_SHIELD_FOLLOW=0`,
//! `MEMVEIL_SHIELD_ZERO_POOL=0`.

use std::ffi::CStr;
use std::sync::Arc;
use std::time::Duration;

use memveil_secmem::{Level, Policy};

use crate::{
    watch_supervisor, Bound, Budget, Config, HandlerCpu, PageKey, Shield, StatsFile,
    DEFAULT_WINDOW, UNBOUNDED,
};

/// The region's size when `MEMVEIL_SHIELD_REGION_GIB` does not say.
pub const DEFAULT_REGION_GIB: usize = 16;

/// The environment variable `name`, if set and UTF-8. Read with `getenv`,
/// which takes no lock (a forked child of a threaded program may read it).
#[must_use]
pub fn env_str(name: &CStr) -> Option<String> {
    // SAFETY: getenv with a NUL-terminated name; the result is a
    // NUL-terminated string owned by the environment, read at once.
    let v = unsafe { libc::getenv(name.as_ptr()) };
    if v.is_null() {
        return None;
    }
    // SAFETY: non-null result of getenv, NUL-terminated.
    unsafe { CStr::from_ptr(v) }
        .to_str()
        .ok()
        .map(str::to_owned)
}

/// The environment variable `name` as a number, if set and one.
#[must_use]
pub fn env_usize(name: &CStr) -> Option<usize> {
    env_str(name)?.parse().ok()
}

/// The protected region's size in bytes (`MEMVEIL_SHIELD_REGION_GIB`, at
/// least 1 GiB).
#[must_use]
pub fn region_len() -> usize {
    env_usize(c"MEMVEIL_SHIELD_REGION_GIB")
        .unwrap_or(DEFAULT_REGION_GIB)
        .clamp(1, 1 << 16)
        << 30
}

/// The shield's settings and the KeyID of the program's memory.
///
/// # Errors
/// A setting out of range, named with what is wrong.
pub fn config() -> Result<(Config, u16), String> {
    let keyid = env_usize(c"MEMVEIL_SHIELD_KEYID").unwrap_or(1);
    let keyid = u16::try_from(keyid).map_err(|_| format!("KeyID {keyid} out of range"))?;
    // Adaptive window within a bound; absent, the window stays fixed.
    let max_plaintext = match env_str(c"MEMVEIL_SHIELD_MAX_PLAINTEXT") {
        Some(b) => Some(Bound::parse(&b)?),
        None => None,
    };
    // The cost budget (memveil run's default: 10%), and the hand-off a
    // fault costs on this machine as memveil run measured it.
    let budget = match env_str(c"MEMVEIL_SHIELD_MAX_OVERHEAD") {
        Some(p) => Some(Budget::percent(
            Budget::parse_percent(&p)?,
            env_usize(c"MEMVEIL_SHIELD_FAULT_NS").map_or(Budget::DEFAULT_FAULT_NS, |n| n as u64),
        )),
        None => None,
    };
    // A budget alone bounds no plaintext; otherwise the window (or an
    // adaptive window's least) defaults to 4096 pages.
    let window = env_usize(c"MEMVEIL_SHIELD_WINDOW").unwrap_or(
        if budget.is_some() && max_plaintext.is_none() {
            UNBOUNDED
        } else {
            DEFAULT_WINDOW
        },
    );
    let spin = env_usize(c"MEMVEIL_SHIELD_SPIN_US").unwrap_or(0);
    let accept_locked = env_usize(c"MEMVEIL_SHIELD_ALLOW_LOCKED") == Some(1);
    let cfg = Config {
        window,
        max_plaintext,
        budget,
        spin: Duration::from_micros(spin as u64),
        accept_unwiped_free: env_usize(c"MEMVEIL_SHIELD_ACCEPT_UNWIPED") == Some(1),
        force_write_protect: env_usize(c"MEMVEIL_SHIELD_FORCE_WP") == Some(1),
        zero_pool: env_usize(c"MEMVEIL_SHIELD_ZERO_POOL") != Some(0),
        // The host's budget ledger memveil run left open (docs/shield.md,
        // "One budget per host").
        host_fd: env_usize(c"MEMVEIL_SHIELD_HOST_FD")
            .and_then(|fd| i32::try_from(fd).ok())
            .inspect(|&fd| {
                memveil_sys::fdguard::hold(fd);
            }),
        handler_cpu: if env_usize(c"MEMVEIL_SHIELD_FOLLOW") == Some(0) {
            HandlerCpu::Current
        } else {
            HandlerCpu::Follow
        },
        policy: if accept_locked {
            Policy::allow(Level::Locked)
        } else {
            Policy::secret_only()
        },
        ..Config::default()
    };
    Ok((cfg, keyid))
}

/// The host KeyID's page key, from the descriptor `memveil run --keyid`
/// leaves to the program and its descendants (`MEMVEIL_SHIELD_KEY_FD`);
/// the process stops when that `memveil run` is gone.
fn page_key(keyid: u16, cfg: &Config) -> Result<Option<Arc<PageKey>>, String> {
    let Some(fd) = env_usize(c"MEMVEIL_SHIELD_KEY_FD") else {
        return Ok(None);
    };
    let fd = i32::try_from(fd).map_err(|_| format!("MEMVEIL_SHIELD_KEY_FD {fd} out of range"))?;
    let key = PageKey::from_fd(fd, keyid, cfg.policy).map_err(|e| e.to_string())?;
    // Left open for the descendants: out of the program's reach.
    memveil_sys::fdguard::hold(fd);
    // A tenant stops when memveil run, which would stop it on a clear, is gone.
    let supervisor = env_usize(c"MEMVEIL_SHIELD_SUPERVISOR")
        .and_then(|p| u32::try_from(p).ok())
        .ok_or("MEMVEIL_SHIELD_KEY_FD without MEMVEIL_SHIELD_SUPERVISOR")?;
    watch_supervisor(supervisor).map_err(|e| e.to_string())?;
    Ok(Some(Arc::new(key)))
}

/// This process's shield, made from the environment (fresh keys or the
/// host KeyID's page key, its own handler thread and counters file
/// `PID.stats`), for the life of the process. The caller then protects its
/// region with it (`encrypt_mprotect` under the KeyID [`config`] gives) and
/// attaches it to the region. At start-up, and in a child after `fork`.
///
/// # Errors
/// A bad setting, or why the shield cannot start, as a sentence.
pub fn from_env() -> Result<&'static Shield, String> {
    let (cfg, keyid) = config()?;
    let stats = match std::env::var_os("MEMVEIL_SHIELD_STATS_DIR") {
        Some(d) => {
            let path = std::path::Path::new(&d).join(format!("{}.stats", std::process::id()));
            StatsFile::create(&path).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => StatsFile::private(),
    };
    let page_key = page_key(keyid, &cfg)?;
    let cfg = Config { page_key, ..cfg };
    let s = Shield::new(&cfg, stats).map_err(|e| e.to_string())?;
    Ok(Box::leak(Box::new(s)))
}
