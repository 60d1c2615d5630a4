//! A sweep level's queue of resident pages ([`crate::sweep::Sweep::queues`]):
//! `(arrival in ms, page address)` entries, taken smallest first, as a
//! min-heap would give them, at a fraction of its cost.
//!
//! A binary heap of a large program's pages costs its sweep more than the
//! kernel's move of each page: the cold server's 1 GiB heap (262k pages,
//! each queued once on arrival and once more behind its block's probe) spent
//! 0.6 µs per swept page in `BinaryHeap::pop` alone (18 levels of a 4 MiB
//! heap, a cache miss each), against 0.95 µs to encrypt the page. Pages
//! arrive in few distinct milliseconds (a chunk's 512 pages are registered
//! with one arrival, faults arrive in time order), so the queue keeps one
//! bucket per arrival: an ordered map of milliseconds, each bucket its
//! addresses in ascending order (appended in order nearly always; inserted
//! in place otherwise). Taking the first entry is a walk down a map of a
//! few thousand keys and a `pop_front`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, VecDeque};

/// A queued page: `(arrival in ms, page address)`, earliest first (the
/// form a min-heap of it would hand out).
pub(crate) type Entry = Reverse<(u64, usize)>;

/// Pages by arrival, then address (see the module's doc).
#[derive(Debug, Default)]
pub(crate) struct Queue {
    /// Per arrival (ms): its pages' entries, addresses ascending; never
    /// empty.
    buckets: BTreeMap<u64, VecDeque<Entry>>,
    len: usize,
}

impl Queue {
    /// An empty queue.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Queues `e`.
    pub(crate) fn push(&mut self, e: Entry) {
        let Reverse((at, addr)) = e;
        let b = self.buckets.entry(at).or_default();
        match b.back() {
            Some(Reverse((_, last))) if *last > addr => {
                let k = b.partition_point(|Reverse((_, a))| *a <= addr);
                b.insert(k, e);
            }
            _ => b.push_back(e),
        }
        self.len += 1;
    }

    /// The first entry (earliest arrival, lowest address among those).
    pub(crate) fn peek(&self) -> Option<&Entry> {
        self.buckets.first_key_value().and_then(|(_, b)| b.front())
    }

    /// Takes the first entry.
    pub(crate) fn pop(&mut self) -> Option<Entry> {
        let mut first = self.buckets.first_entry()?;
        let e = first.get_mut().pop_front();
        if first.get().is_empty() {
            first.remove();
        }
        self.len -= usize::from(e.is_some());
        e
    }

    /// Entries queued.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BinaryHeap;

    /// A xorshift generator: the same sequence every run.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn entries_leave_in_a_min_heaps_order_whatever_order_they_came_in() {
        // Runs in order (a chunk registered), arrivals out of order (a
        // block's pages put back behind their probe), duplicates, and pops
        // between pushes: every pop is what a min-heap would give.
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut q = Queue::new();
        let mut h = BinaryHeap::new();
        for round in 0..2_000u64 {
            let at = round / 4 + rng.next() % 8;
            let run = usize::try_from(rng.next() % 70).unwrap_or(0);
            let base = usize::try_from(rng.next() % 4096).unwrap_or(0) * 4096;
            let descending = rng.next().is_multiple_of(3);
            for k in 0..run {
                let k = if descending { run - k } else { k };
                let e = Reverse((at, base + k * 4096));
                q.push(e);
                h.push(e);
            }
            for _ in 0..rng.next() % 80 {
                assert_eq!(q.peek(), h.peek());
                assert_eq!(q.pop(), h.pop());
            }
            assert_eq!(q.len(), h.len());
            assert_eq!(q.is_empty(), h.is_empty());
        }
        while let Some(e) = h.pop() {
            assert_eq!(q.pop(), Some(e));
        }
        assert_eq!((q.pop(), q.peek(), q.len()), (None, None, 0));
        assert!(q.is_empty());
    }
}
