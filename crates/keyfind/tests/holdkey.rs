//! The finder finds a key schedule in ordinary memory (positive control) and
//! not in memfd_secret memory, through /proc/PID/mem and through gcore dumps.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};

use memveil_keyfind::{read_core, read_process, scan_image};
use memveil_testkit::{skip, Need};

const KEY: &str = "8c5f0e2ba317d94e61f0c83a2d7b9e14";

struct Holder(Child);
impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(mode: &str) -> Holder {
    let exe = std::env::current_exe().expect("exe");
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("dir")
        .join("examples")
        .join("holdkey");
    let mut c = Command::new(bin)
        .args([mode, KEY])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn holdkey");
    let mut line = String::new();
    BufReader::new(c.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("ready");
    assert_eq!(line.trim(), "ready");
    Holder(c)
}

fn key() -> Vec<u8> {
    (0..16)
        .map(|i| u8::from_str_radix(&KEY[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

fn gcore(pid: u32, tag: &str) -> Option<std::path::PathBuf> {
    let base = std::env::temp_dir().join(format!("keyfind-{tag}-{}", std::process::id()));
    let out = Command::new("gcore")
        .arg("-o")
        .arg(&base)
        .arg(pid.to_string())
        .output();
    match out {
        Ok(o) if o.status.success() => Some(base.with_extension(pid.to_string())),
        // gcore present but failing on a child of ours is a failure, not
        // a reason to skip the core part.
        Ok(o) => panic!(
            "gcore of the {tag} holder failed: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            skip(
                Need::Installed("gcore"),
                format!("the gcore part: gcore not runnable ({e}); install gdb"),
            );
            None
        }
    }
}

#[test]
fn heap_key_is_found_and_secret_key_is_not() {
    let heap = start("heap");
    let img = read_process(heap.0.id()).expect("read heap holder");
    let found: Vec<_> = scan_image(&img, 8)
        .into_iter()
        .filter(|f| f.key == key())
        .collect();
    assert!(
        !found.is_empty(),
        "positive control: key schedule not found in ordinary memory"
    );
    let secret = start("secret");
    let img = read_process(secret.0.id()).expect("read secret holder");
    assert!(img.bytes() > 1 << 20, "read only {} bytes", img.bytes());
    let hits: Vec<_> = scan_image(&img, 8)
        .into_iter()
        .filter(|f| f.key == key())
        .map(|f| (f.address, f.region, f.errors))
        .collect();
    assert!(
        hits.is_empty(),
        "key schedule found in memfd_secret holder: {hits:x?}"
    );
    assert!(
        !img.unreadable.is_empty(),
        "the secret mapping should be reported unreadable"
    );
    eprintln!(
        "unreadable in secret holder: {:?}",
        img.unreadable
            .iter()
            .map(|u| (&u.2, &u.3))
            .collect::<Vec<_>>()
    );

    if let (Some(hc), Some(sc)) = (gcore(heap.0.id(), "heap"), gcore(secret.0.id(), "secret")) {
        let h = read_core(&hc).expect("parse heap core");
        let s = read_core(&sc).expect("parse secret core");
        let _ = std::fs::remove_file(&hc);
        let _ = std::fs::remove_file(&sc);
        assert!(
            scan_image(&h, 8).iter().any(|f| f.key == key()),
            "positive control: key not in the heap holder's core"
        );
        assert!(
            s.bytes() > 256 << 10,
            "secret core holds only {} bytes",
            s.bytes()
        );
        assert!(
            !scan_image(&s, 8).iter().any(|f| f.key == key()),
            "key schedule in the secret holder's core dump"
        );
    }
}

#[test]
fn a_dropped_stack_buffer_still_holds_the_schedule() {
    let h = start("stack");
    let img = read_process(h.0.id()).expect("read stack holder");
    let on_stack: Vec<_> = scan_image(&img, 8)
        .into_iter()
        .filter(|f| f.key == key() && f.region == "[stack]")
        .collect();
    assert!(
        !on_stack.is_empty(),
        "the dropped stack copy of the schedule was not found"
    );
}
