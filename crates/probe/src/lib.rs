//! What memory protection a host really offers, with the evidence for each
//! answer.
//!
//! Two halves, kept apart so the interesting half can be tested on recorded
//! inputs:
//!
//! - [`collect()`] gathers [`HostFacts`] live: CPUID leaves, MSRs through
//!   `/dev/cpu/N/msr` (loading the msr module only when asked), the first
//!   processor of `/proc/cpuinfo`, the kernel log (`/dev/kmsg`, `dmesg`, the
//!   journal), sysctls and sysfs attributes, a short live sample of RDRAND and
//!   RDSEED through the SP 800-90B health tests of `memveil-drng`, and one
//!   attempt each at `memfd_secret`, `userfaultfd` and `/dev/kvm`.
//! - [`decode()`] turns facts into a [`Report`]: each item's value and how it
//!   was known (CPUID leaf and bit, register field, file, log line) or
//!   "unknown" with the reason, then checks with pass/warn/fail and what to do.
//!
//! [`render`] prints a report for people, as JSON, or in the Prometheus
//! textfile format ([`exposition`] writes that format); [`fleet`] adds the
//! vault's and the entropy service's live counters for a scrape, and
//! [`http`] is the small server `memveil probe --serve` answers Prometheus
//! with (it parses requests from the network, sans-IO, and never panics on
//! them).
//!
//! What it refuses to do: guess. A value it could not establish is reported
//! as unknown with the reason and the way to find out; the absence of a boot
//! log line counts as evidence only when the log still holds the whole boot.
//! It never loads a kernel module unless told to, and never writes an MSR.
//!
//! This crate parses input from outside the process (kernel log, sysfs,
//! recorded facts), so it forbids unsafe code; CPUID, MSR reads and system
//! calls go through `memveil-sys`.
#![forbid(unsafe_code)]

pub mod collect;
pub mod decode;
pub mod exposition;
pub mod facts;
pub mod fleet;
pub mod http;
pub mod render;
pub mod report;
pub mod seccomp;

pub use collect::{collect, CollectOptions};
pub use decode::decode;
pub use facts::{FactsError, HostFacts};
pub use report::{Check, Item, Report, Section, Status, Value};
