//! Seeded fault injection in the worker's transport, for tests and soaks:
//! off unless [`WorkerConfig::inject`](crate::WorkerConfig::inject) (or
//! `PHUB_WORKER_INJECT`) asks for it, and then every datagram the I/O
//! thread sends and every datagram it receives gets a fate from a seeded
//! [`Faults`]: delivered, lost, duplicated, held back and delivered after
//! later ones (reordered), or held back for the spec's `delay_ms` (delayed).
//!
//! Fates are drawn per datagram, before the datagrams are grouped into UDP
//! GSO trains on the way out and after GRO trains are split on the way in
//! ([`crate::net`] hands the I/O thread single datagrams), so GSO and GRO
//! stay on and a train is never lost or duplicated as a whole.
//!
//! Reordered means: a send is held for one turn of the I/O loop and goes
//! out after what that turn sends (at most about one 1 ms tick later while
//! requests are in flight); a receive is handled after the next batch the
//! socket gives (likewise). Delayed means: a send goes out, and a receive is
//! handled, at the first turn of the I/O loop once `delay_ms` has passed
//! since it was sent or received (phub-proto's `fault::Injector` holds
//! them, as it does for the dataplane); the loop's wait is bounded by
//! [`Injector::next_due`] so that turn comes in time. Time is a parameter
//! here (the I/O thread passes its clock), so the tests need no sleeps.
//!
//! Off, the I/O thread pays one branch on an `Option` per batch sent and
//! per datagram received.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use phub_proto::fault::{self, Fate, FaultSpec};

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

/// The injector of one worker: a decider per direction and what it holds
/// (phub-proto's [`fault::Injector`], which the dataplane's queues use too).
#[derive(Debug)]
pub(crate) struct Injector {
    tx: fault::Injector<Held>,
    rx: fault::Injector<Held>,
    stats: Arc<Counters>,
}

/// A copy of `d`'s bytes, to hold.
fn copy(d: &Datagram<'_>) -> Held {
    let mut bytes = Vec::with_capacity(d.len());
    bytes.extend_from_slice(d.head);
    bytes.extend_from_slice(d.body);
    Held { addr: d.to, bytes }
}

/// `h` as a datagram to send.
fn datagram(h: &Held) -> Datagram<'_> {
    Datagram {
        to: h.addr,
        head: &h.bytes,
        body: &[],
    }
}

impl Injector {
    /// An injector for `spec`, with streams of its own for job `job`, rank
    /// `rank` (workers of one job draw different sequences).
    pub(crate) fn new(spec: FaultSpec, job: u16, rank: u16, stats: Arc<Counters>) -> Injector {
        let stream = WORKER_STREAMS | (u64::from(job) << 17) | (u64::from(rank) << 1);
        Injector {
            tx: fault::Injector::new(spec, stream),
            rx: fault::Injector::new(spec, stream | 1),
            stats,
        }
    }

    fn count(&self, fate: Fate) {
        let c = match fate {
            Fate::Deliver => return,
            Fate::Drop => &self.stats.injected_drops,
            Fate::Duplicate => &self.stats.injected_dups,
            Fate::Reorder => &self.stats.injected_reorders,
            Fate::Delay => &self.stats.injected_delays,
        };
        add(c, 1);
    }

    /// Appends to `out` what goes out now (`now`) of `batch`: a lost
    /// datagram is left out, a duplicated one appended twice, a reordered
    /// one copied and held until the end of the next turn, a delayed one
    /// copied and held until `now` + `delay_ms` ([`Injector::release`]).
    pub(crate) fn outgoing<'a>(&mut self, batch: &[Datagram<'a>], out: &mut Vec<Datagram<'a>>, now: Instant) {
        for d in batch {
            let (fate, times) = self.tx.admit(now, || copy(d));
            self.count(fate);
            for _ in 0..times {
                out.push(*d);
            }
        }
    }

    /// The end of a turn of the I/O loop at `now`: hands `send` the
    /// datagrams held back in the previous turn and the delayed ones due by
    /// `now`, in one batch (if any), and keeps those held in this turn for
    /// the next.
    pub(crate) fn release(&mut self, now: Instant, send: impl FnOnce(&[Datagram<'_>])) {
        let mut out = Vec::new();
        self.tx.end_turn(now, |h| out.push(h));
        if !out.is_empty() {
            let ds: Vec<Datagram<'_>> = out.iter().map(datagram).collect();
            send(&ds);
        }
    }

    /// Whether reordered sends are held back (the I/O loop must come round
    /// again soon to release them; delayed ones have [`Injector::next_due`]).
    pub(crate) fn holds_sends(&self) -> bool {
        self.tx.holds()
    }

    /// When the first delayed datagram (sent or received) is due, if any:
    /// the I/O loop must not wait past it.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        match (self.tx.next_due(), self.rx.next_due()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The fate of a datagram received at `now`, as the number of times to
    /// handle it now: 0 (lost, or copied and held back until
    /// [`Injector::released`] gives it back), 1, or 2 (duplicated).
    pub(crate) fn incoming(&mut self, from: SocketAddr, d: &[u8], now: Instant) -> usize {
        let (fate, times) = self.rx.admit(now, || Held {
            addr: from,
            bytes: d.to_vec(),
        });
        self.count(fate);
        times
    }

    /// After a batch was received at `now`: the datagrams held back in the
    /// batch before and the delayed ones due by `now` (each kind in the
    /// order received), to handle after this batch's own.
    pub(crate) fn released(&mut self, now: Instant) -> Vec<Held> {
        let mut out = Vec::new();
        self.rx.end_turn(now, |h| out.push(h));
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use phub_proto::fault::Faults;

    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// Turn `i` of the I/O loop in the tests: 1 ms apart.
    fn turn(start: Instant, i: u32) -> Instant {
        start + Duration::from_millis(u64::from(i))
    }

    /// Sends `n` numbered datagrams through `inj` in batches of `batch`,
    /// one batch per turn, a turn per millisecond; returns the numbers in
    /// the order they went out.
    fn send_through(inj: &mut Injector, n: u32, batch: u32) -> Vec<u32> {
        let start = Instant::now();
        let payloads: Vec<[u8; 4]> = (0..n).map(u32::to_le_bytes).collect();
        let mut wire = Vec::new();
        let record = |wire: &mut Vec<u32>, ds: &[Datagram<'_>]| {
            for d in ds {
                let mut b = d.head.to_vec();
                b.extend_from_slice(d.body);
                wire.push(u32::from_le_bytes(b[..4].try_into().unwrap()));
            }
        };
        let mut turns = 0;
        for chunk in payloads.chunks(batch as usize) {
            let now = turn(start, turns);
            turns += 1;
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
            inj.outgoing(&ds, &mut out, now);
            record(&mut wire, &out);
            inj.release(now, |ds| record(&mut wire, ds));
        }
        // Two idle turns past the longest hold release whatever is held.
        let later = turn(start, turns + 1001);
        inj.release(later, |ds| record(&mut wire, ds));
        inj.release(later, |ds| record(&mut wire, ds));
        assert!(!inj.holds_sends() && inj.next_due().is_none());
        wire
    }

    /// Receives `n` numbered datagrams in batches of `batch`, one batch per
    /// turn, a turn per millisecond, the held ones after the next batch (or
    /// the first once due); returns the numbers in the order handled.
    fn receive_through(inj: &mut Injector, n: u32, batch: u32) -> Vec<u32> {
        let start = Instant::now();
        let mut handled = Vec::new();
        let mut next = 0;
        let mut turns = 0;
        while next < n || inj.rx.holds() || inj.next_due().is_some() {
            let now = turn(start, turns);
            turns += 1;
            for i in next..(next + batch).min(n) {
                let d = i.to_le_bytes();
                for _ in 0..inj.incoming(addr(9000), &d, now) {
                    handled.push(i);
                }
            }
            next = (next + batch).min(n);
            for h in inj.released(now) {
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
    fn drops_duplicates_reorders_and_delays_at_the_asked_rates() {
        let spec: FaultSpec = "loss=0.1,dup=0.05,reorder=0.08,delay=0.04,delay_ms=3,seed=11"
            .parse()
            .unwrap();
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
            let delays = s.injected_delays;
            for (name, x, want) in [
                ("loss", drops, 0.1),
                ("dup", dups, 0.05),
                ("reorder", reorders, 0.08),
                ("delay", delays, 0.04),
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
            // Reordered and delayed ones come after later ones.
            let mut max = 0;
            let late = got
                .iter()
                .filter(|&&i| {
                    max = max.max(i);
                    i < max
                })
                .count() as u64;
            let held = reorders + delays;
            assert!(
                late <= held && late >= held * 9 / 10,
                "{direction}: {late} datagrams came before earlier ones, {held} held back"
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
            let mine: Vec<Fate> = (0..64).map(|_| inj.tx.faults().fate()).collect();
            let theirs: Vec<Fate> = (0..64).map(|_| f.fate()).collect();
            assert_ne!(mine, theirs, "dataplane stream {stream}");
        }
    }

    #[test]
    fn a_delayed_datagram_waits_its_hold_time_and_no_longer() {
        let spec: FaultSpec = "delay=0.5,delay_ms=3,seed=2".parse().unwrap();
        let stats = Arc::new(Counters::default());
        let mut inj = Injector::new(spec, 1, 0, Arc::clone(&stats));
        let t0 = Instant::now();
        let hold = Duration::from_millis(3);
        let just_before = t0 + hold - Duration::from_nanos(1);
        let number = |b: &[u8]| u32::from_le_bytes(b[..4].try_into().unwrap());

        // Sent at t0: the delayed ones stay held until t0 + 3 ms.
        let payloads: Vec<[u8; 4]> = (0..64u32).map(u32::to_le_bytes).collect();
        let ds: Vec<Datagram<'_>> = payloads
            .iter()
            .map(|p| Datagram {
                to: addr(9000),
                head: p,
                body: &[],
            })
            .collect();
        let mut out = Vec::new();
        inj.outgoing(&ds, &mut out, t0);
        let now: Vec<u32> = out.iter().map(|d| number(d.head)).collect();
        let delayed = stats.snapshot().injected_delays;
        assert!(delayed > 0 && delayed < 64, "{delayed} of 64 delayed");
        assert_eq!(now.len() as u64, 64 - delayed);
        assert_eq!(inj.next_due(), Some(t0 + hold));
        assert!(!inj.holds_sends(), "delayed sends are not held for one turn");
        for at in [t0, just_before] {
            inj.release(at, |ds| panic!("{} datagrams released early", ds.len()));
        }
        let mut late = Vec::new();
        inj.release(t0 + hold, |ds| {
            late.extend(ds.iter().map(|d| number(d.head)));
        });
        // Each delayed one once, in the order sent, then nothing more.
        let mut want: Vec<u32> = (0..64).filter(|i| !now.contains(i)).collect();
        assert_eq!(late, want);
        assert_eq!(inj.next_due(), None);
        inj.release(t0 + hold * 10, |ds| {
            panic!("{} datagrams released twice", ds.len())
        });

        // Received at t0 and t0 + 1 ms: each waits its own 3 ms.
        let t1 = t0 + Duration::from_millis(1);
        let mut kept = Vec::new();
        for (at, i) in (0..64u32).map(|i| (if i < 32 { t0 } else { t1 }, i)) {
            if inj.incoming(addr(9001), &i.to_le_bytes(), at) == 0 {
                kept.push(i);
            }
        }
        assert!(!kept.is_empty() && kept.iter().any(|&i| i < 32) && kept.iter().any(|&i| i >= 32));
        assert_eq!(inj.next_due(), Some(t0 + hold));
        assert!(inj.released(just_before).is_empty(), "released before its time");
        let first: Vec<u32> = inj.released(t0 + hold).iter().map(|h| number(&h.bytes)).collect();
        want = kept.iter().copied().filter(|&i| i < 32).collect();
        assert_eq!(first, want, "the ones received at t0, in order");
        assert!(inj.released(t1 + hold - Duration::from_nanos(1)).is_empty());
        let second = inj.released(t1 + hold);
        assert!(second.iter().all(|h| h.addr == addr(9001)));
        let second: Vec<u32> = second.iter().map(|h| number(&h.bytes)).collect();
        want = kept.iter().copied().filter(|&i| i >= 32).collect();
        assert_eq!(second, want, "the ones received at t0 + 1 ms, in order");
        assert_eq!(inj.next_due(), None);
        assert_eq!(stats.snapshot().injected_delays, delayed + kept.len() as u64);
    }

    #[test]
    fn off_rates_deliver_everything_in_order() {
        let stats = Arc::new(Counters::default());
        let mut inj = Injector::new(FaultSpec::default(), 1, 0, Arc::clone(&stats));
        let want: Vec<u32> = (0..1000).collect();
        assert_eq!(send_through(&mut inj, 1000, 7), want);
        assert_eq!(receive_through(&mut inj, 1000, 7), want);
        assert_eq!(stats.snapshot(), crate::stats::WorkerStats::default());
    }
}
