//! A hostile C caller (`tests/c/robust.c`, built here with `cc`): every
//! entry point with NULL pointers, short buffers, closed sessions and wrong
//! handles, before and after `C_Initialize`; each answer checked against
//! the code PKCS#11 names. A crash of the module kills the C program, and
//! the test sees the signal.

mod common;

use std::process::Command;

#[test]
fn a_hostile_c_caller_gets_the_standard_codes_and_never_crashes_the_module() {
    let dir = std::env::temp_dir().join(format!("memveil-p11-robust-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let Some(exe) = common::compile_c("robust", &dir) else {
        return;
    };
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

/// `tests/c/fork_panic.c` against the cdylib: a forked child initialises
/// again and signs with its own connection while the parent keeps signing
/// (what libp11 does in nginx's workers), and a panic forced inside the
/// module is `CKR_GENERAL_ERROR` to the caller, who lives on.
#[test]
fn a_forked_child_signs_on_its_own_and_a_panic_does_not_kill_the_host() {
    let dir = std::env::temp_dir().join(format!("memveil-p11-fork-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let Some(exe) = common::compile_c("fork_panic", &dir) else {
        return;
    };
    let label = common::label("fork");
    let mut c = memveil_vault::Client::connect(&common::vault().socket).expect("vault");
    c.create_key(&label, memveil_vault::proto::KeyKind::Rsa2048, false)
        .expect("token key");
    let out = Command::new(&exe)
        .arg(common::module_path())
        .arg(&label)
        .env("MEMVEIL_VAULT_SOCKET", &common::vault().socket)
        .output()
        .expect("run fork_panic");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = c.destroy_key(&label);
    assert!(
        out.status.success(),
        "status {:?} (SIGABRT: a panic crossed into the host):\n{text}{err}",
        out.status
    );
    assert!(text.trim_end().ends_with(", 0 failed"), "{text}");
    assert!(
        err.contains("MEMVEIL_PKCS11_PANIC_TEST"),
        "the panic message: {err}"
    );
}
