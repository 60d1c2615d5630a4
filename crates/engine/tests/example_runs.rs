//! The TME-MK walk-through example runs and every claim it checks holds.

#[test]
fn tme_mk_figure_example_passes() {
    let exe = std::env::current_exe().expect("exe");
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("examples")
        .join("tme_mk_figure");
    let out = std::process::Command::new(&bin)
        .output()
        .expect("run example");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.matches("[ok]").count(), 6, "{text}");
    assert!(!text.contains("FAILED"), "{text}");
}
