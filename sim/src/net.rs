//! The simulated network: every datagram between two nodes crosses one
//! link, which delays it (a base delay per link plus jitter), loses it,
//! duplicates it or holds it back behind later ones, each drawn from one
//! seeded generator, so a run is a function of its seed. A node can be
//! cut off for a while (a partition: everything to or from it is lost)
//! or clogged (everything to or from it waits until the clog ends, then
//! arrives, as TigerBeetle's simulator clogs a path).
//!
//! Invariants: a datagram sent is delivered zero, one or two times, never
//! before `now + 1` µs; what is delivered at one instant goes in the order
//! it was queued; the counts add up (`sent = lost + delivered - duplicated`
//! once the queue is empty).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::net::SocketAddr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A node on the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Node {
    /// A worker, by rank.
    Worker(u16),
    /// An lcore of an appliance: (appliance, lcore on it).
    Lcore(u16, u16),
}

impl Node {
    /// The node's address (what the worker transport and the engine see).
    /// An appliance's lcores share its host, one port each from 9000 (its
    /// data address, as control lists it to workers and peers).
    pub fn addr(self) -> SocketAddr {
        match self {
            Node::Worker(r) => {
                let [hi, lo] = r.to_be_bytes();
                SocketAddr::from(([10, 0, hi, lo], 5000))
            }
            Node::Lcore(a, l) => {
                let [hi, lo] = a.to_be_bytes();
                SocketAddr::from(([10, 1, hi, lo], 9000 + l))
            }
        }
    }

    /// The host of appliance `a` (its lcore i at port 9000 + i).
    pub fn appliance_host(a: u16) -> String {
        let [hi, lo] = a.to_be_bytes();
        format!("10.1.{hi}.{lo}")
    }

    /// The node at `addr`, if it is one of a simulated network's.
    pub fn of(addr: SocketAddr) -> Option<Node> {
        let SocketAddr::V4(v4) = addr else { return None };
        let [net, kind, hi, lo] = v4.ip().octets();
        let n = u16::from_be_bytes([hi, lo]);
        match (net, kind, v4.port()) {
            (10, 0, 5000) => Some(Node::Worker(n)),
            (10, 1, p) if p >= 9000 => Some(Node::Lcore(n, p - 9000)),
            _ => None,
        }
    }
}

/// The fault rates of a run, per datagram on every link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Faults {
    /// Probability a datagram is lost.
    pub loss: f64,
    /// Probability it is delivered twice (the copy with its own delay).
    pub dup: f64,
    /// Probability it is held back by up to ten times its link's delay
    /// (behind later ones).
    pub reorder: f64,
    /// A link's base delay is drawn from this range, µs.
    pub delay_us: (u64, u64),
    /// Extra delay drawn per datagram up to this, µs (reorders too).
    pub jitter_us: u64,
}

impl Faults {
    /// No faults: 10 µs links, no jitter.
    pub const NONE: Faults = Faults {
        loss: 0.0,
        dup: 0.0,
        reorder: 0.0,
        delay_us: (10, 10),
        jitter_us: 0,
    };
}

/// A node cut off or clogged from `from_us` until `until_us` (virtual µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spell {
    /// The node.
    pub node: Node,
    /// When it starts.
    pub from_us: u64,
    /// When it ends.
    pub until_us: u64,
}

impl Spell {
    /// Whether a datagram between `a` and `b` sent at `now` is caught.
    fn catches(&self, now: u64, a: Node, b: Node) -> bool {
        (self.node == a || self.node == b) && (self.from_us..self.until_us).contains(&now)
    }
}

/// A datagram on its way.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct InFlight {
    /// When it arrives, µs of virtual time.
    pub at: u64,
    /// Queue order (ties at one instant go in send order).
    pub seq: u64,
    /// Sender.
    pub from: Node,
    /// Receiver.
    pub to: Node,
    /// The datagram.
    pub bytes: Vec<u8>,
}

/// What the network did, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Datagrams sent.
    pub sent: u64,
    /// Lost.
    pub lost: u64,
    /// Delivered twice.
    pub duplicated: u64,
    /// Held back behind later ones.
    pub reordered: u64,
    /// Lost to a partition.
    pub partitioned: u64,
    /// Held until a clog ended.
    pub clogged: u64,
    /// Bytes sent from one appliance to another (a hierarchical job's
    /// partial sums and their results, across the spine).
    pub spine_bytes: u64,
    /// Delivered (copies included).
    pub delivered: u64,
}

/// The network.
#[derive(Debug)]
pub struct Net {
    rng: ChaCha8Rng,
    faults: Faults,
    /// Base delay per (from, to) link, drawn at first use.
    links: BTreeMap<(Node, Node), u64>,
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    /// Nodes cut off for a while.
    pub partitions: Vec<Spell>,
    /// Nodes clogged for a while.
    pub clogs: Vec<Spell>,
    /// Counts.
    pub stats: NetStats,
}

impl Net {
    /// A network with `faults`, its draws seeded by `seed`.
    pub fn new(seed: u64, faults: Faults) -> Net {
        Net {
            rng: ChaCha8Rng::seed_from_u64(seed),
            faults,
            links: BTreeMap::new(),
            queue: BinaryHeap::new(),
            seq: 0,
            partitions: Vec::new(),
            clogs: Vec::new(),
            stats: NetStats::default(),
        }
    }

    /// Sends `bytes` from `from` to `to` at `now`.
    pub fn send(&mut self, now: u64, from: Node, to: Node, bytes: Vec<u8>) {
        self.stats.sent += 1;
        if let (Node::Lcore(a, _), Node::Lcore(b, _)) = (from, to) {
            if a != b {
                self.stats.spine_bytes += bytes.len() as u64;
            }
        }
        let f = self.faults;
        let rng = &mut self.rng;
        let base = *self
            .links
            .entry((from, to))
            .or_insert_with(|| rng.gen_range(f.delay_us.0..=f.delay_us.1.max(f.delay_us.0)));
        if self.rng.gen_bool(f.loss) {
            self.stats.lost += 1;
            return;
        }
        if self.partitions.iter().any(|p| p.catches(now, from, to)) {
            self.stats.lost += 1;
            self.stats.partitioned += 1;
            return;
        }
        // A clogged path lets nothing through before the clog ends.
        let clogged = self
            .clogs
            .iter()
            .filter(|c| c.catches(now, from, to))
            .map(|c| c.until_us)
            .max();
        let copies = if self.rng.gen_bool(f.dup) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut delay = base + self.rng.gen_range(0..=f.jitter_us);
            if self.rng.gen_bool(f.reorder) {
                self.stats.reordered += 1;
                delay += self.rng.gen_range(0..=10 * base);
            }
            self.seq += 1;
            let mut at = now + delay.max(1);
            if let Some(until) = clogged {
                self.stats.clogged += 1;
                at = at.max(until + delay);
            }
            self.queue.push(Reverse(InFlight {
                at,
                seq: self.seq,
                from,
                to,
                bytes: bytes.clone(),
            }));
        }
    }

    /// When the next datagram arrives.
    pub fn next_at(&self) -> Option<u64> {
        self.queue.peek().map(|Reverse(d)| d.at)
    }

    /// The next datagram due at or before `now`.
    pub fn pop_due(&mut self, now: u64) -> Option<InFlight> {
        if self.next_at()? > now {
            return None;
        }
        let Reverse(d) = self.queue.pop()?;
        self.stats.delivered += 1;
        Some(d)
    }

    /// Datagrams still on their way.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_map_back_to_their_nodes() {
        for n in [
            Node::Worker(0),
            Node::Worker(300),
            Node::Lcore(0, 2),
            Node::Lcore(1, 257),
        ] {
            assert_eq!(Node::of(n.addr()), Some(n), "{n:?} at {}", n.addr());
        }
    }

    #[test]
    fn counts_add_up_and_nothing_arrives_early() {
        let faults = Faults {
            loss: 0.2,
            dup: 0.2,
            reorder: 0.2,
            delay_us: (5, 50),
            jitter_us: 20,
        };
        let mut net = Net::new(3, faults);
        for i in 0..1000u64 {
            net.send(
                i,
                Node::Worker(1),
                Node::Lcore(0, 0),
                vec![u8::try_from(i % 256).unwrap()],
            );
        }
        let mut got = 0;
        while let Some(d) = net.pop_due(u64::MAX) {
            assert!(d.at > 0);
            got += 1;
        }
        let s = net.stats;
        assert_eq!(got, s.delivered);
        assert_eq!(s.sent, s.lost + s.delivered - s.duplicated);
        assert!(s.lost > 100 && s.duplicated > 100 && s.reordered > 100, "{s:?}");
    }

    #[test]
    fn a_partition_loses_and_a_clog_holds_what_crosses_it() {
        let mut net = Net::new(1, Faults::NONE);
        let (w, l) = (Node::Worker(0), Node::Lcore(0, 0));
        let spell = Spell {
            node: l,
            from_us: 100,
            until_us: 200,
        };
        net.partitions.push(spell);
        net.send(150, w, l, vec![1]);
        net.send(200, l, w, vec![2]);
        assert_eq!(net.stats.partitioned, 1);
        let d = net.pop_due(u64::MAX).unwrap();
        assert_eq!(d.bytes, vec![2]);
        net.partitions.clear();
        net.clogs.push(spell);
        net.send(150, w, l, vec![3]);
        assert!(net.pop_due(200).is_none(), "a clog holds until it ends");
        assert_eq!(net.pop_due(210).unwrap().bytes, vec![3]);
        assert_eq!(net.stats.clogged, 1);
    }
}
