//! memveil agent's ssh-agent codec on arbitrary bytes: framing and message
//! decoding (an `ADD_IDENTITY` parses an SSH private key into the vault's
//! import format) never panic, and never write past the components buffer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memveil_agent::proto;

fuzz_target!(|data: &[u8]| {
    if data.len() >= 4 {
        let _ = proto::frame_len([data[0], data[1], data[2], data[3]]);
    }
    let mut comp = [0u8; 4096];
    if let Ok(proto::Request::AddIdentity { len, .. }) = proto::decode(data, &mut comp) {
        assert!(len <= comp.len());
        let _ = memveil_asym::components::decode(&comp[..len]);
    }
});
