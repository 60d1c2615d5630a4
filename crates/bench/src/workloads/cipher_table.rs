//! A cipher table in the style of `cryptsetup benchmark` (which needs the
//! kernel's AF_ALG, absent here): memveil's ciphers and OpenSSL's EVP on the
//! same 1 MiB buffer in place, per mode and key size, encryption and
//! decryption in MiB/s, fastest of interleaved rounds ([`crate::cipher`]'s
//! method). XTS works in 4 KiB data units (a page, as the engine and a
//! dm-crypt volume with 4 KiB sectors do), each its own tweak; GCM seals
//! and opens the whole buffer (decryption: open, tag checked).

use std::cell::RefCell;
use std::fmt::Write as _;

use memveil_cipher::{Aes, Gcm, Xts};
use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtx;

use crate::cipher::{interleaved, Evp, KEY};
use crate::{BenchError, BenchOpts, Figure};

fn err(msg: impl Into<String>) -> BenchError {
    BenchError::Part {
        part: "workloads",
        msg: msg.into(),
    }
}

fn ossl(e: &openssl::error::ErrorStack) -> BenchError {
    err(format!("OpenSSL: {e}"))
}

const BUF: usize = 1 << 20;
const UNIT: usize = 4096;

/// One row: encrypt and decrypt of ours and OpenSSL's, ns per buffer.
struct Times {
    ours: (f64, f64),
    theirs: (f64, f64),
}

/// Times ours and OpenSSL's encryption and decryption (`true`: encrypt)
/// over interleaved rounds; an error either recorded in `failed` fails the row.
fn four(
    rounds: usize,
    ours: &dyn Fn(bool),
    theirs: &dyn Fn(bool),
    failed: &RefCell<Option<String>>,
) -> Result<Times, BenchError> {
    let t = interleaved(
        rounds,
        2,
        &mut [
            &mut || ours(true),
            &mut || ours(false),
            &mut || theirs(true),
            &mut || theirs(false),
        ],
    );
    if let Some(e) = failed.borrow_mut().take() {
        return Err(err(e));
    }
    Ok(Times {
        ours: (t[0], t[1]),
        theirs: (t[2], t[3]),
    })
}

/// XTS over the buffer in 4 KiB units, `bytes` per half key.
fn xts(rounds: usize, bytes: usize) -> Result<Times, BenchError> {
    let ours = Xts::new(&KEY[..bytes], &KEY[bytes..2 * bytes]).map_err(|e| err(e.to_string()))?;
    let c = if bytes == 16 {
        Cipher::aes_128_xts()
    } else {
        Cipher::aes_256_xts()
    };
    let oe = RefCell::new(Evp::new(c, &KEY[..2 * bytes], true)?);
    let od = RefCell::new(Evp::new(c, &KEY[..2 * bytes], false)?);
    let b = RefCell::new(vec![0x3cu8; BUF]);
    let failed = RefCell::new(None);
    let evp = |e: &RefCell<Evp>| {
        let mut e = e.borrow_mut();
        for (i, unit) in (0u128..).zip(b.borrow_mut().chunks_mut(UNIT)) {
            if let Err(x) = e.run(&i.to_le_bytes(), unit) {
                *failed.borrow_mut() = Some(format!("OpenSSL: {x}"));
            }
        }
    };
    let ours_run = |enc: bool| {
        let mut b = b.borrow_mut();
        let r = if enc {
            ours.encrypt_units(0, 1, UNIT, &mut b)
        } else {
            ours.decrypt_units(0, 1, UNIT, &mut b)
        };
        if let Err(e) = r {
            *failed.borrow_mut() = Some(e.to_string());
        }
    };
    four(
        rounds,
        &ours_run,
        &|enc| evp(if enc { &oe } else { &od }),
        &failed,
    )
}

/// CBC (no padding: whole blocks) or CTR over the buffer.
fn block_mode(rounds: usize, bytes: usize, cbc: bool) -> Result<Times, BenchError> {
    let aes = Aes::new(&KEY[..bytes]).map_err(|e| err(e.to_string()))?;
    let c = match (cbc, bytes) {
        (true, 16) => Cipher::aes_128_cbc(),
        (true, _) => Cipher::aes_256_cbc(),
        (false, 16) => Cipher::aes_128_ctr(),
        (false, _) => Cipher::aes_256_ctr(),
    };
    let oe = RefCell::new(Evp::new(c, &KEY[..bytes], true)?.without_padding());
    let od = RefCell::new(Evp::new(c, &KEY[..bytes], false)?.without_padding());
    let iv = [9u8; 16];
    // One block more than the data: OpenSSL's update in place asks for it.
    let b = RefCell::new(vec![0x3cu8; BUF + 16]);
    let failed = RefCell::new(None);
    let ours = |enc: bool| {
        let mut b = b.borrow_mut();
        let data = &mut b[..BUF];
        let r = match (cbc, enc) {
            (true, true) => aes.cbc_encrypt(&iv, data),
            (true, false) => aes.cbc_decrypt(&iv, data),
            (false, _) => {
                aes.ctr_apply(&iv, data);
                Ok(())
            }
        };
        if let Err(e) = r {
            *failed.borrow_mut() = Some(e.to_string());
        }
    };
    let evp = |e: &RefCell<Evp>| {
        if let Err(x) = e.borrow_mut().run_in(&iv, &mut b.borrow_mut(), BUF) {
            *failed.borrow_mut() = Some(format!("OpenSSL: {x}"));
        }
    };
    four(
        rounds,
        &ours,
        &|enc| evp(if enc { &oe } else { &od }),
        &failed,
    )
}

/// GCM: seal, and seal then open (decryption = the pair less the seal).
fn gcm(rounds: usize, bytes: usize) -> Result<Times, BenchError> {
    let ours = Gcm::new(&KEY[..bytes]).map_err(|e| err(e.to_string()))?;
    let c = if bytes == 16 {
        Cipher::aes_128_gcm()
    } else {
        Cipher::aes_256_gcm()
    };
    let mut ec = CipherCtx::new().map_err(|e| ossl(&e))?;
    ec.encrypt_init(Some(c), Some(&KEY[..bytes]), None)
        .map_err(|e| ossl(&e))?;
    let mut dc = CipherCtx::new().map_err(|e| ossl(&e))?;
    dc.decrypt_init(Some(c), Some(&KEY[..bytes]), None)
        .map_err(|e| ossl(&e))?;
    let (ec, dc) = (RefCell::new(ec), RefCell::new(dc));
    let nonce = [5u8; 12];
    let b = RefCell::new(vec![0x3cu8; BUF]);
    let failed = RefCell::new(None);
    let opened = std::cell::Cell::new(true);
    let seal_evp = || -> Result<[u8; 16], openssl::error::ErrorStack> {
        let mut tag = [0u8; 16];
        let (mut ec, mut b) = (ec.borrow_mut(), b.borrow_mut());
        ec.encrypt_init(None, None, Some(&nonce))?;
        ec.cipher_update_inplace(&mut b, BUF)?;
        ec.cipher_final(&mut [])?;
        ec.tag(&mut tag)?;
        Ok(tag)
    };
    let note = |r: Result<(), openssl::error::ErrorStack>| {
        if let Err(e) = r {
            *failed.borrow_mut() = Some(e);
        }
    };
    let t = interleaved(
        rounds,
        2,
        &mut [
            &mut || {
                std::hint::black_box(ours.seal(&nonce, &[], &mut b.borrow_mut()));
            },
            &mut || {
                let tag = ours.seal(&nonce, &[], &mut b.borrow_mut());
                if ours.open(&nonce, &[], &mut b.borrow_mut(), &tag).is_err() {
                    opened.set(false);
                }
            },
            &mut || note(seal_evp().map(|_| ())),
            &mut || {
                note(seal_evp().and_then(|tag| {
                    let (mut dc, mut b) = (dc.borrow_mut(), b.borrow_mut());
                    dc.decrypt_init(None, None, Some(&nonce))?;
                    dc.set_tag(&tag)?;
                    dc.cipher_update_inplace(&mut b, BUF)?;
                    dc.cipher_final(&mut []).map(|_| ())
                }));
            },
        ],
    );
    if let Some(e) = failed.into_inner() {
        return Err(ossl(&e));
    }
    if !opened.get() {
        return Err(err("memveil's GCM did not open its own sealed buffer"));
    }
    Ok(Times {
        ours: (t[0], (t[1] - t[0]).max(1.0)),
        theirs: (t[2], (t[3] - t[2]).max(1.0)),
    })
}

/// Adds the table and one figure per row (`workloads.cipher_<mode><bits>_vs_openssl`).
///
/// # Errors
/// When OpenSSL cannot be set up or a cipher fails.
pub(crate) fn run(
    opts: &BenchOpts,
    figs: &mut Vec<Figure>,
    md: &mut String,
) -> Result<(), BenchError> {
    let rounds = opts.pick(10, 40);
    let mibs = |ns: f64| BUF as f64 / ns * 1e9 / f64::from(1u32 << 20);
    let mut table = String::from(
        "| algorithm | key | memveil encryption | memveil decryption | OpenSSL encryption | OpenSSL decryption |\n\
         |---|---|---|---|---|---|\n",
    );
    // (cryptsetup's name, key bits as cryptsetup counts them, id, times)
    let rows: [(&str, u32, &str, Times); 8] = [
        ("aes-cbc", 128, "cbc128", block_mode(rounds, 16, true)?),
        ("aes-cbc", 256, "cbc256", block_mode(rounds, 32, true)?),
        ("aes-xts", 256, "xts128", xts(rounds, 16)?),
        ("aes-xts", 512, "xts256", xts(rounds, 32)?),
        ("aes-ctr", 128, "ctr128", block_mode(rounds, 16, false)?),
        ("aes-ctr", 256, "ctr256", block_mode(rounds, 32, false)?),
        ("aes-gcm", 128, "gcm128", gcm(rounds, 16)?),
        ("aes-gcm", 256, "gcm256", gcm(rounds, 32)?),
    ];
    for (alg, bits, id, t) in rows {
        let (oe, od) = (mibs(t.ours.0), mibs(t.ours.1));
        let (te, td) = (mibs(t.theirs.0), mibs(t.theirs.1));
        let _ = writeln!(
            table,
            "| {alg} | {bits}b | {oe:.0} MiB/s | {od:.0} MiB/s | {te:.0} MiB/s | {td:.0} MiB/s |"
        );
        figs.push(Figure::vs(
            &format!("workloads.cipher_{id}_vs_openssl"),
            (oe + od) / 2.0,
            (te + td) / 2.0,
            "MiB/s",
            &format!(
                "{alg} {bits}b (cryptsetup's key size), 1 MiB in place{}, mean of encryption and decryption, \
                 memveil-cipher (path {}) vs OpenSSL EVP, fastest of {rounds} interleaved rounds",
                if alg == "aes-xts" { " in 4 KiB units" } else { "" },
                memveil_cipher::path()
            ),
        ));
    }
    let _ = writeln!(
        md,
        "Cipher table in the style of `cryptsetup benchmark` (it cannot run here: no AF_ALG): 1 MiB in place, \
         fastest of {rounds} interleaved rounds, key sizes as cryptsetup counts them (XTS: both halves), XTS in \
         4 KiB units, GCM with its tag (decryption = open, tag checked). memveil path: {}.\n\n{table}",
        memveil_cipher::path()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row runs on both sides (the CBC row once panicked inside the
    /// openssl crate: its update in place wants one block of room).
    #[test]
    fn cipher_table_runs_every_row() {
        let opts = BenchOpts::new(crate::Size::Small, Box::new(|_| {}));
        let (mut figs, mut md) = (Vec::new(), String::new());
        run(&opts, &mut figs, &mut md).expect("cipher table");
        assert_eq!(figs.len(), 8);
        for f in &figs {
            assert!(
                f.value > 0.0 && f.baseline.is_some_and(|b| b > 0.0),
                "{f:?}"
            );
        }
        assert!(md.contains("| aes-xts | 512b |"), "{md}");
    }
}
