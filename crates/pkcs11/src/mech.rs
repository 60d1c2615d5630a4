//! Mechanisms as safe state: the parameters a caller gave (already copied
//! out of C memory by the entry points), and the multi-part logic —
//! buffering to whole blocks, CBC chaining, CTR counters, PKCS#7 padding,
//! GCM and CMAC over the whole message — on top of single vault requests.
//!
//! No key material is here: every block-cipher call is one request to the
//! vault through a [`Backend`]. What the module holds between parts is
//! data the caller passed in or got back (pending input, the last
//! ciphertext block as the next CBC IV, the CTR counter block).
#![forbid(unsafe_code)]

use cryptoki_sys::{
    CKR_DATA_LEN_RANGE, CKR_DEVICE_ERROR, CKR_DEVICE_MEMORY, CKR_ENCRYPTED_DATA_INVALID,
    CKR_ENCRYPTED_DATA_LEN_RANGE, CKR_KEY_FUNCTION_NOT_PERMITTED, CKR_KEY_HANDLE_INVALID,
    CKR_KEY_TYPE_INCONSISTENT, CKR_SIGNATURE_INVALID, CKR_SIGNATURE_LEN_RANGE, CK_RV,
};
use memveil_vault::proto::Mode;
use memveil_vault::ring::{status, Op};
use zeroize::Zeroizing;

/// A PKCS#11 return value.
pub type Rv = CK_RV;

/// One vault request.
#[derive(Debug, Clone, Copy)]
pub struct Req<'a> {
    /// Direction.
    pub op: Op,
    /// Vault mode.
    pub mode: Mode,
    /// Vault key id.
    pub key: u32,
    /// IV, counter block or nonce (GCM: first 12 bytes).
    pub iv: [u8; 16],
    /// GCM associated data.
    pub aad: &'a [u8],
    /// Tag to verify (GCM and CMAC decrypt).
    pub tag: [u8; 16],
}

/// Why a vault request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The vault's per-request status (`ring::status`).
    Status(u32),
    /// The vault could not be reached or the request could not be sent
    /// (already a PKCS#11 code).
    Rv(Rv),
}

/// What runs one request: `input` in, `out` (same length, or empty for
/// CMAC) filled, the tag returned.
pub trait Backend {
    /// Runs `req` over `input`.
    ///
    /// # Errors
    /// The vault's status or a connection failure.
    fn run(&self, req: &Req<'_>, input: &[u8], out: &mut [u8]) -> Result<[u8; 16], Failure>;
}

/// A mechanism's parameters.
#[derive(Clone, PartialEq, Eq)]
pub enum Params {
    /// `CKM_AES_ECB`.
    Ecb,
    /// `CKM_AES_CBC` with its IV.
    Cbc([u8; 16]),
    /// `CKM_AES_CBC_PAD` (PKCS#7) with its IV.
    CbcPad([u8; 16]),
    /// `CKM_AES_CTR`: the counter block and how many of its low bits count.
    Ctr {
        /// Counter block.
        cb: [u8; 16],
        /// Counter bits, 1 to 128.
        bits: u32,
    },
    /// `CKM_AES_GCM`: 96-bit nonce, AAD, tag length in bytes.
    Gcm {
        /// Nonce.
        nonce: [u8; 12],
        /// Associated data.
        aad: Vec<u8>,
        /// Tag bytes (12 to 16 on encrypt; 16 on decrypt).
        tag_len: usize,
    },
}

fn map(f: Failure, len_rv: Rv, auth_rv: Rv) -> Rv {
    match f {
        Failure::Rv(rv) => rv,
        Failure::Status(s) => match s {
            status::BAD_LENGTH | status::TOO_LONG => len_rv,
            status::AUTH_FAILED => auth_rv,
            status::NO_KEY => CKR_KEY_HANDLE_INVALID,
            status::DENIED => CKR_KEY_FUNCTION_NOT_PERMITTED,
            status::WRONG_MODE => CKR_KEY_TYPE_INCONSISTENT,
            status::NO_MEMORY => CKR_DEVICE_MEMORY,
            _ => CKR_DEVICE_ERROR,
        },
    }
}

/// Adds `n` blocks to the low `bits` bits of a big-endian counter block,
/// wrapping inside those bits (PKCS#11's `ulCounterBits`).
fn ctr_add(cb: &mut [u8; 16], bits: u32, n: u128) {
    let v = u128::from_be_bytes(*cb);
    let mask = if bits >= 128 {
        u128::MAX
    } else {
        (1u128 << bits) - 1
    };
    let low = (v & mask).wrapping_add(n) & mask;
    *cb = ((v & !mask) | low).to_be_bytes();
}

/// Blocks left before the counter's low `bits` wrap to zero.
fn ctr_room(cb: &[u8; 16], bits: u32) -> u128 {
    if bits >= 128 {
        return u128::MAX;
    }
    let mask = (1u128 << bits) - 1;
    (1u128 << bits) - (u128::from_be_bytes(*cb) & mask)
}

/// An encryption or decryption in progress.
#[derive(Clone)]
pub struct CryptOp {
    op: Op,
    key: u32,
    params: Params,
    /// Input not processed yet (a partial block; all of a GCM message;
    /// the last block of a CBC_PAD decryption).
    pending: Zeroizing<Vec<u8>>,
}

impl CryptOp {
    /// Starts an operation with vault key `key`.
    #[must_use]
    pub fn new(op: Op, key: u32, params: Params) -> Self {
        Self {
            op,
            key,
            params,
            pending: Zeroizing::new(Vec::new()),
        }
    }

    fn len_rv(&self) -> Rv {
        match self.op {
            Op::Encrypt => CKR_DATA_LEN_RANGE,
            Op::Decrypt => CKR_ENCRYPTED_DATA_LEN_RANGE,
        }
    }

    /// An upper bound of the output of `C_Encrypt`/`C_Decrypt` over `n` bytes.
    #[must_use]
    pub fn single_bound(&self, n: usize) -> usize {
        let total = self.pending.len().saturating_add(n);
        match (&self.params, self.op) {
            (Params::CbcPad(_), Op::Encrypt) => (total / 16 + 1) * 16,
            (Params::Gcm { tag_len, .. }, Op::Encrypt) => total.saturating_add(*tag_len),
            (Params::Gcm { .. }, Op::Decrypt) => total.saturating_sub(16),
            _ => total,
        }
    }

    /// An upper bound of the output of an update over `n` more bytes.
    #[must_use]
    pub fn update_bound(&self, n: usize) -> usize {
        match self.params {
            Params::Gcm { .. } => 0,
            _ => self.pending.len().saturating_add(n) / 16 * 16,
        }
    }

    /// An upper bound of the output of the final part.
    #[must_use]
    pub fn final_bound(&self) -> usize {
        self.single_bound(0)
    }

    fn run(&self, be: &dyn Backend, mode: Mode, iv: [u8; 16], input: &[u8]) -> Result<Vec<u8>, Rv> {
        let mut out = vec![0u8; input.len()];
        let req = Req {
            op: self.op,
            mode,
            key: self.key,
            iv,
            aad: &[],
            tag: [0; 16],
        };
        be.run(&req, input, &mut out)
            .map_err(|f| map(f, self.len_rv(), CKR_ENCRYPTED_DATA_INVALID))?;
        Ok(out)
    }

    /// Whole blocks through the mode, updating the chaining state.
    fn blocks(&mut self, be: &dyn Backend, input: &[u8]) -> Result<Vec<u8>, Rv> {
        if input.is_empty() {
            return Ok(Vec::new());
        }
        match &mut self.params {
            Params::Ecb => self.run(be, Mode::Ecb, [0; 16], input),
            Params::Cbc(iv) | Params::CbcPad(iv) => {
                let start = *iv;
                let out = self.run(be, Mode::Cbc, start, input)?;
                let last = match self.op {
                    Op::Encrypt => &out[out.len() - 16..],
                    Op::Decrypt => &input[input.len() - 16..],
                };
                let mut next = [0u8; 16];
                next.copy_from_slice(last);
                if let Params::Cbc(iv) | Params::CbcPad(iv) = &mut self.params {
                    *iv = next;
                }
                Ok(out)
            }
            Params::Ctr { cb, bits } => {
                let (mut cb, bits) = (*cb, *bits);
                let mut out = Vec::with_capacity(input.len());
                let mut rest = input;
                while !rest.is_empty() {
                    // Split where the counter's low bits wrap: the vault
                    // counts over all 128 bits.
                    let room = ctr_room(&cb, bits);
                    let take = usize::try_from(room.saturating_mul(16))
                        .unwrap_or(usize::MAX)
                        .min(rest.len());
                    let (now, later) = rest.split_at(take);
                    out.extend_from_slice(&self.run(be, Mode::Ctr, cb, now)?);
                    ctr_add(&mut cb, bits, (take as u128).div_ceil(16));
                    rest = later;
                }
                if let Params::Ctr { cb: c, .. } = &mut self.params {
                    *c = cb;
                }
                Ok(out)
            }
            Params::Gcm { .. } => Err(CKR_DEVICE_ERROR),
        }
    }

    /// `C_EncryptUpdate`/`C_DecryptUpdate`: the output for `input`.
    ///
    /// # Errors
    /// A PKCS#11 code; the caller ends the operation.
    pub fn update(&mut self, be: &dyn Backend, input: &[u8]) -> Result<Vec<u8>, Rv> {
        if matches!(self.params, Params::Gcm { .. }) {
            // GCM is one vault request over the whole message at the end.
            self.pending.extend_from_slice(input);
            return Ok(Vec::new());
        }
        let total = self.pending.len() + input.len();
        let mut take = total / 16 * 16;
        if matches!(self.params, Params::CbcPad(_)) && self.op == Op::Decrypt && take == total {
            // Keep the last block back: it holds the padding.
            take = take.saturating_sub(16);
        }
        if take == 0 {
            self.pending.extend_from_slice(input);
            return Ok(Vec::new());
        }
        if self.pending.is_empty() {
            let out = self.blocks(be, &input[..take])?;
            self.pending.extend_from_slice(&input[take..]);
            return Ok(out);
        }
        let mut data = Zeroizing::new(Vec::with_capacity(total));
        data.extend_from_slice(&self.pending);
        data.extend_from_slice(input);
        let out = self.blocks(be, &data[..take])?;
        self.pending.clear();
        self.pending.extend_from_slice(&data[take..]);
        Ok(out)
    }

    /// `C_EncryptFinal`/`C_DecryptFinal`.
    ///
    /// # Errors
    /// A PKCS#11 code.
    pub fn finish(&mut self, be: &dyn Backend) -> Result<Vec<u8>, Rv> {
        let pending = std::mem::take(&mut *self.pending);
        let pending = Zeroizing::new(pending);
        self.last(be, &pending)
    }

    /// `C_Encrypt`/`C_Decrypt`: update and final in one (the whole message
    /// goes to the vault in as few requests as the mode allows).
    ///
    /// # Errors
    /// A PKCS#11 code.
    pub fn single(&mut self, be: &dyn Backend, input: &[u8]) -> Result<Vec<u8>, Rv> {
        if !self.pending.is_empty() {
            let mut out = self.update(be, input)?;
            out.extend_from_slice(&self.finish(be)?);
            return Ok(out);
        }
        match (&self.params, self.op) {
            (Params::Ecb | Params::Cbc(_), _) if !input.len().is_multiple_of(16) => {
                Err(self.len_rv())
            }
            (Params::Ecb | Params::Cbc(_) | Params::Ctr { .. } | Params::Gcm { .. }, _) => {
                self.last(be, input)
            }
            (Params::CbcPad(_), Op::Encrypt) => {
                let whole = input.len() / 16 * 16;
                let mut out = self.blocks(be, &input[..whole])?;
                out.extend_from_slice(&self.last(be, &input[whole..])?);
                Ok(out)
            }
            (Params::CbcPad(_), Op::Decrypt) => {
                if input.is_empty() || !input.len().is_multiple_of(16) {
                    return Err(self.len_rv());
                }
                let body = input.len() - 16;
                let mut out = self.blocks(be, &input[..body])?;
                out.extend_from_slice(&self.last(be, &input[body..])?);
                Ok(out)
            }
        }
    }

    /// The last part: `rest` is everything not yet processed.
    fn last(&mut self, be: &dyn Backend, rest: &[u8]) -> Result<Vec<u8>, Rv> {
        match (&self.params, self.op) {
            (Params::Ecb | Params::Cbc(_), _) => {
                if rest.len().is_multiple_of(16) {
                    self.blocks(be, rest)
                } else {
                    Err(self.len_rv())
                }
            }
            (Params::Ctr { .. }, _) => self.blocks(be, rest),
            (Params::CbcPad(_), Op::Encrypt) => {
                let n = 16 - rest.len() % 16;
                let mut block = Zeroizing::new(rest.to_vec());
                block.resize(rest.len() + n, u8::try_from(n).unwrap_or(16));
                self.blocks(be, &block)
            }
            (Params::CbcPad(_), Op::Decrypt) => {
                if rest.len() != 16 {
                    return Err(self.len_rv());
                }
                let mut out = Zeroizing::new(self.blocks(be, rest)?);
                let p = out[15];
                // Check every padding byte without an early exit.
                let mut bad = u8::from(p == 0 || p > 16);
                let n = usize::from(p).clamp(1, 16);
                for b in &out[16 - n..] {
                    bad |= u8::from(*b != p);
                }
                if bad != 0 {
                    return Err(CKR_ENCRYPTED_DATA_INVALID);
                }
                out.truncate(16 - n);
                Ok(std::mem::take(&mut *out))
            }
            (
                Params::Gcm {
                    nonce,
                    aad,
                    tag_len,
                },
                op,
            ) => {
                let mut iv = [0u8; 16];
                iv[..12].copy_from_slice(nonce);
                let mut req = Req {
                    op,
                    mode: Mode::Gcm,
                    key: self.key,
                    iv,
                    aad,
                    tag: [0; 16],
                };
                match op {
                    Op::Encrypt => {
                        let mut out = vec![0u8; rest.len() + tag_len];
                        let tag = be
                            .run(&req, rest, &mut out[..rest.len()])
                            .map_err(|f| map(f, CKR_DATA_LEN_RANGE, CKR_DEVICE_ERROR))?;
                        out[rest.len()..].copy_from_slice(&tag[..*tag_len]);
                        Ok(out)
                    }
                    Op::Decrypt => {
                        let Some(body) = rest.len().checked_sub(16) else {
                            return Err(CKR_ENCRYPTED_DATA_LEN_RANGE);
                        };
                        req.tag.copy_from_slice(&rest[body..]);
                        let mut out = vec![0u8; body];
                        be.run(&req, &rest[..body], &mut out).map_err(|f| {
                            map(f, CKR_ENCRYPTED_DATA_LEN_RANGE, CKR_ENCRYPTED_DATA_INVALID)
                        })?;
                        Ok(out)
                    }
                }
            }
        }
    }
}

/// A CMAC signature or verification in progress (`CKM_AES_CMAC`): the
/// message is kept until the final part, then MACed by one vault request.
#[derive(Clone)]
pub struct MacOp {
    key: u32,
    pending: Zeroizing<Vec<u8>>,
}

impl MacOp {
    /// Starts a MAC with vault key `key`.
    #[must_use]
    pub fn new(key: u32) -> Self {
        Self {
            key,
            pending: Zeroizing::new(Vec::new()),
        }
    }

    /// Adds a part.
    pub fn update(&mut self, part: &[u8]) {
        self.pending.extend_from_slice(part);
    }

    /// One request over the parts so far followed by `last`.
    fn run(&self, be: &dyn Backend, r: &Req<'_>, last: &[u8]) -> Result<[u8; 16], Failure> {
        if self.pending.is_empty() {
            return be.run(r, last, &mut []);
        }
        let mut all = Zeroizing::new(self.pending.to_vec());
        all.extend_from_slice(last);
        be.run(r, &all, &mut [])
    }

    fn req(&self, op: Op, tag: [u8; 16]) -> Req<'static> {
        Req {
            op,
            mode: Mode::Cmac,
            key: self.key,
            iv: [0; 16],
            aad: &[],
            tag,
        }
    }

    /// The 16-byte CMAC of the parts so far followed by `last`.
    ///
    /// # Errors
    /// A PKCS#11 code.
    pub fn sign(&self, be: &dyn Backend, last: &[u8]) -> Result<[u8; 16], Rv> {
        self.run(be, &self.req(Op::Encrypt, [0; 16]), last)
            .map_err(|f| map(f, CKR_DATA_LEN_RANGE, CKR_DEVICE_ERROR))
    }

    /// Verifies `sig` over the parts so far followed by `last`.
    ///
    /// # Errors
    /// `CKR_SIGNATURE_LEN_RANGE`, `CKR_SIGNATURE_INVALID` or another code.
    pub fn verify(&self, be: &dyn Backend, last: &[u8], sig: &[u8]) -> Result<(), Rv> {
        let tag: [u8; 16] = sig.try_into().map_err(|_| CKR_SIGNATURE_LEN_RANGE)?;
        self.run(be, &self.req(Op::Decrypt, tag), last)
            .map(|_| ())
            .map_err(|f| map(f, CKR_DATA_LEN_RANGE, CKR_SIGNATURE_INVALID))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctr_counter_wraps_inside_its_bits() {
        let mut cb = [0u8; 16];
        cb[14] = 0xff;
        cb[15] = 0xfe;
        cb[13] = 0x07;
        assert_eq!(ctr_room(&cb, 16), 2);
        ctr_add(&mut cb, 16, 3);
        assert_eq!(&cb[13..], &[0x07, 0x00, 0x01], "bit 16 must not carry out");
        let mut full = [0xffu8; 16];
        assert_eq!(ctr_room(&full, 128), u128::MAX);
        ctr_add(&mut full, 128, 1);
        assert_eq!(full, [0u8; 16]);
    }
}
