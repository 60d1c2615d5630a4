//! nginx serving TLS with its private keys in the vault (issue 27): the
//! recipe of docs/pkcs11-recipes.md, set up in a scratch directory for the
//! figures `nginx.tls_*_vault_vs_file` and for the end-to-end test
//! (`crates/memveil/tests/asym_nginx.rs`).
//!
//! A vault started for the run; an RSA-2048 and a P-256 key made by
//! `openssl` as PEM files and imported into it (so the same key can be
//! served from the file for the baseline, and its primes and scalar looked
//! for in memory), `e` granted to `www-data`; the RSA certificate signed
//! through the engine (the key in the vault), the EC one from the file; an
//! OpenSSL configuration loading libp11's `pkcs11` engine over
//! `libmemveil_pkcs11.so`; two nginx configurations, one with
//! `ssl_certificate_key "engine:pkcs11:pkcs11:…"`, one with the PEM files:
//! master plus two workers (as `www-data` when run as root), an RSA and an
//! EC listener on free loopback ports.

use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::nginx::{free_port, tool as run};

/// libp11's OpenSSL engine on Debian 12 (`libengine-pkcs11-openssl`).
pub const ENGINE: &str = "/usr/lib/x86_64-linux-gnu/engines-3/pkcs11.so";

/// The uid nginx's workers run as when started by root (Debian's
/// `www-data`).
pub const WWW_DATA: u32 = 33;

/// The site: a vault with the two keys, certificates, configurations.
pub struct VaultTls {
    /// Scratch directory (mode 0755 so the workers reach the socket).
    pub dir: PathBuf,
    /// The memveil binary.
    pub memveil: PathBuf,
    /// The vault's control socket.
    pub socket: PathBuf,
    /// The RSA listener.
    pub rsa_port: u16,
    /// The P-256 listener.
    pub ec_port: u16,
    vault: Child,
    as_root: bool,
}

/// The PKCS#11 URI of a vault key for libp11.
fn uri(name: &str) -> String {
    format!("pkcs11:token=memveil%20vault;object={name};type=private")
}

impl VaultTls {
    /// Sets the site up in `dir` (created): starts the vault, makes and
    /// imports the keys, signs the RSA certificate through the engine,
    /// writes the configurations.
    ///
    /// # Errors
    /// A tool is missing or failed; the message names it.
    pub fn prepare(dir: &Path, memveil: &Path, module: &Path) -> Result<Self, String> {
        if !Path::new(ENGINE).exists() {
            return Err(format!(
                "{ENGINE} missing: install libengine-pkcs11-openssl (scripts/install.sh)"
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        let as_root = memveil_sys::probe::euid() == 0;
        let socket = dir.join("vault.sock");
        let mut vault = Command::new(memveil)
            .args(["vault", "serve", "--vault"])
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("vault.log")).map_err(|e| e.to_string())?)
            .spawn()
            .map_err(|e| format!("memveil vault serve: {e}"))?;
        let ready = crate::vault::first_line(&mut vault, Duration::from_secs(30));
        if !ready.starts_with("memveil-vault ready") {
            let _ = vault.kill();
            let _ = vault.wait();
            return Err(format!(
                "the vault did not start: {}",
                std::fs::read_to_string(dir.join("vault.log")).unwrap_or_default()
            ));
        }
        let site = VaultTls {
            dir: dir.to_owned(),
            memveil: memveil.to_owned(),
            socket,
            rsa_port: free_port()?,
            ec_port: free_port()?,
            vault,
            as_root,
        };
        let p = |n: &str| dir.join(n);
        for (alg, opt, file) in [
            ("RSA", "rsa_keygen_bits:2048", "rsa.pem"),
            ("EC", "ec_paramgen_curve:P-256", "ec.pem"),
        ] {
            run(
                Command::new("openssl")
                    .args(["genpkey", "-algorithm", alg, "-pkeyopt", opt, "-out"])
                    .arg(p(file)),
                &format!("openssl genpkey ({opt})"),
            )?;
        }
        for (name, file) in [("rsa", "rsa.pem"), ("ec", "ec.pem")] {
            site.vault_cli(&["import", name, "--key-file", &p(file).display().to_string()])?;
            site.vault_cli(&["grant", name, &WWW_DATA.to_string(), "e"])?;
        }
        std::fs::write(
            p("openssl.cnf"),
            format!(
                "openssl_conf = openssl_init\n[openssl_init]\nengines = engine_section\n\
                 [engine_section]\npkcs11 = pkcs11_section\n[pkcs11_section]\nengine_id = pkcs11\n\
                 dynamic_path = {ENGINE}\nMODULE_PATH = {}\ninit = 1\n",
                module.display()
            ),
        )
        .map_err(|e| e.to_string())?;
        // Self-signed certificates for CN=localhost, valid two days.
        let req = || {
            let mut c = Command::new("openssl");
            c.args([
                "req",
                "-new",
                "-x509",
                "-days",
                "2",
                "-subj",
                "/CN=localhost",
            ]);
            c
        };
        // The RSA certificate is signed by the vault's key, through the engine.
        run(
            req()
                .args([
                    "-engine",
                    "pkcs11",
                    "-keyform",
                    "engine",
                    "-key",
                    &uri("rsa"),
                ])
                .arg("-out")
                .arg(p("rsa.crt"))
                .env("OPENSSL_CONF", p("openssl.cnf"))
                .env("MEMVEIL_VAULT_SOCKET", &site.socket),
            "openssl req with the pkcs11 engine",
        )?;
        run(
            req()
                .arg("-key")
                .arg(p("ec.pem"))
                .arg("-out")
                .arg(p("ec.crt")),
            "openssl req (P-256)",
        )?;
        for vault_keys in [true, false] {
            site.write_conf(vault_keys)?;
        }
        Ok(site)
    }

    /// Runs `memveil vault ARGS` against this site's vault.
    ///
    /// # Errors
    /// The verb failed.
    pub fn vault_cli(&self, args: &[&str]) -> Result<String, String> {
        run(
            Command::new(&self.memveil)
                .arg("vault")
                .args(args)
                .env("MEMVEIL_VAULT_SOCKET", &self.socket),
            "memveil vault",
        )
    }

    fn conf(&self, vault_keys: bool) -> PathBuf {
        self.dir.join(if vault_keys {
            "vault.conf"
        } else {
            "file.conf"
        })
    }

    fn write_conf(&self, vault_keys: bool) -> Result<(), String> {
        let d = self.dir.display();
        let key = |name: &str| {
            if vault_keys {
                format!("\"engine:pkcs11:{}\"", uri(name))
            } else {
                format!("{d}/{name}.pem")
            }
        };
        let user = if self.as_root { "user www-data;\n" } else { "" };
        let server = |port: u16, name: &str| {
            format!(
                "  server {{\n    listen 127.0.0.1:{port} ssl;\n    ssl_protocols TLSv1.2 TLSv1.3;\n\
                 ssl_certificate {d}/{name}.crt;\n    ssl_certificate_key {};\n\
                 location / {{ return 200 \"ok\\n\"; }}\n  }}\n",
                key(name)
            )
        };
        let conf = format!(
            "{user}daemon off;\nmaster_process on;\nworker_processes 2;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log warn;\nenv MEMVEIL_VAULT_SOCKET;\n\
             events {{ worker_connections 512; }}\nhttp {{\n  access_log off;\n\
             client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fcgi;\n\
             uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  keepalive_timeout 0;\n{}{}}}\n",
            server(self.rsa_port, "rsa"),
            server(self.ec_port, "ec")
        );
        std::fs::write(self.conf(vault_keys), conf).map_err(|e| e.to_string())
    }

    /// Starts nginx with the keys in the vault (`vault_keys`) or in the PEM
    /// files, and waits until both listeners accept.
    ///
    /// # Errors
    /// nginx did not come up; its error log says why.
    pub fn start(&self, vault_keys: bool) -> Result<Child, String> {
        let mut child = Command::new("nginx")
            .arg("-c")
            .arg(self.conf(vault_keys))
            .env("OPENSSL_CONF", self.dir.join("openssl.cnf"))
            .env("MEMVEIL_VAULT_SOCKET", &self.socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("nginx: {e} (install it: scripts/install.sh)"))?;
        let t = Instant::now();
        let up = |p: u16| TcpStream::connect((Ipv4Addr::LOCALHOST, p)).is_ok();
        while t.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(st)) = child.try_wait() {
                return Err(format!("nginx exited ({st}): {}", self.error_log()));
            }
            if up(self.rsa_port) && up(self.ec_port) && self.worker_pids().len() == 2 {
                return Ok(child);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.stop(&mut child);
        Err(format!("nginx did not listen: {}", self.error_log()))
    }

    /// The last lines of nginx's error log.
    #[must_use]
    pub fn error_log(&self) -> String {
        crate::nginx::error_log_in(&self.dir)
    }

    /// The master's pid.
    #[must_use]
    pub fn master_pid(&self) -> Option<u32> {
        crate::nginx::master_pid_in(&self.dir)
    }

    /// The workers' pids.
    #[must_use]
    pub fn worker_pids(&self) -> Vec<u32> {
        crate::nginx::worker_pids_in(&self.dir)
    }

    /// Stops nginx (SIGTERM to the master) and reaps it; removes the pid
    /// file so the next start does not read a dead master's pid.
    pub fn stop(&self, child: &mut Child) {
        crate::nginx::stop_in(&self.dir, child);
        let _ = std::fs::remove_file(self.dir.join("nginx.pid"));
    }

    /// One TLS handshake against `port` (TLS 1.3, or 1.2), the certificate
    /// verified against the site's own (`-CAfile`, `-verify_return_error`):
    /// the server proved it holds the certificate's private key. Returns
    /// `openssl s_client`'s "Peer signature type" (RSA-PSS, ECDSA…).
    ///
    /// # Errors
    /// The handshake or the verification failed.
    pub fn handshake(&self, port: u16, tls13: bool) -> Result<String, String> {
        let cert = if port == self.rsa_port {
            "rsa.crt"
        } else {
            "ec.crt"
        };
        let out = run(
            Command::new("openssl")
                .arg("s_client")
                .arg(if tls13 { "-tls1_3" } else { "-tls1_2" })
                .args(["-connect", &format!("127.0.0.1:{port}")])
                .args([
                    "-servername",
                    "localhost",
                    "-verify_return_error",
                    "-CAfile",
                ])
                .arg(self.dir.join(cert))
                .stdin(Stdio::null()),
            "openssl s_client",
        )?;
        if !out.contains("Verify return code: 0 (ok)") {
            return Err(format!("certificate not verified: {out}"));
        }
        out.lines()
            .find_map(|l| l.trim().strip_prefix("Peer signature type: "))
            .map(str::to_owned)
            .ok_or_else(|| format!("no peer signature in: {out}"))
    }
}

impl Drop for VaultTls {
    fn drop(&mut self) {
        let _ = self.vault.kill();
        let _ = self.vault.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
