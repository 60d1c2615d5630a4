//! Proof of protection: the key finder (memveil-keyfind, aeskeyfind's method)
//! finds nothing of the vault's keys in the vault's readable memory, in a
//! `gcore` dump of the vault, or in the client's readable memory while
//! requests are in flight — and, in the same test, finds the same keys
//! expanded by the same backend in ordinary memory (positive control).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::{Opts, Vault};
use memveil_keyfind::{read_core, read_process, scan_image, Image};
use memveil_vault::client::Crypt;
use memveil_vault::proto::{KeyKind, Mode};

fn euid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2))
                .and_then(|u| u.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

fn hits(img: &Image, keys: &[&[u8]]) -> Vec<(u64, String, u32)> {
    scan_image(img, 8)
        .into_iter()
        .filter(|f| keys.iter().any(|k| f.key == *k))
        .map(|f| (f.address, f.region, f.errors))
        .collect()
}

fn gcore(pid: u32, base: &std::path::Path) -> Option<std::path::PathBuf> {
    match std::process::Command::new("gcore")
        .arg("-o")
        .arg(base)
        .arg(pid.to_string())
        .output()
    {
        Ok(o) if o.status.success() => Some(base.with_extension(pid.to_string())),
        Ok(o) => {
            eprintln!(
                "SKIP vault gcore part: gcore failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            None
        }
        Err(e) => {
            eprintln!("SKIP vault gcore part: gcore not runnable ({e}); install gdb");
            None
        }
    }
}

#[test]
fn vault_and_client_memory_hold_no_key_schedule_but_the_baseline_does() {
    if euid() != 0 {
        eprintln!("SKIP vault_and_client_memory_hold_no_key_schedule_but_the_baseline_does: needs root to read /proc/PID/mem of the non-dumpable vault");
        return;
    }
    let dir = common::scratch_dir("proof");
    let mut k256 = [0u8; 32];
    let mut k128 = [0u8; 16];
    memveil_sys::getrandom(&mut k256).expect("random");
    memveil_sys::getrandom(&mut k128).expect("random");
    let v = Vault::start_with(Opts::default().dir(&dir)).expect("start vault");
    let mut c = v.client();
    let a = c
        .import_key("a256", KeyKind::Aes256, false, &k256)
        .expect("import 256");
    let b = c
        .import_key("a128", KeyKind::Aes128, false, &k128)
        .expect("import 128");

    // Requests in flight from a client thread while we scan.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let worker = {
        let (stop, done) = (stop.clone(), done.clone());
        let mut c2 = v.client();
        std::thread::spawn(move || {
            let mut d = vec![7u8; 16384];
            while !stop.load(Ordering::Relaxed) {
                for (id, mode) in [(a.id, Mode::Ctr), (b.id, Mode::Cbc), (a.id, Mode::Gcm)] {
                    let t = c2.encrypt(&Crypt::new(id, mode), &mut d).expect("enc");
                    c2.decrypt(&Crypt::new(id, mode).tag(&t), &mut d)
                        .expect("dec");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    while done.load(Ordering::Relaxed) < 10 {
        std::thread::yield_now();
    }
    let keys: [&[u8]; 2] = [&k256, &k128];

    let vimg = read_process(v.pid()).expect("read vault memory");
    assert!(
        vimg.bytes() > 1 << 20,
        "read only {} bytes of the vault",
        vimg.bytes()
    );
    let vh = hits(&vimg, &keys);
    assert!(
        vh.is_empty(),
        "key schedule in the vault's readable memory: {vh:x?}"
    );
    eprintln!(
        "vault: scanned {} bytes, {} mappings unreadable: {:?}",
        vimg.bytes(),
        vimg.unreadable.len(),
        vimg.unreadable
            .iter()
            .map(|u| (&u.2, &u.3))
            .collect::<Vec<_>>()
    );
    // The client is this process (it holds the raw key bytes it imported, but
    // must hold no expanded schedule).
    let cimg = read_process(std::process::id()).expect("read client memory");
    let ch = hits(&cimg, &keys);
    assert!(
        ch.is_empty(),
        "key schedule in the client's readable memory: {ch:x?}"
    );

    if let Some(core) = gcore(v.pid(), &dir.join("vault-core")) {
        let img = read_core(&core).expect("parse vault core");
        let _ = std::fs::remove_file(&core);
        assert!(
            img.bytes() > 256 << 10,
            "vault core holds only {} bytes",
            img.bytes()
        );
        let h = hits(&img, &keys);
        assert!(
            h.is_empty(),
            "key schedule in the vault's core dump: {h:x?}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().expect("client thread");
    assert!(done.load(Ordering::Relaxed) >= 10);

    // Positive control: the same keys, the same backend, ordinary memory,
    // found by the same scanner in this process.
    let base256 = Box::new(memveil_cipher::Aes::new(&k256).expect("aes"));
    let base128 = Box::new(memveil_cipher::Aes::new(&k128).expect("aes"));
    let img = read_process(std::process::id()).expect("read self");
    let h = hits(&img, &keys);
    assert!(
        h.iter().any(|x| x.2 == 0),
        "positive control: baseline schedules not found"
    );
    assert!(
        scan_image(&img, 8).iter().any(|f| f.key == k256),
        "AES-256 control"
    );
    assert!(
        scan_image(&img, 8).iter().any(|f| f.key == k128),
        "AES-128 control"
    );
    drop((base256, base128));
    drop(c);
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}
