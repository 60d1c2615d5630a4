//! nginx with TLS and two workers, for the shield's figures
//! (`shield.nginx_tls_*`) and for the test that its workers' heaps are
//! protected (`crates/memveil/tests/shield_run.rs`): a site in a scratch
//! directory (a fresh RSA key and self-signed certificate from `openssl`, a
//! 1 MiB file, a configuration with a TLS and a plain HTTP listener on free
//! loopback ports), started plainly or under `memveil run`, and
//! `openssl s_time` against it.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A site ready to be served.
pub struct Site {
    /// The scratch directory (configuration, key, certificate, logs).
    pub dir: PathBuf,
    /// The TLS listener's port.
    pub tls_port: u16,
    /// The plain HTTP listener's port (serves the same files).
    pub http_port: u16,
    /// The server key's first prime, little-endian, as it sits in
    /// OpenSSL's big-number limbs in the server's memory: the secret to
    /// look for (its low 24 bytes, hex).
    pub prime_pattern: String,
}

/// A free loopback port (bound and released: another process could take it
/// before nginx does, which then fails to start and says so).
pub(crate) fn free_port() -> Result<u16, String> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free loopback port: {e}"))
}

fn tool(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{what}: {e} (install it: scripts/install.sh)"))?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The first prime of the RSA key in `key`, from `openssl rsa -text`.
fn prime1(key: &Path) -> Result<Vec<u8>, String> {
    let text = tool(
        Command::new("openssl")
            .args(["rsa", "-text", "-noout", "-in"])
            .arg(key),
        "openssl rsa",
    )?;
    let mut hex = String::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with("prime1:") {
            inside = true;
        } else if inside && line.starts_with(char::is_whitespace) {
            hex.extend(line.chars().filter(char::is_ascii_hexdigit));
        } else if inside {
            break;
        }
    }
    let hex = hex.trim_start_matches('0');
    let hex = if hex.len() % 2 == 1 {
        format!("0{hex}")
    } else {
        hex.to_owned()
    };
    let bytes = hex::decode(&hex).map_err(|e| format!("openssl rsa -text: prime1: {e}"))?;
    if bytes.len() < 64 {
        return Err(format!(
            "openssl rsa -text: prime1 has {} bytes",
            bytes.len()
        ));
    }
    Ok(bytes)
}

impl Site {
    /// Writes the site into `dir` (created) for `workers` worker processes.
    ///
    /// # Errors
    /// A tool is missing or failed, or the directory cannot be written.
    pub fn prepare(dir: &Path, workers: u32) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let key = dir.join("key.pem");
        let cert = dir.join("cert.pem");
        tool(
            Command::new("openssl")
                .args([
                    "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                ])
                .args(["-subj", "/CN=localhost", "-keyout"])
                .arg(&key)
                .arg("-out")
                .arg(&cert),
            "openssl req",
        )?;
        let mut little = prime1(&key)?;
        little.reverse();
        let prime_pattern = hex::encode(&little[..24]);
        let body: Vec<u8> = (0..1u32 << 20)
            .map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[1])
            .collect();
        let big = dir.join("big.bin");
        std::fs::write(&big, body).map_err(|e| format!("{}: {e}", big.display()))?;
        let (tls_port, http_port) = (free_port()?, free_port()?);
        let d = dir.display();
        // sendfile off, one 1 MiB output buffer: a request for big.bin
        // reads it through the worker's heap, so requests churn the heap
        // (what pushes older pages out of a small window).
        let conf = format!(
            "daemon off;\nmaster_process on;\nworker_processes {workers};\npid {d}/nginx.pid;\n\
             error_log {d}/error.log warn;\nevents {{ worker_connections 512; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
             fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
             sendfile off;\n  output_buffers 1 1m;\n  keepalive_timeout 0;\n\
             server {{\n    listen 127.0.0.1:{tls_port} ssl;\n    ssl_certificate {d}/cert.pem;\n\
             ssl_certificate_key {d}/key.pem;\n    root {d};\n  }}\n\
             server {{\n    listen 127.0.0.1:{http_port};\n    root {d};\n  }}\n}}\n"
        );
        let conf_path = dir.join("nginx.conf");
        std::fs::write(&conf_path, conf).map_err(|e| format!("{}: {e}", conf_path.display()))?;
        Ok(Self {
            dir: dir.to_owned(),
            tls_port,
            http_port,
            prime_pattern,
        })
    }

    /// The arguments that run nginx on this site in the foreground.
    #[must_use]
    pub fn nginx_args(&self) -> Vec<std::ffi::OsString> {
        vec!["-c".into(), self.dir.join("nginx.conf").into_os_string()]
    }

    /// Waits until both listeners accept (nginx is up), or `limit` passes.
    ///
    /// # Errors
    /// nginx did not come up; the error log's tail says why.
    pub fn wait_ready(&self, server: &mut Child, limit: Duration) -> Result<(), String> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Ok(Some(st)) = server.try_wait() {
                return Err(format!("nginx exited ({st}): {}", self.error_log()));
            }
            let up = |p: u16| TcpStream::connect((Ipv4Addr::LOCALHOST, p)).is_ok();
            if up(self.tls_port) && up(self.http_port) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "nginx did not listen within {limit:?}: {}",
            self.error_log()
        ))
    }

    /// The last lines of nginx's error log.
    #[must_use]
    pub fn error_log(&self) -> String {
        let s = std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }

    /// The master's process id, from its pid file.
    #[must_use]
    pub fn master_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("nginx.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// The worker processes: the master's children.
    #[must_use]
    pub fn worker_pids(&self) -> Vec<u32> {
        let Some(master) = self.master_pid() else {
            return Vec::new();
        };
        let path = format!("/proc/{master}/task/{master}/children");
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Stops nginx (SIGTERM to the master: a fast shutdown) and reaps it.
    pub fn stop(&self, server: &mut Child) {
        if let Some(pid) = self.master_pid().and_then(|p| i32::try_from(p).ok()) {
            // SAFETY: kill(2) with a pid nginx wrote; no memory is shared.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        } else {
            let _ = server.kill();
        }
        if crate::procs::exited_within(server, Duration::from_secs(20)) {
            return;
        }
        let _ = server.kill();
        let _ = server.wait();
    }
}

/// New TLS connections a second that `openssl s_time` makes against
/// `port` in about `secs` seconds: each a full handshake (`-new`) or a
/// resumption of the first session (`-reuse`); each fetches `/`.
///
/// # Errors
/// `openssl s_time` failed or printed no count.
pub fn s_time(port: u16, reuse: bool, secs: u32) -> Result<f64, String> {
    let t = Instant::now();
    let out = tool(
        Command::new("openssl")
            .arg("s_time")
            .args(["-connect", &format!("127.0.0.1:{port}")])
            .arg(if reuse { "-reuse" } else { "-new" })
            .args(["-time", &secs.to_string()]),
        "openssl s_time",
    )?;
    let wall = t.elapsed().as_secs_f64();
    // "1234 connections in 2.01s; 614.00 connections/user sec, ..." (for
    // -reuse the first line is the one full handshake; take the largest).
    let conns = out
        .lines()
        .filter_map(|l| {
            let (n, rest) = l.split_once(" connections in ")?;
            rest.contains("real seconds").then_some(())?;
            n.trim().parse::<f64>().ok()
        })
        .fold(0.0_f64, f64::max);
    if conns <= 0.0 {
        return Err(format!(
            "openssl s_time printed no connection count: {}",
            out.trim()
        ));
    }
    Ok(conns / wall)
}

/// Starts nginx on `site`, plainly or under `memveil run` at its defaults
/// (shared memory let through: nginx maps its accept-mutex zone shared)
/// with `run_args` added (e.g. `--window 4096`).
pub(crate) fn start(
    site: &Site,
    memveil: Option<&Path>,
    run_args: &[&str],
) -> Result<Child, String> {
    let mut cmd = match memveil {
        Some(m) => {
            let mut c = Command::new(m);
            c.args(["run", "--quiet", "--shared-memory", "unprotected"]);
            c.args(run_args).args(["--", "nginx"]);
            c
        }
        None => Command::new("nginx"),
    };
    let mut child = cmd
        .args(site.nginx_args())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("nginx: {e} (install it: scripts/install.sh)"))?;
    if let Err(e) = site.wait_ready(&mut child, Duration::from_secs(30)) {
        site.stop(&mut child);
        return Err(e);
    }
    Ok(child)
}

/// `shield.nginx_tls_new_vs_plain` and `shield.nginx_tls_reuse_vs_plain`:
/// `openssl s_time` new and resumed TLS connections a second against nginx
/// with two workers, under `memveil run` at its defaults vs plain, in the
/// same run (the order alternates between rounds; medians).
pub(crate) fn figures(
    opts: &crate::BenchOpts,
    memveil: &Path,
    dir: &Path,
) -> Result<Vec<crate::Figure>, String> {
    let site = Site::prepare(dir, 2)?;
    let rounds = opts.pick(2, 5);
    let secs = opts.pick(3, 10);
    // [plain, protected] x [new, reuse]
    let mut got: [[Vec<f64>; 2]; 2] = Default::default();
    for round in 0..rounds {
        for k in 0..2 {
            let protected = (k + round) % 2 == 1;
            opts.say(&format!(
                "shield: nginx TLS, {} (round {}/{rounds})",
                if protected { "memveil run" } else { "plain" },
                round + 1
            ));
            let mut server = start(&site, protected.then_some(memveil), &[])?;
            let measured = s_time(site.tls_port, false, secs)
                .and_then(|new| Ok((new, s_time(site.tls_port, true, secs)?)));
            site.stop(&mut server);
            let (new, reuse) = measured?;
            got[usize::from(protected)][0].push(new);
            got[usize::from(protected)][1].push(reuse);
        }
    }
    let mut figs = Vec::new();
    for (i, (name, what)) in [
        ("new", "full handshakes (-new)"),
        ("reuse", "session resumptions (-reuse)"),
    ]
    .into_iter()
    .enumerate()
    {
        let [plain, prot] = &mut got;
        let (plain, prot) = (&mut plain[i], &mut prot[i]);
        figs.push(
            crate::Figure::vs(
                &format!("shield.nginx_tls_{name}_vs_plain"),
                crate::timing::median(prot),
                crate::timing::median(plain),
                "conn/s",
                &format!(
                    "nginx 1 master + 2 workers, TLS (RSA 2048, self-signed), `openssl s_time` {what} for {secs} s \
                     fetching `/`, under `memveil run` at its defaults (`--shared-memory unprotected`: nginx's \
                     accept-mutex zone) vs plain, median of {rounds} alternating rounds"
                ),
            )
            .target(">= 0.90"),
        );
    }
    Ok(figs)
}
