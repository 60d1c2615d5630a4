//! Reliability: clients and vaults killed at bad moments, 64 concurrent
//! clients, and the keystore under crashes.
// Test data: small counters cast to bytes on purpose; expected errors unwrapped.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::err_expect,
    clippy::manual_is_multiple_of
)]

mod common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Opts, Rng, Vault};
use memveil_cipher::{Aes, Gcm, Xts};
use memveil_vault::client::{ClientError, Crypt};
use memveil_vault::proto::{KeyKind, Mode};
use memveil_vault::Client;

#[test]
fn sixty_four_concurrent_clients_zero_wrong_results() {
    let v = Vault::start_with(
        Opts::default()
            .arg("--spin-us=5")
            .arg("--max-connections=128"),
    )
    .expect("start");
    let socket = v.socket.clone();
    let wrong = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..64u64)
        .map(|t| {
            let (socket, wrong, done) = (socket.clone(), Arc::clone(&wrong), Arc::clone(&done));
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (t + 1));
                let mut c = Client::connect(&socket).expect("connect");
                let mut key = [0u8; 32];
                rng.fill(&mut key);
                let mut xkey = [0u8; 64];
                rng.fill(&mut xkey);
                let k = c
                    .import_key(&format!("c{t}"), KeyKind::Aes256, false, &key)
                    .expect("import");
                let xk = c
                    .import_key(&format!("x{t}"), KeyKind::Xts256, false, &xkey)
                    .expect("import");
                let (aes, gcm, xts) = (
                    Aes::new(&key).expect("aes"),
                    Gcm::new(&key).expect("gcm"),
                    Xts::from_combined(&xkey).expect("xts"),
                );
                for _ in 0..40 {
                    let len = 16 * (1 + rng.below(256) as usize);
                    let mut data = vec![0u8; len];
                    rng.fill(&mut data);
                    let mut iv = [0u8; 16];
                    rng.fill(&mut iv);
                    let mode = [
                        Mode::Ecb,
                        Mode::Cbc,
                        Mode::Ctr,
                        Mode::Xts,
                        Mode::Gcm,
                        Mode::Cmac,
                    ][rng.below(6) as usize];
                    let mut want = data.clone();
                    let id = if mode == Mode::Xts { xk.id } else { k.id };
                    let mut want_tag = [0u8; 16];
                    match mode {
                        Mode::Ecb => aes.ecb_encrypt(&mut want).expect("len"),
                        Mode::Cbc => aes.cbc_encrypt(&iv, &mut want).expect("len"),
                        Mode::Ctr => aes.ctr_apply(&iv, &mut want),
                        Mode::Xts => xts.encrypt(&iv, &mut want).expect("len"),
                        Mode::Gcm => {
                            let n: [u8; 12] = iv[..12].try_into().expect("12");
                            want_tag = gcm.seal(&n, b"aad", &mut want);
                        }
                        // Cmac: the only other mode drawn above.
                        _ => want_tag = memveil_vault::cmac::cmac(&aes, &want),
                    }
                    let p = Crypt::new(id, mode).iv(&iv).aad(if mode == Mode::Gcm {
                        b"aad"
                    } else {
                        b""
                    });
                    let mut got = data.clone();
                    let tag = c.encrypt(&p, &mut got).expect("encrypt");
                    if got != want || (matches!(mode, Mode::Gcm | Mode::Cmac) && tag != want_tag) {
                        wrong.fetch_add(1, Ordering::SeqCst);
                    }
                    c.decrypt(&p.tag(&tag), &mut got).expect("decrypt");
                    if got != data {
                        wrong.fetch_add(1, Ordering::SeqCst);
                    }
                    done.fetch_add(2, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
    assert_eq!(done.load(Ordering::SeqCst), 64 * 80);
    assert_eq!(wrong.load(Ordering::SeqCst), 0, "wrong results");
    assert_eq!(
        Client::connect(&v.socket)
            .expect("c")
            .list_keys()
            .expect("list")
            .len(),
        128
    );
}

#[test]
fn client_killed_mid_request_leaves_the_vault_serving() {
    let v = Vault::start();
    let mut c = v.client();
    let k = c.create_key("big", KeyKind::Aes256, false).expect("create");
    let input = v.dir.join("big.in");
    std::fs::write(&input, vec![0x5Au8; 64 << 20]).expect("input");
    let mut rng = Rng(42);
    for round in 0..6 {
        let mut child = Command::new(common::bin())
            .arg("--socket")
            .arg(&v.socket)
            .args(["encrypt", "--key", "big", "--mode", "ctr", "-i"])
            .arg(&input)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("client");
        std::thread::sleep(Duration::from_millis(20 + rng.below(200)));
        let _ = child.kill();
        let _ = child.wait();
        let mut d = [round as u8; 48];
        c.encrypt(&Crypt::new(k.id, Mode::Cbc), &mut d)
            .expect("enc after kill");
        c.decrypt(&Crypt::new(k.id, Mode::Cbc), &mut d)
            .expect("dec after kill");
        assert_eq!(d, [round as u8; 48]);
    }
    // The killed clients' connections (and their lanes) are cleaned up.
    let t0 = Instant::now();
    loop {
        let n = c.status().expect("status").clients;
        if n == 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{n} clients still registered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn vault_killed_under_load_gives_clients_a_clear_error_and_they_reconnect() {
    let dir = common::scratch_dir("killed");
    let mut v = Vault::start_with(Opts::default().dir(&dir)).expect("start");
    let socket = v.socket.clone();
    v.client()
        .create_key("load", KeyKind::Aes128, false)
        .expect("create");
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let (socket, stop) = (socket.clone(), Arc::clone(&stop));
            std::thread::spawn(move || -> (String, Duration) {
                let mut c = Client::connect(&socket).expect("connect");
                let id = c.key_info("load").expect("info").id;
                let mut data = vec![i as u8; 1 << 20];
                let mut died_at = None;
                loop {
                    match c.encrypt(&Crypt::new(id, Mode::Ctr), &mut data) {
                        Ok(_) => {}
                        Err(e) => {
                            let t = died_at.map_or(Duration::ZERO, |d: Instant| d.elapsed());
                            return (e.to_string(), t);
                        }
                    }
                    if stop.load(Ordering::SeqCst) && died_at.is_none() {
                        died_at = Some(Instant::now());
                    }
                    if died_at.is_some_and(|d| d.elapsed() > Duration::from_secs(20)) {
                        return ("no error within 20 s".into(), Duration::MAX);
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    v.kill();
    for t in threads {
        let (msg, after) = t.join().expect("thread");
        assert!(
            msg.contains("is gone while a request was in flight")
                || msg.contains("vault connection lost"),
            "unclear error: {msg}"
        );
        assert!(
            after < Duration::from_secs(5),
            "error came {after:?} after the kill"
        );
    }
    // Restart on the same socket; clients reconnect (ephemeral keys are gone).
    let v2 = Vault::start_with(Opts::default().dir(&dir)).expect("restart");
    let mut c = Client::connect(&v2.socket).expect("reconnect");
    let e = c
        .key_info("load")
        .err()
        .expect("ephemeral key died with the vault");
    assert!(matches!(e, ClientError::Refused { .. }), "{e}");
    let k = c
        .create_key("load", KeyKind::Aes128, false)
        .expect("create again");
    let mut d = [3u8; 16];
    c.encrypt(&Crypt::new(k.id, Mode::Ecb), &mut d)
        .expect("works again");
    drop(v2);
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}

fn durable_opts(dir: &std::path::Path) -> Opts {
    let pass = dir.join("pass");
    if !pass.exists() {
        std::fs::write(&pass, "a long passphrase for tests\n").expect("pass");
    }
    Opts::default()
        .dir(dir)
        .arg("--state")
        .arg(dir.join("state").to_str().expect("utf8"))
        .arg("--passphrase-file")
        .arg(pass.to_str().expect("utf8"))
        .arg("--kdf-memory-kib=256")
        .arg("--kdf-iterations=1")
}

fn names(c: &mut Client) -> Vec<String> {
    let mut v: Vec<String> = c
        .list_keys()
        .expect("list")
        .into_iter()
        .map(|k| k.name)
        .collect();
    v.sort();
    v
}

#[test]
fn persistent_keys_survive_restart_and_ephemeral_ones_do_not() {
    let dir = common::scratch_dir("durable");
    let v = Vault::start_with(durable_opts(&dir)).expect("start");
    let mut c = v.client();
    let k = c
        .create_key("keep", KeyKind::Aes256, true)
        .expect("persistent");
    c.create_key("gone", KeyKind::Aes256, false)
        .expect("ephemeral");
    c.grant("keep", 1234, 3).expect("grant");
    let mut ct = *b"persisted secret";
    let iv = [9u8; 16];
    c.encrypt(&Crypt::new(k.id, Mode::Cbc).iv(&iv), &mut ct)
        .expect("enc");
    c.rotate_key("keep").expect("rotate");
    drop(c);
    drop(v);
    let v = Vault::start_with(durable_opts(&dir)).expect("restart");
    let mut c = v.client();
    assert_eq!(names(&mut c), vec!["keep".to_owned()]);
    let info = c.key_info("keep").expect("info");
    assert_eq!((info.versions, info.acl.clone()), (2, vec![(1234, 3)]));
    let mut d = ct;
    c.decrypt(&Crypt::new(info.id, Mode::Cbc).iv(&iv).version(1), &mut d)
        .expect("dec");
    assert_eq!(&d, b"persisted secret");
    let raw = std::fs::read(dir.join("state/keys.vault")).expect("keystore");
    assert!(raw.starts_with(b"MVVAULT1"));
    drop(c);
    drop(v);
    // The wrong passphrase is refused with a clear message.
    std::fs::write(dir.join("pass"), "not it\n").expect("pass");
    let e = Vault::start_with(durable_opts(&dir))
        .err()
        .expect("wrong passphrase");
    assert!(e.contains("does not open with this passphrase"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two vaults started on one state directory (a second unit, a restart
/// while the first still runs): each seals only the keys it holds, so the
/// one that writes last loses the other's. The second is refused, before it
/// reads or removes anything there, and the first keeps the directory.
#[test]
fn a_second_vault_on_a_running_vaults_state_directory_is_refused() {
    let dir = common::scratch_dir("one-state");
    let other = common::scratch_dir("one-state-b");
    let a = Vault::start_with(durable_opts(&dir)).expect("start");
    a.client()
        .create_key("first", KeyKind::Aes256, true)
        .expect("persistent");
    // The same --state and passphrase, its own socket.
    let mut second = durable_opts(&dir);
    second.dir = Some(other.clone());
    match Vault::start_with(second) {
        Err(e) => assert!(
            e.contains("another vault uses this state directory"),
            "the second vault failed otherwise: {e}"
        ),
        Ok(b) => {
            // What the two then do to the keystore.
            b.client()
                .create_key("from-b", KeyKind::Aes256, true)
                .expect("persistent through the second");
            a.client()
                .create_key("from-a", KeyKind::Aes256, true)
                .expect("persistent through the first");
            drop(b);
            drop(a);
            let v = Vault::start_with(durable_opts(&dir)).expect("restart");
            panic!(
                "a second vault started on a running vault's state directory; after each made a \
                 persistent key the keystore holds {:?}",
                names(&mut v.client())
            );
        }
    }
    // The first still writes its keystore, and the directory is free once
    // it is gone (its lock went with it).
    a.client()
        .create_key("second", KeyKind::Aes256, true)
        .expect("persistent after the refusal");
    drop(a);
    let v = Vault::start_with(durable_opts(&dir)).expect("restart");
    assert_eq!(
        names(&mut v.client()),
        vec!["first".to_owned(), "second".to_owned()]
    );
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&other);
}

#[test]
fn keystore_crash_points_leave_old_or_new_never_broken() {
    for (point, expect_new) in [("partial", false), ("written", false), ("renamed", true)] {
        let dir = common::scratch_dir(point);
        let v = Vault::start_with(durable_opts(&dir)).expect("start");
        v.client()
            .create_key("old", KeyKind::Aes128, true)
            .expect("old");
        drop(v);
        let mut v = Vault::start_with(durable_opts(&dir).env("MEMVEIL_VAULT_CRASH_AT", point))
            .expect("start");
        let r = v.client().create_key("new", KeyKind::Aes128, true);
        assert!(
            r.is_err(),
            "{point}: the vault should have died before replying"
        );
        let st = v.wait_exit(Duration::from_secs(10)).expect("vault exited");
        assert!(!st.success());
        assert!(v.stderr().contains(&format!("crash point {point} reached")));
        drop(v);
        let v = Vault::start_with(durable_opts(&dir))
            .unwrap_or_else(|e| panic!("{point}: keystore broken: {e}"));
        let got = names(&mut v.client());
        let want: Vec<String> = if expect_new {
            vec!["new".into(), "old".into()]
        } else {
            vec!["old".into()]
        };
        assert_eq!(got, want, "{point}");
        drop(v);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn sigkill_at_random_moments_during_keystore_writes() {
    let dir = common::scratch_dir("sigkill");
    let mut rng = Rng(7);
    let mut acknowledged: Vec<String> = Vec::new();
    let mut n = 0;
    for round in 0..8 {
        let mut v = Vault::start_with(durable_opts(&dir))
            .unwrap_or_else(|e| panic!("round {round}: keystore broken: {e}"));
        let mut c = v.client();
        let have = names(&mut c);
        for a in &acknowledged {
            assert!(have.contains(a), "round {round}: acknowledged key {a} lost");
        }
        let sock = v.socket.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = Arc::clone(&stop);
        let base = n;
        let writer = std::thread::spawn(move || {
            let mut ok = Vec::new();
            let Ok(mut c) = Client::connect(&sock) else {
                return ok;
            };
            for i in 0.. {
                if s2.load(Ordering::SeqCst) {
                    break;
                }
                let name = format!("k{}", base + i);
                match c.create_key(&name, KeyKind::Aes256, true) {
                    Ok(_) => ok.push(name),
                    Err(_) => break,
                }
                if i % 3 == 2 {
                    let d = format!("k{}", base + i - 1);
                    let r = c.destroy_key(&d);
                    // Destroyed, or in doubt (reply lost): no longer promised.
                    ok.retain(|n| *n != d);
                    if r.is_err() {
                        break;
                    }
                }
            }
            ok
        });
        std::thread::sleep(Duration::from_millis(5 + rng.below(60)));
        v.kill();
        stop.store(true, Ordering::SeqCst);
        let ok = writer.join().expect("writer");
        n += ok.len() + 10;
        acknowledged.extend(ok);
        drop(c);
    }
    let v = Vault::start_with(durable_opts(&dir)).expect("final start");
    assert!(!names(&mut v.client()).is_empty());
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}
