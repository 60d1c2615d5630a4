//! NIST CAVP known-answer tests for the CTR_DRBG (AES-256, with and without
//! derivation function; no reseed, reseed, prediction resistance). Vectors
//! and provenance in `tests/vectors/`.

use memveil_drng::drbg::{CtrDrbg, DfMode, Drbg, EntropyInput};
use memveil_drng::DrngError;

type Case = Vec<(String, Vec<u8>)>;

fn load(name: &str) -> String {
    let path = format!("{}/tests/vectors/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Cases in file order; each case is its `key = value` lines in order (keys
/// such as `AdditionalInput` repeat). Section headers are skipped.
fn parse(text: &str, first_key: &str) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut cur: Case = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('[') {
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        let (k, v) = (k.trim(), v.trim());
        if k == "COUNT" {
            continue;
        }
        if k == first_key && !cur.is_empty() {
            cases.push(std::mem::take(&mut cur));
        }
        cur.push((k.to_owned(), hex::decode(v).expect("hex")));
    }
    if !cur.is_empty() {
        cases.push(cur);
    }
    cases
}

fn get<'a>(c: &'a Case, key: &str, nth: usize) -> &'a [u8] {
    c.iter()
        .filter(|(k, _)| k == key)
        .nth(nth)
        .map(|(_, v)| v.as_slice())
        .unwrap_or_else(|| panic!("case lacks {key} #{nth}: {c:?}"))
}

#[test]
fn aes256_df_no_reseed() {
    let cases = parse(&load("ctr_drbg_aes256_df_no_reseed.rsp"), "EntropyInput");
    assert_eq!(cases.len(), 48);
    for (i, c) in cases.iter().enumerate() {
        let mut d = CtrDrbg::instantiate(
            DfMode::UseDf,
            get(c, "EntropyInput", 0),
            get(c, "Nonce", 0),
            get(c, "PersonalizationString", 0),
        )
        .expect("instantiate");
        let want = get(c, "ReturnedBits", 0);
        let mut out = vec![0u8; want.len()];
        d.generate(&mut out, get(c, "AdditionalInput", 0))
            .expect("gen 1");
        d.generate(&mut out, get(c, "AdditionalInput", 1))
            .expect("gen 2");
        assert_eq!(hex::encode(&out), hex::encode(want), "case {i}");
    }
}

#[test]
fn aes256_df_reseed() {
    let cases = parse(&load("ctr_drbg_aes256_df_pr_false.rsp"), "EntropyInput");
    assert_eq!(cases.len(), 48);
    for (i, c) in cases.iter().enumerate() {
        let mut d = CtrDrbg::instantiate(
            DfMode::UseDf,
            get(c, "EntropyInput", 0),
            get(c, "Nonce", 0),
            get(c, "PersonalizationString", 0),
        )
        .expect("instantiate");
        d.reseed(
            get(c, "EntropyInputReseed", 0),
            get(c, "AdditionalInputReseed", 0),
        )
        .expect("reseed");
        let want = get(c, "ReturnedBits", 0);
        let mut out = vec![0u8; want.len()];
        d.generate(&mut out, get(c, "AdditionalInput", 0))
            .expect("gen 1");
        d.generate(&mut out, get(c, "AdditionalInput", 1))
            .expect("gen 2");
        assert_eq!(hex::encode(&out), hex::encode(want), "case {i}");
    }
}

#[test]
fn aes256_df_prediction_resistance() {
    let cases = parse(&load("ctr_drbg_aes256_df_pr_true.rsp"), "EntropyInput");
    assert_eq!(cases.len(), 48);
    for (i, c) in cases.iter().enumerate() {
        let mut d = CtrDrbg::instantiate(
            DfMode::UseDf,
            get(c, "EntropyInput", 0),
            get(c, "Nonce", 0),
            get(c, "PersonalizationString", 0),
        )
        .expect("instantiate");
        let want = get(c, "ReturnedBits", 0);
        let mut out = vec![0u8; want.len()];
        // SP 800-90A 9.3.1: with prediction resistance each generate first
        // reseeds with fresh entropy and the additional input, then
        // generates with no additional input.
        for n in 0..2 {
            d.reseed(get(c, "EntropyInputPR", n), get(c, "AdditionalInput", n))
                .expect("reseed");
            d.generate(&mut out, &[]).expect("gen");
        }
        assert_eq!(hex::encode(&out), hex::encode(want), "case {i}");
    }
}

/// Entropy input that replays scripted bytes, to drive [`Drbg`] (the
/// per-consumer wrapper) through the CAVP prediction-resistance flow.
struct Scripted(Vec<u8>);

impl EntropyInput for Scripted {
    fn name(&self) -> String {
        "scripted".into()
    }
    fn get(&mut self, out: &mut [u8]) -> Result<(), DrngError> {
        assert!(self.0.len() >= out.len(), "script ran out");
        let rest = self.0.split_off(out.len());
        out.copy_from_slice(&self.0);
        self.0 = rest;
        Ok(())
    }
}

#[test]
fn consumer_drbg_with_prediction_resistance_matches_cavp() {
    let cases = parse(&load("ctr_drbg_aes256_df_pr_true.rsp"), "EntropyInput");
    let mut checked = 0;
    for c in cases
        .iter()
        .filter(|c| get(c, "AdditionalInput", 0).is_empty())
    {
        let mut script = get(c, "EntropyInput", 0).to_vec();
        script.extend_from_slice(get(c, "Nonce", 0));
        script.extend_from_slice(get(c, "EntropyInputPR", 0));
        script.extend_from_slice(get(c, "EntropyInputPR", 1));
        let mut d = Drbg::new(
            Box::new(Scripted(script)),
            true,
            get(c, "PersonalizationString", 0),
        )
        .expect("drbg");
        let want = get(c, "ReturnedBits", 0);
        let mut out = vec![0u8; want.len()];
        d.fill(&mut out).expect("first");
        d.fill(&mut out).expect("second");
        assert_eq!(hex::encode(&out), hex::encode(want));
        assert_eq!(d.reseeds(), 2);
        checked += 1;
    }
    assert!(
        checked >= 6,
        "only {checked} cases without additional input"
    );
}

#[test]
fn aes256_no_df_reseed() {
    let cases = parse(&load("ctr_drbg_aes256_nodf_reseed.txt"), "EntropyInput");
    assert_eq!(cases.len(), 4);
    for (i, c) in cases.iter().enumerate() {
        let mut d = CtrDrbg::instantiate(
            DfMode::NoDf,
            get(c, "EntropyInput", 0),
            &[],
            get(c, "PersonalizationString", 0),
        )
        .expect("instantiate");
        d.reseed(
            get(c, "EntropyInputReseed", 0),
            get(c, "AdditionalInputReseed", 0),
        )
        .expect("reseed");
        let want = get(c, "ReturnedBits", 0);
        let mut out = vec![0u8; want.len()];
        d.generate(&mut out, get(c, "AdditionalInput1", 0))
            .expect("gen 1");
        d.generate(&mut out, get(c, "AdditionalInput2", 0))
            .expect("gen 2");
        assert_eq!(hex::encode(&out), hex::encode(want), "case {i}");
    }
}

#[test]
fn a_flipped_bit_fails_the_kat() {
    // Positive control: the harness does detect a wrong output.
    let cases = parse(&load("ctr_drbg_aes256_df_no_reseed.rsp"), "EntropyInput");
    let c = &cases[0];
    let mut e = get(c, "EntropyInput", 0).to_vec();
    e[0] ^= 1;
    let mut d = CtrDrbg::instantiate(DfMode::UseDf, &e, get(c, "Nonce", 0), &[]).expect("inst");
    let want = get(c, "ReturnedBits", 0);
    let mut out = vec![0u8; want.len()];
    d.generate(&mut out, &[]).expect("gen");
    d.generate(&mut out, &[]).expect("gen");
    assert_ne!(out, want);
}
