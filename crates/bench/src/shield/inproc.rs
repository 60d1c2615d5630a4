//! The shield's figures measured inside this process: fault cost for each
//! window, the fault path at default settings, the plaintext fraction over
//! time with a random-access loop (RamCrypt's trade-off) and STREAM.

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::time::{Duration, Instant};

use memveil_cipher::Xts;
use memveil_shield::{Config, HandlerCpu, Shield, Snapshot, StatsFile, DEFAULT_WINDOW, PAGE};
use memveil_sys::uffd;

use super::err;
use crate::timing::{best_of, gbps, median};
use crate::{BenchError, BenchOpts, Figure, Plot, Series};
const KEY: [u8; 32] = [
    0x6d, 0x65, 0x6d, 0x76, 0x65, 0x69, 0x6c, 0x2d, 0x73, 0x68, 0x69, 0x65, 0x6c, 0x64, 0x21, 0x01,
    0x93, 0x27, 0x18, 0x28, 0x45, 0x90, 0x45, 0x23, 0x53, 0x60, 0x28, 0x74, 0x71, 0x35, 0x26, 0x62,
];

/// The windows of RamCrypt's trade-off, in pages.
const WINDOWS: [usize; 3] = [16, 256, 4096];

#[allow(clippy::cast_precision_loss)]
fn f(x: u64) -> f64 {
    x as f64
}

#[allow(clippy::cast_precision_loss)]
fn fu(x: usize) -> f64 {
    x as f64
}

/// Anonymous private memory mapped by system call (outside any allocator),
/// unmapped on drop, seen as pages.
struct Mapping(uffd::DirectMap);

impl Mapping {
    fn new(pages: usize) -> Result<Self, BenchError> {
        let len = pages * PAGE;
        uffd::DirectMap::new(len)
            .map(Self)
            .map_err(|e| err(format!("mmap of {len} bytes: {e}")))
    }

    fn ptr(&self) -> *mut u8 {
        self.0.as_ptr()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn pages(&self) -> usize {
        self.len() / PAGE
    }

    /// The first byte of page `i`, as a pointer.
    fn page(&self, i: usize) -> *mut u8 {
        debug_assert!(i < self.pages());
        self.ptr().wrapping_add(i * PAGE)
    }

    /// The mapping as `f64`s (for STREAM).
    fn as_f64(&mut self) -> &mut [f64] {
        let bytes = self.0.as_mut_slice();
        // SAFETY: the bytes are page-aligned read-write memory (protected
        // pages fault back in on touch), every bit pattern is a valid f64,
        // and the slice reborrows `bytes`, the only access for its lifetime.
        unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<f64>(), bytes.len() / 8) }
    }
}

/// A mapping protected by a shield, unprotected (contents dropped) on drop.
struct Protected<'s> {
    shield: &'s Shield,
    map: Mapping,
}

impl<'s> Protected<'s> {
    fn new(shield: &'s Shield, pages: usize) -> Result<Self, BenchError> {
        let map = Mapping::new(pages)?;
        // SAFETY: a fresh anonymous private mapping owned by `map`, which
        // is only touched through plain loads/stores and unmapped after
        // `unprotect` in Drop.
        unsafe {
            shield.encrypt_mprotect(map.ptr(), map.len(), libc::PROT_READ | libc::PROT_WRITE, 1)
        }
        .map_err(|e| err(format!("encrypt_mprotect: {e}")))?;
        Ok(Self { shield, map })
    }
}

impl Drop for Protected<'_> {
    fn drop(&mut self) {
        // SAFETY: the buffer holds benchmark data only; nothing refers to it
        // any more, so its contents may become zero (no page is decrypted
        // back by `unprotect` after this).
        unsafe { self.shield.discard(self.map.ptr() as usize, self.map.len()) };
        let _ = self.shield.unprotect(self.map.ptr(), self.map.len());
    }
}

/// Reads and rewrites one word of page `i` (a load and a store, as a
/// program updating a field does).
fn touch(m: &Mapping, i: usize, off: usize) {
    let p = m.page(i).wrapping_add(off & (PAGE - 8)).cast::<u64>();
    // SAFETY: `p` is 8-aligned inside page `i` of a live read-write mapping
    // (off is masked to a multiple of 8 below PAGE); volatile so the
    // compiler keeps every access, which is what is being timed.
    unsafe { p.write_volatile(p.read_volatile().wrapping_add(1)) };
}

fn shield_with(window: usize, handler_cpu: HandlerCpu) -> Result<Shield, BenchError> {
    shield_cfg(&Config {
        window,
        handler_cpu,
        ..Config::default()
    })
}

fn shield_cfg(cfg: &Config) -> Result<Shield, BenchError> {
    Shield::new(cfg, StatsFile::private()).map_err(|e| {
        err(format!(
            "cannot create a shield (window {}): {e}",
            cfg.window
        ))
    })
}

// ---------------------------------------------------------------- fault cost

struct FaultCost {
    pages: usize,
    sweeps: usize,
    /// µs per page faulted, the touching thread's view (median of sweeps).
    fault_us: f64,
    /// µs per first touch of fresh anonymous memory (median of sweeps).
    first_touch_us: f64,
    /// µs per page evicted, handler side.
    evict_us: f64,
    /// µs the handler spends per page brought in (excluding eviction).
    handler_in_us: f64,
    faults_per_page: f64,
    plaintext: f64,
    mechanism: &'static str,
}

/// Runs `f` on a thread of its own, pinned to `cpu` when given (and
/// allowed), so the caller's affinity is left alone.
pub(super) fn pinned<T: Send>(cpu: Option<usize>, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            if let Some(c) = cpu {
                let _ = memveil_sys::process::pin_to_cpu(c);
            }
            f()
        });
        match h.join() {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}

/// Fault cost with the handler on `handler_cpu`, touched from the calling
/// thread.
fn fault_cost(
    window: usize,
    min_faults: usize,
    handler_cpu: HandlerCpu,
) -> Result<FaultCost, BenchError> {
    // One page per fault (no readahead): what a single fault costs.
    let shield = shield_cfg(&Config {
        window,
        handler_cpu,
        readahead: false,
        ..Config::default()
    })?;
    let pages = 4 * window;
    let buf = Protected::new(&shield, pages)?;
    // First sweep: zero fills; from then on every page touched is evicted.
    for i in 0..pages {
        touch(&buf.map, i, 0);
    }
    let sweeps = min_faults.div_ceil(pages).max(3);
    let before = shield.stats();
    let mut per_page = Vec::with_capacity(sweeps);
    let mut total_faults = 0u64;
    for _ in 0..sweeps {
        let s0 = shield.stats();
        let t = Instant::now();
        for i in 0..pages {
            touch(&buf.map, i, 8);
        }
        let d = t.elapsed();
        let faults = shield.stats().faults() - s0.faults();
        total_faults += faults;
        if faults > 0 {
            per_page.push(d.as_secs_f64() * 1e6 / f(faults));
        }
    }
    let after = shield.stats();
    let plaintext = after.plaintext_fraction();
    let evictions = after.evictions - before.evictions;
    let evict_ns = after.evict_ns - before.evict_ns;
    let handler_ns = after.handler_ns - before.handler_ns;
    let faults = after.faults() - before.faults();
    let evict_us = if evictions > 0 {
        f(evict_ns) / f(evictions) / 1e3
    } else {
        0.0
    };
    let handler_in_us = if faults > 0 {
        f(handler_ns.saturating_sub(evict_ns)) / f(faults) / 1e3
    } else {
        0.0
    };
    let mechanism = shield.mechanism().name();
    drop(buf);
    drop(shield);

    // Baseline: the first touch of fresh anonymous memory (a kernel
    // zero-fill fault per page), same pages, same number of sweeps.
    let mut base = Vec::with_capacity(sweeps);
    for _ in 0..sweeps {
        let m = Mapping::new(pages)?;
        let t = Instant::now();
        for i in 0..pages {
            touch(&m, i, 8);
        }
        base.push(t.elapsed().as_secs_f64() * 1e6 / fu(pages));
    }
    Ok(FaultCost {
        pages,
        sweeps,
        fault_us: median(&mut per_page),
        first_touch_us: median(&mut base),
        evict_us,
        handler_in_us,
        faults_per_page: f(total_faults) / fu(pages * sweeps),
        plaintext,
        mechanism,
    })
}

// ------------------------------------- the fault path at default settings

/// The fault path as `memveil run` uses it (default `Config`: readahead,
/// the handler following the faulting thread at `SCHED_IDLE`), touched from
/// an unpinned thread.
struct Paths {
    pages: usize,
    /// µs per never-written page touched in sequence (amortized).
    zero_fill_us: f64,
    /// µs per evicted page brought back by a sequential scan (amortized).
    seq_fault_us: f64,
    /// µs per fault on one evicted page at a random address.
    random_fault_us: f64,
    /// Faults per page of each sweep (zero, sequential) and random faults.
    faults: (u64, u64, u64),
    /// Plain first touch of fresh anonymous memory, µs per page.
    first_touch_us: f64,
    /// Handler moves and idle rescues during the random phase.
    moves: u64,
    rescues: u64,
}

fn fault_paths(pages: usize, random_touches: usize) -> Result<Paths, BenchError> {
    let shield = shield_cfg(&Config::default())?;
    let buf = Protected::new(&shield, pages)?;
    let s0 = shield.stats();
    let t = Instant::now();
    for i in 0..pages {
        touch(&buf.map, i, 0);
    }
    let zero = t.elapsed();
    let s1 = shield.stats();
    let t = Instant::now();
    for i in 0..pages {
        touch(&buf.map, i, 8);
    }
    let seq = t.elapsed();
    let s2 = shield.stats();
    // Every page but the window's was evicted after the first sweep; the
    // second sweep brings those back.
    let brought = (s2.faults_in + s2.readahead) - (s1.faults_in + s1.readahead);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let t = Instant::now();
    for _ in 0..random_touches {
        #[allow(clippy::cast_possible_truncation)]
        let i = (rng.next() % pages as u64) as usize;
        touch(&buf.map, i, 16);
    }
    let random = t.elapsed();
    let s3 = shield.stats();
    drop(buf);
    drop(shield);
    let plain = Mapping::new(pages)?;
    let t = Instant::now();
    for i in 0..pages {
        touch(&plain, i, 0);
    }
    let first = t.elapsed();
    let random_faults = s3.faults() - s2.faults();
    Ok(Paths {
        pages,
        zero_fill_us: first_us(zero, pages as u64),
        seq_fault_us: first_us(seq, brought),
        random_fault_us: first_us(random, random_faults),
        faults: (
            s1.faults() - s0.faults(),
            s2.faults() - s1.faults(),
            random_faults,
        ),
        first_touch_us: first_us(first, pages as u64),
        moves: s3.handler_moves - s2.handler_moves,
        rescues: s3.idle_rescues - s0.idle_rescues,
    })
}

/// Microseconds per item.
fn first_us(d: Duration, n: u64) -> f64 {
    if n == 0 {
        0.0
    } else {
        d.as_secs_f64() * 1e6 / f(n)
    }
}

/// What any fault hand-off costs on this machine at least, measured: a
/// round trip between two threads on one CPU (a pipe each way: two thread
/// switches and four system calls) and a plain page fault (first touch
/// after `MADV_DONTNEED`, page-table work only). Returns (round trip µs,
/// fault µs).
fn fault_floor(home: usize) -> Result<(f64, f64), BenchError> {
    let rounds = 20_000u32;
    let (mut a_r, mut a_w) = std::io::pipe().map_err(|e| err(format!("pipe: {e}")))?;
    let (mut b_r, mut b_w) = std::io::pipe().map_err(|e| err(format!("pipe: {e}")))?;
    let echo = std::thread::spawn(move || {
        let _ = memveil_sys::process::pin_to_cpu(home);
        let mut c = [0u8; 1];
        for _ in 0..rounds {
            if a_r.read_exact(&mut c).is_err() || b_w.write_all(&c).is_err() {
                break;
            }
        }
    });
    let mut c = [0u8; 1];
    let t = Instant::now();
    for _ in 0..rounds {
        a_w.write_all(&c).map_err(|e| err(format!("pipe: {e}")))?;
        b_r.read_exact(&mut c)
            .map_err(|e| err(format!("pipe: {e}")))?;
    }
    let trip = first_us(t.elapsed(), u64::from(rounds));
    let _ = echo.join();
    Ok((trip, plain_fault_us()?))
}

/// A plain page fault on this machine, µs: the first touch of a page after
/// `MADV_DONTNEED` (page-table work only, no hand-off), averaged over 8192
/// pages.
pub(crate) fn plain_fault_us() -> Result<f64, BenchError> {
    let pages = 8192;
    let m = Mapping::new(pages)?;
    for i in 0..pages {
        touch(&m, i, 0);
    }
    // SAFETY: the benchmark's own mapping; its contents may become zero.
    unsafe { uffd::madvise_direct(m.ptr(), m.len(), libc::MADV_DONTNEED) }
        .map_err(|e| err(format!("madvise: {e}")))?;
    let t = Instant::now();
    for i in 0..pages {
        touch(&m, i, 0);
    }
    Ok(first_us(t.elapsed(), pages as u64))
}

// ------------------------------------------- plaintext fraction over time

/// xorshift64*: a cheap generator for access patterns.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Pages of the hot set of the random-access loop (between the smallest and
/// the middle window, so the three windows fall on three sides of it).
const HOT_PAGES: usize = 128;

/// One access of the skewed random-access loop: 95% of accesses to the first
/// `HOT_PAGES` pages, 5% anywhere.
fn random_access(m: &Mapping, rng: &mut Rng) {
    let r = rng.next();
    let pages = m.pages();
    #[allow(clippy::cast_possible_truncation)]
    let low = (r >> 32) as usize;
    let page = if r.is_multiple_of(20) {
        low % pages
    } else {
        low % HOT_PAGES.min(pages)
    };
    #[allow(clippy::cast_possible_truncation)]
    let off = (r as usize) >> 4;
    touch(m, page, off);
}

struct Trace {
    window: usize,
    /// (ms since start, plaintext fraction).
    samples: Vec<(f64, f64)>,
    /// Plaintext fraction over the random phase (mean of samples).
    steady: f64,
    /// Accesses per second in the random phase.
    rate: f64,
    faults: u64,
    fill_ms: f64,
}

/// Fills `pages` protected pages in order, then runs the random-access loop
/// for `dur`, sampling the shield's counters every ~5 ms.
fn trace(window: usize, pages: usize, dur: Duration) -> Result<Trace, BenchError> {
    let shield = shield_with(window, HandlerCpu::Current)?;
    let buf = Protected::new(&shield, pages)?;
    let every = Duration::from_millis(5);
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut last = start;
    let sample = |now: Instant, s: &Snapshot, samples: &mut Vec<(f64, f64)>| {
        samples.push((
            now.duration_since(start).as_secs_f64() * 1e3,
            s.plaintext_fraction(),
        ));
    };
    for i in 0..pages {
        touch(&buf.map, i, 0);
        if i % 16 == 0 {
            let now = Instant::now();
            if now.duration_since(last) >= every {
                last = now;
                sample(now, &shield.stats(), &mut samples);
            }
        }
    }
    let fill_ms = start.elapsed().as_secs_f64() * 1e3;
    let random_from = samples.len();
    let s0 = shield.stats();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ window as u64);
    let t = Instant::now();
    let mut n = 0u64;
    loop {
        for _ in 0..64 {
            random_access(&buf.map, &mut rng);
        }
        n += 64;
        let now = Instant::now();
        if now.duration_since(last) >= every {
            last = now;
            sample(now, &shield.stats(), &mut samples);
            if now.duration_since(t) >= dur {
                break;
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let faults = shield.stats().faults() - s0.faults();
    let steady_samples = &samples[random_from..];
    let steady = if steady_samples.is_empty() {
        shield.stats().plaintext_fraction()
    } else {
        steady_samples.iter().map(|s| s.1).sum::<f64>() / fu(steady_samples.len())
    };
    drop(buf);
    Ok(Trace {
        window,
        samples,
        steady,
        rate: f(n) / secs,
        faults,
        fill_ms,
    })
}

/// The same random-access loop over plain memory: accesses per second.
fn random_plain(pages: usize, dur: Duration) -> Result<f64, BenchError> {
    let m = Mapping::new(pages)?;
    for i in 0..pages {
        touch(&m, i, 0);
    }
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < dur {
        for _ in 0..4096 {
            random_access(&m, &mut rng);
        }
        n += 4096;
    }
    Ok(f(n) / t.elapsed().as_secs_f64())
}

// ------------------------------------------------------------------- STREAM

const SCALAR: f64 = 3.0;

fn triad(a: &mut [f64], b: &[f64], c: &[f64]) {
    for ((ai, bi), ci) in a.iter_mut().zip(b).zip(c) {
        *ai = bi + SCALAR * ci;
    }
}

struct TriadResult {
    pages_per_array: usize,
    plain: f64,
    protected: f64,
    faults_per_pass: f64,
    evictions_per_pass: f64,
    plaintext: f64,
}

/// Triad over three arrays of `pages` pages each, protected by `shield` and
/// plain, best of `reps` passes each, interleaved. Optional AES passes are
/// run in the same rounds (so load bursts hit all alike).
fn triad_run(
    shield: &Shield,
    pages: usize,
    reps: usize,
    mut extra: impl FnMut(),
) -> Result<TriadResult, BenchError> {
    let mut prot = Protected::new(shield, 3 * pages)?;
    let n = pages * PAGE / 8;
    let (pa, rest) = prot.map.as_f64().split_at_mut(n);
    let (pb, pc) = rest.split_at_mut(n);
    pa.fill(1.0);
    pb.fill(2.0);
    pc.fill(0.5);
    let mut plain = Mapping::new(3 * pages)?;
    let (qa, rest) = plain.as_f64().split_at_mut(n);
    let (qb, qc) = rest.split_at_mut(n);
    qa.fill(1.0);
    qb.fill(2.0);
    qc.fill(0.5);
    let bytes = 3 * 8 * n;
    let (mut tp, mut tq) = (Duration::MAX, Duration::MAX);
    let s0 = shield.stats();
    for _ in 0..reps {
        tq = tq.min(best_of(1, || triad(qa, qb, qc)));
        tp = tp.min(best_of(1, || triad(pa, pb, pc)));
        extra();
    }
    let s1 = shield.stats();
    std::hint::black_box((&pa, &qa));
    if pa[n / 2].to_bits() != qa[n / 2].to_bits() {
        return Err(err(
            "triad over protected memory computed a different result than over plain memory",
        ));
    }
    let passes = fu(reps.max(1));
    Ok(TriadResult {
        pages_per_array: pages,
        plain: gbps(bytes, tq),
        protected: gbps(bytes, tp),
        faults_per_pass: f(s1.faults() - s0.faults()) / passes,
        evictions_per_pass: f(s1.evictions - s0.evictions) / passes,
        plaintext: s1.plaintext_fraction(),
    })
}

type Parts = (Vec<Figure>, String, Vec<Plot>);

/// Fault cost, plaintext fraction over time and STREAM, on the calling
/// thread (pinned to `home` by the caller).
#[allow(clippy::too_many_lines)]
pub(super) fn in_process(
    opts: &BenchOpts,
    home: usize,
    other: Option<usize>,
) -> Result<Parts, BenchError> {
    let mut figs = Vec::new();
    let mut md = String::new();
    let mut plots = Vec::new();

    // --- Fault cost per window.
    let min_faults = opts.pick(16_384, 65_536);
    let mut rows = String::new();
    for w in WINDOWS {
        opts.say(&format!(
            "shield: fault cost, window {w} pages, sweeps over {} pages, handler on CPU {home}{}",
            4 * w,
            other.map_or(String::new(), |o| format!(" then on CPU {o}"))
        ));
        let c = fault_cost(w, min_faults, HandlerCpu::Cpu(home))?;
        let x = match other {
            Some(o) => Some(fault_cost(w, min_faults / 2, HandlerCpu::Cpu(o))?),
            None => None,
        };
        figs.push(Figure::vs(
            &format!("shield.fault_us_w{w}"),
            c.fault_us,
            c.first_touch_us,
            "µs",
            &format!(
                "µs per page brought in, seen by the touching thread: sweeps touching every page of a \
                 protected buffer of {} pages (4x the window of {w}; every page faults: decrypt, \
                 UFFDIO_COPY, and the handler's eviction behind it), median over {} sweeps of sweep time / \
                 pages faulted, handler and thread on one CPU; baseline: first touch of fresh anonymous \
                 memory (kernel zero-fill fault)",
                c.pages, c.sweeps
            ),
        ));
        if let Some(x) = &x {
            figs.push(Figure::vs(
                &format!("shield.fault_us_w{w}_cross_cpu"),
                x.fault_us,
                x.first_touch_us,
                "µs",
                &format!(
                    "as shield.fault_us_w{w}, with the handler thread pinned to the other CPU (each fault \
                     wakes a thread on another vCPU)"
                ),
            ));
        }
        figs.push(Figure::plain(
            &format!("shield.evict_us_w{w}"),
            c.evict_us,
            "µs",
            &format!(
                "handler-side µs per page evicted (evict_ns / evictions over the sweeps, window {w}; \
                 {} mechanism, batches of up to {})",
                c.mechanism,
                32.min((w / 4).max(1))
            ),
        ));
        let _ = writeln!(
            rows,
            "| {w} | {} | {:.2} | **{:.1}** | {} | {:.2} | {:.0}x | {:.1} | {:.1} | {:.3} |",
            c.pages,
            c.faults_per_page,
            c.fault_us,
            x.as_ref()
                .map_or("—".into(), |x| format!("{:.1}", x.fault_us)),
            c.first_touch_us,
            c.fault_us / c.first_touch_us,
            c.handler_in_us,
            c.evict_us,
            c.plaintext
        );
    }
    let _ = writeln!(
        md,
        "Fault cost (after a first sweep, sweeps touching one word of every page of a protected buffer 4x the \
         window; µs per page from the touching thread = sweep time / pages faulted, median of sweeps; the \
         handler-side times are the handler's counters and, with both threads on one CPU, include time the \
         woken thread runs before the handler gets the CPU back):\n\n\
         | window (pages) | buffer (pages) | faults per page touched | µs per fault, same CPU | µs per fault, handler on the other CPU | µs first touch, plain | ratio (same CPU) | handler µs per page in (excl. eviction) | handler µs per page evicted | plaintext fraction after the sweeps |\n\
         |---|---|---|---|---|---|---|---|---|---|\n{rows}\n\
         Issue 5's own measurements for comparison: mprotect + SIGSEGV 1.7 µs per fault; a userfaultfd MISSING \
         fault resolved by UFFDIO_COPY from a handler thread 47-51 µs when that thread sleeps in poll (waking \
         an idle vCPU), 18-20 µs when it busy-polls.\n"
    );

    // --- The fault path as `memveil run` uses it, from an unpinned thread.
    let paths_pages = opts.pick(4 * DEFAULT_WINDOW, 8 * DEFAULT_WINDOW);
    let touches = opts.pick(65_536, 262_144);
    opts.say(&format!(
        "shield: fault path at default settings, {paths_pages} pages (window {DEFAULT_WINDOW}), unpinned; then the \
         hand-off floor on CPU {home}"
    ));
    let paths = std::thread::scope(|sc| {
        sc.spawn(|| {
            let _ = memveil_sys::process::unpin();
            fault_paths(paths_pages, touches)
        })
        .join()
    })
    .map_err(|_| err("the fault-path thread panicked"))??;
    let (trip, plain_fault) = fault_floor(home)?;
    let floor = trip + plain_fault;
    figs.push(
        Figure::vs(
            "shield.zero_fill_us",
            paths.zero_fill_us,
            paths.first_touch_us,
            "µs",
            &format!(
                "µs per never-written page touched in sequence (a sweep over {} fresh protected pages, window {DEFAULT_WINDOW}, \
                 default Config: runs of up to 64 pages filled per fault; {} faults), amortized; baseline: the first touch \
                 of fresh anonymous memory, same sweep",
                paths.pages, paths.faults.0
            ),
        )
        .target("<= 2"),
    );
    figs.push(
        Figure::vs(
            "shield.seq_fault_us",
            paths.seq_fault_us,
            paths.first_touch_us,
            "µs",
            &format!(
                "µs per evicted page brought back by a sequential sweep ({} pages, window {DEFAULT_WINDOW}; {} faults), \
                 amortized; baseline: the first touch of fresh anonymous memory",
                paths.pages, paths.faults.1
            ),
        )
        .target("<= 2"),
    );
    figs.push(
        Figure::vs(
            "shield.random_fault_us",
            paths.random_fault_us,
            floor,
            "µs",
            &format!(
                "µs per fault on one evicted page at a random address ({} random touches over {} pages, window \
                 {DEFAULT_WINDOW}: {} faults), touching thread unpinned, handler at its default placement ({} handler \
                 moves, {} idle rescues); baseline: the hand-off floor of this machine, shield.fault_floor_us",
                touches, paths.pages, paths.faults.2, paths.moves, paths.rescues
            ),
        )
        .target("<= 6"),
    );
    figs.push(Figure::plain(
        "shield.fault_floor_us",
        floor,
        "µs",
        &format!(
            "what any hand-off of a fault to another thread costs here at least: a round trip between two threads on \
             one CPU through pipes ({trip:.2} µs: two thread switches, four system calls) plus a plain page fault \
             (first touch after MADV_DONTNEED: {plain_fault:.2} µs)"
        ),
    ));
    let _ = writeln!(
        md,
        "\nThe fault path at default settings (what `memveil run` uses: runs of pages on sequential faults, the handler \
         at SCHED_IDLE following the faulting thread), from an unpinned thread over {} pages, window {DEFAULT_WINDOW}:\n\n\
         | | µs | faults | target |\n|---|---|---|---|\n\
         | never-written pages in sequence, per page | **{:.2}** | {} | <= 2 |\n\
         | evicted pages in sequence, per page | **{:.2}** | {} | <= 2 |\n\
         | one evicted page at random, per fault | **{:.2}** | {} | <= 6 |\n\
         | plain first touch, per page | {:.2} | — | — |\n\
         | hand-off floor: thread round trip on one CPU + plain fault | {floor:.2} ({trip:.2} + {plain_fault:.2}) | — | — |\n",
        paths.pages,
        paths.zero_fill_us,
        paths.faults.0,
        paths.seq_fault_us,
        paths.faults.1,
        paths.random_fault_us,
        paths.faults.2,
        paths.first_touch_us
    );

    // --- Plaintext fraction over time, and the access rate it buys.
    let trace_pages = opts.pick(16_384usize, 32_768);
    let dur = Duration::from_millis(opts.pick(1000, 3000));
    opts.say(&format!(
        "shield: plaintext fraction over time, {trace_pages} pages, windows {WINDOWS:?}, {} ms random phase each",
        dur.as_millis()
    ));
    let plain_rate = random_plain(trace_pages, dur)?;
    let mut series = Vec::new();
    let mut trows = String::new();
    for w in WINDOWS {
        let tr = trace(w, trace_pages, dur)?;
        let ratio = tr.rate / plain_rate;
        figs.push(Figure::plain(
            &format!("shield.plaintext_fraction_w{}", tr.window),
            tr.steady,
            "fraction",
            &format!(
                "plaintext pages / pages holding data over a {trace_pages}-page buffer (mean of ~5 ms samples \
                 during the random-access phase), window {w}"
            ),
        ));
        figs.push(Figure::vs(
            &format!("shield.random_w{w}_vs_plain"),
            tr.rate / 1e6,
            plain_rate / 1e6,
            "M accesses/s",
            &format!(
                "skewed random read-modify-write of one word (95% to a {HOT_PAGES}-page hot set, 5% anywhere \
                 in {trace_pages} pages), protected with window {w} vs plain memory"
            ),
        ));
        let _ = writeln!(
            trows,
            "| {w} | {:.0} | {:.4} | {:.3} | {:.3} | {:.2e} | {} |",
            tr.fill_ms,
            tr.steady,
            tr.rate / 1e6,
            plain_rate / 1e6,
            ratio,
            tr.faults
        );
        series.push(Series {
            name: format!("window {w}"),
            points: tr.samples,
        });
    }
    let _ = writeln!(
        md,
        "Plaintext fraction over time (plot `shield_plaintext_fraction.svg`): a buffer of {trace_pages} pages \
         ({} MiB) is written page by page (the fraction falls as window / pages written), then read and written \
         at random for {} ms (95% of accesses to the first {HOT_PAGES} pages, 5% anywhere); counters sampled \
         every ~5 ms. The trade-off RamCrypt measured: a smaller window keeps less plaintext and costs more faults.\n\n\
         | window (pages) | fill (ms) | plaintext fraction (random phase) | M accesses/s protected | M accesses/s plain | ratio | faults in random phase |\n\
         |---|---|---|---|---|---|---|\n{trows}",
        (trace_pages * PAGE) >> 20,
        dur.as_millis()
    );
    plots.push(Plot {
        file: "shield_plaintext_fraction.svg".into(),
        title: format!("Plaintext fraction over time, {trace_pages}-page buffer"),
        x_label: "ms".into(),
        y_label: "plaintext fraction".into(),
        series,
    });

    // --- STREAM triad vs the AES bound.
    let window = DEFAULT_WINDOW;
    let big = 8 * window / 3;
    let fit = 3 * window / 4 / 3;
    let reps = opts.pick(3, 7);
    opts.say(&format!(
        "shield: STREAM triad, arrays 3 x {big} pages (8x the window of {window}) and 3 x {fit} (fit), vs the AES bound"
    ));
    let xts = Xts::new(&KEY[..16], &KEY[16..]).map_err(|e| err(e.to_string()))?;
    let aes_bytes = 64 << 20;
    let mut aes_buf = vec![0x5au8; aes_bytes];
    let (mut te, mut td) = (Duration::MAX, Duration::MAX);
    let mut aes_pass = || {
        te = te.min(best_of(1, || {
            for (i, p) in aes_buf.chunks_mut(PAGE).enumerate() {
                let _ = xts.encrypt_unit((i * PAGE) as u128, p);
            }
        }));
        td = td.min(best_of(1, || {
            for (i, p) in aes_buf.chunks_mut(PAGE).enumerate() {
                let _ = xts.decrypt_unit((i * PAGE) as u128, p);
            }
        }));
    };
    let shield = shield_with(window, HandlerCpu::Current)?;
    let tb = triad_run(&shield, big, reps, &mut aes_pass)?;
    drop(shield);
    let shield = shield_with(window, HandlerCpu::Current)?;
    let tf = triad_run(&shield, fit, reps.max(5), || {})?;
    drop(shield);
    let (enc, dec) = (gbps(aes_bytes, te), gbps(aes_bytes, td));
    // Every page of a triad pass is decrypted in once and encrypted out once
    // (a, though only written, was evicted as ciphertext and comes back
    // decrypted): the triad's bytes cost one decryption plus one encryption.
    let bound = 1.0 / (1.0 / enc + 1.0 / dec);
    figs.push(
        Figure::vs(
            "shield.triad_8x_vs_aes_bound",
            tb.protected,
            bound,
            "GB/s",
            &format!(
                "STREAM triad (a = b + 3c, 24 bytes counted per element) over three protected arrays of {} pages \
                 (8x the default window of {window} pages) vs the AES bound of one core: every page of a pass \
                 is decrypted in and encrypted out once by the single handler thread, so the bound is \
                 1/(1/enc + 1/dec) with enc/dec the XTS-128 throughput of 4 KiB pages (memveil-cipher \
                 encrypt_unit/decrypt_unit over 64 MiB in place, best of the same rounds)",
                tb.pages_per_array
            ),
        ),
    );
    figs.push(Figure::vs(
        "shield.triad_8x_vs_plain",
        tb.protected,
        tb.plain,
        "GB/s",
        "STREAM triad, arrays 8x the window: protected vs plain memory of the same size (best of the same rounds)",
    ));
    figs.push(Figure::vs(
        "shield.triad_fit_vs_plain",
        tf.protected,
        tf.plain,
        "GB/s",
        &format!(
            "STREAM triad, three arrays of {} pages (3/4 of the window): protected vs plain",
            tf.pages_per_array
        ),
    ));
    figs.push(Figure::plain(
        "shield.aes_xts128_enc_4k",
        enc,
        "GB/s",
        "XTS-128 encryption of 4 KiB pages, 64 MiB in place, 1 thread",
    ));
    figs.push(Figure::plain(
        "shield.aes_xts128_dec_4k",
        dec,
        "GB/s",
        "XTS-128 decryption of 4 KiB pages, 64 MiB in place, 1 thread",
    ));
    let _ = writeln!(
        md,
        "\nSTREAM triad (GB/s, 24 bytes per element counted as STREAM does; best of {reps} rounds, each round \
         one plain pass, one protected pass, one XTS encryption and one decryption pass over 64 MiB):\n\n\
         | arrays | plain | protected | AES bound | protected / bound | protected / plain | faults per pass | evictions per pass | plaintext fraction |\n\
         |---|---|---|---|---|---|---|---|---|\n\
         | 3 x {} pages (8x window {window}) | {:.2} | {:.3} | {bound:.3} | **{:.3}** | {:.4} | {:.0} | {:.0} | {:.3} |\n\
         | 3 x {} pages (fits the window) | {:.2} | {:.2} | — | — | {:.3} | {:.0} | {:.0} | {:.3} |\n\n\
         AES bound: XTS-128 on this core encrypts 4 KiB pages at {enc:.2} GB/s and decrypts at {dec:.2} GB/s; \
         each page of a pass at 8x the window is decrypted in once and encrypted out once by the one handler \
         thread, so no protected triad can exceed 1/(1/{enc:.2} + 1/{dec:.2}) = {bound:.3} GB/s. The rest of the \
         gap to that bound is the fault path: the touching thread stops, the handler wakes, UFFDIO_COPY maps the \
         page, the eviction moves pages out (UFFDIO_MOVE) and copies the ciphertext to the store.\n",
        tb.pages_per_array,
        tb.plain,
        tb.protected,
        tb.protected / bound,
        tb.protected / tb.plain,
        tb.faults_per_pass,
        tb.evictions_per_pass,
        tb.plaintext,
        tf.pages_per_array,
        tf.plain,
        tf.protected,
        tf.protected / tf.plain,
        tf.faults_per_pass,
        tf.evictions_per_pass,
        tf.plaintext,
    );
    drop(aes_buf);

    Ok((figs, md, plots))
}
