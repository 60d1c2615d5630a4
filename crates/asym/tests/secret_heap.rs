//! With the secret heap in place, what aws-lc allocates for a key (its
//! BIGNUMs, Montgomery contexts, blinding values) is out of readable memory:
//! a scan of `/proc/self/mem` for the key's primes finds nothing. Positive
//! control, same binary: a child process that does not switch to the
//! secret heap finds both primes of the key it made the same way.
//!
//! `CRYPTO_set_mem_functions` is once per process, so each case runs in a
//! child process of this test binary (`MEMVEIL_ASYM_HEAP_CHILD=plain|secret`).
//! The child holds the primes only XOR-masked while it reads its memory,
//! so the scan cannot find the test's own copy.

use std::process::Command;

use memveil_asym::{use_secret_heap, Algorithm, PrivateKey, SignScheme};
use memveil_secmem::Policy;
use memveil_testkit::{skip, Need};

const MASK: u8 = 0x5a;

fn child_body(mode: &str) {
    if mode == "secret" {
        let st = use_secret_heap(1 << 20, Policy::secret_only()).expect("secret heap");
        println!("heap {} bytes at level {}", st.size, st.level);
    }
    let key = PrivateKey::generate(Algorithm::Rsa2048).expect("generate");
    // Use the key so aws-lc builds its Montgomery contexts and blinding.
    let mut sig = [0u8; 256];
    key.sign(SignScheme::Pkcs1, b"hello", &mut sig)
        .expect("sign");
    let mut c = vec![0u8; key.components_len()];
    let n = key.components(&mut c).expect("components");
    let f = memveil_asym::components::decode(&c[..n]).expect("decode");
    let masked: Vec<Vec<u8>> = [f[3], f[4]]
        .iter()
        .map(|p| p.iter().map(|b| b ^ MASK).collect())
        .collect();
    drop(f);
    zeroize::Zeroize::zeroize(&mut c);
    if let Some(st) = memveil_asym::heap_stats() {
        println!("heap in use {} bytes (peak {})", st.in_use, st.peak);
    }
    let img = memveil_keyfind::read_process(std::process::id()).expect("read own memory");
    let mut found = 0;
    for (i, m) in masked.iter().enumerate() {
        let be: Vec<u8> = m.iter().map(|b| b ^ MASK).collect();
        let le: Vec<u8> = be.iter().rev().copied().collect();
        for (v, order) in [(be, "BE"), (le, "LE")] {
            if memveil_keyfind::contains(&img, &v) {
                println!("found prime {} ({order})", i + 1);
                found += 1;
            }
        }
    }
    println!("found {found} in {} bytes read", img.bytes());
}

fn run(mode: &str) -> String {
    let out = Command::new(std::env::current_exe().expect("exe"))
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env("MEMVEIL_ASYM_HEAP_CHILD", mode)
        .output()
        .expect("run child");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{mode} child failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn child() {
    if let Ok(mode) = std::env::var("MEMVEIL_ASYM_HEAP_CHILD") {
        child_body(&mode);
    }
}

#[test]
fn primes_are_found_on_the_ordinary_heap_and_not_in_the_secret_heap() {
    if memveil_secmem::SecretRegion::new(4096, Policy::secret_only()).is_err() {
        skip(Need::MemfdSecret, "the secret heap needs memfd_secret");
        return;
    }
    let plain = run("plain");
    eprintln!("plain:\n{plain}");
    assert!(
        plain.contains("found prime 1") && plain.contains("found prime 2"),
        "control: the primes were not found on the ordinary heap:\n{plain}"
    );
    let secret = run("secret");
    eprintln!("secret:\n{secret}");
    assert!(secret.contains("level secret"), "{secret}");
    assert!(
        secret.contains("found 0 in"),
        "a prime in readable memory with the secret heap:\n{secret}"
    );
}
