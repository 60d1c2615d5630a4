//! memveil agent's LOCK/UNLOCK path on arbitrary bytes: a sequence of
//! agent messages (each prefixed by one length byte) decoded by the codec,
//! the LOCK and UNLOCK among them driven through the lock (crates/agent/
//! src/lock.rs, at a tiny Argon2id cost) and checked against a model: the
//! lock opens with its passphrase only, a second LOCK and an UNLOCK of an
//! open agent are refused, a wrong guess owes a delay within its cap; no
//! panic on any input.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use memveil_agent::lock::{LockError, Locker, MAX_DELAY};
use memveil_agent::proto::{self, Request};
use memveil_secmem::{Level, Policy, SecretPool};
use memveil_vault::keystore::KdfParams;

fn pool() -> &'static SecretPool {
    static P: OnceLock<SecretPool> = OnceLock::new();
    P.get_or_init(|| SecretPool::new(1 << 16, Policy::allow(Level::Locked)).expect("pool"))
}

fuzz_target!(|data: &[u8]| {
    let mut l = Locker::new(KdfParams {
        m_kib: 8,
        t: 1,
        p: 1,
    });
    let mut model: Option<Vec<u8>> = None;
    let mut rest = data;
    while let [n, tail @ ..] = rest {
        let (msg, r) = tail.split_at(usize::from(*n).min(tail.len()));
        rest = r;
        match proto::decode(msg, &mut []) {
            Ok(Request::Lock { passphrase }) => match (&model, l.lock(pool(), passphrase)) {
                (None, Ok(())) => model = Some(passphrase.to_vec()),
                (Some(_), Err(LockError::Locked)) => {}
                (m, r) => panic!("LOCK with the agent locked={}: {r:?}", m.is_some()),
            },
            Ok(Request::Unlock { passphrase }) => match (&model, l.unlock(pool(), passphrase)) {
                (None, Err(LockError::NotLocked)) => {}
                (Some(p), Ok(())) if p == passphrase => model = None,
                (Some(p), Err(LockError::Wrong { delay, failures }))
                    if p != passphrase && failures > 0 && delay <= MAX_DELAY => {}
                (m, r) => panic!("UNLOCK with the agent locked={}: {r:?}", m.is_some()),
            },
            _ => {}
        }
        assert_eq!(l.is_locked(), model.is_some());
    }
});
