//! Test harness: one vault per test binary (started in-process on a private
//! socket, on its own thread, until the binary exits), the module built by
//! this crate, and the PKCS#11 module initialised once over that vault.
#![allow(dead_code, clippy::cast_possible_truncation)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cryptoki_sys::*;
use memveil_pkcs11::ffi;
use memveil_secmem::{Level, Policy};
use memveil_vault::{Config, Server};

/// The vault of this test binary: its socket and protection level.
pub struct TestVault {
    pub socket: PathBuf,
    pub level: String,
}

static VAULT: OnceLock<TestVault> = OnceLock::new();

/// Starts (once) a vault on a private socket; `MEMVEIL_VAULT_SOCKET` names it.
pub fn vault() -> &'static TestVault {
    VAULT.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("memveil-p11-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let socket = dir.join("vault.sock");
        let mut cfg = Config::new(socket.clone());
        cfg.pool_bytes = 8 << 20;
        let server = match Server::start(cfg.clone()) {
            Ok(s) => s,
            Err(e) => {
                // Functional tests run at the weaker level too (and say so);
                // the proof tests check the level themselves.
                eprintln!("vault at level secret refused ({e}); using locked");
                cfg.policy = Policy::allow(Level::Locked);
                Server::start(cfg).expect("vault starts at level locked")
            }
        };
        let level = server.level().to_string();
        std::thread::spawn(move || server.run());
        // SAFETY-free: set before the module reads it (C_Initialize below
        // runs after this OnceLock completes).
        std::env::set_var("MEMVEIL_VAULT_SOCKET", &socket);
        for _ in 0..200 {
            if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        TestVault { socket, level }
    })
}

static INIT: OnceLock<()> = OnceLock::new();

/// Initialises the module (once) over this binary's vault.
pub fn init() {
    vault();
    INIT.get_or_init(|| {
        // SAFETY: NULL arguments are allowed.
        let rv = unsafe { ffi::C_Initialize(std::ptr::null_mut()) };
        assert_eq!(rv, CKR_OK, "C_Initialize");
    });
}

/// A read/write session.
pub fn open() -> CK_SESSION_HANDLE {
    init();
    let mut h = 0;
    // SAFETY: `h` is a valid out-pointer.
    let rv = unsafe {
        ffi::C_OpenSession(
            0,
            CKF_SERIAL_SESSION | CKF_RW_SESSION,
            std::ptr::null_mut(),
            None,
            &mut h,
        )
    };
    assert_eq!(rv, CKR_OK, "C_OpenSession");
    h
}

/// `libmemveil_pkcs11.so` as built with this crate (target/release).
pub fn module_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let p = dir.join("libmemveil_pkcs11.so");
    assert!(
        p.exists(),
        "{} missing: build it with `cargo build --release -p memveil-pkcs11` (cargo test does not build a cdylib; scripts/test.sh builds the workspace first)",
        p.display()
    );
    // `cargo test` builds the rlib, not the cdylib: a library older than the
    // sources would test old code.
    let built = std::fs::metadata(&p)
        .and_then(|m| m.modified())
        .expect("mtime");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for dir in ["pkcs11/src", "vault/src"] {
        for e in std::fs::read_dir(root.join(dir))
            .expect("sources")
            .flatten()
        {
            let changed = e.metadata().and_then(|m| m.modified()).expect("mtime");
            assert!(
                changed <= built,
                "{} is older than {}: run `cargo build --release -p memveil-pkcs11` first",
                p.display(),
                e.path().display()
            );
        }
    }
    p
}

/// A unique label for this test.
pub fn label(tag: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "t{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// An attribute pointing at `v` (which must outlive its use).
pub fn attr<T>(t: CK_ATTRIBUTE_TYPE, v: &T) -> CK_ATTRIBUTE {
    CK_ATTRIBUTE {
        type_: t,
        pValue: std::ptr::from_ref(v).cast_mut().cast(),
        ulValueLen: std::mem::size_of::<T>() as CK_ULONG,
    }
}

/// An attribute over bytes.
pub fn attr_bytes(t: CK_ATTRIBUTE_TYPE, v: &[u8]) -> CK_ATTRIBUTE {
    CK_ATTRIBUTE {
        type_: t,
        pValue: v.as_ptr().cast_mut().cast(),
        ulValueLen: v.len() as CK_ULONG,
    }
}

/// Imports `key` as a session object (or token object with `token`).
pub fn import(h: CK_SESSION_HANDLE, key: &[u8], label: &str, token: bool) -> CK_OBJECT_HANDLE {
    let class = CKO_SECRET_KEY;
    let kt = CKK_AES;
    let tok: CK_BBOOL = if token { CK_TRUE } else { CK_FALSE };
    let mut t = [
        attr(CKA_CLASS, &class),
        attr(CKA_KEY_TYPE, &kt),
        attr(CKA_TOKEN, &tok),
        attr_bytes(CKA_LABEL, label.as_bytes()),
        attr_bytes(CKA_VALUE, key),
    ];
    let mut o = 0;
    // SAFETY: the template's values outlive the call.
    let rv = unsafe { ffi::C_CreateObject(h, t.as_mut_ptr(), t.len() as CK_ULONG, &mut o) };
    assert_eq!(rv, CKR_OK, "C_CreateObject");
    o
}

/// Compiles `tests/c/NAME.c` into `dir/NAME` (`cc -O1 -Wall -Werror -ldl`);
/// `None` after a skip line when no C compiler is installed.
pub fn compile_c(name: &str, dir: &Path) -> Option<PathBuf> {
    let exe = dir.join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(format!("{name}.c"));
    let cc = match std::process::Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-ldl")
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            memveil_testkit::skip(
                memveil_testkit::Need::Installed("build-essential"),
                format!("cc: {e}"),
            );
            return None;
        }
    };
    assert!(
        cc.status.success(),
        "cc {}: {}",
        src.display(),
        String::from_utf8_lossy(&cc.stderr)
    );
    Some(exe)
}

/// Where Debian puts SoftHSM2's module.
pub const SOFTHSM: [&str; 2] = [
    "/usr/lib/softhsm/libsofthsm2.so",
    "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
];

/// SoftHSM2's module and the config file of a fresh token `label` (PIN
/// 1234, SO PIN 12345678) whose files live under `dir`; `None` after a skip
/// line when SoftHSM2 is not installed.
pub fn softhsm_token(dir: &Path, label: &str) -> Option<(PathBuf, PathBuf)> {
    let Some(lib) = SOFTHSM.iter().map(PathBuf::from).find(|p| p.exists()) else {
        memveil_testkit::skip(
            memveil_testkit::Need::Installed("softhsm2"),
            "libsofthsm2.so not found",
        );
        return None;
    };
    std::fs::create_dir_all(dir.join("tokens")).expect("token dir");
    let conf = dir.join("softhsm2.conf");
    std::fs::write(
        &conf,
        format!(
            "directories.tokendir = {}\nobjectstore.backend = file\nlog.level = ERROR\n",
            dir.join("tokens").display()
        ),
    )
    .expect("softhsm2.conf");
    let o = std::process::Command::new("softhsm2-util")
        .args(["--init-token", "--free", "--label", label])
        .args(["--pin", "1234", "--so-pin", "12345678"])
        .env("SOFTHSM2_CONF", &conf)
        .output();
    match o {
        Ok(o) if o.status.success() => Some((lib, conf)),
        other => {
            memveil_testkit::skip(
                memveil_testkit::Need::Installed("softhsm2"),
                format!("softhsm2-util --init-token: {other:?}"),
            );
            None
        }
    }
}
