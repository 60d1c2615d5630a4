//! CPUID, MSR and the on-chip DRNG instructions.

use std::io;
use std::os::unix::fs::FileExt;

/// The four registers returned by one CPUID leaf/subleaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuidResult {
    /// EAX.
    pub eax: u32,
    /// EBX.
    pub ebx: u32,
    /// ECX.
    pub ecx: u32,
    /// EDX.
    pub edx: u32,
}

/// Executes CPUID for `leaf`/`subleaf`. Returns `None` on non-x86_64 targets.
#[must_use]
pub fn cpuid(leaf: u32, subleaf: u32) -> Option<CpuidResult> {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID is part of the x86_64 baseline, so the intrinsic is safe here.
        let r = std::arch::x86_64::__cpuid_count(leaf, subleaf);
        Some(CpuidResult {
            eax: r.eax,
            ebx: r.ebx,
            ecx: r.ecx,
            edx: r.edx,
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (leaf, subleaf);
        None
    }
}

/// CPU features memveil cares about, detected from CPUID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CpuFeature {
    /// RDRAND: CPUID.1:ECX bit 30.
    Rdrand,
    /// RDSEED: CPUID.(7,0):EBX bit 18.
    Rdseed,
    /// AES-NI: CPUID.1:ECX bit 25.
    AesNi,
    /// PCLMULQDQ: CPUID.1:ECX bit 1.
    Pclmulqdq,
    /// VAES: CPUID.(7,0):ECX bit 9.
    Vaes,
    /// VPCLMULQDQ: CPUID.(7,0):ECX bit 10.
    Vpclmulqdq,
    /// AVX-512 Foundation: CPUID.(7,0):EBX bit 16.
    Avx512f,
    /// Running under a hypervisor: CPUID.1:ECX bit 31.
    Hypervisor,
}

impl CpuFeature {
    /// The CPUID leaf, subleaf, register name and bit that report this feature.
    #[must_use]
    pub fn location(self) -> (u32, u32, &'static str, u32) {
        match self {
            CpuFeature::Rdrand => (1, 0, "ecx", 30),
            CpuFeature::Rdseed => (7, 0, "ebx", 18),
            CpuFeature::AesNi => (1, 0, "ecx", 25),
            CpuFeature::Pclmulqdq => (1, 0, "ecx", 1),
            CpuFeature::Vaes => (7, 0, "ecx", 9),
            CpuFeature::Vpclmulqdq => (7, 0, "ecx", 10),
            CpuFeature::Avx512f => (7, 0, "ebx", 16),
            CpuFeature::Hypervisor => (1, 0, "ecx", 31),
        }
    }
}

/// Whether CPUID reports `feature` on this processor.
#[must_use]
pub fn has_feature(feature: CpuFeature) -> bool {
    let (leaf, sub, reg, bit) = feature.location();
    let Some(max) = cpuid(0, 0) else {
        return false;
    };
    if leaf > max.eax {
        return false;
    }
    let Some(r) = cpuid(leaf, sub) else {
        return false;
    };
    let v = match reg {
        "eax" => r.eax,
        "ebx" => r.ebx,
        "ecx" => r.ecx,
        _ => r.edx,
    };
    (v >> bit) & 1 == 1
}

/// One RDRAND attempt. `None` when the instruction reported failure (CF=0) or
/// the CPU lacks RDRAND; callers own the retry policy.
#[must_use]
pub fn rdrand64() -> Option<u64> {
    #[cfg(target_arch = "x86_64")]
    {
        if !std::is_x86_feature_detected!("rdrand") {
            return None;
        }
        // SAFETY: the runtime check above proved the CPU implements RDRAND.
        unsafe { rdrand64_unchecked() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "rdrand")]
/// # Safety
/// The CPU must implement RDRAND.
unsafe fn rdrand64_unchecked() -> Option<u64> {
    let mut v = 0u64;
    let ok = std::arch::x86_64::_rdrand64_step(&mut v);
    (ok == 1).then_some(v)
}

/// One RDSEED attempt. `None` on failure (CF=0, frequent under load) or when the
/// CPU lacks RDSEED; callers own the retry policy.
#[must_use]
pub fn rdseed64() -> Option<u64> {
    #[cfg(target_arch = "x86_64")]
    {
        if !std::is_x86_feature_detected!("rdseed") {
            return None;
        }
        // SAFETY: the runtime check above proved the CPU implements RDSEED.
        unsafe { rdseed64_unchecked() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "rdseed")]
/// # Safety
/// The CPU must implement RDSEED.
unsafe fn rdseed64_unchecked() -> Option<u64> {
    let mut v = 0u64;
    let ok = std::arch::x86_64::_rdseed64_step(&mut v);
    (ok == 1).then_some(v)
}

/// Reads model-specific register `msr` of logical CPU `cpu` through
/// `/dev/cpu/N/msr` (needs the `msr` module and CAP_SYS_RAWIO).
///
/// # Errors
/// The I/O error of opening or reading the device (`NotFound` when the msr
/// module is not loaded, `PermissionDenied` without privilege, EIO when the
/// register does not exist or the hypervisor refuses it).
pub fn read_msr(cpu: u32, msr: u32) -> io::Result<u64> {
    let f = std::fs::File::open(format!("/dev/cpu/{cpu}/msr"))?;
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, u64::from(msr))?;
    Ok(u64::from_le_bytes(b))
}

/// Fills `buf` from the kernel's `getrandom(2)` (blocking until the pool is
/// initialised).
///
/// # Errors
/// The error of the system call (ENOSYS on kernels before 3.17).
pub fn getrandom(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid writable slice of `rest.len()` bytes for
        // the duration of the call.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n.unsigned_abs();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpuid_vendor_is_readable() {
        let r = cpuid(0, 0).expect("x86_64");
        let mut v = Vec::new();
        for reg in [r.ebx, r.edx, r.ecx] {
            v.extend_from_slice(&reg.to_le_bytes());
        }
        assert!(v.iter().all(u8::is_ascii), "vendor string {v:?}");
    }

    #[test]
    fn rdrand_matches_cpuid() {
        let present = has_feature(CpuFeature::Rdrand);
        let got = (0..32).find_map(|_| rdrand64());
        if present {
            assert!(got.is_some(), "RDRAND advertised but never succeeded");
        } else {
            memveil_testkit::skip(
                memveil_testkit::Need::Cpu("RDRAND"),
                "the value check (CPUID.1:ECX[30] clear; absence checked)",
            );
            assert!(got.is_none());
        }
    }

    #[test]
    fn getrandom_fills() {
        let mut a = [0u8; 64];
        getrandom(&mut a).expect("getrandom");
        assert_ne!(a, [0u8; 64]);
    }
}
