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
/// `memveil run` the child of it that runs `exe` (memveil run also starts a
/// guardian process for its cgroup).
fn canary_pid(child: &Child, wrapped: bool, exe: &Path) -> Option<u32> {
    if !wrapped {
        return Some(child.id());
    }
    let want = std::fs::canonicalize(exe).ok()?;
    let kids = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", child.id())).ok()?;
    kids.split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|p| std::fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|e| e == want))
}

/// Kills the child (and its process group's canary) on every way out.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
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
    let mut cmd = match wrap.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    let ms = |d: Duration| d.as_millis().to_string();
    cmd.args([heap_mib.to_string(), period.arg(), ms(warm), ms(run)])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = Reaper(
        cmd.spawn()
            .map_err(|e| format!("starting {}: {e}", exe.display()))?,
    );
    let stdout = child.0.stdout.take().ok_or("no stdout")?;
    let stderr = child.0.stderr.take().ok_or("no stderr")?;
    let err_text = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut s);
        s
    });
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + warm + run + Duration::from_secs(60);
    let fail = |what: &str, child: Reaper, err: std::thread::JoinHandle<String>| {
        drop(child);
        format!("{what}: {}", err.join().unwrap_or_default().trim())
    };
    let first = rx.recv_timeout(warm + Duration::from_secs(30));
    let Some(layout) = first.ok().as_deref().and_then(parse_layout) else {
        return Err(fail("the canary did not start", child, err_text));
    };
    if rx.recv_timeout(warm + Duration::from_secs(30)).as_deref() != Ok("ready") {
        return Err(fail("the canary never wrote its secret", child, err_text));
    }
    let Some(pid) = canary_pid(&child.0, !wrap.is_empty(), exe) else {
        return Err(fail("the canary's process was not found", child, err_text));
    };
    let mem = File::open(format!("/proc/{pid}/mem"))
        .map_err(|e| format!("/proc/{pid}/mem: {e} (needs root, or ptrace rights)"))?;
    let pagemap = File::open(format!("/proc/{pid}/pagemap")).ok();
    let heap_pages = usize::try_from(layout.heap_bytes / 4096).unwrap_or(0);
    let mut entries = vec![0u8; heap_pages * 8];
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
        match rx.recv_timeout(wait) {
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
                return Err(fail("the canary ended without finishing", child, err_text));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if Instant::now() > deadline {
            return Err(fail("the canary ran past its time", child, err_text));
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
            if let Some(pm) = &pagemap {
                if pm
                    .read_exact_at(&mut entries, layout.heap / 4096 * 8)
                    .is_ok()
                {
                    let present = entries.chunks_exact(8).filter(|e| e[7] & 0x80 != 0).count();
                    #[allow(clippy::cast_precision_loss)]
                    let frac = present as f64 / heap_pages.max(1) as f64;
                    heap_sum += frac;
                    heap_n += 1;
                }
            }
        }
    }
    buf.fill(0);
    got.heap_plaintext = (heap_n > 0).then(|| heap_sum / f64::from(heap_n));
    let _ = child.0.wait();
    Ok(got)
}

/// The exposure figures of `memveil bench --only shield`: the canary with a
/// 256 MiB heap at the defaults, its secret read never again, every second,
/// every 100 ms and continuously, and plainly as the positive control.
pub(crate) fn figures(
    opts: &crate::BenchOpts,
    memveil: &Path,
    dir: &Path,
    figs: &mut Vec<crate::Figure>,
    md: &mut String,
) -> Result<(), String> {
    use std::fmt::Write as _;
    let exe = super::compile_canary(dir)?;
    let warm = Duration::from_secs(5);
    let run = Duration::from_secs(opts.pick(10, 30));
    let wrap: Vec<&std::ffi::OsStr> = vec![
        memveil.as_os_str(),
        "run".as_ref(),
        "--quiet".as_ref(),
        "--".as_ref(),
    ];
    opts.say("shield: canary, plainly (the positive control)");
    let plain = measure(&exe, &[], 256, Period::EveryMs(1000), warm, run)?;
    let mut table = format!(
        "| plain (positive control), read every 1 s | {} | {:.4} | {} |\n",
        plain.samples,
        plain.encrypted_fraction(),
        plain
            .heap_plaintext
            .map_or("n/a".into(), |h| format!("{h:.3}"))
    );
    figs.push(
        crate::Figure::plain(
            "shield.canary_plain_encrypted_fraction",
            plain.encrypted_fraction(),
            "fraction",
            &format!(
                "the positive control: the canary run plainly, its secret read every second; the sampler must find \
                 it in every one of its {} samples",
                plain.samples
            ),
        )
        .target("== 0"),
    );
    let mut heap = Vec::new();
    for (period, target) in [
        (Period::Once, ">= 0.99"),
        (Period::EveryMs(1000), ">= 0.95"),
        (Period::EveryMs(100), "reported"),
        (Period::Continuous, "reported"),
    ] {
        opts.say(&format!(
            "shield: canary at the defaults, secret read {}",
            period.id()
        ));
        let e = measure(&exe, &wrap, 256, period, warm, run)?;
        let _ = writeln!(
            table,
            "| `memveil run`, read {} | {} | **{:.4}** | {} |",
            period.id(),
            e.samples,
            e.encrypted_fraction(),
            e.heap_plaintext.map_or("n/a".into(), |h| format!("{h:.3}"))
        );
        heap.extend(e.heap_plaintext);
        figs.push(
            crate::Figure::plain(
                &format!("shield.canary_{}_encrypted_fraction", period.id()),
                e.encrypted_fraction(),
                "fraction",
                &format!(
                    "the canary (a 256 MiB heap, a quarter of it touched continuously at random) under `memveil run` \
                     at its defaults, its 64-byte secret {}: the share of {} samples (5-35 ms apart, for {} s after \
                     the secret was written {} s into the run) in which /proc/PID/mem did not show the secret in \
                     plaintext",
                    match period {
                        Period::Once => "written once and never read again".to_owned(),
                        Period::Continuous => "read continuously".to_owned(),
                        Period::EveryMs(ms) => format!("read every {ms} ms"),
                    },
                    e.samples,
                    run.as_secs(),
                    warm.as_secs()
                ),
            )
            .target(target),
        );
    }
    #[allow(clippy::cast_precision_loss)]
    let mean_heap = (!heap.is_empty()).then(|| heap.iter().sum::<f64>() / heap.len() as f64);
    if let Some(h) = mean_heap {
        figs.push(crate::Figure::plain(
            "shield.canary_heap_plaintext_fraction",
            h,
            "fraction",
            "mean over the canary runs at the defaults of the heap's pages present (plaintext) in /proc/PID/pagemap \
             samples: a quarter of the heap is in constant use",
        ));
    }
    let _ = write!(
        md,
        "\nExposure (issue 26): the canary program holds a 64-byte secret in a page of its own and a 256 MiB heap, a \
         quarter of which it touches continuously; a sampler reads the secret's page through /proc/PID/mem at random \
         times (5-35 ms apart) for {} s after the secret is written ({} s into the run) and counts the samples in which \
         the secret is plaintext; every fourth sample it counts the heap's pages present in /proc/PID/pagemap.\n\n\
         | run | samples | secret encrypted | heap plaintext |\n|---|---|---|---|\n{table}",
        run.as_secs(),
        warm.as_secs()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
