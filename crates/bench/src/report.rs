//! The report: figures, sections, SVG plots, Markdown and JSON output.

use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

use crate::BenchError;

/// One measured figure, the unit of the JSON report.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    /// Stable id, e.g. `engine.xts128_vs_openssl`. Headline ids never change.
    pub figure: String,
    /// The measured value.
    pub value: f64,
    /// Unit of `value` and `baseline`.
    pub unit: String,
    /// The baseline measured in the same run, if any.
    pub baseline: Option<f64>,
    /// `value / baseline` (or the ratio the figure defines), if any.
    pub ratio: Option<f64>,
    /// The target the issue names, as text (e.g. `>= 1.0`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// What was measured, for people.
    pub note: String,
    /// The rounds the figure is the median of, and how far they spread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread: Option<Spread>,
}

/// How the rounds of a figure spread: the least and the largest of what
/// its target is of (the ratio when the figure has one, else its value).
/// A figure that decides a target is the median of at least three rounds
/// (issue 33), and the sheet says which figures moved by more than this.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Spread {
    /// Rounds measured.
    pub rounds: u32,
    /// The least round.
    pub low: f64,
    /// The largest round.
    pub high: f64,
}

impl Spread {
    /// The spread of `rounds` (`None` when there are none).
    #[must_use]
    pub fn of(rounds: &[f64]) -> Option<Self> {
        let low = rounds.iter().copied().reduce(f64::min)?;
        let high = rounds.iter().copied().reduce(f64::max)?;
        Some(Self {
            rounds: u32::try_from(rounds.len()).unwrap_or(u32::MAX),
            low,
            high,
        })
    }
}

impl Figure {
    /// A figure with a baseline; the ratio is `value / baseline`.
    #[must_use]
    pub fn vs(id: &str, value: f64, baseline: f64, unit: &str, note: &str) -> Self {
        let ratio = (baseline != 0.0).then(|| value / baseline);
        Self {
            figure: id.to_owned(),
            value,
            unit: unit.to_owned(),
            baseline: Some(baseline),
            ratio,
            target: None,
            note: note.to_owned(),
            spread: None,
        }
    }

    /// A figure without a baseline.
    #[must_use]
    pub fn plain(id: &str, value: f64, unit: &str, note: &str) -> Self {
        Self {
            figure: id.to_owned(),
            value,
            unit: unit.to_owned(),
            baseline: None,
            ratio: None,
            target: None,
            note: note.to_owned(),
            spread: None,
        }
    }

    /// Records the rounds the figure is the median of: `per_round` holds
    /// each round's ratio when the figure has one, else each round's value.
    #[must_use]
    pub fn rounds(mut self, per_round: &[f64]) -> Self {
        self.spread = Spread::of(per_round);
        self
    }

    /// Sets the ratio explicitly (for figures whose ratio is not value/baseline).
    #[must_use]
    pub fn with_ratio(mut self, ratio: f64) -> Self {
        self.ratio = Some(ratio);
        self
    }

    /// A figure whose value is what it adds to a baseline (`value` =
    /// measured − baseline): it has no ratio.
    #[must_use]
    pub fn added(id: &str, added: f64, baseline: f64, unit: &str, note: &str) -> Self {
        Self {
            baseline: Some(baseline),
            ..Self::plain(id, added, unit, note)
        }
    }

    /// Records the target the issue names, written as what it is of
    /// (`>= 0.85` of a `_vs_` figure becomes `ratio >= 0.85`, `<= 6` of a
    /// µs figure `value <= 6 µs`; see [`crate::sheet::Target`]).
    #[must_use]
    pub fn target(mut self, t: &str) -> Self {
        self.target = Some(
            crate::sheet::Target::parse(&self.figure, t, self.ratio.is_some())
                .map_or_else(|| t.to_owned(), |x| x.show(&self.unit)),
        );
        self
    }
}

/// One data series of a plot.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// (x, y) points in x order.
    pub points: Vec<(f64, f64)>,
}

/// A line plot, written as SVG.
#[derive(Debug, Clone)]
pub struct Plot {
    /// File name inside the report folder (`*.svg`).
    pub file: String,
    /// Title.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// The series.
    pub series: Vec<Series>,
}

/// The result of one part.
#[derive(Debug, Clone)]
pub struct Section {
    /// Part name (`engine`, `vault`, ...).
    pub part: String,
    /// Heading.
    pub title: String,
    /// Free Markdown (tables, comparisons with published figures).
    pub markdown: String,
    /// Figures.
    pub figures: Vec<Figure>,
    /// Plots.
    pub plots: Vec<Plot>,
}

const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

impl Plot {
    /// Renders the plot as a self-contained SVG document.
    #[must_use]
    pub fn to_svg(&self) -> String {
        let (w, h, l, r, t, b) = (720.0_f64, 420.0_f64, 70.0, 180.0, 40.0, 50.0);
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, f64::MIN);
        for &(x, y) in pts {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
        if x0 > x1 {
            (x0, x1, y1) = (0.0, 1.0, 1.0);
        }
        if x1 == x0 {
            x1 = x0 + 1.0;
        }
        let y1 = if y1 <= 0.0 { 1.0 } else { y1 * 1.1 };
        let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - r);
        let py = |y: f64| h - b - y / y1 * (h - t - b);
        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = write!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = write!(
            s,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            (w - r + l) / 2.0,
            esc(&self.title)
        );
        for i in 0..=5 {
            let yv = y1 * f64::from(i) / 5.0;
            let y = py(yv);
            let _ = write!(
                s,
                r##"<line x1="{l}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                w - r,
                l - 5.0,
                y + 4.0,
                fmt_tick(yv)
            );
            let xv = x0 + (x1 - x0) * f64::from(i) / 5.0;
            let _ = write!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
                px(xv),
                h - b + 16.0,
                fmt_tick(xv)
            );
        }
        let _ = write!(
            s,
            r#"<line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{l}" y1="{t}" x2="{l}" y2="{}" stroke="black"/>"#,
            h - b,
            w - r,
            h - b,
            h - b
        );
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text><text transform="translate(16,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
            (w - r + l) / 2.0,
            h - 10.0,
            esc(&self.x_label),
            (h - b + t) / 2.0,
            esc(&self.y_label)
        );
        for (i, se) in self.series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            let path: Vec<String> = se
                .points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
                path.join(" ")
            );
            for &(x, y) in &se.points {
                let _ = write!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#,
                    px(x),
                    py(y)
                );
            }
            #[allow(clippy::cast_precision_loss)]
            let ly = t + 10.0 + 18.0 * i as f64;
            let _ = write!(
                s,
                r#"<rect x="{}" y="{}" width="12" height="12" fill="{c}"/><text x="{}" y="{}">{}</text>"#,
                w - r + 10.0,
                ly - 10.0,
                w - r + 28.0,
                ly,
                esc(&se.name)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn fmt_num(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Renders the Markdown report.
#[must_use]
pub fn to_markdown(sections: &[Section], header: &str) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# memveil benchmark report\n\n{header}\n");
    for sec in sections {
        let _ = writeln!(md, "## {}\n", sec.title);
        if !sec.figures.is_empty() {
            md.push_str("| figure | value | baseline | ratio | target | what |\n|---|---|---|---|---|---|\n");
            for f in &sec.figures {
                let _ = writeln!(
                    md,
                    "| `{}` | {} {} | {} | {} | {} | {} |",
                    f.figure,
                    fmt_num(f.value),
                    f.unit,
                    f.baseline.map_or_else(|| "—".into(), fmt_num),
                    f.ratio.map_or_else(|| "—".into(), |r| format!("{r:.3}")),
                    f.target.as_deref().unwrap_or("—"),
                    f.note
                );
            }
            md.push('\n');
        }
        md.push_str(&sec.markdown);
        md.push('\n');
        for p in &sec.plots {
            let _ = writeln!(md, "![{}]({})\n", p.title, p.file);
        }
    }
    md
}

/// All figures of all sections as the JSON array of the machine-readable report.
#[must_use]
pub fn to_json(sections: &[Section]) -> serde_json::Value {
    let figs: Vec<&Figure> = sections.iter().flat_map(|s| s.figures.iter()).collect();
    serde_json::to_value(figs).unwrap_or(serde_json::Value::Null)
}

fn write(path: &Path, data: &str) -> Result<(), BenchError> {
    std::fs::write(path, data).map_err(|source| BenchError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Writes `report.md`, `report.json` and the SVG plots into `dir` (created).
///
/// # Errors
/// `BenchError::Io` naming the file that could not be written.
pub fn write_report(dir: &Path, sections: &[Section], header: &str) -> Result<(), BenchError> {
    std::fs::create_dir_all(dir).map_err(|source| BenchError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    for sec in sections {
        for p in &sec.plots {
            write(&dir.join(&p.file), &p.to_svg())?;
        }
    }
    write(&dir.join("report.md"), &to_markdown(sections, header))?;
    let json = serde_json::to_string_pretty(&to_json(sections)).unwrap_or_default();
    write(&dir.join("report.json"), &json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_records_have_the_fixed_fields() {
        let s = Section {
            part: "x".into(),
            title: "X".into(),
            markdown: String::new(),
            figures: vec![Figure::vs("x.a", 2.0, 4.0, "GB/s", "n")],
            plots: vec![],
        };
        let v = to_json(&[s]);
        let rec = &v[0];
        assert_eq!(rec["figure"], "x.a");
        assert_eq!(rec["ratio"], 0.5);
        assert_eq!(rec["baseline"], 4.0);
        assert_eq!(rec["unit"], "GB/s");
    }

    #[test]
    fn svg_is_well_formed_for_empty_and_flat_series() {
        let p = Plot {
            file: "p.svg".into(),
            title: "t<".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series: vec![Series {
                name: "s".into(),
                points: vec![(1.0, 0.0)],
            }],
        };
        let svg = p.to_svg();
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("t&lt;"));
        assert!(!svg.contains("NaN"));
    }
}
