//! End-to-end tests of `memveil rng serve` (the library daemon) over real
//! Unix and TCP sockets: many consumers, bad input, consumers that vanish, a
//! source that starts failing, rate limits and fairness.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memveil_drng::egd::{Client, ClientError, Limits};
use memveil_drng::serve::{
    ConsumerStats, Listen, LogFn, Output, SeedSpec, ServeConfig, Server, ServerStats,
};
use memveil_drng::source::{Fault, FaultControl, FaultySource, Getrandom, RawSource, SourceKind};

fn sock(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("memveil-serve-{}-{name}.sock", std::process::id()))
}

/// A log that the test can read back.
fn capture() -> (LogFn, Arc<Mutex<Vec<String>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l = Arc::clone(&lines);
    (
        Arc::new(move |m: &str| l.lock().expect("log").push(m.to_owned())),
        lines,
    )
}

/// getrandom behind a fault switch, treated as a seed-grade source.
fn faulty_getrandom(ctl: &FaultControl) -> SeedSpec {
    let ctl = ctl.clone();
    SeedSpec::custom(
        SourceKind::Getrandom,
        Arc::new(move || {
            Ok(Box::new(FaultySource::new(Getrandom::new(), ctl.clone())) as Box<dyn RawSource>)
        }),
    )
}

fn consumer(st: &ServerStats, id: u64) -> ConsumerStats {
    st.consumers
        .iter()
        .find(|c| c.id == id)
        .cloned()
        .unwrap_or_else(|| panic!("consumer {id} not in stats: {st:?}"))
}

/// Polls until `f` holds (bounded).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for: {what}");
}

fn unix_client(p: &PathBuf) -> Client<UnixStream> {
    let s = UnixStream::connect(p).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    Client::new(s)
}

#[test]
fn many_consumers_unix_and_tcp_each_own_stream() {
    let p = sock("many");
    let (log, _) = capture();
    let srv = Server::start(ServeConfig {
        listen: vec![
            Listen::Unix(p.clone()),
            Listen::Tcp("127.0.0.1:0".parse().expect("addr")),
        ],
        sources: vec![SeedSpec::real(SourceKind::Getrandom)],
        output: Output::Drbg,
        log,
        ..ServeConfig::default()
    })
    .expect("start");
    let tcp = srv.tcp_addrs()[0];
    let mut handles = Vec::new();
    for i in 0..8 {
        let p = p.clone();
        handles.push(std::thread::spawn(move || {
            let mut out = vec![0u8; 4096];
            if i % 2 == 0 {
                unix_client(&p).read_blocking(&mut out).expect("unix read");
            } else {
                let s = TcpStream::connect(tcp).expect("tcp connect");
                s.set_read_timeout(Some(Duration::from_secs(10)))
                    .expect("timeout");
                Client::new(s).read_blocking(&mut out).expect("tcp read");
            }
            out
        }));
    }
    let outs: Vec<Vec<u8>> = handles
        .into_iter()
        .map(|h| h.join().expect("join"))
        .collect();
    // Each consumer its own stream: no two share a 16-byte block.
    let mut seen = std::collections::HashSet::new();
    for o in &outs {
        for b in o.chunks(16) {
            assert!(seen.insert(b.to_vec()), "a block was served twice");
        }
    }
    eventually("8 consumers closed", || srv.stats().consumers_open == 0);
    let st = srv.stats();
    assert_eq!(st.consumers_total, 8);
    assert_eq!(st.bytes_served, 8 * 4096);
    for c in &st.consumers {
        assert_eq!(c.bytes_served, 4096, "{c:?}");
        assert!(c.seed_bytes >= 48, "DRBG instantiated from the pool: {c:?}");
        assert_eq!(c.blocking_reads, 17);
    }
    assert_eq!(
        st.consumers
            .iter()
            .filter(|c| c.listener.starts_with("tcp:"))
            .count(),
        4
    );
}

#[test]
fn all_five_commands_answer_exactly() {
    let p = sock("five");
    let (log, _) = capture();
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![SeedSpec::real(SourceKind::Getrandom)],
        output: Output::Seed,
        log,
        ..ServeConfig::default()
    })
    .expect("start");
    let mut c = unix_client(&p);
    // Let the producer fill its buffer, then the level reports it.
    eventually("seed buffer filled", || {
        c.entropy_level().expect("level") == 8 * 1024
    });
    let nb = c.read_nonblocking(100).expect("0x01");
    assert_eq!(nb.len(), 100);
    let mut b = [0u8; 255];
    c.read_blocking(&mut b).expect("0x02");
    c.write_entropy(64, &[0xaa; 8]).expect("0x03");
    assert_eq!(c.pid().expect("0x04"), std::process::id().to_string());
    eventually("counters", || consumer(&srv.stats(), 1).pid_queries == 1);
    let st = srv.stats();
    let me = consumer(&st, 1);
    assert_eq!(me.bytes_served, 355);
    assert_eq!(me.bytes_written_ignored, 8);
    assert_eq!(me.nonblocking_reads, 1);
    assert_eq!(me.blocking_reads, 1);
    assert_eq!(me.pid_queries, 1);
    assert!(me.level_queries >= 1);
}

#[test]
fn malformed_truncated_and_oversized_close_only_that_consumer() {
    let p = sock("bad");
    let (log, lines) = capture();
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![SeedSpec::real(SourceKind::Getrandom)],
        limits: Limits { max_read: 64 },
        log,
        ..ServeConfig::default()
    })
    .expect("start");
    let mut good = unix_client(&p); // consumer 1
    let mut b = [0u8; 32];
    good.read_blocking(&mut b).expect("good read");

    // 2: unknown command byte after a valid command: the valid one is answered.
    let mut s = UnixStream::connect(&p).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("t");
    s.write_all(&[0x02, 0x08, 0x07, 0x02, 0x08]).expect("send");
    let mut got = Vec::new();
    s.read_to_end(&mut got).expect("server closes");
    assert_eq!(
        got.len(),
        8,
        "the command before the bad byte is answered, nothing after"
    );

    // 3: truncated write-entropy command, then EOF.
    let mut s = UnixStream::connect(&p).expect("connect");
    s.write_all(&[0x03, 0x00, 0x40, 0x10, 1, 2, 3])
        .expect("send");
    s.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut got = Vec::new();
    s.read_to_end(&mut got).expect("closed");
    assert!(got.is_empty());

    // 4: blocking read above --max-request 64.
    let mut s = UnixStream::connect(&p).expect("connect");
    s.write_all(&[0x02, 65]).expect("send");
    let mut got = Vec::new();
    s.read_to_end(&mut got).expect("closed");
    assert!(
        got.is_empty(),
        "no partial answer that would desynchronise the client"
    );

    // 5: non-blocking read above the cap is answered short.
    let mut c5 = unix_client(&p);
    assert_eq!(c5.read_nonblocking(200).expect("short answer").len(), 64);

    // The first consumer is still served.
    good.read_blocking(&mut b).expect("still served");
    eventually("three bad consumers closed", || {
        srv.stats()
            .consumers
            .iter()
            .filter(|c| c.state == "closed")
            .count()
            == 3
    });
    eventually("first consumer's counter", || {
        consumer(&srv.stats(), 1).bytes_served == 64
    });
    let st = srv.stats();
    let reason = |id| consumer(&st, id).close_reason.unwrap_or_default();
    assert!(
        reason(2).contains("unknown EGD command byte 0x07"),
        "{}",
        reason(2)
    );
    assert!(
        reason(3).contains("inside EGD command 0x03: 7 of 20 bytes"),
        "{}",
        reason(3)
    );
    assert!(
        reason(4).contains("exceeds this server's limit of 64"),
        "{}",
        reason(4)
    );
    assert_eq!(consumer(&st, 1).state, "open");
    let log = lines.lock().expect("log").join("\n");
    assert!(log.contains("consumer 2"), "{log}");
}

#[test]
fn consumer_vanishing_mid_read_leaves_others_served() {
    let p = sock("vanish");
    let (log, _) = capture();
    // A slow source (seed mode, conditioned RDRAND would do; a rate-limited
    // pattern keeps it portable): consumer 1 asks for a lot and disappears.
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![SeedSpec::real(SourceKind::Getrandom)],
        output: Output::Seed,
        log,
        ..ServeConfig::default()
    })
    .expect("start");
    {
        let mut s = UnixStream::connect(&p).expect("connect");
        // 4000 pipelined blocking reads (1 MB of answers, more than any
        // socket buffer holds), then gone without reading.
        let reqs: Vec<u8> = std::iter::repeat_n([0x02u8, 0xff], 4000)
            .flatten()
            .collect();
        s.write_all(&reqs).expect("send");
    }
    let mut other = unix_client(&p);
    let mut b = vec![0u8; 8192];
    other
        .read_blocking(&mut b)
        .expect("other consumer still served");
    eventually("vanished consumer closed", || {
        srv.stats()
            .consumers
            .iter()
            .any(|c| c.id == 1 && c.state == "closed")
    });
    let st = srv.stats();
    let gone = consumer(&st, 1);
    let why = gone.close_reason.clone().unwrap_or_default();
    assert!(why.contains("went away"), "{why}");
    assert!(gone.bytes_discarded > 0, "{gone:?}");
    eventually("other consumer's counter", || {
        consumer(&srv.stats(), 2).bytes_served == 8192
    });
}

#[test]
fn failing_source_is_quarantined_and_fallback_serves() {
    let p = sock("fallback");
    let ctl = FaultControl::new();
    let (log, lines) = capture();
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![
            faulty_getrandom(&ctl),
            SeedSpec::real(SourceKind::Getrandom),
        ],
        output: Output::Drbg,
        prediction_resistance: true,
        log,
        ..ServeConfig::default()
    })
    .expect("start");
    let mut a = unix_client(&p);
    let mut b = unix_client(&p);
    let mut buf = [0u8; 255];
    a.read_blocking(&mut buf).expect("a before");
    b.read_blocking(&mut buf).expect("b before");
    ctl.set(Fault::Stuck(0x0123_4567_89ab_cdef));
    // Prediction resistance draws 32 seed bytes for every request: once the
    // 1 KiB of seeds made before the fault is used up, the stuck source
    // fails its health test, and serving moves on to the fallback.
    for _ in 0..40 {
        a.read_blocking(&mut buf).expect("a after failover");
        b.read_blocking(&mut buf).expect("b after failover");
    }
    let st = srv.stats();
    assert_eq!(st.sources[0].state, "quarantined", "{:?}", st.sources);
    assert!(
        st.sources[0]
            .error
            .as_deref()
            .unwrap_or("")
            .contains("quarantined"),
        "{:?}",
        st.sources
    );
    assert_eq!(st.sources[1].state, "active");
    assert_eq!(st.active_source.as_deref(), Some("getrandom"));
    let log = lines.lock().expect("log").join("\n");
    assert!(
        log.contains("serving from fallback source getrandom"),
        "{log}"
    );
    // Both consumers kept being served across the failover.
    eventually("counters", || {
        let st = srv.stats();
        consumer(&st, 1).bytes_served == 41 * 255 && consumer(&st, 2).bytes_served == 41 * 255
    });
}

#[test]
fn failing_source_without_fallback_stops_serving_but_daemon_lives() {
    let p = sock("nofallback");
    let ctl = FaultControl::new();
    let (log, lines) = capture();
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![faulty_getrandom(&ctl)],
        output: Output::Seed,
        log,
        ..ServeConfig::default()
    })
    .expect("start");
    let mut a = unix_client(&p);
    let mut buf = [0u8; 64];
    a.read_blocking(&mut buf).expect("healthy");
    // Wait for the seed buffer to fill, then make the next seed fail.
    eventually("seed buffer full", || {
        a.entropy_level().expect("level") == 8 * 1024
    });
    ctl.set(Fault::Fail);
    let mut big = vec![0u8; 4096];
    let e = a.read_blocking(&mut big).expect_err("no healthy source");
    assert!(matches!(e, ClientError::Io(_)), "{e}");
    let st = srv.stats();
    assert_eq!(st.active_source, None);
    assert_eq!(st.sources[0].state, "quarantined");
    assert!(st.seed_bytes_wiped > 0, "buffered seeds wiped: {st:?}");
    // Requests answered from seeds made before the fault are complete 255-byte
    // answers; the one that hit the failure got nothing.
    let served = consumer(&st, 1).bytes_served;
    assert!(
        (64..64 + 4096).contains(&served) && (served - 64).is_multiple_of(255),
        "{served}"
    );
    // The daemon still answers: level 0, non-blocking 0 bytes, stats.
    let mut c = unix_client(&p);
    assert_eq!(c.entropy_level().expect("level"), 0);
    assert!(c.read_nonblocking(32).expect("nb").is_empty());
    eventually("the log says so", || {
        lines
            .lock()
            .expect("log")
            .iter()
            .any(|l| l.contains("no healthy entropy source left"))
    });
}

#[test]
fn rate_limit_holds_a_consumer_back() {
    let p = sock("rate");
    let (log, _) = capture();
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![SeedSpec::real(SourceKind::Getrandom)],
        rate_limit: Some(8192),
        log,
        ..ServeConfig::default()
    })
    .expect("start");
    let mut c = unix_client(&p);
    let t = Instant::now();
    let mut b = vec![0u8; 8192 * 2];
    c.read_blocking(&mut b).expect("read");
    // One second of burst, then 8 KiB/s: at least ~1 s for 16 KiB.
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    let me = consumer(&srv.stats(), 1);
    assert!(me.rate_limited_seconds > 0.5, "{me:?}");
}

#[test]
fn per_endpoint_rate_limit_applies_to_that_endpoint_only() {
    let (slow, fast) = (sock("slow"), sock("fast"));
    let (log, _) = capture();
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(slow.clone()), Listen::Unix(fast.clone())],
        sources: vec![SeedSpec::real(SourceKind::Getrandom)],
        listener_rate_limits: vec![(format!("unix:{}", slow.display()), 4096)],
        log,
        ..ServeConfig::default()
    })
    .expect("start");
    let mut s = unix_client(&slow);
    let mut f = unix_client(&fast);
    let mut b = vec![0u8; 4096 * 2];
    f.read_blocking(&mut b).expect("fast");
    s.read_blocking(&mut b).expect("slow");
    let st = srv.stats();
    // Ids follow accept order across two listener threads: find by endpoint.
    let by = |path: &PathBuf| {
        let l = format!("unix:{}", path.display());
        st.consumers
            .iter()
            .find(|c| c.listener == l)
            .cloned()
            .expect("consumer on that endpoint")
    };
    let (cs, cf) = (by(&slow), by(&fast));
    assert_eq!(cs.rate_limit, Some(4096), "{cs:?}");
    assert!(cs.rate_limited_seconds > 0.5, "{cs:?}");
    assert_eq!(cf.rate_limit, None);
    assert!(cf.rate_limited_seconds == 0.0, "{cf:?}");
    let e = Server::start(ServeConfig {
        listen: vec![Listen::Unix(sock("other"))],
        sources: vec![SeedSpec::real(SourceKind::Getrandom)],
        listener_rate_limits: vec![("unix:/nowhere.sock".into(), 1)],
        log: capture().0,
        ..ServeConfig::default()
    })
    .err()
    .expect("unknown endpoint refused");
    assert!(e.to_string().contains("no such endpoint"), "{e}");
}

#[test]
/// Over real sockets every backlogged consumer keeps getting seeds. Exact
/// round-robin shares are checked without sockets or timing in the unit test
/// `serve::tests::round_robin_hands_each_backlogged_consumer_every_nth_seed`;
/// here thread scheduling on a loaded machine can delay a consumer's next
/// request, so the bound is loose (and the real measurement is the bench).
fn backlogged_consumers_all_progress_over_sockets() {
    let p = sock("fair");
    let (log, _) = capture();
    // A deliberately slow source: conditioned 512:1 (RDRAND-like treatment of
    // getrandom words), so the producer is the bottleneck.
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![SeedSpec::custom(
            SourceKind::Rdrand,
            Arc::new(|| Ok(Box::new(Getrandom::new()) as Box<dyn RawSource>)),
        )],
        output: Output::Seed,
        log,
        ..ServeConfig::default()
    })
    .expect("start");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut hs = Vec::new();
    for _ in 0..4 {
        let (p, stop) = (p.clone(), Arc::clone(&stop));
        hs.push(std::thread::spawn(move || {
            let mut c = unix_client(&p);
            let mut b = [0u8; 255];
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                c.read_blocking(&mut b).expect("read");
                n += 255;
            }
            n
        }));
    }
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let got: Vec<u64> = hs.into_iter().map(|h| h.join().expect("join")).collect();
    let (min, max) = (
        got.iter().min().copied().unwrap_or(0),
        got.iter().max().copied().unwrap_or(0),
    );
    assert!(min > 0, "{got:?}");
    #[allow(clippy::cast_precision_loss)]
    let spread = max as f64 / min as f64;
    assert!(spread < 2.0, "shares {got:?}");
    drop(srv);
}
