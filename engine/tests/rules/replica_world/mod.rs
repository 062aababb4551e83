//! A hand-wired replicated job, shared by the replica tests
//! (`replica_rules.rs`, `failover_rules.rs`, `rereplication_rules.rs`): every lcore of every
//! appliance is a [`Shard`], datagrams between them and the workers go
//! through one seeded network that loses, duplicates and reorders them,
//! and the workers run BSP rounds with retransmission, each chunk sent
//! where [`ReplicaLayout::serve`] says it is served in the workers' epoch
//! (PROTOCOL.md §11.6), with that epoch in the header. An appliance marked
//! dead neither sends nor receives; one brought back is installed anew,
//! empty ([`World::reinstall`], §11.7).

#![allow(dead_code, unused_imports)]

pub(crate) use std::collections::HashMap;
pub(crate) use std::net::{Ipv4Addr, SocketAddrV4};
pub(crate) use std::sync::Arc;

pub(crate) use phub_engine::engine::{hierarchy_plan, replica_plan, replica_plan_at, ReplicaInstall};
pub(crate) use phub_engine::kernels::Kernels;
pub(crate) use phub_engine::{InstallKind, JobInstall, Shard, Verdict};
pub(crate) use phub_proto::api::{DataAddr, Hierarchy, InstallJob, RackPeer};
pub(crate) use phub_proto::checkpoint::SlotState;
pub(crate) use phub_proto::failover::{EpochView, ReplicaLayout};
pub(crate) use phub_proto::layout::Layout;
pub(crate) use phub_proto::layout::{ChunkRange, Chunks, SlotChunk};
pub(crate) use phub_proto::replica::{self, backup_runs, replica_set, ReplicaMsgType};
pub(crate) use phub_proto::spec::{Appliances, Consistency, JobSpec, Optimizer};
pub(crate) use phub_proto::wire::{self, flags, DropReason, MsgType, Repr};
pub(crate) use phub_proto::Dtype;

pub(crate) const JOB: u16 = 7;
pub(crate) const TOKEN: u64 = 0x5eed_0f4e_11ca_5eed;
pub(crate) const MS: u64 = 1_000_000;

/// A seeded generator (SplitMix64): the same faults for the same seed.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub(crate) fn value(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
    }
}

/// What the network does to datagrams.
#[derive(Clone, Copy)]
pub(crate) struct Faults {
    /// Chance each copy of a replication message (REPLICATE, ACK) is lost.
    pub(crate) replica_loss: f64,
    /// Chance any other datagram is lost.
    pub(crate) loss: f64,
    /// Chance a datagram is sent twice.
    pub(crate) dup: f64,
}

/// No fault at all.
pub(crate) const CLEAN: Faults = Faults {
    replica_loss: 0.0,
    loss: 0.0,
    dup: 0.0,
};

/// Per (rank, chunk): its values in a round.
pub(crate) type Values = HashMap<(u16, u64), Vec<f32>>;

/// Per (rank, chunk): the last round whose RESULT the rank holds, and its
/// payload ([`World::got`]).
pub(crate) type Got = HashMap<(u16, u64), (u32, Vec<u8>)>;

/// Every rank's values of every chunk in `round`, drawn from `seed`: the
/// same in every run.
pub(crate) fn round_values(w: &World, seed: u64, round: u32) -> Values {
    let mut rng = Rng(seed + u64::from(round));
    let mut v = HashMap::new();
    for rank in 0..w.spec.workers as u16 {
        for g in 0..w.total() {
            let n = w.chunk(g).elems as usize;
            v.insert((rank, g), (0..n).map(|_| rng.value()).collect());
        }
    }
    v
}

/// Appliance i's lcore j listens at 10.0.i.1, port 9000 + j.
pub(crate) fn lcore_addr(i: usize, j: usize) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(10, 0, i as u8, 1), 9000 + j as u16)
}

pub(crate) fn worker_addr(rank: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(10, 9, 0, rank as u8 + 1), 5000)
}

pub(crate) struct World {
    pub(crate) spec: JobSpec,
    pub(crate) racks: Vec<String>,
    pub(crate) lcores: Vec<usize>,
    pub(crate) runs: Vec<ChunkRange>,
    /// shards[i][j]: appliance i's lcore j.
    pub(crate) shards: Vec<Vec<Shard<SocketAddrV4>>>,
    /// In flight: (from, to, datagram).
    pub(crate) net: Vec<(SocketAddrV4, SocketAddrV4, Vec<u8>)>,
    pub(crate) rng: Rng,
    pub(crate) faults: Faults,
    pub(crate) now: u64,
    /// Per (rank, chunk): the last round whose RESULT the rank holds, and
    /// its payload.
    pub(crate) got: HashMap<(u16, u64), (u32, Vec<u8>)>,
    /// RESULTs seen leaving a primary, by round.
    pub(crate) results: u64,
    /// Verdicts of every replication message handled.
    pub(crate) verdicts: Vec<Verdict>,
    /// Where chunks are served, by epoch (PROTOCOL.md §11.6).
    pub(crate) layout: ReplicaLayout<String>,
    /// The workers' epoch: where they send, and what their headers say.
    pub(crate) epoch: EpochView,
    /// Per appliance: dead (its datagrams go nowhere, both ways).
    pub(crate) dead: Vec<bool>,
    /// ERRORs the workers received: from, header, header epoch.
    pub(crate) errors: Vec<(SocketAddrV4, Repr, u32)>,
    /// Per appliance index: the last octet of its lcores' host (1; 2 once
    /// a drain moved the index to another appliance, PROTOCOL.md §11.8).
    pub(crate) hosts: Vec<u8>,
    /// An lcore takes every datagram in flight to it before it sends
    /// (a burst, as `recvmmsg` takes them), not one at a time.
    pub(crate) bursts: bool,
    /// REPLICATE_ACK datagrams sent, and the acknowledgements they carried.
    pub(crate) acks_sent: (u64, u64),
    /// A hierarchical job's (PROTOCOL.md §11.11): per appliance (rack), its
    /// rack layout's runs; the workers send to their rack's appliance at
    /// epoch 0. None for a flat job.
    pub(crate) hier: Option<Vec<Vec<ChunkRange>>>,
}

impl World {
    /// Appliances with these lcore counts and rack labels, `spec`'s job
    /// installed on them (epoch 0), its chunks spread over all their
    /// lcores by count.
    pub(crate) fn new(spec: JobSpec, lcores: &[usize], racks: &[&str], seed: u64, faults: Faults) -> World {
        let chunks = Chunks::new(&spec);
        let total = chunks.total();
        let nl: usize = lcores.iter().sum();
        // Runs by count over every lcore, in layout order.
        let runs: Vec<ChunkRange> = backup_runs(
            ChunkRange {
                first: 0,
                count: total,
            },
            nl,
        );
        let appliances = appliance_list(lcores);
        let racks: Vec<String> = racks.iter().map(|r| r.to_string()).collect();
        let mut shards = Vec::new();
        for (i, &l) in lcores.iter().enumerate() {
            let plan = replica_plan(&spec, &runs, &appliances, &racks, i as u16, 0).unwrap();
            assert_eq!(plan.len(), l);
            let mut mine = Vec::new();
            for (j, (slots, rep)) in plan.into_iter().enumerate() {
                let mut s: Shard<SocketAddrV4> = Shard::new(j as u16, Kernels::best());
                s.set_peer_resolver(Arc::new(Some));
                s.install(job(&spec, slots), InstallKind::Replicated(Box::new(rep)))
                    .unwrap();
                mine.push(s);
            }
            shards.push(mine);
        }
        let layout = ReplicaLayout::new(runs.clone(), lcores, racks.clone(), spec.replicas()).unwrap();
        World {
            layout,
            epoch: EpochView::default(),
            dead: vec![false; lcores.len()],
            errors: Vec::new(),
            hosts: vec![1; lcores.len()],
            spec,
            racks,
            lcores: lcores.to_vec(),
            runs,
            shards,
            net: Vec::new(),
            rng: Rng(seed),
            faults,
            now: 1,
            got: HashMap::new(),
            results: 0,
            verdicts: Vec::new(),
            bursts: false,
            acks_sent: (0, 0),
            hier: None,
        }
    }

    /// [`World::new`] for a hierarchical `spec` (`hierarchical_over`, one
    /// rack per appliance, each its own rack label): every appliance
    /// installed as the dataplane installs a rack's part
    /// (`hierarchy_plan`), its rack layout by count over its lcores, the
    /// home layout by count over all (PROTOCOL.md §9.1, §11.11).
    pub(crate) fn new_hier(spec: JobSpec, lcores: &[usize], seed: u64, faults: Faults) -> World {
        let labels: Vec<String> = (0..lcores.len()).map(|i| format!("rack{i}")).collect();
        let names: Vec<&str> = labels.iter().map(String::as_str).collect();
        // The same job flat first: its home layout, replica sets and world.
        let mut flat = spec.clone();
        flat.placement.as_mut().unwrap().hierarchical = false;
        let mut w = World::new(flat, lcores, &names, seed, faults);
        w.spec = spec;
        let total = w.total();
        let layout = |runs: Vec<ChunkRange>| Layout {
            chunk_elems: w.spec.chunk_elems(),
            lcores: runs,
        };
        let rack_runs: Vec<Vec<ChunkRange>> = lcores
            .iter()
            .map(|&l| {
                backup_runs(
                    ChunkRange {
                        first: 0,
                        count: total,
                    },
                    l,
                )
            })
            .collect();
        let racks: Vec<RackPeer> = rack_runs
            .iter()
            .enumerate()
            .map(|(i, runs)| RackPeer {
                name: labels[i].clone(),
                data: DataAddr {
                    host: lcore_addr(i, 0).ip().to_string(),
                    base_port: 9000,
                },
                layout: layout(runs.clone()),
            })
            .collect();
        for (i, &l) in lcores.iter().enumerate() {
            let req = InstallJob {
                id: JOB,
                token: TOKEN,
                spec: w.spec.clone(),
                layout: layout(rack_runs[i].clone()),
                hierarchy: Some(Hierarchy {
                    rack: i as u16,
                    racks: racks.clone(),
                    homes: layout(w.runs.clone()),
                }),
                replication: None,
                entries: None,
            };
            let (_, per_lcore) = hierarchy_plan(&req, l).unwrap();
            w.shards[i] = per_lcore
                .into_iter()
                .enumerate()
                .map(|(j, h)| {
                    assert_eq!(h.replica.is_some(), w.spec.replicas() > 1);
                    let mut s: Shard<SocketAddrV4> = Shard::new(j as u16, Kernels::best());
                    s.set_peer_resolver(Arc::new(Some));
                    let slots = Chunks::new(&w.spec).iter(rack_runs[i][j].range()).collect();
                    let rack = JobInstall {
                        optimizer: Optimizer::Sum,
                        ..job(&w.spec, slots)
                    };
                    s.install(rack, InstallKind::Hierarchical(Box::new(h))).unwrap();
                    s
                })
                .collect();
        }
        w.hier = Some(rack_runs);
        w
    }

    /// Where rank `rank` sends chunk g: its rack's appliance, lcore and
    /// rack slot while the job is hierarchical (a hierarchical world at
    /// epoch 0), else where the workers' epoch serves it.
    pub(crate) fn route(&self, rank: u16, g: u64) -> (usize, usize, u32) {
        if let Some(racks) = self.hier.as_ref().filter(|_| self.epoch.epoch == 0) {
            let r = self
                .spec
                .rack_ranks()
                .unwrap()
                .iter()
                .position(|ranks| ranks.contains(&rank))
                .unwrap();
            let (j, slot) = replica::place(&racks[r], g).unwrap();
            return (r, j, slot as u32);
        }
        let s = self.layout.serve(g, &self.epoch).unwrap();
        (s.appliance, s.lcore, s.slot as u32)
    }

    /// Whether a RESULT of epoch `epoch` left a rack slot (a hierarchical
    /// job's, before its first epoch change).
    fn is_rack_result(&self, epoch: u32) -> bool {
        self.hier.is_some() && epoch == 0
    }

    /// Appliance i, declared down before, back in `view` (which names it
    /// joined): installed anew, empty, as control installs it (§11.7).
    pub(crate) fn reinstall(&mut self, i: usize, view: &EpochView) {
        self.install_anew(i, view, None);
    }

    /// Every appliance restarted (a power cut) and installed again at the
    /// job's epoch from a checkpoint of each of its lcores taken now (its
    /// primary slots), as control takes a job every replica of some part
    /// of which lost its state back to its checkpoints.
    pub(crate) fn restore_all_from_checkpoints(&mut self) {
        let saved: Vec<Vec<Vec<SlotState>>> = self
            .shards
            .iter()
            .map(|a| a.iter().map(|s| s.snapshot(JOB).unwrap()).collect())
            .collect();
        let view = self.epoch.clone();
        for (i, saved) in saved.iter().enumerate() {
            self.install_anew(i, &view, Some(saved));
        }
    }

    fn install_anew(&mut self, i: usize, view: &EpochView, saved: Option<&[Vec<SlotState>]>) {
        let appliances: Vec<(Ipv4Addr, u16, u16)> = appliance_list(&self.lcores)
            .into_iter()
            .enumerate()
            .map(|(a, (_, port, l))| (*self.at(a, 0).ip(), port, l))
            .collect();
        let plan = replica_plan_at(&self.spec, &self.runs, &appliances, &self.racks, i as u16, view).unwrap();
        let mut mine = Vec::new();
        for (j, (slots, rep)) in plan.into_iter().enumerate() {
            assert!(
                saved.is_some() || slots.is_empty(),
                "an appliance back serves nothing at first"
            );
            let mut s: Shard<SocketAddrV4> = Shard::new(j as u16, Kernels::best());
            s.set_peer_resolver(Arc::new(Some));
            s.install(job(&self.spec, slots), InstallKind::Replicated(Box::new(rep)))
                .unwrap();
            if let Some(saved) = saved {
                s.restore(JOB, &saved[j]).unwrap();
            }
            mine.push(s);
        }
        self.shards[i] = mine;
        self.dead[i] = false;
    }

    /// Every rank pulls every chunk from where the workers' epoch serves
    /// it (what a worker does after a restored lcore said `ahead`), and
    /// the answers are taken.
    pub(crate) fn pull_all(&mut self) {
        for rank in 0..self.spec.workers as u16 {
            for g in 0..self.total() {
                let (i, j, slot) = self.route(rank, g);
                let c = self.chunk(g);
                let repr = Repr::request(MsgType::Pull, JOB, TOKEN, rank, 0, slot)
                    .with_payload(self.spec.dtype, 0)
                    .with_chunk(c.key, c.chunk);
                let mut d = repr.to_datagram(&[]);
                wire::Header::new_unchecked(&mut d[..]).set_epoch(self.epoch.epoch);
                let to = self.at(i, j);
                self.send(worker_addr(rank), to, d);
            }
        }
        self.run();
    }

    /// Appliance index i's lcore j's address now (its host moves with a
    /// drain).
    pub(crate) fn at(&self, i: usize, j: usize) -> SocketAddrV4 {
        let a = lcore_addr(i, j);
        let o = a.ip().octets();
        SocketAddrV4::new(Ipv4Addr::new(o[0], o[1], o[2], self.hosts[i]), a.port())
    }

    /// Whether the job is async or bounded delay (PROTOCOL.md §11.10).
    pub(crate) fn clocked(&self) -> bool {
        self.spec.consistency != Consistency::Sync
    }

    pub(crate) fn total(&self) -> u64 {
        self.runs.iter().map(|r| r.count).sum()
    }

    /// Appliance and lcore of layout entry `l`.
    pub(crate) fn entry(&self, l: usize) -> (usize, usize) {
        let mut at = l;
        for (i, &n) in self.lcores.iter().enumerate() {
            if at < n {
                return (i, at);
            }
            at -= n;
        }
        unreachable!("entry {l}")
    }

    /// Chunk g's primary: appliance, lcore, slot.
    pub(crate) fn primary(&self, g: u64) -> (usize, usize, u32) {
        let (l, slot) = replica::place(&self.runs, g).unwrap();
        let (i, j) = self.entry(l);
        (i, j, slot as u32)
    }

    pub(crate) fn chunk(&self, g: u64) -> SlotChunk {
        Chunks::new(&self.spec).iter(g..g + 1).next().unwrap()
    }

    /// The appliances backing up appliance i's chunks.
    pub(crate) fn backups_of(&self, i: usize) -> Vec<usize> {
        replica_set(&self.racks, i, self.spec.replicas())[1..].to_vec()
    }

    pub(crate) fn send(&mut self, from: SocketAddrV4, to: SocketAddrV4, d: Vec<u8>) {
        let appliance = |a: &SocketAddrV4| (a.ip().octets()[1] == 0).then(|| usize::from(a.ip().octets()[2]));
        if [appliance(&from), appliance(&to)]
            .into_iter()
            .flatten()
            .any(|i| self.dead[i])
        {
            return;
        }
        let replication = replica::is_replica_message(&d);
        let loss = if replication {
            self.faults.replica_loss
        } else {
            self.faults.loss
        };
        if self.rng.chance(loss) {
            return;
        }
        if self.rng.chance(self.faults.dup) {
            self.net.push((from, to, d.clone()));
        }
        self.net.push((from, to, d));
    }

    /// Sends what appliance i's lcore j queued, checking every RESULT
    /// against the backups first.
    pub(crate) fn drain(&mut self, i: usize, j: usize) {
        let from = self.at(i, j);
        let mut out = Vec::new();
        for t in self.shards[i][j].transmits() {
            let mut d = t.header.to_vec();
            d.extend_from_slice(t.payload);
            for to in t.to {
                out.push((to, d.clone()));
            }
        }
        self.shards[i][j].clear_transmits();
        for (to, d) in out {
            if let Ok((r, payload)) = replica::parse(&d) {
                if r.kind == replica::ReplicaMsgType::ReplicateAck {
                    self.acks_sent.0 += 1;
                    self.acks_sent.1 += 1 + replica::acks(payload).count() as u64;
                }
            }
            if !replica::is_replica_message(&d) {
                let (repr, _) = wire::parse(&d).unwrap();
                let epoch = wire::Header::new_unchecked(&d[..]).epoch();
                if repr.kind == MsgType::Result && !self.is_rack_result(epoch) {
                    let rank = u16::from(to.ip().octets()[3]) - 1;
                    self.check_backups_hold(i, j, repr.slot, repr.round, rank);
                }
                if repr.kind == MsgType::PartialResult {
                    // A home slot's result to a rack (PROTOCOL.md §11.11;
                    // its slot is the rack's).
                    let g = (0..self.total())
                        .find(|&g| {
                            let c = self.chunk(g);
                            (c.key, c.chunk) == (repr.key, repr.chunk)
                        })
                        .unwrap();
                    self.check_chunk_held(i, g, repr.round, 0);
                }
            }
            self.send(from, to, d);
        }
    }

    /// Chunk served at appliance i's lcore j, slot `slot`: its own slot,
    /// else an adopted one in the workers' epoch.
    pub(crate) fn served_chunk(&self, i: usize, j: usize, slot: u32) -> u64 {
        let l: usize = self.lcores[..i].iter().sum::<usize>() + j;
        let run = self.runs[l];
        if u64::from(slot) < run.count {
            return run.first + u64::from(slot);
        }
        (0..self.total())
            .find(|&g| {
                self.layout
                    .serve(g, &self.epoch)
                    .is_some_and(|s| (s.appliance, s.lcore, s.slot) == (i, j, u64::from(slot)))
            })
            .unwrap_or_else(|| panic!("appliance {i} lcore {j} slot {slot} serves no chunk"))
    }

    /// The rule under test: a RESULT of `round` for slot `slot` of
    /// appliance i's lcore j leaves only once every backup of the chunk
    /// after i in its set in the workers' epoch (§11.7: down ones out,
    /// those back at the end, new ones counted) completed it.
    /// In an async or bounded-delay job (§11.10) `round` is rank `rank`'s
    /// clock, which every such backup must have applied.
    fn check_backups_hold(&mut self, i: usize, j: usize, slot: u32, round: u32, rank: u16) {
        let g = self.served_chunk(i, j, slot);
        self.check_chunk_held(i, g, round, rank);
    }

    /// [`World::check_backups_hold`] of chunk g.
    fn check_chunk_held(&mut self, i: usize, g: u64, round: u32, rank: u16) {
        self.results += 1;
        let home = self.layout.home(g).unwrap();
        let set = self.layout.set_in(home, &self.epoch);
        let Some(after) = set.iter().position(|&a| a == i) else {
            // A primary fenced in an older epoch: only a round every
            // replica holds can leave it (§11.6 rule 4), checked by the
            // tests that make one.
            return;
        };
        for &b in &set[after + 1..] {
            let held = self.shards[b]
                .iter()
                .find_map(|s| s.backup_state(JOB, g))
                .unwrap_or_else(|| panic!("appliance {b} keeps no backup of chunk {g}"));
            if self.clocked() && held.round.is_none() {
                // Awaiting its state copy (a restore's): never adopted.
                continue;
            }
            if self.clocked() && held.round.is_some_and(|t| t > 0) {
                let applied = held.clocks[usize::from(rank)] & !phub_proto::checkpoint::CLOCK_HELD;
                assert!(
                    applied >= round,
                    "a RESULT of clock {round} of chunk {g} left appliance {i} for rank {rank} while its backup \
                     {b} applied its clock {applied}"
                );
                continue;
            }
            assert!(
                held.round.is_some_and(|r| r >= round),
                "a RESULT of round {round} of chunk {g} left appliance {i} while its backup {b} holds round {:?}",
                held.round
            );
        }
    }

    /// Delivers what is in flight, in a random order, until nothing is.
    pub(crate) fn run(&mut self) {
        while self.step() {}
    }

    /// Delivers one datagram in flight, picked at random; false when none is.
    pub(crate) fn step(&mut self) -> bool {
        {
            if self.net.is_empty() {
                return false;
            }
            let k = self.rng.below(self.net.len());
            let (from, to, d) = self.net.swap_remove(k);
            if to.ip().octets()[1] == 9 {
                self.deliver_to_worker(from, to, &d);
                return true;
            }
            let i = to.ip().octets()[2] as usize;
            let j = usize::from(to.port() - 9000);
            if to.ip().octets()[3] != self.hosts[i] {
                // To an appliance a drain took the index from: gone.
                return true;
            }
            let mut burst = vec![(from, d)];
            if self.bursts {
                let mut k = 0;
                while k < self.net.len() {
                    if self.net[k].1 == to {
                        let (f, _, d) = self.net.remove(k);
                        burst.push((f, d));
                    } else {
                        k += 1;
                    }
                }
            }
            for (from, d) in burst {
                let v = self.shards[i][j].handle(from, &d, self.now);
                if replica::is_replica_message(&d) {
                    self.verdicts.push(v);
                }
            }
            self.drain(i, j);
            self.now += 1_000;
        }
        true
    }

    /// A datagram reaches worker `to` from appliance lcore `from`.
    fn deliver_to_worker(&mut self, from: SocketAddrV4, to: SocketAddrV4, d: &[u8]) {
        let (repr, payload) = wire::parse(d).unwrap();
        if repr.kind == MsgType::Error {
            let epoch = wire::Header::new_checked(d).unwrap().epoch();
            self.errors.push((from, repr, epoch));
            return;
        }
        assert_eq!(repr.kind, MsgType::Result, "{repr:?}");
        let rank = u16::from(to.ip().octets()[3]) - 1;
        let i = from.ip().octets()[2] as usize;
        let j = usize::from(from.port() - 9000);
        // A replicated job's RESULT carries its lcore's epoch (PROTOCOL.md
        // §2; a worker drops one older than the epoch the job last went
        // back to its checkpoints at, §11.7).
        let installed = self.shards[i][j]
            .job_stats()
            .iter()
            .find(|s| s.id == JOB)
            .and_then(|s| s.copies.as_ref().map(|c| c.epoch));
        assert_eq!(
            Some(wire::Header::new_checked(d).unwrap().epoch()),
            // (A job without replicas, a hierarchical world's reference:
            // epoch 0.)
            installed.or(self.hier.as_ref().map(|_| 0)),
            "a RESULT from appliance {i} lcore {j}"
        );
        let epoch = wire::Header::new_checked(d).unwrap().epoch();
        let g = match &self.hier {
            Some(racks) if self.is_rack_result(epoch) => racks[i][j].first + u64::from(repr.slot),
            _ => self.served_chunk(i, j, repr.slot),
        };
        let c = self.chunk(g);
        assert_eq!((repr.key, repr.chunk), (c.key, c.chunk));
        let clocked = self.clocked();
        match self.got.get(&(rank, g)) {
            // A round is answered with one result, however often (not a
            // clock: a copy of a push is answered with the values then,
            // PROTOCOL.md §5.8 rule 1).
            Some((r, p)) if *r == repr.round && !clocked => {
                assert_eq!(p, payload, "chunk {g}, round {r}: two different RESULTs")
            }
            Some((r, _)) if *r == repr.round => {}
            Some((r, _)) if *r > repr.round => {}
            _ => {
                self.got.insert((rank, g), (repr.round, payload.to_vec()));
            }
        }
    }

    pub(crate) fn poll(&mut self) {
        for i in 0..self.shards.len() {
            for j in 0..self.shards[i].len() {
                self.shards[i][j].poll_timers(self.now);
                self.drain(i, j);
            }
        }
    }
}

/// Appliance i's data address, base port and lcore count.
pub(crate) fn appliance_list(lcores: &[usize]) -> Vec<(Ipv4Addr, u16, u16)> {
    lcores
        .iter()
        .enumerate()
        .map(|(i, &l)| (*lcore_addr(i, 0).ip(), 9000, l as u16))
        .collect()
}

pub(crate) fn job(spec: &JobSpec, slots: Vec<SlotChunk>) -> JobInstall {
    JobInstall {
        id: JOB,
        token: TOKEN,
        workers: spec.workers as u16,
        dtype: spec.dtype,
        optimizer: spec.optimizer,
        consistency: spec.consistency,
        chunk_elems: spec.chunk_elems(),
        slots,
    }
}

/// Every (rank, chunk)'s result after each of rounds 0..=`rounds` of
/// `spec` on appliances of `lcores` in `racks`, without fault or
/// failure, the values drawn from `seed` ([`round_values`]).
pub(crate) fn results_without_failure(
    spec: JobSpec,
    lcores: &[usize],
    racks: &[&str],
    rounds: u32,
    seed: u64,
) -> Vec<Got> {
    let mut w = World::new(spec, lcores, racks, 1, CLEAN);
    (0..=rounds)
        .map(|r| {
            seeded_round(&mut w, seed, r);
            w.got.clone()
        })
        .collect()
}

/// Round `r` of every rank with the values drawn from `seed`
/// ([`round_values`]).
pub(crate) fn seeded_round(w: &mut World, seed: u64, r: u32) {
    let v = round_values(w, seed, r);
    round(w, r, &v);
}

/// Installs `view` on every lcore of every appliance not dead (each takes
/// it once: again changes nothing) and sends what it released; the
/// workers take it too.
pub(crate) fn change_epoch(w: &mut World, view: &EpochView) {
    w.epoch = view.clone();
    for i in 0..w.shards.len() {
        if w.dead[i] {
            continue;
        }
        for j in 0..w.shards[i].len() {
            assert_eq!(w.shards[i][j].change_epoch(JOB, view), Ok(true), "appliance {i}");
            assert_eq!(w.shards[i][j].change_epoch(JOB, view), Ok(false));
            w.drain(i, j);
        }
    }
}

/// Round `round` of every rank, every chunk, to its primary (INIT for
/// round 0, rank 0's with values), resent until every RESULT is in.
pub(crate) fn round(w: &mut World, round: u32, values: &Values) {
    let mut sends = 0;
    loop {
        let missing: Vec<(u16, u64)> = every_push(w)
            .into_iter()
            .filter(|k| w.got.get(k).is_none_or(|e| e.0 < round))
            .collect();
        // A rank resends its push of a chunk until it holds the round's
        // RESULT (a resent push of a round the primary completed is
        // answered with its stored result, §5.4 rule 4).
        if missing.is_empty() {
            break;
        }
        assert!(sends < 400, "round {round}: chunks {missing:?} never answered");
        send_and_wait(w, round, values, &missing, sends > 0);
        sends += 1;
    }
}

/// Each of `chunks`' push of `round` sent ([`send_round`], resent when
/// `again`) and what follows delivered, then 30 ms later the timers'
/// resends and what follows them.
pub(crate) fn send_and_wait(w: &mut World, round: u32, values: &Values, chunks: &[(u16, u64)], again: bool) {
    send_round(w, round, values, chunks, again);
    w.run();
    w.now += 30 * MS;
    w.poll();
    w.run();
}

/// After an appliance died during round `round` (`what`, for the
/// messages): `epoch` put on the survivors, what is unanswered of that
/// round resent where the epoch serves it, then every round to `last`,
/// each round's values `values`' and its results `want`'s.
pub(crate) fn go_on_after_failure(
    w: &mut World,
    epoch: &EpochView,
    round: u32,
    last: u32,
    want: &[Got],
    values: impl Fn(&World, u32) -> Values,
    what: &str,
) {
    change_epoch(w, epoch);
    w.run();
    let v = values(w, round);
    self::round(w, round, &v);
    assert_eq!(w.got, want[round as usize], "round {round}, {what}");
    for r in round + 1..=last {
        let v = values(w, r);
        self::round(w, r, &v);
        assert_eq!(w.got, want[r as usize], "round {r}, {what} in round {round}");
    }
}

/// A replication counter of the job summed over every lcore of `shards`.
pub(crate) fn replica_sum(
    shards: &[Vec<Shard<SocketAddrV4>>],
    f: fn(&phub_engine::engine::ReplicaStats) -> u64,
) -> u64 {
    shards
        .iter()
        .flatten()
        .map(|s| f(&s.replica_stats(JOB).unwrap()))
        .sum()
}

/// Every rank's push (INIT for round 0) of each of `chunks` (rank,
/// chunk), where the workers' epoch serves it, with that epoch.
pub(crate) fn send_round(w: &mut World, round: u32, values: &Values, chunks: &[(u16, u64)], again: bool) {
    {
        for &(rank, g) in chunks {
            let (i, j, slot) = w.route(rank, g);
            let c = w.chunk(g);
            let kind = if round == 0 { MsgType::Init } else { MsgType::Push };
            let v: &[f32] = if round == 0 && rank != 0 {
                &[]
            } else {
                &values[&(rank, g)]
            };
            let repr = Repr::request(kind, JOB, TOKEN, rank, round, slot)
                .with_payload(w.spec.dtype, v.len() as u16)
                .with_chunk(c.key, c.chunk)
                .with_flags(if again { flags::RETRANSMIT } else { 0 });
            let mut d = repr.to_datagram(v);
            wire::Header::new_unchecked(&mut d[..]).set_epoch(w.epoch.epoch);
            let to = w.at(i, j);
            w.send(worker_addr(rank), to, d);
        }
    }
}

/// Every rank's push of every chunk: (rank, chunk).
pub(crate) fn every_push(w: &World) -> Vec<(u16, u64)> {
    let total = w.total();
    (0..w.spec.workers as u16)
        .flat_map(|r| (0..total).map(move |g| (r, g)))
        .collect()
}

/// Every rank's push of round `round` sent, `n` datagrams delivered, then
/// appliance `a` is gone (its datagrams go nowhere). False when the round
/// needed fewer than `n` deliveries: every point of it has been a kill
/// point.
pub(crate) fn kill_after(w: &mut World, round: u32, values: &Values, n: usize, a: usize) -> bool {
    let all = every_push(w);
    send_round(w, round, values, &all, false);
    let mut delivered = 0;
    while delivered < n && w.step() {
        delivered += 1;
    }
    if delivered < n {
        return false;
    }
    w.dead[a] = true;
    w.run();
    true
}

/// Every backup of every chunk holds its primary's bits.
pub(crate) fn assert_replicas_equal(w: &World, round: u32) {
    for g in 0..w.total() {
        let (i, j, slot) = w.primary(g);
        let p = w.shards[i][j].primary_state(JOB, slot).unwrap();
        assert_eq!(p.round, Some(round), "chunk {g}'s primary");
        for b in w.backups_of(i) {
            let s = w.shards[b].iter().find_map(|s| s.backup_state(JOB, g)).unwrap();
            assert_eq!(s.round, p.round, "chunk {g}, backup {b}: round");
            assert_eq!(
                s.result, p.result,
                "chunk {g}, backup {b}: stored result, round {round}"
            );
            assert_eq!(s.state.len(), p.state.len());
            for (k, (a, b2)) in p.state.iter().zip(&s.state).enumerate() {
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(a),
                    bits(b2),
                    "chunk {g}, backup {b}: state buffer {k}, round {round}"
                );
            }
        }
    }
}

pub(crate) fn spec(opt: Optimizer, dtype: Dtype, replicas: u32, appliances: u32) -> JobSpec {
    let s = JobSpec::new("rep", 3, &[40, 24, 8, 33])
        .with_optimizer(opt)
        .with_dtype(dtype)
        .with_chunk_bytes(64)
        .sharded_over(Appliances::Count(appliances))
        .with_replicas(replicas);
    s.validate().unwrap();
    s
}

/// Runs `rounds` BSP rounds of `spec` under `faults`; returns the world.
pub(crate) fn train(
    spec: JobSpec,
    lcores: &[usize],
    racks: &[&str],
    seed: u64,
    faults: Faults,
    rounds: u32,
) -> World {
    train_world(World::new(spec, lcores, racks, seed, faults), rounds)
}

/// [`train`] in world `w`.
pub(crate) fn train_world(mut w: World, rounds: u32) -> World {
    let total = w.total();
    for r in 0..=rounds {
        let mut values = HashMap::new();
        for rank in 0..w.spec.workers as u16 {
            for g in 0..total {
                let n = w.chunk(g).elems as usize;
                values.insert((rank, g), (0..n).map(|_| w.rng.value()).collect());
            }
        }
        round(&mut w, r, &values);
        assert_replicas_equal(&w, r);
    }
    assert!(w.errors.is_empty(), "ERRORs: {:?}", w.errors);
    w
}

pub(crate) const LOSSY: Faults = Faults {
    replica_loss: 0.3,
    loss: 0.05,
    dup: 0.2,
};

/// An appliance's state copies of the job as its lcores' stats report
/// them (what control watches, PROTOCOL.md §11.7), over `shards`.
pub(crate) fn copies_of(shards: &[Shard<SocketAddrV4>]) -> phub_proto::api::CopyProgress {
    let mut all: Option<phub_proto::api::CopyProgress> = None;
    for s in shards {
        let c = s
            .job_stats()
            .into_iter()
            .find(|j| j.id == JOB)
            .and_then(|j| j.copies)
            .expect("a replicated job reports its copies");
        match &mut all {
            Some(a) => a.merge(&c),
            None => all = Some(c),
        }
    }
    all.expect("an appliance has lcores")
}
