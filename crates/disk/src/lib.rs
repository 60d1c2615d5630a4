//! Disk encryption whose key never lives in readable memory: an
//! `aes-xts-plain64` block image (dm-crypt's plain format) served as a file
//! in a FUSE mount and attached to a loop device, every sector encrypted and
//! decrypted by the memveil vault through its shared-memory lanes.
//!
//! The data key is created in the vault (or imported once, one way) and the
//! image is bound to it by name ([`binding`]). The server holds only the
//! key's id: no key, no round key, no tweak key is ever in its memory, which
//! is the point (VM-Vault's use case: dm-crypt's keys otherwise sit in
//! kernel memory where a disclosure bug or a dump finds them).
//!
//! The image is the same bytes dm-crypt writes: a host that has dm-crypt
//! opens it with `cryptsetup open --type plain --cipher aes-xts-plain64
//! --key-size 256` (or 512) and the same key (`--sector-size 4096
//! [--iv-large-sectors]` for 4096-byte sectors). See docs/disk.md.
//!
//! What it refuses: to serve an image whose key check value does not match
//! the key the vault holds under the bound name; to change the image's size;
//! to pass discards down (holes would read as zeros and decrypt to garbage,
//! and would show which sectors are free); to start without FUSE, loop
//! devices or root (each refusal names the fix).
#![forbid(unsafe_code)]

pub mod binding;
mod fs;
pub mod geometry;
pub mod host;
mod order;
pub mod seccomp;
mod sectors;
mod serve;

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};

use memveil_vault::client::{ClientError, Crypt};
use memveil_vault::proto::{KeyKind, Mode};
use memveil_vault::Client;
use zeroize::Zeroizing;

pub use binding::{Binding, Cipher};
pub use fs::Counters;
pub use geometry::Geometry;
pub use sectors::{slot_bytes, MAX_IO};
pub use serve::{serve, Ready, ServeOpts, Summary};

/// Errors of the disk server and its verbs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskError {
    /// The vault refused or could not be reached.
    #[error("vault: {0}")]
    Vault(#[from] ClientError),
    /// A file could not be read or written.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The binding file is missing or wrong.
    #[error("{}: {msg}", path.display())]
    Binding {
        /// The binding file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// The key the vault holds under the bound name is not the image's key.
    #[error("the vault's key {key:?} (version {version}) is not the key image {} was written with: its check value differs (was the key destroyed and created again? serving would write garbage over the data, so the server refuses)", image.display())]
    WrongKey {
        /// Key name.
        key: String,
        /// Version.
        version: u32,
        /// The image.
        image: PathBuf,
    },
    /// The host lacks FUSE, loop devices or the rights to use them.
    #[error("{0}")]
    Host(String),
    /// A request that cannot be carried out as given.
    #[error("{0}")]
    Usage(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DiskError {
    let what = what.into();
    move |source| DiskError::Io { what, source }
}

/// Where the image's key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A new random key made in the vault.
    New,
    /// A key already in the vault under that name.
    Existing,
    /// Raw key bytes from a file (32 or 64 bytes, as `cryptsetup --key-file`
    /// reads them), imported once; the file stays the caller's to destroy.
    Import(PathBuf),
}

/// What `create` makes.
#[derive(Debug, Clone)]
pub struct CreateOpts {
    /// The image file (created sparse when missing).
    pub image: PathBuf,
    /// Its size, for a new image; an existing image keeps its own.
    pub size: Option<u64>,
    /// Cipher.
    pub cipher: Cipher,
    /// The vault's socket (not needed for [`Cipher::Plain`]).
    pub vault: Option<PathBuf>,
    /// The key's name in the vault.
    pub key: String,
    /// Where the key comes from.
    pub source: KeySource,
    /// `xts128` (cryptsetup `--key-size 256`, the default) or `xts256` (`--key-size 512`).
    pub key_kind: KeyKind,
    /// Keep the key across vault restarts (the vault needs `--state`).
    pub persistent: bool,
    /// 512 or 4096.
    pub sector_size: u32,
    /// Tweaks count sectors of `sector_size` (cryptsetup `--iv-large-sectors`).
    pub iv_large_sectors: bool,
}

/// The key check value of a bound key, computed by the vault.
///
/// # Errors
/// The vault's refusal.
pub fn check_value(c: &mut Client, key: u32, version: u32) -> Result<[u8; 8], DiskError> {
    let mut d = [0u8; geometry::CHECK_BYTES];
    c.encrypt(
        &Crypt::new(key, Mode::Xts)
            .iv(&geometry::CHECK_TWEAK)
            .version(version),
        &mut d,
    )?;
    let mut out = [0u8; 8];
    out.copy_from_slice(&d[..8]);
    Ok(out)
}

/// Reads a raw key file of exactly `n` bytes into memory that is wiped
/// when dropped.
fn read_key_file(path: &Path, n: usize) -> Result<Zeroizing<Vec<u8>>, DiskError> {
    let mut f = std::fs::File::open(path).map_err(io_err(format!("{}", path.display())))?;
    let mut k = Zeroizing::new(vec![0u8; n]);
    f.read_exact(&mut k).map_err(|_| {
        DiskError::Usage(format!(
            "{}: a key of {n} bytes is expected (raw bytes, as `cryptsetup --key-file` reads them)",
            path.display()
        ))
    })?;
    let mut extra = [0u8; 1];
    if f.read(&mut extra)
        .map_err(io_err(path.display().to_string()))?
        != 0
    {
        return Err(DiskError::Usage(format!(
            "{}: longer than the {n}-byte key expected (raw bytes, not hex)",
            path.display()
        )));
    }
    Ok(k)
}

/// Creates (or adopts) an image and its binding: makes or imports the key in
/// the vault, or binds an existing one, and writes `IMAGE.memveil-disk`.
///
/// All of it runs under the binding's lock (`IMAGE.memveil-disk.lock`,
/// [`memveil_sys::ipc::PathLock`]), taken without waiting before the check
/// for a binding: of two creates on one image at once, one binds it and the
/// other is refused before it makes a key or touches the image. Without it
/// both found no binding and the second renamed its binding over the first's.
///
/// # Errors
/// Another create binding the image now, an existing binding, a size that
/// is not whole sectors, the vault's refusal, a key of the wrong kind.
pub fn create(o: &CreateOpts) -> Result<Binding, DiskError> {
    let bpath = binding::path_for(&o.image);
    let lock = memveil_sys::ipc::PathLock::try_take(&bpath)
        .map_err(io_err(format!(
            "{}.lock (the binding's lock)",
            bpath.display()
        )))?
        .ok_or_else(|| {
            DiskError::Usage(format!(
                "{}.lock is held: another `memveil disk create` is binding {} now; let it \
                 finish, then `memveil disk info {}` shows the binding it wrote",
                bpath.display(),
                o.image.display(),
                o.image.display()
            ))
        })?;
    let made = create_locked(o, &bpath);
    lock.release();
    made
}

/// [`create`] under the binding's lock.
fn create_locked(o: &CreateOpts, bpath: &Path) -> Result<Binding, DiskError> {
    if bpath.exists() {
        return Err(DiskError::Usage(format!(
            "{} exists: the image is bound already (remove the binding only if you mean to \
             forget which key opens the image)",
            bpath.display()
        )));
    }
    let existing = std::fs::metadata(&o.image).ok().map(|m| m.len());
    let size = match (existing, o.size) {
        (Some(have), Some(want)) if have != want => {
            return Err(DiskError::Usage(format!(
                "{} exists with {have} bytes, not {want}: leave out --size to adopt it as it is",
                o.image.display()
            )))
        }
        (Some(have), _) => have,
        (None, Some(want)) => want,
        (None, None) => {
            return Err(DiskError::Usage(format!(
                "{} does not exist: give --size to create it",
                o.image.display()
            )))
        }
    };
    let geometry = Geometry::new(o.sector_size, o.iv_large_sectors, size)
        .map_err(|m| DiskError::Usage(format!("{}: {m}", o.image.display())))?;
    let b = match o.cipher {
        Cipher::Plain => Binding {
            cipher: Cipher::Plain,
            key: String::new(),
            key_kind: KeyKind::Xts128,
            key_version: 0,
            geometry,
            check: [0; 8],
        },
        Cipher::AesXtsPlain64 => {
            if !matches!(o.key_kind, KeyKind::Xts128 | KeyKind::Xts256) {
                return Err(DiskError::Usage(format!(
                    "aes-xts-plain64 takes an xts128 or xts256 key, not {}",
                    o.key_kind
                )));
            }
            let sock = o.vault.as_ref().ok_or_else(|| {
                DiskError::Usage("an encrypted image needs the vault's socket (--vault)".into())
            })?;
            let mut c = Client::connect(sock)?;
            let info = match &o.source {
                KeySource::New => c
                    .create_key(&o.key, o.key_kind, o.persistent)
                    .map_err(|e| key_exists(e, o))?,
                KeySource::Import(file) => {
                    let k = read_key_file(file, o.key_kind.key_len())?;
                    c.import_key(&o.key, o.key_kind, o.persistent, &k)?
                }
                KeySource::Existing => c.key_info(&o.key)?,
            };
            if !matches!(info.kind, KeyKind::Xts128 | KeyKind::Xts256) {
                return Err(DiskError::Usage(format!(
                    "vault key {:?} is an {} key; aes-xts-plain64 needs xts128 or xts256 \
                     (`memveil vault create NAME --kind xts128`)",
                    o.key, info.kind
                )));
            }
            let check = check_value(&mut c, info.id, info.versions)?;
            Binding {
                cipher: Cipher::AesXtsPlain64,
                key: o.key.clone(),
                key_kind: info.kind,
                key_version: info.versions,
                geometry,
                check,
            }
        }
    };
    if existing.is_none() {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&o.image)
            .map_err(io_err(format!("creating {}", o.image.display())))?;
        f.set_len(size)
            .map_err(io_err(format!("sizing {}", o.image.display())))?;
    }
    write_binding(bpath, &b)?;
    Ok(b)
}

/// A new key's name taken in the vault, while the image has no binding (the
/// caller checked): what a `create` stopped between making the key and
/// writing the binding leaves. Named with both ways on: bind the image to
/// that key, or pick another name. Other errors pass as they are.
fn key_exists(e: ClientError, o: &CreateOpts) -> DiskError {
    match e {
        ClientError::Refused {
            code: memveil_vault::proto::ErrorCode::Exists,
            ..
        } => DiskError::Usage(format!(
            "vault key {key:?} exists, but {img} has no binding: a `memveil disk create` stopped \
             after it made the key and before it wrote the binding leaves it so (or the name is \
             another key's). If it is this image's, `memveil disk create {img} --key {key} \
             --existing-key` binds the image to it; otherwise choose another --key",
            key = o.key,
            img = o.image.display()
        )),
        e => e.into(),
    }
}

/// Writes the binding file: a temporary file, `fsync`, `rename`, `fsync` of
/// the directory. Called under the binding's lock, after the check that no
/// binding is there: the temporary file is the lock holder's alone.
fn write_binding(path: &Path, b: &Binding) -> Result<(), DiskError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::File::create(&tmp).map_err(io_err(format!("{}", tmp.display())))?;
    f.write_all(b.encode().as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(io_err(format!("{}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io_err(format!("{}", path.display())))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Reads an image's binding.
///
/// # Errors
/// [`DiskError::Binding`] when missing or malformed.
pub fn read_binding(image: &Path) -> Result<Binding, DiskError> {
    let path = binding::path_for(image);
    let text = std::fs::read_to_string(&path).map_err(|e| DiskError::Binding {
        path: path.clone(),
        msg: format!(
            "{e} (the image is not bound to a key: `memveil disk create {}` binds it)",
            image.display()
        ),
    })?;
    Binding::parse(&text).map_err(|msg| DiskError::Binding { path, msg })
}
