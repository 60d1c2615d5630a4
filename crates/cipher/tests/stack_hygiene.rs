//! Issue 14: after a cipher operation returns, nothing it left on the
//! calling thread's stack gives its key away — on every path.
//!
//! What the compiler spills to the stack stays there, unwiped, after the
//! function returns; the shield's fault handler, the engine's callers and
//! the DRNG's threads run on ordinary stacks a memory dump can read. Not
//! only round keys give a key away: a block's state between two rounds
//! beside the state after (or its known plaintext or ciphertext) gives the
//! round key that joins them, and one AES round key gives the whole key.
//!
//! Each operation runs on a fresh thread, 64 KiB deep in its stack (what
//! the thread does afterwards, parked at the top, cannot overwrite what the
//! operation left below). Another thread then reads the whole stack mapping
//! through `/proc/self/mem` and looks, at every byte offset, for any of:
//! the round keys of every key used (encryption and equivalent-inverse
//! decryption schedules), every XTS tweak mask, and every block's state
//! after round 0, 1, …, Nr-1 (computed with RustCrypto's hazmat round
//! functions), plus GHASH's key. Keys are built on the test's main thread
//! (building returns them by value, through the stack: callers build them in
//! secret memory with a stack scrub, `SecretPool::alloc`).
//!
//! Positive controls, in the same run and the same way: a thread that
//! leaves a round key, a tweak mask and a mid-cipher state in a local
//! array on its stack is caught, each of the three.

use std::collections::HashMap;
use std::hint::black_box;

#[path = "common/mod.rs"]
mod common;

use aes::hazmat::{cipher_round, equiv_inv_cipher_round, inv_mix_columns};
use memveil_cipher::{Aes, Gcm, Path, Xts};
use memveil_testkit::stack_after;

type B16 = [u8; 16];

/// The patterns looked for, each with what it is.
#[derive(Default)]
struct Secrets(HashMap<B16, String>);

impl Secrets {
    fn add(&mut self, b: B16, what: impl Into<String>) {
        if b != [0; 16] {
            self.0.entry(b).or_insert_with(|| what.into());
        }
    }
}

fn xor(a: &B16, b: &B16) -> B16 {
    std::array::from_fn(|i| a[i] ^ b[i])
}

fn round_keys(key: &[u8]) -> (Vec<B16>, Vec<B16>) {
    let sched = memveil_keyfind::expand(key).expect("key length");
    let enc: Vec<B16> = sched
        .chunks_exact(16)
        .map(|c| c.try_into().expect("16"))
        .collect();
    let r = enc.len() - 1;
    let dec = (0..=r)
        .map(|i| {
            if i == 0 || i == r {
                enc[r - i]
            } else {
                let mut b = aes::Block::from(enc[r - i]);
                inv_mix_columns(&mut b);
                b.0
            }
        })
        .collect();
    (enc, dec)
}

/// The key's round keys, both schedules.
fn add_key(s: &mut Secrets, key: &[u8], name: &str) {
    let (enc, dec) = round_keys(key);
    for (i, k) in enc.iter().enumerate() {
        s.add(*k, format!("{name} encryption round key {i}"));
    }
    for (i, k) in dec.iter().enumerate() {
        s.add(*k, format!("{name} decryption round key {i}"));
    }
}

/// The states of block `input` (already whitened by the caller's XOR, e.g.
/// the XTS tweak) after round 0 .. Nr-1, and the last round's output.
fn add_states(s: &mut Secrets, key: &[u8], enc: bool, input: &B16, name: &str) {
    let (ek, dk) = round_keys(key);
    let k = if enc { ek } else { dk };
    let r = k.len() - 1;
    let mut st = aes::Block::from(xor(input, &k[0]));
    s.add(st.0, format!("{name}: state after round 0"));
    for (i, rk) in k.iter().enumerate().take(r).skip(1) {
        let rk = aes::Block::from(*rk);
        if enc {
            cipher_round(&mut st, &rk);
        } else {
            equiv_inv_cipher_round(&mut st, &rk);
        }
        s.add(st.0, format!("{name}: state after round {i}"));
    }
}

fn mul_alpha(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

/// A round key XORed with a known value (a kernel forms these for the first
/// or last round): with the value public, as good as the round key.
fn add_mixed(s: &mut Secrets, rk: &B16, with: &B16, what: String) {
    s.add(xor(rk, with), what);
}

/// XTS over one unit: the tweak masks, the first and last round keys XORed
/// with them, and every block's states.
fn add_xts(s: &mut Secrets, k1: &[u8], k2: &[u8], unit: u128, input: &[u8], enc: bool) {
    let mut t0 = unit.to_le_bytes();
    Aes::with_path(k2, Path::Portable)
        .expect("key")
        .encrypt_block(&mut t0);
    let (ek, dk) = round_keys(k1);
    let k = if enc { ek } else { dk };
    let mut t = u128::from_le_bytes(t0);
    let blocks = input.len() / 16;
    for j in 0..blocks + 1 {
        s.add(t.to_le_bytes(), format!("XTS tweak mask {j}"));
        add_mixed(
            s,
            &k[0],
            &t.to_le_bytes(),
            format!("round key 0 ^ XTS tweak {j}"),
        );
        add_mixed(
            s,
            &k[k.len() - 1],
            &t.to_le_bytes(),
            format!("last round key ^ XTS tweak {j}"),
        );
        t = mul_alpha(t);
    }
    let mut t = u128::from_le_bytes(t0);
    for (j, b) in input.chunks_exact(16).enumerate() {
        let b: B16 = b.try_into().expect("16");
        add_states(
            s,
            k1,
            enc,
            &xor(&b, &t.to_le_bytes()),
            &format!("XTS block {j}"),
        );
        t = mul_alpha(t);
    }
}

/// Runs `f` 64 KiB deep in a fresh thread's stack, then returns that
/// thread's whole stack mapping, read from another thread.
fn found(stack: &[u8], s: &Secrets) -> Vec<(usize, String)> {
    stack
        .windows(16)
        .enumerate()
        .filter_map(|(o, w)| {
            let b: B16 = w.try_into().ok()?;
            s.0.get(&b).map(|what| (o, what.clone()))
        })
        .collect()
}

fn check(path: Path, op: &str, s: &Secrets, f: impl FnOnce() + Send) -> Vec<String> {
    let stack = stack_after(f);
    let hits = found(&stack, s);
    for (o, what) in hits.iter().take(5) {
        eprintln!("  {path} {op}: {what} at stack offset {o:#x}");
    }
    if hits.is_empty() {
        Vec::new()
    } else {
        vec![format!(
            "{path} {op}: {} secrets on the stack (first: {})",
            hits.len(),
            hits[0].1
        )]
    }
}

const K1: [u8; 32] = [
    0x3a, 0x91, 0x17, 0xc4, 0x5e, 0x02, 0xd8, 0x6b, 0xf1, 0x29, 0x84, 0x4d, 0xb7, 0x60, 0x1e, 0xa3,
    0x75, 0xcc, 0x08, 0x5f, 0x93, 0x2e, 0xe6, 0x41, 0x1b, 0xd0, 0x67, 0xa9, 0x3c, 0xf4, 0x82, 0x15,
];
const K2: [u8; 32] = [
    0xe2, 0x4b, 0x70, 0x9d, 0x16, 0xc8, 0x33, 0xaf, 0x58, 0x0e, 0xb1, 0x64, 0xfa, 0x27, 0x8c, 0xd5,
    0x49, 0x3e, 0xa0, 0x12, 0x7b, 0xe9, 0x55, 0xc6, 0x0d, 0x98, 0x2f, 0xb4, 0x61, 0x1a, 0xdc, 0x87,
];

fn page(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| u8::try_from(i % 251).unwrap_or(0) ^ seed)
        .collect()
}

/// Runs every operation on `path` and returns what was found.
fn scan_path(path: Path) -> Vec<String> {
    let mut bad = Vec::new();
    let unit = 0x7f3a_5000u128;
    for klen in [16usize, 32] {
        let (k1, k2) = (&K1[..klen], &K2[..klen]);
        let xts = Xts::with_path(k1, k2, path).expect("key");
        for len in [4096usize, 4111] {
            let pt = page(len, 0x11);
            let mut s = Secrets::default();
            add_key(&mut s, k1, "XTS data key");
            add_key(&mut s, k2, "XTS tweak key");
            add_xts(&mut s, k1, k2, unit, &pt[..len / 16 * 16], true);
            let mut buf = pt.clone();
            bad.extend(check(
                path,
                &format!("XTS-{} encrypt {len}", klen * 8),
                &s,
                || {
                    xts.encrypt_unit(unit, &mut buf).expect("enc");
                },
            ));
            let mut s = Secrets::default();
            add_key(&mut s, k1, "XTS data key");
            add_key(&mut s, k2, "XTS tweak key");
            add_xts(&mut s, k1, k2, unit, &buf[..len / 16 * 16], false);
            bad.extend(check(
                path,
                &format!("XTS-{} decrypt {len}", klen * 8),
                &s,
                || {
                    xts.decrypt_unit(unit, &mut buf).expect("dec");
                },
            ));
            assert_eq!(buf, pt);
        }
        let a = Aes::with_path(k1, path).expect("key");
        let mut s = Secrets::default();
        add_key(&mut s, k1, "AES key");
        let ctr0 = [0xc7u8; 16];
        let mut c = u128::from_be_bytes(ctr0);
        for j in 0..257 {
            add_states(
                &mut s,
                k1,
                true,
                &c.to_be_bytes(),
                &format!("CTR block {j}"),
            );
            c = c.wrapping_add(1);
        }
        let pt = page(4096, 0x22);
        for j in 0..256 {
            let b: B16 = pt[16 * j..16 * j + 16].try_into().expect("16");
            add_states(&mut s, k1, true, &b, &format!("ECB block {j}"));
        }
        let mut cbc = pt.clone();
        Aes::with_path(k1, Path::Portable)
            .expect("key")
            .cbc_encrypt(&ctr0, &mut cbc)
            .expect("cbc");
        let mut prev = ctr0;
        let (ek, dk) = round_keys(k1);
        for j in 0..256 {
            let p: B16 = pt[16 * j..16 * j + 16].try_into().expect("16");
            let ct: B16 = cbc[16 * j..16 * j + 16].try_into().expect("16");
            add_mixed(
                &mut s,
                &dk[dk.len() - 1],
                &prev,
                format!("last decryption round key ^ ciphertext {j}"),
            );
            add_mixed(
                &mut s,
                &ek[0],
                &prev,
                format!("round key 0 ^ CBC chaining value {j}"),
            );
            add_states(
                &mut s,
                k1,
                true,
                &xor(&p, &prev),
                &format!("CBC encrypt block {j}"),
            );
            add_states(&mut s, k1, false, &ct, &format!("CBC decrypt block {j}"));
            prev = ct;
        }
        let mut buf = vec![0u8; 4100];
        bad.extend(check(path, &format!("AES-{} CTR", klen * 8), &s, || {
            a.ctr_keystream(&ctr0, &mut buf);
            a.ctr_apply(&ctr0, &mut buf);
        }));
        let mut buf = pt.clone();
        bad.extend(check(path, &format!("AES-{} ECB", klen * 8), &s, || {
            a.ecb_encrypt(&mut buf).expect("ecb");
            a.ecb_decrypt(&mut buf).expect("ecb");
        }));
        let mut buf = pt.clone();
        bad.extend(check(path, &format!("AES-{} CBC", klen * 8), &s, || {
            a.cbc_encrypt(&ctr0, &mut buf).expect("cbc");
            a.cbc_decrypt(&ctr0, &mut buf).expect("cbc");
        }));
        assert_eq!(buf, pt);

        let g = Gcm::with_path(k1, path).expect("key");
        let mut s = Secrets::default();
        add_key(&mut s, k1, "GCM key");
        let nonce = [0x5au8; 12];
        let mut j0 = [0u8; 16];
        j0[..12].copy_from_slice(&nonce);
        for (j, c) in (u128::from_be_bytes(j0) + 1..).take(258).enumerate() {
            add_states(
                &mut s,
                k1,
                true,
                &c.to_be_bytes(),
                &format!("GCM counter block {j}"),
            );
        }
        let mut h = [0u8; 16];
        Aes::with_path(k1, Path::Portable)
            .expect("key")
            .encrypt_block(&mut h);
        s.add(h, "GHASH key H");
        let mut rev = h;
        rev.reverse();
        s.add(rev, "GHASH key H, byte-reversed");
        let v = u128::from_be_bytes(h);
        let hx = (v << 1) ^ ((v >> 127) * ((0xc2u128 << 120) | 1));
        s.add(hx.to_le_bytes(), "POLYVAL key H'");
        let mut buf = page(4096, 0x33);
        let orig = buf.clone();
        bad.extend(check(path, &format!("AES-{}-GCM", klen * 8), &s, || {
            let tag = g.seal(&nonce, b"associated", &mut buf);
            g.open(&nonce, b"associated", &mut buf, &tag).expect("open");
        }));
        assert_eq!(buf, orig);
    }
    bad
}

#[test]
fn positive_controls_are_caught() {
    let (enc, _) = round_keys(&K1[..16]);
    let mut s = Secrets::default();
    add_key(&mut s, &K1[..16], "AES key");
    add_xts(&mut s, &K1[..16], &K2[..16], 9, &page(64, 1), true);
    let mut t0 = 9u128.to_le_bytes();
    Aes::with_path(&K2[..16], Path::Portable)
        .expect("key")
        .encrypt_block(&mut t0);
    let state = xor(&xor(&page(16, 1).try_into().expect("16"), &t0), &enc[0]);
    let planted: [(&str, B16); 3] = [
        ("round key 5", enc[5]),
        ("tweak mask", t0),
        ("mid-cipher state", state),
    ];
    for (what, b) in planted {
        let stack = stack_after(move || {
            let mut local = [0u8; 64];
            local[20..36].copy_from_slice(&b);
            black_box(&mut local);
        });
        let hits = found(&stack, &s);
        assert!(
            !hits.is_empty(),
            "positive control: a {what} planted on the stack was not found"
        );
        eprintln!("positive control: planted {what} found as {:?}", hits[0].1);
    }
}

#[test]
fn kernels_leave_no_key_material_on_the_stack() {
    let mut bad = Vec::new();
    for p in common::paths("stack hygiene") {
        let found = scan_path(p);
        eprintln!(
            "stack hygiene: path {p}: {} operations with finds",
            found.len()
        );
        bad.extend(found);
    }
    assert!(
        bad.is_empty(),
        "key material left on the stack:\n{}",
        bad.join("\n")
    );
}
