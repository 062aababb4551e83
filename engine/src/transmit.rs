//! What an lcore sends: the engine queues messages, a backend sends them as
//! [`Transmit`]s. This is the one type the two share, so that backends know
//! nothing of the engine (quinn-udp's shape: a backend takes an iterator of
//! transmits).

use phub_proto::wire::HEADER_LEN;

/// Most packets a backend may hand to the engine between two drains of its
/// transmits without the transmit queue allocating; also the largest
/// receive burst a backend hands over.
pub const MAX_BURST: usize = 512;

/// How an lcore turns another appliance's data address (a hierarchical
/// job's peer, PROTOCOL.md §9) into its backend's address type; `None`
/// when the backend cannot reach it.
pub type PeerResolver<A> = std::sync::Arc<dyn Fn(std::net::SocketAddrV4) -> Option<A> + Send + Sync>;

/// One message to send: a header, a payload borrowed from slot memory, and
/// its destinations. The header is the same for every destination, so a
/// backend sends the payload to each without copying it per destination.
#[derive(Debug)]
pub struct Transmit<'a, D> {
    /// The phub header.
    pub header: [u8; HEADER_LEN],
    /// The payload (empty for ERROR and for a RESULT with the SHM flag).
    pub payload: &'a [u8],
    /// Where to send it.
    pub to: D,
}

/// The destinations of a [`Transmit`], walked once while it is sent.
pub trait Destinations: Iterator {
    /// How many destinations there are before anything in between (fault
    /// injection) skips or repeats some: what a backend can prepare for
    /// (one payload reference each). Counting them changes nothing.
    fn planned(&self) -> usize;
}
