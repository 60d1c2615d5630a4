//! The one dispatch point: which AES implementation ("path") this process
//! uses, chosen once from CPUID.
//!
//! | path | needs | what runs |
//! |---|---|---|
//! | [`Path::Vaes256`] | AES-NI, PCLMULQDQ, SSSE3, AVX2, VAES, VPCLMULQDQ | VAES kernels on 256-bit registers (two blocks per instruction, sixteen in flight) for XTS, CTR, ECB and GCM (GHASH with VPCLMULQDQ); the AES-NI kernels for single blocks and CBC |
//! | [`Path::AesNi`] | AES-NI, PCLMULQDQ, SSSE3 | 128-bit AES-NI kernels (eight blocks in flight), GHASH with PCLMULQDQ |
//! | [`Path::Portable`] | nothing | memveil's modes over RustCrypto's `aes` block API and RustCrypto `aes-gcm` |
//!
//! Every key object picks its path when it is built: the path of the
//! process ([`path`]) for `new`, or one named by the caller for
//! `with_path` (tests and benchmarks). A CPU without a path's features never
//! runs it: it takes the next path down, silently and correctly.
//!
//! `MEMVEIL_CIPHER_PATH=portable|aesni|vaes256` (read once, at the first key)
//! caps the process's path, so that whole programs and daemons can be run on
//! each path in turn (the key-finder proofs, the benchmarks). It never raises
//! the path above what the CPU has; [`path_note`] says what it did.

use std::sync::OnceLock;

/// The environment variable that caps the path.
pub const PATH_ENV: &str = "MEMVEIL_CIPHER_PATH";

/// An AES implementation, from the most portable to the widest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Path {
    /// memveil's modes over RustCrypto's block API (which itself uses AES-NI
    /// when it can, or constant-time fixslice software).
    Portable,
    /// memveil's 128-bit AES-NI + PCLMULQDQ kernels.
    AesNi,
    /// memveil's VAES + VPCLMULQDQ kernels on 256-bit registers.
    Vaes256,
}

impl Path {
    /// Every path, portable first.
    pub const ALL: [Path; 3] = [Path::Portable, Path::AesNi, Path::Vaes256];

    /// The short name (`portable`, `aesni`, `vaes256`), as
    /// `MEMVEIL_CIPHER_PATH` takes it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Path::Portable => "portable",
            Path::AesNi => "aesni",
            Path::Vaes256 => "vaes256",
        }
    }

    /// Parses a name (`vaes` is taken for `vaes256`).
    #[must_use]
    pub fn from_name(s: &str) -> Option<Path> {
        match s.trim().to_ascii_lowercase().as_str() {
            "portable" | "soft" => Some(Path::Portable),
            "aesni" | "aes-ni" | "ni" => Some(Path::AesNi),
            "vaes256" | "vaes" => Some(Path::Vaes256),
            _ => None,
        }
    }

    /// One line for reports: what runs on this path.
    #[must_use]
    pub fn describe(self) -> &'static str {
        match self {
            Path::Portable => {
                "portable: memveil modes over RustCrypto aes 0.9 / aes-gcm 0.11 (RustCrypto picks AES-NI or constant-time fixslice itself)"
            }
            Path::AesNi => {
                "aesni: memveil 128-bit AES-NI kernels (8 blocks in flight), GHASH with PCLMULQDQ"
            }
            Path::Vaes256 => {
                "vaes256: memveil VAES kernels on ymm (2 blocks per instruction, 16 in flight), GHASH with VPCLMULQDQ; AES-NI for single blocks and CBC"
            }
        }
    }

    /// The CPU features this path needs that this CPU lacks (empty: it can
    /// run here).
    #[must_use]
    pub fn missing(self) -> Vec<&'static str> {
        let mut m = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let base = [
                ("AES-NI", std::is_x86_feature_detected!("aes")),
                ("PCLMULQDQ", std::is_x86_feature_detected!("pclmulqdq")),
                ("SSSE3", std::is_x86_feature_detected!("ssse3")),
            ];
            let wide = [
                ("AVX2", std::is_x86_feature_detected!("avx2")),
                ("VAES", std::is_x86_feature_detected!("vaes")),
                ("VPCLMULQDQ", std::is_x86_feature_detected!("vpclmulqdq")),
            ];
            let need: &[(&'static str, bool)] = match self {
                Path::Portable => &[],
                Path::AesNi => &base,
                Path::Vaes256 => &[base, wide].concat(),
            };
            m.extend(need.iter().filter(|(_, has)| !has).map(|(n, _)| *n));
        }
        #[cfg(not(target_arch = "x86_64"))]
        if self != Path::Portable {
            m.push("an x86_64 CPU");
        }
        m
    }

    /// Whether this CPU can run the path.
    #[must_use]
    pub fn supported(self) -> bool {
        self.missing().is_empty()
    }

    /// `self` when this CPU runs it, otherwise the error naming what it lacks.
    pub(crate) fn require(self) -> Result<Path, crate::CipherError> {
        if self.supported() {
            Ok(self)
        } else {
            Err(crate::CipherError::unavailable(self))
        }
    }

    /// The widest path this CPU runs.
    #[must_use]
    pub fn best() -> Path {
        Path::ALL
            .into_iter()
            .rev()
            .find(|p| p.supported())
            .unwrap_or(Path::Portable)
    }

    /// The widest supported path at or below `self`.
    #[must_use]
    pub fn capped(self) -> Path {
        Path::ALL
            .into_iter()
            .rev()
            .find(|p| *p <= self && p.supported())
            .unwrap_or(Path::Portable)
    }
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

struct Choice {
    path: Path,
    note: Option<String>,
}

fn choose(env: Option<&str>) -> Choice {
    let best = Path::best();
    let Some(raw) = env else {
        return Choice {
            path: best,
            note: None,
        };
    };
    match Path::from_name(raw) {
        None => Choice {
            path: best,
            note: Some(format!(
                "{PATH_ENV}={raw:?} not understood (portable, aesni, vaes256): ignored, {best} in use"
            )),
        },
        Some(want) => {
            let got = want.capped();
            let note = if got == want {
                format!("{PATH_ENV}={want}: path capped at {want} (this CPU's best: {best})")
            } else {
                format!(
                    "{PATH_ENV}={want}: this CPU lacks {}, {got} in use",
                    want.missing().join(", ")
                )
            };
            Choice {
                path: got,
                note: Some(note),
            }
        }
    }
}

fn choice() -> &'static Choice {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    CHOICE.get_or_init(|| choose(std::env::var(PATH_ENV).ok().as_deref()))
}

/// The path this process's keys take: the widest the CPU runs, capped by
/// `MEMVEIL_CIPHER_PATH`. Chosen once.
#[must_use]
pub fn path() -> Path {
    choice().path
}

/// What `MEMVEIL_CIPHER_PATH` did, if it was set.
#[must_use]
pub fn path_note() -> Option<&'static str> {
    choice().note.as_deref()
}

/// For tests: the paths this CPU runs, after printing which it cannot run
/// and why (a narrower CPU says what it did not test).
#[cfg(test)]
pub(crate) fn runnable() -> Vec<Path> {
    Path::ALL
        .into_iter()
        .filter(|p| {
            if !p.supported() {
                eprintln!(
                    "path {p} not run: this CPU lacks {}",
                    p.missing().join(", ")
                );
            }
            p.supported()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for p in Path::ALL {
            assert_eq!(Path::from_name(p.name()), Some(p));
        }
        assert_eq!(Path::from_name("VAES"), Some(Path::Vaes256));
        assert_eq!(Path::from_name("fast"), None);
    }

    #[test]
    fn env_caps_never_raise() {
        assert_eq!(choose(None).path, Path::best());
        assert_eq!(choose(Some("portable")).path, Path::Portable);
        let c = choose(Some("vaes256"));
        assert_eq!(c.path, Path::Vaes256.capped());
        assert!(c.path <= Path::best());
        let bad = choose(Some("turbo"));
        assert_eq!(bad.path, Path::best());
        assert!(bad.note.is_some_and(|n| n.contains("not understood")));
    }

    #[test]
    fn capped_is_supported() {
        for p in Path::ALL {
            assert!(p.capped().supported());
            assert!(p.capped() <= p);
        }
        assert!(Path::Portable.supported());
    }
}
