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

    fn h(s: &str) -> Vec<u8> {
        hex::decode(s).expect("hex")
    }

    /// RFC 4493 section 4 (AES-128) and NIST SP 800-38B appendix D.3 (AES-256).
    #[test]
    fn rfc4493_and_sp800_38b_examples() {
        let m = h("6bc1bee22e409f96e93d7e117393172aae2d8a571e03ac9c9eb76fac45af8e5130c81c46a35ce411e5fbc1191a0a52eff69f2445df4f9b17ad2b417be66c3710");
        let k128 = h("2b7e151628aed2a6abf7158809cf4f3c");
        let k256 = h("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4");
        let cases: [(&[u8], usize, &str); 8] = [
            (&k128, 0, "bb1d6929e95937287fa37d129b756746"),
            (&k128, 16, "070a16b46b4d4144f79bdd9dd04a287c"),
            (&k128, 40, "dfa66747de9ae63030ca32611497c827"),
            (&k128, 64, "51f0bebf7e3b9d92fc49741779363cfe"),
            (&k256, 0, "028962f61b7bf89efc6b551f4667d983"),
            (&k256, 16, "28a7023f452e8f82bd4bf28d8c37c35c"),
            (&k256, 40, "aaf3d8f1de5640c232f5b169b9c911e6"),
            (&k256, 64, "e1992190549f6ed5696a2c056c315410"),
        ];
        for (key, len, want) in cases {
            let aes = Aes::new(key).expect("key");
            let tag = cmac(&aes, &m[..len]);
            assert_eq!(hex::encode(tag), want, "key {} bytes, msg {len}", key.len());
            assert!(verify(&aes, &m[..len], &tag));
            let mut bad = tag;
            bad[15] ^= 1;
            assert!(!verify(&aes, &m[..len], &bad), "a wrong tag verified");
        }
    }
}
