//! Replicated jobs in the simulator (PROTOCOL.md §11): every chunk on a
//! primary and its backups, and control's part of failover, played on the
//! virtual clock.
//!
//! Layer: test support, part of [`crate::World`]. The appliances are the
//! real engine shards installed as the dataplane installs a replicated
//! job (`replica_plan_at`), the workers the real transports routing by
//! epoch (`SimTransport::set_replication`); what control does is played
//! here, step by step as `phub-control` does it (`control/src/daemon/
//! failover.rs`, `drain.rs`):
//! - an appliance killed (its lcores lose everything) or cut off (alive
//!   behind a partition: a split brain) is declared down `detect_us`
//!   after it went silent: the job's next epoch has it down
//!   (`EpochView::with_down`), recorded before anyone is told, then put on
//!   every lcore of every live appliance, each at its own instant;
//! - a worker asking for an epoch (an ERROR `wrong_epoch` named one, a
//!   silence asks whether the held one is current) is answered with the
//!   recorded one once it is at least the one wanted, asked again every
//!   20 ms as the worker's fetch asks;
//! - an appliance that answers again (killed and restarted, or its
//!   partition healed) is given the job back: the next epoch has it
//!   joined, it is installed at that epoch, empty (a healed one has the
//!   job removed first), the epoch is put on the others, and their
//!   primaries copy their state to it; control watches the copies until
//!   none is awaited or owed (full strength);
//! - a drain moves an appliance's index to a spare (`with_moved`): the
//!   spare is installed empty at that epoch, the others are put the epoch,
//!   and the old appliance has the job evicted a while later;
//! - then, maybe, another appliance is killed: after full strength, or the
//!   returning one during its copy;
//! - a kill that leaves a part no live member (a declaration that downs
//!   its set's last member, or an lcore that refuses an epoch 410, its
//!   copy not whole) fails the job, or, where every lcore's checkpoint was
//!   taken before the faults ([`StallBack`]), stalls it: the epoch
//!   recorded and put on nobody, no return; once every appliance answers
//!   again the job goes back to its checkpoints at the next epoch naming
//!   nobody, every index restored in turn (PROTOCOL.md §11.7, "Stalled
//!   jobs").
//!
//! Checks, beside [`crate`]'s (every RESULT the reference's, nothing
//! applied twice, every datagram counted, no worker stuck):
//! - a RESULT of a round leaves a primary only once every backup of the
//!   chunk after it in its epoch's replica set holds that round (no
//!   answered round can be lost);
//! - every epoch put on an lcore is taken (`change_epoch` refuses
//!   nothing control sends);
//! - at the end every backup holding a round holds the serving primary's
//!   round, result and optimizer state, bit for bit.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use phub_engine::engine::{replica_plan_at, BackupState};
use phub_engine::kernels::Kernels;
use phub_engine::Verdict;
use phub_engine::{InstallKind, JobInstall, Shard};
use phub_proto::api::DataAddr;
use phub_proto::failover::{EpochView, ReplicaLayout};
use phub_proto::layout::ChunkRange;
use phub_proto::replica::ReplicaMsgType;
use phub_proto::spec::Consistency;
use phub_proto::wire::{self, MsgType};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::net::{Node, Spell};
use crate::{Lcore, World, JOB, TOKEN};

/// How often the worker's epoch fetch asks control again, µs (its RETRY).
const ASK_AGAIN_US: u64 = 20_000;
/// How long the worker's epoch fetch asks, µs (its EPOCH_WAIT).
const ASK_FOR_US: u64 = 10_000_000;
/// How often control polls the appliances' copy progress, µs.
const WATCH_US: u64 = 1_000;

/// A replicated job's shape and what happens to its appliances.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaCase {
    /// Copies of every chunk (2 or 3, at most the appliances).
    pub replicas: u8,
    /// Each appliance's rack label (a replica set prefers other racks).
    pub racks: Vec<String>,
    /// What happens first.
    pub event: Option<ReplicaEvent>,
    /// Control's heartbeat deadline: an appliance silent this long is
    /// declared down, µs.
    pub detect_us: u64,
    /// Control's answers and puts take up to this long to arrive, µs.
    pub control_us: u64,
    /// What happens then.
    pub then_kill: Option<ThenKill>,
    /// Control killed and restarted meanwhile.
    pub control_down: Option<ControlDown>,
    /// Kills are played even when they lose a part (every member of its
    /// set dead, awaiting its copy or behind control's epoch): control
    /// then fails the job (a 410 from the appliance, or a declaration
    /// that leaves a part no member), and every rank stops with
    /// `JobFailed` when it next asks control for an epoch.
    pub lose: bool,
    /// Control's puts to this appliance take this much longer (a slow
    /// management path: its lcores take epochs late, or skip one).
    pub slow_puts: Option<(u16, u64)>,
    /// With [`ReplicaCase::lose`]: every lcore's checkpoint taken early,
    /// so that a declaration that leaves a part no live member **stalls**
    /// the job instead of failing it (PROTOCOL.md §11.7, "Stalled jobs"),
    /// until every appliance is back and it goes back to its checkpoints.
    pub stall: Option<StallBack>,
}

/// A stalled job's way back ([`ReplicaCase::stall`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallBack {
    /// When every lcore's checkpoint is taken, µs (before every fault:
    /// each lcore alive at epoch 0).
    pub checkpoint_us: u64,
    /// How long after the stall every appliance answers again (the dead
    /// ones restarted, empty), µs; a partition of the job's still heals
    /// first.
    pub back_us: u64,
    /// Index `a` is restored `a * stagger_us` after the job went back, µs.
    pub stagger_us: u64,
}

/// The first thing that happens to an appliance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaEvent {
    /// Killed at `at_us` (everything to or from it lost); restarted
    /// `back_us` after it is declared down (`None`: never), empty.
    Kill {
        /// The appliance.
        appliance: u16,
        /// When, µs.
        at_us: u64,
        /// When it is back, after the declaration, µs.
        back_us: Option<u64>,
    },
    /// Cut off from `at_us` for `for_us`, alive (a split brain if control
    /// declares it down meanwhile; given the job back when it heals).
    Partition {
        /// The appliance.
        appliance: u16,
        /// When, µs.
        at_us: u64,
        /// How long, µs.
        for_us: u64,
    },
    /// Drained at `at_us` to a spare (an appliance not of the job).
    Drain {
        /// The appliance.
        appliance: u16,
        /// When, µs.
        at_us: u64,
    },
    /// Every appliance killed at `at_us` after a checkpoint of every
    /// lcore at `checkpoint_us`, and given the job back from it: control
    /// records a new epoch naming nobody at the kill, and index `a` is
    /// back `down_us + a * stagger_us` after it, installed as the
    /// checkpoint's job, restored and put that epoch, as control takes a
    /// job back to its checkpoints when no replica of some part kept its
    /// state (PROTOCOL.md §11.7, "Restored parts"; control restarted with
    /// them, or they within its deadline: none is declared down). Each
    /// restored primary slot copies its state to its backups, which await
    /// it; the ranks, refused `wrong_epoch` then `ahead`, pull and repeat
    /// the rounds since. Brought forward, with its checkpoint, to the
    /// instant the first rank submitted its last round if that came first
    /// (as a [`crate::Crash`] is).
    Restart {
        /// When every lcore's checkpoint is taken, µs (before `at_us`).
        checkpoint_us: u64,
        /// When, µs.
        at_us: u64,
        /// Index 0 back after, µs.
        down_us: u64,
        /// Each next index back this much later, µs.
        stagger_us: u64,
    },
    /// Killed at `at_us` for good, and replaced by a spare
    /// `spare_after_us` after it is declared down (`phub-control
    /// --spare-after-ms`, or a drain of the dead appliance: its index
    /// moved to the spare, which is filled by state copies).
    Replace {
        /// The appliance.
        appliance: u16,
        /// When, µs.
        at_us: u64,
        /// After the declaration, µs.
        spare_after_us: u64,
    },
}

/// Each appliance's rack label, drawn: its own rack or none.
fn draw_racks(rng: &mut ChaCha8Rng, appliances: u16) -> Vec<String> {
    (0..appliances)
        .map(|a| match rng.gen_bool(0.5) {
            true => format!("r{a}"),
            false => String::new(),
        })
        .collect()
}

/// Control's heartbeat deadline and how long its answers and puts take,
/// µs, drawn.
fn draw_control(rng: &mut ChaCha8Rng) -> (u64, u64) {
    let detect_us = if rng.gen_bool(0.7) {
        rng.gen_range(200..5_000)
    } else {
        rng.gen_range(5_000..300_000)
    };
    (detect_us, rng.gen_range(10..2_000))
}

/// An appliance whose puts are slow, and by how much, µs: in 3 of 10.
fn draw_slow_puts(rng: &mut ChaCha8Rng, appliances: u16) -> Option<(u16, u64)> {
    rng.gen_bool(0.3)
        .then(|| (rng.gen_range(0..appliances), rng.gen_range(1_000..30_000)))
}

/// Another kill, after the first event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThenKill {
    /// The appliance given the job back (or the spare), `after_us` after
    /// its install: during its copy, or after.
    Returning {
        /// Delay after the install, µs.
        after_us: u64,
    },
    /// Another appliance, `after_us` after full strength (without a
    /// return: after the declaration), if the job survives it.
    Other {
        /// The appliance.
        appliance: u16,
        /// Delay, µs.
        after_us: u64,
    },
    /// Another appliance, `after_us` after the returning one's (or the
    /// spare's) install: during its copy, if the job survives it (three
    /// replicas: the part's third member holds it).
    OtherDuringCopy {
        /// The appliance.
        appliance: u16,
        /// Delay, µs.
        after_us: u64,
    },
}

/// Control is down (killed and restarted, its state kept): from `at_us`
/// for `for_us` it declares nothing, answers no worker, puts no epoch
/// (those on their way are lost), watches no copy and takes no drain; once
/// back it declares what went silent a deadline after its start, puts the
/// job's epoch on every lcore that lacks it (reconciliation), and watches
/// the copies under way again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlDown {
    /// When, µs.
    pub at_us: u64,
    /// How long, µs.
    pub for_us: u64,
}

impl ControlDown {
    /// In a quarter of the cases, control down at a drawn time for a
    /// drawn while.
    fn draw(rng: &mut ChaCha8Rng) -> Option<ControlDown> {
        rng.gen_bool(0.25).then(|| ControlDown {
            at_us: rng.gen_range(0..30_000),
            for_us: rng.gen_range(100..50_000),
        })
    }
}

impl ReplicaCase {
    /// An async or bounded-delay job's replicated shape over `appliances`
    /// and its faults, drawn (PROTOCOL.md §11.10): as [`ReplicaCase::draw`]
    /// draws them, from a generator of their own.
    pub fn draw_clocked(rng: &mut ChaCha8Rng, appliances: u16) -> ReplicaCase {
        ReplicaCase::draw(rng, appliances)
    }

    /// A replicated shape over `appliances` and its faults, drawn.
    pub fn draw(rng: &mut ChaCha8Rng, appliances: u16) -> ReplicaCase {
        let replicas: u8 = rng.gen_range(2..=u8::try_from(appliances.min(3)).expect("at most 3"));
        let racks = draw_racks(rng, appliances);
        let appliance = rng.gen_range(0..appliances);
        let at_us = rng.gen_range(500..20_000);
        let event = match rng.gen_range(0..6) {
            0 => None,
            1 | 2 => Some(ReplicaEvent::Kill {
                appliance,
                at_us,
                back_us: rng.gen_bool(0.6).then(|| rng.gen_range(0..20_000)),
            }),
            3 => Some(ReplicaEvent::Partition {
                appliance,
                at_us,
                for_us: rng.gen_range(100..40_000),
            }),
            4 => Some(ReplicaEvent::Drain { appliance, at_us }),
            _ => Some(ReplicaEvent::Replace {
                appliance,
                at_us,
                spare_after_us: rng.gen_range(0..20_000),
            }),
        };
        let (detect_us, control_us) = draw_control(rng);
        let other = (appliance + rng.gen_range(1..appliances)) % appliances;
        let then_kill = rng.gen_bool(0.4).then(|| match rng.gen_range(0..3) {
            0 => ThenKill::Returning {
                after_us: rng.gen_range(0..3_000),
            },
            1 => ThenKill::Other {
                appliance: other,
                after_us: rng.gen_range(0..5_000),
            },
            _ => ThenKill::OtherDuringCopy {
                appliance: other,
                after_us: rng.gen_range(0..2_000),
            },
        });
        let control_down = ControlDown::draw(rng);
        let lose = rng.gen_bool(0.2);
        let slow_puts = draw_slow_puts(rng, appliances);
        ReplicaCase {
            replicas,
            racks,
            event,
            detect_us,
            control_us,
            then_kill,
            control_down,
            lose,
            slow_puts,
            stall: None,
        }
    }
}

/// What control knows and is doing, and what the run saw of it.
pub(crate) struct Control {
    pub(crate) layout: ReplicaLayout<String>,
    pub(crate) runs: Vec<ChunkRange>,
    /// Per key, the sequence number of its chunk 0.
    pub(crate) key_first: Vec<u64>,
    /// The job's epoch, as recorded.
    pub(crate) view: EpochView,
    /// Per chunk, the last round a RESULT of it left an lcore for.
    answered: Vec<Option<u32>>,
    /// Epochs on their way to lcores: (when, layout lcore, view).
    puts: Vec<(u64, usize, EpochView)>,
    /// Workers' questions: (when answered, rank, epoch wanted, asked at).
    asks: Vec<(u64, usize, u32, u64)>,
    /// Per appliance index, when it went silent (killed or cut off).
    silent_since: Vec<Option<u64>>,
    /// Per appliance index, when control declared it down.
    declared_at: Vec<Option<u64>>,
    /// When each index comes back (a restart, a partition healing).
    back_at: Vec<Option<u64>>,
    /// A copy being watched: (index, epoch, installed at).
    copying: Option<(usize, u32, u64)>,
    /// When the job was last back to full strength.
    pub(crate) full_at: Option<u64>,
    /// The index the first event gave the job back to (or moved).
    returned: Option<usize>,
    /// When the next watch of the copies is due.
    watch_at: Option<u64>,
    /// When the old appliance of a drain has the job evicted.
    evict_at: Option<u64>,
    /// When a dead appliance is replaced by the spare.
    replace_at: Option<u64>,
    /// The index whose old lcores a drain kept (at the end of `lcores`).
    retired: Option<usize>,
    /// The then-kill: when, which index (decided once its cause came).
    then_at: Option<(u64, usize)>,
    first_done: bool,
    then_done: bool,
    /// Control came back from its [`ControlDown`].
    restarted: bool,
    /// A [`ReplicaEvent::Restart`]'s steps done: its checkpoint, its
    /// kill, then one per index back.
    restart_step: usize,
    /// Control failed the job, for this reason ([`ReplicaCase::lose`]).
    pub(crate) failed: Option<String>,
    /// Every lcore's checkpoint of a [`StallBack`] was taken.
    checkpointed: bool,
    /// Stalled: when every appliance answers again and the job goes back
    /// to its checkpoints.
    stalled_until: Option<u64>,
    /// Gone back from a stall: (when, the indices still to restore).
    restoring: Option<(u64, usize)>,
}

impl Control {
    pub(crate) fn new(
        layout: ReplicaLayout<String>,
        runs: Vec<ChunkRange>,
        key_first: Vec<u64>,
        n: usize,
    ) -> Control {
        let total = runs.iter().map(|r| r.count).sum::<u64>();
        Control {
            answered: vec![None; usize::try_from(total).expect("a sim job is small")],
            layout,
            runs,
            key_first,
            view: EpochView::default(),
            puts: Vec::new(),
            asks: Vec::new(),
            silent_since: vec![None; n],
            declared_at: vec![None; n],
            back_at: vec![None; n],
            copying: None,
            full_at: None,
            returned: None,
            watch_at: None,
            evict_at: None,
            replace_at: None,
            retired: None,
            then_at: None,
            first_done: false,
            then_done: false,
            restarted: false,
            restart_step: 0,
            failed: None,
            checkpointed: false,
            stalled_until: None,
            restoring: None,
        }
    }

    /// The next instant control does something.
    pub(crate) fn next_at(&self, rc: &ReplicaCase, now: u64) -> Option<u64> {
        let declare = self
            .silent_since
            .iter()
            .zip(&self.declared_at)
            .filter_map(|(s, d)| match (s, d) {
                (Some(s), None) => Some(s + rc.detect_us),
                _ => None,
            });
        let first = match (rc.event, self.first_done) {
            (Some(ReplicaEvent::Kill { at_us, .. }), false)
            | (Some(ReplicaEvent::Partition { at_us, .. }), false)
            | (Some(ReplicaEvent::Drain { at_us, .. }), false)
            | (Some(ReplicaEvent::Replace { at_us, .. }), false) => Some(at_us),
            _ => None,
        };
        self.puts
            .iter()
            .map(|p| p.0)
            .chain(self.asks.iter().map(|a| a.0))
            .chain(declare)
            .chain(self.back_at.iter().flatten().copied())
            .chain(self.watch_at)
            .chain(self.evict_at)
            .chain(self.replace_at)
            .chain(self.then_at.filter(|_| !self.then_done).map(|t| t.0))
            .chain(
                rc.control_down
                    .into_iter()
                    .flat_map(|d| [d.at_us, d.at_us + d.for_us]),
            )
            .chain(first)
            .chain(rc.stall.map(|s| s.checkpoint_us).filter(|_| !self.checkpointed))
            .chain(self.stalled_until)
            .chain(
                self.restoring
                    .map(|(t, next)| t + next as u64 * rc.stall.map_or(0, |s| s.stagger_us)),
            )
            .filter(|&t| t > now)
            .min()
    }
}

impl World<'_> {
    /// A replicated case's job installed as the dataplanes install it
    /// (epoch 0), control set up, every rank routing by epoch.
    pub(crate) fn replicate(&mut self) {
        let Some(rc) = self.case.replication.clone() else {
            return;
        };
        let n = usize::from(self.case.appliances);
        let l = usize::from(self.case.lcores);
        let runs = self.lay.lcores.clone();
        let layout = match ReplicaLayout::new(
            runs.clone(),
            &vec![l; n],
            rc.racks.clone(),
            usize::from(rc.replicas),
        ) {
            Ok(x) => x,
            Err(e) => panic!("the case's replica layout: {e}"),
        };
        let key_first = (0..self.case.keys.len())
            .map(|k| {
                self.placement
                    .chunks()
                    .of_key(u32::try_from(k).expect("few keys"))
                    .start
            })
            .collect();
        self.control = Some(Control::new(layout, runs, key_first, n));
        let view = EpochView::default();
        // A hierarchical job's shards are installed already, hierarchical
        // at epoch 0 with their home slots' replicas (PROTOCOL.md §11.11).
        for a in (0..n).filter(|_| self.hier.is_none()) {
            let shards = self.replica_shards(a, &view);
            for (g, shard) in self.lcores_of(a).zip(shards) {
                self.lcores[g].shard = shard;
            }
        }
        for lc in &mut self.lcores[..n * l] {
            lc.view = Some(view.clone());
        }
        for i in 0..self.ranks.len() {
            self.route_rank(i);
        }
        if rc.event.is_none() {
            self.plan_then_kill(None);
        }
    }

    fn rc(&self) -> &ReplicaCase {
        self.case.replication.as_ref().expect("a replicated case")
    }

    /// Appliance index `a`'s lcores' positions in `lcores`.
    fn lcores_of(&self, a: usize) -> std::ops::Range<usize> {
        let l = usize::from(self.case.lcores);
        a * l..(a + 1) * l
    }

    /// Where index `a` is served in `view`: its own appliance's host, or
    /// the spare a drain moved it to.
    fn host_of(a: usize, view: &EpochView) -> Ipv4Addr {
        let host = match view.moved_to(a) {
            Some(m) => m.data.host.clone(),
            None => Node::appliance_host(u16::try_from(a).expect("few appliances")),
        };
        host.parse().expect("a simulated appliance's host is IPv4")
    }

    /// Index `me`'s shards as the dataplane installs the job at `view`
    /// (epoch 0: everything; joined at `view`: empty).
    pub(crate) fn replica_shards(&self, me: usize, view: &EpochView) -> Vec<Shard<SocketAddr>> {
        let rc = self.rc();
        let n = usize::from(self.case.appliances);
        let appliances: Vec<(Ipv4Addr, u16, u16)> = (0..n)
            .map(|a| (Self::host_of(a, view), 9000, self.case.lcores))
            .collect();
        let me16 = u16::try_from(me).expect("few appliances");
        let plan = match replica_plan_at(&self.spec, &self.rep().runs, &appliances, &rc.racks, me16, view) {
            Ok(p) => p,
            Err(e) => panic!(
                "appliance {me}: the replicated install at epoch {} is refused: {e}",
                view.epoch
            ),
        };
        plan.into_iter()
            .enumerate()
            .map(|(l, (slots, rep))| {
                let g = me * usize::from(self.case.lcores) + l;
                let kernels = Kernels::available()[g % Kernels::available().len()];
                let mut shard = Shard::new(u16::try_from(l).expect("few lcores"), kernels);
                shard.set_peer_resolver(Arc::new(|a| Some(SocketAddr::V4(a))));
                // Its tables, with their backups (PROTOCOL.md §11.9).
                let tables: Vec<_> = self
                    .case
                    .tables
                    .iter()
                    .enumerate()
                    .map(|(i, t)| phub_engine::engine::TableInstall {
                        key: crate::table_key(self.case, i),
                        spec: t.spec(),
                        chunk_bytes: self.case.chunk_bytes,
                        lcores: u32::from(self.case.appliances * self.case.lcores),
                        entry: u32::try_from(g).expect("few lcores"),
                    })
                    .collect();
                if let Err(e) = shard.install_with_tables(
                    JobInstall {
                        id: JOB,
                        token: TOKEN,
                        workers: self.case.workers,
                        dtype: self.case.dtype,
                        optimizer: self.case.optimizer,
                        consistency: self.case.consistency,
                        chunk_elems: self.lay.chunk_elems,
                        slots,
                    },
                    InstallKind::Replicated(Box::new(rep)),
                    tables,
                ) {
                    panic!("appliance {me} lcore {l}: the replicated job does not install: {e}");
                }
                shard
            })
            .collect()
    }

    fn rep(&self) -> &Control {
        self.control.as_ref().expect("a replicated case has control")
    }

    fn rep_mut(&mut self) -> &mut Control {
        self.control.as_mut().expect("a replicated case has control")
    }

    /// Rank `i`'s transport routes by epoch, from the view control holds
    /// (its join answer's).
    pub(crate) fn route_rank(&mut self, i: usize) {
        let Some(c) = &self.control else { return };
        let rc = self.case.replication.as_ref().expect("a replicated case");
        let n = usize::from(self.case.appliances);
        let l = usize::from(self.case.lcores);
        let lcores: Vec<SocketAddr> = (0..n * l).map(|g| self.lcores[g].node.addr()).collect();
        let (runs, view, key_first) = (c.runs.clone(), c.view.clone(), c.key_first.clone());
        let (racks, replicas) = (rc.racks.clone(), usize::from(rc.replicas));
        if let Some(rt) = self.ranks[i].rt.as_mut() {
            // Its tables' entries too (PROTOCOL.md §11.9).
            let r = rt.set_replication(
                runs.clone(),
                &vec![l; n],
                racks.clone(),
                replicas,
                view.clone(),
                lcores.clone(),
                key_first.clone(),
            );
            if let Err(e) = r {
                panic!("rank {i}: the replicated job's table routing: {e}");
            }
        }
        let r = self.ranks[i]
            .t
            .set_replication(runs, &vec![l; n], racks, replicas, view, lcores, key_first);
        if let Err(e) = r {
            panic!("rank {i}: the replicated job's routing: {e}");
        }
        // A hierarchical job's rank: to its rack's appliance at epoch 0.
        if let Some(h) = &self.hier {
            let rack = self.rack_of[i];
            let runs = h.layouts[rack].lcores.clone();
            if let Err(e) = self.ranks[i].t.set_rack(rack, runs) {
                panic!("rank {i}: the hierarchical job's rack: {e}");
            }
        }
    }

    /// Control's and the faults' doings at `now`, in order.
    pub(crate) fn replica_events(&mut self) {
        if self.control.is_none() {
            return;
        }
        let now = self.now;
        let rc = self.rc().clone();
        let down = rc
            .control_down
            .is_some_and(|d| (d.at_us..d.at_us + d.for_us).contains(&now));
        if let Some(d) = rc
            .control_down
            .filter(|d| now >= d.at_us + d.for_us && !self.rep().restarted)
        {
            self.restart_control(d);
        }
        self.first_event(&rc, down);
        if let Some((t, a)) = self.rep().then_at.filter(|_| !self.rep().then_done) {
            if now >= t {
                self.rep_mut().then_done = true;
                self.kill(a);
            }
        }
        if down {
            // Control's puts on their way are lost; the workers' questions
            // go unanswered (their fetch asks again).
            let c = self.rep_mut();
            c.puts.retain(|p| p.0 > now);
            for q in c.asks.iter_mut().filter(|q| q.0 <= now) {
                q.0 = now + ASK_AGAIN_US;
            }
            self.deliver_puts();
            return;
        }
        if self.rep().failed.is_some() {
            self.answer_asks();
            return;
        }
        self.stall_steps(&rc);
        // Declarations.
        for a in 0..usize::from(self.case.appliances) {
            let c = self.rep();
            if let (Some(s), None) = (c.silent_since[a], c.declared_at[a]) {
                if now >= s + rc.detect_us {
                    self.declare_down(a);
                }
            }
        }
        // Returns.
        for a in 0..usize::from(self.case.appliances) {
            if self.rep().back_at[a].is_some_and(|t| now >= t) {
                self.rep_mut().back_at[a] = None;
                self.give_back(a);
            }
        }
        self.deliver_puts();
        self.answer_asks();
        self.watch_copies();
        if let Some(t) = self.rep().replace_at.filter(|&t| now >= t) {
            let a = match rc.event {
                Some(ReplicaEvent::Replace { appliance, .. }) => usize::from(appliance),
                _ => unreachable!("only a Replace plans a replacement ({t} µs)"),
            };
            self.rep_mut().replace_at = None;
            self.drain_to_spare(a);
        }
        if self.rep().evict_at.is_some_and(|t| now >= t) {
            self.rep_mut().evict_at = None;
            let total = self.total_lcores();
            for lc in self.lcores.iter_mut().skip(total) {
                lc.shard.evict(JOB, now * 1000);
                lc.view = None;
            }
        }
    }

    /// Control is back: what went silent is declared a deadline after its
    /// start, every live lcore lacking the job's epoch is put it, and the
    /// copy under way is watched again.
    fn restart_control(&mut self, d: ControlDown) {
        let back = d.at_us + d.for_us;
        let c = self.rep_mut();
        c.restarted = true;
        for s in c.silent_since.iter_mut().zip(&c.declared_at) {
            if let (Some(t), None) = s {
                *t = (*t).max(back);
            }
        }
        if c.copying.is_some() {
            c.watch_at = Some(back + WATCH_US);
        }
        let view = c.view.clone();
        // A stalled job's epoch is put on nobody.
        let stalled = c.stalled_until.is_some();
        let control_us = self.rc().control_us;
        for a in (0..usize::from(self.case.appliances)).filter(|&a| !view.is_down(a) && !stalled) {
            for g in self.lcores_of(a) {
                if self.lcores[g].view.as_ref().is_some_and(|v| v.epoch < view.epoch) {
                    let at = self.now + self.rng.gen_range(0..=control_us);
                    self.rep_mut().puts.push((at, g, view.clone()));
                }
            }
        }
        self.outcome.control_restarts += 1;
    }

    pub(super) fn total_lcores(&self) -> usize {
        usize::from(self.case.appliances) * usize::from(self.case.lcores)
    }

    /// The first event, when its time comes (a drain, asked of control,
    /// waits while control is `down`).
    fn first_event(&mut self, rc: &ReplicaCase, down: bool) {
        let now = self.now;
        let Some(e) = rc.event else { return };
        if self.rep().first_done {
            return;
        }
        if self.rep().stalled_until.is_some() {
            // Nothing more happens to a stalled job's appliances (a drain
            // of it is refused).
            self.rep_mut().first_done = true;
            return;
        }
        match e {
            ReplicaEvent::Kill { appliance, at_us, .. } | ReplicaEvent::Replace { appliance, at_us, .. }
                if now >= at_us =>
            {
                self.rep_mut().first_done = true;
                self.kill(usize::from(appliance));
            }
            ReplicaEvent::Partition {
                appliance,
                at_us,
                for_us,
            } if now >= at_us => {
                self.rep_mut().first_done = true;
                let a = usize::from(appliance);
                for l in 0..self.case.lcores {
                    self.net.partitions.push(Spell {
                        node: Node::Lcore(appliance, l),
                        from_us: at_us,
                        until_us: at_us + for_us,
                    });
                }
                let c = self.rep_mut();
                c.silent_since[a] = Some(at_us);
                // Control hears it again once the partition heals (a
                // return only if it was declared down meanwhile).
                c.back_at[a] = Some(at_us + for_us);
            }
            ReplicaEvent::Drain { appliance, at_us } if now >= at_us && !down => {
                self.rep_mut().first_done = true;
                self.drain_to_spare(usize::from(appliance));
            }
            ReplicaEvent::Restart { .. } => self.restart_all(),
            _ => {}
        }
    }

    /// The instant of a [`ReplicaEvent::Restart`]'s next step, brought
    /// forward (with its checkpoint) to the instant the first rank
    /// submitted its last round: a rank with all its results stops, and
    /// would never push again the rounds the restore lost.
    pub(crate) fn restart_next_at(&self) -> Option<u64> {
        let c = self.control.as_ref()?;
        let Some(ReplicaEvent::Restart {
            checkpoint_us,
            at_us,
            down_us,
            stagger_us,
        }) = self.case.replication.as_ref()?.event
        else {
            return None;
        };
        let at = self.last_round_at.map_or(at_us, |t| t.min(at_us));
        let step = c.restart_step;
        match step {
            0 => Some(checkpoint_us.min(at)),
            1 => Some(at),
            s if s < 2 + usize::from(self.case.appliances) => {
                Some(at + down_us + (s as u64 - 2) * stagger_us)
            }
            _ => None,
        }
    }

    /// A [`ReplicaEvent::Restart`]'s steps that are due: every lcore's
    /// checkpoint; every lcore down (the rounds answered since are lost
    /// with them: the job goes back); then each index back in turn, its
    /// shards installed at epoch 0 as the dataplane installs the job and
    /// restored from their checkpoints.
    fn restart_all(&mut self) {
        while self.restart_next_at().is_some_and(|t| t <= self.now) {
            let step = self.rep().restart_step;
            match step {
                0 => {
                    self.checkpoint_every_lcore();
                }
                1 => {
                    for g in 0..self.total_lcores() {
                        self.lcores[g].down = true;
                    }
                    // Control takes the job back at a new epoch naming
                    // nobody, recorded before anyone is told.
                    let c = self.rep_mut();
                    c.answered.iter_mut().for_each(|a| *a = None);
                    c.view = c.view.back_to_checkpoints();
                }
                s => {
                    let a = s - 2;
                    self.restore_index(a);
                    if a + 1 == usize::from(self.case.appliances) {
                        self.rep_mut().first_done = true;
                    }
                }
            }
            self.rep_mut().restart_step += 1;
        }
    }

    /// Every lcore's checkpoint, as control takes it: its appliance's own
    /// part ([`Shard::part_snapshot`]).
    fn checkpoint_every_lcore(&mut self) {
        for g in 0..self.total_lcores() {
            let lc = &mut self.lcores[g];
            let saved = lc.shard.part_snapshot(JOB).expect("the job is installed");
            lc.checkpoint = Some(saved.expect("its own part is here"));
            // Its own entry's tables (PROTOCOL.md §11.9), which it serves
            // at epoch 0 (a checkpoint is taken only then): their models
            // too, as the engine holds them now.
            lc.table_checkpoint = lc.shard.snapshot_tables(JOB);
        }
        let n = self.total_lcores();
        self.checkpoint_tables_of(&|g| g < n);
        // An async or bounded-delay job's (PROTOCOL.md §11.10): each
        // chunk's model at its home, whose part the checkpoint holds.
        if self.clocked_replicas() {
            let c = self.rep();
            let saved: Vec<_> = self
                .rmodels
                .iter()
                .filter(|(&(k, ch, a), _)| {
                    let g = c.key_first[k as usize] + u64::from(ch);
                    c.layout.home(g) == Some(a)
                })
                .map(|(&(k, ch, _), m)| ((k, ch), m.clone()))
                .collect();
            self.model_checkpoint = saved.into_iter().collect();
        }
    }

    /// Index `a`'s lcores installed as its checkpoint's job (epoch 0) and
    /// restored from it, then put control's epoch at once, as
    /// reconciliation does.
    fn restore_index(&mut self, a: usize) {
        let shards = self.replica_shards(a, &EpochView::default());
        let view = self.rep().view.clone();
        for (g, mut shard) in self.lcores_of(a).zip(shards) {
            let lc = &mut self.lcores[g];
            let state = lc.checkpoint.take().expect("a checkpoint before the kill");
            // As the dataplane restores: the tables with the install, then
            // the slots.
            if let Some(tables) = lc.table_checkpoint.take() {
                if let Err(e) = shard.restore_tables(JOB, &tables) {
                    panic!("lcore {g}: its tables' checkpoint does not restore: {e}");
                }
            }
            if let Err(e) = shard.restore(JOB, &state) {
                panic!("lcore {g}: its checkpoint does not restore: {e}");
            }
            if let Err(e) = shard.change_epoch(JOB, &view) {
                panic!(
                    "lcore {g}: the restored job does not take epoch {}: {e}",
                    view.epoch
                );
            }
            lc.shard = shard;
            lc.down = false;
            lc.incarnation += 1;
            lc.delivered = 0;
            lc.drops.iter_mut().for_each(|d| *d = 0);
            lc.view = Some(view.clone());
        }
        let gs = self.lcores_of(a);
        self.restore_tables_of(&|g| gs.contains(&g));
        if self.clocked_replicas() {
            // Its part's models go back to the checkpoint's (a `sum` job's
            // values come back as its result, rounded to the wire type, as
            // after a crash); its backup slots await copies, which bring
            // their primaries' models.
            let sum = !self.case.optimizer.keeps_params();
            let dtype = self.case.dtype;
            let c = self.rep();
            let mine: Vec<_> = self
                .model_checkpoint
                .iter()
                .filter(|(&(k, ch), _)| c.layout.home(c.key_first[k as usize] + u64::from(ch)) == Some(a))
                .map(|(&(k, ch), m)| {
                    let mut m = m.clone();
                    if sum {
                        m.values = crate::reference::through_wire(dtype, &m.values);
                    }
                    ((k, ch, a), m)
                })
                .collect();
            self.rmodels.extend(mine);
        }
        self.note(format_args!(
            "appliance {a} restored from its checkpoint at {view:?}"
        ));
        self.outcome.restored += 1;
    }

    /// A [`StallBack`]'s steps that are due: every lcore's checkpoint
    /// (when each is alive at epoch 0; otherwise none, and a lost part
    /// fails the job); the stalled job going back to its checkpoints once
    /// every appliance answers again; then each index restored in turn.
    fn stall_steps(&mut self, rc: &ReplicaCase) {
        let Some(sb) = rc.stall else { return };
        let now = self.now;
        if now >= sb.checkpoint_us && !self.rep().checkpointed {
            self.rep_mut().checkpointed = true;
            let whole = (0..self.total_lcores())
                .all(|g| !self.lcores[g].down && self.lcores[g].view.as_ref().is_some_and(|v| v.epoch == 0));
            if whole && self.rep().silent_since.iter().all(Option::is_none) {
                self.checkpoint_every_lcore();
            }
        }
        if self.rep().stalled_until.is_some_and(|t| now >= t) {
            // Every appliance answers: the job goes back at a new epoch
            // naming nobody, recorded first; every lcore loses the job
            // (a survivor's is removed, a dead one restarted empty), and
            // is restored from its checkpoint in turn.
            for g in 0..self.total_lcores() {
                self.lcores[g].down = true;
            }
            let c = self.rep_mut();
            c.stalled_until = None;
            c.silent_since.iter_mut().for_each(|s| *s = None);
            c.declared_at.iter_mut().for_each(|s| *s = None);
            c.back_at.iter_mut().for_each(|s| *s = None);
            c.answered.iter_mut().for_each(|a| *a = None);
            c.view = c.view.back_to_checkpoints();
            c.restoring = Some((now, 0));
            self.outcome.epochs += 1;
            self.note(format_args!("the stalled job goes back to its checkpoints"));
        }
        while let Some((at, next)) = self.rep().restoring {
            if now < at + next as u64 * sb.stagger_us {
                break;
            }
            self.restore_index(next);
            let n = usize::from(self.case.appliances);
            self.rep_mut().restoring = (next + 1 < n).then_some((at, next + 1));
        }
    }

    /// Whether a declaration that leaves a part no live member (epoch
    /// `view`) stalls the job rather than fail it: a [`StallBack`] whose
    /// checkpoint of every lcore was taken, no index moved, and no rank
    /// has submitted its last round (a rank done with it would not repeat
    /// the rounds the going back loses: the simulator's limit, not the
    /// system's).
    fn can_stall(&self, view: &EpochView) -> bool {
        self.rc().stall.is_some()
            && view.moved.is_empty()
            && self.last_round_at.is_none()
            && (0..self.total_lcores()).all(|g| self.lcores[g].checkpoint.is_some())
    }

    /// Control stalls the job at `view` (PROTOCOL.md §11.7, "Stalled
    /// jobs"; a declaration's next epoch, or the epoch an lcore refused
    /// 410): the epoch recorded and put on nobody further, every copy, return,
    /// replacement and later kill called off; every appliance answers
    /// again [`StallBack::back_us`] later (a partition of the job's
    /// healed first).
    fn stall(&mut self, view: EpochView) {
        let now = self.now;
        let rc = self.rc().clone();
        let sb = rc.stall.expect("can_stall");
        let healed = match rc.event {
            Some(ReplicaEvent::Partition { at_us, for_us, .. }) => at_us + for_us,
            _ => 0,
        };
        let c = self.rep_mut();
        c.view = view;
        c.puts.clear();
        c.copying = None;
        c.watch_at = None;
        c.replace_at = None;
        c.evict_at = None;
        c.back_at.iter_mut().for_each(|b| *b = None);
        c.then_done = true;
        c.stalled_until = Some((now + sb.back_us).max(healed));
        self.outcome.stalls += 1;
        self.note(format_args!("the job stalls"));
    }

    /// Index `a` dies: its lcores lose everything from now on.
    fn kill(&mut self, a: usize) {
        let c = self.rep();
        if c.silent_since[a].is_some() && c.declared_at[a].is_none() {
            return;
        }
        // The job must survive it: some member of every part's set must
        // hold the part, neither dead (declared or not) nor awaiting its
        // state copy. A part left to a backup awaiting its copy is lost
        // (the engine refuses the adoption, `PartLost`, HTTP 410), and so
        // is one with every member down; control fails such a job (a job
        // failing is not simulated). A kill that would do it waits while
        // copies or epochs are on their way (they may end), and is
        // dropped otherwise.
        let n = usize::from(self.case.appliances);
        let mut view = c.view.clone();
        // An lcore that has not taken control's epoch yet may drop its
        // backup slots' state when it does (their primary changed): it
        // counts as awaiting too.
        let lags = |g: usize| {
            self.lcores[g]
                .view
                .as_ref()
                .is_some_and(|v| v.epoch < c.view.epoch)
        };
        let gone = (0..n).filter(|&x| {
            x == a
                || c.silent_since[x].is_some()
                || c.copying.is_some_and(|(i, _, _)| i == x)
                || self.lcores_of(x).any(|g| self.awaits_copies(g) || lags(g))
        });
        for x in gone.collect::<Vec<_>>() {
            if let Some(v) = view.with_down(u16::try_from(x).expect("few appliances")) {
                view = v;
            }
        }
        if self.lost_part(&view).is_some() && !self.rc().lose {
            let settling = (0..self.total_lcores()).any(|g| !self.lcores[g].down && lags(g));
            if settling || c.copying.is_some() || self.copies_under_way() {
                let later = self.now + WATCH_US;
                let c = self.rep_mut();
                if let Some(t) = c.then_at.as_mut() {
                    t.0 = later;
                    c.then_done = false;
                }
            }
            return;
        }
        for g in self.lcores_of(a) {
            self.lcores[g].down = true;
        }
        self.note(format_args!("appliance {a} killed"));
        let now = self.now;
        let c = self.rep_mut();
        c.silent_since[a] = Some(now);
        c.declared_at[a] = None;
        self.outcome.replica_kills += 1;
    }

    /// The first part every member of which is down in `view`, as control
    /// finds it: one with chunks, or any with a job with tables (its
    /// entries hold rows, PROTOCOL.md §11.9).
    fn lost_part(&self, view: &EpochView) -> Option<usize> {
        let layout = &self.rep().layout;
        match self.case.tables.is_empty() {
            true => layout.lost_part(view),
            false => layout.lost_part_with_tables(view),
        }
    }

    /// Whether a state copy is owed or awaited on a live lcore.
    fn copies_under_way(&self) -> bool {
        (0..self.total_lcores()).any(|g| {
            !self.lcores[g].down
                && self.lcores[g]
                    .shard
                    .job_stats()
                    .iter()
                    .any(|s| s.id == JOB && s.copies.is_some_and(|p| p.owed > 0 || p.awaiting > 0))
        })
    }

    /// Whether the lcore at position `g` awaits a state copy.
    fn awaits_copies(&self, g: usize) -> bool {
        self.lcores[g]
            .shard
            .job_stats()
            .iter()
            .any(|s| s.id == JOB && s.copies.is_some_and(|p| p.awaiting > 0))
    }

    /// Control declares index `a` down: the next epoch, recorded, then
    /// put on every live lcore.
    fn declare_down(&mut self, a: usize) {
        self.note(format_args!("control declares appliance {a} down"));
        let now = self.now;
        let c = self.rep_mut();
        c.declared_at[a] = Some(now);
        let Some(view) = c.view.with_down(u16::try_from(a).expect("few appliances")) else {
            return;
        };
        if c.stalled_until.is_some() {
            // Stalled: the declaration is recorded, put on nobody.
            c.view = view;
            self.outcome.epochs += 1;
            return;
        }
        let lost = self.lost_part(&view);
        let c = self.rep_mut();
        if let Some(p) = lost {
            assert!(
                self.rc().lose,
                "appliance {a} declared down at {now} µs loses part {p}: the draws should have kept it"
            );
            if self.can_stall(&view) {
                self.outcome.epochs += 1;
                self.stall(view);
                return;
            }
            let why = format!("appliance {a} is down and part {p} has no live member left");
            self.fail_job(why);
            return;
        }
        if c.copying.is_some_and(|(i, _, _)| i == a) {
            c.copying = None;
            c.watch_at = None;
        }
        c.view = view.clone();
        self.outcome.epochs += 1;
        // A return drawn for a killed appliance comes after the
        // declaration.
        if let Some(ReplicaEvent::Kill {
            appliance,
            back_us: Some(b),
            ..
        }) = self.rc().event
        {
            if usize::from(appliance) == a && self.rep().returned.is_none() {
                self.rep_mut().back_at[a] = Some(now + b);
            }
        }
        if let Some(ReplicaEvent::Replace {
            appliance,
            spare_after_us,
            ..
        }) = self.rc().event
        {
            if usize::from(appliance) == a && self.rep().returned.is_none() {
                self.rep_mut().replace_at = Some(now + spare_after_us);
            }
        }
        self.put_on_others(a, &view);
        // Without a return, the then-kill of another index comes after
        // the declaration.
        let back = self.rep().back_at[a].is_some() || self.rep().replace_at.is_some();
        if !back && self.rep().then_at.is_none() {
            self.plan_then_kill(None);
        }
    }

    /// `view` put on every lcore of every live index but `except`.
    fn put_on_others(&mut self, except: usize, view: &EpochView) {
        let control_us = self.rc().control_us;
        let l = usize::from(self.case.lcores);
        let mut puts = Vec::new();
        for a in (0..usize::from(self.case.appliances)).filter(|&a| a != except && !view.is_down(a)) {
            let slow = self.put_lag(a);
            for g in a * l..(a + 1) * l {
                puts.push((
                    self.now + slow + self.rng.gen_range(0..=control_us),
                    g,
                    view.clone(),
                ));
            }
        }
        self.rep_mut().puts.extend(puts);
    }

    /// How much longer control's puts to index `a` take ([`ReplicaCase::slow_puts`]).
    fn put_lag(&self, a: usize) -> u64 {
        self.rc()
            .slow_puts
            .filter(|&(s, _)| usize::from(s) == a)
            .map_or(0, |(_, lag)| lag)
    }

    /// The epochs due reach their lcores.
    fn deliver_puts(&mut self) {
        let now = self.now;
        for (_, g, view) in take_due(&mut self.rep_mut().puts, |p| p.0 <= now) {
            let lc = &mut self.lcores[g];
            // A dead lcore takes nothing; control stops putting an epoch
            // once the job moved past it.
            if lc.down || lc.view.as_ref().is_some_and(|v| v.epoch >= view.epoch) {
                continue;
            }
            let taken = lc.shard.change_epoch(JOB, &view);
            self.note(format_args!("lcore {g} takes epoch {view:?}: {taken:?}"));
            let lc = &mut self.lcores[g];
            match taken {
                Ok(_) => {
                    lc.view = Some(view);
                    self.tables_after_epoch(g);
                }
                Err(e @ phub_engine::EngineError::PartLost { .. }) if self.rc().lose => {
                    // Answered 410: control stalls the job at its epoch,
                    // or fails it with the answer.
                    let view = self.rep().view.clone();
                    if self.can_stall(&view) {
                        self.stall(view);
                    } else {
                        self.fail_job(format!("lcore {g}: {e}"));
                    }
                    return;
                }
                Err(e) => panic!("lcore {g}: epoch {} refused: {e}", view.epoch),
            }
            self.drain(g);
        }
    }

    /// Control fails the job (`why`): it changes nothing more of it, and
    /// answers every epoch question with the reason.
    fn fail_job(&mut self, why: String) {
        self.note(format_args!("the job fails: {why}"));
        let c = self.rep_mut();
        if c.failed.is_none() {
            c.failed = Some(why);
            c.puts.clear();
            c.watch_at = None;
            c.copying = None;
            c.replace_at = None;
            c.back_at.iter_mut().for_each(|b| *b = None);
            self.outcome.jobs_failed += 1;
        }
    }

    /// Index `a` answers control again: the job is given back to it (a
    /// partition that healed before it was declared down changes nothing).
    fn give_back(&mut self, a: usize) {
        let c = self.rep_mut();
        if c.stalled_until.is_some() {
            // A stalled job re-replicates to nobody: the index answers
            // again, and is restored when the job goes back.
            return;
        }
        c.silent_since[a] = None;
        let declared = c.declared_at[a].take().is_some();
        if !declared {
            return;
        }
        let Some(view) = c.view.with_joined(u16::try_from(a).expect("few appliances")) else {
            return;
        };
        c.view = view.clone();
        c.returned = Some(a);
        self.outcome.epochs += 1;
        self.outcome.returns += 1;
        self.note(format_args!("appliance {a} given back at {view:?}"));
        // Installed anew at the epoch, empty (a healed one has the job
        // removed first: its old state goes).
        let shards = self.replica_shards(a, &view);
        self.install_index(a, shards, &view, None);
        self.put_on_others(a, &view);
        self.start_copy_watch(a, &view);
    }

    fn start_copy_watch(&mut self, a: usize, view: &EpochView) {
        let now = self.now;
        let c = self.rep_mut();
        c.copying = Some((a, view.epoch, now));
        c.watch_at = Some(now + WATCH_US);
        c.full_at = None;
        if self.rep().then_at.is_none() {
            let then = match self.rc().then_kill {
                Some(ThenKill::Returning { after_us }) => Some((now + after_us, a)),
                Some(ThenKill::OtherDuringCopy { appliance, after_us }) => {
                    Some((now + after_us, usize::from(appliance)))
                }
                _ => None,
            };
            self.rep_mut().then_at = then;
        }
    }

    /// Index `a`'s lcores become `shards` (installed at `view`): the old
    /// ones are gone, or, when the index `moved_to` another appliance (a
    /// drain), the new ones take that appliance's nodes and the old ones
    /// are kept at the end of `lcores` (alive until evicted).
    fn install_index(
        &mut self,
        a: usize,
        shards: Vec<Shard<SocketAddr>>,
        view: &EpochView,
        moved_to: Option<u16>,
    ) {
        for (k, shard) in self.lcores_of(a).zip(shards) {
            let lc = &mut self.lcores[k];
            let node = match moved_to {
                Some(s) => Node::Lcore(s, lc.shard.lcore()),
                None => lc.node,
            };
            let fresh = Lcore {
                shard,
                down: false,
                incarnation: lc.incarnation + 1,
                // Control's checkpoint of the lcore stays with control,
                // its tables' too.
                checkpoint: lc.checkpoint.take(),
                table_checkpoint: lc.table_checkpoint.take(),
                table_stream: None,
                node,
                delivered: 0,
                drops: vec![0; lc.drops.len()],
                view: Some(view.clone()),
            };
            let old = std::mem::replace(lc, fresh);
            if moved_to.is_some() {
                self.lcores.push(old);
                // The table entries the old lcore serves stay with it
                // (it goes on serving them at its epoch until the epoch
                // that moved its index reaches their backups, one of
                // which then adopts them).
                let at = self.lcores.len() - 1;
                for s in self.served_by.iter_mut().filter(|s| **s == k) {
                    *s = at;
                }
            }
        }
        if moved_to.is_some() {
            // The old lcores go on with the index's models as they stand.
            let retired = usize::from(self.case.appliances) + a;
            let models: Vec<_> = self
                .rmodels
                .iter()
                .filter(|((_, _, x), _)| *x == a)
                .map(|(&(k, c, _), m)| ((k, c, retired), m.clone()))
                .collect();
            self.rmodels.extend(models);
        }
    }

    /// A drain of index `a` to the spare (the appliance after the job's).
    fn drain_to_spare(&mut self, a: usize) {
        let c = self.rep();
        // A live appliance at full strength moves; so does a dead one
        // down alone (its replacement), which comes back no more.
        let only_it_down = c.view.down.iter().map(|&d| usize::from(d)).eq([a]);
        if !(c.view.down.is_empty() || only_it_down) || c.copying.is_some() {
            return;
        }
        self.outcome.replaced += u64::from(only_it_down);
        let c = self.rep_mut();
        c.silent_since[a] = None;
        c.declared_at[a] = None;
        c.retired = Some(a);
        let c = self.rep();
        let spare = self.case.appliances;
        let view = c.view.with_moved(
            u16::try_from(a).expect("few appliances"),
            "spare",
            DataAddr {
                host: Node::appliance_host(spare),
                base_port: 9000,
            },
        );
        self.rep_mut().view = view.clone();
        self.rep_mut().returned = Some(a);
        self.outcome.epochs += 1;
        self.outcome.drains += 1;
        self.note(format_args!("appliance {a} drained to the spare at {view:?}"));
        let shards = self.replica_shards(a, &view);
        self.install_index(a, shards, &view, Some(spare));
        self.put_on_others(a, &view);
        self.start_copy_watch(a, &view);
        // Reconciliation evicts the job from the drained appliance later.
        let control_us = self.rc().control_us;
        self.rep_mut().evict_at = Some(self.now + 5 * control_us + 1);
    }

    /// Control polls the copies: every live lcore at the epoch or later,
    /// none awaited or owed, is full strength.
    fn watch_copies(&mut self) {
        let now = self.now;
        let Some(at) = self.rep().watch_at else { return };
        if now < at {
            return;
        }
        let Some((_, epoch, _)) = self.rep().copying else {
            self.rep_mut().watch_at = None;
            return;
        };
        let view = self.rep().view.clone();
        let full = (0..usize::from(self.case.appliances))
            .filter(|&a| !view.is_down(a))
            .flat_map(|a| self.lcores_of(a))
            .all(|g| {
                let lc = &self.lcores[g];
                !lc.down
                    && lc.shard.job_stats().iter().any(|s| {
                        s.id == JOB
                            && s.copies
                                .is_some_and(|p| p.epoch >= epoch && p.awaiting == 0 && p.owed == 0)
                    })
            });
        if !full {
            self.rep_mut().watch_at = Some(now + WATCH_US);
            return;
        }
        let c = self.rep_mut();
        c.copying = None;
        c.watch_at = None;
        c.full_at = Some(now);
        self.outcome.full_strength += 1;
        if self.rep().then_at.is_none() {
            self.plan_then_kill(Some(now));
        }
    }

    /// The then-kill of another index, if drawn, after `from` (or now).
    fn plan_then_kill(&mut self, from: Option<u64>) {
        if let Some(ThenKill::Other { appliance, after_us }) = self.rc().then_kill {
            let at = from.unwrap_or(self.now) + after_us;
            self.rep_mut().then_at = Some((at, usize::from(appliance)));
        }
    }

    /// Every rank's question for an epoch, and control's answers.
    pub(crate) fn ask_epochs(&mut self) {
        if self.control.is_none() {
            return;
        }
        let control_us = self.rc().control_us;
        for i in 0..self.ranks.len() {
            let rows = self.ranks[i].rt.as_mut().and_then(|rt| rt.poll_epoch());
            let Some(wanted) = self.ranks[i].t.poll_epoch().max(rows) else {
                continue;
            };
            self.outcome.epochs_asked += 1;
            let now = self.now;
            let at = now + self.rng.gen_range(1..=control_us);
            let c = self.rep_mut();
            match c.asks.iter_mut().find(|q| q.1 == i) {
                Some(q) => q.2 = q.2.max(wanted),
                None => c.asks.push((at, i, wanted, now)),
            }
        }
    }

    fn answer_asks(&mut self) {
        let now = self.now;
        for (_, i, wanted, asked) in take_due(&mut self.rep_mut().asks, |q| q.0 <= now) {
            if let Some(why) = self.rep().failed.clone() {
                // Control answers 409 with the reason; the rank's requests
                // end with it.
                self.ranks[i].t.job_failed(&why);
                if let Some(rt) = self.ranks[i].rt.as_mut() {
                    rt.job_failed(JOB, &why);
                }
                continue;
            }
            let view = self.rep().view.clone();
            if view.epoch >= wanted {
                let t = self.at(now);
                if let Some(rt) = self.ranks[i].rt.as_mut() {
                    rt.set_epoch(t, view.clone());
                }
                self.ranks[i].t.set_epoch(t, view);
                continue;
            }
            assert!(
                now - asked < ASK_FOR_US,
                "rank {i} asked control for epoch {wanted} at {asked} µs and control never served it (it holds {})",
                view.epoch
            );
            self.rep_mut().asks.push((now + ASK_AGAIN_US, i, wanted, asked));
        }
    }

    /// A RESULT of `round` for `slot` leaves position `l`'s lcore: every
    /// backup after it in the chunk's set, in the epoch the lcore holds,
    /// holds that round (PROTOCOL.md §11.4).
    pub(crate) fn check_backups_hold(&self, l: usize, key: u32, chunk: u32, round: u32) {
        let Some(c) = &self.control else { return };
        let lc = &self.lcores[l];
        let Some(view) = &lc.view else { return };
        let Some(&first) = c.key_first.get(key as usize) else {
            panic!("lcore {l} answered key {key}, which the job does not have");
        };
        let g = first + u64::from(chunk);
        let home = c.layout.home(g).expect("a chunk of the job has a home");
        let set = c.layout.set_in(home, view);
        // Which index the lcore serves: by position, or a retired one's
        // (a drained appliance's old lcores: its own index).
        let me = self.index_of(l);
        let Some(after) = set.iter().position(|&a| a == me) else {
            return;
        };
        for &b in &set[after + 1..] {
            // A drained appliance rid of the job (evicted) is no backup:
            // a RESULT from an lcore still in the epoch before the drain
            // resends a round it acknowledged before.
            if self.positions_of(b, view).all(|x| self.lcores[x].view.is_none()) {
                continue;
            }
            let Some(round_held) = self.round_held(b, g, view) else {
                panic!(
                    "appliance {b} keeps no copy of chunk {g} (epoch {}; lcore {l}, appliance {me}, set {set:?})",
                    view.epoch
                );
            };
            // A backup awaiting its state copy (it came back, is a spare,
            // or its part's primary changed) holds no round, and no round
            // of the chunk completes until it acknowledges its copy
            // (§11.7): a RESULT leaving meanwhile is of a round completed
            // before, which the primary holds. So is one whose lcore has
            // not taken the sender's epoch yet, in which the part's
            // primary changed: it drops its state when it does.
            assert!(
                self.will_await(b, home, view) || round_held.is_none_or(|r| r >= round),
                "a RESULT of round {round} of chunk {g} left appliance {me} (lcore {l}, epoch {}) while its backup {b} holds round {round_held:?}",
                view.epoch,
            );
        }
    }

    /// Whether index `b` has a lcore that has not taken `view` yet and
    /// will await a state copy of part `home` when it does (the part's
    /// primary changed since the epoch it holds): it drops its state then.
    fn will_await(&self, b: usize, home: usize, view: &EpochView) -> bool {
        let c = self.rep();
        self.positions_of(b, view)
            .filter_map(|x| self.lcores[x].view.as_ref())
            .any(|held| {
                held.epoch < view.epoch && c.layout.primary(home, held) != c.layout.primary(home, view)
            })
    }

    /// The last round index `b` (as `view` addresses it) holds of chunk
    /// `g`: in its backup slot, or in the primary slot it adopted the chunk
    /// into since (in the epoch its lcore holds). `None` outside: it keeps
    /// no copy of the chunk.
    fn round_held(&self, b: usize, g: u64, view: &EpochView) -> Option<Option<u32>> {
        self.state_held(b, g, view).map(|st| st.round)
    }

    /// What index `b` (as `view` addresses it) holds of chunk `g`: its
    /// backup slot's state, or that of the primary slot it adopted the
    /// chunk into since (in the epoch its lcore holds). `None` outside: it
    /// keeps no copy of the chunk.
    fn state_held(&self, b: usize, g: u64, view: &EpochView) -> Option<BackupState<'_>> {
        let c = self.rep();
        let per = usize::from(self.case.lcores);
        for pos in self.positions_of(b, view) {
            let lc = &self.lcores[pos];
            if let Some(st) = lc.shard.backup_state(JOB, g) {
                return Some(st);
            }
            let Some(held) = &lc.view else { continue };
            let Some(s) = c.layout.serve(g, held) else {
                continue;
            };
            if s.appliance == b && s.lcore == pos % per {
                let slot = u32::try_from(s.slot).ok()?;
                if let Some(st) = lc.shard.primary_state(JOB, slot) {
                    return Some(st);
                }
            }
        }
        None
    }

    /// The index position `l`'s lcore serves (a retired lcore: the index
    /// it served before the drain).
    /// Which model of a chunk position `l`'s lcore follows in a replicated
    /// async or bounded-delay job: its index's, or a drained appliance's
    /// old lcores (alive in the old epoch) one of their own, the index's
    /// when they were retired ([`World::install_index`]).
    pub(crate) fn model_key(&self, l: usize) -> usize {
        let i = self.index_of(l);
        if l < self.total_lcores() {
            i
        } else {
            usize::from(self.case.appliances) + i
        }
    }

    pub(crate) fn index_of(&self, l: usize) -> usize {
        let per = usize::from(self.case.lcores);
        if l < self.total_lcores() {
            return l / per;
        }
        self.rep().retired.expect("only a drain retires lcores")
    }

    /// Index `b`'s lcores' positions as `view` addresses it: its current
    /// lcores, or a drained appliance's old ones if the view has not moved
    /// it yet.
    fn positions_of(&self, b: usize, view: &EpochView) -> std::ops::Range<usize> {
        let total = self.total_lcores();
        let retired =
            self.lcores.len() > total && self.rep().retired == Some(b) && view.moved_to(b).is_none();
        if retired {
            total..self.lcores.len()
        } else {
            self.lcores_of(b)
        }
    }

    /// At the end: each chunk's serving primary in control's epoch (once
    /// every epoch put is taken) holds the last round, and so does every
    /// backup holding a round, bit for bit.
    pub(crate) fn check_replicas(&mut self) {
        if self.control.is_none() {
            return;
        }
        // Every put still on its way is taken now, and every live lcore
        // behind control's epoch is put it (as reconciliation does; the
        // run may end while control is down, its puts lost).
        for p in &mut self.rep_mut().puts {
            p.0 = 0;
        }
        let view = self.rep().view.clone();
        let lagging: Vec<usize> = (0..usize::from(self.case.appliances))
            .filter(|&a| !view.is_down(a))
            .flat_map(|a| self.lcores_of(a))
            .filter(|&g| {
                !self.lcores[g].down && self.lcores[g].view.as_ref().is_some_and(|v| v.epoch < view.epoch)
            })
            .collect();
        self.rep_mut()
            .puts
            .extend(lagging.into_iter().map(|g| (0, g, view.clone())));
        self.deliver_puts();
        // A part lost after the last round (an lcore answers such an
        // epoch 410 only now): nothing is left to compare.
        if self.rep().failed.is_some() {
            return;
        }
        let view = self.rep().view.clone();
        let total: u64 = self.rep().runs.iter().map(|r| r.count).sum();
        let last = self.case.rounds;
        for g in 0..total {
            let c = self.rep();
            let s = c.layout.serve(g, &view).expect("a chunk of a live job is served");
            let home = c.layout.home(g).expect("a chunk has a home");
            let set = c.layout.set_in(home, &view);
            let pos = s.appliance * usize::from(self.case.lcores) + s.lcore;
            let slot = u32::try_from(s.slot).expect("a slot number");
            let Some(p) = self.lcores[pos].shard.primary_state(JOB, slot) else {
                panic!(
                    "chunk {g}: its primary, appliance {} lcore {} slot {slot}, has no state",
                    s.appliance, s.lcore
                );
            };
            let k = c
                .key_first
                .iter()
                .rposition(|&f| f <= g)
                .expect("chunk 0 is key 0's");
            let chunk = usize::try_from(g - c.key_first[k]).expect("a chunk index");
            let start = chunk * self.lay.chunk_elems as usize;
            let mut v = vec![0f32; p.result.len() / self.case.dtype.size()];
            phub_proto::dtype::decode(self.case.dtype, p.result, &mut v);
            let clocked = self.case.consistency != Consistency::Sync;
            let model;
            let want: &[f32] = if clocked {
                // Every rank's every clock applied once, in the model of
                // the serving appliance (PROTOCOL.md §11.10).
                let Some(m) = u32::try_from(k)
                    .ok()
                    .zip(u32::try_from(chunk).ok())
                    .and_then(|(k, c)| self.rmodels.get(&(k, c, s.appliance)))
                else {
                    panic!("chunk {g}: no model at appliance {}", s.appliance);
                };
                assert!(
                    m.applied.iter().all(|&a| a == last) && p.clocks.iter().all(|&a| a == last),
                    "chunk {g}: clocks {:?} (model {:?}) at the end, not all {last}",
                    p.clocks,
                    m.applied
                );
                model = crate::reference::through_wire(self.case.dtype, &m.values);
                &model
            } else {
                assert_eq!(p.round, Some(last), "chunk {g}: its primary's round at the end");
                &self.expect[k][last as usize][start..start + v.len()]
            };
            assert!(
                v.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "chunk {g} (key {k} chunk {chunk}): the stored result at the end is not the reference's"
            );
            for &b in set.iter().filter(|&&b| b != s.appliance) {
                let Some(st) = self
                    .positions_of(b, &view)
                    .find_map(|x| self.lcores[x].shard.backup_state(JOB, g))
                else {
                    panic!("chunk {g}: appliance {b} of its set keeps no backup of it");
                };
                // A slot awaiting its state copy holds no round (§11.7).
                let Some(r) = st.round else { continue };
                if clocked {
                    assert_eq!(st.round, p.round, "chunk {g}: backup {b}'s updates at the end");
                    assert_eq!(st.clocks, p.clocks, "chunk {g}: backup {b}'s clocks");
                } else {
                    assert_eq!(r, last, "chunk {g}: backup {b}'s round at the end");
                }
                assert_eq!(st.result, p.result, "chunk {g}: backup {b}'s stored result");
                let bits = |x: &[&[f32]]| -> Vec<Vec<u32>> {
                    x.iter()
                        .map(|v| v.iter().map(|f| f.to_bits()).collect())
                        .collect()
                };
                assert_eq!(
                    bits(&st.state),
                    bits(&p.state),
                    "chunk {g}: backup {b}'s parameters and optimizer state"
                );
                self.outcome.backups_checked += 1;
            }
        }
    }

    /// A PARTIAL_RESULT in `bytes` (an appliance-bound datagram from
    /// position `l`, a replicated hierarchical job's home), checked against
    /// the backups: the rack it goes to answers its ranks with it
    /// (PROTOCOL.md §11.11).
    pub(crate) fn check_partial_result_held(&self, l: usize, bytes: &[u8]) {
        if self.control.is_none() || phub_proto::replica::is_replica_message(bytes) {
            return;
        }
        if let Ok((repr, _)) = wire::parse(bytes) {
            if repr.kind == MsgType::PartialResult {
                self.check_backups_hold(l, repr.key, repr.chunk, repr.round);
            }
        }
    }

    /// The RESULT in `bytes` (a worker-bound datagram from position `l`),
    /// checked against the backups.
    pub(crate) fn check_result_held(&mut self, l: usize, rank: u16, bytes: &[u8]) {
        if self.control.is_none() {
            return;
        }
        if let Ok((repr, _)) = wire::parse(bytes) {
            if repr.kind == MsgType::Result {
                if self.case.consistency != Consistency::Sync {
                    self.check_clock_held(l, rank, repr.key, repr.chunk, repr.round);
                    return;
                }
                self.check_backups_hold(l, repr.key, repr.chunk, repr.round);
                self.check_answered_held(repr.key, repr.chunk, repr.round);
            }
        }
    }

    /// Async and bounded delay (PROTOCOL.md §11.10): a RESULT of rank
    /// `rank`'s clock `clock` leaves position `l`'s lcore only once every
    /// backup after it in the chunk's set, in the epoch the lcore holds,
    /// applied that clock (no answered push can be lost); and every live
    /// member of the set in control's epoch holds it too.
    fn check_clock_held(&self, l: usize, rank: u16, key: u32, chunk: u32, clock: u32) {
        let c = self.rep();
        let Some(view) = &self.lcores[l].view else { return };
        let g = c.key_first[key as usize] + u64::from(chunk);
        let home = c.layout.home(g).expect("a chunk of the job has a home");
        let me = self.index_of(l);
        let set = c.layout.set_in(home, view);
        let Some(after) = set.iter().position(|&a| a == me) else {
            return;
        };
        let members = set[after + 1..]
            .iter()
            .map(|&b| (b, view))
            .chain(c.layout.set_in(home, &c.view).into_iter().map(|b| (b, &c.view)));
        for (b, v) in members {
            if self.lcores_of(b).any(|x| self.lcores[x].down) {
                continue;
            }
            // A drained appliance rid of the job is no backup; one whose
            // lcore has not taken `v` yet, in which the part's primary
            // changed, drops its state when it does and awaits a copy (as
            // for BSP, `check_backups_hold`).
            if self.positions_of(b, v).all(|x| self.lcores[x].view.is_none()) || self.will_await(b, home, v) {
                continue;
            }
            let Some((t, clocks)) = self.clocks_held(b, g, v) else {
                panic!(
                    "appliance {b} keeps no copy of chunk {g} (epoch {}, set {set:?})",
                    v.epoch
                );
            };
            if t.is_none() || (t == Some(0) && clock == 0) {
                // Awaiting its state copy, which brings the clocks.
                continue;
            }
            let applied = clocks
                .get(usize::from(rank))
                .map_or(0, |c| c & !phub_proto::checkpoint::CLOCK_HELD);
            assert!(
                applied >= clock,
                "a RESULT of rank {rank}'s clock {clock} of chunk {g} left appliance {me} (lcore {l}, epoch {}) while \
                 appliance {b} applied its clock {applied} (epoch {})",
                view.epoch,
                v.epoch
            );
        }
    }

    /// The update count and ranks' clocks index `b` holds of chunk `g` (as
    /// `view` addresses it): in its backup slot or the primary slot it
    /// adopted the chunk into. `None`: it keeps no copy.
    fn clocks_held(&self, b: usize, g: u64, view: &EpochView) -> Option<(Option<u32>, Vec<u32>)> {
        self.state_held(b, g, view).map(|st| (st.round, st.clocks))
    }

    /// A replication message position `l`'s lcore took (`verdict`): an
    /// update its backup slot applied (PROTOCOL.md §11.10) goes into the
    /// model of its chunk at its appliance.
    pub(crate) fn update_taken(&mut self, l: usize, bytes: &[u8], verdict: Verdict) {
        if verdict != Verdict::Replicated || self.case.consistency == Consistency::Sync {
            return;
        }
        let Ok((repr, payload)) = phub_proto::replica::parse(bytes) else {
            return;
        };
        let g = self.rep().key_first[repr.key as usize] + u64::from(repr.chunk);
        let Some(st) = self.lcores[l].shard.backup_state(JOB, g) else {
            return;
        };
        // A copy of a chunk with no completed round (a primary restored
        // from a checkpoint taken before round 0 completed) installs no
        // round: the backup's model starts again where the primary's is.
        let nothing =
            repr.kind == ReplicaMsgType::ReplicateState && repr.round == u32::MAX && st.round.is_none();
        if st.round != Some(repr.round) && !nothing {
            return;
        }
        let a = self.model_key(l);
        if repr.kind == ReplicaMsgType::ReplicateState {
            // A state copy installed (a fragment of one held before taken
            // again): this appliance's model is its primary's, which
            // applies nothing while the copy runs.
            let Some(view) = self.lcores[l].view.clone() else {
                return;
            };
            let Some(q) = self.rep().layout.serve(g, &view).map(|s| s.appliance) else {
                return;
            };
            let Some(m) = self.rmodels.get(&(repr.key, repr.chunk, q)).cloned() else {
                return;
            };
            if (m.t == repr.round || (nothing && m.t == 0)) && q != a {
                self.rmodels.insert((repr.key, repr.chunk, a), m);
            }
            return;
        }
        if repr.kind != ReplicaMsgType::Replicate || repr.round == 0 {
            return;
        }
        let t = self.rmodels.get(&(repr.key, repr.chunk, a)).map_or(0, |m| m.t);
        if t + 1 != repr.round {
            // The ACK of one applied before, sent again.
            assert!(
                t >= repr.round,
                "appliance {a} applied update {} after {t}",
                repr.round
            );
            return;
        }
        self.outcome.updates_replicated += 1;
        let h = wire::Header::new_unchecked(bytes);
        self.take_update(
            l,
            (repr.key, repr.chunk),
            (h.update_rank(), h.update_clock()),
            phub_proto::Dtype::F32,
            payload,
        );
    }

    /// No answered round can be lost: once a RESULT of round r of a chunk
    /// left any lcore, every live member of the chunk's set in control's
    /// epoch holds round r or later, or awaits its state copy (which is
    /// taken from a primary holding it).
    fn check_answered_held(&mut self, key: u32, chunk: u32, round: u32) {
        let c = self.rep();
        let g = c.key_first[key as usize] + u64::from(chunk);
        let at = usize::try_from(g).expect("a sim job is small");
        let answered = c.answered[at].max(Some(round)).expect("a round");
        let home = c.layout.home(g).expect("a chunk of the job has a home");
        let view = c.view.clone();
        for b in c.layout.set_in(home, &view) {
            if self.lcores_of(b).any(|x| self.lcores[x].down) {
                continue;
            }
            if self.will_await(b, home, &view) {
                continue;
            }
            let held = self.round_held(b, g, &view);
            assert!(
                held.is_none_or(|r| r.is_none_or(|r| r >= answered)),
                "chunk {g}: round {answered} was answered, and appliance {b} of its set in epoch {} holds round {:?}",
                view.epoch,
                held.flatten()
            );
        }
        self.rep_mut().answered[at] = Some(answered);
    }
}

/// The entries of `v` that are `due`, taken out of it (the others kept in
/// order).
fn take_due<T>(v: &mut Vec<T>, due: impl Fn(&T) -> bool) -> Vec<T> {
    let (now, later): (Vec<T>, Vec<T>) = std::mem::take(v).into_iter().partition(|x| due(x));
    *v = later;
    now
}
