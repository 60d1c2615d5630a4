//! RSA PKCS#1 v1.5 decryption padding with implicit rejection
//! (draft-irtf-cfrg-rsa-guidance; what OpenSSL 3.2 does by default).
//!
//! A PKCS#1 v1.5 decryption that tells the caller whether the padding was
//! good — by an error, or by its timing — is a Bleichenbacher oracle (the
//! Marvin attack measured it in most implementations, the Rust `rsa` crate
//! among them: RUSTSEC-2023-0071). With implicit rejection a bad padding is
//! never reported: the decryption returns a synthetic message instead,
//! derived from the private key and the ciphertext (so the same ciphertext
//! always gives the same answer), of a length drawn from the same
//! derivation. A higher protocol (TLS's premaster check) then fails the way
//! it fails for a wrong message, in constant time.
//!
//! This module checks the padding of the raw RSA output and selects the
//! message without branches or memory accesses that depend on secret data;
//! the caller supplies the key derivation key (HMAC-SHA256 under SHA-256 of
//! the private exponent, over the ciphertext) and HMAC-SHA256. The
//! derivation is OpenSSL's, so the synthetic messages are the same as
//! OpenSSL 3.2's for the same key and ciphertext.
#![forbid(unsafe_code)]

use std::hint::black_box;

/// HMAC-SHA256(key, message).
pub type Hmac<'a> = &'a dyn Fn(&[u8], &[u8]) -> [u8; 32];

/// All ones when `x` is zero, else zero.
fn is_zero(x: u32) -> u32 {
    black_box(0u32.wrapping_sub((!x & x.wrapping_sub(1)) >> 31))
}

fn eq(a: u32, b: u32) -> u32 {
    is_zero(a ^ b)
}

/// All ones when `a < b` (both below 2^31).
fn lt(a: u32, b: u32) -> u32 {
    black_box(0u32.wrapping_sub((a ^ ((a ^ b) | (a.wrapping_sub(b) ^ b))) >> 31))
}

fn select(mask: u32, a: u32, b: u32) -> u32 {
    (mask & a) | (!mask & b)
}

fn select_u8(mask: u32, a: u8, b: u8) -> u8 {
    let m = (mask & 0xff) as u8;
    (m & a) | (!m & b)
}

/// OpenSSL's `ossl_rsa_prf`: `out.len()` bytes of HMAC-SHA256(kdk, i ‖
/// label ‖ bits), i counting blocks from 0, both 16-bit big-endian.
fn prf(hmac: Hmac<'_>, kdk: &[u8; 32], label: &[u8], out: &mut [u8]) {
    let bits = u16::try_from(out.len() * 8)
        .unwrap_or(u16::MAX)
        .to_be_bytes();
    let mut msg = Vec::with_capacity(4 + label.len());
    for (i, chunk) in out.chunks_mut(32).enumerate() {
        msg.clear();
        msg.extend_from_slice(&u16::try_from(i).unwrap_or(u16::MAX).to_be_bytes());
        msg.extend_from_slice(label);
        msg.extend_from_slice(&bits);
        let mut block = hmac(kdk, &msg);
        chunk.copy_from_slice(&block[..chunk.len()]);
        zeroize::Zeroize::zeroize(&mut block);
    }
}

/// Decodes `em` (the raw RSA decryption, `k` bytes) into `out` (at least
/// `k` bytes): the message when the padding is good, else the synthetic
/// message. Returns the length written. `kdk` is the key derivation key
/// for this ciphertext (see the module doc).
///
/// Returns `None` only for a modulus too short for PKCS#1 v1.5 (under 11
/// bytes) or an `out` shorter than `em` — public facts, never the padding.
#[must_use]
pub fn decode(em: &[u8], kdk: &[u8; 32], hmac: Hmac<'_>, out: &mut [u8]) -> Option<usize> {
    let k = em.len();
    if !(11..=0xFFFF / 8).contains(&k) || out.len() < k {
        return None;
    }
    let num = u32::try_from(k).ok()?;
    let mut synthetic = zeroize::Zeroizing::new(vec![0u8; k]);
    prf(hmac, kdk, b"message", &mut synthetic);
    let mut lengths = [0u8; 256];
    prf(hmac, kdk, b"length", &mut lengths);
    let max_sep_offset = num - 2 - 8;
    let mut mask = max_sep_offset;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    let mut synthetic_length = 0u32;
    for c in lengths.chunks_exact(2) {
        let cand = (u32::from(c[0]) << 8 | u32::from(c[1])) & mask;
        synthetic_length = select(lt(cand, max_sep_offset), cand, synthetic_length);
    }
    zeroize::Zeroize::zeroize(&mut lengths);

    let mut good = is_zero(u32::from(em[0]));
    good &= eq(u32::from(em[1]), 2);
    let mut found_zero = 0u32;
    let mut zero_index = 0u32;
    for (i, b) in (0u32..).zip(em.iter()).skip(2) {
        let z = is_zero(u32::from(*b));
        zero_index = select(!found_zero & z, i, zero_index);
        found_zero |= z;
    }
    // PS is at least 8 bytes from offset 2; no zero at all leaves index 0.
    good &= !lt(zero_index, 2 + 8);
    let msg_index = select(good, zero_index + 1, num - synthetic_length);
    let good = black_box(good);
    // From here msg_index is the length the caller sees either way.
    let start = usize::try_from(msg_index).ok()?;
    let mut n = 0;
    for (o, (e, s)) in out
        .iter_mut()
        .zip(em.iter().zip(synthetic.iter()).skip(start))
    {
        *o = select_u8(good, *e, *s);
        n += 1;
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_hmac(key: &[u8], msg: &[u8]) -> [u8; 32] {
        // Not HMAC: enough to exercise the selection deterministically.
        let mut out = [0u8; 32];
        for (i, b) in key.iter().chain(msg).enumerate() {
            out[i % 32] = out[i % 32].wrapping_mul(31).wrapping_add(*b);
        }
        out
    }

    #[test]
    fn constant_time_helpers() {
        assert_eq!(is_zero(0), u32::MAX);
        assert_eq!(is_zero(1), 0);
        assert_eq!(is_zero(0x8000_0000), 0);
        assert_eq!(lt(1, 2), u32::MAX);
        assert_eq!(lt(2, 2), 0);
        assert_eq!(lt(3, 2), 0);
        assert_eq!(select(u32::MAX, 5, 6), 5);
        assert_eq!(select(0, 5, 6), 6);
    }

    #[test]
    fn good_padding_gives_the_message_bad_gives_a_stable_synthetic_one() {
        let k = 256;
        let mut em = vec![0u8; k];
        em[1] = 2;
        em[2..k - 17].fill(0x55);
        em[k - 16..].copy_from_slice(b"sixteen byte msg");
        let kdk = [9u8; 32];
        let mut out = vec![0u8; k];
        let n = decode(&em, &kdk, &fake_hmac, &mut out).expect("decode");
        assert_eq!(&out[..n], b"sixteen byte msg");
        // Every kind of bad padding: a synthetic message, the same each time.
        let mut bads = Vec::new();
        for f in [
            |e: &mut Vec<u8>| e[0] = 1,
            |e: &mut Vec<u8>| e[1] = 1,
            |e: &mut Vec<u8>| e[5] = 0,
            |e: &mut Vec<u8>| {
                let k = e.len();
                e[2..k].fill(0x55)
            },
        ] {
            let mut b = em.clone();
            f(&mut b);
            let n1 = decode(&b, &kdk, &fake_hmac, &mut out).expect("decode");
            let first = out[..n1].to_vec();
            let n2 = decode(&b, &kdk, &fake_hmac, &mut out).expect("decode");
            assert_eq!(first, out[..n2].to_vec());
            assert_ne!(first, b"sixteen byte msg".to_vec());
            assert!(n1 <= k - 11);
            bads.push(first);
        }
        // The synthetic message depends on the KDK only, not the padding flaw.
        assert!(bads.windows(2).all(|w| w[0] == w[1]));
        assert_eq!(decode(&em[..10], &kdk, &fake_hmac, &mut out), None);
    }
}
