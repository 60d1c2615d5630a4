//! Maps a static executable into this process: its PT_LOAD segments with
//! their protections, the bss zeroed, at the address it was linked for
//! (ET_EXEC) or at a base the kernel picks for a static-pie (ET_DYN).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::FileExt as _;

use crate::elf::{self, round_up, Image, PAGE};

/// A program mapped and ready to enter.
pub struct Loaded {
    pub image: Image,
    /// What the segments' addresses are relative to (0 for ET_EXEC).
    pub base: usize,
    /// The dynamic loader it names, mapped too (a dynamically linked
    /// program: the loader's entry is entered, AT_BASE is its base).
    pub interp: Option<Box<Loaded>>,
}

impl Loaded {
    pub fn entry(&self) -> usize {
        self.base + self.image.entry
    }
    /// Where execution starts: the dynamic loader's entry, else the program's.
    pub fn start(&self) -> usize {
        self.interp
            .as_ref()
            .map_or_else(|| self.entry(), |l| l.entry())
    }
    /// AT_BASE: the dynamic loader's base, 0 without one.
    pub fn interp_base(&self) -> usize {
        self.interp.as_ref().map_or(0, |l| l.base)
    }
    pub fn phdr(&self) -> usize {
        self.base + self.image.phdr
    }
}

/// Reads and parses the headers of `path`, then maps it.
pub fn load(path: &std::path::Path) -> Result<Loaded, String> {
    let name = path.display();
    let f = File::open(path).map_err(|e| format!("{name}: {e}"))?;
    let mut head = vec![0u8; 64];
    f.read_exact_at(&mut head, 0)
        .map_err(|e| format!("{name}: reading its ELF header: {e}"))?;
    let want = elf::headers_len(&head).map_err(|e| format!("{name}: {e}"))?;
    if want > 1 << 20 {
        return Err(format!("{name}: program headers beyond its first MiB"));
    }
    head.resize(want.max(64), 0);
    f.read_exact_at(&mut head, 0)
        .map_err(|e| format!("{name}: reading its program headers: {e}"))?;
    let image = elf::parse(&head).map_err(|e| format!("{name}: {e}"))?;
    let interp = match image.interp {
        Some((off, len)) => {
            let mut p = vec![0u8; len];
            f.read_exact_at(&mut p, u64::try_from(off).unwrap_or(u64::MAX))
                .map_err(|e| format!("{name}: reading the loader it names: {e}"))?;
            let end = p.iter().position(|&b| b == 0).unwrap_or(p.len());
            let ld = std::path::Path::new(std::ffi::OsStr::from_bytes(&p[..end]));
            let l = load(ld)?;
            if l.interp.is_some() || !l.image.relocatable {
                return Err(format!(
                    "{name}: its loader {} is not a self-contained ET_DYN",
                    ld.display()
                ));
            }
            Some(Box::new(l))
        }
        None => None,
    };
    let base = map_image(&f, &image).map_err(|e| format!("{name}: mapping it: {e}"))?;
    Ok(Loaded {
        image,
        base,
        interp,
    })
}

fn map(
    addr: usize,
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: libc::c_int,
    off: usize,
) -> io::Result<usize> {
    let off = libc::off_t::try_from(off).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a new mapping; MAP_FIXED is used only over the reservation
    // made by `map_image`, which nothing else in this process uses.
    let p = unsafe { libc::mmap(addr as *mut libc::c_void, len, prot, flags, fd, off) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as usize)
}

fn protect(addr: usize, len: usize, prot: libc::c_int) -> io::Result<()> {
    // SAFETY: the range is part of the program's image, mapped by map_image.
    if unsafe { libc::mprotect(addr as *mut libc::c_void, len, prot) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reserves the image's span (at its linked address, or anywhere suitably
/// aligned for a static-pie) and maps each segment over it; returns the base.
fn map_image(f: &File, img: &Image) -> io::Result<usize> {
    let (lo, hi) = img.span();
    let span = hi - lo;
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    let base = if img.relocatable {
        let r = map(0, span + img.align, libc::PROT_NONE, anon, -1, 0)?;
        let start = (r + img.align - 1) & !(img.align - 1);
        // SAFETY: the slack before and after the aligned span is ours.
        unsafe {
            if start > r {
                libc::munmap(r as *mut libc::c_void, start - r);
            }
            let end = start + span;
            if r + span + img.align > end {
                libc::munmap(end as *mut libc::c_void, r + span + img.align - end);
            }
        }
        start - lo
    } else {
        let got = map(
            lo,
            span,
            libc::PROT_NONE,
            anon | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("its addresses {lo:#x}..{hi:#x} are taken in the loader ({e})"),
            )
        })?;
        if got != lo {
            return Err(io::Error::other(format!(
                "its addresses {lo:#x}..{hi:#x} are taken in the loader"
            )));
        }
        0
    };
    let fd = f.as_raw_fd();
    let fixed = libc::MAP_PRIVATE | libc::MAP_FIXED;
    for s in &img.segments {
        let start = base + (s.vaddr & !(PAGE - 1));
        let fend = base + s.vaddr + s.filesz;
        let mend = base + s.vaddr + s.memsz;
        let fpage = round_up(fend);
        if s.filesz > 0 {
            map(
                start,
                fpage - start,
                s.prot | libc::PROT_WRITE,
                fixed,
                fd,
                s.offset & !(PAGE - 1),
            )?;
            if mend > fend {
                // The rest of the last file page, as the kernel clears it: the
                // bss's start, and beyond it zeros a dynamic loader's first
                // allocations rely on (its minimal malloc starts at `_end`).
                // SAFETY: [fend, fpage) lies in the mapping just made, writable.
                unsafe { std::ptr::write_bytes(fend as *mut u8, 0, fpage - fend) };
            }
            protect(start, fpage - start, s.prot)?;
        }
        let zstart = if s.filesz > 0 { fpage } else { start };
        if round_up(mend) > zstart {
            map(
                zstart,
                round_up(mend) - zstart,
                s.prot,
                fixed | libc::MAP_ANONYMOUS,
                -1,
                0,
            )?;
        }
    }
    Ok(base)
}
