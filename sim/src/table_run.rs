//! A run's table keys (PROTOCOL.md §10): each rank pushes every table
//! round by round through its real row transport
//! (`phub_worker::sim_rows::SimRowTransport`), apart from its dense keys
//! (tables keep their own rounds, §10.3), and the run checks what the
//! lcores take and send against the tables' models ([`crate::rows`]).
//!
//! Checks, after every datagram:
//! - a ROW_PUSH is taken once per (lcore incarnation, rank, round,
//!   sequence), for the round in progress (BSP) or the rank's next clock;
//! - BSP: a round completes once, in order; without a restore its
//!   accumulator is every rank's rows on that lcore summed;
//! - every ROW_RESULT and ROW_PULL_RESULT carries the model's rows, bit
//!   for bit, and every row a worker's push ends with is one a
//!   ROW_RESULT of that round carried to it;
//! - at the end, every (table, lcore) completed every round (every rank's
//!   every clock) and no row transport has a request in flight;
//! - with [`crate::Case::table_prefetch`], every row a worker's pull ends
//!   with is one a ROW_PULL_RESULT carried to it.

use std::time::Instant;

use phub_engine::Verdict;
use phub_proto::rows::{self, KeyCache, RowMsgType, RowPayload, RowRepr};
use phub_proto::spec::Consistency;
use rand::Rng;

use super::{rows as model, Lcore, World};

/// The tag of a table's pull ([`crate::Case::table_prefetch`]) beside its
/// push's (the table's index).
const PULL: u64 = 1 << 32;

/// Whether `row` is, bit for bit, one of the rows `sent` (answers to a
/// rank for one id) carried.
fn carried(sent: Option<&Vec<Vec<f32>>>, row: &[f32]) -> bool {
    sent.is_some_and(|s| {
        s.iter()
            .any(|a| a.iter().zip(row).all(|(x, y)| x.to_bits() == y.to_bits()))
    })
}

impl World<'_> {
    /// Rank `i`'s row transport: its timers, its ended pushes, and the
    /// tables whose next round is ready.
    pub(super) fn step_tables(&mut self, i: usize) {
        let now = self.at(self.now);
        let Some(rt) = self.ranks[i].rt.as_mut() else {
            return;
        };
        if rt.poll_timeout().is_some_and(|t| t <= now) {
            rt.handle_timeout(now);
        }
        self.take_table_ends(i);
        // Every table's round together, in table order, as a training
        // step calls them: ranks that submitted tables in different
        // orders could each fill their window with a table the others
        // send later (seed 4 did, before this).
        if self.ranks[i]
            .tables
            .iter()
            .all(|t| t.ids.is_none() && t.pull.is_none() && !t.catching_up)
            && self.ranks[i]
                .tables
                .iter()
                .any(|t| t.ready_at.is_some_and(|at| at <= self.now))
        {
            // With prefetch, the round's pulls go first, together; once
            // they all ended (`pulled`), the pushes.
            let pull = self.case.table_prefetch
                && self.ranks[i]
                    .tables
                    .iter()
                    .any(|t| t.ready_at.is_some() && t.pulled != t.next);
            for t in 0..self.case.tables.len() {
                if self.ranks[i].tables[t].ready_at.is_some() {
                    if pull {
                        self.submit_pull(i, t);
                    } else {
                        self.submit_table(i, t);
                    }
                }
            }
        }
    }

    /// Rank `i` pulls the ids of its next round of table `t`
    /// ([`crate::Case::table_prefetch`]).
    fn submit_pull(&mut self, i: usize, t: usize) {
        let now = self.at(self.now);
        let (key, round, ids) = self.next_ids(i, t);
        let rt = self.ranks[i]
            .rt
            .as_mut()
            .expect("a case with tables gives each rank a row transport");
        if let Err(e) = rt.pull(now, PULL | t as u64, key, &ids) {
            panic!("rank {i}: table {t}'s pull for round {round} is refused before it is sent: {e}");
        }
        self.ranks[i].tables[t].pull = Some(ids);
    }

    /// Rank `i`'s pull of table `t` ended: each row is one a
    /// ROW_PULL_RESULT carried to it, and the round's push may go.
    fn on_pull_done(&mut self, i: usize, t: usize, d: phub_worker::sim_rows::SimRowDone) {
        // Cast: ranks are u16.
        #[allow(clippy::cast_possible_truncation)]
        let rank = i as u16;
        let ids = self.ranks[i].tables[t]
            .pull
            .take()
            .unwrap_or_else(|| panic!("rank {i}: table {t} ended a pull it did not make"));
        let values = match d.result {
            Ok((_, values)) => values,
            Err(phub_worker::WorkerError::JobFailed { message, .. }) => {
                self.stop_rank(i, &message);
                return;
            }
            Err(e) => panic!("rank {i}: table {t}'s pull (key {}) failed: {e}", d.key),
        };
        let dim = self.case.tables[t].dim as usize;
        assert_eq!(values.len(), ids.len() * dim, "rank {i}: table {t}'s pull's rows");
        for (j, id) in ids.iter().enumerate() {
            let row = &values[j * dim..(j + 1) * dim];
            let sent = self.pull_answers.get(&(rank, d.key, *id));
            assert!(
                carried(sent, row),
                "rank {i}: table {t}'s pull, id {id:#x}: the row {row:?} is none a ROW_PULL_RESULT carried to it ({sent:?})"
            );
        }
        self.outcome.table_pulls += 1;
        let tr = &mut self.ranks[i].tables[t];
        tr.pulled = tr.next;
    }

    /// Rank `i` rejoined at `now`: a new row transport (the same
    /// address) asks every lcore where each table stands, as
    /// `Worker::catch_up_tables` does, and its pushes go on from the
    /// rounds that gives (`caught_up_together`: the lowest over the
    /// tables, never below a table's highest stated round less one;
    /// PROTOCOL.md §10.3, "A rank that rejoins"). A push the rank left in
    /// flight is sent again from its first message: the gradients are
    /// the round's, as they were, so what an lcore took of it before is
    /// a duplicate there.
    pub(super) fn catch_up_tables(&mut self, i: usize, now: Instant) {
        // Cast: ranks are u16.
        #[allow(clippy::cast_possible_truncation)]
        let rank = i as u16;
        if self.case.tables.is_empty() {
            return;
        }
        let mut rt = super::row_transport(self.case, &self.spec, &self.lay, rank, now)
            .expect("a case with tables gives each rank a row transport");
        for t in 0..self.case.tables.len() {
            let key = super::table_key(self.case, t);
            if let Err(e) = rt.catch_up(now, t as u64, key) {
                panic!("rank {i}: table {t}'s catch-up is refused before it is sent: {e}");
            }
            self.ranks[i].tables[t].catching_up = true;
        }
        self.ranks[i].rt = Some(rt);
        self.ranks[i].row_received = 0;
        self.outcome.tables_caught_up += 1;
    }

    /// Table `t`'s key, rank `i`'s next round of it, and the ids that
    /// round carries (its pull's, with prefetch, and its push's).
    fn next_ids(&self, i: usize, t: usize) -> (u32, u32, Vec<u64>) {
        // Cast: ranks are u16.
        #[allow(clippy::cast_possible_truncation)]
        let rank = i as u16;
        let key = super::table_key(self.case, t);
        let round = self.ranks[i].tables[t].next;
        (
            key,
            round,
            self.case.tables[t].round_ids(self.case.seed, key, rank, round),
        )
    }

    /// Rank `i` pushes its next round of table `t`.
    fn submit_table(&mut self, i: usize, t: usize) {
        let now = self.at(self.now);
        let (key, round, ids) = self.next_ids(i, t);
        // Cast: ranks are u16.
        #[allow(clippy::cast_possible_truncation)]
        let grads = self.case.tables[t].grads(key, i as u16, round, &ids);
        if round == self.case.rounds && self.last_round_at.is_none() {
            self.last_round_at = Some(self.now);
        }
        let r = &mut self.ranks[i];
        let rt =
            r.rt.as_mut()
                .expect("a case with tables gives each rank a row transport");
        if let Err(e) = rt.push(now, t as u64, key, round, &ids, &grads) {
            panic!("rank {i}: table {t} round {round} is refused before it is sent: {e}");
        }
        r.tables[t].ids = Some(ids);
        r.tables[t].ready_at = None;
    }

    /// Rank `i`'s table requests that ended, each taken
    /// ([`World::on_table_done`]).
    pub(super) fn take_table_ends(&mut self, i: usize) {
        let mut ended = Vec::new();
        if let Some(rt) = self.ranks[i].rt.as_mut() {
            while let Some(d) = rt.poll_done() {
                ended.push(d);
            }
        }
        for d in ended {
            self.on_table_done(i, d);
        }
    }

    /// Rank `i`'s push of a table ended: its rows are those ROW_RESULTs
    /// of its round carried to it.
    fn on_table_done(&mut self, i: usize, d: phub_worker::sim_rows::SimRowDone) {
        // Cast: the tag is the table's index (and PULL for a pull).
        #[allow(clippy::cast_possible_truncation)]
        let t = (d.tag & !PULL) as usize;
        if d.tag & PULL != 0 {
            self.on_pull_done(i, t, d);
            return;
        }
        // Cast: ranks are u16.
        #[allow(clippy::cast_possible_truncation)]
        let rank = i as u16;
        if self.ranks[i].tables[t].catching_up {
            let round = match d.result {
                Ok((round, _)) => round,
                Err(e) => panic!("rank {i}: table {t}'s catch-up after the rejoin failed: {e}"),
            };
            let tr = &mut self.ranks[i].tables[t];
            tr.catching_up = false;
            tr.caught = (round, d.highest);
            // Every table goes on together, as `Worker::catch_up_tables`
            // has them: a step pushes every table, and a rank that left
            // mid-step left one a round ahead; pushed first, that one waits
            // on ranks that wait for this rank's part of the other's round
            // (seed 11891, BSP).
            let tables = &mut self.ranks[i].tables;
            if tables.iter().all(|t| !t.catching_up) {
                let caught: Vec<(u32, u32)> = tables.iter().map(|t| t.caught).collect();
                let rounds = phub_worker::sim_rows::caught_up_together(&caught);
                for (tr, r) in tables.iter_mut().zip(rounds) {
                    tr.next = r + 1;
                }
            }
            self.ready_tables(i);
            return;
        }
        if let Err(phub_worker::WorkerError::JobFailed { message, .. }) = &d.result {
            // Control failed the job (a part lost): the rank stops with
            // its reason, as its dense keys do (`on_done`).
            self.ranks[i].tables[t].ids = None;
            self.stop_rank(i, message);
            return;
        }
        let round = self.ranks[i].tables[t].next;
        let ids = self.ranks[i].tables[t]
            .ids
            .take()
            .unwrap_or_else(|| panic!("rank {i}: table {t} ended a push it did not make"));
        let (got, values) = match d.result {
            Ok(v) => v,
            Err(e) => panic!("rank {i}: table {t} (key {}) round {round} failed: {e}", d.key),
        };
        assert_eq!(got, round, "rank {i}: table {t} answered for another round");
        let dim = self.case.tables[t].dim as usize;
        for (j, id) in ids.iter().enumerate() {
            let row = &values[j * dim..(j + 1) * dim];
            let sent = self.row_answers.get(&(rank, d.key, round, *id));
            assert!(
                carried(sent, row),
                "rank {i}: table {t} round {round} id {id:#x}: the row {row:?} is none a ROW_RESULT carried to it ({sent:?})"
            );
        }
        self.outcome.table_pushes += 1;
        self.ranks[i].tables[t].next += 1;
        self.ready_tables(i);
    }

    /// Once every table's round (or catch-up) of rank `i` ended, the next
    /// is computed.
    fn ready_tables(&mut self, i: usize) {
        if self.ranks[i]
            .tables
            .iter()
            .all(|t| t.ids.is_none() && t.pull.is_none() && !t.catching_up)
        {
            let slow = if i == 0 { 3 } else { 1 };
            let at = self.now + slow * self.rng.gen_range(0..=self.case.compute_us);
            let rounds = self.case.rounds;
            for tr in &mut self.ranks[i].tables {
                if tr.next <= rounds {
                    tr.ready_at = Some(at);
                }
            }
        }
    }

    /// A message's (or answer's) ids and rows: its own, or, in the cached
    /// form (PROTOCOL.md §10.7), the ids of the list its signature names,
    /// which a store of `rank` carried before; a store's list is
    /// recorded. `None` for a message without ids, or naming a list no
    /// store carried.
    fn ids_and_rows(
        &mut self,
        repr: &RowRepr,
        rank: u16,
        payload: RowPayload<'_>,
    ) -> Option<(Vec<u64>, Vec<f32>)> {
        let dim = repr.dim as usize;
        let (ids, rows): (Vec<u64>, Vec<f32>) = match payload {
            RowPayload::Rows(rs) => {
                let mut v = vec![0f32; rs.len() * dim];
                for (j, row) in v.chunks_exact_mut(dim.max(1)).enumerate() {
                    assert!(rs.decode_row(j, row), "a parsed message's rows decode");
                }
                (rs.ids().iter().collect(), v)
            }
            RowPayload::Ids(ids) => (ids.iter().collect(), Vec::new()),
            RowPayload::Empty => return None,
            RowPayload::Cached(values) => {
                let c = repr.cache.reference()?;
                let ids = self.key_lists.get(&(repr.key, rank, c.sig))?.clone();
                self.outcome.lists_named += 1;
                let mut v = vec![0f32; values.len() / repr.dtype.size()];
                phub_proto::dtype::decode(repr.dtype, values, &mut v);
                (ids, v)
            }
        };
        if let KeyCache::Store(c) = repr.cache {
            assert_eq!(
                c.sig,
                rows::ids_signature(ids.iter().copied()),
                "a worker's store is signed by its ids"
            );
            self.key_lists.insert((repr.key, rank, c.sig), ids.clone());
        }
        Some((ids, rows))
    }

    /// Lcore `l` handled the table message `bytes` with `verdict`: the
    /// model of its (table, lcore) takes what the lcore took, and replays
    /// the rows it evicted at the cap.
    pub(super) fn row_taken(&mut self, l: usize, bytes: &[u8], verdict: Verdict) {
        let capped = self.give_cap_victims(l, bytes);
        let e = self.entry_of(l, bytes);
        self.follow_row(l, e, bytes, verdict);
        if let Some((t, key)) = capped {
            self.check_cap(l, t, key);
        }
    }

    /// A table with a small cap ([`model::TableCase::cap`]): its model
    /// gets the lcore's share of the cap and the ids the lcore evicted at
    /// the cap taking `bytes` (the engine's eviction log), to replay as
    /// it takes the message. Returns the table and its key, if capped.
    fn give_cap_victims(&mut self, l: usize, bytes: &[u8]) -> Option<(usize, u32)> {
        let (repr, _) = rows::parse(bytes).ok()?;
        let t = (repr.key as usize)
            .checked_sub(self.case.keys.len())
            .filter(|&t| t < self.case.tables.len())?;
        self.case.tables[t].cap?;
        let shard = &mut self.lcores[l].shard;
        let (cap, _, _) = shard.row_cap_count(super::JOB, repr.key)?;
        let victims = shard.take_cap_victims(super::JOB, repr.key)?;
        self.tmodels[t][l].at_cap = Some(model::AtCap {
            cap,
            victims: victims.into(),
        });
        Some((t, repr.key))
    }

    /// After a capped table's model took a message: every id the lcore
    /// evicted was replayed, the lcore stores exactly the model's rows
    /// (no more than its share of the cap), and counts as evicted at the
    /// cap exactly the rows that went.
    fn check_cap(&mut self, l: usize, t: usize, key: u32) {
        let shard = &self.lcores[l].shard;
        let Some((cap, stored, evicted)) = shard.row_cap_count(super::JOB, key) else {
            return;
        };
        let m = &mut self.tmodels[t][l];
        let at = m.at_cap.take().unwrap_or_default();
        assert!(
            at.victims.is_empty(),
            "lcore {l}: table key {key}: the lcore evicted {:?} at the cap, which the model did not",
            at.victims
        );
        let went = m.take_evicted_at_cap();
        assert!(
            stored <= cap && stored == m.rows.len() as u64,
            "lcore {l}: table key {key} stores {stored} rows (cap {cap}), the model {}",
            m.rows.len()
        );
        if let Some(id) = m
            .rows
            .keys()
            .find(|&&id| shard.row_stored(super::JOB, key, id) != Some(true))
        {
            panic!("lcore {l}: table key {key}: row {id:#x} stored in the model, not on the lcore");
        }
        assert_eq!(
            evicted - m.cap_seen,
            went,
            "lcore {l}: table key {key}: rows evicted at the cap by the lcore's count and the model's"
        );
        m.cap_seen = evicted;
        self.outcome.rows.evicted_at_cap += went;
    }

    /// The entry a table message at (or from) lcore `l` is for: the
    /// lcore's own, or in a replicated job the header's (an lcore may
    /// serve an adopted entry, PROTOCOL.md §11.9).
    pub(super) fn entry_of(&self, l: usize, bytes: &[u8]) -> usize {
        if self.control.is_none() {
            return l;
        }
        phub_proto::wire::Header::new_checked(bytes).map_or(l, |h| h.entry() as usize)
    }

    /// [`World::row_taken`]'s model of what lcore `l` took for entry `e`.
    fn follow_row(&mut self, l: usize, e: usize, bytes: &[u8], verdict: Verdict) {
        if !self.serves(l, e) {
            // A fenced lcore (cut off behind an epoch that moved the
            // entry, PROTOCOL.md §11.9) takes the messages of the old
            // epoch that reach it, and completes no round its entry's
            // server does not hold; the entry's rounds are its server's.
            if verdict == Verdict::Completed {
                if let Ok((r, _)) = rows::parse(bytes) {
                    self.check_fenced_round(l, e, r.key, r.round);
                }
            }
            return;
        }
        let Ok((repr, payload)) = rows::parse(bytes) else {
            assert!(
                matches!(verdict, Verdict::Dropped(_)),
                "lcore {l}: a table message that does not parse was {verdict:?}"
            );
            return;
        };
        let resolved = self.ids_and_rows(&repr, repr.rank, payload);
        let Some(t) = (repr.key as usize).checked_sub(self.case.keys.len()) else {
            return;
        };
        if t >= self.case.tables.len() {
            return;
        }
        let sync = self.case.consistency == Consistency::Sync;
        // Forwarded: a replicated job's round, every rank in, waiting for
        // the entry's backups (completed at their last ACK).
        let took = matches!(
            verdict,
            Verdict::Aggregated | Verdict::Completed | Verdict::Applied | Verdict::Held | Verdict::Forwarded
        );
        let r = usize::from(repr.rank);
        let tc = &self.case.tables[t];
        let shard = &self.lcores[l].shard;
        let key = repr.key;
        let stored = |id: u64| {
            shard.row_stored(super::JOB, key, id).unwrap_or_else(|| {
                panic!("lcore {l}: table key {key} took a message and holds no such table")
            })
        };
        let m = &mut self.tmodels[t][e];
        if repr.kind == RowMsgType::RowPush && took {
            let fresh = self.row_applied.insert((
                l,
                e,
                self.lcores[l].incarnation,
                repr.key,
                repr.rank,
                repr.round,
                repr.seq,
            ));
            assert!(
                fresh,
                "lcore {l}: ROW_PUSH {} of rank {} round {} of table key {} taken twice",
                repr.seq, repr.rank, repr.round, repr.key
            );
            let want = if sync { m.completed + 1 } else { m.applied[r] + 1 };
            assert_eq!(
                repr.round, want,
                "lcore {l}: table key {} took rank {r}'s ROW_PUSH of round {} (round in progress or next clock {want})",
                repr.key, repr.round
            );
            let Some((ids, values)) = resolved else {
                panic!("lcore {l}: a ROW_PUSH without rows, or naming a list no store carried, was taken");
            };
            let d = tc.dim as usize;
            for (j, &id) in ids.iter().enumerate() {
                let a = &values[j * d..(j + 1) * d];
                if sync {
                    m.accumulate(id, a);
                } else {
                    self.outcome.rows.count(m.apply(tc, id, a, stored(id)));
                }
            }
        }
        if !matches!(verdict, Verdict::Completed | Verdict::Held) {
            return;
        }
        if !sync {
            assert_eq!(
                repr.round,
                m.applied[r] + 1,
                "lcore {l}: table key {}: rank {r}'s clock {} completed after clock {}",
                repr.key,
                repr.round,
                m.applied[r]
            );
            let slowest = |m: &model::TableModel| m.applied.iter().copied().min().unwrap_or(0);
            let before = slowest(m);
            m.applied[r] = repr.round;
            // The store's round advances when the slowest clock rises.
            if slowest(m) > before {
                self.outcome.rows.evicted += m.advance(tc, stored);
            }
            return;
        }
        self.complete_model(l, e, t, repr.key, repr.round);
    }

    /// BSP: table `t`'s (key `key`) round `round` completed on entry `e`,
    /// served at lcore `l`: its model completes it, and its sum is every
    /// rank's pushes'.
    pub(super) fn complete_model(&mut self, l: usize, e: usize, t: usize, key: u32, round: u32) {
        let tc = &self.case.tables[t];
        let shard = &self.lcores[l].shard;
        let stored = |id: u64| {
            shard.row_stored(super::JOB, key, id).unwrap_or_else(|| {
                panic!("lcore {l}: table key {key} completed a round and holds no such table")
            })
        };
        let m = &mut self.tmodels[t][e];
        assert_eq!(
            round,
            m.completed + 1,
            "lcore {l}: table key {key} entry {e} completed round {round} after round {}",
            m.completed
        );
        let acc = m.complete(tc, stored, &mut self.outcome.rows);
        if self.outcome.restored > 0 {
            return;
        }
        // Cast: lcores are few.
        #[allow(clippy::cast_possible_truncation)]
        let entry = e as u32;
        let want = model::expected_round(self.case, t, &self.tplace[t], entry, round);
        assert_eq!(
            acc.len(),
            want.len(),
            "lcore {l}: table key {} round {}: {} rows summed, every rank's pushes have {}",
            key,
            round,
            acc.len(),
            want.len()
        );
        for (id, a) in &acc {
            let same = want
                .get(id)
                .is_some_and(|w| w.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits()));
            assert!(
                same,
                "lcore {l}: table key {} round {} id {id:#x}: summed {a:?}, every rank's rows sum to {:?}",
                key,
                round,
                want.get(id)
            );
        }
    }

    /// A table answer leaving lcore `l` for `rank` carries the model's rows.
    pub(super) fn check_row_answer(&mut self, l: usize, rank: u16, bytes: &[u8]) {
        let Ok((repr, payload)) = rows::parse(bytes) else {
            panic!("lcore {l} sent a table message that does not parse");
        };
        if !matches!(payload, RowPayload::Rows(_) | RowPayload::Cached(_)) {
            return;
        }
        let Some((ids, values)) = self.ids_and_rows(&repr, rank, payload) else {
            panic!(
                "lcore {l}: a {} to rank {rank} names list {:?} of table key {}, which no store carried",
                repr.kind.name(),
                repr.cache,
                repr.key
            );
        };
        let t = (repr.key as usize)
            .checked_sub(self.case.keys.len())
            .filter(|&t| t < self.case.tables.len())
            .unwrap_or_else(|| {
                panic!(
                    "lcore {l} answered rows of key {}, no table of the case",
                    repr.key
                )
            });
        if repr.kind == RowMsgType::RowPullResult {
            // Recorded whoever sent it (a fenced lcore's answer may be
            // taken too): the worker's rows are checked against these.
            let d = self.case.tables[t].dim as usize;
            for (j, &id) in ids.iter().enumerate() {
                self.pull_answers
                    .entry((rank, repr.key, id))
                    .or_default()
                    .push(values[j * d..(j + 1) * d].to_vec());
            }
        }
        let tc = &self.case.tables[t];
        let e = self.entry_of(l, bytes);
        let m = &self.tmodels[t][e];
        if !(self.serves(l, e) || repr.kind == RowMsgType::RowResult && m.completed == repr.round) {
            // A fenced lcore's answer to a message of the old epoch: the
            // rows it holds, which its server may have moved past. (A
            // round it completed, its last backup's ACK in flight when
            // the epoch moved the entry, is answered as its server holds
            // it: checked below while no later round completed, and a
            // rank still waiting for it has not let one complete.)
            return;
        }
        let d = tc.dim as usize;
        for (j, &id) in ids.iter().enumerate() {
            let got = values[j * d..(j + 1) * d].to_vec();
            let want = m.answer(tc, self.case.dtype, id);
            if let Some(e) = (0..got.len()).find(|&e| got[e].to_bits() != want[e].to_bits()) {
                panic!(
                    "lcore {l}: {} of table key {} round {} to rank {rank}: id {id:#x} has {} at element {e}, the model {}",
                    repr.kind.name(),
                    repr.key,
                    repr.round,
                    got[e],
                    want[e]
                );
            }
            self.outcome.rows_checked += 1;
            if repr.kind == RowMsgType::RowResult {
                self.row_answers
                    .entry((rank, repr.key, repr.round, id))
                    .or_default()
                    .push(got.clone());
            }
        }
    }

    /// The crashed appliance's table models as its checkpoint is taken.
    pub(super) fn checkpoint_tables(&mut self, on: &dyn Fn(&Lcore) -> bool) {
        for (t, models) in self.tmodels.iter().enumerate() {
            for (g, m) in models.iter().enumerate() {
                if on(&self.lcores[g]) {
                    self.tmodel_checkpoint.insert((t, g), m.clone());
                }
            }
        }
    }

    /// The models of the entries of the lcores at positions `on` as their
    /// checkpoints are taken (a replicated job's, each its own entry,
    /// served there at epoch 0).
    pub(super) fn checkpoint_tables_of(&mut self, on: &dyn Fn(usize) -> bool) {
        for (t, models) in self.tmodels.iter().enumerate() {
            for (g, m) in models.iter().enumerate() {
                if on(g) {
                    self.tmodel_checkpoint.insert((t, g), m.clone());
                }
            }
        }
    }

    /// The models of the entries of the lcores at positions `on` go back
    /// to their checkpoints with the engine (a replicated job's, each
    /// restored lcore serving its own entry again).
    pub(super) fn restore_tables_of(&mut self, on: &dyn Fn(usize) -> bool) {
        let back: Vec<(usize, usize)> = self
            .tmodel_checkpoint
            .keys()
            .copied()
            .filter(|&(_, g)| on(g))
            .collect();
        for (t, g) in back {
            let Some(mut m) = self.tmodel_checkpoint.remove(&(t, g)) else {
                continue;
            };
            m.clear_round();
            let key = super::table_key(self.case, t);
            m.cap_seen = self.lcores[g]
                .shard
                .row_cap_count(super::JOB, key)
                .map_or(0, |(_, _, evicted)| evicted);
            m.take_evicted_at_cap();
            self.tmodels[t][g] = m;
            if let Some(s) = self.served_by.get_mut(g) {
                *s = g;
            }
        }
    }

    /// The models go back to the checkpoint with the engine; a BSP round
    /// in progress is not saved (PROTOCOL.md §10.6).
    pub(super) fn restore_tables(&mut self) {
        self.restore_tables_of(&|_| true);
    }

    /// At the end: every (table, lcore) completed every round (BSP) or
    /// took every rank's every clock.
    pub(super) fn check_tables(&self) {
        if self.control.as_ref().is_some_and(|c| c.failed.is_some()) {
            // Control failed the job: its ranks stopped short.
            return;
        }
        let rounds = self.case.rounds;
        for (t, models) in self.tmodels.iter().enumerate() {
            for (g, m) in models.iter().enumerate() {
                if self.case.consistency == Consistency::Sync {
                    assert_eq!(m.completed, rounds, "table {t} lcore {g}: rounds completed");
                } else {
                    assert!(
                        m.applied.iter().all(|&a| a == rounds),
                        "table {t} lcore {g}: clocks {:?} at the end, not all {rounds}",
                        m.applied
                    );
                }
            }
        }
        for (i, r) in self.ranks.iter().enumerate() {
            if let Some(rt) = &r.rt {
                assert!(
                    !rt.busy(),
                    "rank {i}: a finished rank has table requests in flight"
                );
            }
        }
    }

    /// A table replication message lcore `l` handled with `verdict`
    /// (PROTOCOL.md §11.9): the last ACK of a round its entry waited for
    /// completes the round there, and in its model.
    pub(super) fn row_replica_taken(&mut self, l: usize, bytes: &[u8], verdict: Verdict) {
        if verdict != Verdict::Completed {
            return;
        }
        let Ok((r, _)) = phub_proto::replica_rows::parse(bytes) else {
            panic!("lcore {l}: a table replication message that does not parse completed a round");
        };
        let t = (r.key as usize)
            .checked_sub(self.case.keys.len())
            .filter(|&t| t < self.case.tables.len())
            .unwrap_or_else(|| panic!("lcore {l}: an ACK of key {}, no table of the case", r.key));
        if !self.serves(l, r.entry as usize) {
            self.check_fenced_round(l, r.entry as usize, r.key, r.round);
            return;
        }
        self.complete_model(l, r.entry as usize, t, r.key, r.round);
    }

    /// A fenced lcore `l` completed round `round` of entry `e`'s table key
    /// `key`: only a round every backup applied completes (PROTOCOL.md
    /// §11.9), so the entry's server holds it too (no split brain).
    fn check_fenced_round(&self, l: usize, e: usize, key: u32, round: u32) {
        let s = self.served_by[e];
        // Cast: lcores are few.
        #[allow(clippy::cast_possible_truncation)]
        let held = self.lcores[s]
            .shard
            .served_tables(super::JOB, e as u32)
            .and_then(|ts| ts.into_iter().find(|t| t.key == key))
            .map(|t| match t.rounds {
                phub_proto::table_checkpoint::TableRoundsState::Bsp { completed } => completed,
                phub_proto::table_checkpoint::TableRoundsState::Clocked { .. } => 0,
            });
        assert!(
            held.is_some_and(|c| c >= round),
            "lcore {l} completed round {round} of entry {e} (table key {key}), which lcore {s} serves at round \
             {held:?} (a split brain)"
        );
    }

    /// Whether lcore `l` serves entry `e`'s tables (always its own, but in
    /// a replicated job the lcore control's epoch has serve it).
    pub(super) fn serves(&self, l: usize, e: usize) -> bool {
        self.control.is_none() || self.served_by.get(e).is_none_or(|&s| s == l)
    }

    /// Lcore `l` took an epoch (PROTOCOL.md §11.9): a round of an entry it
    /// serves that the epoch completed (its last missing backups down), or
    /// that the backup tables it adopted had applied, completes in the
    /// model; an adopted entry's round in progress (taken at the dead
    /// primary, not applied here) is lost there, and the ranks send it
    /// again.
    pub(super) fn tables_after_epoch(&mut self, l: usize) {
        if self.case.tables.is_empty() {
            return;
        }
        for e in 0..self.tmodels.first().map_or(0, Vec::len) {
            // Cast: lcores are few.
            #[allow(clippy::cast_possible_truncation)]
            let Some(states) = self.lcores[l].shard.served_tables(super::JOB, e as u32) else {
                continue;
            };
            let adopted = self.served_by[e] != l;
            self.served_by[e] = l;
            self.outcome.tables_adopted += u64::from(adopted);
            for st in states {
                let t = (st.key as usize) - self.case.keys.len();
                let phub_proto::table_checkpoint::TableRoundsState::Bsp { completed } = st.rounds else {
                    panic!("lcore {l}: a replicated table that is not BSP");
                };
                let m = &mut self.tmodels[t][e];
                if completed == m.completed + 1 {
                    self.complete_model(l, e, t, st.key, completed);
                } else if adopted {
                    assert_eq!(
                        completed, m.completed,
                        "lcore {l}: entry {e} of table key {} adopted at round {completed}, the model at {}",
                        st.key, m.completed
                    );
                    m.clear_round();
                }
            }
        }
    }

    /// At the end of a replicated job with tables: every backup table a
    /// live lcore keeps is its entry's served table, bit for bit. Returns
    /// how many it checked.
    pub(super) fn check_backup_tables(&self) -> u64 {
        if self.control.as_ref().is_none_or(|c| c.failed.is_some()) || self.case.tables.is_empty() {
            // No replicas, or control failed the job (a part lost):
            // nothing is left to compare.
            return 0;
        }
        let mut checked = 0;
        for e in 0..self.served_by.len() {
            // Cast: lcores are few.
            #[allow(clippy::cast_possible_truncation)]
            let e32 = e as u32;
            let l = self.served_by[e];
            if self.lcores[l].down {
                continue;
            }
            let Some(primary) = self.lcores[l].shard.served_tables(super::JOB, e32) else {
                panic!("entry {e}: lcore {l} serves it no more");
            };
            // Lcores of appliances down in control's epoch are fenced
            // (cut off alive, or dead): their copies are behind.
            let down = |h: usize| {
                let a = h / usize::from(self.case.lcores);
                self.control.as_ref().is_some_and(|c| c.view.is_down(a))
            };
            // Lcores past the job's are a drained appliance's, kept until
            // evicted: fenced at their old epoch too.
            for (h, lc) in self
                .lcores
                .iter()
                .enumerate()
                .take(self.total_lcores())
                .filter(|(h, lc)| !lc.down && !down(*h))
            {
                if lc.shard.awaits_table_copy(super::JOB, e32) {
                    // An appliance back whose copy is still on its way
                    // (PROTOCOL.md §11.9 item 4): it holds no round yet.
                    continue;
                }
                if let Some(backup) = lc.shard.backup_tables(super::JOB, e32) {
                    assert!(
                        backup == primary,
                        "entry {e}: lcore {h}'s backup tables are not lcore {l}'s served ones"
                    );
                    checked += 1;
                }
            }
        }
        checked
    }
}
