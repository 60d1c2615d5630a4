//! `memveil key program|clear|status` through the binary, against a real
//! `memveil vault serve`: output, PCONFIG statuses as exit codes, who may
//! program, and key bytes that never come back. The table itself is tested
//! in depth by `crates/vault/tests/keyids.rs`.

use std::path::Path;
use std::process::{Command, Output};

use memveil_testkit::{skip, Need};

const BIN: &str = env!("CARGO_BIN_EXE_memveil");

type Vault = memveil_testkit::VaultProcess;

fn vault(tag: &str) -> Vault {
    Vault::start(BIN, &format!("key-cli-{tag}"), &[])
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

/// Runs `memveil key ARGS`, checks its exit status and that its output
/// says `says`; returns the output.
fn expect(v: &Vault, args: &[&str], exit: i32, says: &str) -> String {
    let o = v.key(args);
    let t = text(&o);
    assert_eq!(code(&o), exit, "{args:?}: {t}");
    assert!(t.contains(says), "{args:?}: {t}");
    t
}

fn file(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("key file");
    p.display().to_string()
}

#[test]
fn help_explains_the_tme_mk_analogy_and_the_exit_codes() {
    let o = Command::new(BIN)
        .args(["key", "--help"])
        .output()
        .expect("help");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for says in [
        "TME-MK",
        "PCONFIG",
        "KeyID 0",
        "platform key",
        "--key-admin",
        "13 INVALID_KEYID",
        "restart clears",
    ] {
        assert!(t.contains(says), "help lacks {says:?}:\n{t}");
    }
}

#[test]
fn program_clear_status_and_pconfig_statuses_as_exit_codes() {
    let v = vault("verbs");
    let o = v.key(&["program", "--keyid", "5", "--mode", "random"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(
        text(&o).contains("KeyID 5: PROG_SUCCESS (0) mode=random alg=aes-xts-128 generation=1"),
        "{}",
        text(&o)
    );

    // PCONFIG refusals: name, code, and exit 10 + code.
    for (args, exit, says) in [
        (
            vec!["program", "--keyid", "0", "--mode", "random"],
            13,
            "KeyID 0: INVALID_KEYID (3): KeyID 0 is not programmable",
        ),
        (vec!["clear", "0"], 13, "INVALID_KEYID (3)"),
        (
            vec!["program", "--keyid", "64", "--mode", "no-encrypt"],
            13,
            "usable 1..=63",
        ),
    ] {
        expect(&v, &args, exit, says);
    }
    let short = file(&v.dir, "short.key", &[0x42; 31]);
    let sw = ["program", "--keyid", "2", "--mode", "software"];
    let t = expect(
        &v,
        &[&sw[..], &["--key-file", &short]].concat(),
        11,
        "INVALID_PROG_CMD (1)",
    );
    assert!(t.contains("the file has 31"), "{t}");

    // A software key: the data key then the tweak key, raw.
    let k: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(29) ^ 0xA7).collect();
    let good = file(&v.dir, "good.key", &k);
    let args = [&sw[..], &["--alg", "aes-xts-256", "--key-file", &good]].concat();
    expect(&v, &args, 0, "mode=software alg=aes-xts-256");
    expect(&v, &["clear", "5"], 0, "mode=clear alg=- generation=2");

    let o = v.key(&["status"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("KeyIDs 1..=63 programmable, 1 programmed, 0 running tenant(s)"),
        "{t}"
    );
    let rows: Vec<&str> = t.lines().skip(2).collect();
    assert_eq!(rows.len(), 3, "KeyID 0 and the two touched: {t}");
    // KeyID, mode, algorithm, generation, programmed-by, tenants.
    assert!(rows[1]
        .split_whitespace()
        .eq(["2", "software", "aes-xts-256", "1", "0", "0"]));
    let o = v.key(&["status", "--all"]);
    assert_eq!(text(&o).lines().count(), 2 + 64);

    let o = v.key(&["status", "--json"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["max_keyid"], 63);
    assert_eq!(j["keyids"].as_array().map(Vec::len), Some(64));
    assert_eq!(j["keyids"][5]["generation"], 2);
    assert_eq!(j["keyids"][5]["mode"], "clear");
    assert_eq!(j["keyids"][2]["alg"], "aes-xts-256");
    assert_eq!(j["keyids"][0]["mode"], "platform");
    assert_eq!(j["keyids"][2]["tenants"], 0);

    // The key never comes back: not in any output, as bytes or hex
    // (positive control: the hex of the key is found in itself).
    let hex: String = k.iter().map(|b| format!("{b:02x}")).collect();
    assert!(hex.contains(&hex[40..56]));
    for args in [&["status", "--all"][..], &["status", "--json"]] {
        let o = v.key(args);
        for w in k.windows(8) {
            assert!(!o.stdout.windows(8).any(|x| x == w), "{args:?}");
        }
        let t = text(&o);
        for i in (0..hex.len() - 16).step_by(8) {
            assert!(!t.contains(&hex[i..i + 16]), "{args:?}: {t}");
        }
    }
}

#[test]
fn usage_mistakes_and_an_absent_vault_are_clear_errors() {
    let v = vault("usage");
    let f = file(&v.dir, "k", &[1; 32]);
    for (args, says) in [
        (
            vec!["program", "--keyid", "1", "--mode", "software"],
            "needs --key-file",
        ),
        (
            vec![
                "program",
                "--keyid",
                "1",
                "--mode",
                "random",
                "--key-file",
                &f,
            ],
            "--key-file goes with --mode software",
        ),
        (
            vec![
                "program",
                "--keyid",
                "1",
                "--mode",
                "no-encrypt",
                "--alg",
                "aes-xts-128",
            ],
            "takes no --alg",
        ),
    ] {
        expect(&v, &args, 1, says);
    }
    let long = file(&v.dir, "long", &[1; 129]);
    let sw = [
        "program",
        "--keyid",
        "1",
        "--mode",
        "software",
        "--key-file",
    ];
    expect(
        &v,
        &[&sw[..], &[&long]].concat(),
        1,
        "longer than 128 bytes",
    );
    // clap's usage error.
    expect(
        &v,
        &["program", "--keyid", "1", "--mode", "fast"],
        2,
        "invalid value",
    );
    // Nothing above reached the table (positive control below: it can).
    let o = v.key(&["status", "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["keyids"][1]["generation"], 0);
    expect(
        &v,
        &["program", "--keyid", "1", "--mode", "no-encrypt"],
        0,
        "PROG_SUCCESS",
    );

    let gone = v.dir.join("no-such.sock").display().to_string();
    let o = Command::new(BIN)
        .args(["key", "status", "--socket", &gone])
        .output()
        .expect("run");
    assert_eq!(code(&o), 1);
    assert!(
        text(&o).contains("cannot connect to the vault"),
        "{}",
        text(&o)
    );
}

#[test]
fn nobody_is_refused_with_exit_4_but_reads_the_status() {
    if memveil_sys::probe::euid() != 0 {
        skip(Need::Root, "runs memveil key as nobody");
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        skip(Need::Installed("setpriv"), "runs memveil key as nobody");
        return;
    }
    let v = vault("nobody");
    std::fs::set_permissions(&v.dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let as_nobody = |args: &[&str]| {
        Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                BIN,
                "key",
            ])
            .args(args)
            .args(["--socket", &v.socket])
            .output()
            .expect("setpriv")
    };
    let o = as_nobody(&["program", "--keyid", "3", "--mode", "random"]);
    assert_eq!(code(&o), 4, "{}", text(&o));
    assert!(
        text(&o).contains("refused: uid 65534 may not program"),
        "{}",
        text(&o)
    );
    let o = as_nobody(&["clear", "3"]);
    assert_eq!(code(&o), 4, "{}", text(&o));
    let o = as_nobody(&["status"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("0 programmed"), "{}", text(&o));
    // Positive control: root may.
    let o = v.key(&["program", "--keyid", "3", "--mode", "random"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
}
