//! SP 800-90A Rev. 1 CTR_DRBG with AES-256 (§10.2.1), one instance per
//! consumer.
//!
//! Choice: **with derivation function** (`Block_Cipher_df`, §10.3.2) for every
//! instance memveil serves. The df lets the DRBG take conditioned entropy of
//! any length (the 512:1 seeds come 128 bits at a time), takes a nonce and a
//! personalization string of any length, and makes additional input safe to
//! pass as is. The no-df variant ([`DfMode::NoDf`]) is implemented too, only
//! so both halves of the NIST CAVP vectors can be checked.
//!
//! Limits enforced (Table 3 for AES-256): at most [`MAX_REQUEST_BYTES`]
//! (2^19 bits) per request; at most [`MAX_RESEED_INTERVAL`] (2^48) requests
//! between reseeds, memveil's default being [`DEFAULT_RESEED_INTERVAL`];
//! entropy input of at least 256 bits (the security strength). [`Drbg`] keeps
//! requests within these limits by splitting large reads and reseeding on
//! schedule, and on every request when prediction resistance is on.
//!
//! Speed: output blocks E(V+1), E(V+2), ... are the CTR keystream from V+1,
//! which memveil-cipher writes straight into the caller's buffer with its
//! counter-mode kernel (on the VAES path sixteen blocks in flight, counters
//! built in registers), not block by block.

use memveil_cipher::Aes;
use zeroize::{Zeroize, Zeroizing};

use crate::condition::Conditioner;
use crate::source::RawSource;
use crate::DrngError;

/// AES-256 key length.
pub const KEY_BYTES: usize = 32;
/// Block length.
pub const BLOCK_BYTES: usize = 16;
/// seedlen = keylen + blocklen.
pub const SEED_BYTES: usize = KEY_BYTES + BLOCK_BYTES;
/// Security strength in bytes (AES-256: 256 bits).
pub const STRENGTH_BYTES: usize = 32;
/// max_number_of_bits_per_request = 2^19 bits.
pub const MAX_REQUEST_BYTES: usize = 1 << 16;
/// reseed_interval upper bound for CTR_DRBG: 2^48 requests.
pub const MAX_RESEED_INTERVAL: u64 = 1 << 48;
/// memveil's reseed interval: every 1024 requests (at most 64 MiB of output
/// per seed), far inside the standard's 2^48.
pub const DEFAULT_RESEED_INTERVAL: u64 = 1 << 10;
/// Longest entropy input, personalization string or additional input taken
/// (the standard allows 2^35 bits; memveil takes 64 KiB).
pub const MAX_INPUT_BYTES: usize = 1 << 16;

/// With or without the derivation function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DfMode {
    /// `Block_Cipher_df` on all inputs (what memveil serves).
    UseDf,
    /// Inputs used directly: entropy exactly 48 bytes, personalization and
    /// additional input at most 48 bytes, nonce ignored. For CAVP tests.
    NoDf,
}

/// The CTR_DRBG state: key schedule, V, reseed counter.
pub struct CtrDrbg {
    mode: DfMode,
    aes: Aes,
    v: u128,
    reseed_counter: u64,
    reseed_interval: u64,
}

fn check_len(
    what: &'static str,
    got: usize,
    max: usize,
    expected: &'static str,
) -> Result<(), DrngError> {
    if got > max {
        return Err(DrngError::BadInput {
            what,
            got,
            expected,
        });
    }
    Ok(())
}

/// `Block_Cipher_df(input, 384)` (SP 800-90A §10.3.2) over the concatenation
/// of `parts`.
#[must_use]
pub fn block_cipher_df(parts: &[&[u8]]) -> Zeroizing<[u8; SEED_BYTES]> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    // S = L || N || input || 0x80, zero-padded to whole blocks, behind a
    // 16-byte IV slot that BCC chains from.
    let s_len = (8 + len + 1).div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
    let mut buf = Zeroizing::new(vec![0u8; BLOCK_BYTES + s_len]);
    let l = u32::try_from(len).unwrap_or(u32::MAX);
    buf[16..20].copy_from_slice(&l.to_be_bytes());
    #[allow(clippy::cast_possible_truncation)]
    buf[20..24].copy_from_slice(&(SEED_BYTES as u32).to_be_bytes());
    let mut off = 24;
    for p in parts {
        buf[off..off + p.len()].copy_from_slice(p);
        off += p.len();
    }
    buf[off] = 0x80;
    let mut k0 = [0u8; KEY_BYTES];
    for (i, b) in k0.iter_mut().enumerate() {
        #[allow(clippy::cast_possible_truncation)]
        {
            *b = i as u8;
        }
    }
    let mut temp = Zeroizing::new([0u8; SEED_BYTES]);
    let mut work = Zeroizing::new(vec![0u8; buf.len()]);
    if let Ok(bcc) = Aes::new(&k0) {
        for i in 0..3u32 {
            work.copy_from_slice(&buf);
            work[..4].copy_from_slice(&i.to_be_bytes());
            // BCC = CBC-MAC with zero IV over IV_i || S.
            if bcc.cbc_encrypt(&[0u8; 16], &mut work[..]).is_ok() {
                let last = work.len() - BLOCK_BYTES;
                let i = i as usize;
                temp[i * 16..i * 16 + 16].copy_from_slice(&work[last..]);
            }
        }
    }
    let mut out = Zeroizing::new([0u8; SEED_BYTES]);
    if let Ok(k) = Aes::new(&temp[..KEY_BYTES]) {
        let mut x = [0u8; 16];
        x.copy_from_slice(&temp[KEY_BYTES..]);
        for i in 0..3 {
            k.encrypt_block(&mut x);
            out[i * 16..i * 16 + 16].copy_from_slice(&x);
        }
        x.zeroize();
    }
    out
}

impl CtrDrbg {
    /// `CTR_DRBG_Instantiate_algorithm` (§10.2.1.3).
    ///
    /// # Errors
    /// [`DrngError::BadInput`] for entropy shorter than 256 bits (or not 384
    /// bits without df), or inputs longer than the mode takes.
    pub fn instantiate(
        mode: DfMode,
        entropy: &[u8],
        nonce: &[u8],
        personalization: &[u8],
    ) -> Result<Self, DrngError> {
        let seed = Self::seed_material(
            mode,
            entropy,
            nonce,
            personalization,
            "personalization string",
        )?;
        let aes = Aes::new(&[0u8; KEY_BYTES])?;
        let mut d = Self {
            mode,
            aes,
            v: 0,
            reseed_counter: 1,
            reseed_interval: DEFAULT_RESEED_INTERVAL,
        };
        d.update(&seed)?;
        Ok(d)
    }

    fn seed_material(
        mode: DfMode,
        entropy: &[u8],
        nonce: &[u8],
        extra: &[u8],
        extra_name: &'static str,
    ) -> Result<Zeroizing<[u8; SEED_BYTES]>, DrngError> {
        match mode {
            DfMode::UseDf => {
                if entropy.len() < STRENGTH_BYTES {
                    return Err(DrngError::BadInput {
                        what: "entropy input",
                        got: entropy.len(),
                        expected: "at least 32 bytes (256-bit security strength)",
                    });
                }
                check_len(
                    "entropy input",
                    entropy.len(),
                    MAX_INPUT_BYTES,
                    "at most 64 KiB",
                )?;
                check_len("nonce", nonce.len(), MAX_INPUT_BYTES, "at most 64 KiB")?;
                check_len(extra_name, extra.len(), MAX_INPUT_BYTES, "at most 64 KiB")?;
                Ok(block_cipher_df(&[entropy, nonce, extra]))
            }
            DfMode::NoDf => {
                if entropy.len() != SEED_BYTES {
                    return Err(DrngError::BadInput {
                        what: "entropy input",
                        got: entropy.len(),
                        expected: "exactly 48 bytes without a derivation function",
                    });
                }
                check_len(
                    extra_name,
                    extra.len(),
                    SEED_BYTES,
                    "at most 48 bytes without a derivation function",
                )?;
                let mut s = Zeroizing::new([0u8; SEED_BYTES]);
                s.copy_from_slice(entropy);
                for (a, b) in s.iter_mut().zip(extra) {
                    *a ^= b;
                }
                Ok(s)
            }
        }
    }

    /// `CTR_DRBG_Update` (§10.2.1.2).
    fn update(&mut self, provided: &[u8; SEED_BYTES]) -> Result<(), DrngError> {
        let mut temp = Zeroizing::new([0u8; SEED_BYTES]);
        for (i, blk) in temp.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            blk.copy_from_slice(&self.v.wrapping_add(i as u128 + 1).to_be_bytes());
        }
        self.aes.ecb_encrypt(&mut temp[..])?;
        for (a, b) in temp.iter_mut().zip(provided) {
            *a ^= b;
        }
        self.aes = Aes::new(&temp[..KEY_BYTES])?;
        let mut v = [0u8; 16];
        v.copy_from_slice(&temp[KEY_BYTES..]);
        self.v = u128::from_be_bytes(v);
        v.zeroize();
        Ok(())
    }

    /// `CTR_DRBG_Reseed_algorithm` (§10.2.1.4).
    ///
    /// # Errors
    /// As [`CtrDrbg::instantiate`].
    pub fn reseed(&mut self, entropy: &[u8], additional: &[u8]) -> Result<(), DrngError> {
        let seed = Self::seed_material(self.mode, entropy, &[], additional, "additional input")?;
        self.update(&seed)?;
        self.reseed_counter = 1;
        Ok(())
    }

    /// Whether the next generate would exceed the reseed interval.
    #[must_use]
    pub fn needs_reseed(&self) -> bool {
        self.reseed_counter > self.reseed_interval
    }

    /// Sets the reseed interval (clamped to 1..=2^48).
    pub fn set_reseed_interval(&mut self, requests: u64) {
        self.reseed_interval = requests.clamp(1, MAX_RESEED_INTERVAL);
    }

    /// The reseed interval.
    #[must_use]
    pub fn reseed_interval(&self) -> u64 {
        self.reseed_interval
    }

    /// `CTR_DRBG_Generate_algorithm` (§10.2.1.5.2): fills `out` (at most
    /// 2^19 bits).
    ///
    /// # Errors
    /// [`DrngError::RequestTooLarge`], [`DrngError::ReseedRequired`],
    /// [`DrngError::BadInput`] for additional input too long.
    pub fn generate(&mut self, out: &mut [u8], additional: &[u8]) -> Result<(), DrngError> {
        if out.len() > MAX_REQUEST_BYTES {
            return Err(DrngError::RequestTooLarge {
                requested: out.len(),
                max: MAX_REQUEST_BYTES,
            });
        }
        if self.needs_reseed() {
            return Err(DrngError::ReseedRequired {
                interval: self.reseed_interval,
            });
        }
        let addl = if additional.is_empty() {
            Zeroizing::new([0u8; SEED_BYTES])
        } else {
            let a = match self.mode {
                DfMode::UseDf => {
                    check_len(
                        "additional input",
                        additional.len(),
                        MAX_INPUT_BYTES,
                        "at most 64 KiB",
                    )?;
                    block_cipher_df(&[additional])
                }
                DfMode::NoDf => {
                    check_len(
                        "additional input",
                        additional.len(),
                        SEED_BYTES,
                        "at most 48 bytes without a derivation function",
                    )?;
                    let mut s = Zeroizing::new([0u8; SEED_BYTES]);
                    s[..additional.len()].copy_from_slice(additional);
                    s
                }
            };
            self.update(&a)?;
            a
        };
        let full = out.len() / BLOCK_BYTES;
        let (body, tail) = out.split_at_mut(full * BLOCK_BYTES);
        // The output blocks are E(V+1), E(V+2), ...: the CTR keystream from
        // V+1, which memveil-cipher generates with the counters in registers.
        self.aes
            .ctr_keystream(&self.v.wrapping_add(1).to_be_bytes(), body);
        self.v = self.v.wrapping_add(full as u128);
        if !tail.is_empty() {
            self.v = self.v.wrapping_add(1);
            let mut blk = self.v.to_be_bytes();
            self.aes.encrypt_block(&mut blk);
            tail.copy_from_slice(&blk[..tail.len()]);
            blk.zeroize();
        }
        self.update(&addl)?;
        self.reseed_counter += 1;
        Ok(())
    }
}

impl Drop for CtrDrbg {
    fn drop(&mut self) {
        // The key schedule wipes itself (memveil-cipher); V is wiped here.
        self.v.zeroize();
        self.reseed_counter = 0;
    }
}

/// Where a [`Drbg`] takes its entropy input.
pub trait EntropyInput: Send {
    /// Name for reports, e.g. `seed(rdrand 512:1 AES-CBC-MAC)`.
    fn name(&self) -> String;
    /// Fills `out` with full-entropy bytes.
    ///
    /// # Errors
    /// The source's failure.
    fn get(&mut self, out: &mut [u8]) -> Result<(), DrngError>;
}

impl<S: RawSource> EntropyInput for Conditioner<S> {
    fn name(&self) -> String {
        Conditioner::name(self)
    }
    fn get(&mut self, out: &mut [u8]) -> Result<(), DrngError> {
        self.fill(out)
    }
}

/// A seed-grade raw source used directly as entropy input (RDSEED, or
/// `getrandom(2)`, whose output the kernel already conditions).
pub struct DirectInput<S: RawSource>(pub S);

impl<S: RawSource> EntropyInput for DirectInput<S> {
    fn name(&self) -> String {
        self.0.name()
    }
    fn get(&mut self, out: &mut [u8]) -> Result<(), DrngError> {
        fill_bytes(&mut self.0, out)
    }
}

/// Fills bytes from a source of 64-bit samples (little-endian; the last
/// sample's unused bytes are dropped). `out` is wiped on error.
///
/// # Errors
/// The source's failure.
pub fn fill_bytes<S: RawSource + ?Sized>(src: &mut S, out: &mut [u8]) -> Result<(), DrngError> {
    let mut words = [0u64; 512];
    for chunk in out.chunks_mut(words.len() * 8) {
        let n = chunk.len().div_ceil(8);
        if let Err(e) = src.fill(&mut words[..n]) {
            out.zeroize();
            words.zeroize();
            return Err(e);
        }
        for (c, w) in chunk.chunks_mut(8).zip(words.iter()) {
            c.copy_from_slice(&w.to_le_bytes()[..c.len()]);
        }
    }
    words.zeroize();
    Ok(())
}

/// One consumer's DRBG: a [`CtrDrbg`] with df, its entropy input, and the
/// reseed policy (on schedule, or before every request with prediction
/// resistance).
pub struct Drbg {
    ctr: CtrDrbg,
    input: Box<dyn EntropyInput>,
    prediction_resistance: bool,
    reseeds: u64,
    bytes: u64,
}

impl Drbg {
    /// Instantiates from `input`: 256 bits of entropy input and a 128-bit
    /// nonce, both drawn from `input`, and `personalization` (e.g. a consumer
    /// id).
    ///
    /// # Errors
    /// The entropy input's failure.
    pub fn new(
        mut input: Box<dyn EntropyInput>,
        prediction_resistance: bool,
        personalization: &[u8],
    ) -> Result<Self, DrngError> {
        let mut seed = Zeroizing::new([0u8; STRENGTH_BYTES + BLOCK_BYTES]);
        input.get(&mut seed[..])?;
        let ctr = CtrDrbg::instantiate(
            DfMode::UseDf,
            &seed[..STRENGTH_BYTES],
            &seed[STRENGTH_BYTES..],
            personalization,
        )?;
        Ok(Self {
            ctr,
            input,
            prediction_resistance,
            reseeds: 0,
            bytes: 0,
        })
    }

    /// Name for reports.
    #[must_use]
    pub fn name(&self) -> String {
        format!(
            "drbg(CTR_DRBG AES-256 df{}, input {})",
            if self.prediction_resistance {
                ", prediction resistance"
            } else {
                ""
            },
            self.input.name()
        )
    }

    /// Sets the reseed interval in requests of up to 64 KiB.
    pub fn set_reseed_interval(&mut self, requests: u64) {
        self.ctr.set_reseed_interval(requests);
    }

    /// Reseeds now from the entropy input (256 bits).
    ///
    /// # Errors
    /// The entropy input's failure.
    pub fn reseed(&mut self, additional: &[u8]) -> Result<(), DrngError> {
        let mut e = Zeroizing::new([0u8; STRENGTH_BYTES]);
        self.input.get(&mut e[..])?;
        self.ctr.reseed(&e[..], additional)?;
        self.reseeds += 1;
        Ok(())
    }

    /// Fills `out`, in requests of at most 64 KiB, reseeding when due (and
    /// before every request with prediction resistance). On error `out` is
    /// wiped.
    ///
    /// # Errors
    /// The entropy input's failure at a reseed.
    pub fn fill(&mut self, out: &mut [u8]) -> Result<(), DrngError> {
        for i in (0..out.len()).step_by(MAX_REQUEST_BYTES) {
            let end = (i + MAX_REQUEST_BYTES).min(out.len());
            let r = if self.prediction_resistance || self.ctr.needs_reseed() {
                self.reseed(&[])
            } else {
                Ok(())
            }
            .and_then(|()| self.ctr.generate(&mut out[i..end], &[]));
            if let Err(e) = r {
                out.zeroize();
                return Err(e);
            }
            self.bytes += (end - i) as u64;
        }
        Ok(())
    }

    /// Reseeds done since instantiation.
    #[must_use]
    pub fn reseeds(&self) -> u64 {
        self.reseeds
    }

    /// Bytes generated.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{Fault, FaultControl, FaultySource, TestPattern};
    use crate::{HealthChecked, HealthConfig};

    #[test]
    fn request_limit_and_reseed_interval_are_enforced() {
        let mut d = CtrDrbg::instantiate(DfMode::UseDf, &[1; 32], &[2; 16], &[]).expect("inst");
        let mut big = vec![0u8; MAX_REQUEST_BYTES + 1];
        assert!(matches!(
            d.generate(&mut big, &[]),
            Err(DrngError::RequestTooLarge { .. })
        ));
        d.set_reseed_interval(2);
        let mut b = [0u8; 32];
        d.generate(&mut b, &[]).expect("1");
        d.generate(&mut b, &[]).expect("2");
        assert!(matches!(
            d.generate(&mut b, &[]),
            Err(DrngError::ReseedRequired { interval: 2 })
        ));
        d.reseed(&[3; 32], &[]).expect("reseed");
        d.generate(&mut b, &[]).expect("after reseed");
    }

    #[test]
    fn large_requests_match_block_by_block_ctr() {
        // The chunked generate equals AES-256 of successive counters.
        let mut a = CtrDrbg::instantiate(DfMode::UseDf, &[5; 32], &[6; 16], &[]).expect("a");
        let v0 = a.v;
        let mut out = vec![0u8; MAX_REQUEST_BYTES];
        // Reference: single blocks through the same key schedule.
        let mut reference = vec![0u8; MAX_REQUEST_BYTES];
        for (i, blk) in reference.chunks_exact_mut(16).enumerate() {
            let mut b = v0.wrapping_add(i as u128 + 1).to_be_bytes();
            a.aes.encrypt_block(&mut b);
            blk.copy_from_slice(&b);
        }
        a.generate(&mut out, &[]).expect("gen");
        assert!(out == reference);
    }

    #[test]
    fn short_entropy_is_refused() {
        assert!(CtrDrbg::instantiate(DfMode::UseDf, &[1; 31], &[], &[]).is_err());
        assert!(CtrDrbg::instantiate(DfMode::NoDf, &[1; 32], &[], &[]).is_err());
    }

    #[test]
    fn split_requests_equal_one_stream_of_blocks() {
        // Output of one 64-byte request equals E(K, V+1..V+4): check that the
        // tail path and the batched path agree on the counter sequence.
        let mut a = CtrDrbg::instantiate(DfMode::UseDf, &[9; 32], &[8; 16], &[]).expect("a");
        let mut b = CtrDrbg::instantiate(DfMode::UseDf, &[9; 32], &[8; 16], &[]).expect("b");
        let mut x = [0u8; 61];
        let mut y = [0u8; 64];
        a.generate(&mut x, &[]).expect("x");
        b.generate(&mut y, &[]).expect("y");
        assert_eq!(&x[..], &y[..61]);
    }

    #[test]
    fn prediction_resistance_reseeds_every_request() {
        let src = HealthChecked::new(TestPattern::new(4), HealthConfig::default());
        let mut d = Drbg::new(Box::new(Conditioner::new(src)), true, b"consumer-1").expect("drbg");
        let mut out = vec![0u8; 3 * MAX_REQUEST_BYTES + 5];
        d.fill(&mut out).expect("fill");
        assert_eq!(d.reseeds(), 4);
        assert!(d.name().contains("prediction resistance"));
    }

    #[test]
    fn quarantined_input_stops_output() {
        let ctl = FaultControl::new();
        let src = HealthChecked::new(
            FaultySource::new(TestPattern::new(6), ctl.clone()),
            HealthConfig::default(),
        );
        let mut d = Drbg::new(Box::new(DirectInput(src)), true, b"").expect("drbg");
        let mut out = [0x55u8; 100];
        d.fill(&mut out).expect("healthy");
        ctl.set(Fault::Stuck(0));
        let mut out = [0x55u8; 100];
        let e = d.fill(&mut out).expect_err("must stop");
        assert!(matches!(e, DrngError::Quarantined { .. }), "{e}");
        assert_eq!(out, [0u8; 100]);
    }
}
