//! Per-uid limits: what one local user may hold in the vault at once.
//!
//! The socket is open to every local user (mode 0666 by default), so a limit
//! per connection would be no limit: more connections multiply it. Every
//! resource a client can make the vault hold is therefore counted per uid
//! (from `SO_PEERCRED`), across all of that uid's connections: connections,
//! keys, key versions, its share of the secret pool and of the secret heap of
//! asymmetric keys, lanes (a thread and a
//! secret stack each), registered buffers, shared areas and their bytes. A
//! refusal names the limit and the `memveil vault serve` flag that raises it.
//!
//! Keys and versions are counted from the key table (their owner's uid);
//! everything else is counted in the vault's ledger as it is taken and given back.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// Limits per uid (except `gcm_bytes`, per message).
#[derive(Debug, Clone, Copy)]
pub struct Quotas {
    /// Connections one uid may have open (`--max-connections`).
    pub connections: usize,
    /// Keys one uid may own (`--max-keys`).
    pub keys: usize,
    /// Key versions the keys one uid owns may hold in all (`--max-versions`).
    pub versions: usize,
    /// Bytes of the secret pool one uid's keys and connections may take
    /// (`--uid-pool-kib`); `None` = a quarter of the pool.
    pub uid_pool_bytes: Option<usize>,
    /// Bytes of the asymmetric keys' secret heap one uid's keys may take
    /// (`--uid-asym-heap-kib`, counted with each key type's estimate);
    /// `None` = a quarter of the heap outside its reserve.
    pub uid_asym_heap_bytes: Option<usize>,
    /// Lanes one uid may have open (`--max-lanes`; each is a vault thread
    /// with a secret stack, and holds at most 31 requests in flight).
    pub lanes: usize,
    /// Buffers one uid may have registered (`--max-buffers`).
    pub buffers: usize,
    /// Shared areas one uid may have mapped into the vault (`--max-areas`).
    pub areas: usize,
    /// Bytes of those shared areas (`--max-area-mib`).
    pub area_bytes: u64,
    /// Longest GCM message, either way (`--max-gcm-mib`): opening one takes
    /// that much of the vault's private memory.
    pub gcm_bytes: usize,
}

impl Default for Quotas {
    fn default() -> Self {
        Self {
            connections: 64,
            keys: 256,
            versions: 1024,
            uid_pool_bytes: None,
            uid_asym_heap_bytes: None,
            lanes: 64,
            buffers: 256,
            areas: 64,
            area_bytes: 4 << 30,
            gcm_bytes: 64 << 20,
        }
    }
}

/// A counted resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resource {
    /// One connection.
    Connection,
    /// One lane.
    Lane,
    /// One registered buffer.
    Buffer,
    /// One shared area of this many bytes.
    Area(u64),
    /// This many bytes of the secret pool.
    Pool(usize),
    /// One key version: bytes of the secret pool, and of the secret heap
    /// of asymmetric keys (aws-lc's objects).
    Key {
        /// Of the pool.
        pool: usize,
        /// Of the asymmetric heap.
        heap: usize,
    },
}

impl Resource {
    /// `n` times this key charge.
    pub(crate) fn times(self, n: usize) -> Resource {
        match self {
            Resource::Key { pool, heap } => Resource::Key {
                pool: pool.saturating_mul(n),
                heap: heap.saturating_mul(n),
            },
            r => r,
        }
    }
}

/// What one uid holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub(crate) connections: usize,
    pub(crate) lanes: usize,
    pub(crate) buffers: usize,
    pub(crate) areas: usize,
    pub(crate) area_bytes: u64,
    pub(crate) pool: usize,
    pub(crate) asym_heap: usize,
}

impl Usage {
    fn add(&mut self, r: Resource) {
        match r {
            Resource::Connection => self.connections += 1,
            Resource::Lane => self.lanes += 1,
            Resource::Buffer => self.buffers += 1,
            Resource::Area(b) => {
                self.areas += 1;
                self.area_bytes = self.area_bytes.saturating_add(b);
            }
            Resource::Pool(b) => self.pool = self.pool.saturating_add(b),
            Resource::Key { pool, heap } => {
                self.pool = self.pool.saturating_add(pool);
                self.asym_heap = self.asym_heap.saturating_add(heap);
            }
        }
    }

    fn is_zero(&self) -> bool {
        *self == Usage::default()
    }
}

/// The per-uid counts, behind one mutex (held only to count).
pub(crate) struct Ledger {
    q: Quotas,
    pool_share: usize,
    heap_share: usize,
    by_uid: Mutex<HashMap<u32, Usage>>,
}

fn kib(b: usize) -> usize {
    b.div_ceil(1024)
}

impl Ledger {
    /// A ledger for a secret pool of `pool_bytes` and an asymmetric heap of
    /// `heap_bytes` (outside its reserve).
    pub(crate) fn new(q: Quotas, pool_bytes: usize, heap_bytes: usize) -> Self {
        Self {
            q,
            pool_share: q.uid_pool_bytes.unwrap_or(pool_bytes / 4),
            heap_share: q.uid_asym_heap_bytes.unwrap_or(heap_bytes / 4),
            by_uid: Mutex::new(HashMap::new()),
        }
    }

    /// Bytes of the secret pool one uid may hold.
    #[cfg(test)]
    fn pool_share(&self) -> usize {
        self.pool_share
    }

    /// Counts `r` against `uid`, or says which limit it would pass and the
    /// flag that raises it.
    pub(crate) fn take(&self, uid: u32, r: Resource) -> Result<(), String> {
        let mut m = self.by_uid.lock().unwrap_or_else(PoisonError::into_inner);
        let u = m.entry(uid).or_default();
        let q = &self.q;
        match r {
            Resource::Connection if u.connections >= q.connections => Err(format!(
                "uid {uid} has {} connections to the vault open, the per-uid limit (--max-connections)",
                u.connections
            )),
            Resource::Lane if u.lanes >= q.lanes => Err(format!(
                "uid {uid} has {} lanes open, the per-uid limit (--max-lanes)",
                u.lanes
            )),
            Resource::Buffer if u.buffers >= q.buffers => Err(format!(
                "uid {uid} has {} buffers registered, the per-uid limit (--max-buffers)",
                u.buffers
            )),
            Resource::Area(_) if u.areas >= q.areas => Err(format!(
                "uid {uid} has {} shared areas registered, the per-uid limit (--max-areas)",
                u.areas
            )),
            Resource::Area(b) if u.area_bytes.saturating_add(b) > q.area_bytes => Err(format!(
                "uid {uid} has {} MiB of shared areas registered; {} MiB more would pass the per-uid limit of {} MiB (--max-area-mib)",
                u.area_bytes >> 20,
                b.div_ceil(1 << 20),
                q.area_bytes >> 20
            )),
            Resource::Pool(b) | Resource::Key { pool: b, .. }
                if u.pool.saturating_add(b) > self.pool_share =>
            {
                Err(format!(
                    "uid {uid} holds {} KiB of the vault's secret memory (its keys and connections); {} KiB more would pass its share of {} KiB (--uid-pool-kib)",
                    kib(u.pool),
                    kib(b),
                    kib(self.pool_share)
                ))
            }
            Resource::Key { heap, .. } if u.asym_heap.saturating_add(heap) > self.heap_share => {
                Err(format!(
                    "uid {uid}'s asymmetric keys hold about {} KiB of the vault's secret heap for them; {} KiB more would pass its share of {} KiB (--uid-asym-heap-kib)",
                    kib(u.asym_heap),
                    kib(heap),
                    kib(self.heap_share)
                ))
            }
            r => {
                u.add(r);
                Ok(())
            }
        }
    }

    /// Counts `r` against `uid` without a limit (persistent keys loaded at
    /// start belong to their owners whatever the limits are now).
    pub(crate) fn take_unchecked(&self, uid: u32, r: Resource) {
        let mut m = self.by_uid.lock().unwrap_or_else(PoisonError::into_inner);
        m.entry(uid).or_default().add(r);
    }

    /// Gives `r` back.
    pub(crate) fn give_back(&self, uid: u32, r: Resource) {
        let mut m = self.by_uid.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(u) = m.get_mut(&uid) else {
            return;
        };
        match r {
            Resource::Connection => u.connections = u.connections.saturating_sub(1),
            Resource::Lane => u.lanes = u.lanes.saturating_sub(1),
            Resource::Buffer => u.buffers = u.buffers.saturating_sub(1),
            Resource::Area(b) => {
                u.areas = u.areas.saturating_sub(1);
                u.area_bytes = u.area_bytes.saturating_sub(b);
            }
            Resource::Pool(b) => u.pool = u.pool.saturating_sub(b),
            Resource::Key { pool, heap } => {
                u.pool = u.pool.saturating_sub(pool);
                u.asym_heap = u.asym_heap.saturating_sub(heap);
            }
        }
        if u.is_zero() {
            m.remove(&uid);
        }
    }

    /// What `uid` holds now.
    #[cfg(test)]
    fn usage(&self, uid: u32) -> Usage {
        self.by_uid
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&uid)
            .copied()
            .unwrap_or_default()
    }

    /// Checks that `uid`, owning `keys` keys with `versions` versions in all,
    /// may own `new_keys` more keys holding `new_versions` more versions.
    pub(crate) fn check_keys(
        &self,
        uid: u32,
        keys: usize,
        versions: usize,
        new_keys: usize,
        new_versions: usize,
    ) -> Result<(), String> {
        if keys.saturating_add(new_keys) > self.q.keys {
            return Err(format!(
                "uid {uid} owns {keys} keys, the per-uid limit (--max-keys)"
            ));
        }
        if versions.saturating_add(new_versions) > self.q.versions {
            return Err(format!(
                "the keys uid {uid} owns hold {versions} versions, the per-uid limit (--max-versions); destroy keys it no longer needs"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Quotas {
        Quotas {
            connections: 2,
            keys: 3,
            versions: 4,
            uid_pool_bytes: Some(4096),
            uid_asym_heap_bytes: Some(8192),
            lanes: 1,
            buffers: 1,
            areas: 2,
            area_bytes: 3 << 20,
            gcm_bytes: 1 << 20,
        }
    }

    /// Regression (issue 14): limits were per connection, so a uid opening
    /// more connections got more of everything. Counted per uid, a second
    /// uid is untouched by the first one's use.
    #[test]
    fn limits_are_per_uid_and_name_their_flag() {
        let l = Ledger::new(small(), 1 << 20, 1 << 20);
        for r in [Resource::Connection, Resource::Connection] {
            l.take(1, r).expect("within");
        }
        let e = l.take(1, Resource::Connection).expect_err("third");
        assert!(
            e.contains("uid 1") && e.contains("--max-connections"),
            "{e}"
        );
        l.take(2, Resource::Connection).expect("another uid");
        l.take(1, Resource::Lane).expect("lane");
        assert!(l
            .take(1, Resource::Lane)
            .expect_err("lane")
            .contains("--max-lanes"));
        l.take(1, Resource::Buffer).expect("buffer");
        assert!(l
            .take(1, Resource::Buffer)
            .expect_err("buffer")
            .contains("--max-buffers"));
        l.take(1, Resource::Area(2 << 20)).expect("area");
        assert!(l
            .take(1, Resource::Area(2 << 20))
            .expect_err("bytes")
            .contains("--max-area-mib"));
        l.take(1, Resource::Area(1 << 20)).expect("area 2");
        assert!(l
            .take(1, Resource::Area(1))
            .expect_err("count")
            .contains("--max-areas"));
        l.take(1, Resource::Pool(4000)).expect("pool");
        let e = l.take(1, Resource::Pool(100)).expect_err("pool");
        assert!(e.contains("--uid-pool-kib") && e.contains("4 KiB"), "{e}");
        assert!(l
            .check_keys(1, 3, 0, 1, 1)
            .expect_err("keys")
            .contains("--max-keys"));
        assert!(l
            .check_keys(1, 1, 4, 0, 1)
            .expect_err("versions")
            .contains("--max-versions"));
        l.check_keys(1, 2, 3, 1, 1).expect("room");
        // Uid 2 holds one connection and nothing else.
        assert_eq!(
            l.usage(2),
            Usage {
                connections: 1,
                ..Usage::default()
            }
        );
        // Giving back makes room again, and an idle uid is forgotten.
        l.give_back(1, Resource::Connection);
        l.take(1, Resource::Connection).expect("room again");
        l.give_back(2, Resource::Connection);
        assert!(l.by_uid.lock().expect("lock").get(&2).is_none());
        // The default shares are a quarter of the pool and of the heap.
        let d = Ledger::new(Quotas::default(), 2 << 20, 1 << 20);
        assert_eq!(d.pool_share(), 512 << 10);
        assert_eq!(d.heap_share, 256 << 10);
    }

    /// Issue 32: one uid's asymmetric keys take at most its share of the
    /// secret heap (each counted at its type's estimate), whatever room
    /// its pool share leaves; the refusal names the flag.
    #[test]
    fn asymmetric_keys_are_capped_by_a_share_of_the_heap() {
        let l = Ledger::new(small(), 1 << 20, 1 << 20);
        let key = Resource::Key {
            pool: 100,
            heap: 6 << 10,
        };
        l.take(1, key).expect("first");
        let e = l.take(1, key).expect_err("second");
        assert!(
            e.contains("uid 1") && e.contains("--uid-asym-heap-kib") && e.contains("8 KiB"),
            "{e}"
        );
        // The refusal took nothing; another uid has its own share.
        assert_eq!(l.usage(1).pool, 100);
        l.take(2, key).expect("uid 2");
        l.give_back(1, key);
        l.take(1, key.times(1)).expect("room again");
        assert_eq!(
            key.times(3),
            Resource::Key {
                pool: 300,
                heap: 18 << 10
            }
        );
    }
}
