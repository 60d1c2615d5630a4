//! Pure decoding: [`HostFacts`] in, [`Report`] out. No I/O here.
//!
//! One file per section of the report, each a part of the `Decoder`: `cpu`
//! (the CPU and its instructions), `intel` (TME, MKTME), `amd` (SME, TSME),
//! `guest` (hypervisor, SEV, TDX), `kernel` (secret memory, userfaultfd,
//! limits, swap); then `checks` (the verdicts from the items), with `log`
//! (the kernel log's lines) beside them.
//!
//! Register layouts:
//! - Intel, "Intel Architecture Memory Encryption Technologies
//!   Specification" (TME/MKTME): `CPUID.(EAX=7,ECX=0):ECX[13]` TME_EN,
//!   `CPUID.(EAX=7,ECX=0):EDX[18]` PCONFIG; `IA32_TME_CAPABILITY` (0x981) bit 0
//!   AES-XTS-128, bit 2 AES-XTS-256, bit 31 TME encryption bypass supported,
//!   35:32 MK_TME_MAX_KEYID_BITS, 50:36 MK_TME_MAX_KEYS; `IA32_TME_ACTIVATE`
//!   (0x982) bit 0 lock, 1 TME enable, 2 key select (0 new random key,
//!   1 restore from storage), 3 save key for standby, 7:4 TME policy
//!   (encryption algorithm; 0 = AES-XTS-128, 2 = AES-XTS-256), 31 TME bypass
//!   enable, 35:32 MK_TME_KEYID_BITS, 63:48 MK_TME_CRYPTO_ALGS (bit 48
//!   AES-XTS-128, bit 50 AES-XTS-256).
//! - AMD, "AMD64 Architecture Programmer's Manual" vol. 2 §7.10 and vol. 3
//!   appendix E: CPUID 0x8000001F EAX bit 0 SME, 1 SEV, 3 SEV-ES, 4 SEV-SNP;
//!   EBX 5:0 C-bit position, 11:6 physical address bit reduction; ECX number
//!   of encrypted guests; EDX minimum SEV-only ASID. `SYSCFG` (0xC0010010)
//!   bit 23 MemEncryptionModeEn (SMEE), bit 24 SecureNestedPagingEn.
//!   `SEV_STATUS` (0xC0010131, guest) bit 0 SEV, 1 SEV-ES, 2 SEV-SNP.
//! - Linux kernel log lines: `arch/x86/kernel/cpu/intel.c`
//!   (`x86/tme: ...`, `x86/mktme: ...`, both the 4.18–6.6 and the 6.7+
//!   wording), `arch/x86/mm/mem_encrypt.c` (`Memory Encryption Features
//!   active: AMD SME`, `... AMD SEV SEV-ES SEV-SNP`, `... Intel TDX`),
//!   `drivers/crypto/ccp` (`psp: TSME enabled`), `arch/x86/coco/sev`
//!   (`SEV: Status: ...`), `arch/x86/coco/tdx` (`tdx: Guest detected`).

use crate::facts::{HostFacts, MsrAccess};
use crate::report::{Item, Report, Section, Value};

/// A CPUID bit: leaf, subleaf, register name, bit number.
type CpuidBit<'a> = (u32, u32, &'a str, u32);

/// `IA32_TME_CAPABILITY`.
pub const MSR_TME_CAPABILITY: u32 = 0x981;
/// `IA32_TME_ACTIVATE`.
pub const MSR_TME_ACTIVATE: u32 = 0x982;
/// AMD `SYSCFG`.
pub const MSR_AMD_SYSCFG: u32 = 0xC001_0010;
/// AMD `SEV_STATUS` (read inside guests).
pub const MSR_AMD_SEV_STATUS: u32 = 0xC001_0131;

/// Decodes recorded facts into the report.
#[must_use]
pub fn decode(f: &HostFacts) -> Report {
    let mut d = Decoder {
        f,
        items: Vec::new(),
        log: LogView::new(f),
    };
    d.cpu();
    let tme = d.intel_tme();
    let amd = d.amd_sme();
    let guest = d.guest();
    d.instructions();
    d.kernel();
    let checks = d.checks(&tme, &amd, &guest);
    Report {
        description: f.description.clone(),
        kernel_release: f.kernel_release.clone(),
        items: d.items,
        checks,
    }
}

fn bit(v: u64, n: u32) -> bool {
    (v >> n) & 1 == 1
}

fn field(v: u64, lo: u32, hi: u32) -> u64 {
    (v >> lo) & ((1u64 << (hi - lo + 1)) - 1)
}

fn int(v: u64) -> Value {
    Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
}

mod amd;
mod checks;
mod cpu;
mod guest;
mod intel;
mod kernel;
mod log;

use log::LogView;

/// What was concluded about Intel TME, for the checks.
#[derive(Debug, Default)]
struct TmeVerdict {
    cpuid: bool,
    enabled: Option<bool>,
    how: String,
    unknown_why: String,
    keyid_bits: Option<u64>,
    inconsistent: bool,
    bypass: bool,
}

/// What was concluded about AMD memory encryption, for the checks.
#[derive(Debug, Default)]
struct AmdVerdict {
    sme_cpuid: bool,
    sme_active: Option<bool>,
    tsme_active: Option<bool>,
    how: String,
    unknown_why: String,
}

/// What was concluded about the guest state, for the checks.
#[derive(Debug, Default)]
struct GuestVerdict {
    hypervisor: bool,
    confidential: Option<String>,
}

struct Decoder<'a> {
    f: &'a HostFacts,
    items: Vec<Item>,
    log: LogView,
}

impl Decoder<'_> {
    fn push(&mut self, section: Section, id: &str, label: &str, value: Value, how: String) {
        let how = if value.is_known() { how } else { String::new() };
        self.items.push(Item {
            id: id.to_owned(),
            section,
            label: label.to_owned(),
            value,
            how,
        });
    }

    fn cpuinfo_lines(&self) -> Option<&[String]> {
        self.f.cpuinfo.lines.as_deref()
    }

    /// The flags of the first processor in /proc/cpuinfo.
    fn cpu_flags(&self) -> Option<Vec<&str>> {
        let lines = self.cpuinfo_lines()?;
        let l = lines.iter().find(|l| {
            let k = l.split(':').next().unwrap_or("").trim();
            k == "flags"
        })?;
        let v = l.split_once(':')?.1;
        Some(v.split_whitespace().collect())
    }

    fn cpuinfo_value(&self, key: &str) -> Option<String> {
        let lines = self.cpuinfo_lines()?;
        lines.iter().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_owned())
        })
    }

    fn has_flag(&self, flag: &str) -> Option<bool> {
        self.cpu_flags().map(|fl| fl.contains(&flag))
    }

    fn vendor(&self) -> Option<String> {
        let r = self.f.cpuid(0, 0)?;
        let mut b = Vec::with_capacity(12);
        for reg in [r.ebx, r.edx, r.ecx] {
            b.extend_from_slice(&reg.to_le_bytes());
        }
        Some(String::from_utf8_lossy(&b).into_owned())
    }

    fn is_vendor(&self, v: &str) -> bool {
        self.vendor().is_some_and(|x| x == v)
    }

    /// CPUID bit, or why not known.
    fn cpuid_bit(&self, leaf: u32, sub: u32, reg: &str, n: u32) -> Result<bool, String> {
        if !self.f.cpuid_available && self.f.cpuid.is_empty() {
            return Err("CPUID not available (not an x86_64 CPU)".to_owned());
        }
        let max = if leaf >= 0x8000_0000 {
            self.f.cpuid(0x8000_0000, 0).map(|r| r.eax)
        } else if leaf >= 0x4000_0000 {
            self.f.cpuid(0x4000_0000, 0).map(|r| r.eax.max(0x4000_0000))
        } else {
            self.f.cpuid(0, 0).map(|r| r.eax)
        };
        let Some(r) = self.f.cpuid(leaf, sub) else {
            return match max {
                Some(m) if m < leaf => Ok(false),
                _ => Err(format!("CPUID leaf {leaf:#x} not recorded")),
            };
        };
        let v = match reg {
            "eax" => r.eax,
            "ebx" => r.ebx,
            "ecx" => r.ecx,
            _ => r.edx,
        };
        Ok((v >> n) & 1 == 1)
    }

    fn push_cpuid_bit(
        &mut self,
        section: Section,
        id: &str,
        label: &str,
        (leaf, sub, reg, n): CpuidBit<'_>,
    ) -> bool {
        let name = if sub == 0 && leaf != 7 {
            format!("CPUID.{leaf:#x}:{}[{n}]", reg.to_uppercase())
        } else {
            format!(
                "CPUID.(EAX={leaf:#x},ECX={sub}):{}[{n}]",
                reg.to_uppercase()
            )
        };
        match self.cpuid_bit(leaf, sub, reg, n) {
            Ok(b) => {
                let how = if self.f.cpuid(leaf, sub).is_some() {
                    format!("{name}={}", u8::from(b))
                } else {
                    format!("{name}: leaf beyond the maximum CPUID leaf, so 0")
                };
                self.push(section, id, label, Value::Bool(b), how);
                b
            }
            Err(why) => {
                self.push(section, id, label, Value::unknown(why), String::new());
                false
            }
        }
    }

    /// Why an MSR value is not known.
    fn msr_unknown(&self, msr: u32) -> String {
        match &self.f.msr_access {
            MsrAccess::NotLoaded => {
                "msr module not loaded (modprobe msr, or run with --load-msr)".to_owned()
            }
            MsrAccess::ModprobeFailed(m) => {
                format!("msr module not loaded and `modprobe msr` failed: {m}")
            }
            MsrAccess::PermissionDenied => {
                "/dev/cpu/0/msr needs root (CAP_SYS_RAWIO); run the probe as root".to_owned()
            }
            MsrAccess::Error(e) => format!("/dev/cpu/0/msr could not be opened: {e}"),
            MsrAccess::NotTried => "MSRs were not read".to_owned(),
            MsrAccess::Readable => match self.f.msrs(msr).find_map(|r| r.error.clone()) {
                Some(e) => format!(
                    "rdmsr {msr:#x} failed ({e}): the register does not exist on this CPU or the hypervisor hides it"
                ),
                None => format!("MSR {msr:#x} not read: CPUID does not enumerate it"),
            },
        }
    }

    /// CPU 0's value of `msr`, or why not known.
    fn msr0(&self, msr: u32) -> Result<u64, String> {
        self.f
            .msrs(msr)
            .filter(|r| r.cpu == 0)
            .find_map(|r| r.value)
            .ok_or_else(|| self.msr_unknown(msr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields() {
        assert_eq!(field(0x0000_03f6_0000_0001, 32, 35), 6);
        assert_eq!(field(0x0000_03f6_0000_0001, 36, 50), 63);
        assert_eq!(field(u64::MAX, 48, 63), 0xffff);
    }

    #[test]
    fn empty_facts_decode_to_unknowns_without_panicking() {
        let r = decode(&HostFacts::default());
        assert!(r.items.iter().any(|i| !i.value.is_known()));
        assert!(!r.checks.is_empty());
    }

    #[test]
    fn cipher_path_is_reported_or_unknown() {
        let r = decode(&HostFacts::default());
        let item = r.item("cipher.path").expect("item");
        assert!(!item.value.is_known(), "no record: unknown");
        let f = HostFacts {
            cipher_path: Some(crate::facts::CipherPath {
                path: "aesni".into(),
                detail: "aesni: kernels".into(),
                note: Some("MEMVEIL_CIPHER_PATH=aesni".into()),
                cannot_run: vec!["vaes256 (lacks VAES)".into()],
            }),
            ..HostFacts::default()
        };
        let r = decode(&f);
        let item = r.item("cipher.path").expect("item");
        assert_eq!(item.value, Value::Text("aesni".into()));
        assert!(
            item.how.contains("cannot run: vaes256 (lacks VAES)"),
            "{}",
            item.how
        );
        assert!(
            item.how.contains("MEMVEIL_CIPHER_PATH=aesni"),
            "{}",
            item.how
        );
    }
}
