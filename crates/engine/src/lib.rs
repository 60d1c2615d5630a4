//! A software multi-key memory-encryption engine: the model of Intel TME-MK
//! (and TME), AMD SME and TSME, as docs/engine.md describes them.
//!
//! - **Physical memory** of N 4 KiB frames holds ciphertext (the "DRAM"). Each
//!   page is encrypted with AES-XTS (128-bit keys by default) whose tweak is the
//!   page's *physical address*, so the same plaintext at two addresses gives
//!   two ciphertexts and ciphertext moved to another frame decrypts to garbage.
//! - **Addresses carry the KeyID** in the top `keyid_bits` bits of a 46-bit
//!   physical address (as MKTME steals the top bits of MAXPHYADDR); in SME mode
//!   bit 47 is the C-bit that marks a page encrypted. See [`Address`].
//! - **The key table** has `2^keyid_bits` KeyIDs. KeyID 0 is the platform (TME)
//!   key, random at start-up and never readable. Others are programmed with the
//!   four PCONFIG `MKTME_KEY_PROGRAM` commands ([`Command`]) and answer with its
//!   six status codes ([`Status`]). Keys live only in secret memory; no API
//!   returns key bytes. An unprogrammed or cleared KeyID uses the platform key.
//! - **A bounded write-back plaintext cache** (the analogue of the CPU caches,
//!   kept in secret memory) serves byte-granular reads and writes; a page is
//!   decrypted when it enters and encrypted when it leaves.
//! - **Aliasing rule.** Hardware does not keep one frame coherent across two
//!   KeyIDs; software must flush. memveil defines it instead: the cache holds a
//!   frame under one (KeyID, encryption) view at a time; touching the frame
//!   through another view first writes back and evicts the old one (an implicit
//!   flush, counted in [`Stats::alias_flushes`]). So no access ever returns
//!   stale plaintext: it returns exactly what a flush-then-access would give
//!   (garbage when the keys differ).
//! - **Reprogramming a KeyID** first writes back and evicts that KeyID's cached
//!   pages under the old key. Data written under a key that is then cleared or
//!   replaced stays ciphertext under a key that no longer exists: crypto-erase.
//! - **Domains** ([`Domain`]) are views that may use only their own KeyIDs (a
//!   VM's private KeyID and the KeyIDs of pages it shares); the engine itself
//!   is the manager (hypervisor) and may use any.
//! - **Zero-copy access.** Besides byte-granular [`Engine::read`] and
//!   [`Engine::write`], [`Engine::pages`] lends cached pages in place (a
//!   [`Pages`] guard borrows the plaintext frames while the cache holds them),
//!   so work on data inside the plaintext cache costs what plain memory
//!   costs, as it does on hardware; a miss still decrypts the page into the
//!   cache and a dirty eviction still encrypts it.
//!
//! What this crate refuses to do: return or print key bytes, accept XTS keys
//! with equal halves, keep keys outside secret memory without the caller's
//! explicit acceptance of the weaker level, or panic on any address, KeyID,
//! command or key it is given.
#![forbid(unsafe_code)]

mod cache;
mod domain;
mod keytable;

pub use cache::Stats;
pub use domain::Domain;
pub use keytable::{
    cpu_entropy, Algorithm, Command, DeriveError, EntropyFn, KeyIdMode, KeyIdState, KeyProgram,
    KeyTable, ProgramError, Status, PAGE_KEY_LEN,
};

use std::sync::{Mutex, MutexGuard, PoisonError};

use memveil_secmem::{Level, Policy, SecmemError};

use cache::Memory;

/// Bytes per page (frame).
pub const PAGE: usize = 4096;
/// Physical address width modelled (MAXPHYADDR of an Ice Lake server).
pub const MAX_PHYS_BITS: u32 = 46;
/// Position of the SME C-bit (above MAXPHYADDR, as on AMD EPYC parts).
pub const C_BIT: u32 = 47;

/// Whether memory is encrypted page by page (SME) or as a whole (TSME/TME).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Per-page: a page is encrypted only when its address has the C-bit set;
    /// the KeyID then picks the key. Pages without the C-bit are plaintext.
    Sme,
    /// Every page is encrypted whatever its C-bit (TSME; also Intel TME/TME-MK,
    /// where KeyID 0 is the platform key). The default.
    Tsme,
}

/// Engine configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Physical memory in 4 KiB frames.
    pub frames: usize,
    /// KeyID bits (1..=15). Hardware: 6 on Ice Lake servers (63 usable KeyIDs).
    pub keyid_bits: u32,
    /// SME or TSME.
    pub mode: Mode,
    /// Capacity of the plaintext cache in pages.
    pub cache_pages: usize,
    /// Cipher of the platform key (KeyID 0).
    pub platform_algorithm: Algorithm,
    /// Which secret-memory levels are accepted for keys and the cache.
    pub policy: Policy,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            frames: 1024,
            keyid_bits: 6,
            mode: Mode::Tsme,
            cache_pages: 64,
            platform_algorithm: Algorithm::AesXts128,
            policy: Policy::secret_only(),
        }
    }
}

/// Errors of the engine's data path and set-up (key programming answers with
/// a [`Status`] instead, as PCONFIG does).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// An address beyond installed memory.
    #[error("address {addr:#x}: physical address {phys:#x} is beyond installed memory ({limit:#x} bytes)")]
    AddressOutOfRange {
        /// The full address given.
        addr: u64,
        /// Its physical part.
        phys: u64,
        /// Installed bytes.
        limit: u64,
    },
    /// Address bits that are neither memory, KeyID nor (in SME) the C-bit.
    #[error("address {addr:#x} sets reserved bits {bits:#x} (KeyID occupies bits {lo}..{hi}, C-bit is bit {c})")]
    ReservedBits {
        /// The address.
        addr: u64,
        /// The offending bits.
        bits: u64,
        /// First KeyID bit.
        lo: u32,
        /// One past the last KeyID bit.
        hi: u32,
        /// C-bit position.
        c: u32,
    },
    /// A domain used a KeyID it was not given.
    #[error("domain {domain:?} may not use KeyID {keyid} (its KeyIDs: {allowed:?})")]
    KeyIdNotPermitted {
        /// Domain name.
        domain: String,
        /// The KeyID in the address.
        keyid: u16,
        /// KeyIDs it may use.
        allowed: Vec<u16>,
    },
    /// A domain touched a frame that is not mapped to it.
    #[error("domain {domain:?} has no mapping for frame {frame}")]
    FrameNotMapped {
        /// Domain name.
        domain: String,
        /// The frame.
        frame: usize,
    },
    /// A configuration value out of range.
    #[error("invalid engine configuration: {0}")]
    Config(String),
    /// Secret memory for keys or the cache could not be had.
    #[error(transparent)]
    Secmem(#[from] SecmemError),
    /// The platform key could not be generated.
    #[error("platform key: {0}")]
    PlatformKey(String),
    /// Zero-copy access was asked for at an address inside a page.
    #[error("address {addr:#x} is not page-aligned: zero-copy access lends whole {PAGE}-byte pages (use read/write for other ranges)")]
    Unaligned {
        /// The address.
        addr: u64,
    },
    /// One zero-copy request named the same frame twice (possibly through
    /// two KeyIDs: the cache holds a frame under one view at a time).
    #[error("frame {frame} asked for twice in one zero-copy request: ask for it once, as written if it is written")]
    SameFrameTwice {
        /// The frame.
        frame: usize,
    },
    /// Runs whose pages would share cache slots (each run sits at the slots
    /// its first frame maps to: frame number modulo the cache size).
    #[error("runs starting at frames {a} and {b} would overlap in the plaintext cache (each run sits at its first frame modulo the cache's {cache} pages); lend them in two requests")]
    RunsOverlap {
        /// First frame of one run.
        a: usize,
        /// First frame of the other.
        b: usize,
        /// Pages the cache holds.
        cache: usize,
    },
    /// A run that would pass the end of the cache's slots.
    #[error("a run of {pages} pages from frame {frame} passes the end of the plaintext cache ({cache} pages; a run sits at its first frame modulo that): shorten or split it")]
    RunPastEnd {
        /// First frame of the run.
        frame: usize,
        /// Its length in pages.
        pages: usize,
        /// Pages the cache holds.
        cache: usize,
    },
    /// One zero-copy request asked for more pages than the cache holds.
    #[error("{asked} pages asked for at once, but the plaintext cache holds {cache}")]
    TooManyPages {
        /// Pages asked for.
        asked: usize,
        /// Pages the cache holds.
        cache: usize,
    },
}

/// A decoded engine address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Address {
    /// Physical byte address (without KeyID and C-bit).
    pub phys: u64,
    /// KeyID.
    pub keyid: u16,
    /// C-bit (meaningful in SME mode).
    pub c_bit: bool,
}

/// The engine: key table, physical memory and plaintext cache.
pub struct Engine {
    cfg: Config,
    keys: KeyTable,
    mem: Mutex<Memory>,
}

impl Engine {
    /// Builds an engine: generates the platform key, allocates the key table and
    /// the plaintext cache in secret memory, and fills memory with the platform
    /// key's encryption of zero pages lazily (frames start as zeros on "DRAM",
    /// which decrypt to garbage under any key, as freshly powered DRAM does).
    ///
    /// # Errors
    /// [`EngineError::Config`] for out-of-range settings; [`EngineError::Secmem`]
    /// when secret memory is unavailable under the policy or `RLIMIT_MEMLOCK`
    /// is exhausted.
    pub fn new(cfg: Config) -> Result<Self, EngineError> {
        Self::with_entropy(cfg, Box::new(cpu_entropy))
    }

    /// [`Engine::new`] with another key-entropy source (e.g. memveil-drng's
    /// conditioned output, or a failing source in tests).
    ///
    /// # Errors
    /// As [`Engine::new`].
    pub fn with_entropy(cfg: Config, entropy: EntropyFn) -> Result<Self, EngineError> {
        // The table checks keyid_bits (1..=15) before anything uses it.
        let keys = KeyTable::new(cfg.keyid_bits, cfg.platform_algorithm, cfg.policy, entropy)?;
        if cfg.frames == 0 || cfg.cache_pages == 0 {
            return Err(EngineError::Config(
                "frames and cache_pages must be at least 1".into(),
            ));
        }
        let mem_bits = MAX_PHYS_BITS - cfg.keyid_bits;
        let bytes = u64::try_from(cfg.frames)
            .ok()
            .and_then(|f| f.checked_mul(PAGE as u64))
            .ok_or_else(|| EngineError::Config("frames overflow".into()))?;
        if bytes > 1u64 << mem_bits {
            return Err(EngineError::Config(format!(
                "{} frames do not fit the {mem_bits} address bits left by {} KeyID bits",
                cfg.frames, cfg.keyid_bits
            )));
        }
        let mem = Memory::new(cfg.frames, cfg.cache_pages, cfg.policy)?;
        Ok(Self {
            cfg,
            keys,
            mem: Mutex::new(mem),
        })
    }

    /// The configuration in force.
    #[must_use]
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The protection level of the memory holding keys and plaintext.
    #[must_use]
    pub fn level(&self) -> Level {
        self.keys.level()
    }

    /// Highest KeyID (`2^bits - 1`); KeyIDs 1..=max are programmable.
    #[must_use]
    pub fn max_keyid(&self) -> u16 {
        self.keys.max_keyid()
    }

    /// Builds an address from its parts (no range check; accesses check).
    #[must_use]
    pub fn address(&self, phys: u64, keyid: u16, c_bit: bool) -> u64 {
        let shift = MAX_PHYS_BITS - self.cfg.keyid_bits;
        phys | (u64::from(keyid) << shift) | (u64::from(c_bit) << C_BIT)
    }

    /// Splits an address into physical part, KeyID and C-bit.
    ///
    /// # Errors
    /// [`EngineError::ReservedBits`] for bits above the C-bit or between
    /// MAXPHYADDR and the C-bit.
    pub fn decode(&self, addr: u64) -> Result<Address, EngineError> {
        let lo = MAX_PHYS_BITS - self.cfg.keyid_bits;
        let allowed = ((1u64 << MAX_PHYS_BITS) - 1) | (1 << C_BIT);
        let bad = addr & !allowed;
        if bad != 0 {
            return Err(EngineError::ReservedBits {
                addr,
                bits: bad,
                lo,
                hi: MAX_PHYS_BITS,
                c: C_BIT,
            });
        }
        let keyid = u16::try_from((addr >> lo) & ((1 << self.cfg.keyid_bits) - 1)).unwrap_or(0);
        Ok(Address {
            phys: addr & ((1 << lo) - 1),
            keyid,
            c_bit: addr >> C_BIT & 1 == 1,
        })
    }

    /// Programs a KeyID, as PCONFIG's `MKTME_KEY_PROGRAM` leaf does. Cached
    /// pages of that KeyID are written back under the old key first.
    ///
    /// # Errors
    /// A [`ProgramError`] whose [`ProgramError::status`] is the PCONFIG status.
    pub fn program(&self, req: &KeyProgram<'_>) -> Result<(), ProgramError> {
        let _busy = self.keys.begin()?;
        let prepared = self.keys.prepare(req)?;
        // Hold the memory lock across write-back and swap, so no page of this
        // KeyID can enter the cache under the old key in between.
        let mut m = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        m.flush_keyid(&self.keys, req.keyid);
        self.keys.install(req.keyid, prepared, None);
        Ok(())
    }

    /// Every KeyID's state (mode, algorithm, generation), KeyID 0 first.
    #[must_use]
    pub fn key_states(&self) -> Vec<KeyIdState> {
        self.keys.states()
    }

    /// `program` answering with the raw status code, as PCONFIG puts it in RAX.
    pub fn program_status(&self, req: &KeyProgram<'_>) -> Status {
        match self.program(req) {
            Ok(()) => Status::ProgSuccess,
            Err(e) => e.status(),
        }
    }

    /// Installed bytes (`frames * PAGE` fits: checked in `with_entropy`).
    fn limit(&self) -> u64 {
        (self.cfg.frames * PAGE) as u64
    }

    fn check(&self, addr: u64, len: usize) -> Result<Address, EngineError> {
        let a = self.decode(addr)?;
        let limit = self.limit();
        let end = a.phys.checked_add(len as u64);
        if end.is_none_or(|e| e > limit) {
            return Err(EngineError::AddressOutOfRange {
                addr,
                phys: a.phys,
                limit,
            });
        }
        Ok(a)
    }

    /// Checks that frames `[first, first + count)` exist, on frame numbers:
    /// `first * PAGE` computed first would wrap in release builds (frame
    /// 2^52 became address 0, i.e. frame 0).
    fn check_frames(&self, first: usize, count: usize) -> Result<(), EngineError> {
        if first
            .checked_add(count)
            .is_some_and(|end| end <= self.cfg.frames)
        {
            return Ok(());
        }
        let phys = u64::try_from(first)
            .ok()
            .and_then(|f| f.checked_mul(PAGE as u64))
            .unwrap_or(u64::MAX);
        Err(EngineError::AddressOutOfRange {
            addr: phys,
            phys,
            limit: self.limit(),
        })
    }

    fn encrypted(&self, a: &Address) -> bool {
        match self.cfg.mode {
            Mode::Tsme => true,
            Mode::Sme => a.c_bit,
        }
    }

    /// Reads `buf.len()` bytes at `addr` (any alignment, may cross pages).
    /// Reading through the wrong KeyID gives garbage, never an error.
    ///
    /// # Errors
    /// Address errors only.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), EngineError> {
        let a = self.check(addr, buf.len())?;
        let enc = self.encrypted(&a);
        let mut m = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        m.read(&self.keys, a.phys, a.keyid, enc, buf);
        Ok(())
    }

    /// Writes `data` at `addr` (any alignment, may cross pages).
    ///
    /// # Errors
    /// Address errors only.
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), EngineError> {
        let a = self.check(addr, data.len())?;
        let enc = self.encrypted(&a);
        let mut m = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        m.write(&self.keys, a.phys, a.keyid, enc, data);
        Ok(())
    }

    /// Zero-copy access: brings the pages at `reads` and `writes` (page-aligned
    /// addresses, each frame once, at most the cache's size) into the
    /// plaintext cache, decrypting those not there, and lends them in place
    /// until the guard drops. The written pages are marked dirty and are
    /// encrypted back when they leave the cache; the read ones are not.
    ///
    /// The guard holds the engine's memory lock: every other access waits
    /// until it drops. Keep it for one piece of work (a STREAM kernel over a
    /// page, a page copy), not for a whole program.
    ///
    /// # Errors
    /// Address errors; [`EngineError::Unaligned`],
    /// [`EngineError::SameFrameTwice`], [`EngineError::TooManyPages`].
    pub fn pages<const R: usize, const W: usize>(
        &self,
        reads: [u64; R],
        writes: [u64; W],
    ) -> Result<Pages<'_, R, W>, EngineError> {
        let (rq, wq) = self.requests(&reads, &writes, 1)?;
        let mut mem = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        let (reads, writes) = mem
            .pin(&self.keys, rq, wq)
            .map_err(|frame| EngineError::SameFrameTwice { frame })?;
        Ok(Pages { mem, reads, writes })
    }

    /// Zero-copy access to runs: like [`Engine::pages`], but each address
    /// starts a run of `pages` consecutive pages, lent as one contiguous
    /// slice. The engine keeps such runs in consecutive cache slots
    /// (placing them there on the way in, by swapping slots), so a program
    /// working through its memory in runs pays one lookup per page and
    /// nothing per byte, and walks through the cache in address order as
    /// the processor's prefetchers expect.
    ///
    /// # Errors
    /// As [`Engine::pages`] (for every page of every run);
    /// [`EngineError::RunsOverlap`] and [`EngineError::RunPastEnd`] for
    /// runs that cannot each have their own slots.
    pub fn runs<const R: usize, const W: usize>(
        &self,
        reads: [u64; R],
        writes: [u64; W],
        pages: usize,
    ) -> Result<Runs<'_, R, W>, EngineError> {
        let pages = pages.max(1);
        let cache = self.cfg.cache_pages.min(self.cfg.frames);
        let (rq, wq) = self.requests(&reads, &writes, pages)?;
        let mut mem = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        let (reads, writes) = mem
            .pin_runs(&self.keys, rq, wq, pages)
            .map_err(|e| match e {
                cache::RunError::Twice { frame } => EngineError::SameFrameTwice { frame },
                cache::RunError::Overlap { a, b } => EngineError::RunsOverlap { a, b, cache },
                cache::RunError::PastEnd { frame } => EngineError::RunPastEnd {
                    frame,
                    pages,
                    cache,
                },
            })?;
        Ok(Runs {
            mem,
            reads,
            writes,
            pages,
        })
    }

    /// Checks the addresses of a zero-copy request (each starting `pages`
    /// pages) and turns them into (frame, KeyID, encrypted).
    #[allow(clippy::type_complexity)]
    fn requests<const R: usize, const W: usize>(
        &self,
        reads: &[u64; R],
        writes: &[u64; W],
        pages: usize,
    ) -> Result<([(usize, u16, bool); R], [(usize, u16, bool); W]), EngineError> {
        let cache = self.cfg.cache_pages.min(self.cfg.frames);
        let total = (R + W).saturating_mul(pages);
        if total > cache {
            return Err(EngineError::TooManyPages {
                asked: total,
                cache,
            });
        }
        let mut rq = [(0usize, 0u16, false); R];
        let mut wq = [(0usize, 0u16, false); W];
        for (q, &addr) in rq
            .iter_mut()
            .chain(wq.iter_mut())
            .zip(reads.iter().chain(writes))
        {
            let a = self.check(addr, pages * PAGE)?;
            if a.phys % PAGE as u64 != 0 {
                return Err(EngineError::Unaligned { addr });
            }
            let frame = usize::try_from(a.phys).unwrap_or(usize::MAX) / PAGE;
            *q = (frame, a.keyid, self.encrypted(&a));
        }
        Ok((rq, wq))
    }

    /// [`Engine::pages`] for one page read in place.
    ///
    /// # Errors
    /// As [`Engine::pages`].
    pub fn page(&self, addr: u64) -> Result<Pages<'_, 1, 0>, EngineError> {
        self.pages([addr], [])
    }

    /// [`Engine::pages`] for one page written in place.
    ///
    /// # Errors
    /// As [`Engine::pages`].
    pub fn page_mut(&self, addr: u64) -> Result<Pages<'_, 0, 1>, EngineError> {
        self.pages([], [addr])
    }

    /// Writes back every dirty cached page and empties the cache (WBINVD).
    pub fn flush(&self) {
        let mut m = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        m.flush_all(&self.keys);
    }

    /// What a physical attacker sees: the raw bytes of `frame` in "DRAM"
    /// (ciphertext, or plaintext for bypassed pages). Dirty cached data is not
    /// included, as a cold-boot image would not include CPU caches.
    ///
    /// # Errors
    /// [`EngineError::AddressOutOfRange`] for a frame beyond memory.
    pub fn dram_frame(&self, frame: usize) -> Result<Vec<u8>, EngineError> {
        self.check_frames(frame, 1)?;
        let m = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(m.dram(frame).to_vec())
    }

    /// A physical attacker's relocation: copies the raw "DRAM" bytes of frame
    /// `src` over frame `dst`, behind the cache's back (any cached copy of
    /// `dst` is dropped, as a DMA write would invalidate it).
    ///
    /// # Errors
    /// [`EngineError::AddressOutOfRange`] for frames beyond memory.
    pub fn dram_copy(&self, src: usize, dst: usize) -> Result<(), EngineError> {
        self.check_frames(src, 1)?;
        self.check_frames(dst, 1)?;
        let mut m = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        m.dram_copy(src, dst);
        Ok(())
    }

    /// Encrypts frames `[first, first+count)` in place under `keyid` with
    /// `threads` threads, treating their DRAM content as plaintext: the
    /// manager's bulk conversion of pages to a domain's key. Cached copies are
    /// written back first.
    ///
    /// # Errors
    /// Address errors.
    pub fn encrypt_frames(
        &self,
        first: usize,
        count: usize,
        keyid: u16,
        threads: usize,
    ) -> Result<(), EngineError> {
        self.bulk(first, count, keyid, threads, true)
    }

    /// The inverse of [`Engine::encrypt_frames`]: decrypts frames in place
    /// under `keyid`, leaving plaintext in DRAM (conversion to bypass).
    ///
    /// # Errors
    /// Address errors.
    pub fn decrypt_frames(
        &self,
        first: usize,
        count: usize,
        keyid: u16,
        threads: usize,
    ) -> Result<(), EngineError> {
        self.bulk(first, count, keyid, threads, false)
    }

    fn bulk(
        &self,
        first: usize,
        count: usize,
        keyid: u16,
        threads: usize,
        enc: bool,
    ) -> Result<(), EngineError> {
        self.check_frames(first, count)?;
        if keyid > self.max_keyid() {
            return Err(EngineError::Config(format!(
                "KeyID {keyid} above {}",
                self.max_keyid()
            )));
        }
        let mut m = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        m.flush_all(&self.keys);
        m.bulk(&self.keys, first, count, keyid, threads.max(1), enc);
        Ok(())
    }

    /// Cache and cipher counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        let m = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        m.stats()
    }

    /// Bytes the engine uses beyond the data itself: key table and cache
    /// (secret memory) and bookkeeping.
    #[must_use]
    pub fn overhead(&self) -> Overhead {
        let m = self.mem.lock().unwrap_or_else(PoisonError::into_inner);
        Overhead {
            key_table_bytes: self.keys.secret_bytes(),
            cache_bytes: m.cache_bytes(),
            metadata_bytes: m.metadata_bytes() + std::mem::size_of::<Self>(),
        }
    }
}

/// Pages lent in place by [`Engine::pages`]: `R` read, `W` written. While
/// the guard lives the cache holds them (nothing can evict them: the guard
/// holds the engine's memory lock) and every other access to the engine
/// waits.
pub struct Pages<'e, const R: usize, const W: usize> {
    mem: MutexGuard<'e, Memory>,
    reads: [usize; R],
    writes: [usize; W],
}

impl<const R: usize, const W: usize> Pages<'_, R, W> {
    /// The plaintext of the pages, in the order asked for: the read ones
    /// shared, the written ones exclusive.
    pub fn split(&mut self) -> ([&[u8; PAGE]; R], [&mut [u8; PAGE]; W]) {
        self.mem.slots(&self.reads, &self.writes)
    }
}

impl Pages<'_, 1, 0> {
    /// The page's plaintext.
    #[must_use]
    pub fn bytes(&self) -> &[u8; PAGE] {
        self.mem.slot(self.reads[0])
    }
}

impl Pages<'_, 0, 1> {
    /// The page's plaintext, to change in place.
    pub fn bytes_mut(&mut self) -> &mut [u8; PAGE] {
        let ([], [p]) = self.mem.slots(&[], &self.writes);
        p
    }
}

/// Runs of pages lent in place by [`Engine::runs`]: `R` read, `W` written,
/// each one contiguous slice. As [`Pages`], the guard holds the engine's
/// memory lock.
pub struct Runs<'e, const R: usize, const W: usize> {
    mem: MutexGuard<'e, Memory>,
    reads: [usize; R],
    writes: [usize; W],
    pages: usize,
}

impl<const R: usize, const W: usize> Runs<'_, R, W> {
    /// The plaintext of the runs, in the order asked for, `pages * PAGE`
    /// bytes each: the read ones shared, the written ones exclusive.
    pub fn split(&mut self) -> ([&[u8]; R], [&mut [u8]; W]) {
        self.mem.ranges(&self.reads, &self.writes, self.pages)
    }
}

/// Memory the engine uses beyond the data.
#[derive(Debug, Clone, Copy)]
pub struct Overhead {
    /// Secret memory of the key table (all KeyIDs and the platform key).
    pub key_table_bytes: usize,
    /// Secret memory of the plaintext cache.
    pub cache_bytes: usize,
    /// Ordinary memory for cache tags and counters.
    pub metadata_bytes: usize,
}

impl Overhead {
    /// Total bytes.
    #[must_use]
    pub fn total(&self) -> usize {
        self.key_table_bytes + self.cache_bytes + self.metadata_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn four_frames() -> Engine {
        Engine::new(Config {
            frames: 4,
            policy: Policy::allow(Level::Locked),
            ..Config::default()
        })
        .expect("engine")
    }

    #[test]
    fn concurrent_programming_is_device_busy() {
        let e = four_frames();
        let held = e.keys.begin().expect("first programmer");
        assert_eq!(e.program_status(&KeyProgram::clear(1)), Status::DeviceBusy);
        drop(held);
        assert_eq!(e.program_status(&KeyProgram::clear(1)), Status::ProgSuccess);
    }

    /// Regression: `frame * PAGE` was computed unchecked, and wraps in
    /// release builds: frame 2^52 became address 0, so dram_frame(2^52)
    /// returned frame 0, dram_copy and the bulk conversions touched frame 0,
    /// and a domain's address for it pointed into frame 0.
    #[test]
    fn frame_numbers_that_overflow_are_refused_not_wrapped() {
        let e = four_frames();
        e.write(0, b"frame zero").expect("write");
        e.flush();
        let wraps = 1usize << 52; // wraps * PAGE == 2^64
        let huge = [wraps, wraps + 1, usize::MAX / PAGE + 1, usize::MAX];
        for f in huge {
            assert!(
                matches!(e.dram_frame(f), Err(EngineError::AddressOutOfRange { .. })),
                "dram_frame({f:#x})"
            );
            assert!(e.dram_copy(f, 1).is_err(), "dram_copy({f:#x}, 1)");
            assert!(e.dram_copy(1, f).is_err(), "dram_copy(1, {f:#x})");
            assert!(
                e.encrypt_frames(f, 1, 1, 1).is_err(),
                "encrypt_frames({f:#x})"
            );
            assert!(
                e.decrypt_frames(1, f, 1, 1).is_err(),
                "decrypt_frames(1, count {f:#x})"
            );
            let d = e.domain("vm", &[1], &[0..2, 2..4]);
            let mut b = [0u8; 10];
            assert!(
                d.read(d.address(f, 0, 1), &mut b).is_err(),
                "domain read of frame {f:#x}"
            );
        }
        // Frame 1 was never written (a relocation from "frame 2^52", which
        // was frame 0, would have put frame 0's ciphertext there), and the
        // last frame and an empty range at the end are still in range.
        assert_eq!(e.dram_frame(1).expect("frame 1"), vec![0u8; PAGE]);
        assert!(e.dram_frame(3).is_ok() && e.dram_frame(4).is_err());
        assert!(e.encrypt_frames(4, 0, 1, 1).is_ok());
    }
}
