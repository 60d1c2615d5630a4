//! Physical memory ("DRAM", ciphertext) and the bounded write-back plaintext
//! cache in secret memory.

use std::collections::HashMap;

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
    index: HashMap<usize, usize>,
    /// Slots holding nothing, so a miss never scans for one.
    free: Vec<usize>,
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
            index: HashMap::with_capacity(cache_pages),
            free: (0..cache_pages).rev().collect(),
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
        self.index.remove(&tag.frame);
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
        self.free.push(s);
    }

    fn victim(&mut self, keys: &KeyTable) -> usize {
        let n = self.tags.len();
        loop {
            if let Some(free) = self.free.pop() {
                return free;
            }
            let s = self.hand;
            self.hand = (self.hand + 1) % n;
            if self.referenced[s] {
                self.referenced[s] = false;
            } else {
                self.evict(keys, s);
                self.stats.evictions += 1;
            }
        }
    }

    /// The cache slot holding `frame` under (keyid, enc), filling it (by
    /// decryption) unless the caller will overwrite the whole page.
    fn lookup(
        &mut self,
        keys: &KeyTable,
        frame: usize,
        keyid: u16,
        enc: bool,
        fill: bool,
    ) -> usize {
        let want = Tag { frame, keyid, enc };
        if let Some(&s) = self.index.get(&frame) {
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
        let s = self.victim(keys);
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
        self.index.insert(frame, s);
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
            let s = self.lookup(keys, frame, keyid, enc, true);
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
            let s = self.lookup(keys, frame, keyid, enc, n != PAGE);
            let page = &mut self.cache.bytes()[s * PAGE..(s + 1) * PAGE];
            page[off..off + n].copy_from_slice(&data[done..done + n]);
            self.dirty[s] = true;
            done += n;
            addr += n;
        }
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
        if let Some(s) = self.index.remove(&dst) {
            self.tags[s] = None;
            self.dirty[s] = false;
            self.stats.cached_pages -= 1;
            self.slot_bytes(s).fill(0);
            self.free.push(s);
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
                    for (j, page) in part.chunks_mut(PAGE).enumerate() {
                        if enc {
                            seal(Some(x), base + j, page);
                        } else {
                            open(Some(x), base + j, page);
                        }
                    }
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
        n * (std::mem::size_of::<Option<Tag>>() + 2)
            + self.index.capacity() * (2 * std::mem::size_of::<usize>() + 1)
    }
}
