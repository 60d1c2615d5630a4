//! Where images come from: raw files, ELF64 core files, live processes.

use std::io::{Read as _, Seek as _, SeekFrom};
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
    /// Regions that exist but could not be read: (start, length, name, why).
    pub unreadable: Vec<(u64, u64, String, String)>,
}

impl Image {
    /// Bytes read.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.regions.iter().map(|r| r.data.len()).sum()
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

/// Reads every readable mapping of process `pid` through `/proc/PID/mem`
/// (needs ptrace rights over it: the same user and a dumpable process, or
/// root). Mappings that fail to read (`memfd_secret` gives EIO) are listed
/// in [`Image::unreadable`].
///
/// # Errors
/// `/proc/PID/maps` or `/proc/PID/mem` cannot be opened.
pub fn read_process(pid: u32) -> Result<Image, KeyfindError> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(io(format!("/proc/{pid}/maps")))?;
    let mut mem =
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
        let Ok(len) = usize::try_from(b.saturating_sub(a)) else {
            continue;
        };
        let mut data = vec![0u8; len];
        match mem
            .seek(SeekFrom::Start(a))
            .and_then(|_| mem.read_exact(&mut data))
        {
            Ok(()) => img.regions.push(Region {
                start: a,
                name,
                data,
            }),
            Err(e) => img.unreadable.push((a, b - a, name, e.to_string())),
        }
    }
    Ok(img)
}

#[cfg(test)]
mod tests {
    use super::*;

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
