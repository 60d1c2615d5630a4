//! `memveil key`: the host's key table, the software counterpart of TME-MK's
//! KeyIDs, held by the vault (docs/vault.md, "Host key table"). The checks,
//! commands and status codes are the engine's (`memveil_engine::KeyTable`);
//! this module parses flags, sends one request and prints the answer.

use std::io::Write as _;
use std::path::PathBuf;

use memveil_engine::{Algorithm, KeyIdState, KeyProgram, Status};
use memveil_vault::client::{ClientError, Programmed};
use memveil_vault::proto::{ErrorCode, KeyIdTable, MAX_KEY_FIELD};
use memveil_vault::Client;

/// Exit status when the vault refused the caller (not a key admin).
pub const EXIT_DENIED: u8 = 4;
/// Exit status for PCONFIG status `s` other than PROG_SUCCESS: `10 + s`.
pub const EXIT_PCONFIG_BASE: u8 = 10;

/// `memveil key --help`: the TME-MK analogy and the exit statuses.
pub const ABOUT: &str = "\
The host's key table: KeyIDs programmed as Intel TME-MK programs them with PCONFIG.

On TME-MK hardware the memory controller holds a table of KeyIDs; KeyID 0 is the
platform key (TME), random at reset and never readable, and each other KeyID is
programmed by ring-0 software with the PCONFIG leaf MKTME_KEY_PROGRAM: a random key
(KEYID_SET_KEY_RANDOM), a key the caller supplies (KEYID_SET_KEY_DIRECT), plaintext
(KEYID_NO_ENCRYPT), or back to the platform key (KEYID_CLEAR_KEY). PCONFIG answers
with a status code. Keys are write-only and do not survive a reset.

memveil's table is held by the vault (`memveil vault serve`, `--keyid-bits`, default
6: KeyIDs 1..=63), with the engine's own checks and status codes. Keys live in the
vault's secret memory; no request returns them; a vault restart clears the table.
Only the vault's own uid, root and uids given with `memveil vault serve --key-admin
UID` may program or clear (PCONFIG is ring-0 only); anyone may read the status.
Each KeyID has a generation, raised by every successful program or clear.

Exit status: 0 success; 1 an error (vault unreachable, unreadable file); 2 bad
flags; 4 refused: this uid may not program KeyIDs; 10 + the PCONFIG status for a
request the table refused: 11 INVALID_PROG_CMD, 12 ENTROPY_ERROR (retry),
13 INVALID_KEYID, 14 INVALID_ENC_ALG, 15 DEVICE_BUSY (retry).";

/// `memveil key --help`, after the verbs.
pub const AFTER_LONG_HELP: &str = "\
Examples:
  memveil vault serve &                                  # holds the host key table
  memveil key program --keyid 5 --mode random            # a random AES-XTS-128 key
  memveil run --keyid 5 -- ./server                      # a tenant under KeyID 5
  memveil key status                                     # the table and its tenants
  memveil key clear 5                                    # crypto-erase: tenants stopped

See docs/vault.md, \"Host key table\".";

/// Flags of `memveil key`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The vault's socket
    #[command(flatten)]
    pub vault: memveil_vault::cli::VaultSocket,
    /// What to do
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// How a KeyID is programmed.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModeArg {
    /// KEYID_SET_KEY_RANDOM: a key from the vault's DRNG (RDRAND, else getrandom).
    Random,
    /// KEYID_SET_KEY_DIRECT: the data key and tweak key from --key-file.
    Software,
    /// KEYID_NO_ENCRYPT: memory under this KeyID is plaintext.
    NoEncrypt,
}

/// `memveil key program --help`, after the options.
const PROGRAM_EXAMPLES: &str = "\
Examples:
  memveil key program --keyid 5 --mode random
  memveil key program --keyid 5 --mode random --alg aes-xts-256 --entropy-file seed.bin
  head -c 64 /dev/urandom > k && memveil key program --keyid 6 --mode software \\
      --alg aes-xts-256 --key-file k && shred -u k
  memveil key program --keyid 7 --mode no-encrypt       # tenants then need --accept-no-encrypt
  memveil key program --keyid 8 --mode software --kmip-id 42 \\
      --kmip kms.example.net --kmip-cert host.crt --kmip-key host.key --kmip-ca ca.crt
  memveil key program --keyid 8 --mode software --kmip-id 42   # settings in /etc/memveil/kmip.toml";

/// `memveil key clear --help`, after the options.
const CLEAR_EXAMPLES: &str = "\
Examples:
  memveil key clear 5         # KEYID_CLEAR_KEY: key wiped, tenants stopped (exit 123)";

/// `memveil key status --help`, after the options.
const STATUS_EXAMPLES: &str = "\
Examples:
  memveil key status                    # KeyID 0 and every KeyID programmed or cleared
  memveil key status --all              # every KeyID
  memveil key status --json | jq '.keyids[] | select(.generation > 0)'";

/// Verbs.
#[derive(clap::Subcommand, Debug)]
pub enum Cmd {
    /// Program a KeyID (PCONFIG MKTME_KEY_PROGRAM); its old key is wiped
    #[command(after_long_help = PROGRAM_EXAMPLES)]
    Program {
        /// The KeyID (1..=max; KeyID 0 is the platform key)
        ///
        /// The KeyID (1..=max; KeyID 0 is the platform key and cannot be programmed).
        #[arg(long, value_name = "N", verbatim_doc_comment)]
        keyid: u16,
        /// How to program it
        ///
        /// random: a key from the vault's DRNG (KEYID_SET_KEY_RANDOM); software:
        /// the keys in --key-file (KEYID_SET_KEY_DIRECT); no-encrypt: memory
        /// under the KeyID is plaintext (KEYID_NO_ENCRYPT).
        #[arg(long, value_enum, verbatim_doc_comment)]
        mode: ModeArg,
        /// aes-xts-128 (default) or aes-xts-256; not for no-encrypt
        #[arg(long)]
        alg: Option<Algorithm>,
        /// software: the data key then the tweak key, raw bytes
        ///
        /// software: raw bytes, the data key then the tweak key (2x16 bytes for
        /// aes-xts-128, 2x32 for aes-xts-256). Read by this command and sent once
        /// over the vault socket: it passes through this process's (locked)
        /// memory.
        #[arg(long, value_name = "F", verbatim_doc_comment)]
        key_file: Option<PathBuf>,
        /// random: raw bytes XORed into the vault's random key
        ///
        /// random: raw bytes XORed into the vault's random key (two halves, each
        /// the key length or 64 bytes), as PCONFIG mixes caller entropy.
        #[arg(long, value_name = "F", verbatim_doc_comment)]
        entropy_file: Option<PathBuf>,
        /// software: the key of this KMIP object, fetched from --kmip
        ///
        /// software: the KMIP object with this Unique Identifier (an AES key of
        /// 2x16 bytes for aes-xts-128, 2x32 for aes-xts-256: the data key then
        /// the tweak key), fetched over TLS straight into secret memory and
        /// sent once over the vault socket; never through a file.
        #[arg(long, value_name = "UID", conflicts_with_all = ["key_file", "entropy_file"],
              verbatim_doc_comment)]
        kmip_id: Option<String>,
        /// The KMIP server (with --kmip-id)
        #[command(flatten)]
        kmip: memveil_vault::cli::KmipArgs,
    },
    /// Clear a KeyID (KEYID_CLEAR_KEY): back to the platform key
    ///
    /// Clear a KeyID (KEYID_CLEAR_KEY): its key is wiped and it falls back to
    /// the platform key; the vault stops the KeyID's running tenants
    /// (`memveil run --keyid`) before it answers.
    #[command(after_long_help = CLEAR_EXAMPLES, verbatim_doc_comment)]
    Clear {
        /// The KeyID
        keyid: u16,
    },
    /// Show the table: mode, algorithm, generation, programmer, tenants
    ///
    /// Show the table: each KeyID's mode, algorithm, generation, who
    /// programmed it (never key bytes) and how many tenants (`memveil run
    /// --keyid`) run under it now ("?" and null from a vault that predates
    /// the count).
    #[command(after_long_help = STATUS_EXAMPLES, verbatim_doc_comment)]
    Status {
        /// Machine-readable output (every KeyID)
        #[arg(long)]
        json: bool,
        /// List every KeyID, not only those programmed or cleared
        ///
        /// List every KeyID, not only KeyID 0 and those programmed or cleared
        /// since the vault started.
        #[arg(long, verbatim_doc_comment)]
        all: bool,
    },
}

/// Runs `memveil key`.
///
/// # Errors
/// The vault cannot be reached, a file cannot be read, or a flag is wrong.
pub fn run(args: Args) -> anyhow::Result<u8> {
    let socket = args.vault.path();
    let mut c = Client::connect(&socket).map_err(|e| anyhow::anyhow!("{e}"))?;
    match args.cmd {
        Cmd::Status { json, all } => {
            let t = c.keyid_status().map_err(|e| anyhow::anyhow!("{e}"))?;
            // None from a vault that predates the count.
            let tenants = c.keyid_tenants().map_err(|e| anyhow::anyhow!("{e}"))?;
            let tenants = tenants.as_deref();
            let mut out = std::io::stdout().lock();
            let r = if json {
                writeln!(out, "{}", status_json(&t, tenants))
            } else {
                print_status(&mut out, &t, tenants, all)
            };
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                r => r?,
            }
            Ok(0)
        }
        Cmd::Clear { keyid } => answer(c.program_keyid(&KeyProgram::clear(keyid)), keyid, None),
        Cmd::Program {
            keyid,
            mode,
            alg,
            key_file,
            entropy_file,
            kmip_id,
            kmip,
        } => {
            if let Some(uid) = kmip_id {
                anyhow::ensure!(
                    mode == ModeArg::Software,
                    "--kmip-id goes with --mode software (the KMIP key is the KeyID's key)"
                );
                let alg = alg.unwrap_or(Algorithm::AesXts128);
                let key = kmip_key(&kmip, &uid, alg)?;
                let (f1, f2) = key.split_at(key.len() / 2);
                return answer(
                    c.program_keyid(&KeyProgram::direct(keyid, alg, f1, f2)),
                    keyid,
                    None,
                );
            }
            if !kmip.overrides().is_empty() {
                anyhow::bail!("--kmip... settings go with --kmip-id UID");
            }
            let file = match (mode, &key_file, &entropy_file) {
                (ModeArg::Software, Some(f), None) | (ModeArg::Random, None, Some(f)) => Some(f),
                (ModeArg::Random | ModeArg::NoEncrypt, None, None) => None,
                (ModeArg::Software, None, _) => {
                    anyhow::bail!("--mode software needs --key-file F (the data key then the tweak key, raw bytes)")
                }
                _ => anyhow::bail!(
                    "--key-file goes with --mode software, --entropy-file with --mode random"
                ),
            };
            if mode == ModeArg::NoEncrypt && alg.is_some() {
                anyhow::bail!(
                    "--mode no-encrypt takes no --alg: memory under the KeyID is plaintext"
                );
            }
            let alg = alg.unwrap_or(Algorithm::AesXts128);
            // Both fields at most MAX_KEY_FIELD bytes: one byte more tells a
            // longer file.
            let max = 2 * MAX_KEY_FIELD;
            let read = file
                .map(|f| {
                    memveil_vault::cli::read_secret_file(f, max + 1)
                        .map_err(|e| anyhow::anyhow!("{e}"))
                        .and_then(|(pool, raw, n)| {
                            anyhow::ensure!(
                                n <= max,
                                "{} is longer than {max} bytes: PCONFIG's two key fields hold {MAX_KEY_FIELD} bytes each",
                                f.display()
                            );
                            Ok((pool, raw, n))
                        })
                })
                .transpose()?;
            let bytes: &[u8] = read.as_ref().map_or(&[], |(_, raw, n)| &raw[..*n]);
            // The file splits in two halves; the engine judges their lengths.
            let (f1, f2) = bytes.split_at(bytes.len() / 2);
            let req = match mode {
                ModeArg::Random => KeyProgram::random(keyid, alg, f1, f2),
                ModeArg::Software => KeyProgram::direct(keyid, alg, f1, f2),
                ModeArg::NoEncrypt => KeyProgram::no_encrypt(keyid),
            };
            let hint = (mode == ModeArg::Software).then(|| {
                format!(
                    "--key-file holds raw bytes, the data key then the tweak key: {} bytes for {alg}; the file has {}",
                    2 * alg.key_len(),
                    bytes.len()
                )
            });
            answer(c.program_keyid(&req), keyid, hint.as_deref())
        }
    }
}

/// KMIP object `uid`'s bytes, in secret memory, checked to be `alg`'s two keys.
fn kmip_key(
    kmip: &memveil_vault::cli::KmipArgs,
    uid: &str,
    alg: Algorithm,
) -> anyhow::Result<memveil_secmem::SecretBox<[u8]>> {
    let cfg = kmip.resolve().map_err(|e| anyhow::anyhow!("{e}"))?;
    let policy = memveil_secmem::Policy::allow(memveil_secmem::Level::Locked);
    let client = memveil_kmip::Client::new(cfg, policy)?;
    let why = format!("--alg {alg} (the data key then the tweak key)");
    Ok(client.get_key_len(uid, 2 * alg.key_len(), &why)?)
}

/// Prints the vault's answer and returns the exit status.
fn answer(
    r: Result<Programmed, ClientError>,
    keyid: u16,
    hint: Option<&str>,
) -> anyhow::Result<u8> {
    let p = match r {
        Ok(p) => p,
        Err(ClientError::Refused {
            code: ErrorCode::Denied,
            message,
        }) => {
            eprintln!("memveil: refused: {message}");
            return Ok(EXIT_DENIED);
        }
        Err(e) => anyhow::bail!("KeyID {keyid}: {e}"),
    };
    match (p.status, p.state) {
        (Status::ProgSuccess, Some(s)) => {
            // After the status name, the vault's words on the KeyID's tenants.
            let tenants = p
                .message
                .strip_prefix(&p.status.to_string())
                .unwrap_or_default();
            println!(
                "KeyID {}: {} ({}) {}{tenants}",
                s.keyid,
                p.status,
                p.status as u8,
                fields(&s)
            );
            Ok(0)
        }
        (status, _) => {
            // The engine's words start with the status name, printed already.
            let why = p
                .message
                .strip_prefix(&format!("{status}: "))
                .unwrap_or(&p.message);
            eprintln!("memveil: KeyID {keyid}: {status} ({}): {why}", status as u8);
            if let (Status::InvalidProgCmd, Some(h)) = (status, hint) {
                eprintln!("memveil: {h}");
            }
            Ok(EXIT_PCONFIG_BASE + status as u8)
        }
    }
}

fn fields(s: &KeyIdState) -> String {
    format!(
        "mode={} alg={} generation={} programmed-by={}",
        s.mode.name(),
        s.mode.algorithm().map_or("-", Algorithm::name),
        s.generation,
        s.programmed_by
            .map_or_else(|| "-".to_owned(), |u| u.to_string())
    )
}

/// KeyID `keyid`'s running tenants, when the vault said (`tenants`, by KeyID).
pub(crate) fn tenants_of(tenants: Option<&[u32]>, keyid: u16) -> Option<u32> {
    tenants.map(|n| n.get(usize::from(keyid)).copied().unwrap_or(0))
}

fn print_status(
    out: &mut impl std::io::Write,
    t: &KeyIdTable,
    tenants: Option<&[u32]>,
    all: bool,
) -> std::io::Result<()> {
    let programmed = t.programmed();
    let running = tenants.map_or_else(
        || {
            "running tenants unknown (the vault predates the count: restart it with this build)"
                .to_owned()
        },
        |n| {
            format!(
                "{} running tenant(s)",
                n.iter().map(|&c| u64::from(c)).sum::<u64>()
            )
        },
    );
    writeln!(
        out,
        "host key table: KeyIDs 1..={} programmable, {programmed} programmed, {running}; keys in the vault's {} memory; cleared at vault restart",
        t.max_keyid, t.level
    )?;
    writeln!(
        out,
        "{:<6} {:<10} {:<11} {:>10} {:>13} {:>7}",
        "KEYID", "MODE", "ALG", "GENERATION", "PROGRAMMED-BY", "TENANTS"
    )?;
    for e in t
        .entries
        .iter()
        .filter(|e| all || e.keyid == 0 || e.generation > 0)
    {
        writeln!(
            out,
            "{:<6} {:<10} {:<11} {:>10} {:>13} {:>7}",
            e.keyid,
            e.mode.name(),
            e.mode.algorithm().map_or("-", Algorithm::name),
            e.generation,
            e.programmed_by
                .map_or_else(|| "-".to_owned(), |u| u.to_string()),
            tenants_of(tenants, e.keyid).map_or_else(|| "?".to_owned(), |n| n.to_string())
        )?;
    }
    Ok(())
}

fn status_json(t: &KeyIdTable, tenants: Option<&[u32]>) -> serde_json::Value {
    serde_json::json!({
        "max_keyid": t.max_keyid,
        "level": t.level,
        "keyids": t.entries.iter().map(|e| serde_json::json!({
            "keyid": e.keyid,
            "mode": e.mode.name(),
            "alg": e.mode.algorithm().map(Algorithm::name),
            "generation": e.generation,
            "programmed_by": e.programmed_by,
            "tenants": tenants_of(tenants, e.keyid),
        })).collect::<Vec<_>>(),
    })
}
