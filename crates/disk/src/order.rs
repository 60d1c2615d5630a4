//! What keeps concurrent requests on the served file in order: a lock over
//! the sectors each request touches, and the image's write-back errors as
//! each open handle of the file has still to hear them.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, PoisonError};

/// Locks over byte ranges of the image (always whole sectors). A write
/// holds its sectors alone, a read shares them with other reads: two writes
/// over a common sector run one after the other, whole (a read-modify-write
/// of an edge sector never puts back bytes a full-sector write has replaced
/// meanwhile), and a read never sees a sector half written. Requests over
/// different sectors run in parallel.
#[derive(Default)]
pub(crate) struct SectorLocks {
    held: Mutex<Ranges>,
    freed: Condvar,
}

#[derive(Default)]
struct Ranges {
    held: Vec<Held>,
    /// Requests waiting for a range (a release wakes them only when some).
    waiting: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Held {
    start: u64,
    end: u64,
    write: bool,
}

impl Held {
    fn conflicts(&self, o: &Held) -> bool {
        (self.write || o.write) && self.start < o.end && o.start < self.end
    }
}

/// Sectors held until dropped.
pub(crate) struct SectorGuard<'a> {
    locks: &'a SectorLocks,
    held: Held,
}

impl SectorLocks {
    /// Waits until no other request holds a sector of `[start, end)` in a
    /// way that conflicts, then holds them (alone when `write`).
    pub(crate) fn lock(&self, start: u64, end: u64, write: bool) -> SectorGuard<'_> {
        let me = Held { start, end, write };
        let mut g = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        while g.held.iter().any(|h| h.conflicts(&me)) {
            g.waiting += 1;
            g = self.freed.wait(g).unwrap_or_else(PoisonError::into_inner);
            g.waiting -= 1;
        }
        g.held.push(me);
        SectorGuard {
            locks: self,
            held: me,
        }
    }
}

impl Drop for SectorGuard<'_> {
    fn drop(&mut self) {
        let mut g = self
            .locks
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Equal entries (reads of the same sectors) are interchangeable.
        if let Some(i) = g.held.iter().position(|h| *h == self.held) {
            g.held.swap_remove(i);
        }
        let wake = g.waiting > 0;
        drop(g);
        if wake {
            self.locks.freed.notify_all();
        }
    }
}

/// The image's write-back errors, reported as Linux reports a file's to its
/// open file descriptions (`errseq_t`): once to every handle of the served
/// file that was open when the error was found, at that handle's next
/// `fsync` or `flush`.
///
/// The server writes the image through one file of its own, and the kernel
/// reports a failed write-back to the first `fsync` of that file only: the
/// `flush` of some unrelated `close()` would take the error, and the loop
/// device's next `fsync` would succeed over lost writes. So the server
/// counts the errors its syncs find and remembers, per handle it gave out,
/// how many that handle has been told.
#[derive(Default)]
pub(crate) struct WritebackErrors {
    /// Serialises the syncs of the image, so a sync that succeeds because
    /// another one took the error counts that error.
    sync: Mutex<()>,
    state: Mutex<ErrState>,
}

#[derive(Default)]
struct ErrState {
    /// Errors found so far.
    found: u64,
    /// The last one's errno.
    errno: i32,
    /// Per open handle: how many errors it has been told (or were found
    /// before it opened).
    seen: HashMap<u64, u64>,
    next: u64,
}

impl WritebackErrors {
    /// A new handle; it will hear of errors found from now on.
    pub(crate) fn open(&self) -> u64 {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.next += 1;
        let (fh, found) = (s.next, s.found);
        s.seen.insert(fh, found);
        fh
    }

    /// The handle is closed.
    pub(crate) fn release(&self, fh: u64) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .seen
            .remove(&fh);
    }

    /// Runs `sync` (an `fsync` of the image) for handle `fh`. `Err(errno)`
    /// when it failed, or when an earlier sync of any handle failed and
    /// `fh` has not been told yet; `found` is `Some` with the sync's own
    /// error.
    pub(crate) fn sync(
        &self,
        fh: u64,
        sync: impl FnOnce() -> std::io::Result<()>,
    ) -> (Result<(), i32>, Option<std::io::Error>) {
        let _one = self.sync.lock().unwrap_or_else(PoisonError::into_inner);
        let r = sync();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let own = r.err();
        if let Some(e) = &own {
            s.found += 1;
            s.errno = e.raw_os_error().unwrap_or(libc::EIO);
        }
        let found = s.found;
        let errno = s.errno;
        // A handle the kernel never opened here (none today) hears every
        // error found.
        let seen = s.seen.entry(fh).or_insert(0);
        let r = if *seen < found {
            *seen = found;
            Err(errno)
        } else {
            Ok(())
        };
        (r, own)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    fn fail() -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::ENOSPC))
    }

    #[test]
    fn every_open_handle_hears_a_writeback_error_once() {
        let w = WritebackErrors::default();
        let (a, b) = (w.open(), w.open());
        // b's flush finds the error; a, open at the time, hears it at its
        // next sync although that sync succeeds.
        assert_eq!(w.sync(b, fail).0, Err(libc::ENOSPC));
        assert_eq!(w.sync(a, || Ok(())).0, Err(libc::ENOSPC));
        assert_eq!(w.sync(a, || Ok(())).0, Ok(()));
        assert_eq!(w.sync(b, || Ok(())).0, Ok(()));
        // A handle opened after the error was found does not hear it.
        let c = w.open();
        assert_eq!(w.sync(c, || Ok(())).0, Ok(()));
        // A second error reaches all three.
        assert_eq!(w.sync(c, fail).0, Err(libc::ENOSPC));
        assert_eq!(w.sync(a, || Ok(())).0, Err(libc::ENOSPC));
        w.release(b);
        assert!(!w.state.lock().expect("state").seen.contains_key(&b));
    }

    #[test]
    fn a_write_waits_for_every_request_over_its_sectors_and_reads_share() {
        let l = Arc::new(SectorLocks::default());
        let r1 = l.lock(0, 1024, false);
        let r2 = l.lock(512, 1024, false);
        let w_other = l.lock(1024, 2048, true);
        let done = Arc::new(AtomicBool::new(false));
        let t = {
            let (l, done) = (l.clone(), done.clone());
            std::thread::spawn(move || {
                let _w = l.lock(512, 1536, true);
                done.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!done.load(Ordering::SeqCst), "write ran over held sectors");
        drop(r1);
        drop(r2);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!done.load(Ordering::SeqCst), "write ran over a held write");
        drop(w_other);
        t.join().expect("writer");
        assert!(done.load(Ordering::SeqCst));
        let g = l.held.lock().expect("held");
        assert!(g.held.is_empty() && g.waiting == 0);
    }
}
