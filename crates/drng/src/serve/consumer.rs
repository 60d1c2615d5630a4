//! Consumers: one thread per connection, its EGD session (seed or DRBG
//! bytes, rate limit, writes) and its counters.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zeroize::{Zeroize, Zeroizing};

use super::dispatch::{lock, PoolInput, Shared, Starved};
use super::{ConsumerStats, Output, RECORD_LIMIT, TICK, WRITE_TIMEOUT};
use crate::drbg::Drbg;
use crate::egd::{self, Decoder, Request};

pub(super) struct Consumer {
    pub(super) id: u64,
    pub(super) listener: String,
    pub(super) rate_limit: Option<u64>,
    pub(super) peer: String,
    pub(super) connected: Instant,
    pub(super) closed_after: Mutex<Option<(Duration, String)>>,
    pub(super) bytes_served: AtomicU64,
    pub(super) bytes_discarded: AtomicU64,
    pub(super) blocking_reads: AtomicU64,
    pub(super) nonblocking_reads: AtomicU64,
    pub(super) level_queries: AtomicU64,
    pub(super) pid_queries: AtomicU64,
    pub(super) bytes_written_ignored: AtomicU64,
    pub(super) seed_bytes: AtomicU64,
    pub(super) limited_ns: AtomicU64,
    pub(super) recorded: Mutex<Vec<u8>>,
}

impl Consumer {
    pub(super) fn stats(&self) -> ConsumerStats {
        let closed = lock(&self.closed_after).clone();
        let secs = closed
            .as_ref()
            .map_or_else(|| self.connected.elapsed(), |(d, _)| *d)
            .as_secs_f64();
        let served = self.bytes_served.load(Ordering::Relaxed);
        #[allow(clippy::cast_precision_loss)]
        let rate = if secs > 0.0 {
            served as f64 / secs
        } else {
            0.0
        };
        #[allow(clippy::cast_precision_loss)]
        let limited = self.limited_ns.load(Ordering::Relaxed) as f64 / 1e9;
        ConsumerStats {
            id: self.id,
            listener: self.listener.clone(),
            peer: self.peer.clone(),
            state: if closed.is_some() { "closed" } else { "open" }.into(),
            close_reason: closed.map(|(_, r)| r),
            seconds: secs,
            bytes_served: served,
            rate_bytes_per_s: rate,
            bytes_discarded: self.bytes_discarded.load(Ordering::Relaxed),
            blocking_reads: self.blocking_reads.load(Ordering::Relaxed),
            nonblocking_reads: self.nonblocking_reads.load(Ordering::Relaxed),
            level_queries: self.level_queries.load(Ordering::Relaxed),
            pid_queries: self.pid_queries.load(Ordering::Relaxed),
            bytes_written_ignored: self.bytes_written_ignored.load(Ordering::Relaxed),
            seed_bytes: self.seed_bytes.load(Ordering::Relaxed),
            rate_limited_seconds: limited,
            rate_limit: self.rate_limit,
        }
    }
}

pub(super) trait Conn: Read + Write + Send {
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()>;
}

impl Conn for UnixStream {
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(read))?;
        self.set_write_timeout(Some(write))
    }
}

impl Conn for TcpStream {
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.set_nodelay(true)?;
        self.set_read_timeout(Some(read))?;
        self.set_write_timeout(Some(write))
    }
}

/// Token bucket of one consumer.
struct Bucket {
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    pub(super) fn new(rate: u64) -> Self {
        #[allow(clippy::cast_precision_loss)]
        let rate = rate as f64;
        Self {
            rate,
            // Start with a full second of burst.
            tokens: rate,
            last: Instant::now(),
        }
    }

    /// Waits until `n` bytes may be sent; false on shutdown.
    fn acquire(&mut self, n: usize, shared: &Shared, c: &Consumer) -> bool {
        #[allow(clippy::cast_precision_loss)]
        let need = n as f64;
        let burst = self.rate.max(egd::MAX_COUNT as f64);
        loop {
            let now = Instant::now();
            self.tokens =
                (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(burst);
            self.last = now;
            if self.tokens >= need {
                self.tokens -= need;
                return true;
            }
            if shared.shutdown.load(Ordering::Relaxed) {
                return false;
            }
            let wait = Duration::from_secs_f64(((need - self.tokens) / self.rate).min(0.1));
            std::thread::sleep(wait);
            #[allow(clippy::cast_possible_truncation)]
            let ns = wait.as_nanos().min(u128::from(u64::MAX)) as u64;
            c.limited_ns.fetch_add(ns, Ordering::Relaxed);
        }
    }
}

enum Gen {
    Drbg { drbg: Box<Drbg>, epoch: u64 },
    Seed,
}

struct Session<'a> {
    shared: &'a Arc<Shared>,
    c: &'a Arc<Consumer>,
    gen: Option<Gen>,
    bucket: Option<Bucket>,
}

/// Outcome of serving one request.
enum Step {
    Continue,
    Close(String),
}

impl Session<'_> {
    /// Produces exactly `out.len()` bytes of this consumer's stream.
    fn produce(&mut self, out: &mut [u8]) -> Result<(), String> {
        if self.gen.is_none() {
            self.gen = Some(match self.shared.cfg.output {
                Output::Seed => Gen::Seed,
                Output::Drbg => {
                    let epoch = self.shared.epoch();
                    let input = PoolInput {
                        shared: Arc::clone(self.shared),
                        consumer: Arc::clone(self.c),
                    };
                    let pers = format!(
                        "memveil-egd consumer {} pid {}",
                        self.c.id,
                        std::process::id()
                    );
                    let mut d = Drbg::new(
                        Box::new(input),
                        self.shared.cfg.prediction_resistance,
                        pers.as_bytes(),
                    )
                    .map_err(|e| format!("DRBG instantiation failed: {e}"))?;
                    d.set_reseed_interval(self.shared.cfg.reseed_interval);
                    Gen::Drbg {
                        drbg: Box::new(d),
                        epoch,
                    }
                }
            });
        }
        match self.gen.as_mut() {
            Some(Gen::Seed) => match self.shared.take(self.c.id, out) {
                Ok(()) => {
                    self.c
                        .seed_bytes
                        .fetch_add(out.len() as u64, Ordering::Relaxed);
                    Ok(())
                }
                Err(Starved::NoSource) => Err("no healthy entropy source".into()),
                Err(Starved::Shutdown) => Err("daemon shutting down".into()),
            },
            Some(Gen::Drbg { drbg, epoch }) => {
                let now = self.shared.epoch();
                if now != *epoch {
                    drbg.reseed(b"source quarantined")
                        .map_err(|_| "no healthy entropy source".to_string())?;
                    *epoch = now;
                }
                if !self.shared.healthy() {
                    return Err("no healthy entropy source".into());
                }
                drbg.fill(out)
                    .map_err(|_| "no healthy entropy source".to_string())
            }
            None => Err("internal: no generator".into()),
        }
    }

    fn send(&mut self, conn: &mut dyn Conn, bytes: &[u8], payload: usize) -> Step {
        match conn.write_all(bytes) {
            Ok(()) => {
                self.c
                    .bytes_served
                    .fetch_add(payload as u64, Ordering::Relaxed);
                self.shared
                    .served_total
                    .fetch_add(payload as u64, Ordering::Relaxed);
                if self.shared.cfg.record_served {
                    let mut r = lock(&self.c.recorded);
                    let room = RECORD_LIMIT.saturating_sub(r.len());
                    let p = &bytes[bytes.len() - payload..];
                    r.extend_from_slice(&p[..room.min(p.len())]);
                }
                Step::Continue
            }
            Err(e) => {
                self.c
                    .bytes_discarded
                    .fetch_add(payload as u64, Ordering::Relaxed);
                Step::Close(format!(
                    "consumer went away mid-read ({e}); {payload} bytes wiped"
                ))
            }
        }
    }

    fn handle(&mut self, conn: &mut dyn Conn, req: Request) -> Step {
        let mut reply = Zeroizing::new(Vec::with_capacity(egd::MAX_COUNT + 1));
        match req {
            Request::EntropyLevel => {
                self.c.level_queries.fetch_add(1, Ordering::Relaxed);
                let bits = match self.shared.cfg.output {
                    Output::Seed => self.shared.buffered_bits(),
                    Output::Drbg if self.shared.healthy() => {
                        u32::try_from(8 * egd::MAX_COUNT).unwrap_or(0)
                    }
                    Output::Drbg => 0,
                };
                egd::encode_entropy_level(bits, &mut reply);
                self.send(conn, &reply, 0)
            }
            Request::ReportPid => {
                self.c.pid_queries.fetch_add(1, Ordering::Relaxed);
                egd::encode_pid(std::process::id(), &mut reply);
                self.send(conn, &reply, 0)
            }
            Request::WriteEntropy { mut data, .. } => {
                self.c
                    .bytes_written_ignored
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                data.zeroize();
                Step::Continue
            }
            Request::ReadBlocking { len } => {
                let n = match self.shared.cfg.limits.admit_read(len, true) {
                    Ok(n) => usize::from(n),
                    Err(e) => return Step::Close(e.to_string()),
                };
                if let Some(b) = self.bucket.as_mut() {
                    if !b.acquire(n, self.shared, self.c) {
                        return Step::Close("daemon shutting down".into());
                    }
                }
                reply.resize(n, 0);
                if let Err(why) = self.produce(&mut reply) {
                    return Step::Close(why);
                }
                self.c.blocking_reads.fetch_add(1, Ordering::Relaxed);
                self.send(conn, &reply, n)
            }
            Request::ReadNonBlocking { len } => {
                let cap = usize::from(self.shared.cfg.limits.admit_read(len, false).unwrap_or(0));
                let mut data = match self.shared.cfg.output {
                    Output::Seed => self.shared.try_take(cap),
                    Output::Drbg => {
                        let mut v = Zeroizing::new(vec![0u8; cap]);
                        if self.shared.healthy() && self.produce(&mut v).is_ok() {
                            v
                        } else {
                            Zeroizing::new(Vec::new())
                        }
                    }
                };
                if let Some(b) = self.bucket.as_mut() {
                    if !b.acquire(data.len(), self.shared, self.c) {
                        return Step::Close("daemon shutting down".into());
                    }
                }
                let n = data.len();
                if egd::encode_nonblocking(&data, &mut reply).is_err() {
                    return Step::Close("internal: non-blocking answer too long".into());
                }
                data.zeroize();
                self.c.nonblocking_reads.fetch_add(1, Ordering::Relaxed);
                self.send(conn, &reply, n)
            }
        }
    }
}

pub(super) fn serve_conn(shared: &Arc<Shared>, c: &Arc<Consumer>, conn: &mut dyn Conn) -> String {
    if let Err(e) = conn.set_timeouts(TICK, WRITE_TIMEOUT) {
        return format!("socket setup failed: {e}");
    }
    let mut s = Session {
        shared,
        c,
        gen: None,
        bucket: c.rate_limit.map(Bucket::new),
    };
    let mut dec = Decoder::new();
    let mut buf = [0u8; 512];
    let mut reqs = Vec::new();
    loop {
        if shared.shutdown.load(Ordering::Relaxed) {
            return "daemon shutting down".into();
        }
        let n = match conn.read(&mut buf) {
            Ok(0) => {
                return match dec.finish() {
                    Ok(()) => "consumer closed the connection".into(),
                    Err(e) => e.to_string(),
                };
            }
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return format!("consumer went away ({e})"),
        };
        let fed = dec.feed(&buf[..n], &mut reqs);
        buf[..n].zeroize();
        for req in reqs.drain(..) {
            if let Step::Close(why) = s.handle(conn, req) {
                return why;
            }
        }
        if let Err(e) = fed {
            return e.to_string();
        }
    }
}
