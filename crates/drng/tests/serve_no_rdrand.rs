//! RDRAND absent: the daemon refuses to start on it alone (naming the CPUID
//! bit and the fix), and with an explicit fallback it serves from the
//! fallback and says so. Its own test binary, because it sets
//! `MEMVEIL_DRNG_DISABLE` for the whole process.

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use memveil_drng::egd::Client;
use memveil_drng::serve::{Listen, SeedSpec, ServeConfig, ServeError, Server};
use memveil_drng::source::{SourceKind, DISABLE_ENV};

#[test]
fn rdrand_absent_refused_alone_and_fallback_announced() {
    // The only test in this binary: set before any other thread reads it.
    std::env::set_var(DISABLE_ENV, "rdrand");
    let p = std::env::temp_dir().join(format!(
        "memveil-serve-nordrand-{}.sock",
        std::process::id()
    ));
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let l2 = Arc::clone(&lines);
    let cfg = ServeConfig {
        listen: vec![Listen::Unix(p.clone())],
        sources: vec![SeedSpec::real(SourceKind::Rdrand)],
        log: Arc::new(move |m: &str| l2.lock().expect("log").push(m.to_owned())),
        ..ServeConfig::default()
    };
    let e = Server::start(cfg.clone())
        .err()
        .expect("must refuse without RDRAND");
    assert!(matches!(e, ServeError::NoSource(_)), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("RDRAND not available"), "{msg}");
    assert!(msg.contains("CPUID.1:ECX[30]"), "{msg}");
    assert!(msg.contains("--source getrandom"), "{msg}");
    assert!(!p.exists(), "nothing bound when refusing");

    let srv = Server::start(ServeConfig {
        sources: vec![
            SeedSpec::real(SourceKind::Rdrand),
            SeedSpec::real(SourceKind::Getrandom),
        ],
        ..cfg
    })
    .expect("starts on the explicit fallback");
    let st = srv.stats();
    assert_eq!(st.sources[0].state, "unavailable");
    assert_eq!(st.active_source.as_deref(), Some("getrandom"));
    assert!(st.stream.contains("getrandom"), "{}", st.stream);
    let mut c = Client::new(UnixStream::connect(&p).expect("connect"));
    let mut b = [0u8; 300];
    c.read_blocking(&mut b).expect("served from the fallback");
    let log = lines.lock().expect("log").join("\n");
    assert!(
        log.contains("serving from fallback source getrandom"),
        "{log}"
    );
    assert!(log.contains("CPUID.1:ECX[30]"), "{log}");
}
