//! The token: one slot over the vault this process can reach, its
//! sessions, its objects (vault keys) and the operations in progress.
//! Safe Rust only; the C entry points (`ffi`) copy or borrow what the
//! caller passed and call in here.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use cryptoki_sys::*;
use memveil_vault::client::{ClientError, LaneClient, Session as Shared};
use memveil_vault::proto::{perm, ErrorCode, KeyInfo, KeyKind, Mode, PublicParts};
use memveil_vault::ring::{status, AsymParams, Entry, Op};
use memveil_vault::Client;
use zeroize::Zeroizing;

use crate::asym::{AsymBackend, AsymDecrypt, AsymSign, Ecdh, Import, PairTemplate};
use crate::digest::DigestOp;
use crate::hmac::HmacOp;
use crate::mech::{Backend, CryptOp, Failure, MacOp, Req, Rv};
use crate::object::{cap, CERT_PREFIX, SESSION_PREFIX};
pub use crate::object::{parse_name, token_name, Attr, Obj};
use crate::public::{AsymEncrypt, AsymVerify};

/// The one slot's id.
pub const SLOT: CK_SLOT_ID = 0;
/// Lanes (vault worker threads) one process uses at most, by default.
const DEFAULT_LANES: usize = 8;
/// Bytes of a lane's shared data buffer at first (grown on demand).
const LANE_BYTES: usize = 1 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where the vault listens: `$MEMVEIL_VAULT_SOCKET`, else the default.
#[must_use]
pub fn socket_path() -> PathBuf {
    std::env::var_os("MEMVEIL_VAULT_SOCKET")
        .map_or_else(|| PathBuf::from("/run/memveil/vault.sock"), PathBuf::from)
}

fn client_rv(e: &ClientError) -> Rv {
    match e {
        ClientError::Refused { code, .. } => match code {
            ErrorCode::NotFound => CKR_OBJECT_HANDLE_INVALID,
            ErrorCode::Denied => CKR_ACTION_PROHIBITED,
            ErrorCode::Quota => CKR_DEVICE_MEMORY,
            ErrorCode::Exists => CKR_ATTRIBUTE_VALUE_INVALID,
            _ => CKR_DEVICE_ERROR,
        },
        ClientError::Usage(_) => CKR_ARGUMENTS_BAD,
        _ => CKR_DEVICE_ERROR,
    }
}

/// A decryption in progress.
#[derive(Clone)]
pub enum DecOp {
    /// With an AES key.
    Aes(CryptOp),
    /// With an RSA key.
    Rsa(AsymDecrypt),
}

/// An encryption in progress.
#[derive(Clone)]
pub enum EncOp {
    /// With an AES key (in the vault).
    Aes(CryptOp),
    /// With an RSA public key (here).
    Rsa(AsymEncrypt),
}

/// A signature in progress.
#[derive(Clone)]
pub enum SignOp {
    /// `CKM_AES_CMAC`.
    Cmac(MacOp),
    /// `CKM_SHA*_HMAC`.
    Hmac(HmacOp),
    /// With an asymmetric key.
    Asym(AsymSign),
}

/// A verification in progress.
#[derive(Clone)]
pub enum VerifyOp {
    /// `CKM_AES_CMAC` (in the vault).
    Cmac(MacOp),
    /// `CKM_SHA*_HMAC` (in the vault).
    Hmac(HmacOp),
    /// With a public key (here).
    Asym(AsymVerify),
}

/// One session's state.
#[derive(Default)]
pub struct Sess {
    /// Opened with `CKF_RW_SESSION`.
    pub rw: bool,
    /// Encryption in progress.
    pub enc: Option<EncOp>,
    /// Decryption in progress.
    pub dec: Option<DecOp>,
    /// Signature in progress.
    pub sign: Option<SignOp>,
    /// Verification in progress.
    pub verify: Option<VerifyOp>,
    /// Verification with recovery in progress.
    pub recover: Option<AsymVerify>,
    /// Digest in progress.
    pub digest: Option<DigestOp>,
    /// Handles a search has still to return.
    pub find: Option<Vec<CK_OBJECT_HANDLE>>,
}

struct Lane {
    shared: Shared,
    lane: LaneClient,
}

/// The vault connection: the control socket and a pool of lanes, each used
/// by one thread at a time.
struct Vault {
    ctl: Client,
}

/// The module's state between `C_Initialize` and `C_Finalize`.
pub struct Module {
    socket: PathBuf,
    vault: Mutex<Option<Vault>>,
    lanes: Mutex<(Vec<Lane>, usize)>,
    lane_free: Condvar,
    max_lanes: usize,
    sessions: Mutex<HashMap<CK_SESSION_HANDLE, Arc<Mutex<Sess>>>>,
    objects: Mutex<HashMap<CK_OBJECT_HANDLE, Obj>>,
    /// Public keys built for verification and encryption, by object.
    pubkeys: Mutex<HashMap<CK_OBJECT_HANDLE, Arc<memveil_asym::PublicKey>>>,
    /// Public key objects of token pairs destroyed in this process (vault
    /// key ids): the private half stays, so a refresh must not bring them
    /// back.
    hidden: Mutex<std::collections::HashSet<u32>>,
    next: AtomicU64,
    logged_in: AtomicBool,
    rng: Mutex<Option<memveil_drng::Stream>>,
    uid: AtomicU64,
    pid: u32,
}

impl Module {
    /// State for the vault at [`socket_path`]; connects lazily, so the
    /// module loads (and says "token not present") while the vault is down.
    #[must_use]
    pub fn new() -> Self {
        let max_lanes = std::env::var("MEMVEIL_PKCS11_LANES")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| (1..=64).contains(n))
            .unwrap_or(DEFAULT_LANES);
        let m = Self {
            socket: socket_path(),
            vault: Mutex::new(None),
            lanes: Mutex::new((Vec::new(), 0)),
            lane_free: Condvar::new(),
            max_lanes,
            sessions: Mutex::new(HashMap::new()),
            objects: Mutex::new(HashMap::new()),
            pubkeys: Mutex::new(HashMap::new()),
            hidden: Mutex::new(std::collections::HashSet::new()),
            next: AtomicU64::new(1),
            logged_in: AtomicBool::new(false),
            rng: Mutex::new(None),
            uid: AtomicU64::new(u64::MAX),
            pid: std::process::id(),
        };
        let _ = m.with_vault(|_| Ok(()));
        m
    }

    /// The process that initialised the module.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The socket this module uses.
    #[must_use]
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    fn handle(&self) -> CK_ULONG {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs `f` on the control connection, connecting first if needed; a
    /// connection that failed is dropped so the next call reconnects.
    fn with_vault<R>(&self, f: impl FnOnce(&mut Client) -> Result<R, Rv>) -> Result<R, Rv> {
        let mut g = lock(&self.vault);
        if g.is_none() {
            let ctl = Client::connect(&self.socket).map_err(|_| CKR_TOKEN_NOT_PRESENT)?;
            self.uid.store(u64::from(ctl.uid()), Ordering::Relaxed);
            *g = Some(Vault { ctl });
            // Lanes of an earlier connection belong to a vault that is gone.
            lock(&self.lanes).0.clear();
        }
        let v = g.as_mut().ok_or(CKR_TOKEN_NOT_PRESENT)?;
        f(&mut v.ctl)
    }

    fn forget_vault(&self) {
        *lock(&self.vault) = None;
        let mut l = lock(&self.lanes);
        l.0.clear();
        l.1 = 0;
    }

    /// Whether the vault answers (the token is present).
    pub fn present(&self) -> bool {
        self.with_vault(|c| c.status().map(|_| ()).map_err(|_| CKR_DEVICE_ERROR))
            .map_err(|_| self.forget_vault())
            .is_ok()
    }

    /// The vault's protection level, for the token's model field.
    pub fn level(&self) -> Option<String> {
        self.with_vault(|c| Ok(c.level().to_owned())).ok()
    }

    fn uid(&self) -> u32 {
        u32::try_from(self.uid.load(Ordering::Relaxed)).unwrap_or(u32::MAX)
    }

    fn take_lane(&self, need: usize) -> Result<Lane, Rv> {
        let mut g = lock(&self.lanes);
        loop {
            if let Some(i) = g.0.iter().position(|l| l.shared.len() >= need) {
                return Ok(g.0.swap_remove(i));
            }
            if g.1 < self.max_lanes || !g.0.is_empty() {
                // Room for one more, or a free lane too small: replace it.
                if !g.0.is_empty() {
                    g.0.pop();
                } else {
                    g.1 += 1;
                }
                drop(g);
                let size = need.max(LANE_BYTES).next_power_of_two();
                let made = self.with_vault(|c| c.session(size, 1).map_err(|e| client_rv(&e)));
                return match made {
                    Ok((shared, mut lanes)) => match lanes.pop() {
                        Some(lane) => Ok(Lane { shared, lane }),
                        None => Err(self.lane_lost()),
                    },
                    Err(rv) => Err(self.lane_failed(rv)),
                };
            }
            g = self
                .lane_free
                .wait(g)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn lane_failed(&self, rv: Rv) -> Rv {
        let mut g = lock(&self.lanes);
        g.1 = g.1.saturating_sub(1);
        self.lane_free.notify_one();
        rv
    }

    fn lane_lost(&self) -> Rv {
        self.lane_failed(CKR_DEVICE_ERROR)
    }

    fn give_lane(&self, l: Lane) {
        lock(&self.lanes).0.push(l);
        self.lane_free.notify_one();
    }

    // ---- sessions ----

    /// Opens a session.
    ///
    /// # Errors
    /// `CKR_TOKEN_NOT_PRESENT` when the vault cannot be reached.
    pub fn open_session(&self, rw: bool) -> Result<CK_SESSION_HANDLE, Rv> {
        self.with_vault(|_| Ok(()))?;
        let h = self.handle();
        let s = Sess {
            rw,
            ..Sess::default()
        };
        lock(&self.sessions).insert(h, Arc::new(Mutex::new(s)));
        Ok(h)
    }

    /// The session `h`.
    ///
    /// # Errors
    /// `CKR_SESSION_HANDLE_INVALID`.
    pub fn session(&self, h: CK_SESSION_HANDLE) -> Result<Arc<Mutex<Sess>>, Rv> {
        lock(&self.sessions)
            .get(&h)
            .cloned()
            .ok_or(CKR_SESSION_HANDLE_INVALID)
    }

    /// Closes a session and destroys its session objects.
    ///
    /// # Errors
    /// `CKR_SESSION_HANDLE_INVALID`.
    pub fn close_session(&self, h: CK_SESSION_HANDLE) -> Result<(), Rv> {
        lock(&self.sessions)
            .remove(&h)
            .ok_or(CKR_SESSION_HANDLE_INVALID)?;
        let mine: Vec<(CK_OBJECT_HANDLE, String)> = lock(&self.objects)
            .iter()
            .filter(|(_, o)| !o.token && o.session == h)
            .map(|(k, o)| (*k, o.name.clone()))
            .collect();
        let mut gone = std::collections::BTreeSet::new();
        for (k, name) in mine {
            lock(&self.objects).remove(&k);
            lock(&self.pubkeys).remove(&k);
            // A key pair is two objects over one vault key; an imported
            // public key has none.
            if !name.is_empty() && gone.insert(name.clone()) {
                let _ = self.with_vault(|c| c.destroy_key(&name).map_err(|e| client_rv(&e)));
            }
        }
        if lock(&self.sessions).is_empty() {
            self.logged_in.store(false, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Closes every session.
    pub fn close_all(&self) {
        let all: Vec<CK_SESSION_HANDLE> = lock(&self.sessions).keys().copied().collect();
        for h in all {
            let _ = self.close_session(h);
        }
    }

    /// Sessions open (all read/write or read-only).
    pub fn session_count(&self) -> (usize, usize) {
        let s = lock(&self.sessions);
        let rw = s.values().filter(|x| lock(x).rw).count();
        (s.len(), rw)
    }

    /// Whether `C_Login` has been called.
    pub fn logged_in(&self) -> bool {
        self.logged_in.load(Ordering::Relaxed)
    }

    /// `C_Login`: the PIN is optional and not checked (the vault's
    /// `SO_PEERCRED` uid decides what this process may use).
    ///
    /// # Errors
    /// `CKR_USER_ALREADY_LOGGED_IN`.
    pub fn login(&self) -> Result<(), Rv> {
        if self.logged_in.swap(true, Ordering::Relaxed) {
            Err(CKR_USER_ALREADY_LOGGED_IN)
        } else {
            Ok(())
        }
    }

    /// `C_Logout`.
    ///
    /// # Errors
    /// `CKR_USER_NOT_LOGGED_IN`.
    pub fn logout(&self) -> Result<(), Rv> {
        if self.logged_in.swap(false, Ordering::Relaxed) {
            Ok(())
        } else {
            Err(CKR_USER_NOT_LOGGED_IN)
        }
    }

    // ---- objects ----

    /// What this uid may do with an object of `class` over vault key `k`:
    /// an AES key encrypts and signs (CMAC) with `e`, decrypts and verifies
    /// with `d`; a generic secret signs (HMAC) with `e` and verifies with
    /// `d`; a private key signs with `e`, decrypts (RSA) and derives (EC)
    /// with `d`; a public key verifies (and encrypts, RSA) in this process,
    /// whatever the vault's ACL; certificates do nothing.
    fn caps_of(&self, k: &KeyInfo, class: CK_OBJECT_CLASS) -> [bool; 5] {
        let uid = self.uid();
        let bits = if k.owner == uid {
            perm::ALL
        } else {
            k.acl.iter().find(|(u, _)| *u == uid).map_or(0, |(_, p)| *p)
        };
        let e = bits & perm::ENCRYPT != 0;
        let d = bits & perm::DECRYPT != 0;
        let ty = crate::object::key_type(k.kind);
        match class {
            CKO_SECRET_KEY if k.kind == KeyKind::Secret => [false, false, e, d, false],
            CKO_SECRET_KEY => [e, d, e, d, false],
            CKO_PUBLIC_KEY => [ty == CKK_RSA, false, false, true, false],
            CKO_PRIVATE_KEY => {
                let rsa = crate::object::key_type(k.kind) == CKK_RSA;
                let ec = crate::object::key_type(k.kind) == CKK_EC;
                [false, d && rsa, e, false, d && ec]
            }
            _ => [false; 5],
        }
    }

    /// The classes a vault kind shows as.
    fn classes(kind: KeyKind) -> &'static [CK_OBJECT_CLASS] {
        match kind {
            KeyKind::Aes128 | KeyKind::Aes256 | KeyKind::Secret => &[CKO_SECRET_KEY],
            KeyKind::Xts128 | KeyKind::Xts256 => &[],
            KeyKind::Cert => &[CKO_CERTIFICATE],
            KeyKind::Data => &[CKO_DATA],
            _ => &[CKO_PRIVATE_KEY, CKO_PUBLIC_KEY],
        }
    }

    /// Re-reads the keys this uid may see from the vault: token objects
    /// appear and disappear; session objects stay as this process made them.
    ///
    /// # Errors
    /// The vault cannot be reached.
    pub fn refresh(&self) -> Result<(), Rv> {
        let keys = self.with_vault(|c| c.list_keys().map_err(|e| client_rv(&e)))?;
        let mut seen = Vec::new();
        for k in keys {
            if k.name.starts_with(SESSION_PREFIX) {
                continue;
            }
            for &class in Self::classes(k.kind) {
                if class == CKO_PUBLIC_KEY && lock(&self.hidden).contains(&k.id) {
                    continue;
                }
                seen.push((k.id, class));
                let known = {
                    let mut objs = lock(&self.objects);
                    match objs
                        .values_mut()
                        .find(|o| o.vault_id == k.id && o.class == class)
                    {
                        Some(o) => {
                            o.caps = self.caps_of(&k, class);
                            true
                        }
                        None => false,
                    }
                };
                if known {
                    continue;
                }
                let public = self.public_of(&k)?;
                let (mut label, mut id) = parse_name(&k.name, k.kind);
                if let Some(PublicParts::Data(b)) = public.as_deref() {
                    (label, id) = (
                        crate::data::Data::decode(b).unwrap_or_default().label,
                        Vec::new(),
                    );
                }
                if id.is_empty() {
                    id = public
                        .as_deref()
                        .map(crate::object::default_id)
                        .unwrap_or_default();
                }
                let o = Obj {
                    vault_id: k.id,
                    name: k.name.clone(),
                    kind: k.kind,
                    class,
                    label,
                    id,
                    token: true,
                    session: 0,
                    local: false,
                    caps: self.caps_of(&k, class),
                    public,
                };
                lock(&self.objects).insert(self.handle(), o);
            }
        }
        lock(&self.objects).retain(|_, o| !o.token || seen.contains(&(o.vault_id, o.class)));
        Ok(())
    }

    /// The public half (or certificate) of vault key `k`, if it has one.
    fn public_of(&self, k: &KeyInfo) -> Result<Option<Arc<PublicParts>>, Rv> {
        if k.kind.is_symmetric() {
            return Ok(None);
        }
        let p = self.with_vault(|c| c.public_key(&k.name).map_err(|e| client_rv(&e)))?;
        Ok(Some(Arc::new(p)))
    }

    /// The object `h`.
    ///
    /// # Errors
    /// `CKR_OBJECT_HANDLE_INVALID`.
    pub fn object(&self, h: CK_OBJECT_HANDLE) -> Result<Obj, Rv> {
        lock(&self.objects)
            .get(&h)
            .cloned()
            .ok_or(CKR_OBJECT_HANDLE_INVALID)
    }

    /// The public key of object `h` (a public key object with `cap`), built
    /// once and kept for the object's life.
    ///
    /// # Errors
    /// As [`Module::key`]; `CKR_KEY_TYPE_INCONSISTENT` for an object
    /// without a public half.
    pub fn public_key(
        &self,
        h: CK_OBJECT_HANDLE,
        cap: usize,
    ) -> Result<(Obj, Arc<memveil_asym::PublicKey>), Rv> {
        let o = self.key(h, cap)?;
        if let Some(k) = lock(&self.pubkeys).get(&h) {
            return Ok((o, k.clone()));
        }
        let Some(PublicParts::Key(p)) = o.public.as_deref() else {
            return Err(CKR_KEY_TYPE_INCONSISTENT);
        };
        let k = Arc::new(memveil_asym::PublicKey::new(p).map_err(|_| CKR_KEY_HANDLE_INVALID)?);
        lock(&self.pubkeys).insert(h, k.clone());
        Ok((o, k))
    }

    /// A key for an operation: `CKR_KEY_HANDLE_INVALID` instead of the
    /// object error, and `CKR_KEY_FUNCTION_NOT_PERMITTED` without `cap`.
    ///
    /// # Errors
    /// As above.
    pub fn key(&self, h: CK_OBJECT_HANDLE, cap: usize) -> Result<Obj, Rv> {
        let o = self.object(h).map_err(|_| CKR_KEY_HANDLE_INVALID)?;
        if o.caps.get(cap).copied().unwrap_or(false) {
            Ok(o)
        } else {
            Err(CKR_KEY_FUNCTION_NOT_PERMITTED)
        }
    }

    /// Handles of objects matching `template` (type, value bytes).
    ///
    /// # Errors
    /// The vault cannot be reached.
    pub fn find(
        &self,
        template: &[(CK_ATTRIBUTE_TYPE, &[u8])],
    ) -> Result<Vec<CK_OBJECT_HANDLE>, Rv> {
        self.refresh()?;
        let objs = lock(&self.objects);
        let mut v: Vec<CK_OBJECT_HANDLE> = objs
            .iter()
            .filter(|(_, o)| {
                template
                    .iter()
                    .all(|(t, want)| o.attr(*t) == Attr::Value(want.to_vec()))
            })
            .map(|(h, _)| *h)
            .collect();
        v.sort_unstable();
        Ok(v)
    }

    /// The vault name for a new object: `LABEL..ID` (certificates:
    /// `crt.LABEL..ID`), `p11-<random>` for a token object without either,
    /// `p11s.<pid>.<n>` for a session object.
    fn new_name(&self, token: bool, label: &[u8], id: &[u8], kind: KeyKind) -> Result<String, Rv> {
        if !token {
            return Ok(format!(
                "{SESSION_PREFIX}{}.{}",
                std::process::id(),
                self.next.fetch_add(1, Ordering::Relaxed)
            ));
        }
        let name = if label.is_empty() && id.is_empty() {
            let mut r = [0u8; 4];
            self.random(&mut r)?;
            format!(
                "p11-{}",
                r.iter().map(|b| format!("{b:02x}")).collect::<String>()
            )
        } else {
            token_name(label, id)?
        };
        if kind == KeyKind::Cert {
            let n = format!("{CERT_PREFIX}{name}");
            return if memveil_vault::proto::valid_name(&n) {
                Ok(n)
            } else {
                Err(CKR_ATTRIBUTE_VALUE_INVALID)
            };
        }
        Ok(name)
    }

    /// Makes a vault key for a new object of `session`: generated when
    /// `value` is `None`, imported otherwise (the bytes go from the caller's
    /// buffer to the socket). Token objects are sealed to disk when the
    /// vault has a keystore (`--state`), and live as long as the vault
    /// otherwise.
    #[allow(clippy::too_many_arguments)]
    fn vault_key(
        &self,
        session: CK_SESSION_HANDLE,
        token: bool,
        label: &[u8],
        id: &[u8],
        kind: KeyKind,
        value: Option<&[u8]>,
        len: usize,
    ) -> Result<KeyInfo, Rv> {
        let s = self.session(session)?;
        if token && !lock(&s).rw {
            return Err(CKR_SESSION_READ_ONLY);
        }
        let name = self.new_name(token, label, id, kind)?;
        self.with_vault(|c| {
            let make = |c: &mut Client, persistent: bool| match value {
                None if kind == KeyKind::Secret => c.create_secret(&name, len, persistent),
                None => c.create_key(&name, kind, persistent),
                Some(v) => c.import_key(&name, kind, persistent, v),
            };
            match make(c, token) {
                Err(ClientError::Refused {
                    code: ErrorCode::NotDurable,
                    ..
                }) => make(c, false),
                r => r,
            }
            .map_err(|e| client_rv(&e))
        })
    }

    /// Adds the objects of a new vault key; returns their handles in the
    /// order of [`Module::classes`].
    #[allow(clippy::too_many_arguments)]
    fn add_objects(
        &self,
        session: CK_SESSION_HANDLE,
        info: &KeyInfo,
        token: bool,
        label: &[u8],
        id: &[u8],
        local: bool,
        want: [bool; 5],
    ) -> Result<Vec<CK_OBJECT_HANDLE>, Rv> {
        let public = self.public_of(info)?;
        let (label, mut id) = if token {
            parse_name(&info.name, info.kind)
        } else {
            (label.to_vec(), id.to_vec())
        };
        if id.is_empty() {
            id = public
                .as_deref()
                .map(crate::object::default_id)
                .unwrap_or_default();
        }
        let mut handles = Vec::new();
        for &class in Self::classes(info.kind) {
            let mut caps = self.caps_of(info, class);
            for (c, w) in caps.iter_mut().zip(want) {
                *c &= w;
            }
            let o = Obj {
                vault_id: info.id,
                name: info.name.clone(),
                kind: info.kind,
                class,
                label: label.clone(),
                id: id.clone(),
                token,
                session: if token { 0 } else { session },
                local,
                caps,
                public: public.clone(),
            };
            let h = self.handle();
            lock(&self.objects).insert(h, o);
            handles.push(h);
        }
        Ok(handles)
    }

    /// Creates an AES key in the vault: generated when `value` is `None`,
    /// imported from the caller's bytes otherwise (passed straight to the
    /// socket, never copied here).
    ///
    /// # Errors
    /// A template the vault cannot honour, or the vault's refusal.
    pub fn create(
        &self,
        session: CK_SESSION_HANDLE,
        t: &Template<'_>,
        value: Option<&[u8]>,
    ) -> Result<CK_OBJECT_HANDLE, Rv> {
        let kind = match (t.generic, t.key_len) {
            (true, _) => KeyKind::Secret,
            (_, 16) => KeyKind::Aes128,
            (_, 32) => KeyKind::Aes256,
            _ => return Err(CKR_ATTRIBUTE_VALUE_INVALID),
        };
        let info = self.vault_key(session, t.token, t.label, t.id, kind, value, t.key_len)?;
        let want = [t.caps[0], t.caps[1], t.caps[2], t.caps[3], false];
        let h = self.add_objects(
            session,
            &info,
            t.token,
            t.label,
            t.id,
            value.is_none(),
            want,
        )?;
        h.first().copied().ok_or(CKR_GENERAL_ERROR)
    }

    /// Generates a key pair inside the vault; returns the public and the
    /// private key's handles.
    ///
    /// # Errors
    /// The vault's refusal (name taken, quota) or a read-only session.
    pub fn generate_pair(
        &self,
        session: CK_SESSION_HANDLE,
        t: &PairTemplate<'_>,
    ) -> Result<(CK_OBJECT_HANDLE, CK_OBJECT_HANDLE), Rv> {
        let kind = t.kind.ok_or(CKR_TEMPLATE_INCOMPLETE)?;
        let info = self.vault_key(session, t.token, t.label, t.id, kind, None, 0)?;
        let want = [true, t.decrypt, t.sign, true, t.derive];
        match self.add_objects(session, &info, t.token, t.label, t.id, true, want)?[..] {
            [private, public] => Ok((public, private)),
            _ => Err(CKR_GENERAL_ERROR),
        }
    }

    /// Imports a private key or a certificate (`C_CreateObject`); returns
    /// the private key's or certificate's handle (a private key's public
    /// object appears beside it).
    ///
    /// # Errors
    /// The vault's refusal (inconsistent components, name taken).
    pub fn import(
        &self,
        session: CK_SESSION_HANDLE,
        i: &Import<'_>,
    ) -> Result<CK_OBJECT_HANDLE, Rv> {
        let t = &i.t;
        let info = self.vault_key(session, t.token, t.label, t.id, i.kind, Some(&i.bytes), 0)?;
        let want = [true, t.decrypt, t.sign, true, t.derive];
        let h = self.add_objects(session, &info, t.token, t.label, t.id, false, want)?;
        h.first().copied().ok_or(CKR_GENERAL_ERROR)
    }

    /// Adds an imported public key (`C_CreateObject`, `CKO_PUBLIC_KEY`): a
    /// session object this module holds (public data, no vault key).
    ///
    /// # Errors
    /// `CKR_SESSION_HANDLE_INVALID`.
    pub fn add_public(
        &self,
        session: CK_SESSION_HANDLE,
        p: crate::public::PublicImport,
    ) -> Result<CK_OBJECT_HANDLE, Rv> {
        self.session(session)?;
        let public = PublicParts::Key(p.key);
        let id = if p.id.is_empty() {
            crate::object::default_id(&public)
        } else {
            p.id
        };
        let rsa = crate::object::key_type(p.kind) == CKK_RSA;
        let o = Obj {
            vault_id: 0,
            name: String::new(),
            kind: p.kind,
            class: CKO_PUBLIC_KEY,
            label: p.label,
            id,
            token: false,
            session,
            local: false,
            caps: [rsa && p.encrypt, false, false, p.verify, false],
            public: Some(Arc::new(public)),
        };
        let h = self.handle();
        lock(&self.objects).insert(h, o);
        Ok(h)
    }

    /// Keeps `blob` (a data object's attributes) as a token object: a vault
    /// entry of kind `data` named `dat.<random>`.
    fn store_data(&self, blob: &[u8]) -> Result<KeyInfo, Rv> {
        let mut r = [0u8; 6];
        self.random(&mut r)?;
        let name = format!(
            "{}{}",
            crate::data::DATA_PREFIX,
            r.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        self.with_vault(|c| {
            match c.import_key(&name, KeyKind::Data, true, blob) {
                Err(ClientError::Refused {
                    code: ErrorCode::NotDurable,
                    ..
                }) => c.import_key(&name, KeyKind::Data, false, blob),
                r => r,
            }
            .map_err(|e| client_rv(&e))
        })
    }

    /// Creates a data object (`C_CreateObject`, `CKO_DATA`): a token object
    /// in the vault, a session object here.
    ///
    /// # Errors
    /// `CKR_SESSION_READ_ONLY` for a token object in a read-only session;
    /// the vault's refusal.
    pub fn create_data(
        &self,
        session: CK_SESSION_HANDLE,
        token: bool,
        d: &crate::data::Data,
    ) -> Result<CK_OBJECT_HANDLE, Rv> {
        let s = self.session(session)?;
        if token && !lock(&s).rw {
            return Err(CKR_SESSION_READ_ONLY);
        }
        let blob = d.encode()?;
        let (vault_id, name) = if token {
            let info = self.store_data(&blob)?;
            (info.id, info.name)
        } else {
            (0, String::new())
        };
        let o = Obj {
            vault_id,
            name,
            kind: KeyKind::Data,
            class: CKO_DATA,
            label: d.label.clone(),
            id: Vec::new(),
            token,
            session: if token { 0 } else { session },
            local: false,
            caps: [false; 5],
            public: Some(Arc::new(PublicParts::Data(blob))),
        };
        let h = self.handle();
        lock(&self.objects).insert(h, o);
        Ok(h)
    }

    /// `C_SetAttributeValue`: a data object's label changes (a token
    /// object is written to the vault anew, then the old entry destroyed);
    /// every other attribute and object is read-only.
    ///
    /// # Errors
    /// `CKR_ATTRIBUTE_READ_ONLY`, `CKR_ATTRIBUTE_TYPE_INVALID`,
    /// `CKR_SESSION_READ_ONLY`, the vault's refusal.
    pub fn set_attributes(
        &self,
        session: CK_SESSION_HANDLE,
        h: CK_OBJECT_HANDLE,
        attrs: &[(CK_ATTRIBUTE_TYPE, &[u8])],
    ) -> Result<(), Rv> {
        let s = self.session(session)?;
        let o = self.object(h)?;
        let Some(mut d) = o.data() else {
            return Err(CKR_ATTRIBUTE_READ_ONLY);
        };
        if o.token && !lock(&s).rw {
            return Err(CKR_SESSION_READ_ONLY);
        }
        for (ty, v) in attrs {
            if !d.apply(*ty, v, false)? {
                return Err(CKR_ATTRIBUTE_TYPE_INVALID);
            }
        }
        let blob = d.encode()?;
        let (vault_id, name) = if o.token {
            let info = self.store_data(&blob)?;
            let _ = self.with_vault(|c| c.destroy_key(&o.name).map_err(|e| client_rv(&e)));
            (info.id, info.name)
        } else {
            (0, String::new())
        };
        if let Some(x) = lock(&self.objects).get_mut(&h) {
            x.vault_id = vault_id;
            x.name = name;
            x.label = d.label;
            x.public = Some(Arc::new(PublicParts::Data(blob)));
        }
        Ok(())
    }

    /// ECDH with the EC key `base` into a new AES key (`C_DeriveKey`).
    ///
    /// # Errors
    /// The vault's refusal (a point off the curve, no `d` permission).
    pub fn derive(
        &self,
        session: CK_SESSION_HANDLE,
        base: CK_OBJECT_HANDLE,
        p: &Ecdh,
        t: &Template<'_>,
    ) -> Result<CK_OBJECT_HANDLE, Rv> {
        let b = self.key(base, cap::DERIVE)?;
        let kind = match t.key_len {
            16 => KeyKind::Aes128,
            32 => KeyKind::Aes256,
            _ => return Err(CKR_ATTRIBUTE_VALUE_INVALID),
        };
        let s = self.session(session)?;
        if t.token && !lock(&s).rw {
            return Err(CKR_SESSION_READ_ONLY);
        }
        let name = self.new_name(t.token, t.label, t.id, kind)?;
        let info = self.with_vault(|c| {
            let make = |c: &mut Client, persistent: bool| {
                c.derive_key(&name, kind, persistent, &b.name, p.kdf, &p.peer, &p.shared)
            };
            match make(c, t.token) {
                Err(ClientError::Refused {
                    code: ErrorCode::NotDurable,
                    ..
                }) => make(c, false),
                r => r,
            }
            .map_err(|e| match e {
                ClientError::Refused {
                    code: ErrorCode::Invalid,
                    ..
                } => CKR_MECHANISM_PARAM_INVALID,
                e => client_rv(&e),
            })
        })?;
        let want = [t.caps[0], t.caps[1], t.caps[2], t.caps[3], false];
        let h = self.add_objects(session, &info, t.token, t.label, t.id, false, want)?;
        h.first().copied().ok_or(CKR_GENERAL_ERROR)
    }

    /// Destroys an object's vault key (a private key takes its public
    /// object with it). A public key object is only removed: the private
    /// half stays in the vault (for a token pair, other processes still
    /// show its public object, which the vault derives from the private key).
    ///
    /// # Errors
    /// `CKR_OBJECT_HANDLE_INVALID`, `CKR_SESSION_READ_ONLY`, the vault's
    /// refusal.
    pub fn destroy(&self, session: CK_SESSION_HANDLE, h: CK_OBJECT_HANDLE) -> Result<(), Rv> {
        let s = self.session(session)?;
        let o = self.object(h)?;
        if o.token && !lock(&s).rw {
            return Err(CKR_SESSION_READ_ONLY);
        }
        if o.class == CKO_PUBLIC_KEY || o.vault_id == 0 {
            if o.token {
                lock(&self.hidden).insert(o.vault_id);
            }
            lock(&self.objects).remove(&h);
            lock(&self.pubkeys).remove(&h);
            return Ok(());
        }
        self.with_vault(|c| c.destroy_key(&o.name).map_err(|e| client_rv(&e)))?;
        let mut objs = lock(&self.objects);
        let gone: Vec<CK_OBJECT_HANDLE> = objs
            .iter()
            .filter(|(_, x)| x.vault_id == o.vault_id)
            .map(|(k, _)| *k)
            .collect();
        let mut pk = lock(&self.pubkeys);
        for k in gone {
            objs.remove(&k);
            pk.remove(&k);
        }
        drop(pk);
        drop(objs);
        lock(&self.hidden).remove(&o.vault_id);
        Ok(())
    }

    /// Fills `out` from memveil's CTR_DRBG (AES-256, seeded from RDRAND
    /// conditioned 512:1, or from `getrandom(2)` on a CPU without RDRAND).
    ///
    /// # Errors
    /// `CKR_DEVICE_ERROR` when the DRBG's source fails its health tests.
    pub fn random(&self, out: &mut [u8]) -> Result<(), Rv> {
        use memveil_drng::{SourceKind, Stream, StreamKind, StreamOptions};
        let mut g = lock(&self.rng);
        if g.is_none() {
            let rdrand = Stream::open(StreamKind::Drbg, &StreamOptions::default());
            let s = match rdrand {
                Ok(s) => s,
                Err(_) => Stream::open(
                    StreamKind::Drbg,
                    &StreamOptions {
                        input: SourceKind::Getrandom,
                        ..StreamOptions::default()
                    },
                )
                .map_err(|_| CKR_DEVICE_ERROR)?,
            };
            *g = Some(s);
        }
        let s = g.as_mut().ok_or(CKR_DEVICE_ERROR)?;
        for chunk in out.chunks_mut(1 << 16) {
            s.fill(chunk).map_err(|_| CKR_DEVICE_ERROR)?;
        }
        Ok(())
    }
}

impl Default for Module {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        self.close_all();
    }
}

/// What a creation template asked for, checked.
#[derive(Debug, Default)]
pub struct Template<'a> {
    /// `CKK_GENERIC_SECRET` ([`KeyKind::Secret`]), else AES (the kind by
    /// length).
    pub generic: bool,
    /// `CKA_VALUE_LEN` or the length of `CKA_VALUE`.
    pub key_len: usize,
    /// `CKA_TOKEN`.
    pub token: bool,
    /// `CKA_LABEL`.
    pub label: &'a [u8],
    /// `CKA_ID`.
    pub id: &'a [u8],
    /// `CKA_ENCRYPT`, `CKA_DECRYPT`, `CKA_SIGN`, `CKA_VERIFY` (default true).
    pub caps: [bool; 4],
}

pub(crate) fn as_bool(v: &[u8]) -> Result<bool, Rv> {
    match v {
        [b] => Ok(*b != 0),
        _ => Err(CKR_ATTRIBUTE_VALUE_INVALID),
    }
}

pub(crate) fn as_ulong(v: &[u8]) -> Result<CK_ULONG, Rv> {
    let a: [u8; std::mem::size_of::<CK_ULONG>()] =
        v.try_into().map_err(|_| CKR_ATTRIBUTE_VALUE_INVALID)?;
    Ok(CK_ULONG::from_ne_bytes(a))
}

/// Checks a template for `C_GenerateKey` (`value` is `None`) or
/// `C_CreateObject` (returns `CKA_VALUE`, borrowed).
///
/// Every key is sensitive: `CKA_SENSITIVE=false` (what `pkcs11-tool
/// --keygen` asks for unless given `--sensitive`) is accepted and the key
/// reads back `CKA_SENSITIVE=true`. Refused with
/// `CKR_ATTRIBUTE_VALUE_INVALID`: `CKA_EXTRACTABLE=true`, `CKA_WRAP`/`CKA_UNWRAP`/`CKA_DERIVE=true`,
/// `CKA_MODIFIABLE`/`CKA_COPYABLE=true`, a class other than secret key, a
/// key type other than AES or generic secret, AES lengths other than 16 and
/// 32 bytes, generic secrets shorter than 14 bytes (112 bits, the least
/// SP 800-131A allows for HMAC) or longer than 256; for a token
/// object, `CKA_ENCRYPT`/`CKA_DECRYPT`/`CKA_SIGN`/`CKA_VERIFY=false` (the
/// vault's ACL decides those for every process: `memveil vault grant`).
///
/// # Errors
/// As above; `CKR_TEMPLATE_INCOMPLETE` without a length (generate) or a
/// value (import); `CKR_ATTRIBUTE_TYPE_INVALID` for an unknown attribute.
pub fn check_template<'a>(
    attrs: &[(CK_ATTRIBUTE_TYPE, &'a [u8])],
    import: bool,
    generic: bool,
) -> Result<(Template<'a>, Option<&'a [u8]>), Rv> {
    let mut t = Template {
        caps: [true; 4],
        ..Template::default()
    };
    let (mut class, mut key_type, mut value_len, mut value) = (None, None, None, None);
    for (ty, v) in attrs {
        let v: &'a [u8] = v;
        match *ty {
            CKA_CLASS => class = Some(as_ulong(v)?),
            CKA_KEY_TYPE => key_type = Some(as_ulong(v)?),
            CKA_VALUE_LEN => value_len = Some(as_ulong(v)?),
            CKA_VALUE if import => value = Some(v),
            CKA_TOKEN => t.token = as_bool(v)?,
            CKA_LABEL => t.label = v,
            CKA_ID => t.id = v,
            // `CKA_SENSITIVE=false` (pkcs11-tool's default) still gets a
            // sensitive key: the vault has no way to give the value out.
            CKA_SENSITIVE | CKA_DESTROYABLE | CKA_PRIVATE => {
                as_bool(v)?;
            }
            CKA_EXTRACTABLE
            | CKA_WRAP
            | CKA_UNWRAP
            | CKA_DERIVE
            | CKA_MODIFIABLE
            | CKA_COPYABLE
            | CKA_TRUSTED
            | CKA_WRAP_WITH_TRUSTED => {
                if as_bool(v)? {
                    return Err(CKR_ATTRIBUTE_VALUE_INVALID);
                }
            }
            CKA_ENCRYPT => t.caps[0] = as_bool(v)?,
            CKA_DECRYPT => t.caps[1] = as_bool(v)?,
            CKA_SIGN => t.caps[2] = as_bool(v)?,
            CKA_VERIFY => t.caps[3] = as_bool(v)?,
            // Descriptive attributes the standard gives every secret key:
            // taken, not enforced (the vault's ACL says who may do what).
            CKA_START_DATE
            | CKA_END_DATE
            | CKA_ALLOWED_MECHANISMS
            | CKA_CHECK_VALUE
            | CKA_WRAP_TEMPLATE
            | CKA_UNWRAP_TEMPLATE
            | CKA_DERIVE_TEMPLATE
            | CKA_SUBJECT => {}
            CKA_ALWAYS_AUTHENTICATE => {
                as_bool(v)?;
            }
            CKA_VALUE
            | CKA_LOCAL
            | CKA_ALWAYS_SENSITIVE
            | CKA_NEVER_EXTRACTABLE
            | CKA_KEY_GEN_MECHANISM => return Err(CKR_ATTRIBUTE_READ_ONLY),
            _ => return Err(CKR_ATTRIBUTE_TYPE_INVALID),
        }
    }
    if class.is_some_and(|c| c != CKO_SECRET_KEY)
        || key_type.is_some_and(|k| k != CKK_AES && k != CKK_GENERIC_SECRET)
    {
        return Err(CKR_ATTRIBUTE_VALUE_INVALID);
    }
    t.generic = key_type.map_or(generic, |k| k == CKK_GENERIC_SECRET);
    // A generic secret never encrypts: only its CKA_SIGN and CKA_VERIFY
    // follow the vault's ACL.
    let usages = if t.generic { &t.caps[2..] } else { &t.caps[..] };
    if t.token && usages.contains(&false) {
        return Err(CKR_ATTRIBUTE_VALUE_INVALID);
    }
    if import {
        if class.is_none() || key_type.is_none() {
            return Err(CKR_TEMPLATE_INCOMPLETE);
        }
        let v = value.ok_or(CKR_TEMPLATE_INCOMPLETE)?;
        if value_len.is_some_and(|l| usize::try_from(l).ok() != Some(v.len())) {
            return Err(CKR_TEMPLATE_INCONSISTENT);
        }
        t.key_len = v.len();
    } else {
        let l = value_len.ok_or(CKR_TEMPLATE_INCOMPLETE)?;
        t.key_len = usize::try_from(l).map_err(|_| CKR_ATTRIBUTE_VALUE_INVALID)?;
    }
    let ok = if t.generic {
        KeyKind::Secret.import_len_ok(t.key_len)
    } else {
        t.key_len == 16 || t.key_len == 32
    };
    if !ok {
        return Err(CKR_ATTRIBUTE_VALUE_INVALID);
    }
    Ok((t, value))
}

impl Backend for Module {
    fn run(&self, req: &Req<'_>, input: &[u8], out: &mut [u8]) -> Result<[u8; 16], Failure> {
        let aad_at = input.len().div_ceil(64) * 64;
        let need = aad_at + req.aad.len();
        let mut l = self.take_lane(need.max(1)).map_err(Failure::Rv)?;
        let r = self.run_on(&mut l, req, input, out, aad_at);
        match r {
            Err(Failure::Rv(_)) => {
                // The lane or the vault is gone: do not reuse it.
                let _ = self.lane_lost();
                self.forget_vault();
            }
            _ => self.give_lane(l),
        }
        r
    }
}

impl AsymBackend for Module {
    fn run_asym(
        &self,
        op: Op,
        key: u32,
        mode: Mode,
        params: AsymParams,
        input: &[u8],
    ) -> Result<Zeroizing<Vec<u8>>, Failure> {
        const OUT: usize = 512;
        let out_at = input.len().div_ceil(64) * 64;
        let mut l = self.take_lane(out_at + OUT).map_err(Failure::Rv)?;
        let r = Self::asym_on(&mut l, op, key, mode, params, input, out_at, OUT);
        match r {
            Err(Failure::Rv(_)) => {
                // The lane or the vault is gone: do not reuse it.
                let _ = self.lane_lost();
                self.forget_vault();
            }
            _ => self.give_lane(l),
        }
        r
    }
}

impl Module {
    #[allow(clippy::too_many_arguments)]
    fn asym_on(
        l: &mut Lane,
        op: Op,
        key: u32,
        mode: Mode,
        params: AsymParams,
        input: &[u8],
        out_at: usize,
        out_len: usize,
    ) -> Result<Zeroizing<Vec<u8>>, Failure> {
        let dev = |_| Failure::Rv(CKR_DEVICE_ERROR);
        l.shared.write(0, input).map_err(dev)?;
        let e = Entry::asym(
            op,
            mode,
            key,
            l.shared.buffer(),
            (0, input.len() as u64),
            (out_at as u64, out_len as u64),
            params,
        );
        let o = l.lane.run(&[e]).map_err(dev)?;
        let o = o.first().ok_or(Failure::Rv(CKR_DEVICE_ERROR))?;
        if o.status != status::OK {
            return Err(Failure::Status(o.status));
        }
        let n = usize::try_from(o.out_len)
            .unwrap_or(usize::MAX)
            .min(out_len);
        let mut out = Zeroizing::new(vec![0u8; n]);
        l.shared.read(out_at, &mut out).map_err(dev)?;
        // The result (a decrypted message) does not stay in the lane.
        l.shared.write(out_at, &vec![0u8; n]).map_err(dev)?;
        Ok(out)
    }

    fn run_on(
        &self,
        l: &mut Lane,
        req: &Req<'_>,
        input: &[u8],
        out: &mut [u8],
        aad_at: usize,
    ) -> Result<[u8; 16], Failure> {
        let dev = |_| Failure::Rv(CKR_DEVICE_ERROR);
        if !input.is_empty() {
            l.shared.write(0, input).map_err(dev)?;
        }
        if !req.aad.is_empty() {
            l.shared.write(aad_at, req.aad).map_err(dev)?;
        }
        let e = Entry {
            op: req.op,
            mode: req.mode,
            key: req.key,
            version: 0,
            buffer: l.shared.buffer(),
            offset: 0,
            len: input.len() as u64,
            iv: req.iv,
            tag: req.tag,
            aad_offset: aad_at as u64,
            aad_len: req.aad.len() as u64,
            unit: 0,
            step: 0,
        };
        let o = l.lane.run(&[e]).map_err(dev)?;
        let o = o.first().ok_or(Failure::Rv(CKR_DEVICE_ERROR))?;
        if o.status != status::OK {
            return Err(Failure::Status(o.status));
        }
        if !out.is_empty() {
            l.shared.read(0, out).map_err(dev)?;
        }
        Ok(o.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_that_would_let_the_key_out_are_refused() {
        let t = CK_TRUE;
        let f = CK_FALSE;
        let len = (32 as CK_ULONG).to_ne_bytes();
        let ok = [(CKA_VALUE_LEN, &len[..])];
        assert!(check_template(&ok, false, false).is_ok());
        // Asked not to be sensitive: still made (and reported) sensitive.
        assert!(check_template(
            &[ok[0], (CKA_SENSITIVE, std::slice::from_ref(&f))],
            false,
            false
        )
        .is_ok());
        for bad in [
            (CKA_EXTRACTABLE, std::slice::from_ref(&t)),
            (CKA_WRAP, std::slice::from_ref(&t)),
        ] {
            let r = check_template(&[ok[0], bad], false, false);
            assert_eq!(r.err(), Some(CKR_ATTRIBUTE_VALUE_INVALID), "{:#x}", bad.0);
        }
        assert_eq!(
            check_template(&[], false, false).err(),
            Some(CKR_TEMPLATE_INCOMPLETE)
        );
        // Issue 36: attributes the standard gives a secret key are taken
        // (SoftHSM2 takes them; they were CKR_ATTRIBUTE_TYPE_INVALID).
        let mechs = CKM_AES_CBC.to_ne_bytes();
        let kcv = [1u8, 2, 3];
        let std_attrs = [
            ok[0],
            (CKA_ALLOWED_MECHANISMS, &mechs[..]),
            (CKA_CHECK_VALUE, &kcv[..]),
            (CKA_WRAP_TEMPLATE, &[][..]),
            (CKA_ALWAYS_AUTHENTICATE, std::slice::from_ref(&f)),
        ];
        assert!(check_template(&std_attrs, false, false).is_ok());
        // A generic secret: 14 to 256 bytes.
        let l13 = (13 as CK_ULONG).to_ne_bytes();
        assert_eq!(
            check_template(&[(CKA_VALUE_LEN, &l13[..])], false, true).err(),
            Some(CKR_ATTRIBUTE_VALUE_INVALID)
        );
        let (t, _) = check_template(&ok, false, true).expect("generic");
        assert!(t.generic && t.key_len == 32);
        // A token HMAC key that says it does not encrypt (it cannot).
        let tr = CK_TRUE;
        let no_enc = [
            ok[0],
            (CKA_TOKEN, std::slice::from_ref(&tr)),
            (CKA_ENCRYPT, std::slice::from_ref(&f)),
            (CKA_DECRYPT, std::slice::from_ref(&f)),
        ];
        assert!(check_template(&no_enc, false, true).is_ok());
        assert_eq!(
            check_template(&no_enc, false, false).err(),
            Some(CKR_ATTRIBUTE_VALUE_INVALID)
        );
        let l24 = (24 as CK_ULONG).to_ne_bytes();
        assert_eq!(
            check_template(&[(CKA_VALUE_LEN, &l24[..])], false, false).err(),
            Some(CKR_ATTRIBUTE_VALUE_INVALID)
        );
    }
}
