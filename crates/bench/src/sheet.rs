//! The figure sheet: one current table of every figure (its value, its
//! target, whether it is met, the machine and the date), made from the JSON
//! files `memveil bench --json` writes, so that BENCHMARKS.md cannot drift
//! from what was measured (`scripts/figures.sh` rewrites its table).

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Where and when a run measured its figures (the `run` object of the JSON
/// file).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct RunInfo {
    /// CPU model and the AES path in use.
    pub machine: String,
    /// UTC date and time the run ended, `YYYY-MM-DD HH:MM`.
    pub date: String,
    /// The commit measured (`git describe`), when known.
    pub commit: String,
    /// `Small` or `Full`.
    pub size: String,
}

impl RunInfo {
    /// This host, now.
    #[must_use]
    pub fn here(size: crate::Size) -> Self {
        let (cpu, cores) = crate::cpu_model();
        let commit = std::process::Command::new("git")
            .args(["describe", "--always", "--dirty"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        Self {
            machine: format!(
                "{cpu}, {cores} vCPUs, AES path {}",
                memveil_cipher::path().describe()
            ),
            date: utc_now(),
            commit,
            size: format!("{size:?}"),
        }
    }
}

/// `YYYY-MM-DD HH:MM` UTC.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60
    )
}

/// Whether a figure meets `target` (`>= 0.85`, `<= 2`, `== 0`): a target
/// with a unit (`<= 2 us added`) is of the `value`, one without of the
/// `ratio` (the value when there is none); `None` for a figure that is only
/// reported.
#[must_use]
pub fn met(target: &str, value: f64, ratio: Option<f64>) -> Option<bool> {
    let t = target.trim();
    let (op, rest) = [">=", "<=", "=="]
        .iter()
        .find_map(|op| t.strip_prefix(op).map(|r| (*op, r)))?;
    let mut words = rest.split_whitespace();
    let v: f64 = words.next()?.parse().ok()?;
    let x = if words.next().is_some() {
        value
    } else {
        ratio.unwrap_or(value)
    };
    Some(match op {
        ">=" => x >= v,
        "<=" => x <= v,
        _ => (x - v).abs() < 1e-9,
    })
}

/// One figure as read back from a JSON file.
#[derive(Debug, Clone, serde::Deserialize)]
struct Read {
    figure: String,
    value: f64,
    unit: String,
    ratio: Option<f64>,
    target: Option<String>,
}

/// The sheet for the runs `files` (the contents of `--json` files, oldest
/// first: a figure a later file measured again takes its value from it).
///
/// # Errors
/// A file that is not a `memveil bench --json` report.
pub fn markdown(files: &[(String, String)]) -> Result<String, String> {
    let mut rows: BTreeMap<String, (Read, usize)> = BTreeMap::new();
    let mut runs = Vec::new();
    for (name, text) in files {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("{name}: not JSON: {e}"))?;
        let (run, figs) = match v {
            serde_json::Value::Object(mut o) => (
                o.remove("run")
                    .and_then(|r| serde_json::from_value::<RunInfo>(r).ok())
                    .unwrap_or_default(),
                o.remove("figures").unwrap_or(serde_json::Value::Null),
            ),
            a @ serde_json::Value::Array(_) => (RunInfo::default(), a),
            _ => return Err(format!("{name}: not a memveil bench --json report")),
        };
        let figs: Vec<Read> = serde_json::from_value(figs)
            .map_err(|e| format!("{name}: not a memveil bench --json report: {e}"))?;
        let k = runs.len();
        runs.push((name.clone(), run));
        for f in figs {
            rows.insert(f.figure.clone(), (f, k));
        }
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "| figure | value | ratio | target | met | run |\n|---|---|---|---|---|---|"
    );
    let (mut n_met, mut n_missed) = (0, 0);
    for (id, (f, k)) in &rows {
        let verdict = match f.target.as_deref().and_then(|t| met(t, f.value, f.ratio)) {
            Some(true) => {
                n_met += 1;
                "met"
            }
            Some(false) => {
                n_missed += 1;
                "**missed**"
            }
            None => "",
        };
        let _ = writeln!(
            md,
            "| `{id}` | {} {} | {} | {} | {verdict} | {} |",
            num(f.value),
            f.unit,
            f.ratio.map_or_else(String::new, num),
            f.target.as_deref().unwrap_or("reported"),
            k + 1
        );
    }
    let _ = writeln!(
        md,
        "\n{} figures, {n_met} targets met, {n_missed} missed. Runs:\n",
        rows.len()
    );
    for (k, (name, r)) in runs.iter().enumerate() {
        let _ = writeln!(
            md,
            "{}. `{name}`: {} ({} size), at {}, on {}",
            k + 1,
            if r.date.is_empty() {
                "date unknown"
            } else {
                &r.date
            },
            if r.size.is_empty() { "?" } else { &r.size },
            if r.commit.is_empty() {
                "an unknown commit"
            } else {
                &r.commit
            },
            if r.machine.is_empty() {
                "an unknown machine"
            } else {
                &r.machine
            }
        );
    }
    Ok(md)
}

/// A figure's number with as many digits as it deserves.
fn num(x: f64) -> String {
    let a = x.abs();
    if a >= 100.0 || x == x.trunc() && a < 1e15 {
        format!("{x:.0}")
    } else if a >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_read_and_checked() {
        assert_eq!(met(">= 0.85", 0.9, None), Some(true));
        assert_eq!(met(">= 0.85", 0.8, None), Some(false));
        assert_eq!(met(">= 0.85", 5.0, Some(0.8)), Some(false));
        assert_eq!(met("<= 2", 2.0, None), Some(true));
        assert_eq!(met("== 0", 0.0, None), Some(true));
        assert_eq!(met("reported", 1.0, None), None);
        assert_eq!(met(">= x", 1.0, None), None);
        assert_eq!(met("<= 2 us added", 2.86, Some(-8.4)), Some(false));
    }

    #[test]
    fn a_later_run_wins_and_the_sheet_names_its_runs() {
        let a = r#"{"run":{"machine":"M","date":"2026-11-26 10:00","commit":"abc","size":"Small"},
            "figures":[{"figure":"x.a_vs_plain","value":2.0,"unit":"s","baseline":1.0,"ratio":0.5,"target":">= 0.85","note":""},
                       {"figure":"x.b","value":3.25,"unit":"us","baseline":null,"ratio":null,"note":""}]}"#;
        let b = r#"[{"figure":"x.a_vs_plain","value":1.0,"unit":"s","baseline":1.0,"ratio":0.9,"target":">= 0.85","note":""}]"#;
        let md =
            markdown(&[("a.json".into(), a.into()), ("b.json".into(), b.into())]).expect("sheet");
        assert!(
            md.contains("| `x.a_vs_plain` | 1 s | 0.900 | >= 0.85 | met | 2 |"),
            "{md}"
        );
        assert!(
            md.contains("| `x.b` | 3.25 us |  | reported |  | 1 |"),
            "{md}"
        );
        assert!(md.contains("2 figures, 1 targets met, 0 missed"), "{md}");
        assert!(
            md.contains("1. `a.json`: 2026-11-26 10:00 (Small size), at abc, on M"),
            "{md}"
        );
        assert!(markdown(&[("c".into(), "{}".into())]).is_err());
        assert!(markdown(&[("d".into(), "nope".into())]).is_err());
    }

    #[test]
    fn dates_are_civil_utc() {
        let d = utc_now();
        assert_eq!(d.len(), 16, "{d}");
        assert!(d.starts_with("20"), "{d}");
    }
}
