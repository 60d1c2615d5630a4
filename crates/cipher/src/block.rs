//! AES as a block cipher: single blocks, ECB, CBC, CTR.

use aes::cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};

use crate::ni::NiKeys;
use crate::CipherError;

/// Blocks processed per batch: enough for the backend's 8-way pipelining and
/// small enough to stay on the stack.
pub(crate) const BATCH: usize = 64;

pub(crate) type Block = Array<u8, aes::cipher::consts::U16>;

enum Inner {
    A128(aes::Aes128),
    A256(aes::Aes256),
}

/// An AES-128 or AES-256 key schedule. Wiped on drop; never printed or cloned.
pub struct Aes {
    inner: Inner,
    /// The fused AES-NI kernels' schedule, when the CPU has AES-NI.
    ni: Option<NiKeys>,
}

macro_rules! with {
    ($self:expr, $c:ident => $e:expr) => {
        match &$self.inner {
            Inner::A128($c) => $e,
            Inner::A256($c) => $e,
        }
    };
}

/// Splits `data` into 16-byte blocks, or says why it cannot.
pub(crate) fn blocks_of<'a>(
    mode: &'static str,
    data: &'a mut [u8],
) -> Result<&'a mut [Block], CipherError> {
    let (blocks, rest) = Block::slice_as_chunks_mut(data);
    if !rest.is_empty() {
        return Err(CipherError::BadLength {
            mode,
            got: blocks.len() * 16 + rest.len(),
            expected: "a multiple of 16 bytes",
        });
    }
    Ok(blocks)
}

pub(crate) fn xor_into(dst: &mut Block, src: &[u8; 16]) {
    let v = u128::from_ne_bytes(dst.0) ^ u128::from_ne_bytes(*src);
    dst.0 = v.to_ne_bytes();
}

impl Aes {
    /// Expands a 16-byte (AES-128) or 32-byte (AES-256) key.
    ///
    /// # Errors
    /// [`CipherError::BadKeyLength`] for any other length.
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        let inner = match key.len() {
            16 => Inner::A128(aes::Aes128::new_from_slice(key).map_err(|_| bad_key(key))?),
            32 => Inner::A256(aes::Aes256::new_from_slice(key).map_err(|_| bad_key(key))?),
            _ => return Err(bad_key(key)),
        };
        Ok(Self {
            inner,
            ni: NiKeys::new(key),
        })
    }

    /// This key without the fused AES-NI kernels (the portable path hosts
    /// without AES-NI take), for tests and benchmarks.
    #[doc(hidden)]
    #[must_use]
    pub fn without_kernels(mut self) -> Self {
        self.ni = None;
        self
    }

    /// 128 or 256.
    #[must_use]
    pub fn key_bits(&self) -> usize {
        match self.inner {
            Inner::A128(_) => 128,
            Inner::A256(_) => 256,
        }
    }

    /// Encrypts one block in place.
    pub fn encrypt_block(&self, b: &mut [u8; 16]) {
        let mut blk = Block::from(*b);
        with!(self, c => c.encrypt_block(&mut blk));
        *b = blk.0;
    }

    /// Decrypts one block in place.
    pub fn decrypt_block(&self, b: &mut [u8; 16]) {
        let mut blk = Block::from(*b);
        with!(self, c => c.decrypt_block(&mut blk));
        *b = blk.0;
    }

    pub(crate) fn encrypt_blocks(&self, blocks: &mut [Block]) {
        with!(self, c => c.encrypt_blocks(blocks));
    }

    pub(crate) fn decrypt_blocks(&self, blocks: &mut [Block]) {
        with!(self, c => c.decrypt_blocks(blocks));
    }

    /// ECB encryption in place.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] unless the length is a multiple of 16.
    pub fn ecb_encrypt(&self, data: &mut [u8]) -> Result<(), CipherError> {
        let blocks = blocks_of("ECB", data)?;
        match &self.ni {
            Some(ni) => ni.ecb(Block::slice_as_flattened_mut(blocks), true),
            None => self.encrypt_blocks(blocks),
        }
        Ok(())
    }

    /// ECB decryption in place.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] unless the length is a multiple of 16.
    pub fn ecb_decrypt(&self, data: &mut [u8]) -> Result<(), CipherError> {
        let blocks = blocks_of("ECB", data)?;
        match &self.ni {
            Some(ni) => ni.ecb(Block::slice_as_flattened_mut(blocks), false),
            None => self.decrypt_blocks(blocks),
        }
        Ok(())
    }

    /// CBC encryption in place (no padding).
    ///
    /// # Errors
    /// [`CipherError::BadLength`] unless the length is a multiple of 16.
    pub fn cbc_encrypt(&self, iv: &[u8; 16], data: &mut [u8]) -> Result<(), CipherError> {
        let mut prev = *iv;
        for b in blocks_of("CBC", data)? {
            xor_into(b, &prev);
            with!(self, c => c.encrypt_block(b));
            prev = b.0;
        }
        Ok(())
    }

    /// CBC decryption in place (no padding); blocks are decrypted in parallel
    /// batches.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] unless the length is a multiple of 16.
    pub fn cbc_decrypt(&self, iv: &[u8; 16], data: &mut [u8]) -> Result<(), CipherError> {
        let mut prev = *iv;
        let mut saved = [[0u8; 16]; BATCH];
        for chunk in blocks_of("CBC", data)?.chunks_mut(BATCH) {
            for (s, b) in saved.iter_mut().zip(chunk.iter()) {
                *s = b.0;
            }
            self.decrypt_blocks(chunk);
            for (i, b) in chunk.iter_mut().enumerate() {
                xor_into(b, if i == 0 { &prev } else { &saved[i - 1] });
            }
            prev = saved[chunk.len() - 1];
        }
        Ok(())
    }

    /// CTR mode (SP 800-38A): XORs the keystream of successive counter blocks,
    /// the whole 128-bit block incremented big-endian, into `data` of any length.
    pub fn ctr_apply(&self, counter: &[u8; 16], data: &mut [u8]) {
        self.ctr(counter, data, true);
    }

    /// Writes the CTR keystream from `counter` over `out` (the keystream
    /// alone, as a CTR_DRBG's generate step needs it).
    pub fn ctr_keystream(&self, counter: &[u8; 16], out: &mut [u8]) {
        self.ctr(counter, out, false);
    }

    fn ctr(&self, counter: &[u8; 16], data: &mut [u8], xor: bool) {
        if let Some(ni) = &self.ni {
            ni.ctr(u128::from_be_bytes(*counter), data, xor);
            return;
        }
        let mut ctr = u128::from_be_bytes(*counter);
        let mut ks = [Block::default(); BATCH];
        for chunk in data.chunks_mut(BATCH * 16) {
            let n = chunk.len().div_ceil(16);
            for k in &mut ks[..n] {
                k.0 = ctr.to_be_bytes();
                ctr = ctr.wrapping_add(1);
            }
            self.encrypt_blocks(&mut ks[..n]);
            for (d, k) in chunk.iter_mut().zip(ks.iter().flat_map(|b| b.0.iter())) {
                *d = if xor { *d ^ k } else { *k };
            }
        }
        for k in &mut ks {
            k.0 = [0; 16];
        }
    }
}

fn bad_key(key: &[u8]) -> CipherError {
    CipherError::BadKeyLength {
        algorithm: "AES",
        got: key.len(),
        expected: "16 (AES-128) or 32 (AES-256) bytes",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused AES-NI ECB/CTR kernels and the portable path agree on every
    /// length, including partial final blocks and counter wrap-around.
    #[test]
    fn kernels_and_portable_path_agree() {
        for klen in [16usize, 32] {
            let key: Vec<u8> = (0..klen)
                .map(|i| u8::try_from(i * 7 % 256).unwrap_or(0))
                .collect();
            let fast = Aes::new(&key).expect("key");
            if fast.ni.is_none() {
                eprintln!("SKIP kernels_and_portable_path_agree: no AES-NI on this CPU");
                return;
            }
            let slow = Aes::new(&key).expect("key").without_kernels();
            for len in [0usize, 1, 15, 16, 17, 127, 128, 129, 1000, 4096] {
                let src: Vec<u8> = (0..len)
                    .map(|i| u8::try_from(i % 253).unwrap_or(0))
                    .collect();
                for ctr in [[0u8; 16], [0xff; 16], {
                    let mut c = [0u8; 16];
                    c[8..].copy_from_slice(&[0xff; 8]);
                    c
                }] {
                    let (mut a, mut b) = (src.clone(), src.clone());
                    fast.ctr_apply(&ctr, &mut a);
                    slow.ctr_apply(&ctr, &mut b);
                    assert_eq!(a, b, "ctr len {len}");
                    let (mut ka, mut kb) = (src.clone(), vec![0u8; len]);
                    fast.ctr_keystream(&ctr, &mut ka);
                    slow.ctr_apply(&ctr, &mut kb);
                    assert_eq!(ka, kb, "keystream len {len}");
                }
                if len % 16 == 0 {
                    let (mut a, mut b) = (src.clone(), src.clone());
                    fast.ecb_encrypt(&mut a).expect("ecb");
                    slow.ecb_encrypt(&mut b).expect("ecb");
                    assert_eq!(a, b, "ecb len {len}");
                    fast.ecb_decrypt(&mut a).expect("ecb");
                    assert_eq!(a, src);
                }
            }
        }
    }
}
