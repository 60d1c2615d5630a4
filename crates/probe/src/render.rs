//! The three output forms: for people, JSON, and the Prometheus textfile
//! format read by node_exporter's textfile collector.

use std::fmt::Write as _;

use crate::exposition::{flag, Kind, Writer};
use crate::report::{Report, Section, Status};

/// The report for people: sections of items (value, then how it was known
/// or why it is unknown), then the checks with what to do.
#[must_use]
pub fn human(r: &Report) -> String {
    let mut o = String::new();
    wrap(
        &mut o,
        "memveil probe: ",
        if r.description.is_empty() {
            "this host"
        } else {
            &r.description
        },
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
        let value = match &it.value {
            crate::report::Value::Unknown { unknown } => format!("unknown: {unknown}"),
            v => v.to_string(),
        };
        // The label, then its value in the column after it (on the next
        // line when the label is too long for the column).
        if it.label.chars().count() <= LABEL {
            wrap(&mut o, &format!("  {:<LABEL$} ", it.label), &value);
        } else {
            let _ = writeln!(o, "  {}", it.label);
            wrap(&mut o, &" ".repeat(LABEL + 3), &value);
        }
        if !matches!(it.value, crate::report::Value::Unknown { .. }) && !it.how.is_empty() {
            wrap(&mut o, "      from ", &it.how);
        }
    }
    let _ = writeln!(o, "\nChecks");
    for c in &r.checks {
        wrap(
            &mut o,
            &format!("  [{}] {:<18} ", c.status.tag(), c.id),
            &c.summary,
        );
        if !c.action.is_empty() && c.status != Status::Pass {
            wrap(&mut o, &format!("         {:<18} do: ", ""), &c.action);
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

/// Width of the label column of the report for people.
const LABEL: usize = 44;

/// Widest line of the report for people.
pub const WIDTH: usize = 100;

/// Appends `text` after `first` (whose width is the indent of the lines it
/// continues on), word-wrapped to [`WIDTH`] columns; a word longer than a
/// line is cut.
fn wrap(o: &mut String, first: &str, text: &str) {
    let indent = first.chars().count();
    let room = WIDTH.saturating_sub(indent).max(20);
    let mut line = String::new();
    let mut lines = Vec::new();
    for word in text.split_whitespace() {
        let mut word: Vec<char> = word.chars().collect();
        loop {
            let used = line.chars().count();
            let need = word.len() + usize::from(used > 0);
            if used + need <= room {
                if used > 0 {
                    line.push(' ');
                }
                line.extend(word.iter());
                break;
            }
            if used > 0 {
                lines.push(std::mem::take(&mut line));
                continue;
            }
            // A word longer than a whole line: cut it.
            let rest = word.split_off(room);
            lines.push(word.iter().collect());
            word = rest;
        }
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line);
    }
    for (i, l) in lines.iter().enumerate() {
        if i == 0 {
            let _ = writeln!(o, "{first}{l}");
        } else {
            let _ = writeln!(o, "{:indent$}{l}", "");
        }
    }
}

/// The report as pretty JSON (`{"description", "kernel_release", "items",
/// "checks"}`); unknown values are `{"unknown": "reason"}`.
#[must_use]
pub fn json(r: &Report) -> String {
    serde_json::to_string_pretty(r).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

pub use crate::exposition::escape_label;

/// The CPU features exported as `memveil_cpu_feature{feature}`: the label
/// and the report item.
const CPU_FEATURES: &[(&str, &str)] = &[
    ("aes_ni", "cpu.aes_ni"),
    ("vaes", "cpu.vaes"),
    ("pclmulqdq", "cpu.pclmulqdq"),
    ("vpclmulqdq", "cpu.vpclmulqdq"),
    ("avx512f", "cpu.avx512f"),
    ("rdrand", "cpu.rdrand"),
    ("rdseed", "cpu.rdseed"),
];

/// The report in the Prometheus text exposition format, for node_exporter's
/// textfile collector (write it to `*.prom` atomically: a temporary file,
/// then rename) and for `memveil probe --serve`.
///
/// Families (all gauges), first the named ones a dashboard or an alert
/// reads (a sample is left out when the probe could not establish it):
/// - `memveil_memory_encryption_active`: 1 when the `memory-encryption`
///   check passes (TME, SME or TSME active, or an SEV/TDX guest)
/// - `memveil_cpu_feature{feature}`: AES-NI, VAES, (V)PCLMULQDQ, AVX-512F,
///   RDRAND, RDSEED present (CPUID)
/// - `memveil_rng_healthy{source}`: RDRAND/RDSEED passed the live health
///   sample
/// - `memveil_kernel_feature{feature}`: `memfd_secret`, `userfaultfd`
///   (usable, the check passes), `kvm`
/// - `memveil_tme_mk_keyids`: hardware TME-MK KeyIDs usable
///
/// then every item and check generically:
/// - `memveil_probe_info{vendor,model,kernel}` 1
/// - `memveil_probe_item{item}`: numeric and yes/no items (1/0)
/// - `memveil_probe_item_known{item}`: 1 when the item is known, 0 when not
/// - `memveil_probe_check{check,status}`: 1 for the check's status, 0 for
///   the other two (a state set)
/// - `memveil_probe_checks{status}`: how many checks have each status
#[must_use]
pub fn prometheus(r: &Report) -> String {
    let mut w = Writer::new();
    named(r, &mut w);
    generic(r, &mut w);
    w.finish()
}

/// The named host families of [`prometheus`].
pub fn named(r: &Report, w: &mut Writer) {
    let num = |id: &str| r.item(id).and_then(|i| i.value.as_metric());
    let passes = |id: &str| r.check(id).map(|c| flag(c.status == Status::Pass));
    if let Some(v) = passes("memory-encryption") {
        w.single(
            "memveil_memory_encryption_active",
            Kind::Gauge,
            "1 when hardware memory encryption is in force (Intel TME, AMD SME or TSME, or an SEV/TDX confidential guest), 0 when not or unknown.",
            v,
        );
    }
    w.family(
        "memveil_cpu_feature",
        Kind::Gauge,
        "CPU instruction present (CPUID): 1 yes, 0 no.",
    );
    for (label, id) in CPU_FEATURES {
        if let Some(v) = num(id) {
            #[allow(clippy::cast_precision_loss)]
            w.sample(&[("feature", label)], v as f64);
        }
    }
    w.family(
        "memveil_rng_healthy",
        Kind::Gauge,
        "The on-chip RNG passed the SP 800-90B health tests on a live sample: 1 yes, 0 no (absent, failing or unusable).",
    );
    for source in ["rdrand", "rdseed"] {
        if let Some(v) = num(&format!("rng.{source}.healthy")) {
            #[allow(clippy::cast_precision_loss)]
            w.sample(&[("source", source)], v as f64);
        }
    }
    w.family(
        "memveil_kernel_feature",
        Kind::Gauge,
        "Kernel facility memveil uses works here: 1 yes, 0 no (memfd_secret: secret memory; userfaultfd: usable for memveil run; kvm: /dev/kvm).",
    );
    let kernel = [
        (
            "memfd_secret",
            num("kernel.memfd_secret").map(|v| flag(v != 0)),
        ),
        ("userfaultfd", passes("userfaultfd")),
        ("kvm", num("kernel.kvm").map(|v| flag(v != 0))),
    ];
    for (label, v) in kernel {
        if let Some(v) = v {
            w.sample(&[("feature", label)], v);
        }
    }
    if let Some(v) = num("intel.mktme.usable_keyids") {
        #[allow(clippy::cast_precision_loss)]
        w.single(
            "memveil_tme_mk_keyids",
            Kind::Gauge,
            "Hardware TME-MK KeyIDs usable (IA32_TME_ACTIVATE), 0 without TME-MK.",
            v as f64,
        );
    }
}

/// The generic families of [`prometheus`]: every item and check.
#[allow(clippy::cast_precision_loss)]
pub(crate) fn generic(r: &Report, w: &mut Writer) {
    let text = |id: &str| match r.item(id).map(|i| &i.value) {
        Some(crate::report::Value::Text(t)) => t.clone(),
        _ => String::new(),
    };
    w.family(
        "memveil_probe_info",
        Kind::Gauge,
        "Host identity as seen by memveil probe.",
    )
    .sample(
        &[
            ("vendor", &text("cpu.vendor")),
            ("model", &text("cpu.model_name")),
            ("kernel", r.kernel_release.as_deref().unwrap_or("")),
        ],
        1.0,
    );
    w.family(
        "memveil_probe_item",
        Kind::Gauge,
        "Numeric and yes/no (1/0) facts found by memveil probe.",
    );
    for it in &r.items {
        if let Some(v) = it.value.as_metric() {
            w.sample(&[("item", &it.id)], v as f64);
        }
    }
    w.family(
        "memveil_probe_item_known",
        Kind::Gauge,
        "1 when memveil probe could establish the fact, 0 when it is unknown.",
    );
    for it in &r.items {
        w.sample(&[("item", &it.id)], flag(it.value.is_known()));
    }
    w.family(
        "memveil_probe_check",
        Kind::Gauge,
        "Verdict of each memveil probe check (1 for its status).",
    );
    for c in &r.checks {
        for s in [Status::Pass, Status::Warn, Status::Fail] {
            w.sample(
                &[("check", &c.id), ("status", s.name())],
                flag(c.status == s),
            );
        }
    }
    w.family(
        "memveil_probe_checks",
        Kind::Gauge,
        "Number of memveil probe checks with each status.",
    );
    for s in [Status::Pass, Status::Warn, Status::Fail] {
        let n = r.checks.iter().filter(|c| c.status == s).count();
        w.sample(&[("status", s.name())], n as f64);
    }
}
