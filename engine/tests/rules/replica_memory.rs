//! What a replicated job holds on each lcore (PROTOCOL.md §11.2) is what
//! admission charges it: the engine's count of an installed lcore
//! ([`Shard::job_memory_bytes`]) equals the memory model's charge for its
//! primary slots ([`MemoryModel::job_cost`]) plus its backup slots,
//! pending records and peers ([`MemoryModel::replica_cost`]), for
//! appliances of unequal lcore counts, one rack or several, 2 and 3
//! replicas, and optimizers with and without state.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use phub_engine::engine::{memory_model, replica_plan, replica_plan_at};
use phub_engine::{InstallKind, JobInstall, Kernels, RustHeap, Shard, SlotAllocator};
use phub_proto::failover::{EpochView, Joined};
use phub_proto::layout::{ChunkRange, Chunks, Layout, SlotChunk};
use phub_proto::memory::ResultStore;
use phub_proto::replica::backup_runs;
use phub_proto::spec::JobSpec;

/// Appliances' lcore counts, their rack labels, replicas, optimizer, dtype.
type Case = (
    &'static [usize],
    &'static [&'static str],
    u32,
    &'static str,
    &'static str,
);

/// `spec`'s chunks spread by count over appliances of `lcores` lcores:
/// the runs (one per lcore, layout order), each appliance's part of the
/// layout, and each appliance's data address, base port and lcore count.
#[allow(clippy::type_complexity)]
fn spread(spec: &JobSpec, lcores: &[usize]) -> (Vec<ChunkRange>, Vec<Layout>, Vec<(Ipv4Addr, u16, u16)>) {
    let runs = backup_runs(
        ChunkRange {
            first: 0,
            count: Chunks::new(spec).total(),
        },
        lcores.iter().sum(),
    );
    let mut parts = Vec::new();
    let mut at = 0;
    for &l in lcores {
        parts.push(Layout {
            chunk_elems: spec.chunk_elems(),
            lcores: runs[at..at + l].to_vec(),
        });
        at += l;
    }
    let appliances = lcores
        .iter()
        .enumerate()
        .map(|(i, &l)| (Ipv4Addr::new(10, 0, i as u8, 1), 9000, l as u16))
        .collect();
    (runs, parts, appliances)
}

/// A shard for lcore `j` and job 1 of `spec` (3 workers) with `slots` as
/// its primary slots, to be installed on it.
fn lcore_for(
    mem: &Arc<dyn SlotAllocator>,
    spec: &JobSpec,
    j: usize,
    slots: Vec<SlotChunk>,
) -> (Shard<SocketAddrV4>, JobInstall) {
    let mut s: Shard<SocketAddrV4> = Shard::with_slot_memory(j as u16, Kernels::best(), mem.clone());
    s.set_peer_resolver(Arc::new(Some));
    let job = JobInstall {
        id: 1,
        token: 7,
        workers: 3,
        dtype: spec.dtype,
        optimizer: spec.optimizer,
        consistency: spec.consistency,
        chunk_elems: spec.chunk_elems(),
        slots,
    };
    (s, job)
}

#[test]
fn each_lcore_of_a_replicated_job_holds_what_admission_charges() {
    let mem: Arc<dyn SlotAllocator> = Arc::new(RustHeap);
    let model = memory_model(&*mem);
    let cases: &[Case] = &[
        (&[2, 1], &["", ""], 2, "kind = \"sum\"", "f32"),
        (
            &[1, 2, 3],
            &["r1", "r1", "r2"],
            2,
            "kind = \"adam\"\nlr = 0.01",
            "bf16",
        ),
        (
            &[3, 1, 2],
            &["", "", ""],
            3,
            "kind = \"momentum\"\nlr = 0.1",
            "f32",
        ),
    ];
    for &(lcores, racks, replicas, opt, dtype) in cases {
        let spec = JobSpec::from_toml(&format!(
            "name = \"m\"\nworkers = 3\nchunk_bytes = 256\ndtype = \"{dtype}\"\n[optimizer]\n{opt}\n\
             [[keys]]\nelements = 5\n[[keys]]\nelements = 3000\n[[keys]]\nelements = 77\n\
             [placement]\nappliances = {}\nreplicas = {replicas}\n",
            lcores.len()
        ))
        .unwrap();
        let what = format!("{lcores:?} {racks:?} replicas {replicas} {opt} {dtype}");
        let (runs, parts, appliances) = spread(&spec, lcores);
        let part_refs: Vec<&Layout> = parts.iter().collect();
        let labels: Vec<String> = racks.iter().map(|r| r.to_string()).collect();
        for (me, part) in parts.iter().enumerate() {
            let primary = model.job_cost(&spec, part, ResultStore::Slot).lcores;
            let backups = model.replica_cost(&spec, &part_refs, racks, me);
            assert_eq!(backups.len(), lcores[me], "{what}");
            let plan = replica_plan(&spec, &runs, &appliances, &labels, me as u16, 0).unwrap();
            for (j, (slots, rep)) in plan.into_iter().enumerate() {
                let (mut s, job) = lcore_for(&mem, &spec, j, slots);
                s.install(job, InstallKind::Replicated(Box::new(rep))).unwrap();
                assert!(backups[j] > 0, "{what}: appliance {me} lcore {j}");
                assert_eq!(
                    s.job_memory_bytes(1),
                    Some(primary[j] + backups[j]),
                    "{what}: appliance {me} lcore {j}"
                );
            }
        }
    }
}

/// A replicated job with a table (PROTOCOL.md §11.9): each lcore holds
/// its primary slots and tables (`part_cost`, the table's share over all
/// the job's lcores) plus its backup slots and the backup tables of the
/// entries it keeps (`replica_cost`), as admission charges them.
#[test]
fn each_lcore_of_a_replicated_job_with_a_table_holds_what_admission_charges() {
    use phub_engine::engine::TableInstall;

    let mem: Arc<dyn SlotAllocator> = Arc::new(RustHeap);
    let model = memory_model(&*mem);
    let lcores: &[usize] = &[2, 1, 2];
    let racks = ["r1", "r2", "r1"];
    let spec = JobSpec::from_toml(
        "name = \"m\"\nworkers = 3\nchunk_bytes = 256\n[optimizer]\nkind = \"sum\"\n\
         [[keys]]\nelements = 300\n[[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 8\nrows = 5000\n\
         optimizer = { kind = \"adagrad\", lr = 0.1 }\n[placement]\nappliances = 3\nreplicas = 2\n",
    )
    .unwrap();
    let table = spec.tables().next().unwrap().spec.clone();
    let nl: usize = lcores.iter().sum();
    let (runs, parts, appliances) = spread(&spec, lcores);
    let part_refs: Vec<&Layout> = parts.iter().collect();
    let labels: Vec<String> = racks.iter().map(|r| r.to_string()).collect();
    let mut entry = 0u32;
    let mut with_backup_tables = 0;
    for (me, part) in parts.iter().enumerate() {
        let primary = model.part_cost(&spec, part, ResultStore::Slot, nl).lcores;
        let backups = model.replica_cost(&spec, &part_refs, &racks, me);
        let plan = replica_plan(&spec, &runs, &appliances, &labels, me as u16, 0).unwrap();
        for (j, (slots, rep)) in plan.into_iter().enumerate() {
            let (mut s, job) = lcore_for(&mem, &spec, j, slots);
            let t = TableInstall {
                key: 1,
                spec: table.clone(),
                chunk_bytes: spec.chunk_bytes,
                lcores: nl as u32,
                entry,
            };
            entry += 1;
            s.install_with_tables(job, InstallKind::Replicated(Box::new(rep)), vec![t])
                .unwrap();
            with_backup_tables += usize::from((0..nl as u32).any(|e| s.backup_tables(1, e).is_some()));
            assert_eq!(
                s.job_memory_bytes(1),
                Some(primary[j] + backups[j]),
                "appliance {me} lcore {j}"
            );
        }
    }
    assert!(with_backup_tables > 0);
}

/// An appliance installed again after it was declared down (PROTOCOL.md
/// §11.7: `joined` at the install's epoch) has no primary slots, its own
/// part kept as backup slots: it holds `part_cost` of its layout without
/// chunks plus `replica_cost_back`, which the dataplane checks an install
/// against (it was charged the part as primary slots, 20 bytes a slot
/// more). An async job's lcores count the update-log buffers admission
/// reserved from the install on, made or not.
#[test]
fn an_appliance_back_and_an_async_job_hold_what_the_model_says() {
    let mem: Arc<dyn SlotAllocator> = Arc::new(RustHeap);
    let model = memory_model(&*mem);
    let lcores: &[usize] = &[2, 1, 2];
    let racks = ["", "", ""];
    let labels: Vec<String> = racks.iter().map(|r| r.to_string()).collect();
    for mode in ["sync", "async"] {
        let spec = JobSpec::from_toml(&format!(
            "name = \"m\"\nworkers = 3\nchunk_bytes = 256\n[optimizer]\nkind = \"sum\"\n\
             [consistency]\nmode = \"{mode}\"\n\
             [[keys]]\nelements = 5\n[[keys]]\nelements = 3000\n[placement]\nappliances = 3\nreplicas = 2\n"
        ))
        .unwrap();
        let (runs, parts, appliances) = spread(&spec, lcores);
        let part_refs: Vec<&Layout> = parts.iter().collect();
        for (me, part) in parts.iter().enumerate() {
            for back in [false, true] {
                let view = if back {
                    EpochView {
                        epoch: 1,
                        joined: vec![Joined {
                            appliance: me as u16,
                            epoch: 1,
                        }],
                        ..EpochView::default()
                    }
                } else {
                    EpochView::default()
                };
                let (primary, backups) = if back {
                    (
                        model
                            .part_cost(&spec, &part.without_chunks(), ResultStore::Slot, 0)
                            .lcores,
                        model.replica_cost_back(&spec, &part_refs, &racks, me),
                    )
                } else {
                    (
                        model.job_cost(&spec, part, ResultStore::Slot).lcores,
                        model.replica_cost(&spec, &part_refs, &racks, me),
                    )
                };
                let plan = replica_plan_at(&spec, &runs, &appliances, &labels, me as u16, &view).unwrap();
                for (j, (slots, rep)) in plan.into_iter().enumerate() {
                    assert_eq!(
                        slots.is_empty(),
                        back,
                        "{mode}: a returned appliance has no primary slot"
                    );
                    let (mut s, job) = lcore_for(&mem, &spec, j, slots);
                    s.install(job, InstallKind::Replicated(Box::new(rep))).unwrap();
                    assert_eq!(
                        s.job_memory_bytes(1),
                        Some(primary[j] + backups[j]),
                        "{mode}, back {back}: appliance {me} lcore {j}"
                    );
                }
            }
        }
    }
}
