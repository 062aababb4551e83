//! Ethernet ports: a builder that configures and starts one, queue handles
//! handed out once, stats, and rte_flow steering.
//!
//! The port is stopped and closed when the last of its handles ([`Port`],
//! [`RxQueue`], [`TxQueue`]) is dropped, so no queue can outlive it; the
//! pools it was set up with (and any the caller asks it to keep) are freed
//! only after that.

use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::eal::Eal;
use crate::error::Error;
use crate::mbuf::Mbuf;
use crate::mempool::Mempool;
use crate::{sys, Result};

/// What a device is and can do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Port id.
    pub id: u16,
    /// Device name (e.g. `net_af_packet0`, a PCI address).
    pub name: String,
    /// Driver name.
    pub driver: String,
    /// NUMA socket of the device, when known.
    pub socket: Option<u32>,
    /// Most RX queues.
    pub max_rx_queues: u16,
    /// Most TX queues.
    pub max_tx_queues: u16,
    /// Smallest and largest MTU the device can be configured with.
    pub mtu_range: (u16, u16),
    /// RX offloads the device has (`RTE_ETH_RX_OFFLOAD_*` bits).
    pub rx_offload_capa: u64,
    /// TX offloads the device has (`RTE_ETH_TX_OFFLOAD_*` bits).
    pub tx_offload_capa: u64,
    /// RSS hash types the device has.
    pub rss_offloads: u64,
    /// The port's MAC address.
    pub mac: [u8; 6],
}

/// The offloads phub asks for, as enabled on a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Offloads {
    /// The device checks IPv4 header checksums on RX.
    pub rx_ipv4_cksum: bool,
    /// The device checks UDP checksums on RX.
    pub rx_udp_cksum: bool,
    /// RX frames may span several mbufs.
    pub rx_scatter: bool,
    /// TX takes chains of mbufs (header + shared payload).
    pub tx_multi_segs: bool,
    /// The device fills in IPv4 header and UDP checksums on TX for frames
    /// that ask ([`Mbuf::offload_udp_checksums`](crate::mbuf::Mbuf::offload_udp_checksums)):
    /// it has both offloads and [`PortBuilder::tx_checksums`] asked for them.
    pub tx_checksums: bool,
    /// RSS spreads flows over the RX queues.
    pub rss: bool,
}

/// The port's counters (`rte_eth_stats`), as the management API shows them.
pub use phub_proto::api::PortStats;

fn port_name(port: u16) -> String {
    let mut buf = [0 as std::ffi::c_char; 64];
    // SAFETY: buf has the RTE_ETH_NAME_MAX_LEN (64) bytes the call may write.
    let rc = unsafe { sys::rte_eth_dev_get_name_by_port(port, buf.as_mut_ptr()) };
    if rc != 0 {
        return format!("port{port}");
    }
    // SAFETY: DPDK wrote a NUL-terminated name into buf.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn dev_info(port: u16) -> Result<sys::rte_eth_dev_info> {
    let mut info = sys::rte_eth_dev_info::default();
    // SAFETY: info is a valid out structure.
    let rc = unsafe { sys::rte_eth_dev_info_get(port, &mut info) };
    if rc != 0 {
        return Err(Error::call(format!("rte_eth_dev_info_get(port {port})"), rc));
    }
    Ok(info)
}

/// What a port is and can do.
pub fn info(eal: Eal, port: u16) -> Result<PortInfo> {
    if !eal.port_exists(port) {
        return Err(Error::Invalid(format!(
            "port {port}: no such port; the EAL found {} (give devices with --vdev or a PCI allow-list)",
            eal.port_count()
        )));
    }
    let i = dev_info(port)?;
    let driver = if i.driver_name.is_null() {
        String::new()
    } else {
        // SAFETY: the driver name is a static NUL-terminated string.
        unsafe { CStr::from_ptr(i.driver_name) }
            .to_string_lossy()
            .into_owned()
    };
    // SAFETY: valid port.
    let socket = unsafe { sys::rte_eth_dev_socket_id(port) };
    // ethdev checks MTU + overhead against max_rx_pktlen; the overhead is
    // what the driver's max_mtu implies, or Ethernet header + CRC.
    let overhead = if i.max_mtu != u16::MAX && i.max_rx_pktlen > u32::from(i.max_mtu) {
        i.max_rx_pktlen - u32::from(i.max_mtu)
    } else {
        18
    };
    // Cast: at most i.max_mtu, a u16, by the min.
    #[allow(clippy::cast_possible_truncation)]
    let max_mtu = u32::from(i.max_mtu).min(i.max_rx_pktlen.saturating_sub(overhead)) as u16;
    let mut mac = sys::rte_ether_addr::default();
    // SAFETY: valid port and out structure.
    unsafe { sys::rte_eth_macaddr_get(port, &mut mac) };
    Ok(PortInfo {
        id: port,
        name: port_name(port),
        driver,
        socket: u32::try_from(socket).ok(),
        max_rx_queues: i.max_rx_queues,
        max_tx_queues: i.max_tx_queues,
        mtu_range: (i.min_mtu, max_mtu),
        rx_offload_capa: i.rx_offload_capa,
        tx_offload_capa: i.tx_offload_capa,
        rss_offloads: i.flow_type_rss_offloads,
        mac: mac.addr_bytes,
    })
}

/// Configures and starts a port.
#[derive(Debug)]
pub struct PortBuilder {
    eal: Eal,
    port: u16,
    queues: u16,
    rx_desc: u16,
    tx_desc: u16,
    mtu: u16,
    rx_pool: Option<Mempool>,
    keep: Vec<Mempool>,
    promiscuous: bool,
    tx_checksums: bool,
}

struct Inner {
    info: PortInfo,
    mtu: u16,
    queues: u16,
    offloads: Offloads,
    desc: (u16, u16),
    /// Flows created (destroyed by rte_flow_flush at close).
    flows: AtomicUsize,
    // Dropped after the port is closed (Drop of Inner runs first): the
    // driver may hold their mbufs until then.
    _pools: Vec<Mempool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let id = self.info.id;
        if self.flows.load(Ordering::Relaxed) > 0 {
            let mut err = sys::rte_flow_error::default();
            // SAFETY: valid port; no queue handle is left (we are the last
            // owner), so nothing polls it.
            unsafe { sys::rte_flow_flush(id, &mut err) };
        }
        // SAFETY: as above.
        let rc = unsafe { sys::rte_eth_dev_stop(id) };
        if rc != 0 {
            log::warn!("port {id}: stop failed: {}", Error::call("rte_eth_dev_stop", rc));
        }
        // SAFETY: stopped; nothing uses the port any more.
        let rc = unsafe { sys::rte_eth_dev_close(id) };
        if rc != 0 {
            log::warn!(
                "port {id}: close failed: {}",
                Error::call("rte_eth_dev_close", rc)
            );
        }
        log::info!("port {id} ({}) stopped and closed", self.info.name);
    }
}

/// A started port. Stopped and closed when it and all its queues are
/// dropped.
#[derive(Clone)]
pub struct Port(Arc<Inner>);

impl std::fmt::Debug for Port {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Port")
            .field("info", &self.0.info)
            .field("mtu", &self.0.mtu)
            .field("offloads", &self.0.offloads)
            .finish()
    }
}

/// One RX queue of a started port; owned by one lcore.
pub struct RxQueue {
    port: Arc<Inner>,
    queue: u16,
}

/// One TX queue of a started port; owned by one lcore.
pub struct TxQueue {
    port: Arc<Inner>,
    queue: u16,
}

impl std::fmt::Debug for RxQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RxQueue(port {}, queue {})", self.port.info.id, self.queue)
    }
}

impl std::fmt::Debug for TxQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TxQueue(port {}, queue {})", self.port.info.id, self.queue)
    }
}

/// Ethernet + VLAN + CRC around an MTU.
const FRAME_OVERHEAD: u32 = 14 + 4 + 4;

impl PortBuilder {
    /// Starts describing port `port`: one queue pair, 1024 descriptors each
    /// way, MTU 1500.
    pub fn new(eal: Eal, port: u16) -> PortBuilder {
        PortBuilder {
            eal,
            port,
            queues: 1,
            rx_desc: 1024,
            tx_desc: 1024,
            mtu: 1500,
            rx_pool: None,
            keep: Vec::new(),
            promiscuous: false,
            tx_checksums: false,
        }
    }

    /// RX/TX queue pairs.
    pub fn queues(mut self, n: u16) -> PortBuilder {
        self.queues = n;
        self
    }

    /// Descriptors per RX and TX queue (clamped to what the device takes).
    pub fn descriptors(mut self, rx: u16, tx: u16) -> PortBuilder {
        self.rx_desc = rx;
        self.tx_desc = tx;
        self
    }

    /// The MTU to ask for (up to jumbo; clamped to the device's maximum).
    pub fn mtu(mut self, mtu: u16) -> PortBuilder {
        self.mtu = mtu;
        self
    }

    /// The pool RX queues fill their descriptors from (required).
    pub fn rx_pool(mut self, pool: Mempool) -> PortBuilder {
        self.rx_pool = Some(pool);
        self
    }

    /// Keeps `pool` alive until the port is closed (pools of mbufs that
    /// are sent on it).
    pub fn keep_pool(mut self, pool: Mempool) -> PortBuilder {
        self.keep.push(pool);
        self
    }

    /// Receives frames for any MAC address.
    pub fn promiscuous(mut self, on: bool) -> PortBuilder {
        self.promiscuous = on;
        self
    }

    /// Enables the device's IPv4 and UDP TX checksum offloads where it has
    /// both ([`Offloads::tx_checksums`] says whether it did).
    pub fn tx_checksums(mut self, on: bool) -> PortBuilder {
        self.tx_checksums = on;
        self
    }

    /// Configures, sets up the queues and starts the port. The queue
    /// handles come back once, in queue order.
    pub fn build(self) -> Result<(Port, Vec<RxQueue>, Vec<TxQueue>)> {
        let id = self.port;
        let info = info(self.eal, id)?;
        let pool = self
            .rx_pool
            .clone()
            .ok_or_else(|| Error::Invalid(format!("port {id}: no RX pool given")))?;
        let q = self.queues;
        if q == 0 || q > info.max_rx_queues || q > info.max_tx_queues {
            return Err(Error::Invalid(format!(
                "port {id} ({}): {q} queue pairs asked; the device has 1..={} RX and 1..={} TX queues",
                info.name, info.max_rx_queues, info.max_tx_queues
            )));
        }
        let (min_mtu, max_mtu) = info.mtu_range;
        let mut mtu = self.mtu.max(min_mtu);
        if max_mtu != 0 && mtu > max_mtu {
            log::warn!(
                "port {id} ({}): MTU {mtu} asked, the device takes at most {max_mtu}: configuring {max_mtu} (a virtual device may still pass larger frames)",
                info.name
            );
            mtu = max_mtu;
        }
        // SAFETY: plain getters of bit values.
        let (rx_ip, rx_udp, rx_scatter, tx_segs, rss_ip_udp) = unsafe {
            (
                sys::phub_rx_offload_ipv4_cksum(),
                sys::phub_rx_offload_udp_cksum(),
                sys::phub_rx_offload_scatter(),
                sys::phub_tx_offload_multi_segs(),
                sys::phub_rss_ip_udp(),
            )
        };
        // SAFETY: as above.
        let tx_cksums = unsafe { sys::phub_tx_offload_ipv4_cksum() | sys::phub_tx_offload_udp_cksum() };
        let room = u32::from(pool.data_room()).saturating_sub(u32::from(crate::PKTMBUF_HEADROOM));
        let need_scatter = room < u32::from(mtu) + FRAME_OVERHEAD;
        if need_scatter && info.rx_offload_capa & rx_scatter == 0 {
            return Err(Error::Invalid(format!(
                "port {id} ({}): MTU {mtu} frames need {} bytes per RX mbuf, the pool has {room} and the device cannot scatter: use larger mbufs or a smaller MTU",
                info.name,
                u32::from(mtu) + FRAME_OVERHEAD
            )));
        }
        let offloads = Offloads {
            rx_ipv4_cksum: info.rx_offload_capa & rx_ip != 0,
            rx_udp_cksum: info.rx_offload_capa & rx_udp != 0,
            rx_scatter: need_scatter,
            tx_multi_segs: info.tx_offload_capa & tx_segs != 0,
            tx_checksums: self.tx_checksums && info.tx_offload_capa & tx_cksums == tx_cksums,
            rss: q > 1 && info.rss_offloads & rss_ip_udp != 0,
        };
        let rx_offloads = (if offloads.rx_ipv4_cksum { rx_ip } else { 0 })
            | (if offloads.rx_udp_cksum { rx_udp } else { 0 })
            | (if offloads.rx_scatter { rx_scatter } else { 0 });
        // Never MBUF_FAST_FREE: it lets the driver put mbufs straight back
        // in their pool without looking at the refcount, and the frames
        // sent here share segments (Mbuf::chain_shared).
        let tx_offloads = (if offloads.tx_multi_segs { tx_segs } else { 0 })
            | (if offloads.tx_checksums { tx_cksums } else { 0 });

        let mut conf = sys::rte_eth_conf::default();
        conf.rxmode.mtu = u32::from(mtu);
        conf.rxmode.offloads = rx_offloads;
        conf.txmode.offloads = tx_offloads;
        if offloads.rss {
            conf.rxmode.mq_mode = sys::RTE_ETH_MQ_RX_RSS;
            conf.rx_adv_conf.rss_conf.rss_hf = info.rss_offloads & rss_ip_udp;
        }
        // SAFETY: valid port, conf fully initialised (zeroed + set fields).
        let rc = unsafe { sys::rte_eth_dev_configure(id, q, q, &conf) };
        if rc != 0 {
            return Err(Error::call(
                format!("rte_eth_dev_configure(port {id}, {q} queues, MTU {mtu})"),
                rc,
            ));
        }
        let (mut nrx, mut ntx) = (self.rx_desc, self.tx_desc);
        // SAFETY: configured port; out pointers valid.
        let rc = unsafe { sys::rte_eth_dev_adjust_nb_rx_tx_desc(id, &mut nrx, &mut ntx) };
        if rc != 0 {
            return Err(Error::call(
                format!("rte_eth_dev_adjust_nb_rx_tx_desc(port {id})"),
                rc,
            ));
        }
        if (nrx, ntx) != (self.rx_desc, self.tx_desc) {
            log::info!(
                "port {id}: descriptors clamped to the device: RX {} -> {nrx}, TX {} -> {ntx}",
                self.rx_desc,
                self.tx_desc
            );
        }
        let dinfo = dev_info(id)?;
        let socket = info.socket.unwrap_or(sys::SOCKET_ID_ANY.cast_unsigned());
        for qi in 0..q {
            let mut rxconf = dinfo.default_rxconf;
            rxconf.offloads = rx_offloads;
            // SAFETY: configured port, queue below the configured count,
            // the pool is live and kept alive by the port (Inner._pools).
            let rc = unsafe { sys::rte_eth_rx_queue_setup(id, qi, nrx, socket, &rxconf, pool.as_ptr()) };
            if rc != 0 {
                return Err(Error::call(
                    format!("rte_eth_rx_queue_setup(port {id}, queue {qi}, {nrx} descriptors)"),
                    rc,
                ));
            }
            let mut txconf = dinfo.default_txconf;
            txconf.offloads = tx_offloads;
            // SAFETY: as above.
            let rc = unsafe { sys::rte_eth_tx_queue_setup(id, qi, ntx, socket, &txconf) };
            if rc != 0 {
                return Err(Error::call(
                    format!("rte_eth_tx_queue_setup(port {id}, queue {qi}, {ntx} descriptors)"),
                    rc,
                ));
            }
        }
        // SAFETY: configured port with all queues set up.
        let rc = unsafe { sys::rte_eth_dev_start(id) };
        if rc != 0 {
            return Err(Error::call(format!("rte_eth_dev_start(port {id})"), rc));
        }
        if self.promiscuous {
            // SAFETY: started port. Not every device can; that is fine.
            let rc = unsafe { sys::rte_eth_promiscuous_enable(id) };
            if rc != 0 {
                log::info!(
                    "port {id}: promiscuous mode not available ({})",
                    crate::error::strerror(-rc)
                );
            }
        }
        let mut pools = vec![pool];
        pools.extend(self.keep);
        let inner = Arc::new(Inner {
            info: info.clone(),
            mtu,
            queues: q,
            offloads,
            desc: (nrx, ntx),
            flows: AtomicUsize::new(0),
            _pools: pools,
        });
        log::info!(
            "port {id} ({}, driver {}) started: {q} queue pair(s), {nrx}/{ntx} descriptors, MTU {mtu}, {offloads:?}, socket {:?}",
            info.name,
            info.driver,
            info.socket
        );
        let rx = (0..q)
            .map(|queue| RxQueue {
                port: Arc::clone(&inner),
                queue,
            })
            .collect();
        let tx = (0..q)
            .map(|queue| TxQueue {
                port: Arc::clone(&inner),
                queue,
            })
            .collect();
        Ok((Port(inner), rx, tx))
    }
}

impl Port {
    /// What the device is.
    pub fn info(&self) -> &PortInfo {
        &self.0.info
    }

    /// Port id.
    pub fn id(&self) -> u16 {
        self.0.info.id
    }

    /// The MTU in force.
    pub fn mtu(&self) -> u16 {
        self.0.mtu
    }

    /// Queue pairs.
    pub fn queues(&self) -> u16 {
        self.0.queues
    }

    /// RX and TX descriptors per queue, as clamped.
    pub fn descriptors(&self) -> (u16, u16) {
        self.0.desc
    }

    /// The offloads enabled.
    pub fn offloads(&self) -> Offloads {
        self.0.offloads
    }

    /// The port's counters now.
    pub fn stats(&self) -> Result<PortStats> {
        let mut s = sys::rte_eth_stats::default();
        // SAFETY: started port; s is a valid out structure. Reading stats
        // from another thread than the lcores is what DPDK apps do.
        let rc = unsafe { sys::rte_eth_stats_get(self.id(), &mut s) };
        if rc != 0 {
            return Err(Error::call(format!("rte_eth_stats_get(port {})", self.id()), rc));
        }
        Ok(PortStats {
            ipackets: s.ipackets,
            opackets: s.opackets,
            ibytes: s.ibytes,
            obytes: s.obytes,
            imissed: s.imissed,
            ierrors: s.ierrors,
            oerrors: s.oerrors,
            rx_nombuf: s.rx_nombuf,
        })
    }

    /// Steers UDP datagrams for destination port `udp_port` to RX queue
    /// `queue` with an rte_flow rule. Fails (with the driver's reason) where
    /// the device has no such flow support; nothing is changed then.
    pub fn steer_udp_dst(&self, udp_port: u16, queue: u16) -> Result<()> {
        if queue >= self.queues() {
            return Err(Error::Invalid(format!(
                "queue {queue}: the port has {}",
                self.queues()
            )));
        }
        let mut flow: *mut sys::rte_flow = std::ptr::null_mut();
        let mut msg: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: started port; out pointers valid. The flow is owned by
        // the port and destroyed by rte_flow_flush at close.
        let rc =
            unsafe { sys::phub_flow_udp_dst_to_queue(self.id(), udp_port, queue, 0, &mut flow, &mut msg) };
        if rc != 0 {
            let why = if msg.is_null() {
                crate::error::strerror(-rc)
            } else {
                // SAFETY: drivers give static NUL-terminated messages.
                unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
            };
            return Err(Error::Call {
                what: format!(
                    "rte_flow (port {}: UDP dst {udp_port} -> queue {queue})",
                    self.id()
                ),
                code: -rc,
                reason: why,
            });
        }
        self.0.flows.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl RxQueue {
    /// Queue index.
    pub fn queue(&self) -> u16 {
        self.queue
    }

    /// Port id.
    pub fn port_id(&self) -> u16 {
        self.port.info.id
    }

    /// Receives up to `out.len()` packets into `out[..n]`; returns n. What
    /// `out` held before is dropped.
    #[inline]
    pub fn rx_burst(&mut self, out: &mut [Option<Mbuf>]) -> usize {
        for s in out.iter_mut() {
            *s = None;
        }
        let n = u16::try_from(out.len()).unwrap_or(u16::MAX);
        // SAFETY: the port is started and this handle is the only user of
        // the queue (handed out once, &mut self); `out` is an array of
        // nullable mbuf pointers (Option<Mbuf> layout), all None, into which
        // the driver writes owned references.
        unsafe {
            sys::phub_rx_burst(
                self.port.info.id,
                self.queue,
                out.as_mut_ptr().cast::<*mut sys::rte_mbuf>(),
                n,
            ) as usize
        }
    }
}

impl TxQueue {
    /// Queue index.
    pub fn queue(&self) -> u16 {
        self.queue
    }

    /// Whether the port takes chains of mbufs.
    pub fn multi_segs(&self) -> bool {
        self.port.offloads.tx_multi_segs
    }

    /// Sends as many of `pkts` as the queue takes, from the front; those
    /// sent leave `pkts` (the driver frees them once sent). Returns how
    /// many.
    #[inline]
    pub fn tx_burst(&mut self, pkts: &mut Vec<Mbuf>) -> usize {
        if pkts.is_empty() {
            return 0;
        }
        let n = u16::try_from(pkts.len()).unwrap_or(u16::MAX);
        // SAFETY: started port, queue used by this handle only; pkts' buffer
        // is an array of owned mbuf pointers (Mbuf is transparent); the
        // first `sent` move to the driver and are removed from pkts without
        // being dropped.
        unsafe {
            let sent = sys::phub_tx_burst(
                self.port.info.id,
                self.queue,
                pkts.as_mut_ptr().cast::<*mut sys::rte_mbuf>(),
                n,
            ) as usize;
            let rest = pkts.len() - sent;
            std::ptr::copy(pkts.as_ptr().add(sent), pkts.as_mut_ptr(), rest);
            pkts.set_len(rest);
            sent
        }
    }
}

/// The mbuf `ol_flags` masks and "bad" values for RX checksums, as
/// `(ip_mask, ip_bad, l4_mask, l4_bad)`: a frame the NIC found bad has
/// `flags & mask == bad`.
pub fn rx_checksum_flags() -> (u64, u64, u64, u64) {
    // SAFETY: plain getters of constants.
    unsafe {
        (
            sys::phub_rx_ip_cksum_mask(),
            sys::phub_rx_ip_cksum_bad(),
            sys::phub_rx_l4_cksum_mask(),
            sys::phub_rx_l4_cksum_bad(),
        )
    }
}
