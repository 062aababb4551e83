//! phub's process-level tests: each module starts the real binaries
//! (phub-dataplane, phub-control, phubctl, phub-demo) on loopback or in
//! network namespaces it makes, and drives them as workers and operators
//! do. They are one test binary (`cargo test -p phub --test it`), linked
//! once, sharing `common`; run one file's tests with a filter, e.g.
//! `cargo test -p phub --test it adversarial::`.
//!
//! Tests that need only a crate's public API live in that crate's tests/,
//! and the deterministic simulator of the whole system is sim/ (phub-sim).

mod common;

mod adversarial;
mod bad_input;
mod consistency;
mod consistency_faults;
mod demo_backends;
mod dpdk_end_to_end;
mod dpdk_failover;
mod dpdk_faults;
mod dpdk_hierarchy;
mod drain;
mod end_to_end;
mod etcd;
mod failover;
mod faults;
mod fencing;
mod hierarchy;
mod memory;
mod packaging;
mod replication;
mod rereplication;
mod sharding;
mod shm;
mod soak;
mod tables;
