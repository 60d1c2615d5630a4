//! A reader of NIST CAVP `.rsp` files, shared by the tests that check modes
//! against the vectors (include it with `#[path]`).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;

/// One test case: its fields (upper-cased keys), the `[ENCRYPT]`/`[DECRYPT]`
/// direction it sits under, the bracketed parameters in force, and whether it
/// is marked `FAIL`.
#[derive(Debug, Clone, Default)]
pub struct Case {
    pub direction: String,
    pub params: BTreeMap<String, String>,
    pub fields: BTreeMap<String, String>,
    pub fail: bool,
}

impl Case {
    pub fn hex(&self, k: &str) -> Vec<u8> {
        let v = self.fields.get(k).map_or("", String::as_str);
        hex::decode(v).unwrap_or_else(|e| panic!("field {k}={v:?} is not hex: {e}"))
    }
    pub fn get(&self, k: &str) -> Option<&str> {
        self.fields.get(k).map(String::as_str)
    }
}

pub fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("vectors")
}

/// Parses one `.rsp` file from the vectors folder.
pub fn parse(name: &str) -> Vec<Case> {
    let path = vectors_dir().join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut out = Vec::new();
    let mut dir = String::from("ENCRYPT");
    let mut params = BTreeMap::new();
    let mut cur: Option<Case> = None;
    for raw in text.lines() {
        let line = raw.trim();
        if line.starts_with('#') {
            continue;
        }
        if line.is_empty() {
            if let Some(c) = cur.take() {
                out.push(c);
            }
            continue;
        }
        if let Some(inner) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            if let Some(c) = cur.take() {
                out.push(c);
            }
            match inner.split_once('=') {
                Some((k, v)) => {
                    params.insert(k.trim().to_uppercase(), v.trim().to_owned());
                }
                None => {
                    dir = inner.trim().to_uppercase();
                    params.clear();
                }
            }
            continue;
        }
        if line == "FAIL" {
            if let Some(c) = cur.as_mut() {
                c.fail = true;
            }
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        let k = k.trim().to_uppercase();
        if k == "COUNT" {
            if let Some(c) = cur.take() {
                out.push(c);
            }
            cur = Some(Case {
                direction: dir.clone(),
                params: params.clone(),
                ..Case::default()
            });
        }
        if let Some(c) = cur.as_mut() {
            c.fields.insert(k, v.trim().to_owned());
        }
    }
    if let Some(c) = cur.take() {
        out.push(c);
    }
    out
}

/// The paths this CPU runs, in order; prints (once per call) which paths it
/// cannot run and why, so a run on a narrower CPU says what it did not test.
pub fn paths(test: &str) -> Vec<memveil_cipher::Path> {
    let mut run = Vec::new();
    for p in memveil_cipher::Path::ALL {
        if p.supported() {
            run.push(p);
        } else {
            eprintln!(
                "{test}: path {p} NOT RUN: this CPU lacks {}",
                p.missing().join(", ")
            );
        }
    }
    eprintln!(
        "{test}: paths run: {}",
        run.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
    );
    run
}
