//! A job's geometry, pure: its parts over its appliances, who sends to
//! each, what each installs and what each costs.

use phub_proto::api::{DataAddr, DataplaneInfo, Hierarchy, InstallJob, RackPeer};
use phub_proto::layout::Layout;
use phub_proto::memory::MemoryModel;

use crate::admission;
use crate::state::StoredJob;

/// A job's parts: each appliance's name and its part of the layout, in
/// layout order. O(lcores).
pub(crate) fn parts(job: &StoredJob) -> Vec<(&str, Layout)> {
    let counts: Vec<usize> = job.parts.iter().map(|p| p.lcores as usize).collect();
    job.parts
        .iter()
        .map(|p| p.appliance.as_str())
        .zip(job.layout.split(&counts))
        .collect()
}

/// Job `job`'s part on appliance `name`, if it has one there.
pub(crate) fn part_of(job: &StoredJob, name: &str) -> Option<Layout> {
    parts(job).into_iter().find(|(n, _)| *n == name).map(|(_, l)| l)
}

/// Who sends job `job`'s chunks to appliance `name`: each layout of the
/// job there with how many send to its lcores: a flat job's part, from
/// its W ranks; a hierarchical job's rack layout, from its rack's ranks,
/// and its part of the home layout, from every rack's appliance.
pub(crate) fn senders(job: &StoredJob, name: &str) -> Vec<(Layout, u64)> {
    let part = part_of(job, name);
    if job.racks.is_empty() {
        return part
            .map(|l| (l, u64::from(job.spec.workers)))
            .into_iter()
            .collect();
    }
    let home = part.map(|l| (l, job.parts.len() as u64));
    home.into_iter().chain(rack_senders(job, name)).collect()
}

/// A hierarchical job's rack layout on appliance `name` and its rack's
/// ranks, who send to it.
pub(crate) fn rack_senders(job: &StoredJob, name: &str) -> Option<(Layout, u64)> {
    let i = led_rack(job, name)?;
    let ranks = job.spec.rack_ranks()?.get(i)?.len() as u64;
    Some((job.racks.get(i)?.clone(), ranks))
}

/// What appliance `name` installs of `job`; for a hierarchical job, its
/// rack layout and the hierarchy, with each appliance's data address as
/// `data` gives it (None if it has none).
pub(crate) fn install_of(
    job: &StoredJob,
    name: &str,
    data: impl Fn(&str) -> Option<DataAddr>,
) -> Option<InstallJob> {
    if job.racks.is_empty() {
        return Some(InstallJob {
            id: job.id,
            token: job.token,
            spec: job.spec.clone(),
            layout: part_of(job, name)?,
            hierarchy: None,
        });
    }
    let rack = job.parts.iter().position(|p| p.appliance == name)?;
    let racks = job
        .parts
        .iter()
        .zip(&job.racks)
        .map(|(p, layout)| {
            Some(RackPeer {
                name: p.appliance.clone(),
                data: data(&p.appliance)?,
                layout: layout.clone(),
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(InstallJob {
        id: job.id,
        token: job.token,
        spec: job.spec.clone(),
        layout: job.racks[rack].clone(),
        hierarchy: Some(Hierarchy {
            rack: u16::try_from(rack).ok()?,
            racks,
            homes: job.layout.clone(),
        }),
    })
}

/// What `part` of `job` (on its appliance `name`) costs on the appliance
/// `info` describes (the last one control heard from), or by
/// [`MemoryModel::default`]'s upper bounds before it heard from one; a
/// hierarchical job's part with its rack slots. O(keys + lcores).
pub(crate) fn part_bytes(job: &StoredJob, name: &str, part: &Layout, info: Option<&DataplaneInfo>) -> u64 {
    let default = MemoryModel::default();
    let model = info.map_or(&default, |i| &i.memory_model);
    if let Some(rack) = rack_of(job, name) {
        return model
            .hierarchical_cost(&job.spec, rack, part, job.layout.lcores.len())
            .total();
    }
    match info {
        Some(info) => admission::cost(&job.spec, part, info).total(),
        None => model.job_cost(&job.spec, part, false).total(),
    }
}

/// The rack (part index) of a hierarchical job's rank.
pub(crate) fn rack_index(job: &StoredJob, rank: u16) -> Option<usize> {
    if job.racks.is_empty() {
        return None;
    }
    job.spec.rack_ranks()?.iter().position(|r| r.contains(&rank))
}

/// "ranks 0..2 on a, ranks 2..4 on b": a hierarchical job's racks.
pub(crate) fn rack_assignment(job: &StoredJob) -> String {
    let ranks = job.spec.rack_ranks().unwrap_or_default();
    job.parts
        .iter()
        .zip(ranks)
        .map(|(p, r)| format!("ranks {}..{} on {}", r.start, r.end, p.appliance))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A hierarchical job's rack layout on appliance `name`.
pub(crate) fn rack_of<'a>(job: &'a StoredJob, name: &str) -> Option<&'a Layout> {
    job.racks.get(led_rack(job, name)?)
}

/// Which of a hierarchical job's racks appliance `name` leads (its part's
/// place: rack i's layout is `racks[i]`, its ranks `rack_ranks()[i]`).
pub(crate) fn led_rack(job: &StoredJob, name: &str) -> Option<usize> {
    job.parts.iter().position(|p| p.appliance == name)
}
