//! A real QEMU guest draws entropy from the daemon: `virtio-rng-pci` backed by
//! `rng-egd` on the daemon's Unix socket. The guest (a Debian cloud kernel and
//! a busybox initramfs built by `scripts/install.d/guest.sh`) reads
//! `/dev/hwrng` and prints the bytes in hex on its serial console. The test
//! shows that
//!
//! 1. the guest's hwrng is `virtio_rng` and the daemon counted at least those
//!    bytes served to the consumer on that socket, in 0x02 requests;
//! 2. the guest's bytes are the daemon's bytes: every 16-byte piece the guest
//!    printed occurs in what the daemon wrote to that consumer (recorded by
//!    the test hook), and a negative control of fresh random pieces does not;
//! 3. they pass the FIPS 140-2 battery (rngtest's counting), while the same
//!    bytes with a bias injected fail it (positive control of the battery).
//!
//! Without qemu or the guest artefacts it skips, saying why (a failure under
//! CI=true: scripts/install.sh installs qemu and builds the guest).

use std::io::{BufRead, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use memveil_drng::fips::{run_rngtest, RngTestOptions};
use memveil_drng::serve::{Listen, Output, SeedSpec, ServeConfig, Server};
use memveil_drng::source::SourceKind;
use memveil_testkit::{skip, Need};

/// Bytes the guest reads: 8 FIPS blocks of 20000 bits plus rngtest's 4-byte
/// bootstrap.
const GUEST_BYTES: usize = 8 * 2500 + 4;

/// Kills QEMU on every exit path.
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        drop(self.0.kill());
        drop(self.0.wait());
    }
}

fn artefacts() -> Result<(PathBuf, PathBuf, PathBuf), (Need, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = root.join("build/guest");
    let kernel = dir.join("vmlinuz");
    let initrd = dir.join("initramfs.cpio.gz");
    for f in [&kernel, &initrd] {
        if !f.exists() {
            return Err((
                Need::Installed("build/guest"),
                format!("{} missing: run scripts/install.d/guest.sh", f.display()),
            ));
        }
    }
    let qemu = std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("qemu-system-x86_64"))
                .find(|f| f.exists())
        })
        .ok_or((
            Need::Installed("qemu-system-x86_64"),
            "not on PATH: apt-get install qemu-system-x86".to_owned(),
        ))?;
    Ok((qemu, kernel, initrd))
}

fn parse_hex(lines: &[String]) -> Vec<u8> {
    lines
        .iter()
        .flat_map(|l| l.split_whitespace())
        .filter_map(|w| u8::from_str_radix(w, 16).ok())
        .collect()
}

/// Boots the guest with virtio-rng on the EGD socket `sock`, returns the
/// bytes it read from `/dev/hwrng` and the boot-and-read time. QEMU is killed
/// on every path.
fn boot_guest(qemu: &Path, kernel: &Path, initrd: &Path, sock: &Path) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let child = Command::new(qemu)
        .args([
            "-accel",
            "tcg",
            "-m",
            "256",
            "-smp",
            "1",
            "-nographic",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 quiet panic=-1 memveil.bytes={GUEST_BYTES}"
        ))
        .args(["-object", "rng-egd,id=rng0,chardev=c0", "-chardev"])
        .arg(format!("socket,id=c0,path={}", sock.display()))
        .args(["-device", "virtio-rng-pci,rng=rng0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu starts");
    let mut qemu_proc = Qemu(child);
    let (tx, rx) = mpsc::channel::<String>();
    let out = qemu_proc.0.stdout.take().expect("stdout");
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx2.send(l).is_err() {
                break;
            }
        }
    });
    let err = qemu_proc.0.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(format!("qemu stderr: {l}")).is_err() {
                break;
            }
        }
    });

    // Boot takes ~5 s under TCG here; allow slow CI machines 180 s.
    let deadline = started + Duration::from_secs(180);
    let mut console = Vec::new();
    let mut hex = Vec::new();
    let (mut in_data, mut done) = (false, false);
    while !done {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "guest did not finish in 180 s; console:\n{}",
            console.join("\n")
        );
        match rx.recv_timeout(left) {
            Ok(l) => {
                let l = l.trim_end_matches('\r').to_owned();
                if l.contains("MEMVEIL-HWRNG-END") {
                    done = true;
                } else if in_data {
                    hex.push(l.clone());
                } else if l.contains("MEMVEIL-HWRNG-BEGIN") {
                    in_data = true;
                }
                console.push(l);
            }
            Err(_) => panic!("guest output ended early; console:\n{}", console.join("\n")),
        }
    }
    let boot_and_read = started.elapsed();
    drop(qemu_proc);
    let text = console.join("\n");
    assert!(!text.contains("MEMVEIL-GUEST-ERROR"), "{text}");
    assert!(
        text.contains("MEMVEIL-HWRNG-CURRENT virtio_rng"),
        "guest hwrng is not virtio: {text}"
    );
    let bytes = parse_hex(&hex);
    assert_eq!(
        bytes.len(),
        GUEST_BYTES,
        "guest printed {} bytes",
        bytes.len()
    );

    (bytes, boot_and_read)
}

#[test]
fn qemu_guest_reads_hwrng_from_the_daemon() {
    let (qemu, kernel, initrd) = match artefacts() {
        Ok(x) => x,
        Err((need, why)) => {
            skip(need, why);
            return;
        }
    };
    let dir = std::env::temp_dir().join(format!("memveil-qemu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let sock = dir.join("egd.sock");
    let log: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let l2 = Arc::clone(&log);
    // RDRAND conditioned 512:1 when the CPU has it, getrandom otherwise (the
    // stats say which).
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(sock.clone())],
        sources: vec![
            SeedSpec::real(SourceKind::Rdrand),
            SeedSpec::real(SourceKind::Getrandom),
        ],
        output: Output::Drbg,
        log: Arc::new(move |m: &str| l2.lock().expect("log").push(m.to_owned())),
        record_served: true,
        ..ServeConfig::default()
    })
    .expect("daemon starts");

    let (bytes, boot_and_read) = boot_guest(&qemu, &kernel, &initrd, &sock);

    // 1. The daemon's counters: one consumer on that socket, served >= N.
    let st = srv.stats();
    let listener = format!("unix:{}", sock.display());
    let mine: Vec<_> = st
        .consumers
        .iter()
        .filter(|c| c.listener == listener)
        .collect();
    assert_eq!(mine.len(), 1, "one QEMU consumer: {:?}", st.consumers);
    let c = mine[0];
    assert!(
        c.bytes_served >= GUEST_BYTES as u64,
        "daemon served {} < {GUEST_BYTES}",
        c.bytes_served
    );
    assert!(c.blocking_reads > 0 && c.nonblocking_reads == 0, "{c:?}");
    assert!(c.seed_bytes >= 48, "DRBG seeded from the pool: {c:?}");

    // 2. The guest's bytes are the daemon's bytes.
    let served = srv.recorded(c.id).expect("recorded");
    let found = |piece: &[u8]| served.windows(piece.len()).any(|w| w == piece);
    let pieces: Vec<&[u8]> = bytes.chunks_exact(16).collect();
    let hits = pieces.iter().filter(|p| found(p)).count();
    let mut fresh = [0u8; 16];
    let mut misses = 0;
    for _ in 0..32 {
        memveil_sys::getrandom(&mut fresh).expect("getrandom");
        if !found(&fresh) {
            misses += 1;
        }
    }
    assert_eq!(
        misses, 32,
        "negative control: random pieces must not be found"
    );
    assert_eq!(
        hits,
        pieces.len(),
        "{} of {} guest pieces not among the {} bytes the daemon served",
        pieces.len() - hits,
        pieces.len(),
        served.len()
    );

    // 3. FIPS 140-2 battery, as rngtest counts.
    let r = run_rngtest(&mut &bytes[..], None, RngTestOptions::default());
    assert_eq!(
        r.counters.successes + r.counters.failures,
        8,
        "{:?}",
        r.counters
    );
    // A good source fails ~0.08% of blocks; allow one in eight.
    assert!(r.counters.failures <= 1, "{:?}", r.counters);
    let biased: Vec<u8> = bytes.iter().map(|b| b | 0x01).collect();
    let bad = run_rngtest(&mut &biased[..], None, RngTestOptions::default());
    assert_eq!(
        bad.counters.successes, 0,
        "positive control: biased bytes must fail {:?}",
        bad.counters
    );

    eprintln!(
        "qemu guest: {} bytes via virtio-rng in {:.1} s (boot + read), daemon served {} bytes to \
         consumer {} in {} blocking reads, source {:?}; FIPS {} ok / {} failed",
        bytes.len(),
        boot_and_read.as_secs_f64(),
        c.bytes_served,
        c.id,
        c.blocking_reads,
        st.active_source,
        r.counters.successes,
        r.counters.failures
    );
    drop(srv);
    drop(std::fs::remove_dir_all(&dir));
}

/// Kills the `memveil rng serve` process on every path.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        drop(self.0.kill());
        drop(self.0.wait());
    }
}

/// The `memveil` binary built beside this test (`target/<profile>/memveil`),
/// or `MEMVEIL_BIN`.
fn memveil_bin() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("MEMVEIL_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("memveil"))
        .ok_or("no target directory")?;
    if bin.exists() {
        Ok(bin)
    } else {
        Err(format!(
            "{} not built (cargo build --release -p memveil, or set MEMVEIL_BIN)",
            bin.display()
        ))
    }
}

/// The same guest against the real daemon process, `memveil rng serve`,
/// with the counters read from its stats socket as JSON.
#[test]
fn qemu_guest_reads_hwrng_from_memveil_rng_serve_process() {
    let (qemu, kernel, initrd) = match artefacts() {
        Ok(x) => x,
        Err((need, why)) => {
            skip(need, why);
            return;
        }
    };
    let bin = match memveil_bin() {
        Ok(b) => b,
        Err(why) => {
            skip(Need::Installed("target/release/memveil"), why);
            return;
        }
    };
    let dir = std::env::temp_dir().join(format!("memveil-qemu-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let sock = dir.join("egd.sock");
    let stats = dir.join("stats.sock");
    let daemon = Daemon(
        Command::new(&bin)
            .args([
                "rng",
                "serve",
                "--source",
                "seed",
                "--fallback",
                "getrandom",
            ])
            .arg("--unix")
            .arg(&sock)
            .arg("--stats")
            .arg(&stats)
            .args(["--stats-interval", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("memveil rng serve starts"),
    );
    let t = Instant::now();
    while !(sock.exists() && stats.exists()) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "daemon did not bind its sockets in 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (bytes, boot_and_read) = boot_guest(&qemu, &kernel, &initrd, &sock);
    let mut text = String::new();
    std::os::unix::net::UnixStream::connect(&stats)
        .expect("stats socket")
        .read_to_string(&mut text)
        .expect("stats JSON");
    // SIGTERM: the daemon closes its consumers, removes its sockets and exits 0.
    let mut daemon = daemon;
    let pid = daemon.0.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status();
    assert!(killed.is_ok_and(|s| s.success()), "kill -TERM {pid}");
    let t = Instant::now();
    let status = loop {
        if let Some(s) = daemon.0.try_wait().expect("wait") {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "daemon ignored SIGTERM for 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "daemon exit status {status}");
    assert!(
        !sock.exists() && !stats.exists(),
        "sockets removed at shutdown"
    );
    drop(daemon);
    let st: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let listener = format!("unix:{}", sock.display());
    let consumers: Vec<&serde_json::Value> = st["consumers"]
        .as_array()
        .expect("consumers")
        .iter()
        .filter(|c| c["listener"] == listener.as_str())
        .collect();
    assert_eq!(consumers.len(), 1, "{text}");
    let served = consumers[0]["bytes_served"].as_u64().expect("bytes_served");
    assert!(
        served >= GUEST_BYTES as u64,
        "daemon says it served {served}: {text}"
    );
    assert!(
        consumers[0]["blocking_reads"].as_u64().unwrap_or(0) > 0,
        "{text}"
    );
    let r = run_rngtest(&mut &bytes[..], None, RngTestOptions::default());
    assert_eq!(
        r.counters.successes + r.counters.failures,
        8,
        "{:?}",
        r.counters
    );
    assert!(r.counters.failures <= 1, "{:?}", r.counters);
    eprintln!(
        "qemu guest via {}: {} bytes in {:.1} s, daemon process served {served} bytes to it \
         (source {}); FIPS {} ok / {} failed",
        bin.display(),
        bytes.len(),
        boot_and_read.as_secs_f64(),
        st["active_source"],
        r.counters.successes,
        r.counters.failures
    );
    drop(std::fs::remove_dir_all(&dir));
}
