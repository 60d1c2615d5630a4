//! The tenants of the host key table: `memveil run --keyid N` processes that
//! hold KeyID N's page key, each on a connection of its own. When the KeyID
//! is cleared or programmed again the vault tells each tenant to stop
//! (crypto-erase: the key copies die with the processes) and waits until it
//! has closed its connection.

use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::proto::{self, Reply};

/// How long a KeyID's programming waits for its tenants to stop.
pub(crate) const STOP_WAIT: Duration = Duration::from_secs(5);

struct Tenant {
    id: u64,
    keyid: u16,
    /// The KeyID's generation when the tenant got its key.
    generation: u64,
    /// The tenant's supervisor (`memveil run`).
    pid: i32,
    stream: UnixStream,
}

/// What a stop did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Stopped {
    /// Tenants that stopped and closed their connection in time.
    pub(crate) confirmed: usize,
    /// Supervisor pids of those that did not within [`STOP_WAIT`].
    pub(crate) unconfirmed: Vec<i32>,
}

impl Stopped {
    /// Words for the programming reply; empty when there were no tenants.
    pub(crate) fn describe(&self, keyid: u16) -> String {
        match (self.confirmed, self.unconfirmed.as_slice()) {
            (0, []) => String::new(),
            (n, []) => format!("; {n} running tenant(s) under KeyID {keyid} stopped"),
            (n, late) => format!(
                "; {n} running tenant(s) under KeyID {keyid} stopped, {} told but not confirmed \
                 within {} s (memveil run pid {late:?}: check that they are gone)",
                late.len(),
                STOP_WAIT.as_secs()
            ),
        }
    }
}

/// The registry.
#[derive(Default)]
pub(crate) struct Tenants {
    list: Mutex<(u64, Vec<Tenant>)>,
    gone: Condvar,
}

impl Tenants {
    fn lock(&self) -> MutexGuard<'_, (u64, Vec<Tenant>)> {
        self.list.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a tenant whose key was derived at `generation`, returning
    /// its id. `derive` runs under the registry's lock, so a programming
    /// request either comes before it (and the tenant gets the new key) or
    /// after its registration (and stops it).
    pub(crate) fn add<T, E>(
        &self,
        pid: i32,
        stream: &UnixStream,
        derive: impl FnOnce() -> Result<(u16, u64, T), E>,
    ) -> Result<(u64, T), E> {
        let mut g = self.lock();
        let (keyid, generation, t) = derive()?;
        match stream.try_clone() {
            Ok(stream) => {
                g.0 += 1;
                let id = g.0;
                g.1.push(Tenant {
                    id,
                    keyid,
                    generation,
                    pid,
                    stream,
                });
                Ok((id, t))
            }
            // Without a second handle it cannot be told to stop: not a
            // tenant (id 0), and the caller refuses it the key.
            Err(_) => Ok((0, t)),
        }
    }

    /// Forgets a tenant whose connection closed.
    pub(crate) fn remove(&self, id: u64) {
        let mut g = self.lock();
        g.1.retain(|t| t.id != id);
        drop(g);
        self.gone.notify_all();
    }

    /// Running tenants of each KeyID `0..=max_keyid`, indexed by KeyID.
    pub(crate) fn counts(&self, max_keyid: u16) -> Vec<u32> {
        let mut n = vec![0u32; usize::from(max_keyid) + 1];
        for t in &self.lock().1 {
            if let Some(c) = n.get_mut(usize::from(t.keyid)) {
                *c = c.saturating_add(1);
            }
        }
        n
    }

    /// Tells every tenant of `keyid` whose key is older than `generation`
    /// to stop, and waits up to `wait` for each to close its connection.
    pub(crate) fn stop(
        &self,
        keyid: u16,
        generation: u64,
        message: &str,
        wait: Duration,
    ) -> Stopped {
        let frame = proto::encode_reply(&Reply::TenantStop {
            keyid,
            generation,
            message: message.to_owned(),
        });
        // The tenants to tell, with handles of their own: the writes (up to
        // 1 s each for a stuck one) happen without the registry's lock.
        let to_tell: Vec<(u64, i32, Option<UnixStream>)> = self
            .lock()
            .1
            .iter()
            .filter(|t| t.keyid == keyid && t.generation < generation)
            .map(|t| (t.id, t.pid, t.stream.try_clone().ok()))
            .collect();
        let mut told = Vec::new();
        for (id, pid, stream) in to_tell {
            if let Some(mut s) = stream {
                let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                // A tenant that cannot be written to is gone or stuck: it
                // is waited for all the same, and named if it stays.
                let _ = s.write_all(&frame);
            }
            told.push((id, pid));
        }
        let deadline = Instant::now() + wait;
        let mut g = self.lock();
        loop {
            let left: Vec<i32> = told
                .iter()
                .filter(|(id, _)| g.1.iter().any(|t| t.id == *id))
                .map(|&(_, pid)| pid)
                .collect();
            let now = Instant::now();
            if left.is_empty() || now >= deadline {
                return Stopped {
                    confirmed: told.len() - left.len(),
                    unconfirmed: left,
                };
            }
            g = self
                .gone
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;

    fn tenant(t: &Tenants, keyid: u16, generation: u64) -> (u64, UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().expect("pair");
        let (id, ()) = t
            .add::<(), ()>(42, &a, || Ok((keyid, generation, ())))
            .expect("add");
        (id, a, b)
    }

    #[test]
    fn a_stop_reaches_the_keyids_older_tenants_only_and_waits_for_them() {
        let t = std::sync::Arc::new(Tenants::default());
        let (id1, _a1, mut b1) = tenant(&t, 5, 1);
        let (_id2, _a2, mut b2) = tenant(&t, 6, 1);
        let (_id3, _a3, mut b3) = tenant(&t, 5, 2);
        assert_eq!(t.counts(6), [0, 0, 0, 0, 0, 2, 1]);
        // A KeyID past the end is left out.
        assert_eq!(t.counts(5), [0, 0, 0, 0, 0, 2]);
        let t2 = std::sync::Arc::clone(&t);
        // The tenant of KeyID 5, generation 1, reads its notice and closes.
        let reader = std::thread::spawn(move || {
            let mut h = [0u8; 4];
            b1.read_exact(&mut h).expect("notice");
            let mut body = vec![0u8; u32::from_le_bytes(h) as usize];
            b1.read_exact(&mut body).expect("body");
            t2.remove(id1);
            proto::decode_reply(&body).expect("decode")
        });
        let s = t.stop(5, 2, "cleared by uid 0", Duration::from_secs(5));
        assert_eq!(
            s,
            Stopped {
                confirmed: 1,
                unconfirmed: vec![]
            }
        );
        assert!(matches!(
            reader.join().expect("reader"),
            Reply::TenantStop {
                keyid: 5,
                generation: 2,
                ..
            }
        ));
        // Neither the other KeyID's tenant nor the one that already has
        // generation 2 was told.
        for b in [&mut b2, &mut b3] {
            b.set_nonblocking(true).expect("nonblocking");
            assert!(b.read(&mut [0u8; 1]).is_err(), "nothing sent");
        }
        // A tenant that never answers is named after the wait.
        let s = t.stop(6, 2, "cleared", Duration::from_millis(50));
        assert_eq!(s.confirmed, 0);
        assert_eq!(s.unconfirmed, vec![42]);
        assert!(s.describe(6).contains("not confirmed"), "{}", s.describe(6));
    }
}
