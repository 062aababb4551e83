//! Ethernet/ARP/IPv4/UDP framing for the DPDK backend: pure functions over
//! byte slices (the same code runs over a test's array and an mbuf's data).
//!
//! Headers are read and written only through the zero-copy views in
//! [`ethernet`], [`ipv4`], [`udp`] and [`arp`], whose `field` modules name
//! every byte range, as `phub_proto::wire` does for the phub header: a
//! checked constructor for received bytes (lengths validated once, after
//! which no accessor panics), an unchecked one and setters for what we send.
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

use phub_engine::counters::NetDrop;

use self::arp::ArpPacket;
use self::ethernet::EthernetFrame;
use self::ipv4::Ipv4Packet;
use self::udp::UdpPacket;

/// Ethernet header length (no VLAN tag).
pub const ETH_LEN: usize = ethernet::HEADER_LEN;
/// IPv4 header length without options.
pub const IPV4_LEN: usize = ipv4::HEADER_LEN;
/// UDP header length.
pub const UDP_LEN: usize = udp::HEADER_LEN;
/// Ethernet + IPv4 + UDP: where the UDP payload starts in frames we send.
pub const L2_L4_LEN: usize = ETH_LEN + IPV4_LEN + UDP_LEN;

const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_ARP: u16 = 0x0806;
const IPPROTO_UDP: u8 = 17;

/// The big-endian `u16` in the two bytes `at` of `b`.
#[inline]
fn get_u16(b: &[u8], at: Range<usize>) -> u16 {
    u16::from_be_bytes(get_bytes(b, at))
}

/// The `N` bytes `at` of `b`.
#[inline]
fn get_bytes<const N: usize>(b: &[u8], at: Range<usize>) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at]);
    a
}

/// Writes `v` big-endian into the two bytes `at` of `b`.
#[inline]
fn set_u16(b: &mut [u8], at: Range<usize>, v: u16) {
    b[at].copy_from_slice(&v.to_be_bytes());
}

/// Ethernet II frames (no VLAN tag).
pub mod ethernet {
    use super::{get_bytes, get_u16, set_u16};
    use phub_engine::counters::NetDrop;

    /// Named byte ranges of the Ethernet header.
    pub mod field {
        use std::ops::Range;

        /// Destination MAC address.
        pub const DESTINATION: Range<usize> = 0..6;
        /// Source MAC address.
        pub const SOURCE: Range<usize> = 6..12;
        /// `u16`, the payload's EtherType.
        pub const ETHERTYPE: Range<usize> = 12..14;
        /// First payload byte.
        pub const PAYLOAD: usize = 14;
    }

    /// Header length.
    pub const HEADER_LEN: usize = field::PAYLOAD;

    /// A view of an Ethernet frame over any byte buffer.
    ///
    /// [`EthernetFrame::new_checked`] verifies the header fits, after which
    /// no accessor can panic. [`EthernetFrame::new_unchecked`] is for
    /// buffers the caller sized itself (emitting); its accessors panic on a
    /// buffer shorter than the header.
    #[derive(Debug, Clone, Copy)]
    pub struct EthernetFrame<T: AsRef<[u8]>> {
        buf: T,
    }

    impl<T: AsRef<[u8]>> EthernetFrame<T> {
        /// Wraps a buffer without checking its length.
        #[inline]
        pub const fn new_unchecked(buf: T) -> EthernetFrame<T> {
            EthernetFrame { buf }
        }

        /// Wraps received bytes: [`NetDrop::NotIpv4`] if shorter than the
        /// header.
        #[inline]
        pub fn new_checked(buf: T) -> Result<EthernetFrame<T>, NetDrop> {
            if buf.as_ref().len() < HEADER_LEN {
                return Err(NetDrop::NotIpv4);
            }
            Ok(EthernetFrame { buf })
        }

        /// Destination MAC address.
        #[inline]
        pub fn dst_addr(&self) -> [u8; 6] {
            get_bytes(self.buf.as_ref(), field::DESTINATION)
        }
        /// Source MAC address.
        #[inline]
        pub fn src_addr(&self) -> [u8; 6] {
            get_bytes(self.buf.as_ref(), field::SOURCE)
        }
        /// EtherType.
        #[inline]
        pub fn ethertype(&self) -> u16 {
            get_u16(self.buf.as_ref(), field::ETHERTYPE)
        }
        /// Bytes after the header (up to the buffer's end: any padding
        /// included).
        #[inline]
        pub fn payload(&self) -> &[u8] {
            &self.buf.as_ref()[field::PAYLOAD..]
        }
    }

    impl<T: AsRef<[u8]> + AsMut<[u8]>> EthernetFrame<T> {
        /// Sets the destination MAC address.
        #[inline]
        pub fn set_dst_addr(&mut self, mac: [u8; 6]) {
            self.buf.as_mut()[field::DESTINATION].copy_from_slice(&mac);
        }
        /// Sets the source MAC address.
        #[inline]
        pub fn set_src_addr(&mut self, mac: [u8; 6]) {
            self.buf.as_mut()[field::SOURCE].copy_from_slice(&mac);
        }
        /// Sets the EtherType.
        #[inline]
        pub fn set_ethertype(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::ETHERTYPE, v);
        }
        /// Bytes after the header, writable.
        #[inline]
        pub fn payload_mut(&mut self) -> &mut [u8] {
            &mut self.buf.as_mut()[field::PAYLOAD..]
        }
    }
}

/// IPv4 packets.
pub mod ipv4 {
    use std::net::Ipv4Addr;

    use super::{get_bytes, get_u16, set_u16};
    use phub_engine::counters::NetDrop;

    /// Named byte ranges of the IPv4 header (options, if any, follow).
    pub mod field {
        use std::ops::Range;

        /// `u8`, the version (high 4 bits) and the header's length in
        /// 32-bit words (IHL, low 4 bits).
        pub const VER_IHL: usize = 0;
        /// `u8`, DSCP and ECN.
        pub const DSCP_ECN: usize = 1;
        /// `u16`, the packet's length, header included.
        pub const LENGTH: Range<usize> = 2..4;
        /// `u16`, identification.
        pub const IDENT: Range<usize> = 4..6;
        /// `u16`, flags (high 3 bits) and fragment offset.
        pub const FLG_OFF: Range<usize> = 6..8;
        /// `u8`, time to live.
        pub const TTL: usize = 8;
        /// `u8`, the payload's protocol.
        pub const PROTOCOL: usize = 9;
        /// `u16`, header checksum.
        pub const CHECKSUM: Range<usize> = 10..12;
        /// Source address.
        pub const SRC_ADDR: Range<usize> = 12..16;
        /// Destination address.
        pub const DST_ADDR: Range<usize> = 16..20;
    }

    /// Header length without options.
    pub const HEADER_LEN: usize = field::DST_ADDR.end;
    /// Flag: don't fragment.
    pub const DONT_FRAGMENT: u16 = 0x4000;
    /// Flag: more fragments follow.
    pub const MORE_FRAGMENTS: u16 = 0x2000;
    /// The fragment offset's bits of [`field::FLG_OFF`].
    pub const FRAGMENT_OFFSET: u16 = 0x1fff;

    /// A view of an IPv4 packet over any byte buffer.
    ///
    /// [`Ipv4Packet::new_checked`] verifies that the header and the
    /// packet's length fit the buffer, after which no accessor can panic.
    /// [`Ipv4Packet::new_unchecked`] is for buffers the caller sized itself
    /// (emitting); its accessors panic on a buffer shorter than the header
    /// ([`Ipv4Packet::payload`]: than the length field).
    #[derive(Debug, Clone, Copy)]
    pub struct Ipv4Packet<T: AsRef<[u8]>> {
        buf: T,
    }

    impl<T: AsRef<[u8]>> Ipv4Packet<T> {
        /// Wraps a buffer without checking its length.
        #[inline]
        pub const fn new_unchecked(buf: T) -> Ipv4Packet<T> {
            Ipv4Packet { buf }
        }

        /// Wraps received bytes: [`NetDrop::BadIpHeader`] if shorter than
        /// [`HEADER_LEN`], of a version other than 4, or if the header's
        /// length is below [`HEADER_LEN`] or above the packet's, or that
        /// beyond the buffer.
        #[inline]
        pub fn new_checked(buf: T) -> Result<Ipv4Packet<T>, NetDrop> {
            let len = buf.as_ref().len();
            if len < HEADER_LEN {
                return Err(NetDrop::BadIpHeader);
            }
            let p = Ipv4Packet { buf };
            if p.version() != 4 {
                return Err(NetDrop::BadIpHeader);
            }
            let (header, total) = (p.header_len(), p.total_len());
            if header < HEADER_LEN || total < header || total > len {
                return Err(NetDrop::BadIpHeader);
            }
            Ok(p)
        }

        /// Version.
        #[inline]
        pub fn version(&self) -> u8 {
            self.buf.as_ref()[field::VER_IHL] >> 4
        }
        /// Header length in bytes, options included (from the IHL).
        #[inline]
        pub fn header_len(&self) -> usize {
            usize::from(self.buf.as_ref()[field::VER_IHL] & 0x0f) * 4
        }
        /// The packet's length, header included.
        #[inline]
        pub fn total_len(&self) -> usize {
            usize::from(get_u16(self.buf.as_ref(), field::LENGTH))
        }
        /// Flags and fragment offset.
        #[inline]
        pub fn flags_and_offset(&self) -> u16 {
            get_u16(self.buf.as_ref(), field::FLG_OFF)
        }
        /// Whether this is a fragment: more fragments follow, or it is not
        /// the first.
        #[inline]
        pub fn is_fragment(&self) -> bool {
            self.flags_and_offset() & (MORE_FRAGMENTS | FRAGMENT_OFFSET) != 0
        }
        /// The payload's protocol.
        #[inline]
        pub fn protocol(&self) -> u8 {
            self.buf.as_ref()[field::PROTOCOL]
        }
        /// Header checksum.
        #[inline]
        pub fn checksum(&self) -> u16 {
            get_u16(self.buf.as_ref(), field::CHECKSUM)
        }
        /// Source address.
        #[inline]
        pub fn src_addr(&self) -> Ipv4Addr {
            Ipv4Addr::from(get_bytes::<4>(self.buf.as_ref(), field::SRC_ADDR))
        }
        /// Destination address.
        #[inline]
        pub fn dst_addr(&self) -> Ipv4Addr {
            Ipv4Addr::from(get_bytes::<4>(self.buf.as_ref(), field::DST_ADDR))
        }
        /// The header, options included.
        #[inline(always)]
        pub fn header(&self) -> &[u8] {
            &self.buf.as_ref()[..self.header_len()]
        }
        /// The payload, as long as the length field says (Ethernet padding
        /// left out).
        #[inline(always)]
        pub fn payload(&self) -> &[u8] {
            &self.buf.as_ref()[self.header_len()..self.total_len()]
        }
    }

    impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv4Packet<T> {
        /// Sets the version and the header's length in bytes (a multiple
        /// of 4, at most 60).
        #[inline]
        pub fn set_version_and_header_len(&mut self, version: u8, header_len: usize) {
            debug_assert!(
                header_len.is_multiple_of(4) && header_len <= 60,
                "IHL of {header_len} bytes"
            );
            let ihl = u8::try_from(header_len / 4).unwrap_or(0x0f) & 0x0f;
            self.buf.as_mut()[field::VER_IHL] = version << 4 | ihl;
        }
        /// Sets DSCP and ECN.
        #[inline]
        pub fn set_dscp_ecn(&mut self, v: u8) {
            self.buf.as_mut()[field::DSCP_ECN] = v;
        }
        /// Sets the packet's length, header included.
        #[inline]
        pub fn set_total_len(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::LENGTH, v);
        }
        /// Sets the identification.
        #[inline]
        pub fn set_ident(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::IDENT, v);
        }
        /// Sets flags and fragment offset.
        #[inline]
        pub fn set_flags_and_offset(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::FLG_OFF, v);
        }
        /// Sets the time to live.
        #[inline]
        pub fn set_ttl(&mut self, v: u8) {
            self.buf.as_mut()[field::TTL] = v;
        }
        /// Sets the payload's protocol.
        #[inline]
        pub fn set_protocol(&mut self, v: u8) {
            self.buf.as_mut()[field::PROTOCOL] = v;
        }
        /// Sets the header checksum.
        #[inline]
        pub fn set_checksum(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::CHECKSUM, v);
        }
        /// Sets the source address.
        #[inline]
        pub fn set_src_addr(&mut self, ip: Ipv4Addr) {
            self.buf.as_mut()[field::SRC_ADDR].copy_from_slice(&ip.octets());
        }
        /// Sets the destination address.
        #[inline]
        pub fn set_dst_addr(&mut self, ip: Ipv4Addr) {
            self.buf.as_mut()[field::DST_ADDR].copy_from_slice(&ip.octets());
        }
    }
}

/// UDP datagrams.
pub mod udp {
    use super::{get_u16, set_u16};
    use phub_engine::counters::NetDrop;

    /// Named byte ranges of the UDP header.
    pub mod field {
        use std::ops::Range;

        /// `u16`, source port.
        pub const SRC_PORT: Range<usize> = 0..2;
        /// `u16`, destination port.
        pub const DST_PORT: Range<usize> = 2..4;
        /// `u16`, the datagram's length, header included.
        pub const LENGTH: Range<usize> = 4..6;
        /// `u16`, checksum (0: none).
        pub const CHECKSUM: Range<usize> = 6..8;
        /// First payload byte.
        pub const PAYLOAD: usize = 8;
    }

    /// Header length.
    pub const HEADER_LEN: usize = field::PAYLOAD;

    /// A view of a UDP datagram over any byte buffer.
    ///
    /// [`UdpPacket::new_checked`] verifies that the header and the
    /// datagram's length fit the buffer, after which no accessor can panic.
    /// [`UdpPacket::new_unchecked`] is for buffers the caller sized itself
    /// (emitting); its accessors panic on a buffer shorter than the header
    /// ([`UdpPacket::datagram`] and [`UdpPacket::payload`]: than the length
    /// field).
    #[derive(Debug, Clone, Copy)]
    pub struct UdpPacket<T: AsRef<[u8]>> {
        buf: T,
    }

    impl<T: AsRef<[u8]>> UdpPacket<T> {
        /// Wraps a buffer without checking its length.
        #[inline]
        pub const fn new_unchecked(buf: T) -> UdpPacket<T> {
            UdpPacket { buf }
        }

        /// Wraps received bytes: [`NetDrop::BadUdpLength`] if shorter than
        /// the header, or if the length field is below [`HEADER_LEN`] or
        /// beyond the buffer.
        #[inline]
        pub fn new_checked(buf: T) -> Result<UdpPacket<T>, NetDrop> {
            let len = buf.as_ref().len();
            if len < HEADER_LEN {
                return Err(NetDrop::BadUdpLength);
            }
            let p = UdpPacket { buf };
            if p.len() < HEADER_LEN || p.len() > len {
                return Err(NetDrop::BadUdpLength);
            }
            Ok(p)
        }

        /// Source port.
        #[inline]
        pub fn src_port(&self) -> u16 {
            get_u16(self.buf.as_ref(), field::SRC_PORT)
        }
        /// Destination port.
        #[inline]
        pub fn dst_port(&self) -> u16 {
            get_u16(self.buf.as_ref(), field::DST_PORT)
        }
        /// The datagram's length (length field), header included.
        #[inline]
        #[allow(clippy::len_without_is_empty, reason = "a datagram is never empty")]
        pub fn len(&self) -> usize {
            usize::from(get_u16(self.buf.as_ref(), field::LENGTH))
        }
        /// Checksum field.
        #[inline]
        pub fn checksum(&self) -> u16 {
            get_u16(self.buf.as_ref(), field::CHECKSUM)
        }
        /// The header.
        #[inline(always)]
        pub fn header(&self) -> &[u8] {
            &self.buf.as_ref()[..HEADER_LEN]
        }
        /// Header and payload, as long as the length field says.
        #[inline(always)]
        pub fn datagram(&self) -> &[u8] {
            &self.buf.as_ref()[..self.len()]
        }
        /// The payload, as long as the length field says.
        #[inline]
        pub fn payload(&self) -> &[u8] {
            &self.buf.as_ref()[HEADER_LEN..self.len()]
        }
    }

    impl<T: AsRef<[u8]> + AsMut<[u8]>> UdpPacket<T> {
        /// Sets the source port.
        #[inline]
        pub fn set_src_port(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::SRC_PORT, v);
        }
        /// Sets the destination port.
        #[inline]
        pub fn set_dst_port(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::DST_PORT, v);
        }
        /// Sets the datagram's length, header included.
        #[inline]
        pub fn set_len(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::LENGTH, v);
        }
        /// Sets the checksum field.
        #[inline]
        pub fn set_checksum(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::CHECKSUM, v);
        }
    }
}

/// ARP over Ethernet for IPv4.
pub mod arp {
    use std::net::Ipv4Addr;

    use super::{get_bytes, get_u16, set_u16};
    use phub_engine::counters::NetDrop;

    /// Named byte ranges of an ARP packet (Ethernet and IPv4 addresses).
    pub mod field {
        use std::ops::Range;

        /// `u16`, hardware type.
        pub const HTYPE: Range<usize> = 0..2;
        /// `u16`, protocol type (an EtherType).
        pub const PTYPE: Range<usize> = 2..4;
        /// `u8`, hardware address length.
        pub const HLEN: usize = 4;
        /// `u8`, protocol address length.
        pub const PLEN: usize = 5;
        /// `u16`, operation.
        pub const OPER: Range<usize> = 6..8;
        /// Sender's hardware address.
        pub const SHA: Range<usize> = 8..14;
        /// Sender's protocol address.
        pub const SPA: Range<usize> = 14..18;
        /// Target's hardware address.
        pub const THA: Range<usize> = 18..24;
        /// Target's protocol address.
        pub const TPA: Range<usize> = 24..28;
    }

    /// Packet length.
    pub const PACKET_LEN: usize = field::TPA.end;
    /// Hardware type: Ethernet.
    pub const HTYPE_ETHERNET: u16 = 1;
    /// Operation: request.
    pub const OPER_REQUEST: u16 = 1;
    /// Operation: reply.
    pub const OPER_REPLY: u16 = 2;
    /// Length of an Ethernet address.
    pub const ETHERNET_ADDR_LEN: u8 = 6;
    /// Length of an IPv4 address.
    pub const IPV4_ADDR_LEN: u8 = 4;

    /// A view of an ARP packet over any byte buffer.
    ///
    /// [`ArpPacket::new_checked`] verifies the packet fits, after which no
    /// accessor can panic. [`ArpPacket::new_unchecked`] is for buffers the
    /// caller sized itself (emitting); its accessors panic on a buffer
    /// shorter than [`PACKET_LEN`].
    #[derive(Debug, Clone, Copy)]
    pub struct ArpPacket<T: AsRef<[u8]>> {
        buf: T,
    }

    impl<T: AsRef<[u8]>> ArpPacket<T> {
        /// Wraps a buffer without checking its length.
        #[inline]
        pub const fn new_unchecked(buf: T) -> ArpPacket<T> {
            ArpPacket { buf }
        }

        /// Wraps received bytes: [`NetDrop::ArpNotForUs`] if shorter than
        /// [`PACKET_LEN`].
        #[inline]
        pub fn new_checked(buf: T) -> Result<ArpPacket<T>, NetDrop> {
            if buf.as_ref().len() < PACKET_LEN {
                return Err(NetDrop::ArpNotForUs);
            }
            Ok(ArpPacket { buf })
        }

        /// Hardware type.
        #[inline]
        pub fn hardware_type(&self) -> u16 {
            get_u16(self.buf.as_ref(), field::HTYPE)
        }
        /// Protocol type.
        #[inline]
        pub fn protocol_type(&self) -> u16 {
            get_u16(self.buf.as_ref(), field::PTYPE)
        }
        /// Hardware address length.
        #[inline]
        pub fn hardware_len(&self) -> u8 {
            self.buf.as_ref()[field::HLEN]
        }
        /// Protocol address length.
        #[inline]
        pub fn protocol_len(&self) -> u8 {
            self.buf.as_ref()[field::PLEN]
        }
        /// Operation.
        #[inline]
        pub fn operation(&self) -> u16 {
            get_u16(self.buf.as_ref(), field::OPER)
        }
        /// Sender's hardware address.
        #[inline]
        pub fn sender_mac(&self) -> [u8; 6] {
            get_bytes(self.buf.as_ref(), field::SHA)
        }
        /// Sender's protocol address.
        #[inline]
        pub fn sender_ip(&self) -> Ipv4Addr {
            Ipv4Addr::from(get_bytes::<4>(self.buf.as_ref(), field::SPA))
        }
        /// Target's hardware address.
        #[inline]
        pub fn target_mac(&self) -> [u8; 6] {
            get_bytes(self.buf.as_ref(), field::THA)
        }
        /// Target's protocol address.
        #[inline]
        pub fn target_ip(&self) -> Ipv4Addr {
            Ipv4Addr::from(get_bytes::<4>(self.buf.as_ref(), field::TPA))
        }
    }

    impl<T: AsRef<[u8]> + AsMut<[u8]>> ArpPacket<T> {
        /// Sets the hardware type.
        #[inline]
        pub fn set_hardware_type(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::HTYPE, v);
        }
        /// Sets the protocol type.
        #[inline]
        pub fn set_protocol_type(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::PTYPE, v);
        }
        /// Sets the hardware address length.
        #[inline]
        pub fn set_hardware_len(&mut self, v: u8) {
            self.buf.as_mut()[field::HLEN] = v;
        }
        /// Sets the protocol address length.
        #[inline]
        pub fn set_protocol_len(&mut self, v: u8) {
            self.buf.as_mut()[field::PLEN] = v;
        }
        /// Sets the operation.
        #[inline]
        pub fn set_operation(&mut self, v: u16) {
            set_u16(self.buf.as_mut(), field::OPER, v);
        }
        /// Sets the sender's hardware address.
        #[inline]
        pub fn set_sender_mac(&mut self, mac: [u8; 6]) {
            self.buf.as_mut()[field::SHA].copy_from_slice(&mac);
        }
        /// Sets the sender's protocol address.
        #[inline]
        pub fn set_sender_ip(&mut self, ip: Ipv4Addr) {
            self.buf.as_mut()[field::SPA].copy_from_slice(&ip.octets());
        }
        /// Sets the target's hardware address.
        #[inline]
        pub fn set_target_mac(&mut self, mac: [u8; 6]) {
            self.buf.as_mut()[field::THA].copy_from_slice(&mac);
        }
        /// Sets the target's protocol address.
        #[inline]
        pub fn set_target_ip(&mut self, ip: Ipv4Addr) {
            self.buf.as_mut()[field::TPA].copy_from_slice(&ip.octets());
        }
    }
}

/// The Ethernet, IPv4 and UDP views of one frame.
type Views<B> = (EthernetFrame<B>, Ipv4Packet<B>, UdpPacket<B>);

/// Views of the headers of a frame we build (Ethernet, IPv4 without
/// options, UDP; the UDP view runs to the end of `f`). Panics if `f` is
/// shorter than [`L2_L4_LEN`].
#[inline]
fn views(f: &[u8]) -> Views<&[u8]> {
    let (eth, rest) = f.split_at(ETH_LEN);
    let (ip, udp) = rest.split_at(IPV4_LEN);
    (
        EthernetFrame::new_unchecked(eth),
        Ipv4Packet::new_unchecked(ip),
        UdpPacket::new_unchecked(udp),
    )
}

/// [`views`], writable.
#[inline]
fn views_mut(f: &mut [u8]) -> Views<&mut [u8]> {
    let (eth, rest) = f.split_at_mut(ETH_LEN);
    let (ip, udp) = rest.split_at_mut(IPV4_LEN);
    (
        EthernetFrame::new_unchecked(eth),
        Ipv4Packet::new_unchecked(ip),
        UdpPacket::new_unchecked(udp),
    )
}

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
        return unsafe { x86::copy_ones_sum_madd(None, data) };
    }
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
        return unsafe { x86::copy_ones_sum_madd(Some(dst), src) };
    }
    if src.len() >= 64 {
        return copy_ones_sum_lanes(dst, src);
    }
    dst.copy_from_slice(src);
    ones_sum(src)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi32, _mm256_castsi256_si128, _mm256_extracti128_si256, _mm256_loadu_si256,
        _mm256_madd_epi16, _mm256_set1_epi16, _mm256_setzero_si256, _mm256_storeu_si256, _mm256_xor_si256,
        _mm_add_epi32, _mm_cvtsi128_si32, _mm_shuffle_epi32,
    };

    /// [`super::ones_sum`] of `src` (as little-endian 16-bit words,
    /// folded, not yet byte-swapped: the caller's `fold` and swap do
    /// that), copying it into `dst` on the way when there is one.
    ///
    /// Each 16-bit word `u` is summed as the signed `s = u - 32768` (its
    /// top bit flipped), pairs of them added into 32-bit lanes by one
    /// multiply-add with 1 (`vpmaddwd`, which the widening of 16-bit
    /// words could not match: those shuffles go one per cycle), and the
    /// 32768 x words taken off added back at the end. A lane gains at
    /// most 2 x 32767 a block, so the lanes are emptied into a 64-bit
    /// total every 2^11 blocks: a lane then holds at most 2^27 and the
    /// eight together 2^30, within an `i32`.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_ones_sum_madd(mut dst: Option<&mut [u8]>, src: &[u8]) -> u16 {
        const BLOCK: usize = 32;
        const FLUSH: usize = 1 << 11;
        if let Some(d) = &dst {
            assert_eq!(d.len(), src.len(), "copy_ones_sum: lengths differ");
        }
        let flip = _mm256_set1_epi16(i16::MIN);
        let ones = _mm256_set1_epi16(1);
        let mut total: i64 = 0;
        let blocks = src.len() / BLOCK;
        let mut b = 0;
        while b < blocks {
            let end = (b + FLUSH).min(blocks);
            let mut acc: __m256i = _mm256_setzero_si256();
            while b < end {
                let at = b * BLOCK;
                // SAFETY: `at + BLOCK <= blocks * BLOCK <= src.len()`;
                // unaligned loads and stores are allowed.
                let v = unsafe { _mm256_loadu_si256(src.as_ptr().add(at).cast()) };
                if let Some(d) = dst.as_deref_mut() {
                    // SAFETY: `d` has `src`'s length (asserted above).
                    unsafe { _mm256_storeu_si256(d.as_mut_ptr().add(at).cast(), v) };
                }
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_xor_si256(v, flip), ones));
                b += 1;
            }
            // The 8 lanes, added up.
            let x = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256::<1>(acc));
            let x = _mm_add_epi32(x, _mm_shuffle_epi32::<0b01_00_11_10>(x));
            let x = _mm_add_epi32(x, _mm_shuffle_epi32::<0b10_11_00_01>(x));
            total += i64::from(_mm_cvtsi128_si32(x));
        }
        let done = blocks * BLOCK;
        // The 32768 taken off each word of the blocks, put back: the total
        // is then the plain sum of the words, never negative.
        let words = (done / 2) as i64;
        let sum = u64::try_from(total + 32768 * words).expect("a sum of unsigned words");
        let rest = &src[done..];
        if let Some(d) = dst {
            d[done..].copy_from_slice(rest);
        }
        let mut tail: u64 = 0;
        for c in rest.chunks(2) {
            tail += u64::from(u16::from_le_bytes([c[0], c.get(1).copied().unwrap_or(0)]));
        }
        super::fold(sum + tail).swap_bytes()
    }
}

/// [`ones_sum_lanes`] that also stores each block where it goes, right
/// after loading it: the portable loop ([`copy_ones_sum`] takes AVX2's
/// multiply-adds where it can: for 8 KiB in cache 88 ns for the sum and
/// 164 ns with the copy, against 150 and 225 ns for this loop compiled
/// for AVX2, whose widening of 16-bit words issues one shuffle per cycle;
/// BENCHMARKS.md).
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
// Cast: the loop leaves sum >> 16 == 0.
#[allow(clippy::cast_possible_truncation)]
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
    // Everything but the checksum field, however short `udp` is.
    let head = udp.get(..udp::field::CHECKSUM.start).unwrap_or(udp);
    let body = udp.get(udp::field::CHECKSUM.end..).unwrap_or_default();
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
/// port, and neither checksum reads a header back. For a port that
/// computes checksums itself ([`ResultHeaders::offloaded`]) they carry what
/// DPDK's TX checksum offload wants instead: the IPv4 checksum 0 and the
/// UDP one the pseudo-header's sum.
#[derive(Debug, Clone, Copy)]
pub struct ResultHeaders {
    /// The headers with the destination's fields and both checksums 0.
    base: [u8; L2_L4_LEN],
    /// One's-complement sum of `base`'s IPv4 header (0 when `offloaded`).
    ip: u64,
    /// Of the UDP pseudo-header's source address, protocol and length,
    /// and unless `offloaded`, `base`'s UDP header and the payload.
    udp: u64,
    /// The port fills both checksums in.
    offloaded: bool,
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
        ResultHeaders::with_sums(src_mac, src_ip, src_port, udp_payload, Some(payload))
    }

    /// Headers as [`ResultHeaders::new`] makes them, for a port that fills
    /// in both checksums (`Mbuf::offload_udp_checksums`): nothing of the
    /// payload is summed.
    pub fn offloaded(src_mac: [u8; 6], src_ip: Ipv4Addr, src_port: u16, udp_payload: usize) -> ResultHeaders {
        ResultHeaders::with_sums(src_mac, src_ip, src_port, udp_payload, None)
    }

    /// The headers and their checksums' common parts: with the payload's
    /// sum, both checksums'; without (offloaded), the pseudo-header's
    /// source, protocol and length alone, which is all the port needs.
    fn with_sums(
        src_mac: [u8; 6],
        src_ip: Ipv4Addr,
        src_port: u16,
        udp_payload: usize,
        payload: Option<u16>,
    ) -> ResultHeaders {
        let mut base = [0u8; L2_L4_LEN];
        let nowhere = PeerAddr {
            mac: [0; 6],
            ip: Ipv4Addr::UNSPECIFIED,
            port: 0,
        };
        write_unsummed_headers(&mut base, src_mac, src_ip, src_port, &nowhere, udp_payload);
        let pseudo = pseudo_header_sum(&src_ip.octets(), &nowhere.ip.octets(), UDP_LEN + udp_payload);
        let Some(payload) = payload else {
            return ResultHeaders {
                base,
                ip: 0,
                udp: pseudo,
                offloaded: true,
            };
        };
        let (_, ip, udp) = views(&base);
        ResultHeaders {
            base,
            ip: u64::from(ones_sum(ip.header())),
            udp: pseudo + u64::from(ones_sum(udp.header())) + u64::from(payload),
            offloaded: false,
        }
    }

    /// Whether the port is to fill in the checksums
    /// ([`ResultHeaders::offloaded`]).
    pub fn is_offloaded(&self) -> bool {
        self.offloaded
    }

    /// Writes the headers of the frame for `to` into `out`, checksums
    /// filled in (offloaded: the IPv4 one 0 and the UDP one the
    /// pseudo-header's sum, for the port to finish).
    pub fn write(&self, out: &mut [u8; L2_L4_LEN], to: &PeerAddr) {
        *out = self.base;
        let (mut eth, mut ip, mut udp) = views_mut(out);
        eth.set_dst_addr(to.mac);
        ip.set_dst_addr(to.ip);
        udp.set_dst_port(to.port);
        let dst = u64::from(ones_sum(&to.ip.octets()));
        if self.offloaded {
            udp.set_checksum(fold(self.udp + dst));
            return;
        }
        ip.set_checksum(!fold(self.ip + dst));
        udp.set_checksum(udp_field(self.udp + dst + u64::from(to.port)));
    }
}

/// Whether a received UDP datagram's checksum field is acceptable: none
/// (0), left partial by the sender's kernel (the pseudo-header's sum
/// alone), or verifying over the pseudo-header (addresses from `ip`) and
/// `udp`'s datagram (header and payload, as long as its length field
/// says, which must fit its buffer).
#[inline]
fn udp_checksum_ok(ip: &Ipv4Packet<&[u8]>, udp: &UdpPacket<&[u8]>) -> bool {
    let field = udp.checksum();
    if field == 0 {
        return true;
    }
    let datagram = udp.datagram();
    let pseudo = pseudo_header_sum(&ip.src_addr().octets(), &ip.dst_addr().octets(), datagram.len());
    field == fold(pseudo) || fold(pseudo + u64::from(ones_sum(datagram))) == 0xffff
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
    let eth = EthernetFrame::new_checked(f)?;
    match eth.ethertype() {
        ETHERTYPE_IPV4 => {}
        ETHERTYPE_ARP => return parse_arp(eth.payload(), opts.ip),
        _ => return Err(NetDrop::NotIpv4),
    }
    let ip = Ipv4Packet::new_checked(eth.payload())?;
    if opts.check_ip_checksum && ip_checksum(ip.header()) != 0 {
        return Err(NetDrop::BadIpChecksum);
    }
    if ip.is_fragment() {
        return Err(NetDrop::IpFragment);
    }
    if ip.dst_addr() != opts.ip {
        return Err(NetDrop::NotOurAddress);
    }
    if ip.protocol() != IPPROTO_UDP {
        return Err(NetDrop::NotUdp);
    }
    let udp = UdpPacket::new_checked(ip.payload())?;
    if opts.check_udp_checksum && !udp_checksum_ok(&ip, &udp) {
        return Err(NetDrop::BadUdpChecksum);
    }
    let start = ETH_LEN + ip.header_len() + UDP_LEN;
    Ok(Frame::Udp {
        from: PeerAddr {
            mac: eth.src_addr(),
            ip: ip.src_addr(),
            port: udp.src_port(),
        },
        dst_port: udp.dst_port(),
        payload: start..start + udp.len() - UDP_LEN,
    })
}

/// Whether the IPv4 header checksum of a frame [`parse`] accepted verifies
/// (for frames whose NIC checks them but left this one unchecked).
pub fn ip_checksum_verifies(f: &[u8]) -> bool {
    let eth = EthernetFrame::new_unchecked(f);
    ip_checksum(Ipv4Packet::new_unchecked(eth.payload()).header()) == 0
}

/// Whether the UDP checksum of a frame [`parse`] accepted as
/// [`Frame::Udp`] with `payload` is acceptable (as when
/// [`ParseOptions::check_udp_checksum`] is set), for frames whose NIC
/// checks them but left this one unchecked.
pub fn udp_checksum_verifies(f: &[u8], payload: &Range<usize>) -> bool {
    let eth = EthernetFrame::new_unchecked(&f[..payload.end]);
    let ip = Ipv4Packet::new_unchecked(eth.payload());
    let udp = UdpPacket::new_unchecked(&eth.payload()[ip.header_len()..]);
    udp_checksum_ok(&ip, &udp)
}

/// Classifies the ARP packet `a` (an Ethernet frame's payload): a request
/// for `ip`, or not for us.
fn parse_arp(a: &[u8], ip: Ipv4Addr) -> Result<Frame, NetDrop> {
    let a = ArpPacket::new_checked(a)?;
    if a.hardware_type() != arp::HTYPE_ETHERNET
        || a.protocol_type() != ETHERTYPE_IPV4
        || a.hardware_len() != arp::ETHERNET_ADDR_LEN
        || a.protocol_len() != arp::IPV4_ADDR_LEN
        || a.operation() != arp::OPER_REQUEST
        || a.target_ip() != ip
    {
        return Err(NetDrop::ArpNotForUs);
    }
    Ok(Frame::ArpRequest)
}

/// Turns an ARP request for `ip` (checked by [`parse`]) into the reply
/// from `mac`, in place.
pub fn arp_reply_in_place(f: &mut [u8], mac: [u8; 6], ip: Ipv4Addr) {
    let fits = EthernetFrame::new_checked(&*f).is_ok_and(|eth| ArpPacket::new_checked(eth.payload()).is_ok());
    if !fits {
        return;
    }
    let mut eth = EthernetFrame::new_unchecked(f);
    let requester_mac = eth.src_addr();
    eth.set_dst_addr(requester_mac);
    eth.set_src_addr(mac);
    let mut a = ArpPacket::new_unchecked(eth.payload_mut());
    a.set_operation(arp::OPER_REPLY);
    let (sha, spa) = (a.sender_mac(), a.sender_ip());
    a.set_target_mac(sha);
    a.set_target_ip(spa);
    a.set_sender_mac(mac);
    a.set_sender_ip(ip);
}

/// Writes Ethernet, IPv4 and UDP headers for a datagram of `udp_payload`
/// bytes (what one frame carries: under 9000) into `out[..L2_L4_LEN]`.
pub fn write_udp_headers(
    out: &mut [u8; L2_L4_LEN],
    src_mac: [u8; 6],
    src_ip: Ipv4Addr,
    src_port: u16,
    to: &PeerAddr,
    udp_payload: usize,
) {
    write_unsummed_headers(out, src_mac, src_ip, src_port, to, udp_payload);
    let (_, mut ip, _) = views_mut(out);
    let c = ip_checksum(ip.header());
    ip.set_checksum(c);
}

/// [`write_udp_headers`] with both checksum fields left 0.
// Cast: `udp_payload` is one phub datagram, at most HEADER_LEN + MAX_PAYLOAD
// (under 9000) bytes, so the IPv4 and UDP lengths fit their u16 fields.
#[allow(clippy::cast_possible_truncation)]
fn write_unsummed_headers(
    out: &mut [u8; L2_L4_LEN],
    src_mac: [u8; 6],
    src_ip: Ipv4Addr,
    src_port: u16,
    to: &PeerAddr,
    udp_payload: usize,
) {
    let (mut eth, mut ip, mut udp) = views_mut(out);
    eth.set_dst_addr(to.mac);
    eth.set_src_addr(src_mac);
    eth.set_ethertype(ETHERTYPE_IPV4);
    ip.set_version_and_header_len(4, IPV4_LEN);
    ip.set_dscp_ecn(0);
    ip.set_total_len((IPV4_LEN + UDP_LEN + udp_payload) as u16);
    ip.set_ident(0);
    ip.set_flags_and_offset(ipv4::DONT_FRAGMENT);
    ip.set_ttl(64);
    ip.set_protocol(IPPROTO_UDP);
    ip.set_checksum(0);
    ip.set_src_addr(src_ip);
    ip.set_dst_addr(to.ip);
    udp.set_src_port(src_port);
    udp.set_dst_port(to.port);
    udp.set_len((UDP_LEN + udp_payload) as u16);
    udp.set_checksum(0);
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
    let mut f = vec![0u8; ETH_LEN + arp::PACKET_LEN];
    let mut eth = EthernetFrame::new_unchecked(&mut f[..]);
    eth.set_dst_addr([0xff; 6]);
    eth.set_src_addr(from.mac);
    eth.set_ethertype(ETHERTYPE_ARP);
    let mut a = ArpPacket::new_unchecked(eth.payload_mut());
    a.set_hardware_type(arp::HTYPE_ETHERNET);
    a.set_protocol_type(ETHERTYPE_IPV4);
    a.set_hardware_len(arp::ETHERNET_ADDR_LEN);
    a.set_protocol_len(arp::IPV4_ADDR_LEN);
    a.set_operation(arp::OPER_REQUEST);
    a.set_sender_mac(from.mac);
    a.set_sender_ip(from.ip);
    a.set_target_ip(target);
    f
}

#[cfg(test)]
// Tests cast small, literal sizes.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
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
        views_mut(&mut f).2.set_checksum(c);
        f
    }

    /// Changes `f`'s IPv4 header with `change` and sums it again.
    fn change_ip(f: &mut [u8], change: impl FnOnce(&mut Ipv4Packet<&mut [u8]>)) {
        let mut ip = views_mut(f).1;
        change(&mut ip);
        ip.set_checksum(0);
        let c = ip_checksum(ip.header());
        ip.set_checksum(c);
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
    fn frames_match_the_rfc_layouts_byte_for_byte() {
        // Written out by hand from RFC 894, 791, 768 and 826, so that the
        // views' field ranges are checked against something other than
        // themselves.
        let f = udp_frame(&peer(), MAC, US, 7000, &[]);
        let want = "020000000001020000000009\
                    0800\
                    4500001c000040004011\
                    26bd\
                    0a0900020a090001\
                    9c401b5800080000";
        let hex: String = f.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, want.split_whitespace().collect::<String>());
        let (eth, ip, udp) = views(&f);
        assert_eq!(
            (eth.dst_addr(), eth.src_addr(), eth.ethertype()),
            (MAC, peer().mac, 0x0800)
        );
        assert_eq!((ip.version(), ip.header_len(), ip.total_len()), (4, 20, 28));
        assert_eq!(
            (ip.flags_and_offset(), ip.protocol(), ip.checksum()),
            (0x4000, 17, 0x26bd)
        );
        assert_eq!((ip.src_addr(), ip.dst_addr()), (peer().ip, US));
        assert_eq!(
            (udp.src_port(), udp.dst_port(), udp.len(), udp.checksum()),
            (40000, 7000, 8, 0)
        );

        let mut a = arp_request(&peer(), US);
        let hex: String = a.iter().map(|b| format!("{b:02x}")).collect();
        let want = "ffffffffffff020000000009\
                    0806\
                    0001080006040001\
                    0200000000090a090002\
                    0000000000000a090001";
        assert_eq!(hex, want.split_whitespace().collect::<String>());
        arp_reply_in_place(&mut a, MAC, US);
        let hex: String = a.iter().map(|b| format!("{b:02x}")).collect();
        let want = "020000000009020000000001\
                    0806\
                    0001080006040002\
                    0200000000010a090001\
                    0200000000090a090002";
        assert_eq!(hex, want.split_whitespace().collect::<String>());
    }

    #[test]
    fn short_frames_are_left_alone_and_views_checked_refuse_them() {
        // A truncated ARP request is not answered, not even in part.
        let req = arp_request(&peer(), US);
        for len in 0..req.len() {
            let mut f = req[..len].to_vec();
            arp_reply_in_place(&mut f, MAC, US);
            assert_eq!(f, req[..len], "{len} bytes");
        }
        assert!(EthernetFrame::new_checked(&req[..ETH_LEN - 1]).is_err());
        assert!(ArpPacket::new_checked(&req[ETH_LEN..req.len() - 1]).is_err());
        let f = udp_frame(&peer(), MAC, US, 7000, &[1, 2, 3]);
        let ip = &f[ETH_LEN..];
        assert!(Ipv4Packet::new_checked(ip).is_ok());
        assert!(
            Ipv4Packet::new_checked(&ip[..ip.len() - 1]).is_err(),
            "total length beyond the buffer"
        );
        assert!(Ipv4Packet::new_checked(&ip[..IPV4_LEN - 1]).is_err());
        let udp = &f[ETH_LEN + IPV4_LEN..];
        assert!(UdpPacket::new_checked(udp).is_ok());
        assert!(
            UdpPacket::new_checked(&udp[..udp.len() - 1]).is_err(),
            "length beyond the buffer"
        );
    }

    #[test]
    fn malformed_frames_are_classified() {
        let good = udp_frame(&peer(), MAC, US, 7900, &[0u8; 100]);
        let p = |f: &[u8]| parse(f, &opts());
        assert_eq!(p(&good[..10]), Err(NetDrop::NotIpv4));
        let mut v = good.clone();
        views_mut(&mut v).0.set_ethertype(0x86dd);
        assert_eq!(p(&v), Err(NetDrop::NotIpv4));
        let mut v = good.clone();
        views_mut(&mut v).1.set_version_and_header_len(6, IPV4_LEN);
        assert_eq!(p(&v), Err(NetDrop::BadIpHeader));
        assert_eq!(p(&good[..30]), Err(NetDrop::BadIpHeader));
        let mut v = good.clone();
        let mut ip = views_mut(&mut v).1;
        ip.set_checksum(ip.checksum() ^ 0xff00);
        assert_eq!(p(&v), Err(NetDrop::BadIpChecksum));
        let mut v = good.clone();
        change_ip(&mut v, |ip| {
            ip.set_flags_and_offset(ip.flags_and_offset() | ipv4::MORE_FRAGMENTS)
        });
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
        change_ip(&mut v, |ip| ip.set_protocol(6));
        assert_eq!(p(&v), Err(NetDrop::NotUdp));
        let mut v = good.clone();
        views_mut(&mut v).2.set_len(500);
        assert_eq!(p(&v), Err(NetDrop::BadUdpLength));
        let mut v = good;
        views_mut(&mut v).2.set_len(3);
        assert_eq!(p(&v), Err(NetDrop::BadUdpLength));
    }

    #[test]
    fn arp_requests_for_us_are_answered_in_place() {
        let mut f = arp_request(&peer(), US);
        assert_eq!(parse(&f, &opts()), Ok(Frame::ArpRequest));
        arp_reply_in_place(&mut f, MAC, US);
        let eth = EthernetFrame::new_checked(&f[..]).unwrap();
        assert_eq!(eth.dst_addr(), peer().mac);
        assert_eq!(eth.src_addr(), MAC);
        let a = ArpPacket::new_checked(eth.payload()).unwrap();
        assert_eq!(a.operation(), 2);
        assert_eq!(a.sender_mac(), MAC);
        assert_eq!(a.sender_ip(), US);
        assert_eq!(a.target_mac(), peer().mac);
        assert_eq!(a.target_ip(), peer().ip);
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
        views_mut(&mut f).2.set_checksum(full);
        let (_, ip, u) = views(&f);
        let addresses = [ip.src_addr().octets(), ip.dst_addr().octets()].concat();
        let mut words: u32 = 17 + (f.len() - udp) as u32;
        for c in addresses.chunks(2).chain(u.datagram().chunks(2)) {
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
        let mut u = views_mut(&mut bad_field).2;
        u.set_checksum(u.checksum() ^ 0x0100);
        assert_eq!(parse(&bad_field, &opts()), Err(NetDrop::BadUdpChecksum));

        // No checksum (0) passes, even over a flipped bit.
        let mut none = bad.clone();
        views_mut(&mut none).2.set_checksum(0);
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
        views_mut(&mut partial).2.set_checksum(0x19ea);
        let them = ParseOptions {
            ip: Ipv4Addr::new(10, 231, 0, 1),
            ..opts()
        };
        assert!(
            parse(&partial, &them).is_ok(),
            "a partial checksum passes unverified"
        );
        let mut u = views_mut(&mut partial).2;
        u.set_checksum(u.checksum() ^ 0x0001);
        assert_eq!(parse(&partial, &them), Err(NetDrop::BadUdpChecksum));

        // A sum of 0 is sent as 0xffff, which verifies.
        let (a, b) = (Ipv4Addr::new(0, 0, 0, 0), Ipv4Addr::new(0, 0, 0, 0));
        let mut zero = [0u8; UDP_LEN];
        let mut u = UdpPacket::new_unchecked(&mut zero[..]);
        u.set_len(8);
        // pseudo 17 + 8, header length 8: 33; make the port field cancel it.
        u.set_src_port(0xffff - 33);
        assert_eq!(udp_checksum(a, b, &zero), 0xffff);
    }

    #[test]
    fn offloaded_headers_finished_as_a_nic_does_equal_the_software_ones() {
        let me = peer();
        let to = PeerAddr {
            mac: [2, 0, 0, 0, 0, 9],
            ip: Ipv4Addr::new(10, 0, 0, 9),
            port: 4242,
        };
        for n in [0usize, 1, 64, 8192] {
            let payload: Vec<u8> = (0..n as u32).map(|i| (i * 7 + 3) as u8).collect();
            let soft = ResultHeaders::new(me.mac, me.ip, me.port, n, payload_sum(&[], &payload));
            let off = ResultHeaders::offloaded(me.mac, me.ip, me.port, n);
            assert!(off.is_offloaded() && !soft.is_offloaded());
            let (mut s, mut o) = ([0u8; L2_L4_LEN], [0u8; L2_L4_LEN]);
            soft.write(&mut s, &to);
            off.write(&mut o, &to);
            // What DPDK's TX checksum offload is given: the IPv4 checksum
            // 0, the UDP one the pseudo-header's sum (rte_ipv4_phdr_cksum).
            assert_eq!(views(&o).1.checksum(), 0, "{n} bytes");
            let pseudo = fold(
                u64::from(ones_sum(&me.ip.octets()))
                    + u64::from(ones_sum(&to.ip.octets()))
                    + u64::from(IPPROTO_UDP)
                    + (UDP_LEN + n) as u64,
            );
            assert_eq!(views(&o).2.checksum(), pseudo, "{n} bytes");
            // What the NIC does: the IPv4 header's checksum, and the UDP
            // datagram (its field holding the pseudo-header's sum) summed
            // and complemented into the field.
            let ip = ip_checksum(views(&o).1.header());
            views_mut(&mut o).1.set_checksum(ip);
            let mut datagram = o[ETH_LEN + IPV4_LEN..].to_vec();
            datagram.extend_from_slice(&payload);
            let udp = udp_field(u64::from(ones_sum(&datagram)));
            views_mut(&mut o).2.set_checksum(udp);
            assert_eq!(o, s, "{n} bytes: the frame a NIC finishes is the one phub sums");
        }
    }

    #[test]
    fn a_result_checksum_from_the_payloads_sum_verifies() {
        // Header and values summed once, then each destination's headers:
        // the same field as summing the whole datagram, and it verifies.
        let head: Vec<u8> = (0..86u32).map(|i| (i * 3 + 1) as u8).collect();
        // Everything before the UDP checksum.
        let sum_at = ETH_LEN + IPV4_LEN + udp::field::CHECKSUM.start;
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
                    h[..sum_at],
                    w[..sum_at],
                    "{n} bytes: the headers write_udp_headers writes"
                );
                assert!(ip_checksum_verifies(&h));
                let field = views(&h).2.checksum();
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
            assert_eq!(h[..sum_at], whole[..sum_at]);
            let field = views(&h).2.checksum();
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
            let at = L2_L4_LEN + 20;
            let old: [u8; 4] = f[at..at + 4].try_into().unwrap();
            f[at..at + 4].copy_from_slice(&new);
            let field = udp_checksum_update(views(&f).2.checksum(), &old, &new);
            assert_eq!(field, udp_checksum(peer().ip, US, &f[udp..]), "{new:?}");
            views_mut(&mut f).2.set_checksum(field);
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
        let mut ip = views_mut(&mut bad).1;
        ip.set_checksum(ip.checksum() ^ 0x0100);
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
                let d = bytes(&mut x, len, fill);
                assert_eq!(ip_checksum(&d), reference(&d), "len {len}, {d:?}");
            }
        }
        // RFC 1071's worked example: words 0001 f203 f4f5 f6f7 sum to ddf2.
        assert_eq!(
            ip_checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            !0xddf2
        );
    }

    /// `len` bytes of `fill`, or of xorshift noise from the state `x`.
    fn bytes(x: &mut u32, len: usize, fill: Option<u8>) -> Vec<u8> {
        (0..len)
            .map(|_| {
                *x ^= *x << 13;
                *x ^= *x >> 17;
                *x ^= *x << 5;
                fill.unwrap_or(*x as u8)
            })
            .collect()
    }

    /// AVX2's multiply-add sum (with and without the copy) against the
    /// portable loop: every length near a block's, and inputs long enough
    /// to empty the lanes several times, of all-ones words (the largest
    /// sums), zeros and noise.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_multiply_add_sum_equals_the_portable_one() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: no AVX2 on this CPU");
            return;
        }
        let mut x: u32 = 0x2545_f491;
        let lens = (0..=70).chain([255, 256, 257, 8191, 8192, 9000, (1 << 11) * 32 * 3 + 17, 1 << 20]);
        for len in lens {
            for fill in [None, Some(0xffu8), Some(0)] {
                let d = bytes(&mut x, len, fill);
                let want = ones_sum_lanes(&d);
                // SAFETY: the CPU has AVX2 (checked above).
                let got = unsafe { x86::copy_ones_sum_madd(None, &d) };
                assert_eq!(got, want, "len {len} fill {fill:?}");
                let mut out = vec![0x5au8; len];
                // SAFETY: as above.
                let got = unsafe { x86::copy_ones_sum_madd(Some(&mut out), &d) };
                assert_eq!(got, want, "copy, len {len} fill {fill:?}");
                assert!(out == d, "copy, len {len}: bytes differ");
            }
        }
    }

    #[test]
    fn checksum_of_a_written_header_verifies() {
        let f = udp_frame(&peer(), MAC, US, 7900, &[0u8; 8000]);
        let ip = views(&f).1;
        assert_eq!(ip_checksum(ip.header()), 0);
        assert_eq!(ip.total_len(), 20 + 8 + 8000);
    }
}
