//! Ring-descriptor parsing and the buffer bounds checks on arbitrary input:
//! the first bytes register buffers in an area, the rest are 128-byte
//! entries; every span the checker accepts lies inside one registered
//! buffer, which lies inside the area; an accepted XTS data-unit size
//! divides the length into whole units.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memveil_vault::ring::{self, Buffers, Entry, ENTRY_BYTES};

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 + 4 * 16 {
        return;
    }
    let area_len = usize::try_from(u64_at(data, 0) % (1 << 30))
        .unwrap_or(0)
        .max(1);
    let mut bufs = Buffers::default();
    let mut regs = Vec::new();
    for i in 0..4 {
        let (s, l) = (u64_at(data, 8 + 16 * i), u64_at(data, 16 + 16 * i));
        let (s, l) = if i % 2 == 0 {
            (s % (1 << 31), l % (1 << 31))
        } else {
            (s, l)
        };
        if let Ok(id) = bufs.register(0, area_len, s, l) {
            regs.push((
                id,
                usize::try_from(s).unwrap_or(0),
                usize::try_from(l).unwrap_or(0),
            ));
        }
    }
    let _ = ring::check_lane(area_len, u64_at(data, 8));
    let _ = ring::check_count(u32::try_from(u64_at(data, 16) & 0xFFFF_FFFF).unwrap_or(0));
    for chunk in data[72..].chunks_exact(ENTRY_BYTES) {
        let mut raw = [0u8; ENTRY_BYTES];
        raw.copy_from_slice(chunk);
        let Ok(e) = Entry::parse(&raw) else { continue };
        // An accepted XTS data-unit size describes whole units of 16 bytes
        // or more, with a step (ring module doc).
        if e.check_length().is_ok() && e.unit != 0 {
            assert!(e.unit >= 16 && e.step >= 1 && e.len > 0);
            assert_eq!(e.len % u64::from(e.unit), 0);
        }
        assert_eq!(Entry::parse(&e.encode()), Ok(e));
        for (off, len) in [(e.offset, e.len), (e.aad_offset, e.aad_len)] {
            if let Ok(span) = bufs.check(e.buffer, off, len) {
                let &(_, bs, bl) = regs.iter().find(|r| r.0 == e.buffer).expect("registered");
                assert!(span.start >= bs && span.start + span.len <= bs + bl);
                assert!(span.start + span.len <= area_len);
            }
        }
    }
});
