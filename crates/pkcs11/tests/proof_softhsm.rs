//! Side by side with SoftHSM2: the same client workload (`tests/c/workload.c`:
//! import a known AES-256 key, start a multi-part AES-CBC encryption, feed
//! it 4 KiB) against Debian's SoftHSM2 and against this module; a `gcore` of
//! the client while the operation is open; `memveil keyfind --core` over the
//! dump. SoftHSM2 decrypts its key into the client's heap: the key's
//! schedule is found (the positive control). With memveil's module the key
//! lives in the vault: neither its schedule nor its raw bytes are in the
//! client's dump.

mod common;

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use memveil_testkit::{skip, Need};

const KEY: &str = "603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4";

struct Found {
    schedules: usize,
    key_schedule: bool,
    key_bytes: bool,
    report: String,
}

/// Runs the workload on `module`, dumps it mid-operation, scans the dump.
fn workload(exe: &Path, memveil: &Path, module: &Path, dir: &Path, env: &[(&str, &Path)]) -> Found {
    let report = dump_and_scan(
        exe,
        &[
            module.as_os_str(),
            "1234".as_ref(),
            "aes".as_ref(),
            KEY.as_ref(),
        ],
        env,
        memveil,
        &["--show-keys", "--pattern", KEY],
        dir,
    );
    let schedules = report.lines().filter(|l| l.starts_with("AES-")).count();
    Found {
        schedules,
        key_schedule: report
            .lines()
            .any(|l| l.starts_with("AES-256") && l.ends_with(KEY)),
        key_bytes: report.lines().any(|l| l.starts_with("pattern at")),
        report,
    }
}

/// Runs `exe ARGS` (a workload that prints `READY pid` and waits for a
/// line), dumps it with `gcore` while it waits, lets it finish, and returns
/// `memveil keyfind KEYFIND --core DUMP`'s report.
fn dump_and_scan(
    exe: &Path,
    args: &[&std::ffi::OsStr],
    env: &[(&str, &Path)],
    memveil: &Path,
    keyfind: &[&str],
    dir: &Path,
) -> String {
    let module = Path::new(args.first().copied().unwrap_or_default());
    let mut c = Command::new(exe);
    c.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.spawn().expect("workload");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("READY line");
    let pid = line
        .trim()
        .strip_prefix("READY ")
        .unwrap_or_default()
        .to_owned();
    if pid.is_empty() {
        let out = child.wait_with_output().expect("workload");
        panic!(
            "workload on {} failed: {}",
            module.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let prefix = dir.join("core");
    let g = Command::new("gcore")
        .arg("-o")
        .arg(&prefix)
        .arg(&pid)
        .output()
        .expect("gcore");
    let core = PathBuf::from(format!("{}.{pid}", prefix.display()));
    assert!(
        core.exists(),
        "gcore wrote no dump: {}",
        String::from_utf8_lossy(&g.stderr)
    );
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("resume");
    let st = child.wait().expect("wait");
    assert!(st.success(), "the workload failed after the dump");
    let k = Command::new(memveil)
        .arg("keyfind")
        .args(keyfind)
        .arg("--core")
        .arg(&core)
        .output()
        .expect("memveil keyfind");
    let _ = std::fs::remove_file(&core);
    String::from_utf8_lossy(&k.stdout).into_owned()
}

/// What both proofs need: SoftHSM2, this module, the memveil binary, a
/// scratch directory with a SoftHSM2 token (`proof`, PIN 1234) and the
/// compiled workload `name`; `None` after a skip line when one is missing.
struct Setup {
    softhsm: PathBuf,
    module: PathBuf,
    memveil: PathBuf,
    dir: PathBuf,
    conf: PathBuf,
    exe: PathBuf,
}

impl Setup {
    fn new(tag: &str, workload: &str) -> Option<Setup> {
        for (tool, pkg) in [
            ("gcore", "gdb"),
            ("softhsm2-util", "softhsm2"),
            ("openssl", "openssl"),
        ] {
            if Command::new(tool).arg("--help").output().is_err() {
                skip(Need::Installed(pkg), format!("{tool} not on PATH"));
                return None;
            }
        }
        let module = common::module_path();
        let memveil = module.with_file_name("memveil");
        if !memveil.exists() {
            skip(
                Need::Installed("target/release/memveil"),
                "scripts/test.sh builds it (cargo build --release --workspace) before the tests",
            );
            return None;
        }
        let dir = std::env::temp_dir().join(format!("memveil-p11-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let exe = common::compile_c(workload, &dir)?;
        let (softhsm, conf) = common::softhsm_token(&dir, "proof")?;
        let s = Setup {
            softhsm,
            module,
            memveil,
            dir,
            conf,
            exe,
        };
        Some(s)
    }

    fn softhsm2_util(&self, args: &[&str]) {
        let o = Command::new("softhsm2-util")
            .args(args)
            .env("SOFTHSM2_CONF", &self.conf)
            .output()
            .expect("softhsm2-util");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn the_key_is_in_a_softhsm2_clients_core_and_not_in_a_memveil_clients() {
    let Some(p) = Setup::new("proof", "workload") else {
        return;
    };
    let (exe, memveil, softhsm, module, dir, conf) =
        (&p.exe, &p.memveil, &p.softhsm, &p.module, &p.dir, &p.conf);
    let hsm = workload(exe, memveil, softhsm, dir, &[("SOFTHSM2_CONF", conf)]);
    let socket = common::vault().socket.clone();
    let mv = workload(
        exe,
        memveil,
        module,
        dir,
        &[("MEMVEIL_VAULT_SOCKET", &socket)],
    );
    eprintln!(
        "SoftHSM2 client core: {} schedules, the key's {}; memveil client core: {} schedules, the key's {}",
        hsm.schedules,
        if hsm.key_schedule { "found" } else { "not found" },
        mv.schedules,
        if mv.key_schedule { "found" } else { "not found" },
    );
    assert!(
        hsm.key_schedule,
        "positive control failed: the key's schedule is not in the SoftHSM2 client's core:\n{}",
        hsm.report
    );
    assert!(
        !mv.key_schedule && !mv.key_bytes,
        "the key is in the memveil client's core:\n{}",
        mv.report
    );
    assert_eq!(
        mv.schedules, 0,
        "an AES schedule in the memveil client:\n{}",
        mv.report
    );
}

/// The RSA side (issue 27): the same RSA-2048 key imported into SoftHSM2
/// (`softhsm2-util --import`) and into the vault; a client
/// (`tests/c/workload.c rsa`) starts a multi-part `CKM_SHA256_RSA_PKCS`
/// signature with it and is dumped mid-operation; `memveil keyfind
/// --private-key` looks for the primes and the private exponent in both
/// byte orders. SoftHSM2 has the key in the client's heap (the positive
/// control); memveil's module has none of it.
#[test]
fn the_rsa_key_is_in_a_softhsm2_clients_core_and_not_in_a_memveil_clients() {
    let Some(p) = Setup::new("rsaproof", "workload") else {
        return;
    };
    let (exe, memveil, softhsm, module, dir) = (&p.exe, &p.memveil, &p.softhsm, &p.module, &p.dir);
    let key = dir.join("key.pem");
    let g = Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(&key)
        .output()
        .expect("openssl");
    assert!(g.status.success());
    let label = common::label("rsaproof");
    p.softhsm2_util(&[
        "--import",
        key.to_str().expect("utf8"),
        "--token",
        "proof",
        "--label",
        &label,
        "--id",
        "01",
        "--pin",
        "1234",
    ]);
    let socket = common::vault().socket.clone();
    let i = Command::new(memveil)
        .args(["vault", "import", &label, "--key-file"])
        .arg(&key)
        .env("MEMVEIL_VAULT_SOCKET", &socket)
        .output()
        .expect("memveil vault import");
    assert!(i.status.success(), "{}", String::from_utf8_lossy(&i.stderr));
    let scan = ["--private-key", key.to_str().expect("utf8")];
    let hsm = dump_and_scan(
        exe,
        &[
            softhsm.as_os_str(),
            "1234".as_ref(),
            "rsa".as_ref(),
            label.as_ref(),
        ],
        &[("SOFTHSM2_CONF", &p.conf)],
        memveil,
        &scan,
        dir,
    );
    let mv = dump_and_scan(
        exe,
        &[
            module.as_os_str(),
            "1234".as_ref(),
            "rsa".as_ref(),
            label.as_ref(),
        ],
        &[("MEMVEIL_VAULT_SOCKET", &socket)],
        memveil,
        &scan,
        dir,
    );
    let hits = |r: &str| r.lines().filter(|l| l.starts_with("secret at")).count();
    eprintln!(
        "RSA key: {} secrets in the SoftHSM2 client's core, {} in the memveil client's",
        hits(&hsm),
        hits(&mv)
    );
    assert!(
        hsm.contains("RSA prime p") && hsm.contains("RSA prime q"),
        "positive control failed: the primes are not in the SoftHSM2 client's core:\n{hsm}"
    );
    assert_eq!(
        hits(&mv),
        0,
        "the RSA key in the memveil client's core:\n{mv}"
    );
}
