//! Known secrets to look for — an RSA key's primes, an EC scalar, an
//! Ed25519 seed — held masked, so the process that looks can scan itself
//! without finding its own copy of what it looks for.
//!
//! A proof builds a [`Secrets`] from the key it gave the system under test,
//! wipes its plain copies, and then searches images taken afterwards: the
//! plain form of each secret exists only for the moment it is compared,
//! after the image was read. Big numbers are looked for in both byte orders:
//! big-endian as files and protocols carry them, and reversed, as
//! little-endian limbs (OpenSSL's and aws-lc's BIGNUMs on x86-64) store them.

use crate::Image;

/// XOR mask of the stored copies (any constant that is not zero will do:
/// the stored bytes must simply differ from the secret).
const MASK: u8 = 0xa7;

/// A set of named secrets, masked.
#[derive(Default, Clone)]
pub struct Secrets {
    items: Vec<(String, Vec<u8>)>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.items.iter().map(|(n, _)| n.as_str()).collect();
        write!(f, "Secrets({names:?})")
    }
}

/// A secret seen in an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    /// The secret's name (with its byte order).
    pub what: String,
    /// Where (process or core address).
    pub address: u64,
    /// The region's name.
    pub region: String,
}

impl Secrets {
    /// An empty set.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `value` as it is, under `what`. Values under 16 bytes are
    /// refused (they would match by chance).
    pub fn add(&mut self, what: &str, value: &[u8]) {
        if value.len() >= 16 {
            self.items
                .push((what.to_owned(), value.iter().map(|b| b ^ MASK).collect()));
        }
    }

    /// Adds a big-endian number under `what`, and its reversal.
    pub fn add_number(&mut self, what: &str, be: &[u8]) {
        let be = &be[be.iter().take_while(|b| **b == 0).count()..];
        self.add(&format!("{what} (big-endian)"), be);
        let le: Vec<u8> = be.iter().rev().copied().collect();
        self.add(&format!("{what} (little-endian)"), &le);
    }

    /// How many byte strings are looked for.
    #[must_use]
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the set is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Every occurrence of every secret in `img`.
    #[must_use]
    pub fn find(&self, img: &Image) -> Vec<Hit> {
        let mut hits = Vec::new();
        for (what, masked) in &self.items {
            let mut plain: Vec<u8> = masked.iter().map(|b| b ^ MASK).collect();
            let finder = memchr::memmem::Finder::new(&plain);
            for r in &img.regions {
                for off in finder.find_iter(&r.data) {
                    hits.push(Hit {
                        what: what.clone(),
                        address: r.start.wrapping_add(off as u64),
                        region: r.name.clone(),
                    });
                }
            }
            drop(finder);
            plain.iter_mut().for_each(|b| *b = 0);
            std::hint::black_box(&plain);
        }
        hits
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Region;

    #[test]
    fn finds_both_orders_and_never_stores_the_plain_value() {
        let p: Vec<u8> = (1..=40).collect();
        let mut s = Secrets::new();
        s.add_number("p", &p);
        s.add("short", b"tiny");
        assert_eq!(s.len(), 2);
        assert!(!format!("{s:?}").contains('\u{1}'));
        for (_, m) in &s.items {
            assert!(!m.windows(16).any(|w| p.windows(16).any(|q| q == w)));
        }
        let mut data = vec![0u8; 200];
        data[10..50].copy_from_slice(&p);
        let rev: Vec<u8> = p.iter().rev().copied().collect();
        data[100..140].copy_from_slice(&rev);
        let img = Image {
            regions: vec![Region {
                start: 0x1000,
                name: "[heap]".into(),
                data,
            }],
            unreadable: Vec::new(),
        };
        let hits = s.find(&img);
        assert_eq!(hits.len(), 2);
        assert_eq!(hits[0].address, 0x100a);
        assert!(hits[1].what.contains("little-endian"));
        assert!(Secrets::new().find(&img).is_empty());
    }
}
