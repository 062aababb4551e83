//! The DPDK backend: one [`DpdkQueue`] (an RX/TX queue pair of a DPDK port)
//! per lcore, driven by the same poll loop as every backend
//! ([`crate::lcore::run`]), launched on an EAL lcore.
//!
//! RX: a burst of mbufs into a preallocated batch; each frame is parsed
//! ([`frame::parse`]: Ethernet, ARP, IPv4, UDP) and its UDP payload is handed
//! to the engine as a slice over the mbuf's data, in place: gradient bytes
//! are never copied. ARP requests for the appliance's address are answered
//! in place with the port's (or a configured) MAC. A datagram for another
//! lcore's UDP port (the NIC steered it wrong, or cannot steer) is handed to
//! its owner through that lcore's hand-off ring, as an mbuf pointer, and
//! counted as `misrouted` here. Everything else is dropped and counted by
//! [`NetDrop`] reason. The burst's mbuf headers are prefetched as soon as it
//! is in, and each frame's headers a few frames ahead of its turn; handled
//! frames (and, on a ring port, the sent frames its peer hands back) are
//! freed with one bulk call per poll.
//!
//! TX: a result goes to W workers without copying the payload W times: it
//! is copied once from slot memory into a payload mbuf (so no mbuf in
//! flight ever points at slot memory the engine may overwrite), and each
//! destination gets a small header mbuf (Ethernet + IPv4 + UDP + phub
//! header, 128 bytes) whose next segment is that payload mbuf itself: one
//! reference each, taken with one refcount update, so no indirect mbuf is
//! needed (DPDK's multicast pattern: freeing a frame frees a reference to
//! each of its segments, and the payload goes back to its pool with the
//! last, whoever frees it). Every frame carries a UDP checksum: the
//! payload is summed as it is copied, and the headers and checksum shares
//! all destinations have in common are worked out once per result
//! ([`frame::ResultHeaders`]); each destination adds only its MAC, address
//! and port. Header and payload mbufs come from their pools 32 at a time
//! (one bulk call resets them together, so their cache misses overlap: more
//! than a quarter of the lcore's time went to single allocations over a
//! ring port at 1 KiB). Devices that cannot send chains get one copied
//! frame per destination. Frames are queued and sent in bursts; what the queue does
//! not take is retried on every poll and dropped (counted) if the queue
//! stays full for [`TX_STALL`].
//!
//! Slot memory ([`DpdkSlotMemory`]) comes from DPDK's heap on the port's
//! NUMA socket: hugepages when the EAL has them, the `-m` area with
//! `--no-huge`.
//!
//! Idle backoff (an option, for tests and small machines): after a run of
//! empty polls the lcore pauses, then sleeps briefly between polls. Off, the
//! lcore spins and owns its core, as on an appliance.

pub mod frame;
pub mod start;

use std::io;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use phub_ffi::mbuf::Shares;
use phub_ffi::{mbuf, Eal, HeapSlice, Mbuf, Mempool, Ring, RxQueue, TxQueue};
use phub_proto::wire::HEADER_LEN;

pub use frame::PeerAddr;
use frame::{Frame, ParseOptions, ETH_LEN, IPV4_LEN, L2_L4_LEN, UDP_LEN};

use super::PacketIo;
use phub_engine::counters::{NetDrop, ShardCounters};
use phub_engine::slotmem::{SlotAllocator, SlotBlock, LINE_BYTES};
use phub_engine::transmit::{Destinations, Transmit};

/// Frames per RX burst.
pub const RX_BURST: usize = 32;
/// Frames sent per TX burst call (a flush also happens at the end of each
/// `tx_burst`).
pub const TX_BURST: usize = 32;
/// Most frames waiting for the TX queue; beyond this, results are dropped.
pub const TX_PENDING_MAX: usize = 4096;
/// How long frames may wait for a full TX queue before they are dropped.
pub const TX_STALL: Duration = Duration::from_millis(100);
/// Slots in each lcore's hand-off ring.
pub const HANDOFF_RING: u32 = 1024;
/// Empty polls before the idle backoff sleeps (it pauses before that).
const BACKOFF_SPINS: u32 = 1000;
/// Longest sleep of the idle backoff.
const BACKOFF_SLEEP: Duration = Duration::from_micros(200);
/// Bytes of a header mbuf's frame: Ethernet + IPv4 + UDP + phub header.
pub const FRAME_HEADER: usize = L2_L4_LEN + HEADER_LEN;
const _: () = assert!(FRAME_HEADER == 128);

/// How many frames ahead of the one handled a burst's headers are
/// prefetched.
const PREFETCH: usize = 4;
/// Mbufs taken from a pool per bulk allocation for results.
const STASH: usize = 32;

/// Fresh mbufs from one pool, taken [`STASH`] at a time.
struct Stash {
    pool: Mempool,
    bulk: Vec<Option<Mbuf>>,
    next: usize,
}

impl Stash {
    fn new(pool: Mempool) -> Stash {
        Stash {
            pool,
            bulk: (0..STASH).map(|_| None).collect(),
            next: STASH,
        }
    }

    /// A fresh mbuf; `None` when the pool has none left.
    fn take(&mut self) -> Option<Mbuf> {
        if self.next == STASH {
            if !self.pool.alloc_bulk(&mut self.bulk) {
                return self.pool.alloc();
            }
            self.next = 0;
        }
        self.next += 1;
        self.bulk[self.next - 1].take()
    }
}

/// Who the appliance is on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// Its IPv4 address.
    pub ip: Ipv4Addr,
    /// The MAC it answers ARP with and sends from.
    pub mac: [u8; 6],
    /// UDP port of lcore 0; lcore i serves base + i.
    pub base_port: u16,
}

/// The pools results are built from, shared by all lcores.
#[derive(Debug, Clone)]
pub struct TxPools {
    /// Header mbufs (at least [`FRAME_HEADER`] bytes of data room).
    pub header: Mempool,
    /// Payload mbufs: the one copy of a result every destination's frame
    /// ends in (or a whole frame each, for devices without chains).
    pub payload: Mempool,
}

impl TxPools {
    /// Creates the two pools: `n` header mbufs, `n / 4` payload ones, on
    /// NUMA `socket`.
    pub fn create(eal: Eal, n: u32, socket: Option<u32>) -> phub_ffi::Result<TxPools> {
        let head = phub_ffi::PKTMBUF_HEADROOM;
        Ok(TxPools {
            header: Mempool::pktmbuf(eal, "txhdr", n, 256, 256 + head, socket)?,
            payload: Mempool::pktmbuf(eal, "txpay", (n / 4).max(512), 128, 9216 + head, socket)?,
        })
    }
}

/// Slot memory from DPDK's heap (`rte_zmalloc_socket`) on one NUMA socket.
#[derive(Debug, Clone, Copy)]
pub struct DpdkSlotMemory {
    eal: Eal,
    socket: Option<u32>,
    hugepages: bool,
}

impl DpdkSlotMemory {
    /// Slot memory on `socket`: the port's (`rte_eth_dev_socket_id`), or
    /// `None` when that is unknown: any socket then, the allocating lcore's
    /// own first.
    pub fn new(eal: Eal, socket: Option<u32>) -> DpdkSlotMemory {
        DpdkSlotMemory {
            eal,
            socket,
            hugepages: eal.has_hugepages(),
        }
    }

    /// The socket asked for.
    pub fn socket(&self) -> Option<u32> {
        self.socket
    }

    /// What of the heap slot memory can use, in bytes, when that is fixed:
    /// with `--no-huge` the heap is the `-m` area and nothing grows it, so
    /// this is what is free in it now (`None` with hugepages, whose heap
    /// grows on demand, or when the heap cannot be read).
    pub fn fixed_heap_free(&self) -> Option<u64> {
        if self.hugepages {
            return None;
        }
        let socket = self.socket.unwrap_or(0);
        phub_ffi::malloc::heap_stats(self.eal, socket)
            .ok()
            .map(|s| s.free_bytes)
    }
}

/// A block of slot memory on DPDK's heap (the engine's [`SlotBlock`] over
/// phub-ffi's [`HeapSlice`]).
#[derive(Debug)]
struct DpdkBlock(HeapSlice<f32>);

impl SlotBlock for DpdkBlock {
    fn as_slice(&self) -> &[f32] {
        self.0.as_slice()
    }
    fn as_mut_slice(&mut self) -> &mut [f32] {
        self.0.as_mut_slice()
    }
}

impl SlotAllocator for DpdkSlotMemory {
    fn zeroed(&self, len: usize) -> Result<Box<dyn SlotBlock>, String> {
        HeapSlice::<f32>::zeroed(self.eal, len, LINE_BYTES, self.socket)
            .map(|s| Box::new(DpdkBlock(s)) as Box<dyn SlotBlock>)
            .map_err(|e| e.to_string())
    }

    fn describe(&self) -> String {
        let socket = match self.socket {
            Some(s) => format!("socket {s}"),
            None => "any socket (the port's is unknown; each lcore's own first)".into(),
        };
        format!(
            "DPDK heap, {socket}, hugepages: {}",
            if self.hugepages { "yes" } else { "no" }
        )
    }
}

/// Creates one hand-off ring per lcore.
pub fn handoff_rings(eal: Eal, lcores: usize, socket: Option<u32>) -> phub_ffi::Result<Vec<Ring>> {
    (0..lcores)
        .map(|_| Ring::create(eal, "handoff", HANDOFF_RING, socket))
        .collect()
}

/// Per-queue settings.
#[derive(Debug, Clone, Copy)]
pub struct QueueOptions {
    /// Check IPv4 header checksums in software (the NIC does not).
    pub check_ip_checksum: bool,
    /// Check UDP checksums in software (the NIC does not; see
    /// [`frame`]'s documentation for what passes unverified).
    pub check_udp_checksum: bool,
    /// Drop frames the NIC flagged with a bad IPv4 or UDP checksum.
    pub nic_checksums: bool,
    /// Send results as header + shared payload chains (the port takes
    /// multi-segment frames).
    pub chains: bool,
    /// The port fills in results' IPv4 and UDP checksums (its TX checksum
    /// offloads are on): results are copied without being summed.
    pub tx_checksums: bool,
    /// Idle backoff (pause, then short sleeps) when polls come back empty.
    pub idle_backoff: bool,
}

/// A NIC's receive-checksum verdict from an mbuf's offload flags `fl`, for
/// one checksum's `mask` and its `bad` value: `Some(false)` bad,
/// `Some(true)` good (or "not right in the packet, but the data is", which
/// DPDK flags as both bits), `None` unknown (the NIC did not check it).
fn nic_verdict(fl: u64, mask: u64, bad: u64) -> Option<bool> {
    match fl & mask {
        0 => None,
        v => Some(v != bad),
    }
}

/// Other appliances' Ethernet addresses (`--neighbor`, `--gateway-mac`):
/// how a queue reaches a hierarchical job's peers. The backend does not
/// resolve addresses by ARP.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Neighbors {
    /// Appliances on this port's segment: IPv4 address and MAC.
    pub table: Vec<(Ipv4Addr, [u8; 6])>,
    /// The next hop for any other address.
    pub gateway: Option<[u8; 6]>,
}

impl Neighbors {
    /// Where frames for `ip` go: its own MAC, or the gateway's.
    pub fn mac_of(&self, ip: Ipv4Addr) -> Option<[u8; 6]> {
        self.table
            .iter()
            .find(|(a, _)| *a == ip)
            .map(|(_, m)| *m)
            .or(self.gateway)
    }
}

/// One lcore's RX/TX queue pair on a DPDK port.
pub struct DpdkQueue {
    lcore: u16,
    rx: RxQueue,
    tx: TxQueue,
    me: Identity,
    parse: ParseOptions,
    opts: QueueOptions,
    handoff_in: Ring,
    /// Frames the device has sent, handed back to be freed here (a ring
    /// port's peer doing what a NIC's TX completions do).
    completions: Option<Ring>,
    handoff_out: Arc<[Ring]>,
    pools: TxPools,
    counters: Arc<ShardCounters>,
    batch: Vec<Option<Mbuf>>,
    /// Header mbufs taken from their pool [`STASH`] at a time (one bulk
    /// call resets them together, overlapping their cache misses).
    headers: Stash,
    /// Payload mbufs for the one copy of each result, likewise.
    payloads: Stash,
    /// Received (and completed) frames done with in this poll, freed
    /// together by one bulk call at its end.
    rx_done: Vec<Mbuf>,
    tx_pending: Vec<Mbuf>,
    stuck_since: Option<Instant>,
    empty_polls: u32,
    ol_masks: OlMasks,
    neighbors: Arc<Neighbors>,
}

impl std::fmt::Debug for DpdkQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DpdkQueue")
            .field("lcore", &self.lcore)
            .field("rx", &self.rx)
            .field("tx", &self.tx)
            .field("me", &self.me)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy)]
struct OlMasks {
    ip_mask: u64,
    ip_bad: u64,
    l4_mask: u64,
    l4_bad: u64,
}

impl DpdkQueue {
    /// A queue for `lcore`, whose hand-off ring is `handoff[lcore]`;
    /// `counters` are its shard's.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        lcore: u16,
        rx: RxQueue,
        tx: TxQueue,
        me: Identity,
        handoff: Arc<[Ring]>,
        pools: TxPools,
        counters: Arc<ShardCounters>,
        opts: QueueOptions,
    ) -> DpdkQueue {
        let (ip_mask, ip_bad, l4_mask, l4_bad) = phub_ffi::port::rx_checksum_flags();
        let (headers, payloads) = (
            Stash::new(pools.header.clone()),
            Stash::new(pools.payload.clone()),
        );
        DpdkQueue {
            lcore,
            rx,
            tx,
            me,
            parse: ParseOptions {
                ip: me.ip,
                check_ip_checksum: opts.check_ip_checksum,
                check_udp_checksum: opts.check_udp_checksum,
            },
            opts,
            handoff_in: handoff[usize::from(lcore)].clone(),
            completions: None,
            handoff_out: handoff,
            pools,
            counters,
            batch: (0..RX_BURST).map(|_| None).collect(),
            headers,
            payloads,
            rx_done: Vec::with_capacity(2 * RX_BURST),
            tx_pending: Vec::with_capacity(TX_PENDING_MAX),
            stuck_since: None,
            empty_polls: 0,
            ol_masks: OlMasks {
                ip_mask,
                ip_bad,
                l4_mask,
                l4_bad,
            },
            neighbors: Arc::default(),
        }
    }

    /// Reaches other appliances (a hierarchical job's peers) at the
    /// Ethernet addresses `neighbors` gives.
    pub fn with_neighbors(mut self, neighbors: Arc<Neighbors>) -> DpdkQueue {
        self.neighbors = neighbors;
        self
    }

    /// Frees, on this lcore, the frames its peer hands back through `ring`
    /// once sent (a ring port's completion ring): the mbufs then return to
    /// this lcore's mempool caches, as with a NIC's TX completions, instead
    /// of the peer's.
    pub fn with_completions(mut self, ring: Ring) -> DpdkQueue {
        self.completions = Some(ring);
        self
    }

    /// Handles one received frame (from the hand-off ring when
    /// `handed_over`).
    fn process(&mut self, m: Mbuf, handed_over: bool, f: &mut dyn FnMut(PeerAddr, &[u8])) {
        if m.nb_segs() != 1 {
            self.counters.count_net_drop(NetDrop::Scattered);
            return;
        }
        match frame::parse(m.data(), &self.parse) {
            Ok(Frame::Udp {
                from,
                dst_port,
                payload,
            }) => {
                if self.opts.nic_checksums {
                    // The NIC's verdict; where it has none for a checksum
                    // parse left to it, the check is done here.
                    let fl = m.ol_flags();
                    let o = self.ol_masks;
                    let ip_ok = nic_verdict(fl, o.ip_mask, o.ip_bad).unwrap_or_else(|| {
                        self.parse.check_ip_checksum || frame::ip_checksum_verifies(m.data())
                    });
                    if !ip_ok {
                        self.counters.count_net_drop(NetDrop::BadIpChecksum);
                        return;
                    }
                    let udp_ok = nic_verdict(fl, o.l4_mask, o.l4_bad).unwrap_or_else(|| {
                        self.parse.check_udp_checksum || frame::udp_checksum_verifies(m.data(), &payload)
                    });
                    if !udp_ok {
                        self.counters.count_net_drop(NetDrop::BadUdpChecksum);
                        return;
                    }
                }
                let owner = usize::from(dst_port.wrapping_sub(self.me.base_port));
                if owner == usize::from(self.lcore) {
                    f(from, &m.data()[payload]);
                    self.rx_done.push(m);
                } else if owner < self.handoff_out.len() && !handed_over {
                    self.counters.misrouted.inc();
                    if let Err(m) = self.handoff_out[owner].enqueue(m) {
                        self.counters.count_net_drop(NetDrop::HandoffFull);
                        drop(m);
                    }
                } else {
                    self.counters.count_net_drop(NetDrop::WrongPort);
                }
            }
            Ok(Frame::ArpRequest) => {
                let mut m = m;
                match m.data_mut() {
                    Some(d) => {
                        frame::arp_reply_in_place(d, self.me.mac, self.me.ip);
                        self.counters.arp_replies.inc();
                        self.queue_tx(m);
                    }
                    // A frame shared with another reference cannot be
                    // rewritten: no reply goes out.
                    None => self.counters.count_net_drop(NetDrop::TxDropped),
                }
            }
            Err(r) => self.counters.count_net_drop(r),
        }
    }

    fn queue_tx(&mut self, m: Mbuf) {
        if self.tx_pending.len() >= TX_PENDING_MAX {
            self.counters.count_net_drop(NetDrop::TxDropped);
            return;
        }
        self.tx_pending.push(m);
        if self.tx_pending.len() >= TX_BURST {
            self.flush();
        }
    }

    /// Sends what is pending; what the queue does not take waits for the
    /// next poll, and is dropped once the queue has been full for
    /// [`TX_STALL`].
    fn flush(&mut self) {
        while !self.tx_pending.is_empty() {
            if self.tx.tx_burst(&mut self.tx_pending) == 0 {
                break;
            }
        }
        if self.tx_pending.is_empty() {
            self.stuck_since = None;
            return;
        }
        let now = Instant::now();
        match self.stuck_since {
            None => self.stuck_since = Some(now),
            Some(t) if now.duration_since(t) > TX_STALL => {
                self.counters.net_drops[NetDrop::TxDropped as usize].add(self.tx_pending.len() as u64);
                mbuf::free_bulk(&mut self.tx_pending);
                self.stuck_since = None;
            }
            Some(_) => {}
        }
    }

    /// One result frame for `to`: the 128-byte header in a header mbuf in
    /// front of `payload` (a reference to the result's one payload mbuf),
    /// or a whole copied frame. `head` holds the phub header after
    /// [`L2_L4_LEN`] bytes, which are filled in here for `to` from the
    /// result's `common` headers.
    fn result_frame(
        &mut self,
        head: &mut [u8; FRAME_HEADER],
        common: &frame::ResultHeaders,
        payload: Option<Mbuf>,
        bytes: &[u8],
        to: &PeerAddr,
    ) -> Option<Mbuf> {
        let whole = payload.is_none() && !bytes.is_empty();
        let mut h = if whole {
            self.pools.payload.alloc()?
        } else {
            self.headers.take()?
        };
        // Built on the stack and copied into the mbuf in one go, so that
        // nothing reads the mbuf's cold data line back.
        let l2: &mut [u8; L2_L4_LEN] = (&mut head[..L2_L4_LEN]).try_into().ok()?;
        common.write(l2, to);
        h.append(FRAME_HEADER)?.copy_from_slice(head);
        if common.is_offloaded() {
            // Cast: the header lengths are constants below 64.
            #[allow(clippy::cast_possible_truncation)]
            h.offload_udp_checksums(ETH_LEN as u16, IPV4_LEN as u16, UDP_LEN as u16);
        }
        if whole {
            return h.extend_from_slice(bytes).then_some(h);
        }
        match payload {
            None => Some(h),
            Some(p) => h.chain_shared(p).ok(),
        }
    }

    /// Hands a frame for this appliance's own address `to` to the lcore
    /// whose port it names, through that lcore's hand-off ring (a NIC does
    /// not send a port's frames back to it); counted as sent, or dropped
    /// as `handoff_full` / `wrong_port`.
    fn loop_back(
        &mut self,
        head: &mut [u8; FRAME_HEADER],
        common: &frame::ResultHeaders,
        bytes: &[u8],
        to: &PeerAddr,
        counters: &ShardCounters,
        len: u64,
    ) {
        let owner = usize::from(to.port.wrapping_sub(self.me.base_port));
        if owner >= self.handoff_out.len() {
            self.counters.count_net_drop(NetDrop::WrongPort);
            return;
        }
        let Some(m) = self.result_frame(head, common, None, bytes, to) else {
            self.counters.count_net_drop(NetDrop::TxDropped);
            return;
        };
        match self.handoff_out[owner].enqueue(m) {
            Ok(()) => {
                counters.tx_packets.inc();
                counters.tx_bytes.add(len);
            }
            Err(m) => {
                self.counters.count_net_drop(NetDrop::HandoffFull);
                drop(m);
            }
        }
    }

    fn backoff(&mut self, wait: Option<Duration>) {
        let Some(w) = wait else { return };
        if !self.opts.idle_backoff {
            return;
        }
        self.empty_polls = self.empty_polls.saturating_add(1);
        if self.empty_polls < BACKOFF_SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(w.min(BACKOFF_SLEEP));
        }
    }
}

impl PacketIo for DpdkQueue {
    type Addr = PeerAddr;

    fn peer_resolver(&self) -> Option<phub_engine::transmit::PeerResolver<PeerAddr>> {
        let n = Arc::clone(&self.neighbors);
        let me = self.me;
        Some(Arc::new(move |a: std::net::SocketAddrV4| {
            let ip = *a.ip();
            Some(PeerAddr {
                // This appliance itself: its frames loop back (tx_burst).
                mac: if ip == me.ip { me.mac } else { n.mac_of(ip)? },
                ip,
                port: a.port(),
            })
        }))
    }

    fn rx_burst(&mut self, wait: Option<Duration>, f: &mut dyn FnMut(PeerAddr, &[u8])) -> io::Result<usize> {
        if !self.tx_pending.is_empty() {
            self.flush();
        }
        // Frames handed back once sent, then frames handled, are freed in
        // bulk: one call per poll, not one per frame.
        if let Some(c) = &self.completions {
            loop {
                let n = c.dequeue_burst(&mut self.batch);
                self.rx_done
                    .extend(self.batch[..n].iter_mut().filter_map(Option::take));
                mbuf::free_bulk(&mut self.rx_done);
                if n < RX_BURST {
                    break;
                }
            }
        }
        let mut total = 0;
        // Packets other lcores received for us first, then our queue.
        let n = self.handoff_in.dequeue_burst(&mut self.batch);
        for i in 0..n {
            if let Some(m) = self.batch[i].take() {
                self.process(m, true, f);
            }
        }
        total += n;
        let n = self.rx.rx_burst(&mut self.batch);
        // The burst's mbufs, then each frame's headers PREFETCH frames
        // ahead of its turn, are prefetched before they are read: their
        // first touches would miss the cache (BENCHMARKS.md measures it).
        for m in self.batch[..n].iter().flatten() {
            m.prefetch_header();
        }
        for i in 0..n {
            if let Some(ahead) = self.batch[..n].get(i + PREFETCH).and_then(Option::as_ref) {
                ahead.prefetch(2);
            }
            if let Some(m) = self.batch[i].take() {
                self.process(m, false, f);
            }
        }
        total += n;
        mbuf::free_bulk(&mut self.rx_done);
        if total == 0 {
            self.backoff(wait);
        } else {
            self.empty_polls = 0;
        }
        if !self.tx_pending.is_empty() {
            self.flush();
        }
        Ok(total)
    }

    fn tx_burst<'a, D>(
        &mut self,
        transmits: impl Iterator<Item = Transmit<'a, D>>,
        counters: &ShardCounters,
    ) -> io::Result<()>
    where
        D: Destinations<Item = PeerAddr>,
    {
        for t in transmits {
            let len = HEADER_LEN + t.payload.len();
            let bytes = len as u64;
            // Copy the result out of slot memory once, summing it for the
            // UDP checksum on the way unless the port fills the checksums
            // in; every destination's header segment ends in that copy (a
            // reference each, taken at once; a destination that fault
            // injection repeats gets a copied frame).
            let offload = self.opts.tx_checksums;
            let mut sum = None;
            let mut shared = if self.opts.chains && !t.payload.is_empty() {
                let n = t.to.planned();
                let copied = self.payloads.take().and_then(|mut p| {
                    let out = p.append(t.payload.len())?;
                    if offload {
                        out.copy_from_slice(t.payload);
                    } else {
                        sum = Some(frame::copy_payload_sum(&t.header, t.payload, out));
                    }
                    p.into_shares(u16::try_from(n).ok()?).ok()
                });
                match copied {
                    Some(shares) => Some(shares),
                    None => {
                        for _ in t.to {
                            self.counters.count_net_drop(NetDrop::TxDropped);
                        }
                        continue;
                    }
                }
            } else {
                None
            };
            // What every destination's headers have in common, once (with
            // the checksum's payload part, where the lcore sums it).
            let src_port = self.me.base_port.wrapping_add(self.lcore);
            let me = self.me;
            let summed = |sum: Option<u16>| {
                let sum = sum.unwrap_or_else(|| frame::payload_sum(&t.header, t.payload));
                frame::ResultHeaders::new(me.mac, me.ip, src_port, len, sum)
            };
            let common = if offload {
                frame::ResultHeaders::offloaded(me.mac, me.ip, src_port, len)
            } else {
                summed(sum)
            };
            // Frames looped back to this appliance never reach the port:
            // their checksums are summed here (made once, if any is).
            let mut looped: Option<frame::ResultHeaders> = None;
            let mut head = [0u8; FRAME_HEADER];
            head[L2_L4_LEN..].copy_from_slice(&t.header);
            for to in t.to {
                let payload = shared.as_mut().and_then(Shares::take);
                if to.ip == self.me.ip {
                    // To this appliance (a hierarchical job's home and rack
                    // slots on one appliance): a whole frame, handed to the
                    // lcore that owns the port as if received.
                    drop(payload);
                    let soft = *looped.get_or_insert_with(|| if offload { summed(None) } else { common });
                    self.loop_back(&mut head, &soft, t.payload, &to, counters, bytes);
                    continue;
                }
                match self.result_frame(&mut head, &common, payload, t.payload, &to) {
                    Some(m) => {
                        counters.tx_packets.inc();
                        counters.tx_bytes.add(bytes);
                        self.queue_tx(m);
                    }
                    None => self.counters.count_net_drop(NetDrop::TxDropped),
                }
            }
        }
        self.flush();
        Ok(())
    }
}

impl Drop for DpdkQueue {
    fn drop(&mut self) {
        // Give what is still pending one last chance, then free it (Vec drop).
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::nic_verdict;

    #[test]
    fn the_nics_checksum_verdicts() {
        // DPDK's own values for both checksums: unknown 0, bad, good, none.
        for (mask, bad) in [phub_ffi::port::rx_checksum_flags()]
            .iter()
            .flat_map(|&(im, ib, lm, lb)| [(im, ib), (lm, lb)])
        {
            assert_eq!(nic_verdict(0, mask, bad), None, "unknown");
            assert_eq!(nic_verdict(bad, mask, bad), Some(false), "bad");
            let good = mask & !bad;
            assert_ne!(good, 0);
            assert_eq!(
                nic_verdict(good | (1 << 63), mask, bad),
                Some(true),
                "good, other flags ignored"
            );
            assert_eq!(nic_verdict(mask, mask, bad), Some(true), "none: data verified");
        }
    }
}
