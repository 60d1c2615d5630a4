//! Issue 36's figures: operations that run in the caller's process (RSA
//! verification with a public key object) or in one vault request (HMAC
//! with a generic secret), against SoftHSM2 with the same keys; two
//! threads, each with its own session, in alternating rounds.

use cryptoki_sys::*;
use openssl::pkey::{PKey, Private};

use super::sign::{at, rate_on_threads, SignOnce};
use super::{check, create, fail, median, session, spread};
use crate::{BenchError, BenchOpts, Figure};

/// One module's side: its function list, a slot, the RSA public key and
/// the HMAC key.
pub(super) struct Side {
    name: &'static str,
    f: &'static CK_FUNCTION_LIST,
    slot: CK_SLOT_ID,
    public: CK_OBJECT_HANDLE,
    secret: CK_OBJECT_HANDLE,
}

/// Imports `rsa`'s public half and a 32-byte generic secret into `f` (as
/// session objects, on the logged-in session `sess`).
pub(super) fn import(
    name: &'static str,
    f: &'static CK_FUNCTION_LIST,
    slot: CK_SLOT_ID,
    sess: CK_SESSION_HANDLE,
    rsa: &PKey<Private>,
) -> Result<Side, BenchError> {
    let r = rsa.rsa().map_err(|e| fail(e.to_string()))?;
    let (n, e) = (r.n().to_vec(), r.e().to_vec());
    let (t, fl) = ([CK_TRUE], [CK_FALSE]);
    let (pub_c, rsa_t) = (CKO_PUBLIC_KEY.to_ne_bytes(), CKK_RSA.to_ne_bytes());
    let mut tpl = [
        at(CKA_CLASS, &pub_c),
        at(CKA_KEY_TYPE, &rsa_t),
        at(CKA_TOKEN, &fl),
        at(CKA_VERIFY, &t),
        at(CKA_MODULUS, &n),
        at(CKA_PUBLIC_EXPONENT, &e),
    ];
    let public = create(f, sess, &mut tpl)?;
    let (sec_c, gen_t) = (
        CKO_SECRET_KEY.to_ne_bytes(),
        CKK_GENERIC_SECRET.to_ne_bytes(),
    );
    let value: [u8; 32] = std::array::from_fn(|i| u8::try_from(i).unwrap_or(0) ^ 0x5c);
    let mut tpl = [
        at(CKA_CLASS, &sec_c),
        at(CKA_KEY_TYPE, &gen_t),
        at(CKA_TOKEN, &fl),
        at(CKA_SENSITIVE, &t),
        at(CKA_SIGN, &t),
        at(CKA_VERIFY, &t),
        at(CKA_VALUE, &value),
    ];
    let secret = create(f, sess, &mut tpl)?;
    Ok(Side {
        name,
        f,
        slot,
        public,
        secret,
    })
}

/// Operations a second: RSA-2048 `CKM_SHA256_RSA_PKCS` verifications of
/// `sig` over 32 bytes (`hmac` false), or `CKM_SHA256_HMAC` over 1 KiB.
fn rate(s: &Side, hmac: bool, sig: &[u8], threads: usize, secs: f64) -> Result<f64, BenchError> {
    let sessions: Vec<CK_SESSION_HANDLE> = (0..threads)
        .map(|_| session(s.f, s.slot))
        .collect::<Result<_, _>>()?;
    let f = s.f;
    let (key, mech_type) = if hmac {
        (s.secret, CKM_SHA256_HMAC)
    } else {
        (s.public, CKM_SHA256_RSA_PKCS)
    };
    let r = rate_on_threads(threads, secs, |i| -> Result<SignOnce<'_>, BenchError> {
        let h = sessions[i];
        let mut data = vec![0x3cu8; if hmac { 1024 } else { 32 }];
        let mut sig = sig.to_vec();
        let mut mac = [0u8; 64];
        let mut mech = CK_MECHANISM {
            mechanism: mech_type,
            pParameter: std::ptr::null_mut(),
            ulParameterLen: 0,
        };
        Ok(Box::new(move || {
            if hmac {
                call!(f, C_SignInit, h, &mut mech, key)?;
                let mut l = mac.len() as CK_ULONG;
                let n = data.len() as CK_ULONG;
                call!(f, C_Sign, h, data.as_mut_ptr(), n, mac.as_mut_ptr(), &mut l)
            } else {
                call!(f, C_VerifyInit, h, &mut mech, key)?;
                let (n, l) = (data.len() as CK_ULONG, sig.len() as CK_ULONG);
                call!(f, C_Verify, h, data.as_mut_ptr(), n, sig.as_mut_ptr(), l)
            }
        }))
    });
    for h in sessions {
        call!(s.f, C_CloseSession, h)?;
    }
    r
}

/// `pkcs11.hmac_sha256_1k_vs_softhsm` and `pkcs11.verify_rsa2048_vs_softhsm`.
pub(super) fn figures(
    opts: &BenchOpts,
    mv: &Side,
    hsm: &Side,
    rsa: &PKey<Private>,
) -> Result<(Vec<Figure>, String), BenchError> {
    let mut s = openssl::sign::Signer::new(openssl::hash::MessageDigest::sha256(), rsa)
        .map_err(|e| fail(e.to_string()))?;
    let sig = s
        .sign_oneshot_to_vec(&[0x3c; 32])
        .map_err(|e| fail(e.to_string()))?;
    let rounds = opts.pick(5, 11);
    let secs = opts.pick(1.0, 2.0);
    let threads = 2;
    opts.say(&format!(
        "pkcs11: HMAC-SHA256 1 KiB and RSA-2048 verification, {rounds} alternating rounds of {secs} s, {threads} threads, memveil / SoftHSM2"
    ));
    for s in [mv, hsm] {
        rate(s, true, &sig, threads, 0.2)?;
        rate(s, false, &sig, threads, 0.2)?;
    }
    // [memveil, SoftHSM2] x [hmac, verify], per round.
    let mut got: [[Vec<f64>; 2]; 2] = Default::default();
    let mut ratios: [Vec<f64>; 2] = Default::default();
    for r in 0..rounds {
        let order = if r % 2 == 0 { [mv, hsm] } else { [hsm, mv] };
        let mut one = [[0.0f64; 2]; 2];
        for s in order {
            let i = usize::from(s.name != "memveil");
            one[i][0] = rate(s, true, &sig, threads, secs)?;
            one[i][1] = rate(s, false, &sig, threads, secs)?;
        }
        for k in 0..2 {
            got[0][k].push(one[0][k]);
            got[1][k].push(one[1][k]);
            ratios[k].push(one[0][k] / one[1][k]);
        }
        opts.say(&format!(
            "pkcs11 round {}: HMAC memveil {:.0}/s SoftHSM2 {:.0}/s; verify memveil {:.0}/s SoftHSM2 {:.0}/s",
            r + 1,
            one[0][0],
            one[1][0],
            one[0][1],
            one[1][1]
        ));
    }
    let m = |v: &Vec<f64>| median(v.clone());
    let md = format!(
        "\n### HMAC and verification (issue 36)\n\nThe same 32-byte generic secret and RSA-2048 public key imported into memveil's module and SoftHSM2 (session objects); {threads} threads, each with its own session: `C_SignInit` + `C_Sign` with `CKM_SHA256_HMAC` over 1 KiB (memveil: one vault request each, the key in the vault), `C_VerifyInit` + `C_Verify` with `CKM_SHA256_RSA_PKCS` over 32 bytes (memveil: in the caller's process, from the public key object); {rounds} alternating rounds of {secs} s; medians, ratio ranges over rounds.\n\n| operation | memveil | SoftHSM2 | memveil/SoftHSM2 |\n|---|---|---|---|\n| HMAC-SHA256 1 KiB | {:.0}/s | {:.0}/s | {:.3} ({}) |\n| RSA-2048 verify | {:.0}/s | {:.0}/s | {:.3} ({}) |\n",
        m(&got[0][0]),
        m(&got[1][0]),
        m(&ratios[0]),
        spread(&ratios[0]),
        m(&got[0][1]),
        m(&got[1][1]),
        m(&ratios[1]),
        spread(&ratios[1]),
    );
    let figs = vec![
        Figure::vs(
            "pkcs11.hmac_sha256_1k_vs_softhsm",
            m(&got[0][0]),
            m(&got[1][0]),
            "MAC/s",
            "CKM_SHA256_HMAC over 1 KiB, C_SignInit+C_Sign, 2 threads, memveil module (32-byte generic secret in the vault) vs SoftHSM2, same key, same run; ratio = median of rounds' ratios",
        )
        .with_ratio(m(&ratios[0]))
        .target(">= 1.0"),
        Figure::vs(
            "pkcs11.verify_rsa2048_vs_softhsm",
            m(&got[0][1]),
            m(&got[1][1]),
            "verify/s",
            "RSA-2048 CKM_SHA256_RSA_PKCS verifications a second, C_VerifyInit+C_Verify with a public key object, 2 threads, memveil module (in the caller's process) vs SoftHSM2, same key, same run; ratio = median of rounds' ratios",
        )
        .with_ratio(m(&ratios[1]))
        .target(">= 1.0"),
    ];
    Ok((figs, md))
}
