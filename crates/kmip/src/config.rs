//! Where the KMIP server is and which certificates to use: flags, or a file
//! of `key = "value"` lines (a TOML subset: `#` comments, one table-less
//! level), e.g. `/etc/memveil/kmip.toml`:
//!
//! ```toml
//! url = "kmip.example.net:5696"
//! cert = "/etc/memveil/kmip/host.crt"   # this host's client certificate (PEM)
//! key = "/etc/memveil/kmip/host.key"    # its private key (PEM)
//! ca = "/etc/memveil/kmip/ca.crt"       # the CA that signed the server's certificate
//! timeout_ms = 5000
//! ```
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The default configuration file.
pub const DEFAULT_FILE: &str = "/etc/memveil/kmip.toml";
/// KMIP's registered port.
pub const DEFAULT_PORT: u16 = 5696;

/// A KMIP server and this host's credentials for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `host:port`, `host` (port 5696) or `kmip://host[:port]`.
    pub url: String,
    /// Client certificate (PEM).
    pub cert: PathBuf,
    /// Client private key (PEM).
    pub key: PathBuf,
    /// CA certificate(s) that sign the server's certificate (PEM).
    pub ca: PathBuf,
    /// Connect, read and write timeout.
    pub timeout: Duration,
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading KMIP configuration {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A line is not `key = "value"`, or the key is unknown.
    #[error("{path}:{line}: {why}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// Line number.
        line: usize,
        /// What is wrong.
        why: String,
    },
    /// A setting is missing.
    #[error("KMIP: no {what}: pass --kmip-{what} or set `{what} = \"...\"` in the configuration file (--kmip-config, default {DEFAULT_FILE})")]
    Missing {
        /// The setting.
        what: &'static str,
    },
}

/// Settings given on the command line; a `None` falls back to the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--kmip`.
    pub url: Option<String>,
    /// `--kmip-cert`.
    pub cert: Option<PathBuf>,
    /// `--kmip-key`.
    pub key: Option<PathBuf>,
    /// `--kmip-ca`.
    pub ca: Option<PathBuf>,
    /// `--kmip-config`.
    pub file: Option<PathBuf>,
}

impl Overrides {
    /// True when no KMIP setting was given at all.
    pub fn is_empty(&self) -> bool {
        self.url.is_none()
            && self.cert.is_none()
            && self.key.is_none()
            && self.ca.is_none()
            && self.file.is_none()
    }

    /// The configuration: flags over the file (`--kmip-config`, else
    /// [`DEFAULT_FILE`] when it exists).
    ///
    /// # Errors
    /// [`ConfigError`] naming the file, the line, or the missing setting.
    pub fn resolve(&self) -> Result<Config, ConfigError> {
        let file = match &self.file {
            Some(f) => Some(parse_file(f)?),
            None if Path::new(DEFAULT_FILE).exists() => Some(parse_file(Path::new(DEFAULT_FILE))?),
            None => None,
        };
        let f = file.unwrap_or_default();
        let url = self
            .url
            .clone()
            .or(f.url)
            .ok_or(ConfigError::Missing { what: "url" })?;
        Ok(Config {
            url,
            cert: self
                .cert
                .clone()
                .or(f.cert)
                .ok_or(ConfigError::Missing { what: "cert" })?,
            key: self
                .key
                .clone()
                .or(f.key)
                .ok_or(ConfigError::Missing { what: "key" })?,
            ca: self
                .ca
                .clone()
                .or(f.ca)
                .ok_or(ConfigError::Missing { what: "ca" })?,
            timeout: Duration::from_millis(f.timeout_ms.unwrap_or(5000)),
        })
    }
}

#[derive(Default, Debug)]
struct FileSettings {
    url: Option<String>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    ca: Option<PathBuf>,
    timeout_ms: Option<u64>,
}

fn parse_file(path: &Path) -> Result<FileSettings, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse(path, &text)
}

fn parse(path: &Path, text: &str) -> Result<FileSettings, ConfigError> {
    let mut s = FileSettings::default();
    for (n, raw) in text.lines().enumerate() {
        let syntax = |why: String| ConfigError::Syntax {
            path: path.to_owned(),
            line: n + 1,
            why,
        };
        let line = strip_comment(raw).trim();
        if line.is_empty() {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| syntax("expected key = \"value\"".into()))?;
        let (k, v) = (k.trim(), v.trim());
        let text = || -> Result<String, ConfigError> {
            v.strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .filter(|v| !v.contains('"') && !v.contains('\\'))
                .map(str::to_owned)
                .ok_or_else(|| {
                    syntax(format!(
                        "{k}: expected a double-quoted string without escapes"
                    ))
                })
        };
        match k {
            "url" => s.url = Some(text()?),
            "cert" => s.cert = Some(text()?.into()),
            "key" => s.key = Some(text()?.into()),
            "ca" => s.ca = Some(text()?.into()),
            "timeout_ms" => {
                s.timeout_ms = Some(
                    v.parse()
                        .map_err(|_| syntax("timeout_ms: expected a whole number".into()))?,
                );
            }
            _ => {
                return Err(syntax(format!(
                    "unknown setting {k:?} (known: url, cert, key, ca, timeout_ms)"
                )))
            }
        }
    }
    Ok(s)
}

/// The line up to a `#` outside quotes.
fn strip_comment(line: &str) -> &str {
    let mut quoted = false;
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '#' if !quoted => return &line[..i],
            _ => {}
        }
    }
    line
}

impl Config {
    /// (host, port) of [`Config::url`].
    pub fn host_port(&self) -> (String, u16) {
        let u = self.url.strip_prefix("kmip://").unwrap_or(&self.url);
        let u = u.trim_end_matches('/');
        // [v6]:port, host:port, host.
        if let Some(rest) = u.strip_prefix('[') {
            if let Some((h, p)) = rest.split_once(']') {
                let port = p.strip_prefix(':').and_then(|p| p.parse().ok());
                return (h.to_owned(), port.unwrap_or(DEFAULT_PORT));
            }
        }
        match u.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h.to_owned(), p.parse().unwrap_or(DEFAULT_PORT)),
            _ => (u.to_owned(), DEFAULT_PORT),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_and_flags() {
        let p = Path::new("kmip.toml");
        let s = parse(
            p,
            "# fleet KMS\nurl = \"kmip://kms:5697\"  # port\ncert = \"/c#1\"\nkey=\"/k\"\nca = \"/ca\"\ntimeout_ms = 100\n",
        )
        .expect("parse");
        assert_eq!(s.url.as_deref(), Some("kmip://kms:5697"));
        assert_eq!(s.cert.as_deref(), Some(Path::new("/c#1")));
        assert_eq!(s.timeout_ms, Some(100));
        let e = parse(p, "url = kms\n").expect_err("unquoted");
        assert!(e.to_string().contains("kmip.toml:1"), "{e}");
        let e = parse(p, "uri = \"x\"\n").expect_err("unknown");
        assert!(e.to_string().contains("unknown setting"), "{e}");
        let c = Config {
            url: "kmip://kms:5697".into(),
            cert: "c".into(),
            key: "k".into(),
            ca: "a".into(),
            timeout: Duration::from_secs(1),
        };
        assert_eq!(c.host_port(), ("kms".into(), 5697));
        let c = Config {
            url: "10.0.0.1".into(),
            ..c
        };
        assert_eq!(c.host_port(), ("10.0.0.1".into(), DEFAULT_PORT));
        let c = Config {
            url: "[::1]:9".into(),
            ..c
        };
        assert_eq!(c.host_port(), ("::1".into(), 9));
        let e = Overrides {
            url: Some("x".into()),
            ..Overrides::default()
        }
        .resolve();
        if !Path::new(DEFAULT_FILE).exists() {
            assert!(e.expect_err("missing").to_string().contains("--kmip-cert"));
        }
    }
}
