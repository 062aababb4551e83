//! Per-lcore counters: one writer (the lcore), any number of readers.
//!
//! A counter is bumped with a relaxed load and store, not an atomic
//! read-modify-write: only its lcore writes it, so no update is lost and the
//! hot path pays no locked instruction. Readers take relaxed snapshots.

use std::sync::atomic::{AtomicU64, Ordering};

use phub_proto::wire::DropReason;

/// One single-writer counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`. Only the owning lcore may call this.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0
            .store(self.0.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }

    /// Adds one. Only the owning lcore may call this.
    #[inline]
    pub fn inc(&self) {
        self.add(1);
    }

    /// Current value.
    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Everything one lcore counts. Cache-line aligned so two lcores' counters
/// never share a line.
#[derive(Debug, Default)]
#[repr(align(64))]
pub struct ShardCounters {
    /// Datagrams received.
    pub rx_packets: Counter,
    /// Bytes received (UDP payload).
    pub rx_bytes: Counter,
    /// Datagrams sent (one per destination).
    pub tx_packets: Counter,
    /// Bytes sent (UDP payload, per destination).
    pub tx_bytes: Counter,
    /// Contributions added to an accumulator (INIT and PUSH).
    pub pushes_aggregated: Counter,
    /// Rounds completed (optimizer runs).
    pub rounds_completed: Counter,
    /// Results queued for sending, one per destination.
    pub results_sent: Counter,
    /// Stored results sent again to a worker that lost one.
    pub results_resent: Counter,
    /// PULL requests answered.
    pub pulls_answered: Counter,
    /// ERROR messages queued.
    pub errors_sent: Counter,
    /// Messages with the SHM flag from a rank of an installed job (the
    /// token checked; their payload, if any, read from a staging region).
    pub shm_rx: Counter,
    /// Packets that reached this lcore but belong to another.
    pub misrouted: Counter,
    /// Poll-loop iterations that found work.
    pub busy_loops: Counter,
    /// Poll-loop iterations that found none.
    pub idle_loops: Counter,
    /// Drops, indexed by [`DropReason::code`].
    pub drops: [Counter; DropReason::COUNT + 1],
    /// Frames dropped before the engine (DPDK backend), indexed by
    /// [`NetDrop`] as `usize`.
    pub net_drops: [Counter; NetDrop::ALL.len()],
    /// ARP requests for the appliance's address answered (DPDK backend).
    pub arp_replies: Counter,
    /// Packets the fault injector dropped (received or sent; tests only).
    pub injected_drops: Counter,
    /// Packets the fault injector duplicated (tests only).
    pub injected_dups: Counter,
    /// Received packets the fault injector held back (tests only).
    pub injected_reorders: Counter,
    /// Received packets the fault injector delayed (tests only).
    pub injected_delays: Counter,
}

/// Why a frame was dropped before it reached the engine: the Ethernet,
/// ARP, IPv4 and UDP checks of a backend that sees whole frames (DPDK), and
/// results it could not send. Names do not overlap [`DropReason`]'s, so both
/// share one "drops by reason" table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NetDrop {
    /// Shorter than an Ethernet header, or an EtherType other than IPv4/ARP.
    NotIpv4,
    /// ARP that is not a request for the appliance's address.
    ArpNotForUs,
    /// IPv4 header malformed (version, header or total length).
    BadIpHeader,
    /// IPv4 header checksum wrong.
    BadIpChecksum,
    /// An IPv4 fragment (phub messages always fit one frame).
    IpFragment,
    /// IPv4 destination is not the appliance's address.
    NotOurAddress,
    /// IPv4 payload other than UDP.
    NotUdp,
    /// UDP length field inconsistent with the IPv4 length.
    BadUdpLength,
    /// UDP checksum wrong (as checked by the NIC, where it can).
    BadUdpChecksum,
    /// UDP destination port served by no lcore of this appliance.
    WrongPort,
    /// A frame spread over several buffers (larger than an RX mbuf).
    Scattered,
    /// A packet for another lcore that could not be handed over (its ring
    /// was full).
    HandoffFull,
    /// A result that could not be sent (no buffer, or the TX queue stayed
    /// full).
    TxDropped,
}

impl NetDrop {
    /// Every reason, in index order.
    pub const ALL: [NetDrop; 13] = [
        NetDrop::NotIpv4,
        NetDrop::ArpNotForUs,
        NetDrop::BadIpHeader,
        NetDrop::BadIpChecksum,
        NetDrop::IpFragment,
        NetDrop::NotOurAddress,
        NetDrop::NotUdp,
        NetDrop::BadUdpLength,
        NetDrop::BadUdpChecksum,
        NetDrop::WrongPort,
        NetDrop::Scattered,
        NetDrop::HandoffFull,
        NetDrop::TxDropped,
    ];

    /// Stable snake_case name, used in stats and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            NetDrop::NotIpv4 => "not_ipv4",
            NetDrop::ArpNotForUs => "arp_not_for_us",
            NetDrop::BadIpHeader => "bad_ip_header",
            NetDrop::BadIpChecksum => "bad_ip_checksum",
            NetDrop::IpFragment => "ip_fragment",
            NetDrop::NotOurAddress => "not_our_address",
            NetDrop::NotUdp => "not_udp",
            NetDrop::BadUdpLength => "bad_udp_length",
            NetDrop::BadUdpChecksum => "bad_udp_checksum",
            NetDrop::WrongPort => "wrong_port",
            NetDrop::Scattered => "scattered",
            NetDrop::HandoffFull => "handoff_full",
            NetDrop::TxDropped => "tx_dropped",
        }
    }
}

impl ShardCounters {
    /// Counts a drop under its reason.
    #[inline]
    pub fn count_drop(&self, r: DropReason) {
        // Codes are 1..=COUNT by construction (a unit test checks it).
        if let Some(c) = self.drops.get(usize::from(r.code())) {
            c.inc();
        }
    }

    /// Drops counted under `r`.
    pub fn drops_of(&self, r: DropReason) -> u64 {
        self.drops.get(usize::from(r.code())).map_or(0, Counter::get)
    }

    /// All drops.
    pub fn drops_total(&self) -> u64 {
        self.drops.iter().map(Counter::get).sum()
    }

    /// Counts a frame dropped before the engine.
    #[inline]
    pub fn count_net_drop(&self, r: NetDrop) {
        self.net_drops[r as usize].inc();
    }

    /// Frames dropped before the engine under `r`.
    pub fn net_drops_of(&self, r: NetDrop) -> u64 {
        self.net_drops[r as usize].get()
    }
}
