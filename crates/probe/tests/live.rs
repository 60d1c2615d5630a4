//! One live probe of the machine the tests run on. Each answer is compared
//! with an independent source (the kernel's /proc/cpuinfo flags, a direct
//! system call), so the test is honest on any host; on the memveil build VM
//! it asserts the values known true there (RDRAND present and healthy,
//! memfd_secret working, running under a hypervisor).

use memveil_probe::{collect, decode, render, CollectOptions, HostFacts, Status, Value};
use memveil_testkit::{skip, Need};

fn cpuinfo_flags() -> Vec<String> {
    let s = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("flags"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

#[test]
fn live_probe_of_this_host() {
    let facts = collect(&CollectOptions {
        load_msr: false,
        rng_samples: 2048,
        run_commands: true,
    });
    // The record replays to the same report.
    let again = HostFacts::from_json(&facts.to_json()).expect("own record must replay");
    let r = decode(&facts);
    assert_eq!(
        serde_json::to_string(&r.items).ok(),
        serde_json::to_string(&decode(&again).items).ok()
    );

    for it in &r.items {
        match &it.value {
            Value::Unknown { unknown } => assert!(!unknown.is_empty(), "{}", it.id),
            _ => assert!(!it.how.is_empty(), "{} has no evidence", it.id),
        }
    }
    assert!(r.check("memory-encryption").is_some());
    assert_eq!(r.exit_code(), u8::from(r.worst() == Status::Fail) * 3);

    let flags = cpuinfo_flags();
    let flag = |f: &str| flags.iter().any(|x| x == f);
    let item_bool = |id: &str| r.item(id).and_then(|i| i.value.as_bool());

    // RDRAND: CPUID agrees with the kernel's flag, and a present RDRAND passes.
    assert_eq!(item_bool("cpu.rdrand"), Some(flag("rdrand")));
    if flag("rdrand") {
        assert_eq!(item_bool("rng.rdrand.healthy"), Some(true));
        assert_eq!(r.check("rdrand").map(|c| c.status), Some(Status::Pass));
    } else {
        skip(Need::Cpu("RDRAND"), "the rdrand health check");
    }
    assert_eq!(item_bool("cpu.aes_ni"), Some(flag("aes")));
    // (VAES is not compared: the kernel hides it when AVX state is off, while
    // CPUID still reports it.)

    // Hypervisor bit agrees with the kernel's "hypervisor" flag.
    assert_eq!(item_bool("guest.hypervisor"), Some(flag("hypervisor")));
    if !flag("hypervisor") {
        skip(Need::Hypervisor, "the hypervisor vendor check");
    } else {
        assert!(r.item("guest.hypervisor_vendor").is_some());
    }

    // memfd_secret agrees with a direct call.
    let direct = memveil_sys::memfd_secret().is_ok();
    assert_eq!(item_bool("kernel.memfd_secret"), Some(direct));
    if !direct {
        skip(Need::MemfdSecret, "unavailable on this kernel");
    }

    // MSR access: unknown with the module hint when the device is missing.
    if !std::path::Path::new("/dev/cpu/0/msr").exists() {
        match &r.item("cpu.msr_access").expect("item").value {
            Value::Unknown { unknown } => assert!(unknown.contains("modprobe msr"), "{unknown}"),
            v => panic!("msr device missing but access reported as {v:?}"),
        }
    }

    let p = render::prometheus(&r);
    assert!(p.contains("# TYPE memveil_probe_check gauge"));
    eprintln!("{}", render::human(&r));
}
