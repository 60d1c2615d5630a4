//! XTS entries carrying many data units (`unit`/`step`, ring module doc),
//! through a running vault: a multi-unit entry gives exactly the bytes of
//! one entry per unit and of OpenSSL's AES-XTS per unit; malformed unit and
//! step values get their documented status and the vault serves on; entries
//! with zeros in both fields (what every client wrote before the fields
//! existed) are one data unit, as before.
// Test sizes are small; expected errors unwrapped.
#![allow(clippy::cast_possible_truncation)]

mod common;

use common::{Rng, Vault};
use memveil_vault::client::LaneClient;
use memveil_vault::proto::{KeyKind, Mode};
use memveil_vault::ring::{status, Entry, Op, MAX_BATCH};
use memveil_vault::Client;
use openssl::symm::{Cipher as Ossl, Crypter, Mode as OsslMode};

/// OpenSSL's AES-XTS of one data unit.
fn ossl_xts(key: &[u8], enc: bool, tweak: u128, data: &[u8]) -> Vec<u8> {
    let c = if key.len() == 64 {
        Ossl::aes_256_xts()
    } else {
        Ossl::aes_128_xts()
    };
    let m = if enc {
        OsslMode::Encrypt
    } else {
        OsslMode::Decrypt
    };
    let mut cr = Crypter::new(c, m, key, Some(&tweak.to_le_bytes())).expect("openssl xts");
    cr.pad(false);
    let mut out = vec![0u8; data.len() + 32];
    let n = cr.update(data, &mut out).expect("update");
    let k = cr.finalize(&mut out[n..]).expect("finalize");
    out.truncate(n + k);
    out
}

fn entry(op: Op, key: u32, buffer: u32, offset: usize, len: usize, iv: u128) -> Entry {
    Entry {
        op,
        mode: Mode::Xts,
        key,
        version: 0,
        buffer,
        offset: offset as u64,
        len: len as u64,
        iv: iv.to_le_bytes(),
        tag: [0; 16],
        aad_offset: 0,
        aad_len: 0,
        unit: 0,
        step: 0,
    }
}

fn run_ok(lane: &mut LaneClient, entries: &[Entry]) {
    for chunk in entries.chunks(MAX_BATCH) {
        let out = lane.run(chunk).expect("run");
        for (i, o) in out.iter().enumerate() {
            assert_eq!(o.status, status::OK, "{i}: {}", status::describe(o.status));
        }
    }
}

/// A key of `kind` with distinct halves, imported as `name`.
fn import(c: &mut Client, rng: &mut Rng, kind: KeyKind, name: &str) -> (u32, Vec<u8>) {
    let mut key = vec![0u8; kind.key_len()];
    rng.fill(&mut key);
    let id = c.import_key(name, kind, false, &key).expect("import").id;
    (id, key)
}

#[test]
fn multi_unit_entries_equal_one_entry_per_unit_and_openssl() {
    let v = Vault::start();
    let mut c = v.client();
    let mut rng = Rng(0x5EC7_0125);
    const AREA: usize = 1 << 20;
    let (sess, mut lanes) = c.session(AREA, 1).expect("session");
    let lane = &mut lanes[0];
    let buf = sess.buffer();
    // (unit bytes, step, units, first sequence number)
    let cases: [(usize, u32, usize, u128); 7] = [
        // dm-crypt plain64, 512-byte sectors: a 128 KiB run.
        (512, 1, 256, 1_000_000),
        // 4096-byte sectors, tweaks counting 512-byte sectors.
        (4096, 8, 32, 8 * 77),
        // 4096-byte sectors with iv_large_sectors.
        (4096, 1, 16, 5),
        // Units that are no multiple of 16 (ciphertext stealing in each).
        (520, 3, 9, 42),
        // The carry past 2^64 into the upper half of the tweak.
        (512, 1, 8, u128::from(u64::MAX) - 3),
        // Wrapping at 2^128.
        (16, 7, 5, u128::MAX - 13),
        // A single unit through the unit field.
        (4096, 1, 1, 9),
    ];
    for kind in [KeyKind::Xts128, KeyKind::Xts256] {
        let (id, key) = import(&mut c, &mut rng, kind, &format!("units-{kind}"));
        for &(unit, step, units, first) in &cases {
            let len = unit * units;
            let seq = |i: usize| first.wrapping_add(i as u128 * u128::from(step));
            let mut plain = vec![0u8; len];
            rng.fill(&mut plain);
            // [0, len): one multi-unit entry; [len, 2 len): one entry per
            // unit; [2 len, 3 len): the whole run as ONE unit (control).
            for part in 0..3 {
                sess.write(part * len, &plain).expect("fill");
            }
            let mut batch = vec![Entry {
                unit: unit as u32,
                step,
                ..entry(Op::Encrypt, id, buf, 0, len, first)
            }];
            batch.extend(
                (0..units).map(|i| entry(Op::Encrypt, id, buf, len + i * unit, unit, seq(i))),
            );
            batch.push(entry(Op::Encrypt, id, buf, 2 * len, len, first));
            run_ok(lane, &batch);
            let mut got = vec![0u8; 3 * len];
            sess.read(0, &mut got).expect("read");
            let (multi, rest) = got.split_at(len);
            let (single, whole) = rest.split_at(len);
            let what = format!("{kind} unit {unit} step {step} x{units} from {first}");
            assert_eq!(multi, single, "{what}: multi-unit vs per-unit entries");
            let ossl: Vec<u8> = plain
                .chunks(unit)
                .enumerate()
                .flat_map(|(i, u)| ossl_xts(&key, true, seq(i), u))
                .collect();
            assert_eq!(multi, &ossl[..], "{what}: vs OpenSSL per unit");
            // Zero unit/step: the whole entry is one data unit, as before
            // the fields existed (OpenSSL over the whole run).
            assert_eq!(whole, &ossl_xts(&key, true, first, &plain)[..], "{what}");
            // Control: with more than one unit the two meanings differ, so
            // a vault ignoring the unit field fails the first assertion.
            if units > 1 {
                assert_ne!(multi, whole, "{what}: control");
            }
            // And back, through one multi-unit entry.
            run_ok(
                lane,
                &[Entry {
                    unit: unit as u32,
                    step,
                    ..entry(Op::Decrypt, id, buf, 0, len, first)
                }],
            );
            let mut back = vec![0u8; len];
            sess.read(0, &mut back).expect("read");
            assert_eq!(back, plain, "{what}: decrypt");
        }
        c.destroy_key(&format!("units-{kind}")).expect("destroy");
    }
}

/// What the ring module doc says about an XTS entry's unit, step and length.
fn expected(unit: u32, step: u32, len: u64) -> u32 {
    match (unit, step) {
        (0, 0) if len >= 16 => status::OK,
        (0, 0) => status::BAD_LENGTH,
        (0, _) | (_, 0) => status::MALFORMED,
        (u, _) if u >= 16 && len > 0 && len.is_multiple_of(u64::from(u)) => status::OK,
        _ => status::BAD_LENGTH,
    }
}

#[test]
fn malformed_unit_and_step_get_their_status_and_the_vault_serves_on() {
    let v = Vault::start();
    let mut c = v.client();
    let mut rng = Rng(0xBAD_0017);
    let (id, _) = import(&mut c, &mut rng, KeyKind::Xts128, "units-bad");
    const AREA: usize = 64 << 10;
    let (sess, mut lanes) = c.session(AREA, 1).expect("session");
    let lane = &mut lanes[0];
    let buf = sess.buffer();
    let pick = |rng: &mut Rng, small: u64| match rng.below(4) {
        0 => 0,
        1 => rng.below(small),
        2 => rng.next(),
        _ => rng.below(4) * 512,
    };
    let (mut ok, mut malformed, mut bad_len) = (0, 0, 0);
    for _ in 0..40 {
        let batch: Vec<Entry> = (0..MAX_BATCH)
            .map(|_| {
                let unit = pick(&mut rng, 64) as u32;
                let step = pick(&mut rng, 3) as u32;
                // Lengths that fit the area, so a refusal is the fields'.
                let len = match rng.below(3) {
                    0 => u64::from(unit) * rng.below(4),
                    1 => rng.below(AREA as u64),
                    _ => 4096,
                }
                .min(AREA as u64);
                Entry {
                    unit,
                    step,
                    ..entry(Op::Encrypt, id, buf, 0, len as usize, rng.next().into())
                }
            })
            .collect();
        // Sequentially in one batch; overlapping ranges are fine there.
        let out = lane.run(&batch).expect("run");
        for (e, o) in batch.iter().zip(&out) {
            let want = expected(e.unit, e.step, e.len);
            assert_eq!(
                o.status,
                want,
                "unit {} step {} len {}: {}",
                e.unit,
                e.step,
                e.len,
                status::describe(o.status)
            );
            match want {
                status::OK => ok += 1,
                status::MALFORMED => malformed += 1,
                _ => bad_len += 1,
            }
        }
    }
    // Every outcome was exercised.
    assert!(
        ok > 20 && malformed > 20 && bad_len > 20,
        "{ok} {malformed} {bad_len}"
    );
    // The vault is alive and still right afterwards.
    let mut rng2 = Rng(7);
    let mut data = vec![0u8; 4096];
    rng2.fill(&mut data);
    sess.write(0, &data).expect("fill");
    let e = Entry {
        unit: 512,
        step: 1,
        ..entry(Op::Encrypt, id, buf, 0, 4096, 0)
    };
    run_ok(lane, &[e]);
    run_ok(
        lane,
        &[Entry {
            op: Op::Decrypt,
            ..e
        }],
    );
    let mut back = vec![0u8; 4096];
    sess.read(0, &mut back).expect("read");
    assert_eq!(back, data);
}
