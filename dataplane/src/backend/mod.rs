//! Packet I/O backends. Each lcore owns one [`PacketIo`] queue; the poll
//! loop ([`crate::lcore`]) is the same for every backend, as are the engine
//! and the counters. A backend receives datagrams and sends
//! [`Transmit`]s; it knows nothing of the engine.

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use phub_proto::api::{LcoreInfo, PortStats};

use crate::config::BackendKind;
use phub_engine::counters::ShardCounters;
use phub_engine::slotmem::SlotAllocator;
use phub_engine::transmit::{Destinations, Transmit};

#[cfg(feature = "dpdk")]
pub mod dpdk;
pub mod udp;

/// One RX/TX queue pair, owned by one lcore.
pub trait PacketIo: Send + 'static {
    /// A peer's address (where results go).
    type Addr: Copy + Eq + Send + 'static;

    /// How this queue reaches other appliances' lcores (a hierarchical
    /// job's peers), if it can reach other appliances at all.
    fn peer_resolver(&self) -> Option<phub_engine::transmit::PeerResolver<Self::Addr>> {
        None
    }

    /// The queue's receive buffer in bytes as its kernel charges it, where
    /// there is one to overflow (a kernel socket's `SO_RCVBUF`); results
    /// state each job's share of it (PROTOCOL.md §6.1).
    fn stated_rx_buffer(&self) -> Option<u64> {
        None
    }

    /// Receives up to one burst, calling `f(from, datagram)` for each
    /// datagram, and returns how many there were. When nothing is waiting,
    /// waits up to `wait` for something to arrive (`None`: return at once).
    fn rx_burst(&mut self, wait: Option<Duration>, f: &mut dyn FnMut(Self::Addr, &[u8]))
        -> io::Result<usize>;

    /// Sends every transmit to each of its destinations, without copying
    /// a payload per destination, and counts what left in `counters`.
    fn tx_burst<'a, D>(
        &mut self,
        transmits: impl Iterator<Item = Transmit<'a, D>>,
        counters: &ShardCounters,
    ) -> io::Result<()>
    where
        D: Destinations<Item = Self::Addr>;
}

/// An lcore's work once its queue is ready: the poll loop over the queue
/// (the appliance makes it; the backend runs it where it belongs).
pub type LcoreJob = Box<dyn FnOnce() -> io::Result<()> + Send + 'static>;

/// One lcore's queue as a backend set it up, for the appliance to make
/// its [`LcoreJob`] from.
pub struct LcoreStart<Io> {
    /// Lcore index.
    pub lcore: u16,
    /// Its queue.
    pub io: Io,
    /// Its counters, which the queue already counts into.
    pub counters: Arc<ShardCounters>,
    /// Where its slot memory comes from.
    pub slot_memory: Arc<dyn SlotAllocator>,
}

/// Makes the job of each lcore a backend starts.
pub type MakeJob<'a, Io> = &'a mut dyn FnMut(LcoreStart<Io>) -> LcoreJob;

/// What a started backend hands to the appliance.
pub struct Started {
    /// Which backend it is.
    pub backend: BackendKind,
    /// UDP port of lcore 0 (lcore i is on the next ports).
    pub base_port: u16,
    /// The lcores, as `/v1/info` shows them.
    pub lcores: Vec<LcoreInfo>,
    /// Per lcore, its thread when it runs on one of ours (the kernel-UDP
    /// backend's); `None` where the backend runs it (DPDK's EAL lcores).
    pub threads: Vec<Option<JoinHandle<io::Result<()>>>>,
    /// The NIC's NUMA node, when the backend knows it.
    pub nic_numa_node: Option<u32>,
    /// Where slot memory comes from.
    pub slot_memory: Arc<dyn SlotAllocator>,
    /// The slot-memory budget that holds for it (the asked one, or less
    /// where the backend's heap is smaller).
    pub memory_budget: u64,
    /// Reads the device's own counters, where there is a device.
    pub port_stats: Option<Box<dyn Fn() -> Option<PortStats> + Send + Sync>>,
    /// Reads how many datagrams the kernel dropped at lcore i's socket
    /// (kernel-UDP backend: [`phub_engine::counters::NetDrop::SocketFull`]).
    pub socket_drops: Option<Box<dyn Fn(usize) -> Option<u64> + Send + Sync>>,
    /// Releases what the backend holds once every lcore was told to stop
    /// (DPDK: waits for its lcores, then lets the port go).
    pub release: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for Started {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Started")
            .field("backend", &self.backend)
            .field("base_port", &self.base_port)
            .field("lcores", &self.lcores)
            .finish_non_exhaustive()
    }
}
