//! The server: binding the sockets, the accept and stats loops, start,
//! statistics and shutdown.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use memveil_sys::ipc::{BindError, PathLock};

use super::consumer::{serve_conn, Conn, Consumer};
use super::dispatch::{lock, Health, Shared};
use super::{
    ConsumerStats, Listen, Output, ServeConfig, ServeError, ServerStats, SourceStatus, CLOSED_KEPT,
    TICK,
};

/// A running daemon. Dropping it stops every thread and removes its sockets.
pub struct Server {
    pub(super) shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    tcp_addrs: Vec<SocketAddr>,
    /// The bound Unix sockets, each with its path's lock.
    unix_paths: Vec<(PathBuf, PathLock)>,
}

enum Bound {
    Unix(UnixListener, String),
    Tcp(TcpListener, String),
}

/// Binds the Unix socket `path` under its path's lock, held from before the
/// check for a live listener for as long as it is bound
/// ([`memveil_sys::ipc::bind_socket`]): a stale socket file is replaced,
/// anything else at the path is refused.
fn bind_unix(path: &Path, mode: u32) -> Result<(UnixListener, PathLock), ServeError> {
    memveil_sys::ipc::bind_socket(path, mode).map_err(|e| match e {
        BindError::Held | BindError::Listening => ServeError::SocketInUse(path.to_path_buf()),
        BindError::NotASocket(what) => ServeError::NotASocket(path.to_path_buf(), what),
        BindError::Unprobed(source) => ServeError::Bind {
            what: format!("unix:{} (probing the socket there)", path.display()),
            source,
        },
        BindError::Io { what, source } => ServeError::Bind {
            what: format!("unix:{} ({what})", path.display()),
            source,
        },
        e => ServeError::Bind {
            what: format!("unix:{}", path.display()),
            source: std::io::Error::other(e.to_string()),
        },
    })
}

/// Removes the sockets bound, each before letting its path's lock go.
fn remove_sockets(paths: impl IntoIterator<Item = (PathBuf, PathLock)>) {
    for (p, held) in paths {
        drop(std::fs::remove_file(p));
        held.release();
    }
}

impl Server {
    /// Checks the configuration, opens the first usable source, binds every
    /// endpoint and starts serving.
    ///
    /// # Errors
    /// [`ServeError`] naming the endpoint or source and the fix.
    pub fn start(cfg: ServeConfig) -> Result<Server, ServeError> {
        if cfg.listen.is_empty() {
            return Err(ServeError::NoListener);
        }
        if cfg.sources.is_empty() {
            return Err(ServeError::Config("no seed source given".into()));
        }
        if cfg.producers == 0 || cfg.producers > 64 {
            return Err(ServeError::Config(format!(
                "--producers {} (1..=64)",
                cfg.producers
            )));
        }
        if cfg.max_consumers == 0 {
            return Err(ServeError::Config("--max-consumers 0".into()));
        }
        if cfg.limits.max_read == 0 {
            return Err(ServeError::Config("--max-request 0 (1..=255)".into()));
        }
        if cfg.rate_limit == Some(0) {
            return Err(ServeError::Config(
                "--rate-limit 0: leave it out for no limit".into(),
            ));
        }
        let names: Vec<String> = cfg.listen.iter().map(ToString::to_string).collect();
        for (l, r) in &cfg.listener_rate_limits {
            if *r == 0 {
                return Err(ServeError::Config(format!(
                    "--rate-limit-on {l}=0: leave it out for no limit"
                )));
            }
            if !names.contains(l) {
                return Err(ServeError::Config(format!(
                    "--rate-limit-on {l}: no such endpoint; endpoints are {}",
                    names.join(", ")
                )));
            }
        }
        if cfg.reseed_interval == 0 || cfg.reseed_interval > crate::drbg::MAX_RESEED_INTERVAL {
            return Err(ServeError::Config(format!(
                "reseed interval {} (1..=2^48 requests, SP 800-90A)",
                cfg.reseed_interval
            )));
        }
        for l in &cfg.listen {
            if let Listen::Tcp(a) = l {
                if !a.ip().is_loopback() && !cfg.allow_remote {
                    return Err(ServeError::RemoteRefused(*a));
                }
            }
        }
        let statuses = cfg
            .sources
            .iter()
            .map(|s| SourceStatus {
                name: s.kind().name().into(),
                state: "standby".into(),
                error: None,
            })
            .collect();
        let shared = Arc::new(Shared::new(cfg, statuses));
        shared.activate_from(0);
        {
            let p = lock(&shared.pool);
            if p.health == Health::Failed {
                let why: Vec<String> = p
                    .statuses
                    .iter()
                    .map(|s| format!("{}: {}", s.name, s.error.as_deref().unwrap_or("?")))
                    .collect();
                return Err(ServeError::NoSource(why.join("; ")));
            }
            let src = p.statuses[p.active].name.clone();
            *lock(&shared.stream_name) = match shared.cfg.output {
                Output::Seed => format!("seed-grade bytes from {src}"),
                Output::Drbg => format!(
                    "CTR_DRBG AES-256 df per consumer{}, seeded from {src}",
                    if shared.cfg.prediction_resistance {
                        " with prediction resistance"
                    } else {
                        ""
                    }
                ),
            };
        }

        let mut bound = Vec::new();
        let mut tcp_addrs = Vec::new();
        let mut unix_paths = Vec::new();
        for l in &shared.cfg.listen {
            match l {
                Listen::Unix(p) => match bind_unix(p, shared.cfg.unix_mode) {
                    Ok((u, held)) => {
                        unix_paths.push((p.clone(), held));
                        bound.push(Bound::Unix(u, l.to_string()));
                    }
                    Err(e) => {
                        remove_sockets(unix_paths);
                        return Err(e);
                    }
                },
                Listen::Tcp(a) => match TcpListener::bind(a) {
                    Ok(t) => {
                        let local = t.local_addr().unwrap_or(*a);
                        if !local.ip().is_loopback() {
                            shared.log(&format!(
                                "WARNING: listening on non-loopback {local} (--allow-remote): EGD has \
                                 no authentication; anyone who can connect can drain entropy"
                            ));
                        }
                        tcp_addrs.push(local);
                        bound.push(Bound::Tcp(t, format!("tcp:{local}")));
                    }
                    Err(source) => {
                        remove_sockets(unix_paths);
                        return Err(ServeError::Bind {
                            what: l.to_string(),
                            source,
                        });
                    }
                },
            }
        }
        let mut stats_listener = None;
        if let Some(p) = &shared.cfg.stats_socket {
            match bind_unix(p, shared.cfg.unix_mode) {
                Ok((u, held)) => {
                    unix_paths.push((p.clone(), held));
                    stats_listener = Some(u);
                }
                Err(e) => {
                    remove_sockets(unix_paths);
                    return Err(e);
                }
            }
        }

        let mut threads = Vec::new();
        for i in 0..shared.cfg.producers {
            let s = Arc::clone(&shared);
            threads.push(spawn(&format!("egd-producer-{i}"), move || s.producer()));
        }
        for b in bound {
            let s = Arc::clone(&shared);
            threads.push(spawn("egd-accept", move || accept_loop(&s, b)));
        }
        if let Some(u) = stats_listener {
            let s = Arc::clone(&shared);
            threads.push(spawn("egd-stats", move || stats_loop(&s, &u)));
        }
        if let Some(iv) = shared.cfg.stats_interval {
            let s = Arc::clone(&shared);
            threads.push(spawn("egd-stats-log", move || {
                let mut last = Instant::now();
                while !s.shutdown.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    if last.elapsed() >= iv {
                        last = Instant::now();
                        s.log(&summary(&stats_of(&s)));
                    }
                }
            }));
        }
        let names: Vec<String> = shared.cfg.listen.iter().map(ToString::to_string).collect();
        shared.log(&format!(
            "serving {} on {} (pid {}, max {} consumers{})",
            lock(&shared.stream_name),
            names.join(", "),
            std::process::id(),
            shared.cfg.max_consumers,
            shared
                .cfg
                .rate_limit
                .map(|r| format!(", {r} B/s per consumer"))
                .unwrap_or_default()
        ));
        Ok(Server {
            shared,
            threads,
            tcp_addrs,
            unix_paths,
        })
    }

    /// The bound TCP addresses (to learn a port picked with `:0`).
    #[must_use]
    pub fn tcp_addrs(&self) -> &[SocketAddr] {
        &self.tcp_addrs
    }

    /// The counters now.
    #[must_use]
    pub fn stats(&self) -> ServerStats {
        stats_of(&self.shared)
    }

    /// Bytes served to consumer `id` (only with the `record_served` test hook).
    #[must_use]
    pub fn recorded(&self, id: u64) -> Option<Vec<u8>> {
        let all = lock(&self.shared.consumers);
        all.open
            .iter()
            .chain(all.closed.iter())
            .find(|c| c.id == id)
            .map(|c| lock(&c.recorded).clone())
    }

    /// Blocks until [`Server::shutdown`] is called from another thread.
    pub fn wait(&self) {
        while !self.shared.shutdown.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Blocks until `stop` is raised (e.g. by [`stop_on_signals`]) or the
    /// server is shut down, polling every 100 ms.
    pub fn wait_until(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) && !self.shared.shutdown.load(Ordering::Relaxed) {
            std::thread::sleep(TICK);
        }
    }

    /// Stops accepting, closes every consumer and joins the threads.
    pub fn shutdown(&mut self) {
        if self.shared.shutdown.swap(true, Ordering::SeqCst) {
            return;
        }
        for d in lock(&self.shared.pool).demands.values() {
            d.done.notify_one();
        }
        self.shared.wanted.notify_all();
        for (p, _) in &self.unix_paths {
            drop(UnixStream::connect(p));
        }
        for a in &self.tcp_addrs {
            let a = if a.ip().is_unspecified() {
                SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), a.port())
            } else {
                *a
            };
            drop(TcpStream::connect_timeout(&a, Duration::from_millis(200)));
        }
        for t in self.threads.drain(..) {
            drop(t.join());
        }
        remove_sockets(self.unix_paths.drain(..));
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .unwrap_or_else(|e| {
            // Thread creation fails only under resource exhaustion; run inline
            // is impossible here, so report and continue without it.
            eprintln!("memveil rng serve: cannot start thread {name}: {e}");
            std::thread::spawn(|| {})
        })
}

fn accept_loop(shared: &Arc<Shared>, b: Bound) {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    loop {
        let accepted: io::Result<(Box<dyn Conn>, String)> = match &b {
            Bound::Unix(l, _) => l
                .accept()
                .map(|(s, _)| (Box::new(s) as Box<dyn Conn>, "unix".to_string())),
            Bound::Tcp(l, _) => l
                .accept()
                .map(|(s, a)| (Box::new(s) as Box<dyn Conn>, a.to_string())),
        };
        if shared.shutdown.load(Ordering::Relaxed) {
            break;
        }
        conns.retain(|h| !h.is_finished());
        let (mut conn, peer) = match accepted {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                shared.log(&format!("accept failed: {e}"));
                std::thread::sleep(TICK);
                continue;
            }
        };
        let listener = match &b {
            Bound::Unix(_, n) | Bound::Tcp(_, n) => n.clone(),
        };
        let open = lock(&shared.consumers).open.len();
        if open >= shared.cfg.max_consumers {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            shared.log(&format!(
                "refused a consumer on {listener} from {peer}: {open} consumers connected, the \
                 limit (--max-consumers {})",
                shared.cfg.max_consumers
            ));
            drop(conn);
            continue;
        }
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let rate_limit = shared
            .cfg
            .listener_rate_limits
            .iter()
            .find(|(l, _)| *l == listener)
            .map(|(_, r)| *r)
            .or(shared.cfg.rate_limit);
        let c = Arc::new(Consumer {
            id,
            listener,
            rate_limit,
            peer,
            connected: Instant::now(),
            closed_after: Mutex::new(None),
            bytes_served: AtomicU64::new(0),
            bytes_discarded: AtomicU64::new(0),
            blocking_reads: AtomicU64::new(0),
            nonblocking_reads: AtomicU64::new(0),
            level_queries: AtomicU64::new(0),
            pid_queries: AtomicU64::new(0),
            bytes_written_ignored: AtomicU64::new(0),
            seed_bytes: AtomicU64::new(0),
            limited_ns: AtomicU64::new(0),
            recorded: Mutex::new(Vec::new()),
        });
        lock(&shared.consumers).open.push(Arc::clone(&c));
        let s = Arc::clone(shared);
        conns.push(spawn(&format!("egd-consumer-{id}"), move || {
            let why = serve_conn(&s, &c, conn.as_mut());
            drop(conn);
            *lock(&c.closed_after) = Some((c.connected.elapsed(), why.clone()));
            s.log(&format!(
                "consumer {} ({} {}) closed after {} bytes: {why}",
                c.id,
                c.listener,
                c.peer,
                c.bytes_served.load(Ordering::Relaxed)
            ));
            let mut all = lock(&s.consumers);
            all.open.retain(|o| o.id != c.id);
            all.closed.push_back(c);
            while all.closed.len() > CLOSED_KEPT {
                all.closed.pop_front();
            }
        }));
    }
    for h in conns {
        drop(h.join());
    }
}

fn stats_loop(shared: &Arc<Shared>, l: &UnixListener) {
    for s in l.incoming() {
        if shared.shutdown.load(Ordering::Relaxed) {
            break;
        }
        if let Ok(mut s) = s {
            drop(s.set_write_timeout(Some(Duration::from_secs(2))));
            let st = stats_of(shared);
            let text = (shared.cfg.stats_format)(&st);
            drop(s.write_all(text.as_bytes()));
        }
    }
}

fn stats_of(shared: &Shared) -> ServerStats {
    let (active, sources, seeds, wiped) = {
        let p = lock(&shared.pool);
        let active = (p.health == Health::Serving)
            .then(|| p.statuses.get(p.active).map(|s| s.name.clone()))
            .flatten();
        (active, p.statuses.clone(), p.seeds, p.wiped)
    };
    let all = lock(&shared.consumers);
    let consumers: Vec<ConsumerStats> = all
        .closed
        .iter()
        .chain(all.open.iter())
        .map(|c| c.stats())
        .collect();
    let mut sorted = consumers;
    sorted.sort_by_key(|c| c.id);
    let bytes_served = shared.served_total.load(Ordering::Relaxed);
    ServerStats {
        pid: std::process::id(),
        uptime_seconds: shared.started.elapsed().as_secs_f64(),
        output: shared.cfg.output,
        stream: lock(&shared.stream_name).clone(),
        active_source: active,
        sources,
        seeds_produced: seeds,
        seed_bytes_wiped: wiped,
        bytes_served,
        consumers_open: all.open.len() as u64,
        consumers_total: shared.next_id.load(Ordering::Relaxed) - 1,
        consumers_refused: shared.refused.load(Ordering::Relaxed),
        rate_limit: shared.cfg.rate_limit,
        consumers: sorted,
    }
}

/// A flag raised by SIGINT or SIGTERM, so the daemon can shut down cleanly
/// (close consumers, remove its sockets, print its counters). `None` when
/// the handlers cannot be installed.
#[must_use]
pub fn stop_on_signals() -> Option<&'static AtomicBool> {
    memveil_sys::stopflag::stop_on_interrupt().ok()
}

/// One log line of the counters.
#[must_use]
pub fn summary(s: &ServerStats) -> String {
    let mut line = format!(
        "stats: source {} | {} open / {} total consumers | {} bytes served | {} seeds",
        s.active_source
            .as_deref()
            .unwrap_or("NONE (no healthy source)"),
        s.consumers_open,
        s.consumers_total,
        s.bytes_served,
        s.seeds_produced
    );
    for c in s.consumers.iter().filter(|c| c.state == "open") {
        line.push_str(&format!(
            " | #{} {} {:.0} B/s",
            c.id, c.bytes_served, c.rate_bytes_per_s
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two servers started at once on a stale socket file: one binds it,
    /// the other is refused as the socket is in use, and clients reach the
    /// one bound. Each round starts both binds together on a fresh stale
    /// file. Before the path's lock, 438 of 2000 rounds bound both (the
    /// second removed the socket the first had just bound).
    #[test]
    fn two_binds_at_once_on_a_stale_socket_leave_one_listening() {
        let dir = std::env::temp_dir().join(format!("memveil-drng-bind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let p = dir.join("rng.sock");
        let (mut both, mut unreachable, mut otherwise) = (0, 0, Vec::new());
        let rounds = 2000;
        for _ in 0..rounds {
            drop(UnixListener::bind(&p).expect("the stale socket"));
            let go = std::sync::Barrier::new(2);
            let (a, b) = std::thread::scope(|s| {
                let t = s.spawn(|| {
                    go.wait();
                    bind_unix(&p, 0o600)
                });
                go.wait();
                let b = bind_unix(&p, 0o600);
                (t.join().expect("thread"), b)
            });
            match (&a, &b) {
                (Ok(_), Ok(_)) => both += 1,
                (Ok(_), Err(ServeError::SocketInUse(_)))
                | (Err(ServeError::SocketInUse(_)), Ok(_)) => {
                    if UnixStream::connect(&p).is_err() {
                        unreachable += 1;
                    }
                }
                (a, b) => otherwise.push(format!(
                    "{:?} / {:?}",
                    a.as_ref().err().map(ToString::to_string),
                    b.as_ref().err().map(ToString::to_string)
                )),
            }
            for (_, held) in [a, b].into_iter().flatten() {
                let _ = std::fs::remove_file(&p);
                held.release();
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            both == 0 && unreachable == 0 && otherwise.is_empty(),
            "of {rounds} rounds: {both} bound both servers (the first one's socket removed by the \
             second), {unreachable} left the bound one unreachable, {} ended otherwise ({:?})",
            otherwise.len(),
            otherwise.first()
        );
    }
}
