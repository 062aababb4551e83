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
use phub_proto::failover::EpochView;
use phub_proto::layout::ChunkRange;

use crate::config::WorkerConfig;
use crate::error::WorkerError;
use crate::stats::{Counters, WorkerStats};
use crate::tables::{one_id_per_lcore, table_infos};
use crate::transport::{
    id_lists, plan_pull, plan_push, unknown_table, JobInfo, Routing, RowRequest, RowTransport, TableInfo,
};

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
    /// A pull's highest round stated; a push's round.
    pub highest: u32,
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

    /// Routes every entry by epoch from now on (a replicated job,
    /// PROTOCOL.md §11.9), as `SimTransport::set_replication` routes the
    /// chunks.
    #[allow(clippy::too_many_arguments)]
    pub fn set_replication(
        &mut self,
        runs: Vec<ChunkRange>,
        per_appliance: &[usize],
        racks: Vec<String>,
        replicas: usize,
        epoch: EpochView,
        lcores: Vec<SocketAddr>,
        key_first: Vec<u64>,
    ) -> Result<(), String> {
        let routing = Routing::new(runs, per_appliance, racks, replicas, epoch, lcores, key_first)?;
        self.t.set_routing(routing);
        Ok(())
    }

    /// The epoch to ask control for, at least, if the row transport wants
    /// one (taken).
    pub fn poll_epoch(&mut self) -> Option<u32> {
        self.t.poll_epoch()
    }

    /// Control's epoch: a newer one re-routes every unanswered message.
    pub fn set_epoch(&mut self, now: Instant, view: EpochView) -> usize {
        self.t.set_epoch(now, view)
    }

    /// Control answered that job `job` failed (`message`, its reason):
    /// every table request in flight ends with [`WorkerError::JobFailed`],
    /// as the I/O thread ends them when its epoch fetch hears so.
    pub fn job_failed(&mut self, job: u16, message: &str) {
        self.t.epoch_unavailable(|| WorkerError::JobFailed {
            job,
            url: "simulated control".to_string(),
            message: message.to_string(),
        });
    }

    fn table(&self, key: u32) -> Result<&TableInfo, WorkerError> {
        self.tables
            .iter()
            .find(|t| t.key == key)
            .ok_or_else(|| unknown_table(key, &self.tables))
    }

    /// Registers `ids` of table `key` for key caching, as
    /// [`crate::Worker::cache_ids`] does (PROTOCOL.md §10.7).
    pub fn cache_ids(&mut self, key: u32, ids: &[u64]) -> Result<(), WorkerError> {
        let (lists, _) = id_lists(self.table(key)?, ids)?;
        self.t.cache_ids(key, &lists)
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

    /// Submits what [`crate::Worker::catch_up_rows`] sends for table
    /// `key`: a pull of one id on each lcore, whose result states the
    /// lowest and highest rounds completed there ([`SimRowDone::highest`];
    /// [`caught_up_together`] takes them).
    pub fn catch_up(&mut self, now: Instant, tag: u64, key: u32) -> Result<(), WorkerError> {
        let t = self.table(key)?;
        let plan = plan_pull(t, &one_id_per_lcore(t)?)?;
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

    /// The rank's dense transport stalled: each idle table whose last push
    /// completed sends every lcore an empty round of it, which ends
    /// silently (PROTOCOL.md §10.6).
    pub fn check_idle_tables(&mut self, now: Instant) {
        self.t.check_idle_tables(now);
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
            highest: f.result.as_ref().map_or(0, |o| o.highest),
            result: f.result.map(|o| (o.round, o.caller_rows())),
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

/// Per table, the round its pushes go on after once a rank's tables are
/// caught up together, from each table's catch-up (the lowest and
/// highest rounds stated), as [`crate::Worker::catch_up_tables`] has them.
pub fn caught_up_together(tables: &[(u32, u32)]) -> Vec<u32> {
    crate::tables::caught_up_together(tables)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::row_tests::{FakeLcore, Sent, JOB, KEY, TOKEN};

    #[test]
    fn a_simulated_rank_pushes_and_pulls_rows_through_the_row_transport() {
        let join: JoinResponse = serde_json::from_str(&format!(
            r#"{{"job": {JOB}, "rank": 0,
            "spec": {{"name": "s", "workers": 1, "dtype": "f32", "chunk_bytes": 64,
              "optimizer": {{"kind": "sum"}}, "consistency": {{"mode": "sync"}},
              "keys": [{{"name": "w", "elements": 8}},
                       {{"name": "emb", "kind": "table", "dim": 4, "seed": 7}}]}},
            "layout": {{"chunk_elems": 16, "lcores": [{{"first": 0, "count": 1}}, {{"first": 1, "count": 0}}]}},
            "dataplane": {{"host": "10.0.0.1", "base_port": 9000}}, "appliances": []}}"#
        ))
        .unwrap();
        let lcores: Vec<SocketAddr> =
            vec!["10.0.0.1:9000".parse().unwrap(), "10.0.0.1:9001".parse().unwrap()];
        let now = Instant::now();
        let mut t =
            SimRowTransport::new(&join, TOKEN, lcores.clone(), 16, &WorkerConfig::default(), now).unwrap();
        let e = t.push(now, 1, 0, 1, &[1], &[0.0; 4]).unwrap_err().to_string();
        assert!(e.contains("key 0") && e.contains("\"emb\" (key 1)"), "{e}");
        let mut fake = [FakeLcore::new(4), FakeLcore::new(4)];
        let ids = [5u64, 9, 5, 1 << 40];
        let grads: Vec<f32> = (0..16).map(|i| i as f32).collect();
        t.push(now, 7, KEY, 1, &ids, &grads).unwrap();
        // One request per table: a pull while the push is out is refused.
        t.pull(now, 8, KEY, &[1 << 40]).unwrap();
        let busy = t.poll_done().unwrap();
        assert!(matches!(
            (busy.tag, busy.result),
            (8, Err(WorkerError::Busy { key: KEY }))
        ));
        let mut exchange = |t: &mut SimRowTransport| {
            let mut out = Vec::new();
            t.poll_transmit(now, &mut out);
            for (to, d) in &out {
                let e = lcores.iter().position(|a| a == to).unwrap();
                for a in fake[e].handle(&Sent::parse(*to, d)) {
                    assert!(t.handle_datagram(now, *to, &a));
                }
            }
            t.poll_done().unwrap()
        };
        let done = exchange(&mut t);
        let (round, rows) = done.result.unwrap();
        assert_eq!((done.tag, done.key, round), (7, KEY, 1));
        let five: Vec<f32> = (0..4).map(|i| (i + i + 8) as f32).collect();
        let want = [
            five.clone(),
            (4..8).map(|i| i as f32).collect(),
            five,
            (12..16).map(|i| i as f32).collect(),
        ]
        .concat();
        assert_eq!(rows, want);
        t.pull(now, 9, KEY, &[1 << 40, 9]).unwrap();
        let pulled = exchange(&mut t);
        assert_eq!(pulled.tag, 9);
        assert_eq!(pulled.result.unwrap(), (1, [&want[12..16], &want[4..8]].concat()));
        assert!(!t.busy() && t.stats().row_answers_accepted > 0);
    }
}
