//! Admission (`POST /v1/jobs`): the appliances a job goes on
//! ([`Shared::choose`]), its placement over their lcores
//! ([`crate::admission`]), and its install on each, recorded only once
//! every appliance installed its part.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use phub_proto::api::{AdmitResponse, DataplaneInfo};
use phub_proto::failover::EpochView;
use phub_proto::spec::{Appliances, JobSpec};

use super::http::RequestError;
use super::registry::{Entry, Inner, Shared};
use crate::admission;
use crate::dataplane::{Client, DataplaneError};
use crate::state::{JobShape, StoredJob, StoredPart};

/// Longest an admission waits for an appliance's description before it
/// takes it as down.
pub(super) const ADMIT_WAIT: Duration = Duration::from_secs(2);

/// The table keys an appliance serves (PROTOCOL.md §10): each with a
/// `rows` cap (admission charges its store at the cap, on every lcore:
/// an uncapped table has no figure to charge), on one appliance or several (each is told where
/// its lcores are among the job's; the spec refuses a replicated one). A
/// spec outside that is refused naming the key, the field and what is
/// accepted.
fn check_tables(spec: &JobSpec) -> Result<(), RequestError> {
    for t in spec.tables() {
        let at = format!("keys[{}] {:?} (a table)", t.key, t.name);
        if t.spec.rows.is_none() {
            return Err(RequestError::BadRequest(format!(
                "{at}: rows = none: a served table needs a rows cap, 1 to 2^40 (its memory is charged at \
                 the cap when the job is admitted)"
            )));
        }
    }
    Ok(())
}

/// A replicated job (PROTOCOL.md §11.1) needs as many appliances as it
/// has replicas: the spec checks its own count (`placement.appliances`);
/// this checks the appliances chosen for it.
fn check_replicas(spec: &JobSpec, appliances: usize) -> Result<(), RequestError> {
    let r = spec.replicas();
    if r > appliances {
        return Err(RequestError::BadRequest(format!(
            "placement.replicas = {r}: at most the job's appliance count ({appliances}): each replica \
             is on another appliance"
        )));
    }
    Ok(())
}

/// A hierarchical job's appliances must each be a different rack's.
pub(super) fn check_racks(inner: &Inner, chosen: &[(String, DataplaneInfo)]) -> Result<(), RequestError> {
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, _) in chosen {
        let rack = inner.appliances.get(name).map_or("", |a| a.spec.rack.as_str());
        if let Some(other) = seen.insert(rack, name) {
            return Err(RequestError::BadRequest(format!(
                "placement.hierarchical: appliances {other:?} and {name:?} are both in rack {rack:?}; a \
                 hierarchical job takes one appliance per rack"
            )));
        }
    }
    Ok(())
}
impl Shared {
    /// The appliances `spec` goes on, with their fresh descriptions, in
    /// layout order: those it names, or the number it asks for (one by
    /// default) with the most free memory among those that answer. An
    /// appliance declared down (heartbeats) is not chosen while it stays
    /// silent: a spec naming one is asked as any other (one just back,
    /// before its next heartbeat, is taken) and refused with a 409 saying
    /// it is declared down if it does not answer; a count is taken from
    /// the others without asking it, unless too few of them answer
    /// (PROTOCOL.md §11.6).
    pub(super) fn choose(&self, spec: &JobSpec) -> Result<Vec<(String, DataplaneInfo)>, RequestError> {
        let (clients, aliases, declared_down) = {
            let inner = self.lock();
            let aliases: BTreeMap<String, String> = inner
                .appliances
                .values()
                .filter_map(|a| {
                    let why = a.alias.clone().or_else(|| {
                        a.spec.draining.then(|| {
                            "being drained (phubctl appliance drain): it takes no new job".to_string()
                        })
                    })?;
                    Some((a.spec.name.clone(), why))
                })
                .collect();
            let declared_down: Vec<String> = inner
                .appliances
                .values()
                .filter(|a| a.liveness.down.is_some())
                .map(|a| a.spec.name.clone())
                .collect();
            (inner.clients(), aliases, declared_down)
        };
        let asked = spec.placement.as_ref().map(|p| &p.appliances);
        let chosen = match asked {
            Some(Appliances::Names(names)) => {
                let mut out = Vec::new();
                for n in names {
                    let Some((_, c)) = clients.iter().find(|(name, _)| name == n) else {
                        let known: Vec<&str> = clients.iter().map(|(n, _)| n.as_str()).collect();
                        return Err(RequestError::BadRequest(format!(
                            "placement.appliances names {n:?}, which control does not manage; its \
                             appliances: {}",
                            known.join(", ")
                        )));
                    };
                    if let Some(why) = aliases.get(n) {
                        return Err(RequestError::Conflict(format!(
                            "placement.appliances names {n:?}, which is {why}"
                        )));
                    }
                    match c.info() {
                        Ok(info) => {
                            // An answer, as a heartbeat's: declared down,
                            // it is up again (the heartbeat thread takes it
                            // so); not declared, its silence ends here.
                            if let Some(a) = self.lock().appliances.get_mut(n) {
                                a.watch.heard(Instant::now());
                                if declared_down.contains(n) {
                                    a.liveness.down = None;
                                }
                            }
                            out.push((n.clone(), info));
                        }
                        Err(e) if declared_down.contains(n) => {
                            let up: Vec<&str> = clients
                                .iter()
                                .map(|(n, _)| n.as_str())
                                .filter(|n| !declared_down.iter().any(|d| d == n))
                                .collect();
                            return Err(RequestError::Conflict(format!(
                                "placement.appliances names {n:?}, which is declared down and does not \
                                 answer ({e}); appliances not declared down: {}",
                                up.join(", ")
                            )));
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                out
            }
            _ => {
                let count = spec.placement.as_ref().map_or(1, |p| p.count());
                let mut answer = Vec::new();
                let mut down = None;
                // Every appliance not declared down asked at once; one that
                // does not answer within ADMIT_WAIT is taken as down. Those
                // declared down are asked only if too few others answer.
                let up: Vec<String> = clients
                    .iter()
                    .map(|(n, _)| n.clone())
                    .filter(|n| !declared_down.contains(n))
                    .collect();
                let mut views = self.views(Some(&up), ADMIT_WAIT);
                let answering = views
                    .iter()
                    .filter(|(n, v)| v.is_ok() && !aliases.contains_key(*n))
                    .count();
                if answering < count && !declared_down.is_empty() {
                    views.extend(self.views(Some(&declared_down), ADMIT_WAIT));
                }
                for (name, v) in views {
                    match v {
                        Ok(_) if aliases.contains_key(&name) => {}
                        Ok(v) => answer.push((name, v.info)),
                        Err(e) => {
                            down = down.or(Some(RequestError::Dataplane(DataplaneError::Unreachable {
                                appliance: name.clone(),
                                base: clients
                                    .iter()
                                    .find(|(n, _)| *n == name)
                                    .map(|(_, c)| c.base().to_string())
                                    .unwrap_or_default(),
                                reason: e,
                            })));
                        }
                    }
                }
                let free: Vec<(String, u64)> = answer
                    .iter()
                    .map(|(n, i)| {
                        (
                            n.clone(),
                            i.memory_budget_bytes.saturating_sub(i.memory_used_bytes),
                        )
                    })
                    .collect();
                let names = match admission::choose_appliances(count, &free) {
                    Ok(n) => n,
                    // Too few answer: name those declared down (asked too,
                    // silent), else say why one does not answer.
                    Err(e) if !declared_down.is_empty() => {
                        return Err(RequestError::Conflict(format!(
                            "{e}; declared down (no new job is placed on them): {}",
                            declared_down.join(", ")
                        )))
                    }
                    Err(e) => return Err(down.unwrap_or(RequestError::Capacity(e))),
                };
                names
                    .into_iter()
                    .filter_map(|n| answer.iter().find(|(a, _)| *a == n).cloned())
                    .collect()
            }
        };
        let mut inner = self.lock();
        for (name, info) in &chosen {
            if let Some(a) = inner.appliances.get_mut(name) {
                a.info = Some(info.clone());
            }
        }
        Ok(chosen)
    }

    /// `POST /v1/jobs`: parses the spec, chooses its appliances, places
    /// it over them, installs its part on each, and records it once every
    /// one did (or undoes the installs and says why).
    pub(super) fn admit(
        &self,
        body: &str,
        content_type: Option<&str>,
    ) -> Result<AdmitResponse, RequestError> {
        let spec = JobSpec::parse(body, content_type)?;
        check_tables(&spec)?;
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut chosen = self.choose(&spec)?;
        check_replicas(&spec, chosen.len())?;
        if spec.hierarchical()
            && matches!(
                spec.placement.as_ref().map(|p| &p.appliances),
                Some(Appliances::Count(_))
            )
        {
            // Racks are numbered in the order of their appliances' names.
            chosen.sort_by(|a, b| a.0.cmp(&b.0));
        }
        // Ids the appliances hold without control knowing them (a lost
        // state file) are skipped rather than clashed with.
        let mut foreign = BTreeSet::new();
        let mut clients = Vec::new();
        for (name, _) in &chosen {
            let c = self.lock().client(name)?;
            foreign.extend(c.jobs()?.into_iter().map(|j| j.id));
            clients.push(c);
        }
        let Placed { id, plan, shape } = self.place(&spec, &chosen, &foreign)?;
        let token = loop {
            let t: u64 = rand::random();
            if t != 0 {
                break t;
            }
        };
        let name = spec.name.clone();
        let chunks = plan.layout.chunk_count();
        let lcores = plan.layout.used_lcores();
        let memory: u64 = plan.parts.iter().map(|p| p.memory_bytes).sum();
        let shm: u64 = plan.parts.iter().map(|p| p.cost.shm).sum();
        let names: Vec<String> = chosen.iter().map(|(n, _)| n.clone()).collect();
        let job = StoredJob {
            id,
            token,
            spec,
            layout: plan.layout,
            joined: BTreeSet::new(),
            parts: chosen
                .iter()
                .map(|(n, info)| StoredPart {
                    appliance: n.clone(),
                    lcores: u32::try_from(info.lcores.len()).unwrap_or(u32::MAX),
                })
                .collect(),
            failed: None,
            shape,
            epoch: EpochView::default(),
            rereplication: None,
            stalled: None,
        };
        let racks: BTreeMap<String, String> = {
            let inner = self.lock();
            chosen
                .iter()
                .map(|(n, _)| (n.clone(), inner.rack_of(n)))
                .collect()
        };
        if let Err(e) = install_everywhere(&job, &clients, &chosen, &racks) {
            log::warn!("job {name:?} not admitted: {e}");
            return Err(e.into());
        }
        let mut inner = self.lock();
        let recorded = self.commit(&mut inner, Entry::Job(id), |inner| inner.jobs.insert(id, job));
        drop(inner);
        if let Err(e) = recorded {
            for c in &clients {
                let _ = c.remove(id);
            }
            log::error!("job {name:?} not admitted: {e}");
            return Err(RequestError::State(format!("{e}; the job was not admitted")));
        }
        log::info!(
            "admitted job {id} ({name:?}): {chunks} chunks, {memory} bytes ({shm} in shared memory) on {} \
             over lcores {lcores:?} of their union",
            names.join(", ")
        );
        Ok(AdmitResponse {
            id,
            token,
            chunks,
            memory_bytes: memory,
            shm_bytes: shm,
            lcores,
            appliances: names,
        })
    }

    /// Places `spec` over the appliances `chosen` (in layout order, with
    /// their fresh descriptions), beside the jobs admitted there, and
    /// picks its id among those neither control nor the appliances
    /// (`foreign`) use.
    fn place(
        &self,
        spec: &JobSpec,
        chosen: &[(String, DataplaneInfo)],
        foreign: &BTreeSet<u16>,
    ) -> Result<Placed, RequestError> {
        let inner = self.lock();
        if spec.hierarchical() {
            check_racks(&inner, chosen)?;
        }
        let targets: Vec<admission::Target<'_>> = chosen
            .iter()
            .map(|(name, info)| admission::Target {
                name,
                info,
                load: inner.load_on(name, info, None),
            })
            .collect();
        let (plan, shape) = if spec.hierarchical() {
            let h = admission::plan_hierarchical(spec, &targets)?;
            assert_eq!(h.racks.len(), chosen.len(), "one rack per appliance");
            (h.homes, JobShape::Hierarchical { racks: h.racks })
        } else {
            let racks: Vec<String> = chosen.iter().map(|(n, _)| inner.rack_of(n)).collect();
            let racks: Vec<&str> = racks.iter().map(String::as_str).collect();
            (
                admission::plan_replicated(spec, &targets, &racks)?,
                JobShape::Flat,
            )
        };
        let id = admission::free_id(|id| inner.jobs.contains_key(&id) || foreign.contains(&id))?;
        Ok(Placed { id, plan, shape })
    }
}

/// Where admission places a job.
struct Placed {
    /// Its id.
    id: u16,
    /// Its layout over the chosen appliances, with each one's part and cost.
    plan: admission::ShardPlan,
    /// Flat, or hierarchical with its rack layouts.
    shape: JobShape,
}

/// Installs `job`'s part on each appliance (`clients` and `chosen` in its
/// parts' order); if one fails, those installed are removed again (and the
/// one whose connection broke, since its install may have landed) and the
/// error is its.
fn install_everywhere(
    job: &StoredJob,
    clients: &[Client],
    chosen: &[(String, DataplaneInfo)],
    racks: &BTreeMap<String, String>,
) -> Result<(), DataplaneError> {
    assert_eq!(clients.len(), job.parts.len(), "one client per part");
    let data = |n: &str| chosen.iter().find(|(c, _)| c == n).map(|(_, i)| i.data.clone());
    for (i, (c, (appliance, _))) in clients.iter().zip(chosen).enumerate() {
        let install = job
            .install_for(appliance, data, |n| racks.get(n).cloned().unwrap_or_default())
            .expect("the job's parts are the chosen appliances");
        if let Err(e) = c.install(&install) {
            let undo = if e.is_unreachable() { i + 1 } else { i };
            // The PUT may have landed before the connection broke.
            for c in &clients[..undo] {
                let _ = c.remove(job.id);
            }
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use phub_proto::spec::JobSpec;

    use super::*;

    /// A table key is admitted when the appliance can serve it, on one
    /// appliance or several, evicting by rounds or seconds; one without a
    /// `rows` cap is refused, naming the key and the field.
    #[test]
    fn table_keys_are_admitted_when_served_and_refused_naming_the_key() {
        let dense =
            "name = \"j\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nname = \"w\"\nelements = 8\n";
        let table = format!("{dense}[[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 16\n");
        let refused = |text: &str, field: &str| {
            let e = check_tables(&JobSpec::parse(text, None).unwrap()).unwrap_err();
            assert!(matches!(e, RequestError::BadRequest(_)), "{e:?}");
            let e = e.to_string();
            assert!(e.contains("keys[1] \"emb\"") && e.contains(field), "{e}");
        };
        refused(&table, "rows = none");
        let capped = format!("{table}rows = 1000\n");
        check_tables(&JobSpec::parse(&capped, None).unwrap()).unwrap();
        check_tables(&JobSpec::parse(&format!("{capped}evict = {{ idle_s = 5 }}\n"), None).unwrap()).unwrap();
        check_tables(&JobSpec::parse(&format!("{capped}evict = {{ idle_rounds = 5 }}\n"), None).unwrap())
            .unwrap();
        check_tables(&JobSpec::parse(&format!("{capped}[placement]\nappliances = 2\n"), None).unwrap())
            .unwrap();
        check_tables(&JobSpec::parse(dense, None).unwrap()).unwrap();
    }

    /// A replicated job goes on at least as many appliances as it has
    /// replicas: fewer chosen is refused naming the field, the value and
    /// the appliances there are.
    #[test]
    fn replicas_beyond_the_chosen_appliances_are_refused_naming_the_field() {
        let two = JobSpec::new("j", 2, &[8])
            .sharded_over(Appliances::Count(2))
            .with_replicas(2);
        two.validate().unwrap();
        check_replicas(&two, 2).unwrap();
        check_replicas(&two, 3).unwrap();
        let e = check_replicas(&two, 1).unwrap_err().to_string();
        assert!(
            e.contains("placement.replicas = 2") && e.contains("appliance count (1)"),
            "{e}"
        );
    }
}
