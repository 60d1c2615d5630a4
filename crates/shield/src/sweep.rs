//! The cost budget: `memveil run`'s default guarantee (`--max-overhead`).
//!
//! A plaintext bound (`policy::Window`) keeps at most a fraction of the data
//! in plaintext, whatever it costs: a program whose working set exceeds it
//! faults on most accesses (0.05-0.2 of plain speed on this kind of VM). The
//! budget inverts the trade, as RamCrypt and TransCrypt do: the shield
//! spends at most a fraction of the program's time on faults and evictions,
//! and within it encrypts every page that has been idle longer than its
//! sweep period.
//!
//! Nothing tells user space which resident pages are in use here (no
//! accessed-bit interface: no idle page tracking, no multi-gen LRU, no
//! soft-dirty, no DAMON for virtual addresses). A page's use is learnt the
//! only way left: it is swept (evicted) once it has been resident for its
//! period, and a page that faults back sooner than that period was in use,
//! so its period doubles ([`relevel`]); one that stays out [`QUIET_MS`] or
//! more goes back to the shortest and is known quiet: each time it comes
//! back it leaves again [`QUICK_MS`] later. Periods run from
//! [`BASE_PERIOD_MS`] (25 ms) to `BASE_PERIOD_MS << (LEVELS - 1)` (12.8 s).
//! A secret the program reads every 100 ms or more rarely is therefore
//! plaintext a few ms per read; a hot page climbs to the longest period
//! and costs one fault every 12.8 s. Blocks of [`HINT_PAGES`] pages
//! learn from one probe page, so a hot array pays one fault per block and
//! level rather than one per page. A level whose swept pages come back
//! within [`PENDING_MS`] three times in four is closed ([`Returns`]): its
//! due pages take the next period without a fault (at the top level, one
//! more period once: [`pass_over_to`]).
//!
//! [`Credit`] is the budget itself, a token bucket in nanoseconds of the
//! program's time: it fills at the budget's rate and empties by what faults
//! and sweeps measurably cost (handler time, plus a hand-off of
//! [`Budget::fault_ns`] per fault). A sweep also reserves the cost of the
//! fault its page would take coming back ([`Pending`]) until the page has
//! stayed out [`PENDING_MS`], so a sweep of pages that are in use cannot
//! overdraw it. When the budget is spent, due pages wait, cheapest levels
//! first, and the wait is reported (`sweep_lag_ms`); only pages back after
//! a long rest ([`LONG_QUIET_MS`]) still leave, a few at a time
//! ([`DEBT_PAGES`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::queue::Queue;

/// Periods: level `l` sweeps a page `BASE_PERIOD_MS << l` ms after it
/// came in.
pub(crate) const LEVELS: usize = 10;
/// The highest level.
#[allow(clippy::cast_possible_truncation)]
pub(crate) const TOP: u8 = LEVELS as u8 - 1;
/// The shortest sweep period, in ms.
pub(crate) const BASE_PERIOD_MS: u64 = 25;
/// How long a chunk of a lazily registered range holds data before it is
/// registered (its pages then are swept at once if their period is over):
/// memory an allocator hands out and takes back within that time never
/// costs a hand-off.
pub(crate) const REGISTER_AFTER_MS: u64 = 100;
/// How long a swept page's fault cost stays reserved ([`Pending`]): pages
/// of a program that touches all its data came back 130 ms after their
/// sweep on average (python3 in the suite), and a cost that arrives after
/// its reservation ended overdraws the budget.
pub(crate) const PENDING_MS: u64 = 400;
/// Width of one [`Pending`] bucket, in ms.
const BUCKET_MS: u64 = 10;
/// Buckets kept: more than [`PENDING_MS`] worth.
const BUCKETS: usize = 48;
/// Most nanoseconds of credit the bucket keeps, per unit of budget fraction
/// (a quarter of a second's worth of budget): an idle program cannot bank a
/// burst larger than that.
const CAP_NS_PER_FRACTION: f64 = 0.25e9;

/// Pages of a block that shares what its pages learn: pages touched
/// together tend to sit together (a hash table, an arena, a buffer). When a
/// block's pages fall due at a level and nothing fresh is known of the block
/// at that level, one page (its probe) is swept first and the others wait
/// one period of the level; if the probe comes back sooner, they take its
/// new level without each paying a fault to learn it, and otherwise they
/// are swept too. A page that has been swept itself (learned) follows its
/// own level.
pub(crate) const HINT_PAGES: usize = 64;
/// How many of its periods a block's probe must stay out before the block
/// is taken as idle at that level (a program that faults often runs slower,
/// and its hot pages come back later than they would plainly); a probe
/// back within that time raises the block's hint. The wait is at most
/// the longest period ([`probe_out_ms`]).
pub(crate) const PROBE_WAIT: u64 = 4;

/// Bits of the tick (ms) in a page's time word; above it the "struck"
/// bit, the "learned" bit, then the level.
const TICK_BITS: u32 = 26;
const TICK_MASK: u32 = (1 << TICK_BITS) - 1;
/// The page, known quiet, came back within [`QUIET_MS`] of its quick sweep
/// once (a read preempted halfway, or the start of a burst): it kept the
/// quiet class, and a second such return in a row ends it. Staying out
/// [`QUIET_MS`] or more clears it.
const STRUCK: u32 = 1 << TICK_BITS;
/// The page is known quiet (once swept, it stayed out [`QUIET_MS`] or
/// more): it follows its own level, not its block's hint.
const LEARNED: u32 = 1 << (TICK_BITS + 1);
const LEVEL_SHIFT: u32 = TICK_BITS + 2;

/// The sweep period of `level`, in ms.
pub(crate) fn period_ms(level: u8) -> u64 {
    BASE_PERIOD_MS << level.min(TOP)
}

/// A page that stays out this long (ms) once swept is cheap to sweep at the
/// shortest period: at most one fault per this long.
pub(crate) const QUIET_MS: u64 = 50;

/// How soon a page known quiet is swept again once it comes back, in ms:
/// what brought it back (a read of a key, a request touching a record) is
/// over within this, and two more faults per quiet spell are all it can
/// cost when it is not (the second chance of [`STRUCK`], then [`relevel`]
/// takes it out of the quiet pages). With
/// the shortest period instead, a secret read every 100 ms stayed
/// plaintext a quarter of the time (`shield.canary_100ms_encrypted_fraction`
/// 0.74), one read every second 2-3%.
pub(crate) const QUICK_MS: u64 = 2;

/// A page known quiet that stayed out this long (ms) before it came back
/// is *long quiet*: the coldest page there is (a secret written after
/// seconds of rest, a record read once by a request), swept before every
/// other page, and even while the budget is spent ([`DEBT_PAGES`]).
/// Queued behind the other quiet pages by due time alone, the Go canary's
/// secret, back after 5 s, waited for thousands of its hot pages that had
/// gone quiet while the program was slowed by their faults (each back
/// 50-500 ms after its sweep), and stayed plaintext the whole 10 s of a
/// bench round in two of six runs.
pub(crate) const LONG_QUIET_MS: u64 = 1_000;

/// Long quiet pages ([`LONG_QUIET_MS`]) swept per [`DEBT_WINDOW_MS`] while
/// the budget (the program's or the host's) is spent: each costs its
/// eviction now (a few µs) and, cold as it is, seldom the fault back; both
/// are counted like any other cost, so the debt they add is paid back the
/// same way. Without it a spent budget held them all back: a hot set swept
/// while the program was still starting (its blocks' probes out four
/// periods) came back at once, 15,000 faults, 570 ms of debt, and nothing
/// left the Go canary for 8.5 s, its secret written meanwhile included.
pub(crate) const DEBT_PAGES: u32 = 16;
/// The window of [`DEBT_PAGES`], ms (at most 160 pages a second).
pub(crate) const DEBT_WINDOW_MS: u64 = 100;

/// Share of a sweep's fault cost reserved for a page known quiet before
/// its quick sweeps have a history ([`Sweep::quiet_share`]), and the least
/// after: a quiet page comes back twice per quiet spell at most ([`STRUCK`]).
pub(crate) const QUIET_BACK_FLOOR: f64 = 0.05;

/// When a page that came in at `at_ms` at `level` is due: [`QUICK_MS`]
/// after it for a page known quiet (`quiet`) at the shortest level, its
/// level's period otherwise.
pub(crate) fn due_ms(at_ms: u64, level: u8, quiet: bool) -> u64 {
    at_ms
        + if quiet && level == 0 {
            QUICK_MS
        } else {
            period_ms(level)
        }
}

/// The level of a page that was swept at `level` and came back `away_ms`
/// later: the shortest period when it stayed out [`QUIET_MS`] or more
/// (sweeping it costs at most a fault per that long, whatever its period,
/// and the shortest period leaves it plaintext least), one up when it came
/// back sooner than its period (it is in use: the sweep bought nothing but
/// a fault), the same otherwise.
pub(crate) fn relevel(level: u8, away_ms: u64) -> u8 {
    if away_ms >= QUIET_MS {
        0
    } else if away_ms < period_ms(level) {
        (level + 1).min(TOP)
    } else {
        level
    }
}

/// A page's time word: the ms tick of its last arrival (resident) or sweep
/// (evicted), 26 bits wrapping (18 hours: only equality and short
/// differences are read), whether its quiet class had its second chance
/// (struck), whether it is known quiet (learned), and its level.
pub(crate) fn pack(now_ms: u64, level: u8) -> u32 {
    // The tick is cut to 26 bits on purpose (it wraps).
    #[allow(clippy::cast_possible_truncation)]
    let t = (now_ms as u32) & TICK_MASK;
    pack_tick(t, level)
}

/// A time word with tick `t` (a time word's tick) and `level`, not learned.
pub(crate) fn pack_tick(t: u32, level: u8) -> u32 {
    (t & TICK_MASK) | (u32::from(level.min(TOP)) << LEVEL_SHIFT)
}

/// `word` with its tick set to `now_ms`, level, learned and struck bits
/// kept.
pub(crate) fn restamp(word: u32, now_ms: u64) -> u32 {
    pack(now_ms, level_of(word)) | (word & (LEARNED | STRUCK))
}

/// `word` with its tick set to `t` (a tick) and its level to `level`, the
/// learned and struck bits kept.
pub(crate) fn retick(word: u32, t: u32, level: u8) -> u32 {
    pack_tick(t, level) | (word & (LEARNED | STRUCK))
}

/// `word` marked struck (see [`STRUCK`]).
pub(crate) fn struck(word: u32) -> u32 {
    word | STRUCK
}

/// Whether `word`'s quiet class had its second chance ([`STRUCK`]).
pub(crate) fn is_struck(word: u32) -> bool {
    word & STRUCK != 0
}

/// `word` marked learned (its level is the page's own).
pub(crate) fn learned(word: u32) -> u32 {
    word | LEARNED
}

/// Whether `word`'s level is the page's own.
pub(crate) fn is_learned(word: u32) -> bool {
    word & LEARNED != 0
}

/// The tick part of a time word.
pub(crate) fn tick_of(word: u32) -> u32 {
    word & TICK_MASK
}

/// The level part of a time word.
pub(crate) fn level_of(word: u32) -> u8 {
    // Four bits.
    #[allow(clippy::cast_possible_truncation)]
    let l = (word >> LEVEL_SHIFT) as u8;
    l.min(TOP)
}

/// Milliseconds from tick `t` (a time word's) to `now_ms`.
pub(crate) fn since(now_ms: u64, t: u32) -> u64 {
    #[allow(clippy::cast_possible_truncation)]
    let now = (now_ms as u32) & TICK_MASK;
    u64::from(now.wrapping_sub(t) & TICK_MASK)
}

/// The cost budget of a shield.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// Largest share of the program's time faults and sweeps may take
    /// (0.10 for 10%).
    pub fraction: f64,
    /// What one fault's hand-off costs the program beyond the handler's own
    /// work (entering the kernel, the two thread switches, the wake-ups), in
    /// ns: `memveil run` measures it at start; without that,
    /// [`Budget::DEFAULT_FAULT_NS`].
    pub fault_ns: u64,
}

impl Budget {
    /// `memveil run`'s default: 10% of the program's time.
    pub const DEFAULT_PERCENT: u8 = 10;
    /// A hand-off when none was measured: this 2-vCPU VM's floor was
    /// 5.6-11 µs (`shield.fault_floor_us`).
    pub const DEFAULT_FAULT_NS: u64 = 8_000;

    /// A budget of `percent` of the program's time (1-100).
    #[must_use]
    pub fn percent(percent: u8, fault_ns: u64) -> Self {
        Self {
            fraction: f64::from(percent.clamp(1, 100)) / 100.0,
            fault_ns,
        }
    }

    /// Parses `10%` or `10` (a percentage of the program's time, 1-100).
    ///
    /// # Errors
    /// A message naming the accepted form.
    pub fn parse_percent(s: &str) -> Result<u8, String> {
        let t = s.trim();
        let t = t.strip_suffix('%').unwrap_or(t).trim();
        match t.parse::<u8>() {
            Ok(p) if (1..=100).contains(&p) => Ok(p),
            _ => Err(format!(
                "bad overhead budget {s:?}: give a percentage of the program's time, 1%-100% \
                 (e.g. 10%)"
            )),
        }
    }

    /// The budget as a whole percentage.
    #[must_use]
    pub fn as_percent(&self) -> u8 {
        // 1-100 by construction.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let p = (self.fraction * 100.0).round() as u8;
        p
    }
}

/// The budget's token bucket, in ns of the program's time.
#[derive(Debug)]
pub(crate) struct Credit {
    fraction: f64,
    tokens: f64,
    cap: f64,
    last_ms: u64,
    last_cost: u64,
}

impl Credit {
    pub(crate) fn new(fraction: f64, now_ms: u64) -> Self {
        Self {
            fraction,
            // Empty at start: what the shield may cost by any moment of a
            // run is its share of the time so far, so a short run keeps
            // to its budget too (full, a quarter second's worth let a
            // 0.5 s run cost 15% at 10%).
            tokens: 0.0,
            cap: fraction * CAP_NS_PER_FRACTION,
            last_ms: now_ms,
            last_cost: 0,
        }
    }

    /// Adds the budget's share of the time since the last call and takes
    /// away what was spent meanwhile (`cost_ns`: everything spent so far).
    #[allow(clippy::cast_precision_loss)]
    pub(crate) fn refill(&mut self, now_ms: u64, cost_ns: u64) {
        let dt = now_ms.saturating_sub(self.last_ms) as f64 * 1e6;
        let spent = cost_ns.saturating_sub(self.last_cost) as f64;
        self.tokens = (self.tokens + dt * self.fraction - spent).min(self.cap);
        self.last_ms = now_ms;
        self.last_cost = self.last_cost.max(cost_ns);
    }

    /// Tokens left once `reserved_ns` is set aside (negative: in debt).
    pub(crate) fn room(&self, reserved_ns: f64) -> f64 {
        self.tokens - reserved_ns
    }
}

/// Swept pages whose fault back is still reserved against the budget: per
/// [`BUCKET_MS`] of sweep time, how many were swept and how many of those
/// came back since.
#[derive(Debug)]
pub(crate) struct Pending {
    id: [u64; BUCKETS],
    swept: [u32; BUCKETS],
    back: [u32; BUCKETS],
    /// What the sweeps of the bucket reserved, ns.
    cost: [f64; BUCKETS],
}

impl Default for Pending {
    fn default() -> Self {
        Self {
            id: [0; BUCKETS],
            swept: [0; BUCKETS],
            back: [0; BUCKETS],
            cost: [0.0; BUCKETS],
        }
    }
}

impl Pending {
    fn slot(&mut self, t_ms: u64) -> Option<usize> {
        let id = t_ms / BUCKET_MS + 1;
        // usize: BUCKETS is small.
        #[allow(clippy::cast_possible_truncation)]
        let k = (id % BUCKETS as u64) as usize;
        if self.id[k] != id {
            if self.id[k] > id {
                return None;
            }
            self.id[k] = id;
            self.swept[k] = 0;
            self.back[k] = 0;
            self.cost[k] = 0.0;
        }
        Some(k)
    }

    /// `n` pages were swept at `now_ms`, reserving `cost` ns in all.
    pub(crate) fn swept(&mut self, now_ms: u64, n: usize, cost: f64) {
        if let Some(k) = self.slot(now_ms) {
            self.swept[k] = self.swept[k].saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
            self.cost[k] += cost;
        }
    }

    /// A page swept at `at_ms` came back at `now_ms`: its reservation ends
    /// (its fault is counted as spent).
    pub(crate) fn back(&mut self, at_ms: u64, now_ms: u64) {
        if now_ms.saturating_sub(at_ms) >= PENDING_MS {
            return;
        }
        let id = at_ms / BUCKET_MS + 1;
        #[allow(clippy::cast_possible_truncation)]
        let k = (id % BUCKETS as u64) as usize;
        if self.id[k] == id && self.back[k] < self.swept[k] {
            self.back[k] += 1;
        }
    }

    fn live(&self, k: usize, now_ms: u64) -> bool {
        self.id[k] != 0 && now_ms.saturating_sub((self.id[k] - 1) * BUCKET_MS) < PENDING_MS
    }

    /// Pages swept less than [`PENDING_MS`] before `now_ms` that have not
    /// come back.
    #[cfg(test)]
    pub(crate) fn pages(&self, now_ms: u64) -> u64 {
        (0..BUCKETS)
            .filter(|&k| self.live(k, now_ms))
            .map(|k| u64::from(self.swept[k] - self.back[k]))
            .sum()
    }

    /// What those pages still hold reserved, ns (each bucket's reservation
    /// in proportion to its pages not back).
    #[allow(clippy::cast_precision_loss)]
    pub(crate) fn reserved(&self, now_ms: u64) -> f64 {
        (0..BUCKETS)
            .filter(|&k| self.live(k, now_ms) && self.swept[k] > 0)
            .map(|k| {
                self.cost[k] * f64::from(self.swept[k] - self.back[k]) / f64::from(self.swept[k])
            })
            .sum()
    }
}

/// Sweep classes: one per level, then the pages known quiet
/// ([`QUIET_CLASS`]).
pub(crate) const CLASSES: usize = LEVELS + 1;
/// The class of the pages known quiet.
pub(crate) const QUIET_CLASS: usize = LEVELS;
/// A class whose swept pages come back within [`class_horizon_ms`] at
/// least this share of the time is closed: the sweep buys a fault and next
/// to no ciphertext there (churn in the suite: every page swept at 25 ms
/// came back, 66 ms later on average).
pub(crate) const CLOSE_SHARE: f64 = 0.75;
/// Settled sweeps of a class before its share decides anything.
pub(crate) const CLASS_MIN: u32 = 16;
/// Sweeps this old (ms) count towards their class's share with what came
/// back of them so far (four of the shortest periods).
pub(crate) const MATURE_MS: u64 = 4 * BASE_PERIOD_MS;
/// Settled sweeps at which a class's counts are halved (its share follows
/// the program's recent use).
const CLASS_WINDOW: u32 = 256;
/// One due page in this many of a closed class is swept anyway: its probe,
/// which keeps the share current, so the class opens again when the
/// program's use changes.
pub(crate) const CLOSED_PROBE_EVERY: u32 = 8;

/// How soon a page swept in `class` must come back for its sweep to count
/// as bought back: [`PENDING_MS`] for a level (a sweep reserves its fault
/// that long), [`QUIET_MS`] for the pages known quiet (a quiet page is
/// plaintext [`QUICK_MS`] a return: one back after 100 ms was ciphertext
/// 98% of the time, which is what its quick sweep is for).
pub(crate) fn class_horizon_ms(class: usize) -> u64 {
    if class == QUIET_CLASS {
        QUIET_MS
    } else {
        PENDING_MS
    }
}

/// The class a page whose time word is `word` was swept in.
pub(crate) fn class_of(word: u32) -> usize {
    if is_learned(word) && level_of(word) == 0 {
        QUIET_CLASS
    } else {
        usize::from(level_of(word))
    }
}

/// Per class, what its sweeps bought: sweeps whose horizon has passed
/// (settled), and how many of them came back within it; and, per
/// [`BUCKET_MS`] of sweep time not yet settled, the sweeps and returns.
/// Far memory (Google, ASPLOS 2019) picks per job the smallest cold age
/// whose promotion rate stays under a target; here a level (a cold age)
/// whose pages come straight back is skipped for the next one.
#[derive(Debug)]
pub(crate) struct Returns {
    /// Settled sweeps and returns per class (halved at [`CLASS_WINDOW`]).
    settled: [u32; CLASSES],
    back: [u32; CLASSES],
    /// Due pages of a closed class passed over, per class (every
    /// [`CLOSED_PROBE_EVERY`]th is swept).
    pub(crate) skipped: [u32; CLASSES],
    /// The classes closed at the last [`Returns::settle`].
    closed: [bool; CLASSES],
    id: [u64; BUCKETS],
    open_swept: [[u32; CLASSES]; BUCKETS],
    open_back: [[u32; CLASSES]; BUCKETS],
}

impl Default for Returns {
    fn default() -> Self {
        Self {
            settled: [0; CLASSES],
            back: [0; CLASSES],
            skipped: [0; CLASSES],
            closed: [false; CLASSES],
            id: [0; BUCKETS],
            open_swept: [[0; CLASSES]; BUCKETS],
            open_back: [[0; CLASSES]; BUCKETS],
        }
    }
}

impl Returns {
    fn bucket(t_ms: u64) -> (u64, usize) {
        let id = t_ms / BUCKET_MS + 1;
        // usize: BUCKETS is small.
        #[allow(clippy::cast_possible_truncation)]
        let k = (id % BUCKETS as u64) as usize;
        (id, k)
    }

    /// Settles bucket `k` into the per-class counts and empties it.
    fn settle_bucket(&mut self, k: usize) {
        for c in 0..CLASSES {
            let (n, b) = (self.open_swept[k][c], self.open_back[k][c]);
            if n == 0 {
                continue;
            }
            self.settled[c] = self.settled[c].saturating_add(n);
            self.back[c] = self.back[c].saturating_add(b.min(n));
            if self.settled[c] >= CLASS_WINDOW {
                self.settled[c] /= 2;
                self.back[c] /= 2;
            }
        }
        self.open_swept[k] = [0; CLASSES];
        self.open_back[k] = [0; CLASSES];
        self.id[k] = 0;
    }

    /// Settles every bucket whose sweeps are [`PENDING_MS`] old at
    /// `now_ms` (their returns are in), and decides which classes are
    /// closed: from the settled sweeps and those at least [`MATURE_MS`]
    /// old (what came back of these so far: a lower bound, so a class
    /// closes no sooner than its returns show), which a run of the
    /// suite's length (0.3-0.5 s) needs.
    #[allow(clippy::cast_precision_loss)]
    pub(crate) fn settle(&mut self, now_ms: u64) {
        let mut swept = [0u32; CLASSES];
        let mut back = [0u32; CLASSES];
        for k in 0..BUCKETS {
            let id = self.id[k];
            if id == 0 {
                continue;
            }
            let age = now_ms.saturating_sub((id - 1) * BUCKET_MS);
            if age >= PENDING_MS + BUCKET_MS {
                self.settle_bucket(k);
            } else if age >= MATURE_MS + BUCKET_MS {
                for c in 0..CLASSES {
                    swept[c] = swept[c].saturating_add(self.open_swept[k][c]);
                    back[c] =
                        back[c].saturating_add(self.open_back[k][c].min(self.open_swept[k][c]));
                }
            }
        }
        for c in 0..CLASSES {
            let n = self.settled[c].saturating_add(swept[c]);
            let b = self.back[c].saturating_add(back[c]);
            // The quiet pages' class is measured, never closed: a quiet page
            // back within QUIET_MS leaves the class itself (`relevel`), and
            // closing it for the others' returns took the quick sweep from
            // a secret read every 100 ms too (the canary's hot pages, slowed
            // by their faults, went quiet and came straight back).
            self.closed[c] =
                c != QUIET_CLASS && n >= CLASS_MIN && f64::from(b) >= CLOSE_SHARE * f64::from(n);
        }
    }

    /// A page of `class` was swept at `now_ms`.
    pub(crate) fn swept(&mut self, class: usize, now_ms: u64) {
        let (id, k) = Self::bucket(now_ms);
        if self.id[k] != id {
            if self.id[k] > id {
                return;
            }
            if self.id[k] != 0 {
                self.settle_bucket(k);
            }
            self.id[k] = id;
        }
        let n = &mut self.open_swept[k][class.min(CLASSES - 1)];
        *n = n.saturating_add(1);
    }

    /// A page of `class` swept at `at_ms` came back at `now_ms`.
    pub(crate) fn back(&mut self, class: usize, at_ms: u64, now_ms: u64) {
        let class = class.min(CLASSES - 1);
        if now_ms.saturating_sub(at_ms) >= class_horizon_ms(class) {
            return;
        }
        let (id, k) = Self::bucket(at_ms);
        if self.id[k] == id {
            let b = &mut self.open_back[k][class];
            *b = b.saturating_add(1);
        }
    }

    /// The share of `class`'s settled sweeps that came back within its
    /// horizon (`None`: fewer than [`CLASS_MIN`] settled).
    #[cfg(test)]
    pub(crate) fn share_of(&self, class: usize) -> Option<f64> {
        let n = self.settled[class];
        (n >= CLASS_MIN).then(|| f64::from(self.back[class]) / f64::from(n))
    }

    /// Whether `class` is closed: its swept pages come back within its
    /// horizon [`CLOSE_SHARE`] of the time or more (as of the last
    /// [`Returns::settle`]).
    pub(crate) fn closed(&self, class: usize) -> bool {
        self.closed[class.min(CLASSES - 1)]
    }

    /// Whether the next due page of closed `class` is passed over (not
    /// swept): all but one in [`CLOSED_PROBE_EVERY`].
    pub(crate) fn pass_over(&mut self, class: usize) -> bool {
        let n = &mut self.skipped[class.min(CLASSES - 1)];
        *n = n.wrapping_add(1);
        !n.is_multiple_of(CLOSED_PROBE_EVERY)
    }
}

/// Where a due page that closed `level` passes over waits next (its
/// arrival and level, for the queue and its time word), and whether it may
/// be passed over again. Below the top level it takes the next period from
/// the same arrival, as a block's hint would raise it. At the top level it
/// waits that period once more from `now_ms` and is then swept whatever
/// its level's other pages do (`false`: its came-back mark is cleared), so
/// a page left alone is ciphertext at most two top periods after it
/// reached the top level. Passed over again and again (7 times in
/// [`CLOSED_PROBE_EVERY`]), an idle etcd's raft entries stayed plaintext
/// for over 30 s of idleness, pages it had used hard during its workload.
pub(crate) fn pass_over_to(at_ms: u64, level: u8, now_ms: u64) -> (u64, u8, bool) {
    if level < TOP {
        (at_ms, level + 1, true)
    } else {
        (now_ms, TOP, false)
    }
}

/// How long a block's probe swept at `probe_level` must stay out before
/// it vouches for its block ([`PROBE_WAIT`] of its periods), at most the
/// longest period: at the top level four periods held the pages behind an
/// idle etcd's probe plaintext 51 s past their own due time.
pub(crate) fn probe_out_ms(probe_level: u8) -> u64 {
    (PROBE_WAIT * period_ms(probe_level)).min(period_ms(TOP))
}

/// Pages known quiet by when they are due: `(due, address, arrival)`.
pub(crate) type QuietHeap = BinaryHeap<Reverse<(u64, usize, u64)>>;

/// Quick sweeps of known quiet pages a second that neither the budget's
/// debt nor the host's hold stops ([`QuickFloor`]).
pub(crate) const QUICK_FLOOR_PER_S: f64 = 32.0;
/// Most of them taken at once (the bucket's size), [`QUICK_FLOOR_KEPT`]
/// of them kept for pages whose last quick sweep held.
const QUICK_FLOOR_BURST: f64 = 10.0;
/// Of the floor's bucket, this many quick sweeps are kept for pages whose
/// last quick sweep held (they stayed out [`QUIET_MS`] or more after it: a
/// secret read every 100 ms or every second); the other quiet pages take
/// the rest (8 at once, [`QUICK_FLOOR_PER_S`] a second, as before).
const QUICK_FLOOR_KEPT: f64 = 2.0;
/// Quiet pages' latest arrivals the floor looks at.
const QUICK_FLOOR_RECENT: usize = 64;

/// The quick sweeps' floor: a page known quiet (a secret read every 100 ms)
/// leaves [`QUICK_MS`] after it came back even when the budget is spent or
/// the host holds the sweep, up to [`QUICK_FLOOR_PER_S`] pages a second. On
/// a saturated host (busy loops beside the 100 ms canary on 2 vCPUs) each
/// fault waited milliseconds for a CPU, which the cost counts; the budget
/// went into debt, or the host held the sweep, and the secret's quick sweep
/// waited with every other. The floor costs at most that many faults a
/// second (under 1 ms of CPU), and what they cost is counted in the cost
/// as any fault's is. It looks at the latest [`QUICK_FLOOR_RECENT`]
/// arrivals only: quiet pages piled up while the budget was spent wait for
/// the budget, and a page that just came back is not queued behind them.
///
/// Among those, a page whose last quick sweep held (it stayed out
/// [`QUIET_MS`] or more after it; its rank is how long) goes first, the
/// longest out first, and [`QUICK_FLOOR_KEPT`] of the bucket are kept for
/// such pages; the others go oldest first. Oldest first alone, the 1 s
/// canary's secret (out ~990 ms after each quick sweep) was pushed out of
/// the latest arrivals, or found the bucket empty, by hot pages learned
/// quiet in a stall of the program (1,000-3,000 quick sweeps in 10 s, all
/// back within the pass), and stayed plaintext 0.15-1.3 s a read while the
/// budget was spent or the host held the sweep (`examples/exposure 1000`
/// 0.50-0.93 in about one run in six, 2026-11-28).
#[derive(Debug)]
pub(crate) struct QuickFloor {
    tokens: f64,
    last_ms: u64,
    /// `(due, address, arrival, rank)` of the latest quiet arrivals, oldest
    /// first; rank: ms out after a quick sweep that held, 0 otherwise.
    pub(crate) recent: VecDeque<(u64, usize, u64, u64)>,
}

impl QuickFloor {
    fn new(now_ms: u64) -> Self {
        Self {
            tokens: QUICK_FLOOR_BURST,
            last_ms: now_ms,
            recent: VecDeque::with_capacity(QUICK_FLOOR_RECENT),
        }
    }

    /// Notes a quiet page's arrival, of `rank` (see [`QuickFloor::recent`]).
    /// When the floor looks at as many as it may, the oldest of the lowest
    /// rank falls out (the new one itself when its rank is lower still).
    fn note(&mut self, due: u64, addr: usize, at_ms: u64, rank: u64) {
        if self.recent.len() == QUICK_FLOOR_RECENT {
            let low = self
                .recent
                .iter()
                .enumerate()
                .min_by_key(|&(k, e)| (e.3, k))
                .map(|(k, e)| (k, e.3));
            match low {
                Some((_, r)) if r > rank => return,
                Some((k, _)) => {
                    self.recent.remove(k);
                }
                None => {}
            }
        }
        self.recent.push_back((due, addr, at_ms, rank));
    }

    /// The entry the floor takes next among those due by `now_ms`: the
    /// highest rank, the oldest among equals.
    pub(crate) fn next(&self, now_ms: u64) -> Option<usize> {
        self.recent
            .iter()
            .enumerate()
            .filter(|(_, e)| e.0 <= now_ms)
            .min_by_key(|&(k, e)| (Reverse(e.3), k))
            .map(|(k, _)| k)
    }

    /// Adds the floor's share of the time since the last call.
    #[allow(clippy::cast_precision_loss)]
    pub(crate) fn refill(&mut self, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.last_ms) as f64 / 1e3;
        self.tokens = (self.tokens + dt * QUICK_FLOOR_PER_S).min(QUICK_FLOOR_BURST);
        self.last_ms = self.last_ms.max(now_ms);
    }

    /// Takes one quick sweep from the floor, if one is left for a page of
    /// `rank` (the last [`QUICK_FLOOR_KEPT`] only for a rank above 0).
    pub(crate) fn take(&mut self, rank: u64) -> bool {
        let keep = if rank > 0 { 0.0 } else { QUICK_FLOOR_KEPT };
        if self.tokens < 1.0 + keep {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

/// The least share of a page's wall time out that [`HeldLog::ran_ms`]
/// counts as the program's: a page out 75 ms or more ([`QUIET_MS`] × 3/2)
/// stays quiet whatever held the program meanwhile. A secret read every
/// 100 ms beside busy loops was out 100 ms of which the program's own
/// faults and its waits for a CPU after them could take half, and it must
/// stay quiet (its quick sweep is what keeps it ciphertext); the hot pages
/// of a pass slowed into 50-75 ms by faults are what the hold is taken
/// off for.
const RAN_FLOOR: (u64, u64) = (2, 3);
/// Width of one [`HeldLog`] slot, ms.
const HELD_GRANULE_MS: u64 = 4;
/// [`HeldLog`] slots kept: 16.4 s of sweeps, more than the longest period.
const HELD_SLOTS: usize = 4096;

/// How long the program was held up in the shield's faults (the handler's
/// `Inner::held_ns`: a hand-off per batch, the handler's work and its
/// wait for the lock and for a CPU with faults in hand), as it stood at
/// the sweeps of the last [`HELD_SLOTS`] × [`HELD_GRANULE_MS`] ms: a page
/// back from a sweep was away that long *in the program's own time* less
/// (issue 33). Quietness ([`QUIET_MS`]) and "back sooner than its period"
/// ([`relevel`]) are judged in that time, not wall time: beside two busy
/// loops a pass of the 100 ms canary over its hot quarter, slowed by the
/// faults' waits, took longer than [`QUIET_MS`] of wall time, so its hot
/// pages were learned as quiet and quick-swept after every touch (17,800
/// quick sweeps in 16 s, 17,798 back), which slowed the passes further; the
/// budget went there and the cold heap stayed plaintext. Wall time minus
/// the faults' hold is what the program itself ran (or waited for a CPU
/// behind other tasks, or slept): a secret read every 100 ms stays out
/// about 100 ms less what its budget lets faults take.
#[derive(Debug)]
pub(crate) struct HeldLog {
    /// Per slot: its granule (ms / [`HELD_GRANULE_MS`]) plus one (0: never
    /// noted), and the hold then, ns.
    slots: Box<[(u64, u64)]>,
    /// The latest reading, ns.
    now_ns: u64,
}

impl Default for HeldLog {
    fn default() -> Self {
        Self {
            slots: vec![(0, 0); HELD_SLOTS].into_boxed_slice(),
            now_ns: 0,
        }
    }
}

impl HeldLog {
    /// The hold so far is `held_ns` (readings only grow).
    pub(crate) fn set(&mut self, held_ns: u64) {
        self.now_ns = self.now_ns.max(held_ns);
    }

    /// A page is swept at `now_ms`: the hold now is kept for its slot (the
    /// first reading of the granule: a hold read earlier makes the page's
    /// time away in the program's time shorter, never longer).
    pub(crate) fn note(&mut self, now_ms: u64) {
        let g = now_ms / HELD_GRANULE_MS + 1;
        let slot = &mut self.slots[usize::try_from(g).unwrap_or(0) % HELD_SLOTS];
        if slot.0 != g {
            *slot = (g, self.now_ns);
        }
    }

    /// Of `away_ms` up to `now_ms` (a swept page's time out), the ms the
    /// program was not held up in faults; `away_ms` itself when the sweep's
    /// hold is no longer kept (or was never noted).
    pub(crate) fn ran_ms(&self, now_ms: u64, away_ms: u64) -> u64 {
        let Some(at) = now_ms.checked_sub(away_ms) else {
            return away_ms;
        };
        if away_ms >= HELD_SLOTS as u64 * HELD_GRANULE_MS {
            return away_ms;
        }
        let g = at / HELD_GRANULE_MS + 1;
        let (tag, then) = self.slots[usize::try_from(g).unwrap_or(0) % HELD_SLOTS];
        if tag != g {
            return away_ms;
        }
        away_ms
            .saturating_sub(self.now_ns.saturating_sub(then) / 1_000_000)
            .max(away_ms * RAN_FLOOR.0 / RAN_FLOOR.1)
    }
}

/// The sweep: resident pages waiting for their period to end, one queue per
/// level ordered by arrival (the first is due first), and the budget.
#[derive(Debug)]
pub(crate) struct Sweep {
    /// An entry whose page has left or come in again since (another tick in
    /// its time word) is stale and skipped.
    pub(crate) queues: [Queue; LEVELS],
    /// Pages known quiet (their time word's learned bit), by when they are
    /// due: `(due, address, arrival)`. Swept before any level's pages: they
    /// are the cheapest (they stay out) and the most worth it.
    pub(crate) quiet: QuietHeap,
    /// Pages known quiet that were out [`LONG_QUIET_MS`] or more before
    /// they came back, in the same form: swept before those of `quiet`.
    pub(crate) long_quiet: QuietHeap,
    /// Long quiet pages swept while the budget was spent: since when (ms)
    /// and how many, against [`DEBT_PAGES`].
    debt_window: (u64, u32),
    pub(crate) credit: Credit,
    pub(crate) pending: Pending,
    /// What the victims [`crate::state::State::due`] last picked reserve,
    /// ns (booked in `pending` once they are evicted).
    pub(crate) reserving: f64,
    /// When chunks were last given back to the kernel for a spent budget
    /// (ms).
    pub(crate) released_at: u64,
    /// Pages known quiet swept so far, and how many of them came back
    /// sooner than [`QUIET_MS`] (their quick sweep bought a fault).
    pub(crate) quiet_swept: u64,
    pub(crate) quiet_back: u64,
    /// Pages of quick sweeps back within [`PENDING_MS`] (a fault each).
    pub(crate) quick_back: u64,
    /// What each class's sweeps bought ([`Returns`]).
    pub(crate) returns: Returns,
    /// The quick sweeps no debt stops ([`QuickFloor`]).
    pub(crate) floor: QuickFloor,
    /// The program's hold in faults at past sweeps ([`HeldLog`]).
    pub(crate) held: HeldLog,
    /// The last [`crate::state::State::due`] stopped at its most pages or
    /// runs ([`crate::state::MAX_RUNS`]): more may be due now.
    pub(crate) full: bool,
}

impl Sweep {
    pub(crate) fn new(budget: Budget, now_ms: u64) -> Self {
        Self {
            queues: std::array::from_fn(|_| Queue::new()),
            quiet: BinaryHeap::new(),
            long_quiet: BinaryHeap::new(),
            debt_window: (0, 0),
            credit: Credit::new(budget.fraction, now_ms),
            pending: Pending::default(),
            reserving: 0.0,
            released_at: 0,
            quiet_swept: 0,
            quiet_back: 0,
            quick_back: 0,
            returns: Returns::default(),
            floor: QuickFloor::new(now_ms),
            held: HeldLog::default(),
            full: false,
        }
    }

    /// The share of a page's fault cost a quiet page's sweep reserves: the
    /// share of quiet pages swept so far that came back sooner than
    /// [`QUIET_MS`] (at least [`QUIET_BACK_FLOOR`]; the floor until 20
    /// sweeps say otherwise).
    #[allow(clippy::cast_precision_loss)]
    pub(crate) fn quiet_share(&self) -> f64 {
        let share =
            (self.quiet_back as f64 + QUIET_BACK_FLOOR * 20.0) / (self.quiet_swept as f64 + 20.0);
        share.clamp(QUIET_BACK_FLOOR, 1.0)
    }

    /// Queues a page that came in at `at_ms` at `level` (`quiet`: known
    /// quiet, see [`Sweep::quiet`]).
    pub(crate) fn arrived(&mut self, addr: usize, at_ms: u64, level: u8, quiet: bool) {
        self.arrived_ranked(addr, at_ms, level, quiet, 0);
    }

    /// [`Sweep::arrived`], for a page whose last quick sweep held: it stayed
    /// out `held_ms` ([`QUIET_MS`] or more) after it (the floor's rank,
    /// [`QuickFloor`]; 0 for any other page).
    pub(crate) fn arrived_ranked(
        &mut self,
        addr: usize,
        at_ms: u64,
        level: u8,
        quiet: bool,
        held_ms: u64,
    ) {
        if quiet {
            let due = due_ms(at_ms, level, true);
            self.quiet.push(Reverse((due, addr, at_ms)));
            self.floor.note(due, addr, at_ms, held_ms);
        } else {
            self.queues[usize::from(level.min(TOP))].push(Reverse((at_ms, addr)));
        }
    }

    /// Queues a page known quiet that came in at `at_ms` after
    /// [`LONG_QUIET_MS`] or more out (see [`Sweep::long_quiet`]).
    pub(crate) fn arrived_long_quiet(&mut self, addr: usize, at_ms: u64) {
        self.long_quiet
            .push(Reverse((due_ms(at_ms, 0, true), addr, at_ms)));
    }

    /// Whether one more long quiet page may leave at `now_ms` while the
    /// budget is spent ([`DEBT_PAGES`] per [`DEBT_WINDOW_MS`]); counts it.
    pub(crate) fn debt_allows(&mut self, now_ms: u64) -> bool {
        let (from, n) = &mut self.debt_window;
        if now_ms >= *from + DEBT_WINDOW_MS {
            (*from, *n) = (now_ms, 0);
        }
        if *n >= DEBT_PAGES {
            return false;
        }
        *n += 1;
        true
    }

    /// Milliseconds until the first queued page is due (0: some are due
    /// now), or `None` when nothing is queued.
    pub(crate) fn next_due_ms(&self, now_ms: u64) -> Option<u64> {
        self.queues
            .iter()
            .zip(0u8..)
            .filter_map(|(q, l)| q.peek().map(|Reverse((t, _))| t + period_ms(l)))
            .chain(self.quiet.peek().map(|Reverse((due, _, _))| *due))
            .chain(self.long_quiet.peek().map(|Reverse((due, _, _))| *due))
            .min()
            .map(|due| due.saturating_sub(now_ms))
    }

    /// The period of the highest level with pages queued (ms; 0: none).
    pub(crate) fn longest_period_ms(&self) -> u64 {
        (0u8..)
            .zip(self.queues.iter())
            .filter(|(_, q)| !q.is_empty())
            .map(|(l, _)| period_ms(l))
            .max()
            .unwrap_or(if self.quiet.is_empty() && self.long_quiet.is_empty() {
                0
            } else {
                BASE_PERIOD_MS
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_double_per_level_up_to_the_last() {
        assert_eq!(period_ms(0), 25);
        assert_eq!(period_ms(1), 50);
        assert_eq!(period_ms(9), 12_800);
        assert_eq!(period_ms(200), 12_800);
    }

    #[test]
    fn a_page_back_sooner_than_its_period_climbs_and_a_quiet_one_falls() {
        // In use: back in 3 ms after a 25 ms sweep.
        let mut l = 0;
        for want in 1..=TOP {
            l = relevel(l, 3);
            assert_eq!(l, want);
        }
        assert_eq!(relevel(l, 3), TOP, "capped");
        // A secret touched once a second stays at the shortest period, and
        // one that climbed while it was in use falls back at once.
        assert_eq!(relevel(0, 975), 0);
        assert_eq!(relevel(TOP, 500), 0);
        assert_eq!(relevel(3, QUIET_MS), 0);
        // Out longer than its period but less than QUIET_MS: unchanged.
        assert_eq!(relevel(0, 30), 0);
        assert_eq!(relevel(1, 60), 0, "quiet");
        // Back sooner than its period: up.
        assert_eq!(relevel(3, 40), 4);
    }

    #[test]
    fn time_words_keep_level_and_wrap_their_tick() {
        let w = pack(1_234, 7);
        assert_eq!(level_of(w), 7);
        assert_eq!(since(1_300, tick_of(w)), 66);
        assert!(!is_learned(w) && is_learned(learned(w)));
        assert_eq!(level_of(learned(w)), 7);
        let r = restamp(learned(w), 2_000);
        assert!(is_learned(r) && level_of(r) == 7 && since(2_001, tick_of(r)) == 1);
        let r = retick(learned(w), 9, 2);
        assert!(is_learned(r) && level_of(r) == 2 && tick_of(r) == 9);
        // Across the 27-bit wrap.
        let t0 = (1u64 << 27) - 5;
        let w = pack(t0, 2);
        assert_eq!(since(t0 + 10, tick_of(w)), 10);
        assert_eq!(level_of(pack(0, 99)), TOP);
    }

    #[test]
    fn a_pages_time_out_is_counted_without_the_programs_hold_in_faults() {
        let mut h = HeldLog::default();
        // Swept at 1000 with 30 ms of hold so far; back at 1060 with 80:
        // 50 ms of its 60 the program was held in faults.
        h.set(30_000_000);
        h.note(1_000);
        h.set(80_000_000);
        assert_eq!(h.ran_ms(1_060, 60), 40);
        // The first reading of a granule is kept: a later sweep in the same
        // 4 ms reads the hold from then (never a longer time out).
        h.note(1_002);
        assert_eq!(h.ran_ms(1_062, 60), 40);
        // Never less than two thirds of the wall time out: a page out
        // 75 ms or more stays quiet.
        assert_eq!(h.ran_ms(1_051, 51), 34);
        assert_eq!(h.ran_ms(1_099, 99), 66);
        // A sweep never noted, or out longer than the log keeps: wall time.
        assert_eq!(h.ran_ms(5_000, 100), 100);
        let far = 1_000 + HELD_SLOTS as u64 * HELD_GRANULE_MS;
        assert_eq!(h.ran_ms(far, far - 1_000), far - 1_000);
        // A reading never goes back.
        h.set(5);
        assert_eq!(h.ran_ms(1_060, 60), 40);
    }

    #[test]
    fn the_budget_parses_percentages_only() {
        assert_eq!(Budget::parse_percent("10%"), Ok(10));
        assert_eq!(Budget::parse_percent(" 5 "), Ok(5));
        assert_eq!(Budget::parse_percent("100%"), Ok(100));
        for bad in ["0%", "101", "x", "", "-3%", "2.5%"] {
            assert!(Budget::parse_percent(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(Budget::percent(10, 1).as_percent(), 10);
    }

    #[test]
    fn credit_fills_at_the_budget_rate_and_caps_at_a_quarter_second_of_it() {
        let mut c = Credit::new(0.10, 0);
        // Empty at start: nothing earned yet.
        assert!(c.room(0.0).abs() < 1.0);
        // 250 ms at 10%: 25 ms; spending 20 ms of it, then 100 ms more:
        // 15 ms of credit.
        c.refill(250, 0);
        assert!((c.room(0.0) - 25e6).abs() < 1.0);
        c.refill(250, 20_000_000);
        c.refill(350, 20_000_000);
        assert!((c.room(0.0) - 15e6).abs() < 1.0);
        assert!((c.room(1e6) - 14e6).abs() < 1.0);
        // An idle hour banks only a quarter second's worth (25 ms).
        c.refill(3_600_000, 20_000_000);
        assert!((c.room(0.0) - 25e6).abs() < 1.0);
        // Overspending puts it in debt.
        c.refill(3_600_000, 20_000_000 + 300_000_000);
        assert!(c.room(0.0) < 0.0);
    }

    #[test]
    fn pending_pages_end_when_back_or_after_the_pending_time() {
        let mut p = Pending::default();
        p.swept(1_000, 100, 1000.0);
        p.swept(1_020, 50, 5000.0);
        assert_eq!(p.pages(1_030), 150);
        assert!((p.reserved(1_030) - 6000.0).abs() < 1e-6);
        p.back(1_000, 1_005);
        p.back(1_021, 1_030);
        assert_eq!(p.pages(1_030), 148);
        assert!((p.reserved(1_030) - (990.0 + 4900.0)).abs() < 1e-6);
        // A page back after the pending time ends nothing (it was released).
        p.back(1_000, 1_000 + PENDING_MS);
        assert_eq!(p.pages(1_005 + PENDING_MS), 49);
        assert_eq!(p.pages(1_020 + PENDING_MS), 0);
        // Old buckets are reused without underflow.
        p.swept(5_000, 3, 3.0);
        assert_eq!(p.pages(5_001), 3);
    }

    #[test]
    fn the_first_due_page_is_found_across_levels() {
        let mut s = Sweep::new(Budget::percent(10, 8_000), 0);
        assert_eq!(s.next_due_ms(0), None);
        s.arrived(0x1000, 10, 3, false); // due at 10 + 200
        s.arrived(0x2000, 100, 0, false); // due at 125
        assert_eq!(s.next_due_ms(100), Some(25));
        assert_eq!(s.next_due_ms(130), Some(0));
        assert_eq!(s.longest_period_ms(), 200);
        s.arrived(0x3000, 90, 0, true); // quiet: due at 90 + QUICK_MS
        assert_eq!(s.next_due_ms(90), Some(QUICK_MS));
        assert_eq!(s.next_due_ms(100), Some(0));
    }

    #[test]
    fn a_quiet_page_is_due_quick_ms_after_it_came_back() {
        const {
            assert!(
                QUICK_MS <= 5,
                "a read every 100 ms must be >= 95% ciphertext"
            );
        }
        assert_eq!(due_ms(1_000, 0, true), 1_000 + QUICK_MS);
        // Not known quiet, or known quiet at a level of its own: its period.
        assert_eq!(due_ms(1_000, 0, false), 1_025);
        assert_eq!(due_ms(1_000, 2, true), 1_100);
        let mut s = Sweep::new(Budget::percent(10, 8_000), 0);
        s.arrived(0x1000, 500, 0, true);
        assert_eq!(s.next_due_ms(500), Some(QUICK_MS));
    }

    #[test]
    fn a_quiet_sweep_reserves_the_share_of_quick_sweeps_that_came_back() {
        let mut s = Sweep::new(Budget::percent(10, 8_000), 0);
        // No history: the floor.
        assert!((s.quiet_share() - QUIET_BACK_FLOOR).abs() < 1e-9);
        // All 200 came straight back: nearly the whole fault.
        s.quiet_swept = 200;
        s.quiet_back = 200;
        assert!(s.quiet_share() > 0.9);
        // One in a hundred: the floor.
        s.quiet_back = 2;
        assert!((s.quiet_share() - QUIET_BACK_FLOOR).abs() < 1e-9);
    }

    #[test]
    fn a_class_whose_sweeps_come_straight_back_closes_and_others_stay_open() {
        let mut r = Returns::default();
        // Level 0: 32 sweeps at 0 ms, 28 back within 66 ms (churn's cold
        // pages, touched again within the run); level 1: 32 sweeps that
        // stayed out; the quiet pages: 32 quick sweeps back 98 ms later
        // (a secret read every 100 ms: ciphertext 98% of the time).
        for k in 0..32 {
            r.swept(0, 0);
            r.swept(1, 0);
            r.swept(QUIET_CLASS, 0);
            if k < 28 {
                r.back(0, 0, 66);
            }
            r.back(QUIET_CLASS, 0, 98);
        }
        // Too fresh to say.
        r.settle(50);
        assert!(!r.closed(0));
        // Mature: level 0 closes on what came back so far; the others stay
        // open.
        r.settle(MATURE_MS + BUCKET_MS);
        assert!(r.closed(0));
        assert!(!r.closed(1) && !r.closed(QUIET_CLASS));
        // The quiet pages' class is never closed, whatever comes back.
        let mut q = Returns::default();
        for _ in 0..32 {
            q.swept(QUIET_CLASS, 0);
            q.back(QUIET_CLASS, 0, 1);
        }
        q.settle(PENDING_MS + BUCKET_MS);
        assert_eq!(q.share_of(QUIET_CLASS), Some(1.0));
        assert!(!q.closed(QUIET_CLASS));
        // Settled after the horizon, the same; a page back after its
        // horizon is not bought back (it stayed out its reservation).
        r.back(1, 0, PENDING_MS);
        r.settle(PENDING_MS + BUCKET_MS);
        assert!(r.closed(0) && !r.closed(1));
        // Too few sweeps decide nothing.
        let mut few = Returns::default();
        for _ in 0..CLASS_MIN - 1 {
            few.swept(2, 0);
            few.back(2, 0, 1);
        }
        few.settle(PENDING_MS + BUCKET_MS);
        assert!(!few.closed(2));
    }

    #[test]
    fn a_page_passed_over_at_the_top_level_is_swept_at_its_next_due() {
        // Below the top: the next period from the same arrival, and it may
        // be passed over again there.
        assert_eq!(pass_over_to(1_000, 3, 1_200), (1_000, 4, true));
        assert_eq!(pass_over_to(1_000, TOP - 1, 7_400), (1_000, TOP, true));
        // At the top: one more period from now, then swept.
        assert_eq!(pass_over_to(1_000, TOP, 13_800), (13_800, TOP, false));
        // A probe vouches after PROBE_WAIT of its periods, at most the top
        // one.
        assert_eq!(probe_out_ms(0), PROBE_WAIT * BASE_PERIOD_MS);
        assert_eq!(probe_out_ms(TOP), period_ms(TOP));
    }

    #[test]
    fn a_closed_class_follows_the_programs_recent_use_through_its_probes() {
        let mut r = Returns::default();
        for t in 0..40u64 {
            r.swept(0, t * 10);
            r.back(0, t * 10, t * 10 + 3);
        }
        r.settle(2_000);
        assert!(r.closed(0));
        // One due page in CLOSED_PROBE_EVERY is still swept.
        let swept = (0..8 * CLOSED_PROBE_EVERY)
            .filter(|_| !r.pass_over(0))
            .count();
        assert_eq!(swept, 8);
        // Those probes now stay out: the class opens again once they
        // outweigh the old returns (halved every CLASS_WINDOW).
        let mut t = 2_000;
        while r.closed(0) {
            r.swept(0, t);
            t += BUCKET_MS;
            r.settle(t);
            assert!(t < 2_000 + 2_000 * BUCKET_MS, "never opened");
        }
    }
}
