//! The live collector: gathers [`HostFacts`] on this machine. It decides
//! nothing; [`crate::decode()`] does. All unsafe operations (CPUID, MSR reads,
//! system calls) go through `memveil-sys`.

use std::collections::BTreeMap;
use std::io::{self, Read as _};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::Path;
use std::process::Command;

use memveil_drng::SourceKind;
use memveil_sys::probe as sysprobe;

use crate::decode::{MSR_AMD_SEV_STATUS, MSR_AMD_SYSCFG, MSR_TME_ACTIVATE, MSR_TME_CAPABILITY};
use crate::facts::{
    Attempt, CipherPath, CpuidRecord, FileRead, HostFacts, KernelLog, MsrAccess, MsrRecord,
    RngSample, Text, SCHEMA,
};

/// What the collector may do beyond reading.
#[derive(Debug, Clone, Copy)]
pub struct CollectOptions {
    /// Run `modprobe msr` when `/dev/cpu/0/msr` is missing.
    pub load_msr: bool,
    /// 64-bit samples of each RNG instruction for the health tests.
    pub rng_samples: usize,
    /// Run programs (`modprobe`, `dmesg`, `journalctl`) when reading is not
    /// enough; false under `probe --serve`'s seccomp filter, which allows no
    /// `execve` (the kernel log is then `/dev/kmsg` alone).
    pub run_commands: bool,
}

impl Default for CollectOptions {
    fn default() -> Self {
        Self {
            load_msr: false,
            rng_samples: 4096,
            run_commands: true,
        }
    }
}

/// Gathers the facts of this host.
#[must_use]
pub fn collect(opts: &CollectOptions) -> HostFacts {
    let mut f = HostFacts {
        schema: SCHEMA,
        description: "live probe of this host".to_owned(),
        sources: vec!["live: memveil probe".to_owned()],
        ..HostFacts::default()
    };
    f.kernel_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|s| s.trim().to_owned());
    cpuid(&mut f);
    msrs(&mut f, opts.load_msr && opts.run_commands);
    f.cpuinfo = cpuinfo();
    f.kernel_log = kernel_log(opts.run_commands);
    files(&mut f);
    swap(&mut f);
    f.rng = [SourceKind::Rdrand, SourceKind::Rdseed]
        .into_iter()
        .map(|k| rng(k, opts.rng_samples))
        .collect();
    f.memfd_secret = Attempt::from_io(&sysprobe::try_memfd_secret(), |()| None);
    let feat = |v: &u64| i64::try_from(*v).ok();
    f.userfaultfd_syscall = Attempt::from_io(&sysprobe::try_userfaultfd(0), feat);
    f.userfaultfd_user_mode_only = Attempt::from_io(
        &sysprobe::try_userfaultfd(sysprobe::UFFD_USER_MODE_ONLY),
        feat,
    );
    f.userfaultfd_dev = Attempt::from_io(&sysprobe::try_dev_userfaultfd(), feat);
    f.kvm = Attempt::from_io(&sysprobe::kvm_api_version(), |v| Some(i64::from(*v)));
    f.memlock = memveil_sys::process::memlock_limit().ok();
    f.euid = Some(sysprobe::euid());
    f.cap_eff = memveil_sys::process::effective_caps();
    f.cipher_path = Some(cipher_path());
    f
}

fn cipher_path() -> CipherPath {
    use memveil_cipher::Path;
    let p = memveil_cipher::path();
    CipherPath {
        path: p.name().to_owned(),
        detail: p.describe().to_owned(),
        note: memveil_cipher::path_note().map(str::to_owned),
        cannot_run: Path::ALL
            .into_iter()
            .filter(|q| !q.supported())
            .map(|q| format!("{q} (lacks {})", q.missing().join(", ")))
            .collect(),
    }
}

fn cpuid(f: &mut HostFacts) {
    let Some(l0) = memveil_sys::cpuid(0, 0) else {
        return;
    };
    f.cpuid_available = true;
    let mut rec = |leaf: u32, sub: u32| {
        if let Some(r) = memveil_sys::cpuid(leaf, sub) {
            f.cpuid.push(CpuidRecord {
                leaf,
                subleaf: sub,
                eax: r.eax,
                ebx: r.ebx,
                ecx: r.ecx,
                edx: r.edx,
            });
            Some(r)
        } else {
            None
        }
    };
    rec(0, 0);
    let max = l0.eax;
    let l1 = if max >= 1 { rec(1, 0) } else { None };
    if max >= 7 {
        rec(7, 0);
    }
    let intel = l0.ebx == u32::from_le_bytes(*b"Genu");
    if intel && max >= 0x21 {
        // TDX guests enumerate "IntelTDX    " here.
        rec(0x21, 0);
    }
    if l1.is_some_and(|r| r.ecx >> 31 & 1 == 1) {
        rec(0x4000_0000, 0);
    }
    if let Some(e) = rec(0x8000_0000, 0) {
        if e.eax >= 0x8000_0008 {
            rec(0x8000_0008, 0);
        }
        if e.eax >= 0x8000_001F {
            rec(0x8000_001F, 0);
        }
    }
}

fn msr_cpus() -> Vec<u32> {
    let mut v: Vec<u32> = std::fs::read_dir("/dev/cpu")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
                .collect()
        })
        .unwrap_or_default();
    v.sort_unstable();
    v
}

fn msrs(f: &mut HostFacts, load: bool) {
    if !f.cpuid_available {
        return;
    }
    let dev0 = Path::new("/dev/cpu/0/msr");
    if !dev0.exists() && load {
        match Command::new("modprobe").arg("msr").output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                f.msr_access = MsrAccess::ModprobeFailed(format!(
                    "{} {}",
                    o.status,
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
                return;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                f.msr_access = MsrAccess::ModprobeFailed(
                    "modprobe not found (install kmod, or load the msr module another way)"
                        .to_owned(),
                );
                return;
            }
            Err(e) => {
                f.msr_access = MsrAccess::ModprobeFailed(format!("could not run modprobe: {e}"));
                return;
            }
        }
    }
    match std::fs::File::open(dev0) {
        Ok(_) => f.msr_access = MsrAccess::Readable,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            f.msr_access = if load {
                MsrAccess::ModprobeFailed(
                    "modprobe msr succeeded but /dev/cpu/0/msr is still missing".to_owned(),
                )
            } else {
                MsrAccess::NotLoaded
            };
            return;
        }
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            f.msr_access = MsrAccess::PermissionDenied;
            return;
        }
        Err(e) => {
            f.msr_access = MsrAccess::Error(e.to_string());
            return;
        }
    }
    let regs = msr_plan(f);
    let cpus = msr_cpus();
    for (msr, all_cpus) in regs {
        for &cpu in &cpus {
            if cpu != 0 && !all_cpus {
                continue;
            }
            let r = memveil_sys::read_msr(cpu, msr);
            f.msr.push(MsrRecord {
                cpu,
                msr,
                value: r.as_ref().ok().copied(),
                error: r.err().map(|e| e.to_string()),
            });
        }
    }
}

/// Which MSRs to read, from the recorded CPUID: `(register, on every CPU)`.
/// Only registers CPUID enumerates are read (reading others gives EIO, and
/// inside a guest may be logged by the hypervisor).
#[must_use]
pub fn msr_plan(f: &HostFacts) -> Vec<(u32, bool)> {
    let bit = |leaf: u32, reg: fn(&CpuidRecord) -> u32, n: u32| {
        f.cpuid(leaf, 0).is_some_and(|r| reg(&r) >> n & 1 == 1)
    };
    let tme = bit(7, |r| r.ecx, 13);
    let sme = bit(0x8000_001F, |r| r.eax, 0);
    let sev = bit(0x8000_001F, |r| r.eax, 1);
    let guest = bit(1, |r| r.ecx, 31);
    let mut regs: Vec<(u32, bool)> = Vec::new();
    if tme {
        regs.push((MSR_TME_CAPABILITY, false));
        regs.push((MSR_TME_ACTIVATE, true));
    }
    // SYSCFG describes the host; inside a guest it is the hypervisor's
    // fiction (and under SEV-ES every access is a round trip to it).
    if (sme || sev) && !guest {
        regs.push((MSR_AMD_SYSCFG, true));
    }
    if sev && guest {
        regs.push((MSR_AMD_SEV_STATUS, false));
    }
    regs
}

fn cpuinfo() -> Text {
    let path = "/proc/cpuinfo";
    match std::fs::read_to_string(path) {
        // The first processor's block is enough (flags are per CPU but equal).
        Ok(s) => Text {
            source: path.to_owned(),
            lines: Some(
                s.lines()
                    .take_while(|l| !l.trim().is_empty())
                    .map(str::to_owned)
                    .collect(),
            ),
            error: None,
        },
        Err(e) => Text {
            source: path.to_owned(),
            lines: None,
            error: Some(e.to_string()),
        },
    }
}

/// One `/dev/kmsg` record, `"prio,seq,usec,flags[,..];message\n"` followed by
/// optional continuation lines `" KEY=value"` (Documentation/ABI/testing/
/// dev-kmsg): the sequence number and the message.
#[must_use]
pub fn parse_kmsg_record(rec: &str) -> Option<(Option<u64>, String)> {
    let (head, msg) = rec.split_once(';')?;
    let seq = head
        .split(',')
        .nth(1)
        .and_then(|s| s.trim().parse::<u64>().ok());
    let msg = msg.lines().next().unwrap_or("");
    Some((seq, msg.to_owned()))
}

/// Reads `/dev/kmsg` without blocking: one record per read, EAGAIN at the end.
fn read_kmsg() -> io::Result<(Vec<String>, bool)> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")?;
    let mut buf = vec![0u8; 16 * 1024];
    let mut lines = Vec::new();
    let mut first_seq = None;
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let Some((seq, msg)) = parse_kmsg_record(&String::from_utf8_lossy(&buf[..n]))
                else {
                    continue;
                };
                if first_seq.is_none() {
                    first_seq = seq;
                }
                lines.push(msg);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            // EPIPE: the record we were about to read was overwritten.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok((lines, first_seq.is_some_and(|s| s > 0)))
}

fn command_lines(cmd: &str, args: &[&str]) -> Result<Vec<String>, String> {
    match Command::new(cmd).args(args).output() {
        Ok(o) if o.status.success() => {
            let s = String::from_utf8_lossy(&o.stdout);
            Ok(s.lines().map(str::to_owned).collect())
        }
        Ok(o) => Err(format!(
            "{cmd} {}: {} {}",
            args.join(" "),
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("{cmd}: {e}")),
    }
}

fn kernel_log(run_commands: bool) -> KernelLog {
    let mut errors = Vec::new();
    let journal = || {
        if !run_commands {
            return Err("journalctl: not run (no programs under --serve's seccomp filter)".into());
        }
        command_lines("journalctl", &["-k", "-b", "-o", "cat", "--no-pager", "-q"])
    };
    match read_kmsg() {
        Ok((lines, false)) => {
            return KernelLog {
                source: "/dev/kmsg".to_owned(),
                lines: Some(lines),
                wrapped: false,
                errors,
            }
        }
        Ok((lines, true)) => {
            // The ring buffer lost the boot messages: the journal may have them.
            match journal() {
                Ok(j) if !j.is_empty() => {
                    return KernelLog {
                        source: "journalctl -k -b".to_owned(),
                        lines: Some(j),
                        wrapped: false,
                        errors,
                    }
                }
                Ok(_) => errors.push("journalctl -k -b: no entries".to_owned()),
                Err(e) => errors.push(e),
            }
            return KernelLog {
                source: "/dev/kmsg".to_owned(),
                lines: Some(lines),
                wrapped: true,
                errors,
            };
        }
        Err(e) => errors.push(format!("/dev/kmsg: {e}")),
    }
    let dmesg = if run_commands {
        command_lines("dmesg", &[])
    } else {
        Err("dmesg: not run (no programs under --serve's seccomp filter)".into())
    };
    match dmesg {
        Ok(l) => {
            return KernelLog {
                source: "dmesg".to_owned(),
                lines: Some(l),
                wrapped: false,
                errors,
            }
        }
        Err(e) => errors.push(e),
    }
    match journal() {
        Ok(j) if !j.is_empty() => KernelLog {
            source: "journalctl -k -b".to_owned(),
            lines: Some(j),
            wrapped: false,
            errors,
        },
        Ok(_) => {
            errors.push("journalctl -k -b: no entries".to_owned());
            KernelLog {
                errors,
                ..KernelLog::default()
            }
        }
        Err(e) => {
            errors.push(e);
            KernelLog {
                errors,
                ..KernelLog::default()
            }
        }
    }
}

fn read_file(path: &str) -> FileRead {
    match std::fs::read_to_string(path) {
        Ok(s) => FileRead::Ok(s),
        Err(e) if e.kind() == io::ErrorKind::NotFound => FileRead::Missing,
        Err(e) => FileRead::Error(e.to_string()),
    }
}

fn record(f: &mut HostFacts, path: &str) {
    f.files.insert(path.to_owned(), read_file(path));
}

fn files(f: &mut HostFacts) {
    for p in [
        "/proc/sys/vm/unprivileged_userfaultfd",
        "/proc/sys/kernel/core_pattern",
        "/proc/sys/fs/suid_dumpable",
        "/proc/sys/kernel/yama/ptrace_scope",
        "/proc/swaps",
    ] {
        record(f, p);
    }
    // The PSP's security attributes (Linux 5.19+), on the ccp PCI device.
    if let Ok(d) = std::fs::read_dir("/sys/bus/pci/devices") {
        let mut paths: Vec<String> = d
            .filter_map(Result::ok)
            .map(|e| format!("{}/tsme_status", e.path().display()))
            .filter(|p| Path::new(p).exists())
            .collect();
        paths.sort();
        for p in paths {
            record(f, &p);
        }
    }
    // Attestation devices of confidential guests: existence only.
    for dev in ["/dev/sev-guest", "/dev/tdx_guest"] {
        let r = match std::fs::metadata(dev) {
            Ok(_) => FileRead::Ok(String::new()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => FileRead::Missing,
            Err(e) => FileRead::Error(e.to_string()),
        };
        f.files.insert(dev.to_owned(), r);
    }
}

/// Linux `dev_t` to "major:minor".
fn majmin(dev: u64) -> String {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    format!("{major}:{minor}")
}

fn record_dm_chain(f: &mut HostFacts, mm: &str, depth: u32, seen: &mut BTreeMap<String, ()>) {
    if depth > 8 || seen.insert(mm.to_owned(), ()).is_some() {
        return;
    }
    let base = format!("/sys/dev/block/{mm}");
    record(f, &format!("{base}/dm/uuid"));
    let slaves_dir = format!("{base}/slaves");
    if let Ok(d) = std::fs::read_dir(&slaves_dir) {
        let names: Vec<String> = d
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .collect();
        f.dirs.insert(slaves_dir, FileRead::Ok(names.join("\n")));
        for n in names {
            let devp = format!("/sys/class/block/{n}/dev");
            record(f, &devp);
            if let Some(sub) = f.file(&devp).map(|s| s.trim().to_owned()) {
                record_dm_chain(f, &sub, depth + 1, seen);
            }
        }
    }
}

fn swap(f: &mut HostFacts) {
    let Some(text) = f.file("/proc/swaps").map(str::to_owned) else {
        return;
    };
    let mut seen = BTreeMap::new();
    for l in text.lines().skip(1) {
        let mut w = l.split_whitespace();
        let (Some(name), Some(kind)) = (w.next(), w.next()) else {
            continue;
        };
        // /proc/swaps escapes spaces etc. as octal; paths with them are not
        // resolved (the decoder reports them as unknown).
        let Ok(md) = std::fs::metadata(name) else {
            continue;
        };
        let dev = if kind == "partition" {
            md.rdev()
        } else {
            md.dev()
        };
        let mm = majmin(dev);
        f.swap_devices.insert(name.to_owned(), mm.clone());
        record_dm_chain(f, &mm, 0, &mut seen);
    }
}

fn rng(kind: SourceKind, samples: usize) -> RngSample {
    let r = memveil_drng::sample_source(kind, samples);
    RngSample {
        source: kind.name().to_owned(),
        available: r.available,
        samples: r.samples,
        h_bits: r.h_bits,
        rct_cutoff: r.rct_cutoff,
        apt_window: r.apt_window,
        apt_cutoff: r.apt_cutoff,
        longest_run: r.longest_run,
        highest_apt_count: r.highest_apt_count,
        attempts: r.stats.attempts,
        failed_attempts: r.stats.failed_attempts,
        error: r
            .failure
            .as_ref()
            .map(ToString::to_string)
            .or(r.error.clone()),
        passed: r.passed,
    }
}

/// Turns raw 64-bit samples into an [`RngSample`] through the same SP 800-90B
/// tests as the live sample (`memveil_drng::health`), stopping at the first
/// failure. Used to check the decoding of a failing source.
#[must_use]
pub fn sample_from_values(source: &str, values: &[u64]) -> RngSample {
    let cfg = memveil_drng::HealthConfig::default();
    let mut t = memveil_drng::health::HealthTests::new(cfg);
    let mut error = None;
    for &x in values {
        if let Err(e) = t.feed(x) {
            error = Some(e.to_string());
            break;
        }
    }
    RngSample {
        source: source.to_owned(),
        available: true,
        samples: t.samples(),
        h_bits: cfg.h_bits,
        rct_cutoff: cfg.rct_cutoff(),
        apt_window: cfg.apt_window,
        apt_cutoff: cfg.apt_cutoff(),
        longest_run: t.longest_run(),
        highest_apt_count: t.highest_apt_count(),
        attempts: values.len() as u64,
        failed_attempts: 0,
        passed: error.is_none(),
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn majmin_matches_the_kernel_encoding() {
        // makedev(253, 1) and makedev(259, 300) as glibc encodes them.
        assert_eq!(majmin((253 << 8) | 1), "253:1");
        let dev = ((259u64 & 0xfff) << 8) | (300 & 0xff) | ((300u64 & !0xff) << 12);
        assert_eq!(majmin(dev), "259:300");
    }

    #[test]
    fn kmsg_records() {
        assert_eq!(
            parse_kmsg_record("6,339,5140900,-;x86/tme: enabled by BIOS\n"),
            Some((Some(339), "x86/tme: enabled by BIOS".to_owned()))
        );
        let r = parse_kmsg_record(
            "6,1024,8000,-;ccp 0000:c3:00.2: psp: TSME enabled\n SUBSYSTEM=pci\n DEVICE=+pci:0000:c3:00.2\n",
        );
        assert_eq!(
            r,
            Some((Some(1024), "ccp 0000:c3:00.2: psp: TSME enabled".to_owned()))
        );
        assert_eq!(parse_kmsg_record("garbage"), None);
        assert_eq!(parse_kmsg_record("x;msg"), Some((None, "msg".to_owned())));
    }

    #[test]
    fn msr_plan_follows_cpuid() {
        let rec = |leaf, eax, ecx| CpuidRecord {
            leaf,
            subleaf: 0,
            eax,
            ebx: 0,
            ecx,
            edx: 0,
        };
        let mut f = HostFacts::default();
        assert!(msr_plan(&f).is_empty());
        f.cpuid.push(rec(7, 0, 1 << 13));
        assert_eq!(
            msr_plan(&f),
            vec![(MSR_TME_CAPABILITY, false), (MSR_TME_ACTIVATE, true)]
        );
        let mut g = HostFacts::default();
        g.cpuid.push(rec(0x8000_001F, 0b11, 0));
        assert_eq!(msr_plan(&g), vec![(MSR_AMD_SYSCFG, true)]);
        g.cpuid.push(rec(1, 0, 1 << 31));
        assert_eq!(msr_plan(&g), vec![(MSR_AMD_SEV_STATUS, false)]);
    }

    #[test]
    fn stuck_values_fail_the_sample_check() {
        let ok: Vec<u64> = (0..1024u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        assert!(sample_from_values("rdrand", &ok).passed);
        let stuck = vec![u64::MAX; 16];
        let s = sample_from_values("rdrand", &stuck);
        assert!(!s.passed);
        assert!(s.error.unwrap_or_default().contains("Repetition Count"));
    }
}
