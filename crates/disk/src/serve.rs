//! The server: vault session, FUSE mount, loop device, and the way down.
//!
//! Start: read the binding, check the host, clean up after a server of the
//! same mount point that was killed, mark the process an I/O flusher (its
//! allocations never wait on writeback to the device it serves), connect to
//! the vault and compare the key check value, mount, attach the loop device
//! with direct I/O, report ready. Stop (SIGTERM, SIGINT, or the FUSE mount
//! going away): unmount every filesystem on the loop device (the server still
//! serving, so their last writes land), detach the loop device, unmount FUSE,
//! exit. The same order runs when a step of the start fails.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fuser::{Config, MountOption, SessionACL};
use memveil_vault::client::Session;
use memveil_vault::ring::{status, Entry, Op};
use memveil_vault::Client;

use crate::binding::{Binding, Cipher};
use crate::fs::{Counters, DiskFs};
use crate::host::{self, LoopDev, Teardown};
use crate::sectors::{slot_bytes, Sectors, VaultKey};
use crate::{io_err, read_binding, DiskError};

/// How to serve.
#[derive(Debug, Clone)]
pub struct ServeOpts {
    /// The image (its binding beside it).
    pub image: PathBuf,
    /// The vault's socket (not needed for a plain image).
    pub vault: Option<PathBuf>,
    /// An empty directory to mount the FUSE filesystem on.
    pub mount: PathBuf,
    /// FUSE worker threads (each with its own vault lanes and buffer).
    pub threads: usize,
    /// Vault lanes per worker (2 lets one batch of sectors be computed
    /// while the next is submitted).
    pub lanes_per_thread: usize,
    /// Attach a loop device (false: serve the file only).
    pub attach_loop: bool,
    /// How long to wait for busy mounts and the loop device at shutdown.
    pub grace: Duration,
    /// TEST ONLY, never set by `memveil disk serve`: acknowledge the write
    /// request of this number (counted from 1 since the start) without
    /// storing it, so a test can show that the crash test finds a lost
    /// acknowledged write. The test harness sets it from the environment
    /// variable `MEMVEIL_DISK_TEST_DROP_WRITE` (tests/common); nothing
    /// else reads that variable.
    #[doc(hidden)]
    pub test_drop_write: Option<u64>,
}

impl ServeOpts {
    /// Defaults for `image` at `mount`.
    #[must_use]
    pub fn new(image: PathBuf, vault: Option<PathBuf>, mount: PathBuf) -> Self {
        Self {
            image,
            vault,
            mount,
            threads: 4,
            lanes_per_thread: 1,
            attach_loop: true,
            grace: Duration::from_secs(10),
            test_drop_write: None,
        }
    }
}

/// What the server reports once it serves.
#[derive(Debug, Clone)]
pub struct Ready {
    /// The decrypted image as a file in the FUSE mount.
    pub file: PathBuf,
    /// The loop device, when attached.
    pub device: Option<PathBuf>,
    /// Whether the loop device does direct I/O on the file.
    pub direct_io: bool,
    /// The binding served.
    pub binding: Binding,
    /// The vault's protection level ("secret", "locked"), or "none" for plain.
    pub level: String,
    /// Whether `PR_SET_IO_FLUSHER` took.
    pub io_flusher: bool,
    /// What was cleaned up after a dead server at the same mount point.
    pub recovered: Vec<String>,
}

/// What the server did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub written_bytes: u64,
    /// Syncs served.
    pub syncs: u64,
    /// Requests that failed.
    pub errors: u64,
    /// The shutdown.
    pub teardown: Teardown,
    /// Whether the FUSE mount had to be detached lazily.
    pub fuse_lazy: bool,
}

/// Cleans up after a server killed while serving at `mount`: filesystems on
/// loop devices backed by its file, those loop devices, the dead mount.
fn recover(mount: &Path, grace: Duration) -> Result<Vec<String>, DiskError> {
    let mut said = Vec::new();
    if !host::is_dead_mount(mount) {
        return Ok(said);
    }
    for l in host::loops_under(mount) {
        let t = host::take_down(&l, grace);
        said.push(format!(
            "{} (left by a dead server): unmounted {:?}, detached: {}{}",
            l.path.display(),
            t.unmounted,
            t.detached,
            if t.problems.is_empty() {
                String::new()
            } else {
                format!(", problems: {}", t.problems.join("; "))
            }
        ));
    }
    memveil_sys::mount::unmount(mount, true).map_err(io_err(format!(
        "unmounting the dead mount {}",
        mount.display()
    )))?;
    said.push(format!(
        "{}: the dead server's FUSE mount, unmounted",
        mount.display()
    ));
    Ok(said)
}

/// Connects to the vault, checks the key against the binding and builds the
/// sector engine.
fn vault_engine(
    sock: &Path,
    b: &Binding,
    image: &Path,
    threads: usize,
    per: usize,
) -> Result<(Sectors, String), DiskError> {
    let mut c = Client::connect(sock)?;
    let info = c.key_info(&b.key)?;
    if info.kind != b.key_kind || info.versions < b.key_version {
        return Err(DiskError::WrongKey {
            key: b.key.clone(),
            version: b.key_version,
            image: image.to_owned(),
        });
    }
    let bytes = threads * slot_bytes(b.geometry);
    let (session, mut lanes) = c.session(bytes, threads * per)?;
    for l in &mut lanes {
        // Many workers share two CPUs with the vault: spin briefly, then sleep.
        l.set_spin(Duration::from_micros(20));
    }
    let check = lane_check(&session, &mut lanes[0], info.id, b.key_version)?;
    units_check(&session, &mut lanes[0], info.id, b.key_version)?;
    if check != b.check {
        return Err(DiskError::WrongKey {
            key: b.key.clone(),
            version: b.key_version,
            image: image.to_owned(),
        });
    }
    let level = c.level().to_owned();
    let key = VaultKey {
        session,
        key: info.id,
        version: b.key_version,
        client: c,
    };
    Ok((Sectors::vault(b.geometry, key, lanes, per), level))
}

/// An XTS encrypt entry of `key` over `[offset, +len)` of the lane's buffer.
fn xts_entry(key: u32, version: u32, buffer: u32, offset: u64, len: u64, seq: u128) -> Entry {
    Entry {
        op: Op::Encrypt,
        mode: memveil_vault::proto::Mode::Xts,
        key,
        version,
        buffer,
        offset,
        len,
        iv: seq.to_le_bytes(),
        tag: [0; 16],
        aad_offset: 0,
        aad_len: 0,
        unit: 0,
        step: 0,
    }
}

/// Runs `entries` on `lane`; the first refusal as an error about `what`.
fn run_checked(
    lane: &mut memveil_vault::client::LaneClient,
    entries: &[Entry],
    what: &str,
) -> Result<(), DiskError> {
    let out = lane.run(entries)?;
    match out.iter().find(|o| o.status != status::OK) {
        Some(o) => Err(DiskError::Usage(format!(
            "the vault refused {what}: {}",
            status::describe(o.status)
        ))),
        None => Ok(()),
    }
}

/// The key check value through a lane of the session.
fn lane_check(
    s: &Session,
    lane: &mut memveil_vault::client::LaneClient,
    key: u32,
    version: u32,
) -> Result<[u8; 8], DiskError> {
    s.write(0, &[0u8; crate::geometry::CHECK_BYTES])?;
    let seq = u128::from_le_bytes(crate::geometry::CHECK_TWEAK);
    let e = xts_entry(
        key,
        version,
        lane.buffer(),
        0,
        crate::geometry::CHECK_BYTES as u64,
        seq,
    );
    run_checked(lane, &[e], "the key check")?;
    let mut c = [0u8; 8];
    s.read(0, &mut c)?;
    Ok(c)
}

/// Checks that the vault computes an entry of several XTS data units as
/// those units, as [`Sectors`] sends runs of sectors. A vault built before
/// the entry's `unit` field would ignore it and encrypt the whole run as
/// one data unit: an image no dm-crypt could read, and garbage on reading
/// back. Two 16-byte units of zeros, once as one entry and once as two,
/// under sequence numbers whose upper half is not zero (no `plain64`
/// tweak of any sector, like the key check's).
fn units_check(
    s: &Session,
    lane: &mut memveil_vault::client::LaneClient,
    key: u32,
    version: u32,
) -> Result<(), DiskError> {
    s.write(0, &[0u8; 64])?;
    let first = u128::MAX - 1;
    let b = lane.buffer();
    let run = Entry {
        unit: 16,
        step: 1,
        ..xts_entry(key, version, b, 0, 32, first)
    };
    let units = [
        run,
        xts_entry(key, version, b, 32, 16, first),
        xts_entry(key, version, b, 48, 16, first.wrapping_add(1)),
    ];
    run_checked(lane, &units, "a multi-sector entry")?;
    let mut got = [0u8; 64];
    s.read(0, &mut got)?;
    if got[..32] != got[32..] {
        return Err(DiskError::Usage(
            "the vault computes a multi-sector ring entry as one XTS data unit: it is older \
             than this disk server (no data-unit size in its ring entries); restart the vault \
             with this build"
                .into(),
        ));
    }
    Ok(())
}

/// Serves until `stop` is raised (or the FUSE mount goes away), then takes
/// everything down in order. `on_ready` is called once the device serves.
///
/// # Errors
/// Binding, host, vault or mount problems at start; the way down is
/// best-effort and reported in the [`Summary`].
pub fn serve(
    o: &ServeOpts,
    stop: &AtomicBool,
    on_ready: impl FnOnce(&Ready),
) -> Result<Summary, DiskError> {
    let b = read_binding(&o.image)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&o.image)
        .map_err(io_err(format!("opening {}", o.image.display())))?;
    let len = file
        .metadata()
        .map_err(io_err(format!("{}", o.image.display())))?
        .len();
    if len != b.geometry.size {
        return Err(DiskError::Usage(format!(
            "{} has {len} bytes; its binding says {}",
            o.image.display(),
            b.geometry.size
        )));
    }
    host::check(o.attach_loop)?;
    let mount = o
        .mount
        .canonicalize()
        .map_err(io_err(format!("mount point {}", o.mount.display())))
        .or_else(|e| {
            // A dead FUSE mount cannot be resolved; its path is what we have.
            if host::is_dead_mount(&o.mount) {
                Ok(o.mount.clone())
            } else {
                Err(e)
            }
        })?;
    let recovered = recover(&mount, o.grace)?;
    let io_flusher = memveil_sys::process::set_io_flusher().is_ok();
    let threads = o.threads.max(1);
    let (sectors, level) = match b.cipher {
        Cipher::Plain => (Sectors::plain(b.geometry, threads), "none".to_owned()),
        Cipher::AesXtsPlain64 => {
            let sock = o.vault.as_ref().ok_or_else(|| {
                DiskError::Usage("an encrypted image needs the vault's socket (--vault)".into())
            })?;
            vault_engine(sock, &b, &o.image, threads, o.lanes_per_thread.max(1))?
        }
    };
    let name = o
        .image
        .file_name()
        .map_or_else(|| "disk".into(), |n| n.to_string_lossy().into_owned());
    let counters = Arc::new(Counters::default());
    let fs = DiskFs::new(
        name.clone(),
        file,
        sectors,
        counters.clone(),
        o.test_drop_write,
    );
    let mut cfg = Config::default();
    cfg.mount_options = vec![
        MountOption::FSName(host::FSNAME.into()),
        MountOption::NoAtime,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
    ];
    cfg.acl = SessionACL::Owner;
    cfg.n_threads = Some(threads);
    cfg.clone_fd = true;
    let session = fuser::Session::new(fs, &mount, &cfg)
        .map_err(io_err(format!("mounting FUSE at {}", mount.display())))?;
    let bg = session
        .spawn()
        .map_err(io_err("starting the FUSE workers"))?;
    let served = mount.join(&name);
    let mut dev: Option<LoopDev> = None;
    let mut started = Ok(());
    if o.attach_loop {
        match host::attach(&served, b.geometry.sector_size) {
            Ok(l) => dev = Some(l),
            Err(e) => started = Err(e),
        }
    }
    if started.is_ok() {
        on_ready(&Ready {
            file: served.clone(),
            device: dev.as_ref().map(|l| l.path.clone()),
            direct_io: dev.as_ref().is_some_and(LoopDev::direct_io),
            binding: b.clone(),
            level,
            io_flusher,
            recovered,
        });
        while !stop.load(Ordering::SeqCst) && !bg.guard.is_finished() {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let mut summary = Summary::default();
    if let Some(l) = &dev {
        summary.teardown = host::take_down(l, o.grace);
    }
    summary.fuse_lazy = if bg.guard.is_finished() {
        false
    } else {
        host::unmount_patiently(&mount, o.grace)
            .map_err(io_err(format!("unmounting {}", mount.display())))?
    };
    if !summary.fuse_lazy {
        let _ = bg.join();
    }
    summary.read_bytes = counters.read_bytes.load(Ordering::Relaxed);
    summary.written_bytes = counters.written_bytes.load(Ordering::Relaxed);
    summary.syncs = counters.syncs.load(Ordering::Relaxed);
    summary.errors = counters.errors.load(Ordering::Relaxed);
    started.map(|()| summary)
}
