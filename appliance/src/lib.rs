//! phub-appliance: what an installed appliance needs beyond the daemons
//! themselves. Not on any data path: this runs once, at a daemon's start-up
//! or in `phub-setup`.
//!
//! - [`config`]: the daemons' configuration files (`/etc/phub/*.toml`),
//!   read into clap as defaults so that the command line overrides them.
//! - `tls` (feature `setup`): the self-signed CA and server certificate
//!   `phub-setup tls` writes for phub-control.

pub mod config;
