//! How much plaintext a shield keeps, and how many pages one fault brings in.
//!
//! - [`Window`]: the plaintext window. Fixed (`memveil run --window`), or
//!   adaptive within a bound (`--max-plaintext`, by default a quarter of the
//!   pages holding data and never less than [`crate::DEFAULT_WINDOW`]): it grows
//!   by a page each time the program faults on a page evicted so recently
//!   that a window still within the bound would have kept it, and gives back
//!   an eighth of what it grew each second in which the program took few
//!   faults. The bound is never exceeded.
//! - [`Streams`]: sequential access detection. A fault on the page right
//!   after the last run brought in for a stream continues that stream, and
//!   the next run is twice as long (1, 2, 4, ... [`RUN_MAX`] pages), the way
//!   the kernel's readahead grows. Never-written pages and evicted pages are
//!   brought in alike; a fault that continues no stream brings one page.

use crate::PAGE;

/// Most pages one fault brings in (256 KiB): one `UFFDIO_MOVE` of a run costs
/// about 0.16 µs a page against 1.3-1.5 µs for one page alone on this VM.
pub const RUN_MAX: usize = 64;

/// The bound of an adaptive window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// At most this many pages of plaintext.
    Pages(usize),
    /// At most this percentage (1-100) of the pages holding data, but never
    /// less than [`crate::DEFAULT_WINDOW`] pages.
    Percent(u8),
}

impl Bound {
    /// The default of `memveil run`: a quarter of the pages holding data.
    pub const DEFAULT: Bound = Bound::Percent(25);

    /// Parses `25%`, a byte count, or a byte count with a `K`, `M` or `G`
    /// suffix (KiB, MiB, GiB; a trailing `B` or `iB` is accepted).
    ///
    /// # Errors
    /// A message naming the accepted forms.
    pub fn parse(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let bad = || {
            format!(
                "bad plaintext bound {s:?}: give a percentage of the data (1%-100%, e.g. 25%) or a size \
                 (bytes, or with K, M or G, e.g. 64M)"
            )
        };
        if let Some(p) = t.strip_suffix('%') {
            let p: u8 = p.trim().parse().map_err(|_| bad())?;
            return if (1..=100).contains(&p) {
                Ok(Bound::Percent(p))
            } else {
                Err(bad())
            };
        }
        let upper = t.to_ascii_uppercase();
        let body = upper
            .strip_suffix("IB")
            .or_else(|| upper.strip_suffix('B'))
            .unwrap_or(&upper);
        let (digits, unit) = match body.char_indices().last() {
            Some((i, 'K')) => (&body[..i], 1usize << 10),
            Some((i, 'M')) => (&body[..i], 1 << 20),
            Some((i, 'G')) => (&body[..i], 1 << 30),
            _ => (body, 1),
        };
        let n: usize = digits.trim().parse().map_err(|_| bad())?;
        let bytes = n.checked_mul(unit).ok_or_else(bad)?;
        if bytes < PAGE {
            return Err(format!(
                "{}: the bound must be at least one page (4K)",
                bad()
            ));
        }
        Ok(Bound::Pages(bytes / PAGE))
    }

    /// The bound in pages for `data` pages holding data.
    #[must_use]
    pub fn pages(self, data: usize) -> usize {
        match self {
            Bound::Pages(n) => n.max(1),
            Bound::Percent(p) => (data / 100 * usize::from(p) + data % 100 * usize::from(p) / 100)
                .max(crate::DEFAULT_WINDOW),
        }
    }

    /// The form [`Bound::parse`] reads back (the preload's environment).
    #[must_use]
    pub fn to_arg(self) -> String {
        match self {
            Bound::Pages(n) => format!("{}K", n * (PAGE / 1024)),
            Bound::Percent(p) => format!("{p}%"),
        }
    }
}

/// The plaintext window of a shield.
#[derive(Debug, Clone)]
pub(crate) struct Window {
    /// Fewest pages (adaptive) or the fixed size.
    min: usize,
    bound: Option<Bound>,
    current: usize,
    faults_since_tick: u64,
    grown_since_tick: u64,
}

/// Faults per second (at least; more for a larger window, see
/// [`Window::tick`]) below which an adaptive window gives pages back.
const QUIET_FAULTS: u64 = 16;

impl Window {
    /// A window of `min` pages, adaptive up to `bound` when given.
    pub(crate) fn new(min: usize, bound: Option<Bound>) -> Self {
        let min = match bound {
            Some(Bound::Pages(n)) => min.min(n),
            _ => min,
        }
        .max(1);
        Self {
            min,
            bound,
            current: min,
            faults_since_tick: 0,
            grown_since_tick: 0,
        }
    }

    /// Most pages this window may hold when `data` pages hold data.
    pub(crate) fn limit(&self, data: usize) -> usize {
        self.bound.map_or(self.min, |b| b.pages(data).max(self.min))
    }

    /// The window now, for `data` pages holding data.
    pub(crate) fn size(&self, data: usize) -> usize {
        self.current.min(self.limit(data))
    }

    /// Whether the window adapts.
    pub(crate) fn adaptive(&self) -> bool {
        self.bound.is_some()
    }

    /// Books a fault on an evicted page that left the window `age`
    /// evictions ago; returns whether a window within the bound would have
    /// kept it (and then the window grows by one page).
    pub(crate) fn fault(&mut self, age: Option<u32>, data: usize) -> bool {
        self.faults_since_tick += 1;
        let Some(age) = age else { return false };
        let limit = self.limit(data);
        let size = self.size(data);
        let near = size.saturating_add(age as usize) < limit;
        if near && self.bound.is_some() {
            self.current = size + 1;
            self.grown_since_tick += 1;
        }
        near
    }

    /// Once a second: an adaptive window that grew above its minimum gives
    /// back an eighth of the excess when the program took few faults in the
    /// second (its working set fits; pages it needs again fault back and
    /// grow it). Returns the new size.
    pub(crate) fn tick(&mut self, data: usize) -> usize {
        let quiet = self.faults_since_tick < QUIET_FAULTS.max(self.current as u64 / 256)
            && self.grown_since_tick == 0;
        self.current = self.size(data);
        if quiet && self.current > self.min {
            self.current -= ((self.current - self.min) / 8).max(1);
        }
        self.faults_since_tick = 0;
        self.grown_since_tick = 0;
        self.current
    }
}

/// Recently seen sequential streams (a few, for a few threads scanning at
/// once), replaced least recently used first.
#[derive(Debug, Default)]
pub(crate) struct Streams {
    s: [Stream; 4],
    clock: u32,
}

#[derive(Debug, Default, Clone, Copy)]
struct Stream {
    /// First page after the last run brought in.
    next: usize,
    /// Length of that run.
    run: usize,
    used: u32,
}

impl Streams {
    /// Pages to bring in for a fault at page address `addr`: twice the last
    /// run when the fault continues a stream (capped at `max`), else 1.
    pub(crate) fn plan(&mut self, addr: usize, max: usize) -> usize {
        self.clock = self.clock.wrapping_add(1);
        let max = max.clamp(1, RUN_MAX);
        if let Some(s) = self.s.iter_mut().find(|s| s.next == addr && s.run > 0) {
            s.used = self.clock;
            return (s.run * 2).min(max);
        }
        1
    }

    /// Records that `n` pages from `addr` were brought in.
    pub(crate) fn ran(&mut self, addr: usize, n: usize) {
        let next = addr + n * PAGE;
        let slot = match self.s.iter().position(|s| s.next == addr && s.run > 0) {
            Some(i) => i,
            None => {
                let clock = self.clock;
                self.s
                    .iter()
                    .enumerate()
                    .max_by_key(|(_, s)| clock.wrapping_sub(s.used))
                    .map_or(0, |(i, _)| i)
            }
        };
        self.s[slot] = Stream {
            next,
            run: n,
            used: self.clock,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_parse_percentages_and_sizes() {
        assert_eq!(Bound::parse("25%"), Ok(Bound::Percent(25)));
        assert_eq!(Bound::parse(" 100% "), Ok(Bound::Percent(100)));
        assert_eq!(Bound::parse("64M"), Ok(Bound::Pages(16384)));
        assert_eq!(Bound::parse("64MiB"), Ok(Bound::Pages(16384)));
        assert_eq!(Bound::parse("1g"), Ok(Bound::Pages(262_144)));
        assert_eq!(Bound::parse("8192"), Ok(Bound::Pages(2)));
        assert_eq!(Bound::parse("16K"), Ok(Bound::Pages(4)));
        for bad in [
            "0%",
            "101%",
            "x%",
            "",
            "12Q",
            "100",
            "-5M",
            "99999999999999999999G",
        ] {
            assert!(Bound::parse(bad).is_err(), "{bad:?} accepted");
        }
        for b in [Bound::Percent(7), Bound::Pages(123)] {
            assert_eq!(Bound::parse(&b.to_arg()), Ok(b));
        }
    }

    #[test]
    fn a_percentage_never_bounds_below_the_default_window() {
        let b = Bound::Percent(25);
        assert_eq!(b.pages(1000), crate::DEFAULT_WINDOW);
        assert_eq!(b.pages(100_000), 25_000);
        assert_eq!(
            b.pages(usize::MAX),
            usize::MAX / 100 * 25 + usize::MAX % 100 * 25 / 100
        );
        assert_eq!(Bound::Pages(10).pages(1 << 40), 10);
    }

    #[test]
    fn a_fixed_window_never_moves() {
        let mut w = Window::new(64, None);
        for _ in 0..1000 {
            assert!(!w.fault(Some(0), 1 << 20));
        }
        assert_eq!(w.size(1 << 20), 64);
        assert_eq!(w.tick(1 << 20), 64);
        assert!(!w.adaptive());
    }

    #[test]
    fn an_adaptive_window_grows_on_near_misses_up_to_the_bound_only() {
        let data = 100_000;
        let mut w = Window::new(4096, Some(Bound::Percent(25)));
        assert_eq!(w.limit(data), 25_000);
        // Faults on pages evicted long ago (cold) do not grow it.
        for _ in 0..100 {
            assert!(!w.fault(Some(1_000_000), data));
            assert!(!w.fault(None, data));
        }
        assert_eq!(w.size(data), 4096);
        // Near misses do, one page each, never past the bound.
        for _ in 0..30_000 {
            w.fault(Some(10), data);
        }
        assert_eq!(w.size(data), 25_000 - 10);
        // Data shrinks: so does the window at once.
        assert_eq!(w.size(20_000), 5000);
    }

    #[test]
    fn an_adaptive_window_gives_back_in_quiet_seconds() {
        let data = 100_000;
        let mut w = Window::new(4096, Some(Bound::Percent(25)));
        for _ in 0..8000 {
            w.fault(Some(0), data);
        }
        let grown = w.size(data);
        assert_eq!(grown, 4096 + 8000);
        // The second in which it grew does not shrink it.
        assert_eq!(w.tick(data), grown);
        // A quiet second gives back an eighth of the excess.
        assert_eq!(w.tick(data), grown - 1000);
        // A busy second (many faults) keeps it.
        for _ in 0..1000 {
            w.fault(Some(1 << 30), data);
        }
        assert_eq!(w.tick(data), grown - 1000);
        for _ in 0..200 {
            w.tick(data);
        }
        assert_eq!(w.size(data), 4096, "back to the minimum");
    }

    #[test]
    fn a_size_bound_below_the_minimum_lowers_the_minimum() {
        let w = Window::new(4096, Some(Bound::Pages(100)));
        assert_eq!(w.size(1 << 20), 100);
        assert_eq!(w.limit(0), 100);
    }

    #[test]
    fn streams_double_their_runs_and_forget_the_oldest() {
        let mut s = Streams::default();
        let a = 0x10_0000;
        assert_eq!(s.plan(a, 64), 1);
        s.ran(a, 1);
        let mut at = a + PAGE;
        let mut runs = Vec::new();
        for _ in 0..9 {
            let n = s.plan(at, 64);
            runs.push(n);
            s.ran(at, n);
            at += n * PAGE;
        }
        assert_eq!(runs, [2, 4, 8, 16, 32, 64, 64, 64, 64]);
        // A random fault starts nothing.
        assert_eq!(s.plan(0x900_0000, 64), 1);
        // The cap follows the caller's limit.
        assert_eq!(s.plan(at, 8), 8);
        // Four other streams push the first out.
        for k in 1..=4 {
            let b = k * 0x100_0000;
            s.plan(b, 64);
            s.ran(b, 1);
        }
        assert_eq!(s.plan(at, 64), 1);
    }
}
