//! The Prometheus output read back by an independent parser: the official
//! Python client's text-format parser (Debian python3-prometheus-client,
//! listed in scripts/packages.txt). Skips when it is not installed (a failure
//! under CI=true, which installs it).

use std::io::Write as _;
use std::process::{Command, Stdio};

use memveil_probe::{decode, render, HostFacts};
use memveil_testkit::{skip, Need};

const PARSER: &str = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
text = sys.stdin.read()
n = 0
for fam in text_string_to_metric_families(text):
    assert fam.type == "gauge", (fam.name, fam.type)
    assert fam.documentation, fam.name
    for s in fam.samples:
        n += 1
print(n)
"#;

/// Debian's interpreter, which python3-prometheus-client installs into (a
/// pyenv or virtualenv `python3` earlier on PATH does not see the package).
fn python3() -> &'static str {
    if std::path::Path::new("/usr/bin/python3").is_file() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

fn parse_with_python(text: &str) -> Option<Result<usize, String>> {
    let ok = Command::new(python3())
        .args(["-c", "import prometheus_client"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        return None;
    }
    let mut child = Command::new(python3())
        .args(["-c", PARSER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(text.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    Some(if out.status.success() {
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|e| format!("{e}"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    })
}

#[test]
fn official_parser_reads_every_fixture() {
    let dir = format!("{}/tests/fixtures", env!("CARGO_MANIFEST_DIR"));
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .expect("fixtures")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    names.sort();
    assert!(names.len() >= 6);
    for p in names {
        let f = HostFacts::from_json(&std::fs::read_to_string(&p).expect("read")).expect("parse");
        let text = render::prometheus(&decode(&f));
        let expected = text.lines().filter(|l| !l.starts_with('#')).count();
        match parse_with_python(&text) {
            None => {
                skip(
                    Need::Installed("python3-prometheus-client"),
                    format!("{} cannot import prometheus_client (apt-get install python3-prometheus-client)", python3()),
                );
                return;
            }
            Some(Ok(n)) => assert_eq!(n, expected, "{}", p.display()),
            Some(Err(e)) => panic!("{}: {e}", p.display()),
        }
    }
    // Positive control: the parser rejects broken output.
    let broken =
        "# HELP memveil_probe_x x\n# TYPE memveil_probe_x gauge\nmemveil_probe_x{a=\"1} 1\n";
    if let Some(r) = parse_with_python(broken) {
        assert!(r.is_err(), "the parser accepted broken text");
    }
}
