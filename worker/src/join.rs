//! Joining a job: the HTTP join through phub-control, the checks of its
//! answer, and the wiring of a [`Worker`] from it (the socket, the
//! window, shared memory, the fault injector, the I/O thread).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use phub_http::{ClientError, Timeouts};
use phub_proto::api::{ApplianceAddr, JoinRequest, JoinResponse};
use phub_proto::fault::FaultSpec;
use phub_proto::layout::Placement;
use phub_proto::spec::Consistency;
use phub_proto::wire::{HEADER_LEN, MAX_PAYLOAD};

#[cfg(doc)]
use crate::config::auto_window;
use crate::config::{WorkerConfig, ASSUMED_LCORE_RCVBUF, CONGESTION_ENV, RACK_ENV, SPIN_ENV};
use crate::epoch::EpochFetch;
use crate::error::WorkerError;
use crate::inject::{self, INJECT_ENV};
use crate::io::{self, CurrentRegions};
use crate::keys::KeyTable;
use crate::net;
use crate::shm::{self, SHM_ENV};
use crate::stats;
use crate::tables::{table_infos, TableClaims};
use crate::transport::{AutoWindow, JobInfo, Routing, RowTransport, Transport};
use crate::worker::Worker;

/// The join's timeouts: 3 s to connect to a control, 10 s for its answer,
/// 10 s of trying the controls given.
const JOIN_TIMEOUTS: Timeouts = Timeouts {
    connect: Duration::from_secs(3),
    call: Duration::from_secs(10),
    wait: Duration::from_secs(10),
};

impl Worker {
    /// Joins `job` as `rank` through phub-control at `control_url` (e.g.
    /// `http://127.0.0.1:7700`, or several controls on one etcd prefix:
    /// `http://a:7700,http://b:7700`), with the default [`WorkerConfig`].
    pub fn join(control_url: &str, job: u16, token: u64, rank: u16) -> Result<Worker, WorkerError> {
        Worker::join_with(control_url, job, token, rank, WorkerConfig::default())
    }

    /// Joins `job` as `rank` through phub-control at `control_url` (one
    /// URL, or several separated by commas: [`phub_http::Controls`] tries
    /// the next while one does not take the join or answers `503`, for
    /// 10 s at most).
    ///
    /// A refusal by control (wrong token, unknown job, rank out of range...)
    /// is a [`WorkerError::Join`] carrying control's message verbatim.
    pub fn join_with(
        control_url: &str,
        job: u16,
        token: u64,
        rank: u16,
        config: WorkerConfig,
    ) -> Result<Worker, WorkerError> {
        Worker::join_as(control_url, job, token, rank, false, config)
    }

    /// Takes the place of `rank` in `job` after this worker's process was
    /// restarted: control accepts a rank that already joined. Follow it with
    /// [`Worker::pull`] on every key to catch up with the job's parameters
    /// and rounds, then carry on with `push_pull`.
    pub fn rejoin(
        control_url: &str,
        job: u16,
        token: u64,
        rank: u16,
        config: WorkerConfig,
    ) -> Result<Worker, WorkerError> {
        Worker::join_as(control_url, job, token, rank, true, config)
    }

    fn join_as(
        control_url: &str,
        job: u16,
        token: u64,
        rank: u16,
        rejoin: bool,
        config: WorkerConfig,
    ) -> Result<Worker, WorkerError> {
        // One control, or several on one etcd prefix (`URL1,URL2,...`): a
        // join goes on to the next while one does not take it or answers
        // 503, following the leader a follower names (phub_http::Controls).
        // https: control's certificate is checked against $PHUB_CA_FILE,
        // or the system's roots.
        let controls =
            phub_http::Controls::new(control_url, None, JOIN_TIMEOUTS).map_err(|e| WorkerError::Http {
                url: control_url.to_string(),
                message: e.to_string(),
            })?;
        let rack = config
            .rack
            .clone()
            .or_else(|| std::env::var(RACK_ENV).ok().filter(|r| !r.trim().is_empty()));
        let request = JoinRequest {
            token,
            rank,
            rejoin,
            rack,
        };
        let join_path = phub_proto::routes::Route::path(&phub_proto::routes::ControlRoute::Join { job });
        let join: JoinResponse = match controls.send(&phub_proto::routes::control::join(job, &request)) {
            Ok(j) => j,
            Err(ClientError::Api { status, message } | ClientError::Http { status, message, .. }) => {
                return Err(WorkerError::Join {
                    url: format!("{}{join_path}", controls.base()),
                    status,
                    message,
                })
            }
            Err(e) => {
                return Err(WorkerError::Http {
                    url: format!("{}{join_path}", controls.base()),
                    message: e.to_string(),
                })
            }
        };
        if join.job != job || join.rank != rank {
            return Err(WorkerError::BadJoin {
                message: format!(
                    "asked to join job {job} as rank {rank}, control answered for job {} rank {}",
                    join.job, join.rank
                ),
            });
        }
        Worker::from_join_at(join, token, config, Some(control_url))
    }

    /// Builds a worker from an already obtained [`JoinResponse`] (for tests
    /// and embedding): checks it, decides on shared memory, binds a UDP
    /// socket, sizes the window and starts the I/O thread.
    ///
    /// A replicated job's worker made this way cannot ask control for a
    /// new epoch (PROTOCOL.md §11.6): [`Worker::from_join_at`] names
    /// control.
    pub fn from_join(join: JoinResponse, token: u64, config: WorkerConfig) -> Result<Worker, WorkerError> {
        Worker::from_join_at(join, token, config, None)
    }

    /// [`Worker::from_join`], with the URL of the phub-control that
    /// answered the join: a replicated job's worker asks it for the job's
    /// epoch when an appliance names a newer one or stops answering
    /// (`GET /v1/jobs/{id}/epoch`, PROTOCOL.md §11.6).
    pub fn from_join_at(
        join: JoinResponse,
        token: u64,
        mut config: WorkerConfig,
        control_url: Option<&str>,
    ) -> Result<Worker, WorkerError> {
        match std::env::var(CONGESTION_ENV).as_deref().map(str::trim) {
            Ok("on") => config.congestion = true,
            Ok("off") => config.congestion = false,
            _ => {}
        }
        if let Ok(v) = std::env::var(SPIN_ENV) {
            let us: u64 = v.trim().parse().map_err(|_| WorkerError::Config {
                message: format!("{SPIN_ENV}={v:?}: not a number of microseconds (0 sleeps at once)"),
            })?;
            config.spin = Duration::from_micros(us);
        }
        let (lcores, placement) = check_join(&join)?;
        let places = (0..placement.chunks().total())
            .map(|seq| {
                placement
                    .place_of(seq)
                    .expect("a placement places every chunk of its sequence")
            })
            .collect();
        let shm = shared_memory(&join, token, &config, &lcores)?;
        // On loopback only when every appliance is there.
        let far = lcores
            .iter()
            .find(|a| !a.ip().is_loopback())
            .unwrap_or(&lcores[0]);
        let socket = Bound::new(far.ip(), &config)?;
        let (window, auto) = window_for(&join, &config, socket.info.rcvbuf);
        let stats = Arc::new(stats::Counters::default());
        let inject = fault_injector(&join, &config, &stats)?;
        let info = JobInfo {
            job: join.job,
            token,
            rank: join.rank,
            dtype: join.spec.dtype,
            in_order: join.spec.rack_ranks().is_none(),
        };
        let regions = shm.as_ref().and_then(|(watch, _)| watch.regions());
        let tables = table_infos(&join)?;
        // Table rows go by datagrams, with the dense window (PROTOCOL.md §10).
        let mut rows = RowTransport::new(
            info.clone(),
            lcores.clone(),
            tables.clone(),
            window,
            &config,
            Arc::clone(&stats),
            Instant::now(),
        );
        let mut transport =
            Transport::new(info, window, &config, Arc::clone(&stats), regions, Instant::now());
        if let Some(auto) = auto {
            // Remade as the lcores state their receive-buffer shares.
            transport.set_auto_window(auto);
        }
        if let Some(routing) = routing_for(&join, &placement, &lcores)? {
            // A replicated job's tables are routed by entry in the same
            // epochs (PROTOCOL.md §11.9).
            rows.set_routing(routing.clone());
            transport.set_routing(routing);
        }
        let keys = KeyTable::new(join.spec.keys.len());
        for t in &tables {
            keys.set_table(t.key);
        }
        let (cmds, cmd_rx) = crossbeam_channel::unbounded();
        let sleeping = Arc::new(AtomicBool::new(false));
        let (watch, shm) = shm.unzip();
        let thread = io::IoThread::new(
            io::IoParts {
                socket: socket.socket,
                own: socket.local,
                sleeping: Arc::clone(&sleeping),
                cmds: cmd_rx,
                keys: keys.clone(),
                stats: Arc::clone(&stats),
                inject,
                regions: watch,
                spin: config.spin,
                epoch: EpochFetch::new(control_url, join.job),
            },
            transport,
            rows,
        );
        let thread = std::thread::Builder::new()
            .name(format!("phub-worker-{}-{}", join.job, join.rank))
            .spawn(move || thread.run())
            .map_err(io_err("starting the worker's I/O thread"))?;
        let (local, socket_info) = (socket.local, socket.info);
        log::info!(
            "phub-worker: job {} rank {} of {} joined; {} keys, {} chunks, dataplane {}, socket {local} \
             (window {window}, shared memory {}, gso {}, gro {}, rcvbuf {})",
            join.job,
            join.rank,
            join.spec.workers,
            join.spec.keys.len(),
            join.layout.chunk_count(),
            lcores[0],
            if shm.is_some() { "yes" } else { "no" },
            socket_info.gso,
            socket_info.gro,
            socket_info.rcvbuf,
        );
        Ok(Worker {
            job: join.job,
            token,
            rank: join.rank,
            spec: join.spec,
            placement,
            places,
            lcores,
            keys,
            cmds,
            waker: socket.waker,
            local,
            sleeping,
            socket_info,
            stats,
            shm,
            table_claims: TableClaims::new(&tables),
            tables,
            thread: Some(thread),
        })
    }
}

/// The shared-memory mapping a join chooses ([`WorkerConfig::shm`],
/// [`SHM_ENV`]), if any: the I/O thread's watch over it and the mapping in
/// use as the API side sees it.
fn shared_memory(
    join: &JoinResponse,
    token: u64,
    config: &WorkerConfig,
    lcores: &[SocketAddr],
) -> Result<Option<(io::RegionWatch, CurrentRegions)>, WorkerError> {
    let mut mode = shm::effective_mode(config.shm, std::env::var(SHM_ENV).ok().as_deref())?;
    if join.spec.consistency != Consistency::Sync {
        // The appliance makes regions for BSP jobs only (PROTOCOL.md §5.8).
        let why = format!(
            "shared memory is for BSP jobs only; job {} is {} (PROTOCOL.md §5.8): its chunks and results go by datagrams",
            join.job, join.spec.consistency
        );
        if mode == shm::ShmMode::On {
            return Err(WorkerError::SharedMemory { message: why });
        }
        log::debug!("phub-worker: datagrams, not shared memory: {why}");
        return Ok(None);
    }
    if join.appliances.len() > 1 {
        // Regions are per appliance (named by its base port); a job over
        // several goes by datagrams.
        let why = format!(
            "job {} is sharded over {} appliances; shared memory serves a job on one appliance",
            join.job,
            join.appliances.len()
        );
        if mode == shm::ShmMode::On {
            return Err(WorkerError::SharedMemory { message: why });
        }
        log::debug!("phub-worker: datagrams, not shared memory: {why}");
        mode = shm::ShmMode::Off;
    }
    let spec = shm::RegionSpec::new(
        join.dataplane.base_port,
        join.job,
        token,
        join.rank,
        &join.layout,
        join.spec.dtype,
    );
    let regions = shm::decide(mode, join.job, join.rank, lcores, || spec.open())?;
    Ok(regions.map(|r| io::RegionWatch::new(spec, r, join.job, join.rank)))
}

/// A replicated job's routing by epoch (PROTOCOL.md §11.6), from its
/// join answer; `None` for a job without replication.
fn routing_for(
    join: &JoinResponse,
    placement: &Placement,
    lcores: &[SocketAddr],
) -> Result<Option<Routing>, WorkerError> {
    let Some(rep) = &join.replication else {
        return Ok(None);
    };
    let bad = |message: String| WorkerError::BadJoin {
        message: format!("job {}: replication: {message}", join.job),
    };
    let per_appliance: Vec<usize> = if join.appliances.is_empty() {
        vec![join.layout.lcore_count()]
    } else {
        join.appliances
            .iter()
            .map(|a| usize::try_from(a.lcores).unwrap_or(usize::MAX))
            .collect()
    };
    let key_first = (0..join.spec.keys.len())
        .map(|k| u32::try_from(k).map_or(0, |k| placement.chunks().of_key(k).start))
        .collect();
    let mut routing = Routing::new(
        join.layout.lcores.clone(),
        &per_appliance,
        rep.racks.clone(),
        usize::from(rep.replicas),
        rep.epoch.clone(),
        lcores.to_vec(),
        key_first,
    )
    .map_err(bad)?;
    // A hierarchical job: to its rack's appliance at epoch 0 (§11.11).
    if let Some(r) = &rep.rack {
        routing
            .set_rack(usize::from(r.appliance), r.layout.lcores.clone())
            .map_err(bad)?;
    }
    Ok(Some(routing))
}

/// A worker's UDP socket, bound and set up.
struct Bound {
    socket: net::BatchSocket,
    /// A handle on the socket, to wake the I/O thread with.
    waker: UdpSocket,
    /// The socket's address, which wake-ups are sent to.
    local: SocketAddr,
    info: net::SocketInfo,
}

impl Bound {
    /// A socket on a port the kernel picks, on loopback when the
    /// `dataplane` is there, on every address otherwise, set up as
    /// `config` asks (GSO, GRO, buffer sizes).
    fn new(dataplane: IpAddr, config: &WorkerConfig) -> Result<Bound, WorkerError> {
        let bind: SocketAddr = match dataplane {
            IpAddr::V4(a) if a.is_loopback() => (Ipv4Addr::LOCALHOST, 0).into(),
            IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            IpAddr::V6(a) if a.is_loopback() => (Ipv6Addr::LOCALHOST, 0).into(),
            IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let socket = UdpSocket::bind(bind).map_err(io_err(&format!("binding a UDP socket on {bind}")))?;
        let waker = socket.try_clone().map_err(io_err("cloning the UDP socket"))?;
        let options = net::SocketOptions {
            gso: config.gso,
            gro: config.gro,
            buffer_bytes: config.socket_buffer,
        };
        let socket = net::BatchSocket::new(socket, options).map_err(io_err("setting the UDP socket up"))?;
        let mut local = socket
            .socket()
            .local_addr()
            .map_err(io_err("reading the UDP socket's address"))?;
        if local.ip().is_unspecified() {
            // Wake-ups go to ourselves through loopback.
            local.set_ip(match local.ip() {
                IpAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
                IpAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
            });
        }
        let info = socket.info();
        Ok(Bound {
            socket,
            waker,
            local,
            info,
        })
    }
}

/// Wraps a system call's error with what was being done.
fn io_err(context: &str) -> impl FnOnce(std::io::Error) -> WorkerError {
    let context = context.to_string();
    move |source| WorkerError::Io { context, source }
}

/// The window: [`WorkerConfig::window`], or, when that is 0, [`auto_window`]
/// from the job's shape, the socket's receive buffer `rcvbuf` and the
/// appliances' stated shares, with what it was made from (to remake it
/// as the shares change).
fn window_for(join: &JoinResponse, config: &WorkerConfig, rcvbuf: usize) -> (usize, Option<AutoWindow>) {
    if config.window != 0 {
        return (config.window, None);
    }
    let auto = AutoWindow {
        // All W, also for a hierarchical job, whose rack appliance hears
        // from its rack's ranks alone: their larger windows (63 chunks
        // against 31 for R = 2, W = 4) made rounds over a 1 Gbit/s spine
        // 12% slower, the deeper windows' partial sums queueing at the
        // spine and timing out (BENCHMARKS.md "Hierarchical windows").
        workers: join.spec.workers,
        // A replicated hierarchical job's chunks go to its rack
        // appliance's lcores until its first epoch change (§11.11), when
        // the transport remakes the window for the whole layout's.
        lcores: join
            .replication
            .as_ref()
            .and_then(|r| r.rack.as_ref())
            .map_or(&join.layout, |r| &r.layout)
            .lcore_count()
            .max(1),
        // The bound "never more than the job's chunks" is the dense
        // keys': a table's round may send up to MAX_ROW_MESSAGES messages
        // to each lcore, so a job with tables has no such bound. (Bounded
        // by its dense chunks, none, a table-only job's window was 16: a
        // rank's ROW_PUSHes to the next lcore waited for the previous
        // lcore's round to complete, and the lcores completed their rounds
        // one after the other, BENCHMARKS.md "BSP tables: the lcores'
        // rounds side by side".)
        chunks: if join.spec.tables().next().is_some() {
            usize::MAX
        } else {
            usize::try_from(join.layout.chunk_count()).unwrap_or(usize::MAX)
        },
        datagram: HEADER_LEN + join.spec.chunk_bytes as usize,
        own_rcvbuf: rcvbuf,
        joined: lcore_rcvbuf(join),
    };
    (auto.window(auto.joined), Some(auto))
}

/// The smallest receive buffer of the job's appliances' lcores, as they
/// state it ([`ASSUMED_LCORE_RCVBUF`] for those that do not).
fn lcore_rcvbuf(join: &JoinResponse) -> usize {
    join.appliances
        .iter()
        .map(|a| {
            a.rx_buffer_bytes
                .map_or(ASSUMED_LCORE_RCVBUF, |b| usize::try_from(b).unwrap_or(usize::MAX))
        })
        .min()
        .unwrap_or(ASSUMED_LCORE_RCVBUF)
}

/// The fault injector [`WorkerConfig::inject`] (or [`INJECT_ENV`]) asks
/// for, if any, counting into `stats`.
fn fault_injector(
    join: &JoinResponse,
    config: &WorkerConfig,
    stats: &Arc<stats::Counters>,
) -> Result<Option<inject::Injector>, WorkerError> {
    let Some(spec) = config
        .inject
        .map_or_else(inject_from_env, |spec| Ok(Some(spec)))?
    else {
        return Ok(None);
    };
    log::warn!(
        "phub-worker: job {} rank {}: injecting faults on every datagram, both directions: {spec}",
        join.job,
        join.rank
    );
    Ok(Some(inject::Injector::new(
        spec,
        join.job,
        join.rank,
        Arc::clone(stats),
    )))
}

/// The fault spec in [`INJECT_ENV`], if it is set and not empty.
fn inject_from_env() -> Result<Option<FaultSpec>, WorkerError> {
    inject_from(std::env::var(INJECT_ENV).ok().as_deref())
}

/// The fault spec `value` of [`INJECT_ENV`] describes.
fn inject_from(value: Option<&str>) -> Result<Option<FaultSpec>, WorkerError> {
    match value {
        Some(v) if !v.trim().is_empty() => v.parse().map(Some).map_err(|e: String| WorkerError::Config {
            message: format!("{INJECT_ENV}={v:?}: {e}"),
        }),
        _ => Ok(None),
    }
}

/// Checks a join response (its layout places its spec's chunks) and
/// resolves each lcore's address.
fn check_join(join: &JoinResponse) -> Result<(Vec<SocketAddr>, Placement), WorkerError> {
    fn bad<T>(message: String) -> Result<T, WorkerError> {
        Err(WorkerError::BadJoin { message })
    }
    let (spec, layout) = (&join.spec, &join.layout);
    if u32::from(join.rank) >= spec.workers {
        return bad(format!(
            "rank {} is not below the worker count {}",
            join.rank, spec.workers
        ));
    }
    let ce = layout.chunk_elems;
    // Cast: MAX_PAYLOAD is a jumbo frame's payload, far below 2^32.
    #[allow(clippy::cast_possible_truncation)]
    let max = (MAX_PAYLOAD / spec.dtype.size()) as u32;
    if ce == 0 || ce > max {
        return bad(format!(
            "layout.chunk_elems = {ce}; accepted: 1..={max} for {}",
            spec.dtype
        ));
    }
    if let Some((k, ks)) = spec
        .keys
        .iter()
        .enumerate()
        .find(|(_, ks)| ks.table.is_none() && (ks.elements == 0 || ks.elements > usize::MAX as u64))
    {
        return bad(format!("key {k} has {} elements", ks.elements));
    }
    let placement = match Placement::new(spec, layout.clone()) {
        Ok(p) => p,
        Err(e) => return bad(format!("the layout does not place the spec's chunks: {e}")),
    };
    // A control that predates sharding names one appliance, `dataplane`.
    let one = [ApplianceAddr {
        name: "default".into(),
        host: join.dataplane.host.clone(),
        base_port: join.dataplane.base_port,
        lcores: u32::try_from(layout.lcore_count()).unwrap_or(u32::MAX),
        rx_buffer_bytes: None,
    }];
    let appliances = if join.appliances.is_empty() {
        &one[..]
    } else {
        &join.appliances[..]
    };
    let named: u64 = appliances.iter().map(|a| u64::from(a.lcores)).sum();
    if named != layout.lcore_count() as u64 {
        return bad(format!(
            "the appliances name {named} lcores; the layout has {}",
            layout.lcore_count()
        ));
    }
    let mut lcores = Vec::with_capacity(layout.lcore_count());
    for a in appliances {
        let ip = resolve(&a.name, &a.host, a.base_port)?;
        for i in 0..a.lcores {
            match u16::try_from(i).ok().and_then(|i| a.base_port.checked_add(i)) {
                Some(port) if port != 0 => lcores.push(SocketAddr::new(ip, port)),
                _ => {
                    return bad(format!(
                        "appliance {:?}: base port {} + lcore {i} is not a valid UDP port",
                        a.name, a.base_port
                    ))
                }
            }
        }
    }
    Ok((lcores, placement))
}

/// The address of appliance `name`'s data `host` (an address, or a name
/// resolved, IPv4 first).
fn resolve(name: &str, host: &str, port: u16) -> Result<IpAddr, WorkerError> {
    let bad = |message: String| WorkerError::BadJoin { message };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse() {
        return Ok(ip);
    }
    let found = (bare, port)
        .to_socket_addrs()
        .map_err(|e| {
            bad(format!(
                "appliance {name:?}: data host {host:?} does not resolve: {e}"
            ))
        })?
        .collect::<Vec<_>>();
    found
        .iter()
        .find(|a| a.is_ipv4())
        .or(found.first())
        .map(SocketAddr::ip)
        .ok_or_else(|| {
            bad(format!(
                "appliance {name:?}: data host {host:?} resolves to no address"
            ))
        })
}

#[cfg(test)]
mod tests {
    use phub_proto::spec::JobSpec;

    use super::*;

    #[test]
    fn the_window_follows_the_smallest_buffer_an_appliance_states() {
        let spec = JobSpec {
            checkpoint_interval_s: None,
            placement: None,
            name: "w".into(),
            workers: 2,
            dtype: phub_proto::Dtype::F32,
            chunk_bytes: 8192,
            optimizer: phub_proto::spec::Optimizer::Sum,
            consistency: Consistency::Sync,
            keys: vec![phub_proto::spec::KeySpec::dense("k", 1 << 22)],
        };
        let layout = phub_proto::layout::layout(&spec, &mut [0], |_| 1);
        let addr = |rx| ApplianceAddr {
            name: "a".into(),
            host: "127.0.0.1".into(),
            base_port: 9000,
            lcores: 1,
            rx_buffer_bytes: rx,
        };
        let join = |appliances| JoinResponse {
            job: 1,
            rank: 0,
            spec: spec.clone(),
            layout: layout.clone(),
            dataplane: phub_proto::api::DataAddr {
                host: "127.0.0.1".into(),
                base_port: 9000,
            },
            appliances,
            replication: None,
        };
        let cfg = WorkerConfig::default();
        let d = HEADER_LEN + 8192;
        let unsaid = window_for(&join(vec![addr(None)]), &cfg, 64 << 20).0;
        assert_eq!(
            unsaid,
            window_for(&join(vec![]), &cfg, 64 << 20).0,
            "no figure: the assumed buffer"
        );
        assert_eq!(unsaid, (1 << 20) / (2 * d));
        let said = window_for(
            &join(vec![addr(Some(1 << 20)), addr(Some(256 << 10))]),
            &cfg,
            64 << 20,
        )
        .0;
        assert_eq!(
            said,
            (256 << 10) / (2 * 2 * d),
            "the smaller of the two appliances' buffers"
        );
        let fixed = WorkerConfig {
            window: 40,
            ..WorkerConfig::default()
        };
        assert_eq!(
            window_for(&join(vec![addr(Some(4096))]), &fixed, 64 << 20),
            (40, None),
            "a set window stands"
        );
        // A hierarchical job's rank divides its rack appliance's stated
        // share by all W, not by its rack's ranks (measured: see
        // `window_for`), whichever rack it is in (W = 8, racks of 2 and 6).
        let mut hier = join(vec![addr(Some(1 << 20))]);
        hier.spec.workers = 8;
        hier.spec.placement = Some(phub_proto::spec::PlacementSpec {
            appliances: phub_proto::spec::Appliances::Count(2),
            hierarchical: true,
            ranks_per_rack: Some(vec![2, 6]),
            replicas: 1,
        });
        for rank in [1, 5] {
            hier.rank = rank;
            assert_eq!(window_for(&hier, &cfg, 64 << 20).0, (1 << 20) / (8 * 2 * d));
        }
        // A replicated hierarchical job's join gives the flat form's
        // layout (here 3 lcores) and its rack's layout (1 lcore): its
        // chunks go to the rack's until the first epoch change, and the
        // window is made for those (§11.11); with the flat layout's 3 the
        // rack appliance's buffer took three times its share (measured:
        // 27,000 resends per 30 ResNet-50 rounds).
        let mut flat = join(vec![addr(Some(1 << 20)); 3]);
        flat.layout = phub_proto::layout::layout(&spec, &mut [0, 0, 0], |_| 1);
        let flat_window = window_for(&flat, &cfg, 64 << 20).0;
        assert_eq!(flat_window, 3 * (1 << 20) / (2 * 2 * d));
        flat.replication = Some(phub_proto::api::JoinReplication {
            replicas: 2,
            racks: vec!["r0".into(), "r1".into(), "r2".into()],
            epoch: phub_proto::failover::EpochView::default(),
            rack: Some(phub_proto::api::JoinRack {
                appliance: 1,
                layout: layout.clone(),
            }),
        });
        assert_eq!(
            window_for(&flat, &cfg, 64 << 20).0,
            unsaid.min((1 << 20) / (2 * 2 * d))
        );
        // A job with tables: the dense keys' chunks do not bound it (a
        // table-only job has none; bounded by them, its window was 16).
        let mut tables = join(vec![addr(None)]);
        tables.spec.keys = vec![phub_proto::spec::KeySpec::table(
            "emb",
            phub_proto::spec::TableSpec {
                dim: 16,
                rows: None,
                seed: 0,
                init: phub_proto::spec::RowInitSpec::Zeros,
                optimizer: phub_proto::spec::RowOptimizerSpec::Sum,
                evict: None,
                admit_after: None,
                key_cache: 0,
            },
        )];
        tables.layout = phub_proto::layout::layout(&tables.spec, &mut [0], |_| 1);
        assert_eq!(tables.layout.chunk_count(), 0);
        assert_eq!(window_for(&tables, &cfg, 64 << 20).0, unsaid);
        tables.spec.keys.push(phub_proto::spec::KeySpec::dense("k", 8192));
        tables.layout = phub_proto::layout::layout(&tables.spec, &mut [0], |_| 1);
        assert_eq!(tables.layout.chunk_count(), 4);
        assert_eq!(window_for(&tables, &cfg, 64 << 20).0, unsaid);
    }

    #[test]
    fn the_injection_variable_is_parsed_and_named_when_wrong() {
        assert_eq!(inject_from(None).unwrap(), None);
        assert_eq!(inject_from(Some(" ")).unwrap(), None);
        let spec = inject_from(Some("loss=0.05,dup=0.01,seed=3")).unwrap().unwrap();
        assert_eq!(
            (spec.loss, spec.dup, spec.reorder, spec.seed),
            (0.05, 0.01, 0.0, 3)
        );
        let e = inject_from(Some("loss=2")).unwrap_err().to_string();
        assert!(
            e.contains("PHUB_WORKER_INJECT") && e.contains("loss=2") && e.contains("[0, 1)"),
            "{e}"
        );
    }
}
