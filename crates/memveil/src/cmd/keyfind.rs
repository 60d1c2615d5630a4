//! `memveil keyfind`: search a memory image, an ELF core file or a live
//! process for expanded AES-128/256 key schedules (as `aeskeyfind` does).

use std::path::PathBuf;

use anyhow::Context as _;
use memveil_keyfind::{read_core, read_process, read_raw, scan_image, Image};

/// `memveil keyfind --help`, after the options.
const AFTER_LONG_HELP: &str = "\
Keys are shown as a key check value (first 4 bytes of AES_K(0^128)) unless
--show-keys.

Exit status: 0 nothing found; 3 a key schedule, the pattern or a private key's
secret was found; 2 usage error; 1 the source could not be read.

Examples:
  memveil keyfind --pid $(pidof redis-server)          # a live process (root or its owner)
  gcore -o core $(pidof app) && memveil keyfind --core core.$(pidof app)
  memveil keyfind --pattern 73656372657421 image.raw   # also look for these bytes
  memveil keyfind --json --max-errors 0 image.raw      # exact schedules only, as JSON
  memveil keyfind --core core.1234 --private-key server.key  # an RSA/EC/Ed25519 key's secrets

See docs/keyfind.md.";

/// Flags of `memveil keyfind`.
///
/// Exit status: 0 nothing found, 3 at least one key schedule (or the
/// `--pattern`, or a `--private-key` secret) found, 2 usage error, 1 the
/// source could not be read.
#[derive(clap::Args)]
#[command(after_long_help = AFTER_LONG_HELP)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["pid", "core", "file"])))]
pub struct Args {
    /// Scan every readable mapping of this live process
    ///
    /// Scan every readable mapping of this live process (/proc/PID/mem; needs
    /// ptrace rights: same user and dumpable, or root).
    #[arg(long, conflicts_with_all = ["core", "file"], verbatim_doc_comment)]
    pid: Option<u32>,
    /// Scan an ELF64 core file (gcore or kernel core)
    ///
    /// Scan the PT_LOAD segments of an ELF64 core file (gcore or kernel core).
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "file",
        verbatim_doc_comment
    )]
    core: Option<PathBuf>,
    /// Scan a raw memory image (offsets are file offsets)
    file: Option<PathBuf>,
    /// Largest number of wrong bits in a schedule still reported
    #[arg(long, value_name = "BITS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(0..=64))]
    max_errors: u32,
    /// Also search for these exact bytes (hex), e.g. a known secret
    #[arg(long, value_name = "HEX")]
    pattern: Option<String>,
    /// Also search for the secrets of this private key file
    ///
    /// Also search for the secrets of this private key file (PKCS#8, PKCS#1,
    /// SEC 1 or OpenSSH): RSA's d, p and q, an EC scalar, an Ed25519 seed and
    /// expanded scalar, in both byte orders. The file is read into locked
    /// memory and wiped; the secrets are held masked while the scan runs.
    /// Repeat it for several keys.
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    private_key: Vec<PathBuf>,
    /// Print the keys themselves in hex (default: only a key check value)
    #[arg(long)]
    show_keys: bool,
    /// Print JSON
    #[arg(long)]
    json: bool,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Key check value: the first 4 bytes of AES_K(0^128), a standard way to
/// name a key without showing it.
fn kcv(key: &[u8]) -> String {
    let mut blk = [0u8; 16];
    match memveil_cipher::Aes::new(key) {
        Ok(a) => {
            a.encrypt_block(&mut blk);
            hex(&blk[..4])
        }
        Err(_) => "?".into(),
    }
}

fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        s.len().is_multiple_of(2) && !s.is_empty(),
        "--pattern must be a non-empty even number of hex digits"
    );
    (0..s.len() / 2)
        .map(|i| {
            s.get(2 * i..2 * i + 2)
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .context("--pattern must be hex digits only")
        })
        .collect()
}

/// Adds the secrets of the private key in `path` (read into locked memory,
/// parsed there, wiped) to `s`, masked.
fn add_key_secrets(s: &mut memveil_keyfind::Secrets, path: &std::path::Path) -> anyhow::Result<()> {
    let (pool, raw, n) = memveil_vault::cli::read_secret_file(path, 16384)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mut scratch = pool.alloc_bytes(2 * n + 64)?;
    let mut comp = pool.alloc_bytes(4096)?;
    let (kind, len) = memveil_vault::keyfile::read_private(&raw[..n], &mut scratch, &mut comp)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let alg = kind
        .asym()
        .with_context(|| format!("{}: a {kind}, not a private key", path.display()))?;
    let parts = memveil_asym::components::secret_parts(alg, &comp[..len])
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    for p in parts {
        if p.number {
            s.add_number(p.what, &p.value);
        } else {
            s.add(p.what, &p.value);
        }
    }
    Ok(())
}

/// What to do when `/proc/PID/…` of `pid` cannot be read, by cause: a PID
/// that is not there, or a refusal (whose fix depends on who asked).
fn process_hint(pid: u32, e: &memveil_keyfind::KeyfindError) -> String {
    let kind = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .map(std::io::Error::kind);
    match kind {
        Some(std::io::ErrorKind::NotFound) => {
            format!("no process {pid} (it has exited, or the PID is wrong)")
        }
        Some(std::io::ErrorKind::PermissionDenied) if memveil_sys::probe::euid() == 0 => format!(
            "reading process {pid}: refused even to root (kernel.yama.ptrace_scope=3, or a \
             security module such as AppArmor or SELinux forbids it)"
        ),
        Some(std::io::ErrorKind::PermissionDenied) => format!(
            "reading process {pid}: run as root or as its owner (a non-dumpable process needs root)"
        ),
        _ => format!("reading process {pid}"),
    }
}

/// Runs `memveil keyfind`.
///
/// # Errors
/// The source cannot be read or parsed, or `--pattern` is not hex.
pub fn run(a: Args) -> anyhow::Result<u8> {
    let pattern = a.pattern.as_deref().map(unhex).transpose()?;
    let mut secrets = memveil_keyfind::Secrets::new();
    for f in &a.private_key {
        add_key_secrets(&mut secrets, f)?;
    }
    let (what, img): (String, Image) = if let Some(pid) = a.pid {
        let img = read_process(pid).map_err(|e| {
            let hint = process_hint(pid, &e);
            anyhow::Error::new(e).context(hint)
        })?;
        (format!("process {pid}"), img)
    } else if let Some(c) = &a.core {
        (c.display().to_string(), read_core(c)?)
    } else if let Some(f) = &a.file {
        (f.display().to_string(), read_raw(f)?)
    } else {
        // clap's `source` group requires one; a usage error all the same.
        eprintln!("memveil keyfind: name a source: --pid N, --core FILE or FILE");
        return Ok(2);
    };
    let found = scan_image(&img, a.max_errors);
    let secret_hits = secrets.find(&img);
    let mut o = String::new();
    let pattern_hits: Vec<(u64, String)> = match &pattern {
        Some(p) => img
            .regions
            .iter()
            .flat_map(|r| {
                r.data
                    .windows(p.len())
                    .enumerate()
                    .filter(|(_, w)| w == p)
                    .map(move |(i, _)| (r.start + i as u64, r.name.clone()))
            })
            .collect(),
        None => Vec::new(),
    };
    if a.json {
        let keys: Vec<_> = found
            .iter()
            .map(|f| {
                let mut v = serde_json::json!({
                    "address": f.address, "region": f.region, "bits": f.bits,
                    "bit_errors": f.errors, "kcv": kcv(&f.key),
                });
                if a.show_keys {
                    v["key"] = hex(&f.key).into();
                }
                v
            })
            .collect();
        let unreadable: Vec<_> = img
            .unreadable
            .iter()
            .map(|u| serde_json::json!({"start": u.0, "len": u.1, "region": u.2, "why": u.3}))
            .collect();
        let hits: Vec<_> = pattern_hits
            .iter()
            .map(|h| serde_json::json!({"address": h.0, "region": h.1}))
            .collect();
        let shits: Vec<_> = secret_hits
            .iter()
            .map(
                |h| serde_json::json!({"address": h.address, "region": h.region, "secret": h.what}),
            )
            .collect();
        o.push_str(&format!(
            "{}\n",
            serde_json::to_string_pretty(&serde_json::json!({
                "source": what, "bytes_scanned": img.bytes(),
                "bytes_skipped": img.skipped_bytes(), "keys": keys,
                "pattern_hits": hits, "secret_hits": shits, "unreadable": unreadable,
            }))?
        ));
    } else {
        o.push_str(&format!(
            "scanned {what}: {} bytes in {} regions; skipped {} unreadable bytes in {} ranges\n",
            img.bytes(),
            img.regions.len(),
            img.skipped_bytes(),
            img.unreadable.len()
        ));
        // A protected region under `memveil run` can hold thousands of
        // evicted runs: list the first ones (--json lists all).
        const LISTED: usize = 32;
        for u in img.unreadable.iter().take(LISTED) {
            o.push_str(&format!(
                "  unreadable {:#x}+{:#x} {}: {}\n",
                u.0, u.1, u.2, u.3
            ));
        }
        if img.unreadable.len() > LISTED {
            o.push_str(&format!(
                "  ... and {} more unreadable ranges (--json lists them all)\n",
                img.unreadable.len() - LISTED
            ));
        }
        for f in &found {
            let k = if a.show_keys {
                hex(&f.key)
            } else {
                format!("kcv {}", kcv(&f.key))
            };
            o.push_str(&format!(
                "AES-{} at {:#x} in {} ({} bit errors): {k}\n",
                f.bits, f.address, f.region, f.errors
            ));
        }
        for h in &pattern_hits {
            o.push_str(&format!("pattern at {:#x} in {}\n", h.0, h.1));
        }
        for h in &secret_hits {
            o.push_str(&format!(
                "secret at {:#x} in {}: {}\n",
                h.address, h.region, h.what
            ));
        }
        let secret_note = if secrets.is_empty() {
            String::new()
        } else {
            format!(", {} private-key secret hits", secret_hits.len())
        };
        o.push_str(&format!(
            "{} key schedules, {} pattern hits{secret_note} in {} bytes read ({} bytes could not be read and were not searched)\n",
            found.len(),
            pattern_hits.len(),
            img.bytes(),
            img.skipped_bytes()
        ));
    }
    match std::io::Write::write_all(&mut std::io::stdout().lock(), o.as_bytes()) {
        // A reader that stops early (`| head`) is not an error.
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(e.into()),
        _ => {}
    }
    Ok(
        if found.is_empty() && pattern_hits.is_empty() && secret_hits.is_empty() {
            0
        } else {
            3
        },
    )
}
