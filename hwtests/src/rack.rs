//! The rack file, and which rack the suite runs on (`PHUB_RACK`).
//!
//! ```toml
//! [appliance]
//! pci = "0000:3b:00.0"        # the NIC DPDK drives
//! cores = [2, 3, 4, 5]        # one data lcore (NIC queue) per core
//! main_core = 1               # EAL main lcore: management, off the data cores
//! ip = "192.168.50.1"         # the appliance's address on the rack network
//! eal = "--in-memory"         # extra EAL arguments (optional)
//! mtu = 9000                  # optional, default 9000
//!
//! [[workers]]
//! host = "worker1"            # how to reach it (ssh)
//! ip = "192.168.50.11"        # its address on the rack network
//! ```

use serde::Deserialize;

/// A lab rack.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RackFile {
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
}

fn default_mtu() -> u16 {
    9000
}

/// One worker host.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerHost {
    /// Host name for ssh.
    pub host: String,
    /// Its address on the rack network.
    pub ip: String,
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
        Ok(r)
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
    Lab(RackFile),
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
            .map(Target::Lab),
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
}
