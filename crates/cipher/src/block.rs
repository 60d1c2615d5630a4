//! AES as a block cipher: single blocks, ECB, CBC, CTR.

use aes::cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};

use crate::kernel::Schedule;
use crate::path::{path, Path};
use crate::CipherError;

/// Blocks processed per batch: enough for the backend's 8-way pipelining and
/// small enough to stay on the stack.
pub(crate) const BATCH: usize = 64;

pub(crate) type Block = Array<u8, aes::cipher::consts::U16>;

enum Inner {
    A128(aes::Aes128),
    A256(aes::Aes256),
}

/// The implementation behind a key: memveil's kernels (AES-NI or VAES), or
/// RustCrypto's block API (the portable path).
enum Imp {
    Kernel(Schedule),
    Soft(Inner),
}

/// An AES-128 or AES-256 key schedule. Wiped on drop; never printed or cloned.
/// Plain inline data, so it can live in secret memory.
pub struct Aes {
    imp: Imp,
}

/// The portable path's RustCrypto cipher, or what the caller does on the
/// kernel path.
macro_rules! soft {
    ($self:expr, $c:ident => $e:expr, $k:ident => $kernel:expr) => {
        match &$self.imp {
            Imp::Soft(Inner::A128($c)) => $e,
            Imp::Soft(Inner::A256($c)) => $e,
            Imp::Kernel($k) => $kernel,
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
    /// Expands a 16-byte (AES-128) or 32-byte (AES-256) key for this
    /// process's path ([`crate::path`]).
    ///
    /// # Errors
    /// [`CipherError::BadKeyLength`] for any other length.
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        Self::build(key, path())
    }

    /// Expands `key` for the path named (for tests and benchmarks that run
    /// every path in turn).
    ///
    /// # Errors
    /// As [`Aes::new`]; [`CipherError::PathUnavailable`] when this CPU
    /// cannot run `p`.
    pub fn with_path(key: &[u8], p: Path) -> Result<Self, CipherError> {
        Self::build(key, p.require()?)
    }

    fn build(key: &[u8], p: Path) -> Result<Self, CipherError> {
        if !(key.len() == 16 || key.len() == 32) {
            return Err(bad_key(key));
        }
        if let Some(s) = Schedule::new(key, p) {
            return Ok(Self {
                imp: Imp::Kernel(s),
            });
        }
        let inner = match key.len() {
            16 => Inner::A128(aes::Aes128::new_from_slice(key).map_err(|_| bad_key(key))?),
            _ => Inner::A256(aes::Aes256::new_from_slice(key).map_err(|_| bad_key(key))?),
        };
        Ok(Self {
            imp: Imp::Soft(inner),
        })
    }

    /// The path this key runs on.
    #[must_use]
    pub fn path(&self) -> Path {
        match &self.imp {
            Imp::Kernel(s) => s.path(),
            Imp::Soft(_) => Path::Portable,
        }
    }

    /// 128 or 256.
    #[must_use]
    pub fn key_bits(&self) -> usize {
        match &self.imp {
            Imp::Kernel(s) => s.key_bits(),
            Imp::Soft(Inner::A128(_)) => 128,
            Imp::Soft(Inner::A256(_)) => 256,
        }
    }

    /// Encrypts one block in place.
    pub fn encrypt_block(&self, b: &mut [u8; 16]) {
        self.block(b, true);
        self.after();
    }

    /// Decrypts one block in place.
    pub fn decrypt_block(&self, b: &mut [u8; 16]) {
        self.block(b, false);
        self.after();
    }

    /// One block, without [`Aes::after`] (for callers that scrub once at
    /// the end of a larger operation).
    pub(crate) fn block(&self, b: &mut [u8; 16], enc: bool) {
        soft!(self, c => {
            let mut blk = Block::from(*b);
            if enc {
                c.encrypt_block(&mut blk);
            } else {
                c.decrypt_block(&mut blk);
            }
            *b = blk.0;
            zeroize::Zeroize::zeroize(&mut blk.0);
        }, k => k.block(b, enc));
    }

    /// Ends a public operation: on the portable path, scrubs the stack that
    /// RustCrypto's backends ran on ([`crate::scrub_stack`]).
    pub(crate) fn after(&self) {
        if matches!(self.imp, Imp::Soft(_)) {
            crate::scrub_stack();
        }
    }

    /// The kernels' schedule, when this key runs on them.
    pub(crate) fn kernel(&self) -> Option<&Schedule> {
        match &self.imp {
            Imp::Kernel(s) => Some(s),
            Imp::Soft(_) => None,
        }
    }

    /// Portable path only (the kernel path never calls it): RustCrypto's
    /// batched encryption.
    pub(crate) fn encrypt_blocks(&self, blocks: &mut [Block]) {
        soft!(self, c => c.encrypt_blocks(blocks), k => k.ecb(Block::slice_as_flattened_mut(blocks), true));
    }

    /// Portable path only: RustCrypto's batched decryption.
    pub(crate) fn decrypt_blocks(&self, blocks: &mut [Block]) {
        soft!(self, c => c.decrypt_blocks(blocks), k => k.ecb(Block::slice_as_flattened_mut(blocks), false));
    }

    /// ECB encryption in place.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] unless the length is a multiple of 16.
    pub fn ecb_encrypt(&self, data: &mut [u8]) -> Result<(), CipherError> {
        self.encrypt_blocks(blocks_of("ECB", data)?);
        self.after();
        Ok(())
    }

    /// ECB decryption in place.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] unless the length is a multiple of 16.
    pub fn ecb_decrypt(&self, data: &mut [u8]) -> Result<(), CipherError> {
        self.decrypt_blocks(blocks_of("ECB", data)?);
        self.after();
        Ok(())
    }

    /// CBC encryption in place (no padding).
    ///
    /// # Errors
    /// [`CipherError::BadLength`] unless the length is a multiple of 16.
    pub fn cbc_encrypt(&self, iv: &[u8; 16], data: &mut [u8]) -> Result<(), CipherError> {
        let blocks = blocks_of("CBC", data)?;
        if let Some(k) = self.kernel() {
            k.cbc_encrypt(iv, Block::slice_as_flattened_mut(blocks));
            return Ok(());
        }
        let mut prev = *iv;
        for b in blocks {
            xor_into(b, &prev);
            self.encrypt_blocks(std::slice::from_mut(b));
            prev = b.0;
        }
        self.after();
        Ok(())
    }

    /// CBC decryption in place (no padding); blocks are decrypted in parallel
    /// batches.
    ///
    /// # Errors
    /// [`CipherError::BadLength`] unless the length is a multiple of 16.
    pub fn cbc_decrypt(&self, iv: &[u8; 16], data: &mut [u8]) -> Result<(), CipherError> {
        let blocks = blocks_of("CBC", data)?;
        if let Some(k) = self.kernel() {
            k.cbc_decrypt(iv, Block::slice_as_flattened_mut(blocks));
            return Ok(());
        }
        let mut prev = *iv;
        let mut saved = [[0u8; 16]; BATCH];
        for chunk in blocks.chunks_mut(BATCH) {
            for (s, b) in saved.iter_mut().zip(chunk.iter()) {
                *s = b.0;
            }
            self.decrypt_blocks(chunk);
            for (i, b) in chunk.iter_mut().enumerate() {
                xor_into(b, if i == 0 { &prev } else { &saved[i - 1] });
            }
            prev = saved[chunk.len() - 1];
        }
        self.after();
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
        if let Some(k) = self.kernel() {
            k.ctr(u128::from_be_bytes(*counter), data, xor);
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
            zeroize::Zeroize::zeroize(&mut k.0);
        }
        self.after();
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

    /// Every path this CPU runs agrees with the portable one on ECB, CBC and
    /// CTR, at every length around the kernels' group sizes (8 and 16
    /// blocks), and at counter wrap-around.
    #[test]
    fn every_path_agrees_with_portable() {
        let lens = [
            0usize, 1, 15, 16, 17, 127, 128, 129, 255, 256, 257, 271, 383, 512, 1000, 4096, 4111,
        ];
        let counters = [[0u8; 16], [0xff; 16], {
            let mut c = [0u8; 16];
            c[8..].copy_from_slice(&[0xff; 8]);
            c[15] = 0xf3;
            c
        }];
        for p in crate::path::runnable() {
            for klen in [16usize, 32] {
                let key: Vec<u8> = (0..klen)
                    .map(|i| u8::try_from(i * 7 % 256).unwrap_or(0))
                    .collect();
                let fast = Aes::with_path(&key, p).expect("key");
                assert_eq!(fast.path(), p);
                let slow = Aes::with_path(&key, Path::Portable).expect("key");
                for len in lens {
                    let src: Vec<u8> = (0..len)
                        .map(|i| u8::try_from(i % 253).unwrap_or(0))
                        .collect();
                    for ctr in &counters {
                        let (mut a, mut b) = (src.clone(), src.clone());
                        fast.ctr_apply(ctr, &mut a);
                        slow.ctr_apply(ctr, &mut b);
                        assert_eq!(a, b, "{p} ctr len {len}");
                        let (mut ka, mut kb) = (src.clone(), vec![0u8; len]);
                        fast.ctr_keystream(ctr, &mut ka);
                        slow.ctr_apply(ctr, &mut kb);
                        assert_eq!(ka, kb, "{p} keystream len {len}");
                    }
                    if len % 16 == 0 {
                        let (mut a, mut b) = (src.clone(), src.clone());
                        fast.ecb_encrypt(&mut a).expect("ecb");
                        slow.ecb_encrypt(&mut b).expect("ecb");
                        assert_eq!(a, b, "{p} ecb len {len}");
                        fast.ecb_decrypt(&mut a).expect("ecb");
                        assert_eq!(a, src);
                        let iv = [0x3c; 16];
                        b.clone_from(&src);
                        fast.cbc_encrypt(&iv, &mut a).expect("cbc");
                        slow.cbc_encrypt(&iv, &mut b).expect("cbc");
                        assert_eq!(a, b, "{p} cbc len {len}");
                        fast.cbc_decrypt(&iv, &mut a).expect("cbc");
                        assert_eq!(a, src, "{p} cbc decrypt len {len}");
                    }
                }
                let mut x = [0x42u8; 16];
                let mut y = x;
                fast.encrypt_block(&mut x);
                slow.encrypt_block(&mut y);
                assert_eq!(x, y);
                fast.decrypt_block(&mut x);
                assert_eq!(x, [0x42; 16]);
            }
        }
    }
}
