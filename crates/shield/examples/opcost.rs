//! Costs of the individual operations of the shield on this machine.
#![allow(
    clippy::unwrap_used,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]
use memveil_shield::PAGE;
use memveil_sys::uffd::{self, Uffd};
use std::time::Instant;

fn main() {
    let n = 2000;
    let f = Uffd::open().map_err(|e| e.syscall).unwrap();
    f.handshake(uffd::FEATURE_PAGEFAULT_FLAG_WP).unwrap();
    let a = uffd::map_anonymous_direct(n * PAGE).unwrap();
    let b = uffd::map_anonymous_direct(n * PAGE).unwrap();
    f.register(
        a as u64,
        (n * PAGE) as u64,
        uffd::MODE_MISSING | uffd::MODE_WP,
    )
    .unwrap();
    f.register(b as u64, (n * PAGE) as u64, uffd::MODE_MISSING)
        .unwrap();
    let src = vec![7u8; PAGE];
    let t = Instant::now();
    for i in 0..n {
        f.copy(a as u64 + (i * PAGE) as u64, &src).unwrap();
    }
    println!(
        "UFFDIO_COPY      {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    let t = Instant::now();
    for i in 0..n {
        f.move_pages(
            b as u64 + (i * PAGE) as u64,
            a as u64 + (i * PAGE) as u64,
            PAGE as u64,
            false,
        )
        .unwrap();
    }
    println!(
        "UFFDIO_MOVE      {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    // Runs of 32 pages in one call: the batched fault-in and eviction.
    let run = 32;
    let t = Instant::now();
    for i in (0..n - run).step_by(run) {
        f.move_pages(
            a as u64 + (i * PAGE) as u64,
            b as u64 + (i * PAGE) as u64,
            (run * PAGE) as u64,
            false,
        )
        .unwrap();
    }
    println!(
        "UFFDIO_MOVE x{run}  {:.2} us/page",
        t.elapsed().as_secs_f64() * 1e6 / (n - n % run - run) as f64
    );
    let t = Instant::now();
    for i in (0..n - run).step_by(run) {
        f.move_pages(
            b as u64 + (i * PAGE) as u64,
            a as u64 + (i * PAGE) as u64,
            (run * PAGE) as u64,
            false,
        )
        .unwrap();
    }
    println!(
        "UFFDIO_MOVE x{run}  {:.2} us/page (back)",
        t.elapsed().as_secs_f64() * 1e6 / (n - n % run - run) as f64
    );
    let zeros = vec![0u8; run * PAGE];
    let z = uffd::map_anonymous_direct(n * PAGE).unwrap();
    f.register(z as u64, (n * PAGE) as u64, uffd::MODE_MISSING)
        .unwrap();
    let t = Instant::now();
    for i in (0..n - run).step_by(run) {
        f.copy(z as u64 + (i * PAGE) as u64, &zeros).unwrap();
    }
    println!(
        "UFFDIO_COPY x{run}  {:.2} us/page (zeros)",
        t.elapsed().as_secs_f64() * 1e6 / (n - n % run - run) as f64
    );
    let pz = uffd::map_anonymous_direct(n * PAGE).unwrap();
    let t = Instant::now();
    for i in (0..n - run).step_by(run) {
        // SAFETY: our own mapping.
        unsafe { uffd::madvise_direct(pz.add(i * PAGE), run * PAGE, 23).unwrap() };
    }
    println!(
        "POPULATE_WRITE x{run} {:.2} us/page",
        t.elapsed().as_secs_f64() * 1e6 / (n - n % run - run) as f64
    );
    let t = Instant::now();
    for i in 0..n {
        // SAFETY: our own mapping.
        unsafe { uffd::madvise_direct(b.add(i * PAGE), PAGE, libc::MADV_DONTNEED).unwrap() };
    }
    println!(
        "DONTNEED 1 page  {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    for i in 0..n {
        f.copy(a as u64 + (i * PAGE) as u64, &src).unwrap();
    }
    let t = Instant::now();
    for i in 0..n {
        f.write_protect(a as u64 + (i * PAGE) as u64, PAGE as u64, true)
            .unwrap();
    }
    println!(
        "WP set           {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    let t = Instant::now();
    for i in 0..n {
        f.write_protect(a as u64 + (i * PAGE) as u64, PAGE as u64, false)
            .unwrap();
    }
    println!(
        "WP clear         {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    let c = uffd::map_anonymous_direct(n * PAGE).unwrap();
    let t = Instant::now();
    for i in 0..n {
        // SAFETY: our own mapping.
        unsafe { c.add(i * PAGE).write_volatile(1) };
    }
    println!(
        "first touch      {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    let t = Instant::now();
    for i in 0..n {
        // SAFETY: our own mapping.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), c.add(i * PAGE), PAGE) };
    }
    println!(
        "memcpy page      {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    let t = Instant::now();
    // SAFETY: our own mapping.
    unsafe { uffd::madvise_direct(c, n * PAGE, libc::MADV_DONTNEED).unwrap() };
    println!(
        "DONTNEED batch   {:.2} us/page",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    let k = memveil_cipher::Xts::new(&[1u8; 16], &[2u8; 16]).unwrap();
    let mut pg = vec![0u8; PAGE];
    let t = Instant::now();
    for i in 0..n {
        k.encrypt_unit(i as u128, &mut pg).unwrap();
    }
    println!(
        "XTS page         {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
}
