//! Checkpoints: a job's durable state per slot ([`Shard::snapshot`]) and
//! putting it back ([`Shard::restore`]); the round in progress is never
//! saved, its contributors push again.

use phub_proto::checkpoint::SlotState;
use phub_proto::Dtype;

use crate::kernels;
use crate::shm::JobRegions;

use super::clock::{RankClock, SINCE_UNKNOWN};
use super::copy::Fill;
use super::error::EngineError;
use super::hier::Partial;
use super::slot::{Blocks, RankSet, ResultKind, Round, Slot, PARAMS, S1, S2};
use super::Shard;

/// What a slot's accumulator holds between rounds, once restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Accumulator {
    /// Nothing kept: the next round's first contribution overwrites it.
    Empty,
    /// A non-BSP `sum` job's current values in f32 (each push is added to
    /// them): a bf16/f16 result is decoded into it too.
    Values,
}

impl Slot {
    /// Length in bytes of the stored result that a checkpoint keeps (none
    /// for parameters, which it keeps apart).
    pub(super) fn saved_result_len(&self) -> usize {
        match self.result {
            ResultKind::Params => 0,
            ResultKind::F32 | ResultKind::Region => 4 * self.mem.n,
            ResultKind::Half => 2 * self.mem.n,
        }
    }

    /// This slot's state for a checkpoint (slot `index` of a job whose
    /// regions are `shm`), with the ranks' `clocks`.
    pub(super) fn save(
        &self,
        index: u32,
        shm: Option<&JobRegions>,
        blocks: &Blocks,
        clocks: Vec<u32>,
    ) -> SlotState {
        let r = self.mem.all(blocks);
        SlotState {
            clocks,
            completed: self.completed.get(),
            params: r[PARAMS].to_vec(),
            s1: r[S1].to_vec(),
            s2: r[S2].to_vec(),
            result: match self.result {
                ResultKind::Params => Vec::new(),
                _ => self.result_bytes(index, shm, blocks).to_vec(),
            },
        }
    }

    /// Whether saved state `st` fits this slot (with `clocks` rank clocks).
    pub(super) fn fits(&self, st: &SlotState, clocks: usize) -> bool {
        let used = &self.mem.used;
        st.params.len() == used[PARAMS]
            && st.s1.len() == used[S1]
            && st.s2.len() == used[S2]
            && st.result.len() == self.saved_result_len()
            && st.completed.is_none_or(Round::completable)
            && st.clocks.len() == clocks
    }

    /// Puts saved state `st` (which [`Slot::fits`]) back, no round in
    /// progress, its accumulator as `acc` says. A [`ResultKind::Region`]
    /// result is the caller's to publish.
    pub(super) fn load(&mut self, blocks: &mut Blocks, st: &SlotState, dtype: Dtype, acc: Accumulator) {
        self.completed = st.completed.map_or(Round::NONE, Round::new);
        self.contributed = RankSet::default();
        self.ncontrib = 0;
        self.deferred = None;
        let acc_in_a = self.mem.acc_in_a;
        let b = self.mem.bufs(blocks);
        b.params.copy_from_slice(&st.params);
        b.s1.copy_from_slice(&st.s1);
        b.s2.copy_from_slice(&st.s2);
        match self.result {
            ResultKind::Params | ResultKind::Region => {}
            ResultKind::Half => {
                bytemuck::cast_slice_mut(b.half).copy_from_slice(&st.result);
                if acc == Accumulator::Values {
                    kernels::decode(dtype, &st.result, b.acc);
                }
            }
            ResultKind::F32 => {
                let [a, b, ..] = self.mem.all_mut(blocks);
                let r = if acc_in_a { b } else { a };
                bytemuck::cast_slice_mut(r).copy_from_slice(&st.result);
            }
        }
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// What a checkpoint of job `id` keeps of this lcore (PROTOCOL.md §7,
    /// §11.7): [`Shard::snapshot`] for a job that is not replicated; for a
    /// replicated one, its appliance's own part alone (the layout's slots
    /// of this lcore), from its primary slots where it serves the part, or
    /// from its backup slots of it where it keeps the part as a backup
    /// (it came back and was filled by state copies), never the parts it
    /// adopted: a checkpoint is restored only when the whole job goes back
    /// to its checkpoints, each appliance its own part. Refused while its
    /// own part's state copy is not all here. `None` when the job is not
    /// installed.
    pub fn part_snapshot(&self, id: u16) -> Option<Result<Vec<SlotState>, EngineError>> {
        let j = self.job(id)?;
        let Some(rep) = j.replica.as_deref() else {
            return self.snapshot(id).map(Ok);
        };
        // An async or bounded-delay job's slots keep their ranks' clocks
        // (checkpoint format version 2, PROTOCOL.md §5.8).
        let w = usize::from(j.workers);
        let clocks_of = |c: &[RankClock], i: usize| -> Vec<u32> {
            c.get(i * w..(i + 1) * w)
                .map_or_else(Vec::new, |c| c.iter().map(|c| c.clock).collect())
        };
        if let Some(g) = rep.groups.iter().find(|g| g.home == rep.me) {
            let own = g.base as usize..(g.base + g.count) as usize;
            // A hierarchical job's primary slots are its home slots: its
            // checkpoint is theirs, as a flat part's (PROTOCOL.md §11.11).
            let (primaries, blocks) = j.primaries();
            let slots = primaries.get(own).unwrap_or_default();
            return Some(Ok(slots
                .iter()
                .zip(g.base..)
                .map(|(s, i)| s.save(i, j.shm.as_ref(), blocks, clocks_of(&j.clocks, i as usize)))
                .collect()));
        }
        let Some(p) = rep.parts.iter().find(|p| p.home == rep.me) else {
            // No chunk of its own part on this lcore.
            return Some(Ok(Vec::new()));
        };
        if let Some(k) = (0..p.slots.len()).find(|&k| !p.holds(k)) {
            return Some(Err(EngineError::Checkpoint {
                id,
                reason: format!(
                    "this appliance keeps its own part as a backup, and backup slot {k}'s state copy is not here                      yet (PROTOCOL.md §11.7)"
                ),
            }));
        }
        Some(Ok(p
            .slots
            .iter()
            .zip(0..)
            .map(|(s, i)| s.save(i, None, &p.blocks, clocks_of(&p.clocks, i as usize)))
            .collect()))
    }

    /// The durable state of every slot of a job (completed round,
    /// parameters, optimizer state, stored result), for a checkpoint. The
    /// round in progress is not saved: its contributors never got a result
    /// and will push again. Allocates; call between bursts.
    pub fn snapshot(&self, id: u16) -> Option<Vec<SlotState>> {
        let j = self.job(id)?;
        let w = usize::from(j.workers);
        let racks = j.slots.iter().zip(0..).map(|(s, i)| {
            let at = i as usize * w;
            let clocks = j
                .clocks
                .get(at..at + w)
                .map_or_else(Vec::new, |c| c.iter().map(|c| c.clock).collect());
            s.save(i, j.shm.as_ref(), &j.blocks, clocks)
        });
        // A hierarchical job's home slots follow its rack slots.
        let homes = j
            .hier
            .as_ref()
            .and_then(|h| h.home.as_ref())
            .into_iter()
            .flat_map(|h| {
                h.slots
                    .iter()
                    .zip(0..)
                    .map(|(s, i)| s.save(i, None, &h.blocks, Vec::new()))
            });
        Some(racks.chain(homes).collect())
    }

    /// Puts slots back in the state a [`Shard::snapshot`] saved. Every
    /// length is checked before anything changes. A job with shared-memory
    /// regions gets every restored result written into its result region.
    pub fn restore(&mut self, id: u16, state: &[SlotState]) -> Result<(), EngineError> {
        let j = self
            .jobs
            .iter_mut()
            .find(|j| j.id == id)
            .ok_or(EngineError::Restore {
                id,
                reason: "the job is not installed".into(),
            })?;
        let mut home = j.hier.as_mut().and_then(|h| h.home.as_mut());
        let homes = home.as_ref().map_or(0, |h| h.slots.len());
        if state.len() != j.slots.len() + homes {
            return Err(EngineError::Restore {
                id,
                reason: format!(
                    "{} slots saved, {} installed ({homes} of them home slots)",
                    state.len(),
                    j.slots.len() + homes
                ),
            });
        }
        let (state, home_state) = state.split_at(j.slots.len());
        let nclocks = j.clocks.len() / j.slots.len().max(1);
        let home_slots = home.as_ref().map_or(&[][..], |h| &h.slots[..]);
        let all = j
            .slots
            .iter()
            .map(|s| (s, nclocks))
            .chain(home_slots.iter().map(|s| (s, 0)));
        if let Some(i) = all
            .zip(state.iter().chain(home_state))
            .position(|((s, n), st)| !s.fits(st, n))
        {
            return Err(EngineError::Restore {
                id,
                reason: format!("slot {i}: saved buffers do not fit the installed chunk"),
            });
        }
        if let Some(h) = &mut home {
            for (slot, st) in h.slots.iter_mut().zip(home_state) {
                slot.load(&mut h.blocks, st, j.dtype, Accumulator::Empty);
            }
        }
        if let Some(h) = &mut j.hier {
            // Nothing is on its way to a home after a restore.
            h.partials.fill(Partial::default());
            h.next_deadline = u64::MAX;
        }
        if let Some(r) = &mut j.replica {
            // Nor to a backup: the restored rounds are completed ones.
            r.clear_pending();
        }
        // Cast (here and in the loop below): i < j.slots.len(), which fits
        // a u32 (checked in install_with).
        #[allow(clippy::cast_possible_truncation)]
        for (i, (slot, st)) in j.slots.iter_mut().zip(state).enumerate() {
            let w = st.clocks.len();
            for (c, &saved) in j.clocks[i * w..(i + 1) * w].iter_mut().zip(&st.clocks) {
                *c = RankClock {
                    clock: saved,
                    since: SINCE_UNKNOWN,
                };
            }
            // Not BSP, sum: the current values in f32 live in the
            // accumulator, which the checkpoint keeps as the result.
            let acc = if w > 0 && !j.optimizer.keeps_params() {
                Accumulator::Values
            } else {
                Accumulator::Empty
            };
            slot.load(&mut j.blocks, st, j.dtype, acc);
            // The result region is where the result is stored: every
            // slot's saved bytes go there, so that a snapshot reads them
            // back. Between bursts: no worker holds a RESULT of this job
            // from this lcore that it has not copied out yet.
            if let (ResultKind::Region, Some(shm)) = (slot.result, &mut j.shm) {
                shm.publish(i as u32, &st.result);
            }
        }
        // A replicated part restored from its checkpoint (control restores
        // one only once every replica of some part lost its state): its
        // backups may hold none of the restored state (their slots are in
        // no checkpoint), so each restored primary slot copies its state
        // to its backups before any further round of it completes
        // (PROTOCOL.md §11.7's copy); a backup slot that completed no
        // round takes it, one that holds a round acknowledges it.
        if let Some(rep) = j.replica.as_deref_mut() {
            // Its own backup slots hold nothing until their primaries'
            // copies come: awaiting them, so that an adoption of such a
            // part is refused as lost rather than served from nothing, and
            // the stats say so (`copies.awaiting`).
            for part in &mut rep.parts {
                if part.slots.iter().all(|s| s.completed.is_none()) {
                    part.fill = vec![Fill::awaiting(); part.slots.len()];
                }
            }
            let copies: Vec<_> = rep
                .groups
                .iter()
                .map(|g| (g.base..g.base + g.count, all_backups(g.backups.len())))
                .collect();
            for (slots, backups) in copies {
                Self::queue_copies(&mut self.pending, j, slots, backups);
            }
        }
        j.counters.held = j.clocks.iter().filter(|c| c.held()).count() as u64;
        // The checkpoint may be older than the state the ranks hold: rounds
        // completed after it are lost, and a rank that holds the result of
        // one such round will not push that round again unless told. Each
        // rank is told at its first INIT or PUSH (`ahead`) and pulls
        // (PROTOCOL.md §5.4 rule 0). A hierarchical part's checkpoint must
        // hold the last round completed (§9, "Restarts"): its ranks go on.
        j.unsynced = if j.hier.is_none() {
            j.members
        } else {
            RankSet::default()
        };
        if let Some(shm) = &mut j.shm {
            #[allow(clippy::cast_possible_truncation)]
            for (i, slot) in j.slots.iter().enumerate() {
                if !slot.completed.is_none() && slot.result != ResultKind::Region {
                    shm.publish(i as u32, slot.result_bytes(i as u32, None, &j.blocks));
                }
            }
        }
        Ok(())
    }
}

/// The bits of a part's `n` backups (at most [`phub_proto::replica::MAX_REPLICAS`] - 1).
fn all_backups(n: usize) -> u8 {
    u8::try_from((1u16 << n.min(8)) - 1).unwrap_or(u8::MAX)
}
