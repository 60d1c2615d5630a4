//! Layout of a lane (one request ring in client-shared memory) and the
//! parsing and bounds-checking of its descriptors.
//!
//! A lane is one page at a page-aligned offset of a shared area:
//!
//! | offset | written by | field |
//! |---|---|---|
//! | 0   | client | `submit`: sequence number of the latest batch (u32, futex word) |
//! | 4   | client | `count`: entries in that batch (1..=[`MAX_BATCH`]) |
//! | 8   | client | `client_waiting`: 1 while the client sleeps on `complete` |
//! | 64  | vault  | `complete`: sequence number of the latest finished batch (futex word) |
//! | 68  | vault  | `vault_sleeping`: 1 while the worker sleeps on `submit` |
//! | 128 + 128·i | both | entry `i` |
//!
//! An entry (128 bytes): `op` u8 at 0 (1 encrypt, 2 decrypt), `mode` u8 at 1,
//! `key` u32 at 4, `buffer` u32 at 8, `version` u32 at 12 (0 = newest),
//! `offset` u64 at 16, `len` u64 at 24, IV / counter / tweak / nonce at 32
//! (16 bytes), GCM or CMAC tag at 48 (16 bytes; written by the vault on encrypt,
//! read on decrypt), `aad_offset` u64 at 64, `aad_len` u64 at 72 (same
//! buffer), `status` u32 at 80 (written by the vault; 0 = ok), and for XTS
//! `unit` u32 at 84 and `step` u32 at 88 (zero for every other mode; bytes
//! 92..128 are reserved and ignored, except below).
//!
//! The asymmetric modes (7 to 12: RSA PKCS#1 v1.5, PSS, raw, OAEP, ECDSA,
//! Ed25519) read `len` bytes at `offset` and write their result into a
//! second range of the same buffer, named by `aad_offset`/`aad_len` (the
//! output range, at least the result's length: a modulus' bytes for RSA,
//! `2·field` for ECDSA, 64 for Ed25519); the vault writes the result's
//! length as a u32 at 92 (`out_len`). Op 1 signs (needs the key's `e`
//! permission), op 2 decrypts (`d`). The IV field carries the parameters
//! ([`AsymParams`]). The input is copied out of shared memory once before
//! the key is used; the output range is claimed for the request alone.
//!
//! An XTS entry with `unit` 0 is one data unit whose tweak is the IV (what
//! every entry meant before the field existed, so a client that writes zeros
//! there is served as before). With `unit` = n > 0 the entry is `len / n`
//! data units of n bytes each: unit i is encrypted under the IEEE 1619 data
//! unit sequence number `iv + i·step` (the IV read as a 128-bit little-endian
//! integer, arithmetic modulo 2^128), which for dm-crypt's `plain64` and a
//! sector size of `step`·512 bytes is the tweak of each sector in turn. One
//! entry can so carry a whole run of disk sectors.
//!
//! [`Entry::check_length`] refuses, before any data is touched: with
//! [`status::MALFORMED`] a `unit` or `step` the mode has no use for (any
//! non-XTS entry with either non-zero, an XTS entry with `unit` 0 and
//! `step` non-zero, or `unit` non-zero and `step` 0); with
//! [`status::BAD_LENGTH`] a `unit` below 16 bytes or a `len` that is not a
//! positive whole number of units.
//!
//! The vault copies each entry out of shared memory once, parses the copy
//! with [`Entry::parse`] and checks every range against the registered
//! buffers with [`Buffers::check`] before touching data. Nothing in this
//! module trusts a value the client wrote.
#![forbid(unsafe_code)]

use crate::proto::Mode;

/// Bytes of one lane.
pub const LANE_BYTES: usize = 4096;
/// Bytes of one entry.
pub const ENTRY_BYTES: usize = 128;
/// Entries per batch.
pub const MAX_BATCH: usize = (LANE_BYTES - 128) / ENTRY_BYTES;
/// Offset of `submit`.
pub const OFF_SUBMIT: usize = 0;
/// Offset of `count`.
pub const OFF_COUNT: usize = 4;
/// Offset of `client_waiting`.
pub const OFF_CLIENT_WAITING: usize = 8;
/// Offset of `complete`.
pub const OFF_COMPLETE: usize = 64;
/// Offset of `vault_sleeping`.
pub const OFF_VAULT_SLEEPING: usize = 68;
/// Offset of entry 0.
pub const OFF_ENTRIES: usize = 128;
/// Offset of the tag inside an entry.
pub const ENTRY_TAG: usize = 48;
/// Offset of the status inside an entry.
pub const ENTRY_STATUS: usize = 80;
/// Offset of the XTS data-unit size inside an entry.
pub const ENTRY_UNIT: usize = 84;
/// Offset of the XTS tweak step per data unit inside an entry.
pub const ENTRY_STEP: usize = 88;
/// Offset of the output length an asymmetric entry's result has (written
/// by the vault).
pub const ENTRY_OUT_LEN: usize = 92;
/// Longest input of an asymmetric entry (an Ed25519 message; the others
/// take at most a modulus' bytes).
pub const MAX_ASYM_INPUT: u64 = 1 << 20;
/// Longest output range of an asymmetric entry (more than any result).
pub const MAX_ASYM_OUTPUT: u64 = 4096;

/// The parameters of an asymmetric entry, carried in its IV field: byte 0
/// the hash (RSA-PSS's, RSA-OAEP's: `memveil_asym::Hash` codes), byte 1
/// MGF1's hash, bytes 4..8 (u32 little-endian) the PSS salt length or the
/// OAEP label's length (the label then opens the input range, the
/// ciphertext follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AsymParams {
    /// Hash code (0 when the mode takes none).
    pub hash: u8,
    /// MGF1 hash code.
    pub mgf1: u8,
    /// PSS salt length, or OAEP label length.
    pub len: u32,
}

impl AsymParams {
    /// Reads the parameters from an entry's IV field.
    #[must_use]
    pub fn from_iv(iv: &[u8; 16]) -> AsymParams {
        AsymParams {
            hash: iv[0],
            mgf1: iv[1],
            len: u32::from_le_bytes([iv[4], iv[5], iv[6], iv[7]]),
        }
    }

    /// The IV field that carries them.
    #[must_use]
    pub fn to_iv(self) -> [u8; 16] {
        let mut iv = [0u8; 16];
        iv[0] = self.hash;
        iv[1] = self.mgf1;
        iv[4..8].copy_from_slice(&self.len.to_le_bytes());
        iv
    }
}

/// Encrypt or decrypt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Encrypt.
    Encrypt,
    /// Decrypt.
    Decrypt,
}

/// Statuses written back into an entry.
pub mod status {
    /// Done.
    pub const OK: u32 = 0;
    /// The entry did not parse (bad op or mode), or carries a data-unit size
    /// or tweak step its mode does not take.
    pub const MALFORMED: u32 = 1;
    /// A range lies outside the registered buffer, or the buffer is unknown.
    pub const OUT_OF_BOUNDS: u32 = 2;
    /// Unknown key or version.
    pub const NO_KEY: u32 = 3;
    /// The client may not use this key this way.
    pub const DENIED: u32 = 4;
    /// The key kind does not serve this mode.
    pub const WRONG_MODE: u32 = 5;
    /// A length the mode cannot process.
    pub const BAD_LENGTH: u32 = 6;
    /// GCM or CMAC tag mismatch.
    pub const AUTH_FAILED: u32 = 7;
    /// The batch count was 0 or larger than the lane holds.
    pub const BAD_COUNT: u32 = 8;
    /// A range overlaps one that another request of the same client is
    /// using right now (or a lane page): concurrent requests on overlapping
    /// ranges are refused, never run over each other.
    pub const BUSY: u32 = 9;
    /// A GCM message longer than the vault opens in its private memory.
    pub const TOO_LONG: u32 = 10;
    /// The vault could not get private memory for this request now.
    pub const NO_MEMORY: u32 = 11;
    /// An RSA input that did not decrypt (OAEP) or is not below the
    /// modulus (raw RSA).
    pub const BAD_CIPHERTEXT: u32 = 12;
    /// An asymmetric operation failed inside the vault (its log says why:
    /// the secret heap for asymmetric keys full, among others).
    pub const FAILED: u32 = 13;
    /// Parameters the mode cannot take (an unknown hash, a PSS salt too
    /// long for the key, a digest of the wrong length).
    pub const BAD_PARAMS: u32 = 14;
    /// Not yet processed (written by the client library before submit).
    pub const PENDING: u32 = 0xFFFF_FFFF;

    /// Words for a status.
    #[must_use]
    pub fn describe(s: u32) -> &'static str {
        match s {
            OK => "ok",
            MALFORMED => "malformed ring entry (bad op or mode, or an XTS unit/step the mode does not take)",
            OUT_OF_BOUNDS => "range outside the registered buffer (or unknown buffer)",
            NO_KEY => "no such key or key version",
            DENIED => "permission denied by the key's ACL",
            WRONG_MODE => "the key's kind does not serve this mode",
            BAD_LENGTH => "data length not acceptable for this mode",
            AUTH_FAILED => "GCM authentication failed (or CMAC tag mismatch)",
            BAD_COUNT => "batch count out of range",
            BUSY => "range in use by another request of this client (overlapping concurrent requests are refused; retry, or use disjoint ranges)",
            TOO_LONG => "GCM message longer than the vault accepts (the vault's --max-gcm-mib)",
            NO_MEMORY => "the vault is out of private memory for this request; retry later",
            BAD_CIPHERTEXT => "the RSA input did not decrypt (OAEP) or is not below the modulus",
            FAILED => "the key operation failed in the vault (see its log: the secret heap for asymmetric keys full, --asym-heap-kib?)",
            BAD_PARAMS => "parameters the mode cannot take (hash, salt length, digest length)",
            PENDING => "not processed",
            _ => "unknown status",
        }
    }
}

/// A request as the client writes it (also used by the client library to
/// encode entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Direction.
    pub op: Op,
    /// Mode.
    pub mode: Mode,
    /// Key id.
    pub key: u32,
    /// Key version (0 = newest).
    pub version: u32,
    /// Registered buffer id.
    pub buffer: u32,
    /// Start of the data in the buffer.
    pub offset: u64,
    /// Length of the data.
    pub len: u64,
    /// IV (CBC), counter block (CTR), tweak (XTS), nonce in the first 12 bytes (GCM).
    pub iv: [u8; 16],
    /// GCM tag to verify (decrypt).
    pub tag: [u8; 16],
    /// GCM associated data start in the buffer.
    pub aad_offset: u64,
    /// GCM associated data length.
    pub aad_len: u64,
    /// XTS data-unit size in bytes (0 = the whole entry is one data unit;
    /// 0 for every other mode).
    pub unit: u32,
    /// XTS tweak step from one data unit to the next (sequence numbers;
    /// 0 when `unit` is 0).
    pub step: u32,
}

fn u32_at(b: &[u8; ENTRY_BYTES], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn u64_at(b: &[u8; ENTRY_BYTES], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

impl Entry {
    /// An asymmetric request (module doc): `input` and `output` are
    /// (offset, length) ranges of `buffer`; `params` goes in the IV field.
    #[must_use]
    pub fn asym(
        op: Op,
        mode: Mode,
        key: u32,
        buffer: u32,
        input: (u64, u64),
        output: (u64, u64),
        params: AsymParams,
    ) -> Entry {
        Entry {
            op,
            mode,
            key,
            version: 0,
            buffer,
            offset: input.0,
            len: input.1,
            iv: params.to_iv(),
            tag: [0; 16],
            aad_offset: output.0,
            aad_len: output.1,
            unit: 0,
            step: 0,
        }
    }

    /// Parses a private copy of an entry.
    ///
    /// # Errors
    /// [`status::MALFORMED`] for an unknown op or mode.
    pub fn parse(b: &[u8; ENTRY_BYTES]) -> Result<Entry, u32> {
        let op = match b[0] {
            1 => Op::Encrypt,
            2 => Op::Decrypt,
            _ => return Err(status::MALFORMED),
        };
        let mode = Mode::from_code(b[1]).ok_or(status::MALFORMED)?;
        let mut iv = [0u8; 16];
        iv.copy_from_slice(&b[32..48]);
        let mut tag = [0u8; 16];
        tag.copy_from_slice(&b[48..64]);
        Ok(Entry {
            op,
            mode,
            key: u32_at(b, 4),
            buffer: u32_at(b, 8),
            version: u32_at(b, 12),
            offset: u64_at(b, 16),
            len: u64_at(b, 24),
            iv,
            tag,
            aad_offset: u64_at(b, 64),
            aad_len: u64_at(b, 72),
            unit: u32_at(b, ENTRY_UNIT),
            step: u32_at(b, ENTRY_STEP),
        })
    }

    /// Encodes the entry (status set to [`status::PENDING`]).
    #[must_use]
    pub fn encode(&self) -> [u8; ENTRY_BYTES] {
        let mut b = [0u8; ENTRY_BYTES];
        b[0] = match self.op {
            Op::Encrypt => 1,
            Op::Decrypt => 2,
        };
        b[1] = self.mode.code();
        b[4..8].copy_from_slice(&self.key.to_le_bytes());
        b[8..12].copy_from_slice(&self.buffer.to_le_bytes());
        b[12..16].copy_from_slice(&self.version.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..48].copy_from_slice(&self.iv);
        b[48..64].copy_from_slice(&self.tag);
        b[64..72].copy_from_slice(&self.aad_offset.to_le_bytes());
        b[72..80].copy_from_slice(&self.aad_len.to_le_bytes());
        b[80..84].copy_from_slice(&status::PENDING.to_le_bytes());
        b[ENTRY_UNIT..ENTRY_UNIT + 4].copy_from_slice(&self.unit.to_le_bytes());
        b[ENTRY_STEP..ENTRY_STEP + 4].copy_from_slice(&self.step.to_le_bytes());
        b
    }

    /// Checks the data length, and the XTS data-unit fields, against what
    /// the mode accepts (module doc).
    ///
    /// # Errors
    /// [`status::MALFORMED`] for a `unit` or `step` the mode does not take;
    /// [`status::BAD_LENGTH`] for a length it cannot process.
    pub fn check_length(&self) -> Result<(), u32> {
        match (self.mode, self.unit, self.step) {
            (Mode::Xts, 0, 0) => {}
            (Mode::Xts, unit, step) if unit != 0 && step != 0 => {
                if unit < 16 || self.len == 0 || !self.len.is_multiple_of(u64::from(unit)) {
                    return Err(status::BAD_LENGTH);
                }
            }
            (_, 0, 0) => {}
            _ => return Err(status::MALFORMED),
        }
        if self.mode.is_asym() {
            let (sign, decrypt) = self.mode.directions();
            let served = match self.op {
                Op::Encrypt => sign,
                Op::Decrypt => decrypt,
            };
            if !served {
                return Err(status::WRONG_MODE);
            }
            // A MAC or a key's digest may be over no data at all.
            let least = u64::from(!matches!(self.mode, Mode::Hmac | Mode::KeyDigest));
            return if (least..=MAX_ASYM_INPUT).contains(&self.len)
                && (1..=MAX_ASYM_OUTPUT).contains(&self.aad_len)
            {
                Ok(())
            } else {
                Err(status::BAD_LENGTH)
            };
        }
        let ok = match self.mode {
            Mode::Ecb | Mode::Cbc => self.len.is_multiple_of(16),
            Mode::Xts => self.len >= 16,
            _ => true,
        };
        if ok && (self.mode == Mode::Gcm || self.aad_len == 0) {
            Ok(())
        } else {
            Err(status::BAD_LENGTH)
        }
    }

    /// The parameters of an asymmetric entry, from its IV field.
    #[must_use]
    pub fn asym_params(&self) -> AsymParams {
        AsymParams::from_iv(&self.iv)
    }

    /// The IEEE 1619 sequence number of XTS data unit `i` of this entry:
    /// the IV as a little-endian integer plus `i · step`, modulo 2^128.
    #[must_use]
    pub fn unit_seq(&self, i: u64) -> u128 {
        u128::from_le_bytes(self.iv).wrapping_add(u128::from(i).wrapping_mul(u128::from(self.step)))
    }
}

/// A registered buffer: a range of one shared area, checked against the
/// area's length when registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    /// Shared area id.
    pub shm: u32,
    /// Start inside the area.
    pub start: usize,
    /// Length.
    pub len: usize,
}

/// A checked range: `len` bytes at `start` of shared area `shm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Shared area id.
    pub shm: u32,
    /// Absolute start in the area.
    pub start: usize,
    /// Length.
    pub len: usize,
}

/// The registered buffers of one client (vault-private; never in shared memory).
#[derive(Debug, Default, Clone)]
pub struct Buffers {
    list: Vec<Option<Buffer>>,
}

impl Buffers {
    /// Registers `[start, start+len)` of an area of `area_len` bytes.
    ///
    /// # Errors
    /// A message when the range is empty or not inside the area.
    pub fn register(
        &mut self,
        shm: u32,
        area_len: usize,
        start: u64,
        len: u64,
    ) -> Result<u32, String> {
        let start = usize::try_from(start).map_err(|_| "offset too large".to_owned())?;
        let len = usize::try_from(len).map_err(|_| "length too large".to_owned())?;
        if len == 0 {
            return Err("empty buffer".into());
        }
        match start.checked_add(len) {
            Some(end) if end <= area_len => {}
            _ => {
                return Err(format!(
                    "buffer [{start}, +{len}) lies outside the shared area of {area_len} bytes"
                ))
            }
        }
        let b = Buffer { shm, start, len };
        if let Some(i) = self.list.iter().position(Option::is_none) {
            self.list[i] = Some(b);
            return u32::try_from(i).map_err(|_| "too many buffers".into());
        }
        self.list.push(Some(b));
        u32::try_from(self.list.len() - 1).map_err(|_| "too many buffers".into())
    }

    /// Forgets a buffer; false if it did not exist.
    pub fn unregister(&mut self, id: u32) -> bool {
        let Ok(i) = usize::try_from(id) else {
            return false;
        };
        match self.list.get_mut(i) {
            Some(slot @ Some(_)) => {
                *slot = None;
                true
            }
            _ => false,
        }
    }

    /// Forgets every buffer of shared area `shm`.
    pub fn drop_area(&mut self, shm: u32) {
        for slot in &mut self.list {
            if slot.is_some_and(|b| b.shm == shm) {
                *slot = None;
            }
        }
    }

    /// Live buffers.
    #[must_use]
    pub fn count(&self) -> usize {
        self.list.iter().flatten().count()
    }

    /// Checks that `[offset, offset+len)` lies inside buffer `id` and
    /// returns the absolute span. Every addition is checked.
    ///
    /// # Errors
    /// [`status::OUT_OF_BOUNDS`].
    pub fn check(&self, id: u32, offset: u64, len: u64) -> Result<Span, u32> {
        let b = usize::try_from(id)
            .ok()
            .and_then(|i| self.list.get(i).copied().flatten())
            .ok_or(status::OUT_OF_BOUNDS)?;
        let off = usize::try_from(offset).map_err(|_| status::OUT_OF_BOUNDS)?;
        let len = usize::try_from(len).map_err(|_| status::OUT_OF_BOUNDS)?;
        let end = off.checked_add(len).ok_or(status::OUT_OF_BOUNDS)?;
        if end > b.len {
            return Err(status::OUT_OF_BOUNDS);
        }
        Ok(Span {
            shm: b.shm,
            start: b.start + off,
            len,
        })
    }
}

/// Checks a lane offset inside an area: page aligned and the whole lane inside.
///
/// # Errors
/// A message saying why not.
pub fn check_lane(area_len: usize, offset: u64) -> Result<usize, String> {
    let off = usize::try_from(offset).map_err(|_| "lane offset too large".to_owned())?;
    if off % LANE_BYTES != 0 {
        return Err(format!(
            "lane offset {off} is not a multiple of {LANE_BYTES}"
        ));
    }
    match off.checked_add(LANE_BYTES) {
        Some(end) if end <= area_len => Ok(off),
        _ => Err(format!(
            "lane at {off} does not fit in the shared area of {area_len} bytes"
        )),
    }
}

/// Reads a batch count (already copied out of shared memory once).
///
/// # Errors
/// [`status::BAD_COUNT`] for 0 or more than [`MAX_BATCH`].
pub fn check_count(count: u32) -> Result<usize, u32> {
    match usize::try_from(count) {
        Ok(n) if (1..=MAX_BATCH).contains(&n) => Ok(n),
        _ => Err(status::BAD_COUNT),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const _: () = assert!(MAX_BATCH == 31 && OFF_ENTRIES + MAX_BATCH * ENTRY_BYTES <= LANE_BYTES);

    #[test]
    fn entry_round_trip() {
        let e = Entry {
            op: Op::Decrypt,
            mode: Mode::Gcm,
            key: 9,
            version: 2,
            buffer: 1,
            offset: 4096,
            len: 100,
            iv: [3; 16],
            tag: [4; 16],
            aad_offset: 7,
            aad_len: 20,
            unit: 0x0102_0304,
            step: 0x0506_0708,
        };
        assert_eq!(Entry::parse(&e.encode()), Ok(e));
        let b = e.encode();
        assert_eq!(b[ENTRY_UNIT..ENTRY_UNIT + 4], [4, 3, 2, 1]);
        assert_eq!(b[ENTRY_STEP..ENTRY_STEP + 4], [8, 7, 6, 5]);
        assert!(b[92..].iter().all(|&x| x == 0));
        let mut b = e.encode();
        b[0] = 9;
        assert_eq!(Entry::parse(&b), Err(status::MALFORMED));
        b[0] = 1;
        b[1] = 0;
        assert_eq!(Entry::parse(&b), Err(status::MALFORMED));
    }

    fn xts(len: u64, unit: u32, step: u32) -> Entry {
        Entry {
            op: Op::Encrypt,
            mode: Mode::Xts,
            key: 1,
            version: 0,
            buffer: 0,
            offset: 0,
            len,
            iv: [0; 16],
            tag: [0; 16],
            aad_offset: 0,
            aad_len: 0,
            unit,
            step,
        }
    }

    #[test]
    fn xts_unit_and_step_are_checked() {
        // Old entries (zeros in both fields) keep their meaning.
        assert_eq!(xts(16, 0, 0).check_length(), Ok(()));
        assert_eq!(xts(4097, 0, 0).check_length(), Ok(()));
        assert_eq!(xts(15, 0, 0).check_length(), Err(status::BAD_LENGTH));
        // Runs of units.
        assert_eq!(xts(512 * 2048, 512, 1).check_length(), Ok(()));
        assert_eq!(xts(4096 * 3, 4096, 8).check_length(), Ok(()));
        assert_eq!(xts(16, 16, u32::MAX).check_length(), Ok(()));
        assert_eq!(xts(1000, 1000, 1).check_length(), Ok(()));
        // Lengths: units under 16 bytes, a partial unit, no unit at all.
        assert_eq!(xts(512, 8, 1).check_length(), Err(status::BAD_LENGTH));
        assert_eq!(xts(520, 512, 1).check_length(), Err(status::BAD_LENGTH));
        assert_eq!(xts(256, 512, 1).check_length(), Err(status::BAD_LENGTH));
        assert_eq!(xts(0, 512, 1).check_length(), Err(status::BAD_LENGTH));
        assert_eq!(
            xts(u64::MAX, 1 << 20, 1).check_length(),
            Err(status::BAD_LENGTH)
        );
        // Fields the entry does not take.
        assert_eq!(xts(1024, 512, 0).check_length(), Err(status::MALFORMED));
        assert_eq!(xts(1024, 0, 1).check_length(), Err(status::MALFORMED));
        for mode in [Mode::Ecb, Mode::Cbc, Mode::Ctr, Mode::Gcm, Mode::Cmac] {
            let plain = Entry {
                mode,
                ..xts(1024, 0, 0)
            };
            assert_eq!(plain.check_length(), Ok(()), "{mode:?}");
            for (unit, step) in [(512, 1), (512, 0), (0, 1)] {
                let e = Entry {
                    unit,
                    step,
                    ..plain
                };
                assert_eq!(e.check_length(), Err(status::MALFORMED), "{mode:?}");
            }
        }
    }

    #[test]
    fn unit_sequence_numbers_are_iv_plus_i_steps_modulo_2_128() {
        let mut e = xts(2048, 512, 8);
        e.iv[..8].copy_from_slice(&100u64.to_le_bytes());
        assert_eq!(e.unit_seq(0), 100);
        assert_eq!(e.unit_seq(3), 124);
        // Past 2^64 the carry goes on into the upper half.
        e.iv = [0; 16];
        e.iv[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(e.unit_seq(1), 1u128 << 64 | 7);
        // And at 2^128 it wraps.
        e.iv = [0xFF; 16];
        assert_eq!(e.unit_seq(1), 7);
    }

    #[test]
    fn registration_is_checked() {
        let mut bs = Buffers::default();
        assert!(bs.register(0, 8192, 4096, 4097).is_err());
        assert!(bs.register(0, 8192, u64::MAX, 2).is_err());
        assert!(bs.register(0, 8192, 0, 0).is_err());
        let id = bs.register(0, 8192, 4096, 4096).expect("ok");
        assert!(bs.check(id, 0, 4096).is_ok());
        assert_eq!(bs.check(id, 1, 4096), Err(status::OUT_OF_BOUNDS));
        assert_eq!(bs.check(id, u64::MAX, 1), Err(status::OUT_OF_BOUNDS));
        assert_eq!(bs.check(id + 1, 0, 1), Err(status::OUT_OF_BOUNDS));
        assert!(bs.unregister(id));
        assert_eq!(bs.check(id, 0, 1), Err(status::OUT_OF_BOUNDS));
        assert!(check_lane(8192, 4096).is_ok());
        assert!(check_lane(8192, 4095).is_err());
        assert!(check_lane(8192, 8192).is_err());
        assert!(check_lane(8192, u64::MAX - 4095).is_err());
        assert_eq!(check_count(0), Err(status::BAD_COUNT));
        assert_eq!(check_count(32), Err(status::BAD_COUNT));
        assert_eq!(check_count(31), Ok(31));
    }

    proptest! {
        /// Whatever the client registers and asks for, an accepted span lies
        /// inside one registered buffer, which lies inside its area.
        #[test]
        fn accepted_spans_stay_inside_registered_buffers(
            area_len in 1usize..1_000_000,
            regs in proptest::collection::vec((any::<u64>(), any::<u64>()), 1..8),
            small_regs in proptest::collection::vec((0u64..1_000_000, 0u64..1_000_000), 1..8),
            asks in proptest::collection::vec((0u32..20, any::<u64>(), any::<u64>()), 1..40),
            small_asks in proptest::collection::vec((0u32..20, 0u64..1_100_000, 0u64..1_100_000), 1..40),
        ) {
            let mut bs = Buffers::default();
            let mut accepted = Vec::new();
            for (s, l) in regs.iter().chain(small_regs.iter()) {
                if let Ok(id) = bs.register(0, area_len, *s, *l) {
                    let (s, l) = (usize::try_from(*s).expect("fits"), usize::try_from(*l).expect("fits"));
                    prop_assert!(s + l <= area_len && l > 0);
                    accepted.push((id, s, l));
                }
            }
            for (id, off, len) in asks.iter().chain(small_asks.iter()) {
                if let Ok(span) = bs.check(*id, *off, *len) {
                    let &(_, bs_, bl) = accepted.iter().find(|(i, _, _)| i == id).expect("registered");
                    prop_assert!(span.start >= bs_);
                    prop_assert!(span.start + span.len <= bs_ + bl);
                    prop_assert!(span.start + span.len <= area_len);
                }
            }
        }

        #[test]
        fn parsing_arbitrary_entries_never_panics(bytes in proptest::collection::vec(any::<u8>(), ENTRY_BYTES)) {
            let mut b = [0u8; ENTRY_BYTES];
            b.copy_from_slice(&bytes);
            if let Ok(e) = Entry::parse(&b) {
                let _ = e.check_length();
                prop_assert_eq!(Entry::parse(&e.encode()), Ok(e));
            }
        }

        /// Whatever unit, step and length a client writes, an accepted
        /// entry is either one data unit of at least 16 bytes (unit 0) or a
        /// positive whole number of XTS units of at least 16 bytes each,
        /// with a step of at least 1; and no other mode accepts either field.
        #[test]
        fn accepted_unit_fields_describe_whole_units(
            mode in prop::sample::select(vec![Mode::Ecb, Mode::Cbc, Mode::Ctr, Mode::Xts, Mode::Gcm, Mode::Cmac]),
            unit in prop_oneof![Just(0u32), 0u32..5000, any::<u32>()],
            step in prop_oneof![Just(0u32), Just(1u32), any::<u32>()],
            len in prop_oneof![0u64..100_000, any::<u64>()],
        ) {
            let e = Entry { mode, ..xts(len, unit, step) };
            match e.check_length() {
                Ok(()) if unit == 0 => prop_assert_eq!(step, 0),
                Ok(()) => {
                    prop_assert_eq!(mode, Mode::Xts);
                    prop_assert!(unit >= 16 && step >= 1 && len >= u64::from(unit));
                    prop_assert_eq!(len % u64::from(unit), 0);
                }
                Err(s) if s == status::MALFORMED => {
                    prop_assert!(unit != 0 || step != 0);
                    prop_assert!(mode != Mode::Xts || unit == 0 || step == 0);
                }
                Err(s) => prop_assert_eq!(s, status::BAD_LENGTH),
            }
        }
    }
}
