//! `mseal(2)` (Linux 6.10): sealing mappings for the rest of the process's
//! life. A sealed range can no longer be unmapped, moved (`mremap`),
//! mapped over (`MAP_FIXED`), have its protection changed (`mprotect`,
//! `pkey_mprotect`) or be discarded by a destructive `madvise`; each of those
//! fails with `EPERM`. The mapping goes away only with the process.
//!
//! The vault seals its code (the executable's and its shared libraries'
//! read-only and executable mappings) and the secret memory that holds keys
//! for its whole life, so that code running under an attacker's control
//! cannot make the code writable, swap a guard page for readable memory, or
//! move the key pages somewhere it can read them more easily.

use std::io;
use std::path::PathBuf;

use crate::mem::Mapping;

/// `mseal(addr, len, 0)`.
///
/// # Errors
/// `ENOSYS` on kernels before 6.10; `EINVAL` for an unaligned start or
/// non-zero flags; `ENOMEM` when the range is not fully mapped.
fn mseal(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: mseal takes an address range and flags; it reads and writes no
    // memory of ours, and only forbids later changes to the range's mapping
    // (the unmaps our destructors would make then fail, which they ignore:
    // the pages stay mapped, nothing dangles).
    let r = unsafe { libc::syscall(libc::SYS_mseal, addr, len, 0_u64) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether an error of this module means the kernel has no `mseal`.
#[must_use]
pub fn unavailable(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSYS)
}

impl Mapping {
    /// Seals the whole mapping (its guard pages too) until the process
    /// exits: from now on it cannot be unmapped, remapped or have its
    /// protection changed, and dropping it leaves the pages mapped. For
    /// mappings that live as long as the process.
    ///
    /// # Errors
    /// As `mseal(2)`: `ENOSYS` before Linux 6.10.
    pub fn seal(&self) -> io::Result<()> {
        mseal(self.as_ptr() as usize, self.len())
    }
}

/// A file-backed mapping as `/proc/self/maps` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapEntry {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
    /// `r-xp` and the like, from `/proc/self/maps`.
    pub perms: String,
    /// The file mapped.
    pub path: PathBuf,
}

/// Seals every mapping of the executable and of the shared libraries
/// loaded now that is not writable (code, read-only data, the relocation
/// tables made read-only after loading), as `/proc/self/maps` lists them.
/// Libraries loaded later (`dlopen`) stay unsealed. Returns what it sealed.
///
/// # Errors
/// Reading `/proc/self/maps`; `mseal(2)`'s error (`ENOSYS` before 6.10)
/// at the first mapping it refuses.
pub fn seal_code() -> io::Result<Vec<MapEntry>> {
    let exe = std::fs::read_link("/proc/self/exe")?;
    let mut done = Vec::new();
    for m in mappings()? {
        let library = m
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".so") || n.contains(".so."));
        if m.perms.contains('w') || !(m.path == exe || library) {
            continue;
        }
        mseal(m.start, m.end - m.start)?;
        done.push(m);
    }
    Ok(done)
}

/// The file-backed mappings of this process (`memfd_secret` ones show as
/// `/secretmem`), from `/proc/self/maps`.
///
/// # Errors
/// Reading `/proc/self/maps`.
pub fn mappings() -> io::Result<Vec<MapEntry>> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    Ok(maps.lines().filter_map(parse_line).collect())
}

/// One line of `/proc/self/maps`: `start-end perms offset dev inode path`.
fn parse_line(l: &str) -> Option<MapEntry> {
    let mut f = l.split_ascii_whitespace();
    let (start, end) = f.next()?.split_once('-')?;
    let perms = f.next()?.to_owned();
    let path = f.nth(3)?;
    if !path.starts_with('/') {
        return None;
    }
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    (end > start).then(|| MapEntry {
        start,
        end,
        perms,
        path: PathBuf::from(path),
    })
}

/// `mprotect(range, same protection)`: changes nothing on an unsealed
/// range and fails with `EPERM` on a sealed one (the vault's mseal
/// self-test, `MEMVEIL_MSEAL_SELFTEST`).
///
/// # Errors
/// `mprotect(2)`'s: `EPERM` when sealed.
pub fn reprotect_same(s: &MapEntry) -> io::Result<()> {
    let mut prot = 0;
    for (c, p) in [
        ('r', libc::PROT_READ),
        ('w', libc::PROT_WRITE),
        ('x', libc::PROT_EXEC),
    ] {
        if s.perms.contains(c) {
            prot |= p;
        }
    }
    // SAFETY: the range is a mapping of this process as /proc/self/maps
    // listed it, and the protection is the one it has, so no access that
    // works now stops working (or the other way round).
    let r = unsafe { libc::mprotect(s.start as *mut libc::c_void, s.end - s.start, prot) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Protection;
    use crate::page_size;

    #[test]
    fn maps_lines_parse() {
        let m = parse_line(
            "55d0c8a00000-55d0c8a2a000 r-xp 00002000 fd:01 1234   /usr/bin/memveil (deleted)",
        );
        // A path with spaces keeps its first word only; good enough to
        // compare with /proc/self/exe, which never is "(deleted)" here.
        let m = m.expect("parsed");
        assert_eq!(m.start, 0x55d0_c8a0_0000);
        assert_eq!(m.perms, "r-xp");
        assert!(parse_line("7ffd1000-7ffd3000 r-xp 00000000 00:00 0 [vdso]").is_none());
        assert!(parse_line("7ffd1000-7ffd3000 rw-p 00000000 00:00 0").is_none());
    }

    #[test]
    fn a_sealed_mapping_cannot_be_unmapped_or_reprotected() {
        let ps = page_size();
        let m = Mapping::anonymous(2 * ps, Protection::ReadWrite).expect("map");
        match m.seal() {
            Err(e) if unavailable(&e) => {
                memveil_testkit::skip(
                    memveil_testkit::Need::HostSetting("Linux 6.10+ (mseal)"),
                    "mseal unavailable: kernel older than 6.10",
                );
                return;
            }
            r => r.expect("mseal"),
        }
        let e = m.protect(0, ps, Protection::Read).expect_err("sealed");
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        // SAFETY: an unmap of our own mapping; if it succeeded the test
        // fails and `m` is forgotten so its drop does not unmap again.
        let r = unsafe { libc::munmap(m.as_ptr().cast(), 2 * ps) };
        let e = io::Error::last_os_error();
        if r == 0 {
            std::mem::forget(m);
            panic!("munmap of a sealed mapping succeeded");
        }
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        // Still there, still writable.
        // SAFETY: the mapping is read-write and ours.
        unsafe { m.as_ptr().write_volatile(7) };
        drop(m); // its munmap fails; the pages stay (a leak of 2 pages)
    }

    #[test]
    fn an_unsealed_mapping_reprotects_to_the_same_protection() {
        let m = Mapping::anonymous(page_size(), Protection::ReadWrite).expect("map");
        let s = MapEntry {
            start: m.as_ptr() as usize,
            end: m.as_ptr() as usize + page_size(),
            perms: "rw-p".into(),
            path: PathBuf::new(),
        };
        reprotect_same(&s).expect("unsealed");
    }
}
