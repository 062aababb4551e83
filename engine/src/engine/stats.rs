//! What a job did on this lcore: its counters ([`JobCounters`]) and the
//! stats read from them on request ([`JobShardStats`]).

use super::Shard;

/// What a job did on one lcore, counted as packets are handled (by the
/// lcore's thread alone) and read on request ([`Shard::job_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct JobCounters {
    /// Contributions aggregated on this lcore.
    pub(super) pushes: u64,
    /// Rounds completed on this lcore, over all slots.
    pub(super) rounds: u64,
    /// Not BSP: the largest lead an answer allowed (clock answered + 1 -
    /// the slot's slowest clock then), 0 before any.
    pub(super) max_lead: u32,
    /// Bounded delay: answers held now.
    pub(super) held: u64,
    /// Bounded delay: answers ever held.
    pub(super) held_total: u64,
    /// Bounded delay: how long the released answers were held in total
    /// (µs of the caller's clock).
    pub(super) held_wait_us: u64,
    /// Bounded delay: the longest any released answer was held, µs.
    pub(super) held_wait_max_us: u64,
}

/// One job as one lcore sees it (for stats; computed on request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobShardStats {
    /// Job id.
    pub id: u16,
    /// Contributions aggregated.
    pub pushes: u64,
    /// Rounds completed over all slots.
    pub rounds_completed: u64,
    /// Lowest and highest last-completed round over the slots that have one.
    pub round_range: Option<(u32, u32)>,
    /// When each rank was last heard from (caller's clock; 0 if never).
    pub last_seen: Vec<u64>,
    /// Not BSP: per rank, its lowest and highest applied clock over the
    /// job's slots here (empty for BSP, or without slots).
    pub clocks: Vec<(u32, u32)>,
    /// Not BSP: the largest lead an answer allowed here (None before any).
    pub max_lead: Option<u32>,
    /// Bounded delay: answers held now.
    pub held: u64,
    /// Bounded delay: answers held since the job was installed here.
    pub held_total: u64,
    /// Bounded delay: microseconds the released answers were held, summed.
    pub held_wait_us: u64,
    /// Bounded delay: the longest any released answer was held, µs.
    pub held_wait_max_us: u64,
    /// A replicated job: its epoch and state copies here (PROTOCOL.md
    /// §11.7).
    pub copies: Option<phub_proto::api::CopyProgress>,
    /// Its tables' rows on this lcore (PROTOCOL.md §10), in key order.
    pub tables: Vec<phub_proto::api::TableLive>,
}

impl<A: Copy + Eq> Shard<A> {
    /// Stats of every installed job. Allocates; call between bursts.
    pub fn job_stats(&self) -> Vec<JobShardStats> {
        self.jobs
            .iter()
            .map(|j| {
                let done = j.slots.iter().filter_map(|s| s.completed.get());
                let round_range = done.fold(None, |acc: Option<(u32, u32)>, r| {
                    Some(acc.map_or((r, r), |(lo, hi)| (lo.min(r), hi.max(r))))
                });
                let w = usize::from(j.workers);
                let clocks = if j.clocks.is_empty() {
                    Vec::new()
                } else {
                    (0..w)
                        .map(|r| {
                            let mine = j.clocks.iter().skip(r).step_by(w).map(|c| c.applied());
                            mine.fold((u32::MAX, 0), |(lo, hi), c| (lo.min(c), hi.max(c)))
                        })
                        .collect()
                };
                JobShardStats {
                    id: j.id,
                    pushes: j.counters.pushes,
                    rounds_completed: j.counters.rounds,
                    round_range,
                    last_seen: j.last_seen.clone(),
                    clocks,
                    max_lead: (j.counters.max_lead > 0).then_some(j.counters.max_lead),
                    held: j.counters.held,
                    held_total: j.counters.held_total,
                    held_wait_us: j.counters.held_wait_us,
                    held_wait_max_us: j.counters.held_wait_max_us,
                    copies: j.replica.as_ref().map(|r| r.copy_progress()),
                    tables: j
                        .tables
                        .iter()
                        .map(|t| {
                            let s = t.store.stats();
                            phub_proto::api::TableLive {
                                key: t.key,
                                rows_stored: s.rows_stored,
                                created: s.created,
                                evicted_cap: s.evicted_cap,
                                evicted_idle: s.evicted_idle,
                                updates: s.updates,
                                lookups: s.lookups,
                                not_admitted: s.not_admitted,
                                no_memory: s.no_memory,
                                bytes: s.bytes,
                                blocks_made_on_lcore: s.blocks_made_on_lcore,
                            }
                        })
                        .collect(),
                }
            })
            .collect()
    }
}
