//! The agent: a Unix socket speaking the ssh-agent protocol, its keys the
//! vault keys of this uid whose names start with a prefix (`ssh.` by
//! default). A key added with `ssh-add` is read into secret memory, turned
//! into the vault's import format there, sent to the vault and wiped; every
//! signature is one vault request. The agent holds no private key.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use memveil_asym::{hash::digest, Hash, Public};
use memveil_secmem::{Policy, SecretPool};
use memveil_vault::keyfile;
use memveil_vault::keystore::KdfParams;
use memveil_vault::proto::{KeyKind, Mode, PublicParts};
use memveil_vault::ring::{AsymParams, Op};
use memveil_vault::Client;

use crate::lock::{LockError, Locker, MAX_LOCK};
use crate::proto::{self, flags, msg, Request};

/// Longest `SSH_AGENTC_ADD_IDENTITY` message read into secret memory (an
/// RSA-4096 key with a long comment is about 2.5 KiB).
pub const MAX_ADD: usize = 16 * 1024;

/// The agent's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// The agent's socket.
    pub socket: PathBuf,
    /// The vault's socket.
    pub vault: PathBuf,
    /// Which vault keys are the agent's: names starting with this.
    pub prefix: String,
    /// Keys added through the agent are sealed to the vault's keystore.
    pub persistent: bool,
    /// Weakest protection accepted for the receive buffer of added keys.
    pub policy: Policy,
    /// Also offer keys other uids granted to the agent's uid (by default
    /// only the uid's own keys: a grant needs no consent, so anyone could
    /// otherwise push keys into its `ssh-add -l` and logins).
    pub offer_granted: bool,
    /// Connections served at once; more are closed at once.
    pub max_connections: usize,
    /// The Argon2id cost of the lock passphrase's hash.
    pub lock_kdf: KdfParams,
}

impl Config {
    /// The defaults: prefix `ssh.`, keys not persistent, secret memory only,
    /// the uid's own keys only, 16 connections, [`crate::lock::KDF`].
    #[must_use]
    pub fn new(socket: PathBuf, vault: PathBuf) -> Self {
        Config {
            socket,
            vault,
            prefix: "ssh.".into(),
            persistent: false,
            policy: Policy::secret_only(),
            offer_granted: false,
            max_connections: 16,
            lock_kdf: crate::lock::KDF,
        }
    }
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentStartError {
    /// The socket could not be bound.
    #[error("agent socket {path}: {source} (does the directory exist, and is no other agent using the path?)")]
    Socket {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Something other than a stale socket sits at the socket's path.
    #[error("agent socket {path}: {what}; refusing to replace it (pick another --socket path, or remove it yourself)")]
    PathTaken {
        /// The path.
        path: PathBuf,
        /// What is there.
        what: String,
    },
    /// Secret memory for added keys could not be had.
    #[error("secret memory for added keys: {0}")]
    Secmem(#[from] memveil_secmem::SecmemError),
    /// The vault does not answer.
    #[error("{0}")]
    Vault(#[from] memveil_vault::client::ClientError),
}

struct Shared {
    cfg: Config,
    uid: u32,
    pool: SecretPool,
    lock: Mutex<Locker>,
    /// Held through each LOCK/UNLOCK and the delay a wrong guess owes, so
    /// guesses from parallel connections wait their turn.
    guess: Mutex<()>,
    conns: AtomicUsize,
}

/// A bound agent.
pub struct Agent {
    listener: UnixListener,
    shared: Arc<Shared>,
    /// The socket path's lock, held while the agent listens there.
    _socket_lock: memveil_sys::ipc::PathLock,
}

fn log(m: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "memveil-agent: {m}");
}

impl Agent {
    /// Binds the socket (mode 0600; a stale socket file is replaced), checks
    /// the vault answers, and reserves secret memory for added keys.
    ///
    /// # Errors
    /// [`AgentStartError`] naming the cause and the fix.
    pub fn bind(cfg: Config) -> Result<Agent, AgentStartError> {
        // Nothing of this process is for other processes of the same uid to
        // read (ssh-agent does the same).
        let _ = memveil_sys::process::set_dumpable(false);
        drop(Client::connect(&cfg.vault)?);
        let pool = SecretPool::new(4 * MAX_ADD, cfg.policy)?;
        let path = cfg.socket.clone();
        // Held from before the check for a live agent while it listens:
        // two agents started at once on a stale socket both found it stale,
        // and the second removed the socket the first had just bound. Only a
        // stale socket is replaced: `--socket ~/.ssh/id_ed25519` must not
        // delete the key.
        let (listener, socket_lock) =
            memveil_sys::ipc::bind_socket(&path, 0o600).map_err(|e| match e {
                memveil_sys::ipc::BindError::Io { what, source } => AgentStartError::Socket {
                    path: path.clone(),
                    source: std::io::Error::new(source.kind(), format!("{what}: {source}")),
                },
                what => AgentStartError::PathTaken {
                    path: path.clone(),
                    what: what.to_string(),
                },
            })?;
        let cfg_kdf = cfg.lock_kdf;
        Ok(Agent {
            listener,
            _socket_lock: socket_lock,
            shared: Arc::new(Shared {
                cfg,
                uid: memveil_sys::probe::euid(),
                pool,
                lock: Mutex::new(Locker::new(cfg_kdf)),
                guess: Mutex::new(()),
                conns: AtomicUsize::new(0),
            }),
        })
    }

    /// The socket path.
    #[must_use]
    pub fn socket(&self) -> &Path {
        &self.shared.cfg.socket
    }

    /// Serves connections until the process ends: only the agent's own uid
    /// (and root) may use it, as with ssh-agent.
    pub fn run(self) {
        for s in self.listener.incoming() {
            let Ok(s) = s else {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            let cred = memveil_sys::ipc::peer_cred(&s);
            match cred {
                Ok(c) if c.uid == self.shared.uid || c.uid == 0 => {}
                Ok(c) => {
                    log(format_args!(
                        "refused a connection from uid {} pid {} (the agent serves uid {})",
                        c.uid, c.pid, self.shared.uid
                    ));
                    continue;
                }
                Err(_) => continue,
            }
            let Some(slot) = Slot::take(&self.shared) else {
                log(format_args!(
                    "refused a connection: {} are open, the limit (--max-connections)",
                    self.shared.cfg.max_connections
                ));
                continue;
            };
            let sh = Arc::clone(&self.shared);
            let _ = std::thread::Builder::new()
                .name("memveil-agent".into())
                .spawn(move || {
                    Conn::new(sh).serve(s);
                    drop(slot);
                });
        }
    }
}

/// One of the agent's connection slots, given back on drop.
struct Slot(Arc<Shared>);

impl Slot {
    fn take(sh: &Arc<Shared>) -> Option<Slot> {
        let max = sh.cfg.max_connections;
        sh.conns
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(Arc::clone(sh)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.conns.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One key the agent offers.
#[derive(Clone)]
struct Key {
    name: String,
    id: u32,
    public: Public,
    blob: Vec<u8>,
}

struct Conn {
    sh: Arc<Shared>,
    vault: Option<Client>,
    cache: HashMap<u32, Key>,
}

impl Conn {
    fn new(sh: Arc<Shared>) -> Self {
        Conn {
            sh,
            vault: None,
            cache: HashMap::new(),
        }
    }

    fn serve(mut self, mut s: UnixStream) {
        loop {
            let mut h = [0u8; 4];
            if s.read_exact(&mut h).is_err() {
                return;
            }
            let Ok(n) = proto::frame_len(h) else {
                return;
            };
            let mut t = [0u8; 1];
            if s.read_exact(&mut t).is_err() {
                return;
            }
            // A passphrase or a private key: received straight into secret
            // memory (at most `max` bytes, with `comp_len` for the key's
            // components); anything else into a Vec.
            let secret = match t[0] {
                msg::LOCK | msg::UNLOCK => Some((MAX_LOCK, 0)),
                msg::ADD_IDENTITY | msg::ADD_ID_CONSTRAINED => {
                    Some((MAX_ADD, memveil_asym::components::MAX_LEN))
                }
                _ => None,
            };
            let reply = if let Some((max, comp_len)) = secret {
                if n > max {
                    return;
                }
                let Ok(mut body) = self.sh.pool.alloc_bytes(n) else {
                    return;
                };
                body[0] = t[0];
                if s.read_exact(&mut body[1..]).is_err() {
                    return;
                }
                let Ok(mut comp) = self.sh.pool.alloc_bytes(comp_len) else {
                    return;
                };
                self.handle(&body, &mut comp)
            } else {
                let mut body = vec![0u8; n];
                body[0] = t[0];
                if s.read_exact(&mut body[1..]).is_err() {
                    return;
                }
                self.handle(&body, &mut [])
            };
            if s.write_all(&reply).is_err() {
                return;
            }
        }
    }

    fn vault(&mut self) -> Option<&mut Client> {
        if self.vault.is_none() {
            match Client::connect(&self.sh.cfg.vault) {
                Ok(c) => self.vault = Some(c),
                Err(e) => {
                    log(format_args!("{e}"));
                    return None;
                }
            }
        }
        self.vault.as_mut()
    }

    fn locked(&self) -> bool {
        self.sh
            .lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_locked()
    }

    /// The agent's keys, their public halves cached by vault id.
    fn keys(&mut self) -> Option<Vec<Key>> {
        let prefix = self.sh.cfg.prefix.clone();
        let (uid, granted) = (self.sh.uid, self.sh.cfg.offer_granted);
        let list = self.vault()?.list_keys().ok()?;
        let mut out = Vec::new();
        for k in list {
            if k.kind.asym().is_none()
                || !k.name.starts_with(&prefix)
                || !(k.owner == uid || granted)
            {
                continue;
            }
            if let Some(c) = self.cache.get(&k.id).filter(|c| c.name == k.name) {
                out.push(c.clone());
                continue;
            }
            let Ok(PublicParts::Key(public)) = self.vault()?.public_key(&k.name) else {
                continue;
            };
            let key = Key {
                name: k.name.clone(),
                id: k.id,
                blob: keyfile::ssh_blob(&public),
                public,
            };
            self.cache.insert(k.id, key.clone());
            out.push(key);
        }
        Some(out)
    }

    fn find(&mut self, blob: &[u8]) -> Option<Key> {
        self.keys()?.into_iter().find(|k| k.blob == blob)
    }

    fn handle(&mut self, body: &[u8], comp: &mut [u8]) -> Vec<u8> {
        let req = match proto::decode(body, comp) {
            Ok(r) => r,
            Err(e) => {
                log(format_args!("{e}"));
                return proto::failure();
            }
        };
        let locked = self.locked();
        match req {
            Request::RequestIdentities if locked => proto::identities(&[]),
            Request::RequestIdentities => match self.keys() {
                Some(ks) => {
                    let p = &self.sh.cfg.prefix;
                    let list: Vec<(Vec<u8>, String)> = ks
                        .into_iter()
                        .map(|k| (k.blob, k.name[p.len()..].to_owned()))
                        .collect();
                    proto::identities(&list)
                }
                None => proto::failure(),
            },
            Request::Sign { key, data, flags } if !locked => {
                self.sign(key, data, flags).unwrap_or_else(proto::failure)
            }
            Request::AddIdentity {
                kind,
                len,
                comment,
                constrained,
            } if !locked => {
                if constrained {
                    log(format_args!(
                        "refused a key with constraints (lifetime, confirmation, destination): this agent keeps keys in the vault without them"
                    ));
                    return proto::failure();
                }
                self.add(kind, &comp[..len], comment)
            }
            Request::RemoveIdentity { key } if !locked => match self.find(key) {
                Some(k) if self.vault().is_some_and(|c| c.destroy_key(&k.name).is_ok()) => {
                    proto::success()
                }
                _ => proto::failure(),
            },
            Request::RemoveAll if !locked => {
                let uid = self.sh.uid;
                let mine: Vec<String> = match self.vault().and_then(|c| c.list_keys().ok()) {
                    Some(l) => l
                        .into_iter()
                        .filter(|k| {
                            k.owner == uid
                                && k.kind.asym().is_some()
                                && k.name.starts_with(&self.sh.cfg.prefix)
                        })
                        .map(|k| k.name)
                        .collect(),
                    None => return proto::failure(),
                };
                for n in mine {
                    if let Some(c) = self.vault() {
                        let _ = c.destroy_key(&n);
                    }
                }
                proto::success()
            }
            Request::Lock { passphrase } => self.lock_op(true, passphrase),
            Request::Unlock { passphrase } => self.lock_op(false, passphrase),
            _ => proto::failure(),
        }
    }

    /// LOCK and UNLOCK, one at a time across all connections; a wrong
    /// passphrase holds the others back for the delay it owes.
    fn lock_op(&mut self, lock: bool, pass: &[u8]) -> Vec<u8> {
        let _turn = self.sh.guess.lock().unwrap_or_else(PoisonError::into_inner);
        let r = {
            let mut l = self.sh.lock.lock().unwrap_or_else(PoisonError::into_inner);
            if lock {
                l.lock(&self.sh.pool, pass)
            } else {
                l.unlock(&self.sh.pool, pass)
            }
        };
        match r {
            Ok(()) => proto::success(),
            Err(LockError::Wrong { failures, delay }) => {
                log(format_args!(
                    "unlock: wrong passphrase ({failures} in a row; the next answer waits {} ms)",
                    delay.as_millis()
                ));
                std::thread::sleep(delay);
                proto::failure()
            }
            Err(e) => {
                log(format_args!(
                    "{}: {e}",
                    if lock { "lock" } else { "unlock" }
                ));
                proto::failure()
            }
        }
    }

    /// A vault name for a new key from its comment: the prefix, then the
    /// comment with characters outside `[A-Za-z0-9._-]` as `_`, made unique.
    fn new_name(&mut self, comment: &[u8]) -> Option<String> {
        let base: String = String::from_utf8_lossy(comment)
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let base = if base.is_empty() { "key".into() } else { base };
        let room = memveil_vault::proto::MAX_NAME - self.sh.cfg.prefix.len() - 4;
        let base: String = base.chars().take(room).collect();
        let taken: Vec<String> = self
            .vault()?
            .list_keys()
            .ok()?
            .into_iter()
            .map(|k| k.name)
            .collect();
        let p = &self.sh.cfg.prefix;
        (1..1000)
            .map(|i| {
                if i == 1 {
                    format!("{p}{base}")
                } else {
                    format!("{p}{base}-{i}")
                }
            })
            .find(|n| !taken.contains(n))
    }

    fn add(&mut self, kind: KeyKind, components: &[u8], comment: &[u8]) -> Vec<u8> {
        let Some(name) = self.new_name(comment) else {
            return proto::failure();
        };
        let persistent = self.sh.cfg.persistent;
        let Some(c) = self.vault() else {
            return proto::failure();
        };
        match c.import_key(&name, kind, persistent, components) {
            Ok(k) => {
                log(format_args!("added {name} ({}) to the vault", k.kind));
                proto::success()
            }
            Err(e) => {
                log(format_args!("adding {name}: {e}"));
                proto::failure()
            }
        }
    }

    fn sign(&mut self, blob: &[u8], data: &[u8], fl: u32) -> Option<Vec<u8>> {
        let k = self.find(blob)?;
        let none = AsymParams::default();
        let (alg, mode, input): (&str, Mode, Vec<u8>) = match &k.public {
            Public::Rsa { .. } => {
                let (alg, h) = if fl & flags::RSA_SHA2_512 != 0 {
                    ("rsa-sha2-512", Hash::Sha512)
                } else if fl & flags::RSA_SHA2_256 != 0 {
                    ("rsa-sha2-256", Hash::Sha256)
                } else {
                    ("ssh-rsa", Hash::Sha1)
                };
                let mut di = h.digest_info_prefix().to_vec();
                di.extend(digest(h, data));
                (alg, Mode::RsaPkcs1, di)
            }
            Public::Ec { curve, .. } => {
                let h = match curve {
                    memveil_asym::Curve::P256 => Hash::Sha256,
                    memveil_asym::Curve::P384 => Hash::Sha384,
                };
                (keyfile::ssh_type(&k.public), Mode::Ecdsa, digest(h, data))
            }
            Public::Ed25519(_) => ("ssh-ed25519", Mode::EdDsa, data.to_vec()),
        };
        let sig = match self
            .vault()?
            .private_op(Op::Encrypt, k.id, mode, none, &input)
        {
            Ok(s) => s,
            Err(e) => {
                log(format_args!("signing with {}: {e}", k.name));
                return None;
            }
        };
        let blob = if mode == Mode::Ecdsa {
            let (r, s) = sig.split_at(sig.len() / 2);
            proto::ecdsa_blob(r, s)
        } else {
            sig
        };
        Some(proto::sign_response(alg, &blob))
    }
}
