//! The Prometheus text exposition format (version 0.0.4): each family's
//! `# HELP` and `# TYPE` lines, then its samples, families contiguous.
//!
//! One writer for every family memveil exports (the probe's facts in
//! [`crate::render::prometheus`], the live counters in [`crate::fleet`]), so
//! escaping and number formatting live in one place.

use std::fmt::Write as _;

/// A family's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A value that goes up and down (a state, a count of things now).
    Gauge,
    /// A total that only grows while its process lives.
    Counter,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

/// Escapes a label value (backslash, double quote, newline).
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

/// Escapes HELP text (backslash and newline).
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A sample value as the format writes it (`+Inf`, `-Inf`, `NaN`).
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        format!("{v}")
    }
}

/// Writes families one after the other: [`Writer::family`] starts one,
/// [`Writer::sample`] adds a sample to the family started last.
#[derive(Debug, Default)]
pub struct Writer {
    out: String,
    name: String,
}

impl Writer {
    /// An empty exposition.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts the family `name` (its HELP and TYPE lines).
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) -> &mut Self {
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.name());
        name.clone_into(&mut self.name);
        self
    }

    /// One sample of the current family with `labels` (names are the
    /// caller's constants; values are escaped here).
    pub fn sample(&mut self, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.out.push_str(&self.name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", number(value));
        self
    }

    /// A family with one unlabelled sample.
    pub fn single(&mut self, name: &str, kind: Kind, help: &str, value: f64) -> &mut Self {
        self.family(name, kind, help).sample(&[], value)
    }

    /// The text.
    #[must_use]
    pub fn finish(self) -> String {
        self.out
    }
}

/// `1.0` for true, `0.0` for false.
#[must_use]
pub fn flag(b: bool) -> f64 {
    f64::from(u8::from(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_escaping() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn families_and_samples() {
        let mut w = Writer::new();
        w.family("m_a", Kind::Gauge, "first\nline")
            .sample(&[("x", "1\"")], 1.0)
            .sample(&[("x", "2"), ("y", "z")], 0.5);
        w.single("m_b_total", Kind::Counter, "b", 12.0);
        w.single("m_c", Kind::Gauge, "c", f64::INFINITY);
        assert_eq!(
            w.finish(),
            "# HELP m_a first\\nline\n# TYPE m_a gauge\nm_a{x=\"1\\\"\"} 1\nm_a{x=\"2\",y=\"z\"} 0.5\n\
             # HELP m_b_total b\n# TYPE m_b_total counter\nm_b_total 12\n\
             # HELP m_c c\n# TYPE m_c gauge\nm_c +Inf\n"
        );
    }
}
