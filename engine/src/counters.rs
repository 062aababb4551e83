//! Per-lcore counters: one writer (the lcore), any number of readers.
//!
//! The counters themselves are defined once, in the table of
//! [`phub_proto::api::LcoreStats`]; here they are held live beside the
//! drops by reason, and [`ShardCounters::snapshot`] reads them for the
//! management API.

use std::ops::Deref;

use phub_proto::api::{LcoreCounters, LcoreStats};
pub use phub_proto::counters::Counter;
use phub_proto::wire::DropReason;

/// Everything one lcore counts: the counters of the table in
/// [`phub_proto::api::LcoreStats`] (reached through `Deref`, as
/// `counters.rx_packets`), and drops by reason. Cache-line aligned so two
/// lcores' counters never share a line.
#[derive(Debug)]
#[repr(align(64))]
pub struct ShardCounters {
    /// The table's counters.
    pub lcore: LcoreCounters,
    /// Drops, indexed by [`DropReason::code`].
    pub drops: [Counter; DropReason::COUNT + 1],
    /// Frames dropped before the engine (DPDK backend), indexed by
    /// [`NetDrop`] as `usize`.
    pub net_drops: [Counter; NetDrop::ALL.len()],
}

impl Default for ShardCounters {
    fn default() -> ShardCounters {
        ShardCounters {
            lcore: LcoreCounters::default(),
            drops: std::array::from_fn(|_| Counter::default()),
            net_drops: std::array::from_fn(|_| Counter::default()),
        }
    }
}

impl Deref for ShardCounters {
    type Target = LcoreCounters;

    fn deref(&self) -> &LcoreCounters {
        &self.lcore
    }
}

macro_rules! net_drops {
    ($( $(#[$doc:meta])* $name:ident, $label:literal; )*) => {
        /// Why a frame was dropped before it reached the engine: the
        /// Ethernet, ARP, IPv4 and UDP checks of a backend that sees whole
        /// frames (DPDK), and packets it could not hand over or send. Names
        /// do not overlap [`DropReason`]'s, so both share one "drops by
        /// reason" table.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum NetDrop {
            $( $(#[$doc])* $name, )*
        }

        impl NetDrop {
            /// Every reason, in index order.
            pub const ALL: &'static [NetDrop] = &[$(NetDrop::$name),*];

            /// Stable snake_case name, used in stats and metrics.
            pub const fn name(self) -> &'static str {
                match self {
                    $( NetDrop::$name => $label, )*
                }
            }
        }
    };
}

net_drops! {
    /// Shorter than an Ethernet header, or an EtherType other than IPv4/ARP.
    NotIpv4, "not_ipv4";
    /// ARP that is not a request for the appliance's address.
    ArpNotForUs, "arp_not_for_us";
    /// IPv4 header malformed (version, header or total length).
    BadIpHeader, "bad_ip_header";
    /// IPv4 header checksum wrong.
    BadIpChecksum, "bad_ip_checksum";
    /// An IPv4 fragment (phub messages always fit one frame).
    IpFragment, "ip_fragment";
    /// IPv4 destination is not the appliance's address.
    NotOurAddress, "not_our_address";
    /// IPv4 payload other than UDP.
    NotUdp, "not_udp";
    /// UDP length field inconsistent with the IPv4 length.
    BadUdpLength, "bad_udp_length";
    /// UDP checksum wrong (as checked by the NIC, where it can).
    BadUdpChecksum, "bad_udp_checksum";
    /// UDP destination port served by no lcore of this appliance.
    WrongPort, "wrong_port";
    /// A frame spread over several buffers (larger than an RX mbuf).
    Scattered, "scattered";
    /// A packet for another lcore that could not be handed over (its ring
    /// was full).
    HandoffFull, "handoff_full";
    /// A result that could not be sent (no buffer, or the TX queue stayed
    /// full).
    TxDropped, "tx_dropped";
    /// Datagrams the kernel dropped at the lcore's socket because its
    /// receive buffer was full (kernel-UDP backend): counted by the
    /// kernel, not by the lcore, and read from the socket when stats are
    /// asked for (`SO_MEMINFO`; a 32-bit count).
    SocketFull, "socket_full";
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

    /// A snapshot of every counter, drops by reason with a non-zero count.
    pub fn snapshot(&self, lcore: u16) -> LcoreStats {
        let mut s = LcoreStats {
            lcore,
            drops: DropReason::ALL
                .iter()
                .map(|r| (r.name().to_string(), self.drops_of(*r)))
                .chain(
                    NetDrop::ALL
                        .iter()
                        .map(|r| (r.name().to_string(), self.net_drops_of(*r))),
                )
                .filter(|(_, n)| *n > 0)
                .collect(),
            ..LcoreStats::default()
        };
        self.lcore.fill(&mut s);
        s
    }
}
