//! The PKCS#11 module's CKM_ECDH1_DERIVE parameters on arbitrary bytes
//! (crates/pkcs11/src/asym.rs, `Ecdh::new` and `peer_point`): the KDF code,
//! the shared data and the peer's point never panic; the point is unwrapped
//! from a DER OCTET STRING only when its length byte covers exactly the
//! rest and the rest is a whole P-256/P-384 point, and a whole raw point is
//! always taken as it is (issue 32: `04 3F 04…` is a raw P-256 point).
#![no_main]

use libfuzzer_sys::fuzz_target;
use memveil_pkcs11::asym::{peer_point, Ecdh};

const POINT_LENS: [usize; 4] = [33, 49, 65, 97];

fuzz_target!(|data: &[u8]| {
    let [k, split, rest @ ..] = data else {
        return;
    };
    let (shared, public) = rest.split_at(usize::from(*split).min(rest.len()));
    let peer = peer_point(public);
    if POINT_LENS.contains(&public.len()) {
        assert_eq!(peer, public, "a whole raw point was changed");
    } else if peer.len() != public.len() {
        assert!(POINT_LENS.contains(&peer.len()) && public[0] == 4);
        assert!(public.ends_with(peer));
        let header = public.len() - peer.len();
        assert!(
            (header == 2 && usize::from(public[1]) == peer.len())
                || (header == 3 && public[1] == 0x81 && usize::from(public[2]) == peer.len())
        );
    }
    // The KDF: CKD_NULL (1) through CKD_SHA512_KDF (8) and anything else.
    if let Ok(e) = Ecdh::new(std::ffi::c_ulong::from(*k), shared, public) {
        assert_eq!(e.peer, peer);
        assert_eq!(e.shared, shared);
        assert!(e.kdf != 0 || shared.is_empty());
    }
});
