//! Unit tests of the daemon: configuration refusals, sockets, the
//! dispatcher's fairness and failover, a served session.

use std::os::unix::net::UnixStream;
use std::sync::Condvar;
use std::time::Instant;

use zeroize::Zeroizing;

use super::dispatch::{lock, Demand, Shared};
use super::*;
use crate::condition::SEED_BYTES;
use crate::egd::Client;
use crate::source::TestPattern;

fn quiet() -> LogFn {
    Arc::new(|_| {})
}

fn sock(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "memveil-egd-unit-{}-{name}.sock",
        std::process::id()
    ))
}

fn pattern_spec() -> SeedSpec {
    SeedSpec::custom(
        SourceKind::Getrandom,
        Arc::new(|| Ok(Box::new(TestPattern::new(42)) as Box<dyn RawSource>)),
    )
}

#[test]
fn remote_bind_refused_without_flag() {
    let cfg = ServeConfig {
        listen: vec![Listen::Tcp("0.0.0.0:0".parse().expect("addr"))],
        sources: vec![pattern_spec()],
        log: quiet(),
        ..ServeConfig::default()
    };
    let e = Server::start(cfg).err().expect("refused");
    assert!(matches!(e, ServeError::RemoteRefused(_)), "{e}");
    assert!(e.to_string().contains("--allow-remote"));
}

/// A server on one Unix socket at `p`, quiet, with the pattern source.
fn unix_only(p: &std::path::Path) -> ServeConfig {
    ServeConfig {
        listen: vec![Listen::Unix(p.to_path_buf())],
        sources: vec![pattern_spec()],
        log: quiet(),
        ..ServeConfig::default()
    }
}

#[test]
fn not_a_socket_is_not_replaced() {
    let p = sock("regular");
    std::fs::write(&p, b"keep me").expect("write");
    let e = Server::start(unix_only(&p)).err().expect("refused");
    assert!(matches!(e, ServeError::NotASocket(..)), "{e}");
    // The message names the path, what is there and the fix.
    let m = e.to_string();
    assert!(m.contains(&p.display().to_string()), "{m}");
    assert!(m.contains("a regular file is there"), "{m}");
    assert!(
        m.contains("remove it yourself") && m.contains("--unix"),
        "{m}"
    );
    assert_eq!(std::fs::read(&p).expect("still there"), b"keep me");
    std::fs::remove_file(&p).expect("cleanup");
}

#[test]
fn a_directory_at_the_socket_path_is_named_and_kept() {
    let p = sock("dir");
    std::fs::create_dir_all(p.join("inside")).expect("mkdir");
    let e = Server::start(unix_only(&p)).err().expect("refused");
    let m = e.to_string();
    assert!(
        matches!(e, ServeError::NotASocket(..)) && m.contains("a directory is there"),
        "{m}"
    );
    assert!(p.join("inside").is_dir(), "kept");
    std::fs::remove_dir_all(&p).expect("cleanup");
}

#[test]
fn bad_configuration_is_named() {
    let base = || ServeConfig {
        listen: vec![Listen::Unix(sock("cfg"))],
        sources: vec![pattern_spec()],
        log: quiet(),
        ..ServeConfig::default()
    };
    let cases: Vec<(ServeConfig, &str)> = vec![
        (
            ServeConfig {
                listen: vec![],
                ..base()
            },
            "--unix PATH",
        ),
        (
            ServeConfig {
                producers: 0,
                ..base()
            },
            "--producers 0",
        ),
        (
            ServeConfig {
                rate_limit: Some(0),
                ..base()
            },
            "--rate-limit 0",
        ),
        (
            ServeConfig {
                limits: Limits { max_read: 0 },
                ..base()
            },
            "--max-request 0",
        ),
        (
            ServeConfig {
                reseed_interval: 0,
                ..base()
            },
            "reseed interval 0",
        ),
    ];
    for (cfg, want) in cases {
        let e = Server::start(cfg).err().expect("refused");
        assert!(e.to_string().contains(want), "{e} lacks {want}");
    }
    let e = Server::start(ServeConfig {
        listen: vec![Listen::Unix(PathBuf::from("/nonexistent-dir/x.sock"))],
        ..base()
    })
    .err()
    .expect("refused");
    assert!(e.to_string().contains("/nonexistent-dir/x.sock"), "{e}");
}

#[test]
fn live_socket_refused_stale_socket_replaced() {
    let p = sock("live");
    let cfg = || ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![pattern_spec()],
        log: quiet(),
        ..ServeConfig::default()
    };
    let first = Server::start(cfg()).expect("first");
    let e = Server::start(cfg()).err().expect("in use");
    assert!(matches!(e, ServeError::SocketInUse(_)), "{e}");
    drop(first);
    // A stale socket file (no listener) is replaced.
    let stale = std::os::unix::net::UnixListener::bind(&p).expect("bind");
    drop(stale);
    assert!(p.exists());
    let again = Server::start(cfg()).expect("stale socket replaced");
    drop(again);
    assert!(!p.exists(), "socket removed at shutdown");
}

/// Regression: a request completed just before a source failure (not yet
/// collected, so no longer queued) was wiped and then never refilled,
/// leaving its consumer blocked for good (seen once under CPU stress in
/// `failing_source_is_quarantined_and_fallback_serves`).
#[test]
fn completed_but_uncollected_request_wiped_by_failure_is_requeued() {
    let p = sock("requeue");
    let srv = Server::start(ServeConfig {
        listen: vec![Listen::Unix(p)],
        sources: vec![pattern_spec(), pattern_spec()],
        output: Output::Seed,
        log: quiet(),
        ..ServeConfig::default()
    })
    .expect("start");
    let sh = &srv.shared;
    let wake = Arc::new(Condvar::new());
    {
        let mut pool = lock(&sh.pool);
        pool.demands.insert(
            999,
            Demand {
                want: 16,
                got: Zeroizing::new(vec![0xaa; 16]),
                done: Arc::clone(&wake),
            },
        );
    }
    sh.source_failed(
        0,
        &DrngError::Exhausted {
            name: "test".into(),
            attempts: 1,
        },
    );
    let t = Instant::now();
    loop {
        let pool = lock(&sh.pool);
        let d = pool.demands.get(&999).expect("still there");
        if d.got.len() == 16 {
            assert_ne!(&d.got[..], &[0xaa; 16], "refilled from the fallback");
            break;
        }
        drop(pool);
        assert!(t.elapsed() < Duration::from_secs(5), "never refilled");
        std::thread::sleep(Duration::from_millis(10));
    }
    lock(&sh.pool).demands.remove(&999);
}

/// The dispatcher alone (no producer threads, no sockets): four backlogged
/// consumers of different request sizes, seeds delivered one by one, each
/// tagged; round robin gives every consumer every fourth seed.
#[test]
fn round_robin_hands_each_backlogged_consumer_every_nth_seed() {
    let sh = Arc::new(Shared::new(ServeConfig::default(), Vec::new()));
    let sizes = [160usize, 160, 160, 160];
    let mut hs = Vec::new();
    for (id, &n) in sizes.iter().enumerate() {
        let sh = Arc::clone(&sh);
        hs.push(std::thread::spawn(move || {
            let mut out = vec![0u8; n];
            sh.take(id as u64, &mut out).map(|()| out).ok()
        }));
    }
    let t = Instant::now();
    while lock(&sh.pool).queue.len() < sizes.len() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "consumers never queued"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let order: Vec<u64> = lock(&sh.pool).queue.iter().copied().collect();
    for i in 0..40u8 {
        sh.deliver(&[i; SEED_BYTES]);
    }
    for (id, h) in hs.into_iter().enumerate() {
        let got = h.join().expect("join").expect("served");
        let pos = order.iter().position(|&q| q == id as u64).expect("queued");
        let tags: Vec<u8> = got.chunks(SEED_BYTES).map(|c| c[0]).collect();
        let want: Vec<u8> = (0..10u8)
            .map(|k| k * 4 + u8::try_from(pos).unwrap_or(0))
            .collect();
        assert_eq!(tags, want, "consumer {id} (queue position {pos})");
    }
    assert!(lock(&sh.pool).buffer.is_empty());
}

#[test]
fn seed_mode_serves_over_unix_and_counts() {
    let p = sock("seed");
    let cfg = ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![pattern_spec()],
        output: Output::Seed,
        log: quiet(),
        ..ServeConfig::default()
    };
    let srv = Server::start(cfg).expect("start");
    let mut c = Client::new(UnixStream::connect(&p).expect("connect"));
    let mut out = vec![0u8; 1000];
    c.read_blocking(&mut out).expect("read");
    assert!(out.iter().any(|&b| b != 0));
    let pid = c.pid().expect("pid");
    assert_eq!(pid, std::process::id().to_string());
    let st = srv.stats();
    assert_eq!(st.consumers[0].bytes_served, 1000);
    assert_eq!(st.consumers[0].pid_queries, 1);
    assert!(st.seeds_produced >= 1000 / 16);
}
