//! `memveil agent` against what issue 32's review found (defects 5–7),
//! through its socket with the ssh-agent protocol and real processes:
//!
//! - it offers only its user's own keys: a key another uid made and granted
//!   to it is not listed (unless `--offer-granted`);
//! - it replaces only a stale socket at its path: a regular file there (say
//!   `~/.ssh/id_ed25519`) survives, with an error naming it;
//! - LOCK/UNLOCK: wrong passphrases cost a growing delay, guesses from
//!   parallel connections wait their turn, the connections served at once
//!   are capped, and the passphrase is gone from the agent's memory after
//!   UNLOCK (read into secret memory and wiped; before, it stayed in a
//!   freed heap buffer that a `gcore` of the agent shows).

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{gcore, is_root};
use memveil_testkit::{skip, Need};

mod common;

fn memveil() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_memveil"))
}

/// The test's processes and directory, killed and removed on drop.
struct Procs(Vec<Child>, PathBuf);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

impl Procs {
    fn new(tag: &str) -> Procs {
        let dir = std::env::temp_dir().join(format!("memveil-agent-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        Procs(Vec::new(), dir)
    }

    /// Starts `cmd` (stderr into `log`), waits for its first stdout line.
    fn start(&mut self, cmd: &mut Command, want: &str, log: &str) -> u32 {
        let mut c = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(self.1.join(log)).expect("log"))
            .spawn()
            .expect("spawn");
        let mut line = String::new();
        let _ = BufReader::new(c.stdout.take().expect("stdout")).read_line(&mut line);
        let pid = c.id();
        self.0.push(c);
        assert!(
            line.starts_with(want),
            "{want}: got {line:?}; log: {}",
            self.log(log)
        );
        pid
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.1.join(name)).unwrap_or_default()
    }

    /// A vault on `dir/vault.sock`, reachable by every uid.
    fn vault(&mut self) -> PathBuf {
        let s = self.1.join("vault.sock");
        std::fs::set_permissions(&self.1, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        self.start(
            Command::new(memveil())
                .args(["vault", "serve", "--socket"])
                .arg(&s),
            "memveil-vault ready",
            "vault.log",
        );
        s
    }

    /// An agent on `dir/NAME` over `vault` with `extra` flags.
    fn agent(&mut self, vault: &Path, name: &str, extra: &[&str]) -> (PathBuf, u32) {
        let s = self.1.join(name);
        let pid = self.start(
            Command::new(memveil())
                .args(["agent", "--socket"])
                .arg(&s)
                .arg("--vault")
                .arg(vault)
                .args(extra),
            "SSH_AUTH_SOCK=",
            &format!("{name}.log"),
        );
        (s, pid)
    }
}

/// `memveil vault ARGS` against `vault`, as root or as `nobody`.
fn vault_cli(vault: &Path, nobody: bool, args: &[&str]) -> String {
    let mut c = if nobody {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(memveil());
        c
    } else {
        Command::new(memveil())
    };
    let out = c
        .arg("vault")
        .arg("--socket")
        .arg(vault)
        .args(args)
        .output()
        .expect("memveil vault");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "vault {args:?}: {text}");
    text
}

/// One ssh-agent request (type and body), its answer's type and body.
fn request(s: &mut UnixStream, t: u8, body: &[u8]) -> std::io::Result<(u8, Vec<u8>)> {
    let n = u32::try_from(body.len() + 1).expect("len");
    let mut m = n.to_be_bytes().to_vec();
    m.push(t);
    m.extend_from_slice(body);
    s.write_all(&m)?;
    let mut h = [0u8; 4];
    s.read_exact(&mut h)?;
    let mut a = vec![0u8; usize::try_from(u32::from_be_bytes(h)).expect("len")];
    s.read_exact(&mut a)?;
    let (t, rest) = a.split_first().expect("a type byte");
    Ok((*t, rest.to_vec()))
}

fn string(b: &[u8]) -> Vec<u8> {
    let mut v = u32::try_from(b.len()).expect("len").to_be_bytes().to_vec();
    v.extend_from_slice(b);
    v
}

/// The comments of the keys the agent lists.
fn identities(sock: &Path) -> Vec<String> {
    let mut s = UnixStream::connect(sock).expect("agent");
    let (t, b) = request(&mut s, 11, &[]).expect("REQUEST_IDENTITIES");
    assert_eq!(t, 12, "IDENTITIES_ANSWER");
    let mut at = 4;
    let mut out = Vec::new();
    let field = |at: &mut usize| {
        let n = usize::try_from(u32::from_be_bytes(b[*at..*at + 4].try_into().expect("4")))
            .expect("len");
        let f = b[*at + 4..*at + 4 + n].to_vec();
        *at += 4 + n;
        f
    };
    for _ in 0..u32::from_be_bytes(b[..4].try_into().expect("count")) {
        let _blob = field(&mut at);
        out.push(String::from_utf8_lossy(&field(&mut at)).into_owned());
    }
    out
}

/// Regression (issue 32, defect 5): `keys()` did not filter on the owner,
/// and a grant needs no consent, so another uid could put its keys into
/// this user's `ssh-add -l` (and logins). Now only the user's own keys are
/// offered; `--offer-granted` restores the old behaviour on request.
#[test]
fn the_agent_offers_only_its_users_own_keys() {
    if !is_root() {
        skip(Need::Root, "runs a vault client as nobody");
        return;
    }
    let mut p = Procs::new("owner");
    let vault = p.vault();
    vault_cli(&vault, false, &["create", "ssh.mine", "--kind", "p256"]);
    vault_cli(&vault, true, &["create", "ssh.planted", "--kind", "p256"]);
    vault_cli(&vault, true, &["grant", "ssh.planted", "0", "e"]);
    let (own, _) = p.agent(&vault, "own.sock", &[]);
    assert_eq!(identities(&own), ["mine"], "{}", p.log("own.sock.log"));
    let (all, _) = p.agent(&vault, "all.sock", &["--offer-granted"]);
    let mut got = identities(&all);
    got.sort();
    assert_eq!(got, ["mine", "planted"]);
}

/// Runs `memveil agent --socket SOCK --vault VAULT`, which must refuse to
/// start: its stderr. An agent that starts instead is killed after 10 s
/// and the test fails.
fn agent_refuses(sock: &Path, vault: &Path) -> String {
    let errlog = sock.with_extension("refused.log");
    let mut c = Command::new(memveil())
        .args(["agent", "--socket"])
        .arg(sock)
        .arg("--vault")
        .arg(vault)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&errlog).expect("log"))
        .spawn()
        .expect("agent");
    let t0 = Instant::now();
    let st = loop {
        if let Some(st) = c.try_wait().expect("wait") {
            break Some(st);
        }
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = c.kill();
            let _ = c.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::fs::read_to_string(&errlog).unwrap_or_default();
    assert!(
        st.is_some_and(|s| !s.success()),
        "the agent started on {} ({st:?}): {err}",
        sock.display()
    );
    err
}

/// Regression (issue 32, defect 6): the agent deleted whatever sat at its
/// socket path (`--socket ~/.ssh/id_ed25519` deleted the key). Now a
/// regular file, a directory or a live socket is refused with a message,
/// and only a stale socket is replaced.
#[test]
fn the_agent_replaces_only_a_stale_socket() {
    let mut p = Procs::new("path");
    let vault = p.vault();
    let key = p.1.join("id_ed25519");
    std::fs::write(&key, b"-----BEGIN OPENSSH PRIVATE KEY-----\n").expect("write");
    let err = agent_refuses(&key, &vault);
    assert!(
        err.contains("a regular file is there") && err.contains("refusing to replace it"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&key).expect("the file survives"),
        b"-----BEGIN OPENSSH PRIVATE KEY-----\n"
    );
    // A live socket (another agent's) is refused too, and keeps working.
    let (live, _) = p.agent(&vault, "live.sock", &[]);
    let err = agent_refuses(&live, &vault);
    assert!(err.contains("listens on it"), "{err}");
    assert!(identities(&live).is_empty());
    // A stale socket (bound, nobody listening) is replaced.
    let stale = p.1.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    p.agent(&vault, "stale.sock", &[]);
    assert!(identities(&stale).is_empty());
}

/// Regression (issue 32, defect 7): a wrong UNLOCK cost a fixed 100 ms
/// with unlimited parallel connections. Now each wrong guess costs 100 ms
/// more than the last, guesses on parallel connections wait their turn,
/// and at most `--max-connections` are served at once.
#[test]
fn unlock_guesses_cost_more_each_and_connections_are_capped() {
    let mut p = Procs::new("lock");
    let vault = p.vault();
    let (sock, _) = p.agent(&vault, "a.sock", &["--max-connections", "3"]);
    let mut s = UnixStream::connect(&sock).expect("agent");
    assert_eq!(request(&mut s, 22, &string(b"right")).expect("LOCK").0, 6);
    let mut took = Vec::new();
    for _ in 0..3 {
        let t0 = Instant::now();
        assert_eq!(request(&mut s, 23, &string(b"wrong")).expect("UNLOCK").0, 5);
        took.push(t0.elapsed());
    }
    println!("wrong guesses answered after {took:?}");
    for (i, t) in took.iter().enumerate() {
        let owed = Duration::from_millis(100) * u32::try_from(i + 1).expect("i");
        assert!(
            *t >= owed,
            "guess {} answered after {t:?}, before {owed:?}",
            i + 1
        );
    }
    // Two more guesses at once, on two connections: the second waits for
    // the first's delay (400 ms) and its own (500 ms).
    let t0 = Instant::now();
    let guessers: Vec<_> = (0..2)
        .map(|_| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&sock).expect("agent");
                request(&mut s, 23, &string(b"wrong")).expect("UNLOCK").0
            })
        })
        .collect();
    for g in guessers {
        assert_eq!(g.join().expect("guesser"), 5);
    }
    let both = t0.elapsed();
    println!("two parallel wrong guesses answered after {both:?}");
    assert!(both >= Duration::from_millis(900), "{both:?}");
    assert_eq!(request(&mut s, 23, &string(b"right")).expect("UNLOCK").0, 6);
    // Three connections at once are served; a fourth is closed unanswered.
    let mut held: Vec<UnixStream> = (0..2)
        .map(|_| UnixStream::connect(&sock).expect("agent"))
        .collect();
    for h in &mut held {
        assert_eq!(request(h, 11, &[]).expect("served").0, 12);
    }
    let mut fourth = UnixStream::connect(&sock).expect("connect");
    fourth
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    assert!(
        request(&mut fourth, 11, &[]).is_err(),
        "a fourth connection was served"
    );
    assert!(p.log("a.sock.log").contains("3 are open, the limit"));
    // A slot given back serves a new connection.
    drop(held.pop());
    let t0 = Instant::now();
    loop {
        let mut c = UnixStream::connect(&sock).expect("connect");
        if request(&mut c, 11, &[]).is_ok() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the slot never came back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Regression (issue 32, defect 7): LOCK/UNLOCK bodies were read into an
/// ordinary buffer, freed unwiped, so the passphrase stayed in the agent's
/// heap (the positive control: found in a `gcore` of the old agent). Now
/// they are read into secret memory and wiped, and the lock keeps only an
/// Argon2id hash: the `gcore` holds no copy.
#[test]
fn the_lock_passphrase_does_not_stay_in_the_agents_memory() {
    if Command::new("gcore").arg("--version").output().is_err() {
        skip(Need::Installed("gdb"), "gcore of the agent");
        return;
    }
    let mut p = Procs::new("pass");
    let vault = p.vault();
    let (sock, pid) = p.agent(&vault, "a.sock", &[]);
    let pass = b"pass-7f3a9c1e-issue32-lock-phrase-0123456789-abcdefghijklmnopq";
    let mut s = UnixStream::connect(&sock).expect("agent");
    assert_eq!(request(&mut s, 22, &string(pass)).expect("LOCK").0, 6);
    assert_eq!(request(&mut s, 23, &string(pass)).expect("UNLOCK").0, 6);
    let core = gcore(&p.1, pid);
    let img = std::fs::read(&core).expect("core");
    let _ = std::fs::remove_file(&core);
    assert!(img.len() > 4096, "an empty core");
    // The tail: a freed block's first 16 bytes become allocator links.
    let tail = &pass[24..];
    let found = img.windows(tail.len()).filter(|w| *w == tail).count();
    assert_eq!(
        found, 0,
        "the passphrase is in the agent's core {found} times"
    );
}
