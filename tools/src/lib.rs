//! phub-tools: helpers shared by the operator tools (`phub-bench`).
//!
//! Layer: tooling, never on the data path. [`membw`] holds the memory
//! baselines the benchmarks compare the aggregation kernels against.

pub mod membw;
