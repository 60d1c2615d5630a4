//! The vault's KMIP figures (issue 28): unlocking a keystore sealed by a
//! KMIP-held key, programming a KeyID from a KMIP key, and the fetch itself,
//! each against its local counterpart in the same run (a 32-byte key file):
//! `vault.kmip_unlock_ms`, `vault.kmip_keyid_program_ms`,
//! `vault.kmip_fetch_vs_local`. The KMS is PyKMIP's server on loopback
//! (`memveil_kmip::testserver`): a reference server in Python, so these
//! figures bound what a network KMS adds from below only by its TLS and
//! KMIP round trips, not by a production server's speed.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memveil_kmip::testserver::{self, TestServer};
use memveil_secmem::{Level, Policy};

use crate::vault::start_daemon_with;
use crate::{BenchError, BenchOpts, Figure};

fn fail(msg: impl Into<String>) -> BenchError {
    BenchError::Part {
        part: "vault",
        msg: msg.into(),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Measures `kmip` and `local` `rounds` times, alternating which goes
/// first; returns (median kmip ms, median local ms, median of the rounds'
/// ratios, spread of the kmip values as (min, max)).
fn paired(
    rounds: usize,
    mut kmip: impl FnMut() -> Result<Duration, BenchError>,
    mut local: impl FnMut() -> Result<Duration, BenchError>,
) -> Result<(f64, f64, f64, (f64, f64)), BenchError> {
    let (mut k, mut l, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        let (a, b) = if i % 2 == 0 {
            let a = kmip()?;
            (a, local()?)
        } else {
            let b = local()?;
            (kmip()?, b)
        };
        k.push(ms(a));
        l.push(ms(b));
        r.push(ms(a) / ms(b));
    }
    let lo = k.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = k.iter().copied().fold(0.0, f64::max);
    Ok((median(&mut k), median(&mut l), median(&mut r), (lo, hi)))
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| (*s).to_owned()).collect()
}

/// The KMIP figures and their Markdown; none (and a line saying why) when
/// PyKMIP is not installed.
///
/// # Errors
/// The KMS or a vault did not start, or a request failed.
pub fn figures(opts: &BenchOpts) -> Result<(Vec<Figure>, String), BenchError> {
    if !testserver::server_program().exists() {
        return Ok((
            Vec::new(),
            "\nKMIP figures not measured: PyKMIP's server is missing (scripts/install.sh installs it into build/kmipvenv).\n".into(),
        ));
    }
    let exe = crate::procs::memveil_exe().ok_or_else(|| {
        fail("the KMIP figures run the memveil binary; run them through `memveil bench`")
    })?;
    let dir = std::env::temp_dir().join(format!("memveil-bench-kmip-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let r = measure(opts, &exe, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

fn measure(opts: &BenchOpts, exe: &Path, dir: &Path) -> Result<(Vec<Figure>, String), BenchError> {
    let rounds = opts.pick(5, 11);
    let s = TestServer::start(&dir.join("kms")).map_err(|e| fail(format!("KMIP server: {e}")))?;
    let client = memveil_kmip::Client::new(s.config("host-a"), Policy::allow(Level::Locked))
        .map_err(|e| fail(e.to_string()))?;
    let kek = client
        .create_aes256(Some("bench keystore"), None)
        .map_err(|e| fail(e.to_string()))?;
    let keyid_key = client
        .create_aes256(Some("bench keyid"), None)
        .map_err(|e| fail(e.to_string()))?;
    let cfg = s.config_file("host-a").map_err(fail)?.display().to_string();
    // The local counterpart: a 32-byte key file (no Argon2id: the fair
    // comparison is one key read from a file vs one key fetched).
    let key_file = dir.join("local.key");
    let bytes = client
        .get_key(&keyid_key)
        .map_err(|e| fail(e.to_string()))?;
    std::fs::write(&key_file, &bytes[..]).map_err(|e| fail(e.to_string()))?;
    drop(bytes);
    let kf = key_file.display().to_string();
    let kmip_args = |state: &Path| {
        let mut v = strings(&["--state", &state.display().to_string(), "--kmip-kek", &kek]);
        v.extend(strings(&["--kmip-config", &cfg]));
        v
    };
    let local_args =
        |state: &Path| strings(&["--state", &state.display().to_string(), "--key-file", &kf]);
    // Each keystore holds one persistent key, so opening decrypts something.
    for (tag, args) in [
        ("kmip-unlock", kmip_args(&dir.join("state-kmip"))),
        ("local-unlock", local_args(&dir.join("state-local"))),
    ] {
        let (d, _) = start_daemon_with(tag, &args)?;
        let mut c = memveil_vault::Client::connect(&d.socket).map_err(|e| fail(e.to_string()))?;
        c.create_key("bench", memveil_vault::proto::KeyKind::Aes256, true)
            .map_err(|e| fail(e.to_string()))?;
    }
    let (uk, ul, ur, (ulo, uhi)) = paired(
        rounds,
        || start_daemon_with("kmip-unlock", &kmip_args(&dir.join("state-kmip"))).map(|(_, t)| t),
        || start_daemon_with("local-unlock", &local_args(&dir.join("state-local"))).map(|(_, t)| t),
    )?;
    opts.say(&format!(
        "vault kmip unlock {uk:.1} ms vs key file {ul:.1} ms"
    ));

    let (d, _) = start_daemon_with("kmip-keyid", &[])?;
    let sock = d.socket.display().to_string();
    let program = |extra: &[&str]| -> Result<Duration, BenchError> {
        let t = Instant::now();
        let o = Command::new(exe)
            .args([
                "key", "program", "--keyid", "5", "--mode", "software", "--vault", &sock,
            ])
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| fail(e.to_string()))?;
        let took = t.elapsed();
        if !o.status.success() {
            return Err(fail(format!(
                "memveil key program: {}",
                String::from_utf8_lossy(&o.stderr)
            )));
        }
        Ok(took)
    };
    let (pk, pl, pr, (plo, phi)) = paired(
        rounds,
        || program(&["--kmip-id", &keyid_key, "--kmip-config", &cfg]),
        || program(&["--key-file", &kf]),
    )?;
    drop(d);
    opts.say(&format!(
        "key program from KMIP {pk:.1} ms vs key file {pl:.1} ms"
    ));

    let fetch_rounds = opts.pick(21, 101);
    let (fk, fl, fr, (flo, fhi)) = paired(
        fetch_rounds,
        || {
            let t = Instant::now();
            let k = client
                .get_key_len(&keyid_key, 32, "the bench")
                .map_err(|e| fail(e.to_string()))?;
            let took = t.elapsed();
            drop(k);
            Ok(took)
        },
        || {
            let t = Instant::now();
            let k = memveil_vault::cli::read_secret_file(&key_file, 33)
                .map_err(|e| fail(e.to_string()))?;
            let took = t.elapsed();
            drop(k);
            Ok(took)
        },
    )?;
    let figs = vec![
        Figure::vs(
            "vault.kmip_unlock_ms",
            uk,
            ul,
            "ms",
            &format!("start to serving of a vault whose keystore (one key) is sealed by a KMIP-held key (Get over TLS 1.2 from PyKMIP on loopback) vs sealed by a 32-byte key file; median of {rounds} alternating starts, ratio = median of the rounds' ratios (KMIP range {ulo:.1}-{uhi:.1} ms)"),
        )
        .with_ratio(ur),
        Figure::vs(
            "vault.kmip_keyid_program_ms",
            pk,
            pl,
            "ms",
            &format!("`memveil key program --mode software --kmip-id` (the whole command: TLS, Get, program through the vault) vs `--key-file`; median of {rounds} alternating runs (KMIP range {plo:.1}-{phi:.1} ms)"),
        )
        .with_ratio(pr),
        Figure::vs(
            "vault.kmip_fetch_vs_local",
            fk,
            fl,
            "ms",
            &format!("one key into secret memory: KMIP Get (new TLS connection, PyKMIP on loopback) vs reading a 32-byte key file into secret memory (pool set-up included); median of {fetch_rounds} alternating fetches (KMIP range {flo:.2}-{fhi:.2} ms)"),
        )
        .with_ratio(fr),
    ];
    let md = format!(
        "\n### KMIP (PyKMIP on loopback, TLS 1.2, client certificates)\n\n| step | KMIP | local key file | ratio |\n|---|---|---|---|\n| vault start to serving (keystore unlock) | {uk:.1} ms | {ul:.1} ms | {ur:.2} |\n| `memveil key program` (software KeyID) | {pk:.1} ms | {pl:.1} ms | {pr:.2} |\n| one key into secret memory | {fk:.2} ms | {fl:.3} ms | {fr:.0} |\n\nPyKMIP is a reference server in Python: a production KMS answers faster, and one across a network adds its round trips.\n"
    );
    Ok((figs, md))
}
