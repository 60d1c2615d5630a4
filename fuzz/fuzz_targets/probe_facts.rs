//! The probe's parsers on arbitrary input: the recorded-facts JSON reader,
//! and the decoder over arbitrary kernel log, cpuinfo, sysfs and /proc/swaps
//! text. Nothing panics; every report renders in all three forms.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memveil_probe::facts::{FileRead, KernelLog, Text};
use memveil_probe::{decode, render, HostFacts};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(f) = HostFacts::from_json(&text) {
        let r = decode(&f);
        let _ = render::prometheus(&r);
    }
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let mut f = HostFacts {
        schema: 1,
        cpuid_available: true,
        ..HostFacts::default()
    };
    f.kernel_log = KernelLog {
        source: "fuzz".to_owned(),
        lines: Some(lines.clone()),
        wrapped: data.first().is_some_and(|b| b & 1 == 1),
        errors: Vec::new(),
    };
    f.cpuinfo = Text {
        source: "fuzz".to_owned(),
        lines: Some(lines),
        error: None,
    };
    f.files
        .insert("/proc/swaps".to_owned(), FileRead::Ok(text.clone().into_owned()));
    f.files.insert(
        "/sys/bus/pci/devices/0000:00:00.0/tsme_status".to_owned(),
        FileRead::Ok(text.into_owned()),
    );
    let r = decode(&f);
    let _ = render::human(&r);
    let _ = render::json(&r);
    let _ = render::prometheus(&r);
});
