//! The daemon as a real process: startup refusals, malformed input,
//! hostile lanes, ACLs, quotas, audit lines, readiness, and replies that
//! never carry key bytes.
// Test data: small counters cast to bytes on purpose; expected errors unwrapped.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::err_expect,
    clippy::manual_is_multiple_of
)]

mod common;

use std::io::{Read as _, Write as _};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::process::Command;
use std::time::Duration;

use common::{Opts, Vault};
use memveil_testkit::{skip, Need};
use memveil_vault::client::{ClientError, Crypt};
use memveil_vault::proto::{self, perm, ErrorCode, KeyKind, Mode, Reply, Request};
use memveil_vault::ring::{self, status, Entry, Op};

const NOBODY: &[&str] = &[
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
];

fn have_memfd_secret() -> bool {
    memveil_sys::memfd_secret().is_ok()
}

#[test]
fn refuses_without_memfd_secret_unless_locked_is_accepted() {
    // Simulated absence (this machine has memfd_secret).
    let e = Vault::start_with(Opts::default().env("MEMVEIL_SECRETMEM", "off"))
        .err()
        .expect("must refuse");
    assert!(
        e.contains("memfd_secret unavailable") && e.contains("--allow-level=locked"),
        "{e}"
    );
    assert!(
        !e.contains("exit Some(ExitStatus(unix_wait_status(0)))"),
        "{e}"
    );

    let v = Vault::start_with(
        Opts::default()
            .env("MEMVEIL_SECRETMEM", "off")
            .arg("--allow-level=locked"),
    )
    .expect("locked");
    assert!(v.ready.contains("level=locked"), "{}", v.ready);
    let mut c = v.client();
    assert_eq!(c.level(), "locked");
    assert_eq!(c.status().expect("status").level, "locked");

    // Positive control: without the switch the strong level is used.
    if have_memfd_secret() {
        let v = Vault::start();
        assert!(v.ready.contains("level=secret"), "{}", v.ready);
        assert_eq!(v.client().level(), "secret");
    } else {
        skip(Need::MemfdSecret, "the secret-level branch");
    }
}

#[test]
fn bad_configuration_exits_non_zero_with_a_clear_message() {
    let e = Vault::start_with(Opts::default().arg("--state").arg("/tmp/x"))
        .err()
        .expect("no kek");
    assert!(
        e.contains("--passphrase-file") && !e.contains("status(0)"),
        "{e}"
    );
    let e = Vault::start_with(Opts::default().arg("--allow-level=bogus"))
        .err()
        .expect("bad level");
    assert!(e.contains("unknown protection level"), "{e}");
    let out = Command::new(common::bin())
        .args(["serve", "--socket", "/nonexistent-dir/v.sock"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent-dir/v.sock") && err.contains("directory exists"),
        "{err}"
    );
    // A second vault on a live socket is refused, the first keeps serving.
    let v = Vault::start();
    let out = Command::new(common::bin())
        .arg("serve")
        .arg("--socket")
        .arg(&v.socket)
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("another vault is listening"));
    v.client().status().expect("first still serves");
    // A vault starting while another is between its check of a stale
    // socket file and its bind (it holds the path's lock) is refused, and
    // leaves the file for that one to replace: two vaults started at once
    // on a stale socket both found it stale, and the second removed the
    // socket the first had just bound (that one then served no client).
    let dir = common::scratch_dir("starting");
    let sock = dir.join("vault.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).expect("a stale socket"));
    let starting = memveil_sys::ipc::PathLock::try_take(&sock)
        .expect("lock")
        .expect("free");
    let out = Command::new(common::bin())
        .arg("serve")
        .arg("--socket")
        .arg(&sock)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("or starting on it"),
        "a vault started on a socket another is binding: {err}"
    );
    assert!(
        std::fs::symlink_metadata(&sock)
            .is_ok_and(|m| { std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) }),
        "the refused vault removed the socket file"
    );
    // Once the other is gone, the stale socket is replaced.
    starting.release();
    let v = Vault::start_with(Opts::default().dir(&dir)).expect("start");
    v.client().status().expect("serves");
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Regression: the vault removed whatever was at its socket path (a
/// mistyped `--vault` deleted the file there) and served in its place. Now
/// it refuses, naming the path, what is there and the fix, and the file is
/// kept byte for byte, with no lock file made beside it; the ssh agent and
/// `rng serve` refuse the same way (one piece of code,
/// `memveil_sys::ipc::bind_socket`).
#[test]
fn a_file_at_the_socket_path_is_kept_and_the_vault_refuses() {
    let dir = common::scratch_dir("notsock");
    let sock = dir.join("vault.sock");
    std::fs::write(&sock, b"someone's notes\n").expect("write");
    let e = match Vault::start_with(Opts::default().dir(&dir)) {
        Ok(v) => panic!("the vault started over a regular file: {}", v.ready),
        Err(e) => e,
    };
    assert!(
        e.contains(&sock.display().to_string())
            && e.contains("a regular file is there")
            && e.contains("refusing to replace it")
            && e.contains("choose another --vault"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(&sock).expect("the file survives"),
        b"someone's notes\n"
    );
    assert!(
        !dir.join("vault.sock.lock").exists(),
        "a lock file made beside a path that is not a socket"
    );
    // Positive control: once the file is gone, the vault serves there.
    std::fs::remove_file(&sock).expect("remove");
    let v = Vault::start_with(Opts::default().dir(&dir)).expect("start");
    v.client().status().expect("serves");
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn memlock_exhausted_names_the_limit_and_the_fix() {
    if common::euid() != 0 {
        skip(Need::Root, "runs the vault as nobody");
        return;
    }
    if !std::path::Path::new("/usr/bin/setpriv").exists() {
        skip(Need::Installed("setpriv"), "runs the vault as nobody");
        return;
    }
    let dir = common::scratch_dir("memlock");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .expect("chmod");
    let wrap = |memlock: &str| {
        // prlimit (as root) sets the limit, then setpriv drops to nobody.
        let mut w = vec![
            "prlimit".to_owned(),
            format!("--memlock={memlock}"),
            "--".to_owned(),
        ];
        w.extend(NOBODY.iter().map(|s| (*s).to_owned()));
        w
    };
    let e = Vault::start_with(
        Opts {
            wrapper: wrap("65536:65536"),
            ..Opts::default()
        }
        .dir(&dir),
    )
    .err()
    .expect("must fail under a 64 KiB memlock limit");
    assert!(
        e.contains("RLIMIT_MEMLOCK")
            && e.contains("65536")
            && e.contains("ulimit -l")
            && e.contains("LimitMEMLOCK="),
        "{e}"
    );
    // Positive control: the same user with room to lock starts fine.
    let v = Vault::start_with(
        Opts {
            wrapper: wrap("8388608:8388608"),
            ..Opts::default()
        }
        .dir(&dir),
    )
    .expect("starts with 8 MiB (the hard limit here)");
    let c = v.client();
    assert_eq!(c.uid(), 0);
    // Running out of locked memory with clients connected: the client that
    // does not fit is told why; the others keep working.
    let mut clients = vec![c];
    let mut refusal = None;
    for _ in 0..64 {
        match memveil_vault::Client::connect(&v.socket) {
            Ok(c) => clients.push(c),
            Err(e) => {
                refusal = Some(e.to_string());
                break;
            }
        }
    }
    let msg = refusal.expect("64 connections under an 8 MiB memlock limit should not all fit");
    assert!(
        msg.contains("cannot serve another client") && msg.contains("RLIMIT_MEMLOCK"),
        "{msg}"
    );
    for c in &mut clients {
        c.status().expect("earlier clients still served");
    }
    drop(clients);
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}

fn raw_call(s: &mut UnixStream, frame: &[u8]) -> (Vec<u8>, Reply) {
    s.write_all(frame).expect("write");
    let mut h = [0u8; 4];
    s.read_exact(&mut h).expect("reply header");
    let n = proto::frame_len(h, proto::MAX_REPLY).expect("len");
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).expect("reply body");
    let r = proto::decode_reply(&b).expect("decode");
    (b, r)
}

#[test]
fn malformed_frames_get_an_error_and_the_vault_keeps_serving() {
    let v = Vault::start();
    let mut good = v.client();
    let k = good
        .create_key("steady", KeyKind::Aes128, false)
        .expect("create");
    let check = |c: &mut memveil_vault::Client| {
        let mut d = [7u8; 64];
        c.encrypt(&Crypt::new(k.id, Mode::Ctr), &mut d)
            .expect("enc");
        c.decrypt(&Crypt::new(k.id, Mode::Ctr), &mut d)
            .expect("dec");
        assert_eq!(d, [7u8; 64]);
    };
    let mut s = UnixStream::connect(&v.socket).expect("connect");
    for bad in [
        vec![1, 0, 0, 0, 0xEE],                      // unknown tag
        vec![2, 0, 0, 0, 2, 9],                      // trailing byte
        vec![1, 0, 0, 0, 1],                         // truncated hello
        vec![4, 0, 0, 0, 6, 3, 0, b'a'],             // truncated name
        vec![6, 0, 0, 0, 6, 2, 0, b'a', b'/', b'b'], // bad name
        vec![3, 0, 0, 0, 9, 0, 0],                   // grant with nothing
    ] {
        let (_, r) = raw_call(&mut s, &bad);
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
        check(&mut good);
    }
    // The connection survived all of that.
    let (_, r) = raw_call(&mut s, &proto::encode_request(&Request::Status));
    assert!(matches!(r, Reply::Status(_)), "{r:?}");
    // An oversized frame: error, then the vault closes that connection only.
    let (_, r) = raw_call(&mut s, &u32::MAX.to_le_bytes());
    assert!(
        matches!(
            r,
            Reply::Error {
                code: ErrorCode::Malformed,
                ..
            }
        ),
        "{r:?}"
    );
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    // Garbage then a hang-up, many times.
    for i in 0..50u8 {
        let mut g = UnixStream::connect(&v.socket).expect("connect");
        let _ = g.write_all(&[i, 0xFF, i, 1, 2, 3, 4, 5, 6, 7]);
    }
    check(&mut good);
    assert!(v.stderr().contains("audit op=create key=steady"));
}

#[test]
fn shared_areas_must_be_sealed_memfds() {
    let v = Vault::start();
    let s = UnixStream::connect(&v.socket).expect("connect");
    let mut s2 = s.try_clone().expect("clone");
    let frame = proto::encode_request(&Request::RegisterShm { len: 8192 });
    // No descriptor attached.
    let (_, r) = raw_call(&mut s2, &frame);
    assert!(
        matches!(&r, Reply::Error { code: ErrorCode::Invalid, message } if message.contains("SCM_RIGHTS")),
        "{r:?}"
    );
    // A regular file.
    let f = std::fs::File::open("/etc/hostname").expect("file");
    memveil_sys::ipc::send_with_fd(
        &s,
        &[std::io::IoSlice::new(&frame)],
        std::os::fd::AsFd::as_fd(&f),
    )
    .expect("send");
    let mut h = [0u8; 4];
    s2.read_exact(&mut h).expect("hdr");
    let mut b = vec![0u8; proto::frame_len(h, proto::MAX_REPLY).expect("len")];
    s2.read_exact(&mut b).expect("body");
    let r = proto::decode_reply(&b).expect("decode");
    assert!(
        matches!(&r, Reply::Error { message, .. } if message.contains("memfd")),
        "{r:?}"
    );
    // A memfd claiming more than it has.
    let fd = memveil_sys::ipc::memfd_sealed("t", 4096).expect("memfd");
    memveil_sys::ipc::send_with_fd(
        &s,
        &[std::io::IoSlice::new(&frame)],
        std::os::fd::AsFd::as_fd(&fd),
    )
    .expect("send");
    s2.read_exact(&mut h).expect("hdr");
    let mut b = vec![0u8; proto::frame_len(h, proto::MAX_REPLY).expect("len")];
    s2.read_exact(&mut b).expect("body");
    let r = proto::decode_reply(&b).expect("decode");
    assert!(
        matches!(&r, Reply::Error { message, .. } if message.contains("smaller")),
        "{r:?}"
    );
}

#[test]
fn hostile_lane_descriptors_never_reach_outside_the_registered_buffer() {
    let v = Vault::start();
    let mut c = v.client();
    let k = c.create_key("h", KeyKind::Aes256, false).expect("create");
    let (sess, mut lanes) = c.session(8192, 1).expect("session");
    let lane = &mut lanes[0];
    let buf = sess.buffer();
    sess.write(0, &[0xAB; 8192]).expect("fill");
    let e = |offset: u64, len: u64| Entry {
        op: Op::Encrypt,
        mode: Mode::Ctr,
        key: k.id,
        version: 0,
        buffer: buf,
        offset,
        len,
        iv: [0; 16],
        tag: [0; 16],
        aad_offset: 0,
        aad_len: 0,
        unit: 0,
        step: 0,
    };
    let cases = [
        (e(8192, 1), status::OUT_OF_BOUNDS),
        (e(8000, 193), status::OUT_OF_BOUNDS),
        (e(u64::MAX, 2), status::OUT_OF_BOUNDS),
        (e(1, u64::MAX), status::OUT_OF_BOUNDS),
        (
            Entry {
                buffer: buf + 1,
                ..e(0, 16)
            },
            status::OUT_OF_BOUNDS,
        ),
        (
            Entry {
                buffer: u32::MAX,
                ..e(0, 16)
            },
            status::OUT_OF_BOUNDS,
        ),
        (
            Entry {
                key: 9999,
                ..e(0, 16)
            },
            status::NO_KEY,
        ),
        (
            Entry {
                version: 7,
                ..e(0, 16)
            },
            status::NO_KEY,
        ),
        (
            Entry {
                mode: Mode::Xts,
                ..e(0, 16)
            },
            status::WRONG_MODE,
        ),
        (
            Entry {
                mode: Mode::Cbc,
                ..e(0, 15)
            },
            status::BAD_LENGTH,
        ),
        (
            Entry {
                mode: Mode::Gcm,
                aad_offset: 8190,
                aad_len: 3,
                ..e(0, 16)
            },
            status::OUT_OF_BOUNDS,
        ),
        // XTS unit and step fields (ring module doc): refused before the
        // key is looked at, so this AES key shows the field checks.
        (
            Entry {
                unit: 512,
                step: 1,
                ..e(0, 1024)
            },
            status::MALFORMED,
        ),
        (
            Entry {
                mode: Mode::Xts,
                unit: 512,
                step: 0,
                ..e(0, 1024)
            },
            status::MALFORMED,
        ),
        (
            Entry {
                mode: Mode::Xts,
                unit: 8,
                step: 1,
                ..e(0, 64)
            },
            status::BAD_LENGTH,
        ),
        (
            Entry {
                mode: Mode::Xts,
                unit: u32::MAX,
                step: u32::MAX,
                ..e(0, 8192)
            },
            status::BAD_LENGTH,
        ),
        (e(0, 8192), status::OK),
    ];
    let entries: Vec<Entry> = cases.iter().map(|(e, _)| *e).collect();
    let out = lane.run(&entries).expect("run");
    for (i, ((_, want), got)) in cases.iter().zip(&out).enumerate() {
        assert_eq!(
            got.status,
            *want,
            "case {i}: {}",
            status::describe(got.status)
        );
    }
    // Raw garbage in the lane: bad counts and bad op/mode bytes.
    assert!(lane.poke(ring::OFF_COUNT, &1000u32.to_le_bytes()));
    lane.kick().expect("kick");
    let out = lane.wait(1).expect("wait");
    assert_eq!(out[0].status, status::BAD_COUNT);
    assert!(lane.poke(ring::OFF_COUNT, &1u32.to_le_bytes()));
    assert!(lane.poke(ring::OFF_ENTRIES, &[9, 9, 9, 9]));
    lane.kick().expect("kick");
    assert_eq!(lane.wait(1).expect("wait")[0].status, status::MALFORMED);
    // The vault is alive and correct afterwards.
    let mut d = [1u8; 32];
    c.encrypt(&Crypt::new(k.id, Mode::Ecb), &mut d)
        .expect("enc");
    c.decrypt(&Crypt::new(k.id, Mode::Ecb), &mut d)
        .expect("dec");
    assert_eq!(d, [1u8; 32]);
}

#[test]
fn replies_never_carry_key_bytes() {
    let v = Vault::start();
    let key: Vec<u8> = (0..64u8)
        .map(|i| i.wrapping_mul(37).wrapping_add(11))
        .collect();
    let mut s = UnixStream::connect(&v.socket).expect("connect");
    let mut all = Vec::new();
    for (name, kind) in [
        ("k128", KeyKind::Aes128),
        ("k256", KeyKind::Aes256),
        ("x128", KeyKind::Xts128),
        ("x256", KeyKind::Xts256),
    ] {
        let kb = &key[..kind.key_len()];
        let mut f = proto::encode_request(&Request::ImportKey {
            name: name.into(),
            kind,
            persistent: false,
            key: kb,
        });
        f.extend_from_slice(kb);
        let (b, r) = raw_call(&mut s, &f);
        assert!(matches!(r, Reply::Key(_)), "{r:?}");
        all.push(b);
        for req in [
            Request::ListKeys,
            Request::Status,
            Request::KeyInfo { name: name.into() },
            Request::Grant {
                name: name.into(),
                uid: 5,
                perms: perm::ENCRYPT,
            },
            Request::RotateKey { name: name.into() },
            Request::KeyIdStatus,
            Request::KeyIdTenants,
        ] {
            all.push(raw_call(&mut s, &proto::encode_request(&req)).0);
        }
    }
    // Positive control: the search below finds key bytes where they are.
    let probe = |hay: &[u8]| key.windows(8).any(|w| hay.windows(8).any(|h| h == w));
    let mut control = b"reply".to_vec();
    control.extend_from_slice(&key[20..40]);
    assert!(probe(&control));
    for b in &all {
        assert!(!probe(b), "a reply holds 8 consecutive key bytes");
    }
    // No request tag exists that returns key material: everything outside
    // the known tags (up to 19, KeyIdTenants; 18, TenantKey, is refused
    // here for want of its KeyID, and tests/keyids.rs checks the host key
    // table's replies) is refused.
    for t in (18..=18).chain(20..=255u8) {
        let (_, r) = raw_call(&mut s, &[1, 0, 0, 0, t]);
        assert!(
            matches!(
                r,
                Reply::Error {
                    code: ErrorCode::Malformed,
                    ..
                }
            ),
            "tag {t}: {r:?}"
        );
    }
}

#[test]
fn acl_owner_grant_revoke_across_users() {
    if common::euid() != 0 {
        skip(Need::Root, "runs a client as nobody");
        return;
    }
    let v = Vault::start();
    let mut c = v.client();
    c.create_key("shared", KeyKind::Aes256, false)
        .expect("create");
    let input = v.dir.join("in");
    std::fs::write(&input, b"secret payload").expect("write");
    std::fs::set_permissions(&v.dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let as_nobody = |verb: &[&str]| {
        let mut cmd = Command::new(NOBODY[0]);
        cmd.args(&NOBODY[1..])
            .arg(common::bin())
            .arg("--socket")
            .arg(&v.socket)
            .args(verb);
        cmd.output().expect("run")
    };
    let enc = [
        "encrypt",
        "--key",
        "shared",
        "--mode",
        "gcm",
        "-i",
        input.to_str().expect("utf8"),
    ];
    let out = as_nobody(&enc);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no key \"shared\" visible to uid 65534"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.grant("shared", 65534, perm::ENCRYPT).expect("grant");
    let out = as_nobody(&enc);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Encrypt only: no decrypt, no admin.
    let ct = v.dir.join("ct");
    std::fs::write(&ct, &out.stdout).expect("ct");
    let out = as_nobody(&[
        "decrypt",
        "--key",
        "shared",
        "-i",
        ct.to_str().expect("utf8"),
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("permission denied"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = as_nobody(&["destroy", "shared"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("may not destroy"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = as_nobody(&["list"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("shared"));
    // The owner decrypts what nobody encrypted.
    let out = Command::new(common::bin())
        .arg("--socket")
        .arg(&v.socket)
        .args([
            "decrypt",
            "--key",
            "shared",
            "-i",
            ct.to_str().expect("utf8"),
        ])
        .output()
        .expect("run");
    assert_eq!(out.stdout, b"secret payload");
    c.revoke("shared", 65534).expect("revoke");
    assert!(!as_nobody(&enc).status.success());
    let log = v.stderr();
    assert!(
        log.contains("audit op=grant uid=65534 perms=1 key=shared uid=0"),
        "{log}"
    );
    assert!(
        log.contains("audit op=destroy key=shared uid=65534") && log.contains("result=denied"),
        "{log}"
    );
}

#[test]
fn quotas_on_keys_and_lanes() {
    let v =
        Vault::start_with(Opts::default().arg("--max-keys=2").arg("--max-lanes=2")).expect("start");
    let mut c = v.client();
    c.create_key("a", KeyKind::Aes128, false).expect("a");
    c.create_key("b", KeyKind::Aes128, false).expect("b");
    let e = c
        .create_key("c", KeyKind::Aes128, false)
        .err()
        .expect("quota");
    assert!(
        matches!(
            e,
            ClientError::Refused {
                code: ErrorCode::Quota,
                ..
            }
        ),
        "{e}"
    );
    c.destroy_key("a").expect("destroy");
    c.create_key("c", KeyKind::Aes128, false)
        .expect("room again");
    let e = c
        .create_key("c", KeyKind::Aes128, false)
        .err()
        .expect("exists");
    assert!(
        matches!(
            e,
            ClientError::Refused {
                code: ErrorCode::Exists,
                ..
            }
        ),
        "{e}"
    );
    let _s = c.session(4096, 2).expect("two lanes");
    let e = c.session(4096, 1).err().expect("lane quota");
    assert!(
        matches!(
            e,
            ClientError::Refused {
                code: ErrorCode::Quota,
                ..
            }
        ),
        "{e}"
    );
    let e = c
        .create_key("p", KeyKind::Aes128, true)
        .err()
        .expect("no keystore");
    assert!(e.to_string().contains("--state"), "{e}");
}

#[test]
fn audit_line_per_key_operation_not_per_data_request() {
    let v = Vault::start();
    let mut c = v.client();
    let k = c.create_key("aud", KeyKind::Aes128, false).expect("create");
    c.rotate_key("aud").expect("rotate");
    let before = v.stderr().matches("audit ").count();
    for _ in 0..200 {
        let mut d = [0u8; 16];
        c.encrypt(&Crypt::new(k.id, Mode::Ecb), &mut d)
            .expect("enc");
    }
    assert_eq!(v.stderr().matches("audit ").count(), before);
    c.destroy_key("aud").expect("destroy");
    let log = v.stderr();
    let me = std::process::id();
    for op in ["create", "rotate", "destroy"] {
        assert!(
            log.contains(&format!("audit op={op} key=aud uid=0 pid={me}")),
            "{op}: {log}"
        );
    }
}

#[test]
fn ready_notification_over_notify_socket() {
    let dir = common::scratch_dir("notify");
    let ns = dir.join("notify.sock");
    let rx = UnixDatagram::bind(&ns).expect("bind");
    rx.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let v = Vault::start_with(Opts::default().env("NOTIFY_SOCKET", ns.to_str().expect("utf8")))
        .expect("start");
    let mut b = [0u8; 256];
    let n = rx.recv(&mut b).expect("READY datagram");
    let msg = String::from_utf8_lossy(&b[..n]);
    assert!(
        msg.contains("READY=1") && msg.contains("STATUS=level="),
        "{msg}"
    );
    assert!(msg.contains(&format!("MAINPID={}", v.pid())), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cli_verbs_for_people() {
    let v = Vault::start();
    let run = |args: &[&str], stdin: &[u8]| {
        let mut ch = Command::new(common::bin())
            .arg("--socket")
            .arg(&v.socket)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        ch.stdin
            .take()
            .expect("stdin")
            .write_all(stdin)
            .expect("stdin");
        let o = ch.wait_with_output().expect("wait");
        (
            o.status.success(),
            o.stdout,
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (ok, out, _) = run(&["status"], b"");
    assert!(
        ok && String::from_utf8_lossy(&out).contains("protection level: "),
        "{}",
        String::from_utf8_lossy(&out)
    );
    assert!(run(&["create", "disk", "--kind", "xts256"], b"").0);
    let kf = v.dir.join("key.hex");
    std::fs::write(
        &kf,
        "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n",
    )
    .expect("kf");
    let (ok, out, err) = run(
        &[
            "import",
            "imp",
            "--kind",
            "aes256",
            "--key-file",
            kf.to_str().expect("utf8"),
        ],
        b"",
    );
    assert!(ok, "{err}");
    assert!(
        !String::from_utf8_lossy(&out).contains("0001020304"),
        "import echoed the key"
    );
    let (_, out, _) = run(&["list"], b"");
    let list = String::from_utf8_lossy(&out).into_owned();
    assert!(
        list.contains("disk\t") && list.contains("imp\t") && !list.contains("0001020304"),
        "{list}"
    );
    let msg: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    for (key, mode) in [
        ("imp", "ecb"),
        ("imp", "cbc"),
        ("imp", "ctr"),
        ("imp", "gcm"),
        ("disk", "xts"),
    ] {
        let (ok, ct, err) = run(&["encrypt", "--key", key, "--mode", mode], &msg);
        assert!(ok, "{mode}: {err}");
        assert_ne!(&ct[ct.len() - 100..], &msg[msg.len() - 100..]);
        let (ok, pt, err) = run(&["decrypt", "--key", key], &ct);
        assert!(ok, "{mode}: {err}");
        assert_eq!(pt, msg, "{mode}");
        if mode == "gcm" {
            let mut bad = ct.clone();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            let (ok, _, err) = run(&["decrypt", "--key", key], &bad);
            assert!(!ok && err.contains("GCM authentication failed"), "{err}");
        }
    }
    let (ok, ct, _) = run(&["encrypt", "--key", "imp"], b"before rotation");
    assert!(ok);
    assert!(run(&["rotate", "imp"], b"").0);
    let (ok, pt, err) = run(&["decrypt", "--key", "imp"], &ct);
    assert!(ok && pt == b"before rotation", "{err}");
    assert!(run(&["destroy", "imp"], b"").0);
    let (ok, _, err) = run(&["decrypt", "--key", "imp"], &ct);
    assert!(!ok && err.contains("no key"), "{err}");
    let (ok, _, err) = run(
        &["decrypt", "--key", "disk"],
        b"not a ciphertext at all, no header here",
    );
    assert!(!ok && err.contains("bad header"), "{err}");
}

/// Every readable mapping of a process, via /proc/PID/maps and /proc/PID/mem.
fn readable_memory(pid: u32) -> Vec<u8> {
    use std::io::{Seek as _, SeekFrom};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("mem");
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        if !perms.starts_with('r') || line.contains("[vvar") || line.contains("[vsyscall") {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (a, b) = (
            u64::from_str_radix(a, 16).expect("hex"),
            u64::from_str_radix(b, 16).expect("hex"),
        );
        let mut buf = vec![0u8; usize::try_from(b - a).expect("len")];
        if mem.seek(SeekFrom::Start(a)).is_ok() && mem.read_exact(&mut buf).is_ok() {
            out.extend_from_slice(&buf);
            continue;
        }
        // Part of the range went away meanwhile (another test thread
        // unmapping next to it): keep every page that still reads, so a
        // neighbour's munmap cannot hide this range (seen once: the positive
        // control missed the key on the test thread's own stack).
        for (i, page) in buf.chunks_mut(4096).enumerate() {
            let at = a + 4096 * i as u64;
            if mem.seek(SeekFrom::Start(at)).is_ok() && mem.read_exact(page).is_ok() {
                out.extend_from_slice(page);
            }
        }
    }
    out
}

/// Regression: `memveil_cipher::Gcm` boxes its state on the heap, which put
/// the AES schedule (whose first round keys are the raw key) in readable
/// memory; the vault now uses its own inline GCM in secret memory.
#[test]
fn raw_key_bytes_are_not_in_the_vaults_readable_memory() {
    if common::euid() != 0 {
        skip(
            Need::Root,
            "reading /proc/PID/mem of a non-dumpable process needs root",
        );
        return;
    }
    let dir = common::scratch_dir("rawkey");
    let mut key = [0u8; 32];
    memveil_sys::getrandom(&mut key).expect("random");
    let kf = dir.join("kek");
    std::fs::write(&kf, key).expect("kek");
    let opts = Opts::default()
        .dir(&dir)
        .arg("--state")
        .arg(dir.join("st").to_str().expect("utf8"))
        .arg("--key-file")
        .arg(kf.to_str().expect("utf8"));
    let v = Vault::start_with(opts).expect("start");
    let mut c = v.client();
    let k = c
        .import_key("p", KeyKind::Aes256, true, &key)
        .expect("import");
    let x = c
        .import_key("x", KeyKind::Xts128, false, &key)
        .expect("import");
    for (id, mode) in [
        (k.id, Mode::Gcm),
        (k.id, Mode::Cbc),
        (k.id, Mode::Ctr),
        (x.id, Mode::Xts),
    ] {
        let mut d = vec![5u8; 4096];
        let t = c.encrypt(&Crypt::new(id, mode), &mut d).expect("enc");
        c.decrypt(&Crypt::new(id, mode).tag(&t), &mut d)
            .expect("dec");
    }
    let found = |hay: &[u8]| hay.windows(16).any(|w| w == &key[..16] || w == &key[16..]);
    // Positive control: the same search finds the key in this process.
    assert!(
        found(&readable_memory(std::process::id())),
        "control: key not found in the test process"
    );
    let vault_mem = readable_memory(v.pid());
    assert!(
        vault_mem.len() > 1 << 20,
        "read only {} bytes of the vault",
        vault_mem.len()
    );
    assert!(
        !found(&vault_mem),
        "raw key bytes in the vault's readable memory"
    );
    drop(c);
    drop(v);
    let _ = std::fs::remove_dir_all(&dir);
}
