//! Issue 28, the Prometheus half: Debian's `prometheus` server scrapes two
//! `memveil probe --serve` endpoints on loopback (two "hosts", each with a
//! vault of its own) and its HTTP API answers with each host's real values;
//! `promtool` checks and unit-tests the example alert rules; the server
//! refuses a port in use by name and answers malformed requests with an
//! error, never a crash; `--textfile` writes atomically.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use memveil_testkit::{first_line, skip, Need, VaultProcess};

const BIN: &str = env!("CARGO_BIN_EXE_memveil");

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

fn fixture(name: &str) -> String {
    repo(&format!("crates/probe/tests/fixtures/{name}"))
        .display()
        .to_string()
}

/// A program on PATH, or a skip naming the package that brings it.
fn installed(prog: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(prog))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        skip(
            Need::Installed("prometheus"),
            format!("{prog} not on PATH (scripts/install.sh installs Debian's prometheus)"),
        );
    }
    found
}

/// A child process killed and reaped on drop, with a scratch directory.
struct Proc {
    child: Child,
    dir: Option<PathBuf>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// `memveil probe --serve 127.0.0.1:0 ARGS`: the process and the address
/// its ready line names.
fn probe_serve(args: &[&str]) -> (Proc, SocketAddr) {
    let mut child = Command::new(BIN)
        .args(["probe", "--serve", "127.0.0.1:0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn memveil probe --serve");
    let line = first_line(
        child.stdout.take().expect("stdout"),
        Duration::from_secs(60),
    );
    let p = Proc { child, dir: None };
    let addr = line
        .trim()
        .strip_prefix("memveil probe: serving http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no ready line: {line:?}"));
    (p, addr)
}

/// Sends `request` as is and returns the whole answer (the server closes).
fn raw(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let _ = s.write_all(request);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// GET `path`: (status code, body).
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let resp = raw(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    );
    status_and_body(&resp)
}

fn status_and_body(resp: &str) -> (u16, String) {
    let code = resp
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

/// The value of the unlabelled sample `name` in an exposition.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A free loopback port (bound and released: Prometheus binds it next).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// Starts Prometheus scraping `targets` every second, in a scratch dir.
fn start_prometheus(prom: &Path, targets: &[SocketAddr]) -> (Proc, SocketAddr) {
    let dir = std::env::temp_dir().join(format!("memveil-prometheus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("data")).expect("scratch");
    let list = targets
        .iter()
        .map(|t| format!("'{t}'"))
        .collect::<Vec<_>>()
        .join(", ");
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: memveil\n    static_configs:\n      - targets: [{list}]\n"
        ),
    )
    .expect("config");
    // Another process may take the free port between our probe and its
    // bind: try a few.
    for _ in 0..3 {
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let log = dir.join("prometheus.log");
        let child = Command::new(prom)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn prometheus");
        let mut p = Proc {
            child,
            dir: Some(dir.clone()),
        };
        let end = Instant::now() + Duration::from_secs(60);
        while Instant::now() < end {
            if let Ok(Some(_)) = p.child.try_wait() {
                break;
            }
            if TcpStream::connect(addr).is_ok() && get(addr, "/-/ready").0 == 200 {
                return (p, addr);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            text.contains("address already in use"),
            "prometheus did not become ready:\n{text}"
        );
        p.dir = None; // keep the config for the next try
    }
    panic!("prometheus could not bind a free port in three tries");
}

/// `query`'s result as (instance, value) pairs, through /api/v1/query.
fn query(prom: SocketAddr, q: &str) -> Vec<(String, f64)> {
    let (code, body) = get(prom, &format!("/api/v1/query?query={}", urlencode(q)));
    assert_eq!(code, 200, "{q}: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["status"], "success", "{body}");
    let mut out: Vec<(String, f64)> = v["data"]["result"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|r| {
                    let inst = r["metric"]["instance"].as_str().unwrap_or("").to_owned();
                    let val = r["value"][1]
                        .as_str()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(f64::NAN);
                    (inst, val)
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn vault_with(tag: &str, keys: usize, keyids: &[&str]) -> VaultProcess {
    let v = VaultProcess::start(BIN, tag, &["--allow-level=locked"]);
    for i in 0..keys {
        let o = Command::new(BIN)
            .args(["vault", "create", &format!("k{i}"), "--socket", &v.socket])
            .output()
            .expect("vault create");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    for k in keyids {
        let o = v.key(&["program", "--keyid", k, "--mode", "random"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    v
}

#[test]
fn prometheus_scrapes_two_hosts_and_its_api_has_each_ones_values() {
    let Some(prom) = installed("prometheus") else {
        return;
    };
    // Host A: this machine's live facts, a vault with 2 keys and KeyID 5.
    // Host B: a recorded TME-MK host, a vault with 3 keys and KeyIDs 1, 2.
    let va = vault_with("fleet-a", 2, &["5"]);
    let vb = vault_with("fleet-b", 3, &["1", "2"]);
    let (_pa, a) = probe_serve(&["--vault-socket", &va.socket]);
    let (_pb, b) = probe_serve(&[
        "--vault-socket",
        &vb.socket,
        "--replay",
        &fixture("icelake-tme-mk-enabled.json"),
    ]);
    // What host A says of itself, straight from its endpoint.
    let (code, direct) = get(a, "/metrics");
    assert_eq!(code, 200, "{direct}");
    let a_encrypted =
        sample(&direct, "memveil_memory_encryption_active").expect("memory encryption sample");

    let (_p, api) = start_prometheus(&prom, &[a, b]);
    let (sa, sb) = (a.to_string(), b.to_string());
    let end = Instant::now() + Duration::from_secs(90);
    let mut keys = Vec::new();
    while Instant::now() < end {
        keys = query(api, "memveil_vault_keys");
        if keys.len() == 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let mut want = vec![(sa.clone(), 2.0), (sb.clone(), 3.0)];
    want.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(keys, want, "memveil_vault_keys of both targets");

    // Each query's value for (host A, host B).
    let both = |q: &str| {
        let m = query(api, q)
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>();
        (m.get(&sa).copied(), m.get(&sb).copied())
    };
    let one = Some(1.0);
    assert_eq!(both("up{job=\"memveil\"}"), (one, one));
    assert_eq!(
        both("memveil_memory_encryption_active"),
        (Some(a_encrypted), one),
        "this host as its endpoint says; the recorded TME-MK host encrypted"
    );
    assert_eq!(both("memveil_vault_keyids_programmed"), (one, Some(2.0)));
    assert_eq!(both("memveil_vault_up"), (one, one));
    assert_eq!(both("memveil_tme_mk_keyids").1, Some(63.0));
    assert_eq!(both("memveil_cpu_feature{feature=\"aes_ni\"}").1, one);

    // The vault of host B stops: Prometheus sees memveil_vault_up 0 there
    // while host A's stays 1.
    drop(vb);
    let end = Instant::now() + Duration::from_secs(60);
    let mut vup = both("memveil_vault_up");
    while Instant::now() < end && vup.1 != Some(0.0) {
        std::thread::sleep(Duration::from_millis(500));
        vup = both("memveil_vault_up");
    }
    assert_eq!(vup, (one, Some(0.0)));
    drop(va);
}

#[test]
fn the_alert_rules_pass_promtool_check_and_their_unit_tests() {
    let Some(promtool) = installed("promtool") else {
        return;
    };
    let dir = repo("contrib/prometheus");
    let run = |dir: &Path, args: &[&str]| {
        let o = Command::new(&promtool)
            .args(args)
            .current_dir(dir)
            .output()
            .expect("promtool");
        let out =
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
        (o.status.success() && out.contains("SUCCESS"), out)
    };
    let (ok, out) = run(&dir, &["check", "rules", "memveil-alerts.yml"]);
    assert!(ok, "{out}");
    let (ok, out) = run(&dir, &["test", "rules", "memveil-alerts.test.yml"]);
    assert!(ok, "{out}");

    // Positive control: a rule test that expects the wrong thing fails.
    let scratch = std::env::temp_dir().join(format!("memveil-rules-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch");
    std::fs::copy(
        dir.join("memveil-alerts.yml"),
        scratch.join("memveil-alerts.yml"),
    )
    .expect("copy rules");
    let tests = std::fs::read_to_string(dir.join("memveil-alerts.test.yml")).expect("tests");
    let wrong = tests.replacen("instance: host-b:9464", "instance: host-a:9464", 1);
    assert_ne!(wrong, tests);
    std::fs::write(scratch.join("wrong.test.yml"), wrong).expect("write");
    let (ok, out) = run(&scratch, &["test", "rules", "wrong.test.yml"]);
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(!ok, "a wrong expectation passed: {out}");
}

#[test]
fn a_port_in_use_is_refused_naming_the_address() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let o = Command::new(BIN)
        .args(["probe", "--no-vault", "--serve", &addr.to_string()])
        .stdin(Stdio::null())
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("cannot listen on {addr}")) && err.contains("another process"),
        "{err}"
    );
}

#[test]
fn malformed_requests_get_an_error_and_the_server_keeps_serving() {
    let (_p, addr) = probe_serve(&["--no-vault", "--replay", &fixture("tsme-only.json")]);
    let code = |req: &[u8]| status_and_body(&raw(addr, req)).0;
    assert_eq!(code(b"GARBAGE\r\n\r\n"), 400);
    assert_eq!(code(b"GET /metrics HTTP/9.9\r\n\r\n"), 400);
    assert_eq!(code(b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n"), 400);
    assert_eq!(code(b"\x00\xff\xfe\x16\x03\x01 tls hello?\r\n\r\n"), 400);
    let mut long = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    long.extend(std::iter::repeat_n(b'a', 20_000));
    assert_eq!(code(&long), 400, "a head longer than 8 KiB");
    assert_eq!(code(b"POST /metrics HTTP/1.1\r\n\r\n"), 405);
    assert_eq!(code(b"GET /nope HTTP/1.1\r\n\r\n"), 404);
    let head = raw(addr, b"HEAD /metrics HTTP/1.0\r\n\r\n");
    assert_eq!(status_and_body(&head), (200, String::new()), "{head}");
    // A client that sends half a request and waits is cut off.
    let t = Instant::now();
    assert_eq!(code(b"GET /metrics HTTP/1.1\r\nHost: x\r\n"), 408);
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    // A client that connects and goes away without a word.
    drop(TcpStream::connect(addr).expect("connect"));
    // And the server still answers.
    let (code, body) = get(addr, "/metrics?x=1");
    assert_eq!(code, 200);
    assert_eq!(sample(&body, "memveil_memory_encryption_active"), Some(1.0));
}

/// Sets the flag on drop, so the trickling thread stops on a failed
/// assertion too.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn slow_clients_cannot_hold_the_exporter_past_the_connection_deadline() {
    let (_p, addr) = probe_serve(&["--no-vault", "--replay", &fixture("tsme-only.json")]);
    // As many slow clients as the server serves at once: half send their
    // request and then a byte every 100 ms (the drain after the answer),
    // half trickle a request head that never ends (read of the head). Each
    // byte arrives well within any per-read timeout.
    let mut slow: Vec<TcpStream> = (0..32)
        .map(|i| {
            let mut s = TcpStream::connect(addr).expect("connect");
            if i % 2 == 0 {
                s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    .expect("request");
            } else {
                s.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                    .expect("request");
            }
            s
        })
        .collect();
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        let _stop = StopOnDrop(&stop);
        sc.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                for s in &mut slow {
                    // Fails once the server closed it: that is the point.
                    let _ = s.write(b"a");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        // They hold every slot: the next scrape is turned away...
        assert_ne!(
            get(addr, "/metrics").0,
            200,
            "the slow clients hold no slot"
        );
        // ...until their deadlines end them all (the head's 5 s, the
        // drain's 0.5 s; every connection's life within 10 s).
        let t = Instant::now();
        let code = loop {
            let (code, _) = get(addr, "/metrics");
            if code == 200 || t.elapsed() > Duration::from_secs(20) {
                break code;
            }
            std::thread::sleep(Duration::from_millis(250));
        };
        assert_eq!(code, 200, "no scrape answered within {:?}", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(13), "{:?}", t.elapsed());
    });
}

#[test]
fn textfile_is_written_whole_and_leaves_no_temporary() {
    let dir = std::env::temp_dir().join(format!("memveil-textfile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
    let file = dir.join("memveil.prom");
    std::fs::write(&file, "old\n").expect("old file");
    // `memveil probe --textfile TO` on the recorded SEV-SNP guest: its
    // exit status and stderr.
    let textfile = |to: &Path| {
        let o = Command::new(BIN)
            .args([
                "probe",
                "--no-vault",
                "--replay",
                &fixture("sev-snp-guest.json"),
            ])
            .arg("--textfile")
            .arg(to)
            .output()
            .expect("run");
        assert!(o.stdout.is_empty(), "nothing on stdout");
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, err) = textfile(&file);
    assert_eq!(code, Some(0), "{err}");
    let text = std::fs::read_to_string(&file).expect("written");
    assert_eq!(sample(&text, "memveil_memory_encryption_active"), Some(1.0));
    let names: Vec<_> = std::fs::read_dir(&dir)
        .expect("list")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert_eq!(names, ["memveil.prom"], "a temporary file was left");
    // An unwritable place is an error naming the file.
    let (code, err) = textfile(Path::new("/nonexistent-dir/memveil.prom"));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("/nonexistent-dir/memveil.prom"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_entropy_service_counters_are_exported_and_its_absence_is_down() {
    let dir = std::env::temp_dir().join(format!("memveil-rngstats-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
    let stats = dir.join("stats.sock");
    let child = Command::new(BIN)
        .args([
            "rng",
            "serve",
            "--source",
            "getrandom",
            "--stats-interval",
            "0",
        ])
        .arg("--unix")
        .arg(dir.join("egd.sock"))
        .arg("--stats")
        .arg(&stats)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rng serve");
    let _serve = Proc {
        child,
        dir: Some(dir.clone()),
    };
    let end = Instant::now() + Duration::from_secs(30);
    while !stats.exists() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    let metrics = |sock: &Path| {
        let o = Command::new(BIN)
            .args([
                "probe",
                "--prometheus",
                "--no-vault",
                "--replay",
                &fixture("tsme-only.json"),
            ])
            .arg("--rng-stats")
            .arg(sock)
            .output()
            .expect("run");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let text = metrics(&stats);
    assert_eq!(sample(&text, "memveil_rng_serve_up"), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, "memveil_rng_serve_source_healthy"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "memveil_rng_serve_consumers"),
        Some(0.0),
        "{text}"
    );
    assert!(
        text.contains("# TYPE memveil_rng_serve_bytes_served_total counter\n"),
        "{text}"
    );
    let text = metrics(&dir.join("no-such.sock"));
    assert_eq!(sample(&text, "memveil_rng_serve_up"), Some(0.0), "{text}");
    assert_eq!(
        sample(&text, "memveil_rng_serve_source_healthy"),
        None,
        "{text}"
    );
}
