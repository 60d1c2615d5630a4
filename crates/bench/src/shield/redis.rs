//! redis-server plainly and under `memveil run`, and redis-benchmark
//! against it: the shield part's redis rows (and the workloads part's).

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::err;
use crate::procs::{exited_within, in_path, memveil_exe, pinned_command, tail};
use crate::{BenchError, BenchOpts};
/// A redis-server (plain or under `memveil run`) on a Unix socket, stopped
/// on drop: SIGTERM, then SIGKILL of the server (by its pid file) and of the
/// child after 10 s.
pub(crate) struct Server {
    child: Option<Child>,
    dir: PathBuf,
    pub(crate) sock: PathBuf,
    log: PathBuf,
}

impl Server {
    /// `cpu`: the CPU the server (and under `memveil run` its fault handler)
    /// is pinned to: `memveil run --cpu N`, or `taskset -c N` for the plain
    /// server.
    pub(crate) fn start(
        redis: &Path,
        memveil: Option<&Path>,
        dir: &Path,
        stats: Option<&Path>,
        cpu: Option<usize>,
        run_args: &[&str],
    ) -> Result<Self, BenchError> {
        let sock = dir.join("redis.sock");
        let log = dir.join("server.log");
        let pidfile = dir.join("redis.pid");
        let _ = std::fs::remove_file(&sock);
        let _ = std::fs::remove_file(&pidfile);
        let logf =
            std::fs::File::create(&log).map_err(|e| err(format!("{}: {e}", log.display())))?;
        let logf2 = logf
            .try_clone()
            .map_err(|e| err(format!("{}: {e}", log.display())))?;
        let mut cmd = match memveil {
            Some(mv) => {
                let mut c = Command::new(mv);
                c.arg("run").arg("--quiet");
                if let Some(s) = stats {
                    c.arg("--stats-json").arg(s);
                }
                if let Some(n) = cpu {
                    c.arg("--cpu").arg(n.to_string());
                }
                c.args(run_args).arg("--").arg(redis);
                c
            }
            None => pinned_command(redis, cpu),
        };
        cmd.arg("--port")
            .arg("0")
            .arg("--unixsocket")
            .arg(&sock)
            .arg("--pidfile")
            .arg(&pidfile)
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .stdin(Stdio::null())
            .stdout(logf)
            .stderr(logf2);
        let child = cmd
            .spawn()
            .map_err(|e| err(format!("starting {}: {e}", redis.display())))?;
        let mut s = Self {
            child: Some(child),
            dir: dir.to_path_buf(),
            sock,
            log,
        };
        s.wait_ready()?;
        Ok(s)
    }

    fn ping(&self) -> bool {
        let Ok(mut c) = UnixStream::connect(&self.sock) else {
            return false;
        };
        let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
        if c.write_all(b"PING\r\n").is_err() {
            return false;
        }
        let mut buf = [0u8; 7];
        c.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    fn wait_ready(&mut self) -> Result<(), BenchError> {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    return Err(err(format!(
                        "redis-server exited at start ({st}): {}",
                        tail(&self.log)
                    )));
                }
            }
            if self.ping() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(err(format!(
            "redis-server did not answer PING on {} within 20 s: {}",
            self.sock.display(),
            tail(&self.log)
        )))
    }

    /// Stops the server; returns whether it exited on SIGTERM.
    pub(crate) fn stop(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let _ = memveil_sys::process::send_signal(child.id(), libc::SIGTERM);
        if exited_within(&mut child, Duration::from_secs(10)) {
            return true;
        }
        if let Some(pid) = std::fs::read_to_string(self.dir.join("redis.pid"))
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
        {
            let _ = memveil_sys::process::send_signal(pid, libc::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs redis-benchmark against `sock` (pinned to `cpu` if given); returns
/// (SET, GET) requests/s.
pub(crate) fn redis_benchmark(
    bench: &Path,
    sock: &Path,
    args: &[&str],
    cpu: Option<usize>,
) -> Result<(f64, f64), BenchError> {
    let out = pinned_command(bench, cpu)
        .arg("-s")
        .arg(sock)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| err(format!("running {}: {e}", bench.display())))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rate = |name: &str| -> Option<f64> {
        text.split(['\r', '\n'])
            .filter_map(|l| l.trim().strip_prefix(name))
            .filter(|l| l.contains("requests per second"))
            .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
            .next_back()
    };
    match (rate("SET:"), rate("GET:")) {
        (Some(s), Some(g)) if out.status.success() => Ok((s, g)),
        _ => Err(err(format!(
            "redis-benchmark {} ({}) printed no SET/GET rates: {} {}",
            args.join(" "),
            out.status,
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
    }
}

pub(super) struct RedisRow {
    pub(super) setting: &'static str,
    pub(super) args: Vec<String>,
    pub(super) plain: (f64, f64),
    pub(super) shield: (f64, f64),
    /// (SET, GET) ratio of each round.
    pub(super) per_round: Vec<(f64, f64)>,
    /// From --stats-json: plaintext fraction at exit, pages protected,
    /// faults, evictions, samples (s, fraction).
    pub(super) plaintext: Option<f64>,
    pub(super) stats_line: String,
    pub(super) samples: Vec<(f64, f64)>,
}

impl RedisRow {
    /// (SET, GET): protected / plain, the median of the paired rounds.
    pub(super) fn median_ratio(&self) -> (f64, f64) {
        let (mut s, mut g): (Vec<f64>, Vec<f64>) = self.per_round.iter().copied().unzip();
        (crate::timing::median(&mut s), crate::timing::median(&mut g))
    }

    /// (SET, GET): the rounds' ratios as `min-max`.
    pub(super) fn spread(&self) -> (String, String) {
        let (s, g): (Vec<f64>, Vec<f64>) = self.per_round.iter().copied().unzip();
        (super::suite::spread(&s), super::suite::spread(&g))
    }
}

fn read_stats(path: &Path) -> (Option<f64>, String, Vec<(f64, f64)>) {
    let Ok(text) = std::fs::read_to_string(path) else {
        return (
            None,
            format!("no --stats-json file at {}", path.display()),
            Vec::new(),
        );
    };
    let Ok(j) = serde_json::from_str::<serde_json::Value>(&text) else {
        return (None, "unreadable --stats-json file".into(), Vec::new());
    };
    let n = |k: &str| j.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
    // Time-weighted where the shield's watchdog measured it, else at exit.
    let frac = j
        .get("time_plaintext_fraction")
        .and_then(serde_json::Value::as_f64)
        .or_else(|| {
            j.get("plaintext_fraction")
                .and_then(serde_json::Value::as_f64)
        });
    let samples = j
        .get("samples")
        .and_then(serde_json::Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| {
                    Some((
                        s.get("t")?.as_f64()?,
                        s.get("plaintext_fraction")?.as_f64()?,
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    let line = format!(
        "{} pages protected, {} resident + {} evicted at exit, {} faults, {} evictions, guarantee {}, the shield \
         cost {}",
        n("pages_protected"),
        n("resident_pages"),
        n("evicted_pages"),
        n("faults"),
        n("evictions"),
        j.get("guarantee").and_then(serde_json::Value::as_str).unwrap_or("?"),
        j.get("cost_fraction")
            .and_then(serde_json::Value::as_f64)
            .map_or("n/a".to_owned(), |c| format!("{:.1}% of its time", 100.0 * c))
    );
    (frac, line, samples)
}

pub(super) struct RedisTools {
    server: PathBuf,
    bench: PathBuf,
    memveil: PathBuf,
}

/// Finds redis-server, redis-benchmark and a working `memveil run`, or says
/// what is missing.
pub(super) fn redis_tools(dir: &Path) -> Result<RedisTools, String> {
    let server = in_path("redis-server")
        .ok_or("redis-server not found in PATH (Debian package redis-server)")?;
    let bench = in_path("redis-benchmark")
        .ok_or("redis-benchmark not found in PATH (Debian package redis-tools)")?;
    let memveil = memveil_exe().ok_or(
        "the memveil executable was not found (this program is not `memveil` and none lies beside it)",
    )?;
    let log = dir.join("probe.log");
    let logf = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let st = Command::new(&memveil)
        .args(["run", "--quiet", "--", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(logf)
        .status()
        .map_err(|e| format!("running {} run: {e}", memveil.display()))?;
    if !st.success() {
        return Err(format!(
            "`{} run -- true` failed ({st}): {}",
            memveil.display(),
            tail(&log)
        ));
    }
    Ok(RedisTools {
        server,
        bench,
        memveil,
    })
}

/// (server CPU, redis-benchmark CPU).
type Pin = (usize, usize);

pub(super) fn redis_rows(
    opts: &BenchOpts,
    t: &RedisTools,
    dir: &Path,
) -> Result<Vec<RedisRow>, BenchError> {
    let n = opts.pick("200000", "200000");
    let large = vec!["-n", n, "-r", "100000", "-d", "512", "-t", "set,get", "-q"];
    // (setting, arguments, (server CPU, benchmark CPU)): the pinned setting
    // places both servers (and the shield's handler) on one CPU and
    // redis-benchmark on another, as `memveil run --cpu` is meant for.
    // (setting, redis-benchmark arguments, pins, `memveil run` arguments).
    type Setting<'a> = (&'static str, Vec<&'a str>, Option<Pin>, &'a [&'a str]);
    let mut settings: Vec<Setting> = vec![
        ("small", vec!["-n", n, "-t", "set,get", "-q"], None, &[]),
        ("large", large.clone(), None, &[]),
        // The program suite's fixed-window figure.
        ("large_w4096", large.clone(), None, &["--window", "4096"]),
    ];
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    if cpus > 1 {
        settings.push(("large_pinned", large, Some((0, 1)), &[]));
    } else {
        opts.say("shield: one CPU only: the large_pinned redis setting is left out");
    }
    // redis-server under `memveil run` with the large setting takes 10-20 s
    // here; the plain baseline moves 30-50% between minutes, so the large
    // setting, whose figures have targets, runs three paired rounds
    // (alternating which goes first; the figure is their median) and the
    // pinned setting once; the small setting (~4 s a side) swings +-20%
    // between rounds, hence three as well.
    let rounds = |setting: &str| match (setting, opts.size) {
        ("large_w4096", _) | ("large_pinned", crate::Size::Small) => 1,
        ("large", _) => 3,
        ("large_pinned", crate::Size::Full) => 2,
        (_, crate::Size::Small) => 3,
        (_, crate::Size::Full) => 4,
    };
    let mut rows = Vec::new();
    for (setting, args, pin, run_args) in settings {
        let (mut plain, mut shield) = ((0.0f64, 0.0f64), (0.0f64, 0.0f64));
        let mut stats = (None, String::new(), Vec::new());
        let mut per_round = Vec::new();
        for round in 0..rounds(setting) {
            let json = dir.join(format!("stats-{setting}.json"));
            let _ = std::fs::remove_file(&json);
            let side = |protected: bool| -> Result<(f64, f64), BenchError> {
                opts.say(&format!(
                    "shield: redis {setting} ({}{}), {}, round {}",
                    args.join(" "),
                    pin.map_or(String::new(), |(a, b)| format!(
                        "; server on CPU {a}, redis-benchmark on CPU {b}"
                    )),
                    if protected {
                        "under memveil run"
                    } else {
                        "plain"
                    },
                    round + 1
                ));
                let mv = protected.then_some(t.memveil.as_path());
                let stats = protected.then_some(json.as_path());
                let mut s = Server::start(&t.server, mv, dir, stats, pin.map(|p| p.0), run_args)?;
                let r = redis_benchmark(&t.bench, &s.sock, &args, pin.map(|p| p.1))?;
                if !s.stop() {
                    opts.say("shield: redis-server did not exit on SIGTERM within 10 s; killed");
                }
                Ok(r)
            };
            // Alternate which side goes first, so a drift in the machine's
            // load does not favour one side.
            let (p, q) = if round % 2 == 0 {
                let p = side(false)?;
                (p, side(true)?)
            } else {
                let q = side(true)?;
                (side(false)?, q)
            };
            per_round.push((q.0 / p.0, q.1 / p.1));
            plain = (plain.0.max(p.0), plain.1.max(p.1));
            shield = (shield.0.max(q.0), shield.1.max(q.1));
            stats = read_stats(&json);
        }
        rows.push(RedisRow {
            setting,
            args: args.iter().map(|s| (*s).to_owned()).collect(),
            plain,
            shield,
            per_round,
            plaintext: stats.0,
            stats_line: stats.1,
            samples: stats.2,
        });
    }
    Ok(rows)
}
