//! One budget per host: the ledger every protected program on the host
//! draws on (docs/shield.md, "One budget per host").
//!
//! Budgets that do not know of each other do not add up: 18 programs at
//! 10% of their own time each claimed 1.8 CPUs of a 2-CPU host. The ledger
//! is a small shared file (`/run/memveil/shield/host`) that `memveil run`
//! opens as the operator and leaves to the program as a descriptor
//! (`MEMVEIL_SHIELD_HOST_FD`). It holds a token bucket in nanoseconds of
//! the host's CPU time, filled lazily by whichever shield draws (a
//! compare-and-swap on the time of the last refill, clamped to a cap) and
//! emptied by what every shield measurably costs (the cost its own budget
//! counts, [`crate::Budget`]), and one slot per process in which each
//! publishes its *bid*: the coldest class of pages it has due (known quiet
//! pages, then the levels from the shortest period up), with a time stamp.
//! A shield sweeps only while both the host's bucket and its own budget
//! have room, and, once the host's bucket is below half of its cap, only
//! when its own bid is as cold as the coldest live bid on the host: the
//! coldest pages of all programs go first.
//!
//! Nobody owns the ledger: a process killed in the middle of an update
//! leaves at worst a slot whose bid expires ([`BID_MS`]) and whose pid is
//! reclaimed, and tokens the refill clamps. Everything read from it is
//! validated (another process may have written anything into it): numbers
//! are clamped, never trusted, and nothing read can panic.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd as _, BorrowedFd};
use std::os::unix::fs::{FileExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use memveil_sys::uffd;

use crate::sweep::{self, Sweep};

/// Bytes of the ledger file.
pub const LEDGER_LEN: usize = 8192;
/// Identifies the layout ("mvhost" v1).
const MAGIC: u64 = 0x6d76_686f_7374_0001;
/// Slots for the processes' bids.
pub const SLOTS: usize = 128;
/// A bid not refreshed for this long (ms) is no longer counted.
pub const BID_MS: u64 = 200;
/// A slot whose bid is this old (ms) and whose process is gone is free.
const SLOT_STALE_MS: u64 = 2_000;
/// The bucket holds at most this share of a second's worth of budget.
const CAP_SECONDS: f64 = 0.25;
/// The most debt kept, in seconds' worth of budget (a larger one, written
/// by anyone, is clamped).
const DEBT_SECONDS: f64 = 2.0;
/// Below this share of its cap, the bucket goes to the coldest pages only.
pub const COLD_ONLY_BELOW: f64 = 0.5;
/// The window over which the spend rate is kept, ns.
const WINDOW_NS: u64 = 1_000_000_000;
/// The default host budget, as a share of the host's CPU time.
pub const DEFAULT_HOST_FRACTION: f64 = 0.05;
/// The least default budget, ns of CPU per second: what one program alone
/// gets under its own default budget (10% of its time), so a program alone
/// on a small host gets what it gets without the host budget.
pub const MIN_DEFAULT_NS_PER_S: u64 = 100_000_000;

// Word indices of the header.
const W_MAGIC: usize = 0;
const W_RATE: usize = 1;
const W_CPUS: usize = 2;
const W_TOKENS: usize = 3;
const W_LAST: usize = 4;
const W_SPENT: usize = 5;
const W_WIN_START: usize = 6;
const W_WIN_SPENT: usize = 7;
const W_LAST_WIN_NS: usize = 8;
const W_LAST_WIN_SPENT: usize = 9;
/// The first slot's word; each slot is [`SLOT_WORDS`] words: pid, bid
/// (class in the top byte, ms stamp below), ns drawn, unused.
const W_SLOTS: usize = 16;
const SLOT_WORDS: usize = 4;
const WORDS: usize = W_SLOTS + SLOTS * SLOT_WORDS;
const _: () = assert!(WORDS * 8 <= LEDGER_LEN);

/// No bid: nothing due.
pub const NO_BID: u8 = u8::MAX;
const STAMP_MASK: u64 = (1 << 56) - 1;

/// CPUs of this host (online), at least 1: counted once per process.
/// `available_parallelism` opens and reads the process's cgroup files, and
/// the ledger's rate is validated against it at every sweep step: counted
/// each time, it took 30% of the watchdog's CPU (perf, the cold server's
/// start), CPU time its budget paid for instead of sweeps.
#[must_use]
pub fn host_cpus() -> u64 {
    static CPUS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| {
        std::thread::available_parallelism()
            .ok()
            .and_then(|n| u64::try_from(n.get()).ok())
            .unwrap_or(1)
            .max(1)
    })
}

/// The most budget a ledger may name: every CPU of the host, ns per s.
fn max_rate() -> u64 {
    host_cpus().saturating_mul(1_000_000_000)
}

/// The default host budget: [`DEFAULT_HOST_FRACTION`] of the host's CPU
/// time, at least [`MIN_DEFAULT_NS_PER_S`], in ns of CPU per second.
#[must_use]
pub fn default_rate() -> u64 {
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let r = (max_rate() as f64 * DEFAULT_HOST_FRACTION) as u64;
    r.max(MIN_DEFAULT_NS_PER_S)
}

/// Parses a host budget: `5%` or `5` or `0.5%` (of the host's CPU time,
/// more than 0, at most 100), or `off`; returns ns of CPU per second (0:
/// off).
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_host_budget(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("off") {
        return Ok(0);
    }
    let p = t.strip_suffix('%').unwrap_or(t).trim();
    match p.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 100.0 => {
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss
            )]
            let r = (max_rate() as f64 * v / 100.0) as u64;
            Ok(r.max(1_000))
        }
        _ => Err(format!(
            "bad host budget {s:?}: give a percentage of the host's CPU time, more than 0% and at \
             most 100% (e.g. 5% or 0.5%), or off"
        )),
    }
}

/// `CLOCK_MONOTONIC` in ns: one clock for every process of the host.
#[must_use]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the one we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    u64::try_from(ts.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or(0))
}

/// Whether process `pid` exists (of any user).
fn alive(pid: u64) -> bool {
    i32::try_from(pid).is_ok_and(memveil_sys::ipc::pid_alive)
}

/// The cap of a bucket filled at `rate` ns per second.
fn cap_of(rate: u64) -> i64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
    let c = (rate as f64 * CAP_SECONDS) as i64;
    c
}

/// The most debt of a bucket filled at `rate` ns per second (negative).
fn floor_of(rate: u64) -> i64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
    let d = (rate as f64 * DEBT_SECONDS) as i64;
    -d
}

/// Reinterprets a word as the signed token count.
#[allow(clippy::cast_possible_wrap)]
fn signed(w: u64) -> i64 {
    w as i64
}

/// A token count as a word.
#[allow(clippy::cast_sign_loss)]
fn word(t: i64) -> u64 {
    t as u64
}

/// Why a ledger cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// Opening, creating or sizing the file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        source: io::Error,
    },
    /// The file is not one memveil may trust to coordinate with.
    #[error("{0}")]
    Untrusted(String),
}

/// Opens the host's ledger at `path` for reading and writing, creating it
/// (mode 0644, with `rate` ns of CPU per second) when it does not exist.
/// The file must be a regular file owned by root or by this process's user
/// (another user could truncate it under the programs' mappings), and not
/// writable by others; a file whose layout is not a ledger's is rewritten
/// empty.
///
/// # Errors
/// What stops it, with the file named.
pub fn open_ledger(path: &Path, rate: u64) -> Result<File, LedgerError> {
    let io_err = |source| LedgerError::Io {
        path: path.display().to_string(),
        source,
    };
    let f = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_err)?;
    let m = f.metadata().map_err(io_err)?;
    // SAFETY: geteuid has no arguments and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !m.file_type().is_file() || (m.uid() != 0 && m.uid() != me) || m.mode() & 0o022 != 0 {
        return Err(LedgerError::Untrusted(format!(
            "{}: not a regular file owned by root (or uid {me}) that only its owner may write \
             (uid {}, mode {:o}): remove it, or let root's memveil run create it",
            path.display(),
            m.uid(),
            m.mode() & 0o7777
        )));
    }
    // One process initialises it; the others wait for the lock.
    // SAFETY: flock on a descriptor we own; no memory touched.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io_err(io::Error::last_os_error()));
    }
    // Its size read under the lock: one read before it may be from before
    // another run made the ledger, and writing it afresh then would wipe
    // the slots of the programs that joined it meanwhile.
    let mut head = [0u8; 8];
    let r = f.metadata().and_then(|m| {
        let fresh = m.len() < LEDGER_LEN as u64
            || f.read_exact_at(&mut head, 0).is_err()
            || u64::from_le_bytes(head) != MAGIC;
        if fresh {
            init(&f, m.len(), rate)
        } else {
            Ok(())
        }
    });
    // SAFETY: as above.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
    r.map_err(io_err)?;
    Ok(f)
}

/// Writes an empty ledger of `rate` ns per second into `f` (now `len`
/// bytes), in place: a file of a ledger's size is never shortened, so a
/// program that mapped it cannot fault on it.
fn init(f: &File, len: u64, rate: u64) -> io::Result<()> {
    if len < LEDGER_LEN as u64 {
        f.set_len(LEDGER_LEN as u64)?;
    }
    let now = monotonic_ns();
    let mut words = [0u64; W_SLOTS];
    words[W_RATE] = rate.min(max_rate());
    words[W_CPUS] = host_cpus();
    words[W_TOKENS] = word(cap_of(words[W_RATE]));
    words[W_LAST] = now;
    words[W_WIN_START] = now;
    // The header and every slot emptied (a file of the right size may hold
    // anything).
    let mut bytes = vec![0u8; LEDGER_LEN - 8];
    for (b, w) in bytes.chunks_exact_mut(8).zip(&words[1..]) {
        b.copy_from_slice(&w.to_le_bytes());
    }
    f.write_all_at(&bytes, 8)?;
    // The magic last: a reader never sees a half-written ledger as one.
    f.write_all_at(&MAGIC.to_le_bytes(), 0)?;
    Ok(())
}

/// What a ledger says, read once (by `memveil shield status` and the
/// exporter, through `read(2)`: a file truncated meanwhile cannot fault).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct LedgerView {
    /// The budget, ns of CPU per second (0: off).
    pub rate_ns_per_s: u64,
    /// The host's CPUs (this reader's count).
    pub cpus: u64,
    /// Tokens now, ns (negative: debt), clamped.
    pub tokens_ns: i64,
    /// The bucket's cap, ns.
    pub cap_ns: i64,
    /// What every shield drew since the ledger was made, ns.
    pub spent_ns: u64,
    /// What they drew over the last full window, per second of it (ns/s).
    pub spent_ns_per_s: u64,
    /// Processes holding a slot.
    pub slots_used: u64,
}

impl LedgerView {
    /// The budget as a share of the host's CPU time.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn budget_fraction(&self) -> f64 {
        self.rate_ns_per_s as f64 / (self.cpus.max(1) as f64 * 1e9)
    }

    /// The spend over the last window as a share of the host's CPU time.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn spent_fraction(&self) -> f64 {
        self.spent_ns_per_s as f64 / (self.cpus.max(1) as f64 * 1e9)
    }

    /// Parses a ledger's bytes, clamping every number.
    ///
    /// # Errors
    /// Too short, or not a ledger (the magic).
    pub fn parse(bytes: &[u8], now_ns: u64) -> Result<Self, String> {
        let w = |i: usize| -> u64 {
            bytes
                .get(i * 8..i * 8 + 8)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        if bytes.len() < WORDS * 8 {
            return Err(format!(
                "not a host ledger: {} bytes, {} expected",
                bytes.len(),
                LEDGER_LEN
            ));
        }
        if w(W_MAGIC) != MAGIC {
            return Err("not a host ledger (bad magic)".to_owned());
        }
        let rate = w(W_RATE).min(max_rate());
        let cap = cap_of(rate);
        // As the next refill would find them: the words hold the tokens
        // of the last draw, and a ledger no run has drawn on since (none
        // running) showed its old debt ("-26.6 ms left").
        let since = now_ns.saturating_sub(w(W_LAST)).min(10 * WINDOW_NS);
        #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
        let refill = (since as f64 * rate as f64 / 1e9) as i64;
        let tokens = signed(w(W_TOKENS))
            .clamp(floor_of(rate), cap)
            .saturating_add(refill)
            .clamp(floor_of(rate), cap);
        let last_len = w(W_LAST_WIN_NS);
        let win_start = w(W_WIN_START);
        // A window older than two is stale: nothing was drawn since.
        let stale = now_ns.saturating_sub(win_start) > 2 * WINDOW_NS;
        let spent_ns_per_s = if stale || !(WINDOW_NS / 2..=4 * WINDOW_NS).contains(&last_len) {
            0
        } else {
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss
            )]
            let r = (w(W_LAST_WIN_SPENT) as f64 * 1e9 / last_len as f64) as u64;
            r.min(max_rate())
        };
        let slots_used = (0..SLOTS)
            .filter(|k| w(W_SLOTS + k * SLOT_WORDS) != 0)
            .count();
        Ok(Self {
            rate_ns_per_s: rate,
            cpus: host_cpus(),
            tokens_ns: tokens,
            cap_ns: cap,
            spent_ns: w(W_SPENT),
            spent_ns_per_s,
            slots_used: u64::try_from(slots_used).unwrap_or(0),
        })
    }

    /// Reads the ledger at `path`.
    ///
    /// # Errors
    /// Reading it, or a file that is not a ledger.
    pub fn read(path: &Path) -> Result<Self, String> {
        let mut f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut bytes = vec![0u8; LEDGER_LEN];
        let n =
            io::Read::read(&mut f, &mut bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        bytes.truncate(n);
        Self::parse(&bytes, monotonic_ns()).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// Sets the budget of the ledger in `f` (`memveil shield budget PCT`),
/// ns of CPU per second (0: off); the tokens are clamped to the new cap.
///
/// # Errors
/// Writing the file.
pub fn set_rate(f: &File, rate: u64) -> io::Result<()> {
    let rate = rate.min(max_rate());
    f.write_all_at(&rate.to_le_bytes(), (W_RATE * 8) as u64)?;
    f.write_all_at(&host_cpus().to_le_bytes(), (W_CPUS * 8) as u64)?;
    let mut t = [0u8; 8];
    f.read_exact_at(&mut t, (W_TOKENS * 8) as u64)?;
    let tokens = signed(u64::from_le_bytes(t)).clamp(floor_of(rate), cap_of(rate));
    f.write_all_at(&word(tokens).to_le_bytes(), (W_TOKENS * 8) as u64)
}

/// A shared mapping of a ledger.
pub(crate) struct Ledger {
    ptr: *const AtomicU64,
}

// SAFETY: the mapping is only reached through atomics, and lives as long as
// the Ledger.
unsafe impl Send for Ledger {}
// SAFETY: as above.
unsafe impl Sync for Ledger {}

impl Ledger {
    /// Maps the ledger open on `fd` (inherited from `memveil run`).
    pub(crate) fn map(fd: BorrowedFd<'_>) -> io::Result<Self> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes one struct stat into the buffer we pass.
        if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fstat succeeded, so it filled the struct.
        let st = unsafe { st.assume_init() };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG
            || u64::try_from(st.st_size).unwrap_or(0) < LEDGER_LEN as u64
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a host ledger (not a regular file of its size)",
            ));
        }
        // SAFETY: a fresh shared mapping at an address of the kernel's
        // choosing: it overlaps no Rust object.
        let p = unsafe {
            uffd::mmap_direct(
                std::ptr::null_mut(),
                LEDGER_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let l = Self { ptr: p.cast() };
        if l.w(W_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a host ledger (bad magic)",
            ));
        }
        Ok(l)
    }

    fn w(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < WORDS);
        // SAFETY: `i < WORDS` (every caller indexes a constant or a slot
        // below SLOTS), so the word lies inside the LEDGER_LEN-byte,
        // page-aligned mapping, valid while self lives; any bit pattern is
        // a valid AtomicU64.
        unsafe { &*self.ptr.add(i.min(WORDS - 1)) }
    }

    /// The budget, ns per second (validated).
    pub(crate) fn rate(&self) -> u64 {
        self.w(W_RATE).load(Ordering::Relaxed).min(max_rate())
    }

    /// Adds the budget's share of the time since the last refill (whoever
    /// did it), clamped to the cap.
    fn refill(&self, now_ns: u64, rate: u64) {
        let last = self.w(W_LAST);
        let prev = last.load(Ordering::Acquire);
        // A stamp from the future (garbage, or another clock) restarts
        // the count from now, adding nothing.
        let from = if prev > now_ns { now_ns } else { prev };
        if last
            .compare_exchange(prev, now_ns, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            // Another process refilled meanwhile.
            return;
        }
        let dt = now_ns - from;
        #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
        let add = (dt.min(10 * WINDOW_NS) as f64 * rate as f64 / 1e9) as i64;
        self.add_tokens(add, rate);
    }

    /// Adds `d` tokens (negative: takes), keeping them within the bounds.
    fn add_tokens(&self, d: i64, rate: u64) {
        let (lo, hi) = (floor_of(rate), cap_of(rate));
        let _ = self
            .w(W_TOKENS)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(word(
                    signed(t).clamp(lo, hi).saturating_add(d).clamp(lo, hi),
                ))
            });
    }

    /// Tokens now (validated).
    fn tokens(&self, rate: u64) -> i64 {
        signed(self.w(W_TOKENS).load(Ordering::Acquire)).clamp(floor_of(rate), cap_of(rate))
    }

    /// Counts `ns` as spent, in total and in the spend window.
    fn spent(&self, ns: u64, now_ns: u64) {
        self.w(W_SPENT).fetch_add(ns, Ordering::Relaxed);
        let start = self.w(W_WIN_START).load(Ordering::Acquire);
        let due = now_ns >= start.saturating_add(WINDOW_NS) || start > now_ns;
        if due
            && self
                .w(W_WIN_START)
                .compare_exchange(start, now_ns, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            let s = self.w(W_WIN_SPENT).swap(0, Ordering::AcqRel);
            self.w(W_LAST_WIN_SPENT).store(s, Ordering::Relaxed);
            self.w(W_LAST_WIN_NS)
                .store(now_ns.saturating_sub(start), Ordering::Relaxed);
        }
        self.w(W_WIN_SPENT).fetch_add(ns, Ordering::Relaxed);
    }

    fn slot(&self, k: usize, field: usize) -> &AtomicU64 {
        self.w(W_SLOTS + k.min(SLOTS - 1) * SLOT_WORDS + field)
    }

    /// Takes a free slot (or one of a process that is gone) for `pid`.
    fn claim(&self, pid: u64, now_ms: u64) -> Option<usize> {
        (0..SLOTS).find(|&k| {
            let p = self.slot(k, 0);
            let held = p.load(Ordering::Acquire);
            if held == pid {
                return true;
            }
            let stamp = self.slot(k, 1).load(Ordering::Relaxed) & STAMP_MASK;
            // Free: never held, a bid not refreshed for long (a live
            // shield refreshes it every step, at least every 100 ms; a
            // stamp from the future is garbage), or a process gone.
            let free = held == 0
                || now_ms.saturating_sub(stamp) > SLOT_STALE_MS
                || stamp > now_ms.saturating_add(SLOT_STALE_MS)
                || !alive(held);
            if free
                && p.compare_exchange(held, pid, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                // Stamped now: a slot just taken is not stale.
                self.slot(k, 1).store(
                    (u64::from(NO_BID) << 56) | (now_ms & STAMP_MASK),
                    Ordering::Release,
                );
                self.slot(k, 2).store(0, Ordering::Relaxed);
                return true;
            }
            false
        })
    }

    /// The coldest live bid on the host (the lowest class bid within
    /// [`BID_MS`]), if any.
    fn coldest(&self, now_ms: u64) -> Option<u8> {
        (0..SLOTS)
            .filter(|&k| self.slot(k, 0).load(Ordering::Relaxed) != 0)
            .filter_map(|k| {
                let b = self.slot(k, 1).load(Ordering::Acquire);
                let stamp = b & STAMP_MASK;
                let class = u8::try_from(b >> 56).unwrap_or(NO_BID);
                (class <= crate::sweep::TOP + 1 && stamp <= now_ms && now_ms - stamp < BID_MS)
                    .then_some(class)
            })
            .min()
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `map`; nothing refers to it after
        // drop (the references handed out borrow self).
        let _ = unsafe { uffd::unmap_direct(self.ptr.cast_mut().cast(), LEDGER_LEN) };
    }
}

/// Why a shield holds its sweep back for the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// The host's bucket is empty: look again in this many ms.
    Spent(u64),
    /// The bucket is low and another program has colder pages due.
    Colder,
}

/// One shield's share of the host's ledger: its slot and what it has drawn.
pub(crate) struct HostShare {
    ledger: Ledger,
    pid: u64,
    slot: Option<usize>,
    /// The shield's cost already drawn from the host's bucket, ns.
    drawn: u64,
}

impl HostShare {
    /// Joins the ledger open on `fd`.
    pub(crate) fn join(fd: BorrowedFd<'_>) -> io::Result<Self> {
        let ledger = Ledger::map(fd)?;
        let pid = u64::from(std::process::id());
        let slot = ledger.claim(pid, monotonic_ns() / 1_000_000);
        Ok(Self {
            ledger,
            pid,
            slot,
            drawn: 0,
        })
    }

    /// Draws what the shield has cost since the last call (`cost_ns`: all
    /// of it so far) from the host's bucket, publishes its bid (`mine`: the
    /// coldest class it has due) and says whether it must hold its sweep
    /// back. `None` also when the host budget is off.
    pub(crate) fn step(&mut self, cost_ns: u64, mine: Option<u8>) -> Option<Hold> {
        let now_ns = monotonic_ns();
        let now_ms = now_ns / 1_000_000;
        let rate = self.ledger.rate();
        let delta = cost_ns.saturating_sub(self.drawn);
        self.drawn = self.drawn.max(cost_ns);
        // A pid taken over (a stale slot reclaimed by mistake) is claimed
        // again.
        if self
            .slot
            .is_none_or(|k| self.ledger.slot(k, 0).load(Ordering::Relaxed) != self.pid)
        {
            self.slot = self.ledger.claim(self.pid, now_ms);
        }
        if let Some(k) = self.slot {
            let class = mine.unwrap_or(NO_BID);
            self.ledger.slot(k, 1).store(
                (u64::from(class) << 56) | (now_ms & STAMP_MASK),
                Ordering::Release,
            );
            self.ledger.slot(k, 2).fetch_add(delta, Ordering::Relaxed);
        }
        if rate == 0 {
            return None;
        }
        self.ledger.refill(now_ns, rate);
        self.ledger.spent(delta, now_ns);
        #[allow(clippy::cast_possible_wrap)]
        self.ledger
            .add_tokens(-(delta.min(i64::MAX as u64) as i64), rate);
        let tokens = self.ledger.tokens(rate);
        if tokens <= 0 {
            // Until an eighth of the cap is back, 10-100 ms.
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss
            )]
            let ms = ((cap_of(rate) / 8 - tokens) as f64 / rate as f64 * 1e3) as u64;
            return Some(Hold::Spent(ms.clamp(10, 100)));
        }
        #[allow(clippy::cast_precision_loss)]
        let low = (tokens as f64) < cap_of(rate) as f64 * COLD_ONLY_BELOW;
        match (mine, self.ledger.coldest(now_ms)) {
            (Some(m), Some(c)) if low && m > c => Some(Hold::Colder),
            _ => None,
        }
    }

    /// Whether the host's bucket has room (or the host budget is off).
    pub(crate) fn open(&self) -> bool {
        let rate = self.ledger.rate();
        rate == 0 || self.ledger.tokens(rate) > 0
    }
}

impl Drop for HostShare {
    fn drop(&mut self) {
        if let Some(k) = self.slot {
            let _ = self.ledger.slot(k, 0).compare_exchange(
                self.pid,
                0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }
}

/// The coldest class of pages `sw` has due at `now_ms` (0: known quiet
/// pages, `1 + l`: level `l`) and how long its first page there has been
/// due (ms), from the heads of its queues (an entry there may be stale: a
/// bid is an estimate); a closed class ([`crate::sweep::Returns`]) bids
/// nothing.
pub(crate) fn coldest_due(sw: &Sweep, now_ms: u64) -> Option<(u8, u64)> {
    for heap in [&sw.long_quiet, &sw.quiet] {
        if let Some(std::cmp::Reverse((due, _, _))) = heap.peek() {
            if *due <= now_ms {
                return Some((0, now_ms - due));
            }
        }
    }
    (0u8..).zip(sw.queues.iter()).find_map(|(l, q)| {
        if sw.returns.closed(usize::from(l)) {
            // Its pages come straight back: passed over, not swept.
            return None;
        }
        let std::cmp::Reverse((at, _)) = q.peek()?;
        let due = at + sweep::period_ms(l);
        (due <= now_ms).then(|| (l + 1, now_ms - due))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd as _;

    fn ledger(rate: u64) -> (tempdir::Dir, File) {
        let d = tempdir::Dir::new();
        let f = open_ledger(&d.0.join("host"), rate).expect("ledger");
        (d, f)
    }

    mod tempdir {
        pub(super) struct Dir(pub(super) std::path::PathBuf);
        impl Dir {
            pub(super) fn new() -> Self {
                let p = std::env::temp_dir().join(format!(
                    "memveil-host-test-{}-{:?}",
                    std::process::id(),
                    std::thread::current().id()
                ));
                let _ = std::fs::remove_dir_all(&p);
                std::fs::create_dir_all(&p).expect("temp dir");
                Self(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn the_host_budget_parses_percentages_of_the_host_and_off() {
        let all = max_rate();
        assert_eq!(parse_host_budget("100%"), Ok(all));
        assert_eq!(parse_host_budget("off"), Ok(0));
        assert_eq!(parse_host_budget(" 5 "), Ok(all / 20));
        assert!(parse_host_budget("0.5%").is_ok_and(|r| r > 0 && r < all / 100));
        for bad in ["0", "0%", "101%", "x", "", "-1", "nan", "inf"] {
            assert!(parse_host_budget(bad).is_err(), "{bad:?} accepted");
        }
        assert!(default_rate() >= MIN_DEFAULT_NS_PER_S);
    }

    #[test]
    fn two_shares_draw_on_one_bucket_and_the_colder_bid_goes_first() {
        let (_d, f) = ledger(1_000_000_000);
        let mut a = HostShare::join(f.as_fd()).expect("a");
        let mut b = HostShare::join(f.as_fd()).expect("b");
        // One process here: both claim the same slot (one pid); give b its
        // own for the test.
        b.pid += 1_000_000;
        b.slot = b.ledger.claim(b.pid, monotonic_ns() / 1_000_000);
        assert_ne!(a.slot, b.slot);
        // Full: 250 ms of tokens. a spends 200 ms; both still free to sweep.
        assert_eq!(a.step(200_000_000, Some(3)), None);
        // b, with quiet pages due (class 0), bids colder; the bucket is
        // now below half its cap, so a (class 3) holds back.
        assert_eq!(b.step(0, Some(0)), None);
        assert_eq!(a.step(200_000_000, Some(3)), Some(Hold::Colder));
        // b spends the rest and more: both wait for the refill.
        assert!(matches!(b.step(300_000_000, Some(0)), Some(Hold::Spent(_))));
        assert!(matches!(a.step(200_000_000, Some(3)), Some(Hold::Spent(_))));
        assert!(!a.open());
        let v = LedgerView::read(&_d.0.join("host")).expect("view");
        assert_eq!(v.spent_ns, 500_000_000);
        assert!(v.tokens_ns < 0);
        assert!(v.slots_used >= 2);
    }

    /// Read system calls this thread has made so far (`/proc/thread-self/io`).
    fn reads_so_far() -> u64 {
        let io = std::fs::read_to_string("/proc/thread-self/io").expect("/proc/thread-self/io");
        io.lines()
            .find_map(|l| l.strip_prefix("syscr:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("syscr in /proc/thread-self/io")
    }

    #[test]
    fn a_sweep_steps_draw_on_the_host_reads_no_file() {
        let (_d, f) = ledger(1_000_000_000);
        let mut a = HostShare::join(f.as_fd()).expect("a");
        let _ = a.step(0, Some(1));
        // What reading the counter itself costs in reads.
        let (x, y) = (reads_so_far(), reads_so_far());
        let own = y - x;
        let before = reads_so_far();
        for k in 0..100u64 {
            let _ = a.step(k * 1_000, Some(1));
            let _ = a.open();
        }
        let steps = reads_so_far() - before;
        assert!(
            steps <= own,
            "100 sweep steps' draws on the host read {steps} times (reading the counter: {own})"
        );
    }

    #[test]
    fn garbage_in_the_ledger_is_clamped_never_trusted() {
        let (d, f) = ledger(100_000_000);
        let mut a = HostShare::join(f.as_fd()).expect("a");
        // Someone writes garbage over every word but the magic.
        let junk: Vec<u8> = (0..LEDGER_LEN - 8)
            .map(|i| u8::try_from((i * 37 + 11) % 251).unwrap_or(0) | 0x80)
            .collect();
        f.write_all_at(&junk, 8).expect("junk");
        for cost in [0, 1, u64::MAX / 2, u64::MAX] {
            let _ = a.step(cost, Some(2));
            let _ = a.step(cost, None);
        }
        let v = LedgerView::read(&d.0.join("host")).expect("view");
        assert!(v.rate_ns_per_s <= max_rate());
        assert!(v.tokens_ns <= v.cap_ns && v.tokens_ns >= floor_of(v.rate_ns_per_s));
        // All ones and all zeros.
        for fill in [0xffu8, 0] {
            f.write_all_at(&vec![fill; LEDGER_LEN - 8], 8)
                .expect("fill");
            let _ = a.step(u64::MAX, Some(200));
            let _ = LedgerView::read(&d.0.join("host")).expect("view");
        }
        // A wrong magic: the view says so, a new join refuses, and
        // opening it again rewrites it empty.
        f.write_all_at(&[0u8; 8], 0).expect("magic");
        assert!(LedgerView::read(&d.0.join("host")).is_err());
        assert!(HostShare::join(f.as_fd()).is_err());
        let g = open_ledger(&d.0.join("host"), 100_000_000).expect("reopen");
        assert!(HostShare::join(g.as_fd()).is_ok());
        // Short bytes never panic.
        assert!(LedgerView::parse(&[1, 2, 3], 0).is_err());
    }

    #[test]
    fn a_run_that_waited_for_the_lock_keeps_the_ledger_made_meanwhile() {
        use std::os::fd::AsRawFd as _;
        use std::os::unix::fs::MetadataExt as _;
        let d = tempdir::Dir::new();
        let p = d.0.join("host");
        // The first run: the file made, still empty, its lock held.
        let first = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&p)
            .expect("create");
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(unsafe { libc::flock(first.as_raw_fd(), libc::LOCK_EX) }, 0);
        let second = std::thread::spawn({
            let p = p.clone();
            move || open_ledger(&p, 100_000_000)
        });
        // The second run has read the file's size (0) and waits for the lock.
        let waiting = format!(":{} ", first.metadata().expect("stat").ino());
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !std::fs::read_to_string("/proc/locks")
            .expect("/proc/locks")
            .lines()
            .any(|l| l.contains("->") && l.contains(&waiting))
        {
            assert!(
                std::time::Instant::now() < until,
                "the second run never waited"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Meanwhile the first makes the ledger and its program joins it.
        init(&first, 0, 100_000_000).expect("init");
        let a = HostShare::join(first.as_fd()).expect("join");
        let k = a.slot.expect("a slot");
        // SAFETY: as above.
        assert_eq!(unsafe { libc::flock(first.as_raw_fd(), libc::LOCK_UN) }, 0);
        let f = second.join().expect("thread").expect("second run");
        assert_eq!(
            a.ledger.slot(k, 0).load(Ordering::Acquire),
            a.pid,
            "the second run wrote the ledger afresh under a joined program"
        );
        assert!(HostShare::join(f.as_fd()).is_ok());
    }

    #[test]
    fn a_ledger_others_may_write_is_refused() {
        let d = tempdir::Dir::new();
        let p = d.0.join("host");
        std::fs::write(&p, b"x").expect("file");
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .expect("chmod");
        let e = open_ledger(&p, 1).expect_err("refused");
        assert!(e.to_string().contains("only its owner may write"), "{e}");
        let l = d.0.join("link");
        std::os::unix::fs::symlink(&p, &l).expect("symlink");
        assert!(open_ledger(&l, 1).is_err(), "a symlink is not followed");
    }

    #[test]
    fn a_debt_left_by_the_last_run_is_refilled_in_the_view() {
        let (d, f) = ledger(100_000_000);
        let mut bytes = vec![0u8; LEDGER_LEN];
        f.read_exact_at(&mut bytes, 0).expect("read");
        let now = monotonic_ns();
        bytes[W_TOKENS * 8..W_TOKENS * 8 + 8].copy_from_slice(&word(-20_000_000).to_le_bytes());
        bytes[W_LAST * 8..W_LAST * 8 + 8].copy_from_slice(&now.to_le_bytes());
        let owed = LedgerView::parse(&bytes, now).expect("view");
        assert!(owed.tokens_ns < 0, "{}", owed.tokens_ns);
        // A second later, nothing drawn: the rate's second refilled it to the cap.
        let later = LedgerView::parse(&bytes, now + 1_000_000_000).expect("view");
        assert_eq!(later.tokens_ns, later.cap_ns);
        // Halfway there after 0.1 s: 10 ms of the 20 owed come back.
        let soon = LedgerView::parse(&bytes, now + 100_000_000).expect("view");
        assert_eq!(soon.tokens_ns, -10_000_000);
        drop(d);
    }

    #[test]
    fn the_budget_can_be_set_and_turned_off() {
        let (d, f) = ledger(100_000_000);
        set_rate(&f, 0).expect("off");
        let mut a = HostShare::join(f.as_fd()).expect("a");
        assert_eq!(a.step(10_000_000_000, Some(5)), None, "off: never holds");
        assert!(a.open());
        set_rate(&f, 1_000_000).expect("tiny");
        let v = LedgerView::read(&d.0.join("host")).expect("view");
        assert_eq!(v.rate_ns_per_s, 1_000_000);
        assert_eq!(v.cap_ns, 250_000);
    }
}
