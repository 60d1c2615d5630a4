//! The CPU (vendor, signature, model, address bits, MSR access) and its
//! instructions (AES-NI, VAES, (V)PCLMULQDQ, AVX-512, RDRAND and RDSEED with
//! the live health sample, the AES path in use).

use super::log::number_before;
use super::{field, int, CpuidBit, Decoder};
use crate::facts::MsrAccess;
use crate::report::{Item, Section, Value};

impl Decoder<'_> {
    pub(super) fn cpu(&mut self) {
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

    pub(super) fn instructions(&mut self) {
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
}
