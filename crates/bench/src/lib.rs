//! memveil's benchmark workloads and report.
