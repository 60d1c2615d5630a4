//! The EGD decoder on arbitrary bytes fed in arbitrary pieces: it never
//! panics, never buffers more than one command, and whatever it decodes
//! re-encodes to the bytes it consumed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memveil_drng::egd::{Decoder, Limits, Request, MAX_COMMAND_LEN};

fuzz_target!(|data: &[u8]| {
    // The first byte chooses the piece size, so splits are explored too.
    let Some((&split, input)) = data.split_first() else {
        return;
    };
    let piece = usize::from(split % 64) + 1;
    let mut d = Decoder::new();
    let mut out: Vec<Request> = Vec::new();
    let mut failed = false;
    for chunk in input.chunks(piece) {
        if d.feed(chunk, &mut out).is_err() {
            failed = true;
            break;
        }
        assert!(d.pending() < MAX_COMMAND_LEN);
    }
    let _ = d.finish();
    // Round trip: the decoded commands re-encode to a prefix of the input.
    let mut wire = Vec::new();
    for r in &out {
        r.encode(&mut wire).expect("decoded requests are encodable");
        // The server's cap: blocking reads above it are refused, non-blocking
        // ones are answered short, never longer than asked.
        let limits = Limits {
            max_read: split.max(1),
        };
        match *r {
            Request::ReadBlocking { len } => {
                assert_eq!(limits.admit_read(len, true).is_ok(), len <= limits.max_read);
            }
            Request::ReadNonBlocking { len } => {
                let n = limits.admit_read(len, false).expect("never refused");
                assert!(n <= len && n <= limits.max_read);
            }
            _ => {}
        }
    }
    assert!(
        input.starts_with(&wire),
        "re-encoding differs from the input"
    );
    if !failed {
        assert_eq!(wire.len() + d.pending(), input.len());
    }
});
