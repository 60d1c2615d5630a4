//! etcd under `memveil run` (issue 34: `shield.etcd_put_vs_plain`,
//! `shield.etcd_get_vs_plain`): Debian's etcd-server (a Go program) run
//! plainly and protected side by side, loaded in turns, its data directory on
//! tmpfs, driven over its HTTP/JSON gateway (`/v3/kv/put`, `/v3/kv/range`)
//! by client threads on kept-alive connections.

use std::fmt::Write as _;
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64ct::{Base64, Encoding as _};

use crate::procs::{exited_within, in_path, scratch_dir};
use crate::timing::median;
use crate::{BenchOpts, Figure};

/// Rounds (each a plain and a protected server side by side, see [`round`]).
const ROUNDS: usize = 5;
/// Client threads, each on its own connection.
const CLIENTS: usize = 8;
/// Keys the load writes and reads.
const KEYS: usize = 1000;

/// One etcd server (killed on drop).
pub struct Server {
    child: Child,
    /// The client port on 127.0.0.1.
    pub port: u16,
    /// Its data directory.
    pub data: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free TCP port on 127.0.0.1 (bound and released).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

impl Server {
    /// Starts etcd with its data in `data`, plainly or under `wrap` (e.g.
    /// `memveil run --quiet --`), and waits until it answers a put.
    ///
    /// # Errors
    /// No etcd (Debian's etcd-server), or it did not come up in 30 s (its
    /// log's end in the message).
    pub fn start(wrap: &[&std::ffi::OsStr], data: &Path, log: &Path) -> Result<Self, String> {
        let etcd = in_path("etcd").ok_or("etcd not found in PATH (Debian package etcd-server)")?;
        let (port, peer) = (free_port()?, free_port()?);
        let mut cmd = match wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&etcd);
                c
            }
            None => Command::new(&etcd),
        };
        let logf = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        cmd.arg("--data-dir")
            .arg(data)
            .args([
                "--name",
                "memveil-bench",
                "--listen-client-urls",
                &format!("http://127.0.0.1:{port}"),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{port}"),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
                "--initial-cluster",
                &format!("memveil-bench=http://127.0.0.1:{peer}"),
                "--logger",
                "zap",
                "--log-level",
                "warn",
            ])
            .stdin(Stdio::null())
            .stdout(logf.try_clone().map_err(|e| e.to_string())?)
            .stderr(logf);
        let child = cmd.spawn().map_err(|e| format!("starting etcd: {e}"))?;
        let mut s = Server {
            child,
            port,
            data: data.to_path_buf(),
        };
        let t = Instant::now();
        loop {
            if let Ok(mut c) = Client::connect(port) {
                if c.put("memveil-bench-ready", b"1").is_ok() {
                    return Ok(s);
                }
            }
            if let Ok(Some(st)) = s.child.try_wait() {
                return Err(format!(
                    "etcd exited at start ({st}): {}",
                    crate::procs::tail(log)
                ));
            }
            if t.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "etcd did not answer within 30 s: {}",
                    crate::procs::tail(log)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The process id of the process `start` spawned.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops it with SIGTERM; its exit status (None: it had to be killed
    /// after 20 s).
    pub fn stop(mut self) -> Option<std::process::ExitStatus> {
        let pid = libc::pid_t::try_from(self.child.id()).ok()?;
        // SAFETY: kill(2) takes no pointers; `pid` is our own child, not yet
        // reaped, so the id cannot have been reused.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        exited_within(&mut self.child, Duration::from_secs(20))
            .then(|| self.child.wait().ok())
            .flatten()
    }
}

/// Whether etcd ended as it does after a graceful shutdown on SIGTERM (it
/// re-raises the signal once its data is synced and closed; `memveil run`
/// passes that on as exit status 128 + 15).
#[must_use]
pub fn clean_stop(st: std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt as _;
    st.success() || st.signal() == Some(libc::SIGTERM) || st.code() == Some(128 + libc::SIGTERM)
}

/// One kept-alive HTTP/1.1 connection to etcd's JSON gateway.
pub struct Client {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

impl Client {
    /// Connects to etcd on 127.0.0.1:`port`.
    ///
    /// # Errors
    /// The connection was refused.
    pub fn connect(port: u16) -> Result<Self, String> {
        let w = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
        let _ = w.set_nodelay(true);
        let _ = w.set_read_timeout(Some(Duration::from_secs(10)));
        let r = BufReader::new(w.try_clone().map_err(|e| e.to_string())?);
        Ok(Self { w, r })
    }

    /// POSTs `body` to `path`; the response body.
    fn post(&mut self, path: &str, body: &str) -> Result<String, String> {
        write!(
            self.w,
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .map_err(|e| e.to_string())?;
        let mut line = String::new();
        self.r.read_line(&mut line).map_err(|e| e.to_string())?;
        let ok = line.split_whitespace().nth(1) == Some("200");
        let (mut len, mut chunked) = (None, false);
        loop {
            line.clear();
            if self.r.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
                return Err("connection closed".into());
            }
            let h = line.trim_end();
            if h.is_empty() {
                break;
            }
            let lower = h.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                len = v.trim().parse::<usize>().ok();
            } else if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
                chunked = true;
            }
        }
        let mut out = Vec::new();
        if chunked {
            loop {
                line.clear();
                self.r.read_line(&mut line).map_err(|e| e.to_string())?;
                let n = usize::from_str_radix(line.trim(), 16).map_err(|e| e.to_string())?;
                let mut chunk = vec![0u8; n + 2];
                self.r.read_exact(&mut chunk).map_err(|e| e.to_string())?;
                if n == 0 {
                    break;
                }
                out.extend_from_slice(&chunk[..n]);
            }
        } else {
            let n = len.ok_or("no Content-Length")?;
            out.resize(n, 0);
            self.r.read_exact(&mut out).map_err(|e| e.to_string())?;
        }
        let text = String::from_utf8_lossy(&out).into_owned();
        if ok {
            Ok(text)
        } else {
            Err(format!("HTTP error: {text}"))
        }
    }

    /// Puts `key` = `value`.
    ///
    /// # Errors
    /// The request failed.
    pub fn put(&mut self, key: &str, value: &[u8]) -> Result<(), String> {
        let body = format!(
            r#"{{"key":"{}","value":"{}"}}"#,
            Base64::encode_string(key.as_bytes()),
            Base64::encode_string(value)
        );
        self.post("/v3/kv/put", &body).map(|_| ())
    }

    /// The value of `key`, if any.
    ///
    /// # Errors
    /// The request failed or its answer was not etcd's.
    pub fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, String> {
        let body = format!(r#"{{"key":"{}"}}"#, Base64::encode_string(key.as_bytes()));
        let text = self.post("/v3/kv/range", &body)?;
        let j: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
        let Some(v) = j
            .get("kvs")
            .and_then(|k| k.get(0))
            .and_then(|k| k.get("value"))
            .and_then(serde_json::Value::as_str)
        else {
            return Ok(None);
        };
        Base64::decode_vec(v)
            .map(Some)
            .map_err(|e| format!("value not base64: {e}"))
    }
}

/// The value written to key `i` in round `tag` (deterministic, 256 bytes).
fn value(tag: u64, i: usize) -> Vec<u8> {
    let mut rng = super::suite::Rng(tag ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (0..32).flat_map(|_| rng.next().to_le_bytes()).collect()
}

/// Requests `CLIENTS` threads doing `op` for `secs` completed, and the
/// seconds they took.
fn load(port: u16, secs: f64, put: bool, tag: u64) -> Result<(u64, f64), String> {
    let t = Instant::now();
    let until = t + Duration::from_secs_f64(secs);
    let handles: Vec<_> = (0..CLIENTS)
        .map(|c| {
            std::thread::spawn(move || -> Result<u64, String> {
                let mut cl = Client::connect(port)?;
                let mut n = 0u64;
                let mut i = c;
                while Instant::now() < until {
                    let k = i % KEYS;
                    if put {
                        cl.put(&format!("bench/{k}"), &value(tag, k))?;
                    } else {
                        let got = cl.get(&format!("bench/{k}"))?;
                        if got.as_deref() != Some(&value(tag, k)[..]) {
                            return Err(format!("bench/{k}: wrong value read back"));
                        }
                    }
                    n += 1;
                    i += CLIENTS;
                }
                Ok(n)
            })
        })
        .collect();
    let mut total = 0;
    for h in handles {
        total += h.join().map_err(|_| "a client thread panicked")??;
    }
    Ok((total, t.elapsed().as_secs_f64()))
}

/// Writes every key once (the gets read them all).
fn fill(port: u16, tag: u64) -> Result<(), String> {
    let handles: Vec<_> = (0..CLIENTS)
        .map(|c| {
            std::thread::spawn(move || -> Result<(), String> {
                let mut cl = Client::connect(port)?;
                for k in (c..KEYS).step_by(CLIENTS) {
                    cl.put(&format!("bench/{k}"), &value(tag, k))?;
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| "a client thread panicked")??;
    }
    Ok(())
}

/// Interleaved load slices per phase and round (each server's share of a
/// phase is cut into this many slices, taken in turns with the other
/// server's, ABBA).
const SLICES: usize = 4;

/// One round: a plain and a protected server side by side (each with its
/// keys written and `warm` s of puts untimed), then `SLICES` slices of
/// `slice` s of puts per server taken in turns, then as many of gets. A
/// slice's neighbour in time is the other server's, so a change of the
/// host's speed (another program, the CPU's turbo) weighs on both alike;
/// plain etcd's rates moved up to 2.5x between the rounds of the bench's
/// first method (one server at a time, 3-10 s each).
/// `[plain, protected]` rates: `(put/s, get/s)`.
fn round(
    wrap: &[&std::ffi::OsStr],
    dir: &Path,
    warm: f64,
    slice: f64,
    round: usize,
) -> Result<[(f64, f64); 2], String> {
    let mut servers = Vec::new();
    for which in 0..2 {
        let tag = (round * 2 + which) as u64 + 1;
        let data = dir.join(format!("data-{tag}"));
        let _ = std::fs::remove_dir_all(&data);
        let log = dir.join(format!("etcd-{tag}.log"));
        let w: &[&std::ffi::OsStr] = if which == 0 { &[] } else { wrap };
        let s = Server::start(w, &data, &log)?;
        fill(s.port, tag)?;
        servers.push((s, tag, log));
    }
    for (s, tag, _) in &servers {
        load(s.port, warm, true, *tag)?;
    }
    let mut rates = [(0.0, 0.0); 2];
    for put in [true, false] {
        let mut done = [(0u64, 0.0f64); 2];
        for k in 0..SLICES {
            // ABBA: each server goes first as often as second.
            let order: [usize; 2] = if (k + round).is_multiple_of(2) {
                [0, 1]
            } else {
                [1, 0]
            };
            for which in order {
                let (s, tag, _) = &servers[which];
                let (n, t) = load(s.port, slice, put, *tag)?;
                done[which].0 += n;
                done[which].1 += t;
            }
        }
        for which in 0..2 {
            #[allow(clippy::cast_precision_loss)]
            let rate = done[which].0 as f64 / done[which].1;
            if put {
                rates[which].0 = rate;
            } else {
                rates[which].1 = rate;
            }
        }
    }
    for (s, _, log) in servers {
        let data = s.data.clone();
        let stopped = s.stop();
        let _ = std::fs::remove_dir_all(&data);
        match stopped {
            Some(st) if clean_stop(st) => {}
            other => {
                return Err(format!(
                    "etcd did not stop cleanly on SIGTERM ({other:?}): {}",
                    crate::procs::tail(&log)
                ))
            }
        }
    }
    Ok(rates)
}

/// The etcd figures.
///
/// # Errors
/// No etcd, or a run failed (the message says which).
pub(crate) fn figures(
    opts: &BenchOpts,
    memveil: &Path,
    md: &mut String,
) -> Result<Vec<Figure>, String> {
    // tmpfs: the server's memory is measured, not the disk's fsync.
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        shm.join(format!("memveil-bench-etcd-{}", std::process::id()))
    } else {
        scratch_dir("etcd")
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let wrap = super::suite::exposure::wrap_default(memveil);
    let (warm, slice): (f64, f64) = opts.pick((1.0, 1.0), (3.0, 2.0));
    let (mut puts, mut gets) = (Vec::new(), Vec::new());
    let mut rows = String::new();
    let result = (|| -> Result<(), String> {
        for r in 0..ROUNDS {
            opts.say(&format!(
                "shield etcd: round {}/{ROUNDS}, plain and memveil run side by side",
                r + 1
            ));
            let [plain, prot] = round(&wrap, &dir, warm, slice, r)?;
            puts.push(prot.0 / plain.0);
            gets.push(prot.1 / plain.1);
            let _ = writeln!(
                rows,
                "| {} | {:.0} / {:.0} | {:.3} | {:.0} / {:.0} | {:.3} |",
                r + 1,
                prot.0,
                plain.0,
                prot.0 / plain.0,
                prot.1,
                plain.1,
                prot.1 / plain.1
            );
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    let _ = writeln!(
        md,
        "\netcd (Debian's etcd-server, a Go program) plainly and under `memveil run` at its defaults, data on tmpfs, \
         both servers up side by side, {CLIENTS} clients on kept-alive connections to its JSON gateway; per round \
         each server's {KEYS} keys written, {warm} s of puts untimed, then {SLICES} slices of {slice} s of puts \
         (256-byte values) per server taken in turns with the other server's (ABBA), then as many of gets (each \
         value checked):\n\n| round | put/s protected / plain | ratio | get/s \
         protected / plain | ratio |\n|---|---|---|---|---|\n{rows}"
    );
    let fig = |id: &str, v: &[f64], target: &str, what: &str| {
        let m = median(&mut v.to_vec());
        Figure::plain(
            id,
            m,
            "ratio",
            &format!(
                "etcd {what} rate under `memveil run` at its defaults over the plain server's, {CLIENTS} clients over \
                 HTTP/JSON, median of {} rounds ({})",
                v.len(),
                super::suite::spread(v)
            ),
        )
        .with_ratio(m)
        .target(target)
        .rounds(v)
    };
    Ok(vec![
        fig("shield.etcd_put_vs_plain", &puts, ">= 0.85", "put"),
        fig("shield.etcd_get_vs_plain", &gets, ">= 0.90", "get"),
    ])
}
