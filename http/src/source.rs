//! What the listener keeps per client source: the connections it holds,
//! and its failed credential checks with the log lines they are worth.
//! Pure: no I/O, no clock (the time is a parameter), no logging.
//!
//! A source is a client's IPv4 address, or the /64 prefix of its IPv6
//! address: one host or one site, which could otherwise take 2^64
//! addresses and be as many sources.
//!
//! Invariants, asserted: a source is in [`Connections`] while it holds
//! between one and the per-source limit of connections, and leaves at
//! zero, so that table holds at most as many sources as the listener has
//! connections; [`Failures`] holds at most [`MAX_TRACKED`] sources (those
//! it has no room for share one entry, [`Source::Others`]), and a source's
//! failures in a window never pass the allowance by more than the checks
//! that were already running when it was reached.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

/// Sources whose failed credential checks are kept apart.
pub(crate) const MAX_TRACKED: usize = 4096;

/// Where a client connects from, as the per-source limits count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// An IPv4 address (IPv4-mapped IPv6 addresses included).
    V4(Ipv4Addr),
    /// The first 64 bits of an IPv6 address.
    V6Prefix(u64),
    /// Every source [`Failures`] has no room for, together.
    Others,
}

impl Source {
    /// The source of a client at `ip`.
    pub(crate) fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(a) => Source::V4(a),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => Source::V4(v4),
                // The high half of a u128 always fits a u64.
                None => Source::V6Prefix((u128::from(a) >> 64) as u64),
            },
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::V4(a) => write!(f, "{a}"),
            Source::V6Prefix(p) => write!(f, "{}/64", Ipv6Addr::from(u128::from(*p) << 64)),
            Source::Others => write!(f, "sources beyond the first {MAX_TRACKED} with failed checks"),
        }
    }
}

/// Connections open per source, each source below its limit.
#[derive(Debug)]
pub(crate) struct Connections {
    per_source: usize,
    open: HashMap<Source, usize>,
}

impl Connections {
    /// A table that lets each source hold at most `per_source` connections
    /// (at least one).
    pub(crate) fn new(per_source: usize) -> Connections {
        Connections {
            per_source: per_source.max(1),
            open: HashMap::new(),
        }
    }

    /// The limit per source.
    pub(crate) fn per_source(&self) -> usize {
        self.per_source
    }

    /// Counts one more connection from `source`; false, and nothing
    /// counted, when it already holds its limit.
    pub(crate) fn open(&mut self, source: Source) -> bool {
        let n = self.open.entry(source).or_insert(0);
        if *n >= self.per_source {
            return false;
        }
        *n += 1;
        true
    }

    /// Counts one connection from `source` closed; it must have been
    /// counted open.
    pub(crate) fn close(&mut self, source: Source) {
        let n = self.open.get_mut(&source);
        assert!(
            n.as_ref().is_some_and(|n| **n >= 1),
            "a connection from {source} closed that was never counted open"
        );
        if let Some(n) = n {
            *n -= 1;
            if *n == 0 {
                self.open.remove(&source);
            }
        }
    }

    /// Connections open from `source`.
    pub(crate) fn held_by(&self, source: Source) -> usize {
        self.open.get(&source).copied().unwrap_or(0)
    }
}

/// One source's failed checks in its current window.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// When its first failure in this window came.
    start: Instant,
    /// Failed checks since `start`.
    failures: u32,
    /// Requests refused without a check since the last reported line.
    refused: u64,
}

/// A log line due about a source's failed checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Report {
    /// The source as it is counted.
    pub(crate) source: Source,
    /// Failures in its current window, this one included.
    pub(crate) failures: u32,
    /// Set when this failure used up the allowance: how long the source's
    /// requests that need a credential are refused from now.
    pub(crate) locked_for: Option<Duration>,
    /// Failed checks answered `429` since the source's last line.
    pub(crate) refused_since: u64,
}

/// Failed credential checks per source: at most `allowed` in a window of
/// `window` from a source's first failure; until that window ends, the
/// source's failed checks are answered `429` (a right credential is still
/// served: on loopback every local client, control included, is one
/// source, and a guesser must not lock the others out). Two log
/// lines per source and window at most: its first failure, and the one
/// that used up its allowance.
#[derive(Debug)]
pub(crate) struct Failures {
    allowed: u32,
    window: Duration,
    table: HashMap<Source, Window>,
}

impl Failures {
    /// At most `allowed` (at least one) failed checks per source in
    /// `window`.
    pub(crate) fn new(allowed: u32, window: Duration) -> Failures {
        Failures {
            allowed: allowed.max(1),
            window,
            table: HashMap::new(),
        }
    }

    /// Whether `source` has used up its allowance of failed checks in its
    /// current window at `now`: `Err(how long until its window ends)` if
    /// so. A further failed check from it is then answered `429` and only
    /// counted ([`Failures::refused`]), neither logged nor counted as a
    /// failure; a right credential is still served.
    pub(crate) fn admit(&mut self, source: Source, now: Instant) -> Result<(), Duration> {
        let key = self.key(source, now);
        let (allowed, window) = (self.allowed, self.window);
        match self.table.get(&key) {
            Some(w) if w.failures >= allowed && now < w.start + window => Err(w.start + window - now),
            _ => Ok(()),
        }
    }

    /// Counts a failed check from a source past its allowance (told in its
    /// next log line).
    pub(crate) fn refused(&mut self, source: Source, now: Instant) {
        let key = self.key(source, now);
        if let Some(w) = self.table.get_mut(&key) {
            w.refused += 1;
        }
    }

    /// Counts a failed check from `source` at `now`; the log line it is
    /// worth, if any.
    pub(crate) fn failed(&mut self, source: Source, now: Instant) -> Option<Report> {
        let key = self.key(source, now);
        let window = self.window;
        let w = self.table.entry(key).or_insert(Window {
            start: now,
            failures: 0,
            refused: 0,
        });
        if now >= w.start + window {
            // A new window; refusals of the last one are still to be told.
            *w = Window {
                start: now,
                failures: 0,
                refused: w.refused,
            };
        }
        w.failures = w.failures.saturating_add(1);
        let locked = w.failures == self.allowed;
        if w.failures != 1 && !locked {
            return None;
        }
        let report = Report {
            source: key,
            failures: w.failures,
            locked_for: locked.then(|| w.start + window - now),
            refused_since: w.refused,
        };
        w.refused = 0;
        debug_assert!(self.table.len() <= MAX_TRACKED + 1);
        Some(report)
    }

    /// The entry `source` is counted in at `now`: its own, or
    /// [`Source::Others`] when the table is full of sources whose windows
    /// are still open.
    fn key(&mut self, source: Source, now: Instant) -> Source {
        if self.table.contains_key(&source) || self.table.len() < MAX_TRACKED {
            return source;
        }
        let window = self.window;
        self.table
            .retain(|s, w| *s == Source::Others || now < w.start + window);
        if self.table.len() < MAX_TRACKED {
            source
        } else {
            Source::Others
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(n: u8) -> Source {
        Source::of(IpAddr::V4(Ipv4Addr::new(127, 0, 0, n)))
    }

    #[test]
    fn sources_are_v4_addresses_and_v6_prefixes() {
        assert_eq!(v4(1).to_string(), "127.0.0.1");
        let a: IpAddr = "2001:db8:1:2:3:4:5:6".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::1".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::of(a), Source::of(b));
        assert_ne!(Source::of(a), Source::of(c));
        assert_eq!(Source::of(a).to_string(), "2001:db8:1:2::/64");
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
        assert_eq!(Source::of(mapped).to_string(), "10.0.0.7");
    }

    #[test]
    fn connections_are_capped_per_source() {
        let mut c = Connections::new(2);
        assert!(c.open(v4(1)));
        assert!(c.open(v4(1)));
        assert!(!c.open(v4(1)), "a third from one source");
        assert!(c.open(v4(2)), "another source is not held back");
        assert_eq!(c.held_by(v4(1)), 2);
        c.close(v4(1));
        assert!(c.open(v4(1)));
        for _ in 0..2 {
            c.close(v4(1));
        }
        c.close(v4(2));
        assert!(c.open.is_empty(), "sources at zero leave the table");
    }

    #[test]
    #[should_panic(expected = "never counted open")]
    fn closing_what_was_not_opened_is_a_bug() {
        Connections::new(2).close(v4(1));
    }

    #[test]
    fn a_source_is_refused_for_the_rest_of_its_window() {
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        let mut f = Failures::new(3, Duration::from_secs(10));
        assert_eq!(f.admit(v4(1), s(0)), Ok(()));
        let first = f.failed(v4(1), s(0)).expect("the first failure is told");
        assert_eq!((first.failures, first.locked_for), (1, None));
        assert_eq!(f.failed(v4(1), s(100)), None, "the second is not");
        assert_eq!(f.admit(v4(1), s(200)), Ok(()));
        let third = f.failed(v4(1), s(1000)).expect("the one that locks is told");
        assert_eq!(third.locked_for, Some(Duration::from_secs(9)));
        assert_eq!(f.admit(v4(1), s(1000)), Err(Duration::from_secs(9)));
        f.refused(v4(1), s(1000));
        assert_eq!(f.admit(v4(1), s(9999)), Err(Duration::from_millis(1)));
        f.refused(v4(1), s(9999));
        assert_eq!(f.admit(v4(2), s(5000)), Ok(()), "another source is not held back");
        // The window over: checked again, and the refusals are told.
        assert_eq!(f.admit(v4(1), s(10_000)), Ok(()));
        let next = f.failed(v4(1), s(10_000)).unwrap();
        assert_eq!((next.failures, next.refused_since), (1, 2));
    }

    #[test]
    fn the_table_of_failures_is_bounded() {
        let t0 = Instant::now();
        let mut f = Failures::new(1, Duration::from_secs(10));
        for i in 0..MAX_TRACKED as u32 {
            let s = Source::V4(Ipv4Addr::from(0x0a00_0000 + i));
            assert!(f.failed(s, t0).is_some());
            assert!(f.admit(s, t0).is_err());
        }
        // Full of open windows: a new source shares the others' entry.
        let late = Source::V4(Ipv4Addr::new(192, 0, 2, 1));
        let r = f.failed(late, t0).unwrap();
        assert_eq!(r.source, Source::Others);
        assert!(f.admit(Source::V4(Ipv4Addr::new(192, 0, 2, 2)), t0).is_err());
        assert!(f.table.len() <= MAX_TRACKED + 1);
        // Once their windows end, they make room.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(f.failed(late, later).unwrap().source, late);
        assert!(f.table.len() <= 2, "{} entries", f.table.len());
    }
}
