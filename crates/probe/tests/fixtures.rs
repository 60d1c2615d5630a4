//! Decoding of recorded hosts. Each fixture under `tests/fixtures/` cites,
//! in its `sources` field, the register layouts and kernel sources its values
//! were built from; `this-machine.json` was recorded live on the build VM.

use std::collections::BTreeSet;

use memveil_probe::facts::{FileRead, KernelLog, MsrAccess, MsrRecord};
use memveil_probe::{decode, render, HostFacts, Report, Status, Value};

fn load(name: &str) -> HostFacts {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    HostFacts::from_json(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn val<'a>(r: &'a Report, id: &str) -> &'a Value {
    &r.item(id).unwrap_or_else(|| panic!("no item {id}")).value
}

fn yes(r: &Report, id: &str) -> bool {
    match val(r, id) {
        Value::Bool(b) => *b,
        v => panic!("{id} is not a yes/no: {v:?}"),
    }
}

fn num(r: &Report, id: &str) -> i64 {
    match val(r, id) {
        Value::Int(i) => *i,
        v => panic!("{id} is not a number: {v:?}"),
    }
}

fn text<'a>(r: &'a Report, id: &str) -> &'a str {
    match val(r, id) {
        Value::Text(t) => t,
        v => panic!("{id} is not text: {v:?}"),
    }
}

fn status(r: &Report, id: &str) -> Status {
    r.check(id)
        .unwrap_or_else(|| panic!("no check {id}"))
        .status
}

const ALL: [&str; 6] = [
    "icelake-tme-mk-enabled.json",
    "icelake-tme-disabled.json",
    "epyc-sme-active.json",
    "tsme-only.json",
    "sev-snp-guest.json",
    "this-machine.json",
];

#[test]
fn every_fixture_cites_its_sources_and_every_item_says_how_or_why() {
    for name in ALL {
        let f = load(name);
        assert!(!f.sources.is_empty(), "{name}: no sources");
        assert!(!f.description.is_empty(), "{name}: no description");
        let r = decode(&f);
        let mut ids = BTreeSet::new();
        for it in &r.items {
            assert!(
                ids.insert(it.id.clone()),
                "{name}: duplicate item {}",
                it.id
            );
            match &it.value {
                Value::Unknown { unknown } => assert!(
                    !unknown.is_empty(),
                    "{name}: {} unknown without reason",
                    it.id
                ),
                _ => assert!(
                    !it.how.is_empty(),
                    "{name}: {} known without evidence",
                    it.id
                ),
            }
        }
        for c in &r.checks {
            if c.status != Status::Pass {
                assert!(!c.summary.is_empty(), "{name}: {}", c.id);
            }
        }
    }
}

#[test]
fn icelake_with_tme_mk_enabled() {
    let r = decode(&load("icelake-tme-mk-enabled.json"));
    assert!(yes(&r, "intel.tme.cpuid"));
    assert!(yes(&r, "intel.pconfig.cpuid"));
    assert!(yes(&r, "intel.tme_cap.aes_xts_128"));
    assert!(!yes(&r, "intel.tme_cap.aes_xts_256"));
    assert_eq!(num(&r, "intel.tme_cap.max_keyid_bits"), 6);
    assert_eq!(num(&r, "intel.tme_cap.max_keys"), 63);
    assert!(yes(&r, "intel.tme_activate.locked"));
    assert!(yes(&r, "intel.tme_activate.enabled"));
    assert!(!yes(&r, "intel.tme_activate.bypass"));
    assert_eq!(text(&r, "intel.tme_activate.policy"), "AES-XTS-128 (0)");
    assert_eq!(num(&r, "intel.mktme.keyid_bits"), 6);
    assert_eq!(text(&r, "intel.mktme.crypto_algs"), "AES-XTS-128");
    assert_eq!(num(&r, "intel.mktme.usable_keyids"), 63);
    assert!(yes(&r, "intel.tme.log_enabled"));
    assert_eq!(num(&r, "intel.mktme.log_keyids"), 63);
    assert!(yes(&r, "intel.tme_activate.consistent"));
    assert!(yes(&r, "intel.tme.enabled"));
    assert_eq!(num(&r, "cpu.kernel_phys_addr_bits"), 40);
    assert_eq!(num(&r, "cpu.phys_addr_bits"), 46);
    assert!(yes(&r, "cpu.vaes") && yes(&r, "cpu.vpclmulqdq"));
    assert!(!yes(&r, "guest.hypervisor"));
    assert_eq!(status(&r, "memory-encryption"), Status::Pass);
    assert!(r
        .check("memory-encryption")
        .is_some_and(|c| c.summary.contains("63 KeyIDs")));
    // memfd_secret off on 5.15 by default: a failed check, exit code 3.
    assert_eq!(status(&r, "memfd-secret"), Status::Fail);
    assert!(r
        .check("memfd-secret")
        .is_some_and(|c| c.action.contains("secretmem.enable=1")));
    assert_eq!(status(&r, "swap"), Status::Warn);
    assert_eq!(r.exit_code(), 3);
}

#[test]
fn icelake_with_tme_disabled_by_bios() {
    let r = decode(&load("icelake-tme-disabled.json"));
    assert!(yes(&r, "intel.tme.cpuid"));
    assert!(yes(&r, "intel.tme_activate.locked"));
    assert!(!yes(&r, "intel.tme_activate.enabled"));
    assert!(!yes(&r, "intel.tme.log_enabled"));
    assert!(!yes(&r, "intel.tme.enabled"));
    assert!(!yes(&r, "intel.tme.cpuinfo_flag"));
    assert_eq!(num(&r, "cpu.kernel_phys_addr_bits"), 46);
    let c = r.check("memory-encryption").expect("check");
    assert_eq!(c.status, Status::Warn);
    assert!(c.action.contains("BIOS"), "{c:?}");
    assert!(yes(&r, "kernel.swap_encrypted"));
    assert_eq!(status(&r, "swap"), Status::Pass);
    assert_eq!(status(&r, "userfaultfd"), Status::Pass);
    assert!(!yes(&r, "kernel.userfaultfd.syscall"));
    assert!(yes(&r, "kernel.userfaultfd.user_mode_only"));
    assert_eq!(r.exit_code(), 0);
}

#[test]
fn epyc_with_sme_active() {
    let r = decode(&load("epyc-sme-active.json"));
    assert_eq!(text(&r, "cpu.vendor"), "AuthenticAMD");
    assert!(yes(&r, "amd.sme.cpuid") && yes(&r, "amd.sev.cpuid") && yes(&r, "amd.sev_es.cpuid"));
    assert!(!yes(&r, "amd.sev_snp.cpuid"));
    assert_eq!(num(&r, "amd.c_bit"), 47);
    assert_eq!(num(&r, "amd.phys_addr_reduction"), 5);
    assert_eq!(num(&r, "amd.sev.max_guests"), 509);
    assert!(yes(&r, "amd.syscfg.smee"));
    assert!(yes(&r, "amd.sme.cpuinfo_flag"));
    assert_eq!(text(&r, "amd.log_features"), "SME");
    assert!(yes(&r, "amd.sme.active"));
    // Linux 5.10 has no tsme_status: unknown, with the reason.
    assert!(
        matches!(val(&r, "amd.tsme.active"), Value::Unknown { unknown } if unknown.contains("5.19"))
    );
    assert!(!yes(&r, "intel.tme.cpuid"));
    assert_eq!(status(&r, "memory-encryption"), Status::Pass);
    assert_eq!(num(&r, "cpu.kernel_phys_addr_bits"), 43);
}

#[test]
fn smee_clear_beats_an_sme_log_line() {
    let mut f = load("epyc-sme-active.json");
    for m in &mut f.msr {
        m.value = m.value.map(|v| v & !(1 << 23));
    }
    let r = decode(&f);
    assert!(!yes(&r, "amd.syscfg.smee"));
    assert!(!yes(&r, "amd.sme.active"));
    assert!(r
        .item("amd.sme.active")
        .is_some_and(|i| i.how.contains("SYSCFG[23]")));
}

#[test]
fn amd_with_tsme_only() {
    let r = decode(&load("tsme-only.json"));
    assert!(yes(&r, "amd.sme.cpuid"));
    assert!(!yes(&r, "amd.sev.cpuid"));
    assert!(yes(&r, "amd.tsme.sysfs"));
    assert!(yes(&r, "amd.tsme.log"));
    assert!(yes(&r, "amd.tsme.active"));
    assert!(!yes(&r, "amd.sme.active"));
    // SYSCFG unreadable: the exact reason the issue asks for.
    assert!(
        matches!(val(&r, "amd.syscfg"), Value::Unknown { unknown } if unknown.contains("msr module not loaded (modprobe msr")),
        "{:?}",
        val(&r, "amd.syscfg")
    );
    let c = r.check("memory-encryption").expect("check");
    assert_eq!(c.status, Status::Pass);
    assert!(c.summary.contains("TSME"), "{c:?}");
    assert!(yes(&r, "kernel.swap_encrypted"), "zram counts as in RAM");
}

#[test]
fn sev_snp_guest() {
    let r = decode(&load("sev-snp-guest.json"));
    assert!(yes(&r, "guest.hypervisor"));
    assert!(text(&r, "guest.hypervisor_vendor").starts_with("KVM"));
    assert!(yes(&r, "guest.sev_status.sev"));
    assert!(yes(&r, "guest.sev_status.sev_es"));
    assert!(yes(&r, "guest.sev_status.sev_snp"));
    assert_eq!(text(&r, "guest.sev"), "SEV-SNP");
    assert_eq!(text(&r, "guest.confidential"), "SEV-SNP");
    assert_eq!(text(&r, "guest.sev_log_status"), "SEV SEV-ES SEV-SNP");
    assert!(yes(&r, "guest.dev.sev_guest"));
    assert_eq!(num(&r, "amd.c_bit"), 51);
    assert_eq!(num(&r, "amd.phys_addr_reduction"), 1);
    assert!(!yes(&r, "amd.sme.cpuid"));
    assert_eq!(status(&r, "memory-encryption"), Status::Pass);
    assert_eq!(status(&r, "core-dumps"), Status::Pass);
    assert_eq!(r.exit_code(), 0);
}

#[test]
fn sev_snp_guest_from_the_log_alone() {
    // Without the msr module the SEV level still comes from the log line.
    let mut f = load("sev-snp-guest.json");
    f.msr.clear();
    f.msr_access = MsrAccess::NotLoaded;
    let r = decode(&f);
    assert_eq!(text(&r, "guest.sev"), "SEV-SNP");
    assert!(r.item("guest.sev").is_some_and(|i| i
        .how
        .contains("Memory Encryption Features active: AMD SEV SEV-ES SEV-SNP")));
}

#[test]
fn this_machine_recorded() {
    let r = decode(&load("this-machine.json"));
    assert_eq!(text(&r, "cpu.vendor"), "GenuineIntel");
    assert!(yes(&r, "guest.hypervisor"));
    assert!(text(&r, "guest.hypervisor_vendor").starts_with("KVM"));
    assert!(yes(&r, "cpu.rdrand") && yes(&r, "cpu.rdseed") && yes(&r, "cpu.aes_ni"));
    assert!(!yes(&r, "cpu.vaes"));
    assert!(!yes(&r, "intel.tme.cpuid"));
    assert!(yes(&r, "kernel.memfd_secret"));
    assert!(yes(&r, "rng.rdrand.healthy"));
    assert!(
        matches!(val(&r, "cpu.msr_access"), Value::Unknown { unknown } if unknown.contains("msr module not loaded"))
    );
    assert_eq!(status(&r, "memory-encryption"), Status::Warn);
    assert_eq!(r.exit_code(), 0);
}

// Negative controls: change one recorded fact, the verdict must follow.

#[test]
fn clearing_the_enable_bit_turns_tme_off() {
    let mut f = load("icelake-tme-mk-enabled.json");
    for m in &mut f.msr {
        if m.msr == 0x982 {
            m.value = m.value.map(|v| v & !0b10);
        }
    }
    // The log says enabled, but the register wins.
    let r = decode(&f);
    assert!(!yes(&r, "intel.tme.enabled"));
    assert_eq!(status(&r, "memory-encryption"), Status::Warn);
}

#[test]
fn bypass_is_not_reported_as_encryption() {
    let mut f = load("icelake-tme-mk-enabled.json");
    for m in &mut f.msr {
        if m.msr == 0x982 {
            m.value = m.value.map(|v| v | (1 << 31));
        }
    }
    let r = decode(&f);
    let c = r.check("memory-encryption").expect("check");
    assert_eq!(c.status, Status::Warn);
    assert!(c.summary.contains("bypass"), "{c:?}");
}

#[test]
fn tme_activate_differing_between_cpus_fails() {
    let mut f = load("icelake-tme-mk-enabled.json");
    f.msr.push(MsrRecord {
        cpu: 2,
        msr: 0x982,
        value: Some(0x1),
        error: None,
    });
    let r = decode(&f);
    assert!(!yes(&r, "intel.tme_activate.consistent"));
    assert_eq!(status(&r, "tme-consistency"), Status::Fail);
}

#[test]
fn without_msr_the_log_decides_and_says_so() {
    let mut f = load("icelake-tme-mk-enabled.json");
    f.msr.clear();
    f.msr_access = MsrAccess::NotLoaded;
    let r = decode(&f);
    assert!(
        matches!(val(&r, "intel.tme_activate"), Value::Unknown { unknown } if unknown == "msr module not loaded (modprobe msr, or run with --load-msr)")
    );
    assert!(yes(&r, "intel.tme.enabled"));
    assert!(r
        .item("intel.tme.enabled")
        .is_some_and(|i| i.how.contains("x86/tme: enabled by BIOS")));
    // The 6.7+ wording gives the KeyID bits instead of the count.
    let mut g = f.clone();
    g.kernel_log.lines = Some(vec![
        "x86/tme: enabled by BIOS".to_owned(),
        "x86/mktme: BIOS enabled: x86_phys_bits reduced by 6".to_owned(),
    ]);
    let r = decode(&g);
    assert_eq!(num(&r, "intel.mktme.log_keyids"), 63);
    assert!(r
        .check("memory-encryption")
        .is_some_and(|c| c.summary.contains("6 KeyID bits")));
}

#[test]
fn a_failed_modprobe_is_named_in_the_reason() {
    let mut f = load("tsme-only.json");
    f.msr_access = MsrAccess::ModprobeFailed("modprobe: FATAL: Module msr not found".to_owned());
    let r = decode(&f);
    assert!(
        matches!(val(&r, "amd.syscfg"), Value::Unknown { unknown } if unknown.contains("`modprobe msr` failed: modprobe: FATAL: Module msr not found")),
        "{:?}",
        val(&r, "amd.syscfg")
    );
    assert!(!yes(&r, "kernel.probe_as_root"));
}

#[test]
fn no_msr_and_a_wrapped_log_is_unknown_not_no() {
    let mut f = load("icelake-tme-mk-enabled.json");
    f.msr.clear();
    f.msr_access = MsrAccess::PermissionDenied;
    f.kernel_log = KernelLog {
        source: "/dev/kmsg".to_owned(),
        lines: Some(vec!["eth0: link up".to_owned()]),
        wrapped: true,
        errors: vec!["journalctl -k -b: no entries".to_owned()],
    };
    let r = decode(&f);
    match val(&r, "intel.tme.enabled") {
        Value::Unknown { unknown } => {
            assert!(unknown.contains("CAP_SYS_RAWIO"), "{unknown}");
            assert!(unknown.contains("wrapped"), "{unknown}");
        }
        v => panic!("must be unknown, got {v:?}"),
    }
    assert_eq!(status(&r, "memory-encryption"), Status::Warn);
}

#[test]
fn a_stuck_rdrand_fails_its_check() {
    let mut f = load("this-machine.json");
    let stuck = memveil_probe::collect::sample_from_values("rdrand", &[u64::MAX; 64]);
    f.rng.retain(|s| s.source != "rdrand");
    f.rng.push(stuck);
    let r = decode(&f);
    assert!(!yes(&r, "rng.rdrand.healthy"));
    let c = r.check("rdrand").expect("check");
    assert_eq!(c.status, Status::Fail);
    assert!(c.summary.contains("Repetition Count"), "{c:?}");
    assert_eq!(r.exit_code(), 3);
}

#[test]
fn unencrypted_lvm_swap_on_crypt_is_found_through_slaves() {
    let mut f = load("icelake-tme-disabled.json");
    f.files.insert(
        "/proc/swaps".to_owned(),
        FileRead::Ok("Filename Type Size Used Priority\n/dev/dm-2 partition 1 0 -2\n".to_owned()),
    );
    f.swap_devices
        .insert("/dev/dm-2".to_owned(), "253:2".to_owned());
    f.files.insert(
        "/sys/dev/block/253:2/dm/uuid".to_owned(),
        FileRead::Ok("LVM-abc\n".to_owned()),
    );
    f.dirs.insert(
        "/sys/dev/block/253:2/slaves".to_owned(),
        FileRead::Ok("dm-0".to_owned()),
    );
    f.files.insert(
        "/sys/class/block/dm-0/dev".to_owned(),
        FileRead::Ok("253:0\n".to_owned()),
    );
    f.files.insert(
        "/sys/dev/block/253:0/dm/uuid".to_owned(),
        FileRead::Ok("CRYPT-LUKS2-0123-root\n".to_owned()),
    );
    let r = decode(&f);
    assert!(yes(&r, "kernel.swap_encrypted"));
    // Positive control: the same LVM volume on a plain partition is not.
    f.files
        .insert("/sys/dev/block/253:0/dm/uuid".to_owned(), FileRead::Missing);
    let r = decode(&f);
    assert!(!yes(&r, "kernel.swap_encrypted"));
    assert_eq!(status(&r, "swap"), Status::Warn);
}

fn check_prometheus(out: &str) {
    let mut families = BTreeSet::new();
    let mut helped = BTreeSet::new();
    let mut typed = BTreeSet::new();
    let mut series = BTreeSet::new();
    let mut current = String::new();
    for line in out.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or("").to_owned();
            assert!(!families.contains(&name), "family {name} not contiguous");
            helped.insert(name.clone());
            current = name;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut w = rest.split(' ');
            let name = w.next().unwrap_or("").to_owned();
            assert!(matches!(w.next(), Some("gauge" | "counter")), "{line}");
            assert_eq!(name, current, "TYPE without HELP first: {line}");
            typed.insert(name);
            continue;
        }
        assert!(!line.starts_with('#'), "stray comment {line}");
        let (key, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {line}"));
        value
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("bad value: {line}"));
        let name = key.split('{').next().unwrap_or("");
        assert!(name.starts_with("memveil_"), "{line}");
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{line}"
        );
        assert_eq!(name, current, "sample outside its family: {line}");
        if let Some(labels) = key.strip_prefix(name) {
            if !labels.is_empty() {
                assert!(labels.starts_with('{') && labels.ends_with('}'), "{line}");
                for pair in split_labels(&labels[1..labels.len() - 1]) {
                    let (k, v) = pair
                        .split_once('=')
                        .unwrap_or_else(|| panic!("label {pair} in {line}"));
                    assert!(
                        k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                        "{line}"
                    );
                    assert!(
                        v.starts_with('"') && v.ends_with('"') && v.len() >= 2,
                        "{line}"
                    );
                }
            }
        }
        families.insert(name.to_owned());
        assert!(series.insert(key.to_owned()), "duplicate series {key}");
    }
    assert_eq!(families, helped);
    assert_eq!(families, typed);
}

/// Splits `a="x",b="y,z"` at commas outside quotes (honouring `\"`).
fn split_labels(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut quoted, mut escaped) = (false, false);
    for c in s.chars() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == '"' {
            quoted = !quoted;
        } else if c == ',' && !quoted {
            out.push(std::mem::take(&mut cur));
            continue;
        }
        cur.push(c);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[test]
fn outputs_are_well_formed_for_every_fixture() {
    for name in ALL {
        let r = decode(&load(name));
        let p = render::prometheus(&r);
        check_prometheus(&p);
        assert!(
            p.contains("memveil_probe_check{check=\"memory-encryption\",status=\"pass\"}"),
            "{name}"
        );
        let j: serde_json::Value = serde_json::from_str(&render::json(&r)).expect("json");
        assert!(
            j["items"].as_array().is_some_and(|a| !a.is_empty()),
            "{name}"
        );
        assert!(
            j["checks"].as_array().is_some_and(|a| !a.is_empty()),
            "{name}"
        );
        let h = render::human(&r);
        assert!(h.contains("Checks") && h.contains("[PASS]"), "{name}");
        // Issue 35: the report reached 288 columns.
        let wide: Vec<&str> = h
            .lines()
            .filter(|l| l.chars().count() > render::WIDTH)
            .collect();
        assert!(
            wide.is_empty(),
            "{name}: lines over 100 columns:\n{}",
            wide.join("\n")
        );
    }
}

#[test]
fn prometheus_item_values_follow_the_report() {
    let r = decode(&load("icelake-tme-mk-enabled.json"));
    let p = render::prometheus(&r);
    assert!(
        p.contains("memveil_probe_item{item=\"intel.tme.enabled\"} 1\n"),
        "{p}"
    );
    assert!(p.contains("memveil_probe_item{item=\"intel.mktme.usable_keyids\"} 63\n"));
    assert!(p.contains("memveil_probe_check{check=\"memfd-secret\",status=\"fail\"} 1\n"));
    assert!(p.contains("memveil_probe_checks{status=\"fail\"} 1\n"));
    let r = decode(&load("tsme-only.json"));
    let p = render::prometheus(&r);
    assert!(
        p.contains("memveil_probe_item_known{item=\"amd.syscfg\"} 0\n"),
        "{p}"
    );
}

#[test]
fn named_metrics_follow_the_checks() {
    // TME-MK enabled, memfd_secret missing on that recorded host.
    let p = render::prometheus(&decode(&load("icelake-tme-mk-enabled.json")));
    assert!(p.contains("\nmemveil_memory_encryption_active 1\n"), "{p}");
    assert!(p.contains("\nmemveil_tme_mk_keyids 63\n"), "{p}");
    assert!(p.contains("\nmemveil_kernel_feature{feature=\"memfd_secret\"} 0\n"));
    assert!(p.contains("\nmemveil_cpu_feature{feature=\"aes_ni\"} 1\n"));
    let p = render::prometheus(&decode(&load("tsme-only.json")));
    assert!(p.contains("\nmemveil_memory_encryption_active 1\n"), "{p}");
    // Negative control: TME capable but disabled by the BIOS.
    let p = render::prometheus(&decode(&load("icelake-tme-disabled.json")));
    assert!(p.contains("\nmemveil_memory_encryption_active 0\n"), "{p}");
}

#[test]
fn the_label_checker_itself_rejects_bad_output() {
    // Positive control for check_prometheus.
    let bad =
        "# HELP memveil_probe_x x\n# TYPE memveil_probe_x gauge\nmemveil_probe_x{a=\"1\"} one\n";
    assert!(std::panic::catch_unwind(|| check_prometheus(bad)).is_err());
    let dup = "# HELP memveil_probe_x x\n# TYPE memveil_probe_x gauge\nmemveil_probe_x 1\nmemveil_probe_x 1\n";
    assert!(std::panic::catch_unwind(|| check_prometheus(dup)).is_err());
}
