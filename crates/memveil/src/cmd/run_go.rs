//! Whether an executable is a Go program: Go maps its heap by raw system
//! call, so a preload library cannot see it even in a dynamically linked
//! (cgo) Go program such as Debian's etcd; `memveil run` sends every Go
//! program through the loader.
//!
//! A Go executable carries a `.go.buildinfo` or `.note.go.buildid` section,
//! and its build id as an ELF note of owner "Go" (type 4) in a `PT_NOTE`
//! segment (which survives stripping the section headers). Only the headers
//! and those small tables are read (with `pread`), never the whole file.

use std::fs::File;
use std::path::Path;

use super::run::{BytesAt as _, FileBytes};

/// Section names only Go's linker writes.
const GO_SECTIONS: [&[u8]; 2] = [b".go.buildinfo", b".note.go.buildid"];
/// Go's build-id note: owner "Go", type 4.
const GO_NOTE_TYPE: u32 = 4;
/// Bounds on what is read from an untrusted file.
const MAX_TABLE: usize = 1 << 20;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// `len` bytes at `off` of `f` (at most [`MAX_TABLE`]), through `memveil
/// run`'s own pread reader; `None` when the file holds fewer.
fn read_at(f: &File, off: u64, len: usize) -> Option<Vec<u8>> {
    if len > MAX_TABLE {
        return None;
    }
    let b = FileBytes(f).bytes_at(off, len).ok()?;
    (b.len() == len).then_some(b)
}

/// Whether the section headers name a Go section.
fn go_section(f: &File, eh: &[u8]) -> Option<bool> {
    let (shoff, shentsize, shnum, shstrndx) = (
        u64_at(eh, 0x28)?,
        usize::from(u16_at(eh, 0x3a)?),
        usize::from(u16_at(eh, 0x3c)?),
        usize::from(u16_at(eh, 0x3e)?),
    );
    if shoff == 0 || shentsize < 0x40 || shstrndx >= shnum {
        return Some(false);
    }
    let table = read_at(f, shoff, shentsize.checked_mul(shnum)?)?;
    let sh = |i: usize| table.get(i * shentsize..(i + 1) * shentsize);
    let strtab = sh(shstrndx)?;
    let names = read_at(
        f,
        u64_at(strtab, 0x18)?,
        usize::try_from(u64_at(strtab, 0x20)?).ok()?,
    )?;
    Some((0..shnum).filter_map(sh).any(|s| {
        let Some(at) = u32_at(s, 0).and_then(|n| usize::try_from(n).ok()) else {
            return false;
        };
        let name = names.get(at..).unwrap_or_default();
        let name = &name[..name.iter().position(|c| *c == 0).unwrap_or(name.len())];
        GO_SECTIONS.contains(&name)
    }))
}

/// Whether a `PT_NOTE` segment holds Go's build-id note.
fn go_note(f: &File, eh: &[u8]) -> Option<bool> {
    const PT_NOTE: u32 = 4;
    let (phoff, phentsize, phnum) = (
        u64_at(eh, 0x20)?,
        usize::from(u16_at(eh, 0x36)?),
        usize::from(u16_at(eh, 0x38)?),
    );
    if phentsize < 0x38 {
        return Some(false);
    }
    let table = read_at(f, phoff, phentsize.checked_mul(phnum)?)?;
    for ph in table.chunks_exact(phentsize) {
        if u32_at(ph, 0)? != PT_NOTE {
            continue;
        }
        let size = usize::try_from(u64_at(ph, 0x20)?).ok()?.min(4096);
        let notes = read_at(f, u64_at(ph, 0x08)?, size)?;
        let mut at = 0;
        while at + 12 <= notes.len() {
            let namesz = usize::try_from(u32_at(&notes, at)?).ok()?;
            let descsz = usize::try_from(u32_at(&notes, at + 4)?).ok()?;
            let kind = u32_at(&notes, at + 8)?;
            let name = notes.get(at + 12..at + 12 + namesz)?;
            if kind == GO_NOTE_TYPE && name.strip_suffix(b"\0").unwrap_or(name) == b"Go" {
                return Some(true);
            }
            at += 12 + namesz.next_multiple_of(4) + descsz.next_multiple_of(4);
        }
    }
    Some(false)
}

/// Whether `path` is a 64-bit little-endian ELF file built by Go's linker.
/// A file that cannot be read or parsed is not (the caller's own checks
/// report why it cannot run).
pub(super) fn is_go(path: &Path) -> bool {
    let Ok(f) = File::open(path) else {
        return false;
    };
    let Some(eh) = read_at(&f, 0, 64) else {
        return false;
    };
    if &eh[..4] != b"\x7fELF" || eh[4] != 2 || eh[5] != 1 {
        return false;
    }
    go_section(&f, &eh) == Some(true) || go_note(&f, &eh) == Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le32(n: usize) -> [u8; 4] {
        u32::try_from(n).expect("small").to_le_bytes()
    }

    fn le64(n: usize) -> [u8; 8] {
        (n as u64).to_le_bytes()
    }

    /// A minimal ELF64 file: the header, one PT_NOTE program header with a
    /// note of owner `owner`, and section headers named `sections`.
    fn elf(owner: &[u8], sections: &[&str]) -> Vec<u8> {
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        // One program header at 64.
        b[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        b[0x36..0x38].copy_from_slice(&0x38u16.to_le_bytes());
        b[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let note_off: usize = 64 + 0x38;
        let mut note = Vec::new();
        let name = [owner, b"\0"].concat();
        note.extend_from_slice(&le32(name.len()));
        note.extend_from_slice(&4u32.to_le_bytes());
        note.extend_from_slice(&GO_NOTE_TYPE.to_le_bytes());
        note.extend_from_slice(&name);
        note.resize(note.len().next_multiple_of(4), 0);
        note.extend_from_slice(b"abcd");
        let mut ph = vec![0u8; 0x38];
        ph[..4].copy_from_slice(&4u32.to_le_bytes());
        ph[0x08..0x10].copy_from_slice(&le64(note_off));
        ph[0x20..0x28].copy_from_slice(&le64(note.len()));
        b.extend_from_slice(&ph);
        b.extend_from_slice(&note);
        // Section names, then the section headers (a null one, the names'
        // table, and one per name).
        let mut names = vec![0u8];
        let mut offs = Vec::new();
        for s in [".shstrtab"].iter().chain(sections) {
            offs.push(le32(names.len()));
            names.extend_from_slice(s.as_bytes());
            names.push(0);
        }
        let names_off = b.len();
        b.extend_from_slice(&names);
        let shoff = b.len();
        let n = 2 + sections.len();
        b.extend_from_slice(&[0u8; 0x40]);
        for (k, off) in offs.iter().enumerate() {
            let mut sh = vec![0u8; 0x40];
            sh[..4].copy_from_slice(off);
            if k == 0 {
                sh[0x18..0x20].copy_from_slice(&le64(names_off));
                sh[0x20..0x28].copy_from_slice(&le64(names.len()));
            }
            b.extend_from_slice(&sh);
        }
        b[0x28..0x30].copy_from_slice(&le64(shoff));
        b[0x3a..0x3c].copy_from_slice(&0x40u16.to_le_bytes());
        b[0x3c..0x3e].copy_from_slice(&u16::try_from(n).expect("few").to_le_bytes());
        b[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        b
    }

    fn check(bytes: &[u8]) -> bool {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("memveil-is-go-{}-{n}", std::process::id()));
        std::fs::write(&p, bytes).expect("write");
        let r = is_go(&p);
        let _ = std::fs::remove_file(&p);
        r
    }

    #[test]
    fn go_programs_are_known_by_their_sections_or_their_build_id_note() {
        assert!(check(&elf(b"Go", &[".text", ".go.buildinfo"])));
        assert!(check(&elf(b"GNU", &[".note.go.buildid"])));
        // Section headers stripped: the note alone.
        assert!(check(&elf(b"Go", &[])));
        assert!(!check(&elf(b"GNU", &[".text", ".data", ".gopclntab_not"])));
    }

    #[test]
    fn truncated_or_lying_headers_are_not_go_and_do_not_panic() {
        let good = elf(b"GNU", &[".go.buildinfo"]);
        for cut in [10, 64, 100, good.len() - 20] {
            let _ = check(&good[..cut]);
        }
        let mut lying = good.clone();
        lying[0x3c..0x3e].copy_from_slice(&u16::MAX.to_le_bytes());
        lying[0x3a..0x3c].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(!check(&lying));
        let mut lying = good;
        lying[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(!check(&lying));
    }

    #[test]
    fn debians_etcd_is_a_go_program_and_python_is_not() {
        assert!(!is_go(Path::new("/usr/bin/python3")), "python3");
        if Path::new("/usr/bin/etcd").is_file() {
            assert!(is_go(Path::new("/usr/bin/etcd")), "etcd");
        } else {
            memveil_testkit::skip(
                memveil_testkit::Need::Installed("etcd-server"),
                "/usr/bin/etcd absent: the check on a real Go program (scripts/install.sh --deps installs it)",
            );
        }
    }
}
