//! phub-proto: what every side of phub agrees on.
//!
//! Layer: pure. No I/O, no clock, no `unsafe`. Holds the wire header views
//! ([`wire`]), the element types ([`Dtype`]), the job spec ([`spec`]) and the
//! chunk layout ([`layout`]). Parsing received bytes never panics and never
//! allocates.
#![forbid(unsafe_code)]

pub mod api;
pub mod checkpoint;
pub mod counters;
pub mod dtype;
pub mod fault;
pub mod layout;
pub mod shm;
pub mod spec;
pub mod wire;

pub use dtype::Dtype;
