//! The `shield` part of the benchmark suite.

use crate::{BenchError, BenchOpts, Section};

/// Runs the `shield` workloads.
///
/// # Errors
/// `BenchError::Part` when a workload cannot run.
pub fn run(_opts: &BenchOpts) -> Result<Section, BenchError> {
    Err(BenchError::Part {
        part: "shield",
        msg: "not built yet".into(),
    })
}
