//! The command line of the vault (`memveil vault …`, also the
//! `memveil-vault` binary): `serve` and the verbs for people.
#![forbid(unsafe_code)]

use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::time::Duration;

use memveil_secmem::{Level, Policy, SecretPool};

use crate::client::{Client, Crypt};
use crate::keystore::{KdfParams, KekSource};
use crate::proto::{perm, KeyInfo, KeyKind, Mode};
use crate::server::{Config, Quotas, Server};

/// Errors of the command line, already worded for people.
pub type CliError = Box<dyn std::error::Error + Send + Sync>;

/// The vault socket when `--vault` is not given: `$MEMVEIL_VAULT_SOCKET`, else
/// `/run/memveil/vault.sock`.
#[must_use]
pub fn default_socket() -> PathBuf {
    std::env::var_os("MEMVEIL_VAULT_SOCKET")
        .map_or_else(|| PathBuf::from("/run/memveil/vault.sock"), PathBuf::from)
}

/// `create --kind`: a kind the vault makes (a certificate is imported, not
/// made, so `cert` is neither accepted nor offered).
///
/// # Errors
/// An unknown kind or `cert`, with the kinds `create` takes.
pub fn creatable_kind(s: &str) -> Result<KeyKind, String> {
    let kinds: Vec<&str> = crate::proto::KINDS
        .iter()
        .filter(|k| **k != KeyKind::Cert)
        .map(|k| k.name())
        .collect();
    match s.parse::<KeyKind>() {
        Ok(KeyKind::Cert) => Err(
            "a certificate is imported, not created (memveil vault import NAME --key-file CERT)"
                .into(),
        ),
        Ok(k) => Ok(k),
        Err(_) => Err(format!("unknown key kind {s:?}: {}", kinds.join(", "))),
    }
}

/// `memveil vault --help`, after the verbs.
const AFTER_LONG_HELP: &str = "\
Examples:
  memveil vault serve &                                      # at /run/memveil/vault.sock
  memveil vault create app --kind aes256                     # a key made in the vault
  memveil vault encrypt --key app -i secret.txt -o secret.mvve
  memveil vault decrypt --key app -i secret.mvve
  memveil vault list                                         # never key bytes

See docs/vault.md.";

/// `--vault SOCKET`, the vault's socket, for the commands whose verbs all
/// talk to the vault (`memveil vault`, `memveil key`): one definition, so
/// one name (`--socket` is a hidden alias for a release).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct VaultSocket {
    /// The vault's socket (default: $MEMVEIL_VAULT_SOCKET)
    ///
    /// The vault's socket (default: $MEMVEIL_VAULT_SOCKET, else
    /// /run/memveil/vault.sock; the vault makes /run/memveil, mode 0755).
    #[arg(
        long = "vault",
        alias = "socket",
        value_name = "SOCKET",
        global = true,
        verbatim_doc_comment
    )]
    pub socket: Option<PathBuf>,
}

impl VaultSocket {
    /// The socket given, else [`default_socket`].
    #[must_use]
    pub fn path(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(default_socket)
    }
}

/// `memveil vault`.
#[derive(clap::Args, Debug)]
#[command(after_long_help = AFTER_LONG_HELP)]
pub struct Args {
    /// The vault's socket
    #[command(flatten)]
    pub vault: VaultSocket,
    /// What to do
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// Verbs.
#[derive(clap::Subcommand, Debug)]
pub enum Cmd {
    /// Run the vault in the foreground (logs to stderr; prints a ready line)
    ///
    /// Run the vault in the foreground: logs and audit lines to stderr, a
    /// `memveil-vault ready socket=... level=... pid=...` line on stdout once
    /// it serves, and READY=1 to systemd (Type=notify). Keys live in
    /// memfd_secret memory; it refuses to start without it unless
    /// --allow-level=locked.
    #[command(after_long_help = SERVE_EXAMPLES, verbatim_doc_comment)]
    Serve(Box<ServeArgs>),
    /// Show the vault's status and protection level
    #[command(
        after_long_help = "Examples:\n  memveil vault status    # level, AES backend, keys, clients, uptime, pid"
    )]
    Status,
    /// Generate a key inside the vault
    #[command(
        after_long_help = CREATE_EXAMPLES
    )]
    Create {
        /// Key name
        name: String,
        /// aes*, xts*, rsa2048/3072/4096, p256, p384, ed25519
        ///
        /// aes128, aes256, xts128, xts256 (symmetric); rsa2048, rsa3072,
        /// rsa4096, p256, p384, ed25519 (a key pair: the private half stays in
        /// the vault, `memveil vault pubkey` prints the public half).
        #[arg(long, default_value = "aes256", value_parser = creatable_kind, verbatim_doc_comment)]
        kind: KeyKind,
        /// Seal the key to disk so it survives restarts
        #[arg(long)]
        persistent: bool,
        /// Back the key up to KMIP, wrapped under this KMIP key (UID)
        ///
        /// Back the new key up to the KMIP server (--kmip...): the key is made
        /// here (getrandom, in secret memory), wrapped with AES-256-GCM under
        /// the KMIP AES-256 key UID, registered as Secret Data named
        /// memveil-backup/NAME, and only then imported into the vault.
        /// `memveil vault restore` brings it into another host's vault.
        #[arg(long, value_name = "UID", verbatim_doc_comment)]
        kmip_backup: Option<String>,
        /// KMIP Operation Policy Name for the backup (who may restore it)
        #[arg(long, value_name = "NAME", requires = "kmip_backup")]
        kmip_policy: Option<String>,
        /// The KMIP server (with --kmip-backup)
        #[command(flatten)]
        kmip: Box<KmipArgs>,
    },
    /// Restore a key backed up to KMIP (`create --kmip-backup`) into this vault
    #[command(after_long_help = RESTORE_EXAMPLES)]
    Restore {
        /// Key name (the name it was backed up under)
        name: String,
        /// The backup's KMIP Unique Identifier (printed by create --kmip-backup)
        #[arg(long, value_name = "UID")]
        kmip_id: String,
        /// The KMIP key the backup is wrapped under
        #[arg(long, value_name = "UID")]
        kmip_kek: String,
        /// Seal the key to disk so it survives restarts
        #[arg(long)]
        persistent: bool,
        /// The KMIP server
        #[command(flatten)]
        kmip: Box<KmipArgs>,
    },
    /// Import a key, private key or certificate from a file; keys never come back out
    ///
    /// Import a key from a file: an AES/XTS key as raw bytes or hex; a private
    /// key as PKCS#8, PKCS#1, SEC 1 (PEM or DER) or OpenSSH (unencrypted); a
    /// certificate (PEM or DER). The file is read into secret memory and the
    /// copy wiped. One way: keys never come back out (a key pair's public
    /// half does, through `pubkey`).
    #[command(after_long_help = IMPORT_EXAMPLES, verbatim_doc_comment)]
    Import {
        /// Key name
        name: String,
        /// Kind (default aes256 for raw or hex files; read from a key file)
        ///
        /// aes128, aes256, xts128, xts256 (default aes256 for raw or hex
        /// files); rsa2048 ... ed25519, cert: read from the file, and checked
        /// against it when given.
        #[arg(long, verbatim_doc_comment)]
        kind: Option<KeyKind>,
        /// File holding the key
        #[arg(long, value_name = "FILE")]
        key_file: PathBuf,
        /// Seal the key to disk
        #[arg(long)]
        persistent: bool,
    },
    /// List the keys this user owns or is granted
    #[command(
        after_long_help = "Examples:\n  memveil vault list    # name, id, kind, owner, versions, ACL: never key bytes"
    )]
    List,
    /// Print an asymmetric key's public half (or a certificate)
    #[command(after_long_help = PUBKEY_EXAMPLES)]
    Pubkey {
        /// Key name
        name: String,
        /// pem (SubjectPublicKeyInfo; a certificate's PEM), ssh, der
        ///
        /// pem (SubjectPublicKeyInfo; a certificate's PEM), ssh (an
        /// authorized_keys line), der.
        #[arg(long, default_value = "pem", verbatim_doc_comment)]
        format: String,
    },
    /// Add a new random version of a key (old versions still decrypt)
    #[command(after_long_help = "Examples:\n  memveil vault rotate app")]
    Rotate {
        /// Key name
        name: String,
    },
    /// Wipe a key and all its versions
    #[command(after_long_help = "Examples:\n  memveil vault destroy app")]
    Destroy {
        /// Key name
        name: String,
    },
    /// Grant a user permissions on a key (e = encrypt, d = decrypt, a = admin)
    #[command(
        after_long_help = "Examples:\n  memveil vault grant app 1000 ed    # uid 1000 may encrypt and decrypt with app"
    )]
    Grant {
        /// Key name
        name: String,
        /// User id
        uid: u32,
        /// Letters from "eda"
        perms: String,
    },
    /// Remove a user from a key's ACL
    #[command(after_long_help = "Examples:\n  memveil vault revoke app 1000")]
    Revoke {
        /// Key name
        name: String,
        /// User id
        uid: u32,
    },
    /// Encrypt a file or stdin to a file or stdout
    #[command(after_long_help = ENCRYPT_EXAMPLES)]
    Encrypt(CryptArgs),
    /// Decrypt what `encrypt` wrote
    #[command(
        after_long_help = "Examples:\n  memveil vault decrypt --key app -i out > in    # mode, IV, key version from the header"
    )]
    Decrypt(CryptArgs),
}

/// `memveil vault serve --help`, after the options.
const SERVE_EXAMPLES: &str = "\
Examples:
  memveil vault serve --vault /run/memveil/vault.sock
  memveil vault serve --state /var/lib/memveil-vault --passphrase-file /etc/memveil/pass
  memveil vault serve --state /var/lib/memveil-vault --kmip-kek 42 \\
      --kmip kms.example.net:5696 --kmip-cert host.crt --kmip-key host.key --kmip-ca ca.crt
  memveil vault serve --state /var/lib/memveil-vault --kmip-kek 42   # /etc/memveil/kmip.toml
  memveil vault serve --keyid-bits 6 --key-admin 1000     # uid 1000 may program KeyIDs
  MEMVEIL_SECRETMEM=off memveil vault serve --allow-level=locked   # mlock only (tests)";

/// `memveil vault import --help`, after the options.
const IMPORT_EXAMPLES: &str = "\
Examples:
  memveil vault import app --kind aes256 --key-file key.hex && shred -u key.hex
  memveil vault import tls.rsa --key-file server.key      # PKCS#8/PKCS#1/SEC 1, PEM or DER
  memveil vault import ssh.me --key-file ~/.ssh/id_ed25519   # an unencrypted OpenSSH key
  memveil vault import tls.crt --key-file server.crt      # a certificate: public data";

/// `memveil vault pubkey --help`, after the options.
const PUBKEY_EXAMPLES: &str = "\
Examples:
  memveil vault pubkey tls.rsa > tls.pub.pem              # SubjectPublicKeyInfo
  memveil vault pubkey ssh.me --format ssh >> ~/.ssh/authorized_keys
  memveil vault pubkey tls.crt                            # a certificate's PEM";

/// `memveil vault create --help`, after the options.
const CREATE_EXAMPLES: &str = "\
Examples:
  memveil vault create app
  memveil vault create disk0 --kind xts256 --persistent   # the vault needs --state
  memveil vault create tls --kind p256 && memveil vault pubkey tls   # a key pair
  memveil vault create app --persistent --kmip-backup 42 --kmip-policy fleet \\
      --kmip-config /etc/memveil/kmip.toml                 # wrapped under KMIP key 42";

/// `memveil vault restore --help`, after the options.
const RESTORE_EXAMPLES: &str = "\
Examples:
  memveil vault restore app --kmip-id 57 --kmip-kek 42 --persistent   # on another host";

/// `memveil vault encrypt --help`, after the options.
const ENCRYPT_EXAMPLES: &str = "\
Examples:
  memveil vault encrypt --key app -i in -o out           # AES-GCM, a 44-byte header first
  tar c dir | memveil vault encrypt --key app --mode cbc > dir.tar.mvve";

/// Flags of encrypt/decrypt.
#[derive(clap::Args, Debug)]
pub struct CryptArgs {
    /// Key name
    #[arg(long, value_name = "NAME")]
    pub key: String,
    /// ecb, cbc, ctr, xts, gcm (decrypt reads the header)
    ///
    /// ecb, cbc, ctr, xts, gcm (encrypt only; decrypt reads it from the header).
    #[arg(long, default_value = "gcm", verbatim_doc_comment)]
    pub mode: Mode,
    /// Input file (default stdin)
    #[arg(short, long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// Output file (default stdout)
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// Where the KMIP server is and this host's credentials for it (flags over
/// the file `--kmip-config`, default `/etc/memveil/kmip.toml`); docs/kmip.md.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct KmipArgs {
    /// KMIP server, HOST or HOST:PORT (port 5696 by default)
    #[arg(long = "kmip", value_name = "HOST:PORT")]
    pub kmip: Option<String>,
    /// This host's KMIP client certificate (PEM)
    #[arg(long, value_name = "FILE")]
    pub kmip_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM)
    #[arg(long, value_name = "FILE")]
    pub kmip_key: Option<PathBuf>,
    /// The CA that signed the KMIP server's certificate (PEM)
    #[arg(long, value_name = "FILE")]
    pub kmip_ca: Option<PathBuf>,
    /// KMIP settings file (default /etc/memveil/kmip.toml, when it exists)
    ///
    /// KMIP settings file of `key = "value"` lines: url, cert, key, ca,
    /// timeout_ms (default /etc/memveil/kmip.toml, when it exists); flags win.
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    pub kmip_config: Option<PathBuf>,
}

impl KmipArgs {
    /// The flags as overrides of the settings file.
    #[must_use]
    pub fn overrides(&self) -> memveil_kmip::config::Overrides {
        memveil_kmip::config::Overrides {
            url: self.kmip.clone(),
            cert: self.kmip_cert.clone(),
            key: self.kmip_key.clone(),
            ca: self.kmip_ca.clone(),
            file: self.kmip_config.clone(),
        }
    }

    /// The resolved configuration.
    ///
    /// # Errors
    /// A setting missing from flags and file, or an unreadable file.
    pub fn resolve(&self) -> Result<memveil_kmip::Config, CliError> {
        Ok(self.overrides().resolve()?)
    }
}

/// Flags of `serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// State directory for the sealed keystore (persistent keys)
    #[arg(long, value_name = "DIR")]
    pub state: Option<PathBuf>,
    /// File holding the keystore passphrase (stretched with Argon2id)
    #[arg(long, value_name = "FILE", conflicts_with_all = ["key_file", "kmip_kek"])]
    pub passphrase_file: Option<PathBuf>,
    /// File holding a 32-byte keystore key (raw or 64 hex digits)
    #[arg(long, value_name = "FILE", conflicts_with = "kmip_kek")]
    pub key_file: Option<PathBuf>,
    /// KMIP id of the AES-256 key that seals the keystore
    ///
    /// Unique Identifier of an AES-256 key on the KMIP server (--kmip...):
    /// fetched into secret memory at every start, it seals the keystore and
    /// is never written to disk. A server that refuses leaves the keystore
    /// closed and the vault not started.
    #[arg(long, value_name = "UID", verbatim_doc_comment)]
    pub kmip_kek: Option<String>,
    /// With --kmip-kek: a copy sealed by this passphrase file
    ///
    /// With --kmip-kek: also keep keys.vault.fallback, the keystore sealed
    /// with this passphrase (Argon2id), in step with keys.vault. If the KMS is
    /// lost for good, `serve --passphrase-file FILE` opens the copy and seals
    /// the keystore with the passphrase from then on.
    #[arg(long, value_name = "FILE", requires = "kmip_kek", verbatim_doc_comment)]
    pub kmip_fallback: Option<PathBuf>,
    /// The KMIP server (with --kmip-kek)
    #[command(flatten)]
    pub kmip: KmipArgs,
    /// Accept mlock-ed memory for keys without memfd_secret
    ///
    /// Accept a weaker protection level when memfd_secret is unavailable
    /// ("locked": mlock only, readable by root).
    #[arg(long, value_name = "LEVEL", verbatim_doc_comment)]
    pub allow_level: Option<String>,
    /// Argon2id memory for a new keystore, KiB
    #[arg(long, value_name = "KIB", default_value_t = 65536)]
    pub kdf_memory_kib: u32,
    /// Argon2id iterations for a new keystore
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub kdf_iterations: u32,
    /// Connections one uid may have open at once
    ///
    /// Connections one uid may have open at once (per uid, across all its processes).
    #[arg(long, value_name = "N", default_value_t = 64, verbatim_doc_comment)]
    pub max_connections: usize,
    /// Keys one uid may own
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_keys: usize,
    /// Key versions the keys of one uid may hold in all
    ///
    /// Key versions (`rotate` adds one) the keys of one uid may hold in all.
    #[arg(long, value_name = "N", default_value_t = 1024, verbatim_doc_comment)]
    pub max_versions: usize,
    /// KiB of the secret pool one uid may take (default: --pool-kib / 4)
    ///
    /// KiB of the secret pool one uid's keys and connections may take (default:
    /// a quarter of --pool-kib).
    #[arg(long, value_name = "KIB", verbatim_doc_comment)]
    pub uid_pool_kib: Option<usize>,
    /// Secret heap one uid's asymmetric keys may take, KiB
    ///
    /// KiB of the secret heap for asymmetric keys (--asym-heap-kib) one uid's
    /// keys may take, each counted at its type's estimate (default: a quarter of
    /// the heap outside the reserve kept for new threads).
    #[arg(long, value_name = "KIB", verbatim_doc_comment)]
    pub uid_asym_heap_kib: Option<usize>,
    /// Lanes one uid may have open (a vault thread each)
    ///
    /// Lanes one uid may have open (each is a vault thread with a secret stack).
    #[arg(long, value_name = "N", default_value_t = 64, verbatim_doc_comment)]
    pub max_lanes: usize,
    /// Buffers one uid may have registered
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_buffers: usize,
    /// Shared areas one uid may have registered
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_areas: usize,
    /// MiB of shared areas one uid may have registered
    #[arg(long, value_name = "MIB", default_value_t = 4096)]
    pub max_area_mib: u64,
    /// Longest GCM message, MiB
    ///
    /// Longest GCM message, MiB (opening one takes as much of the vault's
    /// private memory).
    #[arg(long, value_name = "MIB", default_value_t = 64, verbatim_doc_comment)]
    pub max_gcm_mib: usize,
    /// Secret pool for key objects, KiB
    #[arg(long, value_name = "KIB", default_value_t = 2048)]
    pub pool_kib: usize,
    /// Socket file mode (octal)
    #[arg(long, value_name = "MODE", default_value = "666")]
    pub socket_mode: String,
    /// Microseconds a lane worker spins before sleeping
    #[arg(long, value_name = "US", default_value_t = 50)]
    pub spin_us: u64,
    /// Secret heap for aws-lc (asymmetric keys), KiB
    ///
    /// Secret heap for aws-lc, KiB (asymmetric keys: about 5 KiB per RSA-2048
    /// key, 9 per RSA-4096, under 1 per EC key, 160 KiB once).
    #[arg(long, value_name = "KIB", default_value_t = 2048, verbatim_doc_comment)]
    pub asym_heap_kib: usize,
    /// KeyID bits of the host key table: KeyIDs 1..=2^BITS-1
    ///
    /// KeyID bits of the host key table (`memveil key`): KeyIDs 1..=2^BITS-1
    /// (1..=15; hardware: 6 on Ice Lake servers).
    #[arg(long, value_name = "BITS", default_value_t = memveil_engine::Config::default().keyid_bits,
          verbatim_doc_comment)]
    pub keyid_bits: u32,
    /// A uid that may program and clear KeyIDs (repeatable)
    ///
    /// A uid that may program and clear KeyIDs besides the vault's own uid and
    /// root (repeatable).
    #[arg(long = "key-admin", value_name = "UID", verbatim_doc_comment)]
    pub key_admins: Vec<u32>,
    /// Install no seccomp allowlist (debugging only; logged loudly)
    ///
    /// Install no seccomp allowlist: every system call stays allowed (for
    /// debugging; a WARNING line says so at start). See SECURITY.md.
    #[arg(long, verbatim_doc_comment)]
    pub no_seccomp: bool,
}

/// Builds the daemon configuration from flags.
///
/// # Errors
/// A bad flag value, worded for people.
pub fn config(socket: PathBuf, a: &ServeArgs) -> Result<Config, CliError> {
    let mut c = Config::new(socket);
    c.policy = match a.allow_level.as_deref() {
        None | Some("secret") => Policy::secret_only(),
        Some(l) => Policy::allow(l.parse::<Level>()?),
    };
    c.state.clone_from(&a.state);
    c.kek = match (&a.passphrase_file, &a.key_file, &a.kmip_kek) {
        (Some(p), _, _) => Some(KekSource::PassphraseFile(p.clone())),
        (_, Some(k), _) => Some(KekSource::KeyFile(k.clone())),
        (_, _, Some(uid)) => Some(KekSource::Kmip {
            config: a.kmip.resolve()?,
            uid: uid.clone(),
            fallback: a.kmip_fallback.clone(),
        }),
        _ => None,
    };
    if a.kmip_kek.is_none() && !a.kmip.overrides().is_empty() {
        return Err(
            "--kmip... settings are for --kmip-kek UID (the key that seals the keystore)".into(),
        );
    }
    c.kdf = KdfParams {
        m_kib: a.kdf_memory_kib,
        t: a.kdf_iterations,
        p: 1,
    };
    c.quotas = Quotas {
        connections: a.max_connections,
        keys: a.max_keys,
        versions: a.max_versions,
        uid_pool_bytes: a.uid_pool_kib.map(|k| k.saturating_mul(1024)),
        uid_asym_heap_bytes: a.uid_asym_heap_kib.map(|k| k.saturating_mul(1024)),
        lanes: a.max_lanes,
        buffers: a.max_buffers,
        areas: a.max_areas,
        area_bytes: a.max_area_mib.saturating_mul(1 << 20),
        gcm_bytes: a.max_gcm_mib.saturating_mul(1 << 20),
    };
    c.pool_bytes = a.pool_kib.saturating_mul(1024);
    c.socket_mode = u32::from_str_radix(&a.socket_mode, 8)
        .map_err(|_| format!("--socket-mode {:?} is not an octal mode", a.socket_mode))?;
    c.spin = Duration::from_micros(a.spin_us);
    c.keyid_bits = a.keyid_bits;
    c.asym_heap_bytes = a.asym_heap_kib.saturating_mul(1024);
    c.key_admins.clone_from(&a.key_admins);
    Ok(c)
}

fn print_key(out: &mut impl std::io::Write, k: &KeyInfo) -> std::io::Result<()> {
    let acl: Vec<String> = k
        .acl
        .iter()
        .map(|(u, p)| format!("{u}:{}", perms_str(*p)))
        .collect();
    writeln!(
        out,
        "{}\tid={}\tkind={}\towner={}\tversions={}\t{}\tacl={}",
        k.name,
        k.id,
        k.kind,
        k.owner,
        k.versions,
        if k.persistent {
            "persistent"
        } else {
            "ephemeral"
        },
        if acl.is_empty() {
            "-".into()
        } else {
            acl.join(",")
        }
    )
}

fn perms_str(p: u8) -> String {
    let mut s = String::new();
    for (b, c) in [
        (perm::ENCRYPT, 'e'),
        (perm::DECRYPT, 'd'),
        (perm::ADMIN, 'a'),
    ] {
        if p & b != 0 {
            s.push(c);
        }
    }
    s
}

fn parse_perms(s: &str) -> Result<u8, CliError> {
    let mut p = 0;
    for c in s.chars() {
        p |= match c {
            'e' => perm::ENCRYPT,
            'd' => perm::DECRYPT,
            'a' => perm::ADMIN,
            _ => return Err(format!("unknown permission {c:?}: use letters from \"eda\"").into()),
        };
    }
    if p == 0 {
        return Err("no permission given: use letters from \"eda\"".into());
    }
    Ok(p)
}

/// Header of files written by `encrypt`: magic, format, mode, padded flag,
/// reserved, key version (u32), IV/nonce/tweak (16), GCM tag (16).
const MAGIC: &[u8; 4] = b"MVVE";
const HDR: usize = 4 + 4 + 4 + 16 + 16;

fn read_input(p: Option<&PathBuf>) -> Result<Vec<u8>, CliError> {
    let mut v = Vec::new();
    match p {
        Some(p) => {
            v = std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()))?;
        }
        None => {
            std::io::stdin().read_to_end(&mut v)?;
        }
    }
    Ok(v)
}

fn write_output(p: Option<&PathBuf>, parts: &[&[u8]]) -> Result<(), CliError> {
    match p {
        Some(p) => {
            let mut f =
                std::fs::File::create(p).map_err(|e| format!("creating {}: {e}", p.display()))?;
            for b in parts {
                f.write_all(b)?;
            }
        }
        None => {
            let mut o = std::io::stdout().lock();
            for b in parts {
                o.write_all(b)?;
            }
            o.flush()?;
        }
    }
    Ok(())
}

fn encrypt_file(c: &mut Client, a: &CryptArgs) -> Result<(), CliError> {
    if a.mode == Mode::Cmac || a.mode.is_asym() {
        return Err(format!("{} does not encrypt a file: use ecb, cbc, ctr, xts or gcm (CMAC and the asymmetric operations are served through the ring, the PKCS#11 module and memveil agent)", a.mode.name()).into());
    }
    let k = c.key_info(&a.key)?;
    if !k.kind.serves(a.mode) {
        return Err(format!(
            "key {:?} is {}; it does not serve mode {}",
            k.name,
            k.kind,
            a.mode.name()
        )
        .into());
    }
    let mut data = read_input(a.input.as_ref())?;
    let pad = match a.mode {
        Mode::Ecb | Mode::Cbc => true,
        Mode::Xts => data.len() < 16,
        _ => false,
    };
    if pad {
        let n = 16 - data.len() % 16;
        data.extend(std::iter::repeat_n(u8::try_from(n).unwrap_or(16), n));
    }
    let mut iv = [0u8; 16];
    memveil_sys::getrandom(&mut iv)?;
    if a.mode == Mode::Gcm {
        iv[12..].fill(0);
    }
    let mut hdr = [0u8; HDR];
    hdr[..4].copy_from_slice(MAGIC);
    hdr[4] = 1;
    hdr[5] = a.mode.code();
    hdr[6] = u8::from(pad);
    hdr[8..12].copy_from_slice(&k.versions.to_le_bytes());
    hdr[12..28].copy_from_slice(&iv);
    let aad = hdr[..28].to_vec();
    let p = Crypt::new(k.id, a.mode)
        .iv(&iv)
        .version(k.versions)
        .aad(if a.mode == Mode::Gcm { &aad } else { &[] });
    let tag = c.encrypt(&p, &mut data)?;
    hdr[28..44].copy_from_slice(&tag);
    write_output(a.output.as_ref(), &[&hdr, &data])
}

fn decrypt_file(c: &mut Client, a: &CryptArgs) -> Result<(), CliError> {
    let k = c.key_info(&a.key)?;
    let input = read_input(a.input.as_ref())?;
    if input.len() < HDR || &input[..4] != MAGIC || input[4] != 1 {
        return Err("input is not a memveil vault ciphertext (bad header)".into());
    }
    let mode = Mode::from_code(input[5]).ok_or("input header names an unknown mode")?;
    let pad = input[6] == 1;
    let version = u32::from_le_bytes([input[8], input[9], input[10], input[11]]);
    let p = Crypt::new(k.id, mode)
        .iv(&input[12..28])
        .tag(&input[28..44])
        .version(version)
        .aad(if mode == Mode::Gcm { &input[..28] } else { &[] });
    let mut data = input[HDR..].to_vec();
    c.decrypt(&p, &mut data)?;
    if pad {
        let n = usize::from(*data.last().ok_or("empty padded ciphertext")?);
        if n == 0
            || n > 16
            || n > data.len()
            || !data[data.len() - n..].iter().all(|&b| usize::from(b) == n)
        {
            return Err("bad padding: wrong key, or the file was altered".into());
        }
        data.truncate(data.len() - n);
    }
    write_output(a.output.as_ref(), &[&data])
}

/// Reads at most `max` bytes of a key file into secret memory of this
/// process (`locked` at worst: the CLI is not the vault), never into an
/// ordinary buffer. Returns the pool (for further key buffers), the bytes
/// and how many were read; a file longer than `max` reads as `max` bytes.
///
/// # Errors
/// The file cannot be read, or no locked memory could be had.
pub fn read_secret_file(
    path: &std::path::Path,
    max: usize,
) -> Result<(SecretPool, memveil_secmem::SecretBox<[u8]>, usize), CliError> {
    let pool = SecretPool::new(2 * max + 4096, Policy::allow(Level::Locked))?;
    let mut raw = pool.alloc_bytes(max)?;
    let mut f =
        std::fs::File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
    let mut n = 0;
    loop {
        let r = f
            .read(&mut raw[n..])
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        if r == 0 || n + r >= raw.len() {
            n += r;
            break;
        }
        n += r;
    }
    Ok((pool, raw, n))
}

/// A KMIP client and the backup KEK `kek` fetched into its secret memory.
fn kmip_kek(
    kmip: &KmipArgs,
    kek: &str,
) -> Result<
    (
        memveil_kmip::Client,
        SecretPool,
        memveil_secmem::SecretBox<[u8]>,
    ),
    CliError,
> {
    let policy = Policy::allow(Level::Locked);
    let client = memveil_kmip::Client::new(kmip.resolve()?, policy)?;
    let key = client.get_key_len(kek, 32, "the backup key (AES-256)")?;
    Ok((client, SecretPool::new(16 * 1024, policy)?, key))
}

/// `create --kmip-backup`: a key made here, registered wrapped, then imported.
fn create_backed_up(
    c: &mut Client,
    name: &str,
    kind: KeyKind,
    persistent: bool,
    kek: &str,
    policy: Option<&str>,
    kmip: &KmipArgs,
) -> Result<(KeyInfo, String), CliError> {
    let (client, pool, kek_bytes) = kmip_kek(kmip, kek)?;
    let mut key = pool.alloc_bytes(kind.key_len())?;
    memveil_sys::getrandom(&mut key).map_err(|e| format!("getrandom: {e}"))?;
    let blob = crate::backup::wrap(&pool, &kek_bytes, kind, name, &key)?;
    let label = format!("memveil-backup/{name}");
    // Registered first: a key the vault holds always has its backup.
    let uid = client.register_secret(&blob, Some(&label), policy)?;
    let info = c.import_key(name, kind, persistent, &key)?;
    Ok((info, uid))
}

/// `restore`: the backup fetched, unwrapped in secret memory, imported.
fn restore(
    c: &mut Client,
    name: &str,
    uid: &str,
    kek: &str,
    persistent: bool,
    kmip: &KmipArgs,
) -> Result<KeyInfo, CliError> {
    let (client, pool, kek_bytes) = kmip_kek(kmip, kek)?;
    let blob = client.get_key(uid)?;
    let (kind, key) = crate::backup::unwrap(&pool, &kek_bytes, name, &blob)?;
    Ok(c.import_key(name, kind, persistent, &key)?)
}

fn import(
    c: &mut Client,
    name: &str,
    kind: Option<KeyKind>,
    key_file: &std::path::Path,
    persistent: bool,
) -> Result<KeyInfo, CliError> {
    let (pool, raw, n) = read_secret_file(key_file, 16384)?;
    if !kind.is_some_and(KeyKind::is_symmetric) {
        // A key file: parsed in this locked memory, sent from it, wiped.
        let mut scratch = pool.alloc_bytes(2 * n + 64)?;
        let mut out = pool.alloc_bytes(4096)?;
        match crate::keyfile::read_private(&raw[..n], &mut scratch, &mut out) {
            Ok((found, len)) => {
                if kind.is_some_and(|k| k != found) {
                    return Err(format!(
                        "{} holds a {found} key, not {}",
                        key_file.display(),
                        kind.map_or("", KeyKind::name)
                    )
                    .into());
                }
                return Ok(c.import_key(name, found, persistent, &out[..len])?);
            }
            Err(e) if kind.is_some() => return Err(format!("{}: {e}", key_file.display()).into()),
            Err(crate::keyfile::KeyFileError::Unknown(_)) => {}
            Err(e) => return Err(format!("{}: {e}", key_file.display()).into()),
        }
    }
    let kind = kind.unwrap_or(KeyKind::Aes256);
    let mut key = pool.alloc_bytes(kind.key_len())?;
    let mut end = n;
    while end > 0 && matches!(raw[end - 1], b'\n' | b'\r') {
        end -= 1;
    }
    if n == kind.key_len() {
        key.copy_from_slice(&raw[..n]);
    } else if end == 2 * kind.key_len() {
        for i in 0..kind.key_len() {
            let h = (raw[2 * i] as char).to_digit(16);
            let l = (raw[2 * i + 1] as char).to_digit(16);
            let (Some(h), Some(l)) = (h, l) else {
                return Err(format!("{}: not hex", key_file.display()).into());
            };
            key[i] = u8::try_from(h * 16 + l).unwrap_or(0);
        }
    } else {
        return Err(format!(
            "{}: a {kind} key is {} raw bytes or {} hex digits",
            key_file.display(),
            kind.key_len(),
            2 * kind.key_len()
        )
        .into());
    }
    Ok(c.import_key(name, kind, persistent, &key)?)
}

/// Runs a verb; returns the exit code. A reader that closes our stdout early
/// (`… | head`) is not an error.
///
/// # Errors
/// Anything that failed, worded for people.
pub fn run(args: Args) -> Result<u8, CliError> {
    match run_inner(args) {
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            Ok(0)
        }
        other => other,
    }
}

fn run_inner(args: Args) -> Result<u8, CliError> {
    let socket = args.vault.path();
    if let Cmd::Serve(s) = &args.cmd {
        let cfg = config(socket, s)?;
        let server = Server::start(cfg)?;
        // Ready (and sd_notify, which needs a socket) first; no client is
        // accepted before `run`, so none is served unfiltered.
        server.announce();
        server.lock_down(s.no_seccomp)?;
        server.run()?;
        return Ok(0);
    }
    let mut c = Client::connect(&socket)?;
    let mut out = std::io::stdout().lock();
    match &args.cmd {
        Cmd::Serve(_) => {}
        Cmd::Status => {
            let s = c.status()?;
            writeln!(
                out,
                "vault pid {}\nprotection level: {}{}\nbackend: {}\nkeys: {}\nclients: {}\npersistent keys: {}\nuptime: {} s\nclient sees level: {}",
                s.pid,
                s.level,
                if s.level == "secret" { " (memfd_secret: keys out of the kernel direct map)" } else { " (WEAKER: mlock only, readable by root and the kernel)" },
                s.backend,
                s.keys,
                s.clients,
                if s.durable { "enabled" } else { "disabled (no --state)" },
                s.uptime_s,
                c.level()
            )?;
        }
        Cmd::Create {
            name,
            kind,
            persistent,
            kmip_backup: None,
            ..
        } => print_key(&mut out, &c.create_key(name, *kind, *persistent)?)?,
        Cmd::Create {
            name,
            kind,
            persistent,
            kmip_backup: Some(kek),
            kmip_policy,
            kmip,
        } => {
            let (k, uid) = create_backed_up(
                &mut c,
                name,
                *kind,
                *persistent,
                kek,
                kmip_policy.as_deref(),
                kmip,
            )?;
            print_key(&mut out, &k)?;
            writeln!(out, "backup\tkmip-id={uid}\twrapped-under={kek}")?;
        }
        Cmd::Restore {
            name,
            kmip_id,
            kmip_kek,
            persistent,
            kmip,
        } => {
            let k = restore(&mut c, name, kmip_id, kmip_kek, *persistent, kmip)?;
            print_key(&mut out, &k)?;
        }
        Cmd::Import {
            name,
            kind,
            key_file,
            persistent,
        } => {
            let k = import(&mut c, name, *kind, key_file, *persistent)?;
            print_key(&mut out, &k)?;
        }
        Cmd::List => {
            for k in c.list_keys()? {
                print_key(&mut out, &k)?;
            }
        }
        Cmd::Pubkey { name, format } => {
            use crate::keyfile::{pem, spki_der, ssh_line};
            use crate::proto::PublicParts;
            match (c.public_key(name)?, format.as_str()) {
                (PublicParts::Key(p), "pem") => {
                    write!(out, "{}", pem("PUBLIC KEY", &spki_der(&p)))?
                }
                (PublicParts::Key(p), "ssh") => writeln!(out, "{}", ssh_line(&p, name))?,
                (PublicParts::Key(p), "der") => out.write_all(&spki_der(&p))?,
                (PublicParts::Cert(d), "pem") => write!(out, "{}", pem("CERTIFICATE", &d))?,
                (PublicParts::Cert(d), "der") => out.write_all(&d)?,
                (_, f) => {
                    return Err(format!("format {f:?}: pem, ssh or der (ssh for keys only)").into())
                }
            }
        }
        Cmd::Rotate { name } => print_key(&mut out, &c.rotate_key(name)?)?,
        Cmd::Destroy { name } => {
            c.destroy_key(name)?;
            writeln!(out, "destroyed {name}")?;
        }
        Cmd::Grant { name, uid, perms } => {
            print_key(&mut out, &c.grant(name, *uid, parse_perms(perms)?)?)?
        }
        Cmd::Revoke { name, uid } => print_key(&mut out, &c.revoke(name, *uid)?)?,
        Cmd::Encrypt(a) => {
            drop(out);
            encrypt_file(&mut c, a)?;
        }
        Cmd::Decrypt(a) => {
            drop(out);
            decrypt_file(&mut c, a)?;
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 35: `vault create --kind bogus` listed `cert`, which create then
    /// refused.
    #[test]
    fn create_kind_neither_offers_nor_takes_cert() {
        let e = creatable_kind("bogus").expect_err("refused");
        assert!(e.contains("aes256") && e.contains("ed25519"), "{e}");
        assert!(!e.contains("cert"), "{e}");
        let e = creatable_kind("cert").expect_err("refused");
        assert!(e.contains("vault import"), "{e}");
        assert_eq!(creatable_kind("p256"), Ok(KeyKind::P256));
    }

    /// Issue 35: the vault's socket is `--vault` everywhere; `--socket`
    /// stays as a hidden alias.
    #[test]
    fn the_vault_socket_is_vault_and_socket_is_a_hidden_alias() {
        use clap::{CommandFactory as _, Parser as _};
        #[derive(clap::Parser)]
        struct T {
            #[command(flatten)]
            a: Args,
        }
        for argv in [
            ["x", "--vault", "/v", "list"],
            ["x", "list", "--socket", "/v"],
        ] {
            let t = T::try_parse_from(argv).expect("parsed");
            assert_eq!(t.a.vault.socket, Some(PathBuf::from("/v")), "{argv:?}");
        }
        let help = T::command().render_help().to_string();
        assert!(
            help.contains("--vault <SOCKET>") && !help.contains("--socket "),
            "{help}"
        );
    }
}
