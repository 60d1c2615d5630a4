//! A walk through the TME-MK figure: one hypervisor and two VMs on one host,
//! each VM with its private KeyID, and one page the VMs share under a third.
//!
//! Run it with `cargo run --release -p memveil-engine --example tme_mk_figure`.
//! Every claim it prints is checked as it goes; it exits non-zero if one fails.

use memveil_engine::{Algorithm, Config, Engine, KeyProgram, Mode, PAGE};
use memveil_secmem::{Level, Policy};

fn show(what: &str, bytes: &[u8]) {
    let printable: String = bytes
        .iter()
        .take(24)
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                char::from(b)
            } else {
                '.'
            }
        })
        .collect();
    println!("    {what:<44} {printable:?}");
}

fn check(ok: bool, claim: &str) -> Result<(), String> {
    println!("  [{}] {claim}", if ok { "ok" } else { "FAILED" });
    if ok {
        Ok(())
    } else {
        Err(claim.to_owned())
    }
}

fn main() -> Result<(), String> {
    // 1. The platform: 64 frames (256 KiB) of "DRAM", 6 KeyID bits as on an Ice
    //    Lake server, TME on (every page encrypted; KeyID 0 is the platform key,
    //    random at start-up and never readable).
    let engine = Engine::new(Config {
        frames: 64,
        keyid_bits: 6,
        mode: Mode::Tsme,
        cache_pages: 8,
        policy: Policy::allow(Level::Locked),
        ..Config::default()
    })
    .map_err(|e| e.to_string())?;
    println!(
        "1. Engine up: KeyIDs 1..={} programmable, keys and cache in {} memory.",
        engine.max_keyid(),
        engine.level()
    );

    // 2. The hypervisor programs a KeyID per VM from the CPU's DRNG, and one
    //    for the page the VMs share. It never sees the keys.
    for (keyid, who) in [
        (1u16, "VM1 private"),
        (2, "VM2 private"),
        (3, "VM1+VM2 shared"),
    ] {
        let st = engine.program_status(&KeyProgram::random(keyid, Algorithm::AesXts128, &[], &[]));
        println!("2. PCONFIG KEYID_SET_KEY_RANDOM KeyID {keyid} ({who}) -> {st}");
    }

    // 3. The hypervisor maps frames 0..16 to VM1 and 16..32 to VM2, and frame
    //    40 into both. Each VM's page tables carry only its own KeyIDs.
    let vm1 = engine.domain("vm1", &[1, 3], &[0..16, 40..41]);
    let vm2 = engine.domain("vm2", &[2, 3], &[16..32, 40..41]);
    println!(
        "3. VM1 maps frames 0..16 + 40 with KeyIDs 1, 3; VM2 maps 16..32 + 40 with KeyIDs 2, 3."
    );

    // 4. Each VM writes a secret into its own memory, and VM1 leaves a message
    //    on the shared page.
    let s1 = b"VM1: my database password";
    let s2 = b"VM2: my TLS private key  ";
    vm1.write(vm1.address(0, 0, 1), s1)
        .map_err(|e| e.to_string())?;
    vm2.write(vm2.address(16, 0, 2), s2)
        .map_err(|e| e.to_string())?;
    vm1.write(vm1.address(40, 0, 3), b"hello from VM1")
        .map_err(|e| e.to_string())?;
    println!("4. VM1 and VM2 wrote their secrets; VM1 wrote to the shared page.");

    // 5. VM2 reads the shared page through the shared KeyID.
    let mut msg = [0u8; 14];
    vm2.read(vm2.address(40, 0, 3), &mut msg)
        .map_err(|e| e.to_string())?;
    show("VM2 reads the shared page (KeyID 3):", &msg);
    check(&msg == b"hello from VM1", "VM2 reads what VM1 shared")?;

    // 6. VM2 cannot name VM1's KeyID, nor reach VM1's frames.
    let mut buf = [0u8; 25];
    let e = vm2.read(vm2.address(0, 0, 1), &mut buf).err();
    println!(
        "6. VM2 using KeyID 1: {}",
        e.as_ref().map_or("allowed?!".into(), ToString::to_string)
    );
    check(e.is_some(), "VM2 cannot use VM1's KeyID")?;

    // 7. The hypervisor can read any frame, but not decrypt a VM's page with
    //    its own KeyID 0: it gets garbage, not an error, as on hardware.
    engine
        .read(engine.address(0, 0, true), &mut buf)
        .map_err(|e| e.to_string())?;
    show("hypervisor reads VM1's frame with KeyID 0:", &buf);
    check(
        &buf != s1,
        "the hypervisor's KeyID does not decrypt VM1's page",
    )?;

    // 8. A physical attacker (cold boot, DIMM theft) sees only ciphertext...
    engine.flush();
    let dram = engine.dram_frame(0).map_err(|e| e.to_string())?;
    show("DRAM frame 0 (what a cold-boot image holds):", &dram);
    check(
        !dram.windows(s1.len()).any(|w| w == s1),
        "DRAM holds no plaintext of VM1's secret",
    )?;

    // 9. ...and moving VM1's ciphertext into VM2's frame does not help: the
    //    physical address is the XTS tweak.
    engine.dram_copy(0, 17).map_err(|e| e.to_string())?;
    engine
        .read(engine.address(17 * PAGE as u64, 1, true), &mut buf)
        .map_err(|e| e.to_string())?;
    show("VM1's ciphertext moved to frame 17, KeyID 1:", &buf);
    check(
        &buf != s1,
        "relocated ciphertext decrypts to garbage even with the right key",
    )?;

    // 10. VM1 is destroyed: the hypervisor clears KeyID 1. Everything VM1
    //     ever wrote is now ciphertext under a key that no longer exists.
    let st = engine.program_status(&KeyProgram::clear(1));
    engine
        .read(engine.address(0, 1, true), &mut buf)
        .map_err(|e| e.to_string())?;
    println!("10. PCONFIG KEYID_CLEAR_KEY KeyID 1 -> {st}");
    show("VM1's frame through KeyID 1 after the clear:", &buf);
    check(&buf != s1, "crypto-erase: VM1's data is gone with its key")?;

    let s = engine.stats();
    println!(
        "Stats: {} fills, {} write-backs, {} evictions, {} alias flushes; plaintext now {:.1}% of memory.",
        s.fills,
        s.writebacks,
        s.evictions,
        s.alias_flushes,
        100.0 * s.plaintext_fraction()
    );
    Ok(())
}
