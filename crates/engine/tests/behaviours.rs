//! The behaviours docs/engine.md promises of the engine, one test each.

use memveil_engine::{
    Algorithm, Config, Engine, EngineError, KeyProgram, Mode, ProgramError, Status, PAGE,
};
use memveil_secmem::{Level, Policy};
use memveil_testkit::{skip, Need};

const K1A: [u8; 16] = [0x11; 16];
const K1B: [u8; 16] = [0x22; 16];

fn engine(mode: Mode, cache_pages: usize) -> Engine {
    Engine::new(Config {
        frames: 64,
        cache_pages,
        mode,
        policy: Policy::allow(Level::Locked),
        ..Config::default()
    })
    .expect("engine")
}

fn with_key(e: &Engine, keyid: u16) {
    let a: Vec<u8> = K1A
        .iter()
        .map(|b| b ^ u8::try_from(keyid).unwrap_or(0))
        .collect();
    e.program(&KeyProgram::direct(keyid, Algorithm::AesXts128, &a, &K1B))
        .expect("program");
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| u8::try_from(i % 251).unwrap_or(0) ^ seed)
        .collect()
}

#[test]
fn round_trip_across_pages_and_evictions() {
    let e = engine(Mode::Tsme, 4);
    with_key(&e, 1);
    let data = pattern(10 * PAGE + 123, 7);
    let at = e.address(3 * PAGE as u64 + 1000, 1, true);
    e.write(at, &data).expect("write");
    let mut back = vec![0; data.len()];
    e.read(at, &mut back).expect("read");
    assert_eq!(back, data);
    e.flush();
    let mut back = vec![0; data.len()];
    e.read(at, &mut back).expect("read");
    assert_eq!(back, data);
    let s = e.stats();
    assert!(s.evictions > 0 && s.writebacks > 0, "{s:?}");
}

#[test]
fn memory_holds_ciphertext_not_plaintext() {
    let e = engine(Mode::Tsme, 4);
    with_key(&e, 1);
    let data = pattern(PAGE, 1);
    e.write(e.address(0, 1, true), &data).expect("write");
    e.write(e.address(PAGE as u64, 1, true), &data)
        .expect("write");
    e.flush();
    let (f0, f1) = (e.dram_frame(0).expect("f0"), e.dram_frame(1).expect("f1"));
    assert_ne!(f0, data, "frame 0 holds plaintext");
    assert_ne!(
        f0, f1,
        "same plaintext at two addresses must give two ciphertexts"
    );
}

#[test]
fn wrong_keyid_reads_garbage_not_an_error() {
    let e = engine(Mode::Tsme, 8);
    with_key(&e, 1);
    with_key(&e, 2);
    let data = pattern(PAGE, 3);
    e.write(e.address(0, 1, true), &data).expect("write");
    e.flush();
    let mut other = vec![0; PAGE];
    e.read(e.address(0, 2, true), &mut other)
        .expect("wrong KeyID is not an error");
    assert_ne!(other, data);
    let mut right = vec![0; PAGE];
    e.read(e.address(0, 1, true), &mut right).expect("read");
    assert_eq!(
        right, data,
        "positive control: the right KeyID reads the data"
    );
}

#[test]
fn aliasing_flushes_instead_of_returning_stale_plaintext() {
    let e = engine(Mode::Tsme, 8);
    with_key(&e, 1);
    with_key(&e, 2);
    let data = pattern(PAGE, 9);
    // Dirty in the cache under KeyID 1, then read through KeyID 2 at once.
    e.write(e.address(5 * PAGE as u64, 1, true), &data)
        .expect("write");
    let mut via2 = vec![0; PAGE];
    e.read(e.address(5 * PAGE as u64, 2, true), &mut via2)
        .expect("read");
    assert_ne!(
        via2, data,
        "stale plaintext returned through a second KeyID"
    );
    assert_eq!(e.stats().alias_flushes, 1);
    // What a flush-then-read gives is exactly what we got.
    let mut again = vec![0; PAGE];
    e.flush();
    e.read(e.address(5 * PAGE as u64, 2, true), &mut again)
        .expect("read");
    assert_eq!(again, via2);
    // And the data survived under its own KeyID.
    let mut via1 = vec![0; PAGE];
    e.read(e.address(5 * PAGE as u64, 1, true), &mut via1)
        .expect("read");
    assert_eq!(via1, data);
}

#[test]
fn relocated_ciphertext_decrypts_to_garbage() {
    let e = engine(Mode::Tsme, 8);
    with_key(&e, 1);
    let data = pattern(PAGE, 4);
    e.write(e.address(2 * PAGE as u64, 1, true), &data)
        .expect("write");
    e.flush();
    e.dram_copy(2, 9).expect("copy");
    let mut moved = vec![0; PAGE];
    e.read(e.address(9 * PAGE as u64, 1, true), &mut moved)
        .expect("read");
    assert_ne!(
        moved, data,
        "ciphertext moved to another frame must not decrypt"
    );
    // Positive control: copying it back to where it came from restores it.
    e.dram_copy(9, 2).expect("copy back");
    let mut home = vec![0; PAGE];
    e.read(e.address(2 * PAGE as u64, 1, true), &mut home)
        .expect("read");
    assert_eq!(home, data);
}

#[test]
fn clear_key_crypto_erases() {
    let e = engine(Mode::Tsme, 8);
    e.program(&KeyProgram::random(3, Algorithm::AesXts128, &[], &[]))
        .expect("random key");
    let data = pattern(3 * PAGE, 5);
    let at = e.address(10 * PAGE as u64, 3, true);
    e.write(at, &data).expect("write");
    // Still dirty in the cache: programming must write it back under the old key.
    e.program(&KeyProgram::clear(3)).expect("clear");
    let mut after = vec![0; data.len()];
    e.read(at, &mut after).expect("read");
    assert_ne!(after, data, "data readable after KEYID_CLEAR_KEY");
    e.program(&KeyProgram::random(3, Algorithm::AesXts128, &[], &[]))
        .expect("new random key");
    e.read(at, &mut after).expect("read");
    assert_ne!(after, data, "data readable under a new random key");
}

#[test]
fn random_keys_mix_caller_entropy_and_differ() {
    let e = engine(Mode::Tsme, 8);
    let data = pattern(PAGE, 6);
    for (kid, ent) in [(4u16, [0u8; 16]), (5, [0xAB; 16])] {
        e.program(&KeyProgram::random(kid, Algorithm::AesXts128, &ent, &ent))
            .expect("random");
        e.write(
            e.address(20 * PAGE as u64 + u64::from(kid) * PAGE as u64, kid, true),
            &data,
        )
        .expect("write");
    }
    e.flush();
    assert_ne!(e.dram_frame(24).expect("f"), e.dram_frame(25).expect("f"));
}

#[test]
fn no_encrypt_is_a_plaintext_bypass() {
    let e = engine(Mode::Tsme, 8);
    e.program(&KeyProgram::no_encrypt(6)).expect("bypass");
    with_key(&e, 1);
    let data = pattern(PAGE, 8);
    e.write(e.address(30 * PAGE as u64, 6, true), &data)
        .expect("write");
    e.write(e.address(31 * PAGE as u64, 1, true), &data)
        .expect("write");
    e.flush();
    assert_eq!(
        e.dram_frame(30).expect("f"),
        data,
        "bypass must store plaintext"
    );
    assert_ne!(
        e.dram_frame(31).expect("f"),
        data,
        "control: an encrypting KeyID does not"
    );
}

#[test]
fn sme_encrypts_only_c_bit_pages_and_tsme_every_page() {
    let data = pattern(PAGE, 2);
    let sme = engine(Mode::Sme, 8);
    sme.write(sme.address(0, 0, false), &data).expect("write");
    sme.write(sme.address(PAGE as u64, 0, true), &data)
        .expect("write");
    sme.flush();
    assert_eq!(
        sme.dram_frame(0).expect("f"),
        data,
        "SME: C-bit clear is plaintext"
    );
    assert_ne!(
        sme.dram_frame(1).expect("f"),
        data,
        "SME: C-bit set is encrypted"
    );
    let tsme = engine(Mode::Tsme, 8);
    tsme.write(tsme.address(0, 0, false), &data).expect("write");
    tsme.flush();
    assert_ne!(
        tsme.dram_frame(0).expect("f"),
        data,
        "TSME encrypts regardless of the C-bit"
    );
}

/// The TME-MK figure: a hypervisor (KeyID 0), VM1 (KeyID 1), VM2 (KeyID 2), and
/// one page shared by the two VMs under KeyID 3.
#[test]
fn domains_private_and_shared_pages() {
    let e = engine(Mode::Tsme, 8);
    for k in 1..=3 {
        e.program(&KeyProgram::random(k, Algorithm::AesXts128, &[], &[]))
            .expect("key");
    }
    let vm1 = e.domain("vm1", &[1, 3], &[0..8, 16..17]);
    let vm2 = e.domain("vm2", &[2, 3], &[8..16, 16..17]);
    let secret = b"vm1 private data";
    vm1.write(vm1.address(0, 0, 1), secret).expect("vm1 write");
    vm1.write(vm1.address(16, 0, 3), b"hello vm2")
        .expect("shared write");
    let mut got = [0u8; 9];
    vm2.read(vm2.address(16, 0, 3), &mut got)
        .expect("shared read");
    assert_eq!(&got, b"hello vm2");
    // VM2 cannot name VM1's KeyID nor map VM1's frames.
    let mut buf = [0u8; 16];
    assert!(matches!(
        vm2.read(vm2.address(0, 0, 1), &mut buf),
        Err(EngineError::KeyIdNotPermitted { keyid: 1, .. })
    ));
    assert!(matches!(
        vm2.read(vm2.address(0, 0, 2), &mut buf),
        Err(EngineError::FrameNotMapped { frame: 0, .. })
    ));
    // The hypervisor may read any frame, but under its own KeyID it sees garbage.
    e.read(e.address(0, 0, true), &mut buf)
        .expect("hypervisor read");
    assert_ne!(&buf, secret);
    e.read(e.address(0, 1, true), &mut buf)
        .expect("hypervisor with vm1's KeyID");
    assert_eq!(&buf, secret, "positive control: the right KeyID reads it");
}

#[test]
fn bad_programming_requests_return_their_status() {
    let e = engine(Mode::Tsme, 8);
    let max = e.max_keyid();
    assert_eq!(max, 63);
    let st = |r: KeyProgram<'_>| e.program_status(&r);
    assert_eq!(st(KeyProgram::clear(0)), Status::InvalidKeyId);
    assert_eq!(st(KeyProgram::clear(max + 1)), Status::InvalidKeyId);
    assert_eq!(st(KeyProgram::clear(max)), Status::ProgSuccess);
    let mut bad_cmd = KeyProgram::clear(1);
    bad_cmd.command = 7;
    assert_eq!(st(bad_cmd), Status::InvalidProgCmd);
    let mut bad_alg = KeyProgram::direct(1, Algorithm::AesXts128, &K1A, &K1B);
    bad_alg.enc_alg = 2;
    assert_eq!(st(bad_alg), Status::InvalidEncAlg);
    assert_eq!(
        st(KeyProgram::direct(
            1,
            Algorithm::AesXts128,
            &K1A[..15],
            &K1B
        )),
        Status::InvalidProgCmd
    );
    assert_eq!(
        st(KeyProgram::direct(1, Algorithm::AesXts256, &K1A, &K1B)),
        Status::InvalidProgCmd,
        "128-bit keys under the 256-bit algorithm"
    );
    assert_eq!(
        st(KeyProgram::direct(1, Algorithm::AesXts128, &K1A, &K1A)),
        Status::InvalidProgCmd
    );
    assert_eq!(
        st(KeyProgram::random(1, Algorithm::AesXts128, &[1; 5], &[])),
        Status::InvalidProgCmd
    );
    assert_eq!(
        st(KeyProgram::direct(
            1,
            Algorithm::AesXts256,
            &[1; 32],
            &[2; 32]
        )),
        Status::ProgSuccess
    );
    let msg = e
        .program(&KeyProgram::direct(1, Algorithm::AesXts128, &K1A, &K1A))
        .expect_err("equal halves")
        .to_string();
    assert!(msg.contains("distinct"), "{msg}");
}

#[test]
fn entropy_failure_is_entropy_error() {
    let e = Engine::with_entropy(
        Config {
            frames: 8,
            policy: Policy::allow(Level::Locked),
            ..Config::default()
        },
        Box::new({
            let calls = std::sync::atomic::AtomicUsize::new(0);
            move |buf: &mut [u8]| {
                // The platform key at start-up succeeds; later requests fail.
                if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    buf.fill(0x42);
                    buf[0] = 1;
                    Ok(())
                } else {
                    Err("injected DRNG failure".into())
                }
            }
        }),
    )
    .expect("engine");
    let r = e.program(&KeyProgram::random(1, Algorithm::AesXts128, &[], &[]));
    assert!(matches!(r, Err(ProgramError::Entropy(_))), "{r:?}");
    assert_eq!(r.expect_err("err").status(), Status::EntropyError);
    // Direct keys do not need the DRNG.
    assert!(e
        .program(&KeyProgram::direct(1, Algorithm::AesXts128, &K1A, &K1B))
        .is_ok());
}

#[test]
fn bad_addresses_are_errors() {
    let e = engine(Mode::Tsme, 8);
    let mut b = [0u8; 8];
    let end = e.address(64 * PAGE as u64 - 4, 0, true);
    assert!(matches!(
        e.read(end, &mut b),
        Err(EngineError::AddressOutOfRange { .. })
    ));
    assert!(matches!(
        e.read(1 << 60, &mut b),
        Err(EngineError::ReservedBits { .. })
    ));
    assert!(matches!(
        e.write(1 << 46, &b),
        Err(EngineError::ReservedBits { .. })
    ));
    assert!(
        e.read(e.address(64 * PAGE as u64 - 8, 0, true), &mut b)
            .is_ok(),
        "last bytes are fine"
    );
    assert!(e.dram_frame(64).is_err());
    assert!(matches!(
        Engine::new(Config {
            keyid_bits: 0,
            ..Config::default()
        }),
        Err(EngineError::Config(_))
    ));
    assert!(matches!(
        Engine::new(Config {
            frames: 0,
            ..Config::default()
        }),
        Err(EngineError::Config(_))
    ));
}

#[test]
fn keys_and_cache_live_in_secret_memory_when_available() {
    let e = Engine::new(Config {
        frames: 8,
        policy: Policy::allow(Level::Locked),
        ..Config::default()
    })
    .expect("engine");
    if memveil_sys::memfd_secret().is_ok() {
        assert_eq!(e.level(), Level::Secret);
    } else {
        skip(
            Need::MemfdSecret,
            format!("the secret level check (level {})", e.level()),
        );
    }
    let o = e.overhead();
    assert!(o.cache_bytes >= 8 * PAGE && o.key_table_bytes > 0, "{o:?}");
}
