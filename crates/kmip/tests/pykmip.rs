//! The client against a real KMIP server (PyKMIP, started here on loopback).

use memveil_kmip::testserver::{TestServer, FLEET_POLICY};
use memveil_kmip::{Client, KmipError};
use memveil_secmem::{Level, Policy};

fn server(name: &str) -> Option<(TestServer, tempdir::Dir)> {
    let d = tempdir::Dir::new(name);
    if !memveil_kmip::testserver::server_program().exists() {
        memveil_testkit::skip(
            memveil_testkit::Need::Installed("build/kmipvenv (pykmip)"),
            format!("{name}: scripts/install.d/kmip.sh puts PyKMIP's server there"),
        );
        return None;
    }
    match TestServer::start(d.path()) {
        Ok(s) => Some((s, d)),
        Err(e) => panic!("PyKMIP did not start: {e}"),
    }
}

mod tempdir {
    pub struct Dir(std::path::PathBuf);
    impl Dir {
        pub fn new(name: &str) -> Self {
            let p = std::env::temp_dir().join(format!("mv-kmip-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).expect("temp dir");
            Self(p)
        }
        pub fn path(&self) -> &std::path::Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn client(s: &TestServer, who: &str) -> Client {
    Client::new(s.config(who), Policy::allow(Level::Locked)).expect("client")
}

#[test]
fn create_register_get_locate_destroy_and_every_failure() {
    let Some((mut s, _d)) = server("ops") else {
        return;
    };
    let a = client(&s, "host-a");
    let b = client(&s, "host-b");
    // Create on the server; both hosts of the fleet read the same bytes.
    let uid = a
        .create_aes256(Some("fleet-kek"), Some(FLEET_POLICY))
        .expect("create");
    let ka = a.get_key_len(&uid, 32, "the test").expect("get a");
    let kb = b.get_key(&uid).expect("get b");
    assert_eq!(&ka[..], &kb[..]);
    assert!(a.locate("fleet-kek").expect("locate").contains(&uid));
    // Register: what goes in comes out.
    let key: Vec<u8> = (0u8..32).collect();
    let r = a
        .register_aes(&key, Some("registered"), Some(FLEET_POLICY))
        .expect("register");
    assert_eq!(&b.get_key(&r).expect("get registered")[..], &key[..]);
    // A key without the fleet policy is the creator's alone.
    let own = a.create_aes256(None, None).expect("create own");
    let e = b.get_key(&own).expect_err("b may not");
    assert!(
        e.to_string().contains("Permission Denied") || matches!(e, KmipError::NotFound { .. }),
        "{e}"
    );
    // Wrong length for a use.
    let e = a.get_key_len(&uid, 64, "aes-xts-256").expect_err("length");
    assert!(matches!(e, KmipError::WrongLength { got: 32, .. }), "{e}");
    // Object missing.
    let e = a.get_key("999999").expect_err("missing");
    assert!(matches!(e, KmipError::NotFound { .. }), "{e}");
    assert!(e.to_string().contains("999999"), "{e}");
    // Destroyed.
    a.destroy(&r).expect("destroy");
    let e = a.get_key(&r).expect_err("destroyed");
    assert!(matches!(e, KmipError::NotFound { .. }), "{e}");
    // A client certificate from another CA.
    let e = client(&s, "rogue").get_key(&uid).expect_err("rogue");
    assert!(matches!(e, KmipError::ClientCertificate { .. }), "{e}");
    // A server certificate this CA did not sign.
    let mut cfg = s.config("host-a");
    cfg.ca = s.dir().join("rogue-ca.crt");
    let e = Client::new(cfg, Policy::allow(Level::Locked))
        .expect("client")
        .get_key(&uid)
        .expect_err("ca");
    assert!(matches!(e, KmipError::ServerCertificate { .. }), "{e}");
    assert!(e.to_string().contains("--kmip-ca"), "{e}");
    // Missing certificate file.
    let mut cfg = s.config("host-a");
    cfg.cert = s.dir().join("nope.crt");
    let e = Client::new(cfg, Policy::allow(Level::Locked)).expect_err("no cert");
    assert!(e.to_string().contains("--kmip-cert"), "{e}");
    // Server down, then back with its objects.
    s.stop();
    let e = a.get_key(&uid).expect_err("down");
    assert!(matches!(e, KmipError::Unreachable { .. }), "{e}");
    s.restart().expect("restart");
    assert_eq!(&a.get_key(&uid).expect("after restart")[..], &ka[..]);
}

/// Where `key` (kept only masked: `masked[i] = key[i] ^ MASK`, so the
/// search itself holds no copy) occurs in this process's readable memory,
/// read through `/proc/self/mem` region by region (what a memory dump of
/// the process would show; secret memory cannot be read and is skipped).
fn copies_in_memory(masked: &[u8]) -> Vec<u64> {
    use std::os::unix::fs::FileExt as _;
    let mem = std::fs::File::open("/proc/self/mem").expect("/proc/self/mem");
    let first = masked[0] ^ MASK;
    let mut found = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    for (lo, hi) in memveil_testkit::readable_mappings("self") {
        let mut at = lo;
        while at < hi {
            let n = usize::try_from(hi - at).map_or(buf.len(), |left| left.min(buf.len()));
            // A region that cannot be read (secret memory, a guard) is skipped.
            if mem.read_exact_at(&mut buf[..n], at).is_err() {
                break;
            }
            let chunk = &buf[..n];
            for (i, _) in chunk.iter().enumerate().filter(|(_, b)| **b == first) {
                if chunk[i..].len() >= masked.len()
                    && chunk[i..].iter().zip(masked).all(|(a, m)| a ^ MASK == *m)
                {
                    found.push(at + i as u64);
                }
            }
            if at + n as u64 == hi {
                break;
            }
            // Overlap chunks by the needle's length less one.
            at += (n - (masked.len() - 1)) as u64;
        }
    }
    found
}

const MASK: u8 = 0xA5;

#[test]
fn a_fetched_key_leaves_no_copy_in_the_process_memory() {
    let Some((s, _d)) = server("leftover") else {
        return;
    };
    let admin = client(&s, "host-a");
    let uid = admin
        .create_aes256(None, Some(FLEET_POLICY))
        .expect("create");
    drop(admin);
    // The key comes into this process only through a Get.
    let c = client(&s, "host-b");
    let key = c.get_key_len(&uid, 32, "the test").expect("get");
    let masked: Vec<u8> = key.iter().map(|b| b ^ MASK).collect();
    drop(key);
    drop(c);
    // The search sees the heap: a control pattern placed there is found.
    let control: Vec<u8> = (0u8..32).map(|i| i.wrapping_mul(37) ^ 0x5C).collect();
    let control_masked: Vec<u8> = control.iter().map(|b| b ^ MASK).collect();
    assert!(
        !copies_in_memory(&control_masked).is_empty(),
        "the memory search does not see the heap"
    );
    drop(control);
    let at = copies_in_memory(&masked);
    assert!(
        at.is_empty(),
        "the fetched key is still in this process's memory at {at:x?}"
    );
}
