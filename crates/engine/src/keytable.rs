//! The key table and PCONFIG's `MKTME_KEY_PROGRAM` leaf.

use std::fmt;
use std::sync::{Mutex, RwLock, RwLockReadGuard, TryLockError};

use memveil_cipher::Xts;
use memveil_secmem::{Level, Policy, SecretBox, SecretPool};

use crate::EngineError;

/// Encryption algorithms, with their `ENC_ALG` bit as in `IA32_TME_CAPABILITY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// AES-XTS with 128-bit keys (bit 0). The default.
    AesXts128,
    /// AES-XTS with 256-bit keys (bit 2).
    AesXts256,
}

impl Algorithm {
    /// The one-hot `KEYID_CTRL.ENC_ALG` value.
    #[must_use]
    pub fn bits(self) -> u16 {
        match self {
            Algorithm::AesXts128 => 1 << 0,
            Algorithm::AesXts256 => 1 << 2,
        }
    }

    /// Decodes a one-hot `ENC_ALG` value.
    #[must_use]
    pub fn from_bits(bits: u16) -> Option<Self> {
        match bits {
            1 => Some(Algorithm::AesXts128),
            4 => Some(Algorithm::AesXts256),
            _ => None,
        }
    }

    /// Bytes of each of the two XTS keys.
    #[must_use]
    pub fn key_len(self) -> usize {
        match self {
            Algorithm::AesXts128 => 16,
            Algorithm::AesXts256 => 32,
        }
    }

    /// The name on command lines and in status output.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::AesXts128 => "aes-xts-128",
            Algorithm::AesXts256 => "aes-xts-256",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "aes-xts-128" => Ok(Algorithm::AesXts128),
            "aes-xts-256" => Ok(Algorithm::AesXts256),
            _ => Err(format!(
                "unknown algorithm {s:?}: aes-xts-128 or aes-xts-256"
            )),
        }
    }
}

/// The four `MKTME_KEY_PROGRAM` commands (`KEYID_CTRL.COMMAND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Command {
    /// `KEYID_SET_KEY_DIRECT` (0): the caller supplies data key and tweak key.
    SetKeyDirect = 0,
    /// `KEYID_SET_KEY_RANDOM` (1): keys from the CPU DRNG, optionally XORed
    /// with caller entropy.
    SetKeyRandom = 1,
    /// `KEYID_CLEAR_KEY` (2): the KeyID falls back to the platform key.
    ClearKey = 2,
    /// `KEYID_NO_ENCRYPT` (3): bypass, memory under this KeyID is plaintext.
    NoEncrypt = 3,
}

impl Command {
    /// The command for a raw `KEYID_CTRL.COMMAND` value.
    #[must_use]
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Command::SetKeyDirect,
            1 => Command::SetKeyRandom,
            2 => Command::ClearKey,
            3 => Command::NoEncrypt,
            _ => return None,
        })
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Command::SetKeyDirect => "KEYID_SET_KEY_DIRECT",
            Command::SetKeyRandom => "KEYID_SET_KEY_RANDOM",
            Command::ClearKey => "KEYID_CLEAR_KEY",
            Command::NoEncrypt => "KEYID_NO_ENCRYPT",
        })
    }
}

/// PCONFIG status codes (returned in RAX).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// 0: the KeyID was programmed.
    ProgSuccess = 0,
    /// 1: unknown command, or a malformed request (in memveil: key fields of
    /// the wrong length, or XTS key halves that are equal).
    InvalidProgCmd = 1,
    /// 2: the DRNG did not deliver entropy for `KEYID_SET_KEY_RANDOM`; retry.
    EntropyError = 2,
    /// 3: KeyID 0 (platform key) or above the configured maximum.
    InvalidKeyId = 3,
    /// 4: an algorithm the engine does not offer.
    InvalidEncAlg = 4,
    /// 5: another programming operation is in progress; retry.
    DeviceBusy = 5,
}

impl Status {
    /// The status for a raw RAX value, `None` for a code PCONFIG does not define.
    #[must_use]
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Status::ProgSuccess,
            1 => Status::InvalidProgCmd,
            2 => Status::EntropyError,
            3 => Status::InvalidKeyId,
            4 => Status::InvalidEncAlg,
            5 => Status::DeviceBusy,
            _ => return None,
        })
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::ProgSuccess => "PROG_SUCCESS",
            Status::InvalidProgCmd => "INVALID_PROG_CMD",
            Status::EntropyError => "ENTROPY_ERROR",
            Status::InvalidKeyId => "INVALID_KEYID",
            Status::InvalidEncAlg => "INVALID_ENC_ALG",
            Status::DeviceBusy => "DEVICE_BUSY",
        })
    }
}

/// One `MKTME_KEY_PROGRAM` request. Fields are raw, as software writes them
/// into the PCONFIG structure, so malformed requests can be expressed. No
/// `Debug`: the key fields would print.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyProgram<'a> {
    /// The KeyID to program (1..=max).
    pub keyid: u16,
    /// `KEYID_CTRL.COMMAND` (see [`Command`]).
    pub command: u8,
    /// `KEYID_CTRL.ENC_ALG`, one-hot (see [`Algorithm::bits`]).
    pub enc_alg: u16,
    /// Data key (DIRECT) or entropy to mix (RANDOM; may be empty).
    pub key_field_1: &'a [u8],
    /// Tweak key (DIRECT) or entropy to mix (RANDOM; may be empty).
    pub key_field_2: &'a [u8],
}

impl<'a> KeyProgram<'a> {
    /// `KEYID_SET_KEY_DIRECT`.
    #[must_use]
    pub fn direct(keyid: u16, alg: Algorithm, data_key: &'a [u8], tweak_key: &'a [u8]) -> Self {
        Self {
            keyid,
            command: Command::SetKeyDirect as u8,
            enc_alg: alg.bits(),
            key_field_1: data_key,
            key_field_2: tweak_key,
        }
    }

    /// `KEYID_SET_KEY_RANDOM`, with optional caller entropy (empty slices for none).
    #[must_use]
    pub fn random(keyid: u16, alg: Algorithm, entropy_1: &'a [u8], entropy_2: &'a [u8]) -> Self {
        Self {
            keyid,
            command: Command::SetKeyRandom as u8,
            enc_alg: alg.bits(),
            key_field_1: entropy_1,
            key_field_2: entropy_2,
        }
    }

    /// `KEYID_CLEAR_KEY`.
    #[must_use]
    pub fn clear(keyid: u16) -> Self {
        Self {
            keyid,
            command: Command::ClearKey as u8,
            enc_alg: 0,
            key_field_1: &[],
            key_field_2: &[],
        }
    }

    /// `KEYID_NO_ENCRYPT`.
    #[must_use]
    pub fn no_encrypt(keyid: u16) -> Self {
        Self {
            keyid,
            command: Command::NoEncrypt as u8,
            enc_alg: 0,
            key_field_1: &[],
            key_field_2: &[],
        }
    }
}

/// Why a programming request failed; [`ProgramError::status`] is the PCONFIG code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProgramError {
    /// Unknown command.
    #[error("INVALID_PROG_CMD: unknown command {0} (0 SET_KEY_DIRECT, 1 SET_KEY_RANDOM, 2 CLEAR_KEY, 3 NO_ENCRYPT)")]
    UnknownCommand(u8),
    /// Malformed key fields.
    #[error("INVALID_PROG_CMD: {0}")]
    BadKey(String),
    /// The DRNG failed.
    #[error("ENTROPY_ERROR: {0}; retry the request")]
    Entropy(String),
    /// KeyID out of range.
    #[error("INVALID_KEYID: KeyID {keyid} is not programmable (KeyID 0 is the platform key; usable 1..={max})")]
    InvalidKeyId {
        /// The KeyID.
        keyid: u16,
        /// Highest KeyID.
        max: u16,
    },
    /// Algorithm not offered.
    #[error(
        "INVALID_ENC_ALG: ENC_ALG {0:#x} is not one of 0x1 (AES-XTS-128) or 0x4 (AES-XTS-256)"
    )]
    InvalidAlgorithm(u16),
    /// Another programming operation is in progress.
    #[error("DEVICE_BUSY: another key programming operation is in progress; retry")]
    Busy,
    /// Secret memory for the key could not be had.
    #[error("INVALID_PROG_CMD: no secret memory for the key: {0}")]
    NoSecretMemory(String),
}

impl ProgramError {
    /// The PCONFIG status code of this error.
    #[must_use]
    pub fn status(&self) -> Status {
        match self {
            ProgramError::UnknownCommand(_)
            | ProgramError::BadKey(_)
            | ProgramError::NoSecretMemory(_) => Status::InvalidProgCmd,
            ProgramError::Entropy(_) => Status::EntropyError,
            ProgramError::InvalidKeyId { .. } => Status::InvalidKeyId,
            ProgramError::InvalidAlgorithm(_) => Status::InvalidEncAlg,
            ProgramError::Busy => Status::DeviceBusy,
        }
    }
}

/// Bytes of the page-key material [`KeyTable::derive_page_key`] writes: an
/// AES-XTS-256 data key and tweak key (an AES-XTS-128 tenant takes the first
/// 32 bytes).
pub const PAGE_KEY_LEN: usize = 64;

/// The XTS data unit of a page-key derivation, ORed with the generation: a
/// space no memory under the key uses (the engine tweaks pages with their
/// physical address, below 2^52), so no page of memory ever encrypts under
/// the unit a page key comes from.
const PAGE_KEY_UNIT: u128 = 1 << 127;

/// The label a tenant page key is derived from (64 bytes: four AES blocks).
const PAGE_KEY_LABEL: &[u8; 48] = b"memveil tenant page key v1 (memveil run --keyid)";

/// Why a KeyID gives no page key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeriveError {
    /// KeyID above the table.
    #[error("INVALID_KEYID: KeyID {keyid} is not in this table (0..={max})")]
    InvalidKeyId {
        /// The KeyID.
        keyid: u16,
        /// Highest KeyID.
        max: u16,
    },
    /// Never programmed, or cleared: no key of its own.
    #[error("KeyID {0} holds no key (never programmed, or cleared): program it first, e.g. `memveil key program --keyid {0} --mode random`")]
    NotProgrammed(u16),
    /// `KEYID_NO_ENCRYPT`: memory under it is plaintext, there is no key.
    #[error("KeyID {0} is programmed no-encrypt: memory under it is plaintext")]
    NoEncrypt(u16),
}

/// A source of key entropy: fills the buffer or says why it could not.
pub type EntropyFn = Box<dyn Fn(&mut [u8]) -> Result<(), String> + Send + Sync>;

/// The default entropy source: the CPU DRNG (RDRAND, 10 retries per word as
/// the DRNG guide advises) when CPUID reports it, else `getrandom(2)`.
/// RDRAND present but failing is an error (PCONFIG's ENTROPY_ERROR), never a
/// silent switch.
///
/// The words are key material on their way into `buf` (secret memory in the
/// key table), so none is left in an ordinary stack copy: a whole word goes
/// from the RDRAND register into `buf` in one 8-byte store, and the word of
/// a partial tail sits in a buffer wiped on drop. (Copying a slice of
/// `w.to_le_bytes()` of run-time length went through a stack temporary that
/// kept the last key word after return: tests/key_words.rs.)
pub fn cpu_entropy(buf: &mut [u8]) -> Result<(), String> {
    if !memveil_sys::has_feature(memveil_sys::CpuFeature::Rdrand) {
        return memveil_sys::getrandom(buf).map_err(|e| format!("getrandom: {e}"));
    }
    let word = || {
        (0..10)
            .find_map(|_| memveil_sys::rdrand64())
            .ok_or("RDRAND returned no data after 10 retries")
    };
    let mut words = buf.chunks_exact_mut(8);
    for chunk in &mut words {
        chunk.copy_from_slice(&word()?.to_le_bytes());
    }
    let tail = words.into_remainder();
    if !tail.is_empty() {
        let w = zeroize::Zeroizing::new(word()?.to_le_bytes());
        tail.copy_from_slice(&w[..tail.len()]);
    }
    Ok(())
}

/// What a KeyID holds, as status reports show it. Never key bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyIdMode {
    /// KeyID 0: the platform (TME) key, random at start-up.
    Platform(Algorithm),
    /// No key of its own (never programmed, or `KEYID_CLEAR_KEY`): memory
    /// under this KeyID uses the platform key.
    Clear,
    /// `KEYID_SET_KEY_RANDOM`: a key from the DRNG.
    Random(Algorithm),
    /// `KEYID_SET_KEY_DIRECT`: a key the caller supplied (software key).
    Direct(Algorithm),
    /// `KEYID_NO_ENCRYPT`: plaintext.
    NoEncrypt,
}

impl KeyIdMode {
    /// The name in status output: `platform`, `clear`, `random`,
    /// `software`, `no-encrypt`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            KeyIdMode::Platform(_) => "platform",
            KeyIdMode::Clear => "clear",
            KeyIdMode::Random(_) => "random",
            KeyIdMode::Direct(_) => "software",
            KeyIdMode::NoEncrypt => "no-encrypt",
        }
    }

    /// The algorithm of the KeyID's own key, if it has one.
    #[must_use]
    pub fn algorithm(self) -> Option<Algorithm> {
        match self {
            KeyIdMode::Platform(a) | KeyIdMode::Random(a) | KeyIdMode::Direct(a) => Some(a),
            KeyIdMode::Clear | KeyIdMode::NoEncrypt => None,
        }
    }
}

/// One KeyID's public state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyIdState {
    /// The KeyID.
    pub keyid: u16,
    /// What it holds.
    pub mode: KeyIdMode,
    /// Successful programming requests (any command, clear included) on this
    /// KeyID since start-up: a key written under generation g is gone once
    /// the generation is above g.
    pub generation: u64,
    /// Who made the last successful request: the tag its caller passed to
    /// [`KeyTable::program`] (the vault passes the requester's uid); `None`
    /// for KeyID 0, a KeyID never programmed, or one the engine programmed.
    pub programmed_by: Option<u32>,
}

pub(crate) enum Slot {
    /// Unprogrammed or cleared: the platform key.
    Platform,
    /// A programmed key.
    Key(SecretBox<Option<Xts>>),
    /// `KEYID_NO_ENCRYPT`.
    Bypass,
}

/// A validated request, its key (if any) already in secret memory.
pub(crate) struct Prepared {
    slot: Slot,
    mode: KeyIdMode,
}

pub(crate) struct Slots {
    platform: SecretBox<Option<Xts>>,
    slots: Vec<Slot>,
    /// Per KeyID: what status reports (index 0: the platform key).
    states: Vec<KeyIdState>,
}

impl Slots {
    /// The cipher for an access through `keyid`; `None` means plaintext.
    pub(crate) fn cipher(&self, keyid: u16, encrypted: bool) -> Option<&Xts> {
        if !encrypted {
            return None;
        }
        match self.slots.get(usize::from(keyid)) {
            Some(Slot::Key(k)) => k.as_ref(),
            Some(Slot::Bypass) => None,
            Some(Slot::Platform) | None => self.platform.as_ref(),
        }
    }
}

/// A TME-MK key table: the platform key (KeyID 0) and KeyIDs `1..=max`,
/// programmed with PCONFIG's `MKTME_KEY_PROGRAM` commands and answering with
/// its status codes. The [`crate::Engine`] holds one over its simulated
/// memory; the vault holds one as the host's table. Keys live in a secret
/// pool of the table's own, sized for every KeyID at once (so programming
/// never competes with other users of secret memory); no method returns
/// key bytes.
pub struct KeyTable {
    pool: SecretPool,
    slots: RwLock<Slots>,
    busy: Mutex<()>,
    max_keyid: u16,
    entropy: EntropyFn,
}

fn make_xts(
    pool: &SecretPool,
    k1: &[u8],
    k2: &[u8],
) -> Result<SecretBox<Option<Xts>>, ProgramError> {
    let b = pool
        .alloc(|| Xts::new(k1, k2).ok())
        .map_err(|e| ProgramError::NoSecretMemory(e.to_string()))?;
    if b.is_none() {
        return Err(ProgramError::BadKey(
            "XTS data key and tweak key must be distinct and of the algorithm's length".into(),
        ));
    }
    Ok(b)
}

impl KeyTable {
    /// Seals the table's secret memory (every KeyID's key) for the rest of
    /// the process's life (`mseal(2)`, `SecretPool::seal`).
    ///
    /// # Errors
    /// `mseal(2)`'s: `ENOSYS` before Linux 6.10.
    pub fn seal(&self) -> std::io::Result<()> {
        self.pool.seal()
    }

    /// A table of `2^keyid_bits - 1` programmable KeyIDs (hardware: set at
    /// boot; 6 bits on Ice Lake servers) and a fresh random platform key
    /// from `entropy`, all in secret memory under `policy`.
    ///
    /// # Errors
    /// [`EngineError::Config`] for `keyid_bits` outside 1..=15;
    /// [`EngineError::Secmem`] when secret memory is refused;
    /// [`EngineError::PlatformKey`] when `entropy` fails.
    pub fn new(
        keyid_bits: u32,
        platform_alg: Algorithm,
        policy: Policy,
        entropy: EntropyFn,
    ) -> Result<Self, EngineError> {
        if !(1..=15).contains(&keyid_bits) {
            return Err(EngineError::Config(format!(
                "keyid_bits {keyid_bits} not in 1..=15"
            )));
        }
        let max_keyid = u16::try_from((1u32 << keyid_bits) - 1)
            .map_err(|_| EngineError::Config(format!("keyid_bits {keyid_bits} too large")))?;
        let per_key = std::mem::size_of::<Option<Xts>>().div_ceil(64) * 64;
        let pool = SecretPool::new((usize::from(max_keyid) + 2) * per_key + 4096, policy)?;
        let n = platform_alg.key_len();
        let mut raw = pool.alloc_bytes(2 * n)?;
        entropy(&mut raw).map_err(EngineError::PlatformKey)?;
        let (a, b) = raw.split_at(n);
        let platform =
            make_xts(&pool, a, b).map_err(|e| EngineError::PlatformKey(e.to_string()))?;
        drop(raw);
        let slots = (0..=max_keyid).map(|_| Slot::Platform).collect();
        let states = (0..=max_keyid)
            .map(|keyid| KeyIdState {
                keyid,
                mode: if keyid == 0 {
                    KeyIdMode::Platform(platform_alg)
                } else {
                    KeyIdMode::Clear
                },
                generation: 0,
                programmed_by: None,
            })
            .collect();
        Ok(Self {
            pool,
            slots: RwLock::new(Slots {
                platform,
                slots,
                states,
            }),
            busy: Mutex::new(()),
            max_keyid,
            entropy,
        })
    }

    /// The protection level of the memory holding the keys.
    #[must_use]
    pub fn level(&self) -> Level {
        self.pool.level()
    }

    /// Highest KeyID; KeyIDs `1..=max` are programmable.
    #[must_use]
    pub fn max_keyid(&self) -> u16 {
        self.max_keyid
    }

    /// Bytes of secret memory the table holds (every KeyID's key at once).
    #[must_use]
    pub fn secret_bytes(&self) -> usize {
        self.pool.size()
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Slots> {
        self.slots
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Every KeyID's state, KeyID 0 first.
    #[must_use]
    pub fn states(&self) -> Vec<KeyIdState> {
        self.read().states.clone()
    }

    /// One KeyID's state; `None` above the maximum.
    #[must_use]
    pub fn state(&self, keyid: u16) -> Option<KeyIdState> {
        self.read().states.get(usize::from(keyid)).copied()
    }

    /// The page key of a process that runs under `keyid` (`memveil run
    /// --keyid`), written into `out` (secret memory of the caller's), and the
    /// KeyID's state. It is the KeyID's own XTS encryption of a fixed label
    /// naming the KeyID and its generation, with the generation (in a unit
    /// space no memory uses) as data unit:
    /// every process under the KeyID gets the same key (TME-MK's shared
    /// KeyID), a new program or clear gives a new one, and no byte of the
    /// table's key leaves it (recovering it from a page key is breaking AES).
    /// KeyID 0 derives from the platform key.
    ///
    /// # Errors
    /// [`DeriveError`]: out of range, no key (clear), or no-encrypt.
    pub fn derive_page_key(
        &self,
        keyid: u16,
        out: &mut [u8; PAGE_KEY_LEN],
    ) -> Result<KeyIdState, DeriveError> {
        let s = self.read();
        let Some(state) = s.states.get(usize::from(keyid)).copied() else {
            return Err(DeriveError::InvalidKeyId {
                keyid,
                max: self.max_keyid,
            });
        };
        let key = match (keyid, s.slots.get(usize::from(keyid))) {
            (0, _) => s.platform.as_ref(),
            (_, Some(Slot::Key(k))) => k.as_ref(),
            (_, Some(Slot::Bypass)) => return Err(DeriveError::NoEncrypt(keyid)),
            _ => None,
        };
        let Some(key) = key else {
            return Err(DeriveError::NotProgrammed(keyid));
        };
        out[..PAGE_KEY_LABEL.len()].copy_from_slice(PAGE_KEY_LABEL);
        out[48..50].copy_from_slice(&keyid.to_le_bytes());
        out[50..58].copy_from_slice(&state.generation.to_le_bytes());
        out[58..].fill(0);
        // 64 bytes is always a valid XTS unit; were it refused, the label
        // itself would go out as the key, so that is no outcome to ignore.
        key.encrypt_unit(PAGE_KEY_UNIT | u128::from(state.generation), out)
            .expect("a 64-byte unit is valid XTS");
        Ok(state)
    }

    /// Programs a KeyID of a table that governs no memory of its own (the
    /// engine's [`crate::Engine::program`] also writes back the KeyID's
    /// cached pages). `by` is recorded as [`KeyIdState::programmed_by`].
    /// Returns the KeyID's new state.
    ///
    /// # Errors
    /// A [`ProgramError`] whose [`ProgramError::status`] is the PCONFIG
    /// status; the KeyID is unchanged.
    pub fn program(
        &self,
        req: &KeyProgram<'_>,
        by: Option<u32>,
    ) -> Result<KeyIdState, ProgramError> {
        let _busy = self.begin()?;
        let p = self.prepare(req)?;
        Ok(self.install(req.keyid, p, by))
    }

    /// Takes the programming lock, or DEVICE_BUSY.
    pub(crate) fn begin(&self) -> Result<std::sync::MutexGuard<'_, ()>, ProgramError> {
        match self.busy.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(ProgramError::Busy),
        }
    }

    /// Validates a request and builds the new slot (keys in secret memory).
    pub(crate) fn prepare(&self, req: &KeyProgram<'_>) -> Result<Prepared, ProgramError> {
        if req.keyid == 0 || req.keyid > self.max_keyid {
            return Err(ProgramError::InvalidKeyId {
                keyid: req.keyid,
                max: self.max_keyid,
            });
        }
        let alg =
            || Algorithm::from_bits(req.enc_alg).ok_or(ProgramError::InvalidAlgorithm(req.enc_alg));

        match Command::from_code(req.command) {
            Some(Command::SetKeyDirect) => {
                let alg = alg()?;
                let n = alg.key_len();
                if req.key_field_1.len() != n || req.key_field_2.len() != n {
                    return Err(ProgramError::BadKey(format!(
                        "{alg} takes a {n}-byte data key and a {n}-byte tweak key, got {} and {}",
                        req.key_field_1.len(),
                        req.key_field_2.len()
                    )));
                }
                Ok(Prepared {
                    slot: Slot::Key(make_xts(&self.pool, req.key_field_1, req.key_field_2)?),
                    mode: KeyIdMode::Direct(alg),
                })
            }
            Some(Command::SetKeyRandom) => {
                let alg = alg()?;
                let n = alg.key_len();
                for f in [req.key_field_1, req.key_field_2] {
                    if !(f.is_empty() || f.len() == n || f.len() == 64) {
                        return Err(ProgramError::BadKey(format!(
                            "entropy fields must be empty, {n} bytes or 64 bytes, got {}",
                            f.len()
                        )));
                    }
                }
                let mut raw = self
                    .pool
                    .alloc_bytes(2 * n)
                    .map_err(|e| ProgramError::NoSecretMemory(e.to_string()))?;
                (self.entropy)(&mut raw).map_err(ProgramError::Entropy)?;
                let (a, b) = raw.split_at_mut(n);
                for (dst, src) in [(a, req.key_field_1), (b, req.key_field_2)] {
                    for (d, s) in dst.iter_mut().zip(src.iter()) {
                        *d ^= s;
                    }
                }
                let (a, b) = raw.split_at(n);
                if a == b {
                    return Err(ProgramError::Entropy(
                        "the DRNG returned equal key halves".into(),
                    ));
                }
                Ok(Prepared {
                    slot: Slot::Key(make_xts(&self.pool, a, b)?),
                    mode: KeyIdMode::Random(alg),
                })
            }
            Some(Command::ClearKey) => Ok(Prepared {
                slot: Slot::Platform,
                mode: KeyIdMode::Clear,
            }),
            Some(Command::NoEncrypt) => Ok(Prepared {
                slot: Slot::Bypass,
                mode: KeyIdMode::NoEncrypt,
            }),
            None => Err(ProgramError::UnknownCommand(req.command)),
        }
    }

    /// Installs a prepared slot and bumps the KeyID's generation; the old
    /// key is wiped as it drops. Returns the new state.
    pub(crate) fn install(&self, keyid: u16, p: Prepared, by: Option<u32>) -> KeyIdState {
        let mut s = self
            .slots
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = usize::from(keyid);
        if let Some(x) = s.slots.get_mut(i) {
            *x = p.slot;
        }
        match s.states.get_mut(i) {
            Some(st) => {
                st.mode = p.mode;
                st.generation += 1;
                st.programmed_by = by;
                *st
            }
            None => KeyIdState {
                keyid,
                mode: p.mode,
                generation: 0,
                programmed_by: by,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> KeyTable {
        KeyTable::new(
            2,
            Algorithm::AesXts128,
            Policy::allow(Level::Locked),
            Box::new(cpu_entropy),
        )
        .expect("table")
    }

    #[test]
    fn generation_counts_successful_requests_only() {
        let t = table();
        assert_eq!(t.max_keyid(), 3);
        let s0 = t.state(0).expect("KeyID 0");
        assert_eq!(s0.mode, KeyIdMode::Platform(Algorithm::AesXts128));
        assert_eq!(t.state(4), None);
        let st = t
            .program(
                &KeyProgram::random(2, Algorithm::AesXts256, &[], &[]),
                Some(7),
            )
            .expect("random");
        assert_eq!(
            (st.mode, st.generation, st.programmed_by),
            (KeyIdMode::Random(Algorithm::AesXts256), 1, Some(7))
        );
        // A refused request changes nothing (positive control: the next
        // accepted one does).
        let r = t.program(
            &KeyProgram::direct(2, Algorithm::AesXts128, &[1; 15], &[2; 16]),
            Some(8),
        );
        assert_eq!(r.map_err(|e| e.status()), Err(Status::InvalidProgCmd));
        assert_eq!(t.state(2).map(|s| s.generation), Some(1));
        let st = t.program(&KeyProgram::clear(2), Some(8)).expect("clear");
        assert_eq!(
            (st.mode, st.generation, st.programmed_by),
            (KeyIdMode::Clear, 2, Some(8))
        );
        let st = t.program(&KeyProgram::no_encrypt(2), None).expect("bypass");
        assert_eq!((st.mode, st.generation), (KeyIdMode::NoEncrypt, 3));
        assert_eq!(
            t.program(&KeyProgram::clear(0), Some(0))
                .map_err(|e| e.status()),
            Err(Status::InvalidKeyId)
        );
        assert_eq!(t.states()[0], s0, "KeyID 0 never changes");
        assert_eq!(t.states().len(), 4);
    }

    #[test]
    fn page_keys_are_shared_per_keyid_and_change_with_each_program() {
        let t = table();
        let mut a = [0u8; PAGE_KEY_LEN];
        let mut b = [0u8; PAGE_KEY_LEN];
        assert_eq!(
            t.derive_page_key(1, &mut a),
            Err(DeriveError::NotProgrammed(1))
        );
        assert_eq!(
            t.derive_page_key(4, &mut a),
            Err(DeriveError::InvalidKeyId { keyid: 4, max: 3 })
        );
        let (k1, k2) = ([0x11u8; 16], [0x22u8; 16]);
        t.program(&KeyProgram::direct(1, Algorithm::AesXts128, &k1, &k2), None)
            .expect("program 1");
        t.program(&KeyProgram::direct(2, Algorithm::AesXts128, &k1, &k2), None)
            .expect("program 2");
        let st = t.derive_page_key(1, &mut a).expect("derive 1");
        assert_eq!(st.generation, 1);
        t.derive_page_key(1, &mut b).expect("again");
        assert_eq!(a, b, "every process under a KeyID gets one key");
        // The same key under another KeyID gives another page key.
        t.derive_page_key(2, &mut b).expect("derive 2");
        assert_ne!(a, b);
        // Recomputed from the programmed key: the label under XTS.
        let mut want = [0u8; PAGE_KEY_LEN];
        want[..48].copy_from_slice(PAGE_KEY_LABEL);
        want[48..50].copy_from_slice(&1u16.to_le_bytes());
        want[50..58].copy_from_slice(&1u64.to_le_bytes());
        Xts::new(&k1, &k2)
            .expect("xts")
            .encrypt_unit(PAGE_KEY_UNIT | 1, &mut want)
            .expect("unit");
        assert_eq!(a, want);
        // Reprogrammed with the same key: a new generation, a new page key.
        t.program(&KeyProgram::direct(1, Algorithm::AesXts128, &k1, &k2), None)
            .expect("reprogram");
        t.derive_page_key(1, &mut b).expect("derive 1 again");
        assert_ne!(a, b);
        t.program(&KeyProgram::no_encrypt(3), None).expect("bypass");
        assert_eq!(t.derive_page_key(3, &mut a), Err(DeriveError::NoEncrypt(3)));
        t.program(&KeyProgram::clear(1), None).expect("clear");
        assert_eq!(
            t.derive_page_key(1, &mut a),
            Err(DeriveError::NotProgrammed(1))
        );
        assert!(t.derive_page_key(0, &mut a).is_ok(), "the platform key");
    }

    #[test]
    fn status_codes_round_trip_and_nothing_else_decodes() {
        for c in 0..=255u8 {
            match Status::from_code(c) {
                Some(s) => assert_eq!(s as u8, c),
                None => assert!(c > 5, "{c}"),
            }
        }
        for a in [Algorithm::AesXts128, Algorithm::AesXts256] {
            assert_eq!(a.name().parse::<Algorithm>(), Ok(a));
        }
        assert!("aes-128".parse::<Algorithm>().is_err());
    }
}
