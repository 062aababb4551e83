//! Seeded fault injection for tests and soaks: decides, packet by packet,
//! whether a datagram is delivered, lost, duplicated, held back for one turn
//! of the receiver's loop (reordered) or held back for a time (delayed).
//! The same description, decider ([`Faults`]) and hold queue ([`Injector`])
//! are used by the dataplane's queues and the worker library's transport;
//! both are off unless configured.
//!
//! Written `loss=0.05,dup=0.01,reorder=0.01,delay=0.01,delay_ms=3,seed=7`
//! (any subset; rates in [0, 1), their sum below 1; `delay_ms`, the time a
//! delayed packet is held, in 1..=1000, 2 when not given).

use std::cell::Cell;
use std::collections::VecDeque;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// What happens to one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Passes unchanged.
    Deliver,
    /// Is lost.
    Drop,
    /// Arrives twice.
    Duplicate,
    /// Is held back and arrives after later packets.
    Reorder,
    /// Is held back for [`FaultSpec::delay_ms`] and arrives then.
    Delay,
}

/// The hold time of a delayed packet when `delay_ms` is not given.
pub const DEFAULT_DELAY_MS: u32 = 2;
/// The longest hold time `delay_ms` accepts.
pub const MAX_DELAY_MS: u32 = 1000;

/// Rates of each fault and the seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultSpec {
    /// Probability a packet is lost.
    pub loss: f64,
    /// Probability a packet is duplicated.
    pub dup: f64,
    /// Probability a packet is reordered.
    pub reorder: f64,
    /// Probability a packet is delayed by `delay_ms`.
    pub delay: f64,
    /// How long a delayed packet is held, in milliseconds (1..=1000).
    pub delay_ms: u32,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for FaultSpec {
    /// No faults (and the default hold time for delayed packets).
    fn default() -> FaultSpec {
        FaultSpec {
            loss: 0.0,
            dup: 0.0,
            reorder: 0.0,
            delay: 0.0,
            delay_ms: DEFAULT_DELAY_MS,
            seed: 0,
        }
    }
}

impl FaultSpec {
    /// How long a delayed packet is held.
    pub fn delay_time(&self) -> std::time::Duration {
        std::time::Duration::from_millis(u64::from(self.delay_ms))
    }
}

/// The names a spec accepts, for error messages.
const ACCEPTED: &str = "loss, dup, reorder, delay, delay_ms, seed";

impl FromStr for FaultSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<FaultSpec, String> {
        let mut f = FaultSpec::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("fault {part:?}: expected NAME=VALUE ({ACCEPTED})"))?;
            let rate = || -> Result<f64, String> {
                let x: f64 = v
                    .parse()
                    .map_err(|_| format!("fault {k}={v}: expected a number in [0, 1)"))?;
                if (0.0..1.0).contains(&x) {
                    Ok(x)
                } else {
                    Err(format!("fault {k}={v}: expected a number in [0, 1)"))
                }
            };
            match k {
                "loss" => f.loss = rate()?,
                "dup" => f.dup = rate()?,
                "reorder" => f.reorder = rate()?,
                "delay" => f.delay = rate()?,
                "delay_ms" => {
                    f.delay_ms = v
                        .parse()
                        .ok()
                        .filter(|ms| (1..=MAX_DELAY_MS).contains(ms))
                        .ok_or_else(|| {
                            format!("fault delay_ms={v}: expected whole milliseconds in 1..={MAX_DELAY_MS}")
                        })?
                }
                "seed" => {
                    f.seed = v
                        .parse()
                        .map_err(|_| format!("fault seed={v}: expected an integer"))?
                }
                _ => return Err(format!("fault {k:?}: unknown; accepted: {ACCEPTED}")),
            }
        }
        if f.loss + f.dup + f.reorder + f.delay >= 1.0 {
            return Err(format!(
                "faults {s:?}: loss + dup + reorder + delay must stay below 1"
            ));
        }
        Ok(f)
    }
}

impl std::fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "loss={},dup={},reorder={}", self.loss, self.dup, self.reorder)?;
        // Left out when off, so specs without delay read as they always did.
        if self.delay != 0.0 || self.delay_ms != DEFAULT_DELAY_MS {
            write!(f, ",delay={},delay_ms={}", self.delay, self.delay_ms)?;
        }
        write!(f, ",seed={}", self.seed)
    }
}

/// A seeded decider. Single-threaded (interior mutability, so it can be
/// consulted through a shared reference on one thread).
#[derive(Debug, Clone)]
pub struct Faults {
    spec: FaultSpec,
    state: Cell<u64>,
}

impl Faults {
    /// A decider for `spec`, perturbed by `stream` so that several users of
    /// one spec (lcores, directions) draw different sequences.
    pub fn new(spec: FaultSpec, stream: u64) -> Faults {
        Faults {
            spec,
            state: Cell::new(spec.seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed),
        }
    }

    /// The spec.
    pub fn spec(&self) -> FaultSpec {
        self.spec
    }

    fn uniform(&self) -> f64 {
        // SplitMix64.
        let s = self.state.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        self.state.set(s);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The fate of the next packet.
    pub fn fate(&self) -> Fate {
        let u = self.uniform();
        let s = &self.spec;
        if u < s.loss {
            Fate::Drop
        } else if u < s.loss + s.dup {
            Fate::Duplicate
        } else if u < s.loss + s.dup + s.reorder {
            Fate::Reorder
        } else if u < s.loss + s.dup + s.reorder + s.delay {
            Fate::Delay
        } else {
            Fate::Deliver
        }
    }
}

/// One direction of fault injection over a stream of datagrams, whatever
/// carries them (a dataplane queue, a worker's socket): a seeded decider and
/// the copies it holds back. Time is a parameter.
///
/// The stream goes by turns (one receive batch, or one send batch, of the
/// caller's loop). A reordered item is held and comes out at the end of the
/// next turn, after that turn's own items; a delayed one comes out at the
/// end of the first turn once its hold time has passed. Every delayed item
/// is held for the same time, so they come out in the order they went in.
#[derive(Debug)]
pub struct Injector<T> {
    faults: Faults,
    /// Reordered in this turn.
    held: Vec<T>,
    /// Reordered in the previous turn: out at the end of this one.
    due: Vec<T>,
    /// Delayed, with when each is due.
    delayed: VecDeque<(Instant, T)>,
    delay: Duration,
}

impl<T> Injector<T> {
    /// An injector for `spec`, drawing from stream `stream` of it (see
    /// [`Faults::new`]).
    pub fn new(spec: FaultSpec, stream: u64) -> Injector<T> {
        Injector {
            faults: Faults::new(spec, stream),
            held: Vec::new(),
            due: Vec::new(),
            delayed: VecDeque::new(),
            delay: spec.delay_time(),
        }
    }

    /// The decider (drawing from it moves the stream on).
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Decides the fate of one item at `now` and returns it with how many
    /// times to pass the item on now: 0 (lost, or held: `keep` makes the
    /// copy that is held), 1, or 2 (duplicated).
    pub fn admit(&mut self, now: Instant, keep: impl FnOnce() -> T) -> (Fate, usize) {
        let fate = self.faults.fate();
        let now_times = match fate {
            Fate::Deliver => 1,
            Fate::Drop => 0,
            Fate::Duplicate => 2,
            Fate::Reorder => {
                self.held.push(keep());
                0
            }
            Fate::Delay => {
                self.delayed.push_back((now + self.delay, keep()));
                0
            }
        };
        (fate, now_times)
    }

    /// Ends a turn at `now`: passes `f` the items reordered in the previous
    /// turn, then the delayed ones due by `now`, and keeps those reordered
    /// in this turn for the end of the next.
    pub fn end_turn(&mut self, now: Instant, mut f: impl FnMut(T)) {
        self.due.drain(..).for_each(&mut f);
        while self.delayed.front().is_some_and(|(due, _)| *due <= now) {
            if let Some((_, item)) = self.delayed.pop_front() {
                f(item);
            }
        }
        std::mem::swap(&mut self.due, &mut self.held);
    }

    /// Whether reordered items are held (the caller's loop must come round
    /// again soon to let them out; delayed ones have [`Injector::next_due`]).
    pub fn holds(&self) -> bool {
        !self.held.is_empty() || !self.due.is_empty()
    }

    /// When the first delayed item is due, if any: the caller's loop must
    /// not wait past it.
    pub fn next_due(&self) -> Option<Instant> {
        self.delayed.front().map(|(due, _)| *due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_draws_at_the_asked_rates() {
        let spec: FaultSpec = "loss=0.2, dup=0.1,reorder=0.05,delay=0.15,seed=3"
            .parse()
            .unwrap();
        assert_eq!((spec.seed, spec.delay_ms), (3, DEFAULT_DELAY_MS));
        let f = Faults::new(spec, 1);
        let n = 100_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[match f.fate() {
                Fate::Deliver => 0,
                Fate::Drop => 1,
                Fate::Duplicate => 2,
                Fate::Reorder => 3,
                Fate::Delay => 4,
            }] += 1;
        }
        let rate = |i: usize| counts[i] as f64 / n as f64;
        for (i, want) in [(0, 0.5), (1, 0.2), (2, 0.1), (3, 0.05), (4, 0.15)] {
            assert!(
                (rate(i) - want).abs() < 0.01,
                "fate {i}: rate {} (asked {want})",
                rate(i)
            );
        }
        // Same seed and stream, same sequence.
        let (a, b) = (Faults::new(spec, 9), Faults::new(spec, 9));
        assert!((0..100).all(|_| a.fate() == b.fate()));
        for bad in [
            "loss=1.5",
            "loss",
            "colour=0.1",
            "loss=0.6,dup=0.5",
            "loss=0.5,delay=0.5",
            "delay=1",
            "seed=x",
            "delay_ms=x",
        ] {
            assert!(bad.parse::<FaultSpec>().is_err(), "{bad}");
        }
        // The hold time is named with its range when out of it.
        for bad in ["delay_ms=0", "delay_ms=5000", "delay_ms=-1", "delay_ms=1.5"] {
            let e = bad.parse::<FaultSpec>().unwrap_err();
            assert!(e.contains(bad) && e.contains("1..=1000"), "{bad}: {e}");
        }
        let e = "jitter=1".parse::<FaultSpec>().unwrap_err();
        assert!(e.contains("delay, delay_ms"), "{e}");
        let spec: FaultSpec = "delay=0.1,delay_ms=1000".parse().unwrap();
        assert_eq!((spec.delay, spec.delay_ms), (0.1, 1000));
        assert_eq!(spec.delay_time(), std::time::Duration::from_secs(1));
        assert_eq!("delay_ms=1".parse::<FaultSpec>().unwrap().delay_ms, 1);
        assert_eq!("".parse::<FaultSpec>().unwrap(), FaultSpec::default());
    }

    #[test]
    fn display_parses_back_to_the_same_spec() {
        // The worker's and phub-bench's configurations travel as this text.
        for text in [
            "loss=0.05,dup=0.01,reorder=0.01,seed=3",
            "loss=0.05,dup=0.01,reorder=0.01,delay=0.02,delay_ms=3,seed=3",
            "delay=0.5",
            "delay_ms=999",
            "loss=0.2",
            "seed=18446744073709551615",
            "",
        ] {
            let spec: FaultSpec = text.parse().unwrap();
            assert_eq!(spec.to_string().parse::<FaultSpec>().unwrap(), spec, "{text}");
        }
        // Without delay the text reads as it did before delay existed.
        assert_eq!(
            "loss=0.05,seed=3".parse::<FaultSpec>().unwrap().to_string(),
            "loss=0.05,dup=0,reorder=0,seed=3"
        );
    }

    #[test]
    fn an_injector_lets_reordered_items_out_a_turn_later_and_delayed_ones_when_due() {
        let spec: FaultSpec = "reorder=0.3,delay=0.3,delay_ms=5,seed=11".parse().unwrap();
        let mut inj: Injector<u32> = Injector::new(spec, 0);
        let start = Instant::now();
        let mut out: Vec<(u32, u32)> = Vec::new(); // (item, turn it came out)
        let mut fates = Vec::new();
        for turn in 0..50u32 {
            let now = start + Duration::from_millis(u64::from(turn));
            // Items in the first 40 turns; the last 10 let out the rest.
            for k in (0..4).filter(|_| turn < 40) {
                let item = turn * 4 + k;
                let (fate, n) = inj.admit(now, || item);
                fates.push((item, turn, fate));
                for _ in 0..n {
                    out.push((item, turn));
                }
            }
            inj.end_turn(now, |item| out.push((item, turn)));
        }
        assert!(!inj.holds() && inj.next_due().is_none());
        for (item, turn, fate) in fates {
            let got: Vec<u32> = out.iter().filter(|o| o.0 == item).map(|o| o.1).collect();
            match fate {
                Fate::Deliver => assert_eq!(got, [turn]),
                Fate::Reorder => assert_eq!(got, [turn + 1], "item {item}"),
                Fate::Delay => assert_eq!(got, [turn + 5], "item {item}"),
                f => panic!("{f:?} not asked for"),
            }
        }
        assert!(out.iter().any(|o| o.1 > 0), "some were held");
    }
}
