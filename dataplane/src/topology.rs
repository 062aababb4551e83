//! The machine's NUMA layout, as the dataplane needs it at start-up: which
//! node each CPU belongs to, how many nodes there are, and which node a
//! network interface hangs off.
//!
//! Layer: start-up only. [`Topology::detect`] asks hwloc (through
//! `hwlocality`) once and keeps a plain CPU -> node table, so queries are
//! cheap lookups that never touch hwloc again and the value can be shared
//! or sent anywhere. Node and CPU numbers are OS indices (what Linux, DPDK
//! and `core_affinity` use), not hwloc's logical indices.
//!
//! Invariant: a topology that could not be read knows nothing; every query
//! answers `None` (and [`Topology::nodes`] answers 1) rather than guessing.

use std::ffi::CStr;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Once;

use hwlocality::object::types::ObjectType;

/// Where the kernel publishes network interfaces.
const SYS_CLASS_NET: &str = "/sys/class/net";

/// The machine's NUMA layout as the dataplane needs it.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    /// NUMA node (OS index) of each CPU, indexed by the CPU's OS index.
    /// Empty when the topology is unknown.
    cpu_node: Vec<Option<u32>>,
    /// Number of NUMA nodes hwloc reported; 0 when unknown.
    nodes: usize,
}

impl Topology {
    /// Reads the topology with hwlocality; on failure returns a Topology
    /// that knows nothing (every query None) and logs a warning once.
    pub fn detect() -> Topology {
        // hwlocality is still in alpha and panics on hwloc errors it does not
        // expect; a missing NUMA layout must not stop the appliance.
        match std::panic::catch_unwind(read_hwloc) {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                warn_once(&e);
                Topology::unknown()
            }
            Err(_) => {
                warn_once("hwlocality panicked");
                Topology::unknown()
            }
        }
    }

    /// A topology that knows nothing: what [`Topology::detect`] returns when
    /// hwloc fails.
    pub fn unknown() -> Topology {
        Topology::default()
    }

    /// Whether the topology was read (false: every query answers `None`).
    pub fn is_known(&self) -> bool {
        self.nodes > 0
    }

    /// NUMA node (OS index) of a CPU (OS index), if known.
    pub fn cpu_node(&self, cpu: usize) -> Option<u32> {
        self.cpu_node.get(cpu).copied().flatten()
    }

    /// Number of NUMA nodes (1 on a machine without NUMA, and when the
    /// topology is unknown: every machine has at least one).
    pub fn nodes(&self) -> usize {
        self.nodes.max(1)
    }

    /// NUMA node of the network interface that holds IPv4 address `ip`.
    ///
    /// `None` when no interface holds `ip` (0.0.0.0 included), when the
    /// interface has no device behind it (loopback, veth, bridges and other
    /// virtual devices), when the kernel does not know the device's node
    /// (it reports -1), and when the topology is unknown.
    pub fn nic_node(&self, ip: Ipv4Addr) -> Option<u32> {
        if !self.is_known() {
            return None;
        }
        let iface = interface_with_addr(ip)?;
        device_numa_node(Path::new(SYS_CLASS_NET), &iface)
    }
}

/// Reads the CPU -> node table from hwloc.
fn read_hwloc() -> Result<Topology, String> {
    let topo = hwlocality::Topology::new().map_err(|e| e.to_string())?;
    let mut cpu_node: Vec<Option<u32>> = Vec::new();
    let mut nodes = 0;
    // hwloc lists nodes in logical order, which puts a package's ordinary
    // memory before memory-only nodes (HBM, CXL) that share its CPUs: the
    // first node that claims a CPU is the one it gets.
    for node in topo.objects_with_type(ObjectType::NUMANode) {
        nodes += 1;
        let Some(os) = node.os_index().and_then(|i| u32::try_from(i).ok()) else {
            continue;
        };
        let Some(cpus) = node.cpuset() else {
            continue;
        };
        for cpu in cpus.iter_set() {
            let cpu = usize::from(cpu);
            if cpu >= cpu_node.len() {
                cpu_node.resize(cpu + 1, None);
            }
            cpu_node[cpu].get_or_insert(os);
        }
    }
    if nodes == 0 {
        return Err("hwloc reported no NUMA node".into());
    }
    Ok(Topology { cpu_node, nodes })
}

/// Logs why the topology is unknown, the first time only.
fn warn_once(why: &str) {
    static WARNED: Once = Once::new();
    WARNED.call_once(|| {
        log::warn!("NUMA topology unknown ({why}): lcores and the NIC get no NUMA node");
    });
}

/// Frees a `getifaddrs` list when dropped.
struct IfAddrs(*mut libc::ifaddrs);

impl Drop for IfAddrs {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a successful getifaddrs, is freed only
        // here, and nothing borrowed from the list outlives `self`.
        unsafe { libc::freeifaddrs(self.0) };
    }
}

/// Name of the first interface that holds IPv4 address `ip`.
fn interface_with_addr(ip: Ipv4Addr) -> Option<String> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid place for getifaddrs to store the list head.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let list = IfAddrs(head);
    let mut cur = list.0.cast_const();
    while !cur.is_null() {
        // SAFETY: `cur` is a non-null node of the list getifaddrs returned,
        // which stays allocated until `list` drops at the end of this function.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points to a sockaddr, which starts with
        // its family field; read unaligned, as it assumes nothing about the
        // allocation.
        let family = unsafe { std::ptr::addr_of!((*ifa.ifa_addr).sa_family).read_unaligned() };
        if libc::c_int::from(family) != libc::AF_INET {
            continue;
        }
        // SAFETY: family AF_INET means ifa_addr points to a whole sockaddr_in.
        let sin = unsafe { ifa.ifa_addr.cast::<libc::sockaddr_in>().read_unaligned() };
        if Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)) == ip && !ifa.ifa_name.is_null() {
            // SAFETY: ifa_name is a NUL-terminated string owned by the list,
            // copied out before the list is freed.
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
            return Some(name.to_string_lossy().into_owned());
        }
    }
    None
}

/// NUMA node of interface `iface`'s device, from `<sys_class_net>/IFACE/device/numa_node`.
fn device_numa_node(sys_class_net: &Path, iface: &str) -> Option<u32> {
    if iface.is_empty() || iface.contains('/') || iface == "." || iface == ".." {
        return None;
    }
    let text = std::fs::read_to_string(sys_class_net.join(iface).join("device/numa_node")).ok()?;
    parse_numa_node(&text)
}

/// Parses a sysfs `numa_node` file: a node number, or -1 when unknown.
fn parse_numa_node(text: &str) -> Option<u32> {
    text.trim().parse::<u32>().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPUs of each node per `/sys/devices/system/node`, the kernel's own
    /// view: the naive reference for hwloc's answer. None without that tree.
    fn sysfs_nodes() -> Option<Vec<(u32, Vec<usize>)>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir("/sys/devices/system/node").ok()? {
            let entry = entry.ok()?;
            let name = entry.file_name().into_string().ok()?;
            let Some(node) = name.strip_prefix("node").and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let list = std::fs::read_to_string(entry.path().join("cpulist")).ok()?;
            let mut cpus = Vec::new();
            for part in list.trim().split(',').filter(|p| !p.is_empty()) {
                let (a, b) = part.split_once('-').unwrap_or((part, part));
                cpus.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?);
            }
            out.push((node, cpus));
        }
        (!out.is_empty()).then_some(out)
    }

    #[test]
    fn detect_reads_this_machine() {
        let t = Topology::detect();
        assert!(t.is_known(), "hwloc could not read this machine's topology");
        assert!(t.nodes() >= 1);
        // Every CPU this process may run on has a local node in hwloc 2.
        let cpus = core_affinity::get_core_ids().unwrap_or_default();
        assert!(!cpus.is_empty());
        for c in cpus {
            assert!(t.cpu_node(c.id).is_some(), "cpu {} has no NUMA node", c.id);
        }
        assert_eq!(t.cpu_node(usize::MAX), None);
    }

    #[test]
    fn detect_agrees_with_sysfs() {
        let Some(nodes) = sysfs_nodes() else {
            eprintln!("skipped: no /sys/devices/system/node here");
            return;
        };
        let t = Topology::detect();
        // hwloc hides nodes this process may not use (cgroups), so only the
        // CPUs it may run on are compared, and not the node count.
        for c in core_affinity::get_core_ids().unwrap_or_default() {
            let got = t.cpu_node(c.id);
            // A CPU listed under two nodes (a memory-only node sharing a
            // package's CPUs) may get either.
            let listed: Vec<u32> = nodes
                .iter()
                .filter(|(_, cpus)| cpus.contains(&c.id))
                .map(|&(n, _)| n)
                .collect();
            assert!(
                got.is_some_and(|n| listed.contains(&n)),
                "cpu {}: hwloc says node {got:?}, the kernel lists it under {listed:?}",
                c.id
            );
        }
    }

    #[test]
    fn unknown_knows_nothing() {
        let t = Topology::unknown();
        assert!(!t.is_known());
        assert_eq!(t.nodes(), 1);
        assert_eq!(t.cpu_node(0), None);
        assert_eq!(t.nic_node(Ipv4Addr::LOCALHOST), None);
    }

    #[test]
    fn loopback_has_no_nic_node() {
        let t = Topology::detect();
        assert_eq!(t.nic_node(Ipv4Addr::LOCALHOST), None);
        assert_eq!(t.nic_node(Ipv4Addr::UNSPECIFIED), None);
        // TEST-NET-3: held by no interface.
        assert_eq!(t.nic_node(Ipv4Addr::new(203, 0, 113, 254)), None);
    }

    #[test]
    fn finds_loopback_by_address() {
        // Loopback holds 127.0.0.1 wherever it is up; a bare network
        // namespace may have it down, so only a found name is checked.
        if let Some(name) = interface_with_addr(Ipv4Addr::LOCALHOST) {
            assert!(!name.is_empty());
            assert_eq!(device_numa_node(Path::new(SYS_CLASS_NET), &name), None);
        }
        assert_eq!(interface_with_addr(Ipv4Addr::new(203, 0, 113, 254)), None);
    }

    #[test]
    fn parses_sysfs_numa_node() {
        assert_eq!(parse_numa_node("0\n"), Some(0));
        assert_eq!(parse_numa_node("3"), Some(3));
        assert_eq!(parse_numa_node("-1\n"), None);
        assert_eq!(parse_numa_node(""), None);
        assert_eq!(parse_numa_node("x"), None);
    }

    #[test]
    fn reads_device_node_from_a_sysfs_tree() {
        let root = std::env::temp_dir().join(format!("phub-topology-{}", std::process::id()));
        let dev = |iface: &str, node: &str| {
            let d = root.join(iface).join("device");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("numa_node"), node).unwrap();
        };
        dev("ens1f0", "1\n");
        dev("ens2", "-1\n");
        std::fs::create_dir_all(root.join("veth0")).unwrap();
        assert_eq!(device_numa_node(&root, "ens1f0"), Some(1));
        assert_eq!(device_numa_node(&root, "ens2"), None);
        assert_eq!(device_numa_node(&root, "veth0"), None);
        assert_eq!(device_numa_node(&root, "missing"), None);
        assert_eq!(device_numa_node(&root, "../ens1f0"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
