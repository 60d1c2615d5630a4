//! Whom the client trusts to vouch for the KMIP server: the CA file of
//! `--kmip-ca` and nothing else. A CA that OpenSSL's defaults would add
//! (`SSL_CERT_FILE`, `SSL_CERT_DIR`, the system's store) cannot make a server
//! that impersonates the KMS acceptable.
//!
//! OpenSSL reads those variables when the client is built, so each case
//! runs in a child process (this test binary again, running
//! `child_connects_to_the_impersonator` with the variables set) against a
//! TLS server in it that presents a certificate for 127.0.0.1 signed by a
//! rogue CA. No PyKMIP needed: the verdict falls in the handshake.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use memveil_kmip::{Client, Config, KmipError};
use memveil_secmem::{Level, Policy};
use memveil_testkit::{skip, Need};
use openssl::ssl::{SslAcceptor, SslFiletype, SslMethod};

/// The child's environment: the certificates' directory and the CA file
/// (a name in it) the client is configured with.
const CHILD_DIR: &str = "MEMVEIL_TRUST_CHILD_DIR";
const CHILD_CA: &str = "MEMVEIL_TRUST_CHILD_CA";

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The test certificates in a scratch directory named after `tag`, or a
/// skip without the openssl CLI.
fn certificates(tag: &str) -> Option<Scratch> {
    let s = Scratch(std::env::temp_dir().join(format!("mv-kmip-{tag}-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&s.0);
    if let Err(e) = memveil_kmip::testserver::certificates(&s.0) {
        skip(
            Need::Installed("openssl"),
            format!("no test certificates: {e}"),
        );
        return None;
    }
    Some(s)
}

/// Runs the child with `--kmip-ca` = `ca` and the environment `env`; its
/// report line ("handshake: yes|no; error: ...").
fn child(dir: &Path, ca: &str, env: &[(&str, PathBuf)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([
        "child_connects_to_the_impersonator",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_DIR, dir)
    .env(CHILD_CA, ca)
    .env_remove("SSL_CERT_FILE")
    .env_remove("SSL_CERT_DIR");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The harness prints the test's name on the same line first.
    stdout
        .lines()
        .find_map(|l| l.find("handshake: ").map(|i| l[i..].to_owned()))
        .unwrap_or_else(|| panic!("no report from the child: {stdout}"))
}

#[test]
fn a_rogue_ca_from_ssl_cert_file_or_dir_cannot_vouch_for_the_kms() {
    let Some(s) = certificates("trust") else {
        return;
    };
    // SSL_CERT_DIR wants files named by the subject's hash.
    let hash = Command::new("openssl")
        .args(["x509", "-hash", "-noout", "-in"])
        .arg(s.0.join("rogue-ca.crt"))
        .output()
        .expect("openssl x509 -hash");
    let hash = String::from_utf8_lossy(&hash.stdout).trim().to_owned();
    let certdir = s.0.join("certdir");
    std::fs::create_dir_all(&certdir).expect("certdir");
    std::fs::copy(s.0.join("rogue-ca.crt"), certdir.join(format!("{hash}.0"))).expect("copy");

    // The impersonator is a working TLS server: configured with its CA,
    // the client completes the handshake (and fails later, on KMIP).
    let r = child(&s.0, "rogue-ca.crt", &[]);
    assert!(r.starts_with("handshake: yes"), "{r}");
    // Configured with the real CA, the rogue CA named by SSL_CERT_FILE or
    // SSL_CERT_DIR does not make it acceptable.
    for (var, path) in [
        ("SSL_CERT_FILE", s.0.join("rogue-ca.crt")),
        ("SSL_CERT_DIR", certdir.clone()),
    ] {
        let r = child(&s.0, "ca.crt", &[(var, path)]);
        assert!(
            r.starts_with("handshake: no; error: ServerCertificate"),
            "{var}: {r}"
        );
        assert!(r.contains("--kmip-ca"), "{var}: {r}");
    }
}

#[test]
fn a_ca_file_without_a_certificate_is_refused_naming_the_flag() {
    let Some(s) = certificates("noca") else {
        return;
    };
    // A key where the CA should be: PEM, but no certificate in it.
    let cfg = Config {
        url: "127.0.0.1:5696".to_owned(),
        cert: s.0.join("host-a.crt"),
        key: s.0.join("host-a.key"),
        ca: s.0.join("host-a.key"),
        timeout: Duration::from_secs(1),
    };
    let e = Client::new(cfg, Policy::allow(Level::Locked)).expect_err("no CA in it");
    assert!(
        matches!(e, KmipError::Credentials { flag: "ca", .. }),
        "{e}"
    );
    assert!(
        e.to_string().contains("no PEM certificate in it") && e.to_string().contains("--kmip-ca"),
        "{e}"
    );
}

/// Not a test of its own: what the first test runs in a child process.
#[test]
fn child_connects_to_the_impersonator() {
    let (Some(dir), Some(ca)) = (std::env::var_os(CHILD_DIR), std::env::var_os(CHILD_CA)) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut a = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).expect("acceptor");
    a.set_certificate_chain_file(dir.join("rogue-server.crt"))
        .expect("server cert");
    a.set_private_key_file(dir.join("rogue-server.key"), SslFiletype::PEM)
        .expect("server key");
    let acceptor = a.build();
    let shook = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&shook);
    let server = std::thread::spawn(move || {
        if let Ok((tcp, _)) = listener.accept() {
            let _ = tcp.set_read_timeout(Some(Duration::from_secs(10)));
            if let Ok(tls) = acceptor.accept(tcp) {
                flag.store(true, Ordering::SeqCst);
                drop(tls);
            }
        }
    });
    let cfg = Config {
        url: addr.to_string(),
        cert: dir.join("host-a.crt"),
        key: dir.join("host-a.key"),
        ca: dir.join(ca),
        timeout: Duration::from_secs(10),
    };
    let e = Client::new(cfg, Policy::allow(Level::Locked))
        .expect("client")
        .get_key("1")
        .expect_err("the impersonator has no key");
    server.join().expect("server thread");
    let kind = match e {
        KmipError::ServerCertificate { .. } => "ServerCertificate",
        _ => "other",
    };
    println!(
        "handshake: {}; error: {kind}: {e}",
        if shook.load(Ordering::SeqCst) {
            "yes"
        } else {
            "no"
        }
    );
}
