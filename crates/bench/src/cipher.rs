//! The `cipher` part: memveil-cipher's paths on hot buffers against OpenSSL
//! EVP on the same buffers, in the same run.
//!
//! - `cipher.xts128_4k_hot_vs_openssl` (headline): one hot 4 KiB page,
//!   encrypted and decrypted in place with its address as tweak, on the
//!   process's path, against OpenSSL 3 EVP AES-128-XTS doing the same;
//! - `cipher.gcm256_4k_vs_openssl`: AES-256-GCM seal of 4 KiB messages;
//! - `cipher.ctr256_64k_vs_openssl`: AES-256-CTR over 64 KiB (what the
//!   DRBG and the vault's GCM run on);
//! - per path this CPU runs, the hot-page XTS time, so a report shows what
//!   each path gives on the machine (and which paths it could not run).
//!
//! Each measurement is the fastest of many short interleaved rounds (ours,
//! then OpenSSL, then ours...): a burst of load from another tenant of a
//! shared machine then hits both sides alike.

use std::fmt::Write as _;
use std::time::Instant;

use memveil_cipher::{Aes, Gcm, Path, Xts};
use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtx;

use crate::{BenchError, BenchOpts, Figure, Section};

fn err(msg: impl Into<String>) -> BenchError {
    BenchError::Part {
        part: "cipher",
        msg: msg.into(),
    }
}

fn ossl(e: &openssl::error::ErrorStack) -> BenchError {
    err(e.to_string())
}

/// Distinct XTS halves, no structure worth noticing.
pub(crate) const KEY: [u8; 64] = {
    let mut k = [0u8; 64];
    let mut i = 0u8;
    while i < 64 {
        k[i as usize] = i.wrapping_mul(37).wrapping_add(11);
        i += 1;
    }
    k
};

/// The fastest time of one call of each closure, in nanoseconds, over
/// `rounds` interleaved rounds of `inner` calls each.
pub(crate) fn interleaved(rounds: usize, inner: usize, fs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    let mut best = vec![f64::MAX; fs.len()];
    for _ in 0..rounds {
        for (b, f) in best.iter_mut().zip(fs.iter_mut()) {
            let t = Instant::now();
            for _ in 0..inner {
                f();
            }
            #[allow(clippy::cast_precision_loss)]
            let ns = t.elapsed().as_secs_f64() * 1e9 / inner as f64;
            *b = b.min(ns);
        }
    }
    best
}

/// OpenSSL EVP over one buffer in place: a context initialised once with
/// the key, re-initialised per message with the IV only (as a careful caller
/// does).
pub(crate) struct Evp {
    ctx: CipherCtx,
    enc: bool,
}

impl Evp {
    pub(crate) fn new(
        c: &openssl::cipher::CipherRef,
        key: &[u8],
        enc: bool,
    ) -> Result<Self, BenchError> {
        let mut ctx = CipherCtx::new().map_err(|e| ossl(&e))?;
        if enc {
            ctx.encrypt_init(Some(c), Some(key), None)
        } else {
            ctx.decrypt_init(Some(c), Some(key), None)
        }
        .map_err(|e| ossl(&e))?;
        Ok(Self { ctx, enc })
    }

    /// Without block padding (CBC over whole blocks, as a disk does), so an
    /// update in place returns every block it was given.
    #[must_use]
    pub(crate) fn without_padding(mut self) -> Self {
        self.ctx.set_padding(false);
        self
    }

    pub(crate) fn run(
        &mut self,
        iv: &[u8],
        buf: &mut [u8],
    ) -> Result<(), openssl::error::ErrorStack> {
        let n = buf.len();
        self.run_in(iv, buf, n)
    }

    /// [`Evp::run`] over the first `len` bytes of `buf` (for a block mode,
    /// `buf` holds one block more: the room OpenSSL's update asks for).
    pub(crate) fn run_in(
        &mut self,
        iv: &[u8],
        buf: &mut [u8],
        len: usize,
    ) -> Result<(), openssl::error::ErrorStack> {
        if self.enc {
            self.ctx.encrypt_init(None, None, Some(iv))?;
        } else {
            self.ctx.decrypt_init(None, None, Some(iv))?;
        }
        self.ctx.cipher_update_inplace(buf, len)?;
        Ok(())
    }
}

/// Runs the cipher workloads.
///
/// # Errors
/// When OpenSSL cannot be set up or fails.
#[allow(clippy::too_many_lines)]
pub fn run(opts: &BenchOpts) -> Result<Section, BenchError> {
    let mut figs = Vec::new();
    let mut md = String::new();
    let path = memveil_cipher::path();
    let rounds = opts.pick(300, 1500);
    let unit = 0x5000u128;
    let iv = unit.to_le_bytes();

    opts.say(&format!(
        "cipher: hot 4 KiB XTS page, path {path} and every path this CPU runs, vs OpenSSL EVP"
    ));
    let mut page = vec![0x5au8; 4096];
    let mut oe = Evp::new(Cipher::aes_128_xts(), &KEY[..32], true)?;
    let mut od = Evp::new(Cipher::aes_128_xts(), &KEY[..32], false)?;
    let runs: Vec<Path> = Path::ALL.into_iter().filter(|p| p.supported()).collect();
    let keys: Vec<Xts> = runs
        .iter()
        .map(|&p| Xts::with_path(&KEY[..16], &KEY[16..32], p))
        .collect::<Result<_, _>>()
        .map_err(|e| err(e.to_string()))?;
    let mine = Xts::new(&KEY[..16], &KEY[16..32]).map_err(|e| err(e.to_string()))?;
    let mut failed = None;
    let times = {
        let p = std::cell::RefCell::new(&mut page);
        let mut fs: Vec<Box<dyn FnMut()>> = Vec::new();
        fs.push(Box::new(|| {
            let mut b = p.borrow_mut();
            if let Err(e) = oe.run(&iv, &mut b) {
                failed = Some(e);
            }
            if let Err(e) = od.run(&iv, &mut b) {
                failed = Some(e);
            }
        }));
        fs.push(Box::new(|| {
            let mut b = p.borrow_mut();
            let _ = mine.encrypt_unit(unit, &mut b);
            let _ = mine.decrypt_unit(unit, &mut b);
        }));
        for k in &keys {
            fs.push(Box::new(|| {
                let mut b = p.borrow_mut();
                let _ = k.encrypt_unit(unit, &mut b);
                let _ = k.decrypt_unit(unit, &mut b);
            }));
        }
        let mut refs: Vec<&mut dyn FnMut()> = fs.iter_mut().map(|f| &mut **f as _).collect();
        interleaved(rounds, 20, &mut refs)
    };
    if let Some(e) = failed {
        return Err(ossl(&e));
    }
    // Per page: the pair (encrypt + decrypt) over two.
    let (ossl_ns, ours_ns) = (times[0] / 2.0, times[1] / 2.0);
    let gbps = |ns: f64| 4096.0 / ns;
    figs.push(
        Figure::vs(
            "cipher.xts128_4k_hot_vs_openssl",
            gbps(ours_ns),
            gbps(ossl_ns),
            "GB/s",
            &format!(
                "one hot 4 KiB page, AES-128-XTS encrypt + decrypt in place, path {path}, vs OpenSSL EVP on the same buffer"
            ),
        )
        .target(if path >= Path::Vaes256 {
            ">= 1.8"
        } else {
            ">= 1.0 (no VAES)"
        }),
    );
    figs.push(Figure::plain(
        "cipher.xts128_4k_ns",
        ours_ns,
        "ns",
        &format!("one hot 4 KiB page, AES-128-XTS, mean of encrypt and decrypt, path {path}"),
    ));
    figs.push(Figure::plain(
        "cipher.xts128_4k_openssl_ns",
        ossl_ns,
        "ns",
        "one hot 4 KiB page, AES-128-XTS, mean of encrypt and decrypt, OpenSSL EVP",
    ));
    let mut rows = String::new();
    for (p, t) in runs.iter().zip(&times[2..]) {
        let ns = t / 2.0;
        figs.push(Figure::vs(
            &format!("cipher.xts128_4k_{}_vs_openssl", p.name()),
            gbps(ns),
            gbps(ossl_ns),
            "GB/s",
            &format!("one hot 4 KiB page, AES-128-XTS encrypt + decrypt, forced path {p}, vs OpenSSL EVP"),
        ));
        let _ = writeln!(rows, "| {p} | {ns:.0} | {:.2} |", ossl_ns / ns);
    }
    let lacking: Vec<String> = Path::ALL
        .into_iter()
        .filter(|p| !p.supported())
        .map(|p| format!("{p} (needs {})", p.missing().join(", ")))
        .collect();

    opts.say("cipher: AES-256-GCM seal of 4 KiB messages vs OpenSSL");
    let gcm = Gcm::new(&KEY[..32]).map_err(|e| err(e.to_string()))?;
    let mut ctx = CipherCtx::new().map_err(|e| ossl(&e))?;
    ctx.encrypt_init(Some(Cipher::aes_256_gcm()), Some(&KEY[..32]), None)
        .map_err(|e| ossl(&e))?;
    let nonce = [7u8; 12];
    let mut tag = [0u8; 16];
    let mut failed = None;
    let g = {
        let p = std::cell::RefCell::new(&mut page);
        let mut a = || {
            std::hint::black_box(gcm.seal(&nonce, &[], &mut p.borrow_mut()));
        };
        let mut b = || {
            let mut buf = p.borrow_mut();
            let r = ctx
                .encrypt_init(None, None, Some(&nonce))
                .and_then(|()| ctx.cipher_update_inplace(&mut buf, 4096))
                .and_then(|_| ctx.cipher_final(&mut []))
                .and_then(|_| ctx.tag(&mut tag));
            if let Err(e) = r {
                failed = Some(e);
            }
        };
        interleaved(rounds, 10, &mut [&mut a, &mut b])
    };
    if let Some(e) = failed {
        return Err(ossl(&e));
    }
    figs.push(
        Figure::vs(
            "cipher.gcm256_4k_vs_openssl",
            gbps(g[0]),
            gbps(g[1]),
            "GB/s",
            &format!("AES-256-GCM seal of 4 KiB messages, path {path}, vs OpenSSL EVP (init with the nonce, update, final, tag)"),
        )
        .target(">= 1.0"),
    );

    opts.say("cipher: AES-256-CTR over 64 KiB vs OpenSSL");
    let aes = Aes::new(&KEY[..32]).map_err(|e| err(e.to_string()))?;
    let mut big = vec![0u8; 64 << 10];
    let mut evp = Evp::new(Cipher::aes_256_ctr(), &KEY[..32], true)?;
    let mut failed = None;
    let c = {
        let p = std::cell::RefCell::new(&mut big);
        let mut a = || aes.ctr_apply(&[3; 16], &mut p.borrow_mut());
        let mut b = || {
            if let Err(e) = evp.run(&[3; 16], &mut p.borrow_mut()) {
                failed = Some(e);
            }
        };
        interleaved(rounds / 5, 4, &mut [&mut a, &mut b])
    };
    if let Some(e) = failed {
        return Err(ossl(&e));
    }
    let kib64 = |ns: f64| 65536.0 / ns;
    figs.push(Figure::vs(
        "cipher.ctr256_64k_vs_openssl",
        kib64(c[0]),
        kib64(c[1]),
        "GB/s",
        &format!("AES-256-CTR over 64 KiB in place, path {path}, vs OpenSSL EVP"),
    ));

    let _ = writeln!(
        md,
        "Path in use: **{path}** ({}).{} Paths this CPU cannot run: {}.\n\n\
         One hot 4 KiB page, AES-128-XTS (mean of encrypt and decrypt, fastest of {rounds} interleaved rounds): \
         {ours_ns:.0} ns on {path}, OpenSSL EVP {ossl_ns:.0} ns.\n\n| path | ns per page | vs OpenSSL |\n|---|---|---|\n{rows}\n\
         AES-256-GCM seal, 4 KiB: {:.0} ns ({:.2} GB/s), OpenSSL {:.0} ns ({:.2} GB/s). \
         AES-256-CTR, 64 KiB: {:.2} GB/s, OpenSSL {:.2} GB/s.\n",
        path.describe(),
        memveil_cipher::path_note().map_or(String::new(), |n| format!(" {n}.")),
        if lacking.is_empty() {
            "none".to_owned()
        } else {
            lacking.join("; ")
        },
        g[0],
        gbps(g[0]),
        g[1],
        gbps(g[1]),
        kib64(c[0]),
        kib64(c[1]),
    );
    Ok(Section {
        part: "cipher".into(),
        title: "Cipher: memveil-cipher's paths against OpenSSL".into(),
        markdown: md,
        figures: figs,
        plots: Vec::new(),
    })
}
