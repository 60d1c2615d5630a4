//! Sector I/O on the backing file, with every sector encrypted and decrypted
//! by the vault.
//!
//! The server keeps one vault session: a shared area cut into one slot per
//! FUSE worker thread, each slot with its own vault lane(s). A read lands
//! straight in the slot (`pread` into the shared area), the vault decrypts it
//! there in place, and the FUSE reply is written from there: no copy beyond
//! what plain FUSE does. A write is copied once into the slot, encrypted in
//! place and written to the file from there. A run of sectors goes to the
//! vault as one ring entry per lane: the entry's XTS data-unit size is the
//! sector size and its tweak step the `plain64` distance between sectors,
//! so each sector is still its own data unit under dm-crypt's tweak (ring
//! format: `memveil_vault::ring`). With two lanes per slot a run of at
//! least two [`MIN_PIECE`]s is split in halves computed in parallel.
//!
//! In [`Cipher::Plain`](crate::binding::Cipher::Plain) mode the same code
//! path runs with a private buffer per slot and no cipher: the baseline of
//! the benchmarks.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::sync::{Condvar, Mutex, PoisonError};

use memveil_vault::client::{ClientError, LaneClient, Session};
use memveil_vault::proto::Mode;
use memveil_vault::ring::{status, Entry, Op};

use crate::geometry::Geometry;

/// Largest FUSE read or write the server asks for (the kernel's default
/// ceiling of 256 pages).
pub const MAX_IO: usize = 1 << 20;

/// Smallest piece of a request given to a lane of its own (with
/// `--lanes-per-thread` above 1): below it the hand-off to one more vault
/// lane costs more than the AES it moves there.
pub const MIN_PIECE: usize = 64 << 10;

/// What a slot's bytes live in.
enum Buf {
    /// Offset of the slot in the vault session's buffer.
    Shared(usize),
    /// A private buffer (plain mode).
    Heap(Vec<u8>),
}

/// One worker's share: a buffer and its lanes.
pub(crate) struct Slot {
    buf: Buf,
    lanes: Vec<LaneClient>,
    /// Batches in flight per lane (entries submitted, not yet waited for).
    pending: Vec<usize>,
}

/// The vault side of the engine.
pub(crate) struct VaultKey {
    /// The shared area.
    pub(crate) session: Session,
    /// Key id.
    pub(crate) key: u32,
    /// Key version (1 = first).
    pub(crate) version: u32,
    /// The control connection: the vault keeps the shared area and its
    /// lanes while it is open.
    #[allow(dead_code)]
    pub(crate) client: memveil_vault::Client,
}

/// The engine: sector I/O with or without the vault.
pub(crate) struct Sectors {
    geom: Geometry,
    vault: Option<VaultKey>,
    /// Bytes of one slot.
    cap: usize,
    slots: Mutex<Vec<Slot>>,
    freed: Condvar,
}

/// An error of sector I/O, as the FUSE reply will say it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum IoError {
    #[error("backing file: {0}")]
    File(#[from] io::Error),
    #[error("vault: {0}")]
    Vault(#[from] ClientError),
    #[error("vault refused sector batch: {}", status::describe(*.0))]
    Status(u32),
}

impl Sectors {
    /// A plain engine with `slots` private buffers.
    pub(crate) fn plain(geom: Geometry, slots: usize) -> Self {
        let cap = slot_bytes(geom);
        Self::build(
            geom,
            None,
            cap,
            (0..slots)
                .map(|_| Slot {
                    buf: Buf::Heap(vec![0u8; cap]),
                    lanes: Vec::new(),
                    pending: Vec::new(),
                })
                .collect(),
        )
    }

    /// A vault engine: the session's buffer holds `lanes.len() / per_slot`
    /// slots of [`slot_bytes`] each; each slot takes `per_slot` lanes.
    pub(crate) fn vault(
        geom: Geometry,
        key: VaultKey,
        lanes: Vec<LaneClient>,
        per_slot: usize,
    ) -> Self {
        let cap = slot_bytes(geom);
        let mut slots = Vec::new();
        let mut it = lanes.into_iter();
        let mut i = 0;
        loop {
            let ls: Vec<LaneClient> = it.by_ref().take(per_slot.max(1)).collect();
            if ls.is_empty() || (i + 1) * cap > key.session.len() {
                break;
            }
            slots.push(Slot {
                buf: Buf::Shared(i * cap),
                pending: vec![0; ls.len()],
                lanes: ls,
            });
            i += 1;
        }
        Self::build(geom, Some(key), cap, slots)
    }

    fn build(geom: Geometry, vault: Option<VaultKey>, cap: usize, slots: Vec<Slot>) -> Self {
        Self {
            geom,
            vault,
            cap,
            slots: Mutex::new(slots),
            freed: Condvar::new(),
        }
    }

    /// The geometry.
    pub(crate) fn geometry(&self) -> Geometry {
        self.geom
    }

    /// Bytes one slot holds: the most one call can move.
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    /// Runs `f` with a slot of its own (waits for one to be free).
    pub(crate) fn with_slot<R>(&self, f: impl FnOnce(&mut Slot) -> R) -> R {
        let mut slot = {
            let mut g = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                if let Some(s) = g.pop() {
                    break s;
                }
                g = self.freed.wait(g).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let r = f(&mut slot);
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(slot);
        self.freed.notify_one();
        r
    }

    /// Runs `f` on `[at, at+len)` of the slot's buffer.
    pub(crate) fn with_buf<R>(
        &self,
        slot: &mut Slot,
        at: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, IoError> {
        match (&mut slot.buf, &self.vault) {
            (Buf::Heap(v), _) => v
                .get_mut(at..at + len)
                .map(f)
                .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput).into()),
            (Buf::Shared(off), Some(k)) => Ok(k.session.with_mut(*off + at, len, f)?),
            (Buf::Shared(_), None) => Err(io::Error::from(io::ErrorKind::InvalidInput).into()),
        }
    }

    /// Reads the whole sectors `[start, start+len)` of the image into the
    /// slot's buffer and decrypts them there.
    pub(crate) fn load(
        &self,
        slot: &mut Slot,
        file: &File,
        start: u64,
        len: usize,
    ) -> Result<(), IoError> {
        self.with_buf(slot, 0, len, |b| read_full(file, b, start))??;
        self.cipher(slot, Op::Decrypt, start, len)
    }

    /// Encrypts the slot's first `len` bytes as the sectors at `start` and
    /// writes them to the image.
    pub(crate) fn store(
        &self,
        slot: &mut Slot,
        file: &File,
        start: u64,
        len: usize,
    ) -> Result<(), IoError> {
        self.cipher(slot, Op::Encrypt, start, len)?;
        self.with_buf(slot, 0, len, |b| file.write_all_at(b, start))??;
        Ok(())
    }

    /// Encrypts or decrypts the slot's first `len` bytes in place as the
    /// sectors starting at image byte `start`. The run goes to the vault as
    /// one ring entry per lane of the slot: the entry carries whole sectors,
    /// each its own XTS data unit (`unit` = the sector size, `step` =
    /// [`Geometry::tweak_step`]), so the vault computes the same bytes as
    /// one entry per sector. A run is cut into at most one piece per lane,
    /// each at least [`MIN_PIECE`] bytes, so the lanes work in parallel.
    fn cipher(&self, slot: &mut Slot, op: Op, start: u64, len: usize) -> Result<(), IoError> {
        let (Some(k), Buf::Shared(off)) = (&self.vault, &slot.buf) else {
            return Ok(());
        };
        let off = *off;
        let ss = self.geom.ss();
        let sectors = len / ss;
        if sectors == 0 {
            return Ok(());
        }
        let pieces = slot.lanes.len().min(len / MIN_PIECE).max(1);
        let per = sectors.div_ceil(pieces);
        let mut first_err: Option<IoError> = None;
        for (lane, s0) in (0..sectors).step_by(per).enumerate() {
            if slot.pending[lane] > 0 {
                let n = std::mem::take(&mut slot.pending[lane]);
                check(slot.lanes[lane].wait(n), &mut first_err);
            }
            let at = s0 * ss;
            let bytes = per.min(sectors - s0) * ss;
            let e = Entry {
                op,
                mode: Mode::Xts,
                key: k.key,
                version: k.version,
                buffer: slot.lanes[lane].buffer(),
                offset: (off + at) as u64,
                len: bytes as u64,
                iv: self.geom.tweak_at(start + at as u64),
                tag: [0; 16],
                aad_offset: 0,
                aad_len: 0,
                unit: self.geom.sector_size,
                step: self.geom.tweak_step(),
            };
            slot.lanes[lane].submit(&[e])?;
            slot.pending[lane] = 1;
        }
        for lane in 0..slot.lanes.len() {
            let n = std::mem::take(&mut slot.pending[lane]);
            if n > 0 {
                check(slot.lanes[lane].wait(n), &mut first_err);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// Keeps the first error of a batch's outcomes.
fn check(r: Result<Vec<memveil_vault::client::Outcome>, ClientError>, first: &mut Option<IoError>) {
    let e = match r {
        Ok(out) => match out.iter().find(|o| o.status != status::OK) {
            Some(o) => IoError::Status(o.status),
            None => return,
        },
        Err(e) => IoError::Vault(e),
    };
    if first.is_none() {
        *first = Some(e);
    }
}

/// Bytes of one slot: the largest FUSE request plus a sector on each side
/// (an unaligned request covers one more sector at each end).
#[must_use]
pub fn slot_bytes(geom: Geometry) -> usize {
    (MAX_IO + 2 * geom.ss()).div_ceil(4096) * 4096
}

/// `pread` until `buf` is full; bytes past the end of the file read as zeros.
fn read_full(file: &File, buf: &mut [u8], at: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], at + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
