//! `read_process` on a mapping some of whose pages cannot be read: only
//! those pages are skipped (and counted), the rest of the mapping is read,
//! and a key schedule in it is found. Before, one failing page made the
//! whole mapping "unreadable" and nothing of it was scanned.

use std::os::fd::AsFd as _;
use std::os::unix::fs::FileExt as _;

use memveil_keyfind::{expand, read_process, scan_image};
use memveil_sys::{Mapping, Protection};

#[test]
fn pages_past_the_end_of_a_mapped_file_are_skipped_and_the_page_before_is_scanned() {
    let ps = memveil_sys::page_size();
    let path = std::env::temp_dir().join(format!("keyfind-holes-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("temp file");
    let _ = std::fs::remove_file(&path);
    file.set_len(4 * ps as u64).expect("size");
    let mut key = [0u8; 16];
    memveil_sys::getrandom(&mut key).expect("random key");
    let schedule = expand(&key).expect("AES-128 schedule");
    file.write_all_at(&schedule, 64)
        .expect("plant the schedule");
    drop(schedule);
    let mut map = Mapping::anonymous(4 * ps, Protection::None).expect("reserve");
    map.map_fd_at(0, 4 * ps, file.as_fd())
        .expect("map the file");
    // Pages 1..4 of the mapping now lie past the end of the file: touching
    // them raises SIGBUS, reading them through /proc/PID/mem gives EIO.
    file.set_len(ps as u64).expect("truncate");
    let start = map.as_ptr() as u64;
    let (ps, end) = (ps as u64, start + 4 * ps as u64);

    let img = read_process(std::process::id()).expect("read own memory");
    let found: Vec<u64> = scan_image(&img, 0)
        .into_iter()
        .filter(|f| f.key == key)
        .map(|f| f.address)
        .collect();
    assert!(
        found.contains(&(start + 64)),
        "the schedule in the readable first page of the mapping at {start:#x} was not found (found at {found:x?})"
    );
    let holes: Vec<(u64, u64)> = img
        .unreadable
        .iter()
        .filter(|u| u.0 >= start && u.0 < end)
        .map(|u| (u.0 - start, u.1))
        .collect();
    assert_eq!(
        holes,
        [(ps, 3 * ps)],
        "exactly the three pages past the end of the file are skipped"
    );
    assert!(img.skipped_bytes() >= 3 * ps);
    drop(map);
}
