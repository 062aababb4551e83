//! A replicated job's install (PROTOCOL.md §11): from the install body's
//! [`Replication`] (every appliance of the job, this one's index, the
//! epoch), what each lcore is told: its primary slots and its
//! [`ReplicaInstall`] (its chunks' backups, the backup slots it keeps),
//! and what that costs beside the primary slots.
//!
//! Pure: it checks the body and computes; the lcores install the result
//! (`crate::mgmt`).

use std::net::Ipv4Addr;

use phub_engine::engine::{replica_plan, ReplicaInstall};
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
    if r.epoch != 0 {
        return Err(format!(
            "replication.epoch = {}: 0 (epochs change with failover, which is not built, PROTOCOL.md §11.6)",
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
    let plan = replica_plan(&req.spec, &runs, &appliances, &racks, r.appliance, r.epoch)?;
    if plan.len() != lcores {
        return Err(format!(
            "replication: {} lcores of this appliance's part; this dataplane has {lcores}",
            plan.len()
        ));
    }
    Ok(plan)
}

/// What a replicated job holds on each lcore beyond its primary slots, as
/// admission charges it ([`MemoryModel::replica_cost`]).
pub fn lcore_bytes(model: &MemoryModel, req: &InstallJob, r: &Replication) -> Vec<u64> {
    let parts: Vec<&Layout> = r.appliances.iter().map(|a| &a.layout).collect();
    let racks: Vec<&str> = r.appliances.iter().map(|a| a.rack.as_str()).collect();
    model.replica_cost(&req.spec, &parts, &racks, usize::from(r.appliance))
}
