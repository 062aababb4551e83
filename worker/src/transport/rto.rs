//! Round-trip estimation for the transport: the RFC 6298 estimator and
//! the loss timer.

use std::time::{Duration, Instant};

use crate::config::WorkerConfig;

/// Round-trip state: the RFC 6298 estimator (reported as `srtt_us` and
/// `rto_us`) and the smallest round trip seen, which sets the loss timer.
///
/// Why not RFC 6298's RTO as the loss timer: with a window of thousands of
/// chunks a chunk's round trip includes its wait behind the rest of the
/// window, and with W > 1 the wait for the slowest rank (who may itself be
/// recovering a loss); samples swing from microseconds to a second, and the
/// RTO follows them up to `max_rto`, so a lost chunk at the end of a round
/// cost up to a second (measured: 10 rounds of 3 workers with 10% loss took
/// 6-11 s against 0.3 s with a window of 64). The loss timer is therefore
/// `max(min_rto, 2 x smallest round trip)` (the path's own round trip, not
/// the queue's), and it only runs while no result comes in at all: while
/// results stream in, late chunks are found by fast retransmission.
///
/// The path's own round trip does not bound a silence where the appliance
/// shares the host's cores: an lcore descheduled for a few milliseconds
/// answers nothing meanwhile, and every message out is resent, then
/// answered twice. Where an answer says it answers a message's first copy
/// (a table answer's FIRST_COPY, PROTOCOL.md §10.3 "Loss timer"), a
/// message retransmitted before it was **spurious**, and the silence that
/// set it off is the least the loss timer must outlast:
/// [`Rto::spurious`] raises a floor under it to 1.5 times that silence
/// (RFC 4015's response, in silences), which halves after each
/// [`FLOOR_HALF_LIFE`] without a spurious resend.
#[derive(Debug)]
pub(crate) struct Rto {
    pub(crate) srtt: Option<Duration>,
    rttvar: Duration,
    pub(crate) rto: Duration,
    min_rtt: Option<Duration>,
    initial: Duration,
    min: Duration,
    max: Duration,
    /// The floor spurious resends set under the loss timer (zero: none).
    floor: Duration,
    /// When the floor was last raised or halved.
    floor_at: Option<Instant>,
}

/// A spurious resend's floor halves after this long without another.
pub(crate) const FLOOR_HALF_LIFE: Duration = Duration::from_secs(1);

impl Rto {
    pub(crate) fn new(c: &WorkerConfig) -> Rto {
        Rto {
            srtt: None,
            rttvar: Duration::ZERO,
            rto: c.initial_rto.clamp(c.min_rto, c.max_rto),
            min_rtt: None,
            initial: c.initial_rto.clamp(c.min_rto, c.max_rto),
            min: c.min_rto,
            max: c.max_rto,
            floor: Duration::ZERO,
            floor_at: None,
        }
    }

    /// A message resent after a silence of `silence` had its first copy
    /// answered at `now`: the loss timer's floor rises to 1.5 `silence`
    /// (at most `max_rto`). True when it rose.
    pub(crate) fn spurious(&mut self, silence: Duration, now: Instant) -> bool {
        self.decay(now);
        let floor = (silence + silence / 2).min(self.max);
        if floor <= self.floor {
            return false;
        }
        self.floor = floor;
        self.floor_at = Some(now);
        true
    }

    /// Halves the floor once per [`FLOOR_HALF_LIFE`] gone by since it was
    /// last raised or halved (called as answers come).
    pub(crate) fn decay(&mut self, now: Instant) {
        let Some(at) = self.floor_at else {
            return;
        };
        if now.saturating_duration_since(at) < FLOOR_HALF_LIFE {
            return;
        }
        self.floor /= 2;
        self.floor_at = (self.floor >= self.min).then_some(now);
        if self.floor_at.is_none() {
            self.floor = Duration::ZERO;
        }
    }

    /// The floor spurious resends set (zero: none).
    #[cfg(test)]
    pub(crate) fn floor(&self) -> Duration {
        self.floor
    }

    pub(crate) fn sample(&mut self, r: Duration) {
        self.min_rtt = Some(self.min_rtt.map_or(r, |m| m.min(r)));
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(r);
                self.rttvar = self.rttvar * 3 / 4 + diff / 4;
                self.srtt = Some(s * 7 / 8 + r / 8);
            }
        }
        let s = self.srtt.unwrap_or(r);
        // RTTVAR counted at least SRTT / 4 (so at least 2 SRTT), as the
        // engine's partial timer (PROTOCOL.md §9.3 rule 4): a window's
        // results come back in bursts, each close to the one before, and
        // RTTVAR shrinks to the spread within a burst, well under the
        // spread between bursts; a hierarchical job's overtaken chunks,
        // lost only once out for this RTO, went again by the thousand
        // (ResNet-50, W = 4, 3 racks: BENCHMARKS.md).
        self.rto = (s + self.rttvar.max(s / 4) * 4).clamp(self.min, self.max);
    }

    /// The smoothed round trip, or the RTO before any sample: how long a
    /// loss episode lasts at least.
    pub(crate) fn smoothed(&self) -> Duration {
        self.srtt.unwrap_or(self.rto)
    }

    /// The RFC 6298 timeout after `retries` doublings (reported, and the
    /// unit test's reference).
    #[cfg(test)]
    fn backoff(&self, retries: u32) -> Duration {
        self.rto
            .checked_mul(1u32 << retries.min(20))
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// The loss timer after `doublings`: `max(min_rto, 2 x min RTT,
    /// floor)` (the initial RTO before any sample), doubled, at most
    /// `max_rto`.
    pub(crate) fn loss(&self, doublings: u32) -> Duration {
        let base = self
            .min_rtt
            .map_or(self.initial, |m| (m * 2).clamp(self.min, self.max))
            .max(self.floor);
        base.checked_mul(1u32 << doublings.min(20))
            .unwrap_or(self.max)
            .min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rto_follows_rfc6298_and_backs_off() {
        let c = WorkerConfig::default();
        let mut r = Rto::new(&c);
        assert_eq!(r.rto, c.initial_rto);
        r.sample(Duration::from_millis(10));
        assert_eq!(r.srtt, Some(Duration::from_millis(10)));
        assert_eq!(r.rto, Duration::from_millis(30));
        r.sample(Duration::from_millis(10));
        // rttvar = 3/4 * 5 = 3.75 ms; rto = 10 + 15 = 25 ms.
        assert_eq!(r.rto, Duration::from_micros(25_000));
        assert_eq!(r.backoff(1), Duration::from_millis(50));
        assert_eq!(r.backoff(40), c.max_rto);
        for _ in 0..50 {
            r.sample(Duration::from_micros(10));
        }
        assert_eq!(r.rto, c.min_rto);
        // Samples alike shrink RTTVAR to nothing: it counts as SRTT / 4,
        // so the RTO is 2 SRTT (not SRTT, which every sample a little
        // late would outlast).
        for _ in 0..200 {
            r.sample(Duration::from_millis(4));
        }
        let s = r.srtt.unwrap();
        assert!(s > Duration::from_micros(3990), "{s:?}");
        assert_eq!(r.rto, s + s / 4 * 4);
    }

    #[test]
    fn loss_timer_follows_the_smallest_round_trip() {
        let c = WorkerConfig::default();
        let mut r = Rto::new(&c);
        assert_eq!(r.loss(0), c.initial_rto);
        // Queueing behind a deep window inflates samples, not the loss timer.
        r.sample(Duration::from_millis(3));
        r.sample(Duration::from_millis(400));
        assert_eq!(r.loss(0), Duration::from_millis(6));
        assert_eq!(r.loss(2), Duration::from_millis(24));
        assert_eq!(r.loss(30), c.max_rto);
        r.sample(Duration::from_micros(50));
        assert_eq!(r.loss(0), c.min_rto);
        assert!(r.rto > Duration::from_millis(100));
    }

    /// A spurious resend's silence sets a floor of 1.5 times it under the
    /// loss timer, only ever raised by another, halved after each second
    /// without one, gone below `min_rto`.
    #[test]
    fn a_spurious_resend_raises_the_loss_timer_until_it_decays() {
        let c = WorkerConfig::default();
        let mut r = Rto::new(&c);
        r.sample(Duration::from_micros(50));
        assert_eq!(r.loss(0), c.min_rto);
        let t0 = Instant::now();
        assert!(r.spurious(Duration::from_millis(4), t0));
        assert_eq!(r.loss(0), Duration::from_millis(6));
        assert_eq!(r.loss(1), Duration::from_millis(12));
        assert!(
            !r.spurious(Duration::from_millis(3), t0),
            "a shorter silence lowers nothing"
        );
        assert_eq!(r.loss(0), Duration::from_millis(6));
        r.decay(t0 + Duration::from_millis(999));
        assert_eq!(r.loss(0), Duration::from_millis(6));
        r.decay(t0 + FLOOR_HALF_LIFE);
        assert_eq!(r.loss(0), Duration::from_millis(3));
        r.decay(t0 + FLOOR_HALF_LIFE * 2);
        assert_eq!((r.floor(), r.loss(0)), (Duration::ZERO, c.min_rto));
        assert!(r.spurious(Duration::from_secs(5), t0), "at most max_rto");
        assert_eq!(r.loss(0), c.max_rto);
    }
}
