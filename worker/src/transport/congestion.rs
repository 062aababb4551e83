//! The congestion window: how many chunks the transport lets out at once
//! within the flow window ([`super::window`]).
//!
//! With [`WorkerConfig::congestion`] (off by default) a loss found by fast
//! retransmission halves it, once per loss episode (a smoothed round trip,
//! and until the chunks outstanding at the cut have come back), never
//! below [`MIN_CWND`] (or the flow window, if smaller); every ⌈cwnd/16⌉
//! results of chunks sent once then grow it by one, up to the flow window
//! again. Without it, it is the flow window.
//!
//! Invariant: `1 <= cwnd <= window`, and `cwnd == window` when not
//! enabled; checked after every change. (A cut never takes it below
//! `MIN_CWND.min(window)`, but a flow window that grows may leave it there
//! until results grow it.)
//!
//! [`WorkerConfig::congestion`]: crate::config::WorkerConfig::congestion

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::stats::{add, Counters};

/// The congestion window never shrinks below this many chunks (or the
/// window, if smaller).
pub(crate) const MIN_CWND: usize = 8;

/// The congestion window and the loss episodes that cut it.
#[derive(Debug)]
pub(super) struct Congestion {
    /// Whether losses cut `cwnd` ([`WorkerConfig::congestion`]).
    ///
    /// [`WorkerConfig::congestion`]: crate::config::WorkerConfig::congestion
    enabled: bool,
    /// Chunks outstanding at most now (<= the flow window).
    pub(super) cwnd: usize,
    /// Results of chunks sent once since `cwnd` last grew.
    grown: usize,
    /// When `cwnd` was last halved.
    last_cut: Option<Instant>,
    /// Results accepted so far (of chunks sent once or again).
    answers: u64,
    /// A loss found before `answers` passes this belongs to the last cut's
    /// episode (the chunks outstanding then have not all come back).
    recover_until: u64,
}

impl Congestion {
    /// The window for a flow window of `window` chunks; losses cut it if
    /// `enabled`.
    pub(super) fn new(window: usize, enabled: bool) -> Congestion {
        Congestion {
            enabled,
            cwnd: window,
            grown: 0,
            last_cut: None,
            answers: 0,
            recover_until: 0,
        }
    }

    /// Starts again as a fresh path of `window` chunks: the chunks in
    /// flight were re-addressed to other appliances (a new epoch), whose
    /// losses say nothing of the old path's.
    pub(super) fn fresh(&mut self, window: usize, stats: &Counters) {
        *self = Congestion::new(window, self.enabled);
        stats.cwnd.store(self.cwnd as u64, Ordering::Relaxed);
    }

    /// A result was accepted at `now`; `first` if its chunk was sent once
    /// only. Such results grow the window by one every ⌈cwnd/16⌉, up to
    /// `window`; not within a round trip (`rtt`) of a cut (those results
    /// were sent before it).
    pub(super) fn on_answer(
        &mut self,
        now: Instant,
        first: bool,
        window: usize,
        rtt: Duration,
        stats: &Counters,
    ) {
        if first && self.cwnd < window && !self.within_episode(now, rtt) {
            self.grown += 1;
            if self.grown >= self.cwnd.div_ceil(16) {
                self.grown = 0;
                self.cwnd += 1;
                stats.cwnd.store(self.cwnd as u64, Ordering::Relaxed);
            }
        }
        self.answers += 1;
        self.check(window);
    }

    /// A loss was found at `now` with `outstanding` chunks out: the window
    /// halves, once per episode (the chunks lost in one burst are one
    /// event).
    pub(super) fn on_loss(
        &mut self,
        now: Instant,
        outstanding: usize,
        window: usize,
        rtt: Duration,
        stats: &Counters,
    ) {
        if !self.enabled || self.within_episode(now, rtt) {
            return;
        }
        self.last_cut = Some(now);
        self.recover_until = self.answers + outstanding as u64;
        let floor = MIN_CWND.min(window);
        let cut = (self.cwnd / 2).max(floor);
        if cut < self.cwnd {
            self.cwnd = cut;
            self.grown = 0;
            add(&stats.window_cuts, 1);
            stats.cwnd.store(self.cwnd as u64, Ordering::Relaxed);
        }
        self.check(window);
    }

    /// The flow window became `window`: the congestion window follows it
    /// (when enabled, only down).
    pub(super) fn on_window(&mut self, window: usize) {
        self.cwnd = if self.enabled {
            self.cwnd.min(window)
        } else {
            window
        };
        self.check(window);
    }

    /// Whether the last cut's episode goes on at `now`: less than a
    /// smoothed round trip `rtt` since it, or the chunks outstanding at the
    /// cut not all answered yet.
    fn within_episode(&self, now: Instant, rtt: Duration) -> bool {
        self.last_cut
            .is_some_and(|t| now.saturating_duration_since(t) < rtt || self.answers < self.recover_until)
    }

    /// The module's invariant, for a flow window of `window`.
    fn check(&self, window: usize) {
        debug_assert!(
            self.cwnd >= 1 && self.cwnd <= window,
            "cwnd {} outside [1, {window}]",
            self.cwnd
        );
        debug_assert!(
            self.enabled || self.cwnd == window,
            "cwnd {} != window {window}",
            self.cwnd
        );
    }
}
