//! Regression: `cpu_entropy` passed each RDRAND key word through an ordinary
//! stack copy (`w.to_le_bytes()`), left behind on the stack of whatever
//! thread programmed a key once the call returned. The stack below the
//! caller is read back through /proc/self/mem and searched for the words.

use std::hint::black_box;
use std::os::unix::fs::FileExt as _;

use memveil_engine::cpu_entropy;
use memveil_testkit::{skip, Need};

/// Calls `f` with 32 KiB of this thread's stack in use above it, so that
/// its frames lie far below those of the code that reads the stack later.
#[inline(never)]
fn deep<R>(f: impl FnOnce() -> R) -> R {
    let pad = [0u8; 32 << 10];
    black_box(&pad);
    let r = f();
    black_box(&pad);
    r
}

/// This thread's stack from 256 KiB below the caller's frame up to 8 KiB
/// below it (where `deep`'s callee ran; above: the reader's own frames).
#[inline(never)]
fn stack_below_here() -> Vec<u8> {
    let here = 0u8;
    let sp = std::ptr::addr_of!(here) as u64;
    let mem = std::fs::File::open("/proc/self/mem").expect("open /proc/self/mem");
    let mut img = vec![0u8; (256 - 8) << 10];
    mem.read_exact_at(&mut img, sp - (256 << 10))
        .expect("read this thread's stack");
    img
}

fn words_in(stack: &[u8], key: &[u8]) -> usize {
    key.chunks_exact(8)
        .filter(|w| stack.windows(8).any(|s| s == *w))
        .count()
}

#[test]
fn rdrand_key_words_leave_no_copy_on_the_stack() {
    if !memveil_sys::has_feature(memveil_sys::CpuFeature::Rdrand) {
        skip(
            Need::Cpu("RDRAND"),
            "cpu_entropy takes getrandom's path, writing in place",
        );
        return;
    }
    std::thread::Builder::new()
        .stack_size(1 << 20)
        .spawn(|| {
            // Positive control: a word kept in a stack buffer by the same
            // kind of call is found by the same search.
            let planted = 0x5eed_c0de_0bad_f00d_u64.to_le_bytes();
            deep(|| {
                let copy = [planted; 4];
                black_box(&copy);
            });
            assert_eq!(
                words_in(&stack_below_here(), &planted),
                1,
                "positive control: a word left on the stack was not found"
            );

            let mut key = vec![0u8; 64];
            deep(|| cpu_entropy(&mut key)).expect("RDRAND");
            let left = words_in(&stack_below_here(), &key);
            assert_eq!(
                left, 0,
                "{left} of the 8 RDRAND key words are still on the stack after cpu_entropy returned"
            );
        })
        .expect("thread")
        .join()
        .expect("test thread");
}
