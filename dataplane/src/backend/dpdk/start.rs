//! Starting the DPDK dataplane: EAL (arguments passed through, lcores
//! mapped so the management thread stays off the data cores), the port and
//! its pools on the port's NUMA socket, rte_flow steering where the device
//! has it, hand-off rings, and one [`DpdkQueue`] per lcore running the job
//! the appliance makes for it on an EAL worker lcore. [`Runtime::stop`]
//! waits for the lcores; the port stops and closes when its last handle
//! goes.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use phub_ffi::eal::{has_option, NO_HUGEPAGE_FILES};
use phub_ffi::lcore::{self as eal_lcore, Launched};
use phub_ffi::{Eal, Mempool, Port, PortBuilder, Ring};
use phub_proto::api::{LcoreInfo, PortStats};

use super::{
    handoff_rings, DpdkQueue, DpdkSlotMemory, Identity, Neighbors, QueueOptions, TxPools, HANDOFF_RING,
    RX_BURST,
};
use crate::backend::{LcoreStart, MakeJob, Started};
use crate::config::{BackendKind, Config, DpdkOptions, DEFAULT_BASE_PORT};
use phub_engine::counters::ShardCounters;

/// The running lcores and the port.
#[derive(Debug)]
pub struct Runtime {
    // Field order is drop order: lcores are waited for in stop(); the port
    // closes after them.
    launched: Vec<Launched>,
    port: Port,
}

impl Runtime {
    /// The port.
    pub fn port(&self) -> &Port {
        &self.port
    }

    /// Waits for every lcore (the caller has set the stop flag), then lets
    /// the port go (it stops and closes once no other handle holds it).
    pub fn stop(self) {
        for l in self.launched {
            let lc = l.lcore();
            let rc = l.wait();
            if rc != 0 {
                log::error!("lcore {lc} ended with status {rc}");
            }
        }
        drop(self.port);
    }
}

/// A reader of the port's own counters, for the management API.
fn port_stats_reader(port: &Port) -> impl Fn() -> Option<PortStats> + Send + Sync + 'static {
    let port = port.clone();
    move || port.stats().ok()
}

/// Share of the free heap kept back from the slot-memory budget when the
/// heap is fixed (`--no-huge`): the allocator's per-block header (64 bytes)
/// and each buffer's padding to a 64-byte line, about 3% for 1 KiB chunks
/// and less for larger ones.
const HEAP_RESERVE_DIV: u64 = 16;

/// The slot-memory budget the dataplane reports and admits against: the
/// operator's `--memory-budget`, but no more than DPDK's heap can give when
/// that is fixed (`--no-huge`: the `-m` area less the pools, less
/// 1/[`HEAP_RESERVE_DIV`] for allocator overhead). With hugepages the heap
/// grows on demand and the budget stands; an install the heap cannot hold
/// is refused whole either way.
fn memory_budget(configured: u64, mem: &DpdkSlotMemory) -> u64 {
    let Some(free) = mem.fixed_heap_free() else {
        return configured;
    };
    let usable = free - free / HEAP_RESERVE_DIV;
    if usable < configured {
        log::warn!(
            "--memory-budget {configured} bytes: DPDK's heap is fixed (--no-huge) with {free} bytes free on socket {} after the pools; \
             the budget is {usable} bytes (raise EAL -m for more)",
            mem.socket().unwrap_or(0)
        );
        usable
    } else {
        configured
    }
}

/// EAL options that give the lcore map.
const LCORE_OPTS: &[&str] = &["-l", "-c", "--lcores"];

/// The EAL arguments the operator gave (`--eal`, then each `--eal-arg`).
fn user_args(d: &DpdkOptions) -> Vec<String> {
    let mut args: Vec<String> = d
        .eal
        .as_deref()
        .unwrap_or("")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    args.extend(d.eal_arg.iter().cloned());
    args
}

/// The EAL arguments: the operator's, plus an lcore map when they give
/// none (main lcore 0 on the CPUs the data lcores do not use, data lcore
/// i on CPU i-1; all floating over every CPU when there are too few CPUs or
/// with `no_pin`) and `--in-memory` when hugepages are in use without it
/// (so no hugepage file outlives the process), except with a ring port,
/// whose other end is a secondary process that needs the shared runtime.
pub fn eal_args(d: &DpdkOptions, lcores: Option<usize>, no_pin: bool, cpus: &[usize]) -> Vec<String> {
    let mut args = user_args(d);
    if !has_option(&args, LCORE_OPTS) {
        let n = lcores.unwrap_or(cpus.len().saturating_sub(1).max(1));
        let all = if cpus.is_empty() {
            "0".to_string()
        } else {
            cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
        };
        let map = if no_pin || cpus.len() <= n {
            format!("(0-{n})@({all})")
        } else {
            let rest: Vec<String> = cpus[n..].iter().map(usize::to_string).collect();
            let mut m = format!("0@({})", rest.join(","));
            for (i, c) in cpus[..n].iter().enumerate() {
                m += &format!(",{}@{c}", i + 1);
            }
            m
        };
        args.push("--lcores".into());
        args.push(map);
    }
    if d.ring_port.is_none() && !has_option(&args, NO_HUGEPAGE_FILES) {
        args.push("--in-memory".into());
    }
    args
}

/// Other appliances' Ethernet addresses, from `--neighbor` and
/// `--gateway-mac`.
fn neighbors(d: &crate::config::DpdkOptions) -> Result<Neighbors> {
    let table = d
        .neighbor
        .iter()
        .map(|n| {
            let (ip, mac) = n.split_once('=').ok_or_else(|| {
                anyhow::anyhow!("--neighbor {n:?}: expected IP=MAC, e.g. 10.0.1.1=02:00:00:00:01:01")
            })?;
            let ip = ip
                .parse()
                .map_err(|_| anyhow::anyhow!("--neighbor {n:?}: {ip:?} is not an IPv4 address"))?;
            Ok((ip, parse_mac_of("--neighbor", mac)?))
        })
        .collect::<Result<_>>()?;
    let gateway = d
        .gateway_mac
        .as_deref()
        .map(|m| parse_mac_of("--gateway-mac", m))
        .transpose()?;
    Ok(Neighbors { table, gateway })
}

fn parse_mac(s: &str) -> Result<[u8; 6]> {
    parse_mac_of("--mac", s)
}

fn parse_mac_of(flag: &str, s: &str) -> Result<[u8; 6]> {
    let parts: Vec<&str> = s.split([':', '-']).collect();
    let bad = || anyhow::anyhow!("{flag} {s:?}: expected six hex bytes like 02:00:00:00:00:01");
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        *m = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    Ok(mac)
}

fn resolve_port(eal: Eal, port: &str) -> Result<u16> {
    let p = if port.is_empty() { "0" } else { port };
    if let Ok(id) = p.parse::<u16>() {
        return Ok(id);
    }
    eal.port_by_name(p).with_context(|| {
        format!(
            "--port {p:?}: no port by that name; the EAL found {} port(s) (ids 0..)",
            eal.port_count()
        )
    })
}

/// Descriptors of each ring of a `--ring-port`.
pub const RING_PORT_SIZE: u32 = 4096;

/// Longest name DPDK gives a ring (`RTE_RING_NAMESIZE` - 1: memzone names
/// have 31 bytes, 3 of them the ring prefix), and, as found, the longest
/// device name the ring PMD takes.
const RING_NAME_MAX: usize = 28;

/// Refuses a `--ring-port` name from which DPDK would make a name too long.
fn check_ring_port_name(name: &str, lcores: usize) -> Result<()> {
    // The names DPDK makes from it: the rings', and the ring PMD's device
    // (`net_ring_NAME`), each at most RING_NAME_MAX bytes.
    let longest = [
        format!("{name}-done{}", lcores.saturating_sub(1)),
        format!("net_ring_{name}"),
    ]
    .into_iter()
    .max_by_key(String::len)
    .unwrap_or_default();
    if name.is_empty() || longest.len() > RING_NAME_MAX {
        bail!(
            "--ring-port {name:?}: expected a name of 1 to {} bytes with {lcores} lcore(s) (DPDK names {longest:?} after it, and takes at most {RING_NAME_MAX})",
            RING_NAME_MAX + name.len() - longest.len()
        );
    }
    Ok(())
}

/// A port made of rings `{name}-rx{i}` and `{name}-tx{i}`, one pair per
/// lcore, for another DPDK process of this runtime to attach to, and
/// completion rings `{name}-done{i}` through which that process may hand
/// back what lcore i sent, to be freed on lcore i.
fn ring_port(eal: Eal, name: &str, lcores: usize) -> Result<(u16, Vec<Ring>)> {
    check_ring_port_name(name, lcores)?;
    if !eal.has_hugepages() {
        log::warn!(
            "--ring-port {name} without hugepages (--no-huge): no other process can attach to its rings"
        );
    }
    let ring = |dir: &str, i: usize| {
        let rn = format!("{name}-{dir}{i}");
        Ring::create_named(eal, &rn, RING_PORT_SIZE, None).with_context(|| {
            format!("--ring-port {name}: ring {rn:?} (a name not taken by another port of this runtime)")
        })
    };
    let rx = (0..lcores).map(|i| ring("rx", i)).collect::<Result<Vec<_>>>()?;
    let tx = (0..lcores).map(|i| ring("tx", i)).collect::<Result<Vec<_>>>()?;
    let done = (0..lcores).map(|i| ring("done", i)).collect::<Result<Vec<_>>>()?;
    let id = eal
        .port_from_rings(name, &rx, &tx, 0)
        .with_context(|| format!("--ring-port {name}: a port from its rings"))?;
    log::info!(
        "ring port {name} (port {id}): a DPDK secondary process with this --file-prefix sends to lcore i through ring {name}-rx<i>, takes what it sends from {name}-tx<i>, and may hand those frames back on {name}-done<i> to be freed there"
    );
    Ok((id, done))
}

/// Starts the DPDK dataplane described by `cfg`.
pub fn start(cfg: &Config, make_job: MakeJob<'_, DpdkQueue>, stop: &Arc<AtomicBool>) -> Result<Started> {
    let d = &cfg.dpdk;
    let cpus: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    let args = eal_args(d, cfg.lcores, cfg.no_pin, &cpus);
    let eal = phub_ffi::eal::init(&args).context("starting the DPDK EAL")?;
    let workers = eal.worker_lcores();
    let n = cfg.lcore_count(workers.len())?;
    if workers.len() < n {
        bail!(
            "--lcores {n}: the EAL has only {} worker lcore(s) {workers:?}; give EAL --lcores/-l with {} lcores (the main one runs management)",
            workers.len(),
            n + 1
        );
    }
    let workers = &workers[..n];
    let (port_id, completions) = match &d.ring_port {
        Some(name) => ring_port(eal, name, n)?,
        None => (resolve_port(eal, &d.port)?, Vec::new()),
    };
    let mut completions = completions.into_iter();
    let info = phub_ffi::port::info(eal, port_id).context("the DPDK port")?;
    let socket = info.socket;
    for &l in workers {
        let s = eal.lcore_socket(l);
        if let Some(ps) = socket {
            if s != ps {
                log::warn!(
                    "lcore {l} is on NUMA socket {s}, port {port_id} ({}) on socket {ps}: every packet crosses sockets",
                    info.name
                );
            }
        }
    }
    // Cast: n <= MAX_LCORES (256), checked in Config::lcore_count.
    #[allow(clippy::cast_possible_truncation)]
    let n16 = n as u16;
    let base = if cfg.base_port == 0 {
        DEFAULT_BASE_PORT
    } else {
        cfg.base_port
    };
    // Cast: RX_BURST is 32.
    #[allow(clippy::cast_possible_truncation)]
    let mbufs = if d.mbufs > 0 {
        d.mbufs
    } else {
        u32::from(n16) * (u32::from(d.rx_desc) + RX_BURST as u32 + HANDOFF_RING) + 1024
    };
    let rx_pool = Mempool::pktmbuf(eal, "rx", mbufs, 256, d.mbuf_size, socket).with_context(|| {
        format!(
            "the RX pool ({mbufs} mbufs of {} bytes; --mbufs, --mbuf-size)",
            d.mbuf_size
        )
    })?;
    let tx_n = d.tx_mbufs.max(1024);
    let pools = TxPools::create(eal, tx_n, socket).context("the TX pools (--tx-mbufs)")?;
    let mac_override = d.mac.as_deref().map(parse_mac).transpose()?;
    let peers = Arc::new(neighbors(d)?);
    let (port, rxq, txq) = PortBuilder::new(eal, port_id)
        .queues(n16)
        .descriptors(d.rx_desc, d.tx_desc)
        .mtu(d.mtu)
        .rx_pool(rx_pool)
        .keep_pool(pools.header.clone())
        .keep_pool(pools.payload.clone())
        .promiscuous(mac_override.is_some())
        .tx_checksums(!d.software_tx_checksums)
        .build()
        .with_context(|| format!("setting up port {port_id} ({})", info.name))?;
    // Steering: one rte_flow rule per lcore where the device has rte_flow;
    // otherwise packets on the wrong queue are handed over.
    if n > 1 {
        for i in 0..n16 {
            if let Err(e) = port.steer_udp_dst(base.wrapping_add(i), i) {
                log::info!(
                    "port {port_id} ({}): no rte_flow steering ({e}); datagrams on the wrong queue are handed to their lcore and counted as misrouted",
                    info.driver
                );
                break;
            }
        }
    }
    let handoff: Arc<[Ring]> = handoff_rings(eal, n, socket)?.into();
    let offl = port.offloads();
    let qopts = QueueOptions {
        check_ip_checksum: !offl.rx_ipv4_cksum,
        check_udp_checksum: !offl.rx_udp_cksum,
        nic_checksums: offl.rx_ipv4_cksum || offl.rx_udp_cksum,
        // The ring PMD passes mbufs through as they are, chains included.
        chains: offl.tx_multi_segs || info.driver == "net_ring",
        tx_checksums: offl.tx_checksums || (d.ring_port.is_some() && d.ring_port_tx_checksums),
        idle_backoff: d.idle_backoff,
    };
    log::info!(
        "port {port_id} ({}): results' IPv4 and UDP checksums {}",
        info.driver,
        if offl.tx_checksums {
            "filled in by the port (TX checksum offload)"
        } else if qopts.tx_checksums {
            "left to the ring port's peer (--ring-port-tx-checksums)"
        } else if d.software_tx_checksums {
            "summed by the lcores (--software-tx-checksums)"
        } else {
            "summed by the lcores (the port has no IPv4 and UDP TX checksum offload)"
        }
    );
    if !qopts.chains {
        log::warn!(
            "port {port_id} ({}) cannot send multi-segment frames: each result is copied once per destination",
            info.driver
        );
    }
    let me = Identity {
        ip: cfg.host,
        mac: mac_override.unwrap_or(info.mac),
        base_port: base,
    };
    // Whether phub made the lcore map and pinned data lcore i to cpus[i-1].
    let pinned =
        !has_option(&user_args(d), LCORE_OPTS) && !cfg.no_pin && cpus.len() > n && !phub_ffi_reused(&args);
    let slot_memory = Arc::new(DpdkSlotMemory::new(eal, socket));
    let mut infos = Vec::with_capacity(n);
    let mut launched = Vec::with_capacity(n);
    for (i, (rx, tx)) in rxq.into_iter().zip(txq).enumerate() {
        // Cast: i < n <= MAX_LCORES (256), checked in Config::lcore_count.
        #[allow(clippy::cast_possible_truncation)]
        let lcore = i as u16;
        let counters = Arc::new(ShardCounters::default());
        let mut q = DpdkQueue::new(
            lcore,
            rx,
            tx,
            me,
            Arc::clone(&handoff),
            pools.clone(),
            Arc::clone(&counters),
            qopts,
        );
        if let Some(c) = completions.next() {
            q = q.with_completions(c);
        }
        q = q.with_neighbors(Arc::clone(&peers));
        let run = make_job(LcoreStart {
            lcore,
            io: q,
            counters,
            slot_memory: slot_memory.clone(),
        });
        let l = workers[i];
        let job = move || match run() {
            Ok(()) => 0,
            Err(e) => {
                log::error!("lcore {i}: {e}");
                -1
            }
        };
        match eal_lcore::launch(eal, l, job) {
            Ok(h) => launched.push(h),
            Err(e) => {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                for h in launched {
                    let _ = h.wait();
                }
                return Err(e).context(format!("launching lcore {i} on EAL lcore {l}"));
            }
        }
        infos.push(LcoreInfo {
            lcore,
            cpu: if pinned {
                cpus.get((l as usize).wrapping_sub(1)).copied()
            } else {
                None
            },
            numa_node: Some(eal.lcore_socket(l)),
            rx_buffer_bytes: None,
        });
    }
    log::info!(
        "phub-dataplane: DPDK port {port_id} ({}, {}), {n} lcore(s) on EAL lcores {workers:?}, {}:{}..{}, MAC {}",
        info.name,
        info.driver,
        cfg.host,
        base,
        base as usize + n - 1,
        me.mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
    );
    let runtime = Runtime { launched, port };
    let reader = port_stats_reader(runtime.port());
    Ok(Started {
        backend: BackendKind::Dpdk,
        base_port: base,
        threads: infos.iter().map(|_| None).collect(),
        lcores: infos,
        nic_numa_node: socket,
        memory_budget: memory_budget(cfg.memory_budget, &slot_memory),
        slot_memory,
        port_stats: Some(Box::new(reader)),
        socket_drops: None,
        release: Some(Box::new(move || runtime.stop())),
    })
}

/// Whether the EAL in force was started by someone else with other
/// arguments (an in-process test): its lcore map is not ours then.
fn phub_ffi_reused(args: &[String]) -> bool {
    phub_ffi::eal::args().is_some_and(|a| a != args)
}

/// Releases the EAL at the end of the process (no hugepage file or runtime
/// directory stays behind). Call after the appliance has shut down. Returns
/// whether there was an EAL to release.
pub fn cleanup_eal() -> bool {
    if phub_ffi::eal::get().is_none() {
        return false;
    }
    // SAFETY: called by the binary after Appliance::shutdown: the lcores
    // have returned and every port, queue, pool, ring and mbuf has been
    // dropped; nothing uses DPDK afterwards.
    if let Err(e) = unsafe { phub_ffi::eal::cleanup() } {
        log::warn!("DPDK EAL cleanup: {e}");
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(eal: &str) -> DpdkOptions {
        DpdkOptions {
            eal: Some(eal.into()),
            ..DpdkOptions::default()
        }
    }

    #[test]
    fn the_lcore_map_keeps_management_off_the_data_cores() {
        let a = eal_args(&opts("--no-pci"), Some(2), false, &[0, 1, 2, 3]);
        assert_eq!(a, ["--no-pci", "--lcores", "0@(2,3),1@0,2@1", "--in-memory"]);
        // Too few CPUs, or no pinning: every lcore floats.
        let a = eal_args(&opts("--no-huge -m 512"), Some(2), false, &[0, 1]);
        assert_eq!(a, ["--no-huge", "-m", "512", "--lcores", "(0-2)@(0,1)"]);
        let a = eal_args(&opts(""), Some(1), true, &[0, 1, 2]);
        assert_eq!(a, ["--lcores", "(0-1)@(0,1,2)", "--in-memory"]);
        // The operator's map and memory options stay as given.
        let mut o = opts("-l 0-2 --in-memory");
        o.eal_arg = vec!["--vdev=net_af_packet0,iface=a b".into()];
        let a = eal_args(&o, Some(2), false, &[0, 1, 2, 3]);
        assert_eq!(a, ["-l", "0-2", "--in-memory", "--vdev=net_af_packet0,iface=a b"]);
        // A ring port's other end is a secondary process: no --in-memory.
        let mut o = opts("--no-pci --file-prefix gen");
        o.ring_port = Some("pb".into());
        let a = eal_args(&o, Some(1), true, &[0, 1]);
        assert_eq!(a, ["--no-pci", "--file-prefix", "gen", "--lcores", "(0-1)@(0,1)"]);
    }

    #[test]
    fn ring_port_names_fit_what_dpdk_makes_of_them() {
        assert!(check_ring_port_name("phubbench", 1).is_ok());
        assert!(check_ring_port_name(&"a".repeat(19), 1).is_ok());
        let e = check_ring_port_name(&"a".repeat(20), 1).unwrap_err().to_string();
        assert!(e.contains("1 to 19 bytes") && e.contains("net_ring_"), "{e}");
        // The rings' names ("NAME-done255") stay shorter than the device's.
        assert!(check_ring_port_name(&"a".repeat(19), 256).is_ok());
        assert!(check_ring_port_name("", 1).is_err());
    }

    #[test]
    fn macs_parse_or_say_what_is_expected() {
        assert_eq!(parse_mac("02:00:0a:ff:00:01").unwrap(), [2, 0, 10, 255, 0, 1]);
        assert_eq!(parse_mac("02-00-0a-ff-00-01").unwrap(), [2, 0, 10, 255, 0, 1]);
        let e = parse_mac("02:00").unwrap_err().to_string();
        assert!(e.contains("six hex bytes"), "{e}");
    }
}
