//! A tenant's page key from the host key table (`memveil run --keyid N`).
//!
//! `memveil run` asks the vault for KeyID N's page key (derived in the vault
//! from the KeyID's key: `memveil_engine::KeyTable::derive_page_key`) and
//! hands it to the program in a `memfd_secret` file whose descriptor the
//! program and all its descendants inherit: byte 0 is the key's length (32
//! for AES-XTS-128, 64 for AES-XTS-256), the data key and tweak key follow.
//! Each process's shield reads it into its own secret memory at start-up and
//! after `fork` (its own secret memory is not inherited), and encrypts its
//! heap and its shared memory under it, so every process under KeyID N
//! shares one key, as TME-MK's KeyIDs do.

use std::os::fd::{AsFd as _, OwnedFd, RawFd};

use memveil_cipher::Xts;
use memveil_secmem::{Level, Policy, SecretBox, SecretPool};
use memveil_sys::uffd;

use crate::{ShieldError, PAGE};

/// A KeyID's page key in this process's secret memory.
pub struct PageKey {
    keyid: u16,
    raw: SecretBox<[u8]>,
    _pool: SecretPool,
}

impl std::fmt::Debug for PageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PageKey(KeyID {}, <{} bytes>)",
            self.keyid,
            self.raw.len()
        )
    }
}

/// Bytes read from a key file: the length byte and the longest key.
const PAGE_KEY_FILE: usize = 65;

/// A zeroed `struct stat` for `fstat` to fill.
fn unsafe_zeroed_stat() -> libc::stat {
    // SAFETY: `struct stat` is plain integers, for which all-zero is valid.
    unsafe { std::mem::zeroed() }
}

fn bad(fd: RawFd, why: impl std::fmt::Display) -> ShieldError {
    ShieldError::PageKey(format!(
        "the page key of the host KeyID (descriptor {fd}, from memveil run --keyid): {why}"
    ))
}

impl PageKey {
    /// Reads the page key of `keyid` from the inherited descriptor `fd`.
    ///
    /// # Errors
    /// [`ShieldError::PageKey`] when the descriptor is closed or not a key
    /// file (a program that closes its inherited descriptors before it forks
    /// leaves its children without their key), and the errors of secret
    /// memory.
    pub fn from_fd(fd: RawFd, keyid: u16, policy: Policy) -> Result<Self, ShieldError> {
        // Only a file of exactly one page is a key file: an empty or short
        // file at this number (the program closed the descriptor and opened
        // another) would fault on the read below.
        let mut st: libc::stat = unsafe_zeroed_stat();
        // SAFETY: fstat writes one `struct stat` into `st`, which it is.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(bad(
                fd,
                format!(
                    "{} (was the descriptor closed by the program?)",
                    std::io::Error::last_os_error()
                ),
            ));
        }
        if usize::try_from(st.st_size).ok() != Some(PAGE) {
            return Err(bad(
                fd,
                format!(
                    "not a key file ({} bytes, not {PAGE}): the program reused the descriptor",
                    st.st_size
                ),
            ));
        }
        // SAFETY: a fresh read-only shared mapping of the file chosen by the
        // kernel; it replaces nothing and is unmapped below.
        let p = unsafe {
            uffd::mmap_direct(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(bad(
                fd,
                format!(
                    "{} (was the descriptor closed by the program?)",
                    std::io::Error::last_os_error()
                ),
            ));
        }
        let pool = SecretPool::new(4096, policy);
        let r = match pool {
            Err(e) => Err(e.into()),
            Ok(pool) => pool
                .alloc_bytes(PAGE_KEY_FILE)
                .map(|mut raw| {
                    // SAFETY: `p` maps the file's first page, readable (the
                    // file is exactly one page: checked above); the copy is a
                    // raw one, as a writer elsewhere may change the bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            p.cast::<u8>(),
                            raw.as_mut_ptr(),
                            PAGE_KEY_FILE,
                        );
                    }
                    (raw, pool)
                })
                .map_err(ShieldError::from),
        };
        // SAFETY: unmapping the page mapped above; `page` is not used again.
        let _ = unsafe { uffd::unmap_direct(p.cast(), PAGE) };
        let (file, pool) = r?;
        let n = usize::from(file[0]);
        if n != 32 && n != 64 {
            return Err(bad(fd, format!("key length {n}, not 32 or 64")));
        }
        let mut raw = pool.alloc_bytes(n)?;
        raw.copy_from_slice(&file[1..=n]);
        drop(file);
        if raw[..n / 2] == raw[n / 2..] {
            return Err(bad(fd, "equal XTS halves"));
        }
        Ok(Self {
            keyid,
            raw,
            _pool: pool,
        })
    }

    /// The KeyID the key belongs to.
    #[must_use]
    pub fn keyid(&self) -> u16 {
        self.keyid
    }

    /// The key as an XTS key schedule in `pool`.
    pub(crate) fn xts(&self, pool: &SecretPool) -> Result<SecretBox<Xts>, ShieldError> {
        let h = self.raw.len() / 2;
        // `from_fd` checked the length (32 or 64) and the distinct halves.
        Ok(pool.alloc(|| Xts::new(&self.raw[..h], &self.raw[h..]).expect("checked by from_fd"))?)
    }
}

/// Stops this process, with a message and exit status 123, once `memveil
/// run` (process `supervisor`), which would stop it when KeyID `keyid` is
/// cleared, has ended: a tenant never outlives the process that answers for
/// it (killed, or crashed). At start-up and in every forked child.
///
/// # Errors
/// `pidfd_open` or the thread could not be started; a supervisor already
/// gone is [`ShieldError::PageKey`].
pub fn watch_supervisor(supervisor: u32) -> Result<(), ShieldError> {
    let started = crate::shared::when_gone(supervisor, "spawn supervisor watchdog", || {
        const MSG: &[u8] = b"memveil-shield: memveil run, which answers for this tenant of a host \
KeyID, is gone: stopping (exit 123), as a clear of the KeyID could not stop it any more\n";
        // SAFETY: a static buffer to stderr, then _exit: nothing allocates
        // or unwinds.
        unsafe {
            let _ = libc::write(2, MSG.as_ptr().cast(), MSG.len());
            libc::_exit(123);
        }
    })?;
    if started {
        Ok(())
    } else {
        Err(ShieldError::PageKey(format!(
            "memveil run (pid {supervisor}), which answers for this tenant, is gone"
        )))
    }
}

/// Writes a page key into a new key file for a program to inherit (`memveil
/// run --keyid`): a `memfd_secret` file, or with `policy` allowing
/// [`Level::Locked`] and no `memfd_secret`, an ordinary memfd (readable by
/// root). The descriptor is close-on-exec: clear that on the copy the
/// program inherits. Returns the file and its level.
///
/// # Errors
/// [`ShieldError::PageKey`] for a key of another length than 32 or 64
/// bytes; the system calls' errors.
pub fn page_key_file(raw: &[u8], policy: Policy) -> Result<(OwnedFd, Level), ShieldError> {
    use memveil_sys::mem::{Mapping, Protection};
    if raw.len() != 32 && raw.len() != 64 {
        return Err(ShieldError::PageKey(format!(
            "a page key is 32 or 64 bytes, not {}",
            raw.len()
        )));
    }
    let os =
        |what: &'static str| move |e: std::io::Error| ShieldError::PageKey(format!("{what}: {e}"));
    let (fd, level) = match memveil_secmem::secret_file() {
        Ok(fd) => (fd, Level::Secret),
        Err(_) if policy.weakest() >= Level::Locked => (plain_memfd()?, Level::Locked),
        Err(e) => {
            return Err(ShieldError::PageKey(format!(
                "memfd_secret: {e}: the page key would sit in memory the kernel maps; \
                 pass --allow-level locked to accept that"
            )))
        }
    };
    let file = std::fs::File::from(fd);
    file.set_len(PAGE as u64)
        .map_err(os("ftruncate key file"))?;
    let mut map = Mapping::anonymous(PAGE, Protection::None).map_err(os("mmap"))?;
    map.map_fd_at(0, PAGE, file.as_fd())
        .map_err(os("mmap key file"))?;
    write_key(&map, raw);
    drop(map);
    Ok((OwnedFd::from(file), level))
}

/// A plain memfd for the key when `memfd_secret` is missing and accepted so.
fn plain_memfd() -> Result<OwnedFd, ShieldError> {
    use std::os::fd::FromRawFd as _;
    // SAFETY: a NUL-terminated name and flags; returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"memveil-page-key".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(ShieldError::PageKey(format!(
            "memfd_create: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: `fd` is new and owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn write_key(map: &memveil_sys::mem::Mapping, raw: &[u8]) {
    // SAFETY: `map` holds one read-write page of the key file, mapped by
    // `map_fd_at` and alive for this call; 1 + raw.len() <= 65 < PAGE.
    let page = unsafe { std::slice::from_raw_parts_mut(map.as_ptr(), PAGE) };
    // 32 or 64, checked by the caller.
    page[0] = u8::try_from(raw.len()).unwrap_or(0);
    page[1..=raw.len()].copy_from_slice(raw);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd as _;

    #[test]
    fn a_key_file_reads_back_and_a_bad_one_is_named() {
        let policy = Policy::allow(Level::Locked);
        let raw: Vec<u8> = (0..32u8).collect();
        let (fd, _) = page_key_file(&raw, policy).expect("key file");
        let k = PageKey::from_fd(fd.as_raw_fd(), 7, policy).expect("read back");
        assert_eq!(k.keyid(), 7);
        assert_eq!(&k.raw[..], &raw[..]);
        let pool = SecretPool::new(4096, policy).expect("pool");
        let x = k.xts(&pool).expect("xts");
        let mut a = [0u8; 64];
        x.encrypt_unit(5, &mut a).expect("unit");
        let mut b = [0u8; 64];
        Xts::new(&raw[..16], &raw[16..])
            .expect("xts")
            .encrypt_unit(5, &mut b)
            .expect("unit");
        assert_eq!(a, b);
        assert!(page_key_file(&raw[..31], policy).is_err());
        // A closed descriptor: the message says what happened.
        let n = fd.as_raw_fd();
        drop(fd);
        let e = PageKey::from_fd(n, 7, policy).expect_err("closed");
        assert!(e.to_string().contains("closed by the program"), "{e}");
        // A file that is no key file.
        let zero = memveil_sys::ipc::memfd_sealed("not-a-key", PAGE as u64).expect("memfd");
        let e = PageKey::from_fd(zero.as_raw_fd(), 7, policy).expect_err("zero");
        assert!(e.to_string().contains("key length 0"), "{e}");
        // An empty file at the number (it used to fault): refused by size.
        let empty = memveil_sys::ipc::memfd_sealed("empty", 0).expect("memfd");
        let e = PageKey::from_fd(empty.as_raw_fd(), 7, policy).expect_err("empty");
        assert!(e.to_string().contains("not a key file (0 bytes"), "{e}");
    }
}
