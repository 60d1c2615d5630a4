//! Sectors and tweaks of dm-crypt's `aes-xts-plain64`, sans-IO.
//!
//! dm-crypt encrypts each sector as one XTS data unit. Its `plain64` IV
//! generator gives the sector number as a 64-bit little-endian integer in the
//! first 8 bytes of the 16-byte tweak, the rest zero. The sector number
//! counts 512-byte sectors whatever the encryption sector size, unless the
//! mapping was made with `iv_large_sectors` (cryptsetup
//! `--iv-large-sectors`), when it counts sectors of the encryption size.
//! There is no offset or skip: sector 0 of the image is sector 0 of the
//! device (cryptsetup plain mode's defaults, `--offset 0 --skip 0`).

/// How an image is cut into sectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes of one encryption sector: 512 or 4096.
    pub sector_size: u32,
    /// Tweaks count sectors of `sector_size` rather than of 512 bytes.
    pub iv_large_sectors: bool,
    /// Bytes of the image (a whole number of sectors).
    pub size: u64,
}

/// The sector sizes dm-crypt and this server accept.
pub const SECTOR_SIZES: [u32; 2] = [512, 4096];

impl Geometry {
    /// Checks the sector size and that `size` is a whole number of sectors.
    ///
    /// # Errors
    /// A sentence saying what is wrong.
    pub fn new(sector_size: u32, iv_large_sectors: bool, size: u64) -> Result<Self, String> {
        if !SECTOR_SIZES.contains(&sector_size) {
            return Err(format!(
                "sector size {sector_size} is not supported: 512 (default) or 4096"
            ));
        }
        if size == 0 || !size.is_multiple_of(u64::from(sector_size)) {
            return Err(format!(
                "image size {size} is not a positive multiple of the {sector_size}-byte sector"
            ));
        }
        Ok(Self {
            sector_size,
            iv_large_sectors,
            size,
        })
    }

    /// Bytes of a sector as `usize`.
    #[must_use]
    pub fn ss(&self) -> usize {
        self.sector_size as usize
    }

    /// The `plain64` tweak of the sector that starts at byte `offset` (a
    /// multiple of the sector size).
    #[must_use]
    pub fn tweak_at(&self, offset: u64) -> [u8; 16] {
        let n = if self.iv_large_sectors {
            offset / u64::from(self.sector_size)
        } else {
            offset / 512
        };
        plain64(n)
    }

    /// How far the `plain64` sector number moves from one sector to the
    /// next: a sector is `sector_size / 512` sectors of 512 bytes, or one
    /// with `iv_large_sectors`. The XTS sequence-number step of a vault
    /// entry that carries a run of sectors.
    #[must_use]
    pub fn tweak_step(&self) -> u32 {
        if self.iv_large_sectors {
            1
        } else {
            self.sector_size / 512
        }
    }

    /// The sector-aligned range `[start, end)` that covers `len` bytes at
    /// `offset`, clipped to the image; `None` when nothing of it is inside.
    #[must_use]
    pub fn cover(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
        let end = offset.checked_add(len)?.min(self.size);
        if offset >= end {
            return None;
        }
        let ss = u64::from(self.sector_size);
        let start = offset - offset % ss;
        let end = end.div_ceil(ss) * ss;
        Some((start, end.min(self.size)))
    }

    /// Whether `[offset, offset+len)` is whole sectors.
    #[must_use]
    pub fn aligned(&self, offset: u64, len: u64) -> bool {
        let ss = u64::from(self.sector_size);
        offset.is_multiple_of(ss) && len.is_multiple_of(ss)
    }
}

/// dm-crypt's `plain64` IV for sector `n`.
#[must_use]
pub fn plain64(n: u64) -> [u8; 16] {
    let mut iv = [0u8; 16];
    iv[..8].copy_from_slice(&n.to_le_bytes());
    iv
}

/// The tweak of the key check value: all ones, which `plain64` never gives
/// (its upper 8 bytes are always zero), so the check block is never the
/// encryption of any sector of any image.
pub const CHECK_TWEAK: [u8; 16] = [0xFF; 16];

/// Bytes encrypted for the key check value (zeros).
pub const CHECK_BYTES: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tweaks_count_512_byte_sectors_unless_large() {
        let g = Geometry::new(4096, false, 1 << 20).expect("ok");
        assert_eq!(g.tweak_at(4096), plain64(8));
        let g = Geometry::new(4096, true, 1 << 20).expect("ok");
        assert_eq!(g.tweak_at(4096), plain64(1));
        let g = Geometry::new(512, false, 1 << 20).expect("ok");
        assert_eq!(g.tweak_at(512 * 300), plain64(300));
        assert_eq!(
            plain64(0x0102_0304_0506_0708),
            [8, 7, 6, 5, 4, 3, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn the_tweak_step_is_the_distance_between_sector_tweaks() {
        for ss in SECTOR_SIZES {
            for large in [false, true] {
                let g = Geometry::new(ss, large, 1 << 20).expect("ok");
                for sector in [0u64, 1, 77, 255] {
                    let at = sector * u64::from(ss);
                    let a = u128::from_le_bytes(g.tweak_at(at));
                    let b = u128::from_le_bytes(g.tweak_at(at + u64::from(ss)));
                    assert_eq!(b - a, u128::from(g.tweak_step()), "{ss} {large}");
                }
            }
        }
    }

    #[test]
    fn bad_geometries_are_refused() {
        assert!(Geometry::new(1024, false, 1 << 20).is_err());
        assert!(Geometry::new(4096, false, 4096 * 3 + 512).is_err());
        assert!(Geometry::new(512, false, 0).is_err());
    }

    proptest! {
        #[test]
        fn cover_is_aligned_inside_and_covers(
            ss in prop::sample::select(SECTOR_SIZES.to_vec()),
            sectors in 1u64..10_000,
            offset in 0u64..6_000_000,
            len in 0u64..3_000_000,
        ) {
            let g = Geometry::new(ss, false, sectors * u64::from(ss)).expect("ok");
            match g.cover(offset, len) {
                None => prop_assert!(len == 0 || offset >= g.size),
                Some((s, e)) => {
                    prop_assert!(g.aligned(s, e - s));
                    prop_assert!(s <= offset && e <= g.size && s < e);
                    prop_assert!(e >= (offset + len).min(g.size));
                    prop_assert!(offset - s < u64::from(ss));
                }
            }
        }
    }
}
