//! `memveil probe` as a user runs it: outputs, exit codes, bad input.

use std::process::Command;

fn memveil() -> Command {
    Command::new(env!("CARGO_BIN_EXE_memveil"))
}

fn fixture(name: &str) -> String {
    format!(
        "{}/../probe/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn replay_exit_codes_follow_the_checks() {
    // No failed check: 0.
    let o = memveil()
        .args(["probe", "--replay", &fixture("sev-snp-guest.json")])
        .output()
        .expect("run");
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("[PASS] memory-encryption"), "{out}");
    assert!(out.contains("SEV-SNP"));
    // memfd_secret missing on that kernel: a failed check, 3.
    let o = memveil()
        .args(["probe", "--replay", &fixture("icelake-tme-mk-enabled.json")])
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stdout).contains("[FAIL] memfd-secret"));
}

#[test]
fn json_and_prometheus_outputs() {
    let o = memveil()
        .args(["probe", "--json", "--replay", &fixture("tsme-only.json")])
        .output()
        .expect("run");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json on stdout");
    let item = v["items"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["id"] == "amd.tsme.active"))
        .expect("tsme item");
    assert_eq!(item["value"], serde_json::Value::Bool(true));
    let syscfg = v["items"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["id"] == "amd.syscfg"))
        .expect("syscfg item");
    assert!(syscfg["value"]["unknown"]
        .as_str()
        .is_some_and(|s| s.contains("modprobe msr")));

    let o = memveil()
        .args([
            "probe",
            "--prometheus",
            "--no-vault",
            "--replay",
            &fixture("tsme-only.json"),
        ])
        .output()
        .expect("run");
    let p = String::from_utf8_lossy(&o.stdout);
    assert!(
        p.starts_with("# HELP memveil_memory_encryption_active"),
        "{p}"
    );
    assert!(p.contains("\nmemveil_memory_encryption_active 1\n"), "{p}");
    assert!(p.contains("memveil_probe_item{item=\"amd.tsme.active\"} 1\n"));
    assert!(!p.contains("memveil_vault"), "--no-vault: {p}");

    // A vault that does not answer is exported as down, not left out.
    let o = memveil()
        .args([
            "probe",
            "--prometheus",
            "--vault-socket",
            "/nonexistent/vault.sock",
        ])
        .args(["--replay", &fixture("tsme-only.json")])
        .output()
        .expect("run");
    let p = String::from_utf8_lossy(&o.stdout);
    assert!(p.contains("\nmemveil_vault_up 0\n"), "{p}");
    assert!(!p.contains("memveil_vault_keys"), "{p}");
}

#[test]
fn bad_replay_file_is_a_clear_error_with_exit_1() {
    let dir = std::env::temp_dir().join(format!("memveil-probe-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{\"schema\": 1, \"cpuid\": 7}").expect("write");
    let o = memveil()
        .args(["probe", "--replay"])
        .arg(&bad)
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("not valid") && err.contains("--record"),
        "{err}"
    );
    let o = memveil()
        .args(["probe", "--replay"])
        .arg(dir.join("missing.json"))
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot read recorded facts"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn too_few_rng_samples_is_refused() {
    let o = memveil()
        .args(["probe", "--rng-samples", "0"])
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(2), "clap usage errors exit 2");
    assert!(String::from_utf8_lossy(&o.stderr).contains("64"));
}

#[test]
fn record_then_replay_gives_the_same_report() {
    let dir = std::env::temp_dir().join(format!("memveil-probe-rec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let rec = dir.join("facts.json");
    let live = memveil()
        .args(["probe", "--json", "--rng-samples", "512", "--record"])
        .arg(&rec)
        .output()
        .expect("run");
    assert!(matches!(live.status.code(), Some(0 | 3)));
    let replay = memveil()
        .args(["probe", "--json", "--replay"])
        .arg(&rec)
        .output()
        .expect("run");
    assert_eq!(live.status.code(), replay.status.code());
    assert_eq!(live.stdout, replay.stdout);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 35: a port in use printed its cause twice ("Address already in use
/// (os error 98) (hint): Address already in use (os error 98)").
#[test]
fn a_port_in_use_is_named_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let o = memveil()
        .args(["probe", "--serve", &addr, "--no-vault"])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.matches("(os error 98)").count(), 1, "{err}");
    assert!(err.contains("ss -ltnp"), "{err}");
}
