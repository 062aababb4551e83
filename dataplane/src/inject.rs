//! Fault injection around any packet I/O (tests and soaks; off unless
//! `--inject` asks for it): [`FaultyIo`] wraps a backend's queue as
//! smoltcp's `FaultInjector` wraps a device, and neither the backend, the
//! engine nor the poll loop knows about faults.
//!
//! Received datagrams get a fate each from a seeded [`Injector`]: handled,
//! lost, duplicated, held back until after the next burst (reordered), or
//! held back for the spec's `delay_ms` (delayed; the wait in the backend
//! never runs past the first one due). Sent results get a fate per
//! destination: lost, duplicated, or sent now. A reordered or delayed send
//! goes out now too: a payload is borrowed from slot memory while it is
//! sent, and nothing here may copy or keep it (the network reorders;
//! received packets are held back and delayed).

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use phub_proto::fault::{Fate, FaultSpec, Faults, Injector};

use crossbeam_channel::Receiver;

use crate::backend::PacketIo;
use crate::lcore::{self, Clock, Command, LoopOptions};
use phub_engine::counters::ShardCounters;
use phub_engine::engine::Shard;
use phub_engine::transmit::{Destinations, Transmit};

/// Runs an lcore's poll loop ([`lcore::run`]) over `io`, wrapped in a
/// [`FaultyIo`] when `faults` asks for injection.
pub fn run_lcore<Io: PacketIo>(
    io: Io,
    shard: Shard<Io::Addr>,
    commands: Receiver<Command>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    clock: Clock,
    opts: LoopOptions,
    faults: Option<FaultSpec>,
) -> io::Result<()> {
    match faults {
        None => lcore::run(io, shard, commands, stop, clock, opts),
        Some(spec) => {
            let io = FaultyIo::new(io, spec, shard.lcore(), Arc::clone(shard.counters()));
            lcore::run(io, shard, commands, stop, clock, opts)
        }
    }
}

/// Counts an injected fate under its counter.
fn count(counters: &ShardCounters, fate: Fate) {
    match fate {
        Fate::Deliver => {}
        Fate::Drop => counters.injected_drops.inc(),
        Fate::Duplicate => counters.injected_dups.inc(),
        Fate::Reorder => counters.injected_reorders.inc(),
        Fate::Delay => counters.injected_delays.inc(),
    }
}

/// A packet I/O queue with faults injected on both directions.
pub struct FaultyIo<Io: PacketIo> {
    inner: Io,
    rx: Injector<(Io::Addr, Vec<u8>)>,
    tx: Faults,
    counters: Arc<ShardCounters>,
}

impl<Io: PacketIo> FaultyIo<Io> {
    /// Wraps `inner`, the queue of lcore `lcore`, injecting `spec` (each
    /// lcore and direction draws its own stream of it) and counting what it
    /// does in `counters`.
    pub fn new(inner: Io, spec: FaultSpec, lcore: u16, counters: Arc<ShardCounters>) -> FaultyIo<Io> {
        let lcore = u64::from(lcore);
        FaultyIo {
            inner,
            rx: Injector::new(spec, 2 * lcore),
            tx: Faults::new(spec, 2 * lcore + 1),
            counters,
        }
    }
}

impl<Io: PacketIo> PacketIo for FaultyIo<Io> {
    type Addr = Io::Addr;

    fn peer_resolver(&self) -> Option<phub_engine::transmit::PeerResolver<Io::Addr>> {
        self.inner.peer_resolver()
    }

    fn stated_rx_buffer(&self) -> Option<u64> {
        self.inner.stated_rx_buffer()
    }

    fn rx_burst(&mut self, wait: Option<Duration>, f: &mut dyn FnMut(Io::Addr, &[u8])) -> io::Result<usize> {
        let now = Instant::now();
        // Never wait past the first delayed datagram's time (rounded up to
        // whole milliseconds, as the UDP backend waits).
        let wait = match (wait, self.rx.next_due()) {
            (Some(w), Some(due)) => {
                let left = due.saturating_duration_since(now).as_nanos();
                let ms = u64::try_from(left.div_ceil(1_000_000)).unwrap_or(u64::MAX);
                Some(w.min(Duration::from_millis(ms)))
            }
            (w, _) => w,
        };
        let (rx, counters) = (&mut self.rx, &*self.counters);
        let n = self.inner.rx_burst(wait, &mut |from, datagram| {
            let (fate, times) = rx.admit(now, || (from, datagram.to_vec()));
            count(counters, fate);
            for _ in 0..times {
                f(from, datagram);
            }
        })?;
        self.rx
            .end_turn(Instant::now(), |(from, datagram)| f(from, &datagram));
        Ok(n)
    }

    fn tx_burst<'a, D>(
        &mut self,
        transmits: impl Iterator<Item = Transmit<'a, D>>,
        counters: &ShardCounters,
    ) -> io::Result<()>
    where
        D: Destinations<Item = Io::Addr>,
    {
        let (faults, injected) = (&self.tx, &*self.counters);
        self.inner.tx_burst(
            transmits.map(|t| Transmit {
                header: t.header,
                payload: t.payload,
                to: Faulty {
                    inner: t.to,
                    faults,
                    counters: injected,
                    again: None,
                },
            }),
            counters,
        )
    }
}

/// A transmit's destinations with a fate drawn for each.
struct Faulty<'f, D: Iterator> {
    inner: D,
    faults: &'f Faults,
    counters: &'f ShardCounters,
    /// A duplicated destination's second send.
    again: Option<D::Item>,
}

impl<D: Iterator> Iterator for Faulty<'_, D>
where
    D::Item: Copy,
{
    type Item = D::Item;

    fn next(&mut self) -> Option<D::Item> {
        if let Some(a) = self.again.take() {
            return Some(a);
        }
        loop {
            let a = self.inner.next()?;
            let fate = self.faults.fate();
            count(self.counters, fate);
            match fate {
                Fate::Drop => {}
                Fate::Duplicate => {
                    self.again = Some(a);
                    return Some(a);
                }
                Fate::Deliver | Fate::Reorder | Fate::Delay => return Some(a),
            }
        }
    }
}

impl<D: Destinations> Destinations for Faulty<'_, D>
where
    D::Item: Copy,
{
    /// The destinations before any fate: counting draws none.
    fn planned(&self) -> usize {
        self.inner.planned()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// A queue that hands out what a test put in, one burst per call, and
    /// records what it was asked to send.
    #[derive(Default)]
    struct Script {
        bursts: VecDeque<Vec<(u32, Vec<u8>)>>,
        sent: Vec<(u32, usize, Vec<u8>)>,
        planned: Vec<usize>,
    }

    impl PacketIo for Script {
        type Addr = u32;

        fn rx_burst(&mut self, _wait: Option<Duration>, f: &mut dyn FnMut(u32, &[u8])) -> io::Result<usize> {
            let burst = self.bursts.pop_front().unwrap_or_default();
            for (from, d) in &burst {
                f(*from, d);
            }
            Ok(burst.len())
        }

        fn tx_burst<'a, D>(
            &mut self,
            transmits: impl Iterator<Item = Transmit<'a, D>>,
            _counters: &ShardCounters,
        ) -> io::Result<()>
        where
            D: Destinations<Item = u32>,
        {
            for t in transmits {
                self.planned.push(t.to.planned());
                for to in t.to {
                    self.sent.push((to, t.payload.len(), t.header.to_vec()));
                }
            }
            Ok(())
        }
    }

    #[derive(Clone)]
    struct Dests(std::ops::Range<u32>);

    impl Iterator for Dests {
        type Item = u32;
        fn next(&mut self) -> Option<u32> {
            self.0.next()
        }
    }

    impl Destinations for Dests {
        fn planned(&self) -> usize {
            self.0.len()
        }
    }

    fn transmit(to: std::ops::Range<u32>) -> Transmit<'static, Dests> {
        Transmit {
            header: [7; phub_proto::wire::HEADER_LEN],
            payload: &[1, 2, 3],
            to: Dests(to),
        }
    }

    #[test]
    fn planned_destinations_are_counted_without_drawing_fates() {
        let counters = Arc::new(ShardCounters::default());
        let spec: FaultSpec = "loss=0.5,seed=9".parse().unwrap();
        let mut io = FaultyIo::new(Script::default(), spec, 0, Arc::clone(&counters));
        io.tx_burst([transmit(0..2)].into_iter(), &counters).unwrap();
        let drops = counters.injected_drops.get();
        assert_eq!(io.inner.planned, [2], "the plan is every destination");
        // The fates drawn as the destinations are walked: each one is
        // either sent or counted as dropped, once.
        assert_eq!(io.inner.sent.len() as u64 + drops, 2);
        // Counting drew no fate: the same spec and stream without the
        // count give the same sends.
        let again = Faults::new(spec, 1);
        let kept: Vec<u32> = (0..2).filter(|_| again.fate() != Fate::Drop).collect();
        let sent: Vec<u32> = io.inner.sent.iter().map(|s| s.0).collect();
        assert_eq!(sent, kept);
    }

    #[test]
    fn sends_are_lost_or_duplicated_per_destination_and_counted() {
        let counters = Arc::new(ShardCounters::default());
        let spec: FaultSpec = "loss=0.2,dup=0.2,reorder=0.1,delay=0.1,seed=4".parse().unwrap();
        let mut io = FaultyIo::new(Script::default(), spec, 3, Arc::clone(&counters));
        let n = 2000u32;
        io.tx_burst((0..n / 10).map(|i| transmit(i * 10..i * 10 + 10)), &counters)
            .unwrap();
        let (drops, dups) = (counters.injected_drops.get(), counters.injected_dups.get());
        assert_eq!(io.inner.sent.len() as u64, u64::from(n) - drops + dups);
        assert!(
            drops > 250 && drops < 550 && dups > 250 && dups < 550,
            "{drops} {dups}"
        );
        // Reordered and delayed sends go out at once, counted.
        assert!(counters.injected_reorders.get() > 100 && counters.injected_delays.get() > 100);
        // Each destination appears at most twice, in order.
        let mut seen = vec![0u8; n as usize];
        let mut last = 0;
        for &(to, len, _) in &io.inner.sent {
            assert!(to >= last && len == 3);
            last = to;
            seen[to as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c <= 2));
    }

    #[test]
    fn received_datagrams_are_held_back_a_burst_or_delayed_and_counted() {
        let counters = Arc::new(ShardCounters::default());
        let spec: FaultSpec = "loss=0.1,dup=0.1,reorder=0.2,delay=0.1,delay_ms=1,seed=2"
            .parse()
            .unwrap();
        let mut script = Script::default();
        let bursts = 50u32;
        for b in 0..bursts {
            script.bursts.push_back(
                (b * 8..b * 8 + 8)
                    .map(|i| (i, i.to_le_bytes().to_vec()))
                    .collect(),
            );
        }
        let mut io = FaultyIo::new(script, spec, 1, Arc::clone(&counters));
        let mut got: Vec<(u32, u32)> = Vec::new(); // (datagram, burst handled in)
        let mut burst = 0;
        let start = Instant::now();
        while burst < bursts + 2 || io.rx.holds() || io.rx.next_due().is_some() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "held datagrams never came out"
            );
            io.rx_burst(Some(Duration::from_millis(1)), &mut |from, d| {
                assert_eq!(d, from.to_le_bytes());
                got.push((from, burst));
            })
            .unwrap();
            burst += 1;
        }
        let c = &counters;
        let (drops, dups) = (c.injected_drops.get(), c.injected_dups.get());
        let (reorders, delays) = (c.injected_reorders.get(), c.injected_delays.get());
        assert!(drops > 0 && dups > 0 && reorders > 0 && delays > 0);
        assert_eq!(got.len() as u64, u64::from(bursts * 8) - drops + dups);
        // A reordered datagram is handled after the next burst's own: in
        // the next call, after a later datagram.
        let late = got
            .windows(2)
            .filter(|w| w[1].0 < w[0].0 && w[1].1 == w[0].1)
            .count();
        assert!(late > 0, "some datagrams came after later ones");
        for &(d, b) in &got {
            assert!(b >= d / 8, "datagram {d} handled in burst {b}, before it arrived");
        }
    }
}
