//! The fair dispatcher: the seed pool, its producers, the round-robin
//! queue of consumers waiting for seed bytes, and source failover.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use zeroize::{Zeroize, Zeroizing};

use super::consumer::Consumer;
use super::{ServeConfig, SourceStatus, SEED_BUFFER, TICK};
use crate::condition::SEED_BYTES;
use crate::drbg::EntropyInput;
use crate::DrngError;

pub(super) struct Demand {
    pub(super) want: usize,
    pub(super) got: Zeroizing<Vec<u8>>,
    /// Woken when this demand is complete (one condvar per waiter, so a
    /// completion wakes one thread, not all of them).
    pub(super) done: Arc<Condvar>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Health {
    Serving,
    /// No healthy source left.
    Failed,
}

pub(super) struct Pool {
    pub(super) queue: VecDeque<u64>,
    pub(super) demands: HashMap<u64, Demand>,
    pub(super) buffer: Zeroizing<Vec<u8>>,
    pub(super) health: Health,
    /// Index into `sources` of the source in use.
    pub(super) active: usize,
    /// Bumped whenever a source is quarantined.
    epoch: u64,
    pub(super) statuses: Vec<SourceStatus>,
    pub(super) seeds: u64,
    pub(super) wiped: u64,
}

pub(super) struct Shared {
    pub(super) cfg: ServeConfig,
    pub(super) pool: Mutex<Pool>,
    /// Producers wait here for demand or buffer space.
    pub(super) wanted: Condvar,
    pub(super) shutdown: AtomicBool,
    pub(super) started: Instant,
    pub(super) consumers: Mutex<Consumers>,
    pub(super) next_id: AtomicU64,
    pub(super) refused: AtomicU64,
    pub(super) served_total: AtomicU64,
    pub(super) stream_name: Mutex<String>,
}

#[derive(Default)]
pub(super) struct Consumers {
    pub(super) open: Vec<Arc<Consumer>>,
    pub(super) closed: VecDeque<Arc<Consumer>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why a consumer could not get bytes.
#[derive(Debug)]
pub(super) enum Starved {
    NoSource,
    Shutdown,
}

impl Shared {
    pub(super) fn new(cfg: ServeConfig, statuses: Vec<SourceStatus>) -> Self {
        Self {
            pool: Mutex::new(Pool {
                queue: VecDeque::new(),
                demands: HashMap::new(),
                buffer: Zeroizing::new(Vec::with_capacity(SEED_BUFFER * SEED_BYTES)),
                health: Health::Serving,
                active: 0,
                epoch: 0,
                statuses,
                seeds: 0,
                wiped: 0,
            }),
            wanted: Condvar::new(),
            shutdown: AtomicBool::new(false),
            started: Instant::now(),
            consumers: Mutex::new(Consumers::default()),
            next_id: AtomicU64::new(1),
            refused: AtomicU64::new(0),
            served_total: AtomicU64::new(0),
            stream_name: Mutex::new(String::new()),
            cfg,
        }
    }

    pub(super) fn log(&self, m: &str) {
        (self.cfg.log)(m);
    }

    pub(super) fn epoch(&self) -> u64 {
        lock(&self.pool).epoch
    }

    /// Takes exactly `out.len()` seed bytes for consumer `id`, waiting in the
    /// round-robin queue.
    pub(super) fn take(&self, id: u64, out: &mut [u8]) -> Result<(), Starved> {
        let mut p = lock(&self.pool);
        if p.health == Health::Failed {
            return Err(Starved::NoSource);
        }
        let mut got = Zeroizing::new(Vec::with_capacity(out.len()));
        if p.queue.is_empty() {
            let n = out.len().min(p.buffer.len());
            let start = p.buffer.len() - n;
            got.extend_from_slice(&p.buffer[start..]);
            p.buffer[start..].zeroize();
            p.buffer.truncate(start);
            if n > 0 {
                self.wanted.notify_all();
            }
        }
        if got.len() == out.len() {
            out.copy_from_slice(&got);
            return Ok(());
        }
        let wake = Arc::new(Condvar::new());
        p.demands.insert(
            id,
            Demand {
                want: out.len(),
                got,
                done: Arc::clone(&wake),
            },
        );
        p.queue.push_back(id);
        self.wanted.notify_all();
        loop {
            let done = p.demands.get(&id).is_some_and(|d| d.got.len() == d.want);
            if done {
                if let Some(d) = p.demands.remove(&id) {
                    out.copy_from_slice(&d.got);
                }
                return Ok(());
            }
            let stop = if p.health == Health::Failed {
                Some(Starved::NoSource)
            } else if self.shutdown.load(Ordering::Relaxed) {
                Some(Starved::Shutdown)
            } else {
                None
            };
            if let Some(s) = stop {
                p.demands.remove(&id);
                p.queue.retain(|&q| q != id);
                return Err(s);
            }
            p = wake
                .wait_timeout(p, TICK)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Takes what is buffered now, at most `max` bytes, without waiting
    /// (never ahead of consumers already queued).
    pub(super) fn try_take(&self, max: usize) -> Zeroizing<Vec<u8>> {
        let mut p = lock(&self.pool);
        let mut v = Zeroizing::new(Vec::new());
        if p.health == Health::Failed || !p.queue.is_empty() {
            return v;
        }
        let n = max.min(p.buffer.len());
        let start = p.buffer.len() - n;
        v.extend_from_slice(&p.buffer[start..]);
        p.buffer[start..].zeroize();
        p.buffer.truncate(start);
        self.wanted.notify_all();
        v
    }

    pub(super) fn buffered_bits(&self) -> u32 {
        let p = lock(&self.pool);
        if p.health == Health::Failed {
            return 0;
        }
        u32::try_from(p.buffer.len() * 8).unwrap_or(u32::MAX)
    }

    pub(super) fn healthy(&self) -> bool {
        lock(&self.pool).health == Health::Serving
    }

    /// Hands one fresh seed out: to the head of the queue, or to the buffer.
    pub(super) fn deliver(&self, seed: &[u8]) {
        let mut p = lock(&self.pool);
        p.seeds += 1;
        let mut rest = seed;
        while !rest.is_empty() {
            let Some(id) = p.queue.pop_front() else {
                let room = (SEED_BUFFER * SEED_BYTES).saturating_sub(p.buffer.len());
                let n = room.min(rest.len());
                p.buffer.extend_from_slice(&rest[..n]);
                break;
            };
            let Some(d) = p.demands.get_mut(&id) else {
                continue;
            };
            let n = (d.want - d.got.len()).min(rest.len());
            d.got.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            if d.got.len() < d.want {
                p.queue.push_back(id);
            } else {
                d.done.notify_one();
            }
        }
    }

    /// Quarantines source `idx` (if still active) and moves on.
    pub(super) fn source_failed(&self, idx: usize, err: &DrngError) {
        let mut p = lock(&self.pool);
        if p.active != idx || p.health == Health::Failed {
            return;
        }
        p.statuses[idx].state = "quarantined".into();
        p.statuses[idx].error = Some(err.to_string());
        // Nothing produced near the failure may be served: wipe the buffer and
        // every partly filled request.
        let mut wiped = p.buffer.len() as u64;
        p.buffer.zeroize();
        p.buffer.clear();
        for d in p.demands.values_mut() {
            wiped += d.got.len() as u64;
            d.got.zeroize();
            d.got.clear();
        }
        // A request completed just before the failure but not yet collected
        // by its consumer has left the queue; wiped, it must wait again.
        let waiting: Vec<u64> = p
            .demands
            .keys()
            .copied()
            .filter(|id| !p.queue.contains(id))
            .collect();
        p.queue.extend(waiting);
        p.wiped += wiped;
        p.epoch += 1;
        let name = p.statuses[idx].name.clone();
        drop(p);
        self.log(&format!(
            "source {name} quarantined: {err}; {wiped} unserved seed bytes wiped, every DRBG \
             will reseed before its next byte"
        ));
        self.activate_from(idx + 1);
    }

    /// Opens sources from `start` on until one works; marks the rest.
    pub(super) fn activate_from(&self, start: usize) {
        let n = self.cfg.sources.len();
        for i in start..n {
            match self.cfg.sources[i].open() {
                Ok(input) => {
                    let name = input.name();
                    drop(input);
                    let mut p = lock(&self.pool);
                    p.active = i;
                    p.statuses[i].name.clone_from(&name);
                    p.statuses[i].state = "active".into();
                    drop(p);
                    if i > 0 {
                        self.log(&format!(
                            "serving from fallback source {name} (source {} of {n} configured)",
                            i + 1
                        ));
                    }
                    self.wanted.notify_all();
                    return;
                }
                Err(e) => {
                    let mut p = lock(&self.pool);
                    p.statuses[i].state = "unavailable".into();
                    p.statuses[i].error = Some(e.to_string());
                    drop(p);
                    self.log(&format!(
                        "source {} unavailable: {e}",
                        self.cfg.sources[i].kind().name()
                    ));
                }
            }
        }
        let mut p = lock(&self.pool);
        p.health = Health::Failed;
        p.active = n;
        for d in p.demands.values() {
            d.done.notify_one();
        }
        drop(p);
        self.log(
            "no healthy entropy source left: no byte will be served; blocking readers are \
             disconnected; restart the daemon once the source is fixed",
        );
    }

    pub(super) fn producer(self: &Arc<Self>) {
        let mut current: Option<(usize, Box<dyn EntropyInput>)> = None;
        let mut seed = Zeroizing::new([0u8; SEED_BYTES]);
        loop {
            // Wait for work: demand, or room in the buffer.
            let active = {
                let mut p = lock(&self.pool);
                loop {
                    if self.shutdown.load(Ordering::Relaxed) || p.health == Health::Failed {
                        return;
                    }
                    if !p.queue.is_empty()
                        || p.buffer.len() + SEED_BYTES <= SEED_BUFFER * SEED_BYTES
                    {
                        break;
                    }
                    p = self
                        .wanted
                        .wait_timeout(p, TICK)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                p.active
            };
            if current.as_ref().is_none_or(|(i, _)| *i != active) {
                current = match self.cfg.sources[active].open() {
                    Ok(inp) => Some((active, inp)),
                    Err(e) => {
                        self.source_failed(active, &e);
                        continue;
                    }
                };
            }
            let Some((idx, input)) = current.as_mut() else {
                continue;
            };
            match input.get(&mut seed[..]) {
                Ok(()) => {
                    // A quarantine decided meanwhile by another producer
                    // makes this seed suspect too.
                    if lock(&self.pool).active == *idx {
                        self.deliver(&seed[..]);
                    }
                }
                Err(e) => {
                    let i = *idx;
                    current = None;
                    self.source_failed(i, &e);
                }
            }
            seed.zeroize();
        }
    }
}

/// The DRBG's entropy input: seeds for one consumer from the dispatcher.
pub(super) struct PoolInput {
    pub(super) shared: Arc<Shared>,
    pub(super) consumer: Arc<Consumer>,
}

impl EntropyInput for PoolInput {
    fn name(&self) -> String {
        let p = lock(&self.shared.pool);
        match p.statuses.get(p.active) {
            Some(s) => format!("pool({})", s.name),
            None => "pool(no healthy source)".into(),
        }
    }

    fn get(&mut self, out: &mut [u8]) -> Result<(), DrngError> {
        match self.shared.take(self.consumer.id, out) {
            Ok(()) => {
                self.consumer
                    .seed_bytes
                    .fetch_add(out.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(_) => Err(DrngError::Exhausted {
                name: "pool (no healthy entropy source)".into(),
                attempts: 0,
            }),
        }
    }
}
