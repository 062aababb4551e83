//! The rack file, and which rack the suite runs on (`PHUB_RACK`).
//!
//! ```toml
//! agent = "/usr/local/bin/phub-rack-agent"  # on the worker hosts (optional, default: on their PATH)
//! ssh = "ssh -o BatchMode=yes"  # how to reach them (optional, this is the default)
//!
//! [appliance]
//! pci = "0000:3b:00.0"        # the NIC DPDK drives
//! cores = [2, 3, 4, 5]        # one data lcore (NIC queue) per core
//! main_core = 1               # EAL main lcore: management, off the data cores
//! ip = "192.168.50.1"         # the appliance's address on the rack network
//! eal = "--in-memory"         # extra EAL arguments (optional)
//! mtu = 9000                  # optional, default 9000
//! base_port = 7900            # UDP port of lcore 0 (optional, default 7900)
//! control = "10.0.0.1:7700"   # where phub-control listens, reachable from the workers
//!                             # (optional, default the rack IP, port 7700)
//! link_gbps = 100             # the NIC's link speed, for the line-rate report (optional)
//!
//! [[workers]]
//! host = "worker1"            # how to reach it (ssh)
//! ip = "192.168.50.11"        # its address on the rack network
//! agent = "/opt/phub/phub-rack-agent"  # this host's agent, if not the global one
//! ```

use serde::Deserialize;

/// A lab rack.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RackFile {
    /// The agent binary's path on the worker hosts (default: `phub-rack-agent`
    /// on their PATH); a worker's own `agent` overrides it.
    #[serde(default)]
    pub agent: Option<String>,
    /// The command that reaches a worker host, split on whitespace (default
    /// `ssh -o BatchMode=yes`); the host and the agent's command line follow.
    #[serde(default)]
    pub ssh: Option<String>,
    /// The appliance.
    pub appliance: Appliance,
    /// The worker hosts.
    #[serde(default)]
    pub workers: Vec<WorkerHost>,
}

/// The appliance's NIC and cores.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Appliance {
    /// PCI address of the NIC.
    pub pci: String,
    /// Data cores, one lcore and NIC queue each.
    pub cores: Vec<usize>,
    /// Core of the EAL main lcore (management).
    pub main_core: usize,
    /// The appliance's IPv4 address.
    pub ip: String,
    /// Extra EAL arguments.
    #[serde(default)]
    pub eal: String,
    /// MTU.
    #[serde(default = "default_mtu")]
    pub mtu: u16,
    /// UDP port of lcore 0; lcore i listens on base_port + i.
    #[serde(default = "default_base_port")]
    pub base_port: u16,
    /// `HOST:PORT` phub-control listens on and the workers reach it at
    /// (default `IP:7700`). The rack IP belongs to the NIC DPDK drives, so
    /// the kernel holds it only on a bifurcated NIC (mlx5); otherwise name
    /// the appliance's management address here.
    #[serde(default)]
    pub control: Option<String>,
    /// The NIC's link speed in Gb/s, for the line-rate report.
    #[serde(default)]
    pub link_gbps: Option<u32>,
}

fn default_mtu() -> u16 {
    9000
}

fn default_base_port() -> u16 {
    7900
}

/// Port phub-control listens on when the rack file names no `control`.
pub const DEFAULT_CONTROL_PORT: u16 = 7700;

/// The agent the rack file names no other: found on the worker's PATH.
pub const DEFAULT_AGENT: &str = "phub-rack-agent";

/// How worker hosts are reached when the rack file names no `ssh`.
pub const DEFAULT_SSH: &str = "ssh -o BatchMode=yes";

/// One worker host.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerHost {
    /// Host name for ssh.
    pub host: String,
    /// Its address on the rack network.
    pub ip: String,
    /// The agent binary's path on this host (default: the rack file's).
    #[serde(default)]
    pub agent: Option<String>,
}

impl RackFile {
    /// Parses and checks a rack file.
    pub fn parse(text: &str) -> Result<RackFile, String> {
        let r: RackFile = toml::from_str(text).map_err(|e| format!("rack file: {e}"))?;
        if r.appliance.cores.is_empty() {
            return Err("rack file: `appliance.cores` is empty: list at least one data core".into());
        }
        if r.appliance.cores.contains(&r.appliance.main_core) {
            return Err(format!(
                "rack file: `appliance.main_core` = {} is also a data core: the management lcore must stay off the data cores",
                r.appliance.main_core
            ));
        }
        r.appliance.ip.parse::<std::net::Ipv4Addr>().map_err(|_| {
            format!(
                "rack file: `appliance.ip` = {:?}: expected an IPv4 address",
                r.appliance.ip
            )
        })?;
        if let Some(c) = &r.appliance.control {
            let ok = c
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return Err(format!(
                    "rack file: `appliance.control` = {c:?}: expected HOST:PORT, e.g. \"10.0.0.1:7700\""
                ));
            }
        }
        if r.appliance.base_port == 0 || usize::from(r.appliance.base_port) + r.appliance.cores.len() > 65536
        {
            return Err(format!(
                "rack file: `appliance.base_port` = {}: the {} data ports must lie within 1..=65535",
                r.appliance.base_port,
                r.appliance.cores.len()
            ));
        }
        if r.ssh.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return Err("rack file: `ssh` is empty: name a command such as \"ssh -o BatchMode=yes\"".into());
        }
        for (i, w) in r.workers.iter().enumerate() {
            w.ip.parse::<std::net::Ipv4Addr>().map_err(|_| {
                format!(
                    "rack file: `workers[{i}].ip` = {:?}: expected an IPv4 address",
                    w.ip
                )
            })?;
        }
        Ok(r)
    }

    /// `HOST:PORT` of phub-control (see [`Appliance::control`]).
    pub fn control_addr(&self) -> String {
        self.appliance
            .control
            .clone()
            .unwrap_or_else(|| format!("{}:{DEFAULT_CONTROL_PORT}", self.appliance.ip))
    }

    /// The command that reaches a worker host, as words.
    pub fn ssh_words(&self) -> Vec<String> {
        self.ssh
            .as_deref()
            .unwrap_or(DEFAULT_SSH)
            .split_whitespace()
            .map(String::from)
            .collect()
    }

    /// Worker `i`'s agent path.
    pub fn agent_of(&self, i: usize) -> String {
        self.workers[i]
            .agent
            .clone()
            .or_else(|| self.agent.clone())
            .unwrap_or_else(|| DEFAULT_AGENT.to_string())
    }

    /// The EAL arguments for the appliance.
    pub fn eal_args(&self) -> String {
        let a = &self.appliance;
        let mut lcores = format!("0@{}", a.main_core);
        for (i, c) in a.cores.iter().enumerate() {
            lcores += &format!(",{}@{c}", i + 1);
        }
        format!("-a {} --lcores {lcores} {}", a.pci, a.eal)
    }
}

/// Where the suite runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Namespaces and veth pairs on this machine.
    Virtual,
    /// A lab rack.
    Lab(Box<RackFile>),
}

/// The rack named by `PHUB_RACK`: `None` when unset, an error when the
/// file cannot be read or is wrong.
pub fn target() -> Option<Result<Target, String>> {
    let v = std::env::var("PHUB_RACK").ok()?;
    if v == "virtual" {
        return Some(Ok(Target::Virtual));
    }
    Some(
        std::fs::read_to_string(&v)
            .map_err(|e| format!("PHUB_RACK={v}: {e}"))
            .and_then(|t| RackFile::parse(&t))
            .map(|r| Target::Lab(Box::new(r))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_rack_file_parses() {
        let r = RackFile::parse(include_str!("../rack.example.toml")).unwrap();
        assert_eq!(r.workers.len(), 2);
    }

    #[test]
    fn a_rack_file_parses_and_is_checked() {
        let r = RackFile::parse(
            "[appliance]\npci = \"0000:3b:00.0\"\ncores = [2, 3]\nmain_core = 1\nip = \"192.168.50.1\"\n[[workers]]\nhost = \"w1\"\nip = \"192.168.50.11\"\n",
        )
        .unwrap();
        assert_eq!(r.appliance.mtu, 9000);
        assert_eq!(r.eal_args().trim(), "-a 0000:3b:00.0 --lcores 0@1,1@2,2@3");
        let e = RackFile::parse("[appliance]\npci = \"x\"\ncores = [1]\nmain_core = 1\nip = \"1.2.3.4\"\n")
            .unwrap_err();
        assert!(e.contains("main_core"), "{e}");
        let e = RackFile::parse("[appliance]\npci = \"x\"\ncores = [2]\nmain_core = 1\nip = \"nope\"\n")
            .unwrap_err();
        assert!(e.contains("appliance.ip"), "{e}");
    }

    const MINIMAL: &str =
        "[appliance]\npci = \"0000:3b:00.0\"\ncores = [2, 3]\nmain_core = 1\nip = \"192.168.50.1\"\n";

    #[test]
    fn the_lab_fields_have_defaults() {
        let r = RackFile::parse(&format!(
            "{MINIMAL}[[workers]]\nhost = \"w1\"\nip = \"192.168.50.11\"\n"
        ))
        .unwrap();
        assert_eq!(r.appliance.base_port, 7900);
        assert_eq!(r.control_addr(), "192.168.50.1:7700");
        assert_eq!(r.ssh_words(), ["ssh", "-o", "BatchMode=yes"]);
        assert_eq!(r.agent_of(0), "phub-rack-agent");
        assert_eq!(r.appliance.link_gbps, None);
    }

    #[test]
    fn the_lab_fields_parse() {
        let r = RackFile::parse(&format!(
            "agent = \"/usr/local/bin/phub-rack-agent\"\nssh = \"ssh -i /root/.ssh/rack -o BatchMode=yes\"\n\
             {MINIMAL}base_port = 9100\ncontrol = \"10.0.0.1:7701\"\nlink_gbps = 100\n\
             [[workers]]\nhost = \"w1\"\nip = \"192.168.50.11\"\n\
             [[workers]]\nhost = \"w2\"\nip = \"192.168.50.12\"\nagent = \"/opt/phub/agent\"\n"
        ))
        .unwrap();
        assert_eq!(r.appliance.base_port, 9100);
        assert_eq!(r.control_addr(), "10.0.0.1:7701");
        assert_eq!(r.appliance.link_gbps, Some(100));
        assert_eq!(
            r.ssh_words(),
            ["ssh", "-i", "/root/.ssh/rack", "-o", "BatchMode=yes"]
        );
        assert_eq!(r.agent_of(0), "/usr/local/bin/phub-rack-agent");
        assert_eq!(r.agent_of(1), "/opt/phub/agent");
    }

    #[test]
    fn wrong_lab_fields_are_named() {
        for (extra, field) in [
            ("control = \"10.0.0.1\"\n", "appliance.control"),
            ("control = \"10.0.0.1:0\"\n", "appliance.control"),
            ("base_port = 65535\n", "appliance.base_port"),
            ("base_port = 0\n", "appliance.base_port"),
            ("agnet = \"x\"\n", "agnet"),
        ] {
            let e = RackFile::parse(&format!("{MINIMAL}{extra}")).unwrap_err();
            assert!(e.contains(field), "{extra}: {e}");
        }
        let e = RackFile::parse(&format!("ssh = \" \"\n{MINIMAL}")).unwrap_err();
        assert!(e.contains("`ssh`"), "{e}");
        let e = RackFile::parse(&format!("{MINIMAL}[[workers]]\nhost = \"w1\"\nip = \"w1\"\n")).unwrap_err();
        assert!(e.contains("workers[0].ip"), "{e}");
    }
}
