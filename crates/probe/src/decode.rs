//! Pure decoding: [`HostFacts`] in, [`Report`] out. No I/O here.
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

use crate::facts::{Attempt, FileRead, HostFacts, MsrAccess};
use crate::report::{Check, Item, Report, Section, Status, Value};

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

/// Kernel log lines with timestamps stripped.
struct LogView {
    lines: Vec<String>,
    readable: bool,
    wrapped: bool,
    source: String,
    why: String,
}

fn strip_timestamp(l: &str) -> &str {
    let t = l.trim_start();
    if let Some(rest) = t.strip_prefix('[') {
        if let Some(end) = rest.find(']') {
            let ts = &rest[..end];
            if ts.trim().chars().all(|c| c.is_ascii_digit() || c == '.') {
                return rest[end + 1..].trim_start();
            }
        }
    }
    t
}

impl LogView {
    fn new(f: &HostFacts) -> LogView {
        let k = &f.kernel_log;
        match &k.lines {
            Some(lines) => LogView {
                lines: lines
                    .iter()
                    .map(|l| strip_timestamp(l).to_owned())
                    .collect(),
                readable: true,
                wrapped: k.wrapped,
                source: k.source.clone(),
                why: String::new(),
            },
            None => LogView {
                lines: Vec::new(),
                readable: false,
                wrapped: false,
                source: String::new(),
                why: if k.errors.is_empty() {
                    "kernel log not recorded".to_owned()
                } else {
                    format!("kernel log unreadable: {}", k.errors.join("; "))
                },
            },
        }
    }

    /// The first line containing `needle`.
    fn find(&self, needle: &str) -> Option<&str> {
        self.lines
            .iter()
            .find(|l| l.contains(needle))
            .map(String::as_str)
    }

    /// "the line is absent" is evidence only when the whole boot log is there.
    fn absence_is_evidence(&self) -> bool {
        self.readable && !self.wrapped
    }

    fn why_absence_means_nothing(&self) -> String {
        if !self.readable {
            self.why.clone()
        } else {
            format!(
                "the kernel log ({}) no longer holds the boot messages (ring buffer wrapped; enable a persistent journal)",
                self.source
            )
        }
    }

    fn cite(&self, line: &str) -> String {
        format!("kernel log ({}): \"{}\"", self.source, line.trim())
    }
}

/// The integer right after `prefix` inside `line`.
fn number_after(line: &str, prefix: &str) -> Option<u64> {
    let at = line.find(prefix)? + prefix.len();
    let digits: String = line[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// The integer right before `suffix` inside `line`.
fn number_before(line: &str, suffix: &str) -> Option<u64> {
    let at = line.find(suffix)?;
    let head = line[..at].trim_end();
    let digits: String = head
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    digits.parse().ok()
}

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

    fn cpu(&mut self) {
        let s = Section::Cpu;
        match self.vendor() {
            Some(v) => self.push(
                s,
                "cpu.vendor",
                "Vendor",
                Value::Text(v.clone()),
                "CPUID.0:EBX,EDX,ECX".to_owned(),
            ),
            None => self.push(
                s,
                "cpu.vendor",
                "Vendor",
                Value::unknown("CPUID leaf 0 not available"),
                String::new(),
            ),
        }
        if let Some(r) = self.f.cpuid(1, 0) {
            let a = u64::from(r.eax);
            let base_family = field(a, 8, 11);
            let family = if base_family == 0xF {
                base_family + field(a, 20, 27)
            } else {
                base_family
            };
            let model = if base_family == 0x6 || base_family == 0xF {
                (field(a, 16, 19) << 4) | field(a, 4, 7)
            } else {
                field(a, 4, 7)
            };
            self.push(
                s,
                "cpu.signature",
                "Family/model/stepping",
                Value::Text(format!(
                    "family {family:#x} model {model:#x} stepping {}",
                    field(a, 0, 3)
                )),
                format!("CPUID.1:EAX={:#010x}", r.eax),
            );
        }
        match self.cpuinfo_value("model name") {
            Some(m) => self.push(
                s,
                "cpu.model_name",
                "Model name",
                Value::Text(m),
                format!("{} \"model name\"", self.f.cpuinfo.source),
            ),
            None => self.push(
                s,
                "cpu.model_name",
                "Model name",
                Value::unknown(
                    self.f
                        .cpuinfo
                        .error
                        .clone()
                        .unwrap_or_else(|| "/proc/cpuinfo has no model name".to_owned()),
                ),
                String::new(),
            ),
        }
        let msr = match &self.f.msr_access {
            MsrAccess::Readable => Value::Text("readable".to_owned()),
            MsrAccess::NotTried => Value::unknown("not examined"),
            _ => Value::unknown(self.msr_unknown(0)),
        };
        self.push(
            s,
            "cpu.msr_access",
            "MSR access (/dev/cpu/N/msr)",
            msr,
            "open /dev/cpu/0/msr".to_owned(),
        );
        if let Some(r) = self.f.cpuid(0x8000_0008, 0) {
            self.push(
                s,
                "cpu.phys_addr_bits",
                "Physical address bits (CPUID)",
                int(u64::from(r.eax & 0xff)),
                format!("CPUID.0x80000008:EAX[7:0]={}", r.eax & 0xff),
            );
        }
        if let Some(a) = self.cpuinfo_value("address sizes") {
            if let Some(p) = number_before(&a, "bits physical") {
                self.push(
                    s,
                    "cpu.kernel_phys_addr_bits",
                    "Physical address bits (kernel, after KeyID/C-bit reduction)",
                    int(p),
                    format!("/proc/cpuinfo \"address sizes: {a}\""),
                );
            }
        }
    }

    #[allow(clippy::too_many_lines)]
    fn intel_tme(&mut self) -> TmeVerdict {
        let s = Section::IntelTme;
        let mut v = TmeVerdict {
            cpuid: self.push_cpuid_bit(s, "intel.tme.cpuid", "TME supported", (7, 0, "ecx", 13)),
            ..TmeVerdict::default()
        };
        self.push_cpuid_bit(
            s,
            "intel.pconfig.cpuid",
            "PCONFIG supported (TME-MK key programming)",
            (7, 0, "edx", 18),
        );
        if let Some(flag) = self.has_flag("tme") {
            self.push(
                s,
                "intel.tme.cpuinfo_flag",
                "Kernel lists the \"tme\" flag",
                Value::Bool(flag),
                "/proc/cpuinfo flags (Linux 6.7+ clears it when the BIOS did not enable TME)"
                    .to_owned(),
            );
        }
        if !v.cpuid {
            v.enabled = Some(false);
            v.how = "CPUID.(EAX=7,ECX=0):ECX[13]=0".to_owned();
            return v;
        }

        // IA32_TME_CAPABILITY.
        let mut max_keys = None;
        match self.msr0(MSR_TME_CAPABILITY) {
            Ok(c) => {
                let how = |what: &str| {
                    format!("IA32_TME_CAPABILITY (MSR 0x981) {what} on cpu0 = {c:#018x}")
                };
                self.push(
                    s,
                    "intel.tme_cap.aes_xts_128",
                    "Capability: AES-XTS-128",
                    Value::Bool(bit(c, 0)),
                    how("bit 0"),
                );
                self.push(
                    s,
                    "intel.tme_cap.aes_xts_256",
                    "Capability: AES-XTS-256",
                    Value::Bool(bit(c, 2)),
                    how("bit 2"),
                );
                self.push(
                    s,
                    "intel.tme_cap.bypass",
                    "Capability: TME encryption bypass",
                    Value::Bool(bit(c, 31)),
                    how("bit 31"),
                );
                self.push(
                    s,
                    "intel.tme_cap.max_keyid_bits",
                    "Capability: MK_TME_MAX_KEYID_BITS",
                    int(field(c, 32, 35)),
                    how("bits 35:32"),
                );
                self.push(
                    s,
                    "intel.tme_cap.max_keys",
                    "Capability: MK_TME_MAX_KEYS",
                    int(field(c, 36, 50)),
                    how("bits 50:36"),
                );
                max_keys = Some(field(c, 36, 50));
                let known = 1u64 | (1 << 2) | (1 << 31) | (0x7_ffff << 32);
                let other = c & !known & !0b10;
                if other != 0 {
                    self.push(
                        s,
                        "intel.tme_cap.other_bits",
                        "Capability: other bits set (not decoded)",
                        Value::Text(format!("{other:#x}")),
                        how("remaining bits"),
                    );
                }
            }
            Err(why) => self.push(
                s,
                "intel.tme_cap",
                "IA32_TME_CAPABILITY (MSR 0x981)",
                Value::unknown(why),
                String::new(),
            ),
        }

        // IA32_TME_ACTIVATE, on every CPU read.
        let values: Vec<(u32, u64)> = self
            .f
            .msrs(MSR_TME_ACTIVATE)
            .filter_map(|r| r.value.map(|x| (r.cpu, x)))
            .collect();
        if values.len() > 1 {
            let first = values[0].1;
            let same = values.iter().all(|(_, x)| *x == first);
            v.inconsistent = !same;
            self.push(
                s,
                "intel.tme_activate.consistent",
                "IA32_TME_ACTIVATE identical on all CPUs",
                Value::Bool(same),
                format!("MSR 0x982 read on {} CPUs", values.len()),
            );
        }
        match self.msr0(MSR_TME_ACTIVATE) {
            Ok(a) => {
                let how = |what: &str| {
                    format!("IA32_TME_ACTIVATE (MSR 0x982) {what} on cpu0 = {a:#018x}")
                };
                let (lock, en) = (bit(a, 0), bit(a, 1));
                self.push(
                    s,
                    "intel.tme_activate.locked",
                    "Activate: lock",
                    Value::Bool(lock),
                    how("bit 0"),
                );
                self.push(
                    s,
                    "intel.tme_activate.enabled",
                    "Activate: TME enable",
                    Value::Bool(en),
                    how("bit 1"),
                );
                self.push(
                    s,
                    "intel.tme_activate.key_select",
                    "Activate: key select",
                    Value::Text(
                        if bit(a, 2) {
                            "restore key from storage (1)"
                        } else {
                            "new random key at each boot (0)"
                        }
                        .to_owned(),
                    ),
                    how("bit 2"),
                );
                self.push(
                    s,
                    "intel.tme_activate.save_key",
                    "Activate: save key for standby",
                    Value::Bool(bit(a, 3)),
                    how("bit 3"),
                );
                let policy = field(a, 4, 7);
                self.push(
                    s,
                    "intel.tme_activate.policy",
                    "Activate: TME policy (algorithm)",
                    Value::Text(match policy {
                        0 => "AES-XTS-128 (0)".to_owned(),
                        2 => "AES-XTS-256 (2)".to_owned(),
                        p => format!("unknown policy {p}"),
                    }),
                    how("bits 7:4"),
                );
                self.push(
                    s,
                    "intel.tme_activate.bypass",
                    "Activate: TME bypass enable (KeyID 0 unencrypted)",
                    Value::Bool(bit(a, 31)),
                    how("bit 31"),
                );
                let kb = field(a, 32, 35);
                self.push(
                    s,
                    "intel.mktme.keyid_bits",
                    "MK_TME_KEYID_BITS (KeyID bits set by BIOS)",
                    int(kb),
                    how("bits 35:32"),
                );
                let algs = field(a, 48, 63);
                let mut names = Vec::new();
                if bit(algs, 0) {
                    names.push("AES-XTS-128");
                }
                if bit(algs, 2) {
                    names.push("AES-XTS-256");
                }
                let rest = algs & !0b101;
                let mut text = if names.is_empty() {
                    "none".to_owned()
                } else {
                    names.join(", ")
                };
                if rest != 0 {
                    text.push_str(&format!(" + unknown {rest:#x}"));
                }
                self.push(
                    s,
                    "intel.mktme.crypto_algs",
                    "MK_TME_CRYPTO_ALGS (algorithms allowed for KeyIDs)",
                    Value::Text(text),
                    how("bits 63:48"),
                );
                let usable = if kb == 0 { 0 } else { (1u64 << kb) - 1 };
                let usable = max_keys.map_or(usable, |m| usable.min(m));
                self.push(
                    s,
                    "intel.mktme.usable_keyids",
                    "Usable TME-MK KeyIDs",
                    int(usable),
                    format!(
                        "2^MK_TME_KEYID_BITS - 1 = {}{}",
                        if kb == 0 { 0 } else { (1u64 << kb) - 1 },
                        if max_keys.is_some() {
                            ", capped by MK_TME_MAX_KEYS"
                        } else {
                            ""
                        }
                    ),
                );
                v.enabled = Some(lock && en);
                v.bypass = bit(a, 31);
                v.keyid_bits = Some(if lock && en { kb } else { 0 });
                v.how = format!(
                    "IA32_TME_ACTIVATE (MSR 0x982) lock={} enable={} on cpu0",
                    u8::from(lock),
                    u8::from(en)
                );
            }
            Err(why) => {
                self.push(
                    s,
                    "intel.tme_activate",
                    "IA32_TME_ACTIVATE (MSR 0x982)",
                    Value::unknown(why.clone()),
                    String::new(),
                );
                v.unknown_why = why;
            }
        }

        // The kernel's own reading of the same register at boot.
        let not_en = self
            .log
            .find("x86/tme: not enabled by BIOS")
            .map(str::to_owned);
        let en = self.log.find("x86/tme: enabled by BIOS").map(str::to_owned);
        let log_enabled = match (not_en, en) {
            (Some(l), _) => Some((false, l)),
            (None, Some(l)) => Some((true, l)),
            _ => None,
        };
        match &log_enabled {
            Some((b, l)) => {
                let how = self.log.cite(l);
                self.push(
                    s,
                    "intel.tme.log_enabled",
                    "Kernel log: TME enabled by BIOS",
                    Value::Bool(*b),
                    how,
                );
            }
            None => {
                let why = if self.log.absence_is_evidence() {
                    "no x86/tme line in the kernel log: the kernel did not see the TME CPUID bit (kernel older than 4.18, or TME hidden from this VM)".to_owned()
                } else {
                    self.log.why_absence_means_nothing()
                };
                self.push(
                    s,
                    "intel.tme.log_enabled",
                    "Kernel log: TME enabled by BIOS",
                    Value::unknown(why),
                    String::new(),
                );
            }
        }
        let mut log_keyids = None;
        if let Some(l) = self.log.find("x86/mktme:").map(str::to_owned) {
            let lines: Vec<String> = self
                .log
                .lines
                .iter()
                .filter(|x| x.contains("x86/mktme:"))
                .cloned()
                .collect();
            for l in &lines {
                if let Some(n) = number_before(l, "KeyIDs available") {
                    log_keyids = Some((n, l.clone()));
                } else if l.contains("x86/mktme: disabled by BIOS") {
                    log_keyids = Some((0, l.clone()));
                } else if let Some(b) = number_after(l, "x86_phys_bits reduced by") {
                    let n = if b == 0 { 0 } else { (1u64 << b.min(15)) - 1 };
                    log_keyids = Some((n, l.clone()));
                    if v.keyid_bits.is_none() {
                        v.keyid_bits = Some(b);
                    }
                }
            }
            let _ = l;
        }
        if let Some((n, l)) = &log_keyids {
            let how = self.log.cite(l);
            self.push(
                s,
                "intel.mktme.log_keyids",
                "Kernel log: TME-MK KeyIDs",
                int(*n),
                how,
            );
        }
        if self
            .log
            .find("x86/tme: configuration is inconsistent between CPUs")
            .is_some()
        {
            v.inconsistent = true;
        }
        if v.enabled.is_none() {
            if let Some((b, l)) = log_enabled {
                v.enabled = Some(b);
                v.how = self.log.cite(&l);
            } else if v.unknown_why.is_empty() {
                v.unknown_why = "neither MSR 0x982 nor the kernel log says".to_owned();
            } else if !self.log.absence_is_evidence() {
                v.unknown_why = format!(
                    "{}; {}",
                    v.unknown_why,
                    self.log.why_absence_means_nothing()
                );
            }
        }
        let value = match v.enabled {
            Some(b) => Value::Bool(b),
            None => Value::unknown(v.unknown_why.clone()),
        };
        let how = v.how.clone();
        self.push(
            s,
            "intel.tme.enabled",
            "TME active (memory encrypted)",
            value,
            how,
        );
        v
    }

    #[allow(clippy::too_many_lines)]
    fn amd_sme(&mut self) -> AmdVerdict {
        let s = Section::AmdSme;
        let mut v = AmdVerdict::default();
        let leaf = self.f.cpuid(0x8000_001F, 0);
        v.sme_cpuid = self.push_cpuid_bit(
            s,
            "amd.sme.cpuid",
            "SME supported",
            (0x8000_001F, 0, "eax", 0),
        );
        self.push_cpuid_bit(
            s,
            "amd.sev.cpuid",
            "SEV supported",
            (0x8000_001F, 0, "eax", 1),
        );
        self.push_cpuid_bit(
            s,
            "amd.sev_es.cpuid",
            "SEV-ES supported",
            (0x8000_001F, 0, "eax", 3),
        );
        self.push_cpuid_bit(
            s,
            "amd.sev_snp.cpuid",
            "SEV-SNP supported",
            (0x8000_001F, 0, "eax", 4),
        );
        if let Some(r) = leaf {
            if r.eax & 0b11 != 0 {
                let b = u64::from(r.ebx);
                self.push(
                    s,
                    "amd.c_bit",
                    "C-bit position",
                    int(field(b, 0, 5)),
                    format!("CPUID.0x8000001F:EBX[5:0], EBX={:#010x}", r.ebx),
                );
                self.push(
                    s,
                    "amd.phys_addr_reduction",
                    "Physical address bit reduction",
                    int(field(b, 6, 11)),
                    format!("CPUID.0x8000001F:EBX[11:6], EBX={:#010x}", r.ebx),
                );
                if r.eax & 0b10 != 0 {
                    self.push(
                        s,
                        "amd.sev.max_guests",
                        "Encrypted guests supported at once",
                        int(u64::from(r.ecx)),
                        format!("CPUID.0x8000001F:ECX={}", r.ecx),
                    );
                }
            }
        }
        for (flag, id, label) in [
            (
                "sme",
                "amd.sme.cpuinfo_flag",
                "Kernel lists the \"sme\" flag (SME active in this kernel)",
            ),
            (
                "sev",
                "amd.sev.cpuinfo_flag",
                "Kernel lists the \"sev\" flag (host may run SEV guests)",
            ),
        ] {
            if v.sme_cpuid || leaf.is_some_and(|r| r.eax & 0b10 != 0) {
                if let Some(b) = self.has_flag(flag) {
                    self.push(s, id, label, Value::Bool(b), "/proc/cpuinfo flags (arch/x86/kernel/cpu/amd.c clears it unless SYSCFG[23] is set and the kernel turned SME on)".to_owned());
                }
            }
        }
        let is_amd = self.is_vendor("AuthenticAMD") || self.is_vendor("HygonGenuine");
        let mut smee = None;
        if is_amd && v.sme_cpuid {
            match self.msr0(MSR_AMD_SYSCFG) {
                Ok(x) => {
                    let how =
                        |what: &str| format!("SYSCFG (MSR 0xC0010010) {what} on cpu0 = {x:#018x}");
                    smee = Some(bit(x, 23));
                    self.push(
                        s,
                        "amd.syscfg.smee",
                        "SYSCFG: MemEncryptionModeEn (SMEE)",
                        Value::Bool(bit(x, 23)),
                        how("bit 23"),
                    );
                    self.push(
                        s,
                        "amd.syscfg.snp_en",
                        "SYSCFG: SecureNestedPagingEn",
                        Value::Bool(bit(x, 24)),
                        how("bit 24"),
                    );
                }
                Err(why) => self.push(
                    s,
                    "amd.syscfg",
                    "SYSCFG (MSR 0xC0010010)",
                    Value::unknown(why),
                    String::new(),
                ),
            }
        }

        // Kernel log: which memory encryption the kernel runs with.
        let me_line = self
            .log
            .find("Memory Encryption Features active:")
            .map(str::to_owned);
        let mut log_sme = None;
        if let Some(l) = &me_line {
            let tail = l
                .split("Memory Encryption Features active:")
                .nth(1)
                .unwrap_or("");
            let words: Vec<&str> = tail.split_whitespace().collect();
            let is_amd_line = words.first() == Some(&"AMD") || l.contains("AMD Memory Encryption");
            log_sme = Some(is_amd_line && words.contains(&"SME"));
            let how = self.log.cite(l);
            self.push(
                s,
                "amd.log_features",
                "Kernel log: memory encryption features active",
                Value::Text(tail.trim().to_owned()),
                how,
            );
        }
        let tsme_line = self
            .log
            .find("psp: TSME enabled")
            .or_else(|| self.log.find("psp: Both TSME and SME are active"))
            .map(str::to_owned);
        if let Some(l) = &tsme_line {
            let how = self.log.cite(l);
            self.push(
                s,
                "amd.tsme.log",
                "Kernel log: PSP reports TSME",
                Value::Bool(true),
                how,
            );
            if l.contains("Both TSME and SME") {
                log_sme = Some(true);
            }
        }

        // TSME from the PSP's security attributes in sysfs.
        let tsme_files: Vec<(String, String)> = self
            .f
            .files
            .iter()
            .filter(|(k, _)| k.ends_with("/tsme_status"))
            .filter_map(|(k, r)| match r {
                FileRead::Ok(c) => Some((k.clone(), c.trim().to_owned())),
                _ => None,
            })
            .collect();
        let mut sysfs_tsme = None;
        if let Some((path, val)) = tsme_files.first() {
            let b = val == "1";
            sysfs_tsme = Some(b);
            self.push(
                s,
                "amd.tsme.sysfs",
                "TSME active (PSP tsme_status)",
                Value::Bool(b),
                format!("{path} = {val}"),
            );
        }

        // Conclusions.
        let sme_flag = self.has_flag("sme");
        v.sme_active = if !v.sme_cpuid {
            v.how = "CPUID.0x8000001F:EAX[0]=0 (or leaf absent)".to_owned();
            Some(false)
        } else if smee == Some(false) {
            // The register wins over a log line (which anyone who can write
            // /dev/kmsg could forge).
            v.how = "SYSCFG[23] (SMEE) = 0: the BIOS did not enable memory encryption".to_owned();
            Some(false)
        } else if let Some(true) = log_sme {
            v.how = me_line
                .as_deref()
                .map(|l| self.log.cite(l))
                .unwrap_or_default();
            Some(true)
        } else if sme_flag == Some(true) {
            v.how = "/proc/cpuinfo flag \"sme\"".to_owned();
            Some(true)
        } else if self.log.absence_is_evidence() && sme_flag == Some(false) {
            v.how = "no \"Memory Encryption Features active: AMD SME\" line in the boot log and no \"sme\" cpuinfo flag".to_owned();
            Some(false)
        } else {
            v.unknown_why = self.log.why_absence_means_nothing();
            None
        };
        v.tsme_active = if !v.sme_cpuid {
            Some(false)
        } else if let Some(b) = sysfs_tsme {
            Some(b)
        } else if tsme_line.is_some() {
            Some(true)
        } else {
            None
        };
        let tsme_unknown = "no tsme_status in sysfs (needs Linux 5.19+, the ccp driver, and a PSP that reports security attributes) and no \"psp: TSME enabled\" log line";
        if v.sme_cpuid {
            let val = match v.sme_active {
                Some(b) => Value::Bool(b),
                None => Value::unknown(v.unknown_why.clone()),
            };
            let how = v.how.clone();
            self.push(
                s,
                "amd.sme.active",
                "SME active (kernel encrypts its memory)",
                val,
                how,
            );
            let (val, how) = match (v.tsme_active, sysfs_tsme, &tsme_line) {
                (Some(b), Some(_), _) => (
                    Value::Bool(b),
                    tsme_files
                        .first()
                        .map(|(p, x)| format!("{p} = {x}"))
                        .unwrap_or_default(),
                ),
                (Some(b), None, Some(l)) => (Value::Bool(b), self.log.cite(l)),
                _ => (Value::unknown(tsme_unknown), String::new()),
            };
            self.push(
                s,
                "amd.tsme.active",
                "TSME active (all memory encrypted by the BIOS setting)",
                val,
                how,
            );
        }
        v
    }

    #[allow(clippy::too_many_lines)]
    fn guest(&mut self) -> GuestVerdict {
        let s = Section::Guest;
        let mut g = GuestVerdict {
            hypervisor: self.push_cpuid_bit(
                s,
                "guest.hypervisor",
                "Running under a hypervisor",
                (1, 0, "ecx", 31),
            ),
            ..GuestVerdict::default()
        };
        if g.hypervisor {
            if let Some(r) = self.f.cpuid(0x4000_0000, 0) {
                let mut b = Vec::with_capacity(12);
                for reg in [r.ebx, r.ecx, r.edx] {
                    b.extend_from_slice(&reg.to_le_bytes());
                }
                let sig = String::from_utf8_lossy(&b)
                    .trim_end_matches('\0')
                    .to_owned();
                let name = match sig.as_str() {
                    "KVMKVMKVM" => "KVM",
                    "Microsoft Hv" => "Hyper-V",
                    "VMwareVMware" => "VMware",
                    "XenVMMXenVMM" => "Xen",
                    "TCGTCGTCGTCG" => "QEMU TCG",
                    "ACRNACRNACRN" => "ACRN",
                    "bhyve bhyve " => "bhyve",
                    " lrpepyh  vr" => "Parallels",
                    _ => "",
                };
                let text = if name.is_empty() {
                    format!("\"{sig}\"")
                } else {
                    format!("{name} (\"{sig}\")")
                };
                self.push(
                    s,
                    "guest.hypervisor_vendor",
                    "Hypervisor vendor",
                    Value::Text(text),
                    format!(
                        "CPUID.0x40000000:EBX,ECX,EDX (max hypervisor leaf {:#x})",
                        r.eax
                    ),
                );
            }
            if let Some(l) = self.log.find("Hypervisor detected:").map(str::to_owned) {
                let name = l
                    .split("Hypervisor detected:")
                    .nth(1)
                    .unwrap_or("")
                    .trim()
                    .to_owned();
                let how = self.log.cite(&l);
                self.push(
                    s,
                    "guest.log_hypervisor",
                    "Kernel log: hypervisor detected",
                    Value::Text(name),
                    how,
                );
            }
        }

        // TDX guest.
        let mut tdx = None;
        if let Some(r) = self.f.cpuid(0x21, 0) {
            let mut b = Vec::with_capacity(12);
            for reg in [r.ebx, r.edx, r.ecx] {
                b.extend_from_slice(&reg.to_le_bytes());
            }
            let sig = String::from_utf8_lossy(&b).into_owned();
            let is = sig == "IntelTDX    ";
            tdx = Some((is, format!("CPUID.0x21:EBX,EDX,ECX = \"{sig}\"")));
        }
        if tdx.is_none() {
            if let Some(l) = self.log.find("tdx: Guest detected").map(str::to_owned) {
                tdx = Some((true, self.log.cite(&l)));
            } else if let Some(true) = self.has_flag("tdx_guest") {
                tdx = Some((true, "/proc/cpuinfo flag \"tdx_guest\"".to_owned()));
            }
        }
        if let Some((is, how)) = tdx.clone() {
            self.push(s, "guest.tdx", "Intel TDX guest", Value::Bool(is), how);
            if is {
                g.confidential = Some("TDX".to_owned());
            }
        }

        // SEV guest: SEV_STATUS MSR, kernel log.
        let is_amd = self.is_vendor("AuthenticAMD") || self.is_vendor("HygonGenuine");
        let mut sev = None;
        if g.hypervisor && is_amd {
            if let Ok(x) = self.msr0(MSR_AMD_SEV_STATUS) {
                let how = |what: &str| format!("SEV_STATUS (MSR 0xC0010131) {what} = {x:#018x}");
                self.push(
                    s,
                    "guest.sev_status.sev",
                    "SEV_STATUS: SEV",
                    Value::Bool(bit(x, 0)),
                    how("bit 0"),
                );
                self.push(
                    s,
                    "guest.sev_status.sev_es",
                    "SEV_STATUS: SEV-ES",
                    Value::Bool(bit(x, 1)),
                    how("bit 1"),
                );
                self.push(
                    s,
                    "guest.sev_status.sev_snp",
                    "SEV_STATUS: SEV-SNP",
                    Value::Bool(bit(x, 2)),
                    how("bit 2"),
                );
                sev = Some((
                    if bit(x, 2) {
                        "SEV-SNP"
                    } else if bit(x, 1) {
                        "SEV-ES"
                    } else if bit(x, 0) {
                        "SEV"
                    } else {
                        ""
                    },
                    how("bits 2:0"),
                ));
            }
        }
        if sev.is_none() {
            if let Some(l) = self
                .log
                .find("Memory Encryption Features active:")
                .map(str::to_owned)
            {
                let tail = l
                    .split("Memory Encryption Features active:")
                    .nth(1)
                    .unwrap_or("");
                let w: Vec<&str> = tail.split_whitespace().collect();
                let level = if w.contains(&"SEV-SNP") {
                    "SEV-SNP"
                } else if w.contains(&"SEV-ES") {
                    "SEV-ES"
                } else if w.contains(&"SEV") {
                    "SEV"
                } else {
                    ""
                };
                if !level.is_empty() {
                    sev = Some((level, self.log.cite(&l)));
                }
            }
        }
        if let Some(l) = self.log.find("SEV: Status:").map(str::to_owned) {
            let tail = l
                .split("SEV: Status:")
                .nth(1)
                .unwrap_or("")
                .trim()
                .to_owned();
            let how = self.log.cite(&l);
            self.push(
                s,
                "guest.sev_log_status",
                "Kernel log: SEV status features",
                Value::Text(tail),
                how,
            );
        }
        for dev in ["/dev/sev-guest", "/dev/tdx_guest"] {
            if let Some(r) = self.f.files.get(dev) {
                let present = matches!(r, FileRead::Ok(_));
                self.push(
                    s,
                    &format!(
                        "guest.dev.{}",
                        dev.trim_start_matches("/dev/").replace('-', "_")
                    ),
                    &format!("{dev} present (attestation device)"),
                    Value::Bool(present),
                    format!("stat {dev}"),
                );
            }
        }
        match &sev {
            Some((level, how)) if !level.is_empty() => {
                self.push(
                    s,
                    "guest.sev",
                    "AMD SEV guest level",
                    Value::Text((*level).to_owned()),
                    how.clone(),
                );
                g.confidential = Some((*level).to_owned());
            }
            Some((_, how)) => self.push(
                s,
                "guest.sev",
                "AMD SEV guest level",
                Value::Text("none".to_owned()),
                how.clone(),
            ),
            None => {}
        }
        let val = match (&g.confidential, g.hypervisor) {
            (Some(c), _) => Value::Text(c.clone()),
            (None, false) => Value::Text("not a guest".to_owned()),
            (None, true)
                if self.log.absence_is_evidence() || self.f.msr_access == MsrAccess::Readable =>
            {
                Value::Text("none".to_owned())
            }
            (None, true) => Value::unknown(self.log.why_absence_means_nothing()),
        };
        let how = match (&g.confidential, g.hypervisor) {
            (Some(_), _) => "see the TDX/SEV items above".to_owned(),
            (None, false) => "CPUID.1:ECX[31]=0".to_owned(),
            (None, true) => "no TDX CPUID leaf, no SEV_STATUS bit and no \"Memory Encryption Features active\" line".to_owned(),
        };
        self.push(
            s,
            "guest.confidential",
            "Confidential guest (memory encrypted against the host)",
            val,
            how,
        );
        g
    }

    fn instructions(&mut self) {
        let s = Section::Instructions;
        let bits: [(&str, &str, CpuidBit<'_>); 7] = [
            ("cpu.rdrand", "RDRAND", (1, 0, "ecx", 30)),
            ("cpu.rdseed", "RDSEED", (7, 0, "ebx", 18)),
            ("cpu.aes_ni", "AES-NI", (1, 0, "ecx", 25)),
            ("cpu.pclmulqdq", "PCLMULQDQ", (1, 0, "ecx", 1)),
            ("cpu.vaes", "VAES", (7, 0, "ecx", 9)),
            ("cpu.vpclmulqdq", "VPCLMULQDQ", (7, 0, "ecx", 10)),
            ("cpu.avx512f", "AVX-512F", (7, 0, "ebx", 16)),
        ];
        for (id, label, loc) in bits {
            self.push_cpuid_bit(s, id, label, loc);
        }
        let (value, how) = match &self.f.cipher_path {
            Some(c) => (
                Value::Text(c.path.clone()),
                format!(
                    "CPUID, as memveil-cipher read it in the probing process: {}{}; {}",
                    c.detail,
                    c.note
                        .as_deref()
                        .map(|n| format!(" ({n})"))
                        .unwrap_or_default(),
                    if c.cannot_run.is_empty() {
                        "every path runs on this CPU".to_owned()
                    } else {
                        format!("this CPU cannot run: {}", c.cannot_run.join("; "))
                    }
                ),
            ),
            None => (
                Value::unknown("not recorded (facts from a probe older than the cipher paths)"),
                String::new(),
            ),
        };
        self.push(
            s,
            "cipher.path",
            "memveil AES path in use (MEMVEIL_CIPHER_PATH caps it)",
            value,
            how,
        );
        for r in &self.f.rng {
            let id = format!("rng.{}.healthy", r.source);
            let label = format!(
                "{} live sample passes SP 800-90B RCT and APT",
                r.source.to_uppercase()
            );
            let (value, how) = if !r.available {
                (
                    Value::unknown(
                        r.error
                            .clone()
                            .unwrap_or_else(|| "instruction not available".to_owned()),
                    ),
                    String::new(),
                )
            } else {
                let how = format!(
                    "{} samples of 64 bits: RCT cutoff C={} (longest run {}), APT W={} C={} (highest count {}), H={} bits/sample claimed; {} of {} attempts failed (CF=0){}",
                    r.samples, r.rct_cutoff, r.longest_run, r.apt_window, r.apt_cutoff, r.highest_apt_count, r.h_bits, r.failed_attempts, r.attempts,
                    r.error.as_deref().map(|e| format!("; {e}")).unwrap_or_default()
                );
                (Value::Bool(r.passed), how)
            };
            self.items.push(Item {
                id,
                section: s,
                label,
                value,
                how,
            });
        }
    }

    fn attempt_item(&mut self, id: &str, label: &str, a: &Attempt, what: &str) -> Option<bool> {
        let s = Section::Kernel;
        match a {
            Attempt::NotTried => {
                self.push(s, id, label, Value::unknown("not tried"), String::new());
                None
            }
            Attempt::Ok { value } => {
                let how = match value {
                    Some(v) => format!("{what}: succeeded ({v:#x})"),
                    None => format!("{what}: succeeded"),
                };
                self.push(s, id, label, Value::Bool(true), how);
                Some(true)
            }
            Attempt::Err { message, .. } => {
                self.push(
                    s,
                    id,
                    label,
                    Value::Bool(false),
                    format!("{what}: {message}"),
                );
                Some(false)
            }
        }
    }

    fn file_item(&mut self, id: &str, label: &str, path: &str, missing: &str) {
        let s = Section::Kernel;
        match self.f.files.get(path) {
            Some(FileRead::Ok(c)) => {
                let c = c.trim().to_owned();
                let v = c.parse::<i64>().map_or(Value::Text(c.clone()), Value::Int);
                self.push(s, id, label, v, path.to_owned());
            }
            Some(FileRead::Missing) => self.push(
                s,
                id,
                label,
                Value::unknown(format!("{path} does not exist: {missing}")),
                String::new(),
            ),
            Some(FileRead::Error(e)) => self.push(
                s,
                id,
                label,
                Value::unknown(format!("{path}: {e}")),
                String::new(),
            ),
            None => self.push(
                s,
                id,
                label,
                Value::unknown(format!("{path} not recorded")),
                String::new(),
            ),
        }
    }

    fn kernel(&mut self) {
        let s = Section::Kernel;
        let a = self.f.memfd_secret.clone();
        self.attempt_item(
            "kernel.memfd_secret",
            "memfd_secret works (one page created, mapped, touched)",
            &a,
            "memfd_secret(2) + ftruncate + mmap + write/read",
        );
        let a = self.f.userfaultfd_syscall.clone();
        self.attempt_item(
            "kernel.userfaultfd.syscall",
            "userfaultfd(2) for all faults",
            &a,
            "userfaultfd(O_CLOEXEC|O_NONBLOCK) + UFFDIO_API",
        );
        let a = self.f.userfaultfd_user_mode_only.clone();
        self.attempt_item(
            "kernel.userfaultfd.user_mode_only",
            "userfaultfd(2) with UFFD_USER_MODE_ONLY",
            &a,
            "userfaultfd(UFFD_USER_MODE_ONLY) + UFFDIO_API",
        );
        let a = self.f.userfaultfd_dev.clone();
        self.attempt_item(
            "kernel.userfaultfd.dev",
            "/dev/userfaultfd usable",
            &a,
            "open /dev/userfaultfd + USERFAULTFD_IOC_NEW + UFFDIO_API",
        );
        self.file_item(
            "kernel.unprivileged_userfaultfd",
            "vm.unprivileged_userfaultfd",
            "/proc/sys/vm/unprivileged_userfaultfd",
            "kernel older than 5.2 or without userfaultfd",
        );
        let a = self.f.kvm.clone();
        self.attempt_item(
            "kernel.kvm",
            "/dev/kvm usable (KVM_GET_API_VERSION)",
            &a,
            "open /dev/kvm + KVM_GET_API_VERSION",
        );
        match self.f.memlock {
            Some((soft, hard)) => {
                let show = |v: u64| {
                    if v == u64::MAX {
                        "unlimited".to_owned()
                    } else {
                        format!("{} KiB", v / 1024)
                    }
                };
                let m = |v: u64| {
                    if v == u64::MAX {
                        Value::Int(-1)
                    } else {
                        int(v)
                    }
                };
                self.push(
                    s,
                    "kernel.memlock_soft",
                    "RLIMIT_MEMLOCK soft, bytes (-1 unlimited)",
                    m(soft),
                    format!("getrlimit(RLIMIT_MEMLOCK): soft {}", show(soft)),
                );
                self.push(
                    s,
                    "kernel.memlock_hard",
                    "RLIMIT_MEMLOCK hard, bytes (-1 unlimited)",
                    m(hard),
                    format!("getrlimit(RLIMIT_MEMLOCK): hard {}", show(hard)),
                );
            }
            None => self.push(
                s,
                "kernel.memlock_soft",
                "RLIMIT_MEMLOCK soft",
                Value::unknown("not recorded"),
                String::new(),
            ),
        }
        if let Some(u) = self.f.euid {
            self.push(
                s,
                "kernel.probe_as_root",
                "Probe ran as root (MSRs and a restricted kernel log need it)",
                Value::Bool(u == 0),
                format!("geteuid() = {u}"),
            );
        }
        if let Some(c) = self.f.cap_eff {
            self.push(
                s,
                "kernel.cap_ipc_lock",
                "CAP_IPC_LOCK (lifts RLIMIT_MEMLOCK)",
                Value::Bool(bit(c, 14)),
                format!("/proc/self/status CapEff={c:#x} bit 14"),
            );
        }
        self.file_item(
            "kernel.core_pattern",
            "kernel.core_pattern",
            "/proc/sys/kernel/core_pattern",
            "no procfs",
        );
        self.file_item(
            "kernel.suid_dumpable",
            "fs.suid_dumpable",
            "/proc/sys/fs/suid_dumpable",
            "no procfs",
        );
        self.file_item(
            "kernel.ptrace_scope",
            "Yama ptrace_scope",
            "/proc/sys/kernel/yama/ptrace_scope",
            "Yama is not built in or not enabled (classic ptrace rules)",
        );
        self.swap();
    }

    /// Whether the block device `majmin` is (or sits on) dm-crypt.
    fn dm_crypt_chain(&self, majmin: &str, depth: u32) -> Option<(bool, String)> {
        if depth > 8 {
            return None;
        }
        let base = format!("/sys/dev/block/{majmin}");
        let uuid = self.f.file(&format!("{base}/dm/uuid"));
        match uuid {
            Some(u) if u.starts_with("CRYPT-") => Some((true, format!("{base}/dm/uuid = {u}"))),
            Some(u) => {
                // A device-mapper device of another kind (LVM...): look below.
                let slaves = match self.f.dirs.get(&format!("{base}/slaves")) {
                    Some(FileRead::Ok(s)) => s.lines().map(str::to_owned).collect::<Vec<_>>(),
                    _ => Vec::new(),
                };
                for sl in slaves {
                    if let Some(mm) = self.f.file(&format!("/sys/class/block/{sl}/dev")) {
                        if let Some((true, how)) = self.dm_crypt_chain(mm.trim(), depth + 1) {
                            return Some((true, format!("{base}/dm/uuid = {u}, on {sl}: {how}")));
                        }
                    }
                }
                Some((
                    false,
                    format!("{base}/dm/uuid = {u} (no CRYPT- device below)"),
                ))
            }
            None => Some((false, format!("{base} is not a device-mapper device"))),
        }
    }

    fn swap(&mut self) {
        let s = Section::Kernel;
        let Some(text) = self.f.file("/proc/swaps").map(str::to_owned) else {
            let why = match self.f.files.get("/proc/swaps") {
                Some(FileRead::Missing) => {
                    "/proc/swaps does not exist (kernel without swap support?)".to_owned()
                }
                Some(FileRead::Error(e)) => format!("/proc/swaps: {e}"),
                _ => "/proc/swaps not recorded".to_owned(),
            };
            self.push(
                s,
                "kernel.swap",
                "Swap in use",
                Value::unknown(why),
                String::new(),
            );
            return;
        };
        let entries: Vec<(String, String)> = text
            .lines()
            .skip(1)
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                Some((w.next()?.to_owned(), w.next()?.to_owned()))
            })
            .collect();
        self.push(
            s,
            "kernel.swap",
            "Swap areas in use",
            int(entries.len() as u64),
            "/proc/swaps".to_owned(),
        );
        let mut all = Some(true);
        let mut hows = Vec::new();
        for (name, kind) in &entries {
            let dev_name = name.trim_start_matches("/dev/");
            if dev_name.starts_with("zram") {
                hows.push(format!(
                    "{name}: zram (compressed RAM, never written to disk)"
                ));
                continue;
            }
            let Some(mm) = self.f.swap_devices.get(name).cloned() else {
                all = None;
                hows.push(format!("{name} ({kind}): block device not recorded"));
                continue;
            };
            match self.dm_crypt_chain(&mm, 0) {
                Some((true, how)) => hows.push(format!("{name} ({kind}) on {mm}: {how}")),
                Some((false, how)) => {
                    if all.is_some() {
                        all = Some(false);
                    }
                    hows.push(format!("{name} ({kind}) on {mm}: {how}"));
                }
                None => all = None,
            }
        }
        let v = if entries.is_empty() {
            Value::Text("no swap".to_owned())
        } else {
            match all {
                Some(b) => Value::Bool(b),
                None => Value::unknown(hows.join("; ")),
            }
        };
        self.push(
            s,
            "kernel.swap_encrypted",
            "All swap encrypted (dm-crypt) or in RAM (zram)",
            v,
            if hows.is_empty() {
                "/proc/swaps lists no swap area".to_owned()
            } else {
                hows.join("; ")
            },
        );
    }

    fn value(&self, id: &str) -> Option<&Value> {
        self.items.iter().find(|i| i.id == id).map(|i| &i.value)
    }

    fn bool_of(&self, id: &str) -> Option<bool> {
        self.value(id).and_then(Value::as_bool)
    }

    fn int_of(&self, id: &str) -> Option<i64> {
        match self.value(id) {
            Some(Value::Int(i)) => Some(*i),
            _ => None,
        }
    }

    #[allow(clippy::too_many_lines)]
    fn checks(&self, tme: &TmeVerdict, amd: &AmdVerdict, guest: &GuestVerdict) -> Vec<Check> {
        let mut out = Vec::new();
        let mut add = |id: &str, status: Status, summary: String, action: &str| {
            out.push(Check {
                id: id.to_owned(),
                status,
                summary,
                action: action.to_owned(),
            });
        };

        // Hardware memory encryption.
        let (st, sum, act): (Status, String, &str) = if let Some(c) = &guest.confidential {
            (
                Status::Pass,
                format!("confidential guest: memory encrypted against the host by {c}"),
                "",
            )
        } else if tme.enabled == Some(true) && tme.bypass {
            (Status::Warn, format!("Intel TME enabled but with encryption bypass (IA32_TME_ACTIVATE bit 31): memory under KeyID 0 is NOT encrypted ({})", tme.how), "turn off \"TME bypass\" in the BIOS setup if all memory should be encrypted")
        } else if tme.enabled == Some(true) {
            (
                Status::Pass,
                format!(
                    "Intel TME active ({}){}",
                    tme.how,
                    tme.keyid_bits
                        .filter(|b| *b > 0)
                        .map(|b| format!(
                            ", TME-MK with {b} KeyID bits ({} KeyIDs)",
                            (1u64 << b.min(15)) - 1
                        ))
                        .unwrap_or_default()
                ),
                "",
            )
        } else if amd.sme_active == Some(true) || amd.tsme_active == Some(true) {
            let what = match (amd.sme_active, amd.tsme_active) {
                (Some(true), Some(true)) => "AMD SME and TSME active (SME is redundant under TSME)",
                (Some(true), _) => "AMD SME active",
                _ => "AMD TSME active",
            };
            (Status::Pass, what.to_owned(), "")
        } else if guest.hypervisor {
            (
                Status::Warn,
                "guest without SEV/TDX: the host's memory encryption (if any) cannot be seen from inside this VM, and the host can read this guest's memory".to_owned(),
                "ask the provider whether hosts run TME/TSME, or use a confidential VM (SEV-SNP, TDX); memveil's software engine (memveil run) keeps protected pages encrypted meanwhile",
            )
        } else if tme.cpuid && tme.enabled.is_none() {
            (Status::Warn, format!("CPU supports TME but whether it is on is unknown: {}", tme.unknown_why), "run as root with the msr module loaded (memveil probe --load-msr), or read the boot log with journalctl -k -b")
        } else if tme.cpuid {
            (Status::Warn, format!("CPU supports TME but it is off ({})", tme.how), "enable \"Total Memory Encryption\" (and Multi-Tenant/TME-MK if wanted) in the BIOS setup, then reboot")
        } else if amd.sme_cpuid && (amd.sme_active.is_none() || amd.tsme_active.is_none()) {
            (Status::Warn, format!("CPU supports SME; whether SME/TSME is on is not fully known: {}", if amd.unknown_why.is_empty() { "TSME status not reported by the PSP" } else { &amd.unknown_why }), "load the msr module and run as root (memveil probe --load-msr) to read SYSCFG; enable TSME in the BIOS, or boot with mem_encrypt=on for SME")
        } else if amd.sme_cpuid {
            (Status::Warn, "CPU supports SME but neither SME nor TSME is on".to_owned(), "enable TSME in the BIOS setup (all memory), or SME (\"SMEE\") in the BIOS and boot with mem_encrypt=on")
        } else {
            (Status::Warn, "no hardware memory encryption on this CPU".to_owned(), "memveil's software engine (memveil run) keeps protected pages encrypted in RAM instead")
        };
        add("memory-encryption", st, sum, act);

        if tme.inconsistent {
            add("tme-consistency", Status::Fail, "IA32_TME_ACTIVATE differs between CPUs (or the kernel said so): TME-MK is not usable".to_owned(), "update the BIOS; report the platform to its vendor");
        }

        // RNG instructions.
        for (src, cpuid_id, insn) in [
            ("rdrand", "cpu.rdrand", "RDRAND"),
            ("rdseed", "cpu.rdseed", "RDSEED"),
        ] {
            let present = self.bool_of(cpuid_id);
            let sample = self.f.rng.iter().find(|r| r.source == src);
            let (st, sum, act) = match (present, sample) {
                (Some(false), _) => (Status::Warn, format!("{insn} absent (CPUID)"), "the entropy service falls back to getrandom(2) only when told to (--source getrandom)"),
                (_, Some(r)) if r.available && r.passed => (Status::Pass, format!("{insn} present; {} live samples passed the SP 800-90B RCT (C={}) and APT (W={}, C={})", r.samples, r.rct_cutoff, r.apt_window, r.apt_cutoff), ""),
                (_, Some(r)) if r.available => (Status::Fail, format!("{insn} advertised but the live sample failed: {}", r.error.clone().unwrap_or_else(|| "health test failed".to_owned())), "do not use it as an entropy source: update the microcode/BIOS (known cases: AMD family 15h/16h/17h returning all-ones after resume), and run memveil rng with --source getrandom"),
                (_, Some(r)) => (Status::Warn, format!("{insn} not usable: {}", r.error.clone().unwrap_or_default()), ""),
                (Some(true), None) => (Status::Warn, format!("{insn} present but not sampled"), "run memveil probe without --replay to take a live sample"),
                (None, None) => (Status::Warn, format!("{insn}: unknown"), ""),
            };
            add(src, st, sum, act);
        }

        // AES.
        let aes = self.bool_of("cpu.aes_ni");
        let vaes = self.bool_of("cpu.vaes").unwrap_or(false)
            && self.bool_of("cpu.vpclmulqdq").unwrap_or(false);
        let path = self
            .f
            .cipher_path
            .as_ref()
            .map(|c| format!("; memveil runs its {} path", c.path))
            .unwrap_or_default();
        match aes {
            Some(true) => add(
                "aes-ni",
                Status::Pass,
                format!(
                    "AES-NI present{}{path}",
                    if vaes {
                        ", VAES and VPCLMULQDQ present (wide kernels: two blocks per instruction)"
                    } else {
                        "; VAES/VPCLMULQDQ absent (128-bit AES-NI kernels)"
                    }
                ),
                "",
            ),
            Some(false) => add(
                "aes-ni",
                Status::Warn,
                "AES-NI absent: software AES is much slower".to_owned(),
                "expect the engine and vault to be several times slower; prefer hosts with AES-NI",
            ),
            None => add("aes-ni", Status::Warn, "AES-NI unknown".to_owned(), ""),
        }

        // memfd_secret.
        match &self.f.memfd_secret {
            Attempt::Ok { .. } => add(
                "memfd-secret",
                Status::Pass,
                "memfd_secret works: the vault keeps keys out of the kernel's direct map"
                    .to_owned(),
                "",
            ),
            Attempt::Err { errno, message } => {
                let act = match errno {
                    Some(38) => "boot a kernel with CONFIG_SECRETMEM (5.14+); on 5.14–6.4 also add secretmem.enable=1 to the kernel command line; or start the vault with --allow-level=locked to accept mlock-only protection",
                    Some(11) | Some(12) => "raise RLIMIT_MEMLOCK (ulimit -l, or LimitMEMLOCK= in the unit)",
                    _ => "see the error; the vault refuses to start without it unless --allow-level=locked is given",
                };
                add(
                    "memfd-secret",
                    Status::Fail,
                    format!("memfd_secret unavailable: {message}"),
                    act,
                );
            }
            Attempt::NotTried => add(
                "memfd-secret",
                Status::Warn,
                "memfd_secret not tried".to_owned(),
                "",
            ),
        }

        // userfaultfd.
        let full = self.bool_of("kernel.userfaultfd.syscall") == Some(true)
            || self.bool_of("kernel.userfaultfd.dev") == Some(true);
        let umo = self.bool_of("kernel.userfaultfd.user_mode_only") == Some(true);
        if full {
            add(
                "userfaultfd",
                Status::Pass,
                "userfaultfd usable by this user for all faults".to_owned(),
                "",
            );
        } else if umo {
            add("userfaultfd", Status::Pass, "userfaultfd usable for user-mode faults only (UFFD_USER_MODE_ONLY); kernel-mode faults (system calls on protected buffers) need the SIGSEGV path".to_owned(), "");
        } else {
            add("userfaultfd", Status::Warn, "userfaultfd not usable by this user".to_owned(), "sysctl vm.unprivileged_userfaultfd=1, or give the user access to /dev/userfaultfd (Linux 6.1+); memveil run falls back to mprotect+SIGSEGV");
        }

        // KVM.
        match &self.f.kvm {
            Attempt::Ok { value } => add("kvm", Status::Pass, format!("/dev/kvm usable (API version {})", value.unwrap_or(0)), ""),
            Attempt::Err { message, .. } => add("kvm", Status::Warn, format!("/dev/kvm not usable: {message}"), "load kvm_intel/kvm_amd and add the user to group kvm; guest tests run under QEMU TCG meanwhile"),
            Attempt::NotTried => add("kvm", Status::Warn, "/dev/kvm not tried".to_owned(), ""),
        }

        // RLIMIT_MEMLOCK.
        let cap = self.bool_of("kernel.cap_ipc_lock") == Some(true);
        match self.f.memlock {
            Some((soft, _)) if soft == u64::MAX || cap => add("memlock", Status::Pass, format!("locked memory unlimited ({})", if cap { "CAP_IPC_LOCK" } else { "RLIMIT_MEMLOCK=unlimited" }), ""),
            Some((soft, _)) if soft >= 8 << 20 => add("memlock", Status::Pass, format!("RLIMIT_MEMLOCK {} KiB", soft / 1024), ""),
            Some((soft, _)) => add("memlock", Status::Warn, format!("RLIMIT_MEMLOCK only {} KiB: secret memory counts against it", soft / 1024), "raise it: ulimit -l, /etc/security/limits.conf memlock, or LimitMEMLOCK= in the systemd unit"),
            None => add("memlock", Status::Warn, "RLIMIT_MEMLOCK unknown".to_owned(), ""),
        }

        // Core dumps.
        let pattern = self
            .f
            .file("/proc/sys/kernel/core_pattern")
            .map(str::to_owned);
        let suid = self.int_of("kernel.suid_dumpable");
        match (pattern, suid) {
            (_, Some(1)) => add("core-dumps", Status::Warn, "fs.suid_dumpable=1: even privileged processes dump core readable by their user".to_owned(), "sysctl fs.suid_dumpable=0"),
            (Some(p), _) if p.starts_with("|/bin/false") || p.starts_with("|/usr/bin/false") || p.starts_with("|/bin/true") => add("core-dumps", Status::Pass, format!("core dumps discarded (core_pattern \"{p}\")"), ""),
            (Some(p), _) => add("core-dumps", Status::Warn, format!("core dumps are written (core_pattern \"{p}\"): memory of crashing processes reaches disk"), "memveil's vault sets PR_SET_DUMPABLE=0 and RLIMIT_CORE=0 itself; for other processes set kernel.core_pattern=|/bin/false or systemd-coredump Storage=none"),
            (None, _) => add("core-dumps", Status::Warn, "core_pattern unknown".to_owned(), ""),
        }

        // ptrace.
        match self.int_of("kernel.ptrace_scope") {
            Some(0) => add("ptrace", Status::Warn, "Yama ptrace_scope=0: any process may ptrace others of the same user".to_owned(), "sysctl kernel.yama.ptrace_scope=1 (or 2); memveil's vault also makes itself non-dumpable"),
            Some(n) => add("ptrace", Status::Pass, format!("Yama ptrace_scope={n}"), ""),
            None => add("ptrace", Status::Warn, "Yama not active: classic ptrace rules (same user may attach to dumpable processes)".to_owned(), "boot with Yama (CONFIG_SECURITY_YAMA, lsm=...,yama) and set kernel.yama.ptrace_scope=1; memveil's vault makes itself non-dumpable meanwhile"),
        }

        // Swap.
        match self.value("kernel.swap_encrypted") {
            Some(Value::Text(t)) if t == "no swap" => add("swap", Status::Pass, "no swap in use".to_owned(), ""),
            Some(Value::Bool(true)) => add("swap", Status::Pass, "all swap is encrypted (dm-crypt) or in RAM (zram)".to_owned(), ""),
            Some(Value::Bool(false)) => add("swap", Status::Warn, "swap in use that is not encrypted: pages of ordinary memory can reach disk in the clear".to_owned(), "put swap on dm-crypt (a random key per boot is enough: crypttab \"swap\" option) or use zram; secret and locked memory is never swapped"),
            _ => add("swap", Status::Warn, "whether swap is encrypted is unknown".to_owned(), "check /proc/swaps and the dm-crypt mapping by hand (dmsetup table)"),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_stripped() {
        assert_eq!(
            strip_timestamp("[    0.000000] x86/tme: enabled by BIOS"),
            "x86/tme: enabled by BIOS"
        );
        assert_eq!(
            strip_timestamp("x86/tme: enabled by BIOS"),
            "x86/tme: enabled by BIOS"
        );
        assert_eq!(strip_timestamp("[abc] x"), "[abc] x");
    }

    #[test]
    fn numbers_in_log_lines() {
        assert_eq!(
            number_before("x86/mktme: 63 KeyIDs available", "KeyIDs available"),
            Some(63)
        );
        assert_eq!(
            number_after(
                "x86/mktme: BIOS enabled: x86_phys_bits reduced by 6",
                "reduced by"
            ),
            Some(6)
        );
        assert_eq!(
            number_after("x86_phys_bits reduced by x", "reduced by"),
            None
        );
        assert_eq!(
            number_before("46 bits physical, 48 bits virtual", "bits physical"),
            Some(46)
        );
    }

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
