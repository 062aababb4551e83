//! Ethernet/ARP/IPv4/UDP framing for the DPDK backend: pure functions over
//! byte slices (the same code runs over a test's array and an mbuf's data).
//!
//! Received frames are classified by [`parse`] into a UDP datagram for the
//! appliance, an ARP request to answer, or a [`NetDrop`] reason, without
//! panicking or allocating. Sent frames get their headers from
//! [`write_udp_headers`] (the IPv4 checksum is computed there, 20 bytes),
//! results' frames from [`ResultHeaders`]: the headers and both checksums'
//! shares that all destinations have in common, with the payload's sum
//! ([`payload_sum`]), once per result, and per destination only what is
//! its own.
//!
//! Received UDP checksums are verified here when asked
//! ([`ParseOptions::check_udp_checksum`]: the device does not): 0 means the
//! sender sent none (RFC 768), and a field holding just the pseudo-header's
//! sum means the sender's kernel left the rest to a NIC that a veth pair is
//! not (CHECKSUM_PARTIAL: what af_packet shows of a local sender's frames,
//! since DPDK's af_packet driver drops the kernel's "checksum not ready"
//! status); those two pass unverified, anything else must verify.

use std::net::Ipv4Addr;
use std::ops::Range;

use crate::counters::NetDrop;

/// Ethernet header length (no VLAN tag).
pub const ETH_LEN: usize = 14;
/// IPv4 header length without options.
pub const IPV4_LEN: usize = 20;
/// UDP header length.
pub const UDP_LEN: usize = 8;
/// Ethernet + IPv4 + UDP: where the UDP payload starts in frames we send.
pub const L2_L4_LEN: usize = ETH_LEN + IPV4_LEN + UDP_LEN;

const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_ARP: u16 = 0x0806;
const IPPROTO_UDP: u8 = 17;

/// A peer as the DPDK backend knows it: where its frames came from, and so
/// where its results go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerAddr {
    /// Its Ethernet address.
    pub mac: [u8; 6],
    /// Its IPv4 address.
    pub ip: Ipv4Addr,
    /// Its UDP port.
    pub port: u16,
}

/// What a received frame is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A UDP datagram for the appliance's address.
    Udp {
        /// The sender.
        from: PeerAddr,
        /// Destination UDP port.
        dst_port: u16,
        /// The UDP payload's bytes within the frame.
        payload: Range<usize>,
    },
    /// An ARP request for the appliance's address.
    ArpRequest,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// The one's-complement sum of `data` as big-endian 16-bit words (an odd
/// last byte padded with zero), folded to 16 bits. Summed as little-endian
/// words and byte-swapped at the end: such sums do not depend on byte
/// order (RFC 1071, section 2). Whole datagrams are summed here when the
/// device does not check them, so large inputs take AVX2 where the CPU
/// has it.
fn ones_sum(data: &[u8]) -> u16 {
    if data.len() < 64 {
        // Headers (IPv4, pseudo-header parts): four bytes at a time.
        let mut sum: u64 = 0;
        let mut words = data.chunks_exact(4);
        for w in &mut words {
            sum += u64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
        }
        for c in words.remainder().chunks(2) {
            sum += u64::from(u16::from_le_bytes([c[0], c.get(1).copied().unwrap_or(0)]));
        }
        return fold(sum).swap_bytes();
    }
    #[cfg(target_arch = "x86_64")]
    if data.len() >= 256 && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { ones_sum_avx2(data) };
    }
    ones_sum_lanes(data)
}

/// [`ones_sum_lanes`] compiled for AVX2.
///
/// # Safety
///
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn ones_sum_avx2(data: &[u8]) -> u16 {
    ones_sum_lanes(data)
}

/// [`ones_sum`] in 16 independent 32-bit lanes of 16-bit words (a shape
/// the compiler vectorises), each lane taking at most 2^15 words before
/// they are added up, so none can overflow.
#[inline(always)]
fn ones_sum_lanes(data: &[u8]) -> u16 {
    const LANES: usize = 16;
    const BLOCK: usize = 2 * LANES;
    let mut total: u64 = 0;
    // Pieces of an even length keep every 16-bit word whole.
    for piece in data.chunks(BLOCK << 15) {
        let mut acc = [0u32; LANES];
        let mut blocks = piece.chunks_exact(BLOCK);
        for b in &mut blocks {
            for (j, a) in acc.iter_mut().enumerate() {
                *a += u32::from(u16::from_le_bytes([b[2 * j], b[2 * j + 1]]));
            }
        }
        total += acc.iter().map(|&a| u64::from(a)).sum::<u64>();
        for c in blocks.remainder().chunks(2) {
            total += u64::from(u16::from_le_bytes([c[0], c.get(1).copied().unwrap_or(0)]));
        }
    }
    fold(total).swap_bytes()
}

/// Copies `src` into `dst` (of the same length) and returns [`ones_sum`]
/// of it: one pass over the bytes instead of a copy and then a sum. Large
/// inputs take AVX2 where the CPU has it.
fn copy_ones_sum(dst: &mut [u8], src: &[u8]) -> u16 {
    assert_eq!(dst.len(), src.len(), "copy_ones_sum: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if src.len() >= 256 && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { copy_ones_sum_avx2(dst, src) };
    }
    if src.len() >= 64 {
        return copy_ones_sum_lanes(dst, src);
    }
    dst.copy_from_slice(src);
    ones_sum(src)
}

/// [`copy_ones_sum_lanes`] compiled for AVX2.
///
/// # Safety
///
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_ones_sum_avx2(dst: &mut [u8], src: &[u8]) -> u16 {
    copy_ones_sum_lanes(dst, src)
}

/// [`ones_sum_lanes`] that also stores each block where it goes, right
/// after loading it. (For 8 KiB from cache into cold memory, as a result
/// is copied, this took 0.46–0.50 us on the development VM's EPYC against
/// 0.65–0.78 us for the C library's copy alone, which uses a string-move
/// instruction at that size, and 0.85–0.97 us for that copy and a sum.)
#[inline(always)]
fn copy_ones_sum_lanes(dst: &mut [u8], src: &[u8]) -> u16 {
    const LANES: usize = 16;
    const BLOCK: usize = 2 * LANES;
    let mut total: u64 = 0;
    for (to, piece) in dst.chunks_mut(BLOCK << 15).zip(src.chunks(BLOCK << 15)) {
        let mut acc = [0u32; LANES];
        let mut blocks = piece.chunks_exact(BLOCK);
        let mut outs = to.chunks_exact_mut(BLOCK);
        for (b, o) in (&mut blocks).zip(&mut outs) {
            let b: &[u8; BLOCK] = b.try_into().expect("chunks_exact");
            o.copy_from_slice(b);
            for (j, a) in acc.iter_mut().enumerate() {
                *a += u32::from(u16::from_le_bytes([b[2 * j], b[2 * j + 1]]));
            }
        }
        total += acc.iter().map(|&a| u64::from(a)).sum::<u64>();
        let rest = blocks.remainder();
        outs.into_remainder().copy_from_slice(rest);
        for c in rest.chunks(2) {
            total += u64::from(u16::from_le_bytes([c[0], c.get(1).copied().unwrap_or(0)]));
        }
    }
    fold(total).swap_bytes()
}

/// Folds a one's-complement sum to 16 bits (end-around carries).
fn fold(mut sum: u64) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The Internet checksum (RFC 1071) of `data`: IPv4 headers here.
pub fn ip_checksum(data: &[u8]) -> u16 {
    !ones_sum(data)
}

/// The sum of the UDP pseudo-header (addresses, protocol, UDP length).
fn pseudo_header_sum(src: &[u8], dst: &[u8], udp_len: usize) -> u64 {
    u64::from(ones_sum(src)) + u64::from(ones_sum(dst)) + u64::from(IPPROTO_UDP) + udp_len as u64
}

/// The checksum field for the UDP datagram `udp` (header and payload; its
/// own checksum field is left out of the sum) from `src` to `dst`: 0xffff
/// where the checksum comes out 0, since 0 means "no checksum" (RFC 768).
pub fn udp_checksum(src: Ipv4Addr, dst: Ipv4Addr, udp: &[u8]) -> u16 {
    let (head, rest) = udp.split_at(udp.len().min(6));
    let body = rest.get(2..).unwrap_or_default();
    udp_field(
        pseudo_header_sum(&src.octets(), &dst.octets(), udp.len())
            + u64::from(ones_sum(head))
            + u64::from(ones_sum(body)),
    )
}

/// A UDP checksum `field` updated for the bytes `old` of its datagram
/// becoming `new` (of the same even length, at an even offset), without
/// summing the rest again (RFC 1624: HC' = ~(~HC + ~m + m')); 0 ("no
/// checksum") stays 0, and a result of 0 goes out as 0xffff (RFC 768).
pub fn udp_checksum_update(field: u16, old: &[u8], new: &[u8]) -> u16 {
    assert_eq!(old.len(), new.len(), "udp_checksum_update: lengths differ");
    if field == 0 {
        return 0;
    }
    // ~m is 0xffff - m for each word: the complement of old's sum.
    let sum = u64::from(!field) + u64::from(!ones_sum(old)) + u64::from(ones_sum(new));
    udp_field(sum)
}

/// The UDP checksum field for a datagram whose one's-complement sum
/// (pseudo-header, header with the field 0, payload) is `sum`: 0xffff where
/// the checksum comes out 0, since 0 means "no checksum" (RFC 768).
fn udp_field(sum: u64) -> u16 {
    match !fold(sum) {
        0 => 0xffff,
        c => c,
    }
}

/// The one's-complement sum of a datagram's UDP payload given in two parts
/// (phub header, then values), for [`ResultHeaders::new`]: computed once per
/// result and shared by every destination's frame. `head` has an even
/// length, so `tail`'s 16-bit words stay whole.
pub fn payload_sum(head: &[u8], tail: &[u8]) -> u16 {
    debug_assert!(
        head.len().is_multiple_of(2),
        "an odd head would shift the tail's words"
    );
    fold(u64::from(ones_sum(head)) + u64::from(ones_sum(tail)))
}

/// [`payload_sum`], copying `tail` into `out` (of the same length) on the
/// way: a result's one copy into its payload mbuf and its checksum's sum
/// in one pass.
pub fn copy_payload_sum(head: &[u8], tail: &[u8], out: &mut [u8]) -> u16 {
    debug_assert!(
        head.len().is_multiple_of(2),
        "an odd head would shift the tail's words"
    );
    fold(u64::from(ones_sum(head)) + u64::from(copy_ones_sum(out, tail)))
}

/// The Ethernet, IPv4 and UDP headers of one result's frames, which differ
/// only in where they go: everything else, and its part of both checksums,
/// is worked out once per result ([`ResultHeaders::new`]), so each
/// destination ([`ResultHeaders::write`]) adds only its MAC, address and
/// port, and neither checksum reads a header back.
#[derive(Debug, Clone, Copy)]
pub struct ResultHeaders {
    /// The headers with the destination's fields and both checksums 0.
    base: [u8; L2_L4_LEN],
    /// One's-complement sum of `base`'s IPv4 header.
    ip: u64,
    /// Of the UDP pseudo-header's source address, protocol and length,
    /// `base`'s UDP header and the payload.
    udp: u64,
}

impl ResultHeaders {
    /// Headers from `src_mac`, `src_ip` and `src_port` for a datagram of
    /// `udp_payload` bytes whose one's-complement sum is `payload`
    /// ([`payload_sum`]).
    pub fn new(
        src_mac: [u8; 6],
        src_ip: Ipv4Addr,
        src_port: u16,
        udp_payload: usize,
        payload: u16,
    ) -> ResultHeaders {
        let mut base = [0u8; L2_L4_LEN];
        let nowhere = PeerAddr {
            mac: [0; 6],
            ip: Ipv4Addr::UNSPECIFIED,
            port: 0,
        };
        write_unsummed_headers(&mut base, src_mac, src_ip, src_port, &nowhere, udp_payload);
        let udp = ETH_LEN + IPV4_LEN;
        ResultHeaders {
            base,
            ip: u64::from(ones_sum(&base[ETH_LEN..udp])),
            udp: pseudo_header_sum(&src_ip.octets(), &nowhere.ip.octets(), UDP_LEN + udp_payload)
                + u64::from(ones_sum(&base[udp..]))
                + u64::from(payload),
        }
    }

    /// Writes the headers of the frame for `to` into `out`, checksums
    /// filled in.
    pub fn write(&self, out: &mut [u8; L2_L4_LEN], to: &PeerAddr) {
        let udp = ETH_LEN + IPV4_LEN;
        *out = self.base;
        out[0..6].copy_from_slice(&to.mac);
        let ip = to.ip.octets();
        out[ETH_LEN + 16..udp].copy_from_slice(&ip);
        out[udp + 2..udp + 4].copy_from_slice(&to.port.to_be_bytes());
        let dst = u64::from(ones_sum(&ip));
        out[ETH_LEN + 10..ETH_LEN + 12].copy_from_slice(&(!fold(self.ip + dst)).to_be_bytes());
        let field = udp_field(self.udp + dst + u64::from(to.port));
        out[udp + 6..udp + 8].copy_from_slice(&field.to_be_bytes());
    }
}

/// Whether a received UDP datagram's checksum field is acceptable: none
/// (0), left partial by the sender's kernel (the pseudo-header's sum
/// alone), or verifying over the pseudo-header and `udp` (header and
/// payload, `udp.len()` its length).
fn udp_checksum_ok(ip: &[u8], udp: &[u8]) -> bool {
    let field = be16(udp, 6);
    if field == 0 {
        return true;
    }
    let pseudo = pseudo_header_sum(&ip[12..16], &ip[16..20], udp.len());
    field == fold(pseudo) || fold(pseudo + u64::from(ones_sum(udp))) == 0xffff
}

/// An IPv4 header's length in bytes, from its IHL field.
fn ihl(ip: &[u8]) -> usize {
    usize::from(ip[0] & 0x0f) * 4
}

/// Options for [`parse`].
#[derive(Debug, Clone, Copy)]
pub struct ParseOptions {
    /// The appliance's IPv4 address.
    pub ip: Ipv4Addr,
    /// Verify the IPv4 header checksum in software (false when the NIC
    /// checked it).
    pub check_ip_checksum: bool,
    /// Verify UDP checksums in software (false when the NIC checked them);
    /// see the module documentation for the two values that pass
    /// unverified.
    pub check_udp_checksum: bool,
}

/// Classifies a received frame.
pub fn parse(f: &[u8], opts: &ParseOptions) -> Result<Frame, NetDrop> {
    if f.len() < ETH_LEN {
        return Err(NetDrop::NotIpv4);
    }
    match be16(f, 12) {
        ETHERTYPE_IPV4 => {}
        ETHERTYPE_ARP => return parse_arp(f, opts.ip),
        _ => return Err(NetDrop::NotIpv4),
    }
    let ip = &f[ETH_LEN..];
    if ip.len() < IPV4_LEN || ip[0] >> 4 != 4 {
        return Err(NetDrop::BadIpHeader);
    }
    let ihl = ihl(ip);
    let total = usize::from(be16(ip, 2));
    if ihl < IPV4_LEN || total < ihl || total > ip.len() {
        return Err(NetDrop::BadIpHeader);
    }
    if opts.check_ip_checksum && ip_checksum(&ip[..ihl]) != 0 {
        return Err(NetDrop::BadIpChecksum);
    }
    // More-fragments flag or a fragment offset.
    if be16(ip, 6) & 0x3fff != 0 {
        return Err(NetDrop::IpFragment);
    }
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    if dst != opts.ip {
        return Err(NetDrop::NotOurAddress);
    }
    if ip[9] != IPPROTO_UDP {
        return Err(NetDrop::NotUdp);
    }
    let udp = &ip[ihl..total];
    if udp.len() < UDP_LEN {
        return Err(NetDrop::BadUdpLength);
    }
    let ulen = usize::from(be16(udp, 4));
    if ulen < UDP_LEN || ulen > udp.len() {
        return Err(NetDrop::BadUdpLength);
    }
    if opts.check_udp_checksum && !udp_checksum_ok(ip, &udp[..ulen]) {
        return Err(NetDrop::BadUdpChecksum);
    }
    let start = ETH_LEN + ihl + UDP_LEN;
    Ok(Frame::Udp {
        from: PeerAddr {
            mac: [f[6], f[7], f[8], f[9], f[10], f[11]],
            ip: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
            port: be16(udp, 0),
        },
        dst_port: be16(udp, 2),
        payload: start..start + ulen - UDP_LEN,
    })
}

/// Whether the IPv4 header checksum of a frame [`parse`] accepted verifies
/// (for frames whose NIC checks them but left this one unchecked).
pub fn ip_checksum_verifies(f: &[u8]) -> bool {
    ip_checksum(&f[ETH_LEN..ETH_LEN + ihl(&f[ETH_LEN..])]) == 0
}

/// Whether the UDP checksum of a frame [`parse`] accepted as
/// [`Frame::Udp`] with `payload` is acceptable (as when
/// [`ParseOptions::check_udp_checksum`] is set), for frames whose NIC
/// checks them but left this one unchecked.
pub fn udp_checksum_verifies(f: &[u8], payload: &Range<usize>) -> bool {
    udp_checksum_ok(&f[ETH_LEN..], &f[ETH_LEN + ihl(&f[ETH_LEN..])..payload.end])
}

/// ARP over Ethernet for IPv4: header at 14, 28 bytes.
const ARP_LEN: usize = 28;

fn parse_arp(f: &[u8], ip: Ipv4Addr) -> Result<Frame, NetDrop> {
    let a = &f[ETH_LEN..];
    if a.len() < ARP_LEN
        || be16(a, 0) != 1
        || be16(a, 2) != ETHERTYPE_IPV4
        || a[4] != 6
        || a[5] != 4
        || be16(a, 6) != 1
        || a[24..28] != ip.octets()
    {
        return Err(NetDrop::ArpNotForUs);
    }
    Ok(Frame::ArpRequest)
}

/// Turns an ARP request for `ip` (checked by [`parse`]) into the reply
/// from `mac`, in place.
pub fn arp_reply_in_place(f: &mut [u8], mac: [u8; 6], ip: Ipv4Addr) {
    if f.len() < ETH_LEN + ARP_LEN {
        return;
    }
    let requester_mac: [u8; 6] = f[6..12].try_into().unwrap_or([0; 6]);
    f[0..6].copy_from_slice(&requester_mac);
    f[6..12].copy_from_slice(&mac);
    let a = &mut f[ETH_LEN..ETH_LEN + ARP_LEN];
    a[6..8].copy_from_slice(&2u16.to_be_bytes());
    let sha: [u8; 6] = a[8..14].try_into().unwrap_or([0; 6]);
    let spa: [u8; 4] = a[14..18].try_into().unwrap_or([0; 4]);
    a[18..24].copy_from_slice(&sha);
    a[24..28].copy_from_slice(&spa);
    a[8..14].copy_from_slice(&mac);
    a[14..18].copy_from_slice(&ip.octets());
}

/// Writes Ethernet, IPv4 and UDP headers for a datagram of `udp_payload`
/// bytes into `out[..L2_L4_LEN]`.
pub fn write_udp_headers(
    out: &mut [u8; L2_L4_LEN],
    src_mac: [u8; 6],
    src_ip: Ipv4Addr,
    src_port: u16,
    to: &PeerAddr,
    udp_payload: usize,
) {
    write_unsummed_headers(out, src_mac, src_ip, src_port, to, udp_payload);
    let ip = &mut out[ETH_LEN..ETH_LEN + IPV4_LEN];
    let c = ip_checksum(ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
}

/// [`write_udp_headers`] with both checksum fields left 0.
fn write_unsummed_headers(
    out: &mut [u8; L2_L4_LEN],
    src_mac: [u8; 6],
    src_ip: Ipv4Addr,
    src_port: u16,
    to: &PeerAddr,
    udp_payload: usize,
) {
    out[0..6].copy_from_slice(&to.mac);
    out[6..12].copy_from_slice(&src_mac);
    out[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    let total = (IPV4_LEN + UDP_LEN + udp_payload) as u16;
    let ip = &mut out[ETH_LEN..ETH_LEN + IPV4_LEN];
    ip[0] = 0x45;
    ip[1] = 0;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[4..6].copy_from_slice(&0u16.to_be_bytes());
    // Don't fragment.
    ip[6..8].copy_from_slice(&0x4000u16.to_be_bytes());
    ip[8] = 64;
    ip[9] = IPPROTO_UDP;
    ip[10..12].copy_from_slice(&[0, 0]);
    ip[12..16].copy_from_slice(&src_ip.octets());
    ip[16..20].copy_from_slice(&to.ip.octets());
    let udp = &mut out[ETH_LEN + IPV4_LEN..];
    udp[0..2].copy_from_slice(&src_port.to_be_bytes());
    udp[2..4].copy_from_slice(&to.port.to_be_bytes());
    udp[4..6].copy_from_slice(&((UDP_LEN + udp_payload) as u16).to_be_bytes());
    udp[6..8].copy_from_slice(&[0, 0]);
}

/// A whole UDP frame (headers + payload), for tests and generators.
pub fn udp_frame(from: &PeerAddr, to_mac: [u8; 6], to_ip: Ipv4Addr, to_port: u16, payload: &[u8]) -> Vec<u8> {
    let mut h = [0u8; L2_L4_LEN];
    let back = PeerAddr {
        mac: to_mac,
        ip: to_ip,
        port: to_port,
    };
    write_udp_headers(&mut h, from.mac, from.ip, from.port, &back, payload.len());
    let mut v = h.to_vec();
    v.extend_from_slice(payload);
    v
}

/// An ARP request from `from` asking who has `target`.
pub fn arp_request(from: &PeerAddr, target: Ipv4Addr) -> Vec<u8> {
    let mut f = vec![0u8; ETH_LEN + ARP_LEN];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&from.mac);
    f[12..14].copy_from_slice(&ETHERTYPE_ARP.to_be_bytes());
    let a = &mut f[ETH_LEN..];
    a[0..2].copy_from_slice(&1u16.to_be_bytes());
    a[2..4].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    a[4] = 6;
    a[5] = 4;
    a[6..8].copy_from_slice(&1u16.to_be_bytes());
    a[8..14].copy_from_slice(&from.mac);
    a[14..18].copy_from_slice(&from.ip.octets());
    a[24..28].copy_from_slice(&target.octets());
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 1);
    const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

    fn peer() -> PeerAddr {
        PeerAddr {
            mac: [2, 0, 0, 0, 0, 9],
            ip: Ipv4Addr::new(10, 9, 0, 2),
            port: 40000,
        }
    }

    /// A frame from [`peer`] to us, port 7000, with its UDP checksum.
    fn checksummed(payload: &[u8]) -> Vec<u8> {
        let mut f = udp_frame(&peer(), MAC, US, 7000, payload);
        let c = udp_checksum(peer().ip, US, &f[ETH_LEN + IPV4_LEN..]);
        f[40..42].copy_from_slice(&c.to_be_bytes());
        f
    }

    fn opts() -> ParseOptions {
        ParseOptions {
            ip: US,
            check_ip_checksum: true,
            check_udp_checksum: true,
        }
    }

    #[test]
    fn a_frame_we_write_parses_back_with_the_payload_at_128() {
        let payload = [7u8; 86 + 64];
        let f = udp_frame(&peer(), MAC, US, 7900, &payload);
        match parse(&f, &opts()).unwrap() {
            Frame::Udp {
                from,
                dst_port,
                payload: r,
            } => {
                assert_eq!(from, peer());
                assert_eq!(dst_port, 7900);
                assert_eq!(r, 42..42 + payload.len());
                assert_eq!(r.start + 86, 128);
            }
            other => panic!("{other:?}"),
        }
        // Ethernet padding after the datagram is ignored.
        let mut padded = udp_frame(&peer(), MAC, US, 7900, &[1, 2]);
        padded.resize(60, 0);
        assert!(matches!(parse(&padded, &opts()), Ok(Frame::Udp { payload, .. }) if payload == (42..44)));
    }

    #[test]
    fn malformed_frames_are_classified() {
        let good = udp_frame(&peer(), MAC, US, 7900, &[0u8; 100]);
        let p = |f: &[u8]| parse(f, &opts());
        assert_eq!(p(&good[..10]), Err(NetDrop::NotIpv4));
        let mut v = good.clone();
        v[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
        assert_eq!(p(&v), Err(NetDrop::NotIpv4));
        let mut v = good.clone();
        v[14] = 0x65;
        assert_eq!(p(&v), Err(NetDrop::BadIpHeader));
        assert_eq!(p(&good[..30]), Err(NetDrop::BadIpHeader));
        let mut v = good.clone();
        v[24] ^= 0xff;
        assert_eq!(p(&v), Err(NetDrop::BadIpChecksum));
        let mut v = good.clone();
        v[20] |= 0x20; // more fragments
        let c = ip_checksum(&{
            let mut h = v[14..34].to_vec();
            h[10] = 0;
            h[11] = 0;
            h
        });
        v[24..26].copy_from_slice(&c.to_be_bytes());
        assert_eq!(p(&v), Err(NetDrop::IpFragment));
        let other = parse(
            &good,
            &ParseOptions {
                ip: Ipv4Addr::new(10, 9, 0, 3),
                ..opts()
            },
        );
        assert_eq!(other, Err(NetDrop::NotOurAddress));
        let mut v = good.clone();
        v[23] = 6;
        let mut h = v[14..34].to_vec();
        h[10] = 0;
        h[11] = 0;
        v[24..26].copy_from_slice(&ip_checksum(&h).to_be_bytes());
        assert_eq!(p(&v), Err(NetDrop::NotUdp));
        let mut v = good.clone();
        v[38..40].copy_from_slice(&500u16.to_be_bytes());
        assert_eq!(p(&v), Err(NetDrop::BadUdpLength));
        let mut v = good;
        v[38..40].copy_from_slice(&3u16.to_be_bytes());
        assert_eq!(p(&v), Err(NetDrop::BadUdpLength));
    }

    #[test]
    fn arp_requests_for_us_are_answered_in_place() {
        let mut f = arp_request(&peer(), US);
        assert_eq!(parse(&f, &opts()), Ok(Frame::ArpRequest));
        arp_reply_in_place(&mut f, MAC, US);
        assert_eq!(&f[0..6], &peer().mac);
        assert_eq!(&f[6..12], &MAC);
        assert_eq!(be16(&f, 20), 2);
        assert_eq!(&f[22..28], &MAC);
        assert_eq!(&f[28..32], &US.octets());
        assert_eq!(&f[32..38], &peer().mac);
        assert_eq!(&f[38..42], &peer().ip.octets());
        let other = arp_request(&peer(), Ipv4Addr::new(10, 9, 0, 7));
        assert_eq!(parse(&other, &opts()), Err(NetDrop::ArpNotForUs));
        assert_eq!(
            parse(&f, &opts()),
            Err(NetDrop::ArpNotForUs),
            "a reply is not a request"
        );
    }

    #[test]
    fn udp_checksums_are_verified_unless_absent_or_left_partial() {
        let from = peer();
        let payload: Vec<u8> = (0..1001u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut f = udp_frame(&from, MAC, US, 7000, &payload);
        let udp = ETH_LEN + IPV4_LEN;
        let full = udp_checksum(from.ip, US, &f[udp..]);
        // Against RFC 768's definition, one 16-bit word at a time: the sum
        // over pseudo-header and datagram, field included, is all ones.
        f[udp + 6..udp + 8].copy_from_slice(&full.to_be_bytes());
        let mut words: u32 = 17 + (f.len() - udp) as u32;
        for c in f[26..34].chunks(2).chain(f[udp..].chunks(2)) {
            words += u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)]));
        }
        while words >> 16 != 0 {
            words = (words & 0xffff) + (words >> 16);
        }
        assert_eq!(
            words, 0xffff,
            "the checksum we compute verifies by the definition"
        );
        assert!(matches!(parse(&f, &opts()), Ok(Frame::Udp { .. })));

        // One payload bit flipped: dropped, and only when checking.
        let mut bad = f.clone();
        bad[200] ^= 0x10;
        assert_eq!(parse(&bad, &opts()), Err(NetDrop::BadUdpChecksum));
        let trusting = ParseOptions {
            check_udp_checksum: false,
            ..opts()
        };
        assert!(parse(&bad, &trusting).is_ok(), "the NIC checked it");
        // The checksum field itself wrong.
        let mut bad_field = f.clone();
        bad_field[udp + 6] ^= 0x01;
        assert_eq!(parse(&bad_field, &opts()), Err(NetDrop::BadUdpChecksum));

        // No checksum (0) passes, even over a flipped bit.
        let mut none = bad.clone();
        none[udp + 6..udp + 8].copy_from_slice(&[0, 0]);
        assert!(parse(&none, &opts()).is_ok());

        // Left partial (CHECKSUM_PARTIAL over a veth): the field holds the
        // pseudo-header's folded sum. The value af_packet showed of a local
        // kernel sender's datagram, 10.231.0.2 -> 10.231.0.1, UDP length
        // 1032: 0x19ea.
        let mut partial = udp_frame(
            &PeerAddr {
                ip: Ipv4Addr::new(10, 231, 0, 2),
                ..from
            },
            MAC,
            Ipv4Addr::new(10, 231, 0, 1),
            9999,
            &[0x5a; 1024],
        );
        partial[udp + 6..udp + 8].copy_from_slice(&0x19eau16.to_be_bytes());
        let them = ParseOptions {
            ip: Ipv4Addr::new(10, 231, 0, 1),
            ..opts()
        };
        assert!(
            parse(&partial, &them).is_ok(),
            "a partial checksum passes unverified"
        );
        partial[udp + 7] ^= 0x01;
        assert_eq!(parse(&partial, &them), Err(NetDrop::BadUdpChecksum));

        // A sum of 0 is sent as 0xffff, which verifies.
        let (a, b) = (Ipv4Addr::new(0, 0, 0, 0), Ipv4Addr::new(0, 0, 0, 0));
        let mut zero = [0u8; 8];
        zero[4..6].copy_from_slice(&8u16.to_be_bytes());
        // pseudo 17 + 8, header length 8: 33; make the port field cancel it.
        zero[0..2].copy_from_slice(&(0xffffu16 - 33).to_be_bytes());
        assert_eq!(udp_checksum(a, b, &zero), 0xffff);
    }

    #[test]
    fn a_result_checksum_from_the_payloads_sum_verifies() {
        // Header and values summed once, then each destination's headers:
        // the same field as summing the whole datagram, and it verifies.
        let head: Vec<u8> = (0..86u32).map(|i| (i * 3 + 1) as u8).collect();
        for n in [0usize, 1, 2, 63, 64, 65, 255, 256, 257, 1000, 8191, 8192] {
            let vals: Vec<u8> = (0..n as u32).map(|i| (i * 11 + 5) as u8).collect();
            // The copy that sums on the way: the same sum, the same bytes
            // (and the portable loop the same as the AVX2 one).
            let mut out = vec![0u8; n];
            assert_eq!(
                copy_payload_sum(&head, &vals, &mut out),
                payload_sum(&head, &vals),
                "{n} bytes"
            );
            assert_eq!(out, vals, "{n} bytes copied");
            let mut out = vec![0u8; n];
            assert_eq!(copy_ones_sum_lanes(&mut out, &vals), ones_sum(&vals), "{n} bytes");
            assert_eq!(out, vals, "{n} bytes copied");
            let mut payload = head.clone();
            payload.extend_from_slice(&vals);
            let whole = udp_frame(&peer(), MAC, US, 7000, &payload);
            let mut h = [0u8; L2_L4_LEN];
            let me = peer();
            let common = ResultHeaders::new(me.mac, me.ip, me.port, payload.len(), payload_sum(&head, &vals));
            // Other destinations from the same common part: each as if
            // written and summed whole.
            for to in [
                PeerAddr {
                    mac: [2, 0, 0, 0, 0, 9],
                    ip: Ipv4Addr::new(10, 0, 0, 9),
                    port: 1,
                },
                PeerAddr {
                    mac: [0xff; 6],
                    ip: Ipv4Addr::new(255, 255, 255, 254),
                    port: 65535,
                },
            ] {
                common.write(&mut h, &to);
                let w = udp_frame(&me, to.mac, to.ip, to.port, &payload);
                assert_eq!(
                    h[..40],
                    w[..40],
                    "{n} bytes: the headers write_udp_headers writes"
                );
                assert!(ip_checksum_verifies(&h));
                let field = u16::from_be_bytes([h[40], h[41]]);
                assert_eq!(
                    field,
                    udp_checksum(me.ip, to.ip, &w[ETH_LEN + IPV4_LEN..]),
                    "{n} bytes"
                );
            }
            common.write(
                &mut h,
                &PeerAddr {
                    mac: MAC,
                    ip: US,
                    port: 7000,
                },
            );
            assert_eq!(h[..40], whole[..40]);
            let field = u16::from_be_bytes([h[40], h[41]]);
            assert_eq!(
                field,
                udp_checksum(peer().ip, US, &whole[ETH_LEN + IPV4_LEN..]),
                "{n} bytes"
            );
            let mut f = h.to_vec();
            f.extend_from_slice(&payload);
            assert!(parse(&f, &opts()).is_ok(), "{n} bytes: verifies");
            f[L2_L4_LEN + 90.min(payload.len() - 1)] ^= 4;
            assert_eq!(
                parse(&f, &opts()),
                Err(NetDrop::BadUdpChecksum),
                "{n} bytes: a flipped bit"
            );
        }
    }

    #[test]
    fn an_updated_udp_checksum_equals_one_summed_again() {
        let mut f = checksummed(&[0x5au8; 300]);
        let udp = ETH_LEN + IPV4_LEN;
        for new in [[0u8, 0, 0, 0], [0xff; 4], [1, 2, 3, 4], [0xa5, 0x5a, 0, 0xff]] {
            let at = udp + 8 + 20;
            let old: [u8; 4] = f[at..at + 4].try_into().unwrap();
            f[at..at + 4].copy_from_slice(&new);
            let field = udp_checksum_update(be16(&f, udp + 6), &old, &new);
            assert_eq!(field, udp_checksum(peer().ip, US, &f[udp..]), "{new:?}");
            f[udp + 6..udp + 8].copy_from_slice(&field.to_be_bytes());
            assert!(parse(&f, &opts()).is_ok());
        }
        assert_eq!(udp_checksum_update(0, &[1, 2], &[3, 4]), 0, "none stays none");
    }

    #[test]
    fn checks_after_parse_agree_with_parse() {
        // What a NIC left unchecked is checked as parse would have.
        let f = checksummed(&[9u8; 300]);
        let trusting = ParseOptions {
            check_ip_checksum: false,
            check_udp_checksum: false,
            ..opts()
        };
        let Ok(Frame::Udp { payload, .. }) = parse(&f, &trusting) else {
            panic!("a UDP frame")
        };
        assert!(ip_checksum_verifies(&f) && udp_checksum_verifies(&f, &payload));
        let mut bad = f.clone();
        bad[100] ^= 1;
        assert!(ip_checksum_verifies(&bad) && !udp_checksum_verifies(&bad, &payload));
        bad[24] ^= 1;
        assert!(!ip_checksum_verifies(&bad));
    }

    #[test]
    fn checksum_matches_the_sum_of_16_bit_words() {
        // RFC 1071's definition, one 16-bit word at a time, against the
        // four-byte sums, over every length up to 64 (odd ones padded).
        fn reference(d: &[u8]) -> u16 {
            let mut s: u32 = 0;
            for c in d.chunks(2) {
                s += u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)]));
            }
            while s >> 16 != 0 {
                s = (s & 0xffff) + (s >> 16);
            }
            !(s as u16)
        }
        let mut x: u32 = 0x9e37_79b9;
        for len in (0..=64).chain([255, 256, 257, 1000, 8193, 9000]) {
            for fill in [None, Some(0xffu8), Some(0)] {
                let d: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        fill.unwrap_or(x as u8)
                    })
                    .collect();
                assert_eq!(ip_checksum(&d), reference(&d), "len {len}, {d:?}");
            }
        }
        // RFC 1071's worked example: words 0001 f203 f4f5 f6f7 sum to ddf2.
        assert_eq!(
            ip_checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            !0xddf2
        );
    }

    #[test]
    fn checksum_of_a_written_header_verifies() {
        let f = udp_frame(&peer(), MAC, US, 7900, &[0u8; 8000]);
        assert_eq!(ip_checksum(&f[14..34]), 0);
        assert_eq!(be16(&f, 16), 20 + 8 + 8000);
    }
}
