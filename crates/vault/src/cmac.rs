//! AES-CMAC (NIST SP 800-38B, RFC 4493) over a key's AES schedule.
//!
//! The subkeys K1/K2 and the chaining value are key-derived secrets: they
//! live on the caller's stack (a lane worker's stack is in secret memory)
//! and are wiped before return.
#![forbid(unsafe_code)]

use memveil_cipher::Aes;
use zeroize::Zeroize as _;

/// Doubling in GF(2^128) with the CMAC polynomial (`Rb = 0x87`).
fn dbl(b: &mut [u8; 16]) {
    let carry = b[0] >> 7;
    for i in 0..15 {
        b[i] = (b[i] << 1) | (b[i + 1] >> 7);
    }
    // Constant time: the reduction is masked, not branched on.
    b[15] = (b[15] << 1) ^ (0x87 & 0u8.wrapping_sub(carry));
}

/// The 16-byte CMAC of `msg` under `aes`.
#[must_use]
pub fn cmac(aes: &Aes, msg: &[u8]) -> [u8; 16] {
    let mut k = [0u8; 16];
    aes.encrypt_block(&mut k);
    dbl(&mut k); // K1
    let full_last = !msg.is_empty() && msg.len().is_multiple_of(16);
    if !full_last {
        dbl(&mut k); // K2
    }
    let blocks = msg.len().div_ceil(16).max(1);
    let mut x = [0u8; 16];
    for (i, chunk) in msg.chunks(16).take(blocks - 1).enumerate() {
        debug_assert!(i < blocks - 1);
        for (xb, mb) in x.iter_mut().zip(chunk) {
            *xb ^= mb;
        }
        aes.encrypt_block(&mut x);
    }
    let tail = &msg[(blocks - 1) * 16..];
    let mut last = [0u8; 16];
    last[..tail.len()].copy_from_slice(tail);
    if !full_last {
        last[tail.len()] = 0x80;
    }
    for i in 0..16 {
        x[i] ^= last[i] ^ k[i];
    }
    aes.encrypt_block(&mut x);
    k.zeroize();
    last.zeroize();
    x
}

/// Whether `tag` (16 bytes) is the CMAC of `msg`, compared in constant time.
#[must_use]
pub fn verify(aes: &Aes, msg: &[u8], tag: &[u8; 16]) -> bool {
    let mut want = cmac(aes, msg);
    let diff = want.iter().zip(tag).fold(0u8, |a, (x, y)| a | (x ^ y));
    want.zeroize();
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NIST SP 800-38B appendix D (AES-128 and AES-256; the AES-128 ones are
    /// RFC 4493's), from `tests/vectors/cmac-sp800-38b.txt`.
    #[test]
    fn rfc4493_and_sp800_38b_examples() {
        let file = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/vectors/cmac-sp800-38b.txt"
        );
        let text = std::fs::read_to_string(file).expect("vector file");
        let cases: Vec<Vec<Vec<u8>>> = text
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| l.split(':').map(|f| hex::decode(f).expect("hex")).collect())
            .collect();
        assert_eq!(cases.len(), 8);
        for c in cases {
            let (key, msg, want) = (&c[0], &c[1], &c[2]);
            let len = msg.len();
            let aes = Aes::new(key).expect("key");
            let tag = cmac(&aes, msg);
            assert_eq!(&tag[..], &want[..], "key {} bytes, msg {len}", key.len());
            assert!(verify(&aes, msg, &tag));
            let mut bad = tag;
            bad[15] ^= 1;
            assert!(!verify(&aes, msg, &bad), "a wrong tag verified");
        }
    }
}
