//! The kernel-UDP backend: one UDP socket per lcore on port base + lcore,
//! batched with `recvmmsg`/`sendmmsg`, with UDP GRO on receive and UDP GSO
//! on send.
//!
//! Receive: the socket has `UDP_GRO` on, so a train of same-size datagrams
//! from one sender (a worker's GSO send) arrives as one message with its
//! segment size in a control message. Each message gets a 64 KiB slot;
//! [`PacketIo::rx_burst`] hands the engine one datagram at a time, cutting
//! trains at their segment size, and never more than
//! [`MAX_BURST`](phub_engine::transmit::MAX_BURST) datagrams per call (what is left
//! of a `recvmmsg` batch is delivered by the next call, before any new
//! receive), so the engine's transmit queue never grows. Each slot starts
//! at offset 42 of a 64-byte aligned block, so the payload of a message's
//! first datagram (after the 86-byte header) starts 64-byte aligned, as it
//! does in an Ethernet frame on the DPDK backend; later datagrams of a train
//! follow at the segment size (the kernels read with unaligned loads).
//!
//! Send: results go out as a header iovec and a payload iovec in slot
//! memory, so W destinations share one payload and nothing is copied per
//! destination. Consecutive results to the same destination whose datagrams
//! have the same size (the last one may be shorter) go out as one GSO train
//! (`UDP_SEGMENT`, at most 64 datagrams and 65507 bytes): one trip through
//! the stack instead of one per datagram. A kernel or device that refuses
//! GSO turns it off for the queue. `PHUB_UDP_GSO=0` and `PHUB_UDP_GRO=0` in
//! the environment turn either off (to measure what they bring).
//!
//! Shared memory (`phub-dataplane --shm`, PROTOCOL.md §3.4): for workers on
//! this host the engine reads chunks from their staging regions and writes
//! results into the lcore's result region ([`phub_engine::shm`]); what crosses
//! this socket for them is headers alone. A RESULT with the SHM flag is a
//! header without payload; consecutive ones to the same destination go out
//! as GSO trains of 86-byte datagrams like any other results (ERRORs, also
//! header-only, still travel alone). The region is written before the
//! `sendmmsg` that carries the headers.
//!
//! Nothing here allocates after [`UdpQueue::bind`]: the scratch arrays have
//! fixed capacities and a batch is flushed before one would be exceeded.
//!
//! The system-call helpers (GSO control messages, GRO segment sizes, train
//! cutting, buffer sizing, the `recvmmsg`/`sendmmsg` calls) are phub-net's,
//! shared with the worker's socket.

use std::io;
use std::net::{SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use phub_net::CmsgBuf;
use phub_proto::wire::{self, flags, HEADER_LEN};

use phub_proto::api::LcoreInfo;

use super::{LcoreStart, MakeJob, PacketIo, Started};
use crate::config::{BackendKind, Config};
use crate::topology::Topology;
use phub_engine::counters::ShardCounters;
use phub_engine::slotmem::{RustHeap, SlotAllocator};
use phub_engine::transmit::{Destinations, Transmit, MAX_BURST};

/// Messages (datagrams, or GRO trains of datagrams) per `recvmmsg` call.
pub const RX_BURST: usize = 64;
/// Bytes of one receive slot: the largest UDP payload (a GRO train) fits.
const RX_SLOT: usize = 65536;
/// Receive slots are this far apart (64-byte multiple, room for the offset).
const RX_STRIDE: usize = RX_SLOT + 64;
/// Where a slot starts inside its 64-byte aligned block.
const RX_OFFSET: usize = (64 - HEADER_LEN % 64) % 64;
/// Datagrams (one per destination) per flush: headers, iovecs and
/// messages are sized for it.
const TX_DATAGRAMS: usize = 4096;

const _: () = assert!((RX_OFFSET + HEADER_LEN).is_multiple_of(64));
const _: () = assert!(RX_STRIDE.is_multiple_of(64) && RX_OFFSET + RX_SLOT <= RX_STRIDE);

/// One datagram to send in the current flush: destination, transmit.
#[derive(Clone, Copy)]
struct Out {
    /// Destination as a sort key (address and port), then the transmit.
    key: (u32, u16, u32),
    /// Index into `tx_addrs`.
    addr: u32,
}

/// A UDP queue.
pub struct UdpQueue {
    sock: UdpSocket,
    gso: bool,
    gro: bool,
    /// `RX_BURST` receive slots of `RX_SLOT` bytes, `RX_STRIDE` apart from `rx_base`.
    rx_mem: Vec<u8>,
    rx_base: usize,
    rx_addrs: Vec<libc::sockaddr_in>,
    rx_iov: Vec<libc::iovec>,
    rx_cmsg: Vec<CmsgBuf>,
    rx_hdrs: Vec<libc::mmsghdr>,
    /// Messages of the last `recvmmsg` not yet delivered: `rx_next..rx_count`,
    /// the first of them from byte `rx_pos` on.
    rx_count: usize,
    rx_next: usize,
    rx_pos: usize,
    /// Per transmit of the current flush: its header (the iovecs point here,
    /// so this never reallocates: capacity TX_DATAGRAMS, flushed when full).
    tx_headers: Vec<[u8; HEADER_LEN]>,
    /// Per transmit: its payload (pointer, length) in slot memory.
    tx_payloads: Vec<(*const u8, usize)>,
    tx_addrs: Vec<libc::sockaddr_in>,
    tx_out: Vec<Out>,
    tx_iov: Vec<libc::iovec>,
    tx_cmsg: Vec<CmsgBuf>,
    tx_hdrs: Vec<libc::mmsghdr>,
    /// Per message: datagrams in it.
    tx_segs: Vec<u32>,
}

// SAFETY: the raw pointers inside the iovec/mmsghdr scratch arrays and
// `tx_payloads` are only set and used within one call on the owning thread;
// between calls they dangle harmlessly and are rewritten before use. Moving
// the queue to its lcore thread is therefore sound.
unsafe impl Send for UdpQueue {}

impl std::fmt::Debug for UdpQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpQueue")
            .field("sock", &self.sock)
            .field("gso", &self.gso)
            .field("gro", &self.gro)
            .finish_non_exhaustive()
    }
}

fn env_off(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| matches!(v.trim(), "0" | "off" | "false" | "no"))
}

impl UdpQueue {
    /// Binds `addr` (IPv4) with large socket buffers, GRO on (unless
    /// `PHUB_UDP_GRO=0`) and GSO sends (unless `PHUB_UDP_GSO=0`).
    pub fn bind(addr: SocketAddrV4, buffer_bytes: usize) -> io::Result<UdpQueue> {
        let sock = UdpSocket::bind(addr)?;
        // Forcing works as root (CAP_NET_ADMIN) and may exceed
        // rmem_max/wmem_max; otherwise the kernel caps the plain option.
        // Failure is tolerated.
        phub_net::set_buffers(&sock, buffer_bytes);
        let gro = !env_off("PHUB_UDP_GRO") && phub_net::enable_gro(&sock);
        let gso = !env_off("PHUB_UDP_GSO");
        let rx_mem = vec![0u8; RX_BURST * RX_STRIDE + 64];
        let misalign = rx_mem.as_ptr() as usize % 64;
        let rx_base = (64 - misalign) % 64 + RX_OFFSET;
        // SAFETY: all-zero is a valid value for these plain C structs.
        let zeroed_addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let zeroed_hdr: libc::mmsghdr = unsafe { std::mem::zeroed() };
        let null_iov = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        Ok(UdpQueue {
            sock,
            gso,
            gro,
            rx_mem,
            rx_base,
            rx_addrs: vec![zeroed_addr; RX_BURST],
            rx_iov: vec![null_iov; RX_BURST],
            rx_cmsg: vec![CmsgBuf::new(); RX_BURST],
            rx_hdrs: vec![zeroed_hdr; RX_BURST],
            rx_count: 0,
            rx_next: 0,
            rx_pos: 0,
            tx_headers: Vec::with_capacity(TX_DATAGRAMS),
            tx_payloads: Vec::with_capacity(TX_DATAGRAMS),
            tx_addrs: Vec::with_capacity(TX_DATAGRAMS),
            tx_out: Vec::with_capacity(TX_DATAGRAMS),
            tx_iov: Vec::with_capacity(2 * TX_DATAGRAMS),
            tx_cmsg: vec![CmsgBuf::new(); TX_DATAGRAMS],
            tx_hdrs: vec![zeroed_hdr; TX_DATAGRAMS],
            tx_segs: Vec::with_capacity(TX_DATAGRAMS),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sock.local_addr()
    }

    /// The receive buffer as the kernel enforces it (twice what was
    /// asked, see [`phub_net::rx_buffer_bytes`]).
    pub fn rx_buffer_bytes(&self) -> io::Result<usize> {
        phub_net::rx_buffer_bytes(&self.sock)
    }

    /// A second handle on the socket, for reading its kernel counters from
    /// another thread ([`phub_net::socket_drops`]).
    pub fn counters_handle(&self) -> io::Result<UdpSocket> {
        self.sock.try_clone()
    }

    /// Whether GRO receives and GSO sends are on.
    pub fn offloads(&self) -> (bool, bool) {
        (self.gro, self.gso)
    }

    fn wait_readable(&self, wait: Duration) -> io::Result<bool> {
        let ms = libc::c_int::try_from(wait.as_millis()).unwrap_or(libc::c_int::MAX);
        phub_net::poll_readable(&self.sock, ms)
    }

    fn recv_batch(&mut self) -> io::Result<usize> {
        let base = self.rx_mem.as_mut_ptr();
        for i in 0..RX_BURST {
            self.rx_iov[i] = libc::iovec {
                // SAFETY: rx_base + i * RX_STRIDE + RX_SLOT <= rx_mem.len()
                // because rx_mem has RX_BURST * RX_STRIDE + 64 bytes,
                // rx_base < 64 + RX_OFFSET and RX_OFFSET + RX_SLOT <= RX_STRIDE.
                iov_base: unsafe { base.add(self.rx_base + i * RX_STRIDE) }.cast(),
                iov_len: RX_SLOT,
            };
            phub_net::set_rx_header(
                &mut self.rx_hdrs[i],
                &mut self.rx_addrs[i],
                &mut self.rx_iov[i],
                &mut self.rx_cmsg[i],
                self.gro,
            );
        }
        // SAFETY: set_rx_header pointed all RX_BURST headers at this queue's
        // own live buffers (sockaddr_in addresses, RX_SLOT-byte slots in
        // rx_mem, control buffers), untouched until the call returns; the
        // kernel writes at most the stated lengths into each.
        unsafe { phub_net::recv_mmsg(&self.sock, &mut self.rx_hdrs) }
    }

    /// The GRO segment size of received message `i` (0: not a train).
    fn segment(&self, i: usize) -> usize {
        self.rx_cmsg[i].gro_segment(&self.rx_hdrs[i].msg_hdr).unwrap_or(0)
    }

    /// Delivers at most `budget` datagrams of the received messages not yet
    /// delivered; returns how many.
    fn deliver(&mut self, budget: usize, f: &mut dyn FnMut(SocketAddrV4, &[u8])) -> usize {
        let mut n = 0;
        while self.rx_next < self.rx_count && n < budget {
            let i = self.rx_next;
            let len = self.rx_hdrs[i].msg_len as usize;
            let seg = match self.segment(i) {
                0 => len.max(1),
                s => s,
            };
            let from = phub_net::socket_addr_v4(&self.rx_addrs[i]);
            let start = self.rx_base + i * RX_STRIDE;
            let msg = &self.rx_mem[start..start + len];
            while self.rx_pos < len.max(1) && n < budget {
                let end = (self.rx_pos + seg).min(len);
                f(from, &msg[self.rx_pos..end]);
                self.rx_pos = end.max(self.rx_pos + 1);
                n += 1;
            }
            if self.rx_pos >= len.max(1) {
                self.rx_next += 1;
                self.rx_pos = 0;
            }
        }
        n
    }

    /// Whether transmit `t` may be part of a GSO train: a result, with its
    /// payload or (SHM flag) without; not an ERROR.
    fn trains(&self, t: usize) -> bool {
        self.tx_payloads[t].1 > 0
            || wire::Header::new_unchecked(&self.tx_headers[t][..]).flags() & flags::SHM != 0
    }

    /// Builds the messages (GSO trains where possible) for `tx_out` and
    /// sends them.
    fn flush_tx(&mut self, counters: &ShardCounters) -> io::Result<()> {
        if self.tx_out.is_empty() {
            self.clear_tx();
            return Ok(());
        }
        // Destination first, then transmit order: each destination's
        // datagrams stay in the order the engine queued them.
        self.tx_out.sort_unstable_by_key(|o| o.key);
        self.tx_iov.clear();
        self.tx_segs.clear();
        let mut m = 0;
        let mut i = 0;
        while i < self.tx_out.len() {
            let first = self.tx_out[i];
            let t0 = first.key.2 as usize;
            let seg = HEADER_LEN + self.tx_payloads[t0].1;
            // ERROR messages (no payload) always travel alone.
            let n = if self.gso && self.trains(t0) {
                phub_net::train_len(seg, |k| {
                    let o = self.tx_out.get(i + k)?;
                    let t = o.key.2 as usize;
                    ((o.key.0, o.key.1) == (first.key.0, first.key.1) && self.trains(t))
                        .then_some(HEADER_LEN + self.tx_payloads[t].1)
                })
            } else {
                1
            };
            let iov_start = self.tx_iov.len();
            for o in &self.tx_out[i..i + n] {
                let t = o.key.2 as usize;
                self.tx_iov.push(libc::iovec {
                    iov_base: self.tx_headers[t].as_ptr() as *mut libc::c_void,
                    iov_len: HEADER_LEN,
                });
                let (p, len) = self.tx_payloads[t];
                if len > 0 {
                    self.tx_iov.push(libc::iovec {
                        iov_base: p as *mut libc::c_void,
                        iov_len: len,
                    });
                }
            }
            let h = &mut self.tx_hdrs[m].msg_hdr;
            h.msg_name = (&mut self.tx_addrs[first.addr as usize] as *mut libc::sockaddr_in).cast();
            h.msg_namelen = phub_net::socklen::<libc::sockaddr_in>();
            // SAFETY: iov_start <= tx_iov.len(), which never exceeds its
            // capacity (2 per datagram, TX_DATAGRAMS datagrams), so the
            // pointer stays inside the allocation, which does not move.
            h.msg_iov = unsafe { self.tx_iov.as_mut_ptr().add(iov_start) };
            h.msg_iovlen = (self.tx_iov.len() - iov_start) as _;
            h.msg_flags = 0;
            if n > 1 {
                // Cast: seg is a header and an engine transmit's payload, at
                // most HEADER_LEN + MAX_PAYLOAD (under 9000) bytes.
                #[allow(clippy::cast_possible_truncation)]
                phub_net::set_gso_segment(h, &mut self.tx_cmsg[m], seg as u16);
            } else {
                h.msg_control = std::ptr::null_mut();
                h.msg_controllen = 0;
            }
            self.tx_hdrs[m].msg_len = 0;
            // Cast: n <= tx_out.len() <= TX_DATAGRAMS (4096).
            #[allow(clippy::cast_possible_truncation)]
            self.tx_segs.push(n as u32);
            m += 1;
            i += n;
        }
        let mut sent = 0;
        while sent < m {
            // SAFETY: tx_hdrs[sent..m] are initialised above; their name,
            // iovec and control pointers point into tx_addrs, tx_iov and
            // tx_cmsg (not resized since), and the iovecs into tx_headers
            // and the shard's slot memory, which the caller keeps borrowed
            // for the whole of tx_burst.
            match unsafe { phub_net::send_mmsg(&self.sock, &mut self.tx_hdrs[sent..m]) } {
                Ok(r) => {
                    for k in sent..sent + r {
                        counters.tx_packets.add(u64::from(self.tx_segs[k]));
                        counters.tx_bytes.add(u64::from(self.tx_hdrs[k].msg_len));
                    }
                    sent += r;
                }
                // The kernel refuses GSO here: turn it off for good and send
                // the rest of this flush one datagram per message.
                Err(e) if phub_net::is_gso_refused(&e) && self.gso && self.tx_segs[sent] > 1 => {
                    log::warn!("udp queue: the kernel refuses UDP GSO ({e}); sending without it");
                    self.gso = false;
                    let done: usize = self.tx_segs[..sent].iter().map(|&s| s as usize).sum();
                    self.tx_out.drain(..done);
                    return self.flush_tx(counters);
                }
                // A destination that refuses (ICMP unreachable reported on
                // this socket) must not stall the others: skip one message.
                Err(e) if phub_net::is_unreachable(&e) => sent += 1,
                Err(e) => {
                    self.clear_tx();
                    return Err(e);
                }
            }
        }
        self.clear_tx();
        Ok(())
    }

    fn clear_tx(&mut self) {
        self.tx_headers.clear();
        self.tx_payloads.clear();
        self.tx_addrs.clear();
        self.tx_out.clear();
        self.tx_iov.clear();
        self.tx_segs.clear();
    }
}

impl PacketIo for UdpQueue {
    type Addr = SocketAddrV4;

    fn peer_resolver(&self) -> Option<phub_engine::transmit::PeerResolver<SocketAddrV4>> {
        Some(std::sync::Arc::new(Some))
    }

    fn stated_rx_buffer(&self) -> Option<u64> {
        self.rx_buffer_bytes().ok().and_then(|b| u64::try_from(b).ok())
    }

    fn rx_burst(
        &mut self,
        wait: Option<Duration>,
        f: &mut dyn FnMut(SocketAddrV4, &[u8]),
    ) -> io::Result<usize> {
        if self.rx_next >= self.rx_count {
            self.rx_count = 0;
            self.rx_next = 0;
            self.rx_pos = 0;
            let mut m = self.recv_batch()?;
            if m == 0 {
                if let Some(w) = wait {
                    if self.wait_readable(w)? {
                        m = self.recv_batch()?;
                    }
                }
            }
            self.rx_count = m;
        }
        Ok(self.deliver(MAX_BURST, f))
    }

    fn tx_burst<'a, D>(
        &mut self,
        transmits: impl Iterator<Item = Transmit<'a, D>>,
        counters: &ShardCounters,
    ) -> io::Result<()>
    where
        D: Destinations<Item = SocketAddrV4>,
    {
        for t in transmits {
            if self.tx_headers.len() == TX_DATAGRAMS {
                self.flush_tx(counters)?;
            }
            let ti = self.tx_headers.len();
            self.tx_headers.push(t.header);
            self.tx_payloads.push((t.payload.as_ptr(), t.payload.len()));
            for to in t.to {
                if self.tx_out.len() == TX_DATAGRAMS {
                    // Flushing clears the transmit table too: keep this
                    // transmit for its remaining destinations.
                    let (h, p) = (self.tx_headers[ti], self.tx_payloads[ti]);
                    self.flush_tx(counters)?;
                    self.tx_headers.push(h);
                    self.tx_payloads.push(p);
                }
                let t_idx = self.tx_headers.len() - 1;
                self.tx_addrs.push(phub_net::sockaddr_in(to));
                // Cast: tx_headers and tx_addrs hold at most TX_DATAGRAMS
                // (4096) entries: both are flushed when that many are out.
                #[allow(clippy::cast_possible_truncation)]
                self.tx_out.push(Out {
                    key: (u32::from(*to.ip()), to.port(), t_idx as u32),
                    addr: (self.tx_addrs.len() - 1) as u32,
                });
            }
        }
        self.flush_tx(counters)
    }
}

/// Starts the kernel-UDP backend: binds one socket per lcore (all of them
/// first, so a port clash fails before anything runs), then runs each
/// lcore's job on a thread of its own, pinned to a CPU unless `--no-pin`.
pub fn start(cfg: &Config, make_job: MakeJob<'_, UdpQueue>) -> anyhow::Result<Started> {
    use anyhow::Context;
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let n = cfg.lcore_count(cores.len())?;
    let topology = Topology::detect();
    // --base-port 0: the kernel picks queue 0's port, the others follow;
    // one of those taken meanwhile (another program's ephemeral port: a
    // test run beside it) starts over from another port the kernel picks,
    // a few times.
    let mut queues = Vec::with_capacity(n);
    let mut attempts = 0;
    let base = 'bind: loop {
        queues.clear();
        let mut base = cfg.base_port;
        for i in 0..n {
            // Cast: i < n <= MAX_LCORES (256), checked in Config::lcore_count.
            #[allow(clippy::cast_possible_truncation)]
            let port = if base == 0 { 0 } else { base.wrapping_add(i as u16) };
            let addr = SocketAddrV4::new(cfg.host, port);
            let q = match UdpQueue::bind(addr, cfg.socket_buffer) {
                Ok(q) => q,
                Err(e)
                    if cfg.base_port == 0
                        && i > 0
                        && attempts < 16
                        && e.kind() == io::ErrorKind::AddrInUse =>
                {
                    attempts += 1;
                    continue 'bind;
                }
                Err(e) => return Err(e).with_context(|| format!("binding queue {i} to {addr}")),
            };
            if base == 0 {
                base = q.local_addr()?.port();
            }
            queues.push(q);
        }
        break base;
    };
    let slot_memory: Arc<dyn SlotAllocator> = Arc::new(RustHeap);
    let mut threads = Vec::with_capacity(n);
    let mut lcores = Vec::with_capacity(n);
    let mut counter_socks = Vec::with_capacity(n);
    for (i, io) in queues.into_iter().enumerate() {
        let rx_buffer = io.rx_buffer_bytes().ok().and_then(|b| u64::try_from(b).ok());
        // The kernel reports twice what it granted.
        if let Some(got) = rx_buffer.filter(|&b| b / 2 < cfg.socket_buffer as u64) {
            log::warn!(
                "lcore {i}: socket receive buffer {} bytes of the {} asked (net.core.rmem_max caps it; \
                 only root, CAP_NET_ADMIN, may exceed it): workers keep their windows within it, so \
                 rounds may be slower; raise net.core.rmem_max or run as root",
                got / 2,
                cfg.socket_buffer
            );
        }
        counter_socks.push(io.counters_handle().context("duplicating a queue's socket")?);
        // Cast: i < n <= MAX_LCORES (256), checked in Config::lcore_count.
        #[allow(clippy::cast_possible_truncation)]
        let lcore = i as u16;
        let job = make_job(LcoreStart {
            lcore,
            io,
            counters: Arc::new(ShardCounters::default()),
            slot_memory: Arc::clone(&slot_memory),
        });
        let core = (!cfg.no_pin && !cores.is_empty()).then(|| cores[i % cores.len()]);
        let thread = std::thread::Builder::new()
            .name(format!("phub-lcore-{i}"))
            .spawn(move || {
                if let Some(c) = core {
                    core_affinity::set_for_current(c);
                }
                job()
            })
            .context("spawning an lcore thread")?;
        threads.push(Some(thread));
        lcores.push(LcoreInfo {
            lcore,
            cpu: core.map(|c| c.id),
            numa_node: core.and_then(|c| topology.cpu_node(c.id)),
            rx_buffer_bytes: rx_buffer,
        });
    }
    Ok(Started {
        backend: BackendKind::Udp,
        base_port: base,
        lcores,
        threads,
        nic_numa_node: topology.nic_node(cfg.host),
        slot_memory,
        memory_budget: cfg.memory_budget,
        port_stats: None,
        socket_drops: Some(Box::new(move |i| {
            let s = counter_socks.get(i)?;
            phub_net::socket_drops(s).ok().map(u64::from)
        })),
        release: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> (UdpQueue, SocketAddrV4) {
        let q = UdpQueue::bind(SocketAddrV4::new([127, 0, 0, 1].into(), 0), 4 << 20).unwrap();
        let SocketAddr::V4(a) = q.local_addr().unwrap() else {
            unreachable!()
        };
        (q, a)
    }

    /// Sends `bytes` as one GSO train of `seg`-byte datagrams.
    fn send_train(s: &UdpSocket, to: SocketAddrV4, bytes: &[u8], seg: u16) {
        use phub_net::{setsockopt_int, SOL_UDP, UDP_SEGMENT};
        setsockopt_int(s, SOL_UDP, UDP_SEGMENT, libc::c_int::from(seg)).unwrap();
        assert_eq!(s.send_to(bytes, to).unwrap(), bytes.len());
        setsockopt_int(s, SOL_UDP, UDP_SEGMENT, 0).unwrap();
    }

    #[test]
    fn gro_trains_arrive_one_datagram_at_a_time_at_most_max_burst_per_call() {
        let (mut q, to) = queue();
        let c = UdpSocket::bind("127.0.0.1:0").unwrap();
        // 10 trains of 60 datagrams of 100 bytes; datagram i starts with i.
        for t in 0..10u16 {
            let train: Vec<u8> = (0..60u16)
                .flat_map(|k| {
                    let i = t * 60 + k;
                    let mut d = vec![0u8; 100];
                    d[..2].copy_from_slice(&i.to_le_bytes());
                    d
                })
                .collect();
            send_train(&c, to, &train, 100);
        }
        let mut got: Vec<u16> = Vec::new();
        let mut calls = Vec::new();
        while got.len() < 600 {
            let n = q
                .rx_burst(Some(Duration::from_millis(500)), &mut |from, d| {
                    assert_eq!(
                        from,
                        SocketAddrV4::new([127, 0, 0, 1].into(), c.local_addr().unwrap().port())
                    );
                    assert_eq!(d.len(), 100);
                    got.push(u16::from_le_bytes([d[0], d[1]]));
                })
                .unwrap();
            assert!(n > 0 && n <= MAX_BURST, "{n}");
            calls.push(n);
        }
        assert_eq!(got, (0..600).collect::<Vec<u16>>(), "in order, none lost");
        if q.gro {
            // Trains came whole: the first call stopped at the engine's cap.
            assert_eq!(calls[0], MAX_BURST, "{calls:?}");
        }
    }
}
