//! The budget's guardrail on what its sweeps buy (issue 34): a program
//! whose swept pages mostly come back spends less of its budget.
//!
//! Far memory (Google, ASPLOS 2019) keeps each job's *promotion rate* (cold
//! pages brought back per minute) under an SLO, and TMO (Meta, ASPLOS 2022)
//! backs off while the memory stall time grows. The budget alone has no
//! such limit: it spends its whole fraction whatever its sweeps buy, and a
//! program in constant use pays it for faults and next to no ciphertext.
//! The Go suite's maps (a map cache on four goroutines, the collector
//! running throughout) had 875 pages swept a run, 94% of them back; json's
//! pages, vouched idle by their blocks' probes (out 100 ms), came back with
//! the collector's next cycle, 200-1000 ms after their sweep (3,058 of
//! 5,999 returns of one run later than [`crate::sweep::PENDING_MS`], so no
//! level closed: `sweep::Returns`). With both vCPUs busy with the program's
//! threads the shield's CPU comes out of the program's time, and the wall
//! time lost (0.13 s of 0.85 s for maps) exceeded the cost counted.
//!
//! So the share of the program's level sweeps (every sweep but the quick
//! sweeps of known quiet pages, which keep their own reservation:
//! [`crate::sweep::Sweep::quiet_share`]) that came back within [`BACK_MS`]
//! scales the budget's refill ([`Promotion::scale`]): in full while at most
//! [`FREE_SHARE`] come back, down to [`MIN_SCALE`] when all do. A cold heap
//! (its sweeps stay out) keeps the whole budget. The counts fade with time
//! ([`HALF_LIFE_MS`]), so a program that stops sweeping (its budget spent
//! on what it costs anyway) gets its budget back and its next sweeps are
//! judged afresh. The quick sweeps' floor (`sweep::QuickFloor`) and the
//! long quiet pages' leave in debt (`sweep::DEBT_PAGES`) do not draw on the
//! refill and are not held back by it.

use crate::sweep::LONG_QUIET_MS;

/// A level sweep is bought back when its page comes back sooner than this
/// (ms): what stays out longer is a *long quiet* page
/// ([`LONG_QUIET_MS`]), the coldest kind. The reservation's
/// [`crate::sweep::PENDING_MS`] (400 ms) missed json's returns, which
/// come with the collector's next cycle.
pub(crate) const BACK_MS: u64 = LONG_QUIET_MS;
/// Share of level sweeps bought back at or under which the budget is spent
/// in full.
pub(crate) const FREE_SHARE: f64 = 0.5;
/// Least share of its budget a program keeps when all its level sweeps
/// come back: its sweeps go on, slowly, so the share follows its use.
pub(crate) const MIN_SCALE: f64 = 0.2;
/// Level sweeps counted before the share decides anything.
pub(crate) const MIN_SWEEPS: f64 = 32.0;
/// The counts halve every this many ms (and at [`WINDOW`] sweeps).
pub(crate) const HALF_LIFE_MS: u64 = 1_000;
/// Sweeps at which the counts halve.
const WINDOW: f64 = 2_048.0;

/// Level sweeps and those of them bought back, fading
/// ([`HALF_LIFE_MS`], [`WINDOW`]).
#[derive(Debug)]
pub(crate) struct Promotion {
    swept: f64,
    back: f64,
    halved_ms: u64,
}

impl Promotion {
    pub(crate) fn new(now_ms: u64) -> Self {
        Self {
            swept: 0.0,
            back: 0.0,
            halved_ms: now_ms,
        }
    }

    /// A level sweep.
    pub(crate) fn swept(&mut self) {
        self.swept += 1.0;
        if self.swept >= WINDOW {
            self.swept /= 2.0;
            self.back /= 2.0;
        }
    }

    /// A page of a level sweep came back `away_ms` after it.
    pub(crate) fn back(&mut self, away_ms: u64) {
        if away_ms < BACK_MS {
            self.back = (self.back + 1.0).min(self.swept);
        }
    }

    /// Halves the counts for each [`HALF_LIFE_MS`] passed by `now_ms`.
    pub(crate) fn fade(&mut self, now_ms: u64) {
        while now_ms >= self.halved_ms + HALF_LIFE_MS {
            self.halved_ms += HALF_LIFE_MS;
            self.swept /= 2.0;
            self.back /= 2.0;
            if self.swept < 1.0 {
                self.halved_ms = now_ms;
                break;
            }
        }
    }

    /// The share of level sweeps bought back (`None`: fewer than
    /// [`MIN_SWEEPS`]).
    pub(crate) fn share(&self) -> Option<f64> {
        (self.swept >= MIN_SWEEPS).then(|| self.back / self.swept)
    }

    /// The share of its budget's refill the program spends: 1 while
    /// [`FREE_SHARE`] or less of its level sweeps come back, falling in
    /// proportion to what stays out down to [`MIN_SCALE`].
    pub(crate) fn scale(&self) -> f64 {
        self.share().map_or(1.0, |s| {
            ((1.0 - s) / (1.0 - FREE_SHARE)).clamp(MIN_SCALE, 1.0)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_whose_sweeps_come_back_keeps_a_fifth_of_its_budget() {
        let mut p = Promotion::new(0);
        // Too few to say.
        for _ in 0..31 {
            p.swept();
            p.back(30);
        }
        assert!((p.scale() - 1.0).abs() < 1e-9);
        p.swept();
        p.back(30);
        assert!((p.scale() - MIN_SCALE).abs() < 1e-9);
        // The collector's returns, 200-1000 ms after the sweep, count.
        let mut gc = Promotion::new(0);
        for k in 0..100 {
            gc.swept();
            gc.back(200 + 8 * k);
        }
        assert!((gc.scale() - MIN_SCALE).abs() < 1e-9);
        // 94% back (the Go suite's maps): a fifth.
        let mut maps = Promotion::new(0);
        for k in 0..100 {
            maps.swept();
            if k % 50 >= 3 {
                maps.back(40);
            }
        }
        assert!(maps.scale() <= 0.2 + 1e-9, "{}", maps.scale());
        // 3 in 4 back: half.
        let mut mixed = Promotion::new(0);
        for k in 0..100 {
            mixed.swept();
            if k % 4 != 0 {
                mixed.back(40);
            }
        }
        assert!((mixed.scale() - 0.5).abs() < 1e-9, "{}", mixed.scale());
    }

    #[test]
    fn a_cold_heap_keeps_its_whole_budget() {
        let mut p = Promotion::new(0);
        for k in 0..1_000 {
            p.swept();
            // Half of them back, or back a second later or more: free.
            if k % 2 == 0 {
                p.back(30);
            } else {
                p.back(BACK_MS);
            }
        }
        assert!((p.scale() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn the_share_fades_so_a_program_that_stopped_sweeping_is_judged_afresh() {
        let mut p = Promotion::new(0);
        for _ in 0..500 {
            p.swept();
            p.back(10);
        }
        p.fade(999);
        assert!((p.scale() - MIN_SCALE).abs() < 1e-9);
        // No sweeps for 4 s: 31 counted, too few to hold it back.
        p.fade(4_000);
        assert!((p.scale() - 1.0).abs() < 1e-9);
        // Its next sweeps stay out: the share follows them at once.
        for _ in 0..64 {
            p.swept();
        }
        assert!((p.scale() - 1.0).abs() < 1e-9);
        // Fading past zero restarts the clock.
        let mut q = Promotion::new(0);
        q.fade(1_000_000);
        q.swept();
        q.fade(1_000_500);
        assert!((q.swept - 1.0).abs() < 1e-9);
    }
}
