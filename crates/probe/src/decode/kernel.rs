//! What the kernel offers: `memfd_secret`, userfaultfd, `/dev/kvm`, the
//! memlock limits, core dumps and ptrace scope (sysctls and files), and
//! whether swap is encrypted.

use super::{bit, int, Decoder};
use crate::facts::{Attempt, FileRead};
use crate::report::{Section, Value};

impl Decoder<'_> {
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

    pub(super) fn kernel(&mut self) {
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
}
