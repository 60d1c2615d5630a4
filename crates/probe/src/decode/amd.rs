//! AMD SME and TSME: CPUID 0x8000001F, `SYSCFG` and the kernel's lines
//! (`Memory Encryption Features active`, `psp: TSME enabled`).

use super::{bit, field, int, AmdVerdict, Decoder, MSR_AMD_SYSCFG};
use crate::facts::FileRead;
use crate::report::{Section, Value};

impl Decoder<'_> {
    #[allow(clippy::too_many_lines)]
    pub(super) fn amd_sme(&mut self) -> AmdVerdict {
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
}
