//! Packet I/O backends. Each lcore owns one [`PacketIo`] queue; the poll
//! loop ([`crate::lcore`]) is the same for every backend, as are the engine
//! and the counters.

use std::io;
use std::time::Duration;

use crate::counters::ShardCounters;
use crate::engine::Shard;

#[cfg(feature = "dpdk")]
pub mod dpdk;
pub mod udp;

/// One RX/TX queue pair, owned by one lcore.
pub trait PacketIo: Send + 'static {
    /// A peer's address (where results go).
    type Addr: Copy + Eq + Send + 'static;

    /// Receives up to one burst, calling `f(from, datagram)` for each
    /// datagram, and returns how many there were. When nothing is waiting,
    /// waits up to `wait` for something to arrive (`None`: return at once).
    fn rx_burst(&mut self, wait: Option<Duration>, f: &mut dyn FnMut(Self::Addr, &[u8]))
        -> io::Result<usize>;

    /// Sends everything `shard` has queued, each payload once per
    /// destination without copying it per destination, and counts what left
    /// in `counters`. The caller clears the shard's transmits afterwards.
    fn tx_burst(&mut self, shard: &Shard<Self::Addr>, counters: &ShardCounters) -> io::Result<()>;
}
