//! The one crate of memveil that holds general-purpose `unsafe`: system calls
//! (`memfd_secret`, `mmap`, `mprotect`, `mlock`, `madvise`, `prctl`, `umount2`, the
//! `fork` of a cgroup's guardian, `mseal`, the daemons' seccomp filters),
//! CPUID, model-specific registers and the
//! RDRAND/RDSEED instructions.
//!
//! Each unsafe operation is fenced in a small function or a safe type whose
//! constructor establishes the invariant ([`Mapping`] owns its pages and unmaps
//! them on drop). Higher crates never call `libc` directly for these.
//!
//! This crate refuses to interpret anything: it returns raw values and
//! `std::io::Error`s; naming causes and fixes is the job of the callers.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod cgroup;
pub mod cpu;
pub mod fdguard;
pub mod ipc;
pub mod mem;
pub mod mount;
pub mod probe;
pub mod process;
pub mod rnd;
pub mod seal;
pub mod seccomp;
pub mod stack_thread;
pub mod stopflag;
pub mod uffd;

pub use cpu::getrandom;
pub use cpu::{cpuid, has_feature, rdrand64, rdseed64, read_msr, CpuFeature, CpuidResult};
pub use mem::{memfd_secret, page_size, Mapping, Protection};
