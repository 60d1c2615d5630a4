//! The host key table (TME-MK's KeyIDs) in a real vault: PCONFIG statuses
//! for bad requests, generations, who may program, and key bytes that never
//! come back out.
// Expected errors unwrapped.
#![allow(clippy::err_expect)]

mod common;

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;

use common::{become_uid, euid, Opts, Vault};
use memveil_engine::{Algorithm, KeyIdMode, KeyProgram, Status};
use memveil_testkit::{skip, Need};
use memveil_vault::client::{ClientError, Programmed};
use memveil_vault::proto::{self, ErrorCode, Reply, Request};
use memveil_vault::Client;

const NOBODY: u32 = 65534;

fn program(c: &mut Client, req: &KeyProgram<'_>) -> Programmed {
    c.program_keyid(req).expect("the vault answers")
}

fn generation(c: &mut Client, keyid: u16) -> u64 {
    c.keyid_status().expect("status").entries[usize::from(keyid)].generation
}

#[test]
fn program_random_shows_in_status_and_clear_raises_the_generation() {
    let v = Vault::start();
    let mut c = v.client();
    let t = c.keyid_status().expect("status");
    assert_eq!(t.max_keyid, 63, "6 KeyID bits by default");
    assert_eq!(t.entries.len(), 64);
    assert_eq!(t.level, c.level());
    assert_eq!(t.entries[0].mode, KeyIdMode::Platform(Algorithm::AesXts128));
    assert!(t.entries[1..]
        .iter()
        .all(|e| e.mode == KeyIdMode::Clear && e.generation == 0 && e.programmed_by.is_none()));

    let p = program(
        &mut c,
        &KeyProgram::random(5, Algorithm::AesXts256, &[], &[]),
    );
    assert_eq!(p.status, Status::ProgSuccess, "{}", p.message);
    let s = p.state.expect("new state");
    assert_eq!(
        (s.keyid, s.mode, s.generation, s.programmed_by),
        (5, KeyIdMode::Random(Algorithm::AesXts256), 1, Some(c.uid()))
    );
    // Another connection sees the same table.
    let mut other = v.client();
    assert_eq!(other.keyid_status().expect("status").entries[5], s);

    // Random again (a new key), clear, no-encrypt, software: each +1.
    let key = [[0x11u8; 16], [0x22u8; 16]];
    for (i, req) in [
        KeyProgram::random(5, Algorithm::AesXts128, &[7; 16], &[9; 64]),
        KeyProgram::clear(5),
        KeyProgram::no_encrypt(5),
        KeyProgram::direct(5, Algorithm::AesXts128, &key[0], &key[1]),
        KeyProgram::clear(5),
    ]
    .iter()
    .enumerate()
    {
        let p = program(&mut c, req);
        assert_eq!(p.status, Status::ProgSuccess, "{}", p.message);
        assert_eq!(p.state.map(|s| s.generation), Some(2 + i as u64));
    }
    let s = other.keyid_status().expect("status").entries[5];
    assert_eq!((s.mode, s.generation), (KeyIdMode::Clear, 6));
    // Other KeyIDs untouched.
    assert_eq!(generation(&mut c, 4), 0);
    assert_eq!(generation(&mut c, 6), 0);
    let log = v.stderr();
    let me = std::process::id();
    let uid = c.uid();
    assert!(
        log.contains(&format!(
            "audit op=keyid-program command=KEYID_SET_KEY_RANDOM keyid=5 uid={uid} pid={me} result=PROG_SUCCESS mode=random generation=1"
        )),
        "{log}"
    );
    assert!(
        log.contains("command=KEYID_CLEAR_KEY keyid=5") && log.contains("generation=6"),
        "{log}"
    );
}

#[test]
fn bad_requests_get_pconfig_statuses_and_change_nothing() {
    let v = Vault::start_with(Opts::default().arg("--keyid-bits").arg("3"))
        .unwrap_or_else(|e| panic!("vault: {e}"));
    let mut c = v.client();
    assert_eq!(c.keyid_status().expect("status").max_keyid, 7);
    let (a, b) = ([1u8; 32], [2u8; 32]);
    let raw = |keyid, command, enc_alg, f1, f2| KeyProgram {
        keyid,
        command,
        enc_alg,
        key_field_1: f1,
        key_field_2: f2,
    };
    for (req, want, says) in [
        (
            KeyProgram::random(0, Algorithm::AesXts128, &[], &[]),
            Status::InvalidKeyId,
            "platform key",
        ),
        (KeyProgram::clear(0), Status::InvalidKeyId, "platform key"),
        (KeyProgram::no_encrypt(8), Status::InvalidKeyId, "1..=7"),
        (KeyProgram::clear(u16::MAX), Status::InvalidKeyId, "1..=7"),
        (
            KeyProgram::direct(3, Algorithm::AesXts128, &a[..16], &b[..15]),
            Status::InvalidProgCmd,
            "16-byte data key",
        ),
        (
            KeyProgram::direct(3, Algorithm::AesXts256, &a[..16], &b[..16]),
            Status::InvalidProgCmd,
            "32-byte data key",
        ),
        (
            KeyProgram::direct(3, Algorithm::AesXts128, &a[..16], &a[..16]),
            Status::InvalidProgCmd,
            "distinct",
        ),
        (
            KeyProgram::random(3, Algorithm::AesXts128, &a[..5], &[]),
            Status::InvalidProgCmd,
            "entropy fields",
        ),
        (
            raw(3, 4, 1, &[], &[]),
            Status::InvalidProgCmd,
            "unknown command 4",
        ),
        (
            raw(3, 0, 2, &a[..16], &b[..16]),
            Status::InvalidEncAlg,
            "0x2",
        ),
        (raw(3, 1, 0, &[], &[]), Status::InvalidEncAlg, "0x0"),
    ] {
        let p = program(&mut c, &req);
        assert_eq!(p.status, want, "{}", p.message);
        assert!(p.message.contains(says), "{want}: {}", p.message);
        assert_eq!(p.state, None);
    }
    let t = c.keyid_status().expect("status");
    assert!(
        t.entries.iter().all(|e| e.generation == 0),
        "a refused request changed the table: {:?}",
        t.entries
    );
    // Positive control: the same KeyID with a good request.
    let p = program(&mut c, &KeyProgram::direct(3, Algorithm::AesXts256, &a, &b));
    assert_eq!(p.status, Status::ProgSuccess, "{}", p.message);
    assert!(v.stderr().contains("keyid=0 uid="), "refusals are audited");
    assert!(v.stderr().contains("result=INVALID_ENC_ALG"));
}

#[test]
fn keyid_bits_outside_the_engines_range_are_refused_at_start() {
    for bits in ["0", "16"] {
        let e = Vault::start_with(Opts::default().arg("--keyid-bits").arg(bits))
            .err()
            .expect("must refuse");
        assert!(e.contains("keyid_bits") && e.contains("1..=15"), "{e}");
    }
}

#[test]
fn concurrent_programmers_each_get_success_or_device_busy_and_generations_add_up() {
    let v = Vault::start();
    let socket = v.socket.clone();
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let s = socket.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(&s).expect("connect");
                let (mut ok, mut busy) = (0u64, 0u64);
                for _ in 0..100 {
                    match c
                        .program_keyid(&KeyProgram::random(9, Algorithm::AesXts128, &[], &[]))
                        .expect("answer")
                        .status
                    {
                        Status::ProgSuccess => ok += 1,
                        Status::DeviceBusy => busy += 1,
                        other => panic!("unexpected status {other}"),
                    }
                }
                (ok, busy)
            })
        })
        .collect();
    let (mut ok, mut busy) = (0, 0);
    for w in workers {
        let (o, b) = w.join().expect("worker");
        ok += o;
        busy += b;
    }
    assert_eq!(ok + busy, 400);
    eprintln!("4 clients x 100 programs of KeyID 9: {ok} PROG_SUCCESS, {busy} DEVICE_BUSY");
    let mut c = v.client();
    assert_eq!(
        generation(&mut c, 9),
        ok,
        "every success, and only successes, raise the generation ({busy} DEVICE_BUSY)"
    );
}

/// Reads one reply body from a raw connection.
fn raw_reply(s: &mut UnixStream) -> Vec<u8> {
    let mut h = [0u8; 4];
    s.read_exact(&mut h).expect("reply header");
    let n = proto::frame_len(h, proto::MAX_REPLY).expect("len");
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).expect("reply body");
    b
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn key_bytes_never_come_back_in_any_reply_or_log() {
    let v = Vault::start();
    let mut s = UnixStream::connect(&v.socket).expect("connect");
    s.write_all(&proto::encode_request(&Request::Hello {
        version: proto::VERSION,
    }))
    .expect("hello");
    raw_reply(&mut s);
    // Distinctive halves, 32 bytes each (AES-XTS-256).
    let k1: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(37) ^ 0xC3).collect();
    let k2: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(91) ^ 0x5E).collect();
    let mut frame = proto::encode_request(&Request::ProgramKeyId(KeyProgram::direct(
        12,
        Algorithm::AesXts256,
        &k1,
        &k2,
    )));
    frame.extend_from_slice(&k1);
    frame.extend_from_slice(&k2);
    // Positive control: the search finds the key in what was sent.
    assert!(contains(&frame, &k1[..8]) && contains(&frame, &k2[24..]));
    s.write_all(&frame).expect("program");
    let mut replies = raw_reply(&mut s);
    match proto::decode_reply(&replies).expect("decode") {
        Reply::Programmed {
            status: Status::ProgSuccess,
            state: Some(st),
            ..
        } => assert_eq!(st.mode, KeyIdMode::Direct(Algorithm::AesXts256)),
        r => panic!("{r:?}"),
    }
    s.write_all(&proto::encode_request(&Request::KeyIdStatus))
        .expect("status");
    let status = raw_reply(&mut s);
    assert!(matches!(proto::decode_reply(&status), Ok(Reply::KeyIds(_))));
    replies.extend_from_slice(&status);
    // A refused request with the same key (KeyID 0) answers without it too.
    let mut bad = proto::encode_request(&Request::ProgramKeyId(KeyProgram::direct(
        0,
        Algorithm::AesXts256,
        &k1,
        &k2,
    )));
    bad.extend_from_slice(&k1);
    bad.extend_from_slice(&k2);
    s.write_all(&bad).expect("program 0");
    replies.extend_from_slice(&raw_reply(&mut s));
    let log = v.stderr();
    for k in [&k1, &k2] {
        for w in k.windows(8) {
            assert!(!contains(&replies, w), "key bytes in a reply");
            assert!(!contains(log.as_bytes(), w), "key bytes in the log");
        }
        let hex: String = k.iter().map(|b| format!("{b:02x}")).collect();
        assert!(!log.contains(&hex[..16]), "key hex in the log");
    }
}

#[test]
fn malformed_program_frames_are_refused_and_the_connection_carries_on() {
    let v = Vault::start();
    let mut s = UnixStream::connect(&v.socket).expect("connect");
    for bad in [
        vec![0x10u8, 1, 0],                   // truncated header
        vec![0x10, 1, 0, 0, 1, 0, 65, 0],     // field 1 longer than 64
        vec![0x10, 1, 0, 0, 1, 0, 16, 16, 1], // fields announced, not sent
        vec![0x11, 0],                        // status with a trailing byte
    ] {
        let mut f = u32::try_from(bad.len())
            .expect("len")
            .to_le_bytes()
            .to_vec();
        f.extend_from_slice(&bad);
        s.write_all(&f).expect("write");
        let r = proto::decode_reply(&raw_reply(&mut s)).expect("decode");
        assert!(
            matches!(
                r,
                Reply::Error {
                    code: ErrorCode::Malformed,
                    ..
                }
            ),
            "{bad:?} -> {r:?}"
        );
    }
    s.write_all(&proto::encode_request(&Request::KeyIdStatus))
        .expect("status");
    assert!(matches!(
        proto::decode_reply(&raw_reply(&mut s)),
        Ok(Reply::KeyIds(_))
    ));
    assert_eq!(generation(&mut v.client(), 1), 0);
}

#[test]
fn a_restart_clears_the_table_like_a_reset() {
    let dir = common::scratch_dir("keyid-restart");
    let mut v = Vault::start_with(Opts::default().dir(&dir)).expect("vault");
    let mut c = v.client();
    let p = program(
        &mut c,
        &KeyProgram::random(2, Algorithm::AesXts128, &[], &[]),
    );
    assert_eq!(p.status, Status::ProgSuccess);
    assert_eq!(generation(&mut c, 2), 1);
    drop(c);
    v.kill();
    let v = Vault::start_with(Opts::default().dir(&dir)).expect("vault again");
    let t = v.client().keyid_status().expect("status");
    assert_eq!(
        (t.entries[2].mode, t.entries[2].generation),
        (KeyIdMode::Clear, 0)
    );
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `f` on a thread that is `uid` (only that thread changes uid).
fn as_uid<T: Send + 'static>(uid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        become_uid(uid);
        f()
    })
    .join()
    .expect("thread")
}

#[test]
fn only_the_owner_root_and_key_admins_may_program_everyone_may_read() {
    if euid() != 0 {
        skip(Need::Root, "runs clients as nobody");
        return;
    }
    let v = Vault::start();
    std::fs::set_permissions(&v.dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let mut root = v.client();
    let p = program(
        &mut root,
        &KeyProgram::random(4, Algorithm::AesXts128, &[], &[]),
    );
    assert_eq!(p.status, Status::ProgSuccess);

    let sock = v.socket.clone();
    let (status, refusals) = as_uid(NOBODY, move || {
        let mut c = Client::connect(&sock).expect("nobody connects");
        assert_eq!(c.uid(), NOBODY);
        let status = c.keyid_status().expect("nobody reads the table");
        let refusals: Vec<_> = [
            KeyProgram::random(4, Algorithm::AesXts128, &[], &[]),
            KeyProgram::clear(4),
            KeyProgram::no_encrypt(6),
            // Refused before the engine judges it: no PCONFIG status leaks.
            KeyProgram::clear(0),
        ]
        .iter()
        .map(|r| c.program_keyid(r))
        .collect();
        (status, refusals)
    });
    assert_eq!(status.entries[4].programmed_by, Some(0));
    assert_eq!(
        status.entries[4].mode,
        KeyIdMode::Random(Algorithm::AesXts128)
    );
    for r in refusals {
        match r {
            Err(ClientError::Refused {
                code: ErrorCode::Denied,
                message,
            }) => assert!(
                message.contains("uid 65534 may not program") && message.contains("--key-admin"),
                "{message}"
            ),
            other => panic!("nobody was not refused: {other:?}"),
        }
    }
    let t = root.keyid_status().expect("status");
    assert_eq!((t.entries[4].generation, t.entries[6].generation), (1, 0));
    assert!(v
        .stderr()
        .contains("command=KEYID_CLEAR_KEY keyid=4 uid=65534"));
    assert!(v.stderr().contains("result=denied"));

    // Positive control: the same requests from a --key-admin uid succeed.
    let v2 = Vault::start_with(Opts::default().arg("--key-admin").arg("65534"))
        .unwrap_or_else(|e| panic!("vault: {e}"));
    std::fs::set_permissions(&v2.dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let sock = v2.socket.clone();
    let got = as_uid(NOBODY, move || {
        let mut c = Client::connect(&sock).expect("nobody connects");
        [
            KeyProgram::random(4, Algorithm::AesXts128, &[], &[]),
            KeyProgram::clear(4),
        ]
        .iter()
        .map(|r| c.program_keyid(r).map(|p| (p.status, p.state)))
        .collect::<Vec<_>>()
    });
    for r in &got {
        assert!(
            matches!(r, Ok((Status::ProgSuccess, Some(s))) if s.programmed_by == Some(NOBODY)),
            "{got:?}"
        );
    }
    assert_eq!(generation(&mut v2.client(), 4), 2);
}
