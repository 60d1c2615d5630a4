//! Whether an executable is a Go program: Go maps its heap by raw system
//! call, so a preload library cannot see it even in a dynamically linked
//! (cgo) Go program such as Debian's etcd; `memveil run` sends every Go
//! program through the loader.
//!
//! A Go executable carries a `.go.buildinfo` or `.note.go.buildid` section,
//! and its build id as an ELF note of owner "Go" (type 4) in a `PT_NOTE`
//! segment (which survives stripping the section headers). `memveil run`'s
//! one reading of the executable's headers (`run::parse_elf`) asks here,
//! with the note segments it found; only the section table and its names
//! are read besides (with `pread`), never the whole file.

use super::run::{field, BytesAt};

/// Section names only Go's linker writes.
const GO_SECTIONS: [&[u8]; 2] = [b".go.buildinfo", b".note.go.buildid"];
/// Go's build-id note: owner "Go", type 4.
const GO_NOTE_TYPE: u64 = 4;
/// Bounds on what is read from an untrusted file.
const MAX_TABLE: u64 = 1 << 20;
/// The most of a note segment read.
const MAX_NOTES: u64 = 4096;

/// `len` bytes at `off` of `file` (at most [`MAX_TABLE`]); `None` when the
/// file holds fewer.
fn read_at(file: &(impl BytesAt + ?Sized), off: u64, len: u64) -> Option<Vec<u8>> {
    if len > MAX_TABLE {
        return None;
    }
    let len = usize::try_from(len).ok()?;
    let b = file.bytes_at(off, len).ok()?;
    (b.len() == len).then_some(b)
}

/// Whether the section headers name a Go section.
fn go_section(file: &(impl BytesAt + ?Sized), eh: &[u8]) -> Option<bool> {
    let (shoff, shentsize, shnum, shstrndx) = (
        field(eh, 0x28, 8)?,
        field(eh, 0x3a, 2)?,
        field(eh, 0x3c, 2)?,
        field(eh, 0x3e, 2)?,
    );
    if shoff == 0 || shentsize < 0x40 || shstrndx >= shnum {
        return Some(false);
    }
    let table = read_at(file, shoff, shentsize.checked_mul(shnum)?)?;
    let (shentsize, shnum) = (
        usize::try_from(shentsize).ok()?,
        usize::try_from(shnum).ok()?,
    );
    let sh = |i: usize| table.get(i * shentsize..(i + 1) * shentsize);
    let strtab = sh(usize::try_from(shstrndx).ok()?)?;
    let names = read_at(file, field(strtab, 0x18, 8)?, field(strtab, 0x20, 8)?)?;
    Some((0..shnum).filter_map(sh).any(|s| {
        let Some(at) = field(s, 0, 4).and_then(|n| usize::try_from(n).ok()) else {
            return false;
        };
        let name = names.get(at..).unwrap_or_default();
        let name = &name[..name.iter().position(|c| *c == 0).unwrap_or(name.len())];
        GO_SECTIONS.contains(&name)
    }))
}

/// Whether a note segment (its file offset and size) holds Go's build-id
/// note.
fn go_note(file: &(impl BytesAt + ?Sized), (off, size): (u64, u64)) -> Option<bool> {
    let notes = read_at(file, off, size.min(MAX_NOTES))?;
    let mut at = 0u64;
    while at + 12 <= notes.len() as u64 {
        let namesz = field(&notes, at, 4)?;
        let descsz = field(&notes, at + 4, 4)?;
        let kind = field(&notes, at + 8, 4)?;
        let name =
            notes.get(usize::try_from(at + 12).ok()?..usize::try_from(at + 12 + namesz).ok()?)?;
        if kind == GO_NOTE_TYPE && name.strip_suffix(b"\0").unwrap_or(name) == b"Go" {
            return Some(true);
        }
        at += 12 + namesz.next_multiple_of(4) + descsz.next_multiple_of(4);
    }
    Some(false)
}

/// Whether the 64-bit little-endian ELF file `file`, whose 64-byte header
/// is `head` and whose `PT_NOTE` segments are `notes` (file offset, size),
/// was built by Go's linker. A file that cannot be parsed is not (the
/// caller's own checks report why it cannot run).
pub(super) fn is_go(file: &(impl BytesAt + ?Sized), head: &[u8], notes: &[(u64, u64)]) -> bool {
    if head.get(..4) != Some(b"\x7fELF") || head.get(4..6) != Some(&[2, 1]) {
        return false;
    }
    go_section(file, head) == Some(true) || notes.iter().any(|&n| go_note(file, n) == Some(true))
}

#[cfg(test)]
mod tests {
    use super::super::run::{parse_elf, FileBytes};

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
        // Four bytes of description; type 4, Go's build id.
        note.extend_from_slice(&4u32.to_le_bytes());
        note.extend_from_slice(&4u32.to_le_bytes());
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

    /// Whether `memveil run`'s reading of an executable calls it Go.
    fn check(bytes: &[u8]) -> bool {
        parse_elf(bytes).go
    }

    fn file_is_go(path: &str) -> bool {
        let f = std::fs::File::open(path).expect(path);
        parse_elf(&FileBytes(&f)).go
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
        assert!(!file_is_go("/usr/bin/python3"), "python3");
        if std::path::Path::new("/usr/bin/etcd").is_file() {
            assert!(file_is_go("/usr/bin/etcd"), "etcd");
        } else {
            memveil_testkit::skip(
                memveil_testkit::Need::Installed("etcd-server"),
                "/usr/bin/etcd absent: the check on a real Go program (scripts/install.sh --deps installs it)",
            );
        }
    }
}
