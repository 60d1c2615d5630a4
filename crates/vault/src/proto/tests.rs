//! The codec's unit and property tests.

use super::wire::tag;
use super::*;
use memveil_engine::{Algorithm, KeyIdMode, KeyIdState, KeyProgram, Status as PconfigStatus};
use proptest::prelude::*;

fn body(f: &[u8]) -> &[u8] {
    &f[4..]
}

fn proto_len(f: &[u8]) -> usize {
    u32::from_le_bytes([f[0], f[1], f[2], f[3]]) as usize
}

fn sample_requests() -> Vec<Request<'static>> {
    vec![
        Request::Hello { version: 1 },
        Request::Status,
        Request::CreateKey {
            name: "k1".into(),
            kind: KeyKind::Aes256,
            persistent: true,
        },
        Request::ListKeys,
        Request::KeyInfo {
            name: "a.b-c_d".into(),
        },
        Request::RotateKey { name: "x".into() },
        Request::DestroyKey { name: "x".into() },
        Request::Grant {
            name: "x".into(),
            uid: 1000,
            perms: perm::ENCRYPT,
        },
        Request::Revoke {
            name: "x".into(),
            uid: 7,
        },
        Request::RegisterShm { len: 1 << 20 },
        Request::RegisterBuffer {
            shm: 1,
            offset: 4096,
            len: 8192,
        },
        Request::UnregisterBuffer { buffer: 3 },
        Request::OpenLane { shm: 1, offset: 0 },
        Request::CloseLane { lane: 2 },
        Request::ProgramKeyId(KeyProgram::clear(5)),
        Request::KeyIdStatus,
        Request::TenantKey { keyid: 9 },
        Request::KeyIdTenants,
        Request::PublicKey { name: "srv".into() },
        Request::CreateSecret {
            name: "hmac".into(),
            len: 32,
            persistent: true,
        },
        Request::DeriveKey {
            name: "session".into(),
            kind: KeyKind::Aes256,
            persistent: false,
            base: "p256".into(),
            kdf: 3,
            peer: &[4, 1, 2, 3],
            shared: b"info",
        },
    ]
}

/// A `ProgramKeyId` frame with its key fields appended, as the client sends it.
fn program_frame(keyid: u16, command: u8, enc_alg: u16, f1: &[u8], f2: &[u8]) -> Vec<u8> {
    let mut f = encode_request(&Request::ProgramKeyId(KeyProgram {
        keyid,
        command,
        enc_alg,
        key_field_1: f1,
        key_field_2: f2,
    }));
    f.extend_from_slice(f1);
    f.extend_from_slice(f2);
    f
}

fn states() -> Vec<KeyIdState> {
    let s = |keyid, mode, generation, programmed_by| KeyIdState {
        keyid,
        mode,
        generation,
        programmed_by,
    };
    vec![
        s(0, KeyIdMode::Platform(Algorithm::AesXts128), 0, None),
        s(1, KeyIdMode::Random(Algorithm::AesXts256), 3, Some(0)),
        s(2, KeyIdMode::Direct(Algorithm::AesXts128), 1, Some(1000)),
        s(3, KeyIdMode::NoEncrypt, 1, Some(7)),
        s(4, KeyIdMode::Clear, 2, Some(u32::MAX)),
        s(u16::MAX, KeyIdMode::Clear, u64::MAX, None),
    ]
}

#[test]
fn program_carries_key_fields_after_the_header() {
    let (k1, k2) = ([0xA5u8; 32], [0x5Au8; 32]);
    let f = program_frame(9, 0, 4, &k1, &k2);
    let header = &f[..f.len() - 64];
    assert!(!header.windows(4).any(|w| w == [0xA5; 4] || w == [0x5A; 4]));
    let n = frame_len(f[..4].try_into().expect("4"), MAX_REQUEST).expect("len");
    assert_eq!(n, f.len() - 4);
    let r = decode_request(body(&f)).expect("decode");
    assert_eq!(
        r,
        Request::ProgramKeyId(KeyProgram::direct(9, Algorithm::AesXts256, &k1, &k2))
    );
    let dbg = format!("{r:?}");
    assert!(
        dbg.contains("32 and 32 bytes") && !dbg.contains("165"),
        "{dbg}"
    );
}

#[test]
fn program_requests_stay_raw_for_the_engine_to_judge() {
    // Unknown commands, algorithms, KeyID 0 and short keys decode: the
    // engine's checks answer them with PCONFIG statuses, not the codec.
    for (keyid, cmd, alg, f1) in [(0u16, 0u8, 1u16, &[1u8; 3][..]), (70, 9, 2, &[][..])] {
        let f = program_frame(keyid, cmd, alg, f1, &[]);
        assert!(
            matches!(
                decode_request(body(&f)),
                Ok(Request::ProgramKeyId(p)) if (p.keyid, p.command, p.enc_alg) == (keyid, cmd, alg)
            ),
            "{keyid} {cmd} {alg}"
        );
    }
}

#[test]
fn oversized_or_missing_key_fields_are_malformed() {
    let long = [1u8; MAX_KEY_FIELD + 1];
    let f = program_frame(1, 0, 1, &long, &[]);
    assert_eq!(
        decode_request(body(&f)),
        Err(DecodeError::BadValue {
            field: "key field 1 length",
            value: 65
        })
    );
    // Declared 16 + 16, sent 16.
    let mut f = encode_request(&Request::ProgramKeyId(KeyProgram::direct(
        1,
        Algorithm::AesXts128,
        &[2; 16],
        &[3; 16],
    )));
    f.extend_from_slice(&[2; 16]);
    assert!(matches!(
        decode_request(body(&f)),
        Err(DecodeError::Truncated {
            what: "key field 2",
            ..
        })
    ));
    // One byte too many.
    let mut f = program_frame(1, 0, 1, &[2; 16], &[3; 16]);
    f.push(0);
    assert_eq!(decode_request(body(&f)), Err(DecodeError::Trailing(1)));
}

#[test]
fn keyid_replies_round_trip_and_reject_impossible_states() {
    for rep in [
        Reply::KeyIds(KeyIdTable {
            max_keyid: 63,
            level: "secret".into(),
            entries: states(),
        }),
        Reply::KeyIds(KeyIdTable {
            max_keyid: 1,
            level: "locked".into(),
            entries: Vec::new(),
        }),
        Reply::Programmed {
            status: PconfigStatus::ProgSuccess,
            message: "PROG_SUCCESS".into(),
            state: Some(states()[1]),
        },
        Reply::Programmed {
            status: PconfigStatus::InvalidKeyId,
            message: "INVALID_KEYID: KeyID 0".into(),
            state: None,
        },
        Reply::TenantStop {
            keyid: 5,
            generation: 3,
            message: "cleared by uid 0".into(),
        },
        Reply::KeyIdTenants(vec![0, 2, 0, u32::MAX]),
        Reply::KeyIdTenants(Vec::new()),
    ] {
        let f = encode_reply(&rep);
        assert_eq!(decode_reply(body(&f)).expect("decode"), rep);
    }
    // Tenant counts: one more announced than sent is truncated, one
    // byte more is trailing.
    let f = encode_reply(&Reply::KeyIdTenants(vec![1, 2]));
    let mut b = body(&f).to_vec();
    b[1] = 3;
    assert!(matches!(
        decode_reply(&b),
        Err(DecodeError::Truncated {
            what: "tenant count",
            ..
        })
    ));
    let mut b = body(&f).to_vec();
    b.push(0);
    assert_eq!(decode_reply(&b), Err(DecodeError::Trailing(1)));
    // A tenant key: the frame's length counts the key bytes sent after it.
    let rep = Reply::TenantKey(states()[1]);
    let mut f = encode_reply(&rep);
    let n = proto_len(&f);
    assert_eq!(n, f.len() - 4 + TENANT_KEY_LEN);
    assert!(matches!(
        decode_reply(body(&f)),
        Err(DecodeError::Truncated { .. })
    ));
    f.extend_from_slice(&[0xAB; TENANT_KEY_LEN]);
    assert_eq!(decode_reply(body(&f)).expect("decode"), rep);
    f.push(0);
    assert_eq!(decode_reply(body(&f)), Err(DecodeError::Trailing(1)));
    let ok = encode_reply(&Reply::Programmed {
        status: PconfigStatus::ProgSuccess,
        message: String::new(),
        state: Some(states()[1]),
    });
    let b = body(&ok).to_vec();
    // Layout: tag, status, message (u16 length 0), present, keyid (2), mode, alg (2).
    let (status_at, mode_at, alg_at) = (1, 7, 8);
    for (at, v, field) in [
        (status_at, 6u8, "PCONFIG status"),
        (mode_at, 5, "keyid mode"),
        (alg_at, 2, "keyid algorithm"),
        (alg_at, 0, "keyid algorithm"),
    ] {
        let mut bad = b.clone();
        bad[at] = v;
        assert!(
            matches!(decode_reply(&bad), Err(DecodeError::BadValue { field: f, .. }) if f == field),
            "{field}={v}: {:?}",
            decode_reply(&bad)
        );
    }
    // Clear and no-encrypt carry no algorithm.
    let mut bad = b.clone();
    bad[mode_at] = 0;
    assert!(decode_reply(&bad).is_err());
    // Positive control: the unmodified body decodes.
    assert!(decode_reply(&b).is_ok());
}

#[test]
fn requests_round_trip() {
    for r in sample_requests() {
        let f = encode_request(&r);
        assert_eq!(
            frame_len(f[..4].try_into().expect("4"), MAX_REQUEST).expect("len"),
            f.len() - 4
        );
        assert_eq!(decode_request(body(&f)).expect("decode"), r, "{r:?}");
    }
}

#[test]
fn import_carries_key_after_the_header() {
    let key = [7u8; 32];
    let r = Request::ImportKey {
        name: "imp".into(),
        kind: KeyKind::Aes256,
        persistent: false,
        key: &key,
    };
    let mut f = encode_request(&r);
    let n = frame_len(f[..4].try_into().expect("4"), MAX_REQUEST).expect("len");
    assert!(!f.windows(32).any(|w| w == key), "key bytes in the header");
    f.extend_from_slice(&key);
    assert_eq!(n, f.len() - 4);
    assert_eq!(decode_request(body(&f)).expect("decode"), r);
    assert!(!format!("{r:?}").contains("7, 7"));
}

#[test]
fn import_with_wrong_key_length_is_refused() {
    let key = [7u8; 16];
    let mut f = encode_request(&Request::ImportKey {
        name: "imp".into(),
        kind: KeyKind::Aes256,
        persistent: false,
        key: &key,
    });
    f.extend_from_slice(&key);
    assert!(matches!(
        decode_request(body(&f)),
        Err(DecodeError::BadValue {
            field: "key length",
            ..
        })
    ));
}

#[test]
fn malformed_inputs_are_errors() {
    assert_eq!(decode_request(&[]), Err(DecodeError::Empty));
    assert_eq!(decode_request(&[0xEE]), Err(DecodeError::UnknownTag(0xEE)));
    assert!(matches!(
        decode_request(&[tag::HELLO]),
        Err(DecodeError::Truncated { .. })
    ));
    assert_eq!(
        decode_request(&[tag::STATUS, 0]),
        Err(DecodeError::Trailing(1))
    );
    let mut bad_name = vec![tag::INFO, 3, 0];
    bad_name.extend_from_slice(b"a/b");
    assert_eq!(decode_request(&bad_name), Err(DecodeError::BadName));
    assert!(frame_len((u32::MAX).to_le_bytes(), MAX_REQUEST).is_err());
    assert!(frame_len(0u32.to_le_bytes(), MAX_REQUEST).is_err());
}

#[test]
fn replies_round_trip() {
    let k = KeyInfo {
        id: 3,
        name: "k".into(),
        kind: KeyKind::Xts256,
        owner: 1000,
        versions: 2,
        persistent: false,
        acl: vec![(1001, perm::DECRYPT)],
    };
    for rep in [
        Reply::Welcome {
            version: 1,
            level: "secret".into(),
            uid: 0,
            pid: -1,
            vault_pid: 77,
        },
        Reply::Status(Status {
            version: 1,
            level: "locked".into(),
            backend: "b".into(),
            keys: 2,
            clients: 1,
            durable: true,
            uptime_s: 9,
            pid: 4,
        }),
        Reply::Key(k.clone()),
        Reply::Keys(vec![k.clone(), k]),
        Reply::Done,
        Reply::Id(5),
        Reply::Error {
            code: ErrorCode::Quota,
            message: "too many".into(),
        },
    ] {
        let f = encode_reply(&rep);
        assert_eq!(decode_reply(body(&f)).expect("decode"), rep);
    }
}

proptest! {
    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = decode_request(&bytes);
        let _ = decode_reply(&bytes);
    }

    #[test]
    fn truncations_of_valid_frames_are_errors(i in 0usize..19, cut in 0usize..64) {
        let reqs = sample_requests();
        let f = encode_request(&reqs[i % reqs.len()]);
        let b = body(&f);
        if cut < b.len() {
            prop_assert!(decode_request(&b[..cut]).is_err());
        }
    }

    #[test]
    fn program_requests_round_trip(
        keyid: u16,
        command: u8,
        enc_alg: u16,
        f1 in proptest::collection::vec(any::<u8>(), 0..=MAX_KEY_FIELD),
        f2 in proptest::collection::vec(any::<u8>(), 0..=MAX_KEY_FIELD),
    ) {
        let f = program_frame(keyid, command, enc_alg, &f1, &f2);
        let want = Request::ProgramKeyId(KeyProgram { keyid, command, enc_alg, key_field_1: &f1, key_field_2: &f2 });
        prop_assert_eq!(decode_request(body(&f)).expect("decode"), want);
        for cut in 0..f.len() - 4 {
            prop_assert!(decode_request(&body(&f)[..cut]).is_err());
        }
    }

    #[test]
    fn keyid_tables_survive_any_corruption_without_panic(at in 0usize..200, v: u8) {
        for rep in [
            Reply::KeyIds(KeyIdTable {
                max_keyid: 5,
                level: "secret".into(),
                entries: states(),
            }),
            Reply::KeyIdTenants(vec![0, 1, 2, 3, 0, 7]),
        ] {
            let f = encode_reply(&rep);
            let mut b = body(&f).to_vec();
            let i = at % b.len();
            b[i] = v;
            let _ = decode_reply(&b);
            let _ = decode_reply(&b[..i]);
        }
    }

    #[test]
    fn names_round_trip(name in "[A-Za-z0-9._-]{1,64}", uid: u32, perms in 1u8..8) {
        let r = Request::Grant { name, uid, perms };
        let f = encode_request(&r);
        prop_assert_eq!(decode_request(body(&f)).expect("decode"), r);
    }
}
