//! The worker's row transport (`transport/rows.rs`) for the whole-system
//! simulator (`phub-sim`), behind the `sim` feature: one rank's pushes and
//! pulls of table rows (PROTOCOL.md §10), planned as
//! [`crate::Worker::push_pull_rows`] and [`crate::Worker::pull_rows`] plan
//! them, driven by the simulator's clock.
//!
//! Layer: test support over the sans-IO row transport. It adds no
//! behaviour: every method is one call of the transport or of the
//! planner. Not part of the public API without the feature.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use phub_proto::api::JoinResponse;

use crate::config::WorkerConfig;
use crate::error::WorkerError;
use crate::stats::{Counters, WorkerStats};
use crate::tables::table_infos;
use crate::transport::{plan_pull, plan_push, JobInfo, RowRequest, RowTransport, TableInfo};

/// A table request that ended.
#[derive(Debug)]
pub struct SimRowDone {
    /// The tag the request was submitted with.
    pub tag: u64,
    /// The table's key index.
    pub key: u32,
    /// The round (a push's; a pull's lowest stated) and each of the
    /// request's ids' row in its order, or why there is none.
    pub result: Result<(u32, Vec<f32>), WorkerError>,
}

/// One rank's row transport, driven by the simulator's clock.
#[derive(Debug)]
pub struct SimRowTransport {
    t: RowTransport<u64>,
    tables: Vec<TableInfo>,
    stats: Arc<Counters>,
}

impl SimRowTransport {
    /// The row transport of `join`'s rank (token `token`), the job's
    /// lcores being at `lcores` (entry order, PROTOCOL.md §10.1: appliance
    /// 0's lcores first), with `window` messages outstanding and `config`'s
    /// timers. `now` starts its clock.
    pub fn new(
        join: &JoinResponse,
        token: u64,
        lcores: Vec<SocketAddr>,
        window: usize,
        config: &WorkerConfig,
        now: Instant,
    ) -> Result<SimRowTransport, WorkerError> {
        let tables = table_infos(join)?;
        let stats = Arc::new(Counters::default());
        let info = JobInfo {
            job: join.job,
            token,
            rank: join.rank,
            dtype: join.spec.dtype,
            in_order: true,
        };
        if let Some(t) = tables
            .iter()
            .find(|t| t.placement.lcores() as usize != lcores.len())
        {
            return Err(WorkerError::BadJoin {
                message: format!(
                    "table {:?} is placed over {} lcores; {} addresses given",
                    t.name,
                    t.placement.lcores(),
                    lcores.len()
                ),
            });
        }
        let t = RowTransport::new(
            info,
            lcores,
            tables.clone(),
            window,
            config,
            Arc::clone(&stats),
            now,
        );
        Ok(SimRowTransport { t, tables, stats })
    }

    fn table(&self, key: u32) -> Result<&TableInfo, WorkerError> {
        self.tables
            .iter()
            .find(|t| t.key == key)
            .ok_or(WorkerError::UnknownKey {
                key,
                keys: self.tables.len(),
            })
    }

    /// Submits round (clock) `round` of table `key`: `grads` holds
    /// `ids.len()` rows of `dim` values. Errors as `push_pull_rows`'s
    /// before anything is sent; a second request of a table in flight
    /// ends with [`WorkerError::Busy`] at [`SimRowTransport::poll_done`].
    pub fn push(
        &mut self,
        now: Instant,
        tag: u64,
        key: u32,
        round: u32,
        ids: &[u64],
        grads: &[f32],
    ) -> Result<(), WorkerError> {
        let plan = plan_push(self.table(key)?, round, ids, grads)?;
        self.t.submit(now, RowRequest { plan, done: tag });
        Ok(())
    }

    /// Submits a pull of `ids`' rows of table `key`.
    pub fn pull(&mut self, now: Instant, tag: u64, key: u32, ids: &[u64]) -> Result<(), WorkerError> {
        let plan = plan_pull(self.table(key)?, ids)?;
        self.t.submit(now, RowRequest { plan, done: tag });
        Ok(())
    }

    /// What to send at `now`: (destination, datagram) pairs, appended to `out`.
    pub fn poll_transmit(&mut self, now: Instant, out: &mut Vec<(SocketAddr, Vec<u8>)>) {
        let mut d = Vec::new();
        self.t.poll_transmit(now, &mut d);
        out.extend(d.iter().map(|d| (d.to, [d.head, d.body].concat())));
    }

    /// When [`SimRowTransport::handle_timeout`] is next due (`None`: idle).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.t.poll_timeout()
    }

    /// Runs the timers at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.t.handle_timeout(now);
    }

    /// Handles a datagram from `from` received at `now`; false when it is
    /// not the row transport's (the dense transport's, or foreign).
    pub fn handle_datagram(&mut self, now: Instant, from: SocketAddr, d: &[u8]) -> bool {
        self.t.handle(now, from, d)
    }

    /// The next request that ended, if any.
    pub fn poll_done(&mut self) -> Option<SimRowDone> {
        let f = self.t.poll_done()?;
        Some(SimRowDone {
            tag: f.done,
            key: f.key,
            result: f.result.map(|o| (o.round, o.rows)),
        })
    }

    /// Whether requests are in flight.
    pub fn busy(&self) -> bool {
        self.t.busy()
    }

    /// Fails every request with [`WorkerError::Closed`] (the rank leaves).
    pub fn close(&mut self) {
        self.t.close();
    }

    /// The transport's counters.
    pub fn stats(&self) -> WorkerStats {
        self.stats.snapshot()
    }
}
