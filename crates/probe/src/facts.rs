//! The recorded inputs of the probe: everything the live collector gathered
//! (or a fixture describes), as plain data. The decoder reads only this.
//!
//! The JSON form of [`HostFacts`] is what `memveil probe --record FILE`
//! writes and `memveil probe --replay FILE` reads; the test fixtures use it.
//! Register values are hex strings (`"0x0001000600000003"`) so fixtures can be
//! checked against the documented bit layouts by eye.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Version of the fixture/record format.
pub const SCHEMA: u32 = 1;

/// Everything the probe knows about one host.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostFacts {
    /// Format version, [`SCHEMA`].
    pub schema: u32,
    /// What host this is (free text).
    #[serde(default)]
    pub description: String,
    /// Where each recorded value comes from (fixtures cite specifications
    /// and kernel sources here; live records say "live").
    #[serde(default)]
    pub sources: Vec<String>,
    /// `uname -r`.
    #[serde(default)]
    pub kernel_release: Option<String>,
    /// Whether CPUID could be executed at all (false on non-x86_64).
    #[serde(default)]
    pub cpuid_available: bool,
    /// The CPUID leaves read. A leaf absent here was not read (beyond the
    /// maximum leaf, or not meaningful on this vendor).
    #[serde(default)]
    pub cpuid: Vec<CpuidRecord>,
    /// State of `/dev/cpu/*/msr` and any `modprobe msr` attempt.
    #[serde(default)]
    pub msr_access: MsrAccess,
    /// Model-specific registers read (or the error of reading each).
    #[serde(default)]
    pub msr: Vec<MsrRecord>,
    /// `/proc/cpuinfo`, one entry per line (or why it could not be read).
    #[serde(default)]
    pub cpuinfo: Text,
    /// The kernel log since boot, one message per line, without timestamps.
    #[serde(default)]
    pub kernel_log: KernelLog,
    /// Small files read verbatim (sysctls, sysfs attributes, `/proc/swaps`,
    /// device-mapper UUIDs), keyed by path.
    #[serde(default)]
    pub files: BTreeMap<String, FileRead>,
    /// Directory listings (device-mapper `slaves/`), keyed by path.
    #[serde(default)]
    pub dirs: BTreeMap<String, FileRead>,
    /// Block device numbers ("major:minor") of swap areas and of the file
    /// systems holding swap files, keyed by the name in `/proc/swaps`.
    #[serde(default)]
    pub swap_devices: BTreeMap<String, String>,
    /// Live samples of the on-chip random number generators.
    #[serde(default)]
    pub rng: Vec<RngSample>,
    /// The attempt to create, map and touch one `memfd_secret` page.
    #[serde(default)]
    pub memfd_secret: Attempt,
    /// `userfaultfd(2)` without flags.
    #[serde(default)]
    pub userfaultfd_syscall: Attempt,
    /// `userfaultfd(UFFD_USER_MODE_ONLY)`.
    #[serde(default)]
    pub userfaultfd_user_mode_only: Attempt,
    /// `/dev/userfaultfd` + `USERFAULTFD_IOC_NEW`.
    #[serde(default)]
    pub userfaultfd_dev: Attempt,
    /// `/dev/kvm` + `KVM_GET_API_VERSION` (value: the API version).
    #[serde(default)]
    pub kvm: Attempt,
    /// Soft and hard `RLIMIT_MEMLOCK` in bytes (`u64::MAX` = unlimited).
    #[serde(default)]
    pub memlock: Option<(u64, u64)>,
    /// Effective user id of the probing process.
    #[serde(default)]
    pub euid: Option<u32>,
    /// Effective capability mask (`CapEff` of `/proc/self/status`).
    #[serde(default, with = "hex_opt64")]
    pub cap_eff: Option<u64>,
    /// The AES implementation memveil-cipher chose in the probing process
    /// (absent from records of older probes).
    #[serde(default)]
    pub cipher_path: Option<CipherPath>,
}

/// memveil-cipher's choice of AES implementation in the probing process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CipherPath {
    /// Short name (`vaes256`, `aesni`, `portable`).
    pub path: String,
    /// What runs on it.
    pub detail: String,
    /// What `MEMVEIL_CIPHER_PATH` did, if it was set.
    #[serde(default)]
    pub note: Option<String>,
    /// Paths this CPU cannot run, each with the features it lacks.
    #[serde(default)]
    pub cannot_run: Vec<String>,
}

/// One CPUID leaf/subleaf and its four registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuidRecord {
    /// EAX input.
    #[serde(with = "hex32")]
    pub leaf: u32,
    /// ECX input.
    #[serde(default)]
    pub subleaf: u32,
    /// EAX output.
    #[serde(with = "hex32")]
    pub eax: u32,
    /// EBX output.
    #[serde(with = "hex32")]
    pub ebx: u32,
    /// ECX output.
    #[serde(with = "hex32")]
    pub ecx: u32,
    /// EDX output.
    #[serde(with = "hex32")]
    pub edx: u32,
}

/// How `/dev/cpu/N/msr` stood when the probe ran.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "detail")]
pub enum MsrAccess {
    /// Not examined (non-x86, or a fixture that does not say).
    #[default]
    NotTried,
    /// The device nodes exist and CPU 0's could be opened.
    Readable,
    /// `/dev/cpu/0/msr` does not exist: the msr driver is not loaded.
    NotLoaded,
    /// `--load-msr` ran `modprobe msr` and it failed (its message).
    ModprobeFailed(String),
    /// The device exists but this process may not open it.
    PermissionDenied,
    /// Any other error opening it.
    Error(String),
}

/// One MSR of one CPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MsrRecord {
    /// Logical CPU.
    pub cpu: u32,
    /// Register address.
    #[serde(with = "hex32")]
    pub msr: u32,
    /// The value, when the read worked.
    #[serde(default, with = "hex_opt64", skip_serializing_if = "Option::is_none")]
    pub value: Option<u64>,
    /// The error of the read otherwise (e.g. "EIO").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Text read from a file or a command: its lines, or why not.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Text {
    /// Where it came from (path or command).
    #[serde(default)]
    pub source: String,
    /// The lines, when it could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lines: Option<Vec<String>>,
    /// Why it could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The kernel log and where it came from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelLog {
    /// The source used (`/dev/kmsg`, `dmesg`, `journalctl -k -b`).
    #[serde(default)]
    pub source: String,
    /// Messages, without timestamps; `None` when no source could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lines: Option<Vec<String>>,
    /// True when the ring buffer no longer holds the first boot messages
    /// (and no journal filled the gap), so absent boot lines mean nothing.
    #[serde(default)]
    pub wrapped: bool,
    /// Why each source tried before failed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

/// A small file: its content or the error of reading it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileRead {
    /// The content (for directories: entry names, one per line).
    Ok(String),
    /// The file does not exist.
    Missing,
    /// Any other error, with its message.
    Error(String),
}

/// The outcome of trying something once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "result")]
pub enum Attempt {
    /// Not tried (a fixture that does not say, or not applicable).
    #[default]
    NotTried,
    /// It worked; `value` holds a number it returned, if any.
    Ok {
        /// A number returned (KVM API version, userfaultfd features).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value: Option<i64>,
    },
    /// It failed.
    Err {
        /// The errno, when there was one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        errno: Option<i32>,
        /// The error message.
        message: String,
    },
}

impl Attempt {
    /// An [`Attempt`] from an I/O result.
    pub fn from_io<T>(r: &std::io::Result<T>, value: impl FnOnce(&T) -> Option<i64>) -> Attempt {
        match r {
            Ok(v) => Attempt::Ok { value: value(v) },
            Err(e) => Attempt::Err {
                errno: e.raw_os_error(),
                message: e.to_string(),
            },
        }
    }
}

/// A short live sample of one RNG instruction through the SP 800-90B
/// Repetition Count and Adaptive Proportion tests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngSample {
    /// `rdrand` or `rdseed`.
    pub source: String,
    /// Whether the instruction could be used at all.
    pub available: bool,
    /// Samples that went through both tests.
    pub samples: u64,
    /// Claimed min-entropy per 64-bit sample, bits.
    pub h_bits: f64,
    /// RCT cutoff C.
    pub rct_cutoff: u32,
    /// APT window W.
    pub apt_window: u32,
    /// APT cutoff C.
    pub apt_cutoff: u32,
    /// Longest run of identical samples.
    pub longest_run: u32,
    /// Highest APT count seen.
    pub highest_apt_count: u32,
    /// Instruction attempts and failed attempts (CF=0).
    pub attempts: u64,
    /// Failed attempts.
    pub failed_attempts: u64,
    /// The health-test failure or other error, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Available, every sample delivered and both tests passed.
    pub passed: bool,
}

impl HostFacts {
    /// The recorded CPUID leaf/subleaf.
    #[must_use]
    pub fn cpuid(&self, leaf: u32, subleaf: u32) -> Option<CpuidRecord> {
        self.cpuid
            .iter()
            .copied()
            .find(|r| r.leaf == leaf && r.subleaf == subleaf)
    }

    /// The MSR records for `msr`, by CPU.
    pub fn msrs(&self, msr: u32) -> impl Iterator<Item = &MsrRecord> {
        self.msr.iter().filter(move |r| r.msr == msr)
    }

    /// The content of a recorded file, trimmed, if it was read.
    #[must_use]
    pub fn file(&self, path: &str) -> Option<&str> {
        match self.files.get(path) {
            Some(FileRead::Ok(s)) => Some(s.trim_end_matches('\n')),
            _ => None,
        }
    }

    /// Parses the JSON form.
    ///
    /// # Errors
    /// [`FactsError`] naming the line and column of the problem, or an
    /// unsupported schema version.
    pub fn from_json(text: &str) -> Result<HostFacts, FactsError> {
        let f: HostFacts = serde_json::from_str(text).map_err(|e| FactsError::Parse {
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        })?;
        if f.schema != SCHEMA {
            return Err(FactsError::Schema { found: f.schema });
        }
        Ok(f)
    }

    /// The JSON form (pretty-printed).
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// Errors of reading recorded facts.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FactsError {
    /// Not valid JSON, or not the fact format.
    #[error("recorded facts are not valid (line {line}, column {column}): {message}; record them again with `memveil probe --record FILE`")]
    Parse {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// serde's message.
        message: String,
    },
    /// A schema this version does not read.
    #[error("recorded facts have schema {found}, this memveil reads schema {SCHEMA}; record them again with this version")]
    Schema {
        /// The schema found.
        found: u32,
    },
}

fn parse_hex(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .ok_or_else(|| format!("expected a hex string like \"0x1f\", got {s:?}"))?;
    let digits: String = digits.chars().filter(|c| *c != '_').collect();
    u64::from_str_radix(&digits, 16).map_err(|e| format!("bad hex {s:?}: {e}"))
}

mod hex32 {
    use serde::{Deserialize, Deserializer, Serializer};

    #[allow(clippy::trivially_copy_pass_by_ref)]
    pub fn serialize<S: Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("0x{v:08x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        let s = String::deserialize(d)?;
        let v = super::parse_hex(&s).map_err(serde::de::Error::custom)?;
        u32::try_from(v).map_err(|_| serde::de::Error::custom(format!("{s} does not fit 32 bits")))
    }
}

mod hex_opt64 {
    use serde::{Deserialize, Deserializer, Serializer};

    #[allow(clippy::ref_option)]
    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_str(&format!("0x{v:016x}")),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        let s = Option::<String>::deserialize(d)?;
        s.map(|s| super::parse_hex(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_json() {
        let mut f = HostFacts {
            schema: SCHEMA,
            ..HostFacts::default()
        };
        f.cpuid.push(CpuidRecord {
            leaf: 7,
            subleaf: 0,
            eax: 1,
            ebx: 2,
            ecx: 1 << 13,
            edx: 1 << 18,
        });
        f.msr.push(MsrRecord {
            cpu: 0,
            msr: 0x982,
            value: Some(0x0001_0006_0000_0003),
            error: None,
        });
        f.cap_eff = Some(0x1ff);
        let j = f.to_json();
        assert!(j.contains("\"0x0001000600000003\""), "{j}");
        let g = HostFacts::from_json(&j).expect("round trip");
        assert_eq!(g.cpuid, f.cpuid);
        assert_eq!(g.msr, f.msr);
        assert_eq!(g.cap_eff, Some(0x1ff));
    }

    #[test]
    fn bad_input_is_an_error_naming_the_place() {
        let e = HostFacts::from_json("{\"schema\": 1, \"cpuid\": [{\"leaf\": 7}]}")
            .expect_err("missing registers");
        assert!(e.to_string().contains("line 1"), "{e}");
        let e = HostFacts::from_json(
            "{\"schema\":1,\"cpuid\":[{\"leaf\":\"7\",\"eax\":\"0x1\",\"ebx\":\"0x1\",\"ecx\":\"0x1\",\"edx\":\"0x1\"}]}",
        )
        .expect_err("leaf without 0x");
        assert!(e.to_string().contains("hex"), "{e}");
        let e = HostFacts::from_json("{\"schema\": 9}").expect_err("schema");
        assert!(e.to_string().contains("schema 9"), "{e}");
        assert!(HostFacts::from_json("not json").is_err());
        assert!(HostFacts::from_json("{\"schema\":1,\"cpuid\":[{\"leaf\":\"0x1ffffffff\",\"eax\":\"0x1\",\"ebx\":\"0x1\",\"ecx\":\"0x1\",\"edx\":\"0x1\"}]}").is_err());
    }
}
