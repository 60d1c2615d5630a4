//! The EGD (Entropy Gathering Daemon) protocol, sans-IO: bytes in, requests
//! out; responses in, bytes out. No sockets here, so every outcome can be
//! property-tested and fuzzed (`fuzz/fuzz_targets/egd_decode.rs`).
//!
//! # Wire format
//!
//! A client sends commands; multi-byte numbers are big-endian. Counts are one
//! byte, so no single command can ask for more than 255 bytes.
//!
//! | command | request bytes | response bytes |
//! |---|---|---|
//! | `0x00` entropy level | `00` | `u32` bits of entropy available now |
//! | `0x01` read, non-blocking | `01 n` | `m` then `m` bytes, `m <= n` |
//! | `0x02` read, blocking | `02 n` | exactly `n` bytes (no count byte) |
//! | `0x03` write entropy | `03 bits:u16 len:u8 data[len]` | nothing |
//! | `0x04` report PID | `04` | `len:u8` then the PID as ASCII decimal |
//!
//! QEMU's `rng-egd` backend sends only `0x02`, in chunks of at most 255
//! bytes, and matches responses to its queued requests purely by byte count;
//! that is why a blocking read must answer exactly `n` bytes and nothing else.
//!
//! # Defined outcomes for bad input
//!
//! - Unknown command byte: [`EgdError::UnknownCommand`]. The byte stream can
//!   no longer be framed, so the decoder stays failed (every later call
//!   returns the same error) and the server closes the connection.
//! - A command cut short by end of stream: [`Decoder::finish`] returns
//!   [`EgdError::Truncated`] naming the command and how many bytes were
//!   missing; nothing is answered for it.
//! - Oversized: the protocol cannot express a count above 255; the server's
//!   own per-request cap ([`Limits::max_read`], default 255) makes a blocking
//!   read above it [`EgdError::TooLarge`] (connection closed, because
//!   answering fewer bytes would desynchronise the client) and a non-blocking
//!   read return at most the cap (the protocol allows short answers).
//! - Write entropy (`0x03`) is parsed, counted and discarded: client-supplied
//!   bytes are never mixed into what other consumers receive and never
//!   credited. A claim of more bits than `8 * len` is accepted by the decoder
//!   (it is not a framing error) and reported by [`Request::is_plausible`].
//! - The decoder never buffers more than one command (at most 259 bytes), so
//!   a client cannot make it grow.

use std::io::{self, Read, Write};

/// `0x00`: how many bits of entropy are available.
pub const CMD_ENTROPY_LEVEL: u8 = 0x00;
/// `0x01`: read up to `n` bytes without waiting.
pub const CMD_READ_NONBLOCKING: u8 = 0x01;
/// `0x02`: read exactly `n` bytes, waiting as long as needed.
pub const CMD_READ_BLOCKING: u8 = 0x02;
/// `0x03`: the client offers entropy.
pub const CMD_WRITE_ENTROPY: u8 = 0x03;
/// `0x04`: the daemon's process id.
pub const CMD_REPORT_PID: u8 = 0x04;

/// The largest count a one-byte length can carry.
pub const MAX_COUNT: usize = 255;

/// The longest command on the wire: `03 bits bits len data[255]`.
pub const MAX_COMMAND_LEN: usize = 4 + MAX_COUNT;

/// One decoded client command.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Request {
    /// `0x00`.
    EntropyLevel,
    /// `0x01 n`.
    ReadNonBlocking {
        /// Bytes asked for.
        len: u8,
    },
    /// `0x02 n`.
    ReadBlocking {
        /// Bytes asked for.
        len: u8,
    },
    /// `0x03 bits len data`.
    WriteEntropy {
        /// Entropy the client claims for `data`, in bits.
        bits: u16,
        /// The offered bytes.
        data: Vec<u8>,
    },
    /// `0x04`.
    ReportPid,
}

impl Request {
    /// The command byte.
    #[must_use]
    pub fn command(&self) -> u8 {
        match self {
            Request::EntropyLevel => CMD_ENTROPY_LEVEL,
            Request::ReadNonBlocking { .. } => CMD_READ_NONBLOCKING,
            Request::ReadBlocking { .. } => CMD_READ_BLOCKING,
            Request::WriteEntropy { .. } => CMD_WRITE_ENTROPY,
            Request::ReportPid => CMD_REPORT_PID,
        }
    }

    /// Appends the wire form (what a client sends).
    ///
    /// # Errors
    /// [`EgdError::TooLarge`] for a write of more than 255 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), EgdError> {
        out.push(self.command());
        match self {
            Request::EntropyLevel | Request::ReportPid => {}
            Request::ReadNonBlocking { len } | Request::ReadBlocking { len } => out.push(*len),
            Request::WriteEntropy { bits, data } => {
                let len = u8::try_from(data.len()).map_err(|_| EgdError::TooLarge {
                    requested: data.len(),
                    max: MAX_COUNT,
                })?;
                out.extend_from_slice(&bits.to_be_bytes());
                out.push(len);
                out.extend_from_slice(data);
            }
        }
        Ok(())
    }

    /// False for a write that claims more bits than its bytes can hold.
    #[must_use]
    pub fn is_plausible(&self) -> bool {
        match self {
            Request::WriteEntropy { bits, data } => usize::from(*bits) <= data.len() * 8,
            _ => true,
        }
    }
}

/// Errors of the EGD codec and of a server's checks on requests.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EgdError {
    /// The first byte of a command is not 0x00..=0x04.
    #[error(
        "unknown EGD command byte 0x{0:02x} (EGD knows 0x00..0x04); the stream cannot be \
         framed any more, so the connection is closed: check that the client speaks EGD"
    )]
    UnknownCommand(u8),
    /// The stream ended inside a command.
    #[error(
        "connection ended inside EGD command 0x{command:02x}: {got} of {need} bytes \
         received; the partial command was ignored"
    )]
    Truncated {
        /// The command byte.
        command: u8,
        /// Bytes of it received.
        got: usize,
        /// Bytes it needs.
        need: usize,
    },
    /// A request above the server's per-request cap (or a write above 255
    /// bytes on the client side).
    #[error(
        "EGD request of {requested} bytes exceeds this server's limit of {max} bytes per \
         request; ask for less per command (or raise --max-request, up to 255)"
    )]
    TooLarge {
        /// Bytes asked for.
        requested: usize,
        /// The cap.
        max: usize,
    },
    /// A response that does not match the request (client side).
    #[error("EGD server answered {got} bytes where at most {max} were asked for")]
    BadResponse {
        /// Count announced by the server.
        got: usize,
        /// Count asked for.
        max: usize,
    },
}

/// Server-side limits applied to decoded requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest read served per command (1..=255).
    pub max_read: u8,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_read: u8::MAX }
    }
}

impl Limits {
    /// What the server does with a read of `len` bytes: the number of bytes it
    /// will answer, or the error that closes the connection.
    ///
    /// # Errors
    /// [`EgdError::TooLarge`] for a blocking read above the cap.
    pub fn admit_read(&self, len: u8, blocking: bool) -> Result<u8, EgdError> {
        if len <= self.max_read {
            Ok(len)
        } else if blocking {
            Err(EgdError::TooLarge {
                requested: usize::from(len),
                max: usize::from(self.max_read),
            })
        } else {
            Ok(self.max_read)
        }
    }
}

/// Incremental decoder of client commands (server side).
///
/// Feed it whatever the socket returned; it hands back complete requests and
/// keeps at most one partial command.
#[derive(Debug, Clone)]
pub struct Decoder {
    buf: Vec<u8>,
    failed: Option<EgdError>,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

/// How many bytes the command starting with `buf[0]` needs in total, if
/// `buf` holds enough of it to know.
fn needed(buf: &[u8]) -> Result<Option<usize>, EgdError> {
    let Some(&cmd) = buf.first() else {
        return Ok(None);
    };
    Ok(Some(match cmd {
        CMD_ENTROPY_LEVEL | CMD_REPORT_PID => 1,
        CMD_READ_NONBLOCKING | CMD_READ_BLOCKING => 2,
        CMD_WRITE_ENTROPY => match buf.get(3) {
            Some(&len) => 4 + usize::from(len),
            None => return Ok(None),
        },
        other => return Err(EgdError::UnknownCommand(other)),
    }))
}

fn parse(cmd: &[u8]) -> Request {
    match cmd[0] {
        CMD_ENTROPY_LEVEL => Request::EntropyLevel,
        CMD_READ_NONBLOCKING => Request::ReadNonBlocking { len: cmd[1] },
        CMD_READ_BLOCKING => Request::ReadBlocking { len: cmd[1] },
        CMD_WRITE_ENTROPY => Request::WriteEntropy {
            bits: u16::from_be_bytes([cmd[1], cmd[2]]),
            data: cmd[4..].to_vec(),
        },
        _ => Request::ReportPid,
    }
}

impl Decoder {
    /// A decoder at the start of a stream.
    #[must_use]
    pub fn new() -> Self {
        Self {
            buf: Vec::with_capacity(MAX_COMMAND_LEN),
            failed: None,
        }
    }

    /// Consumes bytes from `input` until one command is complete or `input`
    /// is used up. Returns the bytes consumed and the command, if complete.
    ///
    /// # Errors
    /// [`EgdError::UnknownCommand`]; after it, every call fails the same way.
    pub fn decode(&mut self, input: &[u8]) -> Result<(usize, Option<Request>), EgdError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut used = 0;
        loop {
            let need = match needed(&self.buf) {
                Ok(n) => n,
                Err(e) => {
                    self.failed = Some(e.clone());
                    self.buf.clear();
                    return Err(e);
                }
            };
            if let Some(n) = need {
                if self.buf.len() == n {
                    let req = parse(&self.buf);
                    zeroize::Zeroize::zeroize(&mut self.buf);
                    self.buf.clear();
                    return Ok((used, Some(req)));
                }
                // Take exactly what this command still needs.
                let take = (n - self.buf.len()).min(input.len() - used);
                if take == 0 {
                    return Ok((used, None));
                }
                self.buf.extend_from_slice(&input[used..used + take]);
                used += take;
            } else {
                // Header incomplete: take one byte and look again.
                let Some(&b) = input.get(used) else {
                    return Ok((used, None));
                };
                self.buf.push(b);
                used += 1;
            }
        }
    }

    /// Decodes every complete command in `input` into `out`; a trailing
    /// partial command stays buffered.
    ///
    /// # Errors
    /// [`EgdError::UnknownCommand`]; the commands before it are in `out`.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<Request>) -> Result<(), EgdError> {
        loop {
            let (used, req) = self.decode(input)?;
            input = &input[used..];
            match req {
                Some(r) => out.push(r),
                None => return Ok(()),
            }
        }
    }

    /// Bytes of a partial command held.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Call at end of stream.
    ///
    /// # Errors
    /// [`EgdError::Truncated`] when a partial command is held, or the error
    /// that failed the decoder.
    pub fn finish(&self) -> Result<(), EgdError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        match self.buf.first() {
            None => Ok(()),
            Some(&command) => {
                let need = match needed(&self.buf) {
                    Ok(Some(n)) => n,
                    // Only a write can have an unknown length: 4 header bytes.
                    _ => 4,
                };
                Err(EgdError::Truncated {
                    command,
                    got: self.buf.len(),
                    need,
                })
            }
        }
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.buf);
    }
}

/// Appends the answer to `0x00`.
pub fn encode_entropy_level(bits: u32, out: &mut Vec<u8>) {
    out.extend_from_slice(&bits.to_be_bytes());
}

/// Appends the answer to `0x01`: the count, then the bytes.
///
/// # Errors
/// [`EgdError::TooLarge`] for more than 255 bytes.
pub fn encode_nonblocking(data: &[u8], out: &mut Vec<u8>) -> Result<(), EgdError> {
    let n = u8::try_from(data.len()).map_err(|_| EgdError::TooLarge {
        requested: data.len(),
        max: MAX_COUNT,
    })?;
    out.push(n);
    out.extend_from_slice(data);
    Ok(())
}

/// Appends the answer to `0x04`.
pub fn encode_pid(pid: u32, out: &mut Vec<u8>) {
    let s = pid.to_string();
    // A u32 has at most 10 decimal digits.
    out.push(u8::try_from(s.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(s.as_bytes());
}

/// A blocking EGD client over any byte stream (tests, the benchmark, and
/// anyone who wants to talk to `memveil rng serve` from Rust).
#[derive(Debug)]
pub struct Client<S: Read + Write> {
    stream: S,
}

/// Errors of [`Client`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Socket I/O failed (a closed connection shows as `UnexpectedEof`).
    #[error("EGD connection: {0}")]
    Io(#[from] io::Error),
    /// The server violated the protocol.
    #[error(transparent)]
    Protocol(#[from] EgdError),
}

impl<S: Read + Write> Client<S> {
    /// Wraps a connected stream.
    pub fn new(stream: S) -> Self {
        Self { stream }
    }

    /// The stream.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    fn send(&mut self, req: &Request) -> Result<(), ClientError> {
        let mut b = Vec::with_capacity(8);
        req.encode(&mut b)?;
        self.stream.write_all(&b)?;
        Ok(())
    }

    /// `0x00`: bits of entropy the server says are available.
    ///
    /// # Errors
    /// I/O errors.
    pub fn entropy_level(&mut self) -> Result<u32, ClientError> {
        self.send(&Request::EntropyLevel)?;
        let mut b = [0u8; 4];
        self.stream.read_exact(&mut b)?;
        Ok(u32::from_be_bytes(b))
    }

    /// `0x02`: fills `out` (any length; sent as commands of at most 255
    /// bytes, the way QEMU does).
    ///
    /// # Errors
    /// I/O errors (EOF when the server closed the connection).
    pub fn read_blocking(&mut self, out: &mut [u8]) -> Result<(), ClientError> {
        for chunk in out.chunks_mut(MAX_COUNT) {
            let len = u8::try_from(chunk.len()).unwrap_or(u8::MAX);
            self.send(&Request::ReadBlocking { len })?;
            self.stream.read_exact(chunk)?;
        }
        Ok(())
    }

    /// `0x01`: up to `len` bytes, whatever the server has now.
    ///
    /// # Errors
    /// I/O errors; [`EgdError::BadResponse`] when the server announces more
    /// than asked.
    pub fn read_nonblocking(&mut self, len: u8) -> Result<Vec<u8>, ClientError> {
        self.send(&Request::ReadNonBlocking { len })?;
        let mut n = [0u8; 1];
        self.stream.read_exact(&mut n)?;
        if n[0] > len {
            return Err(EgdError::BadResponse {
                got: usize::from(n[0]),
                max: usize::from(len),
            }
            .into());
        }
        let mut v = vec![0u8; usize::from(n[0])];
        self.stream.read_exact(&mut v)?;
        Ok(v)
    }

    /// `0x03`: offers `data` with a claimed entropy of `bits`.
    ///
    /// # Errors
    /// I/O errors; [`EgdError::TooLarge`] above 255 bytes.
    pub fn write_entropy(&mut self, bits: u16, data: &[u8]) -> Result<(), ClientError> {
        self.send(&Request::WriteEntropy {
            bits,
            data: data.to_vec(),
        })
    }

    /// `0x04`: the server's process id, as the text it sent.
    ///
    /// # Errors
    /// I/O errors.
    pub fn pid(&mut self) -> Result<String, ClientError> {
        self.send(&Request::ReportPid)?;
        let mut n = [0u8; 1];
        self.stream.read_exact(&mut n)?;
        let mut v = vec![0u8; usize::from(n[0])];
        self.stream.read_exact(&mut v)?;
        Ok(String::from_utf8_lossy(&v).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(bytes: &[u8]) -> Result<Vec<Request>, EgdError> {
        let mut d = Decoder::new();
        let mut out = Vec::new();
        d.feed(bytes, &mut out)?;
        d.finish()?;
        Ok(out)
    }

    #[test]
    fn exact_byte_formats() {
        assert_eq!(decode_all(&[0x00]), Ok(vec![Request::EntropyLevel]));
        assert_eq!(
            decode_all(&[0x01, 0x20]),
            Ok(vec![Request::ReadNonBlocking { len: 32 }])
        );
        assert_eq!(
            decode_all(&[0x02, 0xff]),
            Ok(vec![Request::ReadBlocking { len: 255 }])
        );
        assert_eq!(
            decode_all(&[0x03, 0x01, 0x00, 0x03, 0xaa, 0xbb, 0xcc]),
            Ok(vec![Request::WriteEntropy {
                bits: 256,
                data: vec![0xaa, 0xbb, 0xcc]
            }])
        );
        assert_eq!(decode_all(&[0x04]), Ok(vec![Request::ReportPid]));
        let mut b = Vec::new();
        encode_entropy_level(0x0102_0304, &mut b);
        assert_eq!(b, [1, 2, 3, 4]);
        b.clear();
        encode_nonblocking(&[9, 8], &mut b).expect("small");
        assert_eq!(b, [2, 9, 8]);
        b.clear();
        encode_pid(4711, &mut b);
        assert_eq!(b, b"\x044711");
        assert!(encode_nonblocking(&[0; 256], &mut b).is_err());
    }

    #[test]
    fn qemu_stream_of_blocking_reads_pipelined() {
        // QEMU queues several 0x02 requests back to back.
        let got = decode_all(&[2, 255, 2, 255, 2, 18]).expect("valid");
        assert_eq!(
            got,
            vec![
                Request::ReadBlocking { len: 255 },
                Request::ReadBlocking { len: 255 },
                Request::ReadBlocking { len: 18 }
            ]
        );
    }

    #[test]
    fn unknown_command_poisons_decoder() {
        let mut d = Decoder::new();
        let mut out = Vec::new();
        let e = d.feed(&[0x00, 0x05, 0x00], &mut out);
        assert_eq!(e, Err(EgdError::UnknownCommand(5)));
        assert_eq!(out, vec![Request::EntropyLevel]);
        assert_eq!(d.decode(&[0x00]), Err(EgdError::UnknownCommand(5)));
        assert_eq!(d.finish(), Err(EgdError::UnknownCommand(5)));
    }

    #[test]
    fn truncated_commands_are_reported_at_eof() {
        for (bytes, command, got, need) in [
            (&[0x01][..], 1, 1, 2),
            (&[0x02][..], 2, 1, 2),
            (&[0x03][..], 3, 1, 4),
            (&[0x03, 0, 8][..], 3, 3, 4),
            (&[0x03, 0, 8, 2, 0xaa][..], 3, 5, 6),
        ] {
            assert_eq!(
                decode_all(bytes),
                Err(EgdError::Truncated { command, got, need }),
                "{bytes:?}"
            );
        }
    }

    #[test]
    fn limits_define_oversized_reads() {
        let l = Limits { max_read: 64 };
        assert_eq!(l.admit_read(64, true), Ok(64));
        assert_eq!(
            l.admit_read(65, true),
            Err(EgdError::TooLarge {
                requested: 65,
                max: 64
            })
        );
        assert_eq!(l.admit_read(200, false), Ok(64));
        assert_eq!(Limits::default().admit_read(255, true), Ok(255));
    }

    #[test]
    fn implausible_credit_is_flagged_not_fatal() {
        let r = decode_all(&[3, 0, 9, 1, 0]).expect("frames fine");
        assert!(!r[0].is_plausible());
        let r = decode_all(&[3, 0, 8, 1, 0]).expect("frames fine");
        assert!(r[0].is_plausible());
    }

    fn arb_request() -> impl Strategy<Value = Request> {
        prop_oneof![
            Just(Request::EntropyLevel),
            Just(Request::ReportPid),
            any::<u8>().prop_map(|len| Request::ReadNonBlocking { len }),
            any::<u8>().prop_map(|len| Request::ReadBlocking { len }),
            (
                any::<u16>(),
                proptest::collection::vec(any::<u8>(), 0..=255)
            )
                .prop_map(|(bits, data)| Request::WriteEntropy { bits, data }),
        ]
    }

    proptest! {
        #[test]
        fn round_trip_under_any_split(reqs in proptest::collection::vec(arb_request(), 0..20),
                                      cuts in proptest::collection::vec(any::<usize>(), 0..8)) {
            let mut wire = Vec::new();
            for r in &reqs {
                r.encode(&mut wire).expect("encodable");
            }
            let mut points: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
            points.push(0);
            points.push(wire.len());
            points.sort_unstable();
            let mut d = Decoder::new();
            let mut out = Vec::new();
            for w in points.windows(2) {
                d.feed(&wire[w[0]..w[1]], &mut out).expect("valid stream");
                prop_assert!(d.pending() < MAX_COMMAND_LEN);
            }
            d.finish().expect("complete");
            prop_assert_eq!(out, reqs);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let mut d = Decoder::new();
            let mut out = Vec::new();
            let r = d.feed(&bytes, &mut out);
            prop_assert!(d.pending() < MAX_COMMAND_LEN);
            if r.is_ok() {
                let _ = d.finish();
            }
        }
    }
}
