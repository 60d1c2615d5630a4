//! Signatures through PKCS#11 (issue 27): the same RSA-2048 and P-256 keys
//! imported into memveil's module (the vault) and into SoftHSM2, and held by
//! OpenSSL in this process; two threads, each with its own session, sign
//! in a loop (`C_SignInit` + `C_Sign`, `CKM_SHA256_RSA_PKCS` over 32 bytes,
//! `CKM_ECDSA` over a 32-byte digest), in alternating rounds.

use std::sync::Barrier;
use std::time::Instant;

use cryptoki_sys::*;
use openssl::pkey::{PKey, Private};

use super::{check, create, fail, median, session, spread};
use crate::{BenchError, BenchOpts, Figure};

/// One module's side: its function list, a slot and the imported keys.
pub(super) struct Signer {
    pub(super) name: &'static str,
    f: &'static CK_FUNCTION_LIST,
    slot: CK_SLOT_ID,
    rsa: CK_OBJECT_HANDLE,
    ec: CK_OBJECT_HANDLE,
}

pub(super) fn at(ty: CK_ATTRIBUTE_TYPE, v: &[u8]) -> CK_ATTRIBUTE {
    CK_ATTRIBUTE {
        type_: ty,
        pValue: v.as_ptr().cast_mut().cast(),
        ulValueLen: v.len() as CK_ULONG,
    }
}

/// Imports `rsa` and `ec` into `f` (already initialised and logged in on
/// `slot`) as session objects.
pub(super) fn import(
    name: &'static str,
    f: &'static CK_FUNCTION_LIST,
    slot: CK_SLOT_ID,
    sess: CK_SESSION_HANDLE,
    rsa: &PKey<Private>,
    ec: &PKey<Private>,
) -> Result<Signer, BenchError> {
    let e = |e: openssl::error::ErrorStack| fail(e.to_string());
    let r = rsa.rsa().map_err(e)?;
    let part = |b: Option<&openssl::bn::BigNumRef>| b.map(|b| b.to_vec()).unwrap_or_default();
    let (class, rsa_t, ec_t, t, fl) = (
        CKO_PRIVATE_KEY.to_ne_bytes(),
        CKK_RSA.to_ne_bytes(),
        CKK_EC.to_ne_bytes(),
        [CK_TRUE],
        [CK_FALSE],
    );
    let vals = [
        r.n().to_vec(),
        r.e().to_vec(),
        r.d().to_vec(),
        part(r.p()),
        part(r.q()),
        part(r.dmp1()),
        part(r.dmq1()),
        part(r.iqmp()),
    ];
    let mut tpl = vec![
        at(CKA_CLASS, &class),
        at(CKA_KEY_TYPE, &rsa_t),
        at(CKA_TOKEN, &fl),
        at(CKA_SENSITIVE, &t),
        at(CKA_SIGN, &t),
        at(CKA_LABEL, b"bench-rsa"),
    ];
    for (ty, v) in [
        CKA_MODULUS,
        CKA_PUBLIC_EXPONENT,
        CKA_PRIVATE_EXPONENT,
        CKA_PRIME_1,
        CKA_PRIME_2,
        CKA_EXPONENT_1,
        CKA_EXPONENT_2,
        CKA_COEFFICIENT,
    ]
    .into_iter()
    .zip(&vals)
    {
        tpl.push(at(ty, v));
    }
    let rsa_h = create(f, sess, &mut tpl)?;
    let scalar = ec.ec_key().map_err(e)?.private_key().to_vec();
    let params = [0x06u8, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
    let mut tpl = vec![
        at(CKA_CLASS, &class),
        at(CKA_KEY_TYPE, &ec_t),
        at(CKA_TOKEN, &fl),
        at(CKA_SENSITIVE, &t),
        at(CKA_SIGN, &t),
        at(CKA_LABEL, b"bench-ec"),
        at(CKA_EC_PARAMS, &params),
        at(CKA_VALUE, &scalar),
    ];
    let ec_h = create(f, sess, &mut tpl)?;
    Ok(Signer {
        name,
        f,
        slot,
        rsa: rsa_h,
        ec: ec_h,
    })
}

/// One thread's signing loop: made on its thread (so it may hold what is
/// not `Send`), then called once per signature.
pub(super) type SignOnce<'a> = Box<dyn FnMut() -> Result<(), BenchError> + 'a>;

/// Operations a second of `threads` threads for about `secs` seconds: each
/// thread makes its loop with `make(thread)`, all start together, and each
/// calls its loop until `secs` have passed.
pub(super) fn rate_on_threads<'a, F>(threads: usize, secs: f64, make: F) -> Result<f64, BenchError>
where
    F: Fn(usize) -> Result<SignOnce<'a>, BenchError> + Sync,
{
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|i| {
                let (b, make) = (&barrier, &make);
                sc.spawn(move || -> Result<u64, BenchError> {
                    let once = make(i);
                    b.wait();
                    let mut once = once?;
                    let t = Instant::now();
                    let mut n = 0u64;
                    while t.elapsed().as_secs_f64() < secs {
                        once()?;
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        barrier.wait();
        let t = Instant::now();
        let mut total = 0u64;
        for h in hs {
            total += h.join().map_err(|_| fail("a signing thread panicked"))??;
        }
        Ok(total as f64 / t.elapsed().as_secs_f64())
    })
}

/// Signatures a second with `threads` threads for about `secs` seconds.
fn rate(s: &Signer, rsa: bool, threads: usize, secs: f64) -> Result<f64, BenchError> {
    let sessions: Vec<CK_SESSION_HANDLE> = (0..threads)
        .map(|_| session(s.f, s.slot))
        .collect::<Result<_, _>>()?;
    let (f, key) = (s.f, if rsa { s.rsa } else { s.ec });
    let mech_type = if rsa { CKM_SHA256_RSA_PKCS } else { CKM_ECDSA };
    let counts = rate_on_threads(threads, secs, |i| {
        let h = sessions[i];
        let mut data = [0x3cu8; 32];
        let mut sig = [0u8; 512];
        let mut mech = CK_MECHANISM {
            mechanism: mech_type,
            pParameter: std::ptr::null_mut(),
            ulParameterLen: 0,
        };
        Ok(Box::new(move || {
            call!(f, C_SignInit, h, &mut mech, key)?;
            let mut l = sig.len() as CK_ULONG;
            call!(
                f,
                C_Sign,
                h,
                data.as_mut_ptr(),
                32,
                sig.as_mut_ptr(),
                &mut l
            )
        }))
    });
    for h in sessions {
        call!(s.f, C_CloseSession, h)?;
    }
    counts
}

/// The same loop with OpenSSL in this process (RSA PKCS#1 v1.5, SHA-256).
fn openssl_rate(key: &PKey<Private>, threads: usize, secs: f64) -> Result<f64, BenchError> {
    rate_on_threads(threads, secs, |_| {
        Ok(Box::new(move || {
            let mut s = openssl::sign::Signer::new(openssl::hash::MessageDigest::sha256(), key)
                .map_err(|e| fail(e.to_string()))?;
            s.update(&[0x3c; 32]).map_err(|e| fail(e.to_string()))?;
            std::hint::black_box(s.sign_to_vec().map_err(|e| fail(e.to_string()))?);
            Ok(())
        }))
    })
}

/// The three signature figures; `mv` and `hsm` hold the same keys, `rsa`.
pub(super) fn figures(
    opts: &BenchOpts,
    mv: &Signer,
    hsm: &Signer,
    rsa: &PKey<Private>,
) -> Result<(Vec<Figure>, String), BenchError> {
    let rounds = opts.pick(5, 11);
    let secs = opts.pick(1.0, 2.0);
    let threads = 2;
    opts.say(&format!(
        "pkcs11: signatures, {rounds} alternating rounds of {secs} s, {threads} threads, memveil / SoftHSM2 / OpenSSL in-process"
    ));
    // Warm up (lanes, Montgomery contexts, blinding).
    for s in [mv, hsm] {
        rate(s, true, threads, 0.2)?;
        rate(s, false, threads, 0.2)?;
    }
    let (mut r_rsa, mut r_ec, mut r_ossl) = (Vec::new(), Vec::new(), Vec::new());
    let (mut v_rsa, mut v_hsm_rsa, mut v_ec, mut v_hsm_ec, mut v_ossl) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let order = if r % 2 == 0 { [mv, hsm] } else { [hsm, mv] };
        let mut got = [[0.0f64; 2]; 2];
        for s in order {
            let i = usize::from(s.name != "memveil");
            got[i][0] = rate(s, true, threads, secs)?;
            got[i][1] = rate(s, false, threads, secs)?;
        }
        let ossl = openssl_rate(rsa, threads, secs)?;
        r_rsa.push(got[0][0] / got[1][0]);
        r_ec.push(got[0][1] / got[1][1]);
        r_ossl.push(got[0][0] / ossl);
        v_rsa.push(got[0][0]);
        v_hsm_rsa.push(got[1][0]);
        v_ec.push(got[0][1]);
        v_hsm_ec.push(got[1][1]);
        v_ossl.push(ossl);
        opts.say(&format!(
            "pkcs11 sign round {}: RSA memveil {:.0}/s SoftHSM2 {:.0}/s OpenSSL {ossl:.0}/s; P-256 memveil {:.0}/s SoftHSM2 {:.0}/s",
            r + 1,
            got[0][0],
            got[1][0],
            got[0][1],
            got[1][1]
        ));
    }
    let md = format!(
        "\n### Signatures (issue 27)\n\nThe same RSA-2048 and P-256 keys imported into memveil's module and SoftHSM2 (session objects) and, for RSA, held by OpenSSL in this process; {threads} threads, each with its own session, `C_SignInit` + `C_Sign` in a loop (`CKM_SHA256_RSA_PKCS` over 32 bytes; `CKM_ECDSA` over a 32-byte digest); {rounds} alternating rounds of {secs} s; medians, ratio ranges over rounds.\n\n| key | memveil | SoftHSM2 | OpenSSL in-process | memveil/SoftHSM2 | memveil/OpenSSL |\n|---|---|---|---|---|---|\n| RSA-2048 | {:.0}/s | {:.0}/s | {:.0}/s | {:.3} ({}) | {:.3} ({}) |\n| P-256 | {:.0}/s | {:.0}/s | — | {:.3} ({}) | — |\n",
        median(v_rsa.clone()),
        median(v_hsm_rsa.clone()),
        median(v_ossl.clone()),
        median(r_rsa.clone()),
        spread(&r_rsa),
        median(r_ossl.clone()),
        spread(&r_ossl),
        median(v_ec.clone()),
        median(v_hsm_ec.clone()),
        median(r_ec.clone()),
        spread(&r_ec),
    );
    let figs = vec![
        Figure::vs(
            "pkcs11.rsa2048_sign_vs_softhsm",
            median(v_rsa.clone()),
            median(v_hsm_rsa),
            "sign/s",
            "RSA-2048 CKM_SHA256_RSA_PKCS signatures a second through PKCS#11, 2 threads, memveil module (key in the vault) vs SoftHSM2, same key, same run; ratio = median of rounds' ratios",
        )
        .with_ratio(median(r_rsa))
        .target(">= 1.0"),
        Figure::vs(
            "pkcs11.p256_sign_vs_softhsm",
            median(v_ec),
            median(v_hsm_ec),
            "sign/s",
            "P-256 CKM_ECDSA signatures a second through PKCS#11, 2 threads, memveil module vs SoftHSM2, same key, same run; ratio = median of rounds' ratios",
        )
        .with_ratio(median(r_ec))
        .target(">= 1.0"),
        Figure::vs(
            "pkcs11.rsa2048_sign_vs_openssl",
            median(v_rsa),
            median(v_ossl),
            "sign/s",
            "RSA-2048 signatures a second, 2 threads: memveil module (CKM_SHA256_RSA_PKCS) vs OpenSSL in this process with the same key (EVP, SHA-256); ratio = median of rounds' ratios",
        )
        .with_ratio(median(r_ossl))
        .target(">= 0.8"),
    ];
    Ok((figs, md))
}
