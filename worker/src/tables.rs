//! Table keys (PROTOCOL.md §10) as a caller sees them: rows of `dim`
//! values keyed by `u64` ids, pushed and pulled a few at a time by the
//! table's name ([`Worker::push_pull_rows`], [`Worker::push_rows`],
//! [`Worker::pull_rows`]; [`Worker::start_push_rows`] and
//! [`Worker::start_pull_rows`] return at once, so that several tables'
//! requests are in flight together).
//!
//! Layer: client API. A call checks its slices, claims the table (one
//! request per table in flight, [`TableClaims`]), plans its messages on the
//! caller's thread (`transport/row_plan.rs`: duplicates merged, rows split
//! by lcore), hands them to the I/O thread's row transport
//! (`transport/rows.rs`) and blocks until every message is answered (or
//! returns a [`RowsPush`] / [`RowsPull`] that does when waited).
//!
//! Invariant: a table's round (BSP) or this rank's clock on it (async,
//! bounded delay) advances by one with each push whose every answer came
//! back, and only then may the next push go (§10.3, "The worker's side").

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crossbeam_channel::Receiver;
use phub_proto::api::JoinResponse;
use phub_proto::placement::RowPlacement;
use phub_proto::spec::rows_per_datagram;

use crate::error::WorkerError;
use crate::io::{Command, RowCompletion, RowRequest};
use crate::transport::{id_lists, plan_pull, plan_push, RowOutput, TableInfo};
use crate::worker::{next_round, Worker};

/// The job's table keys from its join answer, in key order.
pub(crate) fn table_infos(join: &JoinResponse) -> Result<Vec<TableInfo>, WorkerError> {
    let spec = &join.spec;
    let mut tables = Vec::new();
    for (k, ks) in (0u32..).zip(&spec.keys) {
        let Some(t) = &ks.table else {
            continue;
        };
        let per = rows_per_datagram(spec.chunk_bytes, t.dim, spec.dtype);
        if per == 0 {
            return Err(WorkerError::BadJoin {
                message: format!(
                    "table {:?} (key {k}): dim {} does not fit one row of {} in chunk_bytes {}",
                    ks.name, t.dim, spec.dtype, spec.chunk_bytes
                ),
            });
        }
        let placement = RowPlacement::from_join(join, k).map_err(|e| WorkerError::BadJoin {
            message: e.to_string(),
        })?;
        tables.push(TableInfo {
            key: k,
            name: ks.name.clone(),
            dim: t.dim,
            per,
            placement,
            key_cache: t.key_cache,
        });
    }
    Ok(tables)
}

/// Where a table stands.
#[derive(Debug, Clone, Copy, Default)]
struct TableState {
    /// The last round (clock) whose every answer this worker holds; 0
    /// before its first push (a table's first round is 1, §10.3).
    round: u32,
    /// A request is in flight.
    busy: bool,
}

/// A set of ids registered for key caching ([`Worker::cache_ids`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedIds {
    /// The signature of the set's distinct ids (PROTOCOL.md §10.7's
    /// function over them in the order the worker's plan puts them: by
    /// lcore, then id).
    pub signature: u64,
    /// The id lists (messages) it takes, one slot each on its lcore.
    pub lists: usize,
}

/// Each table's round and claim, by key index.
#[derive(Debug)]
pub(crate) struct TableClaims(Mutex<HashMap<u32, TableState>>);

impl TableClaims {
    /// Every table free, at round 0.
    pub(crate) fn new(tables: &[TableInfo]) -> TableClaims {
        TableClaims(Mutex::new(
            tables.iter().map(|t| (t.key, TableState::default())).collect(),
        ))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u32, TableState>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims table `key` if free, `next` picking the request's round from
    /// the table's; the claim is given back when the returned guard drops.
    fn claim(
        &self,
        key: u32,
        next: impl FnOnce(u32) -> Result<u32, String>,
    ) -> Result<(Claim<'_>, u32), WorkerError> {
        let mut tables = self.lock();
        // Callers pass a key of `Worker::tables`, from which this was made.
        let t = tables.get_mut(&key).expect("every table of the job has a claim");
        if t.busy {
            return Err(WorkerError::Busy { key });
        }
        let round = next(t.round).map_err(|message| WorkerError::Sequence { key, message })?;
        t.busy = true;
        Ok((
            Claim {
                claims: self,
                key,
                done: None,
            },
            round,
        ))
    }

    fn round(&self, key: u32) -> Option<u32> {
        self.lock().get(&key).map(|t| t.round)
    }
}

/// A claimed table; dropping it frees the table, recording `done` as its
/// round when set.
struct Claim<'a> {
    claims: &'a TableClaims,
    key: u32,
    done: Option<u32>,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.claims.lock().get_mut(&self.key) {
            debug_assert!(t.busy, "table {} freed without a claim", self.key);
            t.busy = false;
            if let Some(r) = self.done {
                t.round = r;
            }
        }
    }
}

impl Worker {
    /// The job's table named `name`.
    fn table_named(&self, name: &str) -> Result<&TableInfo, WorkerError> {
        self.tables.iter().find(|t| t.name == name).ok_or_else(|| {
            let names: Vec<String> = self.tables.iter().map(|t| format!("{:?}", t.name)).collect();
            WorkerError::UnknownTable {
                name: name.to_string(),
                tables: if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                },
            }
        })
    }

    /// The key index of the table named `name` (what its messages carry).
    pub fn table_key(&self, name: &str) -> Result<u32, WorkerError> {
        self.table_named(name).map(|t| t.key)
    }

    /// Values per row of the table named `name` (its spec's `dim`).
    pub fn table_dim(&self, name: &str) -> Result<u32, WorkerError> {
        self.table_named(name).map(|t| t.dim)
    }

    /// The last round (BSP) or this rank's clock (async, bounded delay) of
    /// the table named `name` whose push this worker completed; 0 before
    /// its first.
    pub fn table_round(&self, name: &str) -> Result<u32, WorkerError> {
        let t = self.table_named(name)?;
        Ok(self.table_claims.round(t.key).unwrap_or(0))
    }

    /// One round (clock) of the table named `table`: pushes `grads` (row i,
    /// `dim` values, is id `ids[i]`'s gradient; rows of a repeated id are
    /// summed) and, when every lcore has answered, writes into `out` each
    /// id's row after the round's update (`ids.len() * dim` values, in
    /// `ids`' order, a repeated id's row at each of its positions).
    /// Returns the round. Blocks.
    ///
    /// Every rank of the job pushes every round of the table, with as
    /// many ids as it has (none is fine): an lcore completes a round once
    /// every rank said it sent all its rows there (PROTOCOL.md §10.2). In
    /// an async or bounded-delay job the round is this rank's clock and
    /// the rows are those after its own push (§10.3).
    ///
    /// Errors: `grads` or `out` of another length than `ids.len() * dim`,
    /// no table of that name, more distinct ids for one lcore than one
    /// round carries (1024 datagrams of R rows), the appliance's refusal
    /// ([`WorkerError::TableRefused`]) or silence
    /// ([`WorkerError::TableTimeout`]). After a failed push the table's
    /// round stays where it was, and some of its messages may be in: try
    /// again with the same ids and gradients, which make the same messages
    /// (the plan depends on them alone), each taken once by the appliance;
    /// other rows for that round would make messages whose sequence numbers
    /// it already holds with other ids, and never be answered.
    pub fn push_pull_rows(
        &self,
        table: &str,
        ids: &[u64],
        grads: &[f32],
        out: &mut [f32],
    ) -> Result<u32, WorkerError> {
        let t = self.table_named(table)?;
        check_rows(t, "out", ids.len(), out.len())?;
        let out_rows = self.push_rows_inner(t, ids, grads)?;
        out_rows.write_into(out);
        Ok(out_rows.round)
    }

    /// [`Worker::push_pull_rows`] without the rows after the update: one
    /// round (clock) of pushes. Returns the round.
    pub fn push_rows(&self, table: &str, ids: &[u64], grads: &[f32]) -> Result<u32, WorkerError> {
        self.start_push_rows(table, ids, grads)?.wait()
    }

    /// [`Worker::push_rows`] without waiting: plans the round (the ids and
    /// gradients are copied into its messages), hands it to the I/O thread
    /// and returns at once, so that pushes of several tables are in flight
    /// together (an embedding model's backward). The table stays claimed
    /// until [`RowsPush::wait`] (another request of it meanwhile is
    /// refused [`WorkerError::Busy`]); dropping the push unwaited waits for
    /// it as [`RowsPush::wait`] does and lets the outcome go.
    pub fn start_push_rows(
        &self,
        table: &str,
        ids: &[u64],
        grads: &[f32],
    ) -> Result<RowsPush<'_>, WorkerError> {
        let t = self.table_named(table)?;
        self.send_push(t, ids, grads)
    }

    /// The current rows of `ids` of the table named `table` into `out`
    /// (`ids.len() * dim` values, in `ids`' order): the rows of the last
    /// completed round (BSP; a row never pushed reads as its initial
    /// value, §10.4). Any time, any ids; changes nothing. Returns the
    /// lowest round the answering lcores stated (0 for no ids). Blocks.
    pub fn pull_rows(&self, table: &str, ids: &[u64], out: &mut [f32]) -> Result<u32, WorkerError> {
        check_rows(self.table_named(table)?, "out", ids.len(), out.len())?;
        self.start_pull_rows(table, ids)?.wait_into(out)
    }

    /// [`Worker::pull_rows`] without waiting: plans the pull, hands it to
    /// the I/O thread and returns at once, so that the pulls of several
    /// tables are in flight together (an embedding model's forward, which
    /// knows every table's ids before it needs the first one's rows). The
    /// table stays claimed until [`RowsPull::wait_into`] (another request
    /// of it meanwhile is refused [`WorkerError::Busy`]); dropping the pull
    /// unwaited waits for it and lets the rows go.
    pub fn start_pull_rows(&self, table: &str, ids: &[u64]) -> Result<RowsPull<'_>, WorkerError> {
        let t = self.table_named(table)?;
        let (claim, _) = self.table_claims.claim(t.key, Ok)?;
        let plan = plan_pull(t, ids)?;
        let rx = self.send_rows(plan)?;
        Ok(RowsPull {
            _claim: claim,
            table: &t.name,
            values: ids.len() * t.dim as usize,
            rx,
            ended: false,
        })
    }

    /// For a rank that rejoined a running job (or lost track of a table's
    /// rounds): asks every lcore of the table for its last completed round
    /// (BSP; in async and bounded delay, this rank's last applied clock
    /// there) with a ROW_PULL of one id placed on it, makes the lowest the
    /// table's round here (or one below the highest, where an lcore
    /// restored from an older checkpoint stands lower still), and returns
    /// it. The next push carries the round after it: lcores that completed
    /// that round already (this rank had pushed it before it left) answer
    /// it with their current rows and add nothing (PROTOCOL.md §10.3, rule
    /// 3); the others complete it with this push, and a restored lcore
    /// refuses it `ahead` and is caught up first (§10.6). Blocks. A job
    /// with several tables catches them all up with
    /// [`Worker::catch_up_tables`].
    pub fn catch_up_rows(&self, table: &str) -> Result<u32, WorkerError> {
        self.catch_up_table(table).map(|o| o.caught_up())
    }

    /// [`Worker::catch_up_rows`]'s pull, whose output it returns.
    fn catch_up_table(&self, table: &str) -> Result<RowOutput, WorkerError> {
        let t = self.table_named(table)?;
        let ids = one_id_per_lcore(t)?;
        let (mut claim, _) = self.table_claims.claim(t.key, Ok)?;
        let plan = plan_pull(t, &ids)?;
        let rx = self.send_rows(plan)?;
        let o = wait_rows(&rx)?;
        claim.done = Some(o.caught_up());
        Ok(o)
    }

    /// [`Worker::catch_up_rows`] for every table of the job, after which
    /// every table's round here is the lowest of theirs, which it returns
    /// (0 without tables), or one below the highest round an lcore of the
    /// table stated, if that is higher ([`caught_up_together`]). A
    /// training step pushes every table (each rank pushes every round of
    /// a table), so a rank that left mid-step left one table a round
    /// ahead of another; pushing that one first, it would wait on ranks
    /// that wait for its part of the other's round (BSP: for ever;
    /// simulator seed 11891). Repeating the round of the table ahead is
    /// answered from its completed round and adds nothing (PROTOCOL.md
    /// §10.3, rule 3). Blocks.
    pub fn catch_up_tables(&self) -> Result<u32, WorkerError> {
        let mut caught = Vec::with_capacity(self.tables.len());
        for t in &self.tables {
            let o = self.catch_up_table(&t.name)?;
            caught.push((o.round, o.highest));
        }
        let rounds = caught_up_together(&caught);
        for (t, &round) in self.tables.iter().zip(&rounds) {
            let (mut claim, _) = self.table_claims.claim(t.key, Ok)?;
            claim.done = Some(round);
        }
        Ok(rounds.iter().copied().min().unwrap_or(0))
    }

    /// Key caching (PROTOCOL.md §10.7): registers the ids `ids` of the
    /// table named `table`, so that later pushes and pulls of the same
    /// ids (the same set: any order, any repeats) send each message's ids
    /// once, kept by its lcore, and then name them by a 64-bit signature
    /// instead: 8 bytes an id saved in every message and answer, for 16
    /// bytes of prefix. Each message's list takes one of this rank's
    /// `key_cache` slots (the table's spec) on its lcore; registering the
    /// same ids again takes none. Returns the set's signature and how many
    /// lists it takes. Pushes and pulls of other ids go as before.
    ///
    /// Errors: no table of that name, a table with `key_cache = 0`, or
    /// more lists on an lcore than its free slots (nothing registered).
    pub fn cache_ids(&self, table: &str, ids: &[u64]) -> Result<CachedIds, WorkerError> {
        let t = self.table_named(table)?;
        let (lists, signature) = id_lists(t, ids)?;
        let n = lists.len();
        self.send_cache(t.key, lists, true)?;
        Ok(CachedIds { signature, lists: n })
    }

    /// Forgets a registration of [`Worker::cache_ids`] of the same ids:
    /// lists no registration holds any more give their slots back, and
    /// messages of those ids carry them again.
    pub fn uncache_ids(&self, table: &str, ids: &[u64]) -> Result<(), WorkerError> {
        let t = self.table_named(table)?;
        let (lists, _) = id_lists(t, ids)?;
        self.send_cache(t.key, lists, false)
    }

    fn send_cache(&self, key: u32, lists: Vec<(u32, u64)>, cache: bool) -> Result<(), WorkerError> {
        let (done, rx) = crossbeam_channel::bounded(1);
        self.send_command(Command::CacheIds {
            key,
            lists,
            cache,
            done,
        })?;
        rx.recv().unwrap_or(Err(WorkerError::Closed))
    }

    fn push_rows_inner(&self, t: &TableInfo, ids: &[u64], grads: &[f32]) -> Result<RowOutput, WorkerError> {
        self.send_push(t, ids, grads)?.end()
    }

    /// Claims table `t`'s next round and hands its push to the I/O thread.
    fn send_push(&self, t: &TableInfo, ids: &[u64], grads: &[f32]) -> Result<RowsPush<'_>, WorkerError> {
        check_rows(t, "grads", ids.len(), grads.len())?;
        let consistency = self.spec.consistency;
        let (claim, round) = self
            .table_claims
            .claim(t.key, |r| next_round(consistency, Some(r)))?;
        let plan = plan_push(t, round, ids, grads)?;
        let rx = self.send_rows(plan)?;
        Ok(RowsPush {
            claim,
            round,
            rx,
            ended: false,
        })
    }

    /// Hands a planned table request to the I/O thread.
    fn send_rows(&self, plan: crate::transport::RowPlan) -> Result<Receiver<RowCompletion>, WorkerError> {
        let (done, rx) = crossbeam_channel::bounded(1);
        self.send_command(Command::SubmitRows(RowRequest { plan, done }))?;
        Ok(rx)
    }
}

/// A table's push in flight ([`Worker::start_push_rows`]).
#[must_use = "dropping a push blocks until it ends"]
pub struct RowsPush<'a> {
    claim: Claim<'a>,
    round: u32,
    rx: Receiver<RowCompletion>,
    ended: bool,
}

impl std::fmt::Debug for RowsPush<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowsPush")
            .field("table", &self.claim.key)
            .field("round", &self.round)
            .finish_non_exhaustive()
    }
}

impl RowsPush<'_> {
    /// The round (clock) it pushes.
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Blocks until every lcore of the table has answered (as
    /// [`Worker::push_rows`]); returns the round, now the table's.
    pub fn wait(mut self) -> Result<u32, WorkerError> {
        self.end().map(|o| o.round)
    }

    /// Waits for the push's outcome; records its round as the table's
    /// when it worked.
    fn end(&mut self) -> Result<RowOutput, WorkerError> {
        self.ended = true;
        let o = wait_rows(&self.rx)?;
        debug_assert_eq!(o.round, self.round);
        self.claim.done = Some(self.round);
        Ok(o)
    }
}

impl Drop for RowsPush<'_> {
    fn drop(&mut self) {
        // The I/O thread holds the table's request until it ends: the
        // table is free only then (and its round the push's if it worked).
        if !self.ended {
            let _ = self.end();
        }
    }
}

/// A table's pull in flight ([`Worker::start_pull_rows`]).
#[must_use = "dropping a pull blocks until it ends"]
pub struct RowsPull<'a> {
    /// Held, not read: its drop (after this pull's) frees the table.
    _claim: Claim<'a>,
    table: &'a str,
    /// `ids.len() * dim`: the length [`RowsPull::wait_into`] fills.
    values: usize,
    rx: Receiver<RowCompletion>,
    ended: bool,
}

impl std::fmt::Debug for RowsPull<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowsPull")
            .field("table", &self.table)
            .field("values", &self.values)
            .finish_non_exhaustive()
    }
}

impl RowsPull<'_> {
    /// How many values [`RowsPull::wait_into`] writes (`ids.len() * dim`).
    pub fn values(&self) -> usize {
        self.values
    }

    /// Blocks until every lcore asked has answered, then writes the rows
    /// into `out` as [`Worker::pull_rows`] does and returns the lowest
    /// round the answering lcores stated. `out` of another length than
    /// [`RowsPull::values`] is refused ([`WorkerError::Rows`]) after the
    /// pull has ended (the table is free again either way).
    pub fn wait_into(mut self, out: &mut [f32]) -> Result<u32, WorkerError> {
        self.ended = true;
        let o = wait_rows(&self.rx)?;
        if out.len() != self.values {
            return Err(WorkerError::Rows {
                table: self.table.to_string(),
                message: format!(
                    "out has {} values; the pull's rows have {}",
                    out.len(),
                    self.values
                ),
            });
        }
        o.write_into(out);
        Ok(o.round)
    }
}

impl Drop for RowsPull<'_> {
    fn drop(&mut self) {
        // As RowsPush's: the table is free once the I/O thread let go.
        if !self.ended {
            let _ = wait_rows(&self.rx);
        }
    }
}

/// A table request's outcome ([`WorkerError::Closed`] when the I/O
/// thread is gone).
fn wait_rows(rx: &Receiver<RowCompletion>) -> Result<RowOutput, WorkerError> {
    rx.recv().unwrap_or(Err(WorkerError::Closed))
}

/// Per table, the round its pushes go on after once every table of a
/// rank is caught up together ([`Worker::catch_up_tables`]), from each
/// table's catch-up pull (the lowest and highest rounds its lcores
/// stated, [`RowOutput::round`] and [`RowOutput::highest`]): the lowest of
/// the tables' [`RowOutput::caught_up`]s, unless that is more than one
/// round below the table's highest: its lcores there would only answer a
/// push of an older round (PROTOCOL.md §10.3 rule 4), and the rank would
/// push rounds nothing takes (simulator seed 11567, an lcore of another
/// appliance restored from an older checkpoint).
pub(crate) fn caught_up_together(tables: &[(u32, u32)]) -> Vec<u32> {
    let floor = |highest: u32| highest.saturating_sub(1);
    let lowest = tables
        .iter()
        .map(|&(lowest, highest)| lowest.max(floor(highest)))
        .min()
        .unwrap_or(0);
    tables
        .iter()
        .map(|&(_, highest)| lowest.max(floor(highest)))
        .collect()
}

/// An id placed on each lcore of `t`: the smallest, found by trying ids
/// from 0 on (each lcore gets about 1/L of them, §10.1, so a few times L
/// tries cover all L lcores).
pub(crate) fn one_id_per_lcore(t: &TableInfo) -> Result<Vec<u64>, WorkerError> {
    let lcores = t.placement.lcores() as usize;
    let mut found: Vec<Option<u64>> = vec![None; lcores];
    let mut missing = lcores;
    // Far beyond need: L ln L + O(L) tries on average.
    let tries = (lcores as u64).saturating_mul(1024).max(1 << 20);
    for id in 0..tries {
        let e = &mut found[t.placement.entry(id) as usize];
        if e.is_none() {
            *e = Some(id);
            missing -= 1;
            if missing == 0 {
                break;
            }
        }
    }
    found
        .into_iter()
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| WorkerError::Rows {
            table: t.name.clone(),
            message: format!("no id below {tries} is placed on some of its {lcores} lcores"),
        })
}

/// `got` values in `what` for `ids` ids of table `t`: exactly `ids * dim`.
fn check_rows(t: &TableInfo, what: &str, ids: usize, got: usize) -> Result<(), WorkerError> {
    let dim = t.dim as usize;
    if ids.checked_mul(dim) == Some(got) {
        return Ok(());
    }
    Err(WorkerError::Rows {
        table: t.name.clone(),
        message: format!(
            "{what} has {got} values; expected ids.len() * dim = {ids} * {dim} = {}",
            ids.saturating_mul(dim)
        ),
    })
}

#[cfg(test)]
mod tests {
    use std::net::UdpSocket;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use phub_proto::rows::RowMsgType;

    use super::*;
    use crate::config::WorkerConfig;
    use crate::transport::row_tests::{FakeLcore, Sent, JOB, KEY, TOKEN};

    /// PROTOCOL.md §10.1's join answer (table `emb`, key 1, between two
    /// dense keys; appliance `a` with two lcores, `b` with one), for one
    /// worker, its appliances at `a` and `b` on loopback.
    fn join(a: u16, b: u16) -> JoinResponse {
        let json = format!(
            r#"{{"job": {JOB}, "rank": 0,
            "spec": {{"name": "demo", "workers": 1, "dtype": "f32", "chunk_bytes": 64,
              "optimizer": {{"kind": "sum"}}, "consistency": {{"mode": "sync"}},
              "keys": [{{"name": "w", "elements": 40}},
                       {{"name": "emb", "kind": "table", "dim": 4, "rows": 1000, "seed": 7,
                         "init": {{"kind": "zeros"}}, "optimizer": {{"kind": "sum"}}}},
                       {{"name": "b", "elements": 8}}],
              "placement": {{"appliances": ["a", "b"]}}}},
            "layout": {{"chunk_elems": 16, "lcores": [{{"first": 0, "count": 1}}, {{"first": 1, "count": 2}},
              {{"first": 3, "count": 1}}]}},
            "dataplane": {{"host": "127.0.0.1", "base_port": {a}}},
            "appliances": [
              {{"name": "a", "host": "127.0.0.1", "base_port": {a}, "lcores": 2}},
              {{"name": "b", "host": "127.0.0.1", "base_port": {b}, "lcores": 1}}]}}"#
        );
        serde_json::from_str(&json).unwrap()
    }

    /// Three loopback sockets, the first two on consecutive ports.
    fn lcore_sockets() -> Vec<UdpSocket> {
        for _ in 0..200 {
            let a = UdpSocket::bind("127.0.0.1:0").unwrap();
            let p = a.local_addr().unwrap().port();
            let Some(next) = p.checked_add(1) else {
                continue;
            };
            if let Ok(a1) = UdpSocket::bind(("127.0.0.1", next)) {
                let b = UdpSocket::bind("127.0.0.1:0").unwrap();
                return vec![a, a1, b];
            }
        }
        panic!("no two consecutive free ports on loopback");
    }

    /// Plays the job's three lcores on `sockets` (loopback) until `stop`,
    /// losing the first ROW_PUSH and the first ROW_DONE.
    fn appliance(sockets: Vec<UdpSocket>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let mut lcores: Vec<FakeLcore> = sockets.iter().map(|_| FakeLcore::new(4)).collect();
            for s in &sockets {
                s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
            }
            let (mut lost_push, mut lost_done) = (false, false);
            let mut buf = vec![0u8; 9000];
            while !stop.load(Ordering::Relaxed) {
                for (s, lcore) in sockets.iter().zip(&mut lcores) {
                    let Ok((n, from)) = s.recv_from(&mut buf) else {
                        continue;
                    };
                    let m = Sent::parse(s.local_addr().unwrap(), &buf[..n]);
                    if m.repr.kind == RowMsgType::RowPush && !lost_push {
                        lost_push = true;
                        continue;
                    }
                    for a in lcore.handle(&m) {
                        let done = phub_proto::rows::parse(&a).unwrap().0.kind == RowMsgType::RowDone;
                        if done && !lost_done {
                            lost_done = true;
                            continue;
                        }
                        s.send_to(&a, from).unwrap();
                    }
                }
            }
        })
    }

    #[test]
    fn a_worker_pushes_and_pulls_rows_by_table_name_over_udp() {
        let sockets = lcore_sockets();
        let ports: Vec<u16> = sockets.iter().map(|s| s.local_addr().unwrap().port()).collect();
        let w = Worker::from_join(join(ports[0], ports[2]), TOKEN, WorkerConfig::default()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let fake = appliance(sockets, Arc::clone(&stop));
        assert_eq!(
            (w.table_key("emb").unwrap(), w.table_dim("emb").unwrap()),
            (KEY, 4)
        );
        assert_eq!(w.table_round("emb").unwrap(), 0);
        // Ids over all three lcores (§10.1's example: 0 and 3 on entry 0,
        // 1 on entry 1, 2 on entry 2), one repeated.
        let ids = [0u64, 1, 2, 3, 42, 1];
        let grads: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let mut out = vec![f32::NAN; 24];
        assert_eq!(w.push_pull_rows("emb", &ids, &grads, &mut out).unwrap(), 1);
        let row = |i: usize| grads[i * 4..i * 4 + 4].to_vec();
        let one: Vec<f32> = row(1).iter().zip(row(5)).map(|(a, b)| a + b).collect();
        let want: Vec<f32> = [row(0), one.clone(), row(2), row(3), row(4), one].concat();
        assert_eq!(out, want);
        assert_eq!(w.table_round("emb").unwrap(), 1);
        // Round 2, no rows at all: every lcore still gets its ROW_END.
        assert_eq!(w.push_rows("emb", &[], &[]).unwrap(), 2);
        let mut pulled = vec![f32::NAN; 8];
        assert_eq!(w.pull_rows("emb", &[1, 77], &mut pulled).unwrap(), 2);
        assert_eq!(pulled, [want[4..8].to_vec(), vec![0.0; 4]].concat());
        let s = w.stats();
        assert!(
            s.row_retransmits >= 2,
            "the lost ROW_PUSH and ROW_DONE were resent: {s:?}"
        );
        assert!(s.row_answers_accepted > 0 && s.row_answers_malformed == 0);
        // Mistakes are named.
        let e = w.push_rows("emb", &ids, &grads[..20]).unwrap_err().to_string();
        assert!(
            e.contains("grads has 20 values") && e.contains("6 * 4 = 24"),
            "{e}"
        );
        let e = w
            .push_pull_rows("emb", &ids, &grads, &mut out[..4])
            .unwrap_err()
            .to_string();
        assert!(e.contains("out has 4 values"), "{e}");
        let e = w.pull_rows("w", &ids, &mut out).unwrap_err().to_string();
        assert!(e.contains("no table named \"w\"") && e.contains("\"emb\""), "{e}");
        let e = w.pull(KEY, &mut [0f32; 0]).unwrap_err().to_string();
        assert!(e.contains("table \"emb\"") && e.contains("push_pull_rows"), "{e}");
        assert_eq!(w.table_round("emb").unwrap(), 2, "failed calls leave the round");
        // A second worker of the rank (a rejoin) learns the rounds and goes on.
        let w2 = Worker::from_join(join(ports[0], ports[2]), TOKEN, WorkerConfig::default()).unwrap();
        assert_eq!(w2.table_round("emb").unwrap(), 0);
        assert_eq!(w2.catch_up_rows("emb").unwrap(), 2);
        assert_eq!(w2.table_round("emb").unwrap(), 2);
        assert_eq!(w2.catch_up_tables().unwrap(), 2);
        assert_eq!(w2.table_round("emb").unwrap(), 2);
        let mut again = vec![f32::NAN; 4];
        assert_eq!(w2.push_pull_rows("emb", &[3], &[1.0; 4], &mut again).unwrap(), 3);
        assert_eq!(again, want[12..16].iter().map(|x| x + 1.0).collect::<Vec<_>>());
        stop.store(true, Ordering::Relaxed);
        fake.join().unwrap();
    }

    /// A rank's tables caught up together (`Worker::catch_up_tables`):
    /// each goes on after the lowest round over the tables, unless its own
    /// lcores stand two or more above that (one restored from an older
    /// checkpoint elsewhere): then after one below its highest.
    #[test]
    fn tables_caught_up_together_go_on_from_the_lowest_round_no_lcore_takes_for_stale() {
        let out = |round, highest| RowOutput {
            round,
            highest,
            rows: Vec::new(),
            slot_of: Vec::new(),
            dim: 1,
        };
        // One table: the lowest, or one below the highest past a restore.
        assert_eq!(out(2, 2).caught_up(), 2);
        assert_eq!(out(2, 3).caught_up(), 2);
        assert_eq!(out(1, 3).caught_up(), 2);
        assert_eq!(out(0, 0).caught_up(), 0);
        // Seed 11891: a table one round ahead goes back to the other's.
        assert_eq!(caught_up_together(&[(2, 2), (1, 2)]), [1, 1]);
        // Seed 11567: table 0's lcores stand at 3 and 1 (restored), table
        // 1's at 2 and 1; table 0 cannot go on after 1.
        assert_eq!(caught_up_together(&[(1, 3), (1, 2)]), [2, 1]);
        assert_eq!(caught_up_together(&[]), Vec::<u32>::new());
    }
}
