//! The three output forms: for people, JSON, and the Prometheus textfile
//! format read by node_exporter's textfile collector.

use std::fmt::Write as _;

use crate::report::{Report, Section, Status};

/// The report for people: sections of items (value, then how it was known
/// or why it is unknown), then the checks with what to do.
#[must_use]
pub fn human(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "memveil probe: {}",
        if r.description.is_empty() {
            "this host"
        } else {
            &r.description
        }
    );
    if let Some(k) = &r.kernel_release {
        let _ = writeln!(o, "kernel {k}");
    }
    let mut last: Option<Section> = None;
    for it in &r.items {
        if last != Some(it.section) {
            let _ = writeln!(o, "\n{}", it.section.title());
            last = Some(it.section);
        }
        match &it.value {
            crate::report::Value::Unknown { unknown } => {
                let _ = writeln!(o, "  {:<58} unknown: {unknown}", it.label);
            }
            v => {
                let _ = writeln!(o, "  {:<58} {v}", it.label);
                if !it.how.is_empty() {
                    let _ = writeln!(o, "  {:<58}   from {}", "", it.how);
                }
            }
        }
    }
    let _ = writeln!(o, "\nChecks");
    for c in &r.checks {
        let _ = writeln!(o, "  [{}] {:<18} {}", c.status.tag(), c.id, c.summary);
        if !c.action.is_empty() && c.status != Status::Pass {
            let _ = writeln!(o, "         {:<18} do: {}", "", c.action);
        }
    }
    let count = |s: Status| r.checks.iter().filter(|c| c.status == s).count();
    let _ = writeln!(
        o,
        "\n{} pass, {} warn, {} fail",
        count(Status::Pass),
        count(Status::Warn),
        count(Status::Fail)
    );
    o
}

/// The report as pretty JSON (`{"description", "kernel_release", "items",
/// "checks"}`); unknown values are `{"unknown": "reason"}`.
#[must_use]
pub fn json(r: &Report) -> String {
    serde_json::to_string_pretty(r).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

/// Escapes a Prometheus label value (backslash, double quote, newline).
#[must_use]
pub fn escape_label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// The report in the Prometheus text exposition format, for node_exporter's
/// textfile collector (write it to `*.prom` atomically: a temporary file,
/// then rename).
///
/// Families (all gauges):
/// - `memveil_probe_info{vendor,model,kernel}` 1
/// - `memveil_probe_item{item}`: numeric and yes/no items (1/0)
/// - `memveil_probe_item_known{item}`: 1 when the item is known, 0 when not
/// - `memveil_probe_check{check,status}`: 1 for the check's status, 0 for
///   the other two (a state set)
/// - `memveil_probe_checks{status}`: how many checks have each status
#[must_use]
pub fn prometheus(r: &Report) -> String {
    let mut o = String::new();
    let text = |id: &str| match r.item(id).map(|i| &i.value) {
        Some(crate::report::Value::Text(t)) => t.clone(),
        _ => String::new(),
    };
    let _ = writeln!(
        o,
        "# HELP memveil_probe_info Host identity as seen by memveil probe."
    );
    let _ = writeln!(o, "# TYPE memveil_probe_info gauge");
    let _ = writeln!(
        o,
        "memveil_probe_info{{vendor=\"{}\",model=\"{}\",kernel=\"{}\"}} 1",
        escape_label(&text("cpu.vendor")),
        escape_label(&text("cpu.model_name")),
        escape_label(r.kernel_release.as_deref().unwrap_or(""))
    );
    let _ = writeln!(
        o,
        "# HELP memveil_probe_item Numeric and yes/no (1/0) facts found by memveil probe."
    );
    let _ = writeln!(o, "# TYPE memveil_probe_item gauge");
    for it in &r.items {
        if let Some(v) = it.value.as_metric() {
            let _ = writeln!(
                o,
                "memveil_probe_item{{item=\"{}\"}} {v}",
                escape_label(&it.id)
            );
        }
    }
    let _ = writeln!(o, "# HELP memveil_probe_item_known 1 when memveil probe could establish the fact, 0 when it is unknown.");
    let _ = writeln!(o, "# TYPE memveil_probe_item_known gauge");
    for it in &r.items {
        let _ = writeln!(
            o,
            "memveil_probe_item_known{{item=\"{}\"}} {}",
            escape_label(&it.id),
            u8::from(it.value.is_known())
        );
    }
    let _ = writeln!(
        o,
        "# HELP memveil_probe_check Verdict of each memveil probe check (1 for its status)."
    );
    let _ = writeln!(o, "# TYPE memveil_probe_check gauge");
    for c in &r.checks {
        for s in [Status::Pass, Status::Warn, Status::Fail] {
            let _ = writeln!(
                o,
                "memveil_probe_check{{check=\"{}\",status=\"{}\"}} {}",
                escape_label(&c.id),
                s.name(),
                u8::from(c.status == s)
            );
        }
    }
    let _ = writeln!(
        o,
        "# HELP memveil_probe_checks Number of memveil probe checks with each status."
    );
    let _ = writeln!(o, "# TYPE memveil_probe_checks gauge");
    for s in [Status::Pass, Status::Warn, Status::Fail] {
        let n = r.checks.iter().filter(|c| c.status == s).count();
        let _ = writeln!(o, "memveil_probe_checks{{status=\"{}\"}} {n}", s.name());
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_escaping() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
