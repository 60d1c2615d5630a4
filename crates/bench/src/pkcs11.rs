//! The PKCS#11 module against SoftHSM2, in the same process and run: both
//! libraries loaded with `dlopen` and driven through their function lists,
//! the same AES-256 key imported into each (a session object), then
//! alternating rounds of (a) AES-256-GCM over 64 KiB messages and (b) 256-byte
//! AES-CBC, each message one `C_EncryptInit` + `C_Encrypt` as an application
//! encrypting independent messages does. Ratios are medians of the rounds'
//! ratios (the machine is shared and noisy).

use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use cryptoki_sys::*;

use crate::{BenchError, BenchOpts, Figure, Section};

fn fail(msg: impl Into<String>) -> BenchError {
    BenchError::Part {
        part: "pkcs11",
        msg: msg.into(),
    }
}

const SOFTHSM: [&str; 2] = [
    "/usr/lib/softhsm/libsofthsm2.so",
    "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
];

/// A loaded module: its function list, the slot, a logged-in session and
/// the key.
struct Module {
    name: &'static str,
    f: &'static CK_FUNCTION_LIST,
    slot: CK_SLOT_ID,
    session: CK_SESSION_HANDLE,
    key: CK_OBJECT_HANDLE,
}

fn check(what: &str, rv: CK_RV) -> Result<(), BenchError> {
    if rv == CKR_OK {
        Ok(())
    } else {
        Err(fail(format!("{what}: CK_RV {rv:#x}")))
    }
}

/// Loads `path` and returns its function list (never unloaded).
fn load(path: &Path) -> Result<&'static CK_FUNCTION_LIST, BenchError> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| fail("module path with a NUL byte"))?;
    // SAFETY: `c` is a NUL-terminated path; the handle is kept for the
    // process's life (never dlclose'd), so the function list stays valid.
    let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        return Err(fail(format!("dlopen {}", path.display())));
    }
    // SAFETY: `lib` is a live handle; the symbol name is NUL-terminated.
    let sym = unsafe { libc::dlsym(lib, c"C_GetFunctionList".as_ptr()) };
    if sym.is_null() {
        return Err(fail(format!("{}: no C_GetFunctionList", path.display())));
    }
    // SAFETY: PKCS#11 defines the symbol with exactly this signature.
    let get: unsafe extern "C" fn(*mut *mut CK_FUNCTION_LIST) -> CK_RV =
        unsafe { std::mem::transmute(sym) };
    let mut list = std::ptr::null_mut();
    // SAFETY: `list` is a valid out-pointer.
    check("C_GetFunctionList", unsafe { get(&mut list) })?;
    // SAFETY: non-NULL lists live as long as the loaded library (forever here).
    unsafe { list.as_ref() }.ok_or_else(|| fail("NULL function list"))
}

macro_rules! call {
    ($m:expr, $f:ident, $($a:expr),*) => {{
        let f = $m.$f.ok_or_else(|| fail(concat!(stringify!($f), " missing")))?;
        // SAFETY: a PKCS#11 entry point called with pointers to live locals
        // of the types the standard names.
        check(stringify!($f), unsafe { f($($a),*) })
    }};
}

mod conf;
mod sign;

/// An object of `f` made from `tpl` in session `sess` (`C_CreateObject`).
fn create(
    f: &'static CK_FUNCTION_LIST,
    sess: CK_SESSION_HANDLE,
    tpl: &mut [CK_ATTRIBUTE],
) -> Result<CK_OBJECT_HANDLE, BenchError> {
    let mut h = 0;
    call!(
        f,
        C_CreateObject,
        sess,
        tpl.as_mut_ptr(),
        tpl.len() as CK_ULONG,
        &mut h
    )?;
    Ok(h)
}

/// A read-write session of `f` on `slot`.
fn session(
    f: &'static CK_FUNCTION_LIST,
    slot: CK_SLOT_ID,
) -> Result<CK_SESSION_HANDLE, BenchError> {
    let mut s = 0;
    call!(
        f,
        C_OpenSession,
        slot,
        CKF_SERIAL_SESSION | CKF_RW_SESSION,
        std::ptr::null_mut(),
        None,
        &mut s
    )?;
    Ok(s)
}

/// Initialises `f`, opens a session on the first token whose label starts
/// with `label`, logs in and imports `key`.
fn open(
    name: &'static str,
    f: &'static CK_FUNCTION_LIST,
    label: &str,
    key: &[u8; 32],
) -> Result<Module, BenchError> {
    let mut args = CK_C_INITIALIZE_ARGS {
        CreateMutex: None,
        DestroyMutex: None,
        LockMutex: None,
        UnlockMutex: None,
        flags: CKF_OS_LOCKING_OK,
        pReserved: std::ptr::null_mut(),
    };
    call!(
        f,
        C_Initialize,
        std::ptr::from_mut(&mut args).cast::<c_void>()
    )?;
    let mut slots = [0 as CK_SLOT_ID; 16];
    let mut n = slots.len() as CK_ULONG;
    call!(f, C_GetSlotList, CK_TRUE, slots.as_mut_ptr(), &mut n)?;
    let mut slot = None;
    for s in slots.iter().take(usize::try_from(n).unwrap_or(0)) {
        let mut info = CK_TOKEN_INFO::default();
        call!(f, C_GetTokenInfo, *s, &mut info)?;
        if info.label.starts_with(label.as_bytes()) {
            slot = Some(*s);
            break;
        }
    }
    let slot = slot.ok_or_else(|| fail(format!("{name}: no token labelled {label:?}")))?;
    let session = session(f, slot)?;
    let mut pin = *b"1234";
    call!(f, C_Login, session, CKU_USER, pin.as_mut_ptr(), 4)?;
    let (class, kt) = (CKO_SECRET_KEY, CKK_AES);
    let (t, fl) = (CK_TRUE, CK_FALSE);
    let mut k = *key;
    let at = |ty, p: *const c_void, l: usize| CK_ATTRIBUTE {
        type_: ty,
        pValue: p.cast_mut(),
        ulValueLen: l as CK_ULONG,
    };
    let mut tpl = [
        at(CKA_CLASS, std::ptr::from_ref(&class).cast(), 8),
        at(CKA_KEY_TYPE, std::ptr::from_ref(&kt).cast(), 8),
        at(CKA_TOKEN, std::ptr::from_ref(&fl).cast(), 1),
        at(CKA_SENSITIVE, std::ptr::from_ref(&t).cast(), 1),
        at(CKA_ENCRYPT, std::ptr::from_ref(&t).cast(), 1),
        at(CKA_DECRYPT, std::ptr::from_ref(&t).cast(), 1),
        at(CKA_VALUE, k.as_mut_ptr().cast(), 32),
    ];
    let key_h = create(f, session, &mut tpl)?;
    Ok(Module {
        name,
        f,
        slot,
        session,
        key: key_h,
    })
}

/// `count` messages of `msg` bytes, each `C_EncryptInit` + `C_Encrypt`;
/// returns seconds.
fn encrypt_loop(m: &Module, gcm: bool, msg: usize, count: usize) -> Result<f64, BenchError> {
    let mut data = vec![0x5au8; msg];
    let mut out = vec![0u8; msg + 32];
    let mut iv = [7u8; 16];
    let mut params = CK_GCM_PARAMS {
        pIv: iv.as_mut_ptr(),
        ulIvLen: 12,
        ulIvBits: 96,
        pAAD: std::ptr::null_mut(),
        ulAADLen: 0,
        ulTagBits: 128,
    };
    let mut mech = if gcm {
        CK_MECHANISM {
            mechanism: CKM_AES_GCM,
            pParameter: std::ptr::from_mut(&mut params).cast(),
            ulParameterLen: std::mem::size_of::<CK_GCM_PARAMS>() as CK_ULONG,
        }
    } else {
        CK_MECHANISM {
            mechanism: CKM_AES_CBC,
            pParameter: iv.as_mut_ptr().cast(),
            ulParameterLen: 16,
        }
    };
    let t = Instant::now();
    for _ in 0..count {
        call!(m.f, C_EncryptInit, m.session, &mut mech, m.key)?;
        let mut n = out.len() as CK_ULONG;
        call!(
            m.f,
            C_Encrypt,
            m.session,
            data.as_mut_ptr(),
            msg as CK_ULONG,
            out.as_mut_ptr(),
            &mut n
        )?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// The range of rounds' values, `lo–hi`.
fn spread(v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.3}–{hi:.3}")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Starts SoftHSM2 over a fresh token directory (`SOFTHSM2_CONF`).
fn softhsm_token(dir: &Path) -> Result<PathBuf, BenchError> {
    let lib = SOFTHSM
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or_else(|| {
            fail("SoftHSM2 is not installed (apt-get install softhsm2; scripts/install.sh does)")
        })?;
    std::fs::create_dir_all(dir.join("tokens")).map_err(|e| fail(e.to_string()))?;
    let conf = dir.join("softhsm2.conf");
    std::fs::write(
        &conf,
        format!(
            "directories.tokendir = {}\nobjectstore.backend = file\nlog.level = ERROR\n",
            dir.join("tokens").display()
        ),
    )
    .map_err(|e| fail(e.to_string()))?;
    let o = Command::new("softhsm2-util")
        .args([
            "--init-token",
            "--free",
            "--label",
            "bench",
            "--pin",
            "1234",
            "--so-pin",
            "12345678",
        ])
        .env("SOFTHSM2_CONF", &conf)
        .output()
        .map_err(|e| fail(format!("softhsm2-util: {e}")))?;
    if !o.status.success() {
        return Err(fail(format!(
            "softhsm2-util: {}",
            String::from_utf8_lossy(&o.stderr)
        )));
    }
    std::env::set_var("SOFTHSM2_CONF", &conf);
    Ok(lib)
}

/// The memveil module next to the running binary, else where install.sh puts it.
fn memveil_module() -> Result<PathBuf, BenchError> {
    let exe = std::env::current_exe().map_err(|e| fail(e.to_string()))?;
    [
        exe.with_file_name("libmemveil_pkcs11.so"),
        PathBuf::from("/usr/local/lib/memveil/libmemveil_pkcs11.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .ok_or_else(|| fail("libmemveil_pkcs11.so not found beside the memveil binary or in /usr/local/lib/memveil (cargo build --release)"))
}

/// `nginx.tls_rsa2048_vault_vs_file` and `nginx.tls_p256_vault_vs_file`:
/// full TLS handshakes a second (`openssl s_time -new`) against nginx
/// (master + 2 workers) with its keys in the vault (libp11's engine over
/// this module) vs the same keys in PEM files, alternating rounds.
fn tls_figures(opts: &BenchOpts) -> Result<(Vec<Figure>, String), BenchError> {
    let memveil = crate::procs::memveil_exe()
        .ok_or_else(|| fail("the nginx figures start the vault from the memveil binary; run them through `memveil bench`"))?;
    let module = memveil_module()?;
    let dir = std::env::temp_dir().join(format!("memveil-bench-tls-{}", std::process::id()));
    let site = crate::vault_tls::VaultTls::prepare(&dir, &memveil, &module).map_err(fail)?;
    let rounds = opts.pick(4, 8);
    let secs = opts.pick(3, 5);
    opts.say(&format!(
        "pkcs11: nginx TLS, {rounds} alternating rounds of {secs} s per key, vault vs PEM file"
    ));
    // [vault, file] x [rsa, ec]
    let mut got: [[Vec<f64>; 2]; 2] = Default::default();
    for r in 0..rounds {
        for k in 0..2 {
            let vault = (k + r) % 2 == 0;
            let mut nginx = site.start(vault).map_err(fail)?;
            let m = crate::nginx::s_time(site.rsa_port, false, secs)
                .and_then(|a| Ok((a, crate::nginx::s_time(site.ec_port, false, secs)?)));
            site.stop(&mut nginx);
            let (rsa, ec) = m.map_err(fail)?;
            let i = usize::from(!vault);
            got[i][0].push(rsa);
            got[i][1].push(ec);
            opts.say(&format!(
                "nginx TLS round {} ({}): RSA {rsa:.0}/s, P-256 {ec:.0}/s",
                r + 1,
                if vault { "vault" } else { "file" }
            ));
        }
    }
    let ratios = |i: usize| -> Vec<f64> {
        got[0][i]
            .iter()
            .zip(&got[1][i])
            .map(|(v, f)| v / f)
            .collect()
    };
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:.3}–{hi:.3}")
    };
    let (rrs, ers) = (ratios(0), ratios(1));
    let (rr, er) = (median(rrs.clone()), median(ers.clone()));
    let (rrange, erange) = (range(&rrs), range(&ers));
    let [vault, file] = got;
    let (vr, ve, fr, fe) = (
        median(vault[0].clone()),
        median(vault[1].clone()),
        median(file[0].clone()),
        median(file[1].clone()),
    );
    let md = format!(
        "\n### nginx TLS with its keys in the vault (issue 27)\n\nnginx 1.22 (master + 2 workers as www-data), libp11's engine over this module, keys imported into a vault started for the run, against the same keys as PEM files; `openssl s_time -new` for {secs} s per key, {rounds} alternating rounds; medians (the client's own handshake work shares the 2 vCPUs).\n\n| key | vault | PEM file | ratio (rounds) |\n|---|---|---|---|\n| RSA-2048 | {vr:.0}/s | {fr:.0}/s | {rr:.3} ({rrange}) |\n| P-256 | {ve:.0}/s | {fe:.0}/s | {er:.3} ({erange}) |\n"
    );
    let figs = vec![
        Figure::vs("nginx.tls_rsa2048_vault_vs_file", vr, fr, "conn/s", "full TLS handshakes a second (s_time -new), nginx with its RSA-2048 key in the vault (libp11 engine) vs the same key in a PEM file; ratio = median of rounds' ratios")
            .with_ratio(rr)
            .target(">= 0.8"),
        Figure::vs("nginx.tls_p256_vault_vs_file", ve, fe, "conn/s", "full TLS handshakes a second (s_time -new), nginx with its P-256 key in the vault vs in a PEM file; ratio = median of rounds' ratios")
            .with_ratio(er)
            .target(">= 0.7"),
    ];
    drop(site);
    let (afig, amd) = crate::agent::figure(opts, &memveil)?;
    let mut figs = figs;
    figs.push(afig);
    Ok((figs, md + &amd))
}

/// Runs the PKCS#11 part.
///
/// # Errors
/// A module, SoftHSM2 or the vault could not be set up.
pub fn run(opts: &BenchOpts) -> Result<Section, BenchError> {
    let d = crate::vault::start_daemon()?;
    std::env::set_var("MEMVEIL_VAULT_SOCKET", &d.socket);
    let hsm_lib = softhsm_token(&d.dir.join("softhsm"))?;
    let mv_lib = memveil_module()?;
    let key: [u8; 32] =
        std::array::from_fn(|i| u8::try_from(i).unwrap_or(0).wrapping_mul(29) ^ 0xa5);
    let mv = open("memveil", load(&mv_lib)?, "memveil vault", &key)?;
    let hsm = open("SoftHSM2", load(&hsm_lib)?, "bench", &key)?;
    let rounds = opts.pick(7, 15);
    let (gcm_n, cbc_n) = (opts.pick(200, 1000), opts.pick(4000, 20000));
    opts.say(&format!("pkcs11: {rounds} alternating rounds, {gcm_n} GCM 64 KiB and {cbc_n} CBC 256 B messages per module per round"));
    // Warm up both (lanes, key schedules, caches).
    for m in [&mv, &hsm] {
        encrypt_loop(m, true, 65536, 20)?;
        encrypt_loop(m, false, 256, 200)?;
    }
    let (mut gcm_r, mut cbc_add, mut gcm_mv, mut gcm_hsm, mut cbc_mv, mut cbc_hsm) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for r in 0..rounds {
        // Alternate which module goes first.
        let order = if r % 2 == 0 { [&mv, &hsm] } else { [&hsm, &mv] };
        let mut g = [0.0; 2];
        let mut c = [0.0; 2];
        for m in order {
            let i = usize::from(m.name != "memveil");
            g[i] = (gcm_n * 65536) as f64 / encrypt_loop(m, true, 65536, gcm_n)? / 1e9;
            c[i] = encrypt_loop(m, false, 256, cbc_n)? / cbc_n as f64 * 1e6;
        }
        gcm_r.push(g[0] / g[1]);
        cbc_add.push(c[0] - c[1]);
        gcm_mv.push(g[0]);
        gcm_hsm.push(g[1]);
        cbc_mv.push(c[0]);
        cbc_hsm.push(c[1]);
    }
    let (gr, ca) = (median(gcm_r.clone()), median(cbc_add.clone()));
    let (gm, gh, cm, ch) = (
        median(gcm_mv),
        median(gcm_hsm),
        median(cbc_mv),
        median(cbc_hsm),
    );
    let md = format!(
        "Both modules loaded in this process with `dlopen`, the same AES-256 key imported into each (a session object); memveil's module talks to a vault started for the run (protection level of the vault bench). Each message is one `C_EncryptInit` + `C_Encrypt`. {rounds} alternating rounds; medians, with the range over rounds.\n\n| workload | memveil | SoftHSM2 | figure |\n|---|---|---|---|\n| AES-256-GCM 64 KiB | {gm:.2} GB/s | {gh:.2} GB/s | ratio {gr:.3} (rounds {}) |\n| AES-256-CBC 256 B | {cm:.2} µs | {ch:.2} µs | added {ca:.2} µs (rounds {}) |\n\n",
        spread(&gcm_r),
        spread(&cbc_add)
    );
    let mut figs = vec![
        Figure::vs("pkcs11.gcm_64k_vs_softhsm", gm, gh, "GB/s", "AES-256-GCM, 64 KiB messages, C_EncryptInit+C_Encrypt, memveil module vs SoftHSM2 in the same run")
            .with_ratio(gr)
            .target(">= 0.9"),
        Figure::added("pkcs11.cbc_256_added_us", ca, ch, "µs", "mean latency of C_EncryptInit+C_Encrypt, 256 B AES-256-CBC added by memveil's module to SoftHSM2's (baseline)")
            .target("value <= 2 µs"),
    ];
    // Signatures (issue 27): the same RSA-2048 and P-256 keys in both.
    let e = |e: openssl::error::ErrorStack| fail(e.to_string());
    let rsa =
        openssl::pkey::PKey::from_rsa(openssl::rsa::Rsa::generate(2048).map_err(e)?).map_err(e)?;
    let group =
        openssl::ec::EcGroup::from_curve_name(openssl::nid::Nid::X9_62_PRIME256V1).map_err(e)?;
    let ec = openssl::pkey::PKey::from_ec_key(openssl::ec::EcKey::generate(&group).map_err(e)?)
        .map_err(e)?;
    let smv = sign::import(mv.name, mv.f, mv.slot, mv.session, &rsa, &ec)?;
    let shsm = sign::import(hsm.name, hsm.f, hsm.slot, hsm.session, &rsa, &ec)?;
    let (mut sfigs, smd) = sign::figures(opts, &smv, &shsm, &rsa)?;
    figs.append(&mut sfigs);
    let mut md = md;
    md.push_str(&smd);
    // HMAC and verification (issue 36): the same keys in both.
    let cmv = conf::import(mv.name, mv.f, mv.slot, mv.session, &rsa)?;
    let chsm = conf::import(hsm.name, hsm.f, hsm.slot, hsm.session, &rsa)?;
    let (mut cfigs, cmd) = conf::figures(opts, &cmv, &chsm, &rsa)?;
    figs.append(&mut cfigs);
    md.push_str(&cmd);
    for m in [&mv, &hsm] {
        call!(m.f, C_CloseSession, m.session)?;
        call!(m.f, C_Finalize, std::ptr::null_mut())?;
    }
    drop(d);
    // nginx with its keys in the vault, and memveil agent (issue 27).
    let (mut tfigs, tmd) = tls_figures(opts)?;
    figs.append(&mut tfigs);
    md.push_str(&tmd);
    Ok(Section {
        part: "pkcs11".into(),
        title: "PKCS#11: memveil's module against SoftHSM2".into(),
        markdown: md,
        figures: figs,
        plots: Vec::new(),
    })
}
