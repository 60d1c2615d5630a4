//! A key finder in the manner of `aeskeyfind` (Halderman et al., "Lest We
//! Remember", 2008): it looks for expanded AES-128 and AES-256 *encryption*
//! key schedules in memory images, tolerating a few flipped bits, and for
//! exact byte patterns, and for known secrets held masked ([`Secrets`]: an
//! RSA key's primes, an EC scalar) in both byte orders.
//!
//! Every 4-byte-aligned offset of an image is taken as the start of a
//! candidate schedule (176 bytes for AES-128, 240 for AES-256): the schedule
//! is recomputed from its first 16 or 32 bytes and compared bit by bit; a
//! candidate within `max_errors` flipped bits is reported. (aeskeyfind tries
//! every byte offset; every AES implementation memveil knows of, and every
//! `malloc`, aligns schedules to at least 4 bytes, so this finder trades the
//! unaligned case for a 4x faster scan.) Schedules stored only in the
//! decryption form or in bit-sliced form (software fixslice AES) are not
//! found; memveil's tests run on AES-NI, whose schedules are the standard form.
//!
//! Sources: raw images, ELF64 core files (`gcore`), and live processes through
//! `/proc/PID/maps` and `/proc/PID/mem` (pages that cannot be read, such as
//! `memfd_secret` pages or the evicted pages of a program under `memveil
//! run`, are skipped one by one and counted, the rest of their mapping read).
//!
//! This crate parses hostile input (core files from anywhere) and forbids
//! unsafe code; no input makes it panic.
#![forbid(unsafe_code)]

mod aes;
mod secrets;
mod sources;

pub use secrets::{Hit, Secrets};
pub use sources::{read_core, read_process, read_raw, Image, Region};

/// A key schedule found in an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Address (process or core virtual address; file offset for raw images).
    pub address: u64,
    /// Name of the region (mapping path or `[heap]`, `core`, ...).
    pub region: String,
    /// 128 or 256.
    pub bits: u32,
    /// Bits of the stored schedule that differ from the recomputed one.
    pub errors: u32,
    /// The key (the schedule's first 16 or 32 bytes).
    pub key: Vec<u8>,
}

/// Scans `data`, which starts at `base`, for AES-128/256 encryption key
/// schedules with at most `max_errors` wrong bits.
#[must_use]
pub fn scan(data: &[u8], base: u64, region: &str, max_errors: u32) -> Vec<Found> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off + 176 <= data.len() {
        let w = &data[off..];
        if let Some((bits, errors)) = aes::check(w, max_errors) {
            let n = if bits == 256 { 32 } else { 16 };
            out.push(Found {
                address: base.wrapping_add(off as u64),
                region: region.to_owned(),
                bits,
                errors,
                key: w[..n].to_vec(),
            });
            // Skip the rest of this schedule.
            off += if bits == 256 { 240 } else { 176 };
            continue;
        }
        off += 4;
    }
    out
}

/// Scans every region of an image.
#[must_use]
pub fn scan_image(img: &Image, max_errors: u32) -> Vec<Found> {
    // Split large regions into 4-byte-aligned chunks scanned on every CPU;
    // each chunk reads 240 bytes past its end so no schedule straddling a
    // boundary is missed, and keeps only finds that start inside it.
    const CHUNK: usize = 4 << 20;
    let jobs: Vec<(&Region, usize)> = img
        .regions
        .iter()
        .flat_map(|r| (0..r.data.len()).step_by(CHUNK).map(move |o| (r, o)))
        .collect();
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut parts: Vec<(usize, Vec<Found>)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads.min(jobs.len()).max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(r, o)) = jobs.get(i) else { break };
                        let end = (o + CHUNK).min(r.data.len());
                        let stop = (end + 240).min(r.data.len());
                        let base = r.start.wrapping_add(o as u64);
                        let lim = r.start.wrapping_add(end as u64);
                        let f: Vec<Found> = scan(&r.data[o..stop], base, &r.name, max_errors)
                            .into_iter()
                            .filter(|f| f.address < lim)
                            .collect();
                        mine.push((i, f));
                    }
                    mine
                })
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    parts.sort_by_key(|p| p.0);
    parts.into_iter().flat_map(|p| p.1).collect()
}

/// Whether `needle` occurs in any region of the image.
#[must_use]
pub fn contains(img: &Image, needle: &[u8]) -> bool {
    !needle.is_empty()
        && img
            .regions
            .iter()
            .any(|r| r.data.windows(needle.len()).any(|w| w == needle))
}

/// Errors reading an image.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyfindError {
    /// The file or process could not be read.
    #[error("{what}: {source}")]
    Io {
        /// What was being read.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A malformed core file.
    #[error("not a usable ELF64 core file: {0}")]
    BadElf(String),
}

/// The expanded AES encryption schedule of `key` (16 or 32 bytes), for tests
/// and for callers that want to search for a known key.
#[must_use]
pub fn expand(key: &[u8]) -> Option<Vec<u8>> {
    aes::expand(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect()
    }

    #[test]
    fn finds_planted_schedules_with_bit_flips_and_nothing_in_noise() {
        let mut img = noise(1 << 20, 7);
        assert!(
            scan(&img, 0, "noise", 8).is_empty(),
            "false positive in random data"
        );
        let k128: Vec<u8> = (0..16u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        let k256: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(91) ^ 0xa5).collect();
        let s128 = expand(&k128).expect("128");
        let s256 = expand(&k256).expect("256");
        img[4096..4096 + 176].copy_from_slice(&s128);
        img[65536..65536 + 240].copy_from_slice(&s256);
        // Three flipped bits in the 128-bit schedule (as in decayed DRAM).
        img[4096 + 50] ^= 0x01;
        img[4096 + 100] ^= 0x10;
        img[4096 + 170] ^= 0x80;
        let found = scan(&img, 0x1000_0000, "img", 16);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].key, k128);
        assert_eq!(found[0].address, 0x1000_0000 + 4096);
        assert!(found[0].errors > 0 && found[0].bits == 128);
        assert_eq!(found[1].key, k256);
        assert_eq!((found[1].bits, found[1].errors), (256, 0));
        // Too many flips for the threshold: not reported.
        assert_eq!(scan(&img, 0, "img", 0).len(), 1);
    }

    #[test]
    fn schedules_straddling_a_thread_chunk_boundary_are_found_once() {
        let mut data = noise(9 << 20, 3);
        let k: Vec<u8> = (0..32u8).map(|i| i ^ 0x77).collect();
        let s = expand(&k).expect("256");
        for at in [(4 << 20) - 120, (8 << 20) - 4, 9 << 19] {
            data[at..at + 240].copy_from_slice(&s);
        }
        let img = Image {
            regions: vec![Region {
                start: 0x4000_0000,
                name: "r".into(),
                data,
            }],
            unreadable: Vec::new(),
        };
        let f: Vec<u64> = scan_image(&img, 8)
            .iter()
            .map(|f| f.address - 0x4000_0000)
            .collect();
        assert_eq!(f, vec![(4 << 20) - 120, 9 << 19, (8 << 20) - 4]);
    }
}
