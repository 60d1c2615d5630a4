//! `memveil disk`: an aes-xts-plain64 (dm-crypt plain) image whose key stays
//! in the vault, served as a file in a FUSE mount and a loop device. The
//! logic lives in `memveil_disk`; this module parses and prints.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use memveil_disk::{Cipher, CreateOpts, KeySource, ServeOpts};
use memveil_vault::proto::KeyKind;

/// `memveil disk --help`, after the verbs.
const AFTER_LONG_HELP: &str = "\
Examples:
  memveil disk create disk.img --size 1G --key disk0          # a new key made in the vault
  memveil disk serve disk.img --mount /run/disk0              # prints a ready line
  mkfs.ext4 /dev/loop0 && mount /dev/loop0 /mnt               # the device it names
  memveil disk info disk.img

See docs/disk.md.";

/// Flags of `memveil disk`.
#[derive(Parser)]
#[command(after_long_help = AFTER_LONG_HELP)]
pub struct Args {
    #[command(subcommand)]
    verb: Verb,
}

#[derive(Subcommand)]
enum Verb {
    /// Create an image (or adopt an existing one) and bind it to a vault key
    ///
    /// Create an image (or adopt an existing one) and bind it to a vault key.
    /// Without --import-key-file or --existing-key, a new random key is made
    /// in the vault. The binding is written to IMAGE.memveil-disk.
    #[command(verbatim_doc_comment)]
    Create(CreateArgs),
    /// Serve an image as a file in a FUSE mount and a loop device
    ///
    /// Serve an image: FUSE mount with the decrypted image as a file, and a
    /// loop device over it; prints one `memveil-disk ready ...` line; SIGTERM
    /// or SIGINT takes everything down (filesystems on the device, the
    /// device, the mount).
    #[command(verbatim_doc_comment)]
    Serve(ServeArgs),
    /// Print an image's binding
    #[command(after_long_help = INFO_EXAMPLES)]
    Info {
        /// The image
        image: PathBuf,
    },
}

/// `memveil disk info --help`, after the options.
const INFO_EXAMPLES: &str = "\
Examples:
  memveil disk info disk.img    # cipher, key name, kind and version, sectors, size, check value";

/// `memveil disk create --help`, after the options.
const CREATE_EXAMPLES: &str = "\
Examples:
  memveil disk create disk.img --size 1G --key disk0 --persistent
  memveil disk create disk.img --size 1G --key disk1 --key-size 512 --sector-size 4096
  memveil vault create disk2 --kind xts128 && \\
      memveil disk create disk.img --key disk2 --existing-key
  memveil disk create old.img --key old --import-key-file old.key   # adopt a cryptsetup image
  memveil disk create base.img --size 1G --plain                    # the benchmark's baseline";

#[derive(Parser)]
#[command(after_long_help = CREATE_EXAMPLES)]
struct CreateArgs {
    /// The image file (created sparse when missing)
    image: PathBuf,
    /// Size of a new image (e.g. 1G, 64M); an existing image keeps its own
    #[arg(long, value_parser = super::rng::parse_size)]
    size: Option<u64>,
    /// The vault's socket
    #[arg(long, value_name = "SOCKET")]
    vault: Option<PathBuf>,
    /// The key's name in the vault
    #[arg(long, value_name = "NAME")]
    key: Option<String>,
    /// Key size in bits, as cryptsetup counts it: 256 or 512
    ///
    /// Key size in bits as cryptsetup counts it: 256 (AES-128-XTS, cryptsetup's
    /// default for plain mode) or 512 (AES-256-XTS).
    #[arg(long, value_name = "BITS", default_value_t = 256, value_parser = parse_key_size,
          verbatim_doc_comment)]
    key_size: u32,
    /// Import the key from this file (raw 32 or 64 bytes; one way)
    ///
    /// Import the key from this file (raw bytes, as `cryptsetup --key-file`
    /// reads them: 32 or 64). One way: nothing gives it back.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "existing_key",
        verbatim_doc_comment
    )]
    import_key_file: Option<PathBuf>,
    /// Bind a key already in the vault
    ///
    /// Bind a key already in the vault (`memveil vault create NAME --kind xts128`).
    #[arg(long, verbatim_doc_comment)]
    existing_key: bool,
    /// Keep the key across vault restarts (the vault needs --state)
    #[arg(long)]
    persistent: bool,
    /// Encryption sector size: 512 (default) or 4096
    #[arg(long, value_name = "BYTES", default_value_t = 512)]
    sector_size: u32,
    /// Tweaks count --sector-size sectors, not 512 bytes
    ///
    /// Tweaks count sectors of --sector-size instead of 512 bytes
    /// (cryptsetup --iv-large-sectors).
    #[arg(long, verbatim_doc_comment)]
    iv_large_sectors: bool,
    /// No encryption at all (a baseline for measurements)
    ///
    /// No encryption at all (a baseline for measurements; not dm-crypt format).
    #[arg(long, conflicts_with_all = ["key", "import_key_file", "existing_key", "vault"],
          verbatim_doc_comment)]
    plain: bool,
}

/// `memveil disk serve --help`, after the options.
const SERVE_EXAMPLES: &str = "\
Examples:
  memveil disk serve disk.img --vault /run/memveil/vault.sock --mount /run/disk0
  memveil disk serve disk.img --mount /run/disk0 --threads 2 --lanes-per-thread 2
  memveil disk serve disk.img --mount /run/disk0 --no-loop    # the file only
  kill -TERM PID                    # unmounts, detaches the loop device, unmounts FUSE";

#[derive(Parser)]
#[command(after_long_help = SERVE_EXAMPLES)]
struct ServeArgs {
    /// The image (bound with `memveil disk create`)
    image: PathBuf,
    /// The vault's socket
    #[arg(long, value_name = "SOCKET")]
    vault: Option<PathBuf>,
    /// An empty directory to mount the FUSE filesystem on
    #[arg(long, value_name = "DIR")]
    mount: PathBuf,
    /// FUSE worker threads, each with a vault lane
    ///
    /// FUSE worker threads, each with its own vault lane and buffer.
    #[arg(long, value_name = "N", default_value_t = 4, verbatim_doc_comment)]
    threads: usize,
    /// Vault lanes per worker
    ///
    /// Vault lanes per worker (2: one batch of sectors computed while the next is submitted).
    #[arg(long, value_name = "N", default_value_t = 1, verbatim_doc_comment)]
    lanes_per_thread: usize,
    /// Serve the file only; attach no loop device
    #[arg(long)]
    no_loop: bool,
    /// Seconds to wait for busy mounts at shutdown
    ///
    /// Seconds to wait for busy mounts and the loop device at shutdown
    /// before detaching lazily.
    #[arg(long, value_name = "SECS", default_value_t = 10, verbatim_doc_comment)]
    grace_secs: u64,
    /// Install no seccomp allowlist (debugging only; logged loudly)
    #[arg(long)]
    no_seccomp: bool,
}

fn parse_key_size(s: &str) -> Result<u32, String> {
    match s {
        "256" => Ok(256),
        "512" => Ok(512),
        _ => Err(format!(
            "{s}: 256 (AES-128-XTS) or 512 (AES-256-XTS) bits, as cryptsetup --key-size"
        )),
    }
}

/// Runs `memveil disk`.
///
/// # Errors
/// Whatever the disk server reports, with its cause and fix.
pub fn run(args: Args) -> anyhow::Result<u8> {
    match args.verb {
        Verb::Create(a) => create(a),
        Verb::Serve(a) => serve(a),
        Verb::Info { image } => {
            let b = memveil_disk::read_binding(&image)?;
            print!("{}", b.encode());
            Ok(0)
        }
    }
}

fn create(a: CreateArgs) -> anyhow::Result<u8> {
    let key = match (a.plain, a.key) {
        (true, _) => String::new(),
        (false, Some(k)) => k,
        (false, None) => anyhow::bail!("--key NAME is needed (or --plain for no encryption)"),
    };
    let source = match (a.import_key_file, a.existing_key) {
        (Some(f), _) => KeySource::Import(f),
        (None, true) => KeySource::Existing,
        (None, false) => KeySource::New,
    };
    let b = memveil_disk::create(&CreateOpts {
        image: a.image.clone(),
        size: a.size,
        cipher: if a.plain {
            Cipher::Plain
        } else {
            Cipher::AesXtsPlain64
        },
        vault: a.vault,
        key,
        source,
        key_kind: if a.key_size == 512 {
            KeyKind::Xts256
        } else {
            KeyKind::Xts128
        },
        persistent: a.persistent,
        sector_size: a.sector_size,
        iv_large_sectors: a.iv_large_sectors,
    })?;
    print!("{}", b.encode());
    if b.cipher == Cipher::AesXtsPlain64 {
        let g = b.geometry;
        eprintln!(
            "memveil disk: on a host with dm-crypt and the same key: cryptsetup open --type plain \
             --cipher aes-xts-plain64 --key-size {} {}{}--key-file KEY {} NAME",
            if b.key_kind == KeyKind::Xts256 {
                512
            } else {
                256
            },
            if g.sector_size == 512 {
                String::new()
            } else {
                format!("--sector-size {} ", g.sector_size)
            },
            if g.iv_large_sectors {
                "--iv-large-sectors "
            } else {
                ""
            },
            a.image.display()
        );
    }
    Ok(0)
}

fn serve(a: ServeArgs) -> anyhow::Result<u8> {
    let stop = memveil_sys::stopflag::stop_on_interrupt().context("installing signal handlers")?;
    let mut o = ServeOpts::new(a.image, a.vault, a.mount);
    o.threads = a.threads;
    o.lanes_per_thread = a.lanes_per_thread;
    o.attach_loop = !a.no_loop;
    o.grace = Duration::from_secs(a.grace_secs);
    let mut locked = Ok(());
    let s = memveil_disk::serve(&o, stop, |r| {
        // FUSE workers and the loop device are up: the filter covers them
        // (every thread), before the ready line.
        locked = super::lock_down(
            "memveil disk",
            memveil_disk::seccomp::DISK_SERVE,
            a.no_seccomp,
        );
        if locked.is_err() {
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            return;
        }
        for line in &r.recovered {
            eprintln!("memveil disk: recovered: {line}");
        }
        if !r.io_flusher {
            eprintln!(
                "memveil disk: warning: PR_SET_IO_FLUSHER refused (needs CAP_SYS_RESOURCE, Linux 5.6): \
                 under memory pressure the server could wait on writeback to its own device"
            );
        }
        println!(
            "memveil-disk ready device={} file={} cipher={} key={} level={} direct_io={} pid={}",
            r.device
                .as_ref()
                .map_or_else(|| "none".into(), |d| d.display().to_string()),
            r.file.display(),
            r.binding.cipher.name(),
            if r.binding.key.is_empty() {
                "none"
            } else {
                &r.binding.key
            },
            r.level,
            r.direct_io,
            std::process::id()
        );
    })?;
    locked?;
    for p in &s.teardown.problems {
        eprintln!("memveil disk: shutdown: {p}");
    }
    eprintln!(
        "memveil disk: stopped: read {} B, wrote {} B, {} syncs, {} errors; unmounted {:?}{}; loop detached: {}; FUSE unmounted{}",
        s.read_bytes,
        s.written_bytes,
        s.syncs,
        s.errors,
        s.teardown.unmounted,
        if s.teardown.lazy.is_empty() {
            String::new()
        } else {
            format!(" (lazily: {:?})", s.teardown.lazy)
        },
        s.teardown.detached,
        if s.fuse_lazy { " lazily" } else { "" }
    );
    Ok(u8::from(!s.teardown.problems.is_empty()))
}
