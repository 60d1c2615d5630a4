//! `agent.sign_ed25519_vs_ssh_agent` (issue 27): Ed25519 signatures a
//! second through the agent socket, `memveil agent` (the key in the vault)
//! vs OpenSSH's `ssh-agent` holding the same key, one client connection
//! each sending `SSH_AGENTC_SIGN_REQUEST`s back to back, alternating rounds.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memveil_agent::proto;

use crate::{BenchError, BenchOpts, Figure};

fn fail(msg: impl Into<String>) -> BenchError {
    BenchError::Part {
        part: "pkcs11",
        msg: msg.into(),
    }
}

struct Kill(Vec<Child>);

impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn run(cmd: &mut Command, what: &str) -> Result<(), BenchError> {
    let o = cmd.stdin(Stdio::null()).output().map_err(|e| {
        fail(format!(
            "{what}: {e} (install openssh-client: scripts/install.sh)"
        ))
    })?;
    if o.status.success() {
        Ok(())
    } else {
        Err(fail(format!(
            "{what}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )))
    }
}

fn wait_socket(p: &Path) -> Result<(), BenchError> {
    for _ in 0..250 {
        if UnixStream::connect(p).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(fail(format!("no agent listening at {}", p.display())))
}

/// Signatures a second over one connection to `sock` for `secs` seconds.
fn rate(sock: &Path, blob: &[u8], secs: f64) -> Result<f64, BenchError> {
    let mut s = UnixStream::connect(sock).map_err(|e| fail(e.to_string()))?;
    let mut body = Vec::new();
    for b in [blob, &[0x5a; 64][..]] {
        body.extend_from_slice(&u32::try_from(b.len()).unwrap_or(0).to_be_bytes());
        body.extend_from_slice(b);
    }
    body.extend_from_slice(&0u32.to_be_bytes());
    let req = proto::frame(proto::msg::SIGN_REQUEST, &body);
    let mut buf = vec![0u8; 4096];
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        s.write_all(&req).map_err(|e| fail(e.to_string()))?;
        let mut h = [0u8; 4];
        s.read_exact(&mut h).map_err(|e| fail(e.to_string()))?;
        let len = usize::try_from(u32::from_be_bytes(h))
            .unwrap_or(0)
            .min(buf.len());
        s.read_exact(&mut buf[..len])
            .map_err(|e| fail(e.to_string()))?;
        if buf.first() != Some(&proto::msg::SIGN_RESPONSE) {
            return Err(fail(format!(
                "{}: the agent refused to sign",
                sock.display()
            )));
        }
        n += 1;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// The figure, with a Markdown paragraph.
///
/// # Errors
/// A tool is missing or an agent failed.
pub(crate) fn figure(opts: &BenchOpts, memveil: &Path) -> Result<(Figure, String), BenchError> {
    let d = crate::vault::start_daemon()?;
    let dir: PathBuf = d.dir.join("agents");
    std::fs::create_dir_all(&dir).map_err(|e| fail(e.to_string()))?;
    let key = dir.join("id_ed25519");
    run(
        Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "bench", "-f"])
            .arg(&key),
        "ssh-keygen",
    )?;
    let (msock, osock) = (dir.join("memveil.sock"), dir.join("openssh.sock"));
    let mut m = Command::new(memveil)
        .args(["agent", "--socket"])
        .arg(&msock)
        .arg("--vault")
        .arg(&d.socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| fail(format!("memveil agent: {e}")))?;
    let mut line = String::new();
    if let Some(out) = m.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    let o = Command::new("ssh-agent")
        .arg("-D")
        .arg("-a")
        .arg(&osock)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            fail(format!(
                "ssh-agent: {e} (install openssh-client: scripts/install.sh)"
            ))
        })?;
    let _kill = Kill(vec![m, o]);
    wait_socket(&msock)?;
    wait_socket(&osock)?;
    for s in [&msock, &osock] {
        run(
            Command::new("ssh-add").arg(&key).env("SSH_AUTH_SOCK", s),
            "ssh-add",
        )?;
    }
    let pubtext =
        std::fs::read_to_string(key.with_extension("pub")).map_err(|e| fail(e.to_string()))?;
    let b64 = pubtext.split_whitespace().nth(1).unwrap_or_default();
    let blob = <base64ct::Base64 as base64ct::Encoding>::decode_vec(b64)
        .map_err(|e| fail(format!("the public key: {e}")))?;
    let rounds = opts.pick(5, 11);
    let secs = opts.pick(1.0, 2.0);
    opts.say(&format!(
        "pkcs11: agents, {rounds} alternating rounds of {secs} s, Ed25519"
    ));
    rate(&msock, &blob, 0.2)?;
    rate(&osock, &blob, 0.2)?;
    let (mut vm, mut vo, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let (a, b) = if r % 2 == 0 {
            let a = rate(&msock, &blob, secs)?;
            (a, rate(&osock, &blob, secs)?)
        } else {
            let b = rate(&osock, &blob, secs)?;
            (rate(&msock, &blob, secs)?, b)
        };
        vm.push(a);
        vo.push(b);
        ratios.push(a / b);
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (a, b, r) = (med(vm), med(vo), med(ratios));
    let md = format!(
        "\n### SSH agents (issue 27)\n\nEd25519 signatures a second through the agent socket, one connection each sending `SSH_AGENTC_SIGN_REQUEST`s (64 bytes of data) back to back: `memveil agent` (the key in the vault) {a:.0}/s, OpenSSH `ssh-agent` 9.2 (the same key, shielded in its heap) {b:.0}/s; ratio {r:.3} (median of {rounds} alternating rounds of {secs} s; rounds {lo:.3}–{hi:.3}). OpenSSH's agent decrypts its shielded key (SHA-512 of a 16 KiB prekey, AES-CTR) for every signature.\n"
    );
    let fig = Figure::vs(
        "agent.sign_ed25519_vs_ssh_agent",
        a,
        b,
        "sign/s",
        "Ed25519 signatures a second through the agent socket, memveil agent (key in the vault) vs OpenSSH ssh-agent with the same key; ratio = median of rounds' ratios",
    )
    .with_ratio(r)
    .target(">= 0.8");
    drop(d);
    Ok((fig, md))
}
