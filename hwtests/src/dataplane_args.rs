//! phub-dataplane's command line as a typed value, for every harness that
//! starts one (the tests' racks, the virtual and lab racks, phub-demo,
//! phub-bench): each flag is written here once, so that a flag renamed in
//! `phub_dataplane::config::Config` is changed in one place, and the unit
//! test below (every field set, parsed back by the dataplane's own clap
//! parser) fails until it is.
//!
//! Here rather than beside `Config` in phub-dataplane: phub-rack-agent,
//! built from this crate and copied to worker hosts, must not link the
//! dataplane (hwloc, DPDK). The test needs it only as a dev-dependency.
//!
//! Layer: test support only.

use std::path::PathBuf;

/// `--backend`: the API's [`BackendKind`], under the name the harnesses
/// use.
pub use phub_proto::api::BackendKind as Backend;

/// phub-dataplane's options that harnesses set; None (or false, or empty)
/// leaves the dataplane's default. [`DataplaneArgs::to_args`] writes the
/// command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataplaneArgs {
    /// `--backend`.
    pub backend: Option<Backend>,
    /// `--host`: the IPv4 address the data queues listen on.
    pub host: Option<String>,
    /// `--base-port`: UDP port of queue 0 (0: the backend picks).
    pub base_port: Option<u16>,
    /// `--lcores`.
    pub lcores: Option<usize>,
    /// `--mgmt`: the management API's address, `IP:PORT`.
    pub mgmt: Option<String>,
    /// `--mgmt-token-file`.
    pub mgmt_token_file: Option<PathBuf>,
    /// `--memory-budget`, as the dataplane takes it (`1GiB`, `512MiB`,
    /// bytes).
    pub memory_budget: Option<String>,
    /// `--busy-poll`.
    pub busy_poll: bool,
    /// `--no-pin`.
    pub no_pin: bool,
    /// `--socket-buffer`, bytes.
    pub socket_buffer: Option<usize>,
    /// `--shm`.
    pub shm: bool,
    /// `--inject`: faults on every queue (`loss=0.05,seed=7`).
    pub inject: Option<String>,
    /// `--eal`: EAL arguments, one string.
    pub eal: Option<String>,
    /// `--mtu`.
    pub mtu: Option<u16>,
    /// `--idle-backoff`.
    pub idle_backoff: bool,
    /// More arguments as given (a test's, a user's), after the others.
    pub extra: Vec<String>,
}

impl DataplaneArgs {
    /// The command line, without the program's name.
    pub fn to_args(&self) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        let mut opt = |flag: &str, v: Option<String>| {
            if let Some(v) = v {
                a.push(flag.into());
                a.push(v);
            }
        };
        opt("--backend", self.backend.map(|b| b.name().to_string()));
        opt("--host", self.host.clone());
        opt("--base-port", self.base_port.map(|p| p.to_string()));
        opt("--lcores", self.lcores.map(|n| n.to_string()));
        opt("--mgmt", self.mgmt.clone());
        opt(
            "--mgmt-token-file",
            self.mgmt_token_file.as_ref().map(|p| p.display().to_string()),
        );
        opt("--memory-budget", self.memory_budget.clone());
        opt("--socket-buffer", self.socket_buffer.map(|b| b.to_string()));
        opt("--inject", self.inject.clone());
        opt("--eal", self.eal.clone());
        opt("--mtu", self.mtu.map(|m| m.to_string()));
        for (flag, on) in [
            ("--busy-poll", self.busy_poll),
            ("--no-pin", self.no_pin),
            ("--shm", self.shm),
            ("--idle-backoff", self.idle_backoff),
        ] {
            if on {
                a.push(flag.into());
            }
        }
        a.extend(self.extra.iter().cloned());
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use phub_dataplane::config::{BackendKind, Config};

    fn parse(a: &DataplaneArgs) -> Config {
        let argv = std::iter::once("phub-dataplane".to_string()).chain(a.to_args());
        Config::try_parse_from(argv).unwrap_or_else(|e| panic!("{:?}: {e}", a.to_args()))
    }

    /// Every field set, and read back by phub-dataplane's own parser as the
    /// value given: a flag renamed there fails here.
    #[test]
    fn every_flag_is_the_dataplane_s() {
        let a = DataplaneArgs {
            backend: Some(Backend::Dpdk),
            host: Some("10.0.0.2".into()),
            base_port: Some(7950),
            lcores: Some(3),
            mgmt: Some("127.0.0.1:7801".into()),
            mgmt_token_file: Some("/tmp/phub-test.token".into()),
            memory_budget: Some("256MiB".into()),
            busy_poll: true,
            no_pin: true,
            socket_buffer: Some(1 << 20),
            shm: true,
            inject: Some("loss=0.5,seed=7".into()),
            eal: Some("--no-pci --no-huge -m 512".into()),
            mtu: Some(1500),
            idle_backoff: true,
            extra: vec!["--rx-desc".into(), "512".into()],
        };
        let c = parse(&a);
        assert_eq!(c.backend, BackendKind::Dpdk);
        assert_eq!(c.host.to_string(), "10.0.0.2");
        assert_eq!(c.base_port, 7950);
        assert_eq!(c.lcores, Some(3));
        assert_eq!(c.mgmt.to_string(), "127.0.0.1:7801");
        assert_eq!(c.mgmt_token_file, Some(PathBuf::from("/tmp/phub-test.token")));
        assert_eq!(c.memory_budget, 256 << 20);
        assert!(c.busy_poll && c.no_pin && c.shm && c.dpdk.idle_backoff);
        assert_eq!(c.socket_buffer, 1 << 20);
        assert_eq!(c.inject, Some("loss=0.5,seed=7".parse().unwrap()));
        assert_eq!(c.dpdk.eal.as_deref(), Some("--no-pci --no-huge -m 512"));
        assert_eq!(c.dpdk.mtu, 1500);
        assert_eq!(c.dpdk.rx_desc, 512);
    }

    /// Nothing set is the dataplane's defaults, and the udp backend's name
    /// is its.
    #[test]
    fn nothing_set_is_the_defaults() {
        assert!(DataplaneArgs::default().to_args().is_empty());
        let c = parse(&DataplaneArgs {
            backend: Some(Backend::Udp),
            ..DataplaneArgs::default()
        });
        assert_eq!(c.backend, BackendKind::Udp);
        assert!(!c.busy_poll && !c.no_pin && !c.shm);
    }
}
