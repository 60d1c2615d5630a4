//! The figure sheet: one current table of every figure (its value, its
//! target, whether it is met, the machine and the date), made from the JSON
//! files `memveil bench --json` writes, so that BENCHMARKS.md cannot drift
//! from what was measured (`scripts/figures.sh` rewrites its table).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::report::Spread;

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

/// What a target is of: the figure's ratio to its baseline, or its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Of {
    /// `value / baseline` (a `_vs_` figure).
    Ratio,
    /// The figure's own value, in its unit.
    Value,
}

/// A figure's target, read from its text (`>= 0.85`, `ratio >= 0.85`,
/// `value <= 6 µs`, `<= 2 us added`, `>= 1.0 (no VAES)`).
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// What the bound applies to.
    pub of: Of,
    /// `>=`, `<=`, `==`, `<` or `>`.
    pub op: &'static str,
    /// The bound.
    pub bound: f64,
    /// A remark after the bound in parentheses (`(no VAES)`), kept.
    pub remark: String,
}

/// Whether figure `id` is an "added" figure (its value is a difference to
/// the baseline, so a ratio means nothing).
#[must_use]
pub fn is_added(id: &str) -> bool {
    id.contains("_added")
}

impl Target {
    /// Reads `text` for figure `id`. An explicit `value` or `ratio` word
    /// wins; a unit after the bound (`<= 2 us added`) makes it of the
    /// value, and so does an "added" figure or one named for its unit
    /// (`shield.random_fault_us`, `probe.scrape_ms`); otherwise it is of
    /// the ratio when the figure has one (`engine.scaling_2t`), else of the
    /// value. `None` for "reported" or no target.
    #[must_use]
    pub fn parse(id: &str, text: &str, has_ratio: bool) -> Option<Self> {
        let mut t = text.trim();
        let mut of = None;
        for (word, o) in [("value", Of::Value), ("ratio", Of::Ratio)] {
            if let Some(r) = t.strip_prefix(word) {
                t = r.trim_start();
                of = Some(o);
            }
        }
        let op = [">=", "<=", "==", "<", ">"]
            .into_iter()
            .find(|op| t.starts_with(op))?;
        let rest = t[op.len()..].trim_start();
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-'))
            .unwrap_or(rest.len());
        let bound: f64 = rest[..num_end].parse().ok()?;
        let tail = rest[num_end..].trim();
        let (unit, remark) = match tail.find('(') {
            Some(i) => (tail[..i].trim(), tail[i..].trim()),
            None => (tail, ""),
        };
        let named_for_unit = ["_ns", "_us", "_ms", "_s"].iter().any(|u| id.ends_with(u));
        let of = match of {
            Some(o) => o,
            None if !unit.is_empty() || is_added(id) || named_for_unit || !has_ratio => Of::Value,
            None => Of::Ratio,
        };
        Some(Self {
            of,
            op,
            bound,
            remark: remark.to_owned(),
        })
    }

    /// The quantity the target is of, for a figure with this value and ratio
    /// (a ratio target of a figure without a ratio is of its value: the
    /// figure is itself a ratio, as `rng.share_min_ratio`).
    #[must_use]
    pub fn subject(&self, value: f64, ratio: Option<f64>) -> f64 {
        match (self.of, ratio) {
            (Of::Ratio, Some(r)) => r,
            _ => value,
        }
    }

    /// Whether a figure with this value and ratio meets the target.
    #[must_use]
    pub fn met(&self, value: f64, ratio: Option<f64>) -> bool {
        let x = self.subject(value, ratio);
        match self.op {
            ">=" => x >= self.bound,
            "<=" => x <= self.bound,
            "<" => x < self.bound,
            ">" => x > self.bound,
            _ => (x - self.bound).abs() < 1e-9,
        }
    }

    /// The target as the sheet shows it: `ratio >= 0.85`, `value <= 6 µs`.
    #[must_use]
    pub fn show(&self, unit: &str) -> String {
        let mut s = match self.of {
            Of::Ratio => format!("ratio {} {}", self.op, self.bound),
            Of::Value => format!("value {} {}", self.op, self.bound),
        };
        if self.of == Of::Value && !is_unitless(unit) {
            s.push(' ');
            s.push_str(&show_unit(unit));
        }
        if !self.remark.is_empty() {
            s.push(' ');
            s.push_str(&self.remark);
        }
        s
    }

    /// One line saying why a figure met or missed the target
    /// (`value 23.92 µs is above 6 µs`).
    #[must_use]
    pub fn reason(&self, value: f64, unit: &str, ratio: Option<f64>) -> String {
        let x = self.subject(value, ratio);
        let (what, u) = match (self.of, ratio) {
            (Of::Ratio, Some(_)) => ("ratio", String::new()),
            _ if is_unitless(unit) => ("value", String::new()),
            _ => ("value", format!(" {}", show_unit(unit))),
        };
        let rel = if (x - self.bound).abs() < 1e-9 {
            "equal to"
        } else if x > self.bound {
            "above"
        } else {
            "below"
        };
        format!("{what} {}{u} is {rel} {}{u}", num(x), self.bound)
    }
}

/// Units that are themselves ratios (no unit is printed after their bound).
fn is_unitless(unit: &str) -> bool {
    matches!(unit, "" | "ratio" | "fraction" | "x")
}

/// `us` as `µs`, so one figure sheet spells one unit one way.
fn show_unit(unit: &str) -> String {
    if unit == "us" {
        "µs".to_owned()
    } else {
        unit.to_owned()
    }
}

/// Whether a figure meets `target` (see [`Target::parse`] for what the
/// target is of); `None` for a figure that is only reported.
#[must_use]
pub fn met(id: &str, target: &str, value: f64, ratio: Option<f64>) -> Option<bool> {
    Target::parse(id, target, ratio.is_some()).map(|t| t.met(value, ratio))
}

/// One figure as read back from a JSON file.
#[derive(Debug, Clone, serde::Deserialize)]
struct Read {
    figure: String,
    value: f64,
    unit: String,
    ratio: Option<f64>,
    target: Option<String>,
    #[serde(default)]
    spread: Option<Spread>,
}

/// Rounds a figure that decides a target is the median of, at least.
pub const DECIDING_ROUNDS: u32 = 3;

/// The sheet for the runs `files` (the contents of `--json` files, oldest
/// first: a figure a later file measured again takes its value from it),
/// each figure compared with its value in `previous` (the files the last
/// `scripts/figures.sh --run` replaced, same form; may be empty).
///
/// # Errors
/// A file that is not a `memveil bench --json` report.
pub fn markdown(
    files: &[(String, String)],
    previous: &[(String, String)],
) -> Result<String, String> {
    let (rows, runs) = read_all(files)?;
    let (before, _) = read_all(previous)?;
    Ok(render(&rows, &runs, &before))
}

/// Figures by id (a later file wins) with the run that measured each, and
/// the runs.
#[allow(clippy::type_complexity)]
fn read_all(
    files: &[(String, String)],
) -> Result<(BTreeMap<String, (Read, usize)>, Vec<(String, RunInfo)>), String> {
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
    Ok((rows, runs))
}

/// How a figure moved since its previous measurement: `None` when it had
/// none; else the change of what its target is of (the ratio, or the
/// value) and whether that is more than the new rounds' spread (`None`
/// when the figure has no spread to judge by).
fn moved(id: &str, f: &Read, before: Option<&Read>) -> Option<(f64, Option<bool>)> {
    let b = before?;
    let now = f.ratio_shown(id).unwrap_or(f.value);
    let then = b.ratio_shown(id).unwrap_or(b.value);
    let d = now - then;
    let beyond = f
        .spread
        .filter(|s| s.rounds >= 2)
        .map(|s| d.abs() > s.high - s.low);
    Some((d, beyond))
}

/// `3 (0.88-0.93)`, `1`, or empty when the file does not say.
fn show_rounds(s: Option<Spread>) -> String {
    match s {
        Some(s) if s.rounds >= 2 => format!("{} ({}-{})", s.rounds, num(s.low), num(s.high)),
        Some(s) => s.rounds.to_string(),
        None => String::new(),
    }
}

/// The sheet: the summary, the targets (missed, then met, each with why),
/// the figures only reported grouped by part, and the runs.
fn render(
    rows: &BTreeMap<String, (Read, usize)>,
    runs: &[(String, RunInfo)],
    before: &BTreeMap<String, (Read, usize)>,
) -> String {
    // (id, figure, run, target, met)
    let mut targets = Vec::new();
    let mut reported: BTreeMap<&str, Vec<(&String, &Read, usize)>> = BTreeMap::new();
    for (id, (f, k)) in rows {
        match f
            .target
            .as_deref()
            .and_then(|t| Target::parse(id, t, f.ratio_shown(id).is_some()))
        {
            Some(t) => {
                let ok = t.met(f.value, f.ratio_shown(id));
                targets.push((id, f, *k, t, ok));
            }
            None => reported
                .entry(id.split('.').next().unwrap_or(id))
                .or_default()
                .push((id, f, *k)),
        }
    }
    let n_met = targets.iter().filter(|t| t.4).count();
    let n_missed = targets.len() - n_met;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "**{} figures: {} with a target, {n_met} met, {n_missed} missed; {} only reported.** \
         A target says what it is of: the `ratio` to the baseline measured in the same run, or \
         the figure's `value` in its unit. An \"added\" figure (vault or module minus baseline) has \
         no ratio.\n",
        rows.len(),
        targets.len(),
        rows.len() - targets.len()
    );
    let few = targets
        .iter()
        .filter(|t| t.1.spread.is_none_or(|s| s.rounds < DECIDING_ROUNDS))
        .count();
    let _ = writeln!(
        md,
        "A figure that decides a target is the median of at least {DECIDING_ROUNDS} rounds; \
         `rounds` gives their number and spread (of the ratio, or of the value), empty where the \
         file does not say: {few} of the {} targets are decided by fewer or unknown rounds. \
         `since` is the change from the value the previous measurement gave (what \
         `scripts/figures.sh --run` replaced), **moved** when it exceeds the spread.\n",
        targets.len()
    );
    let _ = writeln!(
        md,
        "### Targets\n\n| figure | value | ratio | rounds | target | verdict | why | since | run |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    targets.sort_by_key(|t| t.4);
    for (id, f, k, t, ok) in &targets {
        let ratio = f.ratio_shown(id);
        let _ = writeln!(
            md,
            "| `{id}` | {} {} | {} | {} | {} | {} | {} | {} | {} |",
            num(f.value),
            show_unit(&f.unit),
            ratio.map_or_else(String::new, num),
            show_rounds(f.spread),
            t.show(&f.unit),
            if *ok { "met" } else { "**missed**" },
            t.reason(f.value, &f.unit, ratio),
            show_since(moved(id, f, before.get(*id).map(|b| &b.0))),
            k + 1
        );
    }
    let moved_rows: Vec<String> = rows
        .iter()
        .filter_map(|(id, (f, _))| {
            let (d, beyond) = moved(id, f, before.get(id).map(|b| &b.0))?;
            (beyond == Some(true)).then(|| format!("`{id}` ({})", signed(d)))
        })
        .collect();
    let _ = writeln!(
        md,
        "\nMoved by more than their spread since the previous measurement: {}.",
        if moved_rows.is_empty() {
            "none".to_owned()
        } else {
            moved_rows.join(", ")
        }
    );
    let _ = writeln!(md, "\n### Reported only, by part");
    for (part, figs) in &reported {
        let _ = writeln!(
            md,
            "\n#### {part}\n\n| figure | value | ratio | rounds | since | run |\n\
             |---|---|---|---|---|---|"
        );
        for (id, f, k) in figs {
            let _ = writeln!(
                md,
                "| `{id}` | {} {} | {} | {} | {} | {} |",
                num(f.value),
                show_unit(&f.unit),
                f.ratio_shown(id).map_or_else(String::new, num),
                show_rounds(f.spread),
                show_since(moved(id, f, before.get(*id).map(|b| &b.0))),
                k + 1
            );
        }
    }
    let _ = writeln!(md, "\n### Runs\n");
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
    md
}

impl Read {
    /// The ratio the sheet shows: none for an "added" figure.
    fn ratio_shown(&self, id: &str) -> Option<f64> {
        self.ratio.filter(|_| !is_added(id))
    }
}

/// The `since` cell: `+0.120 **moved**`, `-0.010`, or empty.
fn show_since(m: Option<(f64, Option<bool>)>) -> String {
    match m {
        Some((d, Some(true))) => format!("{} **moved**", signed(d)),
        Some((d, _)) => signed(d),
        None => String::new(),
    }
}

/// A change with its sign.
fn signed(d: f64) -> String {
    if d >= 0.0 {
        format!("+{}", num(d))
    } else {
        num(d)
    }
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
        let m = |id, t, v, r| met(id, t, v, r);
        assert_eq!(m("x.a_vs_b", ">= 0.85", 0.9, None), Some(true));
        assert_eq!(m("x.a_vs_b", ">= 0.85", 0.8, None), Some(false));
        assert_eq!(m("x.a_vs_b", ">= 0.85", 5.0, Some(0.8)), Some(false));
        assert_eq!(m("x.ratio", "<= 2", 2.0, None), Some(true));
        assert_eq!(m("x.zero", "== 0", 0.0, None), Some(true));
        assert_eq!(m("x.a", "reported", 1.0, None), None);
        assert_eq!(m("x.a", ">= x", 1.0, None), None);
        assert_eq!(
            m("x.cbc_added_us", "<= 2 us added", 2.86, Some(-8.4)),
            Some(false)
        );
        assert_eq!(m("x.lat_vs_b", "< 1.25", 15.9, Some(1.08)), Some(true));
        assert_eq!(m("e.scaling_2t", ">= 1.7", 13.7, Some(1.71)), Some(true));
        assert_eq!(
            m("x.lat_added_us", "value <= 1 µs", 0.39, Some(2.5)),
            Some(true)
        );
        assert_eq!(
            m("x.lat_added_us", "value <= 1 µs", 1.5, Some(0.5)),
            Some(false)
        );
        let t = Target::parse("e.x_vs_y", ">= 1.0 (no VAES)", true).expect("target");
        assert_eq!(t.show("GB/s"), "ratio >= 1 (no VAES)");
        let t = Target::parse("s.fault_us", "<= 6", true).expect("target");
        assert_eq!(t.show("µs"), "value <= 6 µs");
        assert_eq!(
            t.reason(23.92, "µs", Some(2.0)),
            "value 23.92 µs is above 6 µs"
        );
    }

    /// Issue 35: a µs figure above its `<= 6` target was "met" because the
    /// target was read against its ratio; an added figure showed a ratio.
    #[test]
    fn a_figure_that_misses_a_microsecond_target_with_a_passing_ratio_is_missed() {
        let f = r#"[{"figure":"shield.random_fault_us","value":23.92,"unit":"µs","baseline":40.0,"ratio":0.598,"target":"<= 6","note":""},
                    {"figure":"pkcs11.cbc_256_added_us","value":2.45,"unit":"us","baseline":16.7,"ratio":-14.09,"target":"<= 2 us added","note":""}]"#;
        let md = markdown(&[("shield.json".into(), f.into())], &[]).expect("sheet");
        assert!(
            md.contains("| `shield.random_fault_us` | 23.92 µs | 0.598 |  | value <= 6 µs | **missed** | value 23.92 µs is above 6 µs |  | 1 |"),
            "{md}"
        );
        assert!(
            md.contains(
                "| `pkcs11.cbc_256_added_us` | 2.45 µs |  |  | value <= 2 µs | **missed** |"
            ),
            "an added figure shows no ratio: {md}"
        );
        assert!(!md.contains("-14.09"), "{md}");
        assert!(md.contains("2 with a target, 0 met, 2 missed"), "{md}");
    }

    #[test]
    fn a_later_run_wins_and_the_sheet_opens_with_the_summary_and_targets() {
        let a = r#"{"run":{"machine":"M","date":"2026-11-26 10:00","commit":"abc","size":"Small"},
            "figures":[{"figure":"x.a_vs_plain","value":2.0,"unit":"s","baseline":1.0,"ratio":0.5,"target":">= 0.85","note":""},
                       {"figure":"x.b","value":3.25,"unit":"us","baseline":null,"ratio":null,"note":""},
                       {"figure":"y.c","value":1.5,"unit":"s","baseline":null,"ratio":null,"target":"reported","note":""}]}"#;
        let b = r#"[{"figure":"x.a_vs_plain","value":1.0,"unit":"s","baseline":1.0,"ratio":0.9,"target":">= 0.85","note":""}]"#;
        let md = markdown(
            &[("a.json".into(), a.into()), ("b.json".into(), b.into())],
            &[],
        )
        .expect("sheet");
        assert!(
            md.starts_with("**3 figures: 1 with a target, 1 met, 0 missed; 2 only reported.**"),
            "{md}"
        );
        assert!(
            md.contains("| `x.a_vs_plain` | 1 s | 0.900 |  | ratio >= 0.85 | met | ratio 0.900 is above 0.85 |  | 2 |"),
            "{md}"
        );
        let (x, y) = (md.find("#### x").expect("x"), md.find("#### y").expect("y"));
        assert!(
            md.find("### Targets").expect("targets") < x && x < y,
            "{md}"
        );
        assert!(md.contains("| `x.b` | 3.25 µs |  |  |  | 1 |"), "{md}");
        assert!(
            md.contains("1. `a.json`: 2026-11-26 10:00 (Small size), at abc, on M"),
            "{md}"
        );
        assert!(markdown(&[("c".into(), "{}".into())], &[]).is_err());
        assert!(markdown(&[("d".into(), "nope".into())], &[]).is_err());
    }

    /// Issue 33, item 5: the rounds and their spread are shown, and a
    /// figure that moved by more than its spread since the previous
    /// measurement is named; one that moved within it is not.
    #[test]
    fn rounds_spread_and_moves_beyond_the_spread_are_shown() {
        let now = r#"[{"figure":"s.a_vs_plain","value":1.0,"unit":"s","baseline":1.0,"ratio":0.91,"target":">= 0.9","note":"","spread":{"rounds":3,"low":0.89,"high":0.93}},
                      {"figure":"s.b_vs_plain","value":1.0,"unit":"s","baseline":1.0,"ratio":0.80,"target":">= 0.9","note":"","spread":{"rounds":3,"low":0.78,"high":0.84}},
                      {"figure":"s.c","value":7.0,"unit":"ms","baseline":null,"ratio":null,"note":""}]"#;
        let then = r#"[{"figure":"s.a_vs_plain","value":1.0,"unit":"s","baseline":1.0,"ratio":0.74,"target":">= 0.9","note":""},
                       {"figure":"s.b_vs_plain","value":1.0,"unit":"s","baseline":1.0,"ratio":0.79,"target":">= 0.9","note":""}]"#;
        let md = markdown(
            &[("n.json".into(), now.into())],
            &[("p.json".into(), then.into())],
        )
        .expect("sheet");
        assert!(
            md.contains("| `s.a_vs_plain` | 1 s | 0.910 | 3 (0.890-0.930) | ratio >= 0.9 | met | ratio 0.910 is above 0.9 | +0.170 **moved** | 1 |"),
            "{md}"
        );
        assert!(
            md.contains("| ratio 0.800 is below 0.9 | +0.010 | 1 |"),
            "{md}"
        );
        assert!(
            md.contains("Moved by more than their spread since the previous measurement: `s.a_vs_plain` (+0.170)."),
            "{md}"
        );
        assert!(
            md.contains("0 of the 2 targets are decided by fewer or unknown rounds"),
            "{md}"
        );
        assert!(md.contains("| `s.c` | 7 ms |  |  |  | 1 |"), "{md}");
        let Some(sp) = crate::report::Spread::of(&[0.9, 0.7, 0.8]) else {
            panic!("a spread of three rounds");
        };
        assert_eq!((sp.rounds, sp.low, sp.high), (3, 0.7, 0.9));
        assert!(crate::report::Spread::of(&[]).is_none());
    }

    #[test]
    fn dates_are_civil_utc() {
        let d = utc_now();
        assert_eq!(d.len(), 16, "{d}");
        assert!(d.starts_with("20"), "{d}");
    }
}
