//! `memveil agent` with real OpenSSH (issue 27): keys added with `ssh-add`
//! go into the vault; `ssh-add -l` lists them; `ssh-keygen -Y sign` signs
//! through the agent and `ssh-keygen -Y verify` accepts the Ed25519, ECDSA
//! and RSA signatures; a login to an `sshd` started on loopback works through
//! the agent and through `ssh -I libmemveil_pkcs11.so` (a vault RSA key);
//! `ssh-add -d` removes a key, `ssh-add -x`/`-X` lock and unlock.
//!
//! The proof: OpenSSH's own ssh-agent, holding the same Ed25519 key after
//! a signature, keeps it "shielded" (encrypted under a key derived from a
//! 16 KiB random prekey in the same heap); its `gcore` gives the key back
//! to whoever holds the dump: this test finds the prekey, derives the
//! shielding key and recovers the seed (the positive control). The
//! `memveil agent`'s `gcore` holds neither the seed nor the expanded scalar
//! (`memveil keyfind --private-key`): the key is in the vault.

use std::io::{BufRead as _, BufReader};
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{gcore, is_root};
use memveil_testkit::{skip, Need};

mod common;

fn memveil() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_memveil"))
}

struct Procs(Vec<Child>, PathBuf);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Ok(pid) = std::fs::read_to_string(self.1.join("sshd.pid")) {
            if let Ok(p) = pid.trim().parse::<u32>() {
                let _ = memveil_sys::process::send_signal(p, libc::SIGTERM);
            }
        }
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

/// Starts `cmd` (its stderr into `log`) and waits for its first line on stdout.
fn start(cmd: &mut Command, want: &str, log: &Path) -> (Child, String) {
    let mut c = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).expect("log"))
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    BufReader::new(c.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    assert!(line.starts_with(want), "{want}: got {line:?}");
    (c, line)
}

fn ok(cmd: &mut Command, what: &str) -> String {
    let out = cmd.stdin(Stdio::null()).output().expect(what);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what}: {text}");
    text
}

fn keygen(dir: &Path, t: &str, name: &str) -> PathBuf {
    let p = dir.join(name);
    ok(
        Command::new("ssh-keygen")
            .args(["-q", "-t", t, "-N", "", "-C", &format!("{name}@test"), "-f"])
            .arg(&p),
        "ssh-keygen",
    );
    p
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port")
}

/// The seed of an OpenSSH Ed25519 key file, through memveil's reader.
fn ed25519_seed(path: &Path) -> Vec<u8> {
    let text = std::fs::read(path).expect("key");
    let mut scratch = vec![0u8; 2 * text.len() + 64];
    let mut out = vec![0u8; 256];
    let (_, n) =
        memveil_vault::keyfile::read_private(&text, &mut scratch, &mut out).expect("parse");
    memveil_asym::components::decode(&out[..n]).expect("fields")[0].to_vec()
}

/// OpenSSH's key shielding, undone from a memory image: each
/// 16-byte-aligned 16 KiB window of the heap `[lo, hi)` is taken as the
/// prekey; SHA-512 of it gives the AES-256-CTR key and IV; the known start
/// of the serialised Ed25519 key (`string "ssh-ed25519"`, then the public
/// key's length) under that key stream is what the shielded copy's first
/// 16 bytes would be. One pass over the image's 16-byte-aligned blocks
/// finds them; the rest is decrypted and its secret key compared with
/// `seed`.
fn unshield_ed25519(img: &memveil_keyfind::Image, lo: u64, hi: u64, seed: &[u8]) -> bool {
    use openssl::symm::{Cipher, Crypter, Mode};
    let mut plain = Vec::new();
    plain.extend_from_slice(&11u32.to_be_bytes());
    plain.extend_from_slice(b"ssh-ed25519");
    plain.extend_from_slice(&32u32.to_be_bytes());
    let sk_off = plain.len() + 32 + 4;
    let mut firsts: std::collections::HashMap<[u8; 16], Vec<u8>> = std::collections::HashMap::new();
    for r in &img.regions {
        let start = r.start.max(lo);
        let end = (r.start + r.data.len() as u64).min(hi);
        let mut a = start.next_multiple_of(16);
        while a + 16384 <= end {
            let off = usize::try_from(a - r.start).expect("offset");
            let kiv = openssl::sha::sha512(&r.data[off..off + 16384]);
            let mut c = Crypter::new(
                Cipher::aes_256_ctr(),
                Mode::Encrypt,
                &kiv[..32],
                Some(&kiv[32..48]),
            )
            .expect("ctr");
            let mut stream = vec![0u8; sk_off + 32 + 16];
            let zeros = vec![0u8; stream.len()];
            let n = c.update(&zeros, &mut stream).expect("ctr");
            stream.truncate(n);
            let mut first = [0u8; 16];
            for (i, f) in first.iter_mut().enumerate() {
                *f = plain[i] ^ stream[i];
            }
            firsts.insert(first, stream);
            a += 16;
        }
    }
    for r in &img.regions {
        let skew = usize::try_from(r.start % 16).unwrap_or(0);
        let mut at = (16 - skew) % 16;
        while at + sk_off + 32 <= r.data.len() {
            let block: [u8; 16] = r.data[at..at + 16].try_into().expect("16");
            if let Some(stream) = firsts.get(&block) {
                let dec: Vec<u8> = r.data[at + sk_off..at + sk_off + 32]
                    .iter()
                    .zip(&stream[sk_off..])
                    .map(|(e, k)| e ^ k)
                    .collect();
                if dec == seed {
                    return true;
                }
            }
            at += 16;
        }
    }
    false
}

fn heap_of(pid: u32) -> (u64, u64) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    maps.lines()
        .find(|l| l.ends_with("[heap]"))
        .and_then(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .expect("a [heap] mapping")
}

#[test]
fn openssh_uses_vault_keys_through_memveil_agent_and_its_dump_holds_none() {
    for t in ["ssh-add", "ssh-keygen", "ssh-agent", "ssh"] {
        if Command::new(t).arg("-V").output().is_err() && Command::new(t).output().is_err() {
            skip(
                Need::Installed("openssh-client"),
                format!("{t} not on PATH"),
            );
            return;
        }
    }
    let dir = std::env::temp_dir().join(format!("memveil-ssh-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let mut procs = Procs(Vec::new(), dir.clone());
    let vsock = dir.join("vault.sock");
    let asock = dir.join("agent.sock");
    let (v, _) = start(
        Command::new(memveil())
            .args(["vault", "serve", "--socket"])
            .arg(&vsock),
        "memveil-vault ready",
        &dir.join("vault.log"),
    );
    procs.0.push(v);
    let (a, line) = start(
        Command::new(memveil())
            .args(["agent", "--socket"])
            .arg(&asock)
            .arg("--vault")
            .arg(&vsock),
        "SSH_AUTH_SOCK=",
        &dir.join("agent.log"),
    );
    let agent_pid = a.id();
    procs.0.push(a);
    assert!(line.contains(&asock.display().to_string()));
    let keys = [
        keygen(&dir, "ed25519", "ed"),
        keygen(&dir, "ecdsa", "ec"),
        keygen(&dir, "rsa", "rsa"),
    ];
    let agent = |c: &mut Command| -> String {
        ok(
            c.env("SSH_AUTH_SOCK", &asock)
                .env("MEMVEIL_VAULT_SOCKET", &vsock),
            "ssh tool",
        )
    };
    agent(Command::new("ssh-add").args(&keys));
    let list = agent(Command::new("ssh-add").arg("-l"));
    for want in [
        "ed_test (ED25519)",
        "ec_test (ECDSA)",
        "3072 ",
        "rsa_test (RSA)",
    ] {
        assert!(list.contains(want), "ssh-add -l: {list}");
    }
    // In the vault, owned by this uid, named after the comments.
    let vlist = agent(Command::new(memveil()).args(["vault", "list"]));
    for want in ["ssh.ed_test\t", "kind=ed25519", "kind=p256", "kind=rsa3072"] {
        assert!(vlist.contains(want), "vault list: {vlist}");
    }
    // ssh-keygen -Y sign through the agent, verified by OpenSSH.
    let msg = dir.join("msg");
    std::fs::write(&msg, b"signed by a vault key\n").expect("msg");
    for k in &keys {
        let sig = dir.join("msg.sig");
        let _ = std::fs::remove_file(&sig);
        agent(
            Command::new("ssh-keygen")
                .args(["-Y", "sign", "-n", "file", "-f"])
                .arg(k.with_extension("pub"))
                .arg(&msg),
        );
        let who = format!(
            "{}@test",
            k.file_name().and_then(|n| n.to_str()).unwrap_or("")
        );
        let signers = dir.join("allowed");
        let pubkey = std::fs::read_to_string(k.with_extension("pub")).expect("pub");
        std::fs::write(&signers, format!("{who} {pubkey}")).expect("signers");
        let out = Command::new("ssh-keygen")
            .args(["-Y", "verify", "-n", "file", "-f"])
            .arg(&signers)
            .args(["-I", &who, "-s"])
            .arg(&sig)
            .stdin(std::fs::File::open(&msg).expect("msg"))
            .output()
            .expect("verify");
        assert!(
            out.status.success(),
            "ssh-keygen -Y verify {who}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    if is_root() && Command::new("/usr/sbin/sshd").arg("-V").output().is_ok() {
        // A login to an sshd on loopback: through the agent (Ed25519), and
        // through `ssh -I` with a vault RSA key made for it.
        std::fs::create_dir_all("/run/sshd").expect("/run/sshd");
        ok(
            Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(dir.join("host")),
            "host key",
        );
        agent(Command::new(memveil()).args(["vault", "create", "p11rsa", "--kind", "rsa2048"]));
        let p11pub =
            agent(Command::new(memveil()).args(["vault", "pubkey", "p11rsa", "--format", "ssh"]));
        let mut auth = std::fs::read_to_string(keys[0].with_extension("pub")).expect("pub");
        auth.push_str(&p11pub);
        std::fs::write(dir.join("authorized_keys"), auth).expect("authorized_keys");
        // The port is free when chosen, but another process may bind it
        // before sshd does (sshd then exits, "Cannot bind any address"):
        // a port taken meanwhile is chosen again. sshd writes its pid file
        // once it listens (it forks into the background before), so the
        // port is sshd's once the file is there: waiting for the port to
        // answer, another process's listener on it passed for sshd.
        let d = dir.display();
        let mut port = 0;
        for attempt in 1..=5 {
            port = free_port();
            let _ = std::fs::remove_file(dir.join("sshd.log"));
            std::fs::write(
                dir.join("sshd_config"),
                format!(
                    "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host\nPidFile {d}/sshd.pid\n\
                     AuthorizedKeysFile {d}/authorized_keys\nPasswordAuthentication no\n\
                     KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin prohibit-password\nStrictModes no\n"
                ),
            )
            .expect("sshd_config");
            ok(
                Command::new("/usr/sbin/sshd")
                    .arg("-f")
                    .arg(dir.join("sshd_config"))
                    .arg("-E")
                    .arg(dir.join("sshd.log")),
                "sshd",
            );
            let log = || std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default();
            let t0 = std::time::Instant::now();
            let listening = loop {
                if std::fs::read_to_string(dir.join("sshd.pid"))
                    .is_ok_and(|p| p.trim().parse::<u32>().is_ok())
                {
                    break true;
                }
                if log().contains("Cannot bind any address") {
                    break false;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "sshd neither listens on port {port} nor failed to: {}",
                    log()
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            if listening {
                break;
            }
            assert!(
                attempt < 5,
                "sshd could bind none of 5 free ports: {}",
                log()
            );
        }
        let ssh = |extra: &[&str]| {
            let mut c = Command::new("ssh");
            c.args([
                "-F",
                "/dev/null",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
            ])
            .args([
                "-o",
                "BatchMode=yes",
                "-o",
                "LogLevel=ERROR",
                "-p",
                &port.to_string(),
            ])
            .args(extra)
            .args(["root@127.0.0.1", "echo", "logged-in"]);
            c
        };
        let a = agent(&mut ssh(&[
            "-o",
            &format!("IdentityAgent={}", asock.display()),
        ]));
        assert!(a.contains("logged-in"), "{a}");
        let module = memveil().with_file_name("libmemveil_pkcs11.so");
        if module.exists() {
            let p = agent(&mut ssh(&[
                "-o",
                "IdentityAgent=none",
                "-I",
                &module.display().to_string(),
            ]));
            assert!(p.contains("logged-in"), "ssh -I: {p}");
        } else {
            skip(
                Need::Installed("target/release/libmemveil_pkcs11.so"),
                "ssh -I needs the module",
            );
        }
    } else {
        skip(
            Need::Root,
            "the sshd login part (sshd and its privilege separation need root)",
        );
    }

    // Remove, lock, unlock.
    agent(
        Command::new("ssh-add")
            .arg("-d")
            .arg(keys[1].with_extension("pub")),
    );
    let list = agent(Command::new("ssh-add").arg("-l"));
    assert!(
        !list.contains("ec_test") && list.contains("ed_test"),
        "{list}"
    );

    if !is_root() {
        skip(
            Need::Root,
            "the gcore part of the proof (the agents are not dumpable)",
        );
        return;
    }
    // The proof: memveil agent, right after signing, holds none of the key.
    let seed = ed25519_seed(&keys[0]);
    let core = gcore(&dir, agent_pid);
    let k = ok(
        Command::new(memveil())
            .args(["keyfind", "--private-key"])
            .arg(&keys[0])
            .arg("--core")
            .arg(&core),
        "memveil keyfind",
    );
    assert!(
        k.contains(", 0 private-key secret hits"),
        "memveil agent's core: {k}"
    );
    let _ = std::fs::remove_file(&core);
    // Positive control: OpenSSH's ssh-agent with the same key.
    let osock = dir.join("openssh-agent.sock");
    let mut oa = Command::new("ssh-agent")
        .arg("-D")
        .arg("-a")
        .arg(&osock)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("ssh-agent");
    for _ in 0..100 {
        if osock.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let with_ossh = |c: &mut Command| ok(c.env("SSH_AUTH_SOCK", &osock), "openssh agent tool");
    with_ossh(Command::new("ssh-add").arg(&keys[0]));
    let _ = std::fs::remove_file(dir.join("msg.sig"));
    with_ossh(
        Command::new("ssh-keygen")
            .args(["-Y", "sign", "-n", "file", "-f"])
            .arg(keys[0].with_extension("pub"))
            .arg(&msg),
    );
    let (lo, hi) = heap_of(oa.id());
    let core = gcore(&dir, oa.id());
    let img = memveil_keyfind::read_core(&core).expect("core");
    let found = unshield_ed25519(&img, lo, hi, &seed);
    let _ = std::fs::remove_file(&core);
    let _ = oa.kill();
    let _ = oa.wait();
    assert!(
        found,
        "positive control: the Ed25519 key did not come back out of OpenSSH ssh-agent's dump"
    );
}
