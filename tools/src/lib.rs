//! phub-tools: the operator tools (`phub-bench`, the demo) and what they share.
//!
//! Layer: tooling, never on the data path. [`membw`] holds the memory
//! baselines the benchmarks compare the aggregation kernels against;
//! [`model`] the small model the demo and the end-to-end tests train;
//! [`profiles`] the real models' tensor shapes `phub-bench run` pushes;
//! [`bench`] `phub-bench run` itself; [`stats`] and [`sys`] what the
//! benchmarks share (order statistics; machine, commit, CPU time).

pub mod bench;
pub mod demo;
pub mod membw;
pub mod model;
pub mod profiles;
pub mod stats;
pub mod sys;
