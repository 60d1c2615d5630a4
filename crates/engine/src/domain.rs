//! Domains: VMs, containers or tenants that may use only their own KeyIDs and
//! frames, as a hypervisor's page tables enforce for TME-MK guests.

use std::ops::Range;

use crate::{Engine, EngineError, Pages, Runs, PAGE};

/// A domain's view of the engine.
pub struct Domain<'e> {
    engine: &'e Engine,
    name: String,
    keyids: Vec<u16>,
    frames: Vec<Range<usize>>,
}

impl Engine {
    /// A domain named `name` that may use `keyids` (its private KeyID and any
    /// shared ones) on `frames`. The engine itself is the manager and may use
    /// any KeyID on any frame.
    #[must_use]
    pub fn domain(&self, name: &str, keyids: &[u16], frames: &[Range<usize>]) -> Domain<'_> {
        Domain {
            engine: self,
            name: name.to_owned(),
            keyids: keyids.to_vec(),
            frames: frames.to_vec(),
        }
    }
}

impl<'e> Domain<'e> {
    /// The domain's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// An address of this domain: frame `frame`, byte `offset`, under `keyid`
    /// (C-bit set, so it is encrypted in SME mode too). A frame and offset
    /// beyond any address (their product overflows) give an address with
    /// every bit set, which every access refuses, never a wrapped one.
    #[must_use]
    pub fn address(&self, frame: usize, offset: usize, keyid: u16) -> u64 {
        let phys = frame
            .checked_mul(PAGE)
            .and_then(|p| p.checked_add(offset))
            .and_then(|p| u64::try_from(p).ok())
            .unwrap_or(u64::MAX);
        self.engine.address(phys, keyid, true)
    }

    fn check(&self, addr: u64, len: usize) -> Result<(), EngineError> {
        let a = self.engine.decode(addr)?;
        if !self.keyids.contains(&a.keyid) {
            return Err(EngineError::KeyIdNotPermitted {
                domain: self.name.clone(),
                keyid: a.keyid,
                allowed: self.keyids.clone(),
            });
        }
        let first = usize::try_from(a.phys).unwrap_or(usize::MAX) / PAGE;
        let last = usize::try_from(a.phys.saturating_add(len.max(1) as u64) - 1)
            .unwrap_or(usize::MAX)
            / PAGE;
        let inside = |f: usize| self.frames.iter().any(|r| r.contains(&f));
        if let Some(frame) = (first..=last).find(|&f| !inside(f)) {
            return Err(EngineError::FrameNotMapped {
                domain: self.name.clone(),
                frame,
            });
        }
        Ok(())
    }

    /// Reads through the domain's mapping.
    ///
    /// # Errors
    /// [`EngineError::KeyIdNotPermitted`] for another domain's KeyID,
    /// [`EngineError::FrameNotMapped`] for frames not mapped to the domain.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), EngineError> {
        self.check(addr, buf.len())?;
        self.engine.read(addr, buf)
    }

    /// Writes through the domain's mapping.
    ///
    /// # Errors
    /// As [`Domain::read`].
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), EngineError> {
        self.check(addr, data.len())?;
        self.engine.write(addr, data)
    }

    /// Zero-copy access through the domain's mapping ([`Engine::pages`]).
    ///
    /// # Errors
    /// As [`Domain::read`] for each page; as [`Engine::pages`].
    pub fn pages<const R: usize, const W: usize>(
        &self,
        reads: [u64; R],
        writes: [u64; W],
    ) -> Result<Pages<'e, R, W>, EngineError> {
        for &a in reads.iter().chain(&writes) {
            self.check(a, PAGE)?;
        }
        self.engine.pages(reads, writes)
    }

    /// Zero-copy access to runs through the domain's mapping
    /// ([`Engine::runs`]).
    ///
    /// # Errors
    /// As [`Domain::read`] for each run; as [`Engine::runs`].
    pub fn runs<const R: usize, const W: usize>(
        &self,
        reads: [u64; R],
        writes: [u64; W],
        pages: usize,
    ) -> Result<Runs<'e, R, W>, EngineError> {
        for &a in reads.iter().chain(&writes) {
            self.check(a, pages.max(1) * PAGE)?;
        }
        self.engine.runs(reads, writes, pages)
    }
}
