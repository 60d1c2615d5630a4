//! Zero-copy access to cached pages (`Engine::pages`): the same bytes as the
//! read/write interface, in place, pinned while lent, written back only when
//! written, and every misuse an error.

use memveil_engine::{Algorithm, Config, Engine, EngineError, KeyProgram, Mode, PAGE};
use memveil_secmem::{Level, Policy};

fn engine(frames: usize, cache_pages: usize) -> Engine {
    let e = Engine::new(Config {
        frames,
        cache_pages,
        mode: Mode::Tsme,
        policy: Policy::allow(Level::Locked),
        ..Config::default()
    })
    .expect("engine");
    for k in 1..=2u16 {
        e.program(&KeyProgram::random(k, Algorithm::AesXts128, &[], &[]))
            .expect("key");
    }
    e
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..PAGE)
        .map(|i| u8::try_from(i % 253).unwrap_or(0) ^ seed)
        .collect()
}

#[test]
fn lent_pages_are_the_bytes_read_and_write_see() {
    let e = engine(16, 4);
    let at = |f: usize| e.address((f * PAGE) as u64, 1, true);
    e.write(at(3), &pattern(1)).expect("write");
    assert_eq!(&e.page(at(3)).expect("page").bytes()[..], &pattern(1)[..]);
    {
        let mut p = e.page_mut(at(5)).expect("page");
        p.bytes_mut().copy_from_slice(&pattern(2));
    }
    let mut back = vec![0u8; PAGE];
    e.read(at(5), &mut back).expect("read");
    assert_eq!(back, pattern(2));
    // Out of the cache, the page is ciphertext in DRAM and still the data.
    e.flush();
    assert_ne!(e.dram_frame(5).expect("frame"), pattern(2));
    assert_eq!(&e.page(at(5)).expect("page").bytes()[..], &pattern(2)[..]);
}

#[test]
fn pages_stay_pinned_while_the_others_are_brought_in() {
    // A cache of exactly three pages, full of other dirty pages: bringing in
    // three new ones must evict the old ones, never each other.
    let e = engine(16, 3);
    let at = |f: usize| e.address((f * PAGE) as u64, 1, true);
    for (f, seed) in [(0, 10u8), (1, 11), (2, 12)] {
        e.write(at(f), &pattern(seed)).expect("write");
    }
    e.flush();
    for f in 7..10 {
        e.write(at(f), &pattern(0x70)).expect("dirty");
    }
    let mut g = e.pages([at(0), at(1)], [at(2)]).expect("pages");
    let ([a, b], [c]) = g.split();
    assert_eq!(&a[..], &pattern(10)[..]);
    assert_eq!(&b[..], &pattern(11)[..]);
    assert_eq!(&c[..], &pattern(12)[..]);
    for i in 0..PAGE {
        c[i] = a[i] ^ b[i];
    }
    drop(g);
    let want: Vec<u8> = pattern(10)
        .iter()
        .zip(pattern(11))
        .map(|(x, y)| x ^ y)
        .collect();
    e.flush();
    let mut back = vec![0u8; PAGE];
    e.read(at(2), &mut back).expect("read");
    assert_eq!(back, want);
    for f in 7..10 {
        e.read(at(f), &mut back).expect("read");
        assert_eq!(back, pattern(0x70), "evicted dirty page {f} written back");
    }
}

#[test]
fn read_pages_are_not_written_back() {
    let e = engine(16, 4);
    let at = |f: usize| e.address((f * PAGE) as u64, 1, true);
    e.write(at(1), &pattern(3)).expect("write");
    e.flush();
    let before = e.stats().writebacks;
    {
        let g = e.page(at(1)).expect("page");
        assert_eq!(g.bytes()[7], pattern(3)[7]);
    }
    e.flush();
    assert_eq!(
        e.stats().writebacks,
        before,
        "a page only read is not dirty"
    );
    {
        let mut g = e.page_mut(at(1)).expect("page");
        g.bytes_mut()[0] ^= 1;
    }
    e.flush();
    assert_eq!(
        e.stats().writebacks,
        before + 1,
        "a page lent for writing is"
    );
}

#[test]
fn misuse_is_an_error_not_a_panic() {
    let e = engine(8, 2);
    let at = |f: usize, k: u16| e.address((f * PAGE) as u64, k, true);
    assert!(matches!(
        e.page(at(1, 1) + 8).err(),
        Some(EngineError::Unaligned { .. })
    ));
    assert!(matches!(
        e.pages([at(1, 1)], [at(1, 1)]).err(),
        Some(EngineError::SameFrameTwice { frame: 1 })
    ));
    // The same frame through two KeyIDs is the same frame.
    assert!(matches!(
        e.pages([at(1, 1), at(1, 2)], []).err(),
        Some(EngineError::SameFrameTwice { frame: 1 })
    ));
    assert!(matches!(
        e.pages([at(1, 1), at(2, 1)], [at(3, 1)]).err(),
        Some(EngineError::TooManyPages { asked: 3, cache: 2 })
    ));
    assert!(matches!(
        e.page(at(8, 1)).err(),
        Some(EngineError::AddressOutOfRange { .. })
    ));
    assert!(e.pages([at(0, 1), at(1, 1)], []).is_ok());
}

#[test]
fn other_keyid_lends_garbage_as_read_does() {
    let e = engine(8, 4);
    let at = |f: usize, k: u16| e.address((f * PAGE) as u64, k, true);
    e.write(at(2, 1), &pattern(9)).expect("write");
    let seen = e.page(at(2, 2)).expect("page").bytes().to_vec();
    assert_ne!(seen, pattern(9));
    assert!(e.stats().alias_flushes >= 1);
    assert_eq!(
        &e.page(at(2, 1)).expect("page").bytes()[..],
        &pattern(9)[..]
    );
}

#[test]
fn domains_lend_only_their_own_pages() {
    let e = engine(8, 4);
    #[allow(clippy::single_range_in_vec_init)] // one range of frames
    let vm = e.domain("vm", &[1], &[0..4]);
    let mine = vm.address(1, 0, 1);
    vm.pages([], [mine]).expect("own page").split().1[0][0] = 42;
    assert!(matches!(
        vm.pages([vm.address(5, 0, 1)], []).err(),
        Some(EngineError::FrameNotMapped { frame: 5, .. })
    ));
    assert!(matches!(
        vm.pages([vm.address(1, 0, 2)], []).err(),
        Some(EngineError::KeyIdNotPermitted { keyid: 2, .. })
    ));
    let mut b = [0u8; 1];
    vm.read(mine, &mut b).expect("read");
    assert_eq!(b[0], 42);
}

fn run_pattern(frames: std::ops::Range<usize>, seed: u8) -> Vec<u8> {
    frames
        .flat_map(|f| pattern(seed ^ u8::try_from(f).unwrap_or(0)))
        .collect()
}

#[test]
fn runs_lend_contiguous_plaintext() {
    let e = engine(64, 32);
    let at = |f: usize| e.address((f * PAGE) as u64, 1, true);
    for f in 0..8 {
        e.write(at(f), &pattern(3 ^ u8::try_from(f).unwrap_or(0)))
            .expect("write");
    }
    {
        let mut g = e.runs([at(0)], [at(16)], 8).expect("runs");
        let ([src], [dst]) = g.split();
        assert_eq!(src.len(), 8 * PAGE);
        assert_eq!(src, &run_pattern(0..8, 3)[..]);
        for (d, s) in dst.iter_mut().zip(src.iter()) {
            *d = s.wrapping_add(1);
        }
    }
    e.flush();
    let mut back = vec![0u8; 8 * PAGE];
    e.read(at(16), &mut back).expect("read");
    let want: Vec<u8> = run_pattern(0..8, 3)
        .iter()
        .map(|b| b.wrapping_add(1))
        .collect();
    assert_eq!(back, want);
}

#[test]
fn runs_move_pages_that_sit_elsewhere_and_keep_what_they_displace() {
    // An 8-page cache full of dirty pages, then frame 20 brought in: it
    // lands wherever the clock evicted, not at its home (20 mod 8 = 4). A
    // run over frames 18..22 must move it home, and every page it
    // displaces must keep its data.
    let e = engine(64, 8);
    let at = |f: usize| e.address((f * PAGE) as u64, 1, true);
    for f in (8..16).chain(18..22) {
        e.write(at(f), &pattern(u8::try_from(f).unwrap_or(0)))
            .expect("write");
    }
    for f in 8..16 {
        e.write(at(f), &pattern(0x80 ^ u8::try_from(f).unwrap_or(0)))
            .expect("dirty");
    }
    let mut b = [0u8; 16];
    e.read(at(20), &mut b).expect("read");
    {
        let mut g = e.runs([at(18)], [], 4).expect("runs");
        let ([run], []) = g.split();
        for (i, f) in (18..22).enumerate() {
            assert_eq!(
                &run[i * PAGE..(i + 1) * PAGE],
                &pattern(u8::try_from(f).unwrap_or(0))[..],
                "frame {f}"
            );
        }
    }
    e.flush();
    let mut page = vec![0u8; PAGE];
    for f in 8..16 {
        e.read(at(f), &mut page).expect("read");
        assert_eq!(
            page,
            pattern(0x80 ^ u8::try_from(f).unwrap_or(0)),
            "frame {f}"
        );
    }
    for f in 18..22 {
        e.read(at(f), &mut page).expect("read");
        assert_eq!(page, pattern(u8::try_from(f).unwrap_or(0)), "frame {f}");
    }
}

#[test]
fn runs_that_cannot_have_their_own_slots_are_errors() {
    let e = engine(64, 16);
    let at = |f: usize| e.address((f * PAGE) as u64, 1, true);
    assert!(matches!(
        e.runs([at(0), at(2)], [], 4).err(),
        Some(EngineError::SameFrameTwice { frame: 2 })
    ));
    // Frames 0..4 and 16..20 share slots 0..4 (16 mod 16 = 0).
    assert!(matches!(
        e.runs([at(0)], [at(16)], 4).err(),
        Some(EngineError::RunsOverlap { a: 0, b: 16, .. })
    ));
    assert!(matches!(
        e.runs([at(14)], [], 4).err(),
        Some(EngineError::RunPastEnd { frame: 14, .. })
    ));
    assert!(matches!(
        e.runs([at(0), at(4)], [at(8)], 6).err(),
        Some(EngineError::TooManyPages {
            asked: 18,
            cache: 16
        })
    ));
    assert!(matches!(
        e.runs([at(62)], [], 4).err(),
        Some(EngineError::AddressOutOfRange { .. })
    ));
    assert!(e.runs([at(0), at(4)], [at(8)], 4).is_ok());
}
