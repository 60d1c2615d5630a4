//! The KMIP client: one TLS connection (client certificate, server verified
//! against the configured CA) per operation, responses read into secret
//! memory, key bytes returned only as [`SecretBox`]es.
//!
//! The server is verified against the certificates of the CA file alone:
//! the system's CAs, `SSL_CERT_FILE` and `SSL_CERT_DIR` play no part. OpenSSL
//! wipes each record's plaintext once it is read, and its record buffers
//! before it frees them (`SSL_OP_CLEANSE_PLAINTEXT`), so no key bytes stay
//! behind in ordinary heap memory when a connection ends.
#![forbid(unsafe_code)]

use std::io::{Read as _, Write as _};
use std::net::{TcpStream, ToSocketAddrs as _};
use std::path::{Path, PathBuf};

use memveil_secmem::{Policy, SecmemError, SecretBox, SecretPool};
use openssl::ssl::{
    HandshakeError, SslConnector, SslFiletype, SslMethod, SslOptions, SslStream, SslVerifyMode,
    SslVersion,
};
use openssl::x509::store::{X509Store, X509StoreBuilder};
use openssl::x509::verify::X509VerifyFlags;
use openssl::x509::{X509VerifyResult, X509};

use crate::config::Config;
use crate::msg::{self, object_type, reason, Failure, Got, Operation};
use crate::ttlv::{self, typ};

/// Largest response accepted (a key answer is under 1 KiB).
pub const MAX_RESPONSE: usize = 64 * 1024;
/// Secret memory for requests and responses in flight.
const POOL_BYTES: usize = 4 * MAX_RESPONSE;
/// `SSL_OP_CLEANSE_PLAINTEXT` (OpenSSL 3.0+, `SSL_OP_BIT(1)` in `ssl.h`;
/// the openssl crate does not name it): OpenSSL wipes a record's plaintext
/// as soon as it is read, and its record buffers before freeing them.
const CLEANSE_PLAINTEXT: SslOptions = SslOptions::from_bits_retain(1 << 1);
/// The first OpenSSL that honours [`CLEANSE_PLAINTEXT`] (`OPENSSL_VERSION_NUMBER`).
const CLEANSE_SINCE: i64 = 0x3000_0000;

/// What went wrong talking to the KMIP server; each message names the cause
/// and the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KmipError {
    /// A certificate or key file could not be loaded.
    #[error("KMIP {what} {path}: cannot be loaded ({detail}); check --kmip-{flag} (PEM)")]
    Credentials {
        /// "client certificate", "client key", "CA certificate".
        what: &'static str,
        /// The flag naming it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// OpenSSL's words.
        detail: String,
    },
    /// No TCP connection.
    #[error("KMIP server {url} unreachable: {source}; check that it runs and listens there (--kmip / url =)")]
    Unreachable {
        /// The address.
        url: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The server's certificate does not verify.
    #[error("KMIP server {url}: its certificate does not verify against the CA {ca} ({detail}); pass the CA that signed the server's certificate with --kmip-ca, and an address its certificate names")]
    ServerCertificate {
        /// The address.
        url: String,
        /// The CA file.
        ca: PathBuf,
        /// OpenSSL's words.
        detail: String,
    },
    /// The server refused this host's certificate.
    #[error("KMIP server {url} refused the client certificate {cert} ({detail}); it must be signed by a CA the server trusts and carry extendedKeyUsage clientAuth")]
    ClientCertificate {
        /// The address.
        url: String,
        /// The certificate file.
        cert: PathBuf,
        /// What was seen.
        detail: String,
    },
    /// Another TLS failure.
    #[error("KMIP server {url}: TLS failed: {detail}")]
    Tls {
        /// The address.
        url: String,
        /// OpenSSL's words.
        detail: String,
    },
    /// The object does not exist.
    #[error("KMIP object {uid:?} does not exist on {url} (Item Not Found): check the id with the KMS (a Locate by name finds it), or whether it was destroyed")]
    NotFound {
        /// The Unique Identifier.
        uid: String,
        /// The address.
        url: String,
    },
    /// The object is not a key memveil can use.
    #[error("KMIP object {uid:?} is a {got}, not a symmetric key: pass the id of an AES key")]
    WrongType {
        /// The Unique Identifier.
        uid: String,
        /// What it is.
        got: &'static str,
    },
    /// The key has another length than the use needs.
    #[error("KMIP key {uid:?} has {got} bytes; {want}")]
    WrongLength {
        /// The Unique Identifier.
        uid: String,
        /// Its length.
        got: usize,
        /// What is needed, worded for people.
        want: String,
    },
    /// The server answered with a failure.
    #[error("KMIP server {url} refused {op}: {reason}{message}{hint}")]
    Refused {
        /// The address.
        url: String,
        /// The operation.
        op: &'static str,
        /// The Result Reason's name.
        reason: &'static str,
        /// ": " and the Result Message, or empty.
        message: String,
        /// What to do, or empty.
        hint: &'static str,
    },
    /// The server's answer is not a KMIP response to the request.
    #[error("malformed KMIP response from {url}: {why}; is this a KMIP 1.x server on that port?")]
    Malformed {
        /// The address.
        url: String,
        /// What is wrong.
        why: String,
    },
    /// Secret memory for the exchange could not be had.
    #[error("secret memory for the KMIP exchange: {0}")]
    Secmem(#[from] SecmemError),
}

/// A certificate store that holds the certificates of the PEM file `path`
/// and nothing else. Each of them is a trust anchor (partial chains
/// accepted): a file holding only an intermediate CA trusts what it signed.
fn ca_store(path: &Path) -> Result<X509Store, String> {
    let pem = std::fs::read(path).map_err(|e| e.to_string())?;
    let certs = X509::stack_from_pem(&pem).map_err(|e| e.to_string())?;
    if certs.is_empty() {
        return Err("no PEM certificate in it".to_owned());
    }
    let mut b = X509StoreBuilder::new().map_err(|e| e.to_string())?;
    for c in certs {
        b.add_cert(c).map_err(|e| e.to_string())?;
    }
    b.set_flags(X509VerifyFlags::PARTIAL_CHAIN)
        .map_err(|e| e.to_string())?;
    Ok(b.build())
}

/// A KMIP client for one server.
pub struct Client {
    cfg: Config,
    tls: SslConnector,
    pool: SecretPool,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("url", &self.cfg.url)
            .finish()
    }
}

impl Client {
    /// Loads the certificates (checked now, not at first use) and reserves
    /// secret memory under `policy`.
    ///
    /// # Errors
    /// [`KmipError::Credentials`] naming the file; [`KmipError::Secmem`].
    pub fn new(cfg: Config, policy: Policy) -> Result<Self, KmipError> {
        let cred = |what, flag, path: &PathBuf| {
            let path = path.clone();
            move |e: openssl::error::ErrorStack| KmipError::Credentials {
                what,
                flag,
                path,
                detail: e.to_string(),
            }
        };
        let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(|e| KmipError::Tls {
            url: cfg.url.clone(),
            detail: e.to_string(),
        })?;
        b.set_certificate_chain_file(&cfg.cert).map_err(cred(
            "client certificate",
            "cert",
            &cfg.cert,
        ))?;
        b.set_private_key_file(&cfg.key, SslFiletype::PEM)
            .map_err(cred("client key", "key", &cfg.key))?;
        b.check_private_key().map_err(cred(
            "client key (does not match the certificate)",
            "key",
            &cfg.key,
        ))?;
        // The builder loaded the system's CAs (and SSL_CERT_FILE/DIR) into
        // its store; this store replaces it: the CA file, and nothing else.
        let store = ca_store(&cfg.ca).map_err(|detail| KmipError::Credentials {
            what: "CA certificate",
            flag: "ca",
            path: cfg.ca.clone(),
            detail,
        })?;
        b.set_cert_store(store);
        if openssl::version::number() < CLEANSE_SINCE {
            return Err(KmipError::Tls {
                url: cfg.url.clone(),
                detail: format!(
                    "{} cannot wipe the key bytes it decrypts (SSL_OP_CLEANSE_PLAINTEXT needs OpenSSL 3.0 or later); build memveil against OpenSSL 3",
                    openssl::version::version()
                ),
            });
        }
        b.set_options(CLEANSE_PLAINTEXT);
        b.set_verify(SslVerifyMode::PEER);
        b.set_min_proto_version(Some(SslVersion::TLS1_2))
            .map_err(cred("CA certificate", "ca", &cfg.ca))?;
        let pool = SecretPool::new(POOL_BYTES, policy)?;
        Ok(Self {
            cfg,
            tls: b.build(),
            pool,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn url(&self) -> String {
        self.cfg.url.clone()
    }

    fn connect(&self) -> Result<SslStream<TcpStream>, KmipError> {
        let (host, port) = self.cfg.host_port();
        let unreachable = |source| KmipError::Unreachable {
            url: self.url(),
            source,
        };
        let addrs: Vec<_> = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(unreachable)?
            .collect();
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        let mut tcp = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, self.cfg.timeout) {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let tcp = tcp.ok_or_else(|| unreachable(last))?;
        let t = Some(self.cfg.timeout);
        tcp.set_read_timeout(t).map_err(unreachable)?;
        tcp.set_write_timeout(t).map_err(unreachable)?;
        let _ = tcp.set_nodelay(true);
        self.tls.connect(&host, tcp).map_err(|e| match e {
            HandshakeError::Failure(mid) => {
                let v = mid.ssl().verify_result();
                if v != X509VerifyResult::OK {
                    KmipError::ServerCertificate {
                        url: self.url(),
                        ca: self.cfg.ca.clone(),
                        detail: v.error_string().to_owned(),
                    }
                } else {
                    self.tls_failure(&mid.error().to_string())
                }
            }
            HandshakeError::SetupFailure(e) => self.tls_failure(&e.to_string()),
            HandshakeError::WouldBlock(_) => KmipError::Tls {
                url: self.url(),
                detail: format!("no answer within {:?}", self.cfg.timeout),
            },
        })
    }

    /// A TLS error: a peer alert about our certificate, or something else.
    fn tls_failure(&self, detail: &str) -> KmipError {
        let d = detail.to_ascii_lowercase();
        if [
            "alert bad certificate",
            "unknown ca",
            "certificate required",
            "alert certificate",
            "unsupported certificate",
            "handshake failure",
        ]
        .iter()
        .any(|w| d.contains(w))
        {
            KmipError::ClientCertificate {
                url: self.url(),
                cert: self.cfg.cert.clone(),
                detail: detail.to_owned(),
            }
        } else {
            KmipError::Tls {
                url: self.url(),
                detail: detail.to_owned(),
            }
        }
    }

    /// Sends `req` and returns the response message, read into secret memory.
    fn exchange(&self, req: &ttlv::Item<'_>) -> Result<SecretBox<[u8]>, KmipError> {
        let n = req.encoded_len();
        let mut out = self.pool.alloc_bytes(n)?;
        req.encode(&mut out).map_err(|e| KmipError::Malformed {
            url: self.url(),
            why: format!("request not encodable: {e}"),
        })?;
        let mut s = self.connect()?;
        let io = |what: &str, e: std::io::Error| self.io_failure(what, &e);
        s.write_all(&out)
            .map_err(|e| io("sending the request", e))?;
        s.flush().map_err(|e| io("sending the request", e))?;
        drop(out);
        let mut head = [0u8; 8];
        s.read_exact(&mut head)
            .map_err(|e| io("reading the answer", e))?;
        let (tag, t, len) = ttlv::header(&head).map_err(|e| self.malformed(e.to_string()))?;
        if tag != msg::tag::RESPONSE_MESSAGE || t != typ::STRUCTURE {
            return Err(self.malformed(format!(
                "the answer starts with item {tag:06X} of type {t:#04x}, not a Response Message"
            )));
        }
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > MAX_RESPONSE - 8 {
            return Err(
                self.malformed(format!("an answer of {len} bytes (at most {MAX_RESPONSE})"))
            );
        }
        let mut buf = self.pool.alloc_bytes(8 + len)?;
        buf[..8].copy_from_slice(&head);
        s.read_exact(&mut buf[8..])
            .map_err(|e| io("reading the answer", e))?;
        let _ = s.shutdown();
        Ok(buf)
    }

    fn io_failure(&self, what: &str, e: &std::io::Error) -> KmipError {
        let d = e.to_string();
        if d.to_ascii_lowercase().contains("alert") {
            return self.tls_failure(&d);
        }
        if matches!(
            e.kind(),
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
        ) {
            return KmipError::ClientCertificate {
                url: self.url(),
                cert: self.cfg.cert.clone(),
                detail: format!("the server closed the connection while {what}; it may have refused this certificate or the request: see its log"),
            };
        }
        KmipError::Tls {
            url: self.url(),
            detail: format!("{what}: {d}"),
        }
    }

    /// A payload that lacks what the operation returns.
    fn failed(&self, f: Failure) -> KmipError {
        match f {
            Failure::Malformed(w) | Failure::Refused { message: w, .. } => self.malformed(w),
        }
    }

    fn malformed(&self, why: String) -> KmipError {
        KmipError::Malformed {
            url: self.url(),
            why,
        }
    }

    /// Runs `req`, checks the answer to `op`, and hands its payload to `f`.
    fn call<T>(
        &self,
        op: Operation,
        uid: Option<&str>,
        req: &ttlv::Item<'_>,
        f: impl FnOnce(&ttlv::Item<'_>) -> Result<T, KmipError>,
    ) -> Result<T, KmipError> {
        let buf = self.exchange(req)?;
        let m = ttlv::decode(&buf).map_err(|e| self.malformed(e.to_string()))?;
        match msg::response(&m, op) {
            Ok(p) => f(p),
            Err(Failure::Malformed(w)) => Err(self.malformed(w)),
            Err(Failure::Refused { reason: r, message }) => Err(match (r, uid) {
                (reason::ITEM_NOT_FOUND, Some(u)) => KmipError::NotFound {
                    uid: u.to_owned(),
                    url: self.url(),
                },
                _ => KmipError::Refused {
                    url: self.url(),
                    op: op.name(),
                    reason: reason::name(r),
                    message: if message.is_empty() {
                        String::new()
                    } else {
                        format!(": {message}")
                    },
                    hint: if r == reason::PERMISSION_DENIED {
                        "; the server's operation policy does not let this client certificate's identity do that (give the object a policy that allows this host, e.g. --kmip-policy)"
                    } else {
                        ""
                    },
                },
            }),
        }
    }

    /// Runs a request that makes an object; returns its Unique Identifier.
    fn new_object(&self, op: Operation, req: &ttlv::Item<'_>) -> Result<String, KmipError> {
        self.call(op, None, req, |p| {
            msg::uid(p).map(str::to_owned).map_err(|f| self.failed(f))
        })
    }

    /// Create: a new AES-256 key on the server; returns its Unique Identifier.
    /// `policy` names the server's Operation Policy Name for it (who else may
    /// Get it); `None` leaves the server's default (usually owner-only).
    ///
    /// # Errors
    /// [`KmipError`].
    pub fn create_aes256(
        &self,
        name: Option<&str>,
        policy: Option<&str>,
    ) -> Result<String, KmipError> {
        let req = msg::create_aes(256, name, policy);
        self.new_object(Operation::Create, &req)
    }

    /// Register: `key` (in secret memory) as an AES key; returns its Unique
    /// Identifier. The request is built in secret memory.
    ///
    /// # Errors
    /// [`KmipError`].
    pub fn register_aes(
        &self,
        key: &[u8],
        name: Option<&str>,
        policy: Option<&str>,
    ) -> Result<String, KmipError> {
        let req = msg::register_aes(key, name, policy);
        self.new_object(Operation::Register, &req)
    }

    /// Register: `data` as Secret Data (opaque bytes, e.g. a wrapped key);
    /// returns its Unique Identifier. Built in secret memory.
    ///
    /// # Errors
    /// [`KmipError`].
    pub fn register_secret(
        &self,
        data: &[u8],
        name: Option<&str>,
        policy: Option<&str>,
    ) -> Result<String, KmipError> {
        let req = msg::register_secret(data, name, policy);
        self.new_object(Operation::Register, &req)
    }

    /// Get: a symmetric key's (or secret data's) bytes, straight into secret memory.
    ///
    /// # Errors
    /// [`KmipError::NotFound`], [`KmipError::WrongType`], and the rest.
    pub fn get_key(&self, uid: &str) -> Result<SecretBox<[u8]>, KmipError> {
        let req = msg::by_uid(Operation::Get, uid);
        self.call(Operation::Get, Some(uid), &req, |p| {
            match msg::got(p).map_err(|f| self.failed(f))? {
                Got::Key { material, .. } => {
                    let mut k = self.pool.alloc_bytes(material.len())?;
                    k.copy_from_slice(material);
                    Ok(k)
                }
                Got::OtherType(t) => Err(KmipError::WrongType {
                    uid: uid.to_owned(),
                    got: object_type::name(t),
                }),
                Got::Wrapped => Err(KmipError::WrongType {
                    uid: uid.to_owned(),
                    got: "key the server returns wrapped (it has a wrapping policy)",
                }),
            }
        })
    }

    /// Get of a key that must be `want` bytes long.
    ///
    /// # Errors
    /// As [`Client::get_key`], and [`KmipError::WrongLength`] with `why`.
    pub fn get_key_len(
        &self,
        uid: &str,
        want: usize,
        why: &str,
    ) -> Result<SecretBox<[u8]>, KmipError> {
        let k = self.get_key(uid)?;
        if k.len() != want {
            return Err(KmipError::WrongLength {
                uid: uid.to_owned(),
                got: k.len(),
                want: format!("{why} needs {want} bytes ({} bits)", want * 8),
            });
        }
        Ok(k)
    }

    /// Locate: the Unique Identifiers of objects named `name`.
    ///
    /// # Errors
    /// [`KmipError`].
    pub fn locate(&self, name: &str) -> Result<Vec<String>, KmipError> {
        let req = msg::locate_name(name);
        self.call(Operation::Locate, None, &req, |p| {
            Ok(p.all(msg::tag::UNIQUE_IDENTIFIER)
                .filter_map(ttlv::Item::text)
                .map(str::to_owned)
                .collect())
        })
    }

    /// Destroy an object.
    ///
    /// # Errors
    /// [`KmipError::NotFound`] and the rest.
    pub fn destroy(&self, uid: &str) -> Result<(), KmipError> {
        let req = msg::by_uid(Operation::Destroy, uid);
        self.call(Operation::Destroy, Some(uid), &req, |_| Ok(()))
    }
}
