//! The `vault` part of the benchmark suite.

use crate::{BenchError, BenchOpts, Section};

/// Runs the `vault` workloads.
///
/// # Errors
/// `BenchError::Part` when a workload cannot run.
pub fn run(_opts: &BenchOpts) -> Result<Section, BenchError> {
    Err(BenchError::Part {
        part: "vault",
        msg: "not built yet".into(),
    })
}
