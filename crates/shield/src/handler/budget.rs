//! The cost budget's side of the handler (see [`crate::sweep`]): the sweep
//! step the watchdog runs, what faults and sweeps have cost, the scan that
//! registers chunks holding data with the userfaultfd (lazily registered
//! ranges), and giving chunks back when they empty or the budget is spent.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::PoisonError;
use std::time::Instant;

use memveil_sys::uffd;

use super::Inner;
use crate::host::Hold;
use crate::state::{State, CHUNK_PAGES};
use crate::sweep::Sweep;
use crate::{nanos, PAGE};

/// Most pages one sweep step evicts under the lock, in at most
/// [`crate::state::MAX_RUNS`] runs of neighbours (each run one move and one
/// TLB shootdown, 20-30 µs on the AMD host; each page about 1 µs of
/// encryption and bookkeeping): a step of 256 pages in a few long runs holds
/// the lock about as long as a step of 64 single-page runs (a chunk's block
/// probes) did at 64 pages a step. The cold server's evictions cost 2.06-2.12
/// µs a page with it, 2.37-2.44 with 64 (docs/shield.md, "A cold start").
pub(crate) const SWEEP_BATCH: usize = 256;

/// How soon a sweep held back for another program's colder pages looks
/// again (ms; bids live [`crate::host::BID_MS`]).
const HOST_COLDER_WAIT_MS: u64 = 50;

/// Zero fills in a registered chunk that make it worth giving back when the
/// budget is spent (see [`Inner::release_quiet_chunks`]).
const RELEASE_ZERO_FILLS: u16 = 16;

/// What the shield has cost so far, in ns.
struct CostParts {
    /// What the shield has cost the program so far: the wall time
    /// its threads lost against a plain run (the summary's cost). Per
    /// fault the faulting thread waits for a hand-off ([`Budget::fault_ns`]:
    /// the kernel's path and the wake-ups, measured at start), for the
    /// handler to get a CPU ([`crate::cpu::ShieldCpu::handler_wait_ns`]),
    /// for the shield's lock (the watchdog's sweep step or scan holding it:
    /// [`crate::Counters::handler_lock_ns`]) and for the handler's work (its
    /// thread clock: all its CPU is spent on faults; its timed sections
    /// are not used, as they also hold the woken program's run when it
    /// preempts the `SCHED_IDLE` handler before the section ends); the
    /// watchdog and the zero filler cost it only the CPU its threads
    /// waited for meanwhile ([`crate::loss`]); and the shield's work on
    /// its own threads (discards, which wipe freed pages; the allocator's
    /// notes) is its time, and so is what the preload's allocator takes
    /// beyond the C library's ([`crate::Counters::alloc_ns`]). Never more
    /// than `host`.
    loss: u64,
    /// In CPU time of the host: what the budgets draw.
    host: u64,
    /// CPU time of the shield's threads.
    threads: u64,
}

/// What a sweep step left.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SweepStep {
    /// A full batch left: more pages may be due now.
    pub(crate) more: bool,
    /// Due pages wait for the budget.
    pub(crate) waiting: bool,
    /// Milliseconds until the next queued page is due.
    pub(crate) next_due_ms: Option<u64>,
    /// Held back for the host's budget: look again in this many ms.
    pub(crate) host_wait_ms: Option<u64>,
}

impl Inner {
    /// Milliseconds since the shield started, without the lock.
    pub(crate) fn lock_free_now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Wakes the watchdog now (a page came in that is due before it would
    /// have looked).
    pub(super) fn poke_guard(&self) {
        self.poked.store(true, Ordering::Release);
        let _g = self
            .guard_stop
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.guard_wake.notify_all();
    }

    /// What the shield has cost in CPU time of the host so far, in ns: the
    /// CPU time of the shield's threads (the handler, the watchdog's sweeps
    /// and scans, the zero pool's filler: their thread clocks, wake-ups and
    /// system calls included; never less than their timed sections), a
    /// hand-off per fault, the handler's wait for a CPU while a fault waited
    /// ([`crate::cpu::ShieldCpu::handler_wait_ns`]), and the
    /// shield's work on the program's own threads. The budgets, the
    /// process's own bucket and the host's ledger, draw this: on an idle
    /// CPU the sweep costs the program nothing, but the CPU is the host's
    /// (18 programs' sweeps fill both CPUs), and a budget that drew only
    /// the program's loss swept more and lost more (docs/shield.md, "What
    /// the summary's cost is").
    pub(crate) fn drawn_ns(&self) -> u64 {
        self.cost_parts().host
    }

    /// What the shield has cost so far, in its parts.
    fn cost_parts(&self) -> CostParts {
        let c = self.stats.counters();
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let floor = self.budget.map_or(0, |b| b.fault_ns);
        let threads = self.cpu.total_ns();
        let timed = g(&c.handler_ns).saturating_add(g(&c.sweep_ns));
        let common = g(&c.handoffs)
            .saturating_mul(floor)
            .saturating_add(self.cpu.handler_wait_ns())
            .saturating_add(g(&c.program_ns))
            .saturating_add(g(&c.alloc_ns));
        let host = common.saturating_add(threads.max(timed));
        // The agent runs only while a program's thread waits for its
        // answer: all its CPU is the program's loss, as the handler's is.
        let loss = common
            .saturating_add(self.cpu.handler_ns())
            .saturating_add(self.cpu.agent_ns())
            .saturating_add(g(&c.handler_lock_ns))
            .saturating_add(self.contention.ns());
        CostParts {
            loss: loss.min(host),
            host,
            threads,
        }
    }

    /// How long the program's threads were held up in the shield's faults
    /// so far, in ns, from counters alone (read under the lock at each
    /// batch and sweep step): per batch a hand-off ([`Budget::fault_ns`]),
    /// the handler's timed section (its work and its wait for the lock),
    /// its wait for a CPU while a fault waited, and the faulting thread's
    /// wait for a CPU once woken ([`crate::cpu::post_wake_wait`], a thread
    /// that faults alone twice in a row). Batches, not faults: a
    /// batch of several threads' faults holds the program once, so this
    /// grows no faster than wall time (the handler is one thread). What
    /// [`crate::sweep::HeldLog`] takes off a swept page's time out.
    pub(crate) fn held_ns(&self) -> u64 {
        let c = self.stats.counters();
        let batches = self.progress.load(Ordering::Acquire) / 2;
        batches
            .saturating_mul(self.budget.map_or(0, |b| b.fault_ns))
            .saturating_add(c.handler_ns.load(Ordering::Relaxed))
            .saturating_add(self.cpu.handler_wait_ns())
            .saturating_add(self.cpu.woken_wait_ns())
    }

    /// Counts the time since `t0` as the shield's work on a thread of the
    /// program ([`crate::Counters::program_ns`]).
    pub(crate) fn program_time(&self, t0: Instant) {
        self.program_time_less(t0, std::time::Duration::ZERO);
    }

    /// As [`Inner::program_time`], less `release`: the kernel's release of
    /// the frames a discard gave back, which the program pays in a plain
    /// run too (its `munmap` or `free` of the same memory), counted apart
    /// ([`crate::Counters::release_ns`]) and in no cost. A 1 GiB block
    /// with 24 MiB written, freed: 2.1-2.5 ms plain, 5.1-6.0 ms under the
    /// shield, all of which was counted. Not in `program_ns` on the agent:
    /// its thread clock counts its work already.
    pub(crate) fn program_time_less(&self, t0: Instant, release: std::time::Duration) {
        let c = self.stats.counters();
        let took = t0.elapsed();
        c.release_ns
            .fetch_add(nanos(release.min(took)), Ordering::Relaxed);
        if crate::cpu::on_agent() {
            return;
        }
        c.program_ns
            .fetch_add(nanos(took.saturating_sub(release)), Ordering::Relaxed);
    }

    /// Adds the plaintext and data pages since the last call, times the
    /// milliseconds passed, to the statistics (the time-weighted plaintext
    /// fraction), counts those milliseconds as the process's time under the
    /// shield, and publishes what the shield has cost so far. Called by the
    /// watchdog every tick and once more as the process exits
    /// ([`crate::Shield::flush_stats`], `last`: the program's threads' wait
    /// for a CPU is read then however recently it was read); whichever call
    /// moves `alive_ms` first adds the interval, so none is counted twice.
    pub(crate) fn integrate(&self, last: bool) {
        let c = self.stats.counters();
        let now = self.lock_free_now_ms();
        let was = c.alive_ms.load(Ordering::Acquire);
        if now > was
            && c.alive_ms
                .compare_exchange(was, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            let ms = now - was;
            let resident = c.resident.load(Ordering::Relaxed);
            let data = resident + c.evicted.load(Ordering::Relaxed);
            c.plaintext_page_ms
                .fetch_add(resident.saturating_mul(ms), Ordering::Relaxed);
            c.data_page_ms
                .fetch_add(data.saturating_mul(ms), Ordering::Relaxed);
        }
        // Every part only grows: the largest of each published belong to the
        // same (latest) reading.
        // The watchdog's and the filler's CPU: all but the handler's and
        // the agent's (both counted whole).
        let background = self
            .cpu
            .total_ns()
            .saturating_sub(self.cpu.handler_ns())
            .saturating_sub(self.cpu.agent_ns());
        self.contention.look(background, last);
        let p = self.cost_parts();
        c.handler_wait_ns
            .fetch_max(self.cpu.handler_wait_ns(), Ordering::Relaxed);
        c.contention_ns
            .fetch_max(self.contention.ns(), Ordering::Relaxed);
        c.cost_ns.fetch_max(p.loss, Ordering::Relaxed);
        c.host_cost_ns.fetch_max(p.host, Ordering::Relaxed);
        c.shield_cpu_ns.fetch_max(p.threads, Ordering::Relaxed);
        c.agent_ns.fetch_max(self.cpu.agent_ns(), Ordering::Relaxed);
    }

    /// What sweeping a page is expected to cost, in ns: the share of swept
    /// pages that came back so far (a half to start with; at least 1 in 20:
    /// a page may come back later) times what the pages brought in so far cost each (hand-offs
    /// and the handler's CPU over pages: a fault that continues a sequential scan
    /// brings a run of them; a whole fault per page before there is
    /// history).
    #[allow(clippy::cast_precision_loss)]
    pub(super) fn sweep_price(&self) -> (f64, f64) {
        let c = self.stats.counters();
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let faults = g(&c.handoffs);
        let pages = g(&c.faults_in) + g(&c.readahead) + g(&c.zero_fills) + g(&c.prefill);
        let floor = self.budget.map_or(0, |b| b.fault_ns) as f64;
        // The handler's CPU, as `cost_ns` counts it (its thread clock).
        let handler = g(&c.handler_ns).max(self.cpu.handler_ns());
        let per_page = if faults < 16 || pages == 0 {
            floor + 3_000.0
        } else {
            (floor * faults as f64 + handler as f64) / pages as f64
        };
        // Half, until 64 sweeps say otherwise.
        let back = (g(&c.swept_back) as f64 + 32.0) / (g(&c.swept) as f64 + 64.0);
        // A page known quiet comes back twice per quiet spell at most (its
        // quick sweeps' history scales this up: `State::due`).
        (
            per_page * back.clamp(0.05, 1.0),
            per_page * crate::sweep::QUIET_BACK_FLOOR,
        )
    }

    /// One step of the sweep: up to [`SWEEP_BATCH`] pages whose period has
    /// ended leave (encrypted), as far as the budget allows.
    pub(crate) fn sweep_step(&self, st: &mut State) -> SweepStep {
        let t0 = Instant::now();
        let now = st.now_ms();
        let cost = self.drawn_ns();
        let (fault_ns, quiet_ns) = self.sweep_price();
        let Some(sw) = st.sweep.as_mut() else {
            return SweepStep::default();
        };
        sw.credit.refill(now, cost);
        sw.held.set(self.held_ns());
        let hold = self.host_hold(sw, now, cost);
        // Held for the host's budget, only long quiet pages leave (a few:
        // `sweep::DEBT_PAGES`).
        let (victims, lag) = if st.frozen {
            (Vec::new(), 0)
        } else {
            let (v, lag) = st.due(SWEEP_BATCH, now, fault_ns, quiet_ns, hold.is_some());
            (v, hold.map_or(lag, |(_, lag)| lag))
        };
        let done = self.evict_list(st, &victims, true);
        // Known quiet pages the budget left (spent, or held for the host):
        // the floor's quick sweeps (`sweep::QuickFloor`).
        let floor = if st.frozen {
            Vec::new()
        } else {
            st.due_floor(SWEEP_BATCH, now)
        };
        let floor_done = if floor.is_empty() {
            0
        } else {
            self.evict_list(st, &floor, true)
        };
        // In debt: the chunks that hold no ciphertext go back to the kernel
        // (their first touches, which would be hand-offs, cost what plain
        // page faults cost), at most every scan period.
        let host_debt = matches!(hold, Some((Hold::Spent(_), _)));
        let debt = st.sweep.as_ref().is_some_and(|sw| {
            (sw.credit.room(0.0) < 0.0 || host_debt) && now >= sw.released_at + 50
        });
        if self.lazy && debt {
            self.release_quiet_chunks(st);
            if let Some(sw) = st.sweep.as_mut() {
                sw.released_at = now;
            }
        }
        let mut top = 0;
        if let Some(sw) = st.sweep.as_mut() {
            let cost = if victims.is_empty() {
                0.0
            } else {
                #[allow(clippy::cast_precision_loss)]
                let share = done as f64 / victims.len() as f64;
                sw.reserving * share
            };
            sw.pending.swept(now, done, cost);
            top = sw.longest_period_ms();
        }
        self.publish(st);
        let c = self.stats.counters();
        c.swept
            .fetch_add((done + floor_done) as u64, Ordering::Relaxed);
        c.sweep_lag_ms.store(lag, Ordering::Relaxed);
        c.max_sweep_lag_ms.fetch_max(lag, Ordering::Relaxed);
        c.max_period_ms.store(top, Ordering::Relaxed);
        c.sweep_ns.fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
        SweepStep {
            more: st.sweep.as_ref().is_some_and(|s| s.full) && !victims.is_empty(),
            waiting: lag > 0 || hold.is_some(),
            next_due_ms: st.sweep.as_ref().and_then(|s| s.next_due_ms(now)),
            host_wait_ms: hold.map(|(h, _)| match h {
                Hold::Spent(ms) => ms,
                Hold::Colder => HOST_COLDER_WAIT_MS,
            }),
        }
    }

    /// Draws what the shield has cost so far from the host's budget,
    /// publishes its coldest due class, and says whether the sweep must
    /// wait for the host (and how long its first due page has waited).
    fn host_hold(&self, sw: &Sweep, now: u64, cost: u64) -> Option<(Hold, u64)> {
        let host = self.host.as_ref()?;
        let mine = crate::host::coldest_due(sw, now);
        let mut h = host.lock().unwrap_or_else(PoisonError::into_inner);
        let hold = h.step(cost, mine.map(|m| m.0));
        self.host_open.store(h.open(), Ordering::Relaxed);
        drop(h);
        let hold = hold?;
        let c = self.stats.counters();
        match hold {
            Hold::Spent(_) => c.host_waits.fetch_add(1, Ordering::Relaxed),
            Hold::Colder => c.host_colder.fetch_add(1, Ordering::Relaxed),
        };
        Some((hold, mine.map_or(0, |m| m.1)))
    }

    /// Scans the chunks of lazily registered ranges not registered yet:
    /// counts their resident pages (plaintext the shield does not track page
    /// by page), and registers those that have held data for the shortest
    /// sweep period, finding their resident pages, which the sweep then
    /// takes as having come in when the data was first seen. `mincore` runs
    /// without the lock, 64 MiB at a time into `scratch`.
    pub(crate) fn scan_chunks(&self, scratch: &mut uffd::DirectMap) {
        const STEP: usize = 16 * 1024;
        let t0 = Instant::now();
        // Never waits for the lock (the watchdog calls this): a step whose
        // lock is taken is left for the next scan. The steps: runs of
        // chunks in use and not registered, as `(range, first page, pages)`.
        let steps: Vec<(usize, usize, usize, usize)> = {
            let Some(st) = self.try_lock() else {
                return;
            };
            let mut steps = Vec::new();
            for (pos, r) in st.ranges.iter().enumerate() {
                let Some(ch) = r.chunks.as_ref() else {
                    continue;
                };
                let mut c = 0;
                while c < ch.registered.len() {
                    if ch.registered[c] || !ch.in_use[c] {
                        c += 1;
                        continue;
                    }
                    let first = c;
                    while c < ch.registered.len()
                        && !ch.registered[c]
                        && ch.in_use[c]
                        && (c + 1 - first) * CHUNK_PAGES <= STEP
                    {
                        c += 1;
                    }
                    let a = first * CHUNK_PAGES;
                    let b = (c * CHUNK_PAGES).min(r.pages);
                    steps.push((pos, r.base, a, b - a));
                }
            }
            steps
        };
        for (pos, base, i, n) in steps {
            let n = n.min(scratch.as_mut_slice().len());
            let v = &mut scratch.as_mut_slice()[..n];
            if uffd::resident_pages(base + i * PAGE, n * PAGE, v).is_err() {
                continue;
            }
            let Some(mut st) = self.try_lock() else {
                continue;
            };
            let now = st.now_ms();
            if st.ranges.get(pos).is_none_or(|r| r.base != base) {
                continue;
            }
            // Registering is what makes later first touches in the chunk
            // hand-offs: not while the budget is spent.
            let cost = self.drawn_ns();
            let afford = st.sweep.as_mut().is_some_and(|sw| {
                sw.credit.refill(now, cost);
                sw.credit.room(0.0) > 0.0
            }) && self.host_open.load(Ordering::Relaxed);
            for k in (0..n).step_by(CHUNK_PAGES) {
                let c = (i + k) / CHUNK_PAGES;
                let Some(ch) = st.ranges[pos].chunks.as_mut() else {
                    break;
                };
                if ch.registered[c] {
                    continue;
                }
                let m = CHUNK_PAGES.min(n - k);
                let found = v[k..k + m].iter().filter(|b| *b & 1 != 0).count();
                ch.unseen[c] = u16::try_from(found).unwrap_or(u16::MAX);
                if found == 0 {
                    ch.seen[c] = 0;
                } else if ch.seen[c] == 0 {
                    ch.seen[c] = now + 1;
                } else if afford && now + 1 - ch.seen[c] >= crate::sweep::REGISTER_AFTER_MS {
                    let since = ch.seen[c] - 1;
                    self.register_chunk(&mut st, pos, c, since);
                }
            }
            st.unseen = st
                .ranges
                .iter()
                .filter_map(|r| r.chunks.as_ref())
                .flat_map(|c| c.unseen.iter())
                .map(|&u| usize::from(u))
                .sum();
        }
        self.stats
            .counters()
            .sweep_ns
            .fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
    }

    /// Registers chunk `c` of range `pos` with the userfaultfd and books the
    /// pages it holds as resident since `since_ms`.
    pub(super) fn register_chunk(&self, st: &mut State, pos: usize, c: usize, since_ms: u64) {
        let r = &st.ranges[pos];
        let a = c * CHUNK_PAGES;
        let b = (a + CHUNK_PAGES).min(r.pages);
        let (addr, len) = (r.addr(a), (b - a) * PAGE);
        if let Err(e) = self.served(self.uffd.register(
            addr as u64,
            len as u64,
            uffd::MODE_MISSING | uffd::MODE_WP,
        )) {
            let n = self
                .stats
                .counters()
                .register_failures
                .fetch_add(1, Ordering::Relaxed);
            if n == 0 {
                eprintln!(
                    "memveil-shield: cannot register {addr:#x}+{len:#x} with the userfaultfd ({e}): \
                     its pages stay plaintext (counted as register_failures)"
                );
            }
            return;
        }
        // Registered first, then looked at: a page the program touches from
        // now on faults to the handler, which waits for this lock.
        let present = st.ranges[pos].present(a, b).unwrap_or_default();
        if let Some(ch) = st.ranges[pos].chunks.as_mut() {
            ch.registered[c] = true;
            ch.seen[c] = 0;
            ch.unseen[c] = 0;
        }
        for i in present {
            st.mark_found(pos, i, since_ms);
        }
        self.stats
            .counters()
            .chunks_registered
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Unregisters every lazily registered chunk holding no evicted page in
    /// which the program keeps allocating (the budget is spent, and there
    /// [`RELEASE_ZERO_FILLS`] or more never-written pages were filled by
    /// the handler since it was registered: each was a hand-off the kernel
    /// would have served as a plain page fault): its resident pages are no
    /// longer tracked page by page (they keep the level they learnt), the
    /// scan counts them again, and registers the chunk again once the
    /// budget allows. Chunks of data in use stay registered.
    pub(super) fn release_quiet_chunks(&self, st: &mut State) {
        let mut released = 0u64;
        for pos in 0..st.ranges.len() {
            let chunks = st.ranges[pos]
                .chunks
                .as_ref()
                .map_or(0, |c| c.registered.len());
            for c in 0..chunks {
                let r = &st.ranges[pos];
                let Some(ch) = r.chunks.as_ref() else { break };
                if !ch.registered[c] || ch.evicted[c] != 0 || ch.zero_fills[c] < RELEASE_ZERO_FILLS
                {
                    continue;
                }
                let a = c * CHUNK_PAGES;
                let b = (a + CHUNK_PAGES).min(r.pages);
                if self
                    .uffd
                    .unregister(r.addr(a) as u64, ((b - a) * PAGE) as u64)
                    .is_err()
                {
                    continue;
                }
                let dropped = st.ranges[pos].forget_chunk(c);
                st.resident -= dropped;
                released += 1;
            }
        }
        if released > 0 {
            self.stats
                .counters()
                .chunks_unregistered
                .fetch_add(released, Ordering::Relaxed);
            self.publish(st);
        }
    }

    /// Unregisters the lazily registered chunks `emptied` (as `(range,
    /// chunk)`, from [`State::discard`]) that still hold no data: the
    /// program's next touches there are the kernel's own faults again.
    pub(crate) fn unregister_empty(&self, st: &mut State, emptied: &[(usize, usize)]) {
        for &(pos, c) in emptied {
            let r = &mut st.ranges[pos];
            let Some(ch) = r.chunks.as_mut() else {
                continue;
            };
            if !ch.registered[c] || ch.live[c] != 0 {
                continue;
            }
            let a = c * CHUNK_PAGES;
            let b = (a + CHUNK_PAGES).min(r.pages);
            let (addr, len) = (r.addr(a), (b - a) * PAGE);
            if self.uffd.unregister(addr as u64, len as u64).is_ok() {
                if let Some(ch) = r.chunks.as_mut() {
                    ch.registered[c] = false;
                }
                self.stats
                    .counters()
                    .chunks_unregistered
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
