//! nginx with its TLS keys in the vault (issue 27), end to end: Debian's
//! nginx 1.22 and libp11's engine over `libmemveil_pkcs11.so`, a master and
//! two workers (as `www-data`), an RSA-2048 and a P-256 key in the vault
//! (`memveil_bench::vault_tls`: the RSA certificate itself signed through
//! the engine). `openssl s_client` handshakes (TLS 1.3 and 1.2) verify the
//! server's certificate and signature; `openssl s_time` makes full
//! handshakes for a second.
//!
//! The proof: a `gcore` of the master and of each worker, searched with
//! `memveil keyfind --core --private-key` for the RSA primes and private
//! exponent and the EC scalar in both byte orders, finds none of them.
//! Positive control, same run and keys: nginx serving the same keys from
//! their PEM files, dumped and searched the same way: found in every process.

use std::path::{Path, PathBuf};
use std::process::Command;

use common::uid_of;
use memveil_bench::vault_tls::{VaultTls, ENGINE};
use memveil_testkit::{skip, Need};

mod common;

fn memveil() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_memveil"))
}

/// Secrets `memveil keyfind` finds in a `gcore` of `pid`.
fn secrets_in_core(dir: &Path, pid: u32, keys: &[&Path]) -> usize {
    let core = common::gcore(dir, pid);
    let mut k = Command::new(memveil());
    k.args(["keyfind", "--core"]).arg(&core);
    for key in keys {
        k.arg("--private-key").arg(key);
    }
    let out = k.output().expect("memveil keyfind");
    let _ = std::fs::remove_file(&core);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        matches!(out.status.code(), Some(0 | 3)),
        "keyfind failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines().filter(|l| l.starts_with("secret at")).count()
}

#[test]
fn nginx_serves_tls_with_vault_keys_and_its_processes_hold_neither_prime_nor_scalar() {
    if uid_of(std::process::id()) != Some(0) {
        skip(
            Need::Root,
            "nginx's workers run as www-data and gcore dumps them",
        );
        return;
    }
    for (tool, pkg) in [("nginx", "nginx"), ("gcore", "gdb"), ("openssl", "openssl")] {
        if Command::new(tool).arg("-h").output().is_err()
            && Command::new(tool).arg("version").output().is_err()
        {
            skip(Need::Installed(pkg), format!("{tool} not on PATH"));
            return;
        }
    }
    if !Path::new(ENGINE).exists() {
        skip(
            Need::Installed("libengine-pkcs11-openssl"),
            format!("{ENGINE} missing"),
        );
        return;
    }
    let module = memveil().with_file_name("libmemveil_pkcs11.so");
    if !module.exists() {
        skip(
            Need::Installed("target/release/libmemveil_pkcs11.so"),
            "scripts/test.sh builds the workspace before the tests",
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("memveil-nginx-vault-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let site = VaultTls::prepare(&dir, &memveil(), &module).expect("site");
    let keys = [dir.join("rsa.pem"), dir.join("ec.pem")];
    let keys: Vec<&Path> = keys.iter().map(PathBuf::as_path).collect();

    let mut found = Vec::new();
    for vault_keys in [true, false] {
        let mut nginx = site.start(vault_keys).expect("nginx starts");
        let master = site.master_pid().expect("master pid");
        let workers = site.worker_pids();
        assert_eq!(uid_of(master), Some(0));
        assert_eq!(workers.len(), 2);
        for w in &workers {
            assert_eq!(
                uid_of(*w),
                Some(memveil_bench::vault_tls::WWW_DATA),
                "worker {w}"
            );
        }
        for tls13 in [true, false] {
            let rsa = site.handshake(site.rsa_port, tls13).expect("RSA handshake");
            let ec = site.handshake(site.ec_port, tls13).expect("EC handshake");
            assert!(rsa.starts_with("RSA"), "{rsa}");
            assert_eq!(ec, "ECDSA");
            if tls13 {
                assert_eq!(
                    rsa, "RSA-PSS",
                    "TLS 1.3 signs with PSS (raw RSA through the engine)"
                );
            }
        }
        for port in [site.rsa_port, site.ec_port] {
            let n = memveil_bench::nginx::s_time(port, false, 1).expect("s_time");
            assert!(n > 1.0, "s_time: {n} handshakes/s");
        }
        let mut per = Vec::new();
        for pid in std::iter::once(master).chain(workers) {
            per.push((pid, secrets_in_core(&dir, pid, &keys)));
        }
        site.stop(&mut nginx);
        eprintln!(
            "nginx with the keys in {}: secrets found per process (pid, count): {per:?}",
            if vault_keys { "the vault" } else { "PEM files" }
        );
        found.push(per);
    }
    let log = site.error_log();
    drop(site);
    assert!(
        found[0].iter().all(|(_, n)| *n == 0),
        "a private key's secret in an nginx process serving from the vault: {:?} ({log})",
        found[0]
    );
    assert!(
        found[1].iter().all(|(_, n)| *n > 0),
        "positive control: the PEM-file nginx's processes must hold the secrets: {:?}",
        found[1]
    );
}
