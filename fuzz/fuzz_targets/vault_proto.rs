//! The vault's control codec on arbitrary bytes: framing and request/reply
//! decoding never panic, and whatever decodes re-encodes to a frame that
//! decodes to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memveil_vault::proto::{self, Reply, Request};

fuzz_target!(|data: &[u8]| {
    if data.len() >= 4 {
        let h = [data[0], data[1], data[2], data[3]];
        let _ = proto::frame_len(h, proto::MAX_REQUEST);
    }
    if let Ok(req) = proto::decode_request(data) {
        let mut f = proto::encode_request(&req);
        match &req {
            Request::ImportKey { key, .. } => f.extend_from_slice(key),
            Request::ProgramKeyId(p) => {
                f.extend_from_slice(p.key_field_1);
                f.extend_from_slice(p.key_field_2);
            }
            _ => {}
        }
        let again = proto::decode_request(&f[4..]).expect("re-encoded request decodes");
        assert!(again == req, "round trip changed the request");
    }
    if let Ok(rep) = proto::decode_reply(data) {
        let mut f = proto::encode_reply(&rep);
        if let Reply::TenantKey(_) = rep {
            // Its frame counts the page key the vault sends after it.
            f.extend_from_slice(&[0; proto::TENANT_KEY_LEN]);
        }
        let again = proto::decode_reply(&f[4..]).expect("re-encoded reply decodes");
        assert_eq!(again, rep);
    }
});
