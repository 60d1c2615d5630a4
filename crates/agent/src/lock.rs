//! The agent's lock (`ssh-add -x`/`-X`), sans-IO: the passphrase stored as
//! Argon2id of it and a random salt (the vault keystore's KDF,
//! [`memveil_vault::keystore::argon2id`]), its hash in secret memory, and a
//! delay owed after each wrong guess that grows with the guesses (the
//! server sleeps it, holding every other guess back).
//!
//! The passphrase itself is only borrowed: the server reads the request
//! into secret memory and wipes it after the call.
#![forbid(unsafe_code)]

use std::time::Duration;

use memveil_secmem::{SecretBox, SecretPool};
use memveil_vault::keystore::{argon2id, KdfParams};

/// Longest `SSH_AGENTC_LOCK`/`UNLOCK` message read (OpenSSH's passphrases
/// are at most 1 KiB).
pub const MAX_LOCK: usize = 4096;

/// The lock's Argon2id cost: 19 MiB, 2 passes, one lane (OWASP's minimum
/// for Argon2id); about 0.1 s a guess on one core.
pub const KDF: KdfParams = KdfParams {
    m_kib: 19 * 1024,
    t: 2,
    p: 1,
};

/// Delay owed after the first wrong guess; each further one adds as much,
/// up to [`MAX_DELAY`] (as ssh-agent: 0.1 s times the failures, at most
/// 10 s).
pub const STEP: Duration = Duration::from_millis(100);

/// Longest delay a wrong guess costs.
pub const MAX_DELAY: Duration = Duration::from_secs(10);

/// Why locking or unlocking failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// `LOCK` on a locked agent.
    #[error("the agent is locked already")]
    Locked,
    /// `UNLOCK` on an agent that is not locked.
    #[error("the agent is not locked")]
    NotLocked,
    /// The wrong passphrase: the caller waits `delay` before answering.
    #[error("wrong passphrase ({failures} in a row)")]
    Wrong {
        /// Failed guesses since the lock or the last success.
        failures: u32,
        /// What this failure costs.
        delay: Duration,
    },
    /// Salt, KDF or secret memory failed.
    #[error("{0}")]
    Internal(String),
}

struct Locked {
    salt: [u8; 16],
    hash: SecretBox<[u8]>,
}

/// The lock state.
pub struct Locker {
    params: KdfParams,
    locked: Option<Locked>,
    failures: u32,
}

impl Locker {
    /// An unlocked agent whose lock will cost `params`.
    #[must_use]
    pub fn new(params: KdfParams) -> Self {
        Locker {
            params,
            locked: None,
            failures: 0,
        }
    }

    /// Whether the agent is locked.
    #[must_use]
    pub fn is_locked(&self) -> bool {
        self.locked.is_some()
    }

    fn hash(
        &self,
        pool: &SecretPool,
        pass: &[u8],
        salt: &[u8],
    ) -> Result<SecretBox<[u8]>, LockError> {
        let mut h = pool
            .alloc_bytes(32)
            .map_err(|e| LockError::Internal(e.to_string()))?;
        let r = argon2id(pass, salt, self.params, &mut h);
        // Argon2's first hash (Blake2b over the passphrase) ran on this
        // thread's ordinary stack.
        memveil_secmem::scrub_stack(32 * 1024);
        r.map_err(|e| LockError::Internal(e.to_string()))?;
        Ok(h)
    }

    /// Locks with `pass`, its hash into `pool`.
    ///
    /// # Errors
    /// [`LockError::Locked`], or [`LockError::Internal`].
    pub fn lock(&mut self, pool: &SecretPool, pass: &[u8]) -> Result<(), LockError> {
        if self.locked.is_some() {
            return Err(LockError::Locked);
        }
        let mut salt = [0u8; 16];
        memveil_sys::getrandom(&mut salt).map_err(|e| LockError::Internal(e.to_string()))?;
        let hash = self.hash(pool, pass, &salt)?;
        self.locked = Some(Locked { salt, hash });
        self.failures = 0;
        Ok(())
    }

    /// Unlocks when `pass` is the lock's passphrase.
    ///
    /// # Errors
    /// [`LockError::NotLocked`]; [`LockError::Wrong`] with the delay the
    /// caller owes; [`LockError::Internal`].
    pub fn unlock(&mut self, pool: &SecretPool, pass: &[u8]) -> Result<(), LockError> {
        let Some(l) = &self.locked else {
            return Err(LockError::NotLocked);
        };
        let got = self.hash(pool, pass, &l.salt)?;
        let diff = got
            .iter()
            .zip(l.hash.iter())
            .fold(0u8, |d, (a, b)| d | (a ^ b));
        if diff == 0 {
            self.locked = None;
            self.failures = 0;
            return Ok(());
        }
        self.failures = self.failures.saturating_add(1);
        Err(LockError::Wrong {
            failures: self.failures,
            delay: STEP.saturating_mul(self.failures).min(MAX_DELAY),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memveil_secmem::{Level, Policy};

    const CHEAP: KdfParams = KdfParams {
        m_kib: 64,
        t: 1,
        p: 1,
    };

    #[test]
    fn unlocks_with_its_passphrase_only_and_wrong_guesses_cost_more_each() {
        let pool = SecretPool::new(1 << 16, Policy::allow(Level::Locked)).expect("pool");
        let mut l = Locker::new(CHEAP);
        assert!(matches!(l.unlock(&pool, b"x"), Err(LockError::NotLocked)));
        l.lock(&pool, b"right").expect("lock");
        assert!(matches!(l.lock(&pool, b"again"), Err(LockError::Locked)));
        let mut delays = Vec::new();
        for _ in 0..3 {
            match l.unlock(&pool, b"wrong") {
                Err(LockError::Wrong { delay, .. }) => delays.push(delay),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(delays, [STEP, 2 * STEP, 3 * STEP]);
        assert!(l.is_locked());
        l.unlock(&pool, b"right").expect("unlock");
        assert!(!l.is_locked());
        // A new lock starts the count again.
        l.lock(&pool, b"").expect("lock");
        assert!(
            matches!(l.unlock(&pool, b"right"), Err(LockError::Wrong { delay, .. }) if delay == STEP)
        );
        l.unlock(&pool, b"").expect("empty passphrase");
    }

    #[test]
    fn the_stored_hash_is_the_keystores_argon2id() {
        let pool = SecretPool::new(1 << 16, Policy::allow(Level::Locked)).expect("pool");
        let mut l = Locker::new(CHEAP);
        l.lock(&pool, b"pass").expect("lock");
        let st = l.locked.as_ref().expect("locked");
        let mut want = [0u8; 32];
        argon2id(b"pass", &st.salt, CHEAP, &mut want).expect("kdf");
        assert_eq!(&st.hash[..], &want[..]);
    }

    #[test]
    fn the_delay_stops_growing_at_its_cap() {
        let pool = SecretPool::new(1 << 16, Policy::allow(Level::Locked)).expect("pool");
        let mut l = Locker::new(CHEAP);
        l.lock(&pool, b"p").expect("lock");
        l.failures = 1000;
        assert!(
            matches!(l.unlock(&pool, b"q"), Err(LockError::Wrong { delay, .. }) if delay == MAX_DELAY)
        );
    }
}
