//! Runs the canary of the exposure figures once, plainly or under `memveil
//! run` with the given flags, and prints the fraction of random samples in
//! which its secret was ciphertext and the heap's plaintext fraction.
//!
//! `cargo run --release -p memveil-bench --example exposure -- PERIOD [memveil run FLAGS...]`
//! where PERIOD is `idle`, `continuous` or milliseconds; `plain` as the
//! first flag runs it without memveil (the positive control).
//! `... --example exposure -- server[:RUN_PAGES] SECONDS [plain | memveil run FLAGS...]`
//! runs the cold server of `shield.server_cold_coverage` instead (1 GiB, 5%
//! hot in runs of RUN_PAGES pages, 16 by default) for SECONDS.
use std::ffi::OsStr;
use std::time::Duration;

use memveil_bench::shield::suite::{compile_canary, exposure};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let server = args
        .first()
        .and_then(|a| a.strip_prefix("server"))
        .and_then(|rest| match rest.strip_prefix(':') {
            Some(n) => n.parse::<u32>().ok(),
            None => rest.is_empty().then_some(16),
        });
    let run_pages = server.unwrap_or(16);
    let server = server.is_some();
    let args = if server { &args[1..] } else { &args[..] };
    let period = match args.first().map(String::as_str) {
        Some("idle") => exposure::Period::Once,
        Some("continuous") => exposure::Period::Continuous,
        Some(ms) => exposure::Period::EveryMs(ms.parse().unwrap_or(1000)),
        None => {
            eprintln!("usage: exposure idle|continuous|MS [plain | memveil run flags...]");
            std::process::exit(2);
        }
    };
    let dir = std::env::temp_dir().join(format!("memveil-exposure-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let exe = if server {
        memveil_bench::shield::suite::compile_coldserver(&dir)
    } else {
        compile_canary(&dir)
    };
    let exe = match exe {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let memveil = std::env::current_exe()
        .ok()
        .and_then(|p| Some(p.parent()?.parent()?.join("memveil")))
        .unwrap_or_else(|| "memveil".into());
    let mut wrap: Vec<&OsStr> = Vec::new();
    let flags = &args[1..];
    if flags.first().map(String::as_str) != Some("plain") {
        wrap.push(memveil.as_os_str());
        wrap.push(OsStr::new("run"));
        wrap.extend(flags.iter().map(OsStr::new));
        wrap.push(OsStr::new("--"));
    }
    if server {
        let secs = args.first().and_then(|s| s.parse().ok()).unwrap_or(10);
        let got = exposure::serve(&exe, &wrap, 1024, 50, run_pages, Duration::from_secs(secs));
        let _ = std::fs::remove_dir_all(&dir);
        match got {
            Ok(s) => println!("{s:?}"),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1);
            }
        }
        return;
    }
    let got = exposure::measure(
        &exe,
        &wrap,
        256,
        period,
        Duration::from_secs(5),
        Duration::from_secs(10),
    );
    let _ = std::fs::remove_dir_all(&dir);
    match got {
        Ok(e) => println!(
            "{}: secret ciphertext in {:.4} of {} samples; heap plaintext {:?}; {} passes, {} secret reads",
            period.id(),
            e.encrypted_fraction(),
            e.samples,
            e.heap_plaintext,
            e.passes,
            e.secret_reads
        ),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
