//! The parts of a static ELF executable the loader needs: its type, entry,
//! program headers and loadable segments. Every field comes from the file,
//! so every sum is checked: a malformed file is an error, never a panic.

use std::fmt;

/// A page.
pub const PAGE: usize = 4096;

const PT_LOAD: u32 = 1;
const PT_INTERP: u32 = 3;
const PT_PHDR: u32 = 6;
const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;
const EM_X86_64: u16 = 62;
const PHENT: usize = 56;
const MAX_PHNUM: usize = 256;

/// Why a file cannot be loaded.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ElfError {
    /// Not a 64-bit little-endian x86-64 ELF file.
    NotElf(&'static str),
    /// Neither an executable nor a static position-independent one.
    Type(u16),
    /// A header that points outside the file or overflows.
    Malformed(&'static str),
}

impl fmt::Display for ElfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotElf(why) => write!(f, "not a 64-bit x86-64 ELF executable ({why})"),
            Self::Type(t) => write!(f, "ELF type {t} is neither ET_EXEC nor static-pie ET_DYN"),
            Self::Malformed(why) => write!(f, "malformed ELF file: {why}"),
        }
    }
}

/// A loadable segment (PT_LOAD), addresses relative to the load base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub vaddr: usize,
    pub offset: usize,
    pub filesz: usize,
    pub memsz: usize,
    /// PROT_* bits from the segment's PF_* flags.
    pub prot: libc::c_int,
}

/// A static executable, ready to map.
#[derive(Debug, PartialEq, Eq)]
pub struct Image {
    /// ET_DYN (static-pie): mapped at a base the loader chooses.
    pub relocatable: bool,
    pub entry: usize,
    pub phnum: usize,
    /// Where the program headers are, relative to the base.
    pub phdr: usize,
    pub segments: Vec<Segment>,
    /// The largest segment alignment (a power of two, at least a page).
    pub align: usize,
    /// The dynamic loader it names (PT_INTERP: file offset and length of
    /// its path), for a dynamically linked program.
    pub interp: Option<(usize, usize)>,
}

impl Image {
    /// Lowest and end address of the segments (page-rounded, relative).
    pub fn span(&self) -> (usize, usize) {
        let lo = self.segments.iter().map(|s| s.vaddr).min().unwrap_or(0) & !(PAGE - 1);
        let hi = self
            .segments
            .iter()
            .map(|s| s.vaddr + s.memsz)
            .max()
            .unwrap_or(0);
        (lo, round_up(hi))
    }
}

/// `x` rounded up to a page (callers checked it does not overflow).
pub fn round_up(x: usize) -> usize {
    (x + PAGE - 1) & !(PAGE - 1)
}

fn field(data: &[u8], at: usize, n: usize) -> Result<u64, ElfError> {
    let b = at
        .checked_add(n)
        .and_then(|end| data.get(at..end))
        .ok_or(ElfError::Malformed(
            "a header lies beyond the end of the file",
        ))?;
    let mut v = [0u8; 8];
    v[..n].copy_from_slice(b);
    Ok(u64::from_le_bytes(v))
}

fn size(v: u64) -> Result<usize, ElfError> {
    usize::try_from(v).map_err(|_| ElfError::Malformed("a field does not fit an address"))
}

/// Where the program headers are in the file and how many: read them (up to
/// [`headers_len`] bytes from the start) before calling [`parse`].
pub fn headers_len(ehdr: &[u8]) -> Result<usize, ElfError> {
    check_ident(ehdr)?;
    let phoff = size(field(ehdr, 0x20, 8)?)?;
    let phnum = size(field(ehdr, 0x38, 2)?)?;
    phnum
        .checked_mul(PHENT)
        .and_then(|n| n.checked_add(phoff))
        .ok_or(ElfError::Malformed("program headers overflow"))
}

fn check_ident(d: &[u8]) -> Result<(), ElfError> {
    if d.len() < 64 || &d[..4] != b"\x7fELF" {
        return Err(ElfError::NotElf("no ELF magic"));
    }
    if d[4] != 2 || d[5] != 1 {
        return Err(ElfError::NotElf("not 64-bit little-endian"));
    }
    Ok(())
}

/// Parses the ELF header and program headers at the start of `data`.
pub fn parse(data: &[u8]) -> Result<Image, ElfError> {
    check_ident(data)?;
    let ty = u16::try_from(field(data, 0x10, 2)?).unwrap_or(0);
    if u16::try_from(field(data, 0x12, 2)?).unwrap_or(0) != EM_X86_64 {
        return Err(ElfError::NotElf("not x86-64"));
    }
    if ty != ET_EXEC && ty != ET_DYN {
        return Err(ElfError::Type(ty));
    }
    let entry = size(field(data, 0x18, 8)?)?;
    let phoff = size(field(data, 0x20, 8)?)?;
    if size(field(data, 0x36, 2)?)? != PHENT {
        return Err(ElfError::Malformed("program header size is not 56"));
    }
    let phnum = size(field(data, 0x38, 2)?)?;
    if phnum == 0 || phnum > MAX_PHNUM {
        return Err(ElfError::Malformed("no or too many program headers"));
    }
    let mut segments = Vec::new();
    let mut phdr = None;
    let mut align = PAGE;
    let mut interp = None;
    for i in 0..phnum {
        let h = phoff + i * PHENT;
        let p_type = u32::try_from(field(data, h, 4)?).unwrap_or(0);
        let flags = field(data, h + 4, 4)?;
        let offset = size(field(data, h + 8, 8)?)?;
        let vaddr = size(field(data, h + 0x10, 8)?)?;
        let filesz = size(field(data, h + 0x20, 8)?)?;
        let memsz = size(field(data, h + 0x28, 8)?)?;
        let p_align = size(field(data, h + 0x30, 8)?)?;
        match p_type {
            PT_INTERP => {
                if filesz == 0 || filesz > 4096 || offset.checked_add(filesz).is_none() {
                    return Err(ElfError::Malformed("a loader path of no or absurd length"));
                }
                interp = Some((offset, filesz));
            }
            PT_PHDR => phdr = Some(vaddr),
            PT_LOAD => {
                if filesz > memsz || vaddr % PAGE != offset % PAGE {
                    return Err(ElfError::Malformed("a segment's sizes or offsets disagree"));
                }
                // Every end must stay well inside the address space.
                if vaddr.checked_add(memsz).is_none_or(|e| e > 1 << 47)
                    || offset.checked_add(filesz).is_none()
                {
                    return Err(ElfError::Malformed(
                        "a segment lies beyond the address space",
                    ));
                }
                if p_align.is_power_of_two() && p_align <= 1 << 30 {
                    align = align.max(p_align);
                }
                let prot = (if flags & 4 != 0 { libc::PROT_READ } else { 0 })
                    | (if flags & 2 != 0 { libc::PROT_WRITE } else { 0 })
                    | (if flags & 1 != 0 { libc::PROT_EXEC } else { 0 });
                segments.push(Segment {
                    vaddr,
                    offset,
                    filesz,
                    memsz,
                    prot,
                });
            }
            _ => {}
        }
    }
    if segments.is_empty() {
        return Err(ElfError::Malformed("no loadable segment"));
    }
    // Without PT_PHDR: where the segment holding the headers maps them.
    let phdr = match phdr {
        Some(p) => p,
        None => segments
            .iter()
            .find(|s| phoff >= s.offset && phoff - s.offset < s.filesz)
            .map(|s| s.vaddr + (phoff - s.offset))
            .ok_or(ElfError::Malformed("the program headers are in no segment"))?,
    };
    Ok(Image {
        relocatable: ty == ET_DYN,
        entry,
        phnum,
        phdr,
        segments,
        align,
        interp,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(ty: u16, phdrs: &[(u32, u32, u64, u64, u64, u64)]) -> Vec<u8> {
        let mut d = vec![0u8; 64 + 56 * phdrs.len()];
        d[..4].copy_from_slice(b"\x7fELF");
        d[4] = 2;
        d[5] = 1;
        d[0x10..0x12].copy_from_slice(&ty.to_le_bytes());
        d[0x12..0x14].copy_from_slice(&62u16.to_le_bytes());
        d[0x18..0x20].copy_from_slice(&0x401000u64.to_le_bytes());
        d[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        d[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        d[0x38..0x3a].copy_from_slice(&u16::try_from(phdrs.len()).unwrap_or(0).to_le_bytes());
        for (i, &(t, f, off, va, fsz, msz)) in phdrs.iter().enumerate() {
            let h = 64 + 56 * i;
            d[h..h + 4].copy_from_slice(&t.to_le_bytes());
            d[h + 4..h + 8].copy_from_slice(&f.to_le_bytes());
            d[h + 8..h + 16].copy_from_slice(&off.to_le_bytes());
            d[h + 16..h + 24].copy_from_slice(&va.to_le_bytes());
            d[h + 32..h + 40].copy_from_slice(&fsz.to_le_bytes());
            d[h + 40..h + 48].copy_from_slice(&msz.to_le_bytes());
            d[h + 48..h + 56].copy_from_slice(&4096u64.to_le_bytes());
        }
        d
    }

    #[test]
    fn static_executable_yields_its_segments_and_headers() {
        let d = header(
            2,
            &[
                (1, 5, 0, 0x400000, 0x2000, 0x2000),
                (1, 6, 0x2000, 0x402000, 0x100, 0x5000),
            ],
        );
        let img = parse(&d).expect("parse");
        assert!(!img.relocatable);
        assert_eq!(img.phdr, 0x400040);
        assert_eq!(img.segments[0].prot, libc::PROT_READ | libc::PROT_EXEC);
        assert_eq!(img.segments[1].prot, libc::PROT_READ | libc::PROT_WRITE);
        assert_eq!(img.span(), (0x400000, 0x407000));
        assert_eq!(headers_len(&d), Ok(64 + 2 * 56));
    }

    #[test]
    fn loader_is_named_and_malformed_files_are_refused_without_panic() {
        let d = header(
            2,
            &[
                (3, 4, 0x200, 0, 28, 28),
                (1, 5, 0, 0x400000, 0x1000, 0x1000),
            ],
        );
        assert_eq!(parse(&d).map(|i| i.interp), Ok(Some((0x200, 28))));
        let d = header(2, &[(1, 5, 0, 0x400000, 0x2000, 0x1000)]);
        assert!(matches!(parse(&d), Err(ElfError::Malformed(_))));
        let d = header(2, &[(1, 5, 0, usize::MAX as u64 - 10, 0x10, 0x100)]);
        assert!(matches!(parse(&d), Err(ElfError::Malformed(_))));
        assert!(matches!(parse(b"\x7fELF"), Err(ElfError::NotElf(_))));
        let mut d = header(2, &[(1, 5, 0, 0x400000, 0x1000, 0x1000)]);
        d.truncate(80);
        assert!(parse(&d).is_err());
        for n in 0..d.len() {
            let _ = parse(&d[..n]);
        }
    }
}
