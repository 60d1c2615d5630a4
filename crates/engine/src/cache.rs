//! Physical memory ("DRAM", ciphertext) and the bounded write-back plaintext
//! cache in secret memory.

use memveil_cipher::Xts;
use memveil_secmem::{Policy, SecretRegion};

use crate::keytable::KeyTable;
use crate::{EngineError, PAGE};

/// Counters of the cache and the cipher.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Accesses served from the cache (per page touched).
    pub hits: u64,
    /// Accesses that brought a page into the cache.
    pub misses: u64,
    /// Pages decrypted into the cache.
    pub fills: u64,
    /// Whole-page writes that skipped the fill.
    pub full_page_writes: u64,
    /// Dirty pages encrypted back to memory.
    pub writebacks: u64,
    /// Pages pushed out to make room.
    pub evictions: u64,
    /// Implicit flushes because a frame was touched through a second KeyID
    /// (or encryption view) while cached under another.
    pub alias_flushes: u64,
    /// Pages converted by the bulk operations.
    pub bulk_pages: u64,
    /// Pages currently in plaintext in the cache.
    pub cached_pages: u64,
    /// Frames of memory.
    pub frames: u64,
}

impl Stats {
    /// Fraction of memory that is plaintext right now (RamCrypt's figure is
    /// one minus this).
    #[must_use]
    pub fn plaintext_fraction(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let f = self.cached_pages as f64 / self.frames.max(1) as f64;
        f
    }
}

/// Why runs could not be lent (see [`Memory::pin_runs`]).
pub(crate) enum RunError {
    Twice { frame: usize },
    Overlap { a: usize, b: usize },
    PastEnd { frame: usize },
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Tag {
    frame: usize,
    keyid: u16,
    enc: bool,
}

pub(crate) struct Memory {
    dram: Vec<u8>,
    cache: SecretRegion,
    tags: Vec<Option<Tag>>,
    dirty: Vec<bool>,
    referenced: Vec<bool>,
    /// Slot + 1 of each frame in the cache, 0 when it is not: an array, not
    /// a hash map, because the zero-copy path looks frames up at the rate
    /// a program touches pages.
    index: Vec<u32>,
    /// Per frame, the number of the last zero-copy request that named it:
    /// finds a frame named twice in one request in one pass.
    stamp: Vec<u32>,
    request: u32,
    /// Slots that may hold nothing, so a miss never scans for one: every
    /// empty slot is listed once; a listed slot may have been taken since
    /// (as its frames' home, see `victim`) and is skipped then.
    free: Vec<usize>,
    listed: Vec<bool>,
    hand: usize,
    stats: Stats,
}

fn tweak(frame: usize) -> u128 {
    (frame as u128) * (PAGE as u128)
}

fn seal(x: Option<&Xts>, frame: usize, page: &mut [u8]) {
    if let Some(x) = x {
        // A page is 4096 bytes, above XTS's 16-byte minimum: cannot fail.
        let _ = x.encrypt_unit(tweak(frame), page);
    }
}

fn open(x: Option<&Xts>, frame: usize, page: &mut [u8]) {
    if let Some(x) = x {
        let _ = x.decrypt_unit(tweak(frame), page);
    }
}

impl Memory {
    pub(crate) fn new(
        frames: usize,
        cache_pages: usize,
        policy: Policy,
    ) -> Result<Self, EngineError> {
        let cache_pages = cache_pages.min(frames);
        Ok(Self {
            dram: vec![0; frames * PAGE],
            cache: SecretRegion::new(cache_pages * PAGE, policy)?,
            tags: vec![None; cache_pages],
            dirty: vec![false; cache_pages],
            referenced: vec![false; cache_pages],
            index: vec![0; frames],
            stamp: vec![0; frames],
            request: 0,
            free: (0..cache_pages).rev().collect(),
            listed: vec![true; cache_pages],
            hand: 0,
            stats: Stats {
                frames: frames as u64,
                ..Stats::default()
            },
        })
    }

    fn slot_bytes(&mut self, s: usize) -> &mut [u8] {
        &mut self.cache.bytes()[s * PAGE..(s + 1) * PAGE]
    }

    /// Encrypts slot `s` in place (it leaves the cache, so no plaintext copy
    /// needs to survive) and stores it to its frame.
    fn evict(&mut self, keys: &KeyTable, s: usize) {
        let Some(tag) = self.tags[s].take() else {
            return;
        };
        self.index[tag.frame] = 0;
        self.stats.cached_pages -= 1;
        let mut sealed = false;
        if self.dirty[s] {
            let slots = keys.read();
            let x = slots.cipher(tag.keyid, tag.enc);
            sealed = x.is_some();
            let page = &mut self.cache.bytes()[s * PAGE..(s + 1) * PAGE];
            seal(x, tag.frame, page);
            self.dram[tag.frame * PAGE..(tag.frame + 1) * PAGE].copy_from_slice(page);
            self.stats.writebacks += 1;
        }
        if !sealed {
            // Plaintext leaves the cache wiped (a sealed page was encrypted in
            // place and holds only ciphertext).
            self.slot_bytes(s).fill(0);
        }
        self.dirty[s] = false;
        self.release(s);
    }

    /// Lists slot `s` (now empty) as free.
    fn release(&mut self, s: usize) {
        if !self.listed[s] {
            self.listed[s] = true;
            self.free.push(s);
        }
    }

    fn cached(&self, frame: usize) -> Option<usize> {
        self.index[frame].checked_sub(1).map(|s| s as usize)
    }

    /// A slot for `frame`, evicting the clock's choice if none is empty;
    /// never one of `pinned` (which must leave at least one slot unpinned).
    ///
    /// An empty slot at the frame's home (frame number modulo the cache
    /// size) comes first: contiguous frames then sit in contiguous slots,
    /// and a program walking through its memory walks through the cache
    /// the same way, which the processor's prefetchers follow (pages of
    /// three STREAM arrays interleaved in the cache ran at 0.7 of plain
    /// memory, in their own runs at 1.0).
    fn victim(&mut self, keys: &KeyTable, frame: usize, pinned: [&[usize]; 2]) -> usize {
        let n = self.tags.len();
        let home = frame % n;
        if self.tags[home].is_none() {
            return home;
        }
        loop {
            while let Some(s) = self.free.pop() {
                self.listed[s] = false;
                if self.tags[s].is_none() {
                    return s;
                }
            }
            let s = self.hand;
            self.hand = (self.hand + 1) % n;
            if pinned[0].contains(&s) || pinned[1].contains(&s) {
                continue;
            }
            if self.referenced[s] {
                self.referenced[s] = false;
            } else {
                self.evict(keys, s);
                self.stats.evictions += 1;
            }
        }
    }

    /// The cache slot holding `frame` under (keyid, enc), filling it (by
    /// decryption) unless the caller will overwrite the whole page; the
    /// slots in `pinned` are not evicted to make room.
    fn lookup(
        &mut self,
        keys: &KeyTable,
        frame: usize,
        keyid: u16,
        enc: bool,
        fill: bool,
        pinned: [&[usize]; 2],
    ) -> usize {
        let want = Tag { frame, keyid, enc };
        if let Some(s) = self.cached(frame) {
            if self.tags[s] == Some(want) {
                self.stats.hits += 1;
                self.referenced[s] = true;
                return s;
            }
            // Aliasing rule: one view per frame; flush the other first.
            self.evict(keys, s);
            self.stats.alias_flushes += 1;
        }
        self.stats.misses += 1;
        let s = self.victim(keys, frame, pinned);
        if fill {
            let slots = keys.read();
            let x = slots.cipher(keyid, enc);
            let src = &self.dram[frame * PAGE..(frame + 1) * PAGE];
            let page = &mut self.cache.bytes()[s * PAGE..(s + 1) * PAGE];
            page.copy_from_slice(src);
            open(x, frame, page);
            self.stats.fills += 1;
        } else {
            self.stats.full_page_writes += 1;
        }
        self.tags[s] = Some(want);
        // Slots number at most the frames, which fit the address bits.
        self.index[frame] = u32::try_from(s + 1).unwrap_or(0);
        self.referenced[s] = true;
        self.stats.cached_pages += 1;
        s
    }

    pub(crate) fn read(
        &mut self,
        keys: &KeyTable,
        phys: u64,
        keyid: u16,
        enc: bool,
        buf: &mut [u8],
    ) {
        let mut done = 0;
        let mut addr = usize::try_from(phys).unwrap_or(usize::MAX);
        while done < buf.len() {
            let (frame, off) = (addr / PAGE, addr % PAGE);
            let n = (PAGE - off).min(buf.len() - done);
            let s = self.lookup(keys, frame, keyid, enc, true, [&[], &[]]);
            let page = &self.cache.as_slice()[s * PAGE..(s + 1) * PAGE];
            buf[done..done + n].copy_from_slice(&page[off..off + n]);
            done += n;
            addr += n;
        }
    }

    pub(crate) fn write(&mut self, keys: &KeyTable, phys: u64, keyid: u16, enc: bool, data: &[u8]) {
        let mut done = 0;
        let mut addr = usize::try_from(phys).unwrap_or(usize::MAX);
        while done < data.len() {
            let (frame, off) = (addr / PAGE, addr % PAGE);
            let n = (PAGE - off).min(data.len() - done);
            let s = self.lookup(keys, frame, keyid, enc, n != PAGE, [&[], &[]]);
            let page = &mut self.cache.bytes()[s * PAGE..(s + 1) * PAGE];
            page[off..off + n].copy_from_slice(&data[done..done + n]);
            self.dirty[s] = true;
            done += n;
            addr += n;
        }
    }

    /// Brings `reads` and `writes` (frame, KeyID, encrypted), no more than
    /// the cache holds, into the cache at once and returns their slots; the
    /// written ones are marked dirty. A frame named twice is refused (its
    /// number returned) before anything is brought in.
    pub(crate) fn pin<const R: usize, const W: usize>(
        &mut self,
        keys: &KeyTable,
        reads: [(usize, u16, bool); R],
        writes: [(usize, u16, bool); W],
    ) -> Result<([usize; R], [usize; W]), usize> {
        self.request = self.request.wrapping_add(1);
        if self.request == 0 {
            self.stamp.fill(0);
            self.request = 1;
        }
        for &(frame, _, _) in reads.iter().chain(&writes) {
            if self.stamp[frame] == self.request {
                return Err(frame);
            }
            self.stamp[frame] = self.request;
        }
        let mut r = [usize::MAX; R];
        for i in 0..R {
            let (frame, keyid, enc) = reads[i];
            r[i] = self.lookup(keys, frame, keyid, enc, true, [&r[..i], &[]]);
        }
        let mut w = [usize::MAX; W];
        for i in 0..W {
            let (frame, keyid, enc) = writes[i];
            w[i] = self.lookup(keys, frame, keyid, enc, true, [&r, &w[..i]]);
            self.dirty[w[i]] = true;
        }
        Ok((r, w))
    }

    /// Moves the page in slot `s` to slot `t` and whatever `t` held to `s`
    /// (bytes swapped in place, through no other memory).
    fn swap_slots(&mut self, s: usize, t: usize) {
        if s == t {
            return;
        }
        let (lo, hi) = (s.min(t), s.max(t));
        let bytes = self.cache.bytes();
        let (a, b) = bytes.split_at_mut(hi * PAGE);
        a[lo * PAGE..(lo + 1) * PAGE].swap_with_slice(&mut b[..PAGE]);
        self.tags.swap(s, t);
        self.dirty.swap(s, t);
        self.referenced.swap(s, t);
        for x in [s, t] {
            if let Some(tag) = self.tags[x] {
                self.index[tag.frame] = u32::try_from(x + 1).unwrap_or(0);
            }
        }
        // An empty slot may have changed places: list it (a listed slot
        // that is no longer empty is skipped when popped).
        for x in [s, t] {
            if self.tags[x].is_none() {
                self.release(x);
            }
        }
    }

    /// Brings runs of `pages` consecutive frames into consecutive slots,
    /// each run at the slots its first frame's home begins (`reads` then
    /// `writes`: first frame, KeyID, encrypted), and returns each run's
    /// first slot; the written runs are marked dirty. Refused, before
    /// anything moves: a frame in two runs (its number), runs whose slots
    /// would overlap or pass the end of the cache.
    pub(crate) fn pin_runs<const R: usize, const W: usize>(
        &mut self,
        keys: &KeyTable,
        reads: [(usize, u16, bool); R],
        writes: [(usize, u16, bool); W],
        pages: usize,
    ) -> Result<([usize; R], [usize; W]), RunError> {
        let n = self.tags.len();
        let runs = || reads.iter().chain(&writes);
        let meets = |x: usize, y: usize| x < y + pages && y < x + pages;
        for (i, &(f0, _, _)) in runs().enumerate() {
            let home = f0 % n;
            if home + pages > n {
                return Err(RunError::PastEnd { frame: f0 });
            }
            for &(g0, _, _) in runs().take(i) {
                if meets(f0, g0) {
                    return Err(RunError::Twice { frame: f0.max(g0) });
                }
                if meets(home, g0 % n) {
                    return Err(RunError::Overlap { a: g0, b: f0 });
                }
            }
        }
        for (j, &(f0, keyid, enc)) in runs().enumerate() {
            let home = f0 % n;
            let write = j >= R;
            // The common case, a run already in place: one comparison per
            // page (the slow path below costs a lookup per page).
            let in_place = (0..pages).all(|i| {
                self.tags[home + i]
                    == Some(Tag {
                        frame: f0 + i,
                        keyid,
                        enc,
                    })
            });
            if in_place {
                self.referenced[home..home + pages].fill(true);
                if write {
                    self.dirty[home..home + pages].fill(true);
                }
                self.stats.hits += pages as u64;
                continue;
            }
            // Slots of the runs before this one and of this run's pages
            // placed so far: not to be evicted while the rest come in.
            let mut held: Vec<usize> = runs()
                .take(j)
                .flat_map(|&(g0, _, _)| (g0 % n)..(g0 % n + pages))
                .collect();
            for i in 0..pages {
                let s = self.lookup(keys, f0 + i, keyid, enc, true, [&held, &[]]);
                self.swap_slots(s, home + i);
                held.push(home + i);
                if write {
                    self.dirty[home + i] = true;
                }
            }
        }
        let mut r = [0usize; R];
        let mut w = [0usize; W];
        for (o, &(f0, _, _)) in r.iter_mut().chain(w.iter_mut()).zip(runs()) {
            *o = f0 % n;
        }
        Ok((r, w))
    }

    /// The plaintext of the slot ranges starting at `reads` (shared) and
    /// `writes` (exclusive), `pages` slots each, none overlapping: handed
    /// out in slot order, splitting the cache as it goes.
    pub(crate) fn ranges<const R: usize, const W: usize>(
        &mut self,
        reads: &[usize; R],
        writes: &[usize; W],
        pages: usize,
    ) -> ([&[u8]; R], [&mut [u8]; W]) {
        let mut r: [&[u8]; R] = [&[]; R];
        let mut w: [&mut [u8]; W] = std::array::from_fn(|_| <&mut [u8]>::default());
        let mut order: Vec<(usize, bool, usize)> = Vec::new();
        let mut small = [(0usize, false, 0usize); 8];
        let want = reads
            .iter()
            .enumerate()
            .map(|(i, &s)| (s, false, i))
            .chain(writes.iter().enumerate().map(|(i, &s)| (s, true, i)));
        let order: &mut [(usize, bool, usize)] = if R + W <= small.len() {
            for (o, x) in small.iter_mut().zip(want) {
                *o = x;
            }
            &mut small[..R + W]
        } else {
            order.extend(want);
            &mut order
        };
        order.sort_unstable_by_key(|x| x.0);
        let mut rest = self.cache.bytes();
        let mut at = 0;
        for &(slot, write, i) in order.iter() {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((slot - at) * PAGE);
            let (run, tail) = tail.split_at_mut(pages * PAGE);
            rest = tail;
            at = slot + pages;
            if write {
                w[i] = run;
            } else {
                r[i] = run;
            }
        }
        (r, w)
    }

    /// The plaintext of slot `s`.
    pub(crate) fn slot(&self, s: usize) -> &[u8; PAGE] {
        let (pages, _) = self.cache.as_slice().as_chunks::<PAGE>();
        &pages[s]
    }

    /// The plaintext of slots `reads` (shared) and `writes` (exclusive), all
    /// distinct.
    pub(crate) fn slots<const R: usize, const W: usize>(
        &mut self,
        reads: &[usize; R],
        writes: &[usize; W],
    ) -> ([&[u8; PAGE]; R], [&mut [u8; PAGE]; W]) {
        let (r, w) = self.ranges(reads, writes, 1);
        // Ranges of one page each are pages.
        (
            r.map(|p| p.first_chunk::<PAGE>().expect("one page")),
            w.map(|p| p.first_chunk_mut::<PAGE>().expect("one page")),
        )
    }

    pub(crate) fn flush_keyid(&mut self, keys: &KeyTable, keyid: u16) {
        for s in 0..self.tags.len() {
            if self.tags[s].is_some_and(|t| t.keyid == keyid) {
                self.evict(keys, s);
            }
        }
    }

    pub(crate) fn flush_all(&mut self, keys: &KeyTable) {
        for s in 0..self.tags.len() {
            self.evict(keys, s);
        }
    }

    pub(crate) fn dram(&self, frame: usize) -> &[u8] {
        &self.dram[frame * PAGE..(frame + 1) * PAGE]
    }

    pub(crate) fn dram_copy(&mut self, src: usize, dst: usize) {
        if let Some(s) = self.cached(dst) {
            self.index[dst] = 0;
            self.tags[s] = None;
            self.dirty[s] = false;
            self.stats.cached_pages -= 1;
            self.slot_bytes(s).fill(0);
            self.release(s);
        }
        self.dram
            .copy_within(src * PAGE..(src + 1) * PAGE, dst * PAGE);
    }

    pub(crate) fn bulk(
        &mut self,
        keys: &KeyTable,
        first: usize,
        count: usize,
        keyid: u16,
        threads: usize,
        enc: bool,
    ) {
        let slots = keys.read();
        let Some(x) = slots.cipher(keyid, true) else {
            return;
        };
        let region = &mut self.dram[first * PAGE..(first + count) * PAGE];
        let per = count.div_ceil(threads).max(1) * PAGE;
        std::thread::scope(|sc| {
            for (i, part) in region.chunks_mut(per).enumerate() {
                let base = first + i * per / PAGE;
                sc.spawn(move || {
                    // Whole pages, each under its own address: cannot fail.
                    let _ = if enc {
                        x.encrypt_units(tweak(base), PAGE as u128, PAGE, part)
                    } else {
                        x.decrypt_units(tweak(base), PAGE as u128, PAGE, part)
                    };
                });
            }
        });
        self.stats.bulk_pages += count as u64;
    }

    pub(crate) fn stats(&self) -> Stats {
        self.stats
    }

    pub(crate) fn cache_bytes(&self) -> usize {
        self.cache.len()
    }

    pub(crate) fn metadata_bytes(&self) -> usize {
        let n = self.tags.len();
        n * (std::mem::size_of::<Option<Tag>>() + 3 + std::mem::size_of::<usize>())
            + (self.index.len() + self.stamp.len()) * std::mem::size_of::<u32>()
    }
}
