//! The `probe` part: what one Prometheus scrape of `memveil probe --serve`
//! costs (issue 28, `probe.scrape_ms`, target <= 50 ms).
//!
//! A vault is started with keys and a programmed KeyID, then `memveil probe
//! --serve 127.0.0.1:0` reading it; each scrape is what Prometheus does: a
//! new TCP connection, `GET /metrics`, the whole answer read. The scrape
//! renders the facts collected at start and reads the vault's counters live
//! (connect, hello, status, key table, tenants), so its cost is that round
//! trip and the rendering; collecting the facts is timed apart
//! (`probe.collect_ms`, from the exporter's own gauge).

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memveil_vault::proto::KeyKind;
use memveil_vault::Client;

use crate::timing::mean_and_percentile;
use crate::{BenchError, BenchOpts, Figure, Section};

fn fail(msg: impl Into<String>) -> BenchError {
    BenchError::Part {
        part: "probe",
        msg: msg.into(),
    }
}

/// `memveil probe --serve`, killed on drop.
struct Exporter(Child);

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One scrape: the body.
fn scrape(addr: SocketAddr) -> Result<String, BenchError> {
    let mut s = TcpStream::connect(addr).map_err(|e| fail(format!("connect {addr}: {e}")))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| fail(e.to_string()))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept: text/plain\r\n\r\n")
        .map_err(|e| fail(format!("send: {e}")))?;
    let mut out = String::new();
    s.read_to_string(&mut out)
        .map_err(|e| fail(format!("read: {e}")))?;
    match out.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200 ") => Ok(body.to_owned()),
        _ => Err(fail(format!(
            "unexpected answer: {}",
            out.lines().next().unwrap_or("")
        ))),
    }
}

/// Runs the probe part.
///
/// # Errors
/// The vault or the exporter could not be started, or a scrape failed.
pub fn run(opts: &BenchOpts) -> Result<Section, BenchError> {
    let vault = crate::vault::start_daemon()?;
    let mut c = Client::connect(&vault.socket).map_err(|e| fail(e.to_string()))?;
    for i in 0..4 {
        c.create_key(&format!("scrape{i}"), KeyKind::Aes256, false)
            .map_err(|e| fail(e.to_string()))?;
    }
    let exe = crate::procs::memveil_exe().ok_or_else(|| {
        fail("run it through `memveil bench`: the exporter is the memveil binary")
    })?;
    let mut child = Command::new(exe)
        .args(["probe", "--serve", "127.0.0.1:0", "--vault"])
        .arg(&vault.socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| fail(format!("starting memveil probe --serve: {e}")))?;
    let out = child.stdout.take().ok_or_else(|| fail("no stdout"))?;
    let exporter = Exporter(child);
    let line = crate::procs::ready_line(out, Duration::from_secs(60));
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("memveil probe: serving http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| fail(format!("memveil probe --serve did not start: {line:?}")))?;

    let n = opts.pick(200, 2000);
    opts.say(&format!("probe: {n} scrapes of http://{addr}/metrics"));
    let mut body = String::new();
    for _ in 0..10 {
        body = scrape(addr)?;
    }
    let mut ns = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        body = scrape(addr)?;
        ns.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
    }
    drop(exporter);
    let (mean, p50) = mean_and_percentile(&mut ns, 50.0);
    let (_, p99) = mean_and_percentile(&mut ns, 99.0);
    let min = ns.first().copied().unwrap_or(0);
    let max = ns.last().copied().unwrap_or(0);
    let ms = |v: f64| v / 1e6;
    #[allow(clippy::cast_precision_loss)]
    let (min, max) = (ms(min as f64), ms(max as f64));
    let value = |name: &str| {
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
    };
    if value("memveil_vault_keys") != Some(4.0) {
        return Err(fail("the scrape does not carry the vault's 4 keys"));
    }
    let collect_ms = value("memveil_probe_collect_seconds").unwrap_or(f64::NAN) * 1e3;
    let series = body.lines().filter(|l| !l.starts_with('#')).count();
    let mut figures = vec![
        Figure::plain(
            "probe.scrape_ms",
            ms(p50),
            "ms",
            &format!(
                "median of {n} scrapes (new connection, GET /metrics, {} bytes, {series} series, the vault's counters read live); mean {:.3}, p99 {:.3}, min {min:.3}, max {max:.3} ms",
                body.len(),
                ms(mean),
                ms(p99)
            ),
        )
        .target("<= 50"),
    ];
    figures.push(Figure::plain(
        "probe.collect_ms",
        collect_ms,
        "ms",
        "collecting the host's facts once (CPUID, MSRs, kernel log, files, 4096 RDRAND/RDSEED samples, the memfd_secret/userfaultfd/KVM attempts): at start and every --refresh seconds, not per scrape",
    ));
    let markdown = format!(
        "One Prometheus scrape of `memveil probe --serve` with a vault of 4 keys: median {:.3} ms, p99 {:.3} ms over {n} scrapes ({} bytes, {series} series). \
         Collecting the facts took {collect_ms:.1} ms, done at start and every `--refresh` seconds, not per scrape.\n",
        ms(p50),
        ms(p99),
        body.len()
    );
    Ok(Section {
        part: "probe".to_owned(),
        title: "Prometheus exporter (memveil probe --serve)".to_owned(),
        markdown,
        figures,
        plots: Vec::new(),
    })
}
