//! Why a job could not be installed or restored.

use phub_proto::spec::{Consistency, MAX_WORKERS};
use phub_proto::Dtype;

/// Why a job could not be installed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// A job with this id is already installed.
    #[error("job {0} is already installed on this lcore")]
    JobExists(u16),
    /// The worker count is outside 1..=[`MAX_WORKERS`].
    #[error("job {id}: worker count {workers} is outside 1..={max}", max = MAX_WORKERS)]
    BadWorkers {
        /// Job id.
        id: u16,
        /// Worker count given.
        workers: u16,
    },
    /// A checkpoint could not be restored into the job.
    #[error("job {id}: cannot restore the checkpoint: {reason}")]
    Restore {
        /// Job id.
        id: u16,
        /// What did not fit.
        reason: String,
    },
    /// The slot memory allocator had no room for the job's slots; nothing
    /// of the job is installed on this lcore.
    #[error("job {id}: {bytes} bytes of slot memory for {slots} slots do not fit ({from}): {reason}")]
    SlotMemory {
        /// Job id.
        id: u16,
        /// Bytes the job's slots need on this lcore (line padding included).
        bytes: u64,
        /// The job's slots on this lcore.
        slots: usize,
        /// Where slot memory comes from ([`SlotAllocator::describe`](crate::SlotAllocator::describe)).
        from: String,
        /// What the allocator said.
        reason: String,
    },
    /// The job's shared-memory regions could not be created; nothing of the
    /// job is installed on this lcore and no region file is left.
    #[error("job {id}: shared-memory regions not created: {reason}")]
    SharedMemory {
        /// Job id.
        id: u16,
        /// What failed (the file and the system's answer).
        reason: String,
    },
    /// The consistency mode does not go with the rest of the install.
    #[error("job {id}: consistency {mode}: {reason}")]
    Consistency {
        /// Job id.
        id: u16,
        /// The job's consistency mode.
        mode: Consistency,
        /// What does not go with it.
        reason: &'static str,
    },
    /// A slot's element count is zero or does not fit a packet.
    #[error("job {id}: slot {slot} has {elems} elements; accepted: 1..={max} for {dtype}")]
    BadSlot {
        /// Job id.
        id: u16,
        /// Slot index.
        slot: u32,
        /// Elements given.
        elems: u32,
        /// Most elements a packet carries for this dtype.
        max: u32,
        /// The job's dtype.
        dtype: Dtype,
    },
    /// A hierarchical job's install does not fit this shard.
    #[error("job {id}: hierarchical install refused: {reason}")]
    Hierarchy {
        /// Job id.
        id: u16,
        /// What is wrong.
        reason: String,
    },
    /// A replicated job's part cannot be checkpointed on this lcore now
    /// ([`super::Shard::part_snapshot`]); nothing changed.
    #[error("job {id}: no checkpoint of this lcore's part now: {reason}")]
    Checkpoint {
        /// Job id.
        id: u16,
        /// Why not.
        reason: String,
    },
    /// A replicated job's install does not fit this shard.
    #[error("job {id}: replicated install refused: {reason}")]
    Replica {
        /// Job id.
        id: u16,
        /// What is wrong.
        reason: String,
    },
    /// An epoch change refused (PROTOCOL.md §11.6); nothing changed.
    #[error("job {id}: epoch {epoch} refused: {reason}")]
    Epoch {
        /// Job id.
        id: u16,
        /// The epoch offered.
        epoch: u32,
        /// The view disagrees with the job as installed here (not
        /// replicated, an older epoch, another down list for the same
        /// epoch, what is not built) rather than being malformed.
        conflict: bool,
        /// What is wrong, and what would be accepted.
        reason: String,
    },
    /// An epoch change refused because this appliance would serve a part
    /// whose state copy it has not all received, or whose copy may be
    /// behind rounds another member answered in an epoch this lcore
    /// skipped (PROTOCOL.md §11.6, §11.7): no live member surely holds the
    /// part's state, which is lost; nothing changed.
    #[error(
        "job {id}: epoch {epoch} refused: this appliance would serve appliance {part}'s part, {why}: the \
         part is lost (PROTOCOL.md §11.6, §11.7)"
    )]
    PartLost {
        /// Job id.
        id: u16,
        /// The epoch offered.
        epoch: u32,
        /// The part (its home appliance's index in layout order).
        part: usize,
        /// Why its copy here will not do.
        why: &'static str,
    },
    /// More slots than a `u32` slot index can name.
    #[error("job {id}: {slots} slots on one lcore; a slot index is a u32")]
    TooManySlots {
        /// Job id.
        id: u16,
        /// Slots given.
        slots: usize,
    },
    /// A table key of the job cannot be served on this lcore.
    #[error("job {id}: table key {key}: {reason}")]
    Table {
        /// Job id.
        id: u16,
        /// The table's key index.
        key: u32,
        /// The field, its value and what would be accepted.
        reason: String,
    },
}
