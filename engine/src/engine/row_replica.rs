//! A replicated job's tables on one lcore (PROTOCOL.md §11.9): the BSP
//! rounds of this lcore's entry complete only once every backup of the
//! entry applied them, and the lcore may keep backup tables of other
//! appliances' entries, which apply their primaries' rounds.
//!
//! Invariants (on top of the tables' and the replicas'):
//! - A primary table whose ranks are all complete in round t keeps the
//!   round's accumulator, untouched, until every backup of its entry has
//!   acknowledged round t ([`RowPending`]): only then does the store apply
//!   it (the optimizer, in first-arrival order) and do the round's
//!   ROW_RESULTs and ROW_DONEs leave. Until then its fragments go again to
//!   the backups that have not acknowledged, on the replicas' timer.
//! - A backup table applies a round once it holds all of its fragments,
//!   with the store's own batched update over the same ids and rows in
//!   the same order and the primary's completion time, so its rows,
//!   optimizer state, admission counts and evictions are the primary's
//!   bits; it applies each round at most once, the next after its last,
//!   and acknowledges a copy of the last again.
//! - Table replication messages are taken only from the address of the
//!   lcore that sends them in the installed epoch, and only in that
//!   epoch.
//! - At an epoch change ([`Shard::apply_table_epoch`]) each entry served
//!   here keeps only its backups live in the new epoch (a round that
//!   waited only for down ones completes), and the backup tables of an
//!   entry whose part this appliance adopts are served from then on, at
//!   the round they applied; a new backup of an entry served here gets
//!   each table's state copy, then the rounds completed meanwhile, before
//!   it is counted (`table_copy.rs`), and a backup table
//!   whose entry's primary changed awaits the new primary's. An epoch that
//!   would have this lcore serve an entry whose copy is not here is
//!   refused as the part lost ([`Shard::check_table_epoch`]), before
//!   anything of it is applied. An index moved to another appliance (a
//!   drain) is one that came back: its lcores' new addresses are taken
//!   with the epoch, and its new appliance gets its copies.
//! - A checkpoint holds this lcore's own entry's tables alone
//!   ([`super::Job::checkpoint_tables`]); a restore copies them to their
//!   backups, which await them (`table_copy.rs`).
//! - Not built: async and bounded delay.

use phub_proto::failover::EpochView;
use phub_proto::replica_rows::{
    self, entry_backup, entry_parts, fragments_of, rows_per_fragment, RowReplicaPayload, RowReplicaRepr,
    RowReplicaType, RowsFragment,
};
use phub_proto::table_checkpoint::TableState;
use phub_proto::wire::{flags, DropReason, HEADER_LEN};

use super::error::EngineError;
use super::outbox::Pending;
use super::replica::Replica;
use super::rows::{answer_head, complete, Answers};
use super::table::{Table, TableInstall, TableRounds};
use super::table_copy::{copies_to, end_dropped_streams, CopyIn, CopyOut};
use super::{Job, Shard, Verdict};

/// A primary table's BSP round waiting for its backups' acknowledgements.
#[derive(Debug, Clone, Copy)]
pub(super) struct RowPending {
    /// The round; every rank is complete in it.
    pub(super) round: u32,
    /// The clock when its last rank completed: the time the round
    /// completes at, here and on every backup (eviction by `idle_s`).
    pub(super) at_ns: u64,
    /// Bit k: backup k has acknowledged it.
    pub(super) acked: u8,
    /// When it was first sent (caller's clock).
    pub(super) sent: u64,
    /// When to resend it.
    pub(super) deadline: u64,
    /// Resends so far.
    pub(super) resends: u8,
}

/// A round's fragments arriving at a backup table, until it holds them
/// all.
#[derive(Debug, Default)]
pub(super) struct Incoming {
    /// The round (0: none yet).
    round: u32,
    at_ns: u64,
    /// n, the round's fragment count.
    fragments: u32,
    /// Bit f: fragment f is in.
    got: Vec<u64>,
    held: u32,
    /// Rows in the last fragment, once it is in.
    last: usize,
    /// Fragment f's ids at `f * P ..`, its rows at `f * P * D ..`.
    ids: Vec<u64>,
    rows: Vec<f32>,
    /// One fragment's rows, decoded.
    scratch: Vec<f32>,
    /// The table awaits a state copy (PROTOCOL.md §11.9 item 4): it holds
    /// no round its primary's rounds can follow.
    pub(super) awaiting: bool,
    /// The copy arriving, while it awaits one.
    pub(super) copy: Option<Box<CopyIn>>,
    /// Its copy is installed, but the rounds applied since may not be
    /// every round its primary answered (it catches up on rounds with
    /// CATCH_UP): it may not serve the entry until it applies a round
    /// without (PROTOCOL.md §11.9 item 4).
    pub(super) behind: bool,
}

impl Incoming {
    /// A backup table's arrivals with nothing in yet, awaiting a copy or
    /// not.
    pub(super) fn awaiting(awaiting: bool) -> Incoming {
        Incoming {
            awaiting,
            ..Incoming::default()
        }
    }

    /// Forgets the round arriving (its fragments are sent again).
    pub(super) fn clear(&mut self) {
        self.round = 0;
        self.held = 0;
    }
}

/// An entry whose tables this lcore serves (its own, or one adopted when
/// its home went down), and the backups of the entry in the installed
/// epoch.
#[derive(Debug)]
pub(super) struct ServedEntry<A> {
    /// The entry's home appliance.
    pub(super) home: u16,
    /// The entry e.
    pub(super) entry: u32,
    /// Its backups in set order: each appliance and its lcore keeping the
    /// entry's backup tables.
    pub(super) backups: Vec<(u16, A)>,
    /// State copies to new backups not acknowledged whole yet, per
    /// (backup, table); such a backup gets no round of that table.
    pub(super) copies: Vec<CopyOut<A>>,
}

impl<A: Eq> ServedEntry<A> {
    /// Backup appliance `b`'s index among the entry's backups, when the
    /// lcore at `from` is the one keeping the entry there: a message from
    /// it (an ACK) is taken, else dropped `rank_out_of_range` (`b` is not
    /// a backup of the entry) or `wrong_peer` (another source).
    pub(super) fn backup_at(&self, b: u16, from: A) -> Result<usize, DropReason> {
        let k = self
            .backups
            .iter()
            .position(|x| x.0 == b)
            .ok_or(DropReason::RankOutOfRange)?;
        if self.backups[k].1 != from {
            return Err(DropReason::WrongPeer);
        }
        Ok(k)
    }
}

impl<A> ServedEntry<A> {
    /// Whether backup `b` still takes table `key`'s copy (or catches up
    /// after it): it is sent none of the table's rounds in progress.
    pub(super) fn copying(&self, b: u16, key: u32) -> bool {
        self.copies.iter().any(|c| c.backup == b && c.key == key)
    }

    /// Whether the table `key`'s rounds wait for backup `b`: it joined
    /// (no copy to it under way), or its copy is counted
    /// ([`CopyOut::counted`]).
    pub(super) fn waits_for(&self, b: u16, key: u32) -> bool {
        !self
            .copies
            .iter()
            .any(|c| c.backup == b && c.key == key && !c.counted)
    }

    /// Whether every backup that table `key`'s rounds wait for is in
    /// `acked` (bit k: backup k).
    pub(super) fn all_acked(&self, key: u32, acked: u8) -> bool {
        self.backups
            .iter()
            .enumerate()
            .all(|(k, b)| acked & (1 << k) != 0 || !self.waits_for(b.0, key))
    }
}

/// The backup tables of one entry of another appliance, on this lcore.
#[derive(Debug)]
pub(super) struct RowPart<A> {
    /// The entry's home appliance.
    pub(super) home: u16,
    /// The entry e (PROTOCOL.md §10.1).
    pub(super) entry: u32,
    /// Its primary's lcore in the installed epoch.
    pub(super) from: A,
    /// A table per table key of the job, in key order, each with the
    /// round arriving.
    pub(super) tables: Vec<(Table, Incoming)>,
}

/// A round's accumulated rows (ids in first-arrival order, their summed
/// rows) and its completion clock: what its REPLICATE_ROWS carry.
#[derive(Debug, Clone, Copy)]
pub(super) struct RoundRows<'a> {
    pub(super) dim: u32,
    pub(super) ids: &'a [u64],
    pub(super) rows: &'a [f32],
    pub(super) at_ns: u64,
}

impl<'a> RoundRows<'a> {
    /// The bytes its ids and rows take.
    pub(super) fn bytes(&self) -> usize {
        std::mem::size_of_val(self.ids) + std::mem::size_of_val(self.rows)
    }

    /// `table`'s round in progress (its accumulator), completing at
    /// `at_ns`; `None` for a table that is not BSP.
    pub(super) fn of(table: &'a Table, at_ns: u64) -> Option<RoundRows<'a>> {
        let TableRounds::Bsp(round) = &table.rounds else {
            return None;
        };
        Some(RoundRows {
            dim: table.dim,
            ids: &round.ids,
            rows: &round.rows[..round.ids.len() * table.dim as usize],
            at_ns,
        })
    }
}

/// Queues every fragment of round `r` to each backup in `to` (their
/// addresses), the bytes built once into `out`; returns how many.
pub(super) fn queue_fragments<A: Copy>(
    out: &mut Vec<u8>,
    pending: &mut Vec<Pending<A>>,
    head: RowReplicaRepr,
    r: RoundRows<'_>,
    to: impl Iterator<Item = A> + Clone,
) -> u64 {
    let d = r.dim as usize;
    let per = rows_per_fragment(r.dim);
    let Some(n) = fragments_of(r.ids.len(), r.dim) else {
        return 0;
    };
    for f in 0..n as usize {
        let ids = r
            .ids
            .get(f * per..((f + 1) * per).min(r.ids.len()))
            .unwrap_or(&[]);
        let rows = &r.rows[f * per * d..(f * per + ids.len()) * d];
        let at = out.len();
        // Casts: a fragment holds at most P < 2^16 rows; f < n, a u32.
        #[allow(clippy::cast_possible_truncation)]
        let h = RowReplicaRepr {
            count: ids.len() as u16,
            fragment: f as u32,
            ..head
        };
        out.extend_from_slice(&h.to_bytes());
        replica_rows::write_fragment(out, r.at_ns, n, r.dim, ids, rows);
        for a in to.clone() {
            // Casts: the row outbox holds a burst's messages, far below 4 GiB.
            #[allow(clippy::cast_possible_truncation)]
            pending.push(Pending::Row {
                at: at as u32,
                len: (out.len() - at) as u32,
                to: a,
            });
        }
    }
    u64::from(n) * to.count() as u64
}

impl<A> Replica<A> {
    /// Whether the job has tables here (served or backed up).
    pub(super) fn rows_replicated(&self) -> bool {
        !self.served.is_empty() || !self.row_parts.is_empty()
    }

    /// The earliest timer of the tables' state copies owed from here (0:
    /// one to start at the next poll; `u64::MAX`: none): whatever sets
    /// the replicas' timer from the dense slots keeps it.
    pub(super) fn copies_deadline(&self) -> u64 {
        self.served
            .iter()
            .flat_map(|s| &s.copies)
            .map(|c| c.deadline)
            .min()
            .unwrap_or(u64::MAX)
    }
}

impl<A: Copy> Replica<A> {
    /// The entry `entry` served here, if it is.
    pub(super) fn served(&self, entry: u32) -> Option<&ServedEntry<A>> {
        self.served.iter().find(|s| s.entry == entry)
    }
}

/// The header of `table`'s REPLICATE_ROWS of round `round` (`flags`: 0,
/// or RETRANSMIT) for job (`token`, `id`) `job`: sent in the name of the
/// entry's home (its backups keep its tables by it, PROTOCOL.md §11.9),
/// in the installed epoch; each fragment sets its count and index.
fn fragment_head<A: Copy>(
    rep: &Replica<A>,
    job: (u64, u16),
    table: &Table,
    round: u32,
    flags: u8,
) -> RowReplicaRepr {
    RowReplicaRepr {
        kind: RowReplicaType::Rows,
        flags,
        token: job.0,
        job: job.1,
        from: rep.served(table.entry()).map_or(rep.me, |s| s.home),
        count: 0,
        round,
        entry: table.entry(),
        key: table.key,
        fragment: 0,
        epoch: rep.view.epoch,
    }
}

/// Table `table` of job `j` has every rank complete in round `t` at `now`:
/// with backups, the round waits for them and its fragments are queued
/// (`true`); without, it completes at once (`false`).
pub(super) fn begin<A: Copy>(
    j_head: (u64, u16),
    rep: Option<&mut Replica<A>>,
    table: &mut Table,
    t: u32,
    now: u64,
    out: &mut Vec<u8>,
    pending: &mut Vec<Pending<A>>,
) -> bool {
    let Some(rep) = rep else {
        return false;
    };
    {
        let Some(r) = RoundRows::of(table, now) else {
            return false;
        };
        let Some(s) = rep.served.iter_mut().find(|s| s.entry == table.entry()) else {
            return false;
        };
        // Copies under way that do not hold the round up log it for their
        // backups' catch-up (PROTOCOL.md §11.9 item 4).
        for c in s.copies.iter_mut().filter(|c| c.key == table.key) {
            if c.log_round(t, r) {
                rep.stats.table_rounds_logged += 1;
            }
        }
        if !s.backups.iter().any(|b| s.waits_for(b.0, table.key)) {
            return false;
        }
    }
    debug_assert!(table.pending.is_none(), "a second round pending");
    let deadline = now.saturating_add(rep.rtt.rto(0));
    table.pending = Some(RowPending {
        round: t,
        at_ns: now,
        acked: 0,
        sent: now,
        deadline,
        resends: 0,
    });
    rep.next_deadline = rep.next_deadline.min(deadline);
    let head = fragment_head(rep, j_head, table, t, 0);
    let Some(s) = rep.served(table.entry()) else {
        return true;
    };
    // A backup still taking the table's state copy gets the round once it
    // joins (`table_copy.rs`).
    let to = s
        .backups
        .iter()
        .filter(|b| !s.copying(b.0, table.key))
        .map(|b| b.1);
    let Some(r) = RoundRows::of(table, now) else {
        return true;
    };
    let sent = queue_fragments(out, pending, head, r, to);
    rep.stats.replicates_sent += sent;
    true
}

impl<A: Copy + Eq> Shard<A> {
    /// Makes the backup tables of job `id`'s replicated part on this lcore
    /// from its `tables` (PROTOCOL.md §11.9): where this lcore's entry's
    /// backups are, and a table per key for each entry of another
    /// appliance this lcore backs up. Installed at epoch 0, or joined at
    /// the install's epoch (an appliance back, §11.7): then it serves no
    /// entry, and keeps its own entry's tables as backup tables too, every
    /// backup table awaiting its state copy. Refused (the caller removes
    /// the job) at any other epoch (an appliance moved, a restore: not
    /// built) or where this appliance would serve a part it holds no state
    /// of.
    pub(super) fn install_table_backups(
        &mut self,
        id: u16,
        tables: &[TableInstall],
    ) -> Result<(), EngineError> {
        let Some(first) = tables.first() else {
            return Ok(());
        };
        let j = self
            .jobs
            .iter_mut()
            .find(|j| j.id == id)
            .ok_or(EngineError::Table {
                id,
                key: first.key,
                reason: "the job is not installed".into(),
            })?;
        let (workers, dtype, consistency) = (j.workers, j.dtype, j.consistency);
        let Some(rep) = j.replica.as_deref_mut() else {
            return Ok(());
        };
        let refuse = |reason: String| EngineError::Table {
            id,
            key: first.key,
            reason,
        };
        let view = rep.view.clone();
        let me = usize::from(rep.me);
        let joined = view.epoch != 0 && view.joined_at(me) == Some(view.epoch);
        if view != EpochView::default() && !(joined && view.restored == 0) {
            return Err(refuse(format!(
                "epoch {}: a replicated job's tables are installed at epoch 0 or joined at the install's \
                 epoch only (restores of a replicated job's tables are not built, PROTOCOL.md §11.9)",
                view.epoch
            )));
        }
        let lcores: Vec<usize> = rep.addrs.iter().map(Vec::len).collect();
        let total: usize = lcores.iter().sum();
        if tables
            .iter()
            .any(|t| t.lcores as usize != total || t.entry != first.entry)
        {
            return Err(refuse(format!(
                "tables over {} lcores at entry {}: the job's appliances have {total} lcores",
                first.lcores, first.entry
            )));
        }
        // Each appliance's entries: its lcores, after the earlier ones'.
        let parts = entry_parts(&lcores);
        let mine = u64::from(first.entry);
        if !parts[me].range().contains(&mine) {
            return Err(refuse(format!(
                "entry {mine} is not one of appliance {me}'s lcores"
            )));
        }
        // Cast: below this appliance's lcore count, a usize.
        #[allow(clippy::cast_possible_truncation)]
        let j_me = (mine - parts[me].first) as usize;
        let mut row_parts = Vec::new();
        for (p, part) in parts.iter().enumerate() {
            let own = p == me;
            if (own && !joined) || !rep.layout.set(p).contains(&me) {
                continue;
            }
            for e in part.range() {
                if entry_backup(*part, lcores[me], e) != Some(j_me) {
                    continue;
                }
                // Cast: e < L, a u32 (the tables' `lcores`).
                #[allow(clippy::cast_possible_truncation)]
                let e = e as u32;
                let from = match entry_server(rep, p, e, &view) {
                    Some((q, a)) if q != me => a,
                    _ => {
                        return Err(refuse(format!(
                            "entry {e} of appliance {p} would be served here at epoch {}, which holds no \
                             state of it",
                            view.epoch
                        )))
                    }
                };
                let made = tables
                    .iter()
                    .map(|t| {
                        let backup = TableInstall {
                            entry: e,
                            ..t.clone()
                        };
                        Table::new(id, &backup, workers, dtype, consistency)
                            .map(|t| (t, Incoming::awaiting(joined)))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                // Cast: p < the appliance count, a u16 (the install's `me`).
                #[allow(clippy::cast_possible_truncation)]
                row_parts.push(RowPart {
                    home: p as u16,
                    entry: e,
                    from,
                    tables: made,
                });
            }
        }
        if joined {
            // Its own entry is served elsewhere until an epoch gives it
            // back (adoption, §11.6 rule 3): kept as a backup table above.
            j.tables.retain(|t| u64::from(t.entry()) != mine);
            rep.served = Vec::new();
        } else {
            // Cast: the entry is below L, a u32 (checked against the tables').
            #[allow(clippy::cast_possible_truncation)]
            let own = ServedEntry {
                home: rep.me,
                entry: mine as u32,
                backups: entry_backups_in(rep, me, mine as u32, &view),
                copies: Vec::new(),
            };
            rep.served = vec![own];
        }
        rep.row_parts = row_parts;
        Ok(())
    }

    /// A table replication message (PROTOCOL.md §11.9). Refusals are
    /// counted, never answered: the sender is an appliance.
    pub(super) fn row_replica_message(&mut self, from: A, datagram: &[u8], now: u64) -> Verdict {
        let (repr, fragment) = match replica_rows::parse(datagram) {
            Ok(p) => p,
            Err(r) => return Verdict::Dropped(r),
        };
        let Some(i) = self.jobs.iter().position(|j| j.id == repr.job) else {
            return Verdict::Dropped(DropReason::UnknownJob);
        };
        if self.jobs[i].token != repr.token {
            return Verdict::Dropped(DropReason::BadToken);
        }
        if self.closing {
            return Verdict::Dropped(DropReason::ShuttingDown);
        }
        let Some(rep) = self.jobs[i].replica.as_deref_mut() else {
            return Verdict::Dropped(DropReason::WrongPeer);
        };
        if repr.epoch != rep.view.epoch {
            rep.stats.wrong_epoch += 1;
            return Verdict::Dropped(DropReason::WrongEpoch);
        }
        match (repr.kind, fragment) {
            (RowReplicaType::Rows, RowReplicaPayload::Rows(f)) => self.on_rows(i, from, &repr, &f),
            (RowReplicaType::RowsAck, RowReplicaPayload::None) => self.on_rows_ack(i, from, &repr, now),
            (RowReplicaType::TableState, RowReplicaPayload::State(f)) => {
                self.on_table_state(i, from, &repr, &f)
            }
            (RowReplicaType::TableStateAck, RowReplicaPayload::None) => {
                self.on_table_state_ack(i, from, &repr)
            }
            _ => Verdict::Dropped(DropReason::LengthMismatch),
        }
    }

    /// A primary's fragment at a backup table: taken, and the round applied
    /// once whole (an ACK queued), or acknowledged again for the last
    /// round applied, else refused.
    fn on_rows(&mut self, i: usize, from: A, repr: &RowReplicaRepr, f: &RowsFragment<'_>) -> Verdict {
        let Shard {
            jobs,
            pending,
            rows_out,
            counters,
            ..
        } = self;
        let j = &mut jobs[i];
        let (token, id) = (j.token, j.id);
        let rep = j.replica.as_deref_mut().expect("checked by the caller");
        let (me, epoch) = (rep.me, rep.view.epoch);
        let (table, inc) = match backup_table(&mut rep.row_parts, from, repr, f.dim) {
            Ok(t) => t,
            Err(r) => return Verdict::Dropped(r),
        };
        if inc.awaiting {
            // No round to follow until its state copy is in (§11.9 item 4).
            return Verdict::Dropped(DropReason::Ahead);
        }
        let applied = match take_fragment(table, inc, repr, f) {
            Ok(applied) => applied,
            Err(r) => return Verdict::Dropped(r),
        };
        if applied.is_some() && repr.flags & flags::CATCH_UP == 0 {
            // A round its primary waited for (or the primary's confirmation
            // that the catch-up is over): every round answered is here.
            inc.behind = false;
        }
        // The ACK of a catch-up round says so (PROTOCOL.md §11.9 item 4):
        // its primary tells it from the confirmation's of the same round.
        let ack = RowReplicaRepr {
            kind: RowReplicaType::RowsAck,
            flags: repr.flags & flags::CATCH_UP,
            token,
            job: id,
            from: me,
            count: 0,
            round: repr.round,
            entry: repr.entry,
            key: repr.key,
            fragment: 0,
            epoch,
        };
        match applied {
            Some(true) => {
                rep.stats.rounds_applied += 1;
                rep.stats.acks_sent += 1;
                counters.replicate_acks_sent.inc();
            }
            Some(false) => {
                rep.stats.acks_resent += 1;
                counters.replicate_acks_resent.inc();
            }
            None => return Verdict::Replicated,
        }
        queue_ack(rows_out, pending, &ack, from);
        Verdict::Replicated
    }

    /// A backup's ACK at a primary table: counted, and when it was the
    /// last the round waited for, the round completes and its answers
    /// are queued.
    fn on_rows_ack(&mut self, i: usize, from: A, repr: &RowReplicaRepr, now: u64) -> Verdict {
        let j = &mut self.jobs[i];
        let rep = j.replica.as_deref_mut().expect("checked by the caller");
        let Some(served) = rep.served(repr.entry) else {
            return Verdict::Dropped(DropReason::WrongPeer);
        };
        let k = match served.backup_at(repr.from, from) {
            Ok(k) => k,
            Err(r) => return Verdict::Dropped(r),
        };
        if served.copying(repr.from, repr.key) {
            // A backup catching up after its copy: the ACK of a round
            // logged for it (`table_copy.rs`).
            return self.on_catch_up_ack(i, k, repr);
        }
        let Some(t) = j
            .tables
            .iter()
            .position(|t| t.key == repr.key && t.entry() == repr.entry)
        else {
            return Verdict::Dropped(DropReason::UnknownTable);
        };
        let table = &mut j.tables[t];
        let completed = match &table.rounds {
            TableRounds::Bsp(r) => r.completed,
            TableRounds::Clocked { .. } => return Verdict::Dropped(DropReason::WrongPeer),
        };
        let Some(p) = table.pending.as_mut().filter(|p| p.round == repr.round) else {
            return Verdict::Dropped(if repr.round <= completed {
                DropReason::Stale
            } else {
                DropReason::Ahead
            });
        };
        if p.acked & (1 << k) != 0 {
            return Verdict::Dropped(DropReason::Duplicate);
        }
        p.acked |= 1 << k;
        let acked = p.acked;
        if !rep
            .served(repr.entry)
            .is_some_and(|s| s.all_acked(repr.key, acked))
        {
            return Verdict::Replicated;
        }
        if p.resends == 0 {
            rep.rtt.sample(now.saturating_sub(p.sent));
        }
        self.complete_pending(i, t);
        Verdict::Completed
    }

    /// Resends the fragments of the table rounds whose backups have not
    /// all acknowledged in time, within `budget` messages; returns what is
    /// left of it and the earliest deadline after.
    pub(super) fn poll_row_replicas(&mut self, i: usize, now: u64, mut budget: usize) -> (usize, u64) {
        let Shard {
            jobs,
            pending,
            rows_out,
            counters,
            ..
        } = self;
        let j = &mut jobs[i];
        let mut next = u64::MAX;
        let Some(rep) = j.replica.as_deref_mut() else {
            return (budget, next);
        };
        if !rep.rows_replicated() {
            return (budget, next);
        }
        let mut timed_out = false;
        for t in &mut j.tables {
            let Some(mut p) = t.pending else {
                continue;
            };
            let acked = p.acked;
            let Some(s) = rep.served.iter().find(|s| s.entry == t.entry()) else {
                continue;
            };
            let key = t.key;
            let to = s
                .backups
                .iter()
                .enumerate()
                .filter(move |(k, b)| acked & (1 << k) == 0 && !s.copying(b.0, key))
                .map(|(_, b)| b.1);
            let Some(r) = RoundRows::of(t, p.at_ns) else {
                continue;
            };
            let n = fragments_of(r.ids.len(), t.dim).unwrap_or(1) as usize * to.clone().count();
            if p.deadline <= now && budget >= n {
                budget -= n;
                p.deadline = rep.rtt.fire(&mut timed_out, &mut p.resends, now);
                let head = fragment_head(rep, (j.token, j.id), t, p.round, flags::RETRANSMIT);
                let sent = queue_fragments(rows_out, pending, head, r, to);
                rep.stats.replicates_resent += sent;
                for _ in 0..sent {
                    counters.replicates_resent.inc();
                }
                t.pending = Some(p);
            }
            next = next.min(p.deadline);
        }
        let (budget, copies) = self.poll_table_copies(i, now, budget);
        (budget, next.min(copies))
    }

    /// The durable state of the backup tables this lcore keeps of entry
    /// `entry` of job `id`, in key order, as [`Shard::snapshot_tables`]
    /// gives a primary's: what a test compares bit for bit. `None` when it
    /// keeps none.
    pub fn backup_tables(&self, id: u16, entry: u32) -> Option<Vec<TableState>> {
        let rep = self.job(id)?.replica.as_deref()?;
        let part = rep.row_parts.iter().find(|p| p.entry == entry)?;
        Some(part.tables.iter().map(|(t, _)| t.save()).collect())
    }

    /// Whether a backup table this lcore keeps of entry `entry` of job
    /// `id` awaits its state copy (PROTOCOL.md §11.9 item 4): it holds no
    /// round of its primary yet, or catches up after it.
    pub fn awaits_table_copy(&self, id: u16, entry: u32) -> bool {
        self.job(id)
            .and_then(|j| j.replica.as_deref())
            .and_then(|rep| rep.row_parts.iter().find(|p| p.entry == entry))
            .is_some_and(|p| p.tables.iter().any(|(_, inc)| inc.awaiting || inc.behind))
    }
}

/// The backup table a replication message `repr` from `from` is for, of
/// `dim` values a row: dropped `wrong_peer` when this lcore keeps no
/// backup tables of the entry or `from` is not its primary's lcore,
/// `unknown_table`, `dim_mismatch` (PROTOCOL.md §11.9's checks).
pub(super) fn backup_table<'a, A: Copy + Eq>(
    row_parts: &'a mut [RowPart<A>],
    from: A,
    repr: &RowReplicaRepr,
    dim: u32,
) -> Result<(&'a mut Table, &'a mut Incoming), DropReason> {
    let part = row_parts
        .iter_mut()
        .find(|p| p.home == repr.from && p.entry == repr.entry)
        .filter(|p| p.from == from)
        .ok_or(DropReason::WrongPeer)?;
    let (table, inc) = part
        .tables
        .iter_mut()
        .find(|(t, _)| t.key == repr.key)
        .ok_or(DropReason::UnknownTable)?;
    if dim != table.dim {
        return Err(DropReason::DimMismatch);
    }
    Ok((table, inc))
}

/// Queues `ack` (a header alone) to `to`.
pub(super) fn queue_ack<A>(out: &mut Vec<u8>, pending: &mut Vec<Pending<A>>, ack: &RowReplicaRepr, to: A) {
    let at = out.len();
    out.extend_from_slice(&ack.to_bytes());
    // Cast: the row outbox holds a burst's messages, far below 4 GiB.
    #[allow(clippy::cast_possible_truncation)]
    pending.push(Pending::Row {
        at: at as u32,
        len: HEADER_LEN as u32,
        to,
    });
}

/// Takes fragment `f` of round `repr.round` at backup table `table`:
/// `Some(true)` when it completed the round and the round was applied,
/// `Some(false)` for a copy of the last round applied (acknowledged
/// again), `None` when taken and more are awaited.
fn take_fragment(
    table: &mut Table,
    inc: &mut Incoming,
    repr: &RowReplicaRepr,
    f: &RowsFragment<'_>,
) -> Result<Option<bool>, DropReason> {
    let completed = match &table.rounds {
        TableRounds::Bsp(bsp) => bsp.completed,
        TableRounds::Clocked { .. } => return Err(DropReason::WrongPeer),
    };
    let t = repr.round;
    if t == completed {
        return Ok(Some(false));
    }
    if Some(t) != completed.checked_add(1) {
        return Err(if t < completed {
            DropReason::Stale
        } else {
            DropReason::Ahead
        });
    }
    let per = rows_per_fragment(table.dim);
    let n = f.fragments;
    let last = repr.fragment + 1 == n;
    let count = f.len();
    if repr.fragment >= n || count > per || (!last && count != per) || (last && n > 1 && count == 0) {
        return Err(DropReason::CountMismatch);
    }
    if inc.round != t {
        inc.round = t;
        inc.at_ns = f.at_ns;
        inc.fragments = n;
        inc.got.clear();
        inc.got.resize((n as usize).div_ceil(64), 0);
        inc.held = 0;
        inc.last = 0;
        inc.ids.clear();
        inc.rows.clear();
    } else if inc.fragments != n || inc.at_ns != f.at_ns {
        // Another copy of the round with another shape: not the round
        // the fragments taken belong to.
        return Err(DropReason::CountMismatch);
    }
    let fi = repr.fragment as usize;
    if inc.got[fi / 64] & (1 << (fi % 64)) != 0 {
        return Err(DropReason::Duplicate);
    }
    if !f.ids().all(|id| table.holds(id)) {
        return Err(DropReason::RowOutOfPlace);
    }
    let d = table.dim as usize;
    let end = fi * per + count;
    if inc.ids.len() < end {
        inc.ids.resize(end, 0);
        inc.rows.resize(end * d, 0.0);
    }
    for (k, id) in f.ids().enumerate() {
        inc.ids[fi * per + k] = id;
    }
    f.rows_into(&mut inc.scratch);
    inc.rows[fi * per * d..end * d].copy_from_slice(&inc.scratch);
    inc.got[fi / 64] |= 1 << (fi % 64);
    inc.held += 1;
    if last {
        inc.last = count;
    }
    if inc.held < n {
        return Ok(None);
    }
    let total = (n as usize - 1) * per + inc.last;
    // The primary's completion (`rows::complete`): the same batched update
    // over the same rows in the same order, at the same time.
    table
        .store
        .update_batch(&inc.ids[..total], &inc.rows[..total * d]);
    table.store.advance_round_at(inc.at_ns);
    if let TableRounds::Bsp(bsp) = &mut table.rounds {
        bsp.completed = t;
    }
    inc.round = 0;
    Ok(Some(true))
}

/// Entry `entry` of home `p`'s backups in `view`: each live member of
/// p's set after its first (PROTOCOL.md §11.6), with its lcore keeping
/// the entry's backup tables.
fn entry_backups_in<A: Copy>(rep: &Replica<A>, p: usize, entry: u32, view: &EpochView) -> Vec<(u16, A)> {
    let lcores: Vec<usize> = rep.addrs.iter().map(Vec::len).collect();
    let parts = entry_parts(&lcores);
    rep.layout.set_in(p, view)[1..]
        .iter()
        .filter_map(|&b| {
            let l = entry_backup(parts[p], lcores[b], u64::from(entry))?;
            // Cast: b < the appliance count, a u16 (the install's `me`).
            #[allow(clippy::cast_possible_truncation)]
            Some((b as u16, rep.addrs[b][l]))
        })
        .collect()
}

/// Where entry `entry` of home `p` is served in `view` (PROTOCOL.md §11.9
/// failover item 2): the part's primary there and its lcore keeping the
/// entry (the home's own lcore where the home serves it). `None` when no
/// member of p's set is live.
fn entry_server<A: Copy>(rep: &Replica<A>, p: usize, entry: u32, view: &EpochView) -> Option<(usize, A)> {
    let q = rep.layout.primary(p, view)?;
    let lcores: Vec<usize> = rep.addrs.iter().map(Vec::len).collect();
    let parts = entry_parts(&lcores);
    let l = entry_backup(parts[p], lcores[q], u64::from(entry))?;
    Some((q, *rep.addrs[q].get(l)?))
}

impl<A: Copy + Eq> Shard<A> {
    /// Queues job `i`'s table `t`'s pending round to the backup at `to`
    /// alone (one that has just joined the entry's chain).
    pub(super) fn send_pending_to(&mut self, i: usize, t: usize, to: A) {
        let Shard {
            jobs,
            pending,
            rows_out,
            ..
        } = self;
        let j = &mut jobs[i];
        let Some(rep) = j.replica.as_deref_mut() else {
            return;
        };
        let table = &j.tables[t];
        let Some(p) = table.pending else {
            return;
        };
        let head = fragment_head(rep, (j.token, j.id), table, p.round, 0);
        let Some(r) = RoundRows::of(table, p.at_ns) else {
            return;
        };
        let sent = queue_fragments(rows_out, pending, head, r, std::iter::once(to));
        rep.stats.replicates_sent += sent;
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// Whether this lcore can take `view` for job `i`'s tables (PROTOCOL.md
    /// §11.9), before anything of it is applied: refused as the part lost
    /// where this lcore would serve an
    /// entry whose backup tables await their state copy, or may be behind
    /// (it skipped an epoch in which another member may have served it),
    /// or where no member of an entry's part is live.
    pub(super) fn check_table_epoch(&self, i: usize, view: &EpochView) -> Result<(), EngineError> {
        let j = &self.jobs[i];
        let Some(rep) = j.replica.as_deref() else {
            return Ok(());
        };
        if !rep.rows_replicated() {
            return Ok(());
        }
        let old = &rep.view;
        let me = usize::from(rep.me);
        let lost = |part: usize, why: &'static str| EngineError::PartLost {
            id: j.id,
            epoch: view.epoch,
            part,
            why,
        };
        for part in &rep.row_parts {
            let p = usize::from(part.home);
            match rep.layout.primary(p, view) {
                None => return Err(lost(p, "with no live member to serve its table entries")),
                Some(q) if q != me => continue,
                Some(_) => {}
            }
            if part.tables.iter().any(|(_, inc)| inc.awaiting || inc.behind) {
                return Err(lost(p, "whose table state copy is not all here"));
            }
            let skipped = view.epoch > old.epoch + 1;
            let gone_before = rep
                .layout
                .set_in(p, old)
                .into_iter()
                .take_while(|&a| a != me)
                .filter(|&a| view.is_down(a))
                .count();
            if skipped && gone_before >= 2 {
                return Err(lost(
                    p,
                    "whose table copy here may be behind: this lcore skipped an epoch in which another \
                     member may have served it",
                ));
            }
        }
        Ok(())
    }

    /// Applies `view` (checked by [`Shard::check_table_epoch`], the
    /// dense part applied) to job `i`'s tables, coming from `old`: the
    /// backup tables of each entry whose home's part this appliance adopts
    /// become served tables at the round they applied (a round whose
    /// fragments were not all in is dropped: its ranks send it again);
    /// each served entry gets its backups in the new epoch (a round that
    /// waited only for backups now down completes, its answers queued),
    /// and each new one a state copy of every table of the entry; backup
    /// tables whose entry's primary changed await the new primary's copy.
    pub(super) fn apply_table_epoch(&mut self, i: usize, old: &EpochView, view: &EpochView) {
        {
            let j = &mut self.jobs[i];
            let Some(rep) = j.replica.as_deref_mut() else {
                return;
            };
            if !rep.rows_replicated() {
                return;
            }
            let me = usize::from(rep.me);
            // Adopted entries: their backup tables are served from now on.
            let (adopt, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut rep.row_parts)
                .into_iter()
                .partition(|p| rep.layout.primary(usize::from(p.home), view) == Some(me));
            rep.row_parts = keep;
            for part in adopt {
                rep.stats.slots_adopted += part.tables.len() as u64;
                rep.served.push(ServedEntry {
                    home: part.home,
                    entry: part.entry,
                    backups: Vec::new(),
                    copies: Vec::new(),
                });
                j.tables.extend(part.tables.into_iter().map(|(t, _)| t));
            }
            j.tables.sort_by_key(|t| (t.key, t.entry()));
            // Backup tables whose entry's primary changed: from the new
            // one, which copies its state to them first.
            let servers: Vec<Option<(usize, A)>> = rep
                .row_parts
                .iter()
                .map(|p| entry_server(rep, usize::from(p.home), p.entry, view))
                .collect();
            for (part, server) in rep.row_parts.iter_mut().zip(servers) {
                let Some((q, at)) = server else {
                    continue;
                };
                if rep.layout.primary(usize::from(part.home), old) != Some(q) {
                    for (_, inc) in &mut part.tables {
                        *inc = Incoming::awaiting(true);
                    }
                }
                part.from = at;
            }
            // Every served entry's backups now, acknowledgements kept by
            // appliance for those that are not new.
            let backups: Vec<Vec<(u16, A)>> = rep
                .served
                .iter()
                .map(|s| entry_backups_in(rep, usize::from(s.home), s.entry, view))
                .collect();
            let mut copying = false;
            for (s, now) in rep.served.iter_mut().zip(backups) {
                // New: not a backup before, or back since `old`.
                let is_new = |b: u16| {
                    !s.backups.iter().any(|(x, _)| *x == b)
                        || view.joined_at(usize::from(b)).is_some_and(|e| e > old.epoch)
                };
                let new: Vec<(u16, A)> = now.iter().copied().filter(|b| is_new(b.0)).collect();
                for t in j.tables.iter_mut().filter(|t| t.entry() == s.entry) {
                    if let Some(p) = t.pending.as_mut() {
                        let mut acked = 0u8;
                        for (k, (b, _)) in now.iter().enumerate() {
                            if is_new(*b) {
                                continue;
                            }
                            if let Some(o) = s.backups.iter().position(|(x, _)| x == b) {
                                acked |= ((p.acked >> o) & 1) << k;
                            }
                        }
                        p.acked = acked;
                    }
                }
                let keep = |c: &CopyOut<A>| {
                    now.iter().any(|b| b.0 == c.backup) && !new.iter().any(|b| b.0 == c.backup)
                };
                end_dropped_streams(&s.copies, &mut j.tables, s.entry, keep);
                s.copies.retain(keep);
                let started = copies_to(&mut j.tables, s.entry, &new);
                copying |= !started.is_empty();
                s.copies.extend(started);
                s.backups = now;
            }
            // The epoch change set the replicas' timer from the dense
            // slots alone: the tables' rounds still waiting and their
            // copies under way keep theirs, and new copies start theirs at
            // the next poll.
            let tables = j
                .tables
                .iter()
                .filter_map(|t| t.pending)
                .map(|p| p.deadline)
                .min();
            rep.next_deadline = rep
                .next_deadline
                .min(tables.unwrap_or(u64::MAX))
                .min(rep.copies_deadline());
            if copying {
                rep.next_deadline = 0;
            }
        }
        self.send_copy_windows(i);
        // Rounds no backup still owes complete now.
        let released: Vec<usize> = {
            let j = &self.jobs[i];
            let rep = j.replica.as_deref().expect("checked above");
            j.tables
                .iter()
                .enumerate()
                .filter(|(_, t)| {
                    t.pending
                        .is_some_and(|p| rep.served(t.entry()).is_none_or(|s| s.all_acked(t.key, p.acked)))
                })
                .map(|(k, _)| k)
                .collect()
        };
        for k in released {
            if let Some(rep) = self.jobs[i].replica.as_deref_mut() {
                rep.stats.rounds_released += 1;
            }
            self.complete_pending(i, k);
        }
    }

    /// Completes job `i`'s table `k`'s pending round, every backup of its
    /// entry having it: the optimizer at the recorded clock, the ranks'
    /// answers queued (PROTOCOL.md §11.9 rule 2).
    pub(super) fn complete_pending(&mut self, i: usize, k: usize) {
        let share = self.rx_share(&self.jobs[i]);
        let Shard {
            jobs,
            pending,
            rows_out,
            answers_out,
            counters,
            ..
        } = self;
        let Job {
            tables,
            replica,
            endpoints,
            counters: job_counters,
            dtype,
            token,
            id,
            ..
        } = &mut jobs[i];
        let table = &mut tables[k];
        let Some(p) = table.pending.take() else {
            return;
        };
        let (entry, epoch) = (table.entry(), replica.as_deref().map_or(0, |r| r.view.epoch));
        if let Some(rep) = replica.as_deref_mut() {
            rep.stats.rounds_replicated += 1;
        }
        counters.rounds_replicated.inc();
        counters.rounds_completed.inc();
        job_counters.rounds += 1;
        let mut answers = Answers {
            out: rows_out,
            answers: answers_out,
            pending,
            counters,
            endpoints,
            head: answer_head(*dtype, *token, *id, table),
            share,
            // The time the round's last rank completed: the backups took
            // the round at it too.
            now: p.at_ns,
            entry,
            epoch,
        };
        complete(table, p.round, &mut answers);
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// The durable state of the tables this lcore serves for entry `entry`
    /// of job `id` (its own, or one adopted), in key order. `None` when it
    /// serves none.
    pub fn served_tables(&self, id: u16, entry: u32) -> Option<Vec<TableState>> {
        let j = self.job(id)?;
        let t: Vec<TableState> = j
            .tables
            .iter()
            .filter(|t| t.entry() == entry)
            .map(Table::save)
            .collect();
        (!t.is_empty()).then_some(t)
    }
}
