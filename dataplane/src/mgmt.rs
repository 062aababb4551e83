//! The management side of a running dataplane: the lcore threads' command
//! queues, the installed-job registry, and the HTTP/JSON management API that
//! phub-control talks to (routes: `phub_proto::routes::MgmtRoute`).
//!
//! Runs on its own thread, never on a data core. It reaches lcores only
//! through their bounded command queues and waits for each to acknowledge.

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};
use phub_http::{Class, Handler, Request, Response};
use phub_proto::api::{
    ClockStats, DataplaneInfo, DataplaneStats, InstallJob, InstalledJob, JobLive, PortStats, TableLive,
};
use phub_proto::checkpoint::{Checkpoint, Restoring, MAGIC as CKPT_MAGIC};
use phub_proto::failover::EpochView;
use phub_proto::layout::Placement;
use phub_proto::memory::{MemoryModel, ResultStore};
use phub_proto::routes::{MgmtRoute, RouteError};
use phub_proto::spec::Optimizer;

use phub_engine::counters::{NetDrop, ShardCounters};
use phub_engine::engine::{
    self, hierarchy_plan, EngineError, InstallKind, JobInstall, RestoredTable, TableInstall,
};
use phub_engine::shm::ShmSetup;

use crate::lcore::{CheckpointRefused, Clock, Command, Install, Saved, Slice, SLICES_AHEAD};
use crate::tables;

/// How long the management thread waits for an lcore to acknowledge.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// The slowest rate an lcore is allowed to restore a job's dense state at,
/// beyond [`ACK_TIMEOUT`].
const RESTORE_BYTES_PER_S: u64 = 16 << 20;

/// How long beyond [`ACK_TIMEOUT`] an lcore may take to restore `state`
/// (its slots: its tables come built).
fn restore_time(state: Option<&Saved>) -> Duration {
    let Some(s) = state else {
        return Duration::ZERO;
    };
    let slots: u64 = s
        .slots
        .iter()
        .map(|x| 4 * (x.params.len() + x.s1.len() + x.s2.len()) as u64 + x.result.len() as u64)
        .sum();
    Duration::from_secs(slots / RESTORE_BYTES_PER_S)
}

/// What a restore puts back on each lcore, read once the install's checks
/// passed and its memory is counted (a table's rows may be gigabytes):
/// given each lcore's table keys, their state per lcore.
type ReadSaved<'a> = Box<dyn FnOnce(&[Vec<TableInstall>]) -> Result<Vec<Saved>, MgmtError> + 'a>;

/// How long a checkpoint being written waits for an lcore's next slice,
/// or for its reader to take the next bytes, before it is cut.
const CHECKPOINT_STALL: Duration = Duration::from_secs(60);

/// A checkpoint whose parts are being made ([`Manager::checkpoint_begin`]):
/// its head (magic, version, job, every lcore's slots) in memory, each
/// lcore's tables' section coming from that lcore, then the CRC.
#[derive(Debug)]
pub struct CheckpointStream {
    job: u16,
    head: Vec<u8>,
    /// Per lcore, its slices and the bytes its section has.
    sections: Vec<(Receiver<Slice>, u64)>,
}

impl CheckpointStream {
    /// The file's bytes.
    pub fn file_bytes(&self) -> u64 {
        self.head.len() as u64 + self.sections.iter().map(|s| s.1).sum::<u64>() + 4
    }

    /// Hands the file's bytes to `sink` in order, ending with the CRC of
    /// all before it. An lcore that sends no slice for
    /// [`CHECKPOINT_STALL`], ends its stream in an error or sends more
    /// than its section is an error; so is a sink's error (its reader
    /// gone). Dropping the stream at any point ends the lcores' streams.
    pub fn write(self, mut sink: impl FnMut(Vec<u8>) -> Result<(), String>) -> Result<(), MgmtError> {
        let id = self.job;
        let fail = |why: String| err(500, format!("job {id}: {why}"));
        let mut crc = crc32fast::Hasher::new();
        crc.update(&self.head);
        sink(self.head).map_err(&fail)?;
        for (i, (slices, len)) in self.sections.into_iter().enumerate() {
            let mut got = 0u64;
            while got < len {
                let bytes = match slices.recv_timeout(CHECKPOINT_STALL) {
                    Ok(Slice::Bytes(b)) => b,
                    Ok(Slice::Failed(why)) => return Err(fail(format!("lcore {i}: {why}"))),
                    Err(e) => {
                        return Err(fail(format!(
                            "lcore {i} sent {got} of its {len} bytes of tables, then nothing ({e})"
                        )))
                    }
                };
                got += bytes.len() as u64;
                if got > len {
                    return Err(fail(format!(
                        "lcore {i} sent {got} bytes of tables, {len} were stated"
                    )));
                }
                crc.update(&bytes);
                sink(bytes).map_err(&fail)?;
            }
        }
        sink(crc.finalize().to_le_bytes().to_vec()).map_err(&fail)
    }
}

/// One running lcore, as the management side sees it.
#[derive(Debug)]
pub struct LcoreHandle {
    /// Its command queue.
    pub commands: Sender<Command>,
    /// Its counters.
    pub counters: Arc<ShardCounters>,
    /// Its thread.
    pub thread: Option<JoinHandle<std::io::Result<()>>>,
}

/// A management request's failure: an HTTP status and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MgmtError {
    /// HTTP status.
    pub status: u16,
    /// What went wrong.
    pub message: String,
}

fn err(status: u16, message: impl Into<String>) -> MgmtError {
    MgmtError {
        status,
        message: message.into(),
    }
}

/// What this dataplane allocates for a job ([`DataplaneInfo::memory_model`]):
/// the engine's figures for slot memory from `mem` and the registry's for
/// the job's entry and its spec's keys.
pub fn memory_model(mem: &dyn phub_engine::slotmem::SlotAllocator) -> MemoryModel {
    // Cast (each): sizes of small structs, far below 2^32.
    #[allow(clippy::cast_possible_truncation)]
    MemoryModel {
        // The registry's entry: its map node and the job's description,
        // and the spec's name and optimizer; the keys are counted apart.
        job_bytes: (std::mem::size_of::<(u16, Registered)>() + 256) as u32,
        key_bytes: std::mem::size_of::<phub_proto::spec::KeySpec>() as u32,
        ..engine::memory_model(mem)
    }
}

/// An installed job in the registry: what `GET /v1/jobs` lists, and the
/// install it came from (a checkpoint holds it).
#[derive(Debug)]
struct Registered {
    /// The job as listed, with the memory it holds.
    installed: InstalledJob,
    /// Its install request, the spec's spare capacity shrunk away.
    request: InstallJob,
}

/// The jobs installed, and those being installed.
#[derive(Debug, Default)]
struct Registry {
    jobs: BTreeMap<u16, Registered>,
    /// Jobs whose install is under way (a restore reading its checkpoint,
    /// the lcores taking the job), with the memory reserved for each: the
    /// registry's lock is not held across an install, so that listing,
    /// epochs, checkpoints, removals and installs of the other jobs go on
    /// beside a restore of gigabytes. A request for the job itself waits
    /// for its install to end ([`Manager::settled`]) or is refused.
    installing: BTreeMap<u16, u64>,
}

/// Job `id`'s place in [`Registry::installing`] while its install is
/// under way: dropped (the install ended, registered, failed or panicked),
/// the reservation goes and the requests waiting for it wake.
struct Reservation<'m> {
    mgr: &'m Manager,
    id: u16,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.mgr.registry().installing.remove(&self.id);
        self.mgr.install_ended.notify_all();
    }
}

/// The management state of a running dataplane.
#[derive(Debug)]
pub struct Manager {
    info: DataplaneInfo,
    lcores: Vec<LcoreHandle>,
    registry: Mutex<Registry>,
    /// Signalled each time an install ends (its job registered or not).
    install_ended: Condvar,
    /// The memory the registered jobs hold, kept with the registry
    /// (changed under its lock), so that `GET /v1/info`, control's
    /// heartbeat, never waits on the registry.
    memory_used: std::sync::atomic::AtomicU64,
    clock: Clock,
    port_stats: Option<PortStatsReader>,
    socket_drops: Option<SocketDropsReader>,
    /// The lcores' spin before they sleep, where they spin (kernel UDP,
    /// not busy polling).
    spin: Option<Arc<crate::spin::SpinGate>>,
}

/// Reads how many datagrams the kernel dropped at lcore i's socket
/// (kernel-UDP backend), reported as the `socket_full` drop reason.
pub struct SocketDropsReader(pub Box<dyn Fn(usize) -> Option<u64> + Send + Sync>);

impl std::fmt::Debug for SocketDropsReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SocketDropsReader")
    }
}

/// Reads a DPDK port's own counters for `/v1/stats` (DPDK backend).
pub struct PortStatsReader(pub Box<dyn Fn() -> Option<PortStats> + Send + Sync>);

impl std::fmt::Debug for PortStatsReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PortStatsReader")
    }
}

impl Manager {
    /// Wraps running lcores. `info.memory_used_bytes` is kept up to date.
    pub fn new(info: DataplaneInfo, lcores: Vec<LcoreHandle>, clock: Clock) -> Manager {
        Manager {
            info,
            lcores,
            registry: Mutex::new(Registry::default()),
            install_ended: Condvar::new(),
            memory_used: std::sync::atomic::AtomicU64::new(0),
            clock,
            port_stats: None,
            socket_drops: None,
            spin: None,
        }
    }

    /// Reports the kernel's drops at each lcore's socket in `/v1/stats`,
    /// as the lcore's `socket_full` drops.
    pub fn with_socket_drops(mut self, reader: SocketDropsReader) -> Manager {
        self.socket_drops = Some(reader);
        self
    }

    /// Reports the spin the lcores use now in `/v1/stats` (`spin_us`).
    pub fn with_spin(mut self, gate: Arc<crate::spin::SpinGate>) -> Manager {
        self.spin = Some(gate);
        self
    }

    /// Reports a DPDK port's counters beside the lcores' in `/v1/stats`.
    pub fn with_port_stats(mut self, reader: PortStatsReader) -> Manager {
        self.port_stats = Some(reader);
        self
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The registry once job `id` is not being installed (its install
    /// ended, the job registered or not).
    fn settled(&self, id: u16) -> MutexGuard<'_, Registry> {
        self.install_ended
            .wait_while(self.registry(), |r| r.installing.contains_key(&id))
            .unwrap_or_else(|p| p.into_inner())
    }

    /// `GET /v1/info`.
    pub fn info(&self) -> DataplaneInfo {
        let mut i = self.info.clone();
        i.memory_used_bytes = self.memory_used.load(std::sync::atomic::Ordering::Relaxed);
        i
    }

    /// `GET /v1/jobs`.
    pub fn list(&self) -> Vec<InstalledJob> {
        self.registry()
            .jobs
            .values()
            .map(|j| j.installed.clone())
            .collect()
    }

    /// `PUT /v1/jobs/{id}`: installs on every lcore or on none.
    pub fn install(&self, id: u16, req: InstallJob) -> Result<InstalledJob, MgmtError> {
        self.install_with(id, req, None)
    }

    /// `PUT /v1/jobs/{id}` with a checkpoint body, read as it streams in
    /// (its job and slots already read): installs the job it describes
    /// with every slot and table restored, on every lcore or on none. Once
    /// the install's checks pass and its memory is counted, each table is
    /// made and its rows read from the body as they come (on this thread:
    /// the lcores go on serving), then the CRC at the file's end is
    /// checked; only then does any lcore take the job. So the appliance
    /// holds the tables it builds and never the file; a body that is cut,
    /// corrupt or does not fit leaves nothing installed. Its memory is
    /// reserved first and the registry is not held while it reads: the
    /// other jobs' requests (list, epochs, checkpoints, installs) are
    /// served meanwhile; an epoch, removal or install of this job waits
    /// for it, a checkpoint of it is refused (409).
    pub fn restore<R: std::io::Read>(
        &self,
        id: u16,
        restoring: Restoring<R>,
    ) -> Result<InstalledJob, MgmtError> {
        let mut job = restoring.job().clone();
        // A replicated job's checkpoint holds this appliance's own part
        // (PROTOCOL.md §11.7, "Restored parts"), whatever epoch its install
        // was at: it is installed at epoch 0, as admitted (its own part's
        // primary), and control puts it the epoch the job went back at
        // next. (At the file's epoch a part adopted then would be served
        // empty, and an appliance come back would keep its own part as
        // backup slots the file does not fill.)
        if let Some(r) = job.replication.as_mut() {
            r.epoch = 0;
            r.down.clear();
            r.joined.clear();
            r.moved.clear();
            r.restored = 0;
        }
        // A hierarchical job's checkpoint is of its flat form, as it is
        // restored (at an epoch above 0, when it is flat: §11.11).
        crate::replication::flat_form(&mut job);
        let workers = u16::try_from(job.spec.workers).unwrap_or(u16::MAX);
        let (dtype, consistency) = (job.spec.dtype, job.spec.consistency);
        let read: ReadSaved<'_> = Box::new(move |installs: &[Vec<TableInstall>]| {
            let start = std::time::Instant::now();
            let mut built: Vec<Vec<RestoredTable>> = installs.iter().map(|_| Vec::new()).collect();
            let (c, len) = restoring
                .finish(|t| {
                    let install = installs
                        .get(t.lcore)
                        .and_then(|ts| ts.iter().find(|i| i.key == t.key))
                        .ok_or_else(|| format!("no table key {} is installed on lcore {}", t.key, t.lcore))?;
                    let table =
                        RestoredTable::read(id, workers, dtype, consistency, install, t.rounds, t.bytes)
                            .map_err(|e| e.to_string())?;
                    built[t.lcore].push(table);
                    Ok(())
                })
                .map_err(|e| err(400, format!("job {id}: {e}")))?;
            let rows: u64 = built.iter().flatten().map(RestoredTable::rows_stored).sum();
            log::info!(
                "job {id}: a checkpoint of {len} bytes read, {rows} table rows restored, in {:.2} s",
                start.elapsed().as_secs_f64()
            );
            // A file of format 1 or 2 saved no table: every lcore's list
            // empty, and the install makes them.
            Ok(c.lcores
                .into_iter()
                .zip(built)
                .map(|(slots, tables)| Saved { slots, tables })
                .collect())
        });
        let r = self.install_with(id, job, Some(read))?;
        log::info!("job {id} restored from a checkpoint");
        Ok(r)
    }

    /// `GET /v1/jobs/{id}/checkpoint`, streamed: every lcore copies the
    /// job's slots and begins streaming its tables at once (the lcores go
    /// on serving: copy on write, [`crate::lcore::Checkpoint`]); the file
    /// is then written as its parts come, to a thread of its own, so that
    /// the appliance never holds a copy of a table. Its length is known
    /// before the first byte.
    pub fn checkpoint_begin(&self, id: u16) -> Result<CheckpointStream, MgmtError> {
        let mut job = {
            let reg = self.registry();
            if reg.installing.contains_key(&id) {
                return Err(err(
                    409,
                    format!("job {id} is being installed (or restored); checkpoint it once it is"),
                ));
            }
            reg.jobs
                .get(&id)
                .map(|j| j.request.clone())
                .ok_or_else(|| err(404, format!("job {id} is not installed")))?
        };
        // A replicated hierarchical job's lcores save their home slots: its
        // checkpoint is of its flat form (PROTOCOL.md §11.11).
        crate::replication::flat_form(&mut job);
        let mut lcores = Vec::with_capacity(self.lcores.len());
        let mut sections = Vec::with_capacity(self.lcores.len());
        for (i, l) in self.lcores.iter().enumerate() {
            let (tx, rx) = bounded(1);
            let (slices, section) = bounded(SLICES_AHEAD);
            let c = crate::lcore::Checkpoint {
                job: id,
                reply: tx,
                slices,
            };
            // A refusal drops the sections begun: their lcores end them.
            let (slots, len) = l
                .commands
                .send_timeout(Command::Checkpoint(c), ACK_TIMEOUT)
                .ok()
                .and_then(|()| rx.recv_timeout(ACK_TIMEOUT).ok())
                .ok_or_else(|| err(500, format!("lcore {i} did not answer the checkpoint request")))?
                .map_err(|r| match r {
                    CheckpointRefused::NotInstalled => err(404, format!("job {id} is not installed on lcore {i}")),
                    CheckpointRefused::Busy(other) => err(
                        409,
                        format!(
                            "job {id}: lcore {i} is streaming a checkpoint of job {other}; one at a time per lcore, \
                             try again when it is done"
                        ),
                    ),
                    CheckpointRefused::Failed(why) => err(500, format!("job {id}: lcore {i}: {why}")),
                })?;
            lcores.push(slots);
            sections.push((section, len));
        }
        let head = Checkpoint::encode_head(&job, &lcores).map_err(|e| err(500, format!("job {id}: {e}")))?;
        Ok(CheckpointStream {
            job: id,
            head,
            sections,
        })
    }

    fn install_with(
        &self,
        id: u16,
        req: InstallJob,
        restore: Option<ReadSaved<'_>>,
    ) -> Result<InstalledJob, MgmtError> {
        if req.id != id {
            return Err(err(
                400,
                format!("job id {} in the body does not match {id} in the path", req.id),
            ));
        }
        if req.token == 0 {
            return Err(err(
                400,
                format!("job {id}: token 0 is not a token (control gives every job a random non-zero one)"),
            ));
        }
        req.spec.validate().map_err(|e| err(400, e.to_string()))?;
        let n = self.lcores.len();
        if req.layout.lcores.len() != n {
            return Err(err(
                400,
                format!(
                    "layout covers {} lcores; this dataplane has {n}",
                    req.layout.lcores.len()
                ),
            ));
        }
        // A job sharded over several appliances gives this one a part: its
        // lcores' runs of the chunk sequence, which need not start at 0.
        let placement =
            Placement::part(&req.spec, req.layout.clone()).map_err(|e| err(400, format!("job {id}: {e}")))?;
        let hier = match (&req.hierarchy, req.spec.hierarchical()) {
            (None, false) => None,
            // A replicated hierarchical job after its first epoch change
            // (or restored): flat over its home layout (PROTOCOL.md §11.11).
            (None, true) if req.replication.is_some() => None,
            (Some(_), true) => Some(hierarchy_plan(&req, n).map_err(|e| err(400, format!("job {id}: {e}")))?),
            (h, _) => {
                return Err(err(
                    400,
                    format!(
                        "job {id}: the spec {} hierarchical = true but the install {} a hierarchy",
                        if h.is_some() { "does not say" } else { "says" },
                        if h.is_some() { "has" } else { "has no" }
                    ),
                ))
            }
        };
        // A replicated job's lcores get their primary and backup slots.
        let replicated = match (&req.replication, req.spec.replicas()) {
            (None, 1) => None,
            (Some(r), n) if n > 1 => Some((
                if hier.is_some() {
                    // A hierarchical job's home slots are its primary
                    // slots: its hierarchy plan carries their replicas
                    // (PROTOCOL.md §11.11).
                    Vec::new()
                } else {
                    crate::replication::plan(&req, self.lcores.len())
                        .map_err(|e| err(400, format!("job {id}: {e}")))?
                },
                crate::replication::lcore_bytes(&self.info.memory_model, &req, r),
            )),
            (r, n) => {
                return Err(err(
                    400,
                    format!(
                        "job {id}: the spec says placement.replicas = {n} but the install {} replication",
                        if r.is_some() { "has" } else { "has no" }
                    ),
                ))
            }
        };
        // Table keys: where this appliance's lcores are among the job's.
        let entries = tables::entries(&req, n).map_err(|e| err(400, format!("job {id}: {e}")))?;
        let mut cost = match &hier {
            Some((home, per_lcore)) => self.info.memory_model.hierarchical_cost(
                &req.spec,
                &req.layout,
                home,
                per_lcore.first().map_or(0, |h| h.homes.addrs.len()),
            ),
            None => {
                // An appliance installed again after being declared down
                // has no primary slots: its part is kept as backup slots
                // (`replication::lcore_bytes`).
                let emptied;
                let layout = match &req.replication {
                    Some(r) if crate::replication::back(r) => {
                        emptied = req.layout.without_chunks();
                        &emptied
                    }
                    _ => &req.layout,
                };
                // A sharded job's tables are spread over all its lcores.
                self.info.memory_model.part_cost(
                    &req.spec,
                    layout,
                    req.spec.result_store(self.info.shm),
                    entries.total as usize,
                )
            }
        };
        if let Some((_, extra)) = &replicated {
            for (c, e) in cost.lcores.iter_mut().zip(extra) {
                *c += e;
            }
        }
        let need = cost.total();
        // An install of the same job under way is waited for.
        let mut reg = self.settled(id);
        if reg.jobs.contains_key(&id) {
            return Err(err(409, format!("job {id} is already installed")));
        }
        let used: u64 = reg.jobs.values().map(|j| j.installed.memory_bytes).sum::<u64>()
            + reg.installing.values().sum::<u64>();
        if used + need > self.info.memory_budget_bytes {
            return Err(err(
                507,
                format!(
                    "job {id} needs {need} bytes of memory (slot buffers and records, blocks, per-rank and \
                     per-key bookkeeping{}); {} of {} are free",
                    if cost.shm > 0 {
                        format!(", {} of shared-memory regions", cost.shm)
                    } else {
                        String::new()
                    },
                    self.info.memory_budget_bytes.saturating_sub(used),
                    self.info.memory_budget_bytes
                ),
            ));
        }
        // Reserved, and the registry let go of: a restore reads its
        // checkpoint (seconds to minutes) beside the other jobs' requests.
        reg.installing.insert(id, need);
        drop(reg);
        let reservation = Reservation { mgr: self, id };
        if cost.shm > 0 {
            let dir = std::path::Path::new(phub_proto::shm::DIR);
            let free = phub_net::shm::free_bytes(dir).map_err(|e| {
                err(
                    507,
                    format!("job {id}: cannot tell how much of {} is free: {e}", dir.display()),
                )
            })?;
            if cost.shm > free {
                return Err(err(
                    507,
                    format!(
                        "job {id}'s shared-memory regions need {} bytes in {}, which has {free} bytes free",
                        cost.shm,
                        dir.display()
                    ),
                ));
            }
        }
        let workers = u16::try_from(req.spec.workers).unwrap_or(u16::MAX);
        // With --shm every lcore gives the job its shared-memory regions.
        let shm = (req.spec.result_store(self.info.shm) == ResultStore::SharedRegion).then_some(ShmSetup {
            base_port: self.info.data.base_port,
            chunk_elems: req.layout.chunk_elems,
        });
        // Each lcore's table keys; a restore reads its state now, its
        // memory counted (a cut or corrupt file ends the install here).
        let mut installs: Vec<Vec<TableInstall>> =
            (0..n).map(|i| tables::installs(&req, entries, i)).collect();
        let mut restore = match restore {
            Some(read) => Some(read(&installs)?),
            None => None,
        };
        let mut done = Vec::new();
        let mut total = cost.registry + cost.shm;
        let hierarchical = hier.is_some();
        let mut hier = hier.map(|(_, per_lcore)| per_lcore.into_iter());
        let mut replicated = replicated.map(|(plan, _)| plan.into_iter());
        for (i, l) in self.lcores.iter().enumerate() {
            let (tx, rx) = bounded(1);
            let mut job = JobInstall {
                id,
                token: req.token,
                workers,
                dtype: req.spec.dtype,
                // A hierarchical job's rack slots only add (its home slots
                // run the optimizer).
                optimizer: if hierarchical {
                    Optimizer::Sum
                } else {
                    req.spec.optimizer
                },
                consistency: req.spec.consistency,
                chunk_elems: req.layout.chunk_elems,
                slots: placement.slots(i).collect(),
            };
            let state = restore.as_mut().map(|r| std::mem::take(&mut r[i]));
            // The lcore restores the state before it answers: longer the
            // more there is (a table of gigabytes takes tens of seconds).
            let wait = ACK_TIMEOUT + restore_time(state.as_ref());
            // A hierarchical job's lcores get their part of it; the other
            // jobs, with --shm, their shared-memory regions.
            let kind = match (hier.as_mut().and_then(Iterator::next), shm) {
                (Some(part), _) => InstallKind::Hierarchical(Box::new(part)),
                (None, Some(setup)) => InstallKind::Shared(setup),
                (None, None) => InstallKind::Plain,
            };
            // A replicated job's lcore: its primary slots are the plan's,
            // its run's (the same runs), or none for an appliance that came
            // back (its own part is then among its backup slots, at its own
            // slot numbers, PROTOCOL.md §11.7).
            let kind = match replicated.as_mut().and_then(Iterator::next) {
                Some((slots, rep)) => {
                    debug_assert!(
                        slots.is_empty() || slots == job.slots,
                        "lcore {i}: the replica plan's slots"
                    );
                    job.slots = slots;
                    InstallKind::Replicated(Box::new(rep))
                }
                None => kind,
            };
            // Slot memory that runs out is the budget's 507; anything else
            // is the dataplane's fault.
            let answer = l
                .commands
                .send_timeout(
                    Command::Install(Install {
                        job,
                        kind,
                        tables: std::mem::take(&mut installs[i]),
                        restore: state,
                        reply: tx,
                    }),
                    ACK_TIMEOUT,
                )
                .map_err(|_| (500, format!("lcore {i} did not take the command")))
                .and_then(|()| {
                    rx.recv_timeout(wait).map_err(|_| {
                        // It may still install the job: a removal queued
                        // behind the install takes it away again then.
                        self.remove_on(i, id);
                        (500, format!("lcore {i} did not answer within {wait:?}"))
                    })
                })
                .and_then(|r| {
                    r.map_err(|e| {
                        let status = match e {
                            EngineError::SlotMemory { .. } => 507,
                            // A table the spec declares but this engine
                            // cannot serve: the submitter's to change.
                            EngineError::Table { .. } => 400,
                            _ => 500,
                        };
                        (status, format!("lcore {i}: {e}"))
                    })
                });
            match answer {
                Ok(bytes) => {
                    if bytes != cost.lcores[i] {
                        log::warn!(
                            "job {id}: lcore {i} holds {bytes} bytes; admission charged {}",
                            cost.lcores[i]
                        );
                    }
                    total += bytes;
                    done.push(i);
                }
                Err((status, message)) => {
                    for &j in &done {
                        self.remove_on(j, id);
                    }
                    return Err(err(status, format!("job {id} not installed: {message}")));
                }
            }
        }
        drop(placement);
        let mut req = req;
        // The registry keeps the spec: no spare capacity from parsing.
        req.spec.keys.shrink_to_fit();
        let job = InstalledJob {
            id,
            memory_bytes: total,
            shm_bytes: cost.shm,
        };
        log::info!(
            "installed job {id}: {} chunks, {total} bytes of memory ({} in shared memory)",
            req.layout.chunk_count(),
            cost.shm
        );
        let mut reg = self.registry();
        reg.installing.remove(&id);
        reg.jobs.insert(
            id,
            Registered {
                installed: job.clone(),
                request: req,
            },
        );
        self.memory_used
            .fetch_add(total, std::sync::atomic::Ordering::Relaxed);
        drop(reg);
        drop(reservation);
        Ok(job)
    }

    fn remove_on(&self, lcore: usize, id: u16) -> bool {
        let (tx, rx) = bounded(1);
        self.lcores[lcore]
            .commands
            .send_timeout(Command::Remove(id, tx), ACK_TIMEOUT)
            .is_ok()
            && rx.recv_timeout(ACK_TIMEOUT).unwrap_or(false)
    }

    /// `PUT /v1/jobs/{id}/epoch` (PROTOCOL.md §11.6): applies a replicated
    /// job's epoch on every lcore. `Ok(true)` when it changed something,
    /// `Ok(false)` when it is the installed epoch with the same down list;
    /// 404 for a job not installed, 409 for a job not replicated, an
    /// older epoch than installed or what the engine does not build, 400
    /// for a malformed view, 410 when it would have this appliance serve
    /// a part whose state copy it has not all received (the part is
    /// lost, PROTOCOL.md §11.7). Every lcore checks the view against the same
    /// install, so all take it or all refuse it.
    pub fn epoch(&self, id: u16, view: EpochView) -> Result<bool, MgmtError> {
        // Held across the lcores: no install or removal of the job between
        // (one under way is waited for).
        let reg = self.settled(id);
        if !reg.jobs.contains_key(&id) {
            return Err(err(404, format!("job {id} is not installed")));
        }
        let mut changed = false;
        for (i, l) in self.lcores.iter().enumerate() {
            let (tx, rx) = bounded(1);
            let r = l
                .commands
                .send_timeout(Command::Epoch(id, view.clone(), tx), ACK_TIMEOUT)
                .ok()
                .and_then(|()| rx.recv_timeout(ACK_TIMEOUT).ok())
                .ok_or_else(|| {
                    err(
                        500,
                        format!(
                            "job {id}: lcore {i} did not answer the change to epoch {}",
                            view.epoch
                        ),
                    )
                })?;
            match r {
                Ok(c) => changed |= c,
                Err(e @ EngineError::Epoch { conflict, .. }) => {
                    return Err(err(if conflict { 409 } else { 400 }, format!("lcore {i}: {e}")))
                }
                // Gone: the part's state is nowhere any more.
                Err(e @ EngineError::PartLost { .. }) => return Err(err(410, format!("lcore {i}: {e}"))),
                Err(e) => return Err(err(500, format!("lcore {i}: {e}"))),
            }
        }
        if changed {
            log::info!("job {id}: epoch {} installed, down {:?}", view.epoch, view.down);
        }
        Ok(changed)
    }

    /// `DELETE /v1/jobs/{id}`.
    pub fn remove(&self, id: u16) -> Result<(), MgmtError> {
        let mut reg = self.settled(id);
        let Some(gone) = reg.jobs.remove(&id) else {
            return Err(err(404, format!("job {id} is not installed")));
        };
        self.memory_used
            .fetch_sub(gone.installed.memory_bytes, std::sync::atomic::Ordering::Relaxed);
        for i in 0..self.lcores.len() {
            self.remove_on(i, id);
        }
        log::info!("removed job {id}");
        Ok(())
    }

    /// `GET /v1/stats`.
    pub fn stats(&self) -> DataplaneStats {
        // Cast: one handle per running lcore, at most MAX_LCORES (256,
        // checked in Config::lcore_count).
        #[allow(clippy::cast_possible_truncation)]
        let lcores = self
            .lcores
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let mut s = l.counters.snapshot(i as u16);
                if let Some(n) = self
                    .socket_drops
                    .as_ref()
                    .and_then(|r| (r.0)(i))
                    .filter(|&n| n > 0)
                {
                    *s.drops.entry(NetDrop::SocketFull.name().to_string()).or_default() += n;
                }
                s
            })
            .collect();
        let now = self.clock.now();
        let mut jobs: BTreeMap<u16, (JobLive, Vec<u64>)> = BTreeMap::new();
        for l in &self.lcores {
            let (tx, rx) = bounded(1);
            if l.commands
                .send_timeout(Command::JobStats(tx), ACK_TIMEOUT)
                .is_err()
            {
                continue;
            }
            let Ok(list) = rx.recv_timeout(ACK_TIMEOUT) else {
                continue;
            };
            for s in list {
                let e = jobs.entry(s.id).or_insert_with(|| {
                    (
                        JobLive {
                            id: s.id,
                            pushes: 0,
                            rounds_completed: 0,
                            round_range: None,
                            silent_ms: Vec::new(),
                            clock: ClockStats::default(),
                            copies: None,
                            tables: Vec::new(),
                        },
                        vec![0; s.last_seen.len()],
                    )
                });
                e.0.pushes += s.pushes;
                e.0.rounds_completed += s.rounds_completed;
                if let Some((lo, hi)) = s.round_range {
                    e.0.round_range = Some(e.0.round_range.map_or((lo, hi), |(a, b)| (a.min(lo), b.max(hi))));
                }
                for (m, t) in e.1.iter_mut().zip(&s.last_seen) {
                    *m = (*m).max(*t);
                }
                TableLive::merge_all(&mut e.0.tables, &s.tables);
                if let Some(c) = s.copies {
                    match &mut e.0.copies {
                        Some(m) => m.merge(&c),
                        None => e.0.copies = Some(c),
                    }
                }
                // Lcores without the job's slots report no clocks.
                e.0.clock.merge(&ClockStats {
                    clocks: s.clocks,
                    max_lead: s.max_lead,
                    held: s.held,
                    held_total: s.held_total,
                    held_wait_us: s.held_wait_us,
                    held_wait_max_us: s.held_wait_max_us,
                });
            }
        }
        DataplaneStats {
            backend: self.info.backend,
            port: self.port_stats.as_ref().and_then(|r| (r.0)()),
            spin_us: self.spin.as_ref().map(|g| g.micros()),
            lcores,
            jobs: jobs
                .into_values()
                .map(|(mut j, seen)| {
                    j.silent_ms = seen
                        .iter()
                        .map(|&t| (t != 0).then(|| now.saturating_sub(t) / 1_000_000))
                        .collect();
                    j
                })
                .collect(),
        }
    }

    /// Number of lcores.
    pub fn lcore_count(&self) -> usize {
        self.lcores.len()
    }

    /// Tells every lcore to stop (through `stop`) and joins them.
    pub fn join_lcores(&mut self, stop: &AtomicBool) {
        stop.store(true, Ordering::Relaxed);
        for (i, l) in self.lcores.iter_mut().enumerate() {
            if let Some(t) = l.thread.take() {
                match t.join() {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => log::error!("lcore {i} stopped on an I/O error: {e}"),
                    Err(_) => log::error!("lcore {i} panicked"),
                }
            }
        }
    }
}

fn json<T: serde::Serialize>(status: u16, v: &T) -> Response {
    match serde_json::to_vec(v) {
        Ok(body) => Response::new(status, "application/json", body),
        Err(e) => Response::error(500, format!("serialising the answer: {e}")),
    }
}

fn error(e: MgmtError) -> Response {
    Response::error(e.status, e.message)
}

/// The management API over HTTP: what each route does and who may call it.
///
/// Reading the dataplane's description, job list and counters (`GET
/// /v1/info`, `/v1/jobs`, `/v1/stats`) is open to whoever reaches the
/// listener: they hold no secret. Everything else (installing, restoring and
/// removing jobs, reading a checkpoint, which holds a job's token and
/// parameters) needs `Authorization: Bearer <management token>`, the token
/// in the dataplane's management token file (owner-only; see
/// [`phub_http::secret`]), checked before a body is read.
#[derive(Debug)]
pub struct Api {
    mgr: Arc<Manager>,
    token: String,
    token_path: std::path::PathBuf,
}

impl Api {
    /// The API over `mgr`, guarded by `token` (kept in `token_path`).
    pub fn new(mgr: Arc<Manager>, token: String, token_path: std::path::PathBuf) -> Api {
        Api {
            mgr,
            token,
            token_path,
        }
    }

    /// Largest request body: a checkpoint of a job as large as the whole
    /// slot memory budget, plus room for its description.
    pub fn body_limit(&self) -> usize {
        usize::try_from(self.mgr.info.memory_budget_bytes.saturating_mul(2))
            .unwrap_or(usize::MAX)
            .saturating_add(MIN_BODY_LIMIT)
    }
}

/// The body limit of a dataplane with no budget to speak of.
const MIN_BODY_LIMIT: usize = 64 << 20;

impl Handler for Api {
    /// The routes that need the token (installs, removals, checkpoints:
    /// control's calls) run in handlers the open reads cannot take.
    fn class(&self, head: &Request) -> Class {
        if MgmtRoute::is_open(&head.method, &head.path) {
            Class::Read
        } else {
            Class::Write
        }
    }

    /// The management token; failed checks are logged and limited per
    /// source by the listener.
    fn needs_credential(&self, head: &Request) -> bool {
        !MgmtRoute::is_open(&head.method, &head.path)
    }

    fn check_head(&self, head: &Request) -> Result<(), Response> {
        if MgmtRoute::is_open(&head.method, &head.path) {
            return Ok(());
        }
        let given = phub_http::bearer(head.header("Authorization")).map_err(|why| {
            Response::error(
                401,
                format!(
                    "{} {} needs the dataplane's management token ({why}): send `Authorization: Bearer <token>` \
                     with the token in {} (readable by the dataplane's owner only)",
                    head.method,
                    head.path,
                    self.token_path.display()
                ),
            )
        })?;
        if !phub_http::token_matches(given, &self.token) {
            return Err(Response::error(403, "wrong management token"));
        }
        Ok(())
    }

    /// An install's body is taken as it arrives: it may be a checkpoint
    /// of gigabytes ([`Manager::restore`]).
    fn body_stall(&self, head: &Request) -> Option<Duration> {
        matches!(
            MgmtRoute::parse(&head.method, &head.path),
            Ok(MgmtRoute::Install { .. })
        )
        .then_some(CHECKPOINT_STALL)
    }

    fn handle(&self, mut req: Request) -> Response {
        let mgr = &self.mgr;
        let stream = req.body_stream.take();
        let body = &req.body;
        let route = MgmtRoute::parse(&req.method, &req.path).map_err(|e| match e {
            RouteError::JobId { given } => err(
                400,
                format!("job id {given:?}: expected an integer from 1 to 65535"),
            ),
            // A known path with another method is no route here either.
            _ => err(404, format!("no route for {} {}", req.method, req.path)),
        });
        let result: Result<Response, MgmtError> = route.and_then(|route| match route {
            MgmtRoute::Info => Ok(json(200, &mgr.info())),
            // The token was checked before the request was handled.
            MgmtRoute::Auth => Ok(Response::new(204, "application/json", Vec::new())),
            MgmtRoute::Jobs => Ok(json(200, &mgr.list())),
            MgmtRoute::Stats => Ok(json(200, &mgr.stats())),
            MgmtRoute::Epoch { job: id } => {
                let view: EpochView = serde_json::from_slice(body).map_err(|e| {
                    err(
                        400,
                        format!(
                            "epoch of job {id}: {e}; expected {{\"epoch\": <u32>, \"down\": [<appliance index>, ...]}}"
                        ),
                    )
                })?;
                mgr.epoch(id, view)
                    .map(|_| Response::new(204, "application/json", Vec::new()))
            }
            MgmtRoute::Checkpoint { job: id } => {
                let stream = mgr.checkpoint_begin(id)?;
                let (tx, body) = phub_http::streamed(stream.file_bytes(), CHECKPOINT_STALL);
                let spawned = std::thread::Builder::new()
                    .name(format!("checkpoint-{id}"))
                    .spawn(move || {
                        let r = stream.write(|b| tx.send(b).map_err(|e| e.to_string()));
                        if let Err(e) = r {
                            tx.fail(format!("checkpoint of job {id}: {}", e.message));
                        }
                    });
                spawned.map_err(|e| err(500, format!("job {id}: no thread to write the checkpoint: {e}")))?;
                Ok(Response::streamed(200, "application/octet-stream", body))
            }
            MgmtRoute::Install { job: id } => {
                // The body as it arrives (Api::body_stall): a checkpoint is
                // restored as it streams, never held whole.
                let mut body = stream.ok_or_else(|| err(500, format!("job {id}: the install's body was not streamed")))?;
                let mut magic = Vec::with_capacity(CKPT_MAGIC.len());
                (&mut body)
                    .take(CKPT_MAGIC.len() as u64)
                    .read_to_end(&mut magic)
                    .map_err(|e| err(400, format!("install request for job {id}: {e}")))?;
                let body = std::io::Cursor::new(magic).chain(body);
                if body.get_ref().0.get_ref()[..] == CKPT_MAGIC[..] {
                    let r = Checkpoint::restore_from(body).map_err(|e| err(400, format!("job {id}: {e}")))?;
                    return mgr.restore(id, r).map(|j| json(201, &j));
                }
                let mut json_body = Vec::new();
                body.take(MIN_BODY_LIMIT as u64 + 1)
                    .read_to_end(&mut json_body)
                    .map_err(|e| err(400, format!("install request for job {id}: {e}")))?;
                if json_body.len() > MIN_BODY_LIMIT {
                    return Err(err(
                        413,
                        format!("install request for job {id}: a JSON body over {MIN_BODY_LIMIT} bytes"),
                    ));
                }
                let r: InstallJob = serde_json::from_slice(&json_body)
                    .map_err(|e| err(400, format!("install request for job {id}: {e}")))?;
                mgr.install(id, r).map(|j| json(201, &j))
            }
            MgmtRoute::Remove { job: id } => mgr
                .remove(id)
                .map(|()| Response::new(204, "application/json", Vec::new())),
        });
        result.unwrap_or_else(error)
    }
}
