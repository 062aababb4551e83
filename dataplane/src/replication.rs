//! A replicated job's install (PROTOCOL.md §11): from the install body's
//! [`Replication`] (every appliance of the job, this one's index, the
//! epoch), what each lcore is told: its primary slots and its
//! [`ReplicaInstall`] (its chunks' backups, the backup slots it keeps),
//! and what that costs beside the primary slots.
//!
//! Pure: it checks the body and computes; the lcores install the result
//! (`crate::mgmt`).

use std::net::Ipv4Addr;

use phub_engine::engine::{replica_plan_at, ReplicaInstall};
use phub_proto::api::{InstallJob, Replication};
use phub_proto::layout::{ChunkRange, Layout, Placement, SlotChunk};
use phub_proto::memory::MemoryModel;

/// Per lcore of this appliance: its primary slots and its replica install.
pub type Plan = Vec<(Vec<SlotChunk>, ReplicaInstall)>;

/// Checks `req`'s replication against its spec and layout and this
/// dataplane's `lcores`, and makes each lcore's part. Errors name the
/// field, the value and what would be accepted.
pub fn plan(req: &InstallJob, lcores: usize) -> Result<Plan, String> {
    let Some(r) = &req.replication else {
        return Err("replication: absent; a job with placement.replicas above 1 needs it".into());
    };
    let n = r.appliances.len();
    let me = usize::from(r.appliance);
    let mine = r.appliances.get(me).ok_or_else(|| {
        format!("replication.appliance = {me}: below the {n} appliances of replication.appliances")
    })?;
    if mine.layout != req.layout {
        return Err(format!(
            "replication.appliances[{me}] ({}): its layout is not the install's layout",
            mine.name
        ));
    }
    // At epoch 0 nobody is down or back; above it the install is an
    // appliance's return (PROTOCOL.md §11.7): the view must name it joined
    // at that epoch, since an install takes no part over.
    let view = r.view();
    view.check(n)
        .map_err(|e| format!("replication (epoch {}): {e}", r.epoch))?;
    if r.epoch != 0 && view.joined_at(me) != Some(r.epoch) {
        return Err(format!(
            "replication.epoch = {}: 0, or an epoch whose joined list has this appliance ({me}) at it (an \
             appliance installed again after being declared down, PROTOCOL.md §11.7); later epochs of an \
             installed job come with PUT /v1/jobs/{{id}}/epoch",
            r.epoch
        ));
    }
    let mut runs: Vec<ChunkRange> = Vec::new();
    let mut appliances = Vec::with_capacity(n);
    let mut racks = Vec::with_capacity(n);
    for (i, p) in r.appliances.iter().enumerate() {
        let at = |e: String| format!("replication.appliances[{i}] ({}): {e}", p.name);
        let ip: Ipv4Addr = p
            .data
            .host
            .parse()
            .map_err(|_| at(format!("data.host = {:?}: an IPv4 address", p.data.host)))?;
        if p.layout.chunk_elems != req.layout.chunk_elems {
            return Err(at(format!(
                "layout.chunk_elems = {}: the install's, {}",
                p.layout.chunk_elems, req.layout.chunk_elems
            )));
        }
        let l = u16::try_from(p.layout.lcores.len())
            .map_err(|_| at(format!("{} lcores: at most {}", p.layout.lcores.len(), u16::MAX)))?;
        appliances.push((ip, p.data.base_port, l));
        runs.extend(p.layout.lcores.iter().copied());
        racks.push(p.rack.clone());
    }
    // The appliances' parts, in order, place the whole job.
    Placement::new(
        &req.spec,
        Layout {
            chunk_elems: req.layout.chunk_elems,
            lcores: runs.clone(),
        },
    )
    .map_err(|e| format!("replication.appliances: their layouts together: {e}"))?;
    let plan = replica_plan_at(&req.spec, &runs, &appliances, &racks, r.appliance, &view)?;
    if plan.len() != lcores {
        return Err(format!(
            "replication: {} lcores of this appliance's part; this dataplane has {lcores}",
            plan.len()
        ));
    }
    Ok(plan)
}

/// A replicated hierarchical job's install in its flat form (PROTOCOL.md
/// §11.11): no hierarchy, this appliance's part of the home layout as its
/// layout. What its checkpoints hold (the home part's slots, as a flat
/// part's: `Shard::part_snapshot`) and how it is restored (at an epoch
/// above 0, when it is flat). Any other install is left as it is.
pub fn flat_form(job: &mut InstallJob) {
    let Some(r) = job.replication.as_ref() else {
        return;
    };
    if job.hierarchy.is_none() {
        return;
    }
    if let Some(home) = r.appliances.get(usize::from(r.appliance)) {
        job.layout = home.layout.clone();
        job.hierarchy = None;
    }
}

/// What a replicated job holds on each lcore beyond its primary slots, as
/// admission charges it ([`MemoryModel::replica_cost`]); on an appliance
/// installed again ([`back`]), with its own part among them
/// ([`MemoryModel::replica_cost_back`]).
pub fn lcore_bytes(model: &MemoryModel, req: &InstallJob, r: &Replication) -> Vec<u64> {
    let parts: Vec<&Layout> = r.appliances.iter().map(|a| &a.layout).collect();
    let racks: Vec<&str> = r.appliances.iter().map(|a| a.rack.as_str()).collect();
    let me = usize::from(r.appliance);
    if back(r) {
        model.replica_cost_back(&req.spec, &parts, &racks, me)
    } else {
        model.replica_cost(&req.spec, &parts, &racks, me)
    }
}

/// Whether this appliance is installed again after being declared down
/// (PROTOCOL.md §11.7): joined at the install's epoch, its own part kept
/// as backup slots and no primary slots (the engine's plan).
pub fn back(r: &Replication) -> bool {
    r.view().joined_at(usize::from(r.appliance)) == Some(r.epoch)
}

#[cfg(test)]
mod tests {
    use phub_proto::api::{DataAddr, ReplicaPeer};
    use phub_proto::spec::{Appliances, JobSpec};

    use super::*;

    /// Job `spec` of 12 chunks over appliances of 2 and 1 lcores, as
    /// appliance `me` is told it.
    fn install(me: u16) -> InstallJob {
        let spec = JobSpec::new("j", 2, &[12 * 2048])
            .sharded_over(Appliances::Count(2))
            .with_replicas(2);
        let chunk_elems = spec.chunk_elems();
        let run = |first, count| ChunkRange { first, count };
        let parts = [vec![run(0, 4), run(4, 4)], vec![run(8, 4)]];
        let appliances: Vec<ReplicaPeer> = parts
            .iter()
            .enumerate()
            .map(|(i, l)| ReplicaPeer {
                name: format!("a{i}"),
                data: DataAddr {
                    host: format!("127.0.0.{}", i + 1),
                    base_port: 9000,
                },
                rack: String::new(),
                layout: Layout {
                    chunk_elems,
                    lcores: l.clone(),
                },
            })
            .collect();
        InstallJob {
            id: 1,
            token: 7,
            layout: appliances[usize::from(me)].layout.clone(),
            spec,
            hierarchy: None,
            replication: Some(Replication {
                epoch: 0,
                appliance: me,
                appliances,
                down: Vec::new(),
                joined: Vec::new(),
                moved: Vec::new(),
                restored: 0,
            }),
            entries: None,
        }
    }

    /// Each appliance's lcores get their own runs as primary slots and
    /// the other appliance's part cut over them as backup slots; a body
    /// that does not fit is refused naming the field and the value.
    #[test]
    fn each_lcore_gets_its_part_and_a_body_that_does_not_fit_is_refused() {
        let a = plan(&install(0), 2).unwrap();
        assert_eq!(a.iter().map(|(s, _)| s.len()).collect::<Vec<_>>(), [4, 4]);
        // b's 4 chunks cut over a's 2 lcores.
        let backups: Vec<(u16, u64, usize)> = a
            .iter()
            .flat_map(|(_, r)| r.backups.iter().map(|b| (b.primary, b.first, b.slots.len())))
            .collect();
        assert_eq!(backups, [(1, 8, 2), (1, 10, 2)]);
        let b = plan(&install(1), 1).unwrap();
        assert_eq!(b[0].1.backups[0].slots.len(), 8);

        let e = plan(&install(1), 2).unwrap_err();
        assert!(e.contains("1 lcores") && e.contains("has 2"), "{e}");
        let mut far = install(0);
        far.replication.as_mut().unwrap().appliance = 2;
        let e = plan(&far, 2).unwrap_err();
        assert!(e.contains("replication.appliance = 2"), "{e}");
        // An install above epoch 0 is an appliance's return: the view
        // must name it joined at that epoch.
        let mut later = install(0);
        later.replication.as_mut().unwrap().epoch = 1;
        let e = plan(&later, 2).unwrap_err();
        assert!(e.contains("replication.epoch = 1"), "{e}");
        let back = |me: u16| {
            let mut b = install(me);
            let r = b.replication.as_mut().unwrap();
            r.epoch = 2;
            r.joined = vec![phub_proto::failover::Joined {
                appliance: me,
                epoch: 2,
            }];
            b
        };
        // Appliance 1 back at epoch 2: no primary slots, its own part and
        // appliance 0's as backup slots.
        let b = plan(&back(1), 1).unwrap();
        assert!(b[0].0.is_empty(), "{:?}", b[0].0);
        assert_eq!(b[0].1.view.epoch, 2);
        let mut bad = back(1);
        bad.replication.as_mut().unwrap().joined[0].epoch = 3;
        let e = plan(&bad, 1).unwrap_err();
        assert!(e.contains("epoch 2") && e.contains("joined"), "{e}");
        let mut named = install(0);
        named.replication.as_mut().unwrap().appliances[1].data.host = "b.example".into();
        let e = plan(&named, 2).unwrap_err();
        assert!(e.contains("data.host = \"b.example\""), "{e}");
        let mut none = install(0);
        none.replication = None;
        assert!(plan(&none, 2).unwrap_err().contains("replication: absent"));
    }
}
