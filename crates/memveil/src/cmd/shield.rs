//! `memveil shield`: the host's view of the shield. `status` lists every
//! protected program on the host (the registry under
//! `/run/memveil/shield/runs/`) and the host's budget; `budget` shows or sets
//! the size of the budget all of them share (the ledger
//! `/run/memveil/shield/host`, docs/shield.md "One budget per host").
//! `memveil run` uses the same places, through the functions here.

use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use memveil_shield::host::{self, LedgerView};
use memveil_shield::{Snapshot, StatsFile};

/// Where the host's shield keeps its ledger and registry, unless
/// `MEMVEIL_SHIELD_DIR` names another place (tests, a container's own).
const BASE: &str = "/run/memveil/shield";
/// The largest `run.json` read.
const RUN_JSON_MAX: u64 = 16 * 1024;

/// `memveil shield --help`, after the options.
const AFTER_LONG_HELP: &str = "\
Every memveil run on a host draws on one budget of the host's CPU time (the ledger
/run/memveil/shield/host, made by root's memveil run or by `memveil shield budget`),
and lists its program under /run/memveil/shield/runs/ for `memveil shield status`.
MEMVEIL_SHIELD_DIR names another place than /run/memveil/shield.

Examples:
  memveil shield status                 # every protected program and the host's budget
  memveil shield status --json          # the same, as JSON
  memveil shield budget                 # the host's budget now
  memveil shield budget 5%              # 5% of the host's CPU time (as root)
  memveil shield budget off             # every run on its own budget only

See docs/shield.md.";

/// `memveil shield status --help`, after the options.
const STATUS_EXAMPLES: &str = "\
Programs are listed from /run/memveil/shield/runs/ (MEMVEIL_SHIELD_DIR/runs): only live
ones whose entry belongs to the user they run as; entries of runs that are gone are
removed where this user may.

Examples:
  memveil shield status                 # a table, and the host line first
  memveil shield status --json          # host and programs as JSON

See docs/shield.md, \"One budget per host\".";

/// `memveil shield budget --help`, after the options.
const BUDGET_EXAMPLES: &str = "\
Examples:
  memveil shield budget                 # the budget now and what was spent of it
  memveil shield budget 5%              # 5% of the host's CPU time (the default)
  memveil shield budget 0.5%            # a tenth of that
  memveil shield budget off             # every run on its own budget only

See docs/shield.md, \"One budget per host\".";

/// Flags of `memveil shield`.
#[derive(clap::Args)]
#[command(after_long_help = AFTER_LONG_HELP)]
pub struct Args {
    #[command(subcommand)]
    command: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Every protected program on the host, and the host's budget
    ///
    /// Every program running under memveil run on this host (of any user):
    /// pid, user, command, KeyID, guarantee, heap (data pages now), the
    /// time-weighted ciphertext fraction of its heap, what the shield cost
    /// it (share of its time), faults, whether its budget was met, and
    /// whether it draws on the host's budget; then the host's budget, what
    /// was spent of it over the last second, and the programs it covers.
    #[command(verbatim_doc_comment, after_long_help = STATUS_EXAMPLES)]
    Status {
        /// JSON instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Show or set the host's budget (a share of the host's CPU time)
    ///
    /// Without PERCENT: the host's budget now. With it (as root, or the
    /// ledger's owner): the share of the host's CPU time that every
    /// protected program's faults and sweeps together may take, e.g. 5% (the
    /// default: 5% of the host, at least 100 ms of CPU per second) or 0.5%;
    /// "off" leaves every memveil run on its own budget alone. Each program
    /// also keeps its own --max-overhead, which bounds its own slowdown.
    #[command(verbatim_doc_comment, after_long_help = BUDGET_EXAMPLES)]
    Budget {
        /// PERCENT of the host's CPU time (more than 0, at most 100), or off
        #[arg(value_name = "PERCENT|off", value_parser = host::parse_host_budget)]
        size: Option<u64>,
    },
}

/// Runs `memveil shield`.
pub fn run(a: Args) -> anyhow::Result<u8> {
    match a.command {
        Sub::Status { json } => {
            let s = status();
            let mut out = std::io::stdout().lock();
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&s.json())?)?;
            } else {
                write!(out, "{}", s.table())?;
            }
            Ok(0)
        }
        Sub::Budget { size } => budget(size),
    }
}

/// `memveil shield budget [SIZE]`.
fn budget(size: Option<u64>) -> anyhow::Result<u8> {
    let path = ledger_path();
    if let Some(rate) = size {
        ensure_dir(&base_dir(), 0o755, false)
            .map_err(anyhow::Error::msg)
            .context("the host's shield directory")?;
        let f = host::open_ledger(&path, rate)?;
        host::set_rate(&f, rate).with_context(|| format!("writing {}", path.display()))?;
    }
    match LedgerView::read(&path) {
        Ok(v) => println!("{}", describe_budget(&v)),
        Err(e) => println!(
            "no host budget yet ({e}): the first memveil run as root makes it, at {}",
            rate_words(host::default_rate(), host::host_cpus())
        ),
    }
    Ok(0)
}

/// `N ms of CPU per s (P% of C CPUs)`.
fn rate_words(rate: u64, cpus: u64) -> String {
    #[allow(clippy::cast_precision_loss)]
    let (ms, pct) = (
        rate as f64 / 1e6,
        rate as f64 / (cpus.max(1) as f64 * 1e9) * 100.0,
    );
    format!("{ms:.1} ms of CPU per s ({pct:.1}% of {cpus} CPUs)")
}

/// The host's budget in words.
fn describe_budget(v: &LedgerView) -> String {
    if v.rate_ns_per_s == 0 {
        return "host budget: off (every memveil run keeps its own budget only; `memveil shield \
                budget 5%` turns it on)"
            .to_owned();
    }
    #[allow(clippy::cast_precision_loss)]
    let tokens = v.tokens_ns as f64 / 1e6;
    format!(
        "host budget: {}; spent {:.1}% of the host's CPU over the last second; {tokens:.1} ms left \
         in the bucket",
        rate_words(v.rate_ns_per_s, v.cpus),
        v.spent_fraction() * 100.0
    )
}

/// The host's shield directory.
pub(crate) fn base_dir() -> PathBuf {
    std::env::var_os("MEMVEIL_SHIELD_DIR")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(BASE), PathBuf::from)
}

/// The host's ledger.
pub(crate) fn ledger_path() -> PathBuf {
    base_dir().join("host")
}

/// Creates `dir` (and its parents) with `mode` if missing, and checks it
/// may be trusted: a directory (not a link) owned by root or this user,
/// that others may not write, or (`sticky`) the sticky bit set, as /tmp.
fn ensure_dir(dir: &Path, mode: u32, sticky: bool) -> Result<(), String> {
    if std::fs::symlink_metadata(dir).is_err() {
        if let Some(parent) = dir.parent() {
            let _ = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent);
        }
        match std::fs::DirBuilder::new().mode(mode).create(dir) {
            Ok(()) => {
                // The umask took bits away.
                let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
        }
    }
    let m = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // SAFETY: geteuid has no arguments and cannot fail.
    let me = unsafe { libc::geteuid() };
    let others_write = m.mode() & 0o022 != 0;
    let ok = m.file_type().is_dir()
        && (m.uid() == 0 || m.uid() == me)
        && if sticky {
            m.mode() & 0o1000 != 0
        } else {
            !others_write
        };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{}: not a directory owned by root (or uid {me}){} (uid {}, mode {:o}): remove it, and \
             let root's memveil run make it",
            dir.display(),
            if sticky {
                " with the sticky bit"
            } else {
                " that only its owner may write"
            },
            m.uid(),
            m.mode() & 0o7777
        ))
    }
}

/// The host's ledger for `memveil run`, open and inheritable (the
/// descriptor the program gets as `MEMVEIL_SHIELD_HOST_FD`), with the
/// budget it names; or why the run keeps its own budget only.
pub(crate) fn join_host() -> Result<(File, LedgerView), String> {
    let why = |e: String| {
        format!(
            "{e}; the host's budget is shared through {} (made by root's memveil run)",
            ledger_path().display()
        )
    };
    ensure_dir(&base_dir(), 0o755, false).map_err(why)?;
    let path = ledger_path();
    let f = host::open_ledger(&path, host::default_rate()).map_err(|e| why(e.to_string()))?;
    let v = LedgerView::read(&path).map_err(why)?;
    if v.rate_ns_per_s == 0 {
        return Err(format!(
            "the host's budget is off ({}; `memveil shield budget 5%` turns it on)",
            path.display()
        ));
    }
    // Inherited high, out of the way of a program's own descriptors
    // (`memveil_sys::fdguard`).
    let f = memveil_sys::fdguard::dup_high_inheritable(std::os::fd::AsFd::as_fd(&f))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((File::from(f), v))
}

/// The registry of runs (`runs/`, sticky and writable by all, as /tmp),
/// made as the operator before `--user` gives that up.
pub(crate) fn runs_dir() -> Result<PathBuf, String> {
    ensure_dir(&base_dir(), 0o755, false)?;
    let d = base_dir().join("runs");
    ensure_dir(&d, 0o1777, true)?;
    Ok(d)
}

/// What `memveil run` writes into its registry entry.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct RunJson {
    /// The pid of `memveil run` (the supervisor).
    pub(crate) pid: u32,
    /// Its start time in clock ticks since boot (`/proc/PID/stat`), so a
    /// reused pid is not taken for it.
    pub(crate) start_ticks: u64,
    /// The command line, as given.
    pub(crate) command: String,
    /// The host KeyID (`--keyid`).
    pub(crate) keyid: Option<u16>,
    /// The guarantee in words (`budget 10%`, `bound`, ...).
    pub(crate) guarantee: String,
    /// The budget, percent of the program's time.
    pub(crate) budget_percent: Option<u8>,
    /// When it started (seconds since the epoch).
    pub(crate) start_unix: u64,
    /// The host's budget it draws on, or why not.
    pub(crate) host_budget: String,
}

/// Makes this run's entry `runs/PID` (readable by all, writable by this
/// user) with its `run.json`; it is also the run's statistics directory.
pub(crate) fn register(runs: &Path, info: &RunJson) -> Result<PathBuf, String> {
    let d = runs.join(info.pid.to_string());
    // A dead run's entry under our pid (a reused pid): gone first.
    let _ = std::fs::remove_dir_all(&d);
    std::fs::DirBuilder::new()
        .mode(0o755)
        .create(&d)
        .map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755));
    let text = serde_json::to_string(info).map_err(|e| e.to_string())?;
    std::fs::write(d.join("run.json"), text).map_err(|e| {
        let _ = std::fs::remove_dir_all(&d);
        format!("cannot write {}: {e}", d.join("run.json").display())
    })?;
    Ok(d)
}

/// Process `pid`'s start time (clock ticks since boot) and real uid.
pub(crate) fn proc_start(pid: u32) -> Option<(u64, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces and parentheses: fields after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // Field 22 (starttime) is the 20th after the command.
    let start = rest.split_whitespace().nth(19)?.parse().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((start, uid))
}

/// A user's name from the password file (the uid when it has none).
fn user_name(uid: u32, passwd: &str) -> String {
    passwd
        .lines()
        .find_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let id: u32 = f.nth(1)?.parse().ok()?;
            (id == uid).then(|| name.to_owned())
        })
        .unwrap_or_else(|| uid.to_string())
}

/// One protected program, as `status` shows it.
#[derive(Debug, Clone)]
pub(crate) struct Program {
    /// Its registry entry.
    pub(crate) run: RunJson,
    /// The user it runs as (the entry's owner, checked against the pid's).
    pub(crate) uid: u32,
    /// That user's name.
    pub(crate) user: String,
    /// Its processes' counters, summed.
    pub(crate) stats: Snapshot,
}

impl Program {
    /// Bytes of the heap holding data now (plaintext and ciphertext).
    pub(crate) fn heap_bytes(&self) -> u64 {
        (self.stats.resident_pages + self.stats.evicted_pages).saturating_mul(4096)
    }

    /// Ciphertext over data, weighted by time over the run.
    pub(crate) fn ciphertext_fraction(&self) -> Option<f64> {
        self.stats.time_plaintext_fraction().map(|p| 1.0 - p)
    }

    /// Whether its budget was kept (`None`: no budget, or not measured yet).
    pub(crate) fn budget_met(&self) -> Option<bool> {
        let p = self.run.budget_percent?;
        let c = self.stats.cost_fraction()?;
        Some(super::run_report::budget_met(p, c))
    }

    /// Whether any of its processes runs the shield (a program the preload
    /// never reached, or under a no-encrypt KeyID, is unprotected).
    pub(crate) fn protected(&self) -> bool {
        self.stats.processes > 0
    }

    /// Whether its processes draw on the host's budget.
    pub(crate) fn on_host_budget(&self) -> bool {
        self.stats.host_joined > 0
    }
}

/// The host's shield: its budget and every protected program.
#[derive(Debug, Clone)]
pub(crate) struct Status {
    /// The ledger, or why it cannot be read.
    pub(crate) ledger: Result<LedgerView, String>,
    /// The programs, by pid.
    pub(crate) programs: Vec<Program>,
    /// Entries skipped: dead runs, or not what they claim.
    pub(crate) skipped: usize,
}

/// Reads the registry and the ledger (never writes, except to remove the
/// entries of runs that are gone, where this user may).
pub(crate) fn status() -> Status {
    read_status(true)
}

/// [`status`] without removing anything.
fn status_read_only() -> Status {
    read_status(false)
}

fn read_status(clean: bool) -> Status {
    let ledger = LedgerView::read(&ledger_path());
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let mut programs = Vec::new();
    let mut skipped = 0;
    let runs = base_dir().join("runs");
    for e in std::fs::read_dir(&runs).into_iter().flatten().flatten() {
        match program(&e.path(), &passwd) {
            Some(p) => programs.push(p),
            None => {
                skipped += 1;
                // A run that is gone (killed: it could not remove it).
                if clean && gone(&e.path()) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
    programs.sort_by_key(|p| p.run.pid);
    Status {
        ledger,
        programs,
        skipped,
    }
}

/// Whether the entry at `dir` names a process that no longer exists.
fn gone(dir: &Path) -> bool {
    dir.file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.parse::<u32>().ok())
        .is_some_and(|pid| proc_start(pid).is_none())
}

/// The program of the entry at `dir`, if it is a live run whose entry
/// belongs to the user its `memveil run` runs as.
fn program(dir: &Path, passwd: &str) -> Option<Program> {
    let m = std::fs::symlink_metadata(dir).ok()?;
    if !m.file_type().is_dir() {
        return None;
    }
    let path = dir.join("run.json");
    let f = File::open(&path).ok()?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(f, RUN_JSON_MAX), &mut text).ok()?;
    let run: RunJson = serde_json::from_str(&text).ok()?;
    if dir.file_name()?.to_str()? != run.pid.to_string() {
        return None;
    }
    let (start, uid) = proc_start(run.pid)?;
    // A reused pid, or an entry made by another user than the run's.
    if start != run.start_ticks || uid != m.uid() {
        return None;
    }
    let stats = StatsFile::read_dir(dir).unwrap_or_default();
    Some(Program {
        user: user_name(uid, passwd),
        uid,
        run,
        stats,
    })
}

/// Printable: control characters shown as `?`, at most 60 characters.
fn printable(s: &str, max: usize) -> String {
    let mut t: String = s
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .take(max)
        .collect();
    if s.chars().count() > max {
        t.push('…');
    }
    t
}

/// Bytes in K, M or G.
fn size(b: u64) -> String {
    #[allow(clippy::cast_precision_loss)]
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.1}G", b / 1024.0 / 1024.0 / 1024.0)
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.1}M", b / 1024.0 / 1024.0)
    } else {
        format!("{:.0}K", b / 1024.0)
    }
}

/// Percent with one decimal, `-` for none.
fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_owned(), |x| format!("{:.1}%", x * 100.0))
}

impl Status {
    /// The host line.
    fn host_line(&self) -> String {
        let joined = self.programs.iter().filter(|p| p.on_host_budget()).count();
        let n = self.programs.len();
        let budget = match &self.ledger {
            Ok(v) => describe_budget(v),
            Err(e) => format!("host budget: none ({e})"),
        };
        format!("{budget}; {n} protected program(s), {joined} on the host's budget")
    }

    /// The table `status` prints.
    pub(crate) fn table(&self) -> String {
        let mut out = format!("{}\n", self.host_line());
        if self.programs.is_empty() {
            return out;
        }
        out.push_str(&format!(
            "{:>8} {:<10} {:>5} {:<14} {:>8} {:>10} {:>6} {:>9} {:<6} {:<4} {}\n",
            "PID",
            "USER",
            "KEYID",
            "GUARANTEE",
            "HEAP",
            "CIPHERTEXT",
            "COST",
            "FAULTS",
            "BUDGET",
            "HOST",
            "COMMAND"
        ));
        for p in &self.programs {
            out.push_str(&format!(
                "{:>8} {:<10} {:>5} {:<14} {:>8} {:>10} {:>6} {:>9} {:<6} {:<4} {}\n",
                p.run.pid,
                printable(&p.user, 10),
                p.run
                    .keyid
                    .map_or_else(|| "-".to_owned(), |k| k.to_string()),
                printable(&p.run.guarantee, 14),
                size(p.heap_bytes()),
                pct(p.ciphertext_fraction()),
                pct(p.stats.cost_fraction()),
                p.stats.faults(),
                match (p.protected(), p.budget_met()) {
                    (false, _) => "UNPROT",
                    (true, Some(true)) => "met",
                    (true, Some(false)) => "NOT MET",
                    (true, None) => "-",
                },
                if p.on_host_budget() { "yes" } else { "no" },
                printable(&p.run.command, 60)
            ));
        }
        out
    }

    /// `status --json`.
    pub(crate) fn json(&self) -> serde_json::Value {
        let programs: Vec<serde_json::Value> = self
            .programs
            .iter()
            .map(|p| {
                serde_json::json!({
                    "pid": p.run.pid,
                    "uid": p.uid,
                    "user": p.user,
                    "command": p.run.command,
                    "keyid": p.run.keyid,
                    "guarantee": p.run.guarantee,
                    "budget_percent": p.run.budget_percent,
                    "start_unix": p.run.start_unix,
                    "processes": p.stats.processes,
                    "protected": p.protected(),
                    "heap_bytes": p.heap_bytes(),
                    "ciphertext_fraction": p.ciphertext_fraction(),
                    "cost_fraction": p.stats.cost_fraction(),
                    "faults": p.stats.faults(),
                    "budget_met": p.budget_met(),
                    "on_host_budget": p.on_host_budget(),
                    "host_budget": p.run.host_budget,
                    "host_waits": p.stats.host_waits,
                    "host_colder": p.stats.host_colder,
                })
            })
            .collect();
        let host = match &self.ledger {
            Ok(v) => serde_json::json!({
                "ledger": ledger_path(),
                "budget_ns_per_s": v.rate_ns_per_s,
                "budget_fraction": v.budget_fraction(),
                "cpus": v.cpus,
                "tokens_ns": v.tokens_ns,
                "cap_ns": v.cap_ns,
                "spent_ns": v.spent_ns,
                "spent_fraction": v.spent_fraction(),
                "slots_used": v.slots_used,
            }),
            Err(e) => serde_json::json!({ "ledger": ledger_path(), "error": e }),
        };
        serde_json::json!({
            "host": host,
            "programs": programs,
            "on_host_budget": self.programs.iter().filter(|p| p.on_host_budget()).count(),
            "skipped_entries": self.skipped,
        })
    }
}

/// The host's shield for the exporter (`memveil probe --serve`,
/// `--textfile`): read only, never removing anything (the probe's seccomp
/// filter allows no unlink).
pub(crate) fn fleet_view() -> memveil_probe::fleet::ShieldHost {
    let s = status_read_only();
    memveil_probe::fleet::ShieldHost {
        budget_fraction: s.ledger.as_ref().ok().map(LedgerView::budget_fraction),
        spent_fraction: s.ledger.as_ref().ok().map(LedgerView::spent_fraction),
        programs: s
            .programs
            .iter()
            .map(|p| memveil_probe::fleet::ShieldProgram {
                pid: p.run.pid,
                user: p.user.clone(),
                command: p.run.command.clone(),
                keyid: p.run.keyid,
                guarantee: p.run.guarantee.clone(),
                protected: p.protected(),
                heap_bytes: p.heap_bytes(),
                ciphertext_fraction: p.ciphertext_fraction(),
                cost_fraction: p.stats.cost_fraction(),
                faults: p.stats.faults(),
                budget_met: p.budget_met(),
                on_host_budget: p.on_host_budget(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_name_comes_from_the_password_file_or_is_the_uid() {
        let pw = "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/a:/bin/sh\nbad\n";
        assert_eq!(user_name(0, pw), "root");
        assert_eq!(user_name(1000, pw), "alice");
        assert_eq!(user_name(7, pw), "7");
    }

    #[test]
    fn this_process_has_a_start_time_and_a_dead_one_none() {
        let (start, _) = proc_start(std::process::id()).expect("self");
        assert!(start > 0);
        assert!(proc_start(u32::MAX - 1).is_none());
        assert_eq!(printable("a\nb", 60), "a?b");
    }
}
