//! phub-net: the Linux kernel-UDP helpers that the worker's socket
//! (`phub_worker::net::BatchSocket`) and the dataplane's kernel-UDP backend
//! (`phub_dataplane::backend::udp::UdpQueue`) share: socket buffer sizing,
//! `UDP_GRO` on receive, `UDP_SEGMENT` (GSO) control messages on send,
//! cutting a destination's datagrams into GSO trains, and one-call wrappers
//! over `recvmmsg`, `sendmmsg` and `poll`.
//!
//! Layer: system calls, below both sockets and above libc. It owns no
//! buffers and never allocates: each caller keeps its own layout (the
//! dataplane's 64-byte aligned receive slots and zero-copy iovecs over slot
//! memory, the worker's per-datagram delivery), its own batching and its
//! own error policy; what is here is what both did the same way. Linux only
//! (`UDP_SEGMENT` since 4.18, `UDP_GRO` since 5.0; where the kernel refuses
//! them the callers fall back to one datagram per message).
//!
//! Unsafe: the two batch calls are `unsafe fn`s (the kernel follows the raw
//! pointers in the headers they are given); everything else is safe to call.
// Casts that may truncate or drop a sign are checked here rather than in
// Cargo.toml: `[lints] workspace = true` cannot be mixed with crate-level
// lint keys there. Each remaining `as` names its bound in a `// Cast:` note.
#![warn(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

pub mod copy;
pub mod shm;

use std::io;
use std::net::SocketAddrV4;
use std::os::fd::{AsFd, AsRawFd};

/// `SOL_UDP` (linux/udp.h; the libc crate does not export it everywhere).
pub const SOL_UDP: libc::c_int = 17;
/// `UDP_SEGMENT`: the GSO segment size of a send, a `u16` control message.
pub const UDP_SEGMENT: libc::c_int = 103;
/// `UDP_GRO`: a socket option on receive; a received train carries its
/// segment size in a control message of this type (an `int`).
pub const UDP_GRO: libc::c_int = 104;
/// Most datagrams in one GSO train (the kernel's UDP_MAX_SEGMENTS is 64 on
/// older kernels).
pub const MAX_SEGMENTS: usize = 64;
/// Most UDP payload bytes in one datagram over IPv4 (65535 - 20 - 8); also
/// what one GSO train may carry.
pub const MAX_TRAIN_BYTES: usize = 65507;

/// Room for one control message carrying one `int` (`UDP_GRO`) or `u16`
/// (`UDP_SEGMENT`), aligned as the kernel expects.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
pub struct CmsgBuf([u8; CmsgBuf::LEN]);

// One cmsghdr and up to 8 bytes of data (CMSG_SPACE of an int or a u16).
const _: () = assert!(std::mem::size_of::<libc::cmsghdr>() + 8 <= CmsgBuf::LEN);

impl Default for CmsgBuf {
    fn default() -> CmsgBuf {
        CmsgBuf::new()
    }
}

impl std::fmt::Debug for CmsgBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CmsgBuf")
    }
}

impl CmsgBuf {
    /// Bytes of the buffer (what a receive header's `msg_controllen` gets).
    pub const LEN: usize = 32;

    /// A zeroed buffer.
    pub const fn new() -> CmsgBuf {
        CmsgBuf([0; CmsgBuf::LEN])
    }

    /// The GRO segment size the kernel left here with a received message,
    /// `h` being the message's header (only its `msg_controllen` is read):
    /// `None` when the message is not a train (no `UDP_GRO` control
    /// message). Only bytes inside the buffer are read, whatever the kernel
    /// wrote.
    pub fn gro_segment(&self, h: &libc::msghdr) -> Option<usize> {
        // socklen_t on some C libraries, size_t on glibc.
        #[allow(clippy::unnecessary_cast)]
        let controllen = h.msg_controllen as usize;
        self.segment_in(controllen)
    }

    /// [`CmsgBuf::gro_segment`] of the first `controllen` bytes.
    fn segment_in(&self, controllen: usize) -> Option<usize> {
        let controllen = controllen.min(CmsgBuf::LEN);
        let hdr = std::mem::size_of::<libc::cmsghdr>();
        // What CMSG_ALIGN does: control messages start size_t-aligned.
        let align = |n: usize| n.next_multiple_of(std::mem::size_of::<usize>());
        let mut at = 0;
        while at + hdr <= controllen {
            // SAFETY: at + hdr <= controllen <= LEN, so a whole cmsghdr lies
            // inside the buffer; read_unaligned needs no alignment, and any
            // bytes are a valid cmsghdr (integers only).
            let cm: libc::cmsghdr = unsafe { std::ptr::read_unaligned(self.0.as_ptr().add(at).cast()) };
            let len = cm.cmsg_len as usize;
            if len < hdr || at + len > controllen {
                return None; // malformed or cut off (MSG_CTRUNC)
            }
            if cm.cmsg_level == SOL_UDP && cm.cmsg_type == UDP_GRO {
                // CMSG_DATA: the value follows the aligned header.
                let data = at + align(hdr);
                let v = self.0.get(data..data + 4).filter(|_| data + 4 <= at + len)?;
                return usize::try_from(libc::c_int::from_ne_bytes(v.try_into().ok()?)).ok();
            }
            at += align(len);
        }
        None
    }
}

/// Points send header `h`'s control message at `buf` and writes a
/// `UDP_SEGMENT` message of `seg` bytes there: the kernel cuts the
/// message's payload into datagrams of `seg` bytes (the last one may be
/// shorter). `h` keeps a pointer to `buf`, which must stay put until the
/// send.
pub fn set_gso_segment(h: &mut libc::msghdr, buf: &mut CmsgBuf, seg: u16) {
    h.msg_control = buf.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size.
    h.msg_controllen = unsafe { libc::CMSG_SPACE(2) } as _;
    // SAFETY: msg_control points to buf's 32 writable, 8-aligned bytes, at
    // least CMSG_SPACE(2) (asserted at compile time); CMSG_FIRSTHDR returns
    // their start and CMSG_DATA a pointer with room for 2 bytes after it.
    // UDP_SEGMENT's value is a u16, and its cmsg_len must be exactly
    // CMSG_LEN(2) (the kernel checks).
    unsafe {
        let cm = libc::CMSG_FIRSTHDR(h);
        (*cm).cmsg_level = SOL_UDP;
        (*cm).cmsg_type = UDP_SEGMENT;
        (*cm).cmsg_len = libc::CMSG_LEN(2) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cm).cast::<u16>(), seg);
    }
}

/// Sets receive header `h` up for one message: its source address goes to
/// `name` (a plain C sockaddr type: the kernel writes up to its size), its
/// payload to `iov`, and, with `gro`, a GRO train's segment size to `cmsg`
/// (read it back with [`CmsgBuf::gro_segment`]). `h` keeps pointers to all
/// three, which must stay put until the receive.
pub fn set_rx_header<A>(
    h: &mut libc::mmsghdr,
    name: &mut A,
    iov: &mut libc::iovec,
    cmsg: &mut CmsgBuf,
    gro: bool,
) {
    h.msg_hdr.msg_name = (name as *mut A).cast();
    h.msg_hdr.msg_namelen = socklen::<A>();
    h.msg_hdr.msg_iov = iov;
    h.msg_hdr.msg_iovlen = 1;
    h.msg_hdr.msg_control = cmsg.0.as_mut_ptr().cast();
    h.msg_hdr.msg_controllen = if gro { CmsgBuf::LEN as _ } else { 0 };
    h.msg_hdr.msg_flags = 0;
    h.msg_len = 0;
}

/// How many datagrams one GSO train carries, starting with one of `seg`
/// bytes. `next(k)`, for k = 1, 2, ..., gives the length of the k-th
/// datagram after the first, or `None` where it may not join (another
/// destination, the end of the list, or one that must travel alone). A
/// train takes datagrams of at most `seg` bytes (none empty) up to
/// [`MAX_SEGMENTS`] and [`MAX_TRAIN_BYTES`]; a shorter one ends it. The
/// caller decides whether the first may start a train at all (GSO on, a
/// payload).
pub fn train_len(seg: usize, mut next: impl FnMut(usize) -> Option<usize>) -> usize {
    let (mut n, mut bytes) = (1, seg);
    while n < MAX_SEGMENTS {
        let Some(len) = next(n) else {
            break;
        };
        if len > seg || len == 0 || bytes + len > MAX_TRAIN_BYTES {
            break;
        }
        bytes += len;
        n += 1;
        if len < seg {
            break; // a shorter datagram ends the train
        }
    }
    n
}

/// Sets an `int` socket option.
pub fn setsockopt_int(
    sock: &impl AsFd,
    level: libc::c_int,
    name: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    // SAFETY: the descriptor is open (borrowed from its owner); the value
    // points to a live c_int of the stated length for the duration of the
    // call.
    let r = unsafe {
        libc::setsockopt(
            sock.as_fd().as_raw_fd(),
            level,
            name,
            (&v as *const libc::c_int).cast(),
            socklen::<libc::c_int>(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `size_of::<T>()` as a `socklen_t`, for the small C values (addresses,
/// ints) handed to the kernel; a type over 64 KiB fails to compile.
// Cast: the size is at most 64 KiB by the const assertion.
#[allow(clippy::cast_possible_truncation)]
pub const fn socklen<T>() -> libc::socklen_t {
    const { assert!(std::mem::size_of::<T>() <= 1 << 16) };
    std::mem::size_of::<T>() as libc::socklen_t
}

/// Reads an `int` socket option.
pub fn getsockopt_int(sock: &impl AsFd, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = socklen::<libc::c_int>();
    // SAFETY: the descriptor is open; `v` and `len` are live for the call
    // and `len` states v's size.
    let r = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            level,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(v)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The socket's receive buffer as the kernel enforces it: `SO_RCVBUF`,
/// which reports twice what was asked (the kernel charges each queued
/// datagram its buffer's true size, about twice a datagram on loopback,
/// against this figure and drops what arrives past it).
pub fn rx_buffer_bytes(sock: &impl AsFd) -> io::Result<usize> {
    let v = getsockopt_int(sock, libc::SOL_SOCKET, libc::SO_RCVBUF)?;
    usize::try_from(v).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("SO_RCVBUF {v}")))
}

/// `SO_MEMINFO` (asm-generic/socket.h): the socket's memory counters, an
/// array of `u32`.
const SO_MEMINFO: libc::c_int = 55;
/// `SK_MEMINFO_DROPS`: the index of the drop count in `SO_MEMINFO`'s array
/// (linux/sock_diag.h); `SK_MEMINFO_VARS` is one more.
const SK_MEMINFO_DROPS: usize = 8;

/// Datagrams the kernel dropped at this socket since it was opened, before
/// anyone read them: its receive buffer was full (or, rarer, a bad UDP
/// checksum). `SO_MEMINFO`'s `SK_MEMINFO_DROPS`, a 32-bit count that
/// wraps. Reading it costs the socket's owner nothing: any thread holding
/// a duplicate of the descriptor may ask.
pub fn socket_drops(sock: &impl AsFd) -> io::Result<u32> {
    let mut v = [0u32; SK_MEMINFO_DROPS + 1];
    let mut len = socklen::<[u32; SK_MEMINFO_DROPS + 1]>();
    // SAFETY: the descriptor is open (borrowed from its owner); `v` and
    // `len` are live for the call and `len` states v's size, which the
    // kernel writes at most of.
    let r = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            SO_MEMINFO,
            v.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // Cast: len <= the array's 36 bytes (the kernel copies at most that).
    if (len as usize) < std::mem::size_of_val(&v) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("SO_MEMINFO returned {len} bytes, no drop count"),
        ));
    }
    Ok(v[SK_MEMINFO_DROPS])
}

/// Asks for `bytes` of receive and send buffer: `SO_RCVBUFFORCE` and
/// `SO_SNDBUFFORCE` first (root or CAP_NET_ADMIN; they may exceed
/// `net.core.rmem_max`/`wmem_max`), the capped `SO_RCVBUF`/`SO_SNDBUF`
/// otherwise. Failure is tolerated: read back what was granted with
/// [`getsockopt_int`].
pub fn set_buffers(sock: &impl AsFd, bytes: usize) {
    let b = libc::c_int::try_from(bytes).map_or(i32::MAX / 2, |b| b.min(i32::MAX / 2));
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        if setsockopt_int(sock, libc::SOL_SOCKET, force, b).is_err() {
            let _ = setsockopt_int(sock, libc::SOL_SOCKET, plain, b);
        }
    }
}

/// Turns `UDP_GRO` on; returns whether the kernel accepted it.
pub fn enable_gro(sock: &impl AsFd) -> bool {
    setsockopt_int(sock, SOL_UDP, UDP_GRO, 1).is_ok()
}

/// Waits until `sock` is readable or `ms` milliseconds have passed (0: do
/// not wait); returns whether it is readable. An interrupted wait reads as
/// not readable.
pub fn poll_readable(sock: &impl AsFd, ms: libc::c_int) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: sock.as_fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
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

/// An IPv4 address in the kernel's layout.
pub fn sockaddr_in(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        // Cast: AF_INET is 2.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

/// The address a `sockaddr_in` holds.
pub fn socket_addr_v4(s: &libc::sockaddr_in) -> SocketAddrV4 {
    SocketAddrV4::new(s.sin_addr.s_addr.to_ne_bytes().into(), u16::from_be(s.sin_port))
}

/// Receives up to `hdrs.len()` waiting messages with one non-blocking
/// `recvmmsg`; returns how many arrived (each header's `msg_len`, name and
/// control length are the kernel's). Nothing waiting, or an interrupted
/// call, is `Ok(0)`.
///
/// # Safety
///
/// Every header must be set up for receiving (as [`set_rx_header`] does):
/// its name, iovec and control pointers point to live memory of the stated
/// lengths that nothing else reads or writes during the call and that any
/// bytes are valid for (plain C data, byte buffers).
pub unsafe fn recv_mmsg(sock: &impl AsFd, hdrs: &mut [libc::mmsghdr]) -> io::Result<usize> {
    let len = libc::c_uint::try_from(hdrs.len()).unwrap_or(libc::c_uint::MAX);
    // SAFETY: `hdrs` holds `len` live headers; the caller vouches for the
    // memory they point to.
    let n = unsafe {
        libc::recvmmsg(
            sock.as_fd().as_raw_fd(),
            hdrs.as_mut_ptr(),
            len,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    let Ok(n) = usize::try_from(n) else {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
            _ => Err(e),
        };
    };
    Ok(n)
}

/// Sends the messages of `hdrs` with one `sendmmsg` (again if interrupted
/// by a signal); returns how many the kernel took, in order (each header's
/// `msg_len` is then what it sent). An error is the first untaken
/// message's: the caller decides whether to skip it ([`is_unreachable`]),
/// send without GSO ([`is_gso_refused`]) or give up.
///
/// # Safety
///
/// Every header's name, iovec and control pointers point to live memory of
/// the stated lengths, not written during the call.
pub unsafe fn send_mmsg(sock: &impl AsFd, hdrs: &mut [libc::mmsghdr]) -> io::Result<usize> {
    if hdrs.is_empty() {
        return Ok(0);
    }
    let len = libc::c_uint::try_from(hdrs.len()).unwrap_or(libc::c_uint::MAX);
    loop {
        // SAFETY: `hdrs` holds `len` live headers; the caller vouches for
        // the memory they point to.
        let r = unsafe { libc::sendmmsg(sock.as_fd().as_raw_fd(), hdrs.as_mut_ptr(), len, 0) };
        if let Ok(n) = usize::try_from(r) {
            return Ok(n);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Whether a send error means the kernel or the device refuses GSO (for a
/// message with a `UDP_SEGMENT` control message): `EIO`, `EINVAL` or
/// `EOPNOTSUPP`.
pub fn is_gso_refused(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EIO) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
    )
}

/// Whether a send error is one destination's (an ICMP unreachable the
/// socket reports): `ECONNREFUSED`, `EHOSTUNREACH` or `ENETUNREACH`. Such a
/// message is skipped, so that one destination cannot stall the others.
pub fn is_unreachable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ECONNREFUSED) | Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH)
    )
}

#[cfg(test)]
// Tests cast small, literal sizes.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
mod tests {
    use super::*;
    use std::net::{SocketAddr, UdpSocket};

    fn v4(s: &UdpSocket) -> SocketAddrV4 {
        match s.local_addr().unwrap() {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(a) => panic!("{a}: bound to 127.0.0.1, got IPv6"),
        }
    }

    #[test]
    fn trains_take_equal_then_one_shorter_datagram() {
        let lens = [100usize, 100, 100, 40, 100];
        let from = |i: usize| move |k: usize| lens.get(i + k).copied();
        assert_eq!(train_len(100, from(0)), 4, "three full and the short tail");
        assert_eq!(train_len(100, from(4)), 1, "end of the list");
        // A longer one, or an empty one, does not join.
        assert_eq!(train_len(100, |k| [100, 150][..].get(k - 1).copied()), 2);
        assert_eq!(train_len(100, |k| (k == 1).then_some(0)), 1);
        // None: another destination.
        assert_eq!(train_len(100, |k| (k < 3).then_some(100)), 3);
    }

    #[test]
    fn trains_stop_at_the_segment_and_byte_caps() {
        assert_eq!(train_len(10, |_| Some(10)), MAX_SEGMENTS);
        let seg = 8192;
        assert_eq!(train_len(seg, |_| Some(seg)), MAX_TRAIN_BYTES / seg);
        // The last that fits may be a shorter one.
        assert_eq!(
            train_len(30_000, |k| Some(if k == 1 { 30_000 } else { 5_507 })),
            3
        );
        assert_eq!(
            train_len(30_000, |k| Some(if k == 1 { 30_000 } else { 5_508 })),
            2
        );
    }

    #[test]
    fn addresses_round_trip() {
        let a = SocketAddrV4::new([10, 1, 2, 3].into(), 9000);
        let s = sockaddr_in(a);
        assert_eq!(u16::from_be(s.sin_port), 9000);
        assert_eq!(s.sin_addr.s_addr.to_ne_bytes(), [10, 1, 2, 3]);
        assert_eq!(socket_addr_v4(&s), a);
    }

    /// A control buffer as the kernel would fill it: one message of
    /// `level`/`kind` carrying `v`, its cmsg_len `len`.
    fn cmsg(level: libc::c_int, kind: libc::c_int, v: libc::c_int, len: usize) -> CmsgBuf {
        let mut b = CmsgBuf::new();
        let c = libc::cmsghdr {
            cmsg_len: len as _,
            cmsg_level: level,
            cmsg_type: kind,
        };
        let mut put = |at: usize, bytes: &[u8]| b.0[at..at + bytes.len()].copy_from_slice(bytes);
        put(
            std::mem::offset_of!(libc::cmsghdr, cmsg_len),
            &c.cmsg_len.to_ne_bytes(),
        );
        put(
            std::mem::offset_of!(libc::cmsghdr, cmsg_level),
            &level.to_ne_bytes(),
        );
        put(
            std::mem::offset_of!(libc::cmsghdr, cmsg_type),
            &kind.to_ne_bytes(),
        );
        put(std::mem::size_of::<libc::cmsghdr>(), &v.to_ne_bytes());
        b
    }

    #[test]
    fn gro_segment_reads_only_a_whole_udp_gro_message() {
        let h = std::mem::size_of::<libc::cmsghdr>();
        let full = h + 4;
        assert_eq!(cmsg(SOL_UDP, UDP_GRO, 1234, full).segment_in(h + 8), Some(1234));
        assert_eq!(
            cmsg(SOL_UDP, UDP_GRO, 1234, full).segment_in(0),
            None,
            "no control data"
        );
        assert_eq!(
            cmsg(SOL_UDP, UDP_GRO, 1234, full).segment_in(h),
            None,
            "data cut off"
        );
        assert_eq!(
            cmsg(SOL_UDP, UDP_GRO, 1234, h).segment_in(h + 8),
            None,
            "cmsg_len too short"
        );
        assert_eq!(
            cmsg(SOL_UDP, UDP_SEGMENT, 1234, full).segment_in(h + 8),
            None,
            "other type"
        );
        assert_eq!(
            cmsg(libc::SOL_IP, UDP_GRO, 1234, full).segment_in(h + 8),
            None,
            "other level"
        );
        assert_eq!(
            cmsg(SOL_UDP, UDP_GRO, -1, full).segment_in(h + 8),
            None,
            "negative"
        );
    }

    #[test]
    fn socket_drops_counts_what_a_full_receive_buffer_turned_away() {
        let (a, b) = (
            UdpSocket::bind("127.0.0.1:0").unwrap(),
            UdpSocket::bind("127.0.0.1:0").unwrap(),
        );
        assert_eq!(socket_drops(&b).unwrap(), 0, "a new socket has dropped nothing");
        // The smallest buffer the kernel grants holds one such datagram.
        let _ = setsockopt_int(&b, libc::SOL_SOCKET, libc::SO_RCVBUF, 1);
        let got = rx_buffer_bytes(&b).unwrap();
        assert!(got > 0 && got < 64 << 10, "SO_RCVBUF {got}");
        let to = b.local_addr().unwrap();
        for _ in 0..64 {
            a.send_to(&[7u8; 8192], to).unwrap();
        }
        // Loopback delivers in softirq context, almost always before
        // send_to returns; give a late backlog time to drain.
        std::thread::sleep(std::time::Duration::from_millis(100));
        let dropped = socket_drops(&b).unwrap();
        assert!(
            dropped >= 32,
            "64 datagrams of 8 KiB into a {got}-byte buffer nobody reads: {dropped} counted as dropped"
        );
        let mut buf = [0u8; 9000];
        b.set_nonblocking(true).unwrap();
        let mut read = 0u32;
        while b.recv(&mut buf).is_ok() {
            read += 1;
        }
        assert_eq!(
            read + dropped,
            64,
            "every datagram either read or counted as dropped"
        );
    }

    #[test]
    fn buffers_grow_to_what_was_asked_or_the_cap() {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let bytes = 3 << 20;
        set_buffers(&s, bytes);
        let rmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let got = getsockopt_int(&s, libc::SOL_SOCKET, libc::SO_RCVBUF).unwrap() as usize;
        // The kernel reports twice what it granted (its bookkeeping).
        assert!(
            got >= 2 * bytes.min(rmem_max),
            "SO_RCVBUF {got}, rmem_max {rmem_max}"
        );
    }

    #[test]
    fn poll_sees_a_waiting_datagram() {
        let (a, b) = (
            UdpSocket::bind("127.0.0.1:0").unwrap(),
            UdpSocket::bind("127.0.0.1:0").unwrap(),
        );
        assert!(!poll_readable(&b, 0).unwrap(), "nothing sent yet");
        a.send_to(b"x", b.local_addr().unwrap()).unwrap();
        assert!(poll_readable(&b, 5000).unwrap());
    }

    /// One GSO train of 100, 100 and 40 bytes (4 iovecs: header and body
    /// apart), sent with one sendmmsg, received with recvmmsg.
    fn train_round_trip(gro: bool) {
        let (a, b) = (
            UdpSocket::bind("127.0.0.1:0").unwrap(),
            UdpSocket::bind("127.0.0.1:0").unwrap(),
        );
        let gro = gro && enable_gro(&b);
        let d: Vec<Vec<u8>> = [100usize, 100, 40]
            .iter()
            .enumerate()
            .map(|(i, &n)| vec![i as u8 + 1; n])
            .collect();
        let parts: [&[u8]; 4] = [&d[0][..10], &d[0][10..], &d[1], &d[2]];
        let mut iov: Vec<libc::iovec> = parts
            .iter()
            .map(|p| libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            })
            .collect();
        let mut to = sockaddr_in(v4(&b));
        let mut cm = CmsgBuf::new();
        // SAFETY: all-zero is a valid mmsghdr.
        let mut h: [libc::mmsghdr; 1] = [unsafe { std::mem::zeroed() }];
        h[0].msg_hdr.msg_name = (&mut to as *mut libc::sockaddr_in).cast();
        h[0].msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        h[0].msg_hdr.msg_iov = iov.as_mut_ptr();
        h[0].msg_hdr.msg_iovlen = iov.len() as _;
        set_gso_segment(&mut h[0].msg_hdr, &mut cm, 100);
        // SAFETY: the name, iovecs and control buffer are live locals and
        // the payloads are borrowed for the call.
        assert_eq!(unsafe { send_mmsg(&a, &mut h) }.unwrap(), 1);
        assert_eq!(h[0].msg_len, 240);

        const SLOTS: usize = 4;
        let mut mem = vec![0u8; SLOTS * 65536];
        let mut names = [sockaddr_in(SocketAddrV4::new([0; 4].into(), 0)); SLOTS];
        let mut rx_iov: Vec<libc::iovec> = mem
            .chunks_mut(65536)
            .map(|c| libc::iovec {
                iov_base: c.as_mut_ptr().cast(),
                iov_len: c.len(),
            })
            .collect();
        let mut cms = [CmsgBuf::new(); SLOTS];
        // SAFETY: as above.
        let mut rx: [libc::mmsghdr; SLOTS] = [unsafe { std::mem::zeroed() }; SLOTS];
        let mut got: Vec<(SocketAddrV4, Vec<u8>)> = Vec::new();
        let mut messages = Vec::new();
        while got.len() < 3 {
            assert!(poll_readable(&b, 5000).unwrap(), "the datagrams arrive");
            for i in 0..SLOTS {
                set_rx_header(&mut rx[i], &mut names[i], &mut rx_iov[i], &mut cms[i], gro);
            }
            // SAFETY: set_rx_header pointed every header at this function's
            // names, iovecs (into `mem`) and control buffers, which are not
            // touched until the call returns.
            let n = unsafe { recv_mmsg(&b, &mut rx) }.unwrap();
            for i in 0..n {
                let len = rx[i].msg_len as usize;
                let seg = cms[i].gro_segment(&rx[i].msg_hdr);
                messages.push((len, seg));
                let data = &mem[i * 65536..i * 65536 + len];
                for c in data.chunks(seg.unwrap_or(len).max(1)) {
                    got.push((socket_addr_v4(&names[i]), c.to_vec()));
                }
            }
        }
        let from = v4(&a);
        assert_eq!(got, d.iter().map(|p| (from, p.clone())).collect::<Vec<_>>());
        if gro {
            assert_eq!(messages, [(240, Some(100))], "one GRO message");
        } else {
            assert_eq!(
                messages,
                [(100, None), (100, None), (40, None)],
                "cut by the kernel"
            );
        }
    }

    #[test]
    fn gso_train_arrives_as_one_gro_message() {
        train_round_trip(true);
    }

    #[test]
    fn gso_train_arrives_cut_without_gro() {
        train_round_trip(false);
    }
}
