//! The probe's answer: items (value + how it was known, or unknown + why)
//! and checks (pass/warn/fail + what to do).

use serde::Serialize;

/// Groups of items, in the order they are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Section {
    /// Vendor, model.
    Cpu,
    /// Intel TME and TME-MK.
    IntelTme,
    /// AMD SME, TSME, SEV.
    AmdSme,
    /// Running as a guest; confidential-guest state.
    Guest,
    /// RDRAND/RDSEED, AES-NI, VAES, VPCLMULQDQ.
    Instructions,
    /// What memveil can use: memfd_secret, userfaultfd, KVM, limits, dumps,
    /// ptrace, swap.
    Kernel,
}

impl Section {
    /// Heading for people.
    #[must_use]
    pub fn title(self) -> &'static str {
        match self {
            Section::Cpu => "CPU",
            Section::IntelTme => "Intel TME / TME-MK",
            Section::AmdSme => "AMD SME / TSME / SEV",
            Section::Guest => "Virtualisation and confidential guests",
            Section::Instructions => "Instructions (RNG, AES)",
            Section::Kernel => "What memveil can use here",
        }
    }
}

/// A value, or why it is not known.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Value {
    /// Yes/no.
    Bool(bool),
    /// A number.
    Int(i64),
    /// Text.
    Text(String),
    /// Not known, with the reason.
    Unknown {
        /// Why it is not known and how to find out.
        unknown: String,
    },
}

impl Value {
    /// An unknown value with `reason`.
    pub fn unknown(reason: impl Into<String>) -> Value {
        Value::Unknown {
            unknown: reason.into(),
        }
    }

    /// The number this value stands for in Prometheus (booleans as 0/1),
    /// `None` for text and unknown.
    #[must_use]
    pub fn as_metric(&self) -> Option<i64> {
        match self {
            Value::Bool(b) => Some(i64::from(*b)),
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// Whether the value is known.
    #[must_use]
    pub fn is_known(&self) -> bool {
        !matches!(self, Value::Unknown { .. })
    }

    /// The boolean, if this is one.
    #[must_use]
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Bool(true) => f.write_str("yes"),
            Value::Bool(false) => f.write_str("no"),
            Value::Int(i) => write!(f, "{i}"),
            Value::Text(t) => f.write_str(t),
            Value::Unknown { .. } => f.write_str("unknown"),
        }
    }
}

/// One fact about the host.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Item {
    /// Stable identifier (`intel.tme.enabled`), also the Prometheus label.
    pub id: String,
    /// The group.
    pub section: Section,
    /// Short description for people.
    pub label: String,
    /// The value or why unknown.
    pub value: Value,
    /// How it was known: the CPUID leaf and bit, the register and field,
    /// the file, or the log line. Empty for unknown values.
    pub how: String,
}

/// Outcome of a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Pass,
    /// Weaker than it could be, or not known; memveil still works.
    Warn,
    /// Broken or missing something memveil's full protection needs.
    Fail,
}

impl Status {
    /// `PASS`, `WARN`, `FAIL`.
    #[must_use]
    pub fn tag(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        }
    }

    /// `pass`, `warn`, `fail`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One check with its verdict and what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Stable identifier (`rdrand`).
    pub id: String,
    /// The verdict.
    pub status: Status,
    /// What was found.
    pub summary: String,
    /// What to do about it (empty when nothing).
    pub action: String,
}

/// The probe's full answer.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// What host (from the facts).
    pub description: String,
    /// Kernel release, if known.
    pub kernel_release: Option<String>,
    /// The facts.
    pub items: Vec<Item>,
    /// The checks.
    pub checks: Vec<Check>,
}

impl Report {
    /// The item with `id`.
    #[must_use]
    pub fn item(&self, id: &str) -> Option<&Item> {
        self.items.iter().find(|i| i.id == id)
    }

    /// The check with `id`.
    #[must_use]
    pub fn check(&self, id: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.id == id)
    }

    /// The worst status of all checks (`Pass` when there are none).
    #[must_use]
    pub fn worst(&self) -> Status {
        self.checks
            .iter()
            .map(|c| c.status)
            .max()
            .unwrap_or(Status::Pass)
    }

    /// The exit code of `memveil probe`: 0 when no check failed, 3 when one
    /// did (warnings do not change it). 1 and 2 belong to the binary: 1 when
    /// the probe could not run, 2 for usage errors.
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        if self.worst() == Status::Fail {
            3
        } else {
            0
        }
    }
}
