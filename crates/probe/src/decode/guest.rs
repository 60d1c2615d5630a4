//! Whether this is a guest, and a confidential one (SEV, SEV-ES, SEV-SNP,
//! TDX): the hypervisor bit and leaves, `SEV_STATUS`, the kernel's lines.

use super::{bit, Decoder, GuestVerdict, MSR_AMD_SEV_STATUS};
use crate::facts::{FileRead, MsrAccess};
use crate::report::{Section, Value};

impl Decoder<'_> {
    #[allow(clippy::too_many_lines)]
    pub(super) fn guest(&mut self) -> GuestVerdict {
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
}
