//! `memveil keyfind` as a program: a planted schedule is reported (exit 3)
//! with only its key check value unless --show-keys; a hostile core file is
//! a clear error (exit 1), never a panic.

use std::process::Command;

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_memveil"))
        .arg("keyfind")
        .args(args)
        .output()
        .expect("run memveil");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn planted_schedule_is_reported_and_bad_cores_are_errors() {
    let dir = std::env::temp_dir().join(format!("keyfind-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let key: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(29) ^ 0x3c).collect();
    let hexkey: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut img = vec![0u8; 1 << 16];
    let s = memveil_keyfind::expand(&key).expect("expand");
    img[8192..8192 + s.len()].copy_from_slice(&s);
    img[8192 + 100] ^= 0x04;
    let f = dir.join("img");
    std::fs::write(&f, &img).expect("write");
    let p = f.to_str().expect("utf8");

    let (code, out, err) = run(&[p]);
    assert_eq!(code, Some(3), "{out}{err}");
    assert!(out.contains("AES-256 at 0x2000"), "{out}");
    assert!(
        !out.contains(&hexkey),
        "key shown without --show-keys: {out}"
    );
    let (code, out, _) = run(&[p, "--show-keys", "--json"]);
    assert_eq!(code, Some(3));
    assert!(
        out.contains(&hexkey) && out.contains("\"bit_errors\""),
        "{out}"
    );

    // Nothing found: exit 0.
    std::fs::write(&f, vec![0u8; 4096]).expect("write");
    assert_eq!(run(&[p]).0, Some(0));

    // Hostile cores: clear errors, exit 1.
    let mut core = vec![0u8; 64];
    core[..4].copy_from_slice(b"\x7fELF");
    core[4] = 2;
    core[5] = 1;
    core[16] = 4;
    core[0x20] = 64;
    core[0x36] = 56;
    core[0x38] = 200;
    std::fs::write(&f, &core).expect("write");
    let (code, _, err) = run(&["--core", p]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not a usable ELF64 core file"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (code, _, err) = run(&["--core", "/nonexistent/core"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("/nonexistent/core"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
