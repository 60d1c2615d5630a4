//! The checks: pass, warn or fail for each question, from the items
//! decoded before, with what to do.

use super::{AmdVerdict, Decoder, GuestVerdict, TmeVerdict};
use crate::facts::Attempt;
use crate::report::{Check, Status, Value};

impl Decoder<'_> {
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
    pub(super) fn checks(
        &self,
        tme: &TmeVerdict,
        amd: &AmdVerdict,
        guest: &GuestVerdict,
    ) -> Vec<Check> {
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
