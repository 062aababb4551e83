//! Replicas (PROTOCOL.md §11) on hand-wired appliances: every lcore of
//! every appliance is a [`Shard`], datagrams between them and the workers
//! go through one seeded network that loses, duplicates and reorders
//! them, and the workers run BSP rounds with retransmission. After every
//! round each backup's state (round, stored result, parameters and
//! optimizer state) must equal its primary's bit for bit, and no RESULT of
//! a round may leave a primary before every backup of the chunk completed
//! that round.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use phub_engine::engine::{replica_plan, ReplicaInstall};
use phub_engine::kernels::Kernels;
use phub_engine::{InstallKind, JobInstall, Shard, Verdict};
use phub_proto::layout::{ChunkRange, Chunks, SlotChunk};
use phub_proto::replica::{self, backup_runs, replica_set, ReplicaDropReason, ReplicaMsgType};
use phub_proto::spec::{Appliances, Consistency, JobSpec, Optimizer};
use phub_proto::wire::{self, flags, DropReason, MsgType, Repr};
use phub_proto::Dtype;

const JOB: u16 = 7;
const TOKEN: u64 = 0x5eed_0f4e_11ca_5eed;
const MS: u64 = 1_000_000;

/// A seeded generator (SplitMix64): the same faults for the same seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn value(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
    }
}

/// What the network does to datagrams.
#[derive(Clone, Copy)]
struct Faults {
    /// Chance each copy of a replication message (REPLICATE, ACK) is lost.
    replica_loss: f64,
    /// Chance any other datagram is lost.
    loss: f64,
    /// Chance a datagram is sent twice.
    dup: f64,
}

/// Appliance i's lcore j listens at 10.0.i.1, port 9000 + j.
fn lcore_addr(i: usize, j: usize) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(10, 0, i as u8, 1), 9000 + j as u16)
}

fn worker_addr(rank: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(10, 9, 0, rank as u8 + 1), 5000)
}

struct World {
    spec: JobSpec,
    racks: Vec<String>,
    lcores: Vec<usize>,
    runs: Vec<ChunkRange>,
    /// shards[i][j]: appliance i's lcore j.
    shards: Vec<Vec<Shard<SocketAddrV4>>>,
    /// In flight: (from, to, datagram).
    net: Vec<(SocketAddrV4, SocketAddrV4, Vec<u8>)>,
    rng: Rng,
    faults: Faults,
    now: u64,
    /// Per (rank, chunk): the last round whose RESULT the rank holds, and
    /// its payload.
    got: HashMap<(u16, u64), (u32, Vec<u8>)>,
    /// RESULTs seen leaving a primary, by round.
    results: u64,
    /// Verdicts of every replication message handled.
    verdicts: Vec<Verdict>,
}

impl World {
    /// Appliances with these lcore counts and rack labels, `spec`'s job
    /// installed on them (epoch 0), its chunks spread over all their
    /// lcores by count.
    fn new(spec: JobSpec, lcores: &[usize], racks: &[&str], seed: u64, faults: Faults) -> World {
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
        let appliances: Vec<(Ipv4Addr, u16, u16)> = lcores
            .iter()
            .enumerate()
            .map(|(i, &l)| (*lcore_addr(i, 0).ip(), 9000, l as u16))
            .collect();
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
        World {
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
        }
    }

    fn total(&self) -> u64 {
        self.runs.iter().map(|r| r.count).sum()
    }

    /// Appliance and lcore of layout entry `l`.
    fn entry(&self, l: usize) -> (usize, usize) {
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
    fn primary(&self, g: u64) -> (usize, usize, u32) {
        let (l, slot) = replica::place(&self.runs, g).unwrap();
        let (i, j) = self.entry(l);
        (i, j, slot as u32)
    }

    fn chunk(&self, g: u64) -> SlotChunk {
        Chunks::new(&self.spec).iter(g..g + 1).next().unwrap()
    }

    /// The appliances backing up appliance i's chunks.
    fn backups_of(&self, i: usize) -> Vec<usize> {
        replica_set(&self.racks, i, self.spec.replicas())[1..].to_vec()
    }

    fn send(&mut self, from: SocketAddrV4, to: SocketAddrV4, d: Vec<u8>) {
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
    fn drain(&mut self, i: usize, j: usize) {
        let from = lcore_addr(i, j);
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
            if !replica::is_replica_message(&d) {
                let (repr, _) = wire::parse(&d).unwrap();
                if repr.kind == MsgType::Result {
                    self.check_backups_hold(i, j, repr.slot, repr.round);
                }
            }
            self.send(from, to, d);
        }
    }

    /// The rule under test: a RESULT of `round` for primary slot `slot` of
    /// appliance i's lcore j leaves only once every backup completed it.
    fn check_backups_hold(&mut self, i: usize, j: usize, slot: u32, round: u32) {
        self.results += 1;
        let l: usize = self.lcores[..i].iter().sum::<usize>() + j;
        let g = self.runs[l].first + u64::from(slot);
        for b in self.backups_of(i) {
            let held = self.shards[b]
                .iter()
                .find_map(|s| s.backup_state(JOB, g))
                .unwrap_or_else(|| panic!("appliance {b} keeps no backup of chunk {g}"));
            assert!(
                held.round.is_some_and(|r| r >= round),
                "a RESULT of round {round} of chunk {g} left appliance {i} while its backup {b} holds round {:?}",
                held.round
            );
        }
    }

    /// Delivers what is in flight, in a random order, until nothing is.
    fn run(&mut self) {
        while !self.net.is_empty() {
            let k = self.rng.below(self.net.len());
            let (from, to, d) = self.net.swap_remove(k);
            if to.ip().octets()[1] == 9 {
                self.deliver_to_worker(from, to, &d);
                continue;
            }
            let i = to.ip().octets()[2] as usize;
            let j = usize::from(to.port() - 9000);
            let v = self.shards[i][j].handle(from, &d, self.now);
            if replica::is_replica_message(&d) {
                self.verdicts.push(v);
            }
            self.drain(i, j);
            self.now += 1_000;
        }
    }

    /// A datagram reaches worker `to` from appliance lcore `from`.
    fn deliver_to_worker(&mut self, from: SocketAddrV4, to: SocketAddrV4, d: &[u8]) {
        let (repr, payload) = wire::parse(d).unwrap();
        assert_eq!(repr.kind, MsgType::Result, "{repr:?}");
        let rank = u16::from(to.ip().octets()[3]) - 1;
        let i = from.ip().octets()[2] as usize;
        let l = self.lcores[..i].iter().sum::<usize>() + usize::from(from.port() - 9000);
        let g = self.runs[l].first + u64::from(repr.slot);
        let c = self.chunk(g);
        assert_eq!((repr.key, repr.chunk), (c.key, c.chunk));
        match self.got.get(&(rank, g)) {
            Some((r, _)) if *r >= repr.round => {}
            _ => {
                self.got.insert((rank, g), (repr.round, payload.to_vec()));
            }
        }
    }

    fn poll(&mut self) {
        for i in 0..self.shards.len() {
            for j in 0..self.shards[i].len() {
                self.shards[i][j].poll_timers(self.now);
                self.drain(i, j);
            }
        }
    }
}

fn job(spec: &JobSpec, slots: Vec<SlotChunk>) -> JobInstall {
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

/// Round `round` of every rank, every chunk, to its primary (INIT for
/// round 0, rank 0's with values), resent until every RESULT is in.
fn round(w: &mut World, round: u32, values: &HashMap<(u16, u64), Vec<f32>>) {
    let total = w.total();
    let mut sends = 0;
    loop {
        let missing: Vec<(u16, u64)> = (0..w.spec.workers as u16)
            .flat_map(|r| (0..total).map(move |g| (r, g)))
            .filter(|k| w.got.get(k).is_none_or(|e| e.0 < round))
            .collect();
        // A rank resends its push of a chunk until it holds the round's
        // RESULT (a resent push of a round the primary completed is
        // answered with its stored result, §5.4 rule 4).
        if missing.is_empty() {
            break;
        }
        assert!(sends < 400, "round {round}: chunks {missing:?} never answered");
        for (rank, g) in missing {
            let (i, j, slot) = w.primary(g);
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
                .with_flags(if sends > 0 { flags::RETRANSMIT } else { 0 });
            let d = repr.to_datagram(v);
            w.send(worker_addr(rank), lcore_addr(i, j), d);
        }
        sends += 1;
        w.run();
        w.now += 30 * MS;
        w.poll();
        w.run();
    }
}

/// Every backup of every chunk holds its primary's bits.
fn assert_replicas_equal(w: &World, round: u32) {
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

fn spec(opt: Optimizer, dtype: Dtype, replicas: u32, appliances: u32) -> JobSpec {
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
fn train(spec: JobSpec, lcores: &[usize], racks: &[&str], seed: u64, faults: Faults, rounds: u32) -> World {
    let mut w = World::new(spec, lcores, racks, seed, faults);
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
    w
}

const LOSSY: Faults = Faults {
    replica_loss: 0.3,
    loss: 0.05,
    dup: 0.2,
};

#[test]
fn backups_stay_bit_identical_under_loss_duplication_and_reordering() {
    let cases = [
        (
            Optimizer::Sgd {
                lr: 0.1,
                weight_decay: 0.01,
            },
            Dtype::F32,
            2,
        ),
        (
            Optimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
            Dtype::F32,
            3,
        ),
        (
            Optimizer::Momentum {
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 0.0,
            },
            Dtype::Bf16,
            2,
        ),
        (Optimizer::Mean, Dtype::F32, 3),
        (Optimizer::Sum, Dtype::F16, 2),
    ];
    for (seed, (opt, dtype, replicas)) in cases.into_iter().enumerate() {
        let w = train(
            spec(opt, dtype, replicas, 3),
            &[2, 1, 3],
            &["r1", "r2", "r1"],
            seed as u64,
            LOSSY,
            6,
        );
        // The faults happened and were survived.
        let stats: Vec<_> = w
            .shards
            .iter()
            .flatten()
            .map(|s| s.replica_stats(JOB).unwrap())
            .collect();
        let sum = |f: fn(&phub_engine::engine::ReplicaStats) -> u64| stats.iter().map(f).sum::<u64>();
        assert!(
            sum(|s| s.replicates_resent) > 0,
            "{opt:?}: no REPLICATE was resent"
        );
        assert!(sum(|s| s.acks_resent) > 0, "{opt:?}: no ACK was sent again");
        // Each (chunk, round) applied once on each backup.
        let chunks = w.total();
        assert_eq!(
            sum(|s| s.rounds_applied),
            chunks * 7 * (u64::from(replicas) - 1),
            "{opt:?}"
        );
        assert_eq!(sum(|s| s.rounds_replicated), chunks * 7, "{opt:?}");
        assert!(w.results > 0);
    }
}

/// With one replica nothing is replicated: the round completes at the
/// last push, as on an appliance without replicas.
#[test]
fn one_replica_completes_at_the_last_push() {
    let mut w = train(
        spec(
            Optimizer::Sgd {
                lr: 0.1,
                weight_decay: 0.0,
            },
            Dtype::F32,
            1,
            2,
        ),
        &[1, 2],
        &["", ""],
        9,
        Faults {
            replica_loss: 0.0,
            loss: 0.0,
            dup: 0.0,
        },
        3,
    );
    for s in w.shards.iter().flatten() {
        assert_eq!(s.replica_stats(JOB).unwrap(), Default::default());
    }
    // Nor is a replication message taken.
    let c = w.chunk(0);
    let ack = replica::ReplicaRepr {
        kind: ReplicaMsgType::ReplicateAck,
        dtype: Dtype::F32,
        flags: 0,
        token: TOKEN,
        job: JOB,
        from: 1,
        count: 0,
        round: 4,
        slot: 0,
        key: c.key,
        chunk: c.chunk,
        epoch: 0,
    };
    let s = &mut w.shards[0][0];
    assert_eq!(
        s.handle(lcore_addr(1, 0), &ack.to_bytes(), w.now),
        Verdict::Dropped(DropReason::WrongPeer)
    );
}

/// A primary whose REPLICATEs are all lost answers nobody: the round is
/// held (a PULL gets the previous round, a resent push nothing) until the
/// resends get through; then every backup has it before any RESULT.
#[test]
fn a_round_is_held_until_every_backup_acknowledged() {
    let sp = spec(
        Optimizer::Sgd {
            lr: 0.5,
            weight_decay: 0.0,
        },
        Dtype::F32,
        3,
        3,
    );
    let mut w = World::new(
        sp,
        &[1, 1, 1],
        &["", "", ""],
        3,
        Faults {
            replica_loss: 0.0,
            loss: 0.0,
            dup: 0.0,
        },
    );
    let total = w.total();
    let init: HashMap<(u16, u64), Vec<f32>> = (0..total)
        .map(|g| ((0, g), (0..w.chunk(g).elems).map(|e| e as f32).collect()))
        .collect();
    round(&mut w, 0, &init);
    // Round 1 of chunk 0 (primary appliance 0, lcore 0, slot 0), the
    // network now losing every replication message.
    w.faults.replica_loss = 1.0;
    let c = w.chunk(0);
    let pushes: Vec<Vec<u8>> = (0..3u16)
        .map(|rank| {
            Repr::request(MsgType::Push, JOB, TOKEN, rank, 1, 0)
                .with_payload(Dtype::F32, c.elems as u16)
                .with_chunk(c.key, c.chunk)
                .to_datagram(&vec![1.0; c.elems as usize])
        })
        .collect();
    let s = &mut w.shards[0][0];
    assert_eq!(s.handle(worker_addr(0), &pushes[0], 10), Verdict::Aggregated);
    assert_eq!(s.handle(worker_addr(1), &pushes[1], 11), Verdict::Aggregated);
    assert_eq!(s.handle(worker_addr(2), &pushes[2], 12), Verdict::Forwarded);
    let sent: Vec<u8> = s.transmits().map(|t| t.header[wire::field::TYPE]).collect();
    assert_eq!(
        sent,
        [ReplicaMsgType::Replicate.code(); 2],
        "one REPLICATE per backup, no RESULT"
    );
    s.clear_transmits();
    // Held: a copy of a push is a duplicate, a PULL gets round 0.
    assert_eq!(
        s.handle(worker_addr(1), &pushes[1], 13),
        Verdict::Dropped(DropReason::Duplicate)
    );
    let pull = Repr::request(MsgType::Pull, JOB, TOKEN, 1, 0, 0)
        .with_chunk(c.key, c.chunk)
        .to_datagram(&[]);
    assert_eq!(s.handle(worker_addr(1), &pull, 14), Verdict::Pulled);
    let answers: Vec<Repr> = s
        .transmits()
        .map(|t| wire::parse(&[&t.header[..], t.payload].concat()).unwrap().0)
        .collect();
    assert_eq!(answers.len(), 1);
    assert_eq!((answers[0].kind, answers[0].round), (MsgType::Result, 0));
    s.clear_transmits();
    assert_eq!(s.primary_state(JOB, 0).unwrap().round, Some(0));
    // Timers resend to both backups, which get nothing yet.
    for t in 1..=3 {
        w.now = 10 + t * 500 * MS;
        w.poll();
        w.run();
    }
    assert_eq!(w.shards[0][0].primary_state(JOB, 0).unwrap().round, Some(0));
    assert!(w.shards[0][0].replica_stats(JOB).unwrap().replicates_resent >= 6);
    assert!(w.got.get(&(0, 0)).is_some_and(|e| e.0 == 0));
    // The network heals: the next resend completes the round, RESULTs
    // checked against both backups as they leave.
    w.faults.replica_loss = 0.0;
    w.now += 500 * MS;
    w.poll();
    w.run();
    assert_eq!(w.shards[0][0].primary_state(JOB, 0).unwrap().round, Some(1));
    assert!(w.got.get(&(0, 0)).is_some_and(|e| e.0 == 1));
    let p = w.shards[0][0].primary_state(JOB, 0).unwrap();
    assert_ne!(p.state[0], &init[&(0, 0)][..], "round 1 moved the parameters");
    for b in [1, 2] {
        assert_eq!(w.shards[b][0].backup_state(JOB, 0).unwrap(), p);
    }
}

/// Replication messages of another epoch, from a worker's address, or
/// for a part an lcore does not keep are dropped and counted; a copy of
/// a REPLICATE already applied is acknowledged again and changes nothing.
#[test]
fn replication_messages_are_checked_and_idempotent() {
    let sp = spec(
        Optimizer::Sgd {
            lr: 0.5,
            weight_decay: 0.0,
        },
        Dtype::F32,
        2,
        2,
    );
    let mut w = World::new(
        sp,
        &[1, 1],
        &["", ""],
        4,
        Faults {
            replica_loss: 0.0,
            loss: 0.0,
            dup: 0.0,
        },
    );
    let total = w.total();
    let init: HashMap<(u16, u64), Vec<f32>> = (0..total)
        .map(|g| ((0, g), vec![2.0; w.chunk(g).elems as usize]))
        .collect();
    round(&mut w, 0, &init);
    // Appliance 1 backs up appliance 0's chunk 0 in its backup slot 0.
    let c = w.chunk(0);
    let rep = |epoch, round| {
        let r = replica::ReplicaRepr {
            kind: ReplicaMsgType::Replicate,
            dtype: Dtype::F32,
            flags: 0,
            token: TOKEN,
            job: JOB,
            from: 0,
            count: c.elems as u16,
            round,
            slot: 0,
            key: c.key,
            chunk: c.chunk,
            epoch,
        };
        let mut d = r.to_bytes().to_vec();
        for _ in 0..c.elems {
            d.extend_from_slice(&3.0f32.to_le_bytes());
        }
        d
    };
    let primary = lcore_addr(0, 0);
    let b = &mut w.shards[1][0];
    let before = b.backup_state(JOB, 0).unwrap().state[0].to_vec();
    assert_eq!(
        b.handle(primary, &rep(1, 1), 1),
        Verdict::Refused(ReplicaDropReason::WrongEpoch)
    );
    assert_eq!(b.replica_stats(JOB).unwrap().wrong_epoch, 1);
    assert_eq!(
        b.handle(worker_addr(0), &rep(0, 1), 2),
        Verdict::Dropped(DropReason::WrongPeer),
        "the token alone does not speak for a primary"
    );
    assert_eq!(
        b.handle(primary, &rep(0, 2), 3),
        Verdict::Dropped(DropReason::Ahead)
    );
    assert!(!b.has_transmits());
    assert_eq!(b.backup_state(JOB, 0).unwrap().state[0], &before[..]);
    // Round 1 applied once, its copy acknowledged again.
    let st0 = b.replica_stats(JOB).unwrap();
    for t in 0..2 {
        assert_eq!(b.handle(primary, &rep(0, 1), 4 + t), Verdict::Replicated);
        let acks: Vec<_> = b
            .transmits()
            .map(|t| (t.header, t.to.collect::<Vec<_>>()))
            .collect();
        assert_eq!(acks.len(), 1);
        let (a, _) = replica::parse(&acks[0].0).unwrap();
        assert_eq!(
            (a.kind, a.round, a.from, a.slot),
            (ReplicaMsgType::ReplicateAck, 1, 1, 0)
        );
        assert_eq!(acks[0].1, [primary]);
        b.clear_transmits();
    }
    let st = b.replica_stats(JOB).unwrap();
    assert_eq!(
        (st.acks_sent, st.acks_resent, st.rounds_applied),
        (st0.acks_sent + 1, st0.acks_resent + 1, st0.rounds_applied + 1)
    );
    let after = b.backup_state(JOB, 0).unwrap().state[0].to_vec();
    assert_ne!(after, before, "round 1 was applied");
    assert_eq!(b.handle(primary, &rep(0, 1), 6), Verdict::Replicated);
    b.clear_transmits();
    assert_eq!(
        b.backup_state(JOB, 0).unwrap().state[0],
        &after[..],
        "and only once"
    );
    assert_eq!(
        b.handle(primary, &rep(0, 0), 7),
        Verdict::Dropped(DropReason::Stale)
    );
    // The primary takes no ACK it did not wait for.
    let ack = replica::ReplicaRepr {
        kind: ReplicaMsgType::ReplicateAck,
        dtype: Dtype::F32,
        flags: 0,
        token: TOKEN,
        job: JOB,
        from: 1,
        count: 0,
        round: 1,
        slot: 0,
        key: c.key,
        chunk: c.chunk,
        epoch: 0,
    };
    let p = &mut w.shards[0][0];
    assert_eq!(
        p.handle(lcore_addr(1, 0), &ack.to_bytes(), 7),
        Verdict::Dropped(DropReason::Ahead)
    );
    let from_self = replica::ReplicaRepr { from: 0, ..ack };
    assert_eq!(
        p.handle(lcore_addr(0, 0), &from_self.to_bytes(), 8),
        Verdict::Dropped(DropReason::RankOutOfRange)
    );
    assert_eq!(p.primary_state(JOB, 0).unwrap().round, Some(0));
}

/// A spec of another consistency is not installed with replicas.
#[test]
fn only_bsp_jobs_are_replicated() {
    let sp = spec(Optimizer::Sum, Dtype::F32, 2, 2);
    let appliances = [
        (Ipv4Addr::new(10, 0, 0, 1), 9000, 1),
        (Ipv4Addr::new(10, 0, 1, 1), 9000, 1),
    ];
    let runs = backup_runs(
        ChunkRange {
            first: 0,
            count: Chunks::new(&sp).total(),
        },
        2,
    );
    let racks = vec![String::new(), String::new()];
    let mut plan: Vec<(Vec<SlotChunk>, ReplicaInstall)> =
        replica_plan(&sp, &runs, &appliances, &racks, 0, 0).unwrap();
    let (slots, rep) = plan.remove(0);
    let mut s: Shard<SocketAddrV4> = Shard::new(0, Kernels::best());
    s.set_peer_resolver(Arc::new(Some));
    let mut j = job(&sp, slots);
    j.consistency = Consistency::Async;
    let e = s
        .install(j, InstallKind::Replicated(Box::new(rep)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("BSP"), "{e}");
}

/// A primary restored from its checkpoint while an aggregate was pending
/// waits for no acknowledgement: the restored round is a completed one,
/// an ACK of the lost round is `ahead`, and the workers' resent pushes
/// (after each pulled, PROTOCOL.md §5.4 rule 0) make the round again,
/// replicated as any other.
#[test]
fn a_restore_forgets_pending_aggregates() {
    let sp = spec(
        Optimizer::Sgd {
            lr: 0.5,
            weight_decay: 0.0,
        },
        Dtype::F32,
        2,
        2,
    );
    let none = Faults {
        replica_loss: 0.0,
        loss: 0.0,
        dup: 0.0,
    };
    let mut w = World::new(sp, &[1, 1], &["", ""], 5, none);
    let total = w.total();
    let values: HashMap<(u16, u64), Vec<f32>> = (0..3u16)
        .flat_map(|r| (0..total).map(move |g| (r, g)))
        .map(|(r, g)| ((r, g), vec![0.5 + f32::from(r); w.chunk(g).elems as usize]))
        .collect();
    round(&mut w, 0, &values);
    let c = w.chunk(0);
    let s = &mut w.shards[0][0];
    for rank in 0..3u16 {
        let d = Repr::request(MsgType::Push, JOB, TOKEN, rank, 1, 0)
            .with_payload(Dtype::F32, c.elems as u16)
            .with_chunk(c.key, c.chunk)
            .to_datagram(&values[&(rank, 0)]);
        s.handle(worker_addr(rank), &d, 10);
    }
    s.clear_transmits();
    let saved = s.snapshot(JOB).unwrap();
    s.restore(JOB, &saved).unwrap();
    let ack = replica::ReplicaRepr {
        kind: ReplicaMsgType::ReplicateAck,
        dtype: Dtype::F32,
        flags: 0,
        token: TOKEN,
        job: JOB,
        from: 1,
        count: 0,
        round: 1,
        slot: 0,
        key: c.key,
        chunk: c.chunk,
        epoch: 0,
    };
    assert_eq!(
        s.handle(lcore_addr(1, 0), &ack.to_bytes(), 11),
        Verdict::Dropped(DropReason::Ahead)
    );
    assert!(!s.has_transmits());
    // The restored lcore refuses each rank's pushes (`ahead`) until it
    // pulled (PROTOCOL.md §5.4 rule 0): each pulls, as phub-worker does
    // when told `ahead`.
    for rank in 0..3u16 {
        let pull = Repr::request(MsgType::Pull, JOB, TOKEN, rank, 0, 0)
            .with_payload(Dtype::F32, 0)
            .with_chunk(c.key, c.chunk)
            .to_datagram(&[]);
        assert_eq!(s.handle(worker_addr(rank), &pull, 11), Verdict::Pulled);
    }
    s.clear_transmits();
    w.now += 1_000 * MS;
    w.poll();
    assert!(w.net.is_empty(), "no aggregate is resent after the restore");
    round(&mut w, 1, &values);
    assert_replicas_equal(&w, 1);
}
