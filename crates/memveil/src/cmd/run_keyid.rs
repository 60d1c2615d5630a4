//! `memveil run --keyid N`: the program runs under KeyID N of the host key
//! table the vault holds. Its page key (derived in the vault from the
//! KeyID's key) reaches the program in an inherited `memfd_secret` file;
//! this process keeps the vault connection, and when the KeyID is cleared or
//! programmed again (or the vault goes away) it stops every process of the
//! program with SIGKILL, so the key copies die with them, and exits with
//! [`EXIT_KEY_GONE`].

use std::os::fd::{AsFd as _, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{bail, Context as _};
use memveil_engine::{KeyIdMode, KeyIdState};
use memveil_secmem::{Level, Policy, SecretPool};
use memveil_vault::client::TenantStop;
use memveil_vault::Client;

/// Exit status of a program stopped because its KeyID's key is gone.
pub const EXIT_KEY_GONE: u8 = 123;

/// The program's host KeyID.
pub struct HostKeyId {
    keyid: u16,
    state: KeyIdState,
    /// The page-key file the program inherits (`None`: no-encrypt).
    file: Option<OwnedFd>,
    level: Option<Level>,
    /// Why the program must stop, once the vault said so.
    stop: Arc<Mutex<Option<String>>>,
    /// The vault connection, until [`HostKeyId::watch`] hands it to the
    /// watcher thread.
    tenant: Option<memveil_vault::client::Tenant>,
    /// Readable once the watcher has set `stop` (the read end of a pipe
    /// the watcher writes to): memveil run's loop waits on it.
    woken: Option<OwnedFd>,
}

impl HostKeyId {
    /// Gets KeyID `keyid`'s page key from the vault at `socket`, writes it
    /// into a key file for the program, and watches for the vault's stop
    /// notice.
    ///
    /// # Errors
    /// The vault cannot be reached or refuses (no key, not an operator);
    /// a no-encrypt KeyID without `accept_no_encrypt`; no secret memory.
    pub fn fetch(
        socket: &Path,
        keyid: u16,
        accept_no_encrypt: bool,
        policy: Policy,
    ) -> anyhow::Result<Self> {
        let c = Client::connect(socket).map_err(|e| anyhow::anyhow!("--keyid {keyid}: {e}"))?;
        let pool = SecretPool::new(4096, policy)
            .with_context(|| format!("--keyid {keyid}: secret memory for the page key"))?;
        let mut tenant = c
            .tenant_key(keyid, &pool)
            .map_err(|e| anyhow::anyhow!("--keyid {keyid}: {e}"))?;
        let state = tenant.state();
        let (file, level) = if state.mode == KeyIdMode::NoEncrypt {
            if !accept_no_encrypt {
                bail!(
                    "--keyid {keyid}: KeyID {keyid} is programmed no-encrypt (KEYID_NO_ENCRYPT): the \
                     program's memory would be plaintext. Pass --accept-no-encrypt to run it so \
                     (reported), or program the KeyID with a key: memveil key program --keyid \
                     {keyid} --mode random"
                );
            }
            (None, None)
        } else {
            let (fd, level) = memveil_shield::page_key_file(tenant.key(), policy)
                .with_context(|| format!("--keyid {keyid}"))?;
            // The program's copy is the file's; this process needs none.
            tenant.wipe_key();
            // Inherited high, out of the way of a program's own
            // descriptors (`memveil_sys::fdguard`).
            let fd = memveil_sys::fdguard::dup_high_inheritable(fd.as_fd())
                .context("letting the program inherit the page-key file")?;
            (Some(fd), Some(level))
        };
        Ok(Self {
            keyid,
            state,
            file,
            level,
            stop: Arc::new(Mutex::new(None)),
            tenant: Some(tenant),
            woken: None,
        })
    }

    /// Starts watching for the vault's stop notice (after `--user`: a
    /// process that changes users must have one thread).
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn watch(&mut self) -> anyhow::Result<()> {
        let Some(mut tenant) = self.tenant.take() else {
            return Ok(());
        };
        let keyid = self.keyid;
        let said = Arc::clone(&self.stop);
        let (woken, wake) =
            memveil_sys::process::pipe().context("a pipe for the KeyID watcher thread")?;
        self.woken = Some(woken);
        std::thread::Builder::new()
            .name("keyid-watch".into())
            .spawn(move || {
                let why = match tenant.wait_stop() {
                    TenantStop::KeyGone { message, .. } => message,
                    TenantStop::VaultGone(e) => format!(
                        "the vault holding the host key table went away ({e}): nobody could clear \
                         KeyID {keyid} any more"
                    ),
                };
                *said.lock().unwrap_or_else(PoisonError::into_inner) = Some(why);
                // Wakes memveil run's loop at once (it looks at `stop` then).
                let _ = std::io::Write::write_all(&mut std::fs::File::from(wake), b"x");
                // The connection stays open until this process exits: the
                // vault takes its closing as the sign that the program has
                // stopped.
                std::mem::forget(tenant);
            })
            .context("starting the KeyID watcher thread")?;
        Ok(())
    }

    /// The KeyID.
    #[must_use]
    pub fn keyid(&self) -> u16 {
        self.keyid
    }

    /// Whether the program runs unencrypted (an accepted no-encrypt KeyID).
    #[must_use]
    pub fn no_encrypt(&self) -> bool {
        self.file.is_none()
    }

    /// The descriptor number of the page-key file the program inherits.
    #[must_use]
    pub fn fd(&self) -> Option<i32> {
        self.file.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// The page-key file's identity (to know the program's processes by).
    #[must_use]
    pub fn file_id(&self) -> Option<std::fs::Metadata> {
        self.fd()
            .and_then(|fd| std::fs::metadata(format!("/proc/self/fd/{fd}")).ok())
    }

    /// Readable once [`HostKeyId::stop_reason`] has something to say
    /// (after [`HostKeyId::watch`]).
    #[must_use]
    pub fn woken(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.woken.as_ref().map(std::os::fd::AsFd::as_fd)
    }

    /// Why the program must stop now, once the vault said so.
    #[must_use]
    pub fn stop_reason(&self) -> Option<String> {
        self.stop
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// One line for the summary.
    #[must_use]
    pub fn describe(&self) -> String {
        let alg = self
            .state
            .mode
            .algorithm()
            .map_or_else(String::new, |a| format!(" {a}"));
        match self.level {
            Some(l) => format!(
                "host KeyID {} ({}{alg}, generation {}; page key in {l} memory)",
                self.keyid,
                self.state.mode.name(),
                self.state.generation
            ),
            None => format!(
                "host KeyID {} is no-encrypt: the program ran UNPROTECTED (accepted with \
                 --accept-no-encrypt)",
                self.keyid
            ),
        }
    }

    /// For `--stats-json`.
    #[must_use]
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "keyid": self.keyid,
            "mode": self.state.mode.name(),
            "algorithm": self.state.mode.algorithm().map(|a| a.name()),
            "generation": self.state.generation,
            "key_level": self.level.map(|l| l.to_string()),
        })
    }
}

/// Kills (SIGKILL) the program `root` and every process under it, and every
/// process that reported into `stats_dir` (those a daemon's double fork took
/// away from `root`) and still holds the page-key file `key` open or was
/// started with `stats_dir` in its environment (a pid reused by another
/// program since is left alone). Returns how many were
/// signalled.
/// `root` is `None` once the program's main process was reaped (its pid may
/// belong to another program since).
pub fn kill_program(root: Option<u32>, stats_dir: &Path, key: Option<&std::fs::Metadata>) -> usize {
    let mut killed = std::collections::BTreeSet::new();
    // Stopped first, the program forks no more and its children stay its
    // children (killed first, they would be reparented and not found).
    if let Some(r) = root {
        let _ = memveil_sys::process::send_signal(r, libc::SIGSTOP);
    }
    // New processes may be forked while the others die: look again until a
    // look finds nobody left.
    for _ in 0..20 {
        let mut pids = root.map(descendants).unwrap_or_default();
        pids.extend(root);
        pids.extend(left_running(stats_dir, key, None));
        let alive: Vec<u32> = pids
            .into_iter()
            .filter(|&p| !is_zombie(p))
            .filter(|&p| memveil_sys::process::send_signal(p, libc::SIGKILL).is_ok())
            .collect();
        if alive.is_empty() {
            break;
        }
        killed.extend(alive);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    killed.len()
}

/// The live processes that hold the program's KeyID key, other than this
/// one: every process among `among` (the program's cgroup; `None`: every
/// process of the host) with the page-key file `key` open (a scan of their
/// descriptors: those the preload never reached, e.g. a daemon started
/// with `env -i`, included), and those that reported into `stats_dir` and
/// were started with it in their environment (they read the key, even if
/// they closed the file since).
///
/// What inherits the key file stays in the program's cgroup, so a run with
/// one looks there: the scan of every process on the host, by 18 tenants
/// ending together, took more of the host's CPU time than their programs'
/// start (each scan stats every descriptor of every process, and reaping
/// a process then waits for the others' scans of its `/proc` entries).
pub fn left_running(
    stats_dir: &Path,
    key: Option<&std::fs::Metadata>,
    among: Option<&[u32]>,
) -> Vec<u32> {
    let me = std::process::id();
    let mut pids: Vec<u32> = std::fs::read_dir(stats_dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "stats"))
        .filter_map(|p| p.file_stem()?.to_str()?.parse().ok())
        .filter(|&pid| ours(pid, stats_dir))
        .collect();
    if let Some(k) = key {
        match among {
            Some(some) => pids.extend(some.iter().copied().filter(|&pid| holds(pid, k))),
            None => pids.extend(all_pids().filter(|&pid| holds(pid, k))),
        }
    }
    pids.sort_unstable();
    pids.dedup();
    pids.retain(|&pid| pid != me && !is_zombie(pid));
    pids
}

/// Every process id in `/proc`.
fn all_pids() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
}

/// Whether process `pid` has the file `key` open.
fn holds(pid: u32, key: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .any(|m| m.ino() == key.ino() && m.dev() == key.dev())
}

/// Whether process `pid` was started with `stats_dir` as its shield's
/// statistics directory (its environment as at exec).
fn ours(pid: u32, stats_dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let mut want = b"MEMVEIL_SHIELD_STATS_DIR=".to_vec();
    want.extend_from_slice(stats_dir.as_os_str().as_bytes());
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == want.as_slice()))
}

/// `/proc/PID/stat`'s state and parent: (state, ppid).
fn stat(pid: u32) -> Option<(char, u32)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold anything: read after
    // the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some((state, ppid))
}

fn is_zombie(pid: u32) -> bool {
    stat(pid).is_none_or(|(s, _)| s == 'Z' || s == 'X')
}

/// Every process whose chain of parents reaches `root`.
fn descendants(root: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = all_pids()
        .filter_map(|pid| stat(pid).map(|(_, ppid)| (pid, ppid)))
        .collect();
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parents.iter().filter(|&&(_, pp)| pp == p).map(|&(c, _)| c));
        i += 1;
    }
    out.remove(0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descendants_follow_the_parent_chain_and_kill_reaches_grandchildren() {
        // sh -> sleep (grandchild of this test): both found, both killed.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 60 & sleep 60; wait"])
            .spawn()
            .expect("sh");
        let root = child.id();
        let mut found = Vec::new();
        for _ in 0..100 {
            found = descendants(root);
            if found.len() >= 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(found.len(), 2, "two sleeps under sh: {found:?}");
        let dir = std::env::temp_dir().join(format!("memveil-kill-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        // A stats file of a process that does not hold the key file (this
        // test's own pid) is left alone.
        std::fs::write(dir.join(format!("{}.stats", std::process::id())), b"").expect("stats");
        let me = std::fs::metadata("/proc/self/exe").expect("a file this test does not hold");
        let n = kill_program(Some(root), &dir, Some(&me));
        assert!(n >= 3, "sh and its two sleeps signalled: {n}");
        let st = child.wait().expect("wait");
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(9));
        for p in found {
            assert!(is_zombie(p) || stat(p).is_none(), "{p} still runs");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
