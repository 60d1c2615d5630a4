//! `python-pkcs11` (PyPI, in `build/pyvenv` from scripts/install.sh) runs
//! every mechanism against NIST vectors with imported keys, single- and
//! multi-part, from 8 threads at once (`tests/python/nist_threads.py`):
//! CAVP ECB/CBC (KAT and MMT; CBC_PAD checked as CBC plus a padding block),
//! RFC 3686 CTR, CAVP GCM (96-bit IVs; the decrypt files' FAIL cases must be
//! refused), SP 800-38B CMAC.

mod common;

use std::path::PathBuf;
use std::process::Command;

use memveil_testkit::{skip, Need};

#[test]
fn python_pkcs11_matches_nist_vectors_from_eight_threads() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = root.join("build/pyvenv/bin/python");
    if !python.exists() {
        skip(
            Need::Installed("python-pkcs11"),
            format!(
                "{} missing (scripts/install.d/pkcs11.sh makes it)",
                python.display()
            ),
        );
        return;
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests");
    let out = Command::new(&python)
        .arg(here.join("python/nist_threads.py"))
        .arg(common::module_path())
        .arg(root.join("crates/cipher/tests/vectors"))
        .arg(root.join("crates/vault/tests/vectors/cmac-sp800-38b.txt"))
        .env("MEMVEIL_VAULT_SOCKET", &common::vault().socket)
        .output()
        .expect("run python");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "{text}");
    assert!(text.contains("threads 8 of 8 ran cases"), "{text}");
    assert!(text.contains("errors 0"), "{text}");
    let count = |what: &str| -> usize {
        text.lines()
            .find_map(|l| l.strip_prefix(what))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    for (m, min) in [
        ("ECB ", 100),
        ("CBC ", 100),
        ("CBC_PAD ", 20),
        ("CTR ", 6),
        ("GCM ", 1000),
        ("CMAC ", 8),
    ] {
        assert!(count(m) >= min, "{m}: {} cases\n{text}", count(m));
    }
    assert!(count("GCM FAIL cases rejected ") > 100, "{text}");
}
