//! Property tests: memveil's CTR_DRBG against a plain block-by-block
//! reference of SP 800-90A §10.2.1 written here over OpenSSL's AES-256 (an
//! independent AES), for random input lengths, request sizes (including
//! partial blocks and the 64 KiB maximum), additional input and reseeds.

use memveil_drng::drbg::{CtrDrbg, DfMode, MAX_REQUEST_BYTES};
use openssl::symm::{Cipher, Crypter, Mode};
use proptest::prelude::*;

fn aes256(key: &[u8], block: &[u8; 16]) -> [u8; 16] {
    let mut c = Crypter::new(Cipher::aes_256_ecb(), Mode::Encrypt, key, None).expect("ecb");
    c.pad(false);
    let mut out = [0u8; 32];
    let n = c.update(block, &mut out).expect("update");
    assert_eq!(n, 16);
    let mut b = [0u8; 16];
    b.copy_from_slice(&out[..16]);
    b
}

fn inc(v: &mut [u8; 16]) {
    *v = u128::from_be_bytes(*v).wrapping_add(1).to_be_bytes();
}

fn bcc(key: &[u8], data: &[u8]) -> [u8; 16] {
    let mut x = [0u8; 16];
    for blk in data.chunks(16) {
        for (a, b) in x.iter_mut().zip(blk) {
            *a ^= b;
        }
        x = aes256(key, &x);
    }
    x
}

fn df(input: &[u8]) -> Vec<u8> {
    let mut s = Vec::new();
    s.extend_from_slice(&u32::try_from(input.len()).expect("len").to_be_bytes());
    s.extend_from_slice(&48u32.to_be_bytes());
    s.extend_from_slice(input);
    s.push(0x80);
    while s.len() % 16 != 0 {
        s.push(0);
    }
    let k: Vec<u8> = (0u8..32).collect();
    let mut temp = Vec::new();
    let mut i = 0u32;
    while temp.len() < 48 {
        let mut iv_s = i.to_be_bytes().to_vec();
        iv_s.extend_from_slice(&[0u8; 12]);
        iv_s.extend_from_slice(&s);
        temp.extend_from_slice(&bcc(&k, &iv_s));
        i += 1;
    }
    let key = temp[..32].to_vec();
    let mut x = [0u8; 16];
    x.copy_from_slice(&temp[32..48]);
    let mut out = Vec::new();
    while out.len() < 48 {
        x = aes256(&key, &x);
        out.extend_from_slice(&x);
    }
    out.truncate(48);
    out
}

struct Reference {
    key: Vec<u8>,
    v: [u8; 16],
}

impl Reference {
    fn update(&mut self, provided: &[u8]) {
        let mut temp = Vec::new();
        while temp.len() < 48 {
            inc(&mut self.v);
            temp.extend_from_slice(&aes256(&self.key, &self.v));
        }
        for (t, p) in temp.iter_mut().zip(provided) {
            *t ^= p;
        }
        self.key = temp[..32].to_vec();
        self.v.copy_from_slice(&temp[32..48]);
    }

    fn instantiate(entropy: &[u8], nonce: &[u8], pers: &[u8]) -> Self {
        let mut r = Self {
            key: vec![0; 32],
            v: [0; 16],
        };
        let seed = df(&[entropy, nonce, pers].concat());
        r.update(&seed);
        r
    }

    fn reseed(&mut self, entropy: &[u8], addl: &[u8]) {
        let seed = df(&[entropy, addl].concat());
        self.update(&seed);
    }

    fn generate(&mut self, n: usize, addl: &[u8]) -> Vec<u8> {
        let a = if addl.is_empty() {
            vec![0u8; 48]
        } else {
            let a = df(addl);
            self.update(&a);
            a
        };
        let mut out = Vec::new();
        while out.len() < n {
            inc(&mut self.v);
            out.extend_from_slice(&aes256(&self.key, &self.v));
        }
        out.truncate(n);
        self.update(&a);
        out
    }
}

#[derive(Debug, Clone)]
enum Op {
    Generate { n: usize, addl: Vec<u8> },
    Reseed { entropy: Vec<u8>, addl: Vec<u8> },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            prop_oneof![0usize..70, Just(MAX_REQUEST_BYTES), 1000usize..20_000],
            prop::collection::vec(any::<u8>(), 0..80)
        )
            .prop_map(|(n, addl)| Op::Generate { n, addl }),
        1 => (
            prop::collection::vec(any::<u8>(), 32..80),
            prop::collection::vec(any::<u8>(), 0..60)
        )
            .prop_map(|(entropy, addl)| Op::Reseed { entropy, addl }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn matches_the_block_by_block_reference(
        entropy in prop::collection::vec(any::<u8>(), 32..100),
        nonce in prop::collection::vec(any::<u8>(), 0..40),
        pers in prop::collection::vec(any::<u8>(), 0..70),
        ops in prop::collection::vec(op(), 1..6),
    ) {
        let mut ours = CtrDrbg::instantiate(DfMode::UseDf, &entropy, &nonce, &pers).expect("instantiate");
        let mut theirs = Reference::instantiate(&entropy, &nonce, &pers);
        for op in &ops {
            match op {
                Op::Generate { n, addl } => {
                    let mut out = vec![0u8; *n];
                    ours.generate(&mut out, addl).expect("generate");
                    let want = theirs.generate(*n, addl);
                    prop_assert!(out == want, "generate {} bytes differs", n);
                }
                Op::Reseed { entropy, addl } => {
                    ours.reseed(entropy, addl).expect("reseed");
                    theirs.reseed(entropy, addl);
                }
            }
        }
    }
}
