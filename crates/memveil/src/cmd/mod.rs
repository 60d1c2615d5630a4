//! One module per subcommand; each has `Args` (clap) and `run(Args) -> anyhow::Result<u8>`
//! returning the process exit code.

pub mod agent;
pub mod bench;
pub mod disk;
pub mod key;
pub mod keyfind;
pub mod package_files;
pub mod probe;
pub mod rng;
pub mod run;
pub mod run_calibrate;
pub mod run_cgroup;
pub mod run_keyid;
pub mod run_report;
pub mod vault;
