//! AES key expansion (FIPS-197 §5.2) and the candidate check.

use std::sync::OnceLock;

fn sbox() -> &'static [u8; 256] {
    static S: OnceLock<[u8; 256]> = OnceLock::new();
    S.get_or_init(|| {
        // S(x) = affine(x^-1) in GF(2^8) mod x^8+x^4+x^3+x+1.
        let mul = |mut a: u8, mut b: u8| {
            let mut p = 0u8;
            while b != 0 {
                if b & 1 != 0 {
                    p ^= a;
                }
                let hi = a & 0x80;
                a <<= 1;
                if hi != 0 {
                    a ^= 0x1b;
                }
                b >>= 1;
            }
            p
        };
        let mut s = [0u8; 256];
        for (x, slot) in (0u8..=255).zip(s.iter_mut()) {
            let inv = if x == 0 {
                0
            } else {
                (1u8..=255).find(|&y| mul(x, y) == 1).unwrap_or(0)
            };
            let mut b = inv;
            let mut r = inv;
            for _ in 0..4 {
                b = b.rotate_left(1);
                r ^= b;
            }
            *slot = r ^ 0x63;
        }
        s
    })
}

fn sub_word(w: [u8; 4]) -> [u8; 4] {
    let s = sbox();
    [
        s[usize::from(w[0])],
        s[usize::from(w[1])],
        s[usize::from(w[2])],
        s[usize::from(w[3])],
    ]
}

const RCON: [u8; 10] = [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x1b, 0x36];

fn word(b: &[u8], i: usize) -> [u8; 4] {
    [b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]
}

fn xor(a: [u8; 4], b: [u8; 4]) -> [u8; 4] {
    [a[0] ^ b[0], a[1] ^ b[1], a[2] ^ b[2], a[3] ^ b[3]]
}

fn diff(a: [u8; 4], b: [u8; 4]) -> u32 {
    (u32::from_ne_bytes(a) ^ u32::from_ne_bytes(b)).count_ones()
}

/// Word `i` of the schedule given the previous words, for `nk` key words.
fn next(prev: [u8; 4], back: [u8; 4], i: usize, nk: usize) -> [u8; 4] {
    let t = if i.is_multiple_of(nk) {
        let r = sub_word([prev[1], prev[2], prev[3], prev[0]]);
        [r[0] ^ RCON[i / nk - 1], r[1], r[2], r[3]]
    } else if nk > 6 && i % nk == 4 {
        sub_word(prev)
    } else {
        prev
    };
    xor(back, t)
}

/// Bit errors between the stored words `w` (read from the image) and the
/// schedule recomputed from its first `nk` words; gives up above `max`.
fn errors(w: &[u8], nk: usize, total: usize, max: u32) -> Option<u32> {
    let mut errs = 0u32;
    // Recompute from the *stored* previous words, as aeskeyfind does, so one
    // flipped bit costs a few errors locally instead of spreading.
    for i in nk..total {
        let want = next(word(w, i - 1), word(w, i - nk), i, nk);
        errs += diff(want, word(w, i));
        if errs > max {
            return None;
        }
    }
    Some(errs)
}

/// Is `w` the start of an AES-256 or AES-128 schedule? Returns (bits, errors).
pub(crate) fn check(w: &[u8], max: u32) -> Option<(u32, u32)> {
    // Cheap rejects: an all-zero or all-equal window is never reported.
    if w[..16].iter().all(|&b| b == w[0]) {
        return None;
    }
    if w.len() >= 240 {
        if let Some(e) = errors(w, 8, 60, max) {
            return Some((256, e));
        }
    }
    errors(w, 4, 44, max).map(|e| (128, e))
}

/// The expanded encryption schedule of a 16- or 32-byte key.
pub(crate) fn expand(key: &[u8]) -> Option<Vec<u8>> {
    let (nk, total) = match key.len() {
        16 => (4, 44),
        32 => (8, 60),
        _ => return None,
    };
    let mut out = key.to_vec();
    for i in nk..total {
        let w = next(word(&out, i - 1), word(&out, i - nk), i, nk);
        out.extend_from_slice(&w);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sbox_and_fips197_expansion() {
        assert_eq!(sbox()[0x00], 0x63);
        assert_eq!(sbox()[0x53], 0xed);
        // FIPS-197 A.1: key 2b7e1516..., w[43] = b6630ca6.
        let k = [
            0x2b, 0x7e, 0x15, 0x16, 0x28, 0xae, 0xd2, 0xa6, 0xab, 0xf7, 0x15, 0x88, 0x09, 0xcf,
            0x4f, 0x3c,
        ];
        let s = expand(&k).expect("128");
        assert_eq!(&s[172..176], &[0xb6, 0x63, 0x0c, 0xa6]);
        // FIPS-197 A.3: 256-bit key 603deb10..., w[59] = 706c631e.
        let k256: Vec<u8> = [
            0x60, 0x3d, 0xeb, 0x10, 0x15, 0xca, 0x71, 0xbe, 0x2b, 0x73, 0xae, 0xf0, 0x85, 0x7d,
            0x77, 0x81, 0x1f, 0x35, 0x2c, 0x07, 0x3b, 0x61, 0x08, 0xd7, 0x2d, 0x98, 0x10, 0xa3,
            0x09, 0x14, 0xdf, 0xf4,
        ]
        .to_vec();
        let s = expand(&k256).expect("256");
        assert_eq!(&s[236..240], &[0x70, 0x6c, 0x63, 0x1e]);
    }
}
