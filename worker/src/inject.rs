//! Seeded fault injection in the worker's transport, for tests and soaks:
//! off unless [`WorkerConfig::inject`](crate::WorkerConfig::inject) (or
//! `PHUB_WORKER_INJECT`) asks for it, and then every datagram the I/O
//! thread sends and every datagram it receives gets a fate from a seeded
//! [`Faults`]: delivered, lost, duplicated, or held back and delivered after
//! later ones (reordered).
//!
//! Fates are drawn per datagram, before the datagrams are grouped into UDP
//! GSO trains on the way out and after GRO trains are split on the way in
//! ([`crate::net`] hands the I/O thread single datagrams), so GSO and GRO
//! stay on and a train is never lost or duplicated as a whole.
//!
//! Held back means: a send is held for one turn of the I/O loop and goes
//! out after what that turn sends (at most about one 1 ms tick later while
//! requests are in flight); a receive is handled after the next batch the
//! socket gives (likewise). This is also the delay model: `FaultSpec` has no
//! separate delay.
//!
//! Off, the I/O thread pays one branch on an `Option` per batch sent and
//! per datagram received.

use std::net::SocketAddr;
use std::sync::Arc;

use phub_proto::fault::{Fate, FaultSpec, Faults};

use crate::net::Datagram;
use crate::stats::{add, Counters};

/// The environment variable that turns worker-side injection on when the
/// configuration does not: a [`FaultSpec`], e.g. `loss=0.05,seed=3`.
pub const INJECT_ENV: &str = "PHUB_WORKER_INJECT";

/// Streams of the worker's deciders live above the dataplane's (which
/// number theirs 2 x lcore + direction), so that one spec given to both
/// sides does not make them drop the same packets.
const WORKER_STREAMS: u64 = 1 << 40;

/// A datagram held back, copied.
#[derive(Debug)]
pub(crate) struct Held {
    /// Its destination (sent) or source (received).
    pub(crate) addr: SocketAddr,
    /// Its UDP payload.
    pub(crate) bytes: Vec<u8>,
}

/// The injector of one worker: a decider per direction and what it holds.
#[derive(Debug)]
pub(crate) struct Injector {
    tx: Faults,
    rx: Faults,
    /// Sends held back in this turn of the I/O loop.
    tx_held: Vec<Held>,
    /// Sends held back in the previous turn, sent at the end of this one.
    tx_due: Vec<Held>,
    /// Receives held back, handled after the next batch.
    rx_held: Vec<Held>,
    stats: Arc<Counters>,
}

impl Injector {
    /// An injector for `spec`, with streams of its own for job `job`, rank
    /// `rank` (workers of one job draw different sequences).
    pub(crate) fn new(spec: FaultSpec, job: u16, rank: u16, stats: Arc<Counters>) -> Injector {
        let stream = WORKER_STREAMS | (u64::from(job) << 17) | (u64::from(rank) << 1);
        Injector {
            tx: Faults::new(spec, stream),
            rx: Faults::new(spec, stream | 1),
            tx_held: Vec::new(),
            tx_due: Vec::new(),
            rx_held: Vec::new(),
            stats,
        }
    }

    /// Appends to `out` what goes out now of `batch`: a lost datagram is
    /// left out, a duplicated one appended twice, a reordered one copied
    /// and held until the end of the next turn ([`Injector::release`]).
    pub(crate) fn outgoing<'a>(&mut self, batch: &[Datagram<'a>], out: &mut Vec<Datagram<'a>>) {
        for d in batch {
            match self.tx.fate() {
                Fate::Deliver => out.push(*d),
                Fate::Drop => add(&self.stats.injected_drops, 1),
                Fate::Duplicate => {
                    add(&self.stats.injected_dups, 1);
                    out.push(*d);
                    out.push(*d);
                }
                Fate::Reorder => {
                    add(&self.stats.injected_reorders, 1);
                    let mut bytes = Vec::with_capacity(d.len());
                    bytes.extend_from_slice(d.head);
                    bytes.extend_from_slice(d.body);
                    self.tx_held.push(Held { addr: d.to, bytes });
                }
            }
        }
    }

    /// The end of a turn of the I/O loop: hands `send` the datagrams held
    /// back in the previous turn (if any), and keeps those held in this one
    /// for the next.
    pub(crate) fn release(&mut self, send: impl FnOnce(&[Datagram<'_>])) {
        if !self.tx_due.is_empty() {
            let due: Vec<Datagram<'_>> = self
                .tx_due
                .iter()
                .map(|h| Datagram {
                    to: h.addr,
                    head: &h.bytes,
                    body: &[],
                })
                .collect();
            send(&due);
            self.tx_due.clear();
        }
        std::mem::swap(&mut self.tx_due, &mut self.tx_held);
    }

    /// Whether sends are held back (the I/O loop must come round again
    /// soon to release them).
    pub(crate) fn holds_sends(&self) -> bool {
        !self.tx_due.is_empty() || !self.tx_held.is_empty()
    }

    /// The fate of a received datagram, as the number of times to handle it
    /// now: 0 (lost, or copied and held back until [`Injector::take_held`]),
    /// 1, or 2 (duplicated).
    pub(crate) fn incoming(&mut self, from: SocketAddr, d: &[u8]) -> usize {
        match self.rx.fate() {
            Fate::Deliver => 1,
            Fate::Drop => {
                add(&self.stats.injected_drops, 1);
                0
            }
            Fate::Duplicate => {
                add(&self.stats.injected_dups, 1);
                2
            }
            Fate::Reorder => {
                add(&self.stats.injected_reorders, 1);
                self.rx_held.push(Held {
                    addr: from,
                    bytes: d.to_vec(),
                });
                0
            }
        }
    }

    /// Takes the received datagrams held back so far: call it before a
    /// batch is received and handle them after it.
    pub(crate) fn take_held(&mut self) -> Vec<Held> {
        std::mem::take(&mut self.rx_held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// Sends `n` numbered datagrams through `inj` in batches of `batch`,
    /// one batch per turn; returns the numbers in the order they went out.
    fn send_through(inj: &mut Injector, n: u32, batch: u32) -> Vec<u32> {
        let payloads: Vec<[u8; 4]> = (0..n).map(u32::to_le_bytes).collect();
        let mut wire = Vec::new();
        let record = |wire: &mut Vec<u32>, ds: &[Datagram<'_>]| {
            for d in ds {
                let mut b = d.head.to_vec();
                b.extend_from_slice(d.body);
                wire.push(u32::from_le_bytes(b[..4].try_into().unwrap()));
            }
        };
        for chunk in payloads.chunks(batch as usize) {
            // Half the datagrams split into head and body, as the I/O
            // thread's lent gradients are.
            let ds: Vec<Datagram<'_>> = chunk
                .iter()
                .map(|p| Datagram {
                    to: addr(9000),
                    head: &p[..2],
                    body: &p[2..],
                })
                .collect();
            let mut out = Vec::new();
            inj.outgoing(&ds, &mut out);
            record(&mut wire, &out);
            inj.release(|ds| record(&mut wire, ds));
        }
        // Two idle turns release whatever is still held.
        inj.release(|ds| record(&mut wire, ds));
        inj.release(|ds| record(&mut wire, ds));
        assert!(!inj.holds_sends());
        wire
    }

    /// Receives `n` numbered datagrams in batches of `batch`, the held
    /// ones after the next batch; returns the numbers in the order handled.
    fn receive_through(inj: &mut Injector, n: u32, batch: u32) -> Vec<u32> {
        let mut handled = Vec::new();
        let mut next = 0;
        while next < n || !inj.rx_held.is_empty() {
            let held = inj.take_held();
            for i in next..(next + batch).min(n) {
                let d = i.to_le_bytes();
                for _ in 0..inj.incoming(addr(9000), &d) {
                    handled.push(i);
                }
            }
            next = (next + batch).min(n);
            for h in held {
                assert_eq!(h.addr, addr(9000));
                handled.push(u32::from_le_bytes(h.bytes[..4].try_into().unwrap()));
            }
        }
        handled
    }

    fn rate(x: u64, n: u32) -> f64 {
        x as f64 / f64::from(n)
    }

    #[test]
    fn drops_duplicates_and_reorders_at_the_asked_rates() {
        let spec: FaultSpec = "loss=0.1,dup=0.05,reorder=0.08,seed=11".parse().unwrap();
        let n = 50_000;
        for direction in ["send", "receive"] {
            let stats = Arc::new(Counters::default());
            let mut inj = Injector::new(spec, 3, 1, Arc::clone(&stats));
            let got = match direction {
                "send" => send_through(&mut inj, n, 32),
                _ => receive_through(&mut inj, n, 32),
            };
            let s = stats.snapshot();
            let (drops, dups, reorders) = (s.injected_drops, s.injected_dups, s.injected_reorders);
            for (name, x, want) in [
                ("loss", drops, 0.1),
                ("dup", dups, 0.05),
                ("reorder", reorders, 0.08),
            ] {
                assert!(
                    (rate(x, n) - want).abs() < 0.01,
                    "{direction}: {name} rate {} (asked {want})",
                    rate(x, n)
                );
            }
            // Every datagram is accounted for: delivered once, twice or not.
            assert_eq!(got.len() as u64, u64::from(n) - drops + dups, "{direction}");
            let mut counts = vec![0u32; n as usize];
            for &i in &got {
                counts[i as usize] += 1;
            }
            assert_eq!(counts.iter().filter(|&&c| c == 0).count() as u64, drops);
            assert_eq!(counts.iter().filter(|&&c| c == 2).count() as u64, dups);
            // Reordered ones come after later ones.
            let mut max = 0;
            let late = got
                .iter()
                .filter(|&&i| {
                    max = max.max(i);
                    i < max
                })
                .count() as u64;
            assert!(
                late <= reorders && late >= reorders * 9 / 10,
                "{direction}: {late} datagrams came before earlier ones, {reorders} held back"
            );
        }
    }

    #[test]
    fn the_same_seed_and_rank_give_the_same_fates() {
        let spec: FaultSpec = "loss=0.2,dup=0.1,reorder=0.1,seed=5".parse().unwrap();
        let run = |job: u16, rank: u16, seed: u64| {
            let spec = FaultSpec { seed, ..spec };
            let mut inj = Injector::new(spec, job, rank, Arc::new(Counters::default()));
            (
                send_through(&mut inj, 2000, 16),
                receive_through(&mut inj, 2000, 16),
            )
        };
        let a = run(1, 0, 5);
        assert_eq!(a, run(1, 0, 5), "same job, rank and seed");
        assert_ne!(a.0, a.1, "send and receive draw different sequences");
        assert_ne!(a, run(1, 1, 5), "another rank draws another sequence");
        assert_ne!(a, run(2, 0, 5), "another job draws another sequence");
        assert_ne!(a, run(1, 0, 6), "another seed draws another sequence");
        // Not the sequences of the dataplane's lcores for the same spec.
        for stream in 0..8 {
            let f = Faults::new(FaultSpec { seed: 5, ..spec }, stream);
            let inj = Injector::new(FaultSpec { seed: 5, ..spec }, 1, 0, Arc::new(Counters::default()));
            let mine: Vec<Fate> = (0..64).map(|_| inj.tx.fate()).collect();
            let theirs: Vec<Fate> = (0..64).map(|_| f.fate()).collect();
            assert_ne!(mine, theirs, "dataplane stream {stream}");
        }
    }

    #[test]
    fn off_rates_deliver_everything_in_order() {
        let stats = Arc::new(Counters::default());
        let mut inj = Injector::new(FaultSpec::default(), 1, 0, Arc::clone(&stats));
        let want: Vec<u32> = (0..1000).collect();
        assert_eq!(send_through(&mut inj, 1000, 7), want);
        assert_eq!(receive_through(&mut inj, 1000, 7), want);
        assert_eq!(stats.snapshot(), crate::WorkerStats::default());
    }
}
