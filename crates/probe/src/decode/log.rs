//! The kernel log as the decoder reads it: lines without their timestamps,
//! whether the whole boot is still there, and numbers inside lines.

use crate::facts::HostFacts;

/// Kernel log lines with timestamps stripped.
pub(super) struct LogView {
    pub(super) lines: Vec<String>,
    readable: bool,
    wrapped: bool,
    source: String,
    why: String,
}

fn strip_timestamp(l: &str) -> &str {
    let t = l.trim_start();
    if let Some(rest) = t.strip_prefix('[') {
        if let Some(end) = rest.find(']') {
            let ts = &rest[..end];
            if ts.trim().chars().all(|c| c.is_ascii_digit() || c == '.') {
                return rest[end + 1..].trim_start();
            }
        }
    }
    t
}

impl LogView {
    pub(super) fn new(f: &HostFacts) -> LogView {
        let k = &f.kernel_log;
        match &k.lines {
            Some(lines) => LogView {
                lines: lines
                    .iter()
                    .map(|l| strip_timestamp(l).to_owned())
                    .collect(),
                readable: true,
                wrapped: k.wrapped,
                source: k.source.clone(),
                why: String::new(),
            },
            None => LogView {
                lines: Vec::new(),
                readable: false,
                wrapped: false,
                source: String::new(),
                why: if k.errors.is_empty() {
                    "kernel log not recorded".to_owned()
                } else {
                    format!("kernel log unreadable: {}", k.errors.join("; "))
                },
            },
        }
    }

    /// The first line containing `needle`.
    pub(super) fn find(&self, needle: &str) -> Option<&str> {
        self.lines
            .iter()
            .find(|l| l.contains(needle))
            .map(String::as_str)
    }

    /// "the line is absent" is evidence only when the whole boot log is there.
    pub(super) fn absence_is_evidence(&self) -> bool {
        self.readable && !self.wrapped
    }

    pub(super) fn why_absence_means_nothing(&self) -> String {
        if !self.readable {
            self.why.clone()
        } else {
            format!(
                "the kernel log ({}) no longer holds the boot messages (ring buffer wrapped; enable a persistent journal)",
                self.source
            )
        }
    }

    pub(super) fn cite(&self, line: &str) -> String {
        format!("kernel log ({}): \"{}\"", self.source, line.trim())
    }
}

/// The integer right after `prefix` inside `line`.
pub(super) fn number_after(line: &str, prefix: &str) -> Option<u64> {
    let at = line.find(prefix)? + prefix.len();
    let digits: String = line[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// The integer right before `suffix` inside `line`.
pub(super) fn number_before(line: &str, suffix: &str) -> Option<u64> {
    let at = line.find(suffix)?;
    let head = line[..at].trim_end();
    let digits: String = head
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_stripped() {
        assert_eq!(
            strip_timestamp("[    0.000000] x86/tme: enabled by BIOS"),
            "x86/tme: enabled by BIOS"
        );
        assert_eq!(
            strip_timestamp("x86/tme: enabled by BIOS"),
            "x86/tme: enabled by BIOS"
        );
        assert_eq!(strip_timestamp("[abc] x"), "[abc] x");
    }

    #[test]
    fn numbers_in_log_lines() {
        assert_eq!(
            number_before("x86/mktme: 63 KeyIDs available", "KeyIDs available"),
            Some(63)
        );
        assert_eq!(
            number_after(
                "x86/mktme: BIOS enabled: x86_phys_bits reduced by 6",
                "reduced by"
            ),
            Some(6)
        );
        assert_eq!(
            number_after("x86_phys_bits reduced by x", "reduced by"),
            None
        );
        assert_eq!(
            number_before("46 bits physical, 48 bits virtual", "bits physical"),
            Some(46)
        );
    }
}
