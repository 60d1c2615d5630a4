//! Stand-ins for the kernels on targets other than x86_64: no key object is
//! ever built for them (every path but the portable one is unsupported
//! there), so these types are uninhabited.

use crate::path::Path;

pub(crate) enum Schedule {}
pub(crate) enum GhashKey {}

impl Schedule {
    pub(crate) fn new(_key: &[u8], _path: Path) -> Option<Self> {
        None
    }
    pub(crate) fn path(&self) -> Path {
        match *self {}
    }
    pub(crate) fn key_bits(&self) -> usize {
        match *self {}
    }
    pub(crate) fn block(&self, _b: &mut [u8; 16], _enc: bool) {
        match *self {}
    }
    pub(crate) fn ecb(&self, _data: &mut [u8], _enc: bool) {
        match *self {}
    }
    pub(crate) fn cbc_encrypt(&self, _iv: &[u8; 16], _data: &mut [u8]) {
        match *self {}
    }
    pub(crate) fn cbc_decrypt(&self, _iv: &[u8; 16], _data: &mut [u8]) {
        match *self {}
    }
    pub(crate) fn ctr(&self, _ctr: u128, _data: &mut [u8], _xor: bool) {
        match *self {}
    }
    pub(crate) fn xts(&self, _t: &mut [u8; 16], _data: &mut [u8], _enc: bool) {
        match *self {}
    }
}

impl GhashKey {
    pub(crate) fn new(aes: &Schedule) -> Self {
        match *aes {}
    }
    pub(crate) fn update(&self, _s: &mut [u8; 16], _data: &[u8]) {
        match *self {}
    }
}

/// Overwrites `b` with zeros (see the x86_64 kernel module).
pub(crate) fn wipe16(b: &mut [u8; 16]) {
    zeroize::Zeroize::zeroize(b);
}

/// No prefetch on other targets.
pub(crate) fn prefetch(_bytes: &[u8]) {}
