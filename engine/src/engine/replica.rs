//! A replicated job's part on one lcore (PROTOCOL.md §11): its slots are
//! the primary slots of their chunks, whose rounds complete only once
//! every backup holds them, and it may keep backup slots of other
//! appliances' chunks, which apply the primaries' aggregates.
//!
//! Invariants (on top of the engine's):
//! - A primary slot whose W contributions to round r are in holds their sum
//!   in its accumulator, untouched, until every backup of the chunk has
//!   acknowledged round r: only then does the optimizer run, the stored
//!   result change and a RESULT of round r leave (§11.4 rule 2). Until
//!   then it resends the aggregate to the backups that have not
//!   acknowledged it, on its timer, never giving up while installed.
//! - A backup slot applies a round's aggregate with the same code as the
//!   primary ([`Slot::complete`], the job's optimizer, W and round), so
//!   its parameters, optimizer state and stored result are the primary's
//!   bits; it applies each round at most once, the next after its last
//!   completed, and answers a copy of the last with its ACK again.
//! - Replication messages are taken only from the address of the lcore
//!   that sends them in the installed epoch (a token alone, which workers
//!   hold, never speaks for an appliance), and only in that epoch.
//! - A new backup of a chunk (PROTOCOL.md §11.7) is counted at once: no
//!   round of the chunk completes before it installed the chunk's state
//!   copy and acknowledged the round; no aggregate goes to it before its
//!   copy is acknowledged ([`super::copy`]).
//! - An async or bounded-delay job's primary slots send each update
//!   instead of a round's aggregate once round 0 completed
//!   ([`super::clock_replica`]).
//! - No shared-memory regions, no hierarchy.

use std::net::{Ipv4Addr, SocketAddrV4};

use phub_proto::api::CopyProgress;
use phub_proto::failover::{EpochView, ReplicaLayout};
use phub_proto::layout::{ChunkRange, Chunks, SlotChunk};
use phub_proto::memory::{ResultStore, BACKUP_FILL_BYTES, PEER_LCORE_BYTES, REPLICA_RECORD_BYTES};
use phub_proto::replica::{self, ReplicaMsgType, ReplicaRepr, MAX_REPLICAS};
use phub_proto::spec::{Consistency, JobSpec, Optimizer};
use phub_proto::wire::{DropReason, Header, HEADER_LEN, MAX_PAYLOAD};
use phub_proto::Dtype;

use crate::counters::ShardCounters;
use crate::kernels::Kernels;
use crate::slotmem::SlotBlock;
use crate::transmit::{Transmit, MAX_BURST};

use super::clock::RankClock;
use super::clock_replica::{unacked, Updates};
use super::copy::{Fill, Where};
use super::error::EngineError;
use super::hier::home_done;
use super::hier::Rtt;
use super::install::JobInstall;
use super::outbox::{Attempt, Pending, Ranks};
use super::slot::{RankSet, Round, Slot};
use super::{round_done, Job, Shard, Verdict};

/// What an lcore is told of a replicated job beside its primary slots (the
/// [`JobInstall`]'s slots).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaInstall {
    /// The job layout's epoch (PROTOCOL.md §11.5), with who is down and
    /// who came back (§11.7): an appliance the view names joined at its
    /// epoch is installed empty, every part it is a member of (its own
    /// too) kept as backup slots awaiting a copy.
    pub view: EpochView,
    /// This appliance's index in the job's appliance list.
    pub me: u16,
    /// Sequence number of this lcore's primary slot 0.
    pub first: u64,
    /// Per appliance of the job, in layout order: its lcores' data
    /// addresses, in lcore order.
    pub appliances: Vec<Vec<SocketAddrV4>>,
    /// The job's layout over every appliance's lcores (appliance 0's
    /// first), as §4.1 writes it.
    pub runs: Vec<ChunkRange>,
    /// Per appliance: its rack label (all equal: one rack).
    pub racks: Vec<String>,
    /// Appliances holding each chunk, 1 to [`MAX_REPLICAS`].
    pub replicas: u8,
    /// The backup slots this lcore keeps, per part it backs up: in the
    /// order of extended slot numbers (its own part first where it keeps
    /// it as a backup, then the others by home).
    pub backups: Vec<BackupInstall>,
}

/// The backup slots of one part (one appliance's chunks) on one lcore.
#[derive(Debug, Clone, PartialEq)]
pub struct BackupInstall {
    /// The part's home appliance (its primary at admission).
    pub primary: u16,
    /// Sequence number of backup slot 0.
    pub first: u64,
    /// The chunks, in slot order.
    pub slots: Vec<SlotChunk>,
}

/// A primary slot's aggregate waiting for its backups' acknowledgements.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pushed {
    /// The round it belongs to; none when none is waiting.
    pub(super) round: Round,
    /// Bit k: backup k has acknowledged it.
    pub(super) acked: u8,
    /// Bit k: backup k is new and has not acknowledged the slot's state
    /// copy yet (PROTOCOL.md §11.7); it gets no aggregate before.
    pub(super) copying: u8,
    /// When it was first sent (caller's clock).
    pub(super) sent: u64,
    /// When to resend it (and the state copies); 0: a state copy queued
    /// by an epoch change, which has no clock, whose timer the next poll
    /// arms.
    pub(super) deadline: u64,
    /// Resends so far.
    pub(super) resends: u8,
}

impl Default for Pushed {
    fn default() -> Pushed {
        Pushed {
            round: Round::NONE,
            acked: 0,
            copying: 0,
            sent: 0,
            deadline: u64::MAX,
            resends: 0,
        }
    }
}

impl Pushed {
    /// Whether the slot waits for anything of its backups: an aggregate's
    /// ACKs or a state copy's.
    pub(super) fn waiting(&self) -> bool {
        !self.round.is_none() || self.copying != 0
    }
}

// What MemoryModel::replica_lcore_bytes charges per primary slot.
const _: () = assert!(std::mem::size_of::<Pushed>() as u64 <= REPLICA_RECORD_BYTES);

/// One part (an appliance's chunks), backed up on this lcore.
#[derive(Debug)]
pub(super) struct Part<A> {
    /// The part's home appliance.
    pub(super) home: u16,
    /// Sequence number of backup slot 0.
    pub(super) first: u64,
    /// The extended slot number of backup slot 0 on this lcore (PROTOCOL.md
    /// §11.6): the job's slot index it takes if the part is adopted.
    pub(super) base: u32,
    /// The part's primary in the installed epoch.
    pub(super) from: u16,
    /// Where that primary's lcores hold the chunks (its slot numbers).
    pub(super) at: Where<A>,
    pub(super) slots: Vec<Slot>,
    pub(super) blocks: Vec<Box<dyn SlotBlock>>,
    /// Per slot, while some slot awaits a state copy (§11.7); empty when
    /// every slot holds its chunk's state.
    pub(super) fill: Vec<Fill>,
    /// An async or bounded-delay job's: per slot, its ranks' clocks (slot
    /// × W + rank), as the primary's (§11.10); empty for BSP.
    pub(super) clocks: Vec<RankClock>,
}

impl<A> Part<A> {
    /// Whether backup slot `slot` holds its chunk's state (no copy
    /// awaited).
    pub(super) fn holds(&self, slot: usize) -> bool {
        self.fill.get(slot).is_none_or(|f| *f == Fill::Held)
    }
}

/// A part served on this lcore (its own, or one adopted): its slots are
/// a run of the job's, and its live backups get their aggregates.
#[derive(Debug)]
pub(super) struct Group<A> {
    /// The part's home appliance.
    pub(super) home: u16,
    /// The job's slot index of its first chunk here.
    pub(super) base: u32,
    /// Sequence number of that chunk.
    pub(super) first: u64,
    /// Its slots here.
    pub(super) count: u32,
    /// Its backups in this epoch, in set order (PROTOCOL.md §11.7): each
    /// appliance and where its lcores keep the chunks.
    pub(super) backups: Vec<(u16, Where<A>)>,
}

impl<A: Copy> Group<A> {
    /// Whether the job's slot `slot` is one of this group's.
    pub(super) fn has(&self, slot: u32) -> bool {
        (self.base..self.base + self.count).contains(&slot)
    }

    /// Where backup `k` keeps the chunk of the job's slot `slot`.
    pub(super) fn backup_of(&self, k: usize, slot: u32) -> Option<(A, u32)> {
        let seq = self.first + u64::from(slot.checked_sub(self.base)?);
        self.backups.get(k)?.1.place(seq)
    }
}

/// What a job's replication did on this lcore.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaStats {
    /// REPLICATEs sent the first time.
    pub replicates_sent: u64,
    /// REPLICATEs resent on a timer.
    pub replicates_resent: u64,
    /// REPLICATE_ACKs sent for a round applied here.
    pub acks_sent: u64,
    /// REPLICATE_ACKs sent again, for a copy of a round applied before.
    pub acks_resent: u64,
    /// Rounds a primary slot completed once every backup acknowledged.
    pub rounds_replicated: u64,
    /// Rounds a backup slot applied.
    pub rounds_applied: u64,
    /// Replication messages of another epoch (`wrong_epoch`).
    pub wrong_epoch: u64,
    /// Worker messages of another epoch, answered with an ERROR
    /// `wrong_epoch` (PROTOCOL.md §11.6).
    pub worker_wrong_epoch: u64,
    /// Epoch changes applied here ([`Shard::change_epoch`]).
    pub epoch_changes: u64,
    /// Pending aggregates completed by an epoch change, which took their
    /// last missing backups out of the chunk's set.
    pub rounds_released: u64,
    /// Backup slots adopted as primary slots (their home is down).
    pub slots_adopted: u64,
    /// REPLICATE_STATE fragments sent the first time (PROTOCOL.md §11.7).
    pub states_sent: u64,
    /// REPLICATE_STATE fragments resent on a timer.
    pub states_resent: u64,
    /// REPLICATE_STATE fragments taken at a backup slot awaiting a copy.
    pub states_received: u64,
    /// State copies installed whole at a backup slot.
    pub states_installed: u64,
    /// REPLICATE_STATE_ACKs sent (again too, for a copy installed before).
    pub state_acks_sent: u64,
    /// New backups that joined a chunk's chain (their copy acknowledged).
    pub backups_joined: u64,
    /// Payload bytes of the REPLICATE_STATE fragments taken
    /// (`states_received`), and of the REPLICATE_TABLE_STATE fragments'
    /// copy streams (`table_states_received`).
    pub state_bytes_received: u64,
    /// REPLICATE_TABLE_STATE fragments sent the first time (PROTOCOL.md
    /// §11.9 item 4).
    pub table_states_sent: u64,
    /// REPLICATE_TABLE_STATE fragments resent on a timer.
    pub table_states_resent: u64,
    /// REPLICATE_TABLE_STATE fragments taken at a backup table awaiting a
    /// copy (copies of one held counted too).
    pub table_states_received: u64,
    /// Table state copies installed whole at a backup table.
    pub table_states_installed: u64,
    /// REPLICATE_TABLE_STATE_ACKs sent.
    pub table_state_acks_sent: u64,
    /// New backups that joined a table entry's chain (their copy of the
    /// table installed, the rounds completed meanwhile caught up and the
    /// confirmation acknowledged), per table.
    pub table_backups_joined: u64,
    /// Table rounds that completed without a new backup taking its copy,
    /// logged for its catch-up (per round and backup).
    pub table_rounds_logged: u64,
}

/// A replicated job's state on one lcore.
#[derive(Debug)]
pub(super) struct Replica<A> {
    /// The installed epoch (its number is `view.epoch`).
    pub(super) view: EpochView,
    pub(super) me: u16,
    /// The job's layout, rack labels and replica count: replica sets,
    /// parts and where each appliance keeps each chunk (§11.1, §11.6).
    pub(super) layout: ReplicaLayout<String>,
    /// Per appliance of the job: its lcores' addresses.
    pub(super) addrs: Vec<Vec<A>>,
    /// The parts served here, in the order of their slots in the job's.
    pub(super) groups: Vec<Group<A>>,
    /// Per primary slot (the job's slots).
    pub(super) pushed: Vec<Pushed>,
    /// The earliest deadline of `pushed` (u64::MAX: none).
    pub(super) next_deadline: u64,
    pub(super) rtt: Rtt,
    /// The parts backed up here, in the order of extended slot numbers
    /// (its own part first where this appliance came back, then the others
    /// by home); a part adopted in an epoch change leaves for the job's
    /// slots.
    pub(super) parts: Vec<Part<A>>,
    /// The table entries served here (PROTOCOL.md §11.9: its own, and
    /// those adopted) with their backups; empty for a job without tables.
    pub(super) served: Vec<super::row_replica::ServedEntry<A>>,
    /// The backup tables this lcore keeps of other appliances' entries.
    pub(super) row_parts: Vec<super::row_replica::RowPart<A>>,
    /// An async or bounded-delay job's (PROTOCOL.md §11.10).
    pub(super) clocked: bool,
    /// Such a job's, per primary slot: its updates on their way to its
    /// backups; empty for BSP.
    pub(super) updates: Vec<Updates>,
    /// Per primary slot and rank (slot × W + rank): the update its answer
    /// waits for, 0 for none; empty for BSP.
    pub(super) waits: Vec<u32>,
    /// Log buffers not in use, and how many were made (at most
    /// [`phub_proto::memory::UPDATE_LOG_BUFFERS`]), each of
    /// `update_elems` `f32`s.
    pub(super) spare: Vec<Box<[f32]>>,
    pub(super) buffers: usize,
    /// The log buffers admission reserves for this lcore, made or not
    /// (`MemoryModel::replica_lcore_bytes`: one per update in flight, at
    /// most W per slot, primary or backup, and at most
    /// [`phub_proto::memory::UPDATE_LOG_BUFFERS`]); what the job's memory
    /// counts until more are made.
    pub(super) reserved_buffers: usize,
    pub(super) update_elems: u32,
    pub(super) stats: ReplicaStats,
}

impl<A: Copy> Replica<A> {
    /// Primary slot `slot` has all its contributions to `round`: its
    /// aggregate is to go to every backup before the round completes
    /// (PROTOCOL.md §11.4). False when the chunk has no backup (the round
    /// completes at once).
    pub(super) fn begin(&mut self, slot: u32, round: u32, now: u64) -> bool {
        if self.group_of(slot).is_none_or(|g| g.backups.is_empty()) {
            return false;
        }
        let Some(p) = self.pushed.get_mut(slot as usize) else {
            return false;
        };
        debug_assert!(p.round.is_none(), "a second aggregate while one is pending");
        *p = Pushed {
            round: Round::new(round),
            acked: 0,
            copying: p.copying,
            sent: now,
            deadline: now.saturating_add(self.rtt.rto(0)),
            resends: 0,
        };
        self.next_deadline = self.next_deadline.min(p.deadline);
        true
    }

    /// The layout's epoch this lcore has installed.
    pub(super) fn epoch(&self) -> u32 {
        self.view.epoch
    }

    /// Its state copies (PROTOCOL.md §11.7): backup slots awaiting one,
    /// copies owed to new backups, bytes taken.
    pub(super) fn copy_progress(&self) -> CopyProgress {
        CopyProgress {
            epoch: self.view.epoch,
            awaiting: self
                .parts
                .iter()
                .map(|p| p.fill.iter().filter(|f| **f != Fill::Held).count() as u64)
                .sum::<u64>()
                + self
                    .row_parts
                    .iter()
                    .map(|p| {
                        p.tables
                            .iter()
                            .filter(|(_, inc)| inc.awaiting || inc.behind)
                            .count() as u64
                    })
                    .sum::<u64>(),
            owed: self
                .pushed
                .iter()
                .map(|p| u64::from(p.copying.count_ones()))
                .sum::<u64>()
                + self.served.iter().map(|s| s.copies.len() as u64).sum::<u64>(),
            bytes_received: self.stats.state_bytes_received,
        }
    }

    /// The part served here that job slot `slot` belongs to.
    pub(super) fn group_of(&self, slot: u32) -> Option<&Group<A>> {
        self.groups.iter().find(|g| g.has(slot))
    }

    /// Counts a worker's message of another epoch.
    pub(super) fn count_worker_wrong_epoch(&mut self) {
        self.stats.worker_wrong_epoch += 1;
    }

    /// Forgets every pending aggregate (after a restore, whose slots have
    /// no round in progress); state copies still owed stay owed, their
    /// timers armed at the next poll.
    pub(super) fn clear_pending(&mut self) {
        self.clear_updates();
        for p in &mut self.pushed {
            *p = Pushed {
                copying: p.copying,
                deadline: if p.copying != 0 { 0 } else { u64::MAX },
                ..Pushed::default()
            };
        }
        self.next_deadline = if self.pushed.iter().any(|p| p.copying != 0) {
            0
        } else {
            self.copies_deadline()
        };
    }

    /// Where backup `k` of slot `slot`'s part keeps its chunk.
    pub(super) fn backup_of(&self, k: usize, slot: u32) -> Option<(A, u32)> {
        self.group_of(slot)?.backup_of(k, slot)
    }

    /// Bytes this holds beside the job's own slots, as
    /// [`phub_proto::memory::MemoryModel::replica_lcore_bytes`] charges
    /// them: the backup slots' buffers, block overheads (`block_overhead`
    /// each) and records, a pending-aggregate record per primary slot and
    /// every peer lcore's run and address; and its backup tables, as their
    /// primaries' (`MemoryModel::replica_cost` charges them, PROTOCOL.md
    /// §11.9). A table state copy's stream, held while it runs, is not
    /// counted.
    pub(super) fn memory_bytes(&self, block_overhead: u64) -> u64 {
        let parts: u64 = self
            .parts
            .iter()
            .map(|p| {
                let data: u64 = p.blocks.iter().map(|b| 4 * b.as_slice().len() as u64).sum();
                data + p.blocks.len() as u64 * block_overhead
                    + (p.slots.len() * std::mem::size_of::<Slot>()) as u64
                    // Its record of each slot's copy, whether one is
                    // awaited now or not (admission charges it).
                    + p.slots.len() as u64 * BACKUP_FILL_BYTES
                    + (p.clocks.len() * std::mem::size_of::<RankClock>()) as u64
            })
            .sum();
        let peers: usize = self
            .groups
            .iter()
            .flat_map(|g| &g.backups)
            .map(|(_, p)| p.addrs.len())
            .sum::<usize>()
            + self.parts.iter().map(|p| p.at.addrs.len()).sum::<usize>();
        // Backup tables (PROTOCOL.md §11.9), charged as primary tables.
        let tables: u64 = self
            .row_parts
            .iter()
            .flat_map(|p| &p.tables)
            .map(|(t, _)| t.memory_bytes())
            .sum();
        parts
            + tables
            + self.updates_bytes(self.update_elems)
            + self.pushed.len() as u64 * REPLICA_RECORD_BYTES
            + peers as u64 * PEER_LCORE_BYTES
    }

    /// Whether all `n` backups are in `acked` (bits at and above `n` are
    /// never set).
    pub(super) fn all(n: usize, acked: u8) -> bool {
        u32::from(acked).count_ones() as usize == n
    }
}

/// Checks a replicated job's install and makes what each of appliance
/// `me`'s lcores is told: its [`JobInstall`] slots (the chunks of its runs)
/// and its [`ReplicaInstall`]. `appliances[i]` is appliance i's data
/// address and base port and `lcores[i]` its lcore count; `runs` the job's
/// layout over all of them (PROTOCOL.md §4.1). In `epoch` with nobody
/// down ([`replica_plan_at`] for any view).
pub fn replica_plan(
    spec: &JobSpec,
    runs: &[ChunkRange],
    appliances: &[(Ipv4Addr, u16, u16)],
    racks: &[String],
    me: u16,
    epoch: u32,
) -> Result<Vec<(Vec<SlotChunk>, ReplicaInstall)>, String> {
    let view = EpochView {
        epoch,
        ..EpochView::default()
    };
    replica_plan_at(spec, runs, appliances, racks, me, &view)
}

/// [`replica_plan`] in epoch `view`. An appliance the view names joined
/// at its epoch (it came back, PROTOCOL.md §11.7) gets no primary slots:
/// its own part is among its backup slots, first, at its own slot numbers.
pub fn replica_plan_at(
    spec: &JobSpec,
    runs: &[ChunkRange],
    appliances: &[(Ipv4Addr, u16, u16)],
    racks: &[String],
    me: u16,
    view: &EpochView,
) -> Result<Vec<(Vec<SlotChunk>, ReplicaInstall)>, String> {
    let n = appliances.len();
    view.check(n)?;
    let back = view.joined_at(usize::from(me)) == Some(view.epoch);
    let r = spec.replicas();
    if racks.len() != n || usize::from(me) >= n || r == 0 || r > n || r > usize::from(MAX_REPLICAS) {
        return Err(format!(
            "{r} replicas, appliance {me}, {} rack labels, over {n} appliances",
            racks.len()
        ));
    }
    let total: usize = appliances.iter().map(|a| usize::from(a.2)).sum();
    if total != runs.len() {
        return Err(format!("{} runs for {total} lcores", runs.len()));
    }
    let addrs: Vec<Vec<SocketAddrV4>> = appliances
        .iter()
        .map(|&(ip, base, l)| {
            (0..l)
                .map(|j| base.checked_add(j).map(|p| SocketAddrV4::new(ip, p)))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| format!("{ip}: lcore ports above {base} overflow"))
        })
        .collect::<Result<_, _>>()?;
    let mut at = 0;
    let mut parts = Vec::with_capacity(n);
    for a in appliances {
        let own = &runs[at..at + usize::from(a.2)];
        at += usize::from(a.2);
        let first = own.first().map_or(0, |r| r.first);
        parts.push(ChunkRange {
            first,
            count: own.iter().map(|r| r.count).sum(),
        });
    }
    let chunks = Chunks::new(spec);
    let mine: usize = appliances[..usize::from(me)]
        .iter()
        .map(|a| usize::from(a.2))
        .sum();
    let lcores = usize::from(appliances[usize::from(me)].2);
    // Cast: r <= MAX_REPLICAS (checked above).
    #[allow(clippy::cast_possible_truncation)]
    let replicas = r as u8;
    Ok((0..lcores)
        .map(|j| {
            let run = runs[mine + j];
            // Came back: its own part is kept as backup slots, first.
            let own = back.then(|| BackupInstall {
                primary: me,
                first: run.first,
                slots: chunks.iter(run.range()).collect(),
            });
            let backups = own
                .into_iter()
                .chain(
                    (0..n)
                        .filter(|&p| {
                            p != usize::from(me)
                                && replica::replica_set(racks, p, r).contains(&usize::from(me))
                        })
                        .map(|p| {
                            let b = replica::backup_runs(parts[p], lcores)[j];
                            // Cast: p < n, the appliance count, which fits a u16.
                            #[allow(clippy::cast_possible_truncation)]
                            BackupInstall {
                                primary: p as u16,
                                first: b.first,
                                slots: chunks.iter(b.range()).collect(),
                            }
                        }),
                )
                .collect();
            let own_slots = if back {
                Vec::new()
            } else {
                chunks.iter(run.range()).collect()
            };
            (
                own_slots,
                ReplicaInstall {
                    view: view.clone(),
                    me,
                    first: run.first,
                    appliances: addrs.clone(),
                    runs: runs.to_vec(),
                    racks: racks.to_vec(),
                    replicas,
                    backups,
                },
            )
        })
        .collect())
}

impl<A: Copy + Eq> Shard<A> {
    /// Installs a replicated job's part on this lcore (PROTOCOL.md §11):
    /// `job`'s slots are its primary slots, `rep` says where the backups
    /// of its chunks are and which backup slots this lcore keeps. Whole or
    /// refused, as [`Shard::install`] ([`super::InstallKind::Replicated`]).
    pub(super) fn install_replicated(
        &mut self,
        job: JobInstall,
        rep: ReplicaInstall,
    ) -> Result<(), EngineError> {
        let replica = self.replica_for(&job, &job.slots, &job.optimizer, rep)?;
        let nbackups = replica.groups.first().map_or(0, |g| g.backups.len());
        self.install_with(job, None)?;
        self.reserve_replication(nbackups);
        let j = self.jobs.last_mut().expect("installed just now");
        j.replica = Some(Box::new(replica));
        Ok(())
    }

    /// Room for what a replicated part queues: a completed round queues a
    /// REPLICATE per backup; a burst of REPLICATEs from as many primaries'
    /// lcores queues at most one REPLICATE_ACK header and one further
    /// acknowledgement each.
    pub(super) fn reserve_replication(&mut self, nbackups: usize) {
        self.pending.reserve(nbackups * MAX_BURST);
        self.acks_out
            .reserve((HEADER_LEN + replica::ACK_ENTRY_LEN) * MAX_BURST);
    }

    /// Checks a replicated part's install and makes its replication state:
    /// `own` are the primary slots it serves (a flat job's slots; a
    /// hierarchical job's home slots, PROTOCOL.md §11.11), whose chunks'
    /// backups `rep` names, and the backup slots it keeps, allocated here
    /// with `optimizer`'s state.
    pub(super) fn replica_for(
        &self,
        job: &JobInstall,
        own: &[SlotChunk],
        optimizer: &Optimizer,
        rep: ReplicaInstall,
    ) -> Result<Replica<A>, EngineError> {
        let id = job.id;
        let refuse = |reason: String| EngineError::Replica { id, reason };
        let Some(resolve) = self.peers.0.clone() else {
            return Err(refuse(
                "this backend does not send to other appliances (kernel UDP does)".into(),
            ));
        };
        let clocked = job.consistency != Consistency::Sync;
        let n = rep.appliances.len();
        let r = usize::from(rep.replicas);
        if rep.racks.len() != n || usize::from(rep.me) >= n || r == 0 || r > n || rep.replicas > MAX_REPLICAS
        {
            return Err(refuse(format!(
                "{r} replicas, appliance {}, {} rack labels, over {n} appliances",
                rep.me,
                rep.racks.len()
            )));
        }
        if rep.appliances.iter().map(Vec::len).sum::<usize>() != rep.runs.len() {
            return Err(refuse(format!(
                "{} runs for the appliances' lcores",
                rep.runs.len()
            )));
        }
        let resolved = rep
            .appliances
            .iter()
            .map(|l| {
                l.iter()
                    .map(|&a| resolve(a).ok_or_else(|| format!("this backend cannot address appliance {a}")))
                    .collect::<Result<Vec<A>, String>>()
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(refuse)?;
        let lcores: Vec<usize> = rep.appliances.iter().map(Vec::len).collect();
        let layout = ReplicaLayout::new(rep.runs.clone(), &lcores, rep.racks.clone(), r).map_err(refuse)?;
        let view = rep.view.clone();
        view.check(n).map_err(refuse)?;
        let me = usize::from(rep.me);
        if view.is_down(me) {
            return Err(refuse(format!(
                "epoch {} names this appliance ({me}) down",
                view.epoch
            )));
        }
        let back = view.joined_at(me) == Some(view.epoch);
        // Cast: MAX_PAYLOAD is below 9000 (asserted in phub_proto::wire).
        #[allow(clippy::cast_possible_truncation)]
        let max = ((MAX_PAYLOAD / 4) as u32).min(job.chunk_elems);
        if let Some(c) = own
            .iter()
            .chain(rep.backups.iter().flat_map(|b| &b.slots))
            .find(|c| c.elems == 0 || c.elems > max)
        {
            return Err(refuse(format!(
                "a slot of {} elements; an aggregate carries 1..={max} f32s",
                c.elems
            )));
        }
        if back && !own.is_empty() {
            return Err(refuse(format!(
                "{} primary slots: an appliance that came back at epoch {} serves nothing until it is \
                 a part's primary (PROTOCOL.md §11.7)",
                own.len(),
                view.epoch
            )));
        }
        let mut parts = Vec::with_capacity(rep.backups.len());
        // Extended slot numbers: the backed-up parts' slots follow this
        // lcore's own, part after part (an appliance back has no own
        // slots: its own part is its first backed-up one).
        let mut next_base = own.len();
        for b in &rep.backups {
            let p = usize::from(b.primary);
            if p >= n || (p == me && !back) || !layout.set(p).contains(&me) {
                return Err(refuse(format!(
                    "backup slots of appliance {p}, whose replica set {me} is not in"
                )));
            }
            let Some(q) = layout.primary(p, &view).filter(|&q| q != me) else {
                return Err(refuse(format!(
                    "epoch {} would have this appliance serve appliance {p}'s part at install: \
                     an install takes no part over (PROTOCOL.md §11.7)",
                    view.epoch
                )));
            };
            let (slots, blocks) = self
                .alloc_slots(&b.slots, job.dtype, optimizer, job.chunk_elems, ResultStore::Slot)
                .map_err(|reason| EngineError::SlotMemory {
                    id,
                    bytes: b
                        .slots
                        .iter()
                        .map(|c| 4 * Slot::block_len(c.elems, job.dtype, optimizer, ResultStore::Slot) as u64)
                        .sum(),
                    slots: b.slots.len(),
                    from: self.mem.describe(),
                    reason,
                })?;
            let clocks = if clocked {
                vec![RankClock::default(); slots.len() * usize::from(job.workers)]
            } else {
                Vec::new()
            };
            // Came back empty: every slot awaits its copy (§11.7).
            let fill = if back {
                vec![Fill::awaiting(); slots.len()]
            } else {
                Vec::new()
            };
            // Cast: the job's slots and the parts' fit a u32 (the layout
            // numbers slots by u32).
            #[allow(clippy::cast_possible_truncation)]
            let base = next_base as u32;
            next_base += slots.len();
            parts.push(Part {
                home: b.primary,
                first: b.first,
                base,
                // Cast: q < n, whose indices the install's u16 `me` spans.
                #[allow(clippy::cast_possible_truncation)]
                from: q as u16,
                at: Where::of_primary(&layout, &resolved, p, q),
                slots,
                blocks,
                fill,
                clocks,
            });
        }
        let nslots = own.len();
        let workers = usize::from(job.workers);
        let update_elems = job.chunk_elems;
        let backup_slots: usize = parts.iter().map(|p| p.slots.len()).sum();
        let reserved_buffers = if clocked {
            (workers * (nslots + backup_slots)).min(phub_proto::memory::UPDATE_LOG_BUFFERS)
        } else {
            0
        };
        // This appliance's own part, when it serves it.
        let groups = if back {
            Vec::new()
        } else {
            if layout.primary(me, &view) != Some(me) {
                return Err(refuse(format!(
                    "epoch {} has another appliance serve this one's part: an install takes \
                     nothing over and gives nothing away",
                    view.epoch
                )));
            }
            let backups = layout.set_in(me, &view)[1..]
                .iter()
                .map(|&b| {
                    // Cast: b < n, whose indices the install's u16 `me` spans.
                    #[allow(clippy::cast_possible_truncation)]
                    (b as u16, Where::of_backup(&layout, &resolved, me, b))
                })
                .collect::<Vec<_>>();
            // Cast: the job's slots fit a u32 (install_with checks).
            #[allow(clippy::cast_possible_truncation)]
            let count = nslots as u32;
            vec![Group {
                home: rep.me,
                base: 0,
                first: rep.first,
                count,
                backups,
            }]
        };
        Ok(Replica {
            view,
            me: rep.me,
            layout,
            addrs: resolved,
            groups,
            pushed: vec![Pushed::default(); nslots],
            next_deadline: u64::MAX,
            rtt: Rtt::default(),
            parts,
            served: Vec::new(),
            row_parts: Vec::new(),
            clocked,
            updates: if clocked {
                std::iter::repeat_with(Updates::default).take(nslots).collect()
            } else {
                Vec::new()
            },
            waits: if clocked {
                vec![0; nslots * workers]
            } else {
                Vec::new()
            },
            spare: Vec::new(),
            buffers: 0,
            reserved_buffers,
            update_elems,
            stats: ReplicaStats::default(),
        })
    }

    /// What job `id`'s replication did on this lcore (None: not replicated
    /// here).
    pub fn replica_stats(&self, id: u16) -> Option<ReplicaStats> {
        Some(self.job(id)?.replica.as_ref()?.stats)
    }

    /// A backup slot's last completed round and its parameters (`f32`,
    /// with a server-side optimizer) and optimizer state, by the chunk's
    /// sequence number `seq` in the job: what a test compares with the
    /// primary's bit for bit.
    pub fn backup_state(&self, id: u16, seq: u64) -> Option<BackupState<'_>> {
        let j = self.job(id)?;
        let rep = j.replica.as_ref()?;
        let part = rep
            .parts
            .iter()
            .find(|p| (p.first..p.first + p.slots.len() as u64).contains(&seq))?;
        let slot = u32::try_from(seq - part.first).ok()?;
        let s = &part.slots[slot as usize];
        let w = usize::from(j.workers);
        let i = slot as usize;
        Some(BackupState {
            // A slot awaiting its state copy holds no round (§11.7).
            round: s.completed.get().filter(|_| part.holds(slot as usize)),
            result: s.result_bytes(slot, None, &part.blocks),
            state: s.mem.all(&part.blocks)[super::slot::PARAMS..=super::slot::S2].to_vec(),
            clocks: part
                .clocks
                .get(i * w..(i + 1) * w)
                .map_or_else(Vec::new, |c| c.iter().map(|c| c.clock).collect()),
        })
    }

    /// A primary slot's parameters and optimizer state, as
    /// [`Shard::backup_state`] gives a backup's.
    pub fn primary_state(&self, id: u16, slot: u32) -> Option<BackupState<'_>> {
        let j = self.job(id)?;
        let (slots, blocks) = j.primaries();
        let s = slots.get(slot as usize)?;
        let (w, i) = (usize::from(j.workers), slot as usize);
        Some(BackupState {
            round: s.completed.get(),
            result: s.result_bytes(slot, j.shm.as_ref(), blocks),
            state: s.mem.all(blocks)[super::slot::PARAMS..=super::slot::S2].to_vec(),
            clocks: j
                .clocks
                .get(i * w..(i + 1) * w)
                .map_or_else(Vec::new, |c| c.iter().map(|c| c.clock).collect()),
        })
    }

    /// Queues the first REPLICATE of `slot`'s aggregate to each backup
    /// (a new backup still owing its copy's ACK gets it once that comes,
    /// PROTOCOL.md §11.7).
    pub(super) fn queue_replicates(
        pending: &mut Vec<Pending<A>>,
        counters: &ShardCounters,
        j: &mut Job<A>,
        slot: u32,
    ) -> Verdict {
        let Some(rep) = j.replica.as_deref_mut() else {
            return Verdict::Aggregated;
        };
        let nb = rep.group_of(slot).map_or(0, |g| g.backups.len());
        let copying = rep.pushed.get(slot as usize).map_or(0, |p| p.copying);
        for k in (0..nb).filter(|&k| copying & (1 << k) == 0) {
            rep.stats.replicates_sent += 1;
            counters.replicates_sent.inc();
            // Cast: at most MAX_REPLICAS - 1 backups.
            #[allow(clippy::cast_possible_truncation)]
            pending.push(Pending::Replicate {
                job: j.id,
                slot,
                backup: k as u8,
                attempt: Attempt::First,
            });
        }
        Verdict::Forwarded
    }

    /// A replication message (PROTOCOL.md §11.4, §11.7). Refusals are
    /// counted, never answered: the sender is an appliance.
    pub(super) fn replica_message(&mut self, from: A, datagram: &[u8], now: u64) -> Verdict {
        let (repr, payload) = match replica::parse(datagram) {
            Ok(p) => p,
            Err(r) => return Verdict::Dropped(r),
        };
        let Some(i) = self.jobs.iter().position(|j| j.id == repr.job) else {
            return Verdict::Dropped(if self.was_evicted(repr.job, repr.token, now) {
                DropReason::Evicted
            } else {
                DropReason::UnknownJob
            });
        };
        if self.jobs[i].token != repr.token {
            return Verdict::Dropped(DropReason::BadToken);
        }
        if self.closing {
            return Verdict::Dropped(DropReason::ShuttingDown);
        }
        let job = &mut self.jobs[i];
        let Some(rep) = job.replica.as_deref_mut() else {
            return Verdict::Dropped(DropReason::WrongPeer);
        };
        if repr.epoch != rep.view.epoch {
            rep.stats.wrong_epoch += 1;
            return Verdict::Dropped(DropReason::WrongEpoch);
        }
        match repr.kind {
            ReplicaMsgType::Replicate => {
                let h = Header::new_unchecked(datagram);
                let update = (h.update_rank(), h.update_clock());
                match Self::on_replicate(&self.kernels, job, from, &repr, update, payload, now) {
                    Ok(fresh) => {
                        let rep = job.replica.as_deref_mut().expect("checked above");
                        if fresh {
                            rep.stats.acks_sent += 1;
                            rep.stats.rounds_applied += 1;
                            self.counters.replicate_acks_sent.inc();
                        } else {
                            rep.stats.acks_resent += 1;
                            self.counters.replicate_acks_resent.inc();
                        }
                        if let Some((to, ack)) =
                            Self::ack_of(job, repr.from, repr.slot, ReplicaMsgType::ReplicateAck, |_, s| {
                                s.completed.get()
                            })
                        {
                            queue_ack(&mut self.pending, &mut self.acks_out, job.id, to, &ack);
                        }
                        Verdict::Replicated
                    }
                    Err(r) => Verdict::Dropped(r),
                }
            }
            ReplicaMsgType::ReplicateAck => {
                // The header's acknowledgement, then the payload's: the
                // message is handled if any of them is, and otherwise
                // dropped for the first one's reason.
                let mut verdict: Option<Verdict> = None;
                let further = replica::acks(payload).map(|a| (a, false));
                for ((slot, round), head) in std::iter::once(((repr.slot, repr.round), true)).chain(further) {
                    // The primary slot acknowledged: its chunk, and whether
                    // it completed a round (an async or bounded-delay
                    // slot's past round 0 takes updates).
                    let held = job
                        .primaries()
                        .0
                        .get(slot as usize)
                        .map(|s| (s.key, s.chunk, s.completed.get().is_some()));
                    // A further acknowledgement names no key or chunk: the
                    // slot's own stand in for the header's check.
                    let (key, chunk) = match held {
                        Some((key, chunk, _)) if !head => (key, chunk),
                        _ => (repr.key, repr.chunk),
                    };
                    let one = ReplicaRepr {
                        slot,
                        round,
                        key,
                        chunk,
                        ..repr
                    };
                    let clocked = job.replica.as_deref().is_some_and(Replica::clocked)
                        && held.is_some_and(|(_, _, completed)| completed);
                    if clocked {
                        // An update's acknowledgement (PROTOCOL.md §11.10).
                        let v = match Self::backup_index(job, from, &one).and_then(|k| {
                            Self::on_update_ack(&mut self.pending, &self.counters, job, k, &one, now)
                        }) {
                            Ok(()) => Verdict::Replicated,
                            Err(r) => Verdict::Dropped(r),
                        };
                        verdict = match verdict {
                            None | Some(Verdict::Dropped(_)) => Some(v),
                            kept => kept,
                        };
                        continue;
                    }
                    let v = match Self::on_ack(job, from, &one, now) {
                        Ok(true) => {
                            self.counters.rounds_completed.inc();
                            self.counters.rounds_replicated.inc();
                            if job.hier.is_some() {
                                // A home slot's round: its result to every
                                // rack (PROTOCOL.md §11.11).
                                home_done(&mut self.pending, &self.counters, job, slot)
                            } else {
                                round_done(&mut self.pending, &self.counters, job, slot)
                            }
                        }
                        Ok(false) => Verdict::Replicated,
                        Err(r) => Verdict::Dropped(r),
                    };
                    verdict = match verdict {
                        None | Some(Verdict::Dropped(_)) => Some(v),
                        kept => kept,
                    };
                }
                verdict.unwrap_or(Verdict::Dropped(DropReason::LengthMismatch))
            }
            ReplicaMsgType::ReplicateState => {
                match Self::on_state(&self.kernels, job, from, &repr, payload) {
                    Ok(ack) => {
                        if ack {
                            let rep = job.replica.as_deref_mut().expect("checked above");
                            rep.stats.state_acks_sent += 1;
                            self.pending.push(Pending::StateAck {
                                job: job.id,
                                home: repr.from,
                                slot: repr.slot,
                            });
                        }
                        Verdict::Replicated
                    }
                    Err(r) => Verdict::Dropped(r),
                }
            }
            ReplicaMsgType::StateAck => match Self::on_state_ack(job, from, &repr) {
                Ok(replicate) => {
                    if job.replica.as_deref().is_some_and(Replica::clocked) {
                        // The answers that waited for the new backup too.
                        Self::settle(&mut self.pending, &self.counters, job, repr.slot);
                    }
                    if let Some(k) = replicate {
                        let rep = job.replica.as_deref_mut().expect("checked above");
                        rep.stats.replicates_sent += 1;
                        self.counters.replicates_sent.inc();
                        self.pending.push(Pending::Replicate {
                            job: job.id,
                            slot: repr.slot,
                            backup: k,
                            attempt: Attempt::First,
                        });
                    }
                    Verdict::Replicated
                }
                Err(r) => Verdict::Dropped(r),
            },
        }
    }

    /// Checks a message from the part's primary to one of its backup
    /// slots (REPLICATE, REPLICATE_STATE): the part of home `repr.from`,
    /// the slot, its chunk, and the sender's address. Gives the part's
    /// index here.
    pub(super) fn backup_slot_of(rep: &Replica<A>, from: A, repr: &ReplicaRepr) -> Result<usize, DropReason> {
        let k = rep
            .parts
            .iter()
            .position(|p| p.home == repr.from)
            .ok_or(DropReason::WrongPeer)?;
        let part = &rep.parts[k];
        let slot = part
            .slots
            .get(repr.slot as usize)
            .ok_or(DropReason::SlotOutOfRange)?;
        if repr.key != slot.key || repr.chunk != slot.chunk {
            return Err(DropReason::ChunkMismatch);
        }
        // A state copy's fragments are checked by their kind (a round's
        // absence, a rank's clocks: Shard::on_state).
        if u32::from(repr.count) != slot.elems && repr.kind != ReplicaMsgType::ReplicateState {
            return Err(DropReason::CountMismatch);
        }
        let seq = part.first + u64::from(repr.slot);
        if part.at.place(seq).is_none_or(|(at, _)| at != from) {
            return Err(DropReason::WrongPeer);
        }
        Ok(k)
    }

    /// A primary's REPLICATE at a backup slot: applied if it is the slot's
    /// next round (`Ok(true)`), acknowledged again if it is its last
    /// (`Ok(false)`), else refused.
    fn on_replicate(
        k: &Kernels,
        job: &mut Job<A>,
        from: A,
        repr: &ReplicaRepr,
        update: (u16, u32),
        payload: &[u8],
        now: u64,
    ) -> Result<bool, DropReason> {
        let (dtype, workers) = (job.dtype, job.workers);
        // A hierarchical job's backup slots keep home slots, which run the
        // job's optimizer (its own slots, rack slots, only add: §11.11).
        let optimizer = job.hier.as_deref().map_or(job.optimizer, |h| h.optimizer);
        let rep = job.replica.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        if !rep.parts.iter().any(|p| p.home == repr.from) {
            return Err(DropReason::WrongPeer);
        }
        if repr.dtype != Dtype::F32 {
            return Err(DropReason::DtypeMismatch);
        }
        let at = Self::backup_slot_of(rep, from, repr)?;
        let clocked = rep.clocked;
        let part = &mut rep.parts[at];
        if !part.holds(repr.slot as usize) {
            // Its state copy is not in: no round to follow (§11.7).
            return Err(DropReason::Ahead);
        }
        let slot = &mut part.slots[repr.slot as usize];
        if clocked && slot.completed.get().is_some() && repr.round > 0 {
            // Past round 0 an async or bounded-delay job's chunk takes
            // updates (PROTOCOL.md §11.10).
            return Self::on_update(k, job, at, repr, update, payload, now);
        }
        if slot.completed.is(repr.round) {
            return Ok(false);
        }
        if repr.round != slot.in_progress() || !Round::completable(repr.round) {
            return Err(if slot.completed.is_after(repr.round) {
                DropReason::Stale
            } else {
                DropReason::Ahead
            });
        }
        // The aggregate stands for the round's W contributions: the
        // primary's accumulator, bit for bit; the same completion follows.
        k.copy(Dtype::F32, slot.mem.acc_mut(&mut part.blocks), payload);
        slot.contributed = RankSet::of(0..workers);
        slot.ncontrib = workers;
        slot.complete(dtype, &optimizer, workers, workers, &mut part.blocks);
        debug_assert!(
            slot.completed.is(repr.round),
            "a backup completes the round it applied"
        );
        Ok(true)
    }

    /// Checks a backup's message to a primary slot (REPLICATE_ACK,
    /// REPLICATE_STATE_ACK): the backup's index among the slot's part's
    /// backups, after the slot, its chunk and the sender's address.
    pub(super) fn backup_index(job: &Job<A>, from: A, repr: &ReplicaRepr) -> Result<usize, DropReason> {
        let rep = job.replica.as_deref().ok_or(DropReason::WrongPeer)?;
        if rep.groups.iter().all(|g| g.backups.is_empty()) {
            // No chunk here has a backup: no appliance acknowledges one.
            return Err(DropReason::WrongPeer);
        }
        if repr.dtype != Dtype::F32 {
            return Err(DropReason::DtypeMismatch);
        }
        let g = rep.group_of(repr.slot);
        let k = g
            .and_then(|g| g.backups.iter().position(|(b, _)| *b == repr.from))
            .ok_or(DropReason::RankOutOfRange)?;
        let slot = job
            .primaries()
            .0
            .get(repr.slot as usize)
            .ok_or(DropReason::SlotOutOfRange)?;
        if repr.key != slot.key || repr.chunk != slot.chunk {
            return Err(DropReason::ChunkMismatch);
        }
        if rep.backup_of(k, repr.slot).is_none_or(|(at, _)| at != from) {
            return Err(DropReason::WrongPeer);
        }
        Ok(k)
    }

    /// A backup's ACK at a primary slot: `Ok(true)` when it was the last
    /// the pending aggregate waited for, and the round is completed now.
    fn on_ack(job: &mut Job<A>, from: A, repr: &ReplicaRepr, now: u64) -> Result<bool, DropReason> {
        let k = Self::backup_index(job, from, repr)?;
        let rep = job.replica.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        let nb = rep.group_of(repr.slot).map_or(0, |g| g.backups.len());
        // A hierarchical job's primary slots are its home slots, which run
        // the job's optimizer with the racks as contributors (§11.11).
        let (slots, blocks, optimizer, quorum) = match job.hier.as_deref_mut() {
            Some(h) => {
                let home = h.home.as_mut().ok_or(DropReason::SlotOutOfRange)?;
                (&mut home.slots, &mut home.blocks, h.optimizer, h.racks)
            }
            None => (&mut job.slots, &mut job.blocks, job.optimizer, job.quorum),
        };
        let slot = &mut slots[repr.slot as usize];
        let p = rep
            .pushed
            .get_mut(repr.slot as usize)
            .ok_or(DropReason::RankOutOfRange)?;
        if !p.round.is(repr.round) {
            let done = slot.completed.get().is_some_and(|c| repr.round <= c);
            return Err(if done || p.round.is_after(repr.round) {
                DropReason::Stale
            } else {
                DropReason::Ahead
            });
        }
        if p.copying & (1 << k) != 0 {
            // No aggregate went to it before its copy's ACK (§11.7).
            return Err(DropReason::Ahead);
        }
        if p.acked & (1 << k) != 0 {
            return Err(DropReason::Duplicate);
        }
        p.acked |= 1 << k;
        if !Replica::<A>::all(nb, p.acked) {
            return Ok(false);
        }
        if p.resends == 0 {
            rep.rtt.sample(now.saturating_sub(p.sent));
        }
        *p = Pushed {
            copying: p.copying,
            ..Pushed::default()
        };
        debug_assert_eq!(p.copying, 0, "a round completed with a backup still copying");
        rep.stats.rounds_replicated += 1;
        // Every backup holds the round: it completes here too, with the
        // same operations on the same aggregate.
        slot.complete(job.dtype, &optimizer, job.workers, quorum, blocks);
        Ok(true)
    }

    /// Resends the aggregates whose backups have not all acknowledged in
    /// time (PROTOCOL.md §11.4 rule 4), and the state copies new backups
    /// have not acknowledged (§11.7), at most `budget` messages; returns
    /// what is left of it.
    pub(super) fn poll_replicas(&mut self, now: u64, mut budget: usize) -> usize {
        for i in 0..self.jobs.len() {
            // A replicated job's tables' rounds (PROTOCOL.md §11.9).
            let due = self.jobs[i]
                .replica
                .as_deref()
                .is_some_and(|r| r.rows_replicated() && now >= r.next_deadline);
            let tables = if due {
                let (left, next) = self.poll_row_replicas(i, now, budget);
                budget = left;
                next
            } else {
                u64::MAX
            };
            let j = &mut self.jobs[i];
            let Some(rep) = j.replica.as_deref_mut() else {
                continue;
            };
            if now < rep.next_deadline {
                continue;
            }
            let mut timed_out = false;
            let mut next = u64::MAX;
            for g in &rep.groups {
                let nb = g.backups.len();
                // Cast: i indexes the job's slots, which fit a u32 (install).
                #[allow(clippy::cast_possible_truncation)]
                for i in g.base..g.base + g.count {
                    let p = &mut rep.pushed[i as usize];
                    if !p.waiting() {
                        continue;
                    }
                    if p.deadline == 0 {
                        // A copy queued by an epoch change: its timer starts.
                        p.sent = now;
                        p.deadline = now.saturating_add(rep.rtt.rto(0));
                        next = next.min(p.deadline);
                        continue;
                    }
                    // An async or bounded-delay slot's logged updates
                    // (PROTOCOL.md §11.10): each backup not copying gets
                    // again those it has not acknowledged; no aggregate.
                    let log = rep.updates.get(i as usize).filter(|u| !u.log.is_empty());
                    let updates = log.map_or(0, |u| unacked(u, nb, p.copying).count());
                    let fragments = super::primaries(&j.slots, &j.blocks, j.hier.as_deref())
                        .0
                        .get(i as usize)
                        .map_or(0, |s| usize::from(super::copy::fragments(s, rep.clocked)));
                    let pending = if p.round.is_none() || log.is_some() { 0 } else { nb };
                    let replicates = (0..pending)
                        .filter(|&k| (p.acked | p.copying) & (1 << k) == 0)
                        .count();
                    let states = u32::from(p.copying).count_ones() as usize * fragments;
                    if p.deadline <= now && budget >= replicates + states + updates {
                        budget -= replicates + states + updates;
                        p.deadline = rep.rtt.fire(&mut timed_out, &mut p.resends, now);
                        for (backup, t) in log.into_iter().flat_map(|u| unacked(u, nb, p.copying)) {
                            rep.stats.replicates_resent += 1;
                            self.counters.replicates_resent.inc();
                            self.pending.push(Pending::Update {
                                job: j.id,
                                slot: i,
                                backup,
                                t,
                                attempt: Attempt::Again,
                            });
                        }
                        for k in (0..pending).filter(|&k| (p.acked | p.copying) & (1 << k) == 0) {
                            rep.stats.replicates_resent += 1;
                            self.counters.replicates_resent.inc();
                            self.pending.push(Pending::Replicate {
                                job: j.id,
                                slot: i,
                                backup: k as u8,
                                attempt: Attempt::Again,
                            });
                        }
                        for k in (0..nb).filter(|&k| p.copying & (1 << k) != 0) {
                            for f in 0..fragments {
                                rep.stats.states_resent += 1;
                                self.pending.push(Pending::State {
                                    job: j.id,
                                    slot: i,
                                    backup: k as u8,
                                    fragment: f as u8,
                                    attempt: Attempt::Again,
                                });
                            }
                        }
                    }
                    next = next.min(p.deadline);
                }
            }
            rep.next_deadline = next.min(tables);
        }
        budget
    }

    /// Primary slot `slot`'s pending aggregate, to backup `backup` (None
    /// once that backup acknowledged it, or the round completed).
    pub(super) fn replicate_transmit(
        &self,
        job: u16,
        slot: u32,
        backup: u8,
        attempt: Attempt,
    ) -> Option<Transmit<'_, Ranks<'_, A>>> {
        let j = self.job(job)?;
        let rep = j.replica.as_deref()?;
        let (slots, blocks) = j.primaries();
        let s = slots.get(slot as usize)?;
        let p = rep.pushed.get(slot as usize)?;
        let round = p.round.get()?;
        if (p.acked | p.copying) & (1 << backup) != 0 {
            return None;
        }
        let g = rep.group_of(slot)?;
        let (to, backup_slot) = g.backup_of(usize::from(backup), slot)?;
        let repr = replicate_repr(j, g, s, (backup_slot, round), attempt);
        let payload: &[u8] = bytemuck::cast_slice(s.mem.acc(blocks));
        debug_assert_eq!(
            payload.len(),
            repr.payload_len(),
            "an aggregate of the wrong length"
        );
        Some(Transmit {
            header: repr.to_bytes(),
            payload,
            to: Ranks::new(&[], None, Some(to)),
        })
    }

    /// An acknowledgement of `kind` of backup slot `slot` of the part of
    /// home `home` of job `j`, for the round `round` gives (`None`:
    /// nothing to send): the part's primary's lcore holding the chunk,
    /// and the header (`count` 0).
    fn ack_of(
        j: &Job<A>,
        home: u16,
        slot: u32,
        kind: ReplicaMsgType,
        round: impl FnOnce(&Part<A>, &Slot) -> Option<u32>,
    ) -> Option<(A, ReplicaRepr)> {
        let rep = j.replica.as_deref()?;
        let part = rep.parts.iter().find(|p| p.home == home)?;
        let s = part.slots.get(slot as usize)?;
        let round = round(part, s)?;
        let (to, primary_slot) = part.at.place(part.first + u64::from(slot))?;
        Some((
            to,
            ReplicaRepr {
                kind,
                dtype: Dtype::F32,
                flags: 0,
                token: j.token,
                job: j.id,
                from: rep.me,
                count: 0,
                round,
                slot: primary_slot,
                key: s.key,
                chunk: s.chunk,
                epoch: rep.view.epoch,
                fragment: 0,
                fragments: 0,
            },
        ))
    }

    /// [`Shard::ack_of`] as a transmit of its own (no payload).
    pub(super) fn ack_to_primary(
        &self,
        job: u16,
        home: u16,
        slot: u32,
        kind: ReplicaMsgType,
        round: impl FnOnce(&Part<A>, &Slot) -> Option<u32>,
    ) -> Option<Transmit<'_, Ranks<'_, A>>> {
        let (to, repr) = Self::ack_of(self.job(job)?, home, slot, kind, round)?;
        Some(Transmit {
            header: repr.to_bytes(),
            payload: &[],
            to: Ranks::new(&[], None, Some(to)),
        })
    }
}

/// A REPLICATE of primary slot `s` of job `j` (its part's group `g`) to
/// the backup slot `backup_slot`, of `round` (PROTOCOL.md §11.3; an update
/// t in an async or bounded-delay job, §11.10).
pub(super) fn replicate_repr<A>(
    j: &Job<A>,
    g: &Group<A>,
    s: &Slot,
    (backup_slot, round): (u32, u32),
    attempt: Attempt,
) -> ReplicaRepr {
    // Cast: s.elems <= MAX_PAYLOAD / 4 (checked in install_replicated).
    #[allow(clippy::cast_possible_truncation)]
    ReplicaRepr {
        kind: ReplicaMsgType::Replicate,
        dtype: Dtype::F32,
        flags: attempt.flags(),
        token: j.token,
        job: j.id,
        // The part's home: the backup keeps its slots by it (§11.6).
        from: g.home,
        count: s.elems as u16,
        round,
        slot: backup_slot,
        key: s.key,
        chunk: s.chunk,
        epoch: j.replica.as_deref().map_or(0, |r| r.view.epoch),
        fragment: 0,
        fragments: 0,
    }
}

/// A slot's state, for comparing replicas bit for bit.
#[derive(Debug, Clone, PartialEq)]
pub struct BackupState<'a> {
    /// Its last completed round (none before round 0).
    pub round: Option<u32>,
    /// Its stored result, wire bytes.
    pub result: &'a [u8],
    /// Its parameters and the optimizer's two states (each empty where
    /// the optimizer keeps none).
    pub state: Vec<&'a [f32]>,
    /// An async or bounded-delay job's: each rank's applied clock, with
    /// [`phub_proto::checkpoint::CLOCK_HELD`] set while its answer is held
    /// (PROTOCOL.md §5.8, §11.10); empty for BSP.
    pub clocks: Vec<u32>,
}

/// Queues REPLICATE_ACK `ack` of job `job` to `to` (PROTOCOL.md §11.3): as
/// a further acknowledgement of the last queued message when that is one
/// to the same lcore of the same job and epoch with room (consecutive
/// REPLICATEs from one primary lcore, a GSO train, are answered in one
/// datagram), or as a new message, its header at the end of `out`.
fn queue_ack<A: Copy + Eq>(
    pending: &mut Vec<Pending<A>>,
    out: &mut Vec<u8>,
    job: u16,
    to: A,
    ack: &ReplicaRepr,
) {
    if let Some(Pending::ReplicaAcks {
        job: j,
        at,
        more,
        to: t,
    }) = pending.last_mut()
    {
        let at = *at as usize;
        let same = *j == job
            && *t == to
            && usize::from(*more) + 1 < replica::MAX_ACKS
            && out
                .get(at..at + HEADER_LEN)
                .is_some_and(|h| Header::new_unchecked(h).epoch() == ack.epoch);
        if same {
            debug_assert_eq!(
                out.len(),
                at + HEADER_LEN + usize::from(*more) * replica::ACK_ENTRY_LEN
            );
            replica::push_ack(out, ack.slot, ack.round);
            *more += 1;
            return;
        }
    }
    let Ok(at) = u32::try_from(out.len()) else {
        return;
    };
    out.extend_from_slice(&ack.to_bytes());
    pending.push(Pending::ReplicaAcks { job, at, more: 0, to });
}
