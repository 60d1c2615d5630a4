//! Input from outside the process never panics the decoder: arbitrary kernel
//! log lines, cpuinfo text, sysfs contents and register values decode to a
//! report (possibly full of unknowns), and the three renderers accept it;
//! any bytes sent to `memveil probe --serve` parse to a request or are
//! refused.

use memveil_probe::facts::{CpuidRecord, FileRead, KernelLog, MsrAccess, MsrRecord, Text};
use memveil_probe::{decode, render, HostFacts};
use proptest::prelude::*;

fn line() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,80}",
        // Near misses of the lines the decoder looks for.
        "(\\[ *[0-9.]{0,12}\\] )?x86/(tme|mktme): .{0,40}",
        "x86/mktme: [0-9]{0,25} KeyIDs available",
        "x86/mktme: BIOS enabled: x86_phys_bits reduced by [0-9]{0,25}",
        "(AMD )?Memory Encryption Features active:( [A-Za-z-]{0,8}){0,5}",
        "SEV: Status:( [A-Za-z-]{0,8}){0,5}",
        "ccp [0-9a-f:.]{0,12}: psp: (TSME enabled|Both TSME and SME are active.{0,20})",
        "Hypervisor detected:.{0,20}",
    ]
}

fn facts() -> impl Strategy<Value = HostFacts> {
    (
        prop::collection::vec(
            (
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
            ),
            0..12,
        ),
        prop::collection::vec(
            (
                0u32..4,
                prop::sample::select(vec![0x981u32, 0x982, 0xC001_0010, 0xC001_0131]),
                any::<u64>(),
            ),
            0..8,
        ),
        prop::collection::vec(line(), 0..20),
        prop::collection::vec(".{0,60}", 0..10),
        prop::collection::vec(("[a-z/:0-9.]{1,40}", ".{0,30}"), 0..8),
        any::<bool>(),
    )
        .prop_map(|(cpuid, msrs, log, cpuinfo, files, wrapped)| {
            let mut f = HostFacts {
                schema: 1,
                cpuid_available: true,
                ..HostFacts::default()
            };
            // Mix random leaves with the ones the decoder reads.
            let leaves = [
                0u32,
                1,
                7,
                0x21,
                0x4000_0000,
                0x8000_0000,
                0x8000_0008,
                0x8000_001F,
            ];
            for (i, (leaf, a, b, c, d)) in cpuid.into_iter().enumerate() {
                let leaf = if i < leaves.len() { leaves[i] } else { leaf };
                f.cpuid.push(CpuidRecord {
                    leaf,
                    subleaf: 0,
                    eax: a,
                    ebx: b,
                    ecx: c,
                    edx: d,
                });
            }
            f.msr_access = MsrAccess::Readable;
            f.msr = msrs
                .into_iter()
                .map(|(cpu, msr, v)| MsrRecord {
                    cpu,
                    msr,
                    value: Some(v),
                    error: None,
                })
                .collect();
            f.kernel_log = KernelLog {
                source: "test".into(),
                lines: Some(log),
                wrapped,
                errors: vec![],
            };
            f.cpuinfo = Text {
                source: "/proc/cpuinfo".into(),
                lines: Some(cpuinfo),
                error: None,
            };
            for (k, v) in files {
                f.files.insert(k, FileRead::Ok(v));
            }
            f
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decoding_anything_never_panics(f in facts()) {
        let r = decode(&f);
        let _ = render::human(&r);
        let _ = render::json(&r);
        let _ = render::prometheus(&r);
        prop_assert!(!r.checks.is_empty());
    }

    #[test]
    fn any_text_as_recorded_facts_is_an_error_or_a_report(s in ".{0,400}") {
        if let Ok(f) = HostFacts::from_json(&s) {
            let _ = decode(&f);
        }
    }

    #[test]
    fn every_swap_line_decodes(swaps in ".{0,200}", mm in "[0-9:]{0,10}", uuid in ".{0,30}") {
        let mut f = HostFacts { schema: 1, ..HostFacts::default() };
        f.files.insert("/proc/swaps".into(), FileRead::Ok(swaps.clone()));
        for name in swaps.lines().skip(1).filter_map(|l| l.split_whitespace().next()) {
            f.swap_devices.insert(name.to_owned(), mm.clone());
        }
        f.files.insert(format!("/sys/dev/block/{mm}/dm/uuid"), FileRead::Ok(uuid));
        // A device-mapper device listing itself as its own slave must not loop.
        f.dirs.insert(format!("/sys/dev/block/{mm}/slaves"), FileRead::Ok("dm-0".into()));
        f.files.insert("/sys/class/block/dm-0/dev".into(), FileRead::Ok(mm));
        let _ = decode(&f);
    }

    #[test]
    fn any_bytes_as_an_http_request_head_parse_or_are_refused(
        bytes in prop::collection::vec(any::<u8>(), 0..600),
        near in "(GET|HEAD|POST|get) (/metrics|/|x|/a b)(\\?[ -~]{0,10})? HTTP/(1\\.[01]|2|9)(\r?\n[!-~]{0,10}(: ?[ -~]{0,10})?){0,4}\r?\n\r?\n",
    ) {
        for b in [&bytes[..], near.as_bytes()] {
            if let Ok(h) = memveil_probe::http::parse_head(b) {
                prop_assert!(h.path.starts_with('/'));
                let r = memveil_probe::http::route(&h, &|| String::new());
                prop_assert!([200, 404, 405].contains(&r.code));
            }
        }
    }
}
