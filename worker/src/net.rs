//! Batched UDP I/O: `sendmmsg` with `UDP_SEGMENT` (GSO) and `recvmmsg` with
//! `UDP_GRO`, the socket layer of the worker's I/O thread (and of
//! `phub-bench`'s same-run loopback ceiling, so that both use one socket
//! set-up).
//!
//! Why: one datagram per `sendto`/`recvfrom` costs a system call and a trip
//! through the stack per 8 KiB; on loopback that tops out near 1.6 GB/s. A
//! GSO send hands the kernel up to 64 same-size datagrams for one
//! destination in one buffer list (one trip through the stack), and a
//! GRO-enabled socket receives such a train as one message whose segment
//! size comes in a control message: about 5 GB/s on loopback here
//! (BENCHMARKS.md).
//!
//! [`BatchSocket::send`] groups the datagrams it is given by destination
//! (keeping each destination's order), cuts each group into trains of
//! same-size segments (the last one of a train may be shorter) of at most
//! 64 segments and 65507 bytes, and sends all trains with `sendmmsg`.
//! [`BatchSocket::recv`] receives up to [`RX_SLOTS`] messages with
//! `recvmmsg` and calls its callback once per datagram, splitting trains by
//! their segment size. Where the kernel refuses GSO (an old kernel, a device
//! without it) the socket falls back to one datagram per message by itself.
//!
//! The system-call helpers (GSO control messages, GRO segment sizes, train
//! cutting, buffer sizing, the `recvmmsg`/`sendmmsg` calls) are phub-net's,
//! shared with the dataplane's kernel-UDP backend.

use std::io;
use std::net::{SocketAddr, SocketAddrV6, UdpSocket};
use std::time::Duration;

pub use phub_net::set_buffers;
use phub_net::CmsgBuf;

/// Messages per `recvmmsg` call.
pub const RX_SLOTS: usize = 32;
/// Bytes per receive slot: the largest UDP payload (a GRO train).
const RX_SLOT_BYTES: usize = 65536;
/// Messages per `sendmmsg` call (the kernel's UIO_MAXIOV caps it at 1024).
const TX_BATCH: usize = 256;

/// How to set a socket up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketOptions {
    /// Send same-size datagrams to one destination as GSO trains.
    pub gso: bool,
    /// Receive GRO trains (split here into datagrams).
    pub gro: bool,
    /// Receive and send buffer size asked for, bytes. `SO_RCVBUFFORCE`
    /// (which may exceed `net.core.rmem_max`) is tried first; without
    /// CAP_NET_ADMIN the kernel caps `SO_RCVBUF` at rmem_max.
    pub buffer_bytes: usize,
}

impl Default for SocketOptions {
    fn default() -> SocketOptions {
        SocketOptions {
            gso: true,
            gro: true,
            buffer_bytes: 32 << 20,
        }
    }
}

/// What the socket really got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketInfo {
    /// GSO sends are used.
    pub gso: bool,
    /// GRO receives are enabled.
    pub gro: bool,
    /// `SO_RCVBUF` as the kernel reports it (twice what was granted: the
    /// kernel counts its bookkeeping too).
    pub rcvbuf: usize,
    /// `SO_SNDBUF` as the kernel reports it.
    pub sndbuf: usize,
}

/// One datagram to send: its UDP payload is `head` followed by `body`
/// (two iovecs, so a header and a payload can live apart; `body` may be
/// empty).
#[derive(Debug, Clone, Copy)]
pub struct Datagram<'a> {
    /// Destination.
    pub to: SocketAddr,
    /// First part of the payload.
    pub head: &'a [u8],
    /// Rest of the payload.
    pub body: &'a [u8],
}

impl Datagram<'_> {
    /// UDP payload bytes.
    pub fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A socket address in the kernel's layout.
#[derive(Clone, Copy)]
#[repr(C)]
union RawAddr {
    v4: libc::sockaddr_in,
    v6: libc::sockaddr_in6,
}

impl RawAddr {
    fn new(a: SocketAddr) -> (RawAddr, libc::socklen_t) {
        match a {
            SocketAddr::V4(a) => (
                RawAddr {
                    v4: phub_net::sockaddr_in(a),
                },
                phub_net::socklen::<libc::sockaddr_in>(),
            ),
            SocketAddr::V6(a) => (
                RawAddr {
                    v6: libc::sockaddr_in6 {
                        // Cast: AF_INET6 is 10.
                        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                        sin6_family: libc::AF_INET6 as libc::sa_family_t,
                        sin6_port: a.port().to_be(),
                        sin6_flowinfo: a.flowinfo().to_be(),
                        sin6_addr: libc::in6_addr {
                            s6_addr: a.ip().octets(),
                        },
                        sin6_scope_id: a.scope_id(),
                    },
                },
                phub_net::socklen::<libc::sockaddr_in6>(),
            ),
        }
    }

    fn zeroed() -> RawAddr {
        // SAFETY: all-zero bytes are a valid value of both plain C structs.
        unsafe { std::mem::zeroed() }
    }

    fn get(&self) -> Option<SocketAddr> {
        // SAFETY: every variant starts with the family field at the same
        // offset (the kernel's sockaddr layout), and all bit patterns are
        // valid for these integer-only structs.
        let family = i32::from(unsafe { self.v4.sin_family });
        match family {
            libc::AF_INET => {
                // SAFETY: the family says the kernel wrote a sockaddr_in.
                let a = unsafe { self.v4 };
                Some(SocketAddr::V4(phub_net::socket_addr_v4(&a)))
            }
            libc::AF_INET6 => {
                // SAFETY: the family says the kernel wrote a sockaddr_in6.
                let a = unsafe { self.v6 };
                Some(SocketAddr::V6(SocketAddrV6::new(
                    a.sin6_addr.s6_addr.into(),
                    u16::from_be(a.sin6_port),
                    u32::from_be(a.sin6_flowinfo),
                    a.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

/// A UDP socket with batched, segmentation-offloaded I/O.
pub struct BatchSocket {
    sock: UdpSocket,
    info: SocketInfo,
    rx_mem: Vec<u8>,
    rx_addrs: Vec<RawAddr>,
    rx_iov: Vec<libc::iovec>,
    rx_cmsg: Vec<CmsgBuf>,
    rx_hdrs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers inside the iovec/mmsghdr scratch arrays point into
// the socket's own buffers and are rewritten before each system call; they
// are never dereferenced by Rust code, so moving the socket to another
// thread is sound.
unsafe impl Send for BatchSocket {}

impl std::fmt::Debug for BatchSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchSocket")
            .field("sock", &self.sock)
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl BatchSocket {
    /// Wraps a bound socket and applies `opts`.
    pub fn new(sock: UdpSocket, opts: SocketOptions) -> io::Result<BatchSocket> {
        set_buffers(&sock, opts.buffer_bytes);
        let gro = opts.gro && phub_net::enable_gro(&sock);
        let buf = |name| {
            phub_net::getsockopt_int(&sock, libc::SOL_SOCKET, name)
                .map_or(0, |v| usize::try_from(v).unwrap_or(0))
        };
        let info = SocketInfo {
            gso: opts.gso,
            gro,
            rcvbuf: buf(libc::SO_RCVBUF),
            sndbuf: buf(libc::SO_SNDBUF),
        };
        let null_iov = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        // SAFETY: all-zero is a valid mmsghdr (null pointers, zero lengths).
        let zeroed_hdr: libc::mmsghdr = unsafe { std::mem::zeroed() };
        Ok(BatchSocket {
            sock,
            info,
            rx_mem: vec![0u8; RX_SLOTS * RX_SLOT_BYTES],
            rx_addrs: vec![RawAddr::zeroed(); RX_SLOTS],
            rx_iov: vec![null_iov; RX_SLOTS],
            rx_cmsg: vec![CmsgBuf::new(); RX_SLOTS],
            rx_hdrs: vec![zeroed_hdr; RX_SLOTS],
        })
    }

    /// The underlying socket.
    pub fn socket(&self) -> &UdpSocket {
        &self.sock
    }

    /// What the socket got.
    pub fn info(&self) -> SocketInfo {
        self.info
    }

    /// Waits until the socket is readable or `wait` has passed; returns
    /// whether it is readable.
    pub fn wait_readable(&self, wait: Duration) -> io::Result<bool> {
        // Round up, so a sub-millisecond wait still waits.
        let ms = libc::c_int::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX);
        phub_net::poll_readable(&self.sock, ms)
    }

    /// Sends every datagram of `dgrams` (GSO trains where allowed); returns
    /// how many were handed to the kernel. A datagram the kernel refuses is
    /// skipped (the caller's retransmission covers it), except that a full
    /// socket buffer (`WouldBlock` cannot happen on a blocking socket) or
    /// an unexpected error ends the call with what was sent so far.
    pub fn send(&mut self, dgrams: &[Datagram<'_>]) -> io::Result<usize> {
        if dgrams.is_empty() {
            return Ok(0);
        }
        // Stable grouping by destination keeps each destination's order.
        let n = u32::try_from(dgrams.len()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "more than 2^32 datagrams in one send",
            )
        })?;
        let mut order: Vec<u32> = (0..n).collect();
        order.sort_by_key(|&i| dgrams[i as usize].to);
        // Trains: (first index into `order`, count, segment size).
        let mut trains: Vec<(usize, usize, usize)> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let first = &dgrams[order[i] as usize];
            let seg = first.len();
            let n = if self.info.gso && seg > 0 {
                phub_net::train_len(seg, |k| {
                    let d = dgrams[*order.get(i + k)? as usize];
                    (d.to == first.to).then_some(d.len())
                })
            } else {
                1
            };
            trains.push((i, n, seg));
            i += n;
        }
        let mut sent = 0;
        for batch in trains.chunks(TX_BATCH) {
            sent += self.send_trains(dgrams, &order, batch)?;
        }
        Ok(sent)
    }

    fn send_trains(
        &mut self,
        dgrams: &[Datagram<'_>],
        order: &[u32],
        trains: &[(usize, usize, usize)],
    ) -> io::Result<usize> {
        let n_iov: usize = 2 * trains.iter().map(|t| t.1).sum::<usize>();
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(n_iov);
        let mut addrs: Vec<(RawAddr, libc::socklen_t)> = Vec::with_capacity(trains.len());
        let mut cmsgs: Vec<CmsgBuf> = vec![CmsgBuf::new(); trains.len()];
        let mut iov_per_train: Vec<usize> = Vec::with_capacity(trains.len());
        for &(first, n, _) in trains {
            addrs.push(RawAddr::new(dgrams[order[first] as usize].to));
            let before = iov.len();
            for k in 0..n {
                let d = dgrams[order[first + k] as usize];
                for b in [d.head, d.body] {
                    if !b.is_empty() {
                        iov.push(libc::iovec {
                            iov_base: b.as_ptr() as *mut libc::c_void,
                            iov_len: b.len(),
                        });
                    }
                }
            }
            iov_per_train.push(iov.len() - before);
        }
        // SAFETY: all-zero is a valid mmsghdr.
        let mut hdrs: Vec<libc::mmsghdr> = vec![unsafe { std::mem::zeroed() }; trains.len()];
        let mut at = 0;
        for (m, &(_, n, seg)) in trains.iter().enumerate() {
            let h = &mut hdrs[m].msg_hdr;
            h.msg_name = (&mut addrs[m].0 as *mut RawAddr).cast();
            h.msg_namelen = addrs[m].1;
            let k = iov_per_train[m];
            // SAFETY: `at + k <= iov.len()` (the iovecs were pushed train by
            // train above), so the pointer stays inside `iov`.
            h.msg_iov = unsafe { iov.as_mut_ptr().add(at) };
            h.msg_iovlen = k as _;
            at += k;
            if n > 1 {
                // Cast: a train's segments fit one UDP payload (65507 bytes).
                #[allow(clippy::cast_possible_truncation)]
                phub_net::set_gso_segment(h, &mut cmsgs[m], seg as u16);
            }
        }
        let mut done = 0; // messages
        let mut sent = 0; // datagrams
        while done < hdrs.len() {
            // SAFETY: hdrs[done..] are initialised above; their name, iovec
            // and control pointers point into `addrs`, `iov` and `cmsgs`,
            // which are not touched until the call returns, and the iovecs
            // into the caller's datagrams, borrowed for this whole call.
            match unsafe { phub_net::send_mmsg(&self.sock, &mut hdrs[done..]) } {
                Ok(r) => {
                    for &(_, n, _) in &trains[done..done + r] {
                        sent += n;
                    }
                    done += r;
                }
                // The kernel or the device refuses GSO: fall back to one
                // datagram per message from now on and resend this train.
                Err(e) if phub_net::is_gso_refused(&e) && self.info.gso && trains[done].1 > 1 => {
                    self.info.gso = false;
                    let (first, n, _) = trains[done];
                    let rest: Vec<Datagram<'_>> =
                        (first..first + n).map(|k| dgrams[order[k] as usize]).collect();
                    sent += self.send(&rest)?;
                    done += 1;
                }
                // One destination refusing (ICMP unreachable reported on
                // this socket), or one bad message: skip it, it counts as
                // lost.
                Err(e)
                    if phub_net::is_unreachable(&e)
                        || matches!(e.raw_os_error(), Some(libc::EMSGSIZE) | Some(libc::EINVAL)) =>
                {
                    done += 1
                }
                Err(e) => return if sent > 0 { Ok(sent) } else { Err(e) },
            }
        }
        Ok(sent)
    }

    /// Receives what is waiting (without blocking), calling `f(from, datagram)`
    /// once per datagram; returns the number of datagrams. If nothing is
    /// waiting and `wait` is given, first waits up to `wait` for something.
    pub fn recv(
        &mut self,
        wait: Option<Duration>,
        f: &mut dyn FnMut(SocketAddr, &[u8]),
    ) -> io::Result<usize> {
        let mut m = self.recv_batch()?;
        if m == 0 {
            if let Some(w) = wait {
                if self.wait_readable(w)? {
                    m = self.recv_batch()?;
                }
            }
        }
        let mut n = 0;
        for i in 0..m {
            let h = &self.rx_hdrs[i];
            let len = h.msg_len as usize;
            let Some(from) = self.rx_addrs[i].get() else {
                continue;
            };
            let seg = self.rx_cmsg[i].gro_segment(&h.msg_hdr);
            let data = &self.rx_mem[i * RX_SLOT_BYTES..i * RX_SLOT_BYTES + len];
            match seg {
                Some(s) if s > 0 && s < len => {
                    for d in data.chunks(s) {
                        f(from, d);
                        n += 1;
                    }
                }
                _ => {
                    f(from, data);
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// Receives what is waiting (after waiting up to `wait` if nothing is)
    /// and sends every message straight back to its sender, a GRO train as
    /// a GSO train of the same segment size, without copying it in user
    /// space: the echo of `phub-bench`'s loopback ceiling. Returns the
    /// datagrams echoed.
    pub fn reflect(&mut self, wait: Option<Duration>) -> io::Result<usize> {
        let mut m = self.recv_batch()?;
        if m == 0 {
            if let Some(w) = wait {
                if self.wait_readable(w)? {
                    m = self.recv_batch()?;
                }
            }
        }
        if m == 0 {
            return Ok(0);
        }
        // SAFETY: all-zero is a valid mmsghdr.
        let mut hdrs: Vec<libc::mmsghdr> = vec![unsafe { std::mem::zeroed() }; m];
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(m * phub_net::MAX_SEGMENTS);
        let mut cmsgs = vec![CmsgBuf::new(); m];
        let mut datagrams = 0;
        let mut out = 0;
        for i in 0..m {
            let len = self.rx_hdrs[i].msg_len as usize;
            let seg = self.rx_cmsg[i]
                .gro_segment(&self.rx_hdrs[i].msg_hdr)
                .filter(|&s| s > 0 && s < len);
            let base = i * RX_SLOT_BYTES;
            let n = seg.map_or(1, |s| len.div_ceil(s));
            datagrams += n;
            // With GSO: one message per train; without: one per datagram.
            let pieces: Vec<(usize, usize, Option<usize>)> = match seg {
                Some(s) if self.info.gso => vec![(base, len, Some(s))],
                Some(s) => (0..n).map(|k| (base + k * s, s.min(len - k * s), None)).collect(),
                None => vec![(base, len, None)],
            };
            for (at, l, s) in pieces {
                if out == hdrs.len() {
                    // Only without GSO (one message per datagram), when no
                    // header points into `cmsgs` yet: growing it is safe.
                    // SAFETY: all-zero is a valid mmsghdr.
                    hdrs.push(unsafe { std::mem::zeroed() });
                    cmsgs.push(CmsgBuf::new());
                }
                iov.push(libc::iovec {
                    // SAFETY: at + l <= the received bytes of slot i, inside rx_mem.
                    iov_base: unsafe { self.rx_mem.as_mut_ptr().add(at) }.cast(),
                    iov_len: l,
                });
                let h = &mut hdrs[out].msg_hdr;
                h.msg_name = (&mut self.rx_addrs[i] as *mut RawAddr).cast();
                h.msg_namelen = phub_net::socklen::<RawAddr>();
                h.msg_iovlen = 1;
                if let Some(s) = s {
                    // Cast: a GRO segment is shorter than its 64 KiB train.
                    #[allow(clippy::cast_possible_truncation)]
                    phub_net::set_gso_segment(h, &mut cmsgs[out], s as u16);
                }
                out += 1;
            }
        }
        // iovec pointers are set once `iov` no longer grows.
        for (k, h) in hdrs.iter_mut().take(out).enumerate() {
            // SAFETY: k < iov.len() (one iovec per message, pushed above).
            h.msg_hdr.msg_iov = unsafe { iov.as_mut_ptr().add(k) };
        }
        let mut done = 0;
        while done < out {
            // SAFETY: hdrs[done..out] are initialised above; their pointers
            // point into rx_addrs, iov, cmsgs and rx_mem, all live and
            // untouched until the call returns.
            match unsafe { phub_net::send_mmsg(&self.sock, &mut hdrs[done..out]) } {
                Ok(r) => done += r,
                Err(_) => done += 1, // drop the message; the client resends
            }
        }
        Ok(datagrams)
    }

    fn recv_batch(&mut self) -> io::Result<usize> {
        let gro = self.info.gro;
        for (i, (iov, chunk)) in self
            .rx_iov
            .iter_mut()
            .zip(self.rx_mem.chunks_mut(RX_SLOT_BYTES))
            .enumerate()
        {
            *iov = libc::iovec {
                iov_base: chunk.as_mut_ptr().cast(),
                iov_len: RX_SLOT_BYTES,
            };
            phub_net::set_rx_header(
                &mut self.rx_hdrs[i],
                &mut self.rx_addrs[i],
                iov,
                &mut self.rx_cmsg[i],
                gro,
            );
        }
        // SAFETY: set_rx_header pointed all RX_SLOTS headers at this socket's
        // own live buffers (addresses: plain C structs; slots of
        // RX_SLOT_BYTES in rx_mem; control buffers), untouched until the
        // call returns.
        match unsafe { phub_net::recv_mmsg(&self.sock, &mut self.rx_hdrs) } {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset
                ) =>
            {
                Ok(0)
            }
            r => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(opts: SocketOptions) -> (BatchSocket, BatchSocket) {
        let a = BatchSocket::new(UdpSocket::bind("127.0.0.1:0").unwrap(), opts).unwrap();
        let b = BatchSocket::new(UdpSocket::bind("127.0.0.1:0").unwrap(), opts).unwrap();
        (a, b)
    }

    fn exchange(opts: SocketOptions) {
        let (mut a, mut b) = pair(opts);
        let to = b.socket().local_addr().unwrap();
        let other = a.socket().local_addr().unwrap();
        // 20 datagrams of 1000 bytes, then one of 300 (a train's short tail),
        // then 3 of 1000 again, interleaved with datagrams to another socket.
        let payloads: Vec<Vec<u8>> = (0..24u8)
            .map(|i| vec![i; if i == 20 { 300 } else { 1000 }])
            .collect();
        let mut dg = Vec::new();
        for p in &payloads {
            // Half the datagrams in two parts, as header and payload.
            let (head, body) = if p[0] % 2 == 0 {
                p.split_at(7)
            } else {
                (&p[..], &[][..])
            };
            dg.push(Datagram { to, head, body });
            dg.push(Datagram {
                to: other,
                head: &p[..10],
                body: &[],
            });
        }
        assert_eq!(a.send(&dg).unwrap(), dg.len());
        let mut got: Vec<Vec<u8>> = Vec::new();
        let t = std::time::Instant::now();
        while got.len() < payloads.len() && t.elapsed() < Duration::from_secs(5) {
            b.recv(Some(Duration::from_millis(50)), &mut |from, d| {
                assert_eq!(from, other);
                got.push(d.to_vec());
            })
            .unwrap();
        }
        assert_eq!(got, payloads, "datagrams arrive whole, in order");
        let mut mine = 0;
        while mine < payloads.len() {
            a.recv(Some(Duration::from_millis(50)), &mut |_, d| {
                assert_eq!(d.len(), 10);
                mine += 1;
            })
            .unwrap();
        }
    }

    #[test]
    fn gso_trains_and_gro_split_round_trip() {
        exchange(SocketOptions::default());
    }

    #[test]
    fn plain_datagrams_round_trip() {
        exchange(SocketOptions {
            gso: false,
            gro: false,
            buffer_bytes: 1 << 20,
        });
    }
}
