//! Proof of protection (issue 3): with encrypt/decrypt requests in flight, the
//! key finder finds the vault's keys neither in the vault's nor the client's
//! readable memory (`/proc/PID/mem`), nor in `gcore` dumps of either; the same
//! finder finds the same key expanded by the same backend into ordinary
//! memory (the positive control, in the same test).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::gcore;
use common::Vault;
use memveil_keyfind::{read_process, scan_image, Image};
use memveil_testkit::{skip, Need};
use memveil_vault::client::Crypt;
use memveil_vault::proto::{KeyKind, Mode};

fn has_key(img: &Image, keys: &[&[u8]]) -> bool {
    scan_image(img, 8)
        .iter()
        .any(|f| keys.iter().any(|k| f.key == *k))
}

fn random<const N: usize>() -> [u8; N] {
    let mut k = [0u8; N];
    memveil_sys::getrandom(&mut k).expect("random");
    k
}

#[test]
fn keys_are_not_found_in_vault_or_client_memory_but_the_baseline_is() {
    if !std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
    }) {
        skip(
            Need::Root,
            "reading the non-dumpable vault's /proc/PID/mem needs root",
        );
        return;
    }
    let v = Vault::start();
    let k128: [u8; 16] = random();
    let k256: [u8; 32] = random();
    let xts: [u8; 32] = random();
    let mut c = v.client();
    let a = c
        .import_key("p128", KeyKind::Aes128, false, &k128)
        .expect("import");
    let b = c
        .import_key("p256", KeyKind::Aes256, false, &k256)
        .expect("import");
    let x = c
        .import_key("pxts", KeyKind::Xts128, false, &xts)
        .expect("import");
    let keys: [&[u8]; 4] = [&k128, &k256, &xts[..16], &xts[16..]];

    // Requests in flight from another client thread for the whole scan.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let worker = {
        let (stop, done) = (stop.clone(), done.clone());
        let mut c = v.client();
        std::thread::spawn(move || {
            let mut d = vec![7u8; 16 << 10];
            while !stop.load(Ordering::Relaxed) {
                for (id, m) in [
                    (a.id, Mode::Cbc),
                    (b.id, Mode::Gcm),
                    (x.id, Mode::Xts),
                    (a.id, Mode::Ctr),
                ] {
                    let t = c.encrypt(&Crypt::new(id, m), &mut d).expect("encrypt");
                    c.decrypt(&Crypt::new(id, m).tag(&t), &mut d)
                        .expect("decrypt");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    while done.load(Ordering::Relaxed) < 8 {
        std::thread::yield_now();
    }

    let vault_mem = read_process(v.pid()).expect("read vault memory");
    assert!(
        vault_mem.bytes() > 1 << 20,
        "read only {} bytes of the vault",
        vault_mem.bytes()
    );
    assert!(
        !has_key(&vault_mem, &keys),
        "a key schedule in the vault's readable memory"
    );
    eprintln!(
        "vault: {} bytes scanned, unreadable: {:?}",
        vault_mem.bytes(),
        vault_mem
            .unreadable
            .iter()
            .map(|u| &u.2)
            .collect::<Vec<_>>()
    );
    let client_mem = read_process(std::process::id()).expect("read own memory");
    assert!(
        !has_key(&client_mem, &keys),
        "a key schedule in the client's readable memory"
    );
    if let Some(core) = gcore(v.pid(), "vault") {
        assert!(
            core.bytes() > 1 << 20,
            "vault core holds only {} bytes",
            core.bytes()
        );
        assert!(
            !has_key(&core, &keys),
            "a key schedule in the vault's core dump"
        );
    }
    let before = done.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    worker.join().expect("worker");
    assert!(
        done.load(Ordering::Relaxed) >= before,
        "requests kept flowing during the scan"
    );

    // Positive control: the same key, the same backend, ordinary memory, in
    // this very process; the same finder must see it in /proc and in a core.
    let baseline = Box::new(memveil_cipher::Aes::new(&k128).expect("key"));
    let mem = read_process(std::process::id()).expect("read own memory");
    assert!(
        has_key(&mem, &[&k128]),
        "control: baseline schedule not found in /proc/self/mem"
    );
    if let Some(core) = gcore(std::process::id(), "client") {
        assert!(
            has_key(&core, &[&k128]),
            "control: baseline schedule not found in the client's core"
        );
    }
    drop(baseline);
}
