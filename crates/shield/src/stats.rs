//! Counters of a shield, kept in a small shared file so that `memveil run`
//! can show them live while the protected program runs, and sum the files of
//! every process the program starts.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use memveil_sys::uffd;

const MAGIC: u64 = 0x6d76_7368_6c64_0006; // "mvshld" v6

/// Buckets of [`Counters::refault_ages`]: bucket 0 counts refaults of pages
/// that left the window fewer than 256 evictions before, bucket `k` (1 to
/// 14) those that left `[2^(k+7), 2^(k+8))` evictions before, the last all
/// older ones.
pub const AGE_BUCKETS: usize = 16;

/// The bucket of [`Counters::refault_ages`] a refault `age` evictions
/// after its page left the window counts in.
#[must_use]
pub fn age_bucket(age: u32) -> usize {
    match age.checked_ilog2() {
        Some(l) if l >= 8 => (l as usize - 7).min(AGE_BUCKETS - 1),
        _ => 0,
    }
}

/// The first age past bucket `k` of [`Counters::refault_ages`] (`None` for
/// the last, which has no end): a window larger by that many pages would
/// have kept every page refaulted in buckets `0..=k`, replacement being
/// close to least-recently-used.
#[must_use]
pub fn age_bucket_end(k: usize) -> Option<u64> {
    (k + 1 < AGE_BUCKETS).then(|| 1u64 << (k + 8))
}

/// The counters, as laid out in the shared file (all little-endian u64).
#[repr(C)]
#[derive(Default)]
pub struct Counters {
    /// Identifies the layout.
    pub magic: AtomicU64,
    /// Process id of the protected process.
    pub pid: AtomicU64,
    /// Window in pages.
    pub window: AtomicU64,
    /// 1 = uffd-move, 2 = uffd-wp.
    pub mechanism: AtomicU64,
    /// 1 = keys in memfd_secret memory, 2 = locked memory only.
    pub level: AtomicU64,
    /// Pages in protected ranges.
    pub pages_protected: AtomicU64,
    /// Plaintext pages now.
    pub resident: AtomicU64,
    /// Ciphertext (evicted) pages now.
    pub evicted: AtomicU64,
    /// Most plaintext pages at once.
    pub max_resident: AtomicU64,
    /// Evicted pages decrypted back on a fault.
    pub faults_in: AtomicU64,
    /// Never-touched (or discarded) pages filled with zeros on a fault.
    pub zero_fills: AtomicU64,
    /// Pages evicted.
    pub evictions: AtomicU64,
    /// Of those, evicted by write-protection (frame freed unwiped).
    pub wp_evictions: AtomicU64,
    /// Faults found already resolved.
    pub spurious: AtomicU64,
    /// Pages discarded by the program (munmap, MADV_DONTNEED).
    pub discards: AtomicU64,
    /// Time the handler spent resolving faults (ns, includes evictions;
    /// from reading a batch of faults to just before waking their threads).
    pub handler_ns: AtomicU64,
    /// Time spent evicting (ns).
    pub evict_ns: AtomicU64,
    /// Time spent in `UFFDIO_COPY`, which wakes the faulting thread (ns).
    pub copy_ns: AtomicU64,
    /// Times the handler moved to the faulting thread's CPU.
    pub handler_moves: AtomicU64,
    /// The most pages the window may hold now (its bound; the window itself
    /// for a fixed one).
    pub bound: AtomicU64,
    /// 1 when the window adapts to the working set.
    pub adaptive: AtomicU64,
    /// The largest the window has been.
    pub max_window: AtomicU64,
    /// Faults on pages evicted so recently that a window within the bound
    /// would have kept them (each grows an adaptive window by a page).
    pub near_misses: AtomicU64,
    /// Evicted pages brought back ahead of a sequential scan.
    pub readahead: AtomicU64,
    /// Never-written pages filled with zeros ahead of a sequential scan.
    pub prefill: AtomicU64,
    /// Times the watchdog found the `SCHED_IDLE` handler starved and made it
    /// normal again.
    pub idle_rescues: AtomicU64,
    /// 1 while the handler runs at `SCHED_IDLE`.
    pub handler_idle: AtomicU64,
    /// `UFFDIO_MOVE` calls that evicted pages (a run of neighbours takes one).
    pub evict_moves: AtomicU64,
    /// Bytes of shared memory (`MAP_SHARED|MAP_ANONYMOUS`, memfd, System V)
    /// the program mapped and was let through unprotected, as the user
    /// accepted (`memveil run --shared-memory unprotected`).
    pub shared_unprotected: AtomicU64,
    /// Bytes of shared anonymous memory this process created protected for
    /// every process that maps it (`--shared-memory protected`), in all.
    pub shared_protected: AtomicU64,
    /// Of those, plaintext pages now.
    pub shared_resident: AtomicU64,
    /// Of those, ciphertext pages now.
    pub shared_evicted: AtomicU64,
    /// Evicted shared pages decrypted back on a fault (in any process).
    pub shared_faults_in: AtomicU64,
    /// Shared pages evicted.
    pub shared_evictions: AtomicU64,
    /// The most processes whose views of this process's shared memory the
    /// handler served at once (this one and its forked descendants).
    pub shared_views: AtomicU64,
    /// The most pages holding data (plaintext and ciphertext) at once.
    pub max_data: AtomicU64,
    /// Pages of the pool of zeroed frames (0: no pool).
    pub pool_pages: AtomicU64,
    /// Never-written pages filled with a frame from the pool (the others
    /// were copied in).
    pub pool_fills: AtomicU64,
    /// Faults handed to the handler (every kind; each costs the faulting thread a hand-off).
    pub handoffs: AtomicU64,
    /// The cost budget in percent of the program's time (0: none).
    pub budget_percent: AtomicU64,
    /// The hand-off a fault costs beyond the handler's work, as the budget counts it (ns).
    pub fault_floor_ns: AtomicU64,
    /// 1 when chunks are registered as the sweep needs them (a budget without a bound).
    pub lazy: AtomicU64,
    /// Pages evicted by the sweep (idle past their period).
    pub swept: AtomicU64,
    /// Of those, pages that came back (touched again).
    pub swept_back: AtomicU64,
    /// Time the sweep spent scanning and evicting (ns).
    pub sweep_ns: AtomicU64,
    /// How long the most overdue page has waited for the budget, now (ms).
    pub sweep_lag_ms: AtomicU64,
    /// The longest such wait (ms).
    pub max_sweep_lag_ms: AtomicU64,
    /// The longest sweep period pages are queued at now (ms).
    pub max_period_ms: AtomicU64,
    /// What the shield has cost the program in wall time against a plain
    /// run (ns): the summary's cost (the budgets draw `host_cost_ns`).
    pub cost_ns: AtomicU64,
    /// Chunks registered with the userfaultfd as the sweep needed them.
    pub chunks_registered: AtomicU64,
    /// Chunks unregistered again once all their pages went back to the kernel.
    pub chunks_unregistered: AtomicU64,
    /// Chunks the kernel refused to register (their pages stay plaintext).
    pub register_failures: AtomicU64,
    /// Plaintext pages integrated over time (page-ms), from the watchdog's ticks.
    pub plaintext_page_ms: AtomicU64,
    /// Pages holding data integrated over time (page-ms).
    pub data_page_ms: AtomicU64,
    /// Milliseconds the watchdog has integrated over (the process's life
    /// under the shield, near enough).
    pub alive_ms: AtomicU64,
    /// How long the swept pages that came back had stayed out, summed (ms).
    pub back_away_ms: AtomicU64,
    /// Decrypting faults by how many evictions ago the page left the window
    /// (see [`age_bucket`]): how much larger a window would have had to be
    /// to keep it.
    pub refault_ages: [AtomicU64; AGE_BUCKETS],
    /// CPU time of the shield's own threads (handler, watchdog, zero
    /// filler), from their thread CPU clocks (ns).
    pub shield_cpu_ns: AtomicU64,
    /// Time the shield's calls took on the program's threads (discards,
    /// which wipe freed pages; the allocator's notes of memory in use), ns,
    /// less the frames' release (`release_ns`).
    pub program_ns: AtomicU64,
    /// 1 when the process draws on the host's budget (the ledger of
    /// `memveil run`), 0 when on its own budget only.
    pub host_joined: AtomicU64,
    /// Sweep steps held back because the host's budget was spent.
    pub host_waits: AtomicU64,
    /// Sweep steps held back for another program's colder pages.
    pub host_colder: AtomicU64,
    /// Time the fault handler waited for a CPU, runnable but off it (its
    /// `schedstat` run delay), ns: faults waited that long (in `cost_ns`).
    pub handler_wait_ns: AtomicU64,
    /// Quick sweeps: pages known quiet swept `QUICK_MS` (2 ms)
    /// after they came in.
    pub quick_swept: AtomicU64,
    /// Pages of quick sweeps that came back within
    /// `PENDING_MS` (400 ms) (each a fault the quick sweep bought).
    pub quick_back: AtomicU64,
    /// What the shield has cost in CPU time of the host (ns): the budgets,
    /// the process's and the host's, draw this (see
    /// [`Snapshot::host_cost_ns`]).
    pub host_cost_ns: AtomicU64,
    /// The program's threads' wait for a CPU behind the watchdog and the
    /// zero filler (ns, in `cost_ns`; see `crate::loss`).
    pub contention_ns: AtomicU64,
    /// Time the fault handler waited for the shield's lock with faults in
    /// hand (ns, in `cost_ns`).
    pub handler_lock_ns: AtomicU64,
    /// Calls of the preload's allocator on the program's threads (counted
    /// in batches; see [`crate::Shield::count_allocator`]).
    pub alloc_calls: AtomicU64,
    /// What those calls took beyond the C library's allocator, ns: the
    /// calls times the measured difference per call (in `cost_ns`).
    pub alloc_ns: AtomicU64,
    /// The measured difference per call, ns to the nearest (0 until
    /// measured; the latest figure: it is refined over the run).
    pub alloc_call_ns: AtomicU64,
    /// Times the watchdog kept the handler normal, its back-off over,
    /// because the host's CPUs were contended (see `handler::guard`).
    pub idle_held: AtomicU64,
    /// Time the discards' `MADV_DONTNEED` of the span took on the program's
    /// threads, ns: the kernel giving the frames back, which a plain run
    /// pays in its own `munmap` or `free` of the same memory (not in
    /// `program_ns` nor in any cost).
    pub release_ns: AtomicU64,
    /// Memory calls of the program the loader's agent served (seccomp
    /// notifications it answered; see [`crate::Shield::count_served`]).
    pub served_calls: AtomicU64,
    /// CPU time of the loader's agent, from its thread clock (ns; in
    /// `shield_cpu_ns` and `cost_ns`: the caller waits for every answer).
    pub agent_ns: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Snapshot {
    /// Processes summed (1 for one shield).
    pub processes: u64,
    /// Window in pages now (summed over processes).
    pub window: u64,
    /// "uffd-move" or "uffd-wp".
    #[serde(skip)]
    pub mechanism: u64,
    /// 1 = secret, 2 = locked.
    #[serde(skip)]
    pub level: u64,
    /// Pages in protected ranges.
    pub pages_protected: u64,
    /// Plaintext pages.
    pub resident_pages: u64,
    /// Ciphertext pages.
    pub evicted_pages: u64,
    /// Most plaintext pages at once.
    pub max_resident: u64,
    /// Decrypting faults.
    pub faults_in: u64,
    /// Zero-fill faults.
    pub zero_fills: u64,
    /// Evictions.
    pub evictions: u64,
    /// Write-protect evictions.
    pub wp_evictions: u64,
    /// Faults found already resolved.
    pub spurious: u64,
    /// Pages discarded by the program.
    pub discards: u64,
    /// Handler time, ns.
    pub handler_ns: u64,
    /// Eviction time, ns.
    pub evict_ns: u64,
    /// Time in `UFFDIO_COPY` (maps the page and wakes the waiter), ns.
    pub copy_ns: u64,
    /// Times the handler moved to the faulting thread's CPU.
    pub handler_moves: u64,
    /// The window's bound now, in pages (summed over processes).
    pub bound: u64,
    /// Processes whose window adapts.
    pub adaptive: u64,
    /// The largest window (summed over processes).
    pub max_window: u64,
    /// Faults a window within the bound would have saved.
    pub near_misses: u64,
    /// Evicted pages brought back ahead of a sequential scan.
    pub readahead: u64,
    /// Never-written pages zero-filled ahead of a sequential scan.
    pub prefill: u64,
    /// Times a starved `SCHED_IDLE` handler was made normal again.
    pub idle_rescues: u64,
    /// Processes whose handler runs at `SCHED_IDLE` now.
    pub handler_idle: u64,
    /// `UFFDIO_MOVE` calls that evicted pages.
    pub evict_moves: u64,
    /// Bytes of shared memory mapped unprotected, as the user accepted.
    pub shared_unprotected_bytes: u64,
    /// Bytes of shared anonymous memory kept protected.
    pub shared_protected_bytes: u64,
    /// Plaintext shared pages.
    pub shared_resident_pages: u64,
    /// Ciphertext shared pages.
    pub shared_evicted_pages: u64,
    /// Evicted shared pages decrypted back on a fault.
    pub shared_faults_in: u64,
    /// Shared pages evicted.
    pub shared_evictions: u64,
    /// Process views of protected shared memory served.
    pub shared_views: u64,
    /// The most pages holding data at once (summed over processes).
    pub max_data: u64,
    /// Pages of the pools of zeroed frames (summed over processes).
    pub pool_pages: u64,
    /// Never-written pages filled from a pool.
    pub pool_fills: u64,
    /// Faults handed to the handler (every kind; each costs the faulting thread a hand-off).
    pub handoffs: u64,
    /// The cost budget in percent of the program's time (0: none).
    pub budget_percent: u64,
    /// The hand-off a fault costs beyond the handler's work, as the budget counts it (ns).
    pub fault_floor_ns: u64,
    /// 1 when chunks are registered as the sweep needs them (a budget without a bound).
    pub lazy: u64,
    /// Pages evicted by the sweep (idle past their period).
    pub swept: u64,
    /// Of those, pages that came back (touched again).
    pub swept_back: u64,
    /// Time the sweep spent scanning and evicting (ns).
    pub sweep_ns: u64,
    /// How long the most overdue page has waited for the budget, now (ms).
    pub sweep_lag_ms: u64,
    /// The longest such wait (ms).
    pub max_sweep_lag_ms: u64,
    /// The longest sweep period pages are queued at now (ms).
    pub max_period_ms: u64,
    /// What the shield has cost the program in wall time against a plain
    /// run (ns): the summary's cost (the budgets draw `host_cost_ns`).
    pub cost_ns: u64,
    /// Chunks registered with the userfaultfd as the sweep needed them.
    pub chunks_registered: u64,
    /// Chunks unregistered again once all their pages went back to the kernel.
    pub chunks_unregistered: u64,
    /// Chunks the kernel refused to register (their pages stay plaintext).
    pub register_failures: u64,
    /// Plaintext pages integrated over time (page-ms), from the watchdog's ticks.
    pub plaintext_page_ms: u64,
    /// Pages holding data integrated over time (page-ms).
    pub data_page_ms: u64,
    /// Milliseconds the processes' watchdogs integrated over, summed.
    pub alive_ms: u64,
    /// How long the swept pages that came back had stayed out, summed (ms).
    pub back_away_ms: u64,
    /// Decrypting faults by how long ago their page left the window (see
    /// [`age_bucket`]).
    pub refault_ages: [u64; AGE_BUCKETS],
    /// CPU time of the shield's own threads (ns).
    pub shield_cpu_ns: u64,
    /// Time the shield's calls took on the program's threads (ns).
    pub program_ns: u64,
    /// Processes drawing on the host's budget.
    pub host_joined: u64,
    /// Sweep steps held back because the host's budget was spent.
    pub host_waits: u64,
    /// Sweep steps held back for another program's colder pages.
    pub host_colder: u64,
    /// Time the fault handler waited for a CPU (ns, in `cost_ns`).
    pub handler_wait_ns: u64,
    /// Quick sweeps of pages known quiet.
    pub quick_swept: u64,
    /// Of those, pages back within `PENDING_MS` (400 ms).
    pub quick_back: u64,
    /// What the shield has cost in CPU time of the host (ns): the CPU time
    /// of its threads (their timed sections at least), a hand-off per
    /// fault, the faults' wait for the handler and its work on the
    /// program's threads. The budgets draw this; `cost_ns` is the part the
    /// program loses in wall time, never more than this.
    pub host_cost_ns: u64,
    /// The program's threads' wait for a CPU behind the watchdog and the
    /// zero filler (ns, in `cost_ns`).
    pub contention_ns: u64,
    /// Time the fault handler waited for the shield's lock (ns, in `cost_ns`).
    pub handler_lock_ns: u64,
    /// Calls of the preload's allocator on the program's threads.
    pub alloc_calls: u64,
    /// What they took beyond the C library's allocator (ns, in `cost_ns`).
    pub alloc_ns: u64,
    /// The measured difference per call (ns; the largest over processes).
    pub alloc_call_ns: u64,
    /// Times the handler was kept normal because the host's CPUs were
    /// contended.
    pub idle_held: u64,
    /// The discards' release of frames on the program's threads (ns; a
    /// plain run pays it too: in no cost).
    pub release_ns: u64,
    /// Memory calls the loader's agent served.
    pub served_calls: u64,
    /// CPU time of the loader's agent (ns; in `shield_cpu_ns` and `cost_ns`).
    pub agent_ns: u64,
}

impl Snapshot {
    /// Plaintext pages over pages holding data (plaintext + ciphertext).
    #[must_use]
    pub fn plaintext_fraction(&self) -> f64 {
        let data = self.resident_pages + self.evicted_pages;
        if data == 0 {
            0.0
        } else {
            self.resident_pages as f64 / data as f64
        }
    }

    /// Plaintext pages over pages holding data, weighted by time over the
    /// run (the watchdog integrates both every tick); `None` before any.
    #[must_use]
    pub fn time_plaintext_fraction(&self) -> Option<f64> {
        (self.data_page_ms > 0).then(|| self.plaintext_page_ms as f64 / self.data_page_ms as f64)
    }

    /// What the shield cost the processes (`cost_ns`), as a share of their time
    /// under the shield (`None` before the watchdogs measured any).
    #[must_use]
    pub fn cost_fraction(&self) -> Option<f64> {
        self.share_of_life(self.cost_ns)
    }

    /// What the budgets drew (`host_cost_ns`, CPU time of the host), as a
    /// share of the processes' time under the shield (`None` as above).
    #[must_use]
    pub fn host_cost_fraction(&self) -> Option<f64> {
        self.share_of_life(self.host_cost_ns)
    }

    /// `ns` over the processes' time under the shield.
    fn share_of_life(&self, ns: u64) -> Option<f64> {
        (self.alive_ms > 0).then(|| ns as f64 / 1e6 / self.alive_ms as f64)
    }

    /// Faults of any kind (decrypting and zero-fill).
    #[must_use]
    pub fn faults(&self) -> u64 {
        self.faults_in + self.zero_fills
    }

    /// Name of the eviction mechanism.
    #[must_use]
    pub fn mechanism_name(&self) -> &'static str {
        match self.mechanism {
            1 => "uffd-move",
            2 => "uffd-wp",
            _ => "unknown",
        }
    }

    /// Name of the key protection level.
    #[must_use]
    pub fn level_name(&self) -> &'static str {
        match self.level {
            1 => "secret",
            2 => "locked",
            _ => "unknown",
        }
    }

    fn add(&mut self, o: &Snapshot) {
        self.processes += o.processes;
        self.window += o.window;
        self.mechanism = self.mechanism.max(o.mechanism);
        self.level = self.level.max(o.level);
        self.pages_protected += o.pages_protected;
        self.resident_pages += o.resident_pages;
        self.evicted_pages += o.evicted_pages;
        self.max_resident += o.max_resident;
        self.faults_in += o.faults_in;
        self.zero_fills += o.zero_fills;
        self.evictions += o.evictions;
        self.wp_evictions += o.wp_evictions;
        self.spurious += o.spurious;
        self.discards += o.discards;
        self.handler_ns += o.handler_ns;
        self.evict_ns += o.evict_ns;
        self.copy_ns += o.copy_ns;
        self.handler_moves += o.handler_moves;
        self.bound += o.bound;
        self.adaptive += o.adaptive;
        self.max_window += o.max_window;
        self.near_misses += o.near_misses;
        self.readahead += o.readahead;
        self.prefill += o.prefill;
        self.idle_rescues += o.idle_rescues;
        self.handler_idle += o.handler_idle;
        self.evict_moves += o.evict_moves;
        self.shared_unprotected_bytes += o.shared_unprotected_bytes;
        self.shared_protected_bytes += o.shared_protected_bytes;
        self.shared_resident_pages += o.shared_resident_pages;
        self.shared_evicted_pages += o.shared_evicted_pages;
        self.shared_faults_in += o.shared_faults_in;
        self.shared_evictions += o.shared_evictions;
        self.shared_views += o.shared_views;
        self.max_data += o.max_data;
        self.pool_pages += o.pool_pages;
        self.pool_fills += o.pool_fills;
        self.handoffs += o.handoffs;
        self.budget_percent = self.budget_percent.max(o.budget_percent);
        self.fault_floor_ns = self.fault_floor_ns.max(o.fault_floor_ns);
        self.lazy += o.lazy;
        self.swept += o.swept;
        self.swept_back += o.swept_back;
        self.sweep_ns += o.sweep_ns;
        self.sweep_lag_ms = self.sweep_lag_ms.max(o.sweep_lag_ms);
        self.max_sweep_lag_ms = self.max_sweep_lag_ms.max(o.max_sweep_lag_ms);
        self.max_period_ms = self.max_period_ms.max(o.max_period_ms);
        self.cost_ns += o.cost_ns;
        self.chunks_registered += o.chunks_registered;
        self.chunks_unregistered += o.chunks_unregistered;
        self.register_failures += o.register_failures;
        self.plaintext_page_ms += o.plaintext_page_ms;
        self.data_page_ms += o.data_page_ms;
        self.alive_ms += o.alive_ms;
        self.back_away_ms += o.back_away_ms;
        for (a, b) in self.refault_ages.iter_mut().zip(o.refault_ages) {
            *a += b;
        }
        self.shield_cpu_ns += o.shield_cpu_ns;
        self.program_ns += o.program_ns;
        self.host_joined += o.host_joined;
        self.host_waits += o.host_waits;
        self.host_colder += o.host_colder;
        self.handler_wait_ns += o.handler_wait_ns;
        self.quick_swept += o.quick_swept;
        self.quick_back += o.quick_back;
        self.host_cost_ns += o.host_cost_ns;
        self.contention_ns += o.contention_ns;
        self.handler_lock_ns += o.handler_lock_ns;
        self.alloc_calls += o.alloc_calls;
        self.alloc_ns += o.alloc_ns;
        self.alloc_call_ns = self.alloc_call_ns.max(o.alloc_call_ns);
        self.idle_held += o.idle_held;
        self.release_ns += o.release_ns;
        self.served_calls += o.served_calls;
        self.agent_ns += o.agent_ns;
    }
}

impl Counters {
    fn snapshot(&self) -> Snapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Snapshot {
            processes: 1,
            window: g(&self.window),
            mechanism: g(&self.mechanism),
            level: g(&self.level),
            pages_protected: g(&self.pages_protected),
            resident_pages: g(&self.resident),
            evicted_pages: g(&self.evicted),
            max_resident: g(&self.max_resident),
            faults_in: g(&self.faults_in),
            zero_fills: g(&self.zero_fills),
            evictions: g(&self.evictions),
            wp_evictions: g(&self.wp_evictions),
            spurious: g(&self.spurious),
            discards: g(&self.discards),
            handler_ns: g(&self.handler_ns),
            evict_ns: g(&self.evict_ns),
            copy_ns: g(&self.copy_ns),
            handler_moves: g(&self.handler_moves),
            bound: g(&self.bound),
            adaptive: g(&self.adaptive),
            max_window: g(&self.max_window),
            near_misses: g(&self.near_misses),
            readahead: g(&self.readahead),
            prefill: g(&self.prefill),
            idle_rescues: g(&self.idle_rescues),
            handler_idle: g(&self.handler_idle),
            evict_moves: g(&self.evict_moves),
            shared_unprotected_bytes: g(&self.shared_unprotected),
            shared_protected_bytes: g(&self.shared_protected),
            shared_resident_pages: g(&self.shared_resident),
            shared_evicted_pages: g(&self.shared_evicted),
            shared_faults_in: g(&self.shared_faults_in),
            shared_evictions: g(&self.shared_evictions),
            shared_views: g(&self.shared_views),
            max_data: g(&self.max_data),
            pool_pages: g(&self.pool_pages),
            pool_fills: g(&self.pool_fills),
            handoffs: g(&self.handoffs),
            budget_percent: g(&self.budget_percent),
            fault_floor_ns: g(&self.fault_floor_ns),
            lazy: g(&self.lazy),
            swept: g(&self.swept),
            swept_back: g(&self.swept_back),
            sweep_ns: g(&self.sweep_ns),
            sweep_lag_ms: g(&self.sweep_lag_ms),
            max_sweep_lag_ms: g(&self.max_sweep_lag_ms),
            max_period_ms: g(&self.max_period_ms),
            cost_ns: g(&self.cost_ns),
            chunks_registered: g(&self.chunks_registered),
            chunks_unregistered: g(&self.chunks_unregistered),
            register_failures: g(&self.register_failures),
            plaintext_page_ms: g(&self.plaintext_page_ms),
            data_page_ms: g(&self.data_page_ms),
            alive_ms: g(&self.alive_ms),
            back_away_ms: g(&self.back_away_ms),
            refault_ages: std::array::from_fn(|k| g(&self.refault_ages[k])),
            shield_cpu_ns: g(&self.shield_cpu_ns),
            program_ns: g(&self.program_ns),
            host_joined: g(&self.host_joined),
            host_waits: g(&self.host_waits),
            host_colder: g(&self.host_colder),
            handler_wait_ns: g(&self.handler_wait_ns),
            quick_swept: g(&self.quick_swept),
            quick_back: g(&self.quick_back),
            host_cost_ns: g(&self.host_cost_ns),
            contention_ns: g(&self.contention_ns),
            handler_lock_ns: g(&self.handler_lock_ns),
            alloc_calls: g(&self.alloc_calls),
            alloc_ns: g(&self.alloc_ns),
            alloc_call_ns: g(&self.alloc_call_ns),
            idle_held: g(&self.idle_held),
            release_ns: g(&self.release_ns),
            served_calls: g(&self.served_calls),
            agent_ns: g(&self.agent_ns),
        }
    }
}

const FILE_LEN: usize = 4096;
const _: () = assert!(std::mem::size_of::<Counters>() <= FILE_LEN);

/// Where a shield keeps its counters: a shared mapping of a file, or private
/// memory.
pub struct StatsFile {
    ptr: *const Counters,
    mapped: bool,
}

// SAFETY: the counters are atomics; the pointer refers to a mapping (or a
// leaked box) that lives as long as the StatsFile.
unsafe impl Send for StatsFile {}
// SAFETY: as above: all access is through atomics.
unsafe impl Sync for StatsFile {}

impl StatsFile {
    /// Counters in private memory.
    #[must_use]
    pub fn private() -> Self {
        Self {
            ptr: Box::into_raw(Box::<Counters>::default()),
            mapped: false,
        }
    }

    /// Creates (truncating) `path` and keeps the counters in a shared mapping
    /// of it.
    ///
    /// # Errors
    /// Creating, sizing or mapping the file.
    pub fn create(path: &Path) -> io::Result<Self> {
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        f.set_len(FILE_LEN as u64)?;
        let s = Self::map(&f, libc::PROT_READ | libc::PROT_WRITE)?;
        let c = s.counters();
        c.magic.store(MAGIC, Ordering::Relaxed);
        c.pid
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        Ok(s)
    }

    fn map(f: &File, prot: libc::c_int) -> io::Result<Self> {
        if f.metadata()?.len() < FILE_LEN as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a shield statistics file (too short)",
            ));
        }
        // SAFETY: a fresh shared mapping of a file we hold open, at an
        // address of the kernel's choosing: it overlaps no Rust object.
        let p = unsafe {
            uffd::mmap_direct(
                std::ptr::null_mut(),
                FILE_LEN,
                prot,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            ptr: p.cast(),
            mapped: true,
        })
    }

    /// The live counters.
    #[must_use]
    pub fn counters(&self) -> &Counters {
        // SAFETY: `ptr` points at a Counters-sized, 8-aligned region (a
        // mapping of FILE_LEN bytes, or a box) valid for our lifetime, and
        // all-zero bytes are valid atomics.
        unsafe { &*self.ptr }
    }

    /// A copy of the counters.
    #[must_use]
    pub fn snapshot(&self) -> Snapshot {
        self.counters().snapshot()
    }

    /// Reads one statistics file (written by another process).
    ///
    /// # Errors
    /// Opening or mapping it, or a file that is not a shield's.
    pub fn read(path: &Path) -> io::Result<Snapshot> {
        // Read, not mapped: a file its owner truncates meanwhile (any user
        // may own one, `memveil shield status` reads them all) cannot
        // fault the reader.
        let mut bytes = vec![0u8; FILE_LEN];
        let mut f = File::open(path)?;
        let mut n = 0;
        while n < FILE_LEN {
            match io::Read::read(&mut f, &mut bytes[n..])? {
                0 => break,
                k => n += k,
            }
        }
        if n < std::mem::size_of::<Counters>() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a shield statistics file (too short)",
            ));
        }
        let c = Counters::default();
        let words = std::mem::size_of::<Counters>() / 8;
        // SAFETY: Counters is repr(C) and made of AtomicU64 alone (fields
        // and an array of them), so it is `words` AtomicU64 in a row,
        // borrowed while `c` lives.
        let slots =
            unsafe { std::slice::from_raw_parts((&raw const c).cast::<AtomicU64>(), words) };
        for (w, b) in slots.iter().zip(bytes.chunks_exact(8)) {
            let mut v = [0u8; 8];
            v.copy_from_slice(b);
            w.store(u64::from_ne_bytes(v), Ordering::Relaxed);
        }
        if c.magic.load(Ordering::Relaxed) != MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a shield statistics file (bad magic)",
            ));
        }
        Ok(c.snapshot())
    }

    /// Sums the statistics files in `dir` (one per protected process).
    /// Files that vanish or are not shield files are skipped.
    ///
    /// # Errors
    /// Reading the directory.
    pub fn read_dir(dir: &Path) -> io::Result<Snapshot> {
        let mut total = Snapshot::default();
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            if e.path().extension().is_some_and(|x| x == "stats") {
                if let Ok(s) = Self::read(&e.path()) {
                    total.add(&s);
                }
            }
        }
        Ok(total)
    }
}

impl Drop for StatsFile {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: the mapping was made by `map` and nothing refers to it
            // after drop (the references handed out borrow self).
            let _ = unsafe { uffd::unmap_direct(self.ptr.cast_mut().cast(), FILE_LEN) };
        } else {
            // SAFETY: `ptr` came from Box::into_raw in `private`.
            drop(unsafe { Box::from_raw(self.ptr.cast_mut()) });
        }
    }
}
