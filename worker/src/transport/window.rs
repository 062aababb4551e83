//! The flow window: the most chunks the appliance's receive buffers take
//! from this worker at once ([`WorkerConfig::window`], or made from the
//! job's shape by [`auto_window`] and remade as the lcores state their
//! receive-buffer shares, PROTOCOL.md §6.1).
//!
//! Invariant: `window >= 1`.
//!
//! [`WorkerConfig::window`]: crate::config::WorkerConfig::window

use crate::config::auto_window;

/// What the window is made from when the caller did not set one
/// ([`auto_window`]): it is remade whenever an lcore states another
/// receive-buffer share in its RESULTs (PROTOCOL.md §6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AutoWindow {
    pub(crate) workers: u32,
    pub(crate) lcores: usize,
    pub(crate) chunks: usize,
    pub(crate) datagram: usize,
    /// This worker's own socket receive buffer.
    pub(crate) own_rcvbuf: usize,
    /// The lcores' share as the join answer gave it (for lcores that have
    /// not stated one since).
    pub(crate) joined: usize,
}

impl AutoWindow {
    /// The window for an lcore receive-buffer share of `lcore_rcvbuf`.
    pub(crate) fn window(&self, lcore_rcvbuf: usize) -> usize {
        auto_window(
            self.workers,
            self.lcores,
            self.chunks,
            self.datagram,
            self.own_rcvbuf,
            lcore_rcvbuf,
        )
    }
}

/// The flow window and what it is made from.
#[derive(Debug)]
pub(super) struct FlowWindow {
    /// Chunks outstanding at most (>= 1).
    pub(super) window: usize,
    /// How `window` is made, when the caller did not set it.
    auto: Option<AutoWindow>,
    /// Per lcore, the receive-buffer share its RESULTs last stated (0:
    /// none yet).
    shares: Vec<u32>,
}

impl FlowWindow {
    /// A window of `window` chunks (at least 1).
    pub(super) fn new(window: usize) -> FlowWindow {
        FlowWindow {
            window: window.max(1),
            auto: None,
            shares: Vec::new(),
        }
    }

    /// Lets the window follow the receive-buffer shares the lcores state:
    /// it was made by `auto` from the job's shape (the caller set none).
    pub(super) fn set_auto(&mut self, auto: AutoWindow) {
        self.auto = Some(auto);
    }

    /// Lcore `lcore` stated a receive-buffer share of `share` bytes for
    /// this job (0: none): with an automatic window, the window is remade
    /// from the smallest share now known (the join answer's for lcores
    /// that have stated none), shrinking when another job came to an
    /// lcore and growing back when it left. Returns the new window when it
    /// changed.
    pub(super) fn note_share(&mut self, lcore: u16, share: u32) -> Option<usize> {
        self.auto?;
        let l = usize::from(lcore);
        if share == 0 || self.shares.get(l) == Some(&share) {
            return None;
        }
        if self.shares.len() <= l {
            self.shares.resize(l + 1, 0);
        }
        self.shares[l] = share;
        self.remake()
    }

    /// The job's chunks now go to `lcores` lcores (a replicated
    /// hierarchical job made flat, PROTOCOL.md §11.11, goes from its rack
    /// appliance's to every appliance's): with an automatic window, the
    /// window is remade for them. Returns the new window when it changed.
    pub(super) fn reshape(&mut self, lcores: usize) -> Option<usize> {
        self.auto.as_mut()?.lcores = lcores.max(1);
        self.remake()
    }

    /// Remakes an automatic window from the job's shape and the smallest
    /// share now known (the join answer's for lcores that have stated
    /// none); returns it when it changed.
    fn remake(&mut self) -> Option<usize> {
        let auto = self.auto?;
        let known = self.shares.iter().filter(|&&s| s > 0).count();
        let stated = self.shares.iter().filter(|&&s| s > 0).map(|&s| s as usize).min();
        // Lcores that have stated nothing yet keep the join answer's share.
        let rcvbuf = match stated {
            Some(s) if known >= auto.lcores => s,
            Some(s) => s.min(auto.joined),
            None => auto.joined,
        };
        let window = auto.window(rcvbuf).max(1);
        if window == self.window {
            return None;
        }
        self.window = window;
        Some(window)
    }
}
