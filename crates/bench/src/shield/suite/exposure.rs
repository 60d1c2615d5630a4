//! Exposure measured as the published software designs measure it
//! (RamCrypt: "nginx's TLS key stays encrypted 97% of the time";
//! TransCrypt: a password encrypted 98.99% of the time): the fraction of
//! time a secret spends as ciphertext, seen from outside the program.
//!
//! The canary program (`canary.c`) holds a 64-byte secret in a page of its
//! own and a heap it works on (a quarter of it touched continuously); it
//! reads the secret at a chosen period. A sampler reads the secret's page
//! through `/proc/PID/mem` at random times (5-35 ms apart) and counts the
//! samples in which the secret is there in plaintext; every fourth sample
//! it also reads the heap's page-table entries through
//! `/proc/PID/pagemap` and counts the pages present (plaintext: an evicted
//! page is missing from the page tables, its ciphertext elsewhere). A plain
//! run is the positive control: there the secret is found in every sample.

use std::fs::File;
use std::io::{BufRead as _, BufReader};
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

// The suite's xorshift64: the sampler's random intervals.
use super::Rng;

/// How often the canary reads its secret once written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    /// Never again.
    Once,
    /// Every this many milliseconds.
    EveryMs(u32),
    /// Continuously, between pages of its hot quarter.
    Continuous,
}

impl Period {
    /// The canary's PERIOD_MS argument.
    fn arg(self) -> String {
        match self {
            Period::Once => "-1".into(),
            Period::EveryMs(ms) => ms.to_string(),
            Period::Continuous => "0".into(),
        }
    }

    /// A name for figure ids: `idle`, `1s`, `100ms`, `continuous`.
    #[must_use]
    pub fn id(self) -> String {
        match self {
            Period::Once => "idle".into(),
            Period::EveryMs(ms) if ms % 1000 == 0 => format!("{}s", ms / 1000),
            Period::EveryMs(ms) => format!("{ms}ms"),
            Period::Continuous => "continuous".into(),
        }
    }
}

/// What one canary run measured.
#[derive(Debug, Clone)]
pub struct Exposure {
    /// Samples of the secret's page.
    pub samples: u64,
    /// Of those, samples in which the secret was there in plaintext.
    pub plaintext: u64,
    /// Mean fraction of the heap's pages present (plaintext) over the
    /// pagemap samples (`None`: pagemap unreadable).
    pub heap_plaintext: Option<f64>,
    /// Reads of the secret by the canary itself.
    pub secret_reads: u64,
    /// Passes over the hot quarter.
    pub passes: u64,
}

impl Exposure {
    /// The fraction of samples in which the secret was ciphertext.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn encrypted_fraction(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            1.0 - self.plaintext as f64 / self.samples as f64
        }
    }
}

/// The canary's first line: where its secret and heap are.
struct Layout {
    secret: u64,
    key: Vec<u8>,
    heap: u64,
    heap_bytes: u64,
}

fn parse_layout(line: &str) -> Option<Layout> {
    let mut it = line.split_whitespace();
    (it.next()? == "canary").then_some(())?;
    let hex_addr = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let secret = hex_addr(it.next()?)?;
    let key = hex::decode(it.next()?).ok()?;
    let heap = hex_addr(it.next()?)?;
    let heap_bytes = it.next()?.parse().ok()?;
    (key.len() == 64).then_some(Layout {
        secret,
        key,
        heap,
        heap_bytes,
    })
}

/// The process that runs `canary` (`exe`): `child` itself, or under
/// `memveil run` the child of it that runs `exe`, directly or through the
/// shield's loader (Go and static programs; memveil run also starts a
/// guardian process for its cgroup).
fn canary_pid(child: &Child, wrapped: bool, exe: &Path) -> Option<u32> {
    if !wrapped {
        return Some(child.id());
    }
    let want = std::fs::canonicalize(exe).ok()?;
    let kids = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", child.id())).ok()?;
    kids.split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|p| {
            std::fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|e| {
                e == want
                    || e.file_name()
                        .is_some_and(|n| n == crate::procs::SHIELD_LOADER)
            })
        })
}

/// Kills the child (and its process group's canary) on every way out.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A program started under `wrap` (e.g. `memveil run --quiet --`), or
/// plainly when `wrap` is empty: its standard output line by line, its
/// standard error gathered for the error messages.
struct Launched {
    child: Reaper,
    lines: mpsc::Receiver<String>,
    err: std::thread::JoinHandle<String>,
}

impl Launched {
    fn start(exe: &Path, wrap: &[&std::ffi::OsStr], args: &[String]) -> Result<Self, String> {
        let mut cmd = match wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = Reaper(
            cmd.spawn()
                .map_err(|e| format!("starting {}: {e}", exe.display()))?,
        );
        let stdout = child.0.stdout.take().ok_or("no stdout")?;
        let stderr = child.0.stderr.take().ok_or("no stderr")?;
        let err = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut s);
            s
        });
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self { child, lines, err })
    }

    /// Ends the program; `what` went wrong, with its standard error.
    fn fail(self, what: &str) -> String {
        drop(self.child);
        format!("{what}: {}", self.err.join().unwrap_or_default().trim())
    }

    /// The pid of the process running `exe` (see [`canary_pid`]).
    fn pid(&self, wrapped: bool, exe: &Path) -> Option<u32> {
        canary_pid(&self.child.0, wrapped, exe)
    }
}

/// Runs `canary` (`exe`) under `wrap` (e.g. `memveil run --quiet --`), or
/// plainly when `wrap` is empty, with a `heap_mib` heap and the secret read
/// at `period`, written after `warm` and sampled for `run` after that.
///
/// # Errors
/// The canary could not start, said nothing, or ended without "done"; the
/// message says which, with its standard error.
pub fn measure(
    exe: &Path,
    wrap: &[&std::ffi::OsStr],
    heap_mib: u32,
    period: Period,
    warm: Duration,
    run: Duration,
) -> Result<Exposure, String> {
    let ms = |d: Duration| d.as_millis().to_string();
    let mut p = Launched::start(
        exe,
        wrap,
        &[heap_mib.to_string(), period.arg(), ms(warm), ms(run)],
    )?;
    let deadline = Instant::now() + warm + run + Duration::from_secs(60);
    let first = p.lines.recv_timeout(warm + Duration::from_secs(30));
    let Some(layout) = first.ok().as_deref().and_then(parse_layout) else {
        return Err(p.fail("the canary did not start"));
    };
    if p.lines
        .recv_timeout(warm + Duration::from_secs(30))
        .as_deref()
        != Ok("ready")
    {
        return Err(p.fail("the canary never wrote its secret"));
    }
    let Some(pid) = p.pid(!wrap.is_empty(), exe) else {
        return Err(p.fail("the canary's process was not found"));
    };
    let mem = File::open(format!("/proc/{pid}/mem"))
        .map_err(|e| format!("/proc/{pid}/mem: {e} (needs root, or ptrace rights)"))?;
    let pagemap = File::open(format!("/proc/{pid}/pagemap")).ok();
    let mut entries = vec![0u8; usize::try_from(layout.heap_bytes / 4096).unwrap_or(0) * 8];
    let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ u64::from(pid));
    let mut got = Exposure {
        samples: 0,
        plaintext: 0,
        heap_plaintext: None,
        secret_reads: 0,
        passes: 0,
    };
    let (mut heap_sum, mut heap_n) = (0.0, 0u32);
    let mut buf = vec![0u8; layout.key.len()];
    loop {
        let wait = Duration::from_millis(5 + rng.next() % 31);
        match p.lines.recv_timeout(wait) {
            Ok(line) => {
                if let Some(rest) = line.strip_prefix("done ") {
                    let mut it = rest.split_whitespace().map(str::parse::<u64>);
                    got.passes = it.next().and_then(Result::ok).unwrap_or(0);
                    got.secret_reads = it.next().and_then(Result::ok).unwrap_or(0);
                    break;
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(p.fail("the canary ended without finishing"));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if Instant::now() > deadline {
            return Err(p.fail("the canary ran past its time"));
        }
        // A missing (evicted) page reads as an error, never as a
        // decryption: the shield does not serve faults of other processes.
        // Nothing at all (end of file) means the canary's memory is gone:
        // it ended, its "done" on the way; not a sample (one such read
        // failed the plain run's positive control once).
        match mem.read_exact_at(&mut buf, layout.secret) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => continue,
            Ok(()) if buf == layout.key => got.plaintext += 1,
            _ => {}
        }
        got.samples += 1;
        if got.samples.is_multiple_of(4) {
            if let Some(frac) = pagemap
                .as_ref()
                .and_then(|pm| present_fraction(pm, &mut entries, layout.heap))
            {
                heap_sum += frac;
                heap_n += 1;
            }
        }
    }
    buf.fill(0);
    got.heap_plaintext = (heap_n > 0).then(|| heap_sum / f64::from(heap_n));
    let _ = p.child.0.wait();
    Ok(got)
}

/// The fraction of the pages at `heap` present in the page tables
/// (plaintext: an evicted page is missing, its ciphertext elsewhere), from
/// `pagemap` (the process's `/proc/PID/pagemap`); `entries` holds 8 bytes
/// per page of the heap. `None` when it cannot be read.
fn present_fraction(pagemap: &File, entries: &mut [u8], heap: u64) -> Option<f64> {
    pagemap.read_exact_at(entries, heap / 4096 * 8).ok()?;
    let present = entries.chunks_exact(8).filter(|e| e[7] & 0x80 != 0).count();
    #[allow(clippy::cast_precision_loss)]
    let frac = present as f64 / (entries.len() / 8).max(1) as f64;
    Some(frac)
}

/// What one run of the cold server measured.
#[derive(Debug, Clone)]
pub struct Served {
    /// Requests served per second from "ready" to "done".
    pub rate: f64,
    /// Mean over the pagemap samples (every `SERVE_SAMPLE`, from "ready"
    /// on) of the heap's pages missing from the page tables: its
    /// time-weighted ciphertext fraction under `memveil run`.
    pub coverage: f64,
    /// Pagemap samples taken.
    pub samples: u32,
    /// The coverage at the last sample.
    pub coverage_at_end: f64,
    /// Seconds from "ready" to the first sample with at least 0.90 of the
    /// heap missing (`None`: never).
    pub ramp_s: Option<f64>,
}

/// Between two pagemap samples of the cold server's heap (2 MiB of page
/// table entries for its 1 GiB: a few ms each).
const SERVE_SAMPLE: Duration = Duration::from_millis(500);

/// Runs the cold server (`exe`, `coldserver.c`) under `wrap`, or plainly
/// when `wrap` is empty: a `heap_mib` heap, `permille` of it hot in runs of
/// `run_pages` pages, serving for `run` once its dataset is written; samples
/// its heap's page-table entries every `SERVE_SAMPLE` meanwhile.
///
/// # Errors
/// The server could not start, said nothing, or ended without "done"; the
/// message says which, with its standard error.
pub fn serve(
    exe: &Path,
    wrap: &[&std::ffi::OsStr],
    heap_mib: u32,
    permille: u32,
    run_pages: u32,
    run: Duration,
) -> Result<Served, String> {
    let mut p = Launched::start(
        exe,
        wrap,
        &[
            heap_mib.to_string(),
            permille.to_string(),
            run.as_millis().to_string(),
            run_pages.to_string(),
        ],
    )?;
    let start = Duration::from_secs(60);
    let layout = p.lines.recv_timeout(start).ok().and_then(|l| {
        let mut it = l.split_whitespace();
        (it.next()? == "coldserver").then_some(())?;
        let heap = u64::from_str_radix(it.next()?.trim_start_matches("0x"), 16).ok()?;
        Some((heap, it.next()?.parse::<u64>().ok()?))
    });
    let Some((heap, bytes)) = layout else {
        return Err(p.fail("the server did not start"));
    };
    if p.lines.recv_timeout(start).as_deref() != Ok("ready") {
        return Err(p.fail("the server never wrote its dataset"));
    }
    let ready = Instant::now();
    let Some(pid) = p.pid(!wrap.is_empty(), exe) else {
        return Err(p.fail("the server's process was not found"));
    };
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))
        .map_err(|e| format!("/proc/{pid}/pagemap: {e} (needs root)"))?;
    let mut entries = vec![0u8; usize::try_from(bytes / 4096).unwrap_or(0) * 8];
    let (mut sum, mut samples, mut last, mut ramp_s) = (0.0, 0u32, 0.0, None);
    let deadline = ready + run + Duration::from_secs(60);
    let requests = loop {
        match p.lines.recv_timeout(SERVE_SAMPLE) {
            Ok(line) => {
                if let Some(rest) = line.strip_prefix("done ") {
                    let mut it = rest.split_whitespace().map(str::parse::<u64>);
                    let n = it.next().and_then(Result::ok).unwrap_or(0);
                    let ms = it.next().and_then(Result::ok).unwrap_or(0);
                    break (n, ms);
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(p.fail("the server ended without finishing"));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if Instant::now() > deadline {
            return Err(p.fail("the server ran past its time"));
        }
        if let Some(present) = present_fraction(&pagemap, &mut entries, heap) {
            last = 1.0 - present;
            sum += last;
            samples += 1;
            if last >= 0.90 && ramp_s.is_none() {
                ramp_s = Some(ready.elapsed().as_secs_f64());
            }
        }
    };
    let _ = p.child.0.wait();
    if samples == 0 || requests.1 == 0 {
        return Err(format!(
            "the server's heap was never sampled ({samples} samples) or it served no time"
        ));
    }
    #[allow(clippy::cast_precision_loss)]
    let rate = requests.0 as f64 / (requests.1 as f64 / 1000.0);
    Ok(Served {
        rate,
        coverage: sum / f64::from(samples),
        samples,
        coverage_at_end: last,
        ramp_s,
    })
}

/// Pages per run of the cold server's hot pages (what an allocator hands
/// out together).
const RUN_PAGES: u32 = 16;

/// Rounds of every exposure figure: each figure is their median, with the
/// spread (lowest-highest) in its note.
pub(crate) const ROUNDS: usize = 3;

/// The median of `v` and its spread as text (`lowest-highest`).
fn median_spread(v: &[f64], digits: usize) -> (f64, String) {
    let mut s = v.to_vec();
    let m = crate::timing::median(&mut s);
    let (lo, hi) = (
        s.first().copied().unwrap_or(0.0),
        s.last().copied().unwrap_or(0.0),
    );
    (m, format!("{lo:.digits$}-{hi:.digits$}"))
}

pub(crate) fn wrap_default(memveil: &Path) -> Vec<&std::ffi::OsStr> {
    vec![
        memveil.as_os_str(),
        "run".as_ref(),
        "--quiet".as_ref(),
        "--".as_ref(),
    ]
}

/// The `exposure` part (`memveil bench --only exposure`): the canary with a
/// 256 MiB heap at the defaults, its secret read never again, every second,
/// every 100 ms and continuously, and plainly as the positive control, in
/// `ROUNDS` rounds.
///
/// # Errors
/// No `memveil` executable beside this one, no C compiler, or a canary run
/// that failed (the message says which).
pub fn part(opts: &crate::BenchOpts) -> Result<crate::Section, crate::BenchError> {
    use std::fmt::Write as _;
    let fail = |m: String| super::err(format!("exposure: {m}"));
    let memveil = crate::procs::memveil_exe()
        .ok_or_else(|| fail("the memveil executable was not found beside this one".into()))?;
    let dir = crate::procs::scratch_dir("exposure");
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let result = canaries(opts, &memveil, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let (figures, table) = result.map_err(fail)?;
    let warm = 5;
    let mut md = String::new();
    let _ = write!(
        md,
        "Exposure (issues 26 and 33): the canary program holds a 64-byte secret in a page of its own and a 256 MiB \
         heap, a quarter of which it touches continuously; a sampler reads the secret's page through /proc/PID/mem at \
         random times (5-35 ms apart) for {} s after the secret is written ({warm} s into the run) and counts the \
         samples in which the secret is plaintext; every fourth sample it counts the heap's pages present in \
         /proc/PID/pagemap. {ROUNDS} rounds; each figure is their median (lowest-highest in brackets).\n\n\
         | run | samples (per round) | secret encrypted | heap plaintext |\n|---|---|---|---|\n{table}",
        opts.pick(10, 30),
    );
    Ok(crate::Section {
        part: "exposure".into(),
        title: "Exposure: how long a secret stays plaintext under `memveil run`".into(),
        markdown: md,
        figures,
        plots: Vec::new(),
    })
}

/// The canary runs of [`part`], in `dir`: its figures and table rows.
fn canaries(
    opts: &crate::BenchOpts,
    memveil: &Path,
    dir: &Path,
) -> Result<(Vec<crate::Figure>, String), String> {
    use std::fmt::Write as _;
    let exe = super::compile_canary(dir)?;
    let warm = Duration::from_secs(5);
    let run = Duration::from_secs(opts.pick(10, 30));
    let wrap = wrap_default(memveil);
    let periods: [(Option<Period>, &str); 5] = [
        (None, "== 0"),
        (Some(Period::Once), ">= 0.999"),
        (Some(Period::EveryMs(1000)), ">= 0.99"),
        (Some(Period::EveryMs(100)), ">= 0.95"),
        (Some(Period::Continuous), "reported"),
    ];
    // Per period: the encrypted fractions, samples and heap plaintext of
    // each round.
    let mut got: Vec<Vec<Exposure>> = vec![Vec::new(); periods.len()];
    for round in 0..ROUNDS {
        for (k, (period, _)) in periods.iter().enumerate() {
            let (what, w, p) = match period {
                None => (
                    "plainly (the positive control), read every 1 s".to_owned(),
                    &[][..],
                    Period::EveryMs(1000),
                ),
                Some(p) => (
                    format!("at the defaults, secret read {}", p.id()),
                    &wrap[..],
                    *p,
                ),
            };
            opts.say(&format!(
                "exposure: round {}/{ROUNDS}: canary {what}",
                round + 1
            ));
            got[k].push(measure(&exe, w, 256, p, warm, run)?);
        }
    }
    let mut figs = Vec::new();
    let mut table = String::new();
    let mut heap = Vec::new();
    for ((period, target), runs) in periods.iter().zip(&got) {
        let fracs: Vec<f64> = runs.iter().map(Exposure::encrypted_fraction).collect();
        let (m, spread) = median_spread(&fracs, 4);
        let samples: Vec<String> = runs.iter().map(|e| e.samples.to_string()).collect();
        let heaps: Vec<f64> = runs.iter().filter_map(|e| e.heap_plaintext).collect();
        let (h, _) = median_spread(&heaps, 3);
        let (id, row, what) = match period {
            None => (
                "plain".to_owned(),
                "plain (positive control), read every 1 s".to_owned(),
                String::new(),
            ),
            Some(p) => {
                heap.extend(heaps.iter().copied());
                (
                    p.id(),
                    format!("`memveil run`, read {}", p.id()),
                    match p {
                        Period::Once => "written once and never read again".to_owned(),
                        Period::Continuous => "read continuously".to_owned(),
                        Period::EveryMs(ms) => format!("read every {ms} ms"),
                    },
                )
            }
        };
        let _ = writeln!(
            table,
            "| {row} | {} | **{m:.4}** ({spread}) | {} |",
            samples.join(", "),
            if heaps.is_empty() {
                "n/a".to_owned()
            } else {
                format!("{h:.3}")
            }
        );
        let note = if period.is_none() {
            format!(
                "the positive control: the canary run plainly, its secret read every second; the sampler must find \
                 it in every one of its samples ({} per round); median of {ROUNDS} rounds ({spread})",
                samples.join(", ")
            )
        } else {
            format!(
                "the canary (a 256 MiB heap, a quarter of it touched continuously at random) under `memveil run` at \
                 its defaults, its 64-byte secret {what}: the share of samples (5-35 ms apart, for {} s after the \
                 secret was written {} s into the run; {} per round) in which /proc/PID/mem did not show the secret \
                 in plaintext; median of {ROUNDS} rounds (lowest-highest {spread})",
                run.as_secs(),
                warm.as_secs(),
                samples.join(", ")
            )
        };
        figs.push(
            crate::Figure::plain(
                &format!("shield.canary_{id}_encrypted_fraction"),
                m,
                "fraction",
                &note,
            )
            .target(target)
            .rounds(&fracs),
        );
    }
    if !heap.is_empty() {
        let (h, spread) = median_spread(&heap, 3);
        figs.push(crate::Figure::plain(
            "shield.canary_heap_plaintext_fraction",
            h,
            "fraction",
            &format!(
                "median over the canary runs at the defaults of the heap's pages present (plaintext) in \
                 /proc/PID/pagemap samples ({spread}): a quarter of the heap is in constant use"
            ),
        ));
    }
    Ok((figs, table))
}

/// The `coldserver` part (`memveil bench --only coldserver`,
/// `shield.server_cold_coverage`): a long-running server with a 1 GiB heap
/// of which 5% is hot, plainly and under `memveil run` at its defaults, in
/// `ROUNDS` rounds that rotate which goes first: the time-weighted
/// ciphertext fraction of its heap (seen in its page tables from outside)
/// and its request rate against the plain run's.
///
/// # Errors
/// No `memveil` executable beside this one, no C compiler, or a run that
/// failed (the message says which).
pub fn server_part(opts: &crate::BenchOpts) -> Result<crate::Section, crate::BenchError> {
    use std::fmt::Write as _;
    let fail = |m: String| super::err(format!("coldserver: {m}"));
    let memveil = crate::procs::memveil_exe()
        .ok_or_else(|| fail("the memveil executable was not found beside this one".into()))?;
    let dir = crate::procs::scratch_dir("coldserver");
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let exe = super::compile_coldserver(&dir);
    let (heap_mib, permille) = (1024, 50);
    let run = Duration::from_secs(opts.pick(90, 300));
    // The plain server's rate is steady from its first request: a third of
    // the time measures it.
    let plain_run = run / 3;
    let wrap = wrap_default(&memveil);
    let mut rows: Vec<(Served, Served)> = Vec::new();
    // Other protected programs draw on the host's budget the server sweeps
    // from: the figure is the server's alone on the host.
    let mut beside: Vec<String> = Vec::new();
    let result = exe.and_then(|exe| {
        for round in 0..ROUNDS {
            let say = |what: &str| {
                opts.say(&format!("coldserver: round {}/{ROUNDS}: {what}", round + 1));
            };
            for p in protected_programs(&memveil) {
                if !beside.contains(&p) {
                    opts.say(&format!(
                        "coldserver: WARNING: {p} is protected on this host and shares its budget: the figure \
                         needs a quiet host (none listed by `memveil shield status`)"
                    ));
                    beside.push(p);
                }
            }
            let plain_first = round % 2 == 0;
            let mut plain = None;
            let mut shield = None;
            for first in [true, false] {
                if first == plain_first {
                    say("plainly");
                    plain = Some(serve(&exe, &[], heap_mib, permille, RUN_PAGES, plain_run)?);
                } else {
                    say("under memveil run at its defaults");
                    shield = Some(serve(&exe, &wrap, heap_mib, permille, RUN_PAGES, run)?);
                }
            }
            if let (Some(p), Some(s)) = (plain, shield) {
                rows.push((p, s));
            }
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    result.map_err(fail)?;
    let ratio: Vec<f64> = rows.iter().map(|(p, s)| s.rate / p.rate).collect();
    let cover: Vec<f64> = rows.iter().map(|(_, s)| s.coverage).collect();
    let plain_cover: Vec<f64> = rows.iter().map(|(p, _)| p.coverage).collect();
    let (r, r_spread) = median_spread(&ratio, 3);
    let (c, c_spread) = median_spread(&cover, 3);
    let (pc, _) = median_spread(&plain_cover, 3);
    let mut table = String::new();
    for (k, (p, s)) in rows.iter().enumerate() {
        let _ = writeln!(
            table,
            "| {} | {:.2} M/s | {:.2} M/s | {:.3} | **{:.3}** | {:.3} | {} |",
            k + 1,
            p.rate / 1e6,
            s.rate / 1e6,
            s.rate / p.rate,
            s.coverage,
            s.coverage_at_end,
            s.ramp_s.map_or("never".into(), |t| format!("{t:.1} s")),
        );
    }
    let mut what = format!(
        "a request loop (coldserver.c) over a {heap_mib} MiB heap written at start, {}% of its pages hot (runs of \
         16 pages at random places) and the rest never touched again",
        permille / 10
    );
    if !beside.is_empty() {
        let _ = write!(
            what,
            " (NOT alone on the host: {} other protected program(s) shared the host's budget: {}; the figure is \
             the server alone and needs a quiet host)",
            beside.len(),
            beside.join(", ")
        );
    }
    let figures = vec![
        crate::Figure::plain(
            "shield.server_cold_coverage",
            c,
            "fraction",
            &format!(
                "{what}, under `memveil run` at its defaults for {} s once its dataset is written: the mean over \
                 page-table samples every 0.5 s (from /proc/PID/pagemap, from the moment the dataset is written, so \
                 the cold start counts) of the heap's share not present (ciphertext); median of {ROUNDS} rounds \
                 (lowest-highest {c_spread}); the plain server's is {pc:.3}",
                run.as_secs()
            ),
        )
        .target(">= 0.90")
        .rounds(&cover),
        crate::Figure::plain(
            "shield.server_cold_throughput_vs_plain",
            r,
            "ratio",
            &format!(
                "{what}: requests per second under `memveil run` at its defaults ({} s) over the same server's plain \
                 rate ({} s) in the same round; median of {ROUNDS} rounds (lowest-highest {r_spread})",
                run.as_secs(),
                plain_run.as_secs()
            ),
        )
        .target(">= 0.95")
        .rounds(&ratio),
    ];
    let mut md = String::new();
    let _ = write!(
        md,
        "A long-running server with a cold dataset (issue 33): {what}. Each request reads a 64-byte record of a hot \
         page at random and updates it. The server runs {} s under `memveil run` at its defaults and {} s plainly, \
         in {ROUNDS} rounds that alternate which goes first; a sampler reads the heap's page-table entries \
         (/proc/PID/pagemap) every 0.5 s from the moment the dataset is written: a page missing from them is \
         ciphertext. Coverage is their mean over the run, the cold start included.\n\n\
         | round | plain | `memveil run` | ratio | coverage | at the end | to 0.90 |\n|---|---|---|---|---|---|---|\n\
         {table}",
        run.as_secs(),
        plain_run.as_secs()
    );
    Ok(crate::Section {
        part: "coldserver".into(),
        title: "A server with a cold heap under `memveil run`".into(),
        markdown: md,
        figures,
        plots: Vec::new(),
    })
}

/// The protected programs `memveil shield status --json` lists now, as
/// `pid N (command)`; none when it cannot be run or read.
fn protected_programs(memveil: &Path) -> Vec<String> {
    std::process::Command::new(memveil)
        .args(["shield", "status", "--json"])
        .output()
        .ok()
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
        .map_or_else(Vec::new, |v| listed(&v))
}

/// The programs of a `memveil shield status --json` answer, as `pid N
/// (command)`.
fn listed(status: &serde_json::Value) -> Vec<String> {
    status["programs"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    format!(
                        "pid {} ({})",
                        p["pid"].as_u64().unwrap_or(0),
                        p["command"].as_str().unwrap_or("?")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_programs_shield_status_lists_are_named_for_the_cold_servers_warning() {
        let v: serde_json::Value = serde_json::from_str(
            r#"{"host": {"cpus": 2}, "on_host_budget": 1, "programs": [
                {"pid": 15329, "command": "/usr/bin/python3 w.py 200000", "on_host_budget": true}]}"#,
        )
        .expect("json");
        assert_eq!(listed(&v), ["pid 15329 (/usr/bin/python3 w.py 200000)"]);
        let none: serde_json::Value =
            serde_json::from_str(r#"{"host": {"cpus": 2}, "programs": []}"#).expect("json");
        assert!(listed(&none).is_empty());
        assert!(listed(&serde_json::Value::Null).is_empty());
    }

    #[test]
    fn the_layout_line_is_parsed_and_bad_ones_refused() {
        let key = "ab".repeat(64);
        let l = parse_layout(&format!(
            "canary 0x7f0000001000 {key} 0x7f1000000000 268435456"
        ))
        .expect("layout");
        assert_eq!(l.secret, 0x7f00_0000_1000);
        assert_eq!(l.key, vec![0xab; 64]);
        assert_eq!(l.heap_bytes, 256 << 20);
        for bad in [
            "",
            "canary",
            "canary 0x1 abab 0x2 3",
            "other 0x1 {key} 0x2 3",
            "canary zz {key} 0x2 3",
        ] {
            assert!(parse_layout(&bad.replace("{key}", &key)).is_none(), "{bad}");
        }
        assert_eq!(Period::EveryMs(1000).id(), "1s");
        assert_eq!(Period::EveryMs(100).id(), "100ms");
        assert_eq!(Period::Once.id(), "idle");
    }
}
