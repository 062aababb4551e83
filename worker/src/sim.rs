//! The worker's transport ([`crate::transport`]) for the whole-system
//! simulator (`phub-sim`), behind the `sim` feature: the same state
//! machine the I/O thread drives, with requests encoded as the worker's
//! API encodes them (one datagram per chunk, PROTOCOL.md §4) and results
//! decoded to `f32`.
//!
//! Layer: test support over the sans-IO transport. It adds no behaviour:
//! every method is one call of [`crate::transport::Transport`], and a
//! request's datagrams are made as [`crate::Worker`]'s `messages` makes
//! them. Not part of the public API without the feature.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use phub_proto::failover::EpochView;
use phub_proto::layout::ChunkRange;
use phub_proto::wire::{Header, MsgType, Repr, HEADER_LEN};
use phub_proto::Dtype;

use crate::config::WorkerConfig;
use crate::elem::Values;
use crate::error::WorkerError;
use crate::stats::Counters;
use crate::stats::WorkerStats;
use crate::transport::{ChunkMsg, JobInfo, Kind, Request, Routing, Sink, Transport, Tx};

/// One chunk of a key as the join answer places it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimChunk {
    /// Chunk index within the key.
    pub chunk: u32,
    /// Slot on the owning lcore.
    pub slot: u32,
    /// First element of the chunk within the key.
    pub offset: usize,
    /// Elements of the chunk.
    pub len: u32,
    /// The owning lcore (its index in the join answer's list).
    pub lcore: u16,
    /// The owning lcore's address.
    pub to: SocketAddr,
}

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimKind {
    /// Round 0: INIT (the values are rank 0's; other ranks send none).
    Init,
    /// Round (or clock) >= 1: PUSH of a gradient.
    Push,
    /// The last completed result, any round.
    Pull,
}

/// A request that ended.
#[derive(Debug)]
pub struct SimDone {
    /// The tag the request was submitted with.
    pub tag: u64,
    /// The key.
    pub key: u32,
    /// The round of the result and its values (decoded to `f32`), or why
    /// there is none.
    pub result: Result<(u32, Vec<f32>), WorkerError>,
}

/// One rank's transport, driven by the simulator's clock.
#[derive(Debug)]
pub struct SimTransport {
    t: Transport<u64>,
    stats: Arc<Counters>,
    job: u16,
    token: u64,
    rank: u16,
    dtype: Dtype,
}

impl SimTransport {
    /// A transport for rank `rank` of job `job` (`token`, `dtype`) with
    /// `window` chunks outstanding at most and `config`'s timers;
    /// `in_order` is false for a hierarchical job. `now` starts its clock.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        job: u16,
        token: u64,
        rank: u16,
        dtype: Dtype,
        in_order: bool,
        window: usize,
        config: &WorkerConfig,
        now: Instant,
    ) -> SimTransport {
        let stats = Arc::new(Counters::default());
        let info = JobInfo {
            job,
            token,
            rank,
            dtype,
            in_order,
        };
        SimTransport {
            t: Transport::new(info, window, config, Arc::clone(&stats), None, now),
            stats,
            job,
            token,
            rank,
            dtype,
        }
    }

    /// Routes every chunk of a replicated job by epoch (PROTOCOL.md
    /// §11.6), as a join answer with `replication` sets it: the job's
    /// `runs` (one per lcore, appliance by appliance), `per_appliance[a]`
    /// of them on appliance `a`, at `lcores` (one address per run), key
    /// `k`'s chunk 0 being chunk `key_first[k]` of the job's sequence,
    /// `replicas` copies over appliances in `racks`, in `epoch`. Set
    /// before the first request; says what disagrees.
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

    /// A hierarchical job's rack (PROTOCOL.md §11.11), after
    /// [`SimTransport::set_replication`], as a join answer's
    /// `replication.rack` sets it: at epoch 0 every chunk goes to
    /// appliance `appliance`, where its rack layout's `runs` place it.
    pub fn set_rack(&mut self, appliance: usize, runs: Vec<ChunkRange>) -> Result<(), String> {
        self.t.set_rack(appliance, runs)
    }

    /// The epoch to ask control for, at least, if the transport wants one
    /// (taken: asked once; [`SimTransport::set_epoch`] answers it).
    pub fn poll_epoch(&mut self) -> Option<u32> {
        self.t.poll_epoch()
    }

    /// The epoch held (a replicated job's; `None` for any other).
    pub fn epoch(&self) -> Option<&EpochView> {
        self.t.epoch()
    }

    /// Control serves `view` (fetched at `now`): a newer epoch re-addresses
    /// every chunk in flight; returns how many were sent again.
    pub fn set_epoch(&mut self, now: Instant, view: EpochView) -> usize {
        self.t.set_epoch(now, view)
    }

    /// Control answered that job `job` failed (`message`, its reason):
    /// every request in flight ends with [`WorkerError::JobFailed`], as
    /// the I/O thread ends them when its epoch fetch hears so.
    pub fn job_failed(&mut self, message: &str) {
        let job = self.job;
        self.t.epoch_unavailable(|| WorkerError::JobFailed {
            job,
            url: "simulated control".to_string(),
            message: message.to_string(),
        });
    }

    /// Submits a request of `kind` for every chunk in `chunks` of `key`
    /// (`elements` long) in `round`, carrying `values` (the key's, encoded
    /// into the job's dtype; `None`: no payload, as for a PULL or another
    /// rank's INIT), tagged `tag`.
    #[allow(clippy::too_many_arguments)]
    pub fn submit(
        &mut self,
        now: Instant,
        tag: u64,
        key: u32,
        elements: usize,
        round: u32,
        kind: SimKind,
        chunks: &[SimChunk],
        values: Option<&[f32]>,
    ) {
        let size = self.dtype.size();
        let count = |c: &SimChunk| values.map_or(0, |_| c.len as usize);
        let total: usize = chunks.iter().map(|c| HEADER_LEN + count(c) * size).sum();
        let mut buf = vec![0u8; total];
        let mut start = 0;
        let msg_type = match kind {
            SimKind::Init => MsgType::Init,
            SimKind::Push => MsgType::Push,
            SimKind::Pull => MsgType::Pull,
        };
        let msgs = chunks
            .iter()
            .map(|c| {
                let n = count(c);
                let bytes = HEADER_LEN + n * size;
                // Cast: a chunk's elements fit the header's u16 count
                // (checked at join), as the worker's `chunk_repr` says.
                #[allow(clippy::cast_possible_truncation)]
                let repr = Repr::request(msg_type, self.job, self.token, self.rank, round, c.slot)
                    .with_payload(self.dtype, n as u16)
                    .with_chunk(key, c.chunk);
                let mut h = Header::new_unchecked(&mut buf[start..start + bytes]);
                repr.emit(&mut h);
                if let Some(v) = values {
                    crate::codec::encode(self.dtype, &v[c.offset..c.offset + n], h.payload_mut());
                }
                let m = ChunkMsg {
                    chunk: c.chunk,
                    slot: c.slot,
                    offset: c.offset,
                    len: c.len,
                    to: c.to,
                    lcore: c.lcore,
                    start,
                    bytes,
                };
                start += bytes;
                m
            })
            .collect();
        let kind = match kind {
            SimKind::Init => Kind::Init,
            SimKind::Push => Kind::Push,
            SimKind::Pull => Kind::Pull,
        };
        self.t.submit(
            now,
            Request {
                key,
                round,
                kind,
                chunks: msgs,
                tx: Tx::Owned(buf),
                sink: Sink::Owned(Values::F32(vec![f32::NAN; elements])),
                done: tag,
            },
        );
    }

    /// What to send at `now`: (destination, datagram) pairs, appended to `out`.
    pub fn poll_transmit(&mut self, now: Instant, out: &mut Vec<(SocketAddr, Vec<u8>)>) {
        let mut d = Vec::new();
        self.t.poll_transmit(now, &mut d);
        out.extend(d.iter().map(|d| {
            let mut b = Vec::with_capacity(d.head.len() + d.body.len());
            b.extend_from_slice(d.head);
            b.extend_from_slice(d.body);
            (d.to, b)
        }));
    }

    /// When [`SimTransport::handle_timeout`] is next due (`None`: idle).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.t.poll_timeout()
    }

    /// Runs the timers at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.t.handle_timeout(now);
    }

    /// Whether a silence went on long enough for the lcores to be probed
    /// since the last call (the I/O thread then has the row transport
    /// check its idle tables: `SimRowTransport::check_idle_tables`).
    pub fn take_stall(&mut self) -> bool {
        self.t.take_stall()
    }

    /// Handles a datagram received at `now` from `from`.
    pub fn handle_datagram(&mut self, now: Instant, from: SocketAddr, d: &[u8]) {
        if let Some(m) = self.t.accept(Some(from), d) {
            self.t.handle(now, m);
        }
    }

    /// The next request that ended, if any.
    pub fn poll_done(&mut self) -> Option<SimDone> {
        let f = self.t.poll_done()?;
        let result = f.result.map(|o| {
            let v = match o.sink {
                Sink::Owned(Values::F32(v)) => v,
                // `submit` makes every sink an owned f32 buffer.
                other => unreachable!("a simulated request's sink is owned f32, not {other:?}"),
            };
            (o.round, v)
        });
        Some(SimDone {
            tag: f.done,
            key: f.key,
            result,
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
