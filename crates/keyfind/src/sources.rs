//! Where images come from: raw files, ELF64 core files, live processes.

use std::path::Path;

use crate::KeyfindError;

/// One contiguous piece of memory.
#[derive(Debug, Clone)]
pub struct Region {
    /// Its address.
    pub start: u64,
    /// Mapping name or description.
    pub name: String,
    /// Its bytes.
    pub data: Vec<u8>,
}

/// A memory image: the regions that could be read, and those that could not.
#[derive(Debug, Clone, Default)]
pub struct Image {
    /// Readable regions.
    pub regions: Vec<Region>,
    /// Ranges that exist but could not be read: (start, length, name, why).
    /// For a live process, each is a run of pages that failed to read inside
    /// one mapping (the rest of the mapping is in [`Image::regions`]).
    pub unreadable: Vec<(u64, u64, String, String)>,
}

impl Image {
    /// Bytes read.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.regions.iter().map(|r| r.data.len()).sum()
    }

    /// Bytes that exist in the source but could not be read, so were not
    /// scanned (the sum of [`Image::unreadable`]).
    #[must_use]
    pub fn skipped_bytes(&self) -> u64 {
        self.unreadable
            .iter()
            .fold(0u64, |n, u| n.saturating_add(u.1))
    }
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> KeyfindError {
    move |source| KeyfindError::Io { what, source }
}

/// A raw memory image (a file of bytes).
///
/// # Errors
/// The file cannot be read.
pub fn read_raw(path: &Path) -> Result<Image, KeyfindError> {
    let data = std::fs::read(path).map_err(io(path.display().to_string()))?;
    Ok(Image {
        regions: vec![Region {
            start: 0,
            name: path.display().to_string(),
            data,
        }],
        unreadable: Vec::new(),
    })
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

/// Parses an ELF64 little-endian core file held in memory: one region per
/// `PT_LOAD` segment with file contents.
///
/// # Errors
/// [`KeyfindError::BadElf`] for anything that is not a well-formed ELF64 core.
pub fn parse_core(b: &[u8]) -> Result<Image, KeyfindError> {
    let bad = |m: &str| KeyfindError::BadElf(m.to_owned());
    if b.get(..4) != Some(b"\x7fELF") {
        return Err(bad("no ELF magic"));
    }
    if b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return Err(bad("not 64-bit little-endian"));
    }
    if u16_at(b, 16) != Some(4) {
        return Err(bad("not a core file (e_type != ET_CORE)"));
    }
    let phoff = usize::try_from(u64_at(b, 0x20).ok_or_else(|| bad("truncated header"))?)
        .map_err(|_| bad("e_phoff out of range"))?;
    let phentsize = usize::from(u16_at(b, 0x36).ok_or_else(|| bad("truncated header"))?);
    let phnum = usize::from(u16_at(b, 0x38).ok_or_else(|| bad("truncated header"))?);
    if phentsize < 56 {
        return Err(bad("program headers smaller than 56 bytes"));
    }
    let mut img = Image::default();
    for i in 0..phnum {
        let h = phoff
            .checked_add(
                i.checked_mul(phentsize)
                    .ok_or_else(|| bad("phnum overflow"))?,
            )
            .ok_or_else(|| bad("phoff overflow"))?;
        let p_type = u32_at(b, h).ok_or_else(|| bad("program header past the end"))?;
        if p_type != 1 {
            continue;
        }
        let off = u64_at(b, h + 8).ok_or_else(|| bad("truncated program header"))?;
        let vaddr = u64_at(b, h + 16).ok_or_else(|| bad("truncated program header"))?;
        let filesz = u64_at(b, h + 32).ok_or_else(|| bad("truncated program header"))?;
        let memsz = u64_at(b, h + 40).ok_or_else(|| bad("truncated program header"))?;
        if filesz == 0 {
            img.unreadable
                .push((vaddr, memsz, "core".into(), "not in the dump".into()));
            continue;
        }
        let range = usize::try_from(off)
            .ok()
            .and_then(|o| Some(o..o.checked_add(usize::try_from(filesz).ok()?)?))
            .and_then(|r| b.get(r))
            .ok_or_else(|| bad("segment extends past the end of the file"))?;
        img.regions.push(Region {
            start: vaddr,
            name: "core".into(),
            data: range.to_vec(),
        });
    }
    Ok(img)
}

/// Reads an ELF64 core file (as written by `gcore` or the kernel).
///
/// # Errors
/// I/O errors, or [`KeyfindError::BadElf`].
pub fn read_core(path: &Path) -> Result<Image, KeyfindError> {
    let b = std::fs::read(path).map_err(io(path.display().to_string()))?;
    parse_core(&b)
}

/// Reads at an offset, as `pread(2)`: a short count means the byte after
/// the last one returned could not be read (`/proc/PID/mem` stops at the
/// first page it cannot reach, and fails only when that is the first).
trait ReadAt {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize>;
}

impl ReadAt for std::fs::File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self, buf, offset)
    }
}

/// Granularity of what can fail to read: the x86-64 base page. (On a
/// kernel with larger pages, a failing page is just skipped in several
/// steps.)
const PAGE: u64 = 4096;
/// Bytes asked for at once; a failure costs a retry page by page only up to
/// the failing page, since a short read returns everything before it.
const CHUNK: u64 = 1 << 20;

/// Reads `[start, end)` of `mem` into `img`, skipping only the pages that
/// fail: each run of readable pages becomes a [`Region`] named `name`, each
/// run of failing pages one [`Image::unreadable`] entry (with the first
/// error). A mapping with one missing page in the middle (a page of a
/// userfaultfd range not yet filled, an evicted page under `memveil run`)
/// is still read around it.
fn read_range(mem: &impl ReadAt, start: u64, end: u64, name: &str, img: &mut Image) {
    let mut buf = vec![0u8; usize::try_from(CHUNK.min(end.saturating_sub(start))).unwrap_or(0)];
    let mut run: Option<Region> = None;
    let mut bad: Option<(u64, u64, String, String)> = None;
    let mut at = start;
    while at < end {
        let want = usize::try_from(end - at).map_or(buf.len(), |w| w.min(buf.len()));
        let got = mem.read_at(&mut buf[..want], at);
        if got
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::Interrupted)
        {
            continue;
        }
        let n = got.as_ref().map_or(0, |&n| n.min(want));
        if n > 0 {
            if let Some(b) = bad.take() {
                img.unreadable.push(b);
            }
            match &mut run {
                Some(r) => r.data.extend_from_slice(&buf[..n]),
                None => {
                    run = Some(Region {
                        start: at,
                        name: name.to_owned(),
                        data: buf[..n].to_vec(),
                    });
                }
            }
            at += n as u64;
            continue;
        }
        // The page at `at` cannot be read: skip to the next page boundary.
        if let Some(r) = run.take() {
            img.regions.push(r);
        }
        let next = (at / PAGE).saturating_add(1).saturating_mul(PAGE).min(end);
        match &mut bad {
            Some(b) => b.1 += next - at,
            None => {
                let why = match got {
                    Err(e) => e.to_string(),
                    Ok(_) => "nothing read (end of file, or the process exited)".to_owned(),
                };
                bad = Some((at, next - at, name.to_owned(), why));
            }
        }
        at = next;
    }
    if let Some(r) = run {
        img.regions.push(r);
    }
    if let Some(b) = bad {
        img.unreadable.push(b);
    }
}

/// Reads every readable mapping of process `pid` through `/proc/PID/mem`
/// (needs ptrace rights over it: the same user and a dumpable process, or
/// root), page by page where needed: pages that fail to read (`memfd_secret`
/// gives EIO; so do pages of a userfaultfd range that are not there, such as
/// evicted pages under `memveil run`) are skipped and listed in
/// [`Image::unreadable`] (their total is [`Image::skipped_bytes`]); the rest
/// of their mapping is read.
///
/// # Errors
/// `/proc/PID/maps` or `/proc/PID/mem` cannot be opened.
pub fn read_process(pid: u32) -> Result<Image, KeyfindError> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(io(format!("/proc/{pid}/maps")))?;
    let mem =
        std::fs::File::open(format!("/proc/{pid}/mem")).map_err(io(format!("/proc/{pid}/mem")))?;
    let mut img = Image::default();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let name = f.nth(3).unwrap_or("[anon]").to_owned();
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        if !perms.starts_with('r')
            || name == "[vvar]"
            || name == "[vsyscall]"
            || name == "[vvar_vclock]"
        {
            continue;
        }
        read_range(&mem, a, b, &name, &mut img);
    }
    Ok(img)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapping of `pages` pages at `base` whose pages in `bad` fail (EIO),
    /// read the way `/proc/PID/mem` reads: up to the first failing page.
    struct Holes {
        base: u64,
        pages: u64,
        bad: Vec<u64>,
    }

    impl Holes {
        fn byte(at: u64) -> u8 {
            (at / PAGE * 7 + at % 251).to_le_bytes()[0]
        }
    }

    impl ReadAt for Holes {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            let mut n = 0;
            while n < buf.len() {
                let at = offset + n as u64;
                let page = (at - self.base) / PAGE;
                if page >= self.pages || self.bad.contains(&page) {
                    break;
                }
                buf[n] = Self::byte(at);
                n += 1;
            }
            if n == 0 {
                return Err(std::io::Error::from_raw_os_error(5));
            }
            Ok(n)
        }
    }

    #[test]
    fn only_the_failing_pages_are_skipped_and_the_rest_of_the_mapping_is_read() {
        // 300 pages (more than one CHUNK), holes at the start, in the
        // middle (two pages), across the CHUNK boundary and at the end.
        let base = 0x7f00_0000_0000;
        let m = Holes {
            base,
            pages: 300,
            bad: vec![0, 3, 4, 255, 256, 299],
        };
        let mut img = Image::default();
        read_range(&m, base, base + 300 * PAGE, "[anon]", &mut img);
        let runs: Vec<(u64, u64)> = img
            .regions
            .iter()
            .map(|r| ((r.start - base) / PAGE, r.data.len() as u64 / PAGE))
            .collect();
        assert_eq!(runs, [(1, 2), (5, 250), (257, 42)]);
        for r in &img.regions {
            assert!((r.data.len() as u64).is_multiple_of(PAGE) && r.name == "[anon]");
            for (i, &b) in r.data.iter().enumerate() {
                assert_eq!(
                    b,
                    Holes::byte(r.start + i as u64),
                    "byte {i} of {:#x}",
                    r.start
                );
            }
        }
        let holes: Vec<(u64, u64)> = img
            .unreadable
            .iter()
            .map(|u| ((u.0 - base) / PAGE, u.1 / PAGE))
            .collect();
        assert_eq!(holes, [(0, 1), (3, 2), (255, 2), (299, 1)]);
        assert!(img.unreadable.iter().all(|u| u.3.contains("os error 5")));
        assert_eq!(img.skipped_bytes(), 6 * PAGE);
        assert_eq!(img.bytes() as u64, 294 * PAGE);
    }

    #[test]
    fn an_unreadable_mapping_is_one_entry() {
        let m = Holes {
            base: 0,
            pages: 64,
            bad: (0..64).collect(),
        };
        let mut img = Image::default();
        read_range(&m, 0, 64 * PAGE, "/secretmem", &mut img);
        assert!(img.regions.is_empty());
        assert_eq!(img.unreadable.len(), 1);
        assert_eq!(img.skipped_bytes(), 64 * PAGE);
    }

    #[test]
    fn malformed_cores_are_errors() {
        assert!(parse_core(b"").is_err());
        assert!(parse_core(b"\x7fELF").is_err());
        let mut h = vec![0u8; 64];
        h[..4].copy_from_slice(b"\x7fELF");
        h[4] = 2;
        h[5] = 1;
        h[16] = 4;
        h[0x20] = 64; // phoff
        h[0x36] = 56; // phentsize
        h[0x38] = 1; // one header, missing
        assert!(parse_core(&h).is_err());
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(mut b in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512), hdr in proptest::prelude::any::<bool>()) {
            if hdr && b.len() >= 64 {
                b[..4].copy_from_slice(b"\x7fELF");
                b[4] = 2;
                b[5] = 1;
                b[16] = 4;
                b[17] = 0;
            }
            let _ = parse_core(&b);
            let _ = crate::scan(&b, 0, "x", 8);
        }
    }
}
