//! The kernel-UDP backend: one UDP socket per lcore on port base + lcore,
//! batched with `recvmmsg`/`sendmmsg`.
//!
//! Receive buffers place each datagram at offset 42 of a 64-byte aligned
//! block, so its payload (after the 86-byte header) starts 64-byte aligned,
//! as it does in an Ethernet frame on the DPDK backend. Results go out as
//! two iovecs per message, the header and the payload in slot memory: W
//! destinations share one payload and nothing is copied per destination.

use std::io;
use std::net::{SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::Duration;

use phub_proto::wire::{HEADER_LEN, MAX_PAYLOAD};

use super::PacketIo;
use crate::counters::ShardCounters;
use crate::engine::Shard;

/// Datagrams per `recvmmsg` call.
pub const RX_BURST: usize = 64;
/// Messages per `sendmmsg` call.
const TX_BATCH: usize = 256;
/// Bytes reserved per received datagram (more than the largest valid one,
/// so oversized datagrams are seen as such rather than cut to size).
const RX_STRIDE: usize = 9216 + 64;
/// Where a datagram starts inside its 64-byte aligned block.
const RX_OFFSET: usize = (64 - HEADER_LEN % 64) % 64;

const _: () = assert!((RX_OFFSET + HEADER_LEN).is_multiple_of(64));
const _: () = assert!(RX_STRIDE.is_multiple_of(64) && RX_OFFSET + HEADER_LEN + MAX_PAYLOAD < RX_STRIDE);

/// A UDP queue.
pub struct UdpQueue {
    sock: UdpSocket,
    /// `RX_BURST` receive blocks of `RX_STRIDE` bytes, starting at `rx_base`.
    rx_mem: Vec<u8>,
    rx_base: usize,
    rx_addrs: Vec<libc::sockaddr_in>,
    rx_iov: Vec<libc::iovec>,
    rx_hdrs: Vec<libc::mmsghdr>,
    tx_headers: Vec<[u8; HEADER_LEN]>,
    tx_iov: Vec<[libc::iovec; 2]>,
    tx_addrs: Vec<libc::sockaddr_in>,
    tx_msgs: Vec<(usize, usize)>,
    tx_hdrs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers inside the iovec/mmsghdr scratch arrays are only
// ever set and used within one call on the owning thread; between calls they
// dangle harmlessly and are rewritten before use. Moving the queue to its
// lcore thread is therefore sound.
unsafe impl Send for UdpQueue {}

impl std::fmt::Debug for UdpQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpQueue")
            .field("sock", &self.sock)
            .finish_non_exhaustive()
    }
}

fn to_sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

fn from_sockaddr(s: &libc::sockaddr_in) -> SocketAddrV4 {
    SocketAddrV4::new(s.sin_addr.s_addr.to_ne_bytes().into(), u16::from_be(s.sin_port))
}

fn set_buf(fd: i32, force: libc::c_int, plain: libc::c_int, bytes: libc::c_int) {
    let v = bytes;
    let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket; the option value points to a live c_int
    // of the stated length. Failure (no privilege) is tolerated.
    let ok = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            force,
            (&v as *const libc::c_int).cast(),
            len,
        )
    };
    if ok != 0 {
        // SAFETY: as above.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                plain,
                (&v as *const libc::c_int).cast(),
                len,
            )
        };
    }
}

impl UdpQueue {
    /// Binds `addr` (IPv4) with large socket buffers.
    pub fn bind(addr: SocketAddrV4, buffer_bytes: usize) -> io::Result<UdpQueue> {
        let sock = UdpSocket::bind(addr)?;
        let fd = sock.as_raw_fd();
        let b = buffer_bytes.min(i32::MAX as usize) as libc::c_int;
        set_buf(fd, libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, b);
        set_buf(fd, libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, b);
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
            rx_mem,
            rx_base,
            rx_addrs: vec![zeroed_addr; RX_BURST],
            rx_iov: vec![null_iov; RX_BURST],
            rx_hdrs: vec![zeroed_hdr; RX_BURST],
            tx_headers: Vec::with_capacity(TX_BATCH),
            tx_iov: Vec::with_capacity(TX_BATCH),
            tx_addrs: Vec::with_capacity(TX_BATCH),
            tx_msgs: Vec::with_capacity(TX_BATCH),
            tx_hdrs: vec![zeroed_hdr; TX_BATCH],
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sock.local_addr()
    }

    fn wait_readable(&self, wait: Duration) -> io::Result<bool> {
        let mut p = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = wait.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `p` is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            };
        }
        Ok(n > 0)
    }

    fn recv_batch(&mut self) -> io::Result<usize> {
        let base = self.rx_mem.as_mut_ptr();
        for i in 0..RX_BURST {
            self.rx_iov[i] = libc::iovec {
                // SAFETY: rx_base + i * RX_STRIDE + RX_STRIDE - RX_OFFSET <= rx_mem.len()
                // because rx_mem has RX_BURST * RX_STRIDE + 64 bytes and rx_base < 64 + RX_OFFSET.
                iov_base: unsafe { base.add(self.rx_base + i * RX_STRIDE) }.cast(),
                iov_len: RX_STRIDE - RX_OFFSET - 64,
            };
            let h = &mut self.rx_hdrs[i];
            h.msg_hdr.msg_name = (&mut self.rx_addrs[i] as *mut libc::sockaddr_in).cast();
            h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            h.msg_hdr.msg_iov = &mut self.rx_iov[i];
            h.msg_hdr.msg_iovlen = 1;
            h.msg_hdr.msg_control = std::ptr::null_mut();
            h.msg_hdr.msg_controllen = 0;
            h.msg_hdr.msg_flags = 0;
            h.msg_len = 0;
        }
        // SAFETY: rx_hdrs holds RX_BURST initialised headers whose name and
        // iovec pointers point into this queue's own live buffers (set just
        // above); the kernel writes at most iov_len bytes per message.
        let n = unsafe {
            libc::recvmmsg(
                self.sock.as_raw_fd(),
                self.rx_hdrs.as_mut_ptr(),
                RX_BURST as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
                _ => Err(e),
            };
        }
        Ok(n as usize)
    }

    fn flush_tx(&mut self, counters: &ShardCounters) -> io::Result<()> {
        let n = self.tx_msgs.len();
        for (m, &(t, a)) in self.tx_msgs.iter().enumerate() {
            let h = &mut self.tx_hdrs[m];
            h.msg_hdr.msg_name = (&mut self.tx_addrs[a] as *mut libc::sockaddr_in).cast();
            h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            h.msg_hdr.msg_iov = self.tx_iov[t].as_mut_ptr();
            h.msg_hdr.msg_iovlen = if self.tx_iov[t][1].iov_len == 0 { 1 } else { 2 };
            h.msg_hdr.msg_control = std::ptr::null_mut();
            h.msg_hdr.msg_controllen = 0;
            h.msg_hdr.msg_flags = 0;
            h.msg_len = 0;
        }
        let mut sent = 0;
        while sent < n {
            // SAFETY: tx_hdrs[sent..n] are initialised above; their name and
            // iovec pointers point into tx_addrs/tx_iov (not resized since)
            // and the iovecs into tx_headers and the shard's slot memory,
            // which the caller keeps borrowed for the whole of tx_burst.
            let r = unsafe {
                libc::sendmmsg(
                    self.sock.as_raw_fd(),
                    self.tx_hdrs.as_mut_ptr().add(sent),
                    (n - sent) as libc::c_uint,
                    0,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // A destination that refuses (ICMP unreachable reported on
                // this socket) must not stall the others: skip one message.
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ECONNREFUSED) | Some(libc::EHOSTUNREACH)
                ) {
                    sent += 1;
                    continue;
                }
                self.clear_tx();
                return Err(e);
            }
            for h in &self.tx_hdrs[sent..sent + r as usize] {
                counters.tx_packets.inc();
                counters.tx_bytes.add(u64::from(h.msg_len));
            }
            sent += r as usize;
        }
        self.clear_tx();
        Ok(())
    }

    fn clear_tx(&mut self) {
        self.tx_headers.clear();
        self.tx_iov.clear();
        self.tx_addrs.clear();
        self.tx_msgs.clear();
    }
}

impl PacketIo for UdpQueue {
    type Addr = SocketAddrV4;

    fn rx_burst(
        &mut self,
        wait: Option<Duration>,
        f: &mut dyn FnMut(SocketAddrV4, &[u8]),
    ) -> io::Result<usize> {
        let mut n = self.recv_batch()?;
        if n == 0 {
            if let Some(w) = wait {
                if self.wait_readable(w)? {
                    n = self.recv_batch()?;
                }
            }
        }
        for i in 0..n {
            let len = self.rx_hdrs[i].msg_len as usize;
            let start = self.rx_base + i * RX_STRIDE;
            let from = from_sockaddr(&self.rx_addrs[i]);
            f(from, &self.rx_mem[start..start + len]);
        }
        Ok(n)
    }

    fn tx_burst(&mut self, shard: &Shard<SocketAddrV4>, counters: &ShardCounters) -> io::Result<()> {
        for t in shard.transmits() {
            if self.tx_headers.len() == TX_BATCH {
                self.flush_tx(counters)?;
            }
            let ti = self.tx_headers.len();
            self.tx_headers.push(t.header);
            let hdr_ptr = self.tx_headers[ti].as_ptr();
            self.tx_iov.push([
                libc::iovec {
                    iov_base: hdr_ptr as *mut libc::c_void,
                    iov_len: HEADER_LEN,
                },
                libc::iovec {
                    iov_base: t.payload.as_ptr() as *mut libc::c_void,
                    iov_len: t.payload.len(),
                },
            ]);
            for to in t.to {
                if self.tx_msgs.len() == TX_BATCH {
                    // tx_headers/tx_iov hold this transmit already; flushing
                    // clears them, so re-add it for its remaining destinations.
                    let (h, iov) = (self.tx_headers[ti], self.tx_iov[ti]);
                    self.flush_tx(counters)?;
                    self.tx_headers.push(h);
                    let hp = self.tx_headers[0].as_ptr();
                    self.tx_iov.push([
                        libc::iovec {
                            iov_base: hp as *mut libc::c_void,
                            iov_len: HEADER_LEN,
                        },
                        iov[1],
                    ]);
                }
                let t_idx = self.tx_headers.len() - 1;
                self.tx_addrs.push(to_sockaddr(to));
                self.tx_msgs.push((t_idx, self.tx_addrs.len() - 1));
            }
        }
        if !self.tx_msgs.is_empty() {
            self.flush_tx(counters)?;
        } else {
            self.clear_tx();
        }
        Ok(())
    }
}
