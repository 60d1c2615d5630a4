//! Intel TME and MKTME: CPUID, `IA32_TME_CAPABILITY`, `IA32_TME_ACTIVATE`
//! and the kernel's `x86/tme`, `x86/mktme` lines.

use super::log::{number_after, number_before};
use super::{bit, field, int, Decoder, TmeVerdict, MSR_TME_ACTIVATE, MSR_TME_CAPABILITY};
use crate::report::{Section, Value};

impl Decoder<'_> {
    #[allow(clippy::too_many_lines)]
    pub(super) fn intel_tme(&mut self) -> TmeVerdict {
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
}
