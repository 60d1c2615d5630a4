//! The smallest HTTP/1.x server that Prometheus can scrape: `GET /metrics`
//! answers the text exposition, everything else a short error, one request
//! per connection.
//!
//! Robust against what a network peer may send: the request head is read
//! up to [`MAX_HEAD`] bytes within [`HEAD_DEADLINE`] (a slow client is cut
//! off, answered 408), parsed by [`parse_head`] (bytes in, request out, no
//! I/O; malformed input is a 400, never a panic), and at most
//! [`MAX_CONNECTIONS`] connections are served at once (the next one gets a
//! 503). A request body is never read. Each connection has one deadline for
//! all of its life, [`CONNECTION_DEADLINE`] from its accept: reading the
//! head, writing the answer and draining what the client still sends all
//! end by it, and no read or write renews it, so a client that trickles
//! bytes or reads the answer slowly holds its slot for that long at most.
//!
//! | request | answer |
//! |---|---|
//! | `GET /metrics` (any query) | 200, `text/plain; version=0.0.4` |
//! | `HEAD /metrics` | 200, no body |
//! | `GET /` | 200, a line pointing to `/metrics` |
//! | other path | 404 |
//! | other method | 405 |
//! | not HTTP/1.x, a bad request line or header, a head too long | 400 |
//! | the head not complete within the deadline | 408 |

use std::io::{self, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest request head accepted (request line and headers).
pub const MAX_HEAD: usize = 8192;
/// Time a client has to send its whole request head.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// Connections served at once; more are answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 32;
/// Time a connection may last from its accept, all of it: the head, the
/// answer and the drain. Never renewed by a read or a write.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);
/// Longest drain of what the client still sends after the answer.
const DRAIN: Duration = Duration::from_millis(500);

/// Errors of starting the server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The address cannot be bound.
    #[error("cannot listen on {addr}: {source}{}", hint(.source))]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The cause.
        source: io::Error,
    },
}

fn hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::AddrInUse => {
            " (another process listens there: pick another port, or stop it; ss -ltnp shows which)"
        }
        io::ErrorKind::PermissionDenied => " (ports below 1024 need root or CAP_NET_BIND_SERVICE)",
        io::ErrorKind::AddrNotAvailable => " (no interface of this host has that address)",
        _ => "",
    }
}

/// A parsed request head: what the server acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// `GET`, `HEAD`, ...
    pub method: String,
    /// The path, without the query string.
    pub path: String,
}

/// Why a request head is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadRequest {
    /// The head is not complete yet (read more).
    Incomplete,
    /// Malformed: the reason, for the 400's body.
    Malformed(&'static str),
}

/// Parses a request head (`bytes` holds at least everything up to the blank
/// line). Sans-IO: fuzzed and property-tested without sockets.
///
/// # Errors
/// [`BadRequest::Incomplete`] before the blank line, [`BadRequest::Malformed`]
/// for anything that is not an HTTP/1.0 or 1.1 request head.
pub fn parse_head(bytes: &[u8]) -> Result<Head, BadRequest> {
    let end = find(bytes, b"\r\n\r\n")
        .map(|i| i + 2)
        .or_else(|| find(bytes, b"\n\n").map(|i| i + 1))
        .ok_or(BadRequest::Incomplete)?;
    let head = std::str::from_utf8(&bytes[..end])
        .map_err(|_| BadRequest::Malformed("request head is not UTF-8"))?;
    let mut lines = head.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let line = lines.next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(BadRequest::Malformed(
            "request line is not METHOD TARGET HTTP/1.x",
        ));
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(BadRequest::Malformed("bad method"));
    }
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(BadRequest::Malformed(
            "only HTTP/1.0 and HTTP/1.1 are served",
        ));
    }
    if !target.starts_with('/') || target.bytes().any(|b| b.is_ascii_control()) {
        return Err(BadRequest::Malformed(
            "request target is not an absolute path",
        ));
    }
    for h in lines.filter(|l| !l.is_empty()) {
        let Some((name, _)) = h.split_once(':') else {
            return Err(BadRequest::Malformed("header line without a colon"));
        };
        if name.is_empty() || name.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err(BadRequest::Malformed("bad header name"));
        }
    }
    let path = target.split_once('?').map_or(target, |(p, _)| p);
    Ok(Head {
        method: method.to_owned(),
        path: path.to_owned(),
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// What the server answers with: status code, reason, content type, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub code: u16,
    /// Reason phrase.
    pub reason: &'static str,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// The body (not sent for HEAD).
    pub body: String,
}

impl Response {
    fn text(code: u16, reason: &'static str, body: String) -> Self {
        Self {
            code,
            reason,
            content_type: "text/plain; charset=utf-8",
            body,
        }
    }

    fn bytes(&self, with_body: bool) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n",
            self.code,
            self.reason,
            self.content_type,
            self.body.len(),
            if self.code == 405 { "Allow: GET, HEAD\r\n" } else { "" }
        )
        .into_bytes();
        if with_body {
            out.extend_from_slice(self.body.as_bytes());
        }
        out
    }
}

/// The answer to a parsed request; `metrics` renders the exposition (only
/// called for `/metrics`).
pub fn route(head: &Head, metrics: &dyn Fn() -> String) -> Response {
    if head.method != "GET" && head.method != "HEAD" {
        return Response::text(
            405,
            "Method Not Allowed",
            "only GET and HEAD are served\n".to_owned(),
        );
    }
    match head.path.as_str() {
        "/metrics" => Response {
            code: 200,
            reason: "OK",
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            body: metrics(),
        },
        "/" => Response::text(
            200,
            "OK",
            "memveil probe: the metrics are at /metrics\n".to_owned(),
        ),
        _ => Response::text(
            404,
            "Not Found",
            "not found: the metrics are at /metrics\n".to_owned(),
        ),
    }
}

/// Renders the exposition for each scrape.
pub type Metrics = Arc<dyn Fn() -> String + Send + Sync>;

/// A bound metrics server.
pub struct Server {
    listener: TcpListener,
    metrics: Metrics,
    active: Arc<AtomicUsize>,
    /// [`CONNECTION_DEADLINE`]; shorter in tests.
    deadline: Duration,
}

impl Server {
    /// Binds `addr` (port 0: a free port, see [`Server::local_addr`]).
    ///
    /// # Errors
    /// [`HttpError::Bind`] naming the address and what to do.
    pub fn bind(addr: SocketAddr, metrics: Metrics) -> Result<Self, HttpError> {
        let listener =
            TcpListener::bind(addr).map_err(|source| HttpError::Bind { addr, source })?;
        Ok(Self {
            listener,
            metrics,
            active: Arc::new(AtomicUsize::new(0)),
            deadline: CONNECTION_DEADLINE,
        })
    }

    /// The address bound.
    ///
    /// # Errors
    /// The socket's error.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `stop` is set (checked between connections; a
    /// connection to the server wakes it).
    pub fn serve(&self, stop: &AtomicBool) {
        for conn in self.listener.incoming() {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let Ok(mut conn) = conn else {
                // EMFILE and the like: let the peer's retry find us freer.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            if self.active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
                self.active.fetch_sub(1, Ordering::AcqRel);
                let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
                let r = Response::text(
                    503,
                    "Service Unavailable",
                    "too many connections\n".to_owned(),
                );
                let _ = conn.write_all(&r.bytes(true));
                continue;
            }
            let end = Instant::now() + self.deadline;
            let metrics = Arc::clone(&self.metrics);
            let active = Arc::clone(&self.active);
            let spawned = std::thread::Builder::new()
                .name("probe-http".to_owned())
                .spawn(move || {
                    handle(conn, &*metrics, end);
                    active.fetch_sub(1, Ordering::AcqRel);
                });
            if spawned.is_err() {
                self.active.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

/// Serves one connection: reads the head, answers, closes; all of it by
/// `end`.
fn handle(mut conn: TcpStream, metrics: &dyn Fn() -> String, end: Instant) {
    let head_end = end.min(Instant::now() + HEAD_DEADLINE);
    let (resp, with_body) = match read_head(&mut conn, head_end) {
        Ok(head) => (route(&head, metrics), head.method != "HEAD"),
        Err(Some(r)) => (r, true),
        Err(None) => return,
    };
    if write_by(&mut conn, &resp.bytes(with_body), end).is_err() {
        return;
    }
    let _ = conn.shutdown(std::net::Shutdown::Write);
    // Drain what the client still sends for a moment, so closing with unread
    // input does not reset the connection before it read the answer.
    let drain_end = end.min(Instant::now() + DRAIN);
    let mut sink = [0u8; 1024];
    while let Some(left) = left_until(drain_end) {
        if conn.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match conn.read(&mut sink) {
            Ok(n) if n > 0 => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            _ => return,
        }
    }
}

/// The time left until `end`, `None` when none (a socket timeout of zero
/// would mean "no timeout").
fn left_until(end: Instant) -> Option<Duration> {
    Some(end.saturating_duration_since(Instant::now())).filter(|d| !d.is_zero())
}

/// Writes all of `buf` by `end`: each write waits only for the time left,
/// so a client that reads slowly cannot stretch it.
fn write_by(conn: &mut TcpStream, mut buf: &[u8], end: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        let left = left_until(end).ok_or(io::ErrorKind::TimedOut)?;
        conn.set_write_timeout(Some(left))?;
        match conn.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and parses the head; `Err(Some(r))` answers `r`, `Err(None)` closes
/// without answering (the peer went away).
fn read_head(conn: &mut TcpStream, end: Instant) -> Result<Head, Option<Response>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let Some(left) = left_until(end) else {
            return Err(Some(timeout()));
        };
        let _ = conn.set_read_timeout(Some(left));
        match conn.read(&mut chunk) {
            Ok(0) => return Err(None),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Some(timeout()));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Err(None),
        }
        match parse_head(&buf[..buf.len().min(MAX_HEAD)]) {
            Ok(h) => return Ok(h),
            Err(BadRequest::Incomplete) if buf.len() < MAX_HEAD => {}
            Err(BadRequest::Incomplete) => {
                return Err(Some(bad(&format!(
                    "request head longer than {MAX_HEAD} bytes"
                ))))
            }
            Err(BadRequest::Malformed(why)) => return Err(Some(bad(why))),
        }
    }
}

fn bad(why: &str) -> Response {
    Response::text(400, "Bad Request", format!("bad request: {why}\n"))
}

fn timeout() -> Response {
    Response::text(
        408,
        "Request Timeout",
        format!(
            "request head not complete within {} s\n",
            HEAD_DEADLINE.as_secs()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> Head {
        parse_head(s.as_bytes()).expect(s)
    }

    fn malformed(s: &[u8]) -> bool {
        matches!(parse_head(s), Err(BadRequest::Malformed(_)))
    }

    #[test]
    fn request_heads() {
        let h = ok("GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
        assert_eq!((h.method.as_str(), h.path.as_str()), ("GET", "/metrics"));
        assert_eq!(
            ok("GET /metrics?x=1 HTTP/1.0\n\n").path,
            "/metrics",
            "query dropped, bare LF accepted"
        );
        assert_eq!(
            parse_head(b"GET /metrics HTTP/1.1\r\nHost: x\r\n"),
            Err(BadRequest::Incomplete)
        );
        for bad in [
            &b"GET /metrics\r\n\r\n"[..],
            b"GET /metrics HTTP/2.0\r\n\r\n",
            b"get /metrics HTTP/1.1\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET /a b HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\n: empty name\r\n\r\n",
            b"GET /\xff HTTP/1.1\r\n\r\n",
            b"\r\n\r\n",
        ] {
            assert!(malformed(bad), "{}", String::from_utf8_lossy(bad));
        }
    }

    /// A server on loopback whose connections live `deadline`, answering
    /// `body_len` bytes; stopped and joined on drop.
    struct Serving {
        server: Arc<Server>,
        addr: SocketAddr,
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Serving {
        fn start(deadline: Duration, body_len: usize) -> Self {
            let body = "x".repeat(body_len);
            let metrics: Metrics = Arc::new(move || body.clone());
            let mut server = Server::bind(([127, 0, 0, 1], 0).into(), metrics).expect("bind");
            server.deadline = deadline;
            let server = Arc::new(server);
            let addr = server.local_addr().expect("addr");
            let stop = Arc::new(AtomicBool::new(false));
            let (s, f) = (Arc::clone(&server), Arc::clone(&stop));
            let thread = Some(std::thread::spawn(move || s.serve(&f)));
            Self {
                server,
                addr,
                stop,
                thread,
            }
        }

        /// Connections being served.
        fn active(&self) -> usize {
            self.server.active.load(Ordering::Acquire)
        }

        /// Waits (up to 5 s) until the server took a connection in.
        fn until_serving(&self) {
            let t = Instant::now();
            while self.active() == 0 && t.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(self.active(), 1, "the connection was not taken in");
        }
    }

    impl Drop for Serving {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            let _ = TcpStream::connect(self.addr);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    #[test]
    fn a_slowly_reading_client_is_cut_off_at_the_connection_deadline() {
        // 16 MiB: more than loopback's socket buffers hold, so the write
        // waits on the reader, who takes 4 KiB every 20 ms (some 80 s for
        // all of it): progress that renewed a per-write timeout.
        let len = 16 << 20;
        let s = Serving::start(Duration::from_secs(1), len);
        let mut c = TcpStream::connect(s.addr).expect("connect");
        c.write_all(b"GET /metrics HTTP/1.1\r\n\r\n")
            .expect("request");
        c.set_read_timeout(Some(Duration::from_secs(1)))
            .expect("timeout");
        s.until_serving();
        // What the server queued before the deadline still arrives (the
        // kernel sends it after the close); what counts is the slot.
        let t = Instant::now();
        let mut chunk = [0u8; 4096];
        while s.active() > 0 && t.elapsed() < Duration::from_secs(10) {
            let _ = c.read(&mut chunk);
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(s.active(), 0, "held for {:?}", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    #[test]
    fn a_client_that_keeps_sending_after_its_answer_is_cut_off() {
        let s = Serving::start(Duration::from_secs(2), 10);
        let mut c = TcpStream::connect(s.addr).expect("connect");
        c.write_all(b"GET /metrics HTTP/1.1\r\n\r\n")
            .expect("request");
        s.until_serving();
        // A byte every 50 ms: each read of the drain gets one in time.
        let t = Instant::now();
        while s.active() > 0 && t.elapsed() < Duration::from_secs(6) {
            let _ = c.write(b"a");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(s.active(), 0, "held for {:?}", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    #[test]
    fn routes() {
        let m = || "m 1\n".to_owned();
        let get = |p: &str| Head {
            method: "GET".to_owned(),
            path: p.to_owned(),
        };
        let r = route(&get("/metrics"), &m);
        assert_eq!((r.code, r.body.as_str()), (200, "m 1\n"));
        assert!(r.content_type.contains("version=0.0.4"));
        assert_eq!(route(&get("/"), &m).code, 200);
        assert_eq!(route(&get("/metricsx"), &m).code, 404);
        let post = Head {
            method: "POST".to_owned(),
            path: "/metrics".to_owned(),
        };
        let r = route(&post, &m);
        assert_eq!(r.code, 405);
        assert!(String::from_utf8_lossy(&r.bytes(true)).contains("Allow: GET, HEAD\r\n"));
        let head = r.bytes(false);
        assert!(head.ends_with(b"\r\n\r\n"), "no body for HEAD");
    }
}
