//! A hostile C caller (`tests/c/robust.c`, built here with `cc`): every
//! entry point with NULL pointers, short buffers, closed sessions and wrong
//! handles, before and after `C_Initialize`; each answer checked against
//! the code PKCS#11 names. A crash of the module kills the C program, and
//! the test sees the signal.

mod common;

use std::process::Command;

use memveil_testkit::{skip, Need};

#[test]
fn a_hostile_c_caller_gets_the_standard_codes_and_never_crashes_the_module() {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/c/robust.c");
    let dir = std::env::temp_dir().join(format!("memveil-p11-robust-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let exe = dir.join("robust");
    let cc = match Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(src)
        .arg("-ldl")
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            skip(Need::Installed("build-essential"), format!("cc: {e}"));
            return;
        }
    };
    assert!(
        cc.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = Command::new(&exe)
        .arg(common::module_path())
        .env("MEMVEIL_VAULT_SOCKET", &common::vault().socket)
        .output()
        .expect("run robust");
    let text = String::from_utf8_lossy(&out.stdout);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "status {:?} (a signal means the module crashed):\n{text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text.lines().last().unwrap_or_default();
    let checks: usize = line
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(line.ends_with(", 0 failed") && checks > 200, "{text}");
}
