//! `memveil run`'s cgroup: the program runs in a cgroup v2 of its own, a
//! child of memveil run's (`memveil-run-PID`), and whatever is left in it is
//! killed (`cgroup.kill`) when memveil run ends, however it ends: the
//! program's end, a cleared KeyID, an error, or memveil run killed, SIGKILL
//! included. For that last case a guardian process
//! ([`memveil_sys::cgroup::Guardian`]), started before anything else, holds
//! a pipe to memveil run and kills the cgroup when the pipe closes; it also
//! removes the cgroup's directory in the end, unless memveil run, finding
//! it empty at the program's end, removed it itself (the usual case:
//! [`ProgramCgroup::finish`]).
//!
//! Placement: memveil run opens the new cgroup's `cgroup.procs`, `cgroup.kill`
//! and its own cgroup's `cgroup.procs` while it may (before `--user` gives up
//! root; the kernel checks a write to `cgroup.procs` against the opener's
//! rights, Linux 5.16+), moves itself into the new cgroup for the fork of the
//! program, which is so born inside it, before its exec, and moves back.
//!
//! Without a cgroup v2 it can write (none mounted, not root and no delegated
//! cgroup, a kernel without `cgroup.kill`, before 5.14), or with
//! `MEMVEIL_RUN_CGROUP=off` (for tests and comparisons), memveil run says why
//! at start, on stderr, and runs the program as before: killed, it leaves
//! the program running.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use memveil_sys::cgroup::Guardian;

/// The environment variable that turns the cgroup off (`off`).
pub const ENV: &str = "MEMVEIL_RUN_CGROUP";

/// How long memveil run waits at its end for the guardian to empty and
/// remove the cgroup (the guardian itself gives up after 10 s).
const FINISH_WAIT: Duration = Duration::from_secs(15);

/// The program's cgroup.
pub struct ProgramCgroup {
    dir: PathBuf,
    /// The cgroup's `cgroup.procs`: writing `0` moves this process in.
    procs: File,
    /// memveil run's own cgroup's `cgroup.procs`, to move back.
    home: File,
    /// The cgroup's `cgroup.kill`.
    kill: File,
    /// The cgroup's directory, open: `clone3` starts the program in it.
    dir_fd: Option<std::os::fd::OwnedFd>,
    /// Set when this process could not move back home: a kill would kill it
    /// too, so only the guardian kills, once this process has ended.
    stuck_inside: bool,
    guardian: Option<Guardian>,
}

/// Places programs in a cgroup of their own, or says why not (the reason,
/// for stderr and `--stats-json`).
///
/// # Errors
/// Why this process cannot: the variable is set, no cgroup v2, no rights.
pub fn setup(program: &str) -> Result<ProgramCgroup, String> {
    if std::env::var_os(ENV).is_some_and(|v| v == "off") {
        return Err(format!("{ENV}=off"));
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    let (mount, root) = cgroup2_mount(&mountinfo).ok_or(
        "no cgroup v2 hierarchy is mounted (mount -t cgroup2 none /sys/fs/cgroup, or boot with \
         systemd.unified_cgroup_hierarchy=1)",
    )?;
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
    let own = own_cgroup(&own)
        .ok_or("this process has no cgroup v2 (no 0:: line in /proc/self/cgroup)")?;
    let home = cgroup_dir(&mount, &root, &own).ok_or_else(|| {
        format!(
            "this process's cgroup {own} is outside the cgroup2 mount at {}",
            mount.display()
        )
    })?;
    let dir = make_dir(&home)?;
    let open = |p: &Path| {
        std::fs::OpenOptions::new()
            .write(true)
            .open(p)
            .map_err(|e| format!("cannot open {} for writing: {e}", p.display()))
    };
    let files = (|| {
        if !dir.join("cgroup.kill").exists() {
            return Err("this kernel has no cgroup.kill (Linux 5.14+)".to_owned());
        }
        Ok((
            open(&dir.join("cgroup.procs"))?,
            open(&home.join("cgroup.procs"))?,
            open(&dir.join("cgroup.kill"))?,
        ))
    })();
    let (procs, home_procs, kill) = match files {
        Ok(f) => f,
        Err(why) => {
            let _ = std::fs::remove_dir(&dir);
            return Err(why);
        }
    };
    let guardian = Guardian::start(
        &dir,
        &format!(
            "memveil run: ended before {program} did (killed?): every process of it in cgroup {} \
             killed",
            dir.display()
        ),
    )
    .map_err(|e| {
        let _ = std::fs::remove_dir(&dir);
        format!("cannot start the cgroup's guardian process: {e}")
    })?;
    let dir_fd = File::open(&dir).ok().map(std::os::fd::OwnedFd::from);
    Ok(ProgramCgroup {
        dir,
        procs,
        home: home_procs,
        kill,
        dir_fd,
        stuck_inside: false,
        guardian: Some(guardian),
    })
}

/// Creates `memveil-run-PID` (or `memveil-run-PID.N` if that is taken)
/// under `home`.
fn make_dir(home: &Path) -> Result<PathBuf, String> {
    let pid = std::process::id();
    let mut last = None;
    for n in 0..8 {
        let dir = home.join(if n == 0 {
            format!("memveil-run-{pid}")
        } else {
            format!("memveil-run-{pid}.{n}")
        });
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(dir),
            Err(e) => {
                return Err(format!(
                    "cannot create a cgroup under {}: {e} (run as root, or in a cgroup delegated \
                     to this user)",
                    home.display()
                ))
            }
        }
    }
    Err(format!(
        "{} and 7 others like it exist already",
        last.unwrap_or_default().display()
    ))
}

/// The program, as started: by `std` (after moving into the cgroup, or
/// without one), or by `clone3` straight into the cgroup.
pub enum Program {
    /// Started by `std::process::Command`.
    Std(std::process::Child),
    /// Started by [`memveil_sys::cgroup::spawn_into`].
    Into(memveil_sys::cgroup::Spawned),
}

impl Program {
    /// Its process id.
    #[must_use]
    pub fn id(&self) -> u32 {
        match self {
            Program::Std(c) => c.id(),
            Program::Into(c) => c.id(),
        }
    }

    /// Its status if it has ended.
    ///
    /// # Errors
    /// The error of `waitpid(2)`.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        match self {
            Program::Std(c) => c.try_wait(),
            Program::Into(c) => c.try_wait(),
        }
    }

    /// Waits for it to end.
    ///
    /// # Errors
    /// The error of `waitpid(2)`.
    pub fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match self {
            Program::Std(c) => c.wait(),
            Program::Into(c) => c.wait(),
        }
    }
}

/// `cmd`'s program resolved on PATH, its arguments and its environment
/// (this process's, with what `cmd` sets and removes), for `execve`.
fn exec_parts(
    cmd: &std::process::Command,
) -> Option<(
    std::ffi::CString,
    Vec<std::ffi::CString>,
    Vec<std::ffi::CString>,
)> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = |s: &std::ffi::OsStr| std::ffi::CString::new(s.as_bytes()).ok();
    let program = Path::new(cmd.get_program());
    let path = if program.as_os_str().as_bytes().contains(&b'/') {
        program.to_path_buf()
    } else {
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|d| d.join(program))
            .find(|p| p.is_file())?
    };
    let mut argv = vec![c(cmd.get_program())?];
    for a in cmd.get_args() {
        argv.push(c(a)?);
    }
    let mut env: std::collections::BTreeMap<std::ffi::OsString, std::ffi::OsString> =
        std::env::vars_os().collect();
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => env.insert(k.to_owned(), v.to_owned()),
            None => env.remove(k),
        };
    }
    let mut envp = Vec::with_capacity(env.len());
    for (k, v) in env {
        let mut kv = k;
        kv.push("=");
        kv.push(v);
        envp.push(c(&kv)?);
    }
    Some((c(path.as_os_str())?, argv, envp))
}

impl ProgramCgroup {
    /// Starts `cmd` born in the cgroup with `clone3` (no process moves
    /// between cgroups: see [`memveil_sys::cgroup::spawn_into`]); `None`
    /// when that is not possible here (the caller moves into the cgroup and
    /// spawns the usual way), `Some(Err)` when the program could not start.
    pub fn spawn_into(
        &self,
        cmd: &std::process::Command,
    ) -> Option<std::io::Result<memveil_sys::cgroup::Spawned>> {
        use std::os::fd::AsFd as _;
        if cmd.get_current_dir().is_some() {
            return None;
        }
        let fd = self.dir_fd.as_ref()?;
        let (path, argv, envp) = exec_parts(cmd)?;
        // EACCES: after --user, clone3 checks the cgroup's write permission
        // with the user's credentials (the fallback writes through the file
        // root opened). An exec refused with EACCES is then tried again
        // the usual way, and refused again with the same error.
        match memveil_sys::cgroup::spawn_into(fd.as_fd(), &path, &argv, &envp) {
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOSYS | libc::EINVAL | libc::EPERM | libc::EACCES)
                ) =>
            {
                None
            }
            r => Some(r),
        }
    }

    /// Moves this process into the cgroup, so that the process it forks
    /// next is born there; [`ProgramCgroup::leave`] moves it back.
    ///
    /// # Errors
    /// Why it could not (the cgroup is then not used).
    pub fn enter(&mut self) -> Result<(), String> {
        self.procs
            .write_all(b"0")
            .map_err(|e| format!("cannot move into {}: {e}", self.dir.display()))
    }

    /// Moves this process back to its own cgroup, after [`ProgramCgroup::enter`].
    pub fn leave(&mut self) {
        if let Err(e) = self.home.write_all(b"0") {
            self.stuck_inside = true;
            eprintln!(
                "memveil run: warning: could not move back out of cgroup {}: {e}; the program's \
                 processes are killed only once memveil run has ended",
                self.dir.display()
            );
        }
    }

    /// Kills every process in the cgroup now; returns how many of the
    /// program's there were (the loader's keeper is not counted).
    pub fn kill(&mut self) -> usize {
        if self.stuck_inside {
            return 0;
        }
        let listed = self.listed();
        if !listed.is_empty() {
            let _ = self.kill.write_all(b"1");
        }
        listed.into_iter().filter(|&p| !is_keeper(p)).count()
    }

    /// Every process in the cgroup (`cgroup.procs`; empty when unreadable).
    fn listed(&self) -> Vec<u32> {
        std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// How many of the program's processes are in the cgroup (the
    /// loader's keeper is memveil's, not the program's: not counted).
    #[must_use]
    pub fn count(&self) -> usize {
        self.listed().into_iter().filter(|&p| !is_keeper(p)).count()
    }

    /// The program's processes in the cgroup (not the loader's keeper);
    /// `None` when it cannot be read (or this process could not move back
    /// out of it: the cgroup then holds processes that are not the
    /// program's).
    #[must_use]
    pub fn pids(&self) -> Option<Vec<u32>> {
        if self.stuck_inside {
            return None;
        }
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).ok()?;
        Some(
            procs
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .filter(|&p| !is_keeper(p))
                .collect(),
        )
    }

    /// The end of the run. When nothing is left in the cgroup this process
    /// removes it itself, at once, and the guardian, told of the normal
    /// end, exits on its own (not waited for: its wake, removal and exit
    /// took 0.5-10 ms of every run's end here, the most with the CPUs
    /// busy); should it not go, the guardian removes it, waited for up to
    /// [`FINISH_WAIT`] (`false`: it did not, and said why). When the program
    /// left processes running, the guardian removes the cgroup once they
    /// have ended, not waited for. A keeper left alone ends the moment the
    /// kernel has released the loader: it is waited for, up to
    /// [`KEEPER_WAIT`], first.
    pub fn finish(mut self) -> bool {
        let listed = self.listed();
        let keepers: Vec<u32> = listed.iter().copied().filter(|&p| is_keeper(p)).collect();
        let empty = listed.len() == keepers.len();
        if empty {
            for k in keepers {
                if let Ok(Some(fd)) = memveil_sys::process::PidFd::open(k) {
                    fd.wait(Some(KEEPER_WAIT));
                }
            }
        }
        let Some(g) = self.guardian.take() else {
            return false;
        };
        if !empty {
            // Dropped: told of the normal end, it waits for them.
            return true;
        }
        if memveil_sys::cgroup::remove_dir(&self.dir) {
            g.removed();
            true
        } else {
            g.finish(FINISH_WAIT)
        }
    }
}

/// The name memveil-shield-loader's keeper takes (`/proc/PID/comm`): the
/// process that lets the calls of the children a static program started
/// through the loader's seccomp filter once the program has ended
/// (crates/shield-loader/src/keeper.rs). It ends when they all have.
const KEEPER: &str = "memveil-keeper";

/// How long memveil run waits at its end for a keeper with nothing left
/// to serve.
const KEEPER_WAIT: Duration = Duration::from_secs(1);

/// Whether process `pid` is a loader's keeper.
fn is_keeper(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == KEEPER)
}

/// One line for the summary: the program's cgroup and what was killed in
/// it at the end, or why it had none.
#[must_use]
pub fn describe(cg: &Result<ProgramCgroup, String>, left: usize) -> String {
    match cg {
        Ok(c) if left > 0 => format!(
            "{} ({left} process(es) the program left running go on; the cgroup goes when they \
             end)",
            c.dir.display()
        ),
        Ok(c) => format!(
            "{} (killed whole had memveil run been killed)",
            c.dir.display()
        ),
        Err(why) => format!("none ({why}): memveil run killed would leave the program running"),
    }
}

/// `--stats-json`'s `cgroup`: whether the program had its own, where, and
/// how many processes it left running at the end; or why not.
#[must_use]
pub fn json(cg: &Result<ProgramCgroup, String>, left: usize) -> serde_json::Value {
    match cg {
        Ok(c) => serde_json::json!({
            "in_use": true,
            "path": c.dir.display().to_string(),
            "left_running": left,
        }),
        Err(why) => serde_json::json!({ "in_use": false, "why_not": why }),
    }
}

/// The first cgroup2 mount in `/proc/self/mountinfo`: (mount point, the
/// hierarchy's path mounted there).
fn cgroup2_mount(mountinfo: &str) -> Option<(PathBuf, String)> {
    mountinfo.lines().find_map(|line| {
        // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mut f = left.split_whitespace();
        let root = unescape(f.nth(3)?);
        let mount = unescape(f.next()?);
        Some((PathBuf::from(mount), root))
    })
}

/// A mountinfo field with its octal escapes (`\040` for a space) decoded.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let code = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        if let Some(c) = code {
            out.push(c);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// This process's cgroup v2 path, from `/proc/self/cgroup` (the `0::` line).
fn own_cgroup(proc_cgroup: &str) -> Option<String> {
    proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_owned)
}

/// The directory of cgroup `path` under a cgroup2 mount at `mount` that
/// shows the hierarchy from `root`; `None` when `path` is not under `root`.
fn cgroup_dir(mount: &Path, root: &str, path: &str) -> Option<PathBuf> {
    let rel = if root == "/" {
        path
    } else {
        let rest = path.strip_prefix(root)?;
        if !(rest.is_empty() || rest.starts_with('/')) {
            return None;
        }
        rest
    };
    let rel = rel.trim_start_matches('/');
    if rel.split('/').any(|c| c == "..") {
        return None;
    }
    Some(if rel.is_empty() {
        mount.to_path_buf()
    } else {
        mount.join(rel)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_and_this_process_s_directory_are_found() {
        let hybrid = "\
25 30 0:23 / /sys rw,nosuid - sysfs sysfs rw
40 25 0:35 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755
41 40 0:36 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate
42 40 0:37 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
";
        let (m, r) = cgroup2_mount(hybrid).expect("cgroup2");
        assert_eq!(
            (m.as_path(), r.as_str()),
            (Path::new("/sys/fs/cgroup/unified"), "/")
        );
        assert_eq!(
            own_cgroup("4:memory:/x\n0::/user.slice/s.scope\n").as_deref(),
            Some("/user.slice/s.scope")
        );
        assert_eq!(
            cgroup_dir(&m, &r, "/user.slice/s.scope"),
            Some(PathBuf::from("/sys/fs/cgroup/unified/user.slice/s.scope"))
        );
        assert_eq!(cgroup_dir(&m, &r, "/"), Some(m.clone()));
        // A mount of part of the hierarchy, with an escaped space.
        let part = "50 1 0:40 /sys\\040tem.slice /mnt/cg\\040x rw - cgroup2 none rw\n";
        let (m, r) = cgroup2_mount(part).expect("cgroup2");
        assert_eq!(
            (m.as_path(), r.as_str()),
            (Path::new("/mnt/cg x"), "/sys tem.slice")
        );
        assert_eq!(
            cgroup_dir(&m, &r, "/sys tem.slice/a.service"),
            Some(PathBuf::from("/mnt/cg x/a.service"))
        );
        assert_eq!(cgroup_dir(&m, &r, "/sys tem.slicex"), None);
        assert_eq!(cgroup_dir(&m, &r, "/other"), None);
        assert_eq!(cgroup_dir(&m, "/", "/../x"), None);
        // No cgroup2 (v1 only), no 0:: line.
        assert!(
            cgroup2_mount("42 40 0:37 / /sys/fs/cgroup/memory rw - cgroup cgroup rw\n").is_none()
        );
        assert!(own_cgroup("4:memory:/x\n").is_none());
        assert_eq!(unescape("a\\134b\\0"), "a\\b\\0");
    }
}
