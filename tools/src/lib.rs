//! phub-tools: the operator tools (`phub-bench`, the demo) and what they share.
//!
//! Layer: tooling, never on the data path. [`membw`] holds the memory
//! baselines the benchmarks compare the aggregation kernels against;
//! [`model`] the small model the demo and the end-to-end tests train.

pub mod demo;
pub mod membw;
pub mod model;
