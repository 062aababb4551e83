//! A worker's configuration: [`WorkerConfig`], the environment variables
//! that override it, and the window picked from the job's shape
//! ([`auto_window`]).

use std::time::Duration;

use phub_proto::fault::FaultSpec;

use crate::shm::ShmMode;
#[cfg(doc)]
use crate::{inject::INJECT_ENV, shm::SHM_ENV, stats::WorkerStats, worker::Worker};
#[cfg(doc)]
use phub_proto::api::ApplianceAddr;

/// Tuning of a [`Worker`].
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// Most chunks outstanding (sent, no result yet) across all keys; 0
    /// (the default) picks it from the job, see [`auto_window`]. Keep W
    /// workers' windows within an lcore's receive buffer.
    pub window: usize,
    /// A request fails with [`WorkerError::Timeout`] once no result at all
    /// has arrived for this long while requests are outstanding. Default 30 s.
    pub timeout: Duration,
    /// Lower bound of the retransmission timeout. Default 2 ms.
    pub min_rto: Duration,
    /// Upper bound of the retransmission timeout, also after doubling.
    /// Default 1 s.
    pub max_rto: Duration,
    /// Retransmission timeout before the first round-trip sample. Default 50 ms.
    pub initial_rto: Duration,
    /// Send same-size datagrams to one lcore as UDP GSO trains
    /// (`UDP_SEGMENT`). Default on; falls back by itself where the kernel
    /// refuses.
    pub gso: bool,
    /// Receive GRO trains (`UDP_GRO`). Default on.
    pub gro: bool,
    /// Receive and send buffer asked for the socket, bytes (forced beyond
    /// `net.core.rmem_max` where the process may). Default 32 MiB.
    pub socket_buffer: usize,
    /// Fault injection for tests and soaks: every datagram this worker
    /// sends and every one it receives is lost, duplicated or held back
    /// behind later ones at the spec's rates, drawn per datagram (GSO
    /// trains are formed after, GRO trains split before) from generators
    /// seeded with the spec's seed, the job and the rank. Counted in
    /// [`WorkerStats`]' `injected_*`. Default `None` (off: one branch on
    /// the `Option` per batch sent and per datagram received); when
    /// `None`, the environment variable [`INJECT_ENV`]
    /// (`PHUB_WORKER_INJECT=loss=0.05,dup=0.01,reorder=0.01,seed=3`) turns
    /// it on.
    pub inject: Option<FaultSpec>,
    /// Shared memory with a dataplane on this host (PROTOCOL.md §3.4):
    /// chunks and results go through `/dev/shm` regions the dataplane
    /// (started with `--shm`) created for the job, and only headers cross
    /// the socket. [`ShmMode::Auto`] (the default) uses them when every
    /// dataplane address is a loopback address and every region this rank
    /// needs opens with the expected length, datagrams otherwise;
    /// [`ShmMode::On`] fails the join when they cannot be used, naming the
    /// region and the reason; [`ShmMode::Off`] never tries. With `Auto`, the
    /// environment variable [`SHM_ENV`] (`PHUB_WORKER_SHM=off|auto|on`)
    /// decides instead when set. [`Worker::shm`] and [`WorkerStats`]' `shm`
    /// say whether the regions are in use. If the dataplane restarts and
    /// makes new regions, the worker maps them (datagrams while there are
    /// none). Only processes of the dataplane's user can open the regions
    /// (mode 0600), and their names need the job's token.
    pub shm: ShmMode,
    /// Congestion control: a loss found by fast retransmission halves the
    /// number of chunks let out at once, once per loss episode, and results
    /// of chunks sent once grow it back to the window, so that a worker
    /// whose pushes overflow a busy appliance's receive buffer sends less
    /// instead of retransmitting into the same overflow. **Off by
    /// default**: against a CPU-throttled dataplane with small receive
    /// buffers it sent 3x fewer retransmissions but made the slowest rounds
    /// slower (BENCHMARKS.md, "Loss response"). The environment variable
    /// [`CONGESTION_ENV`] (`PHUB_WORKER_CONGESTION=on|off`) overrides it.
    pub congestion: bool,
    /// The rack this worker's host is in, said at join: a hierarchical
    /// job's control checks it against the rack the rank belongs to.
    /// [`RACK_ENV`] (`PHUB_WORKER_RACK`) gives it when this is None.
    pub rack: Option<String>,
    /// While a request is in flight, the I/O thread polls its socket
    /// again without sleeping for this long after the last datagram came
    /// in, so that the next result is taken at once rather than after the
    /// thread is woken (on a VM, a halted vCPU: tens of microseconds).
    /// It costs CPU only while results are coming. **Off by default**
    /// (`Duration::ZERO`: sleep at once): on the 2-vCPU development VM,
    /// where the workers share their cores with the appliance, 200 us made
    /// ResNet-50 rounds 1.4x slower (BENCHMARKS.md, "Spinning before
    /// sleeping"); worth trying where the I/O thread has a core to itself.
    /// [`SPIN_ENV`] (`PHUB_WORKER_SPIN_US`) overrides it.
    pub spin: Duration,
}

/// The environment variable that gives [`WorkerConfig::rack`] when the
/// configuration does not.
pub const RACK_ENV: &str = "PHUB_WORKER_RACK";

/// The environment variable that turns [`WorkerConfig::congestion`] on
/// (`on`) or off (`off`) whatever the configuration says.
pub const CONGESTION_ENV: &str = "PHUB_WORKER_CONGESTION";

/// The environment variable that sets [`WorkerConfig::spin`], in
/// microseconds, whatever the configuration says.
pub const SPIN_ENV: &str = "PHUB_WORKER_SPIN_US";

impl Default for WorkerConfig {
    fn default() -> WorkerConfig {
        WorkerConfig {
            window: 0,
            timeout: Duration::from_secs(30),
            min_rto: Duration::from_millis(2),
            max_rto: Duration::from_secs(1),
            initial_rto: Duration::from_millis(50),
            gso: true,
            gro: true,
            socket_buffer: 32 << 20,
            inject: None,
            shm: ShmMode::Auto,
            congestion: false,
            rack: None,
            spin: Duration::ZERO,
        }
    }
}

/// Receive buffer assumed for each dataplane lcore's socket where the join
/// answer does not give it (an appliance or control that does not say, or
/// the DPDK backend): phub-dataplane's default `--socket-buffer` (32 MiB,
/// forced beyond rmem_max when it runs as root). Where the appliance says
/// ([`ApplianceAddr::rx_buffer_bytes`], what the kernel enforces), that
/// figure is used instead.
pub const ASSUMED_LCORE_RCVBUF: usize = 32 << 20;

/// The smallest window [`auto_window`] picks unless an appliance's stated
/// receive buffer allows fewer.
pub const MIN_AUTO_WINDOW: usize = 16;

/// Bytes in flight per lcore that [`auto_window`] aims at: about one
/// core's L2 cache, so that a chunk is still in cache when the lcore reads
/// it and when its result comes back. Far more than a rack's
/// bandwidth-delay product (100 Gb/s x 50 us = 625 kB).
pub const IN_FLIGHT_PER_LCORE: usize = 1 << 20;

/// The window [`WorkerConfig::window`] = 0 stands for, from the job's shape.
///
/// Two bounds, the smaller wins:
///
/// - **Incast**, a hard bound: every chunk a worker has outstanding may sit
///   in an lcore's receive buffer at the same time as the other W - 1
///   workers' chunks. The layout spreads chunks evenly over the job's L
///   lcores, so each lcore holds about `W * window / L` of them, and the
///   kernel charges each with its overhead (the skb's truesize: up to
///   twice the datagram on loopback, close to 1x for a GRO train; 2x is
///   assumed). Hence `window <= L * lcore_rcvbuf / (W * 2 * datagram)`,
///   `lcore_rcvbuf` the smallest receive buffer the appliances state
///   (else [`ASSUMED_LCORE_RCVBUF`]); past it, a slow appliance's buffer
///   overflows and the worker can only retransmit into it. Likewise the
///   results of the window come back to this worker's own socket: `window
///   <= own_rcvbuf / (2 * datagram)`.
/// - **Cache**, a soft bound: `window <= L * IN_FLIGHT_PER_LCORE / (W *
///   datagram)`. Past it, chunks fall out of cache between the copies of
///   their journey and every copy goes to DRAM: on the 2-core development
///   VM, ResNet-50 with W = 2 cost the dataplane 60 ms of CPU per round
///   with a window of 64 and 92 ms with 1024 (BENCHMARKS.md).
///
/// Never more than `chunks` (the job's dense chunks; a job with tables
/// passes `usize::MAX`: a table's round may have up to 1024 messages per
/// lcore), never fewer than [`MIN_AUTO_WINDOW`]
/// (16) unless the incast bound is lower still (then that bound, at least
/// 1). For 8 KiB chunks on one lcore with 32 MiB buffers: 126 for W = 1,
/// 63 for W = 2, 16 from W = 8 on; with an appliance's 256 KiB buffer
/// (512 KiB as the kernel counts it), 14 for W = 2.
pub fn auto_window(
    workers: u32,
    lcores: usize,
    chunks: usize,
    datagram: usize,
    own_rcvbuf: usize,
    lcore_rcvbuf: usize,
) -> usize {
    let d = datagram.max(64);
    let (w, l) = (workers.max(1) as usize, lcores.max(1));
    let incast = l.saturating_mul(lcore_rcvbuf) / (w * 2 * d);
    let own = own_rcvbuf / (2 * d);
    let cache = l * IN_FLIGHT_PER_LCORE / (w * d);
    incast
        .min(own)
        .min(cache)
        .min(chunks)
        .max(MIN_AUTO_WINDOW.min(incast.max(1)))
}

#[cfg(test)]
mod tests {
    use phub_proto::wire::HEADER_LEN;

    use super::*;

    #[test]
    fn auto_window_takes_the_smallest_bound() {
        let d = HEADER_LEN + 8192;
        // Cache bound: 1 MiB per lcore over W.
        let big = ASSUMED_LCORE_RCVBUF;
        assert_eq!(auto_window(1, 1, 100_000, d, 64 << 20, big), (1 << 20) / d);
        assert_eq!(auto_window(2, 1, 100_000, d, 64 << 20, big), (1 << 20) / (2 * d));
        assert_eq!(auto_window(2, 4, 100_000, d, 64 << 20, big), (4 << 20) / (2 * d));
        // Never beyond the job's chunks, never below 16.
        assert_eq!(auto_window(1, 1, 40, d, 64 << 20, big), 40);
        assert_eq!(auto_window(64, 1, 100_000, d, 64 << 20, big), 16);
        // A small own receive buffer bounds it (an unprivileged process).
        assert_eq!(
            auto_window(1, 8, 100_000, d, 416 << 10, big),
            (416 << 10) / (2 * d)
        );
        // An appliance's small buffer bounds it below 16: W windows of
        // datagrams charged twice their size fit in it.
        let small = 512 << 10;
        let w = auto_window(2, 1, 100_000, d, 64 << 20, small);
        assert_eq!(w, small / (2 * 2 * d));
        assert!(2 * w * 2 * d <= small && w < MIN_AUTO_WINDOW);
        assert_eq!(
            auto_window(2, 4, 100_000, d, 64 << 20, small),
            4 * small / (2 * 2 * d)
        );
        // A buffer too small for one datagram each still lets one out.
        assert_eq!(auto_window(64, 1, 100_000, d, 64 << 20, 4096), 1);
    }
}
