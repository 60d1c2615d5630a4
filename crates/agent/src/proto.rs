//! The ssh-agent protocol (draft-ietf-sshm-ssh-agent, published as RFC
//! 9987): a sans-IO codec of the messages `memveil agent` answers.
//!
//! A message is a `uint32` length and that many bytes: a type byte, then
//! fields in SSH's wire encoding. Requests longer than [`MAX_MESSAGE`] are
//! refused before they are read (the caller closes the connection). A
//! request carrying a private key (`SSH_AGENTC_ADD_IDENTITY`) is decoded
//! by borrowing from the caller's buffer, which the agent keeps in secret
//! memory: its key fields are turned into the vault's import format in
//! secret memory too ([`Request::AddIdentity`] holds them). Nothing here
//! panics on any input (proptest and the `agent_proto` fuzz target).
#![forbid(unsafe_code)]

use memveil_vault::keyfile::{KeyFileError, Ssh};
use memveil_vault::proto::KeyKind;

/// Longest message (OpenSSH's `AGENT_MAX_LEN`).
pub const MAX_MESSAGE: usize = 256 * 1024;

/// Message types.
pub mod msg {
    /// `SSH_AGENT_FAILURE`.
    pub const FAILURE: u8 = 5;
    /// `SSH_AGENT_SUCCESS`.
    pub const SUCCESS: u8 = 6;
    /// `SSH_AGENTC_REQUEST_IDENTITIES`.
    pub const REQUEST_IDENTITIES: u8 = 11;
    /// `SSH_AGENT_IDENTITIES_ANSWER`.
    pub const IDENTITIES_ANSWER: u8 = 12;
    /// `SSH_AGENTC_SIGN_REQUEST`.
    pub const SIGN_REQUEST: u8 = 13;
    /// `SSH_AGENT_SIGN_RESPONSE`.
    pub const SIGN_RESPONSE: u8 = 14;
    /// `SSH_AGENTC_ADD_IDENTITY`.
    pub const ADD_IDENTITY: u8 = 17;
    /// `SSH_AGENTC_REMOVE_IDENTITY`.
    pub const REMOVE_IDENTITY: u8 = 18;
    /// `SSH_AGENTC_REMOVE_ALL_IDENTITIES`.
    pub const REMOVE_ALL_IDENTITIES: u8 = 19;
    /// `SSH_AGENTC_LOCK`.
    pub const LOCK: u8 = 22;
    /// `SSH_AGENTC_UNLOCK`.
    pub const UNLOCK: u8 = 23;
    /// `SSH_AGENTC_ADD_ID_CONSTRAINED`.
    pub const ADD_ID_CONSTRAINED: u8 = 25;
    /// `SSH_AGENTC_EXTENSION`.
    pub const EXTENSION: u8 = 27;
}

/// Signature flags of `SSH_AGENTC_SIGN_REQUEST`.
pub mod flags {
    /// `SSH_AGENT_RSA_SHA2_256`.
    pub const RSA_SHA2_256: u32 = 2;
    /// `SSH_AGENT_RSA_SHA2_512`.
    pub const RSA_SHA2_512: u32 = 4;
}

/// Why a message did not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// Empty, truncated or with bytes left over.
    #[error("malformed agent message: {0}")]
    Malformed(&'static str),
    /// A key the vault does not hold, or a malformed key.
    #[error("{0}")]
    Key(#[from] KeyFileError),
    /// A message longer than [`MAX_MESSAGE`].
    #[error("agent message of {0} bytes (at most {MAX_MESSAGE})")]
    TooLong(usize),
}

/// A request.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Request<'a> {
    /// List the keys.
    RequestIdentities,
    /// Sign `data` with the key whose public blob is `key`.
    Sign {
        /// The key's public blob.
        key: &'a [u8],
        /// What to sign.
        data: &'a [u8],
        /// [`flags`].
        flags: u32,
    },
    /// Add a private key: its vault kind, its components (the vault's
    /// import format) written into the caller's buffer, their length, and
    /// its comment. `constrained`: the request carried constraints
    /// (lifetime, confirmation, destination), which this agent refuses.
    AddIdentity {
        /// The vault kind.
        kind: KeyKind,
        /// Bytes of components written into the caller's buffer.
        len: usize,
        /// The comment.
        comment: &'a [u8],
        /// Constraints were given.
        constrained: bool,
    },
    /// Remove the key with this public blob.
    RemoveIdentity {
        /// The blob.
        key: &'a [u8],
    },
    /// Remove every key.
    RemoveAll,
    /// Lock with a passphrase.
    Lock {
        /// The passphrase.
        passphrase: &'a [u8],
    },
    /// Unlock.
    Unlock {
        /// The passphrase.
        passphrase: &'a [u8],
    },
    /// An extension (`session-bind@openssh.com`, `query`…); answered with
    /// a failure (none is offered).
    Extension {
        /// Its name.
        name: &'a [u8],
    },
    /// Any other message type (answered with a failure).
    Other(u8),
}

/// The length of the message whose 4-byte header is `h`.
///
/// # Errors
/// [`AgentError::TooLong`] or an empty message.
pub fn frame_len(h: [u8; 4]) -> Result<usize, AgentError> {
    let n = usize::try_from(u32::from_be_bytes(h)).unwrap_or(usize::MAX);
    if n == 0 {
        return Err(AgentError::Malformed("empty message"));
    }
    if n > MAX_MESSAGE {
        return Err(AgentError::TooLong(n));
    }
    Ok(n)
}

fn end(r: &Ssh<'_>) -> Result<(), AgentError> {
    if r.rest().is_empty() {
        Ok(())
    } else {
        Err(AgentError::Malformed("trailing bytes"))
    }
}

/// Decodes a message body. An `ADD_IDENTITY` writes the key's components
/// into `components` (the caller's secret memory).
///
/// # Errors
/// [`AgentError`] for anything malformed or a key the vault cannot hold.
pub fn decode<'a>(body: &'a [u8], components: &mut [u8]) -> Result<Request<'a>, AgentError> {
    let mut r = Ssh::new(body);
    let t = r.u8().map_err(|_| AgentError::Malformed("empty message"))?;
    let req = match t {
        msg::REQUEST_IDENTITIES => Request::RequestIdentities,
        msg::SIGN_REQUEST => Request::Sign {
            key: r.string()?,
            data: r.string()?,
            flags: r.u32()?,
        },
        msg::ADD_IDENTITY | msg::ADD_ID_CONSTRAINED => {
            let keytype = r.string()?;
            let (kind, len) = memveil_vault::keyfile::ssh_private(keytype, &mut r, components)?;
            let comment = r.string()?;
            let constrained = t == msg::ADD_ID_CONSTRAINED && !r.rest().is_empty();
            if t == msg::ADD_ID_CONSTRAINED {
                // Constraints are not parsed: any makes the request refused.
                return Ok(Request::AddIdentity {
                    kind,
                    len,
                    comment,
                    constrained,
                });
            }
            Request::AddIdentity {
                kind,
                len,
                comment,
                constrained: false,
            }
        }
        msg::REMOVE_IDENTITY => Request::RemoveIdentity { key: r.string()? },
        msg::REMOVE_ALL_IDENTITIES => Request::RemoveAll,
        msg::LOCK => Request::Lock {
            passphrase: r.string()?,
        },
        msg::UNLOCK => Request::Unlock {
            passphrase: r.string()?,
        },
        msg::EXTENSION => {
            let name = r.string()?;
            // The extension's contents are its own; not parsed.
            return Ok(Request::Extension { name });
        }
        other => return Ok(Request::Other(other)),
    };
    end(&r)?;
    Ok(req)
}

fn put_string(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(b);
}

/// A framed message of type `t` with `body`.
#[must_use]
pub fn frame(t: u8, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + body.len());
    v.extend_from_slice(
        &u32::try_from(body.len() + 1)
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    v.push(t);
    v.extend_from_slice(body);
    v
}

/// `SSH_AGENT_IDENTITIES_ANSWER` for (blob, comment) pairs.
#[must_use]
pub fn identities(keys: &[(Vec<u8>, String)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&u32::try_from(keys.len()).unwrap_or(u32::MAX).to_be_bytes());
    for (blob, comment) in keys {
        put_string(&mut b, blob);
        put_string(&mut b, comment.as_bytes());
    }
    frame(msg::IDENTITIES_ANSWER, &b)
}

/// `SSH_AGENT_SIGN_RESPONSE` with a signature of algorithm `alg`.
#[must_use]
pub fn sign_response(alg: &str, sig: &[u8]) -> Vec<u8> {
    let mut inner = Vec::new();
    put_string(&mut inner, alg.as_bytes());
    put_string(&mut inner, sig);
    let mut b = Vec::new();
    put_string(&mut b, &inner);
    frame(msg::SIGN_RESPONSE, &b)
}

/// An ECDSA signature blob (RFC 5656 3.1.2): `mpint r`, `mpint s`.
#[must_use]
pub fn ecdsa_blob(r: &[u8], s: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    for x in [r, s] {
        let x = &x[x.iter().take_while(|b| **b == 0).count()..];
        let pad = x.first().is_some_and(|b| b & 0x80 != 0);
        v.extend_from_slice(
            &u32::try_from(x.len() + usize::from(pad))
                .unwrap_or(u32::MAX)
                .to_be_bytes(),
        );
        if pad {
            v.push(0);
        }
        v.extend_from_slice(x);
    }
    v
}

/// `SSH_AGENT_SUCCESS`.
#[must_use]
pub fn success() -> Vec<u8> {
    frame(msg::SUCCESS, &[])
}

/// `SSH_AGENT_FAILURE`.
#[must_use]
pub fn failure() -> Vec<u8> {
    frame(msg::FAILURE, &[])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(b: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        put_string(&mut v, b);
        v
    }

    #[test]
    fn requests_decode() {
        let mut c = [0u8; 4096];
        assert_eq!(decode(&[11], &mut c), Ok(Request::RequestIdentities));
        let mut sign = vec![13];
        sign.extend(s(b"blob"));
        sign.extend(s(b"data"));
        sign.extend(4u32.to_be_bytes());
        assert_eq!(
            decode(&sign, &mut c),
            Ok(Request::Sign {
                key: b"blob",
                data: b"data",
                flags: 4
            })
        );
        sign.push(0);
        assert!(decode(&sign, &mut c).is_err());
        // An Ed25519 identity: type, public key, 64-byte secret, comment.
        let mut add = vec![17];
        add.extend(s(b"ssh-ed25519"));
        add.extend(s(&[1; 32]));
        let mut sk = vec![9u8; 32];
        sk.extend([1; 32]);
        add.extend(s(&sk));
        add.extend(s(b"me@host"));
        match decode(&add, &mut c) {
            Ok(Request::AddIdentity {
                kind: KeyKind::Ed25519,
                len,
                comment,
                constrained: false,
            }) => {
                assert_eq!(comment, b"me@host");
                assert_eq!(&c[2..len], &[9u8; 32]);
            }
            o => panic!("{o:?}"),
        }
        let mut cons = add.clone();
        cons[0] = 25;
        cons.extend([1, 0, 0, 0, 60]);
        assert!(matches!(
            decode(&cons, &mut c),
            Ok(Request::AddIdentity {
                constrained: true,
                ..
            })
        ));
        let mut dsa = vec![17];
        dsa.extend(s(b"ssh-dss"));
        assert!(matches!(decode(&dsa, &mut c), Err(AgentError::Key(_))));
        assert_eq!(decode(&[99], &mut c), Ok(Request::Other(99)));
        assert!(frame_len([0, 0x10, 0, 1]).is_err());
        assert_eq!(frame_len([0, 0, 0, 5]), Ok(5));
    }

    #[test]
    fn answers_encode() {
        let a = identities(&[(b"k".to_vec(), "c".into())]);
        assert_eq!(
            a,
            vec![0, 0, 0, 15, 12, 0, 0, 0, 1, 0, 0, 0, 1, b'k', 0, 0, 0, 1, b'c']
        );
        assert_eq!(
            ecdsa_blob(&[0, 0x80], &[1]),
            vec![0, 0, 0, 2, 0, 0x80, 0, 0, 0, 1, 1]
        );
        assert_eq!(success(), vec![0, 0, 0, 1, 6]);
    }

    proptest! {
        #[test]
        fn arbitrary_messages_never_panic(b in proptest::collection::vec(any::<u8>(), 0..600), t in 0u8..30) {
            let mut c = [0u8; 4096];
            let mut m = vec![t];
            m.extend(&b);
            let _ = decode(&m, &mut c);
            let _ = decode(&b, &mut c);
        }
    }
}
