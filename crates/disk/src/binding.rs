//! The binding of an image to its vault key: a small text file beside the
//! image (`IMAGE.memveil-disk`), sans-IO.
//!
//! dm-crypt's plain mode has no header, so nothing in the image says which
//! key opens it. The binding names the key (by its vault name and version),
//! the sector size and tweak counting, the size, and a key check value: the
//! first 8 bytes of the XTS encryption of 32 zero bytes under the all-ones
//! tweak, which no sector of any image uses (see [`crate::geometry::CHECK_TWEAK`]).
//! The server refuses to serve an image when the key the vault now holds
//! under that name does not give the same check value, so a recreated or
//! wrong key never writes garbage over the data. The check value is no key
//! material: it is one ciphertext block of known plaintext, which XTS
//! reveals for every sector anyway.
//!
//! ```text
//! # memveil disk binding (docs/disk.md); the image beside it is aes-xts-plain64
//! format = 1
//! cipher = aes-xts-plain64
//! key = disk0
//! key_kind = xts128
//! key_version = 1
//! sector_size = 512
//! iv_large_sectors = false
//! size = 1073741824
//! check = 9f3a61c0d4e2b785
//! ```

use std::path::{Path, PathBuf};

use memveil_vault::proto::KeyKind;

use crate::geometry::Geometry;

/// How sectors are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cipher {
    /// dm-crypt `aes-xts-plain64`, every sector through the vault.
    AesXtsPlain64,
    /// No encryption: the same server as a baseline for measurements.
    Plain,
}

impl Cipher {
    /// The name in the binding file (dm-crypt's cipher specification).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Cipher::AesXtsPlain64 => "aes-xts-plain64",
            Cipher::Plain => "plain",
        }
    }
}

/// An image's binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The cipher.
    pub cipher: Cipher,
    /// The vault key's name (empty for [`Cipher::Plain`]).
    pub key: String,
    /// Its kind: `xts128` (cryptsetup `--key-size 256`) or `xts256` (`--key-size 512`).
    pub key_kind: KeyKind,
    /// The key version the image was written with (1 = first).
    pub key_version: u32,
    /// Sectors and size.
    pub geometry: Geometry,
    /// Key check value (zeros for [`Cipher::Plain`]).
    pub check: [u8; 8],
}

/// The binding file of an image.
#[must_use]
pub fn path_for(image: &Path) -> PathBuf {
    let mut p = image.as_os_str().to_owned();
    p.push(".memveil-disk");
    PathBuf::from(p)
}

/// The current format number.
pub const FORMAT: u32 = 1;

impl Binding {
    /// The file's text.
    #[must_use]
    pub fn encode(&self) -> String {
        let g = &self.geometry;
        let mut s = String::from(
            "# memveil disk binding (docs/disk.md): which vault key opens the image beside it\n",
        );
        s.push_str(&format!("format = {FORMAT}\n"));
        s.push_str(&format!("cipher = {}\n", self.cipher.name()));
        if self.cipher == Cipher::AesXtsPlain64 {
            s.push_str(&format!("key = {}\n", self.key));
            s.push_str(&format!("key_kind = {}\n", self.key_kind));
            s.push_str(&format!("key_version = {}\n", self.key_version));
        }
        s.push_str(&format!("sector_size = {}\n", g.sector_size));
        s.push_str(&format!("iv_large_sectors = {}\n", g.iv_large_sectors));
        s.push_str(&format!("size = {}\n", g.size));
        if self.cipher == Cipher::AesXtsPlain64 {
            s.push_str("check = ");
            for b in self.check {
                s.push_str(&format!("{b:02x}"));
            }
            s.push('\n');
        }
        s
    }

    /// Parses a binding file's text.
    ///
    /// # Errors
    /// A sentence naming the line or field that is wrong.
    pub fn parse(text: &str) -> Result<Binding, String> {
        let mut format = None;
        let mut cipher = None;
        let mut key = None;
        let mut kind = None;
        let mut version = None;
        let mut ss = None;
        let mut large = None;
        let mut size = None;
        let mut check = None;
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (k, v) = line
                .split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| format!("line {}: expected `name = value`", n + 1))?;
            let num = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| format!("line {}: {k} = {v:?} is not a number", n + 1))
            };
            let slot_taken = match k {
                "format" => format.replace(num(v)?).is_some(),
                "cipher" => cipher
                    .replace(match v {
                        "aes-xts-plain64" => Cipher::AesXtsPlain64,
                        "plain" => Cipher::Plain,
                        _ => {
                            return Err(format!(
                                "line {}: cipher {v:?}: aes-xts-plain64 or plain",
                                n + 1
                            ))
                        }
                    })
                    .is_some(),
                "key" => {
                    if !memveil_vault::proto::valid_name(v) {
                        return Err(format!("line {}: bad key name {v:?}", n + 1));
                    }
                    key.replace(v.to_owned()).is_some()
                }
                "key_kind" => kind
                    .replace(match v {
                        "xts128" => KeyKind::Xts128,
                        "xts256" => KeyKind::Xts256,
                        _ => {
                            return Err(format!("line {}: key_kind {v:?}: xts128 or xts256", n + 1))
                        }
                    })
                    .is_some(),
                "key_version" => version.replace(num(v)?).is_some(),
                "sector_size" => ss.replace(num(v)?).is_some(),
                "iv_large_sectors" => large
                    .replace(match v {
                        "true" => true,
                        "false" => false,
                        _ => return Err(format!("line {}: iv_large_sectors {v:?}", n + 1)),
                    })
                    .is_some(),
                "size" => size.replace(num(v)?).is_some(),
                "check" => {
                    let mut c = [0u8; 8];
                    if v.len() != 16 || !v.is_ascii() {
                        return Err(format!("line {}: check is 16 hex digits", n + 1));
                    }
                    for (i, b) in c.iter_mut().enumerate() {
                        *b = u8::from_str_radix(&v[2 * i..2 * i + 2], 16)
                            .map_err(|_| format!("line {}: check is 16 hex digits", n + 1))?;
                    }
                    check.replace(c).is_some()
                }
                _ => return Err(format!("line {}: unknown field {k:?}", n + 1)),
            };
            if slot_taken {
                return Err(format!("line {}: {k} given twice", n + 1));
            }
        }
        match format {
            Some(f) if f == u64::from(FORMAT) => {}
            Some(f) => {
                return Err(format!(
                    "format {f}: this memveil reads format {FORMAT} only"
                ))
            }
            None => return Err("no `format` line: not a memveil disk binding".into()),
        }
        let cipher = cipher.ok_or("no `cipher` line")?;
        let ss = ss.ok_or("no `sector_size` line")?;
        let ss = u32::try_from(ss).map_err(|_| format!("sector_size {ss}"))?;
        let geometry = Geometry::new(
            ss,
            large.ok_or("no `iv_large_sectors` line")?,
            size.ok_or("no `size` line")?,
        )?;
        if cipher == Cipher::Plain {
            return Ok(Binding {
                cipher,
                key: String::new(),
                key_kind: KeyKind::Xts128,
                key_version: 0,
                geometry,
                check: [0; 8],
            });
        }
        let version = version.ok_or("no `key_version` line")?;
        Ok(Binding {
            cipher,
            key: key.ok_or("no `key` line")?,
            key_kind: kind.ok_or("no `key_kind` line")?,
            key_version: u32::try_from(version)
                .ok()
                .filter(|v| *v >= 1)
                .ok_or_else(|| format!("key_version {version}: 1 or more"))?,
            geometry,
            check: check.ok_or("no `check` line")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Binding {
        Binding {
            cipher: Cipher::AesXtsPlain64,
            key: "disk0".into(),
            key_kind: KeyKind::Xts256,
            key_version: 3,
            geometry: Geometry::new(4096, true, 1 << 30).expect("ok"),
            check: [0x9f, 0x3a, 0x61, 0xc0, 0xd4, 0xe2, 0xb7, 0x85],
        }
    }

    #[test]
    fn round_trip() {
        let b = sample();
        assert_eq!(Binding::parse(&b.encode()), Ok(b));
        let p = Binding {
            cipher: Cipher::Plain,
            key: String::new(),
            key_kind: KeyKind::Xts128,
            key_version: 0,
            geometry: Geometry::new(512, false, 1 << 20).expect("ok"),
            check: [0; 8],
        };
        assert_eq!(Binding::parse(&p.encode()), Ok(p));
    }

    #[test]
    fn wrong_files_are_refused_with_the_line() {
        let good = sample().encode();
        for (from, to, says) in [
            ("format = 1", "format = 2", "format 2"),
            ("key_kind = xts256", "key_kind = aes256", "key_kind"),
            (
                "sector_size = 4096",
                "sector_size = 1024",
                "sector size 1024",
            ),
            ("check = 9f3a61c0d4e2b785", "check = 9f3a", "16 hex"),
            ("key = disk0", "key = a/b", "bad key name"),
            ("key_version = 3", "key_version = 0", "key_version 0"),
            (
                "size = 1073741824",
                "size = 1073741825",
                "not a positive multiple",
            ),
        ] {
            let bad = good.replace(from, to);
            let e = Binding::parse(&bad).expect_err(to);
            assert!(e.contains(says), "{to}: {e}");
        }
        let e = Binding::parse(&format!("{good}size = 5\n")).expect_err("twice");
        assert!(e.contains("given twice"), "{e}");
        assert!(Binding::parse("hello").is_err());
        assert!(Binding::parse("").is_err());
        assert_eq!(
            path_for(Path::new("/x/disk.img")),
            Path::new("/x/disk.img.memveil-disk")
        );
    }

    proptest! {
        #[test]
        fn parsing_arbitrary_text_never_panics(s in "[ -~\n]{0,400}") {
            let _ = Binding::parse(&s);
        }
    }
}
