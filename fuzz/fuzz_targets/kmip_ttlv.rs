//! The KMIP TTLV decoder (crates/kmip/src/ttlv.rs) and the response parser
//! on arbitrary bytes: they never panic; whatever decodes re-encodes to the
//! same length and decodes again to the same items.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memveil_kmip::msg::{self, Operation};
use memveil_kmip::ttlv;

fuzz_target!(|data: &[u8]| {
    let Ok(item) = ttlv::decode(data) else {
        return;
    };
    let again = item.to_vec();
    assert_eq!(again.len(), data.len(), "re-encoded length differs");
    assert_eq!(ttlv::decode(&again).expect("re-encoding decodes"), item);
    for op in [Operation::Get, Operation::Create, Operation::Locate] {
        if let Ok(p) = msg::response(&item, op) {
            let _ = msg::uid(p);
            let _ = msg::got(p);
        }
    }
});
