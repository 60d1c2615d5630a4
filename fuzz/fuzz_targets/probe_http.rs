//! The request-head parser of `memveil probe --serve` on arbitrary bytes
//! from the network: it parses or refuses, never panics, and what it
//! accepts routes to 200, 404 or 405.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memveil_probe::http::{parse_head, route};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = parse_head(data) {
        assert!(h.path.starts_with('/'));
        let r = route(&h, &|| "m 1\n".to_owned());
        assert!([200, 404, 405].contains(&r.code));
    }
});
