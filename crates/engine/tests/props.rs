//! Property tests: the engine behaves as plain memory per KeyID, whatever the
//! cache does, and KeyIDs are isolated.

use memveil_engine::{Algorithm, Config, Engine, EngineError, KeyProgram, Mode, PAGE};
use memveil_secmem::{Level, Policy};
use proptest::prelude::*;

const FRAMES: usize = 16;

fn engine(cache_pages: usize) -> Engine {
    let e = Engine::new(Config {
        frames: FRAMES,
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

#[derive(Debug, Clone)]
enum Op {
    Write {
        off: usize,
        data: Vec<u8>,
    },
    Read {
        off: usize,
        len: usize,
    },
    Flush,
    /// Zero-copy: page `dst` = page `a` + page `b` (bytewise), in place;
    /// as runs of `run` pages when `run` > 1.
    Combine {
        dst: usize,
        a: usize,
        b: usize,
        run: usize,
    },
}

fn op(limit: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..limit, prop::collection::vec(any::<u8>(), 1..3 * PAGE))
            .prop_map(move |(off, data)| { let off = off.min(limit - data.len().min(limit)); Op::Write { off, data } }),
        4 => (0..limit, 1usize..3 * PAGE).prop_map(move |(off, len)| Op::Read { off: off.min(limit - len.min(limit)), len: len.min(limit) }),
        1 => Just(Op::Flush),
        3 => (0..limit / PAGE, 0..limit / PAGE, 0..limit / PAGE, 1usize..3).prop_map(|(dst, a, b, run)| Op::Combine { dst, a, b, run }),
    ]
}

/// Lent pages `dst` = `a` + `b` (bytewise), checked against and applied to
/// the model (`known` marks the bytes the model knows).
fn combine(
    model: &mut [u8],
    known: &mut [bool],
    [a, b, dst]: [usize; 3],
    [pa, pb]: [&[u8]; 2],
    pd: &mut [u8],
) -> Result<(), TestCaseError> {
    for i in 0..pd.len() {
        pd[i] = pa[i].wrapping_add(pb[i]);
        let (ia, ib, id) = (a * PAGE + i, b * PAGE + i, dst * PAGE + i);
        if known[ia] && known[ib] {
            prop_assert_eq!(pa[i], model[ia]);
            prop_assert_eq!(pb[i], model[ib]);
            model[id] = model[ia].wrapping_add(model[ib]);
            known[id] = true;
        } else {
            known[id] = false;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// One KeyID over half the frames, two KeyIDs interleaved on their own halves:
    /// each must read back exactly what a plain byte array would.
    #[test]
    fn engine_matches_plain_memory_per_keyid(
        cache in 1usize..9,
        ops in prop::collection::vec((any::<bool>(), op(FRAMES / 2 * PAGE)), 1..40),
    ) {
        let e = engine(cache);
        let half = FRAMES / 2 * PAGE;
        let mut model = [vec![0u8; half], vec![0u8; half]];
        let mut written = [vec![false; half], vec![false; half]];
        for (second, op) in ops {
            let (k, base) = if second { (2u16, half) } else { (1u16, 0) };
            let m = &mut model[usize::from(second)];
            let w = &mut written[usize::from(second)];
            match op {
                Op::Write { off, data } => {
                    let n = data.len().min(half - off);
                    e.write(e.address((base + off) as u64, k, true), &data[..n]).expect("write");
                    m[off..off + n].copy_from_slice(&data[..n]);
                    w[off..off + n].iter_mut().for_each(|x| *x = true);
                }
                Op::Read { off, len } => {
                    let n = len.min(half - off);
                    let mut b = vec![0u8; n];
                    e.read(e.address((base + off) as u64, k, true), &mut b).expect("read");
                    for i in 0..n {
                        // Never-written bytes are whatever the key makes of zeroed
                        // DRAM; written ones must match exactly.
                        if w[off + i] {
                            prop_assert_eq!(b[i], m[off + i], "KeyID {} offset {}", k, off + i);
                        }
                    }
                }
                Op::Flush => e.flush(),
                Op::Combine { dst, a, b, run } if run > 1 => {
                    let pages = half / PAGE;
                    if dst + run > pages || a + run > pages || b + run > pages {
                        continue;
                    }
                    let at = |p: usize| e.address((base + p * PAGE) as u64, k, true);
                    let r = e.runs([at(a), at(b)], [at(dst)], run);
                    let frames = |p: usize| (base / PAGE + p)..(base / PAGE + p + run);
                    let share = |x: usize, y: usize| frames(x).any(|f| frames(y).contains(&f));
                    let slots = |p: usize| {
                        let s0 = (base / PAGE + p) % cache;
                        s0..s0 + run
                    };
                    let clash = |x: usize, y: usize| slots(x).any(|s| slots(y).contains(&s));
                    let past = [a, b, dst].iter().any(|&p| slots(p).end > cache);
                    let dup = share(a, b) || share(a, dst) || share(b, dst);
                    let over = clash(a, b) || clash(a, dst) || clash(b, dst);
                    if 3 * run > cache || dup || past || over {
                        prop_assert!(r.is_err(), "runs should be refused");
                        continue;
                    }
                    let mut g = r.expect("runs");
                    let ([pa, pb], [pd]) = g.split();
                    combine(m, w, [a, b, dst], [pa, pb], pd)?;
                }
                Op::Combine { dst, a, b, .. } => {
                    let at = |p: usize| e.address((base + p * PAGE) as u64, k, true);
                    let r = e.pages([at(a), at(b)], [at(dst)]);
                    if cache < 3 {
                        prop_assert!(matches!(r, Err(EngineError::TooManyPages { .. })), "{:?}", r.err());
                        continue;
                    }
                    if dst == a || dst == b || a == b {
                        prop_assert!(matches!(r, Err(EngineError::SameFrameTwice { .. })), "{:?}", r.err());
                        continue;
                    }
                    let mut g = r.expect("pages");
                    let ([pa, pb], [pd]) = g.split();
                    combine(m, w, [a, b, dst], [pa, pb], pd)?;
                }
            }
        }
    }

    /// Data written under one KeyID never reads back through another.
    #[test]
    fn other_keyid_never_reads_the_data(
        frame in 0usize..FRAMES,
        data in prop::collection::vec(any::<u8>(), 16..PAGE),
        flush in any::<bool>(),
    ) {
        let e = engine(2);
        let phys = (frame * PAGE) as u64;
        e.write(e.address(phys, 1, true), &data).expect("write");
        if flush {
            e.flush();
        }
        for k in [0u16, 2] {
            let mut b = vec![0u8; data.len()];
            e.read(e.address(phys, k, true), &mut b).expect("read");
            prop_assert_ne!(&b, &data);
        }
        let mut b = vec![0u8; data.len()];
        e.read(e.address(phys, 1, true), &mut b).expect("read");
        prop_assert_eq!(b, data);
    }
}
