//! A real KMIP server for tests and benchmarks: PyKMIP's `pykmip-server`
//! (installed by `scripts/install.d/kmip.sh` into `build/kmipvenv`), on
//! loopback, with a CA, a server certificate and client certificates made
//! here with the `openssl` CLI, in a directory of its own. Not for
//! production: PyKMIP is a reference server.
//!
//! PyKMIP 0.10 on Python 3.11: `auth_suite = TLS1.2` (the `Basic` suite
//! asks for a protocol constant newer Pythons warn about), client
//! certificates with `extendedKeyUsage = clientAuth` (PyKMIP closes the
//! connection after the handshake otherwise), SQLAlchemy below 2. Objects
//! created with the Operation Policy Name [`FLEET_POLICY`] may be read by
//! every client certificate the CA signed (the policy file this module
//! writes); others only by their creator's certificate common name.
//!
//! `pykmip-server` is more than one process: it forks a `multiprocessing`
//! manager and a policy-directory monitor, which a signal to its pid alone
//! leaves running (as would a wrapper script's child). So the server runs
//! as the leader of a process group of its own, and [`TestServer::stop`]
//! (and dropping the [`TestServer`], on a panic too) kills the whole group
//! and waits until it is empty. Should its starter be killed or abort
//! without dropping it, the server gets SIGINT (`PR_SET_PDEATHSIG`), on
//! which PyKMIP leaves its accept loop at once, stops its helpers and exits
//! (within a second, tested by hand); on SIGTERM it would wait out its
//! 10 s socket timeout first.
#![forbid(unsafe_code)]

use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Config;

/// The operation policy under which hosts of one fleet share keys.
pub const FLEET_POLICY: &str = "memveil-fleet";

/// Where `scripts/install.d/kmip.sh` puts the server.
pub fn server_program() -> PathBuf {
    std::env::var_os("MEMVEIL_PYKMIP_SERVER").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../build/kmipvenv/bin/pykmip-server"),
        PathBuf::from,
    )
}

/// A running (or stopped) PyKMIP server and its files.
pub struct TestServer {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

fn run(dir: &Path, args: &[&str]) -> Result<(), String> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("openssl: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Makes `name.key`/`name.crt` in `dir`, signed by `ca` (self-signed when `None`).
fn cert(dir: &Path, name: &str, cn: &str, ca: Option<&str>, ext: &str) -> Result<(), String> {
    let key = format!("{name}.key");
    let crt = format!("{name}.crt");
    run(
        dir,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            &key,
        ],
    )?;
    let subj = format!("/CN={cn}");
    match ca {
        None => run(
            dir,
            &[
                "req",
                "-x509",
                "-new",
                "-key",
                &key,
                "-subj",
                &subj,
                "-days",
                "2",
                "-out",
                &crt,
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=keyCertSign,cRLSign",
            ],
        ),
        Some(ca) => {
            let csr = format!("{name}.csr");
            let extf = format!("{name}.ext");
            std::fs::write(dir.join(&extf), ext).map_err(|e| e.to_string())?;
            run(
                dir,
                &["req", "-new", "-key", &key, "-subj", &subj, "-out", &csr],
            )?;
            run(
                dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    &format!("{ca}.crt"),
                    "-CAkey",
                    &format!("{ca}.key"),
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-out",
                    &crt,
                    "-extfile",
                    &extf,
                ],
            )
        }
    }
}

const CLIENT_EXT: &str =
    "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n";

const SERVER_EXT: &str = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyAgreement\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n";

/// Makes the test certificates in `dir` (created), each `NAME.crt` with its
/// `NAME.key`: `ca`, the server's `server` (for 127.0.0.1) and the clients
/// `host-a`, `host-b` it signed; another CA, `rogue-ca`, and what it signed:
/// a client `rogue` (named host-a) and a server `rogue-server` (for
/// 127.0.0.1, as a server impersonating the KMS would present).
///
/// # Errors
/// The words of what failed (no openssl, a file not written).
pub fn certificates(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    cert(dir, "ca", "memveil test KMIP CA", None, "")?;
    cert(dir, "server", "127.0.0.1", Some("ca"), SERVER_EXT)?;
    cert(dir, "host-a", "host-a", Some("ca"), CLIENT_EXT)?;
    cert(dir, "host-b", "host-b", Some("ca"), CLIENT_EXT)?;
    cert(dir, "rogue-ca", "rogue CA", None, "")?;
    cert(dir, "rogue", "host-a", Some("rogue-ca"), CLIENT_EXT)?;
    cert(
        dir,
        "rogue-server",
        "127.0.0.1",
        Some("rogue-ca"),
        SERVER_EXT,
    )
}

impl TestServer {
    /// Makes [`certificates`] in `dir` (created) and starts the server on a
    /// free loopback port. Client certificates: `host-a`, `host-b`
    /// (CA-signed), `rogue` (signed by another CA).
    ///
    /// # Errors
    /// The words of what failed (no openssl, no PyKMIP, server not listening).
    pub fn start(dir: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(dir.join("policies")).map_err(|e| e.to_string())?;
        certificates(dir)?;
        let all = |p: &str| {
            format!(
                "{{\"GET\": \"ALLOW_ALL\", \"LOCATE\": \"ALLOW_ALL\", \"GET_ATTRIBUTES\": \"ALLOW_ALL\", \"GET_ATTRIBUTE_LIST\": \"ALLOW_ALL\", \"DESTROY\": \"{p}\", \"ACTIVATE\": \"{p}\", \"REVOKE\": \"{p}\", \"ADD_ATTRIBUTE\": \"{p}\", \"MODIFY_ATTRIBUTE\": \"{p}\", \"DELETE_ATTRIBUTE\": \"{p}\"}}"
            )
        };
        std::fs::write(
            dir.join("policies/fleet.json"),
            format!(
                "{{\"{FLEET_POLICY}\": {{\"preset\": {{\"SYMMETRIC_KEY\": {0}, \"SECRET_DATA\": {0}}}}}}}",
                all("ALLOW_OWNER")
            ),
        )
        .map_err(|e| e.to_string())?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let d = dir.display();
        std::fs::write(
            dir.join("server.conf"),
            format!(
                "[server]\nhostname=127.0.0.1\nport={port}\ncertificate_path={d}/server.crt\nkey_path={d}/server.key\nca_path={d}/ca.crt\nauth_suite=TLS1.2\npolicy_path={d}/policies\nenable_tls_client_auth=True\nlogging_level=INFO\ndatabase_path={d}/pykmip.db\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        let mut s = Self {
            dir: dir.to_owned(),
            port,
            child: None,
        };
        s.restart()?;
        Ok(s)
    }

    /// Starts the server again (same port, same database) after [`TestServer::stop`].
    ///
    /// # Errors
    /// The server did not start listening within 30 s.
    pub fn restart(&mut self) -> Result<(), String> {
        let prog = server_program();
        let loaded = |dir: &Path| {
            std::fs::read_to_string(dir.join("pykmip.log"))
                .unwrap_or_default()
                .matches(&format!("Loading policy: {FLEET_POLICY}"))
                .count()
        };
        let before = loaded(&self.dir);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&prog);
        cmd.arg("--config_path")
            .arg(self.dir.join("server.conf"))
            .arg("--log_path")
            .arg(self.dir.join("pykmip.log"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .process_group(0);
        memveil_sys::process::die_with_parent(&mut cmd, libc::SIGINT);
        let child = cmd
            .spawn()
            .map_err(|e| format!("{}: {e} (run scripts/install.sh)", prog.display()))?;
        self.child = Some(child);
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(30) {
            // Listening, and the policy file read (PyKMIP's monitor loads
            // it about a second after the start).
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() && loaded(&self.dir) > before {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    return Err(format!("pykmip-server exited ({st}): {}", self.log()));
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "pykmip-server not listening after 30 s: {}",
            self.log()
        ))
    }

    /// Stops the server (SIGKILL: as a crashed or unreachable KMS): every
    /// process of its group, and waits (up to 10 s) until none is left.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let group = c.id();
            let _ = memveil_sys::process::signal_group(group, libc::SIGKILL);
            let _ = c.kill();
            let _ = c.wait();
            // The forked helpers are not our children: their parent's death
            // hands them to init, which reaps them. Signal 0 finds any left.
            let t0 = Instant::now();
            while memveil_sys::process::signal_group(group, 0).is_ok()
                && t0.elapsed() < Duration::from_secs(10)
            {
                let _ = memveil_sys::process::signal_group(group, libc::SIGKILL);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// The process group of the running server (its leader's pid), `None`
    /// when stopped.
    pub fn process_group(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's log so far (its own log and its stderr).
    pub fn log(&self) -> String {
        let a = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        let b = std::fs::read_to_string(self.dir.join("pykmip.log")).unwrap_or_default();
        let tail = |s: &str| {
            s.lines()
                .rev()
                .take(20)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        };
        format!("{}\n{}", tail(&a), tail(&b))
    }

    /// `127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The directory of its files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A client configuration with certificate `who` (`host-a`, `host-b`, `rogue`).
    pub fn config(&self, who: &str) -> Config {
        Config {
            url: self.url(),
            cert: self.dir.join(format!("{who}.crt")),
            key: self.dir.join(format!("{who}.key")),
            ca: self.dir.join("ca.crt"),
            timeout: Duration::from_secs(10),
        }
    }

    /// Writes a configuration file for `who` and returns its path.
    ///
    /// # Errors
    /// Writing failed.
    pub fn config_file(&self, who: &str) -> Result<PathBuf, String> {
        let c = self.config(who);
        let p = self.dir.join(format!("{who}.toml"));
        std::fs::write(
            &p,
            format!(
                "# KMIP settings of {who}\nurl = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\ntimeout_ms = 10000\n",
                c.url,
                c.cert.display(),
                c.key.display(),
                c.ca.display()
            ),
        )
        .map_err(|e| e.to_string())?;
        Ok(p)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}
