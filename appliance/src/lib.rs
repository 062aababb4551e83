//! phub-appliance: what an installed appliance needs beyond the daemons
//! themselves. Not on any data path: this runs once, at a daemon's start-up
//! or in `phub-setup`.
//!
//! - [`config`]: the daemons' configuration files (`/etc/phub/*.toml`),
//!   read into clap as defaults so that the command line overrides them.
//! - `setup` (feature `setup`): phub-setup's steps: the self-signed CA and
//!   server certificate of phub-control, the management token file both
//!   daemons read, DPDK's hugepages and NIC binding.

pub mod config;
#[cfg(feature = "setup")]
pub mod setup;
