//! What the shield's integration tests share: fresh pages, a shield that
//! skips only where userfaultfd is not permitted, protection of a buffer.

#![allow(dead_code)]

use memveil_shield::{Config, Shield, ShieldError, StatsFile, PAGE};
use memveil_sys::uffd;
use memveil_testkit::{skip, Need};

/// A range of fresh anonymous pages (leaked: the tests own them for good).
pub fn pages(n: usize) -> &'static mut [u8] {
    let p = uffd::map_anonymous_direct(n * PAGE).expect("mmap");
    // SAFETY: a fresh mapping of n pages, owned by the test from now on.
    unsafe { std::slice::from_raw_parts_mut(p, n * PAGE) }
}

/// A shield with `cfg`; `None` (after printing why) only where this process
/// may not handle faults taken inside system calls. Any other failure is a
/// failure of the test.
pub fn shield(cfg: &Config) -> Option<Shield> {
    match Shield::new(cfg, StatsFile::private()) {
        Ok(s) => Some(s),
        Err(e @ ShieldError::NotPermitted { .. }) => {
            skip(Need::Userfaultfd, format!("shield unavailable here: {e}"));
            None
        }
        Err(e) => panic!("the shield failed to start: {e}"),
    }
}

/// Puts `buf` (from [`pages`]) under `s` with KeyID `keyid`.
pub fn protect(s: &Shield, buf: &mut [u8], keyid: u16) {
    // SAFETY: `buf` is a leaked anonymous mapping used only through the shield.
    unsafe {
        s.encrypt_mprotect(
            buf.as_mut_ptr(),
            buf.len(),
            libc::PROT_READ | libc::PROT_WRITE,
            keyid,
        )
    }
    .expect("encrypt_mprotect");
}
