//! What `memveil run` reports at exit (and with `--live`): the counters,
//! which guarantee was in force and what it achieved, and one line of
//! advice from what was measured.

use memveil_shield::Snapshot;

/// The guarantee `memveil run` asked the shield for.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Guarantee {
    /// The cost budget, percent of the program's time.
    pub(super) budget: Option<u8>,
    /// A fixed plaintext bound, pages per process.
    pub(super) window: Option<u64>,
    /// An adaptive plaintext bound.
    pub(super) max_plaintext: Option<memveil_shield::Bound>,
}

impl Guarantee {
    fn bound(&self) -> Option<String> {
        match (self.window, self.max_plaintext) {
            (Some(w), _) => Some(format!("plaintext bound {w} pages per process (fixed)")),
            (None, Some(b)) => Some(format!(
                "plaintext bound {} per process (adaptive window)",
                match b {
                    memveil_shield::Bound::Percent(p) => format!("{p}% of the data"),
                    memveil_shield::Bound::Pages(n) => format!("{n} pages"),
                }
            )),
            (None, None) => None,
        }
    }

    /// A short label: `budget 10%`, `bound`, `bound+budget 10%`.
    pub(super) fn label(&self) -> String {
        match self.budget {
            Some(p) => format!("{} {p}%", self.name()),
            None => self.name().to_owned(),
        }
    }

    /// The name `--stats-json` gives it.
    pub(super) fn name(&self) -> &'static str {
        match (self.budget.is_some(), self.bound().is_some()) {
            (true, true) => "bound+budget",
            (false, true) => "bound",
            _ => "budget",
        }
    }
}

/// Percent, one decimal.
fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// Whether a budget of `budget` percent was kept at a measured cost share
/// `cost` (half a point of rounding and clock allowed).
pub(super) fn budget_met(budget: u8, cost: f64) -> bool {
    cost * 100.0 <= f64::from(budget) + 0.5
}

/// The guarantee line: which guarantee was in force and what it achieved.
pub(super) fn guarantee_line(g: &Guarantee, s: &Snapshot) -> String {
    let mut parts = Vec::new();
    let head = match (g.budget, g.bound()) {
        (Some(p), Some(b)) => format!("guarantee: {b} (never exceeded) and cost budget {p}%"),
        (None, Some(b)) => format!("guarantee: {b} (never exceeded, whatever it costs)"),
        (Some(p), None) => format!("guarantee: cost budget {p}% (no plaintext bound)"),
        (None, None) => "guarantee: none".to_owned(),
    };
    parts.push(head);
    if let Some(cost) = s.cost_fraction() {
        let hand = s.fault_floor_ns as f64 / 1e3;
        let ms = |ns: u64| ns as f64 / 1e6;
        let spent = format!(
            "the shield cost {} of the processes' time, what they lost ({:.0} ms its threads' CPU, of which \
             the sweep's counted only as far as the program waited for a CPU ({:.0} ms); {} hand-offs{}, {:.0} ms \
             faults waited for the handler to get a CPU, {:.0} ms on the program's threads wiping what it freed, \
             {:.0} ms in memveil's allocator beyond the C library's ({} calls at {} ns){}; \
             {:.0} ms of the host's CPU in all, what the budgets draw)",
            pct(cost),
            ms(s.shield_cpu_ns),
            ms(s.contention_ns),
            s.handoffs,
            if s.fault_floor_ns > 0 {
                format!(" counted at {hand:.1} us")
            } else {
                String::new()
            },
            ms(s.handler_wait_ns),
            ms(s.program_ns),
            ms(s.alloc_ns),
            s.alloc_calls,
            s.alloc_call_ns,
            if s.served_calls > 0 {
                format!(
                    ", {:.0} ms of the loader's agent's CPU serving {} memory calls",
                    ms(s.agent_ns),
                    s.served_calls
                )
            } else {
                String::new()
            },
            ms(s.host_cost_ns)
        );
        parts.push(match g.budget {
            Some(p) if !budget_met(p, cost) => {
                format!("BUDGET NOT MET: {spent}, against {p}%: {}", over_why(s))
            }
            Some(_) => format!("budget met: {spent}"),
            None => spent,
        });
    }
    if g.budget.is_some() {
        parts.push(format!(
            "pages idle past their sweep period (2 ms after each use for a page used rarely, {} ms \
             now for the pages in most constant use) leave as ciphertext: {} pages swept, {} of them came back; \
             due pages waited up to {} ms for the budget",
            s.max_period_ms.max(25),
            s.swept,
            s.swept_back,
            s.max_sweep_lag_ms
        ));
    }
    if let Some(t) = s.time_plaintext_fraction() {
        parts.push(format!(
            "plaintext over the run {} of the data (time-weighted), {} at exit",
            pct(t),
            pct(s.plaintext_fraction())
        ));
    }
    parts.join("; ")
}

/// Why a budget was overspent, from the counters.
fn over_why(s: &Snapshot) -> String {
    if s.alloc_ns.saturating_mul(2) > s.cost_ns {
        format!(
            "most of it was memveil's allocator, which takes {} ns a call more than the C library's \
             ({} calls), a cost no budget can skip",
            s.alloc_call_ns, s.alloc_calls
        )
    } else if s.program_ns.saturating_mul(2) > s.cost_ns {
        "most of it was wiping the memory the program freed before its frames went back to the \
         kernel, which no budget can skip (a plaintext frame is never handed back)"
            .to_owned()
    } else if s.zero_fills * 2 > s.handoffs.max(1) {
        "most faults were first touches of memory in chunks the sweep had registered (the program \
         reuses memory it freed)"
            .to_owned()
    } else if s.swept > 0 && s.swept_back * 10 >= s.swept * 9 {
        format!(
            "the program touches nearly all of its data continuously ({} of {} pages swept came \
             back), so faults of pages swept within the budget kept coming after it was spent",
            s.swept_back, s.swept
        )
    } else {
        "pages swept within the budget were touched again after it was spent".to_owned()
    }
}

/// One line a person can act on, or `None`: under a budget, what would buy
/// more protection and what it would cost, from this run's figures; under
/// a bound alone, what would cost less ([`bound_advice`]).
pub(super) fn advice(g: &Guarantee, s: &Snapshot, secs: f64) -> Option<String> {
    if g.budget.is_none() {
        return bound_advice(s, secs, g.window);
    }
    let budget = g.budget.unwrap_or(10);
    let t = s.time_plaintext_fraction()?;
    let mut more = Vec::new();
    if s.max_sweep_lag_ms >= 100 && budget < 50 {
        more.push(format!(
            "--max-overhead {}% (due pages waited up to {} ms for this budget; faults may then cost \
             up to that share of the run)",
            (u16::from(budget) * 2).min(100),
            s.max_sweep_lag_ms
        ));
    }
    if t > 0.25 {
        more.push(bound_estimate(s, secs, t));
    }
    (!more.is_empty()).then(|| {
        format!(
            "more protection: the data was {} plaintext over the run; {}",
            pct(t),
            more.join("; or ")
        )
    })
}

/// What a hard bound of a quarter of the data would cost this program, at
/// least: the pages in use beyond it (the time-weighted plaintext pages,
/// less a quarter of the data), each touched at least as often as the
/// swept pages that came back were (their mean time away: touches between
/// sweeps are not seen), each touch a fault at this run's cost per fault.
#[allow(clippy::cast_precision_loss)]
fn bound_estimate(s: &Snapshot, secs: f64, t: f64) -> String {
    let alive = s.alive_ms.max(1) as f64;
    let data = s.data_page_ms as f64 / alive;
    let beyond = (t - 0.25).max(0.0) * data;
    let per_fault = if s.handoffs > 0 {
        (s.handler_ns as f64 + s.handoffs as f64 * s.fault_floor_ns as f64) / s.handoffs as f64
    } else {
        s.fault_floor_ns as f64
    };
    if s.swept_back == 0 {
        return "a hard bound, --max-plaintext 25%, whatever it costs (no swept page came back, so \
                no estimate)"
            .to_owned();
    }
    let away_ms = (s.back_away_ms as f64 / s.swept_back as f64).max(1.0);
    let faults = beyond * secs * 1e3 / away_ms;
    let cost = faults * per_fault / 1e9;
    format!(
        "a hard bound, --max-plaintext 25%: at least {:.0} faults ({cost:.1} s, {:.1}x this run), \
         from the {:.0} pages in use beyond it and the swept pages' return after {away_ms:.0} ms \
         on average",
        faults,
        cost / secs.max(1e-3),
        beyond
    )
}

/// The counters line: processes, window, keys, pages, faults, evictions.
pub(super) fn summary(s: &Snapshot) -> String {
    let window = if s.bound == 0 && s.window == 0 {
        "no plaintext bound".to_owned()
    } else if s.adaptive > 0 {
        format!(
            "window {} pages now (adaptive, at most {} so far, bound {})",
            s.window, s.max_window, s.bound
        )
    } else {
        format!("window {} pages (fixed)", s.window)
    };
    format!(
        "{} process(es), {window}, keys {}, eviction {}; region {} pages under the shield (reserved address space, not use); plaintext {} pages \
         ({:.1}% of {} holding data, max {}); faults {} decrypt + {} zero-fill (+{} pages read ahead, {} \
         filled ahead; {} never-written pages from the zero pool), evictions {} ({} by write-protect), \
         handler {:.1} ms{}{}{}",
        s.processes,
        s.level_name(),
        s.mechanism_name(),
        s.pages_protected,
        s.resident_pages,
        100.0 * s.plaintext_fraction(),
        s.resident_pages + s.evicted_pages,
        s.max_resident,
        s.faults_in,
        s.zero_fills,
        s.readahead,
        s.prefill,
        s.pool_fills,
        s.evictions,
        s.wp_evictions,
        s.handler_ns as f64 / 1e6,
        if s.idle_rescues > 0 {
            format!(
                "; handler starved behind other threads {} time(s), made normal again",
                s.idle_rescues
            )
        } else {
            String::new()
        },
        if s.shared_protected_bytes > 0 || s.shared_evictions > 0 {
            format!(
                "; shared memory protected: {} KiB for {} process view(s), {} plaintext pages, {} evicted, {} faults in",
                s.shared_protected_bytes.div_ceil(1024),
                s.shared_views,
                s.shared_resident_pages,
                s.shared_evictions,
                s.shared_faults_in
            )
        } else {
            String::new()
        },
        if s.shared_unprotected_bytes > 0 {
            format!(
                "; shared memory NOT protected: {} KiB (--shared-memory unprotected)",
                s.shared_unprotected_bytes.div_ceil(1024)
            )
        } else {
            String::new()
        }
    )
}

/// Microseconds a fault costs the program beyond what the handler does:
/// the fault's entry, the two thread switches and the wake-ups (on a 2-vCPU
/// VM `memveil bench --only shield` measured the floor of a hand-off,
/// `shield.fault_floor_us`, at 8.6-15 µs, and random faults at 8-10 µs
/// more than the handler's own time): a rough figure for the advice line.
const SWITCHES_US: f64 = 12.0;

/// Share of the refaulted pages a larger window should have kept for the
/// advice to name it.
const KEEP_SHARE: f64 = 0.75;

/// How many pages more a window would have needed to keep at least
/// [`KEEP_SHARE`] of the pages that faulted back, and the share it would
/// have kept, from the refault ages (`None`: none measured, or only the
/// open-ended oldest bucket reaches the share).
fn growth(s: &Snapshot) -> Option<(u64, f64)> {
    let total: u64 = s.refault_ages.iter().sum();
    if total == 0 {
        return None;
    }
    let mut kept = 0;
    for (k, n) in s.refault_ages.iter().enumerate() {
        kept += n;
        let end = memveil_shield::age_bucket_end(k)?;
        if kept as f64 >= KEEP_SHARE * total as f64 {
            return Some((end, kept as f64 / total as f64));
        }
    }
    None
}

/// One line a person can act on when faults took a good part of the run,
/// or `None` when they did not. What it names comes from the refault ages:
/// how much larger a window would have had to be to keep the pages that
/// came back.
/// The advice under a plaintext bound alone (see [`advice`]).
fn bound_advice(s: &Snapshot, secs: f64, fixed: Option<u64>) -> Option<String> {
    let faults = s.faults();
    if faults == 0 || secs <= 0.0 {
        return None;
    }
    let cost = s.handler_ns as f64 / 1e9 + faults as f64 * SWITCHES_US / 1e6;
    let share = (cost / secs).min(1.0);
    if share < 0.2 {
        return None;
    }
    let head = format!(
        "faults took about {:.0}% of the run ({faults} faults, {:.1} us each)",
        100.0 * share,
        cost * 1e6 / faults as f64
    );
    let data = s.max_data.max(s.resident_pages + s.evicted_pages).max(1);
    let what = if s.zero_fills * 2 > faults {
        "most were first touches of fresh memory (the program allocates faster than it reuses); \
         nothing but a larger window (more plaintext) avoids them"
            .to_owned()
    } else {
        match growth(s) {
            Some((extra, kept)) if s.max_window + extra < data => {
                let pages = s.max_window + extra;
                let pct = (100 * pages).div_ceil(data).clamp(1, 100);
                let mib = pages.div_ceil(256);
                let kept = 100.0 * kept;
                match fixed {
                    Some(w) => format!(
                        "the working set exceeds the fixed --window {w}: --window {pages} \
                         ({mib} MiB) would have kept about {kept:.0}% of the pages that came back \
                         in plaintext; or drop --window to let the window adapt within 25% of the data"
                    ),
                    None => format!(
                        "the working set exceeds the plaintext bound ({} of {data} pages holding \
                         data): --max-plaintext {pct}% ({mib} MiB) would have kept about \
                         {kept:.0}% of the pages that came back in plaintext, and leaves {pct}% of \
                         the data unencrypted in memory",
                        s.bound
                    ),
                }
            }
            _ => format!(
                "the program reuses its pages only after cycling through nearly all of its data \
                 ({data} pages): only a window holding all of it (--max-plaintext 100%, no \
                 protection at rest) would avoid these faults"
            ),
        }
    };
    Some(format!("{head}: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(f: impl FnOnce(&mut Snapshot)) -> Snapshot {
        let mut s = Snapshot {
            processes: 1,
            resident_pages: 4096,
            evicted_pages: 12_000,
            ..Snapshot::default()
        };
        f(&mut s);
        s
    }

    #[test]
    fn advice_only_when_faults_took_a_good_part_of_the_run() {
        // 1000 faults of ~10 us in 10 s: nothing to say.
        let calm = snap(|s| {
            s.faults_in = 1000;
            s.handler_ns = 3_000_000;
        });
        assert_eq!(bound_advice(&calm, 10.0, None), None);
        assert_eq!(bound_advice(&Snapshot::default(), 1.0, None), None);
        // 500k faults in 10 s: faults dominate. 80% of the pages that came
        // back had left 1024-2047 evictions before: a window 2048 pages
        // larger (6144 of 16000 pages, 39%) would have kept them.
        let busy = snap(|s| {
            s.faults_in = 500_000;
            s.handler_ns = 3_000_000_000;
            s.adaptive = 1;
            s.bound = 4096;
            s.max_window = 4096;
            s.max_data = 16_000;
            s.refault_ages[3] = 400_000;
            s.refault_ages[6] = 100_000;
        });
        let line = bound_advice(&busy, 10.0, None).expect("advice");
        assert!(
            line.starts_with("faults took about 90% of the run"),
            "{line}"
        );
        assert!(
            line.contains("--max-plaintext 39% (24 MiB) would have kept about 80%"),
            "{line}"
        );
        assert!(line.contains("39% of the data unencrypted"), "{line}");
        // A fixed window names the window that would have held them.
        let line = bound_advice(&busy, 10.0, Some(4096)).expect("advice");
        assert!(
            line.contains("fixed --window 4096: --window 6144"),
            "{line}"
        );
        // Fresh memory: no flag helps but a larger window.
        let fresh = snap(|s| {
            s.zero_fills = 400_000;
            s.faults_in = 1000;
            s.refault_ages[0] = 1000;
            s.handler_ns = 2_000_000_000;
        });
        let line = bound_advice(&fresh, 5.0, None).expect("advice");
        assert!(line.contains("first touches of fresh memory"), "{line}");
        // Pages that come back only after the program went through more
        // than all of its data: no window short of all of it helps.
        let cycling = snap(|s| {
            s.faults_in = 300_000;
            s.handler_ns = 2_000_000_000;
            s.adaptive = 1;
            s.bound = 4096;
            s.max_window = 4096;
            s.max_data = 16_000;
            s.refault_ages[7] = 300_000;
        });
        let line = bound_advice(&cycling, 5.0, None).expect("advice");
        assert!(line.contains("only a window holding all of it"), "{line}");
        assert!(!line.contains("--cpu"), "{line}");
        // One line a person reads: no runs of spaces from wrapped literals.
        for s in [&busy, &fresh, &cycling] {
            for fixed in [None, Some(4096)] {
                let line = bound_advice(s, 5.0, fixed).expect("advice");
                assert!(!line.contains("  ") && !line.contains('\n'), "{line:?}");
            }
        }
    }

    #[test]
    fn the_guarantee_line_names_the_budget_and_whether_it_was_met() {
        let g = Guarantee {
            budget: Some(10),
            ..Guarantee::default()
        };
        let mut s = snap(|s| {
            s.alive_ms = 1000;
            s.cost_ns = 80_000_000;
            s.fault_floor_ns = 7_000;
            s.swept = 500;
            s.swept_back = 100;
            s.max_period_ms = 800;
            s.plaintext_page_ms = 250_000;
            s.data_page_ms = 1_000_000;
        });
        let line = guarantee_line(&g, &s);
        assert!(
            line.starts_with("guarantee: cost budget 10% (no plaintext bound)"),
            "{line}"
        );
        assert!(line.contains("budget met: the shield cost 8.0%"), "{line}");
        assert!(line.contains("800 ms now"), "{line}");
        assert!(
            line.contains("plaintext over the run 25.0% of the data"),
            "{line}"
        );
        s.cost_ns = 150_000_000;
        s.swept_back = 480;
        let line = guarantee_line(&g, &s);
        assert!(
            line.contains("BUDGET NOT MET: the shield cost 15.0%"),
            "{line}"
        );
        assert!(line.contains("480 of 500 pages swept came back"), "{line}");
        s.program_ns = 100_000_000;
        let line = guarantee_line(&g, &s);
        assert!(
            line.contains("100 ms on the program's threads")
                && line.contains("most of it was wiping the memory the program freed"),
            "{line}"
        );
        s.alloc_ns = 120_000_000;
        s.alloc_calls = 6_000_000;
        s.alloc_call_ns = 20;
        s.program_ns = 10_000_000;
        let line = guarantee_line(&g, &s);
        assert!(
            line.contains(
                "120 ms in memveil's allocator beyond the C library's (6000000 calls at 20 ns)"
            ) && line.contains("most of it was memveil's allocator, which takes 20 ns a call more"),
            "{line}"
        );
        s.alloc_ns = 0;
        s.program_ns = 100_000_000;
        let bound = Guarantee {
            window: Some(4096),
            ..Guarantee::default()
        };
        let line = guarantee_line(&bound, &s);
        assert!(
            line.starts_with("guarantee: plaintext bound 4096 pages per process (fixed)"),
            "{line}"
        );
        assert!(!line.contains("BUDGET"), "{line}");
        assert_eq!(bound.name(), "bound");
        assert_eq!(g.name(), "budget");
        for l in [guarantee_line(&g, &s), guarantee_line(&bound, &s)] {
            assert!(!l.contains("  ") && !l.contains('\n'), "{l:?}");
        }
    }

    #[test]
    fn budget_advice_names_a_larger_budget_and_estimates_a_hard_bound() {
        let g = Guarantee {
            budget: Some(10),
            ..Guarantee::default()
        };
        // Mostly plaintext, the sweep held back 340 ms, swept pages back
        // after 200 ms on average.
        let s = snap(|s| {
            s.alive_ms = 2000;
            s.plaintext_page_ms = 2000 * 8000;
            s.data_page_ms = 2000 * 10_000;
            s.max_sweep_lag_ms = 340;
            s.swept = 1000;
            s.swept_back = 900;
            s.back_away_ms = 900 * 200;
            s.handoffs = 1000;
            s.handler_ns = 5_000_000;
            s.fault_floor_ns = 10_000;
        });
        let line = advice(&g, &s, 2.0).expect("advice");
        assert!(
            line.starts_with("more protection: the data was 80.0% plaintext"),
            "{line}"
        );
        assert!(
            line.contains("--max-overhead 20% (due pages waited up to 340 ms"),
            "{line}"
        );
        // 5500 pages beyond a quarter, touched every 200 ms for 2 s: 55k
        // faults at 15 us: 0.8 s.
        assert!(
            line.contains("--max-plaintext 25%: at least 55000 faults (0.8 s, 0.4x this run)"),
            "{line}"
        );
        assert!(!line.contains("  ") && !line.contains('\n'), "{line:?}");
        // Little plaintext and no wait: nothing to say.
        let calm = snap(|s| {
            s.alive_ms = 1000;
            s.plaintext_page_ms = 100_000;
            s.data_page_ms = 1_000_000;
        });
        assert_eq!(advice(&g, &calm, 1.0), None);
    }
}
