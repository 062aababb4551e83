//! What `phub-rack-agent` does on a worker host, and what it reports: the
//! suite starts it through a [`crate::launch::Launcher`] (ssh on a lab
//! rack, `ip netns exec` on the virtual one) and reads one JSON line from
//! its stdout.
//!
//! Layer: test support only.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use phub_proto::wire::{MsgType, Repr, HEADER_LEN};
use phub_proto::Dtype;
use phub_worker::WorkerStats;
use serde::{Deserialize, Serialize};

/// What a blast sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blast {
    /// The appliance's data address.
    pub to: String,
    /// UDP port of lcore 0.
    pub base_port: u16,
    /// Ports (lcores) to send to: base_port..base_port + queues.
    pub queues: u16,
    /// Payload bytes after the phub header.
    pub payload: usize,
    /// Job id of what goes to lcore 0's port; lcore q's port gets job + q.
    pub job: u16,
    /// How long to send, or how many datagrams per port.
    pub amount: Amount,
    /// Pause after every 32 rounds over the ports, microseconds (0: none).
    pub pause_us: u64,
}

/// How much a [`Blast`] sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Amount {
    /// As fast as the socket takes them, for this long.
    Secs(u32),
    /// Exactly this many datagrams to each port (each send must succeed).
    PerPort(u64),
}

/// A blast's report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BlastReport {
    /// Datagrams the kernel took, over all ports.
    pub sent: u64,
    /// How long it sent, seconds.
    pub secs: f64,
}

/// A PUSH for job `job` (installed or not) with `payload` bytes of zeros
/// and a token nobody holds.
pub fn push_datagram(job: u16, payload: usize) -> Vec<u8> {
    let repr = Repr::request(MsgType::Push, job, 1, 0, 1, 0).with_payload(Dtype::F32, (payload / 4) as u16);
    let mut b = vec![0u8; HEADER_LEN + payload];
    b[..HEADER_LEN].copy_from_slice(&repr.to_bytes());
    b
}

/// Sends `b`'s datagrams round-robin over the ports.
pub fn blast(b: &Blast) -> Result<BlastReport, String> {
    let s = UdpSocket::bind("0.0.0.0:0").map_err(|e| format!("binding a UDP socket: {e}"))?;
    let ds: Vec<Vec<u8>> = (0..b.queues)
        .map(|q| push_datagram(b.job + q, b.payload))
        .collect();
    let t = Instant::now();
    let mut sent = 0u64;
    let mut i = 0u64;
    loop {
        match b.amount {
            Amount::Secs(secs) if t.elapsed() >= Duration::from_secs(u64::from(secs)) => break,
            Amount::PerPort(n) if i >= n => break,
            _ => {}
        }
        for (q, d) in ds.iter().enumerate() {
            match s.send_to(d, (b.to.as_str(), b.base_port + q as u16)) {
                Ok(_) => sent += 1,
                // Flat out, a full socket buffer is expected: count what went.
                Err(_) if matches!(b.amount, Amount::Secs(_)) => {}
                Err(e) => return Err(format!("sending to {}:{}: {e}", b.to, b.base_port + q as u16)),
            }
        }
        i += 1;
        if b.pause_us > 0 && i.is_multiple_of(32) {
            std::thread::sleep(Duration::from_micros(b.pause_us));
        }
    }
    Ok(BlastReport {
        sent,
        secs: t.elapsed().as_secs_f64(),
    })
}

/// A training rank's report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainReport {
    /// The rank.
    pub rank: u16,
    /// Rounds done, every result checked exactly.
    pub rounds: u32,
    /// The worker's counters.
    pub stats: WorkerStats,
}
