//! Shared-memory contributions (PROTOCOL.md §3.4): where a message's
//! elements are ([`contribution`]) and the one-pass path of an f32 sum/mean
//! slot whose stored result is its chunk of the result region
//! ([`Shard::apply_region`]).

use phub_proto::spec::Optimizer;
use phub_proto::wire::{DropReason, Repr};
use phub_proto::Dtype;

use crate::kernels::Kernels;
use crate::optim;
use crate::optim::ChunkBufs;
use crate::shm::{JobRegions, Staging};

use super::slot::{Blocks, Slot};
use super::{Shard, Step};

/// Where a contribution's elements are: for a message with SHM, in the
/// sender's staging chunk (`staging`: the job's regions), else in the
/// datagram's payload. A staged slice must go before the round's result
/// can be sent (Staging::staged); it is always inside the region:
/// install checked that every slot fits the regions' chunk stride, and
/// the message's count its slot.
pub(super) fn contribution<'a>(
    staging: Option<Staging<'a>>,
    repr: &Repr,
    payload: &'a [u8],
) -> Result<&'a [u8], DropReason> {
    match staging {
        Some(s) if repr.shm() => s
            .staged(repr.rank, repr.slot, repr.payload_len())
            .ok_or(DropReason::CountMismatch),
        _ => Ok(payload),
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// A PUSH to a [`ResultKind::Region`] slot (f32 sum/mean of a job with
    /// regions), with at most one pass over memory per contribution:
    /// - a first contribution by shared memory, unless it is the last, is
    ///   not read yet (`Slot::deferred`): the rank does not write that
    ///   staging chunk again before it holds this round's result (§3.4),
    ///   which needs the second contribution, where it is read;
    /// - the second sums the deferred chunk and its own values into the
    ///   accumulator in one pass;
    /// - the last writes `(accumulator + its values)`, scaled for the mean,
    ///   with streaming stores ([`Kernels::sum_f32_stream`]: no read for
    ///   ownership, the lines not kept in this core's cache)
    ///   straight into the slot's chunk of the result region, which is the
    ///   slot's stored result. The lcore alone writes that region; this
    ///   chunk of it was last written when the previous round completed,
    ///   and every rank has since pushed this round, which a rank does only
    ///   after copying that result out (the worker's wait), so no one reads
    ///   it now. The RESULT headers leave after this returns.
    ///
    /// Sums are taken in arrival order, each rounded as the plain path's
    /// copy, adds and mean pass round them: results are bit-identical.
    pub(super) fn apply_region(
        k: &Kernels,
        workers: u16,
        opt: &Optimizer,
        shm: &mut JobRegions,
        (slot, blocks): (&mut Slot, &mut Blocks),
        repr: &Repr,
        payload: &[u8],
    ) -> Result<Step, DropReason> {
        debug_assert!(slot.ncontrib < workers, "a contribution beyond the quorum");
        let last = slot.ncontrib + 1 == workers;
        let len = repr.payload_len();
        if slot.ncontrib == 0 && repr.shm() && !last {
            slot.deferred = Some(repr.rank);
            slot.contributed.insert(repr.rank);
            slot.ncontrib = 1;
            return Ok(Step::Open);
        }
        // The deferred first contribution's chunk, as `contribution` reads
        // a chunk (same lifetime and bounds).
        fn first_chunk(staging: Staging<'_>, rank: u16, slot: u32, len: usize) -> Result<&[u8], DropReason> {
            staging.staged(rank, slot, len).ok_or(DropReason::CountMismatch)
        }
        let staged = |staging, rank| first_chunk(staging, rank, repr.slot, len);
        let n = slot.elems as usize;
        if last {
            let (staging, out) = shm.result_mut(repr.slot, n).ok_or(DropReason::CountMismatch)?;
            let src = contribution(Some(staging), repr, payload)?;
            // What optim::step's mean pass multiplies by, rounded apart from
            // the addition as it is there.
            let scale = match opt {
                Optimizer::Mean => optim::inv_workers(u32::from(workers)),
                _ => 1.0,
            };
            match (slot.ncontrib, slot.deferred) {
                (0, _) => {
                    // W = 1: the contribution alone, then the mean's pass.
                    k.copy(Dtype::F32, out, src);
                    let bufs = ChunkBufs {
                        acc: out,
                        params: &mut [],
                        s1: &mut [],
                        s2: &mut [],
                    };
                    optim::step(opt, u32::from(workers), repr.round, bufs);
                }
                // Streaming stores: the result region is read next by the
                // ranks' processes, not by this lcore, and a round's
                // results outgrow the cache for models of any size.
                (_, Some(first)) => k.sum_f32_stream(out, staged(staging, first)?, src, scale),
                (_, None) => {
                    k.sum_f32_stream(out, bytemuck::cast_slice(slot.mem.acc_mut(blocks)), src, scale)
                }
            }
            slot.contributed.insert(repr.rank);
            slot.ncontrib += 1;
            slot.close(workers);
            return Ok(Step::Closed);
        }
        let staging = shm.staging();
        let src = contribution(Some(staging), repr, payload)?;
        match (slot.ncontrib, slot.deferred) {
            (0, _) => k.copy(Dtype::F32, slot.mem.acc_mut(blocks), src),
            (_, Some(first)) => k.sum_f32(slot.mem.acc_mut(blocks), staged(staging, first)?, src, 1.0),
            (_, None) => k.add(Dtype::F32, slot.mem.acc_mut(blocks), src),
        }
        slot.deferred = None;
        slot.contributed.insert(repr.rank);
        slot.ncontrib += 1;
        Ok(Step::Open)
    }
}
