//! `phub-bench sparse --engine-only`: the row store of sparse tables alone,
//! no network (issue 32's "Engine alone"). `phub-bench sparse --local`:
//! end to end on loopback, a local appliance and `--workers` worker
//! threads, each pushing `--batch` distinct ids a step with
//! `push_pull_rows`, and with `--baseline tcp-ps` the same draws against
//! a plain TCP row server ([`super::tcp_rows`]) in the same run. With
//! `--racks R` the same ranks run on R virtual racks instead of loopback
//! (the namespaces of `phub-bench run --racks`: an appliance per rack on
//! kernel UDP, the ranks in their racks' namespaces, control in the
//! spine's), the table's rows over every rack's appliance and, with
//! `--replicas N`, every table round applied on the backups of its
//! entry before any rank is answered (PROTOCOL.md §11.9); the bytes that
//! crossed the spine are read from its interfaces.
//!
//! Each of `--lcores` threads owns one [`RowStore`] of `rows / lcores`
//! rows of `--dim` values with `--optimizer`'s state, as an lcore
//! would. Ids are hashed ranks (splitmix64 of the rank), drawn uniformly
//! or, with `--zipf S`, from a Zipf law of exponent S over the lcore's
//! ranks (by inverting the continuous law x^-S on [1, n + 1)). Every store
//! is filled to its rows first (timed apart, as `preload_rows_per_s`);
//! then each thread times `--ops` row updates in batches of `--batch`
//! ([`RowStore::update_batch`]) and as many lookups
//! ([`RowStore::read_batch`]) over the same drawn ids. Rates are summed
//! over the threads. `rss_bytes` is the process's VmRSS after the runs;
//! `charged_bytes` is what admission charges for the stores
//! ([`table_bytes`]), summed.
//!
//! The optimizer is `--optimizer`'s ([`RowOpt`]: the engine's row
//! optimizers of PROTOCOL.md §10.5 with the hyper-parameters it lists),
//! by default element-wise Adagrad (lr 0.01, eps 1e-8), the workload the
//! issue names; rows start as zeros ([`Init::Zeros`]).
//!
//! With `--checkpoint DIR` each store is then written to `DIR/lcore-L.ckpt`
//! ([`RowStore::write_to`], flushed to the disk with fsync and dropped
//! from the page cache), dropped, and read back into a new store
//! ([`RowStore::read_from`]), the threads at once; the rows before and
//! after are compared by a digest over every stored row (id, values and
//! optimizer state, bit for bit).

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use clap::Args;

use phub_engine::table::{Admission, Init, RowOptimizer, RowStore, RowUpdate, StoreConfig, TableInit};
use phub_proto::memory::table_bytes;
use serde::Serialize;

use crate::sys::Machine;

/// `phub-bench sparse`'s options.
#[derive(Args, Debug, Clone, Serialize)]
pub struct SparseArgs {
    /// The row store alone, no network.
    #[arg(long, conflicts_with = "local")]
    pub engine_only: bool,
    /// End to end on loopback: a local phub-dataplane (`--lcores` queues)
    /// and phub-control, `--workers` worker threads each pushing `--batch`
    /// ids a step through `push_pull_rows` (module head).
    #[arg(long)]
    pub local: bool,
    /// `--local`: worker threads, each its own phub worker (rank).
    #[arg(long, value_name = "W", default_value_t = 2)]
    pub workers: u16,
    /// `--local`: steps timed, after 3 untimed.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub steps: u32,
    /// `--local`: the job's consistency, `bsp` (default), `async` or
    /// `ssp:TAU` (an lcore applies each push at once outside BSP, as the
    /// TCP row server does).
    #[arg(long, default_value = "bsp")]
    #[serde(serialize_with = "super::run::as_text")]
    pub consistency: phub_proto::spec::Consistency,
    /// `--local`: also run the same workload against a plain TCP row
    /// server in the same minutes (`tcp-ps`: [`super::tcp_rows`]).
    #[arg(long, value_name = "NAME", value_parser = ["tcp-ps"])]
    pub baseline: Option<String>,
    /// The table's row optimizer (PROTOCOL.md §10.5), in the engine's
    /// stores, the job's table and the TCP row server alike.
    #[arg(long, value_enum, value_name = "NAME", default_value = "adagrad")]
    pub optimizer: RowOpt,
    /// `--local`: hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Rows stored, over all lcores.
    #[arg(long, value_name = "R", default_value_t = 1_000_000)]
    pub rows: u64,
    /// f32 values per row.
    #[arg(long, value_name = "D", default_value_t = 16)]
    pub dim: u32,
    /// Ids per batch.
    #[arg(long, value_name = "K", default_value_t = 4096)]
    pub batch: usize,
    /// Zipf exponent of the ids drawn (uniform without it).
    #[arg(long, value_name = "S")]
    pub zipf: Option<f64>,
    /// Threads, one store each.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub lcores: usize,
    /// Updates (and lookups) timed per lcore.
    #[arg(long, value_name = "N", default_value_t = 20_000_000)]
    pub ops: u64,
    /// Also write the figures as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// `--local`, BSP: check every row every rank read back, every step,
    /// against a reference table computed here from PROTOCOL.md §10.5
    /// (gradients are multiples of 2^-10, so their sums are exact in any
    /// order); the rows cap is raised to twice `--rows` so that nothing is
    /// evicted. Each step's rows are hashed in the timed loop.
    #[arg(long, requires = "local")]
    pub verify: bool,
    /// `--local`: every rank pushes the same `--batch` ids every step (its
    /// first draw), as a model with a fixed set of features does.
    #[arg(long, requires = "local")]
    pub fixed_ids: bool,
    /// `--local`: `--fixed-ids`, registered with `Worker::cache_ids` before
    /// the first step (key caching, PROTOCOL.md §10.7; the table gets
    /// `key_cache` slots enough for them): messages name the ids by
    /// signature instead of carrying them.
    #[arg(long, requires = "local")]
    pub cache_ids: bool,
    /// `--local`: the timed steps pull their ids (`pull_rows`) instead of
    /// pushing them (the untimed first steps push, so that the rows are
    /// stored): `row_lookups_per_s`, and with `--cache-ids` what a pull of
    /// a registered id list saves (its ids named by signature).
    #[arg(long, requires = "local")]
    pub pull_only: bool,
    /// `--pull-only`: after the table's steps, the same ranks pull a dense
    /// key of `--batch` x `--dim` f32 elements as many times (a job of its
    /// own on the same appliance, the key initialized first):
    /// `dense_pull_ms_median` and `pull_vs_dense`, the table pull's step
    /// over the dense pull's (issue 32: a pull of K rows within 1.5x of a
    /// dense pull of K x D elements).
    #[arg(long, requires = "pull_only")]
    pub dense_pull: bool,
    /// `--local`: one more argument for phub-dataplane, as is (repeatable;
    /// e.g. `--dataplane-arg=--spin-us=0`, so that both the table's steps
    /// and `--dense-pull`'s run with the lcores sleeping at once; the
    /// default, `auto`, is set by the dataplane's governor as the load
    /// goes, and the JSON says what each phase ended with).
    #[arg(long, value_name = "ARG", allow_hyphen_values = true, requires = "local")]
    pub dataplane_arg: Vec<String>,
    /// `--local`: before the untimed steps, store every one of the
    /// `--rows` rows: the ranks push them (all of them, rank r the ranks
    /// congruent to r modulo W) in rounds of `--batch` ids, so that the
    /// timed steps run on a table that holds `--rows` rows, not only the
    /// rows the steps drew (`prefill_rows_per_s` in the JSON). Not with
    /// `--verify`, whose reference starts from an empty table.
    #[arg(long, requires = "local")]
    pub prefill: bool,
    /// `--local`: after the timed steps, take the job's checkpoint through
    /// control twice (the dataplane streams it, control writes it to its
    /// file; the second with the first's file in place) and sample both
    /// daemons' resident memory every 2 ms meanwhile: `checkpoints` in the
    /// JSON.
    #[arg(long, requires = "local")]
    pub take_checkpoint: bool,
    /// `--local`: take one checkpoint through control once half the timed
    /// steps are done, while the ranks go on pushing (the stream's copy on
    /// write under traffic), both daemons' resident memory sampled every
    /// 2 ms: `checkpoint_under_load` in the JSON, with the steps that ran
    /// during it against the others.
    #[arg(long, requires = "local")]
    pub checkpoint_under_load: bool,
    /// `--local`: run over R virtual racks instead of loopback (as root:
    /// a network namespace per rack holding its ranks, an appliance per
    /// rack on kernel UDP with `--lcores` lcores behind its own link, a
    /// spine between the racks), the table's rows over every rack's
    /// appliance: `cross_rack_bytes_per_step` in the JSON.
    #[arg(long, value_name = "R", requires = "local")]
    pub racks: Option<usize>,
    /// `--racks`: the job's `[placement] replicas`, 1 to 3 (2 or 3: every
    /// table round applied on the backups of its entry before any rank is
    /// answered, PROTOCOL.md §11.9).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "racks")]
    pub replicas: u32,
    /// `--racks` with `--replicas 2`: kill (SIGKILL) this appliance's
    /// dataplane mid-run, named as control names it (`rack2`), once every
    /// rank has completed timed step `--kill-at-step`; its entries fail
    /// over to their backups (PROTOCOL.md §11.9): `failover_ms` (the kill
    /// to the first step any rank completed beyond the highest completed
    /// before it) and `epoch_served_ms` in the JSON, as `phub-bench run`'s
    /// (module [`super::failover`]), and with `--verify` every rank's rows
    /// of every step, those around the kill included, checked against the
    /// reference (a round lost or applied twice changes them).
    #[arg(long, value_name = "NAME", requires_all = ["racks", "kill_at_step"])]
    pub kill_appliance: Option<String>,
    /// `--kill-appliance`: the timed steps each rank completes before the
    /// kill, 1 to `--steps` - 1.
    #[arg(long, value_name = "N", requires = "kill_appliance")]
    pub kill_at_step: Option<u32>,
    /// `--kill-appliance`: start its dataplane again MS after the kill
    /// (empty, same addresses): control gives the job back to it and its
    /// entries' tables come by state copies while the ranks train
    /// (PROTOCOL.md §11.9 item 4): `full_strength_ms`,
    /// `rereplication_bytes`, `longest_round_during_ms` (the longest step
    /// meanwhile) as `phub-bench run`'s.
    #[arg(long, value_name = "MS", requires = "kill_appliance")]
    pub restart_after_ms: Option<u64>,
    /// `--racks`: control's heartbeat interval, ms (phub-control's
    /// `--heartbeat-ms`; default its own, 100).
    #[arg(long, value_name = "MS", requires = "racks")]
    pub heartbeat_ms: Option<u64>,
    /// `--racks`: control's heartbeat deadline, ms (phub-control's
    /// `--heartbeat-deadline-ms`; default its own, 500).
    #[arg(long, value_name = "MS", requires = "racks")]
    pub heartbeat_deadline_ms: Option<u64>,
    /// `--engine-only`: after the timed runs, write every store to a
    /// checkpoint in this directory, drop it and restore it (module head).
    #[arg(long, value_name = "DIR", requires = "engine_only")]
    pub checkpoint: Option<PathBuf>,
}

impl SparseArgs {
    /// `--racks`' replica, kill and heartbeat options, as `phub-bench
    /// run`'s.
    fn failover(&self) -> super::failover::FailoverArgs {
        super::failover::FailoverArgs {
            replicas: Some(self.replicas),
            kill_appliance: self.kill_appliance.clone(),
            kill_at_round: self.kill_at_step,
            restart_after_ms: self.restart_after_ms,
            heartbeat_ms: self.heartbeat_ms,
            heartbeat_deadline_ms: self.heartbeat_deadline_ms,
            ..super::failover::FailoverArgs::default()
        }
    }
}

/// What one run measured.
#[derive(Debug, Serialize)]
pub struct SparseReport {
    /// Threads, one store each.
    pub lcores: usize,
    /// The row optimizer (`--optimizer`).
    pub optimizer: RowOpt,
    /// Rows asked for, over all lcores.
    pub rows: u64,
    /// Values per row.
    pub dim: u32,
    /// Ids per batch.
    pub batch: usize,
    /// Zipf exponent, or none (uniform).
    pub zipf: Option<f64>,
    /// Rows stored after the runs, over all lcores.
    pub rows_stored: u64,
    /// Row updates per second, summed over the lcores.
    pub row_updates_per_s: f64,
    /// Row lookups per second, summed over the lcores.
    pub row_lookups_per_s: f64,
    /// Row updates per second of each lcore.
    pub row_updates_per_s_per_lcore: Vec<f64>,
    /// Row lookups per second of each lcore.
    pub row_lookups_per_s_per_lcore: Vec<f64>,
    /// Rows created per second while filling the stores, summed.
    pub preload_rows_per_s: f64,
    /// Updates (and lookups) timed per lcore.
    pub ops_per_lcore: u64,
    /// VmRSS after the runs.
    pub rss_bytes: u64,
    /// What admission charges for the stores ([`table_bytes`]), summed.
    pub charged_bytes: u64,
    /// `rss_bytes / charged_bytes`.
    pub rss_over_charge: f64,
    /// /proc/loadavg's 1-minute figure before the run.
    pub loadavg_1m_before: f64,
    /// `--checkpoint`: the write and the restore.
    pub checkpoint: Option<CheckpointFigures>,
    /// The machine.
    pub machine: Machine,
}

/// What `--checkpoint` measured.
#[derive(Debug, Serialize)]
pub struct CheckpointFigures {
    /// Bytes of the checkpoint files, summed.
    pub bytes: u64,
    /// Rows written, summed.
    pub rows: u64,
    /// Writing every store (the threads at once) until fsync returned.
    pub write_s: f64,
    /// Reading every file back into a new store (the threads at once),
    /// its pages dropped from the page cache first.
    pub restore_s: f64,
    /// Rows restored per second, summed.
    pub restore_rows_per_s: f64,
    /// VmRSS holding the restored stores (the written ones dropped).
    pub rss_bytes_after_restore: u64,
    /// Every restored store's digest equals the written one's.
    pub verified: bool,
}

/// The store the benchmark times: zeros, `--optimizer`'s updates.
type Store = RowStore<TableInit, RowOptimizer>;

/// `--optimizer`: a row optimizer of PROTOCOL.md §10.5 with the
/// hyper-parameters the benchmark gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RowOpt {
    /// The gradient added to the row.
    Sum,
    /// SGD, lr 0.01.
    Sgd,
    /// Element-wise Adagrad, lr 0.01, eps 1e-8 (the default).
    Adagrad,
    /// Row-wise Adagrad (one accumulator per row), lr 0.01, eps 1e-8.
    AdagradRowwise,
    /// Lazy Adam, lr 0.001, betas 0.9 and 0.999, eps 1e-8.
    Adam,
    /// FTRL-proximal, alpha 0.05, beta 1, l1 0.001, l2 0.001.
    Ftrl,
}

impl RowOpt {
    /// The table's `optimizer` as a job spec writes it (an inline table).
    pub fn spec_toml(self) -> &'static str {
        match self {
            RowOpt::Sum => "{ kind = \"sum\" }",
            RowOpt::Sgd => "{ kind = \"sgd\", lr = 0.01 }",
            RowOpt::Adagrad => "{ kind = \"adagrad\", lr = 0.01 }",
            RowOpt::AdagradRowwise => "{ kind = \"adagrad\", lr = 0.01, rowwise = true }",
            RowOpt::Adam => "{ kind = \"adam\", lr = 0.001 }",
            RowOpt::Ftrl => "{ kind = \"ftrl\", alpha = 0.05, beta = 1.0, l1 = 0.001, l2 = 0.001 }",
        }
    }

    /// What the job spec's `optimizer` parses to.
    pub fn spec(self) -> Result<phub_proto::spec::RowOptimizerSpec> {
        let text = format!(
            "name = \"opt\"\nworkers = 1\n[optimizer]\nkind = \"sum\"\n[[keys]]\nname = \"emb\"\n\
             kind = \"table\"\ndim = 1\noptimizer = {}\n",
            self.spec_toml()
        );
        phub_proto::spec::JobSpec::from_toml(&text)
            .ok()
            .and_then(|s| s.keys.first().and_then(|k| k.table.as_ref().map(|t| t.optimizer)))
            .with_context(|| format!("the benchmark's own optimizer {}", self.spec_toml()))
    }

    /// The engine's optimizer for it, as the dataplane installs it.
    pub fn engine(self) -> Result<RowOptimizer> {
        let opt = phub_engine::engine::row_optimizer(&self.spec()?);
        opt.check()?;
        Ok(opt)
    }
}

/// splitmix64: the benchmark's ids and random numbers.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The id of global rank `rank`.
fn id_of(rank: u64) -> u64 {
    splitmix(rank ^ 0x5EED_0F1D_5EED_0F1D)
}

/// A rank in `0..n` from the uniform `u` in [0, 1): uniform, or Zipf.
// Cast: a float in [0, n) to an integer rank.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]
fn rank(u: f64, n: u64, zipf: Option<f64>) -> u64 {
    let x = match zipf {
        None => u * n as f64,
        Some(s) if (s - 1.0).abs() < 1e-9 => ((n + 1) as f64).powf(u) - 1.0,
        Some(s) => {
            let top = ((n + 1) as f64).powf(1.0 - s);
            (1.0 + u * (top - 1.0)).powf(1.0 / (1.0 - s)) - 1.0
        }
    };
    (x as u64).min(n - 1)
}

fn vm_rss() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("no VmRSS in /proc/self/status")?;
    Ok(kb * 1024)
}

fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

/// What one lcore measured.
struct LcoreFigures {
    preload_s: f64,
    created: u64,
    updates_per_s: f64,
    lookups_per_s: f64,
    rows_stored: u64,
    charged: u64,
}

// Cast: counts to f64 for rates.
#[allow(clippy::cast_precision_loss)]
fn lcore(args: &SparseArgs, opt: RowOptimizer, l: usize, barrier: &Barrier) -> Result<(LcoreFigures, Store)> {
    let lcores = args.lcores as u64;
    let l64 = l as u64;
    // This lcore's ranks: l, l + lcores, ...
    let n = (args.rows - l64).div_ceil(lcores);
    let config = StoreConfig {
        dim: args.dim,
        rows_cap: n,
        admission: Admission::Always,
        idle_rounds: None,
        idle_seconds: None,
        hash_key: splitmix(0xC0FF_EE00 ^ l64),
    };
    let mut store = RowStore::new(config, TableInit::new(Init::Zeros, 0, 0)?, opt)?;
    let charged = table_bytes(&store.shape());
    let d = args.dim as usize;
    let k = args.batch;
    let grads: Vec<f32> = (0..k * d)
        .map(|i| (splitmix(i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    // Fill: every rank once, in order (ids hashed, so index order is not).
    barrier.wait();
    let t = Instant::now();
    let mut ids = Vec::with_capacity(k);
    let mut r = 0;
    while r < n {
        ids.clear();
        ids.extend((r..n.min(r + k as u64)).map(|i| id_of(i * lcores + l64)));
        store.update_batch(&ids, &grads[..ids.len() * d]);
        r += k as u64;
    }
    let preload_s = t.elapsed().as_secs_f64();
    let created = store.stats().created;
    // The ids timed: drawn once, outside the timing.
    let pool_len = (args.ops as usize).clamp(k, 1 << 24).next_multiple_of(k);
    let pool: Vec<u64> = (0..pool_len as u64)
        .map(|i| {
            let u = (splitmix(i ^ (l64 << 48) ^ 0xABCD) >> 11) as f64 / (1u64 << 53) as f64;
            id_of(rank(u, n, args.zipf) * lcores + l64)
        })
        .collect();
    let batches = args.ops.div_ceil(k as u64) as usize;
    barrier.wait();
    let t = Instant::now();
    for b in 0..batches {
        let at = (b * k) % pool_len;
        store.update_batch(&pool[at..at + k], &grads);
    }
    let updates_per_s = (batches * k) as f64 / t.elapsed().as_secs_f64();
    let mut out = vec![0f32; k * d];
    let mut check = 0f32;
    barrier.wait();
    let t = Instant::now();
    for b in 0..batches {
        let at = (b * k) % pool_len;
        store.read_batch(&pool[at..at + k], &mut out);
        check += out[b % out.len()];
    }
    let lookups_per_s = (batches * k) as f64 / t.elapsed().as_secs_f64();
    std::hint::black_box(check);
    let figures = LcoreFigures {
        preload_s,
        created,
        updates_per_s,
        lookups_per_s,
        rows_stored: store.rows_stored(),
        charged,
    };
    Ok((figures, store))
}

/// `f(i, item)` for each of `items`, each on a thread of its own; the
/// results in order (a thread that panicked: an error naming `what`).
fn in_threads<I: Send, R: Send>(
    items: impl IntoIterator<Item = I>,
    what: &str,
    f: impl Fn(usize, I) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = items
            .into_iter()
            .enumerate()
            .map(|(i, item)| scope.spawn(move || f(i, item)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("{what} thread panicked")))
            })
            .collect()
    })
}

/// An order-free digest of every row `store` holds: its id, values and
/// optimizer state, bit for bit.
fn store_digest(store: &Store) -> u64 {
    store.rows().fold(0u64, |acc, (id, row, state)| {
        let h = row
            .iter()
            .chain(state)
            .fold(splitmix(id), |h, v| splitmix(h ^ u64::from(v.to_bits())));
        acc.wrapping_add(h)
    })
}

/// What [`checkpoint_one`] measured of one store, and the store restored.
struct Restored {
    rows: u64,
    bytes: u64,
    same: bool,
    write_s: f64,
    restore_s: f64,
    store: Store,
}

/// One store through `--checkpoint`: written to `path` and synced, its
/// pages dropped from the page cache, the store dropped, then read back.
fn checkpoint_one(store: Store, opt: RowOptimizer, path: &Path, barrier: &Barrier) -> Result<Restored> {
    let config = *store.config();
    let before = store_digest(&store);
    let rows = store.rows_stored();
    barrier.wait();
    let t = Instant::now();
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let bytes = store
        .write_to(&file)
        .with_context(|| format!("writing {}", path.display()))?;
    file.sync_all()
        .with_context(|| format!("syncing {}", path.display()))?;
    let write_s = t.elapsed().as_secs_f64();
    // SAFETY: `file` is open for the whole call; POSIX_FADV_DONTNEED only
    // drops clean cached pages of it, which the fsync above wrote.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    ensure!(rc == 0, "posix_fadvise({}): error {rc}", path.display());
    drop(file);
    drop(store);
    barrier.wait();
    let t = Instant::now();
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let store = RowStore::read_from(file, config, TableInit::new(Init::Zeros, 0, 0)?, opt)
        .with_context(|| format!("restoring {}", path.display()))?;
    let restore_s = t.elapsed().as_secs_f64();
    let same = store_digest(&store) == before && store.rows_stored() == rows;
    Ok(Restored {
        rows,
        bytes,
        same,
        write_s,
        restore_s,
        store,
    })
}

/// `--checkpoint DIR`: every store written, dropped and restored, the
/// threads at once; `stores` holds the restored ones after.
// Cast: counts to f64 for rates.
#[allow(clippy::cast_precision_loss)]
fn checkpoint_phase(dir: &Path, opt: RowOptimizer, stores: &mut Vec<Store>) -> Result<CheckpointFigures> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let barrier = Barrier::new(stores.len());
    let results = in_threads(std::mem::take(stores), "a checkpoint", |l, store| {
        checkpoint_one(store, opt, &dir.join(format!("lcore-{l}.ckpt")), &barrier)
    });
    let mut figures = CheckpointFigures {
        bytes: 0,
        rows: 0,
        write_s: 0.0,
        restore_s: 0.0,
        restore_rows_per_s: 0.0,
        rss_bytes_after_restore: 0,
        verified: true,
    };
    for r in results {
        let r = r?;
        figures.rows += r.rows;
        figures.bytes += r.bytes;
        figures.verified &= r.same;
        figures.write_s = figures.write_s.max(r.write_s);
        figures.restore_s = figures.restore_s.max(r.restore_s);
        stores.push(r.store);
    }
    figures.restore_rows_per_s = figures.rows as f64 / figures.restore_s;
    figures.rss_bytes_after_restore = vm_rss()?;
    Ok(figures)
}

/// Run `phub-bench sparse`.
// Cast: counts to f64 for rates and ratios.
#[allow(clippy::cast_precision_loss)]
pub fn run(args: &SparseArgs) -> Result<()> {
    if args.local {
        return run_local(args);
    }
    ensure!(
        args.engine_only,
        "phub-bench sparse: say --engine-only (the row store alone) or --local (end to end on loopback)"
    );
    ensure!(args.lcores >= 1, "--lcores {}: accepted 1 or more", args.lcores);
    ensure!(
        args.rows >= args.lcores as u64,
        "--rows {}: accepted at least one per lcore ({})",
        args.rows,
        args.lcores
    );
    ensure!(args.batch >= 1, "--batch 0: accepted 1 or more");
    ensure!(args.dim >= 1, "--dim 0: accepted 1 or more");
    if let Some(s) = args.zipf {
        ensure!(
            s > 0.0 && s.is_finite(),
            "--zipf {s}: accepted a positive exponent"
        );
    }
    let opt = args.optimizer.engine()?;
    let load = loadavg();
    let barrier = Barrier::new(args.lcores);
    let results = in_threads(0..args.lcores, "an lcore", |_, l| lcore(args, opt, l, &barrier));
    let mut figures = Vec::new();
    let mut stores = Vec::new();
    for r in results {
        let (f, s) = r?;
        figures.push(f);
        stores.push(s);
    }
    // Stores are alive: RSS holds them.
    let rss = vm_rss()?;
    let checkpoint = match &args.checkpoint {
        Some(dir) => Some(checkpoint_phase(dir, opt, &mut stores)?),
        None => None,
    };
    let charged: u64 = figures.iter().map(|f| f.charged).sum();
    let report = SparseReport {
        lcores: args.lcores,
        optimizer: args.optimizer,
        rows: args.rows,
        dim: args.dim,
        batch: args.batch,
        zipf: args.zipf,
        rows_stored: figures.iter().map(|f| f.rows_stored).sum(),
        row_updates_per_s: figures.iter().map(|f| f.updates_per_s).sum(),
        row_lookups_per_s: figures.iter().map(|f| f.lookups_per_s).sum(),
        row_updates_per_s_per_lcore: figures.iter().map(|f| f.updates_per_s).collect(),
        row_lookups_per_s_per_lcore: figures.iter().map(|f| f.lookups_per_s).collect(),
        preload_rows_per_s: figures.iter().map(|f| f.created as f64 / f.preload_s).sum(),
        ops_per_lcore: args.ops.div_ceil(args.batch as u64) * args.batch as u64,
        rss_bytes: rss,
        charged_bytes: charged,
        rss_over_charge: rss as f64 / charged as f64,
        loadavg_1m_before: load,
        checkpoint,
        machine: Machine::detect(),
    };
    drop(stores);
    println!(
        "sparse engine-only: {} lcore(s), {} rows stored, dim {}, batch {}, ids {}",
        report.lcores,
        report.rows_stored,
        report.dim,
        report.batch,
        report.zipf.map_or("uniform".to_string(), |s| format!("zipf {s}"))
    );
    println!(
        "  row updates/s {:.3e} ({})   row lookups/s {:.3e}   preload rows/s {:.3e}",
        report.row_updates_per_s,
        opt.name(),
        report.row_lookups_per_s,
        report.preload_rows_per_s
    );
    println!(
        "  rss {:.3} GB   charged {:.3} GB   rss/charge {:.3}   load before {:.2}",
        rss as f64 / 1e9,
        charged as f64 / 1e9,
        report.rss_over_charge,
        load
    );
    if let Some(c) = &report.checkpoint {
        println!(
            "  checkpoint {:.3} GB of {} rows: written in {:.2} s, restored in {:.2} s ({:.3e} rows/s), \
             rss after {:.3} GB, verified {}",
            c.bytes as f64 / 1e9,
            c.rows,
            c.write_s,
            c.restore_s,
            c.restore_rows_per_s,
            c.rss_bytes_after_restore as f64 / 1e9,
            c.verified
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// What `--local` measured.
#[derive(Debug, Serialize)]
pub struct SparseLocalReport {
    /// Worker threads (ranks).
    pub workers: u16,
    /// The job's consistency (`bsp`, `async`, `ssp:TAU`).
    pub consistency: String,
    /// The table's row optimizer (`--optimizer`).
    pub optimizer: RowOpt,
    /// Dataplane queues.
    pub lcores: usize,
    /// The table's rows cap.
    pub rows: u64,
    /// Values per row.
    pub dim: u32,
    /// Ids per worker and step.
    pub batch: usize,
    /// Zipf exponent, or none (uniform).
    pub zipf: Option<f64>,
    /// Steps timed.
    pub steps: u32,
    /// Row updates per second: W x K x steps over the slowest rank's time.
    pub row_updates_per_s: f64,
    /// Rows read back per second (each push_pull_rows returns its rows).
    pub row_lookups_per_s: f64,
    /// Median of rank 0's steps, ms.
    pub round_ms_median: f64,
    /// Largest of rank 0's steps, ms.
    pub round_ms_max: f64,
    /// 90th percentile of rank 0's steps, ms: the tail that
    /// `row_updates_per_s` (a mean over the run) counts and the median
    /// does not.
    pub round_ms_p90: f64,
    /// 99th percentile of rank 0's steps, ms.
    pub round_ms_p99: f64,
    /// UDP payload bytes the workers sent and received, per row pushed.
    pub wire_bytes_per_row: f64,
    /// Rows the appliance stores after the run (control's job detail).
    pub rows_stored: u64,
    /// Row blocks the lcores made themselves, none ready from the
    /// dataplane's block maker (control's job detail).
    pub blocks_made_on_lcore: u64,
    /// Loopback: the dataplane's resident memory (VmRSS) once the timed
    /// steps ended, the table's rows and every other thing it holds;
    /// none over `--racks`.
    pub rss_bytes: Option<u64>,
    /// What admission charged the job: its table at its `rows` cap
    /// (PROTOCOL.md's memory model; every appliance's part).
    pub charged_bytes: u64,
    /// `--prefill`: rows stored per second while the ranks filled the
    /// table (`--rows` over the slowest rank's fill).
    pub prefill_rows_per_s: Option<f64>,
    /// Table messages the workers sent again.
    pub row_retransmits: u64,
    /// `--baseline`'s name, if run.
    pub baseline: Option<String>,
    /// The baseline's row updates per second (same workload, same run).
    pub baseline_row_updates_per_s: Option<f64>,
    /// The baseline's median step (its rank 0), ms.
    pub baseline_round_ms_median: Option<f64>,
    /// The baseline's `round_ms_p90`.
    pub baseline_round_ms_p90: Option<f64>,
    /// The baseline's `round_ms_p99`.
    pub baseline_round_ms_p99: Option<f64>,
    /// `row_updates_per_s / baseline_row_updates_per_s`.
    pub speedup_vs_baseline: Option<f64>,
    /// The machine's busy CPU time per row pushed (or pulled) in the timed
    /// steps, microseconds: every process's (appliance, control, ranks),
    /// steal left out (`/proc/stat`), from when the last rank began its
    /// timed steps to when the last one ended. Less moved by how this
    /// shared VM schedules the run's threads than the rates are: compare
    /// builds by it too.
    pub cpu_us_per_row: Option<f64>,
    /// The baseline's `cpu_us_per_row` (server and ranks), same run.
    pub baseline_cpu_us_per_row: Option<f64>,
    /// `--verify`: whether every rank's rows, every step, were the
    /// reference's (null without it).
    pub verified: Option<bool>,
    /// `--pull-only`: the timed steps pulled their ids (no updates).
    pub pull_only: bool,
    /// `--dense-pull`: the median step of the same ranks pulling a dense
    /// key of `batch` x `dim` elements (rank 0's steps, as
    /// `round_ms_median`), ms.
    pub dense_pull_ms_median: Option<f64>,
    /// `--dense-pull`: `round_ms_median / dense_pull_ms_median`.
    pub pull_vs_dense: Option<f64>,
    /// `--local`: the spin the appliance's kernel-UDP lcores used at the
    /// end of the table's timed steps (`--spin-us`; `auto` as its governor
    /// set it), microseconds.
    pub spin_us: Option<u64>,
    /// `--dense-pull`: the same at the end of the dense pulls.
    pub dense_spin_us: Option<u64>,
    /// `--fixed-ids` (or `--cache-ids`): every step pushed the same ids.
    pub fixed_ids: bool,
    /// `--cache-ids`: the ids were registered for key caching.
    pub cache_ids: bool,
    /// Id bytes the workers' messages and answers left out (timed steps;
    /// `key_cache_id_bytes_saved`), per row pushed.
    pub key_cache_id_bytes_saved_per_row: f64,
    /// Key-cache prefix bytes they carried instead, per row pushed.
    pub key_cache_prefix_bytes_per_row: f64,
    /// `--take-checkpoint`: the two checkpoints and the daemons' memory
    /// (empty without it).
    pub checkpoints: Vec<LocalCheckpoint>,
    /// `--take-checkpoint`: the dataplane restarted after them and the job
    /// restored from the file by control, memory sampled likewise.
    pub restore: Option<LocalCheckpoint>,
    /// `--checkpoint-under-load`: the checkpoint taken while the ranks
    /// pushed.
    pub checkpoint_under_load: Option<UnderLoad>,
    /// /proc/loadavg's 1-minute figure before the run.
    pub loadavg_1m_before: f64,
    /// `--racks`: the virtual racks (null on loopback).
    pub racks: Option<usize>,
    /// `--replicas` and `--kill-appliance`'s figures (`replicas` set with
    /// `--racks`; the rest null without a kill), as `phub-bench run`'s;
    /// `rounds_lost` and `rounds_repeated` are null (a table's rounds are
    /// not in control's view): `--verify` checks every row instead.
    #[serde(flatten)]
    pub failover: super::failover::FailoverFigures,
    /// `--racks`: the bytes that crossed the spine (read from its
    /// interfaces, every datagram between racks: ranks to appliances of
    /// other racks, and appliances to their backups) over the whole run,
    /// per step, the 3 untimed ones included.
    pub cross_rack_bytes_per_step: Option<f64>,
    /// The machine.
    pub machine: Machine,
}

/// What `--take-checkpoint` measured of a checkpoint (or of the restore).
#[derive(Debug, Serialize)]
pub struct LocalCheckpoint {
    /// The checkpoint file's bytes (control's answer).
    pub bytes: u64,
    /// From the request to control's answer (the file written and synced);
    /// a restore: from the dataplane's restart to the job installed there.
    pub seconds: f64,
    /// The dataplane's VmRSS just before.
    pub dataplane_rss_before: u64,
    /// Its largest VmRSS sampled during.
    pub dataplane_rss_peak: u64,
    /// Control's VmRSS just before.
    pub control_rss_before: u64,
    /// Its largest VmRSS sampled during.
    pub control_rss_peak: u64,
}

/// What `--checkpoint-under-load` measured.
#[derive(Debug, Serialize)]
pub struct UnderLoad {
    /// The checkpoint, and the daemons' memory meanwhile (the dataplane's
    /// growth is what copy on write kept of the rows changed meanwhile).
    pub checkpoint: LocalCheckpoint,
    /// Timed steps (over every rank) that ran, at least in part, while it
    /// was taken.
    pub steps_during: usize,
    /// The other timed steps.
    pub steps_outside: usize,
    /// The median step time during it, ms.
    pub step_ms_median_during: f64,
    /// The longest step during it, ms.
    pub step_ms_max_during: f64,
    /// The median step time of the others, ms.
    pub step_ms_median_outside: f64,
    /// The longest of the others, ms.
    pub step_ms_max_outside: f64,
    /// What copy on write kept at most, summed over the lcores, from the
    /// dataplane's log (each lcore logs it when its stream ends): index
    /// entries, and bytes of rows; `None` when the log does not say.
    pub kept_index_entries: Option<u64>,
    /// See [`UnderLoad::kept_index_entries`].
    pub kept_row_bytes: Option<u64>,
}

/// Process `pid`'s VmRSS, bytes.
fn rss_of(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()
        .map(|kb| kb * 1024)
}

/// Runs `f` with both daemons' VmRSS sampled every 2 ms: its result,
/// the seconds it took, each daemon's VmRSS before and its peak.
fn sampled<T>(pids: [u32; 2], f: impl FnOnce() -> T) -> (T, f64, [u64; 2], [u64; 2]) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let before = pids.map(|p| rss_of(p).unwrap_or(0));
    let peaks = [AtomicU64::new(before[0]), AtomicU64::new(before[1])];
    let done = AtomicBool::new(false);
    let t = Instant::now();
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                for (p, peak) in pids.iter().zip(&peaks) {
                    if let Some(r) = rss_of(*p) {
                        peak.fetch_max(r, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        });
        let r = f();
        done.store(true, Ordering::Relaxed);
        r
    });
    (
        r,
        t.elapsed().as_secs_f64(),
        before,
        peaks.map(|p| p.load(Ordering::Relaxed)),
    )
}

/// `--take-checkpoint`: job `id`'s checkpoint through control, both
/// daemons' VmRSS sampled every 2 ms meanwhile.
fn take_checkpoint(local: &super::local::Local, id: u16, token: Option<&str>) -> Result<LocalCheckpoint> {
    let client =
        super::local::control_client(&local.control_url, token, std::time::Duration::from_secs(3600))?;
    let pids = [local.dataplane.pid(), local.control.pid()];
    let (info, seconds, before, peak) =
        sampled(pids, || client.send(&phub_proto::routes::control::checkpoint(id)));
    let info = info.context("taking the job's checkpoint through control")?;
    Ok(LocalCheckpoint {
        bytes: info.bytes,
        seconds,
        dataplane_rss_before: before[0],
        dataplane_rss_peak: peak[0],
        control_rss_before: before[1],
        control_rss_peak: peak[1],
    })
}

/// `--checkpoint-under-load`: waits until half the timed steps are done
/// (over the ranks), then takes a checkpoint as [`take_checkpoint`] does
/// while they go on; returns it and when it began and ended.
fn checkpoint_halfway(
    args: &SparseArgs,
    local: &super::local::Local,
    id: u16,
    token: Option<&str>,
    done: &std::sync::atomic::AtomicU64,
    finished: &std::sync::atomic::AtomicBool,
) -> Result<(LocalCheckpoint, Instant, Instant)> {
    use std::sync::atomic::Ordering;
    let half = u64::from(args.workers) * u64::from(args.steps) / 2;
    while done.load(Ordering::Relaxed) < half {
        ensure!(
            !finished.load(Ordering::Relaxed),
            "the ranks stopped before half their steps: no checkpoint under load"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let start = Instant::now();
    let c = take_checkpoint(local, id, token)?;
    Ok((c, start, Instant::now()))
}

/// The steps that ran (at least in part) between `start` and `end`
/// against the others.
// Casts: step times to durations.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn under_load_figures(
    (checkpoint, start, end): (LocalCheckpoint, Instant, Instant),
    ranks: &[RankFigures],
) -> UnderLoad {
    let (mut during, mut outside) = (Vec::new(), Vec::new());
    for r in ranks {
        for (&at, &ms) in r.steps_at.iter().zip(&r.steps_ms) {
            let ended = at + std::time::Duration::from_micros((ms * 1e3) as u64);
            if at < end && ended > start {
                during.push(ms);
            } else {
                outside.push(ms);
            }
        }
    }
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => (f64::NAN, f64::NAN),
            n => (v[n / 2], v[n - 1]),
        }
    };
    let ((md, xd), (mo, xo)) = (stats(&mut during), stats(&mut outside));
    UnderLoad {
        checkpoint,
        steps_during: during.len(),
        steps_outside: outside.len(),
        step_ms_median_during: md,
        step_ms_max_during: xd,
        step_ms_median_outside: mo,
        step_ms_max_outside: xo,
        kept_index_entries: None,
        kept_row_bytes: None,
    }
}

/// The copy-on-write figures each lcore logged for the last checkpoint
/// stream it ended ("lcore N: checkpoint stream done; copy on write kept
/// at most E index entries and B bytes of rows"), summed over the
/// lcores: (entries, bytes); `None` when no lcore logged one.
fn kept_from_log(log: &str) -> Option<(u64, u64)> {
    let mut last = std::collections::BTreeMap::new();
    for line in log.lines() {
        let Some(at) = line.find("lcore ") else { continue };
        let rest = &line[at + 6..];
        let Some((lcore, rest)) = rest.split_once(": checkpoint stream done; copy on write kept at most ")
        else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let entries = words.next().and_then(|w| w.parse::<u64>().ok());
        let bytes = words.nth(3).and_then(|w| w.parse::<u64>().ok());
        if let (Ok(l), Some(e), Some(b)) = (lcore.parse::<u32>(), entries, bytes) {
            last.insert(l, (e, b));
        }
    }
    (!last.is_empty()).then(|| last.values().fold((0, 0), |(e, b), (x, y)| (e + x, b + y)))
}

/// `--take-checkpoint`, last: the dataplane restarted, and control
/// restoring job `id` from its file (`bytes` long), both daemons' VmRSS
/// sampled until the dataplane lists the job again (within 10 minutes).
fn restore_after_restart(local: &mut super::local::Local, id: u16, bytes: u64) -> Result<LocalCheckpoint> {
    let t = Instant::now();
    local.restart_dataplane()?;
    let mgmt = phub_http::Client::plain(&local.mgmt_url).context("a client of the dataplane")?;
    let pids = [local.dataplane.pid(), local.control.pid()];
    let (listed, _, before, peak) = sampled(pids, || {
        while t.elapsed() < std::time::Duration::from_secs(600) {
            let jobs = mgmt.send(&phub_proto::routes::mgmt::jobs()).unwrap_or_default();
            if jobs.iter().any(|j| j.id == id) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        false
    });
    ensure!(
        listed,
        "control did not restore job {id} within 10 minutes of the dataplane's restart"
    );
    Ok(LocalCheckpoint {
        bytes,
        seconds: t.elapsed().as_secs_f64(),
        dataplane_rss_before: before[0],
        dataplane_rss_peak: peak[0],
        control_rss_before: before[1],
        control_rss_peak: peak[1],
    })
}

/// One rank's figures in `--local`.
struct RankFigures {
    /// `--prefill`: its fill, seconds.
    prefill_s: Option<f64>,
    seconds: f64,
    steps_ms: Vec<f64>,
    /// When each timed step began.
    steps_at: Vec<Instant>,
    bytes: u64,
    retransmits: u64,
    /// Key caching's id bytes saved and prefix bytes, timed steps.
    saved: u64,
    prefixes: u64,
    /// `--verify`: per step (untimed ones first), a hash of the rows read
    /// back.
    digests: Vec<u64>,
}

/// What [`drive`]'s ranks did.
struct Driven {
    ranks: Vec<RankFigures>,
    /// The machine's busy CPU seconds ([`crate::sys::busy_seconds`]: every
    /// process, steal left out) from the moment the last rank began its
    /// timed steps to the moment the last one ended; `None` where
    /// `/proc/stat` is not read.
    machine_busy_s: Option<f64>,
}

/// Rank `r`'s ids, every step's (`--steps` + 3) `--batch` distinct ones in
/// turn, drawn from the rank's own sequence.
// Casts: 53 random bits to f64 for a uniform draw.
#[allow(clippy::cast_precision_loss)]
fn rank_ids(args: &SparseArgs, r: u16) -> Vec<u64> {
    let fixed = args.fixed_ids || args.cache_ids;
    let (total, k) = (if fixed { 1 } else { args.steps as usize + 3 }, args.batch);
    let mut all = Vec::with_capacity(total * k);
    let mut seen = std::collections::HashSet::with_capacity(k);
    let mut draw = u64::from(r) << 40;
    for _ in 0..total {
        seen.clear();
        while seen.len() < k {
            draw += 1;
            let u = (splitmix(draw) >> 11) as f64 / (1u64 << 53) as f64;
            let id = id_of(rank(u, args.rows, args.zipf));
            if seen.insert(id) {
                all.push(id);
            }
        }
    }
    if fixed {
        all = all.repeat(args.steps as usize + 3);
    }
    all
}

/// The spin the appliance's kernel-UDP lcores use now, as its stats say
/// (`--spin-us`; `auto` as its governor set it), microseconds; `None`
/// where control does not say.
fn lcore_spin(url: &str, token: Option<&str>) -> Option<u64> {
    let client = super::local::control_client(url, token, std::time::Duration::from_secs(10)).ok()?;
    let stats = client.send(&phub_proto::routes::control::stats()).ok()?;
    stats.dataplane?.spin_us
}

/// `--dense-pull`: a job of one dense key of `--batch` x `--dim` f32
/// elements on the same appliance; its ranks join, initialize it (round
/// 0) and pull it three times untimed, then `--steps` times timed, all at
/// once as the table's ranks did. The median of rank 0's timed steps, ms.
fn dense_pulls(args: &SparseArgs, url: &str, token: Option<&str>) -> Result<f64> {
    let elements = args.batch * args.dim as usize;
    let spec = format!(
        "name = \"dense-pull\"\nworkers = {}\n[optimizer]\nkind = \"sum\"\n[[keys]]\nname = \"dense\"\n\
         elements = {elements}\n",
        args.workers
    );
    let job = super::local::admit(url, &spec, token)?;
    let ranks = in_threads(0..args.workers, "a dense-pull rank", |_, r| -> Result<Vec<f64>> {
        let w = phub_worker::Worker::join(url, job.id, job.token, r)?;
        let mut values: Vec<f32> = (0..elements).map(|i| (i % 1000) as f32).collect();
        let h = w.init(0, &mut values)?;
        w.wait(h)?;
        let mut steps_ms = Vec::with_capacity(args.steps as usize);
        for step in 0..args.steps + 3 {
            let t = Instant::now();
            w.pull(0, &mut values)?;
            if step >= 3 {
                steps_ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(steps_ms)
    });
    let mut rank0 = Vec::new();
    for (r, steps) in ranks.into_iter().enumerate() {
        let steps = steps.with_context(|| format!("--dense-pull: rank {r}"))?;
        if r == 0 {
            rank0 = steps;
        }
    }
    super::local::evict(url, job.id, token);
    Ok(step_times(&rank0).median)
}

/// A rank's step times: upper median, 90th and 99th percentiles (nearest
/// rank, [`crate::stats::percentile`]), largest, ms.
struct StepTimes {
    median: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

/// [`StepTimes`] of a rank's timed steps (at least one: `run_local`
/// refuses `--steps 0`).
fn step_times(steps_ms: &[f64]) -> StepTimes {
    let mut v = steps_ms.to_vec();
    v.sort_by(f64::total_cmp);
    StepTimes {
        median: v[v.len() / 2],
        p90: crate::stats::percentile(&v, 90.0),
        p99: crate::stats::percentile(&v, 99.0),
        max: v[v.len() - 1],
    }
}

/// `--prefill`: rank `r`'s share of every row, ranks `r`, `r + W`, ...
/// below `--rows` as ids; every rank gets `ceil(rows / W)` of them (the
/// short ones wrap to the first rows, already stored), so that each pushes
/// as many rounds.
fn prefill_ids(args: &SparseArgs, r: u16) -> Vec<u64> {
    let w = u64::from(args.workers);
    let share = args.rows.div_ceil(w);
    (0..share)
        .map(|j| id_of((u64::from(r) + w * j) % args.rows))
        .collect()
}

/// A hash of rows' bits (FNV-1a over each value's bits).
fn digest(rows: &[f32]) -> u64 {
    rows.iter().fold(0xcbf2_9ce4_8422_2325, |h, v| {
        (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `--verify`: the first rank and step whose rows differ from
/// [`reference_digests`], if any.
fn verify_rows(
    args: &SparseArgs,
    opt: &phub_proto::spec::RowOptimizerSpec,
    grads: &[f32],
    ranks: &[RankFigures],
) -> Result<Option<String>> {
    let want = reference_digests(args, opt, grads)?;
    for (step, per_rank) in want.iter().enumerate() {
        for (r, d) in per_rank.iter().enumerate() {
            if ranks.get(r).and_then(|x| x.digests.get(step)) != Some(d) {
                return Ok(Some(format!(
                    "rank {r}, step {step}: the rows read back are not the reference's"
                )));
            }
        }
    }
    Ok(None)
}

/// The reference table run over every rank's ids and `grads`, step by
/// step, each step's summed gradient applied once per id: per step, per
/// rank, the digest of the rows it reads back. Element-wise Adagrad is
/// PROTOCOL.md §10.5's block written here again (rows stored as zeros
/// with `initial_accumulator` on their first push); the other optimizers
/// are the engine's own ([`RowOptimizer`], whose every block the engine's
/// rules tests hold to PROTOCOL.md's worked examples), so that for them
/// `--verify` checks what the transport and the rounds do to the rows.
fn reference_digests(
    args: &SparseArgs,
    opt: &phub_proto::spec::RowOptimizerSpec,
    grads: &[f32],
) -> Result<Vec<Vec<u64>>> {
    use std::collections::HashMap;
    let engine = phub_engine::engine::row_optimizer(opt);
    engine.check()?;
    let apply = |w: &mut [f32], state: &mut [f32], a: &[f32]| match *opt {
        phub_proto::spec::RowOptimizerSpec::Adagrad {
            lr,
            eps,
            rowwise: false,
            ..
        } => {
            for ((w, a), h) in w.iter_mut().zip(a).zip(state.iter_mut()) {
                *h += *a * *a;
                *w -= lr * *a / (h.sqrt() + eps);
            }
        }
        _ => engine.apply(w, state, a),
    };
    let (d, k) = (args.dim as usize, args.batch);
    let ids: Vec<Vec<u64>> = (0..args.workers).map(|r| rank_ids(args, r)).collect();
    // id -> (w, optimizer state)
    let mut table: HashMap<u64, (Vec<f32>, Vec<f32>)> = HashMap::new();
    let mut acc: HashMap<u64, Vec<f32>> = HashMap::new();
    let mut row = vec![0f32; k * d];
    let mut out = Vec::with_capacity(args.steps as usize + 3);
    for step in 0..args.steps as usize + 3 {
        acc.clear();
        for rank_ids in &ids {
            for (i, id) in rank_ids[step * k..(step + 1) * k].iter().enumerate() {
                let a = acc.entry(*id).or_insert_with(|| vec![0.0; d]);
                for (x, g) in a.iter_mut().zip(&grads[i * d..(i + 1) * d]) {
                    *x += *g;
                }
            }
        }
        for (id, a) in &acc {
            let (w, state) = table.entry(*id).or_insert_with(|| {
                let mut state = vec![0.0; engine.state_len(d)];
                engine.init_state(&mut state);
                (vec![0.0; d], state)
            });
            apply(w, state, a);
        }
        let mut per_rank = Vec::with_capacity(ids.len());
        for rank_ids in &ids {
            for (i, id) in rank_ids[step * k..(step + 1) * k].iter().enumerate() {
                row[i * d..(i + 1) * d].copy_from_slice(&table[id].0);
            }
            per_rank.push(digest(&row));
        }
        out.push(per_rank);
    }
    Ok(out)
}

/// One rank's push: `(ids, grads, out)` to `(bytes on the wire so far,
/// table messages resent so far)`; called with no ids for the counts alone.
/// Pushes a step's ids (none: only reads the counters) and returns the
/// worker's counters: bytes sent and received, table messages resent,
/// key caching's id bytes saved and prefix bytes.
type Pusher = Box<dyn FnMut(&[u64], &[f32], &mut [f32]) -> Result<[u64; 4]> + Send>;

/// Runs `--workers` threads, each with the pusher `connect(rank)` makes:
/// three untimed steps, then `--steps` timed, each of `--batch` distinct
/// ids drawn from the rank's own sequence (the same for every pusher).
/// Each rank calls `stepped(step, ms)` as each step ends (steps numbered
/// from 1, the untimed ones first; `ms` its time).
// Casts: counts to f64 for rates.
#[allow(clippy::cast_precision_loss)]
fn drive(
    args: &SparseArgs,
    grads: &[f32],
    stepped: &(dyn Fn(u32, f64) + Sync),
    connect: impl Fn(u16) -> Result<Pusher> + Sync,
) -> Result<Driven> {
    let (d, k) = (args.dim as usize, args.batch);
    // Every rank's steps, untimed ones included (hidden by --quiet, and
    // where stderr is no terminal).
    let bar = if args.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(u64::from(args.workers) * (u64::from(args.steps) + 3)).with_style(
            indicatif::ProgressStyle::with_template("  [{bar:40}] {pos}/{len} worker-steps {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
        )
    };
    bar.set_message(if args.prefill {
        "joining, prefilling"
    } else {
        "joining"
    });
    // The machine's busy time when the last rank began its timed steps.
    let (begun, busy0) = (std::sync::atomic::AtomicU16::new(0), std::sync::OnceLock::new());
    let figures = in_threads(0..args.workers, "a worker", |_, r| -> Result<RankFigures> {
        // Every step's ids, drawn before the timing (a Zipf
        // draw is a pow(), which took a sixth of the CPU when
        // drawn in the loop).
        let all = rank_ids(args, r);
        let mut digests = Vec::new();
        let mut push = connect(r)?;
        let mut out = vec![0f32; k * d];
        let mut steps_ms = Vec::with_capacity(args.steps as usize);
        let mut steps_at = Vec::with_capacity(args.steps as usize);
        let prefill_s = match args.prefill {
            true => {
                let t = Instant::now();
                for ids in prefill_ids(args, r).chunks(k) {
                    push(ids, &grads[..ids.len() * d], &mut out[..ids.len() * d])?;
                }
                Some(t.elapsed().as_secs_f64())
            }
            false => None,
        };
        let (mut before, mut t0) = ([0; 4], Instant::now());
        for (step, ids) in all.chunks_exact(k).enumerate() {
            if step == 3 {
                before = push(&[], &[], &mut [])?;
                if begun.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1 == args.workers {
                    if let Some(b) = crate::sys::busy_seconds() {
                        let _ = busy0.set(b);
                    }
                }
                t0 = Instant::now();
            }
            let t = Instant::now();
            push(ids, grads, &mut out)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if args.verify {
                digests.push(digest(&out));
            }
            if step >= 3 {
                steps_ms.push(ms);
                steps_at.push(t);
            }
            stepped(u32::try_from(step + 1).unwrap_or(u32::MAX), ms);
            if step == 0 {
                bar.set_message("");
            }
            bar.inc(1);
        }
        let seconds = t0.elapsed().as_secs_f64();
        let after = push(&[], &[], &mut [])?;
        Ok(RankFigures {
            prefill_s,
            seconds,
            steps_ms,
            steps_at,
            bytes: after[0] - before[0],
            retransmits: after[1] - before[1],
            saved: after[2] - before[2],
            prefixes: after[3] - before[3],
            digests,
        })
    });
    bar.finish_and_clear();
    Ok(Driven {
        ranks: figures.into_iter().collect::<Result<_>>()?,
        machine_busy_s: busy0
            .get()
            .and_then(|b0| crate::sys::busy_seconds().map(|b1| b1 - b0)),
    })
}

/// What the ranks did where the job ran, and what control said of it.
struct Ran {
    ranks: Driven,
    detail: phub_proto::api::JobDetail,
    checkpoint_under_load: Option<UnderLoad>,
    checkpoints: Vec<LocalCheckpoint>,
    restore: Option<LocalCheckpoint>,
    /// `--dense-pull`'s median step, ms.
    dense: Option<f64>,
    /// `--local`: the lcores' spin after the table's steps and after
    /// `--dense-pull`'s (`lcore_spin`).
    spin: (Option<u64>, Option<u64>),
    /// `--racks`: the bytes that crossed the spine over the whole run.
    cross_rack_bytes: Option<u64>,
    /// `--racks`: `--replicas` and `--kill-appliance`'s figures.
    failover: super::failover::FailoverFigures,
    /// Loopback: the dataplane's VmRSS once the timed steps ended.
    rss_bytes: Option<u64>,
    /// What admission charged the job (every appliance's part).
    charged_bytes: u64,
}

/// Rank `r`'s pusher on job `job` through control at `url`: joins,
/// registers its ids with `--cache-ids`, and pushes (or, past the untimed
/// steps with `--pull-only`, pulls) a step's rows.
fn rank_pusher(args: &SparseArgs, url: &str, job: &phub_proto::api::AdmitResponse, r: u16) -> Result<Pusher> {
    let w = phub_worker::Worker::join(url, job.id, job.token, r)?;
    if args.cache_ids {
        w.cache_ids("emb", &rank_ids(args, r)[..args.batch])?;
    }
    let bytes = |w: &phub_worker::Worker| {
        let s = w.stats();
        [
            s.bytes_sent + s.bytes_received,
            s.row_retransmits,
            s.key_cache_id_bytes_saved,
            s.key_cache_prefix_bytes,
        ]
    };
    // --pull-only: the untimed steps (the first three) push.
    let (pull_only, mut steps) = (args.pull_only, 0u32);
    Ok(Box::new(
        move |ids: &[u64], grads: &[f32], out: &mut [f32]| -> Result<[u64; 4]> {
            if ids.is_empty() {
                return Ok(bytes(&w));
            }
            steps += 1;
            if pull_only && steps > 3 {
                w.pull_rows("emb", ids, out)?;
                return Ok(bytes(&w));
            }
            w.push_pull_rows("emb", ids, grads, out)?;
            Ok(bytes(&w))
        },
    ))
}

/// `--local` on loopback: a local appliance, the job `spec` admitted on
/// it, the ranks driven, and what `--take-checkpoint`,
/// `--checkpoint-under-load` and `--dense-pull` ask for.
fn on_loopback(args: &SparseArgs, spec: &str, budget: u64, grads: &[f32]) -> Result<Ran> {
    use super::local::{admit, control_client, Local, LocalOptions};
    use phub_proto::routes::control;

    let mut local = Local::start(&LocalOptions {
        lcores: args.lcores,
        backend: "udp".into(),
        memory_budget: budget,
        bin_dir: None,
        busy_poll: false,
        no_pin: false,
        socket_buffer: None,
        env: Vec::new(),
        extra_args: args.dataplane_arg.clone(),
        shm: false,
        veth: None,
    })?;
    let token = local.operator_token().ok();
    let job = admit(&local.control_url, spec, token.as_deref())?;
    let url = local.control_url.clone();
    // --checkpoint-under-load: timed steps done so far, over the ranks.
    let done = std::sync::atomic::AtomicU64::new(0);
    let finished = std::sync::atomic::AtomicBool::new(false);
    let (ranks, under_load) = std::thread::scope(|s| {
        let taker = args.checkpoint_under_load.then(|| {
            s.spawn(|| checkpoint_halfway(args, &local, job.id, token.as_deref(), &done, &finished))
        });
        let counted = |step: u32, _| {
            if step > 3 {
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        };
        let ranks = drive(args, grads, &counted, |r| rank_pusher(args, &url, &job, r));
        finished.store(true, std::sync::atomic::Ordering::Relaxed);
        let taken = taker.map(|t| {
            t.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the checkpoint thread panicked")))
        });
        (ranks, taken)
    });
    let ranks = ranks?;
    let rss_bytes = rss_of(local.dataplane.pid());
    let spin = lcore_spin(&local.control_url, token.as_deref());
    let checkpoint_under_load = match under_load {
        Some(taken) => {
            let mut u = under_load_figures(taken?, &ranks.ranks);
            if let Some((e, b)) = kept_from_log(&local.dataplane_log()) {
                (u.kept_index_entries, u.kept_row_bytes) = (Some(e), Some(b));
            }
            Some(u)
        }
        None => None,
    };
    let checkpoints: Vec<LocalCheckpoint> = match args.take_checkpoint {
        true => (0..2)
            .map(|_| take_checkpoint(&local, job.id, token.as_deref()))
            .collect::<Result<_>>()?,
        false => Vec::new(),
    };
    let restore = match checkpoints.last() {
        Some(c) => Some(restore_after_restart(&mut local, job.id, c.bytes)?),
        None => None,
    };
    let detail = control_client(
        &local.control_url,
        token.as_deref(),
        std::time::Duration::from_secs(10),
    )?
    .send(&control::job(job.id))
    .context("asking control for the job's tables")?;
    let (dense, dense_spin) = match args.dense_pull {
        true => (
            Some(dense_pulls(args, &local.control_url, token.as_deref())?),
            lcore_spin(&local.control_url, token.as_deref()),
        ),
        false => (None, None),
    };
    local.stop();
    Ok(Ran {
        ranks,
        detail,
        checkpoint_under_load,
        checkpoints,
        restore,
        dense,
        spin: (spin, dense_spin),
        cross_rack_bytes: None,
        failover: super::failover::FailoverFigures::default(),
        rss_bytes,
        charged_bytes: job.memory_bytes,
    })
}

/// `--racks R`: R virtual racks (those of `phub-bench run --racks`), an
/// appliance per rack and control started, the job `spec` placed flat over
/// every rack's appliance with `--replicas`, the ranks driven from their
/// racks' namespaces (rank r in rack [`super::racks::rack_of_ranks`]'s),
/// and the bytes that crossed the spine meanwhile.
fn on_racks(
    args: &SparseArgs,
    (racks, kill): (usize, Option<usize>),
    spec: &str,
    budget: u64,
    grads: &[f32],
) -> Result<Ran> {
    use super::racks::RackNet;
    let net = RackNet::create(racks, None, None, 50.0)?;
    let dir = std::env::temp_dir().join(format!("phub-bench-sparse-racks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    phub_hwtests::process::track_dir(&dir);
    let r = RackNet::inside_named(&net.spine.name, || {
        in_spine(args, &net, &dir, kill, spec, budget, grads)
    });
    if r.is_err() {
        eprintln!("phub-bench: the racks' logs were in {} (removed)", dir.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
    phub_hwtests::process::untrack_dir(&dir);
    drop(net);
    r
}

/// [`on_racks`] inside the spine's namespace (control's): with
/// `--kill-appliance`, the ranks' steps go to a [`super::failover::Kill`]
/// (as `phub-bench run`'s rounds do), which kills the appliance, starts
/// it again with `--restart-after-ms`, and watches control meanwhile.
fn in_spine(
    args: &SparseArgs,
    net: &super::racks::RackNet,
    dir: &Path,
    kill: Option<usize>,
    spec: &str,
    budget: u64,
    grads: &[f32],
) -> Result<Ran> {
    use super::failover::Kill;
    use super::racks::{appliance_name, rack_of_ranks, start, Daemons};
    use phub_hwtests::dataplane_args::DataplaneArgs;
    let racks = net.racks.len();
    let mut appl = start(
        &Daemons {
            bin_dir: None,
            dataplane: DataplaneArgs {
                lcores: Some(args.lcores),
                ..DataplaneArgs::default()
            },
            env: Vec::new(),
            control_extra: args.failover().control_args(),
            dpdk: false,
        },
        net,
        dir,
        budget,
    )?;
    let names: Vec<String> = (1..=racks).map(appliance_name).collect();
    let spec = format!(
        "{spec}[placement]\nappliances = {names:?}\nreplicas = {}\n",
        args.replicas
    );
    let (url, token) = (appl.control_url.clone(), appl.token.clone());
    let job = super::local::admit(&url, &spec, Some(&token))?;
    let of = rack_of_ranks(usize::from(args.workers), racks);
    let mut kill = match (kill, &args.kill_appliance, args.kill_at_step) {
        (Some(i), Some(name), Some(at)) => {
            let appl = &mut appl;
            Some(Kill::new(
                name,
                at,
                3,
                usize::from(args.workers),
                Some(token.clone()),
                args.restart_after_ms.map(std::time::Duration::from_millis),
                move |act| appl.kill_or_restart(i, act),
            ))
        }
        _ => None,
    };
    let before = net.spine_rx_bytes()?;
    let (tx, rx) = std::sync::mpsc::channel::<(u32, f64)>();
    let (url_, job_, of_) = (&url, &job, &of);
    let ranks = std::thread::scope(|s| {
        let ranks = s.spawn(move || {
            let stepped = |step: u32, ms: f64| {
                let _ = tx.send((step, ms));
            };
            drive(args, grads, &stepped, |r| {
                let ns = &net.racks[of_[usize::from(r)]].name;
                phub_hwtests::virt::try_enter_netns(ns).map_err(|e| anyhow::anyhow!(e))?;
                rank_pusher(args, url_, job_, r)
            })
        });
        // The ranks' steps, until every rank is done (the channel closes):
        // after a kill, control is asked for the epoch (and, with a
        // restart, for full strength) between them.
        loop {
            let wait = match kill.as_mut() {
                Some(k) if k.awaits_control() => {
                    k.poll(&url, job.id);
                    std::time::Duration::from_millis(5)
                }
                _ => std::time::Duration::from_millis(100),
            };
            match rx.recv_timeout(wait) {
                Ok((step, ms)) => {
                    if let Some(k) = kill.as_mut() {
                        k.on_round(step, ms);
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        ranks
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the ranks' thread panicked")))
    });
    let after = net.spine_rx_bytes()?;
    let detail = super::local::control_client(&url, Some(&token), std::time::Duration::from_secs(10))?
        .send(&phub_proto::routes::control::job(job.id))
        .context("asking control for the job's tables")?;
    let mut failover = match (&kill, &ranks) {
        (Some(k), Ok(_)) => k.figures(&url, job.id, args.steps + 3, &[])?,
        _ => super::failover::FailoverFigures::default(),
    };
    failover.replicas = Some(args.replicas);
    drop(kill);
    super::local::evict(&url, job.id, Some(&token));
    appl.stop();
    Ok(Ran {
        ranks: ranks?,
        detail,
        checkpoint_under_load: None,
        checkpoints: Vec::new(),
        restore: None,
        dense: None,
        spin: (None, None),
        cross_rack_bytes: Some(after - before),
        failover,
        rss_bytes: None,
        charged_bytes: job.memory_bytes,
    })
}

/// `phub-bench sparse --local` (module head): one table of `--rows` rows
/// of `--dim` values with `--optimizer`'s updates, BSP by default; each rank
/// draws `--batch` distinct ranks a step (Zipf or uniform over the rows,
/// hashed to ids as `--engine-only` does) and calls `push_pull_rows`.
// Casts: counts to f64 for rates.
#[allow(clippy::cast_precision_loss)]
fn run_local(args: &SparseArgs) -> Result<()> {
    ensure!(args.workers >= 1, "--workers 0: accepted 1 or more");
    ensure!(args.steps >= 1, "--steps 0: accepted 1 or more");
    ensure!(
        args.batch >= 1 && args.dim >= 1,
        "--batch and --dim: accepted 1 or more"
    );
    ensure!(
        !(args.verify && args.prefill),
        "--verify's reference starts from an empty table: drop --verify or --prefill"
    );
    ensure!(
        !(args.verify && args.pull_only),
        "--verify checks the rows pushes make: drop --verify or --pull-only"
    );
    ensure!(
        !args.verify || args.consistency == phub_proto::spec::Consistency::Sync,
        "--verify checks BSP rounds against a reference; with --consistency {} a rank's rows depend on \
         the order the pushes arrived in: drop --verify or use --consistency bsp",
        args.consistency
    );
    // --kill-appliance: the index of the appliance to kill.
    let mut kill = None;
    if let Some(racks) = args.racks {
        ensure!(
            (1..=super::racks::MAX_RACKS).contains(&racks),
            "--racks {racks}: expected 1 to {}",
            super::racks::MAX_RACKS
        );
        ensure!(
            usize::from(args.workers) >= racks,
            "--workers {} with --racks {racks}: expected at least one worker per rack",
            args.workers
        );
        ensure!(
            (1..=3).contains(&args.replicas) && args.replicas as usize <= racks,
            "--replicas {} with --racks {racks}: expected 1 to 3, and no more than the racks (an appliance each)",
            args.replicas
        );
        for (set, flag) in [
            (args.baseline.is_some(), "--baseline"),
            (args.take_checkpoint, "--take-checkpoint"),
            (args.checkpoint_under_load, "--checkpoint-under-load"),
            (args.dense_pull, "--dense-pull"),
            (
                args.prefill,
                "--prefill (the spine's bytes per step would count the fill)",
            ),
        ] {
            ensure!(!set, "--racks with {flag}: not supported; drop one of them");
        }
        kill = super::failover::check(&args.failover(), racks, racks, args.steps, false)
            .map_err(|e| anyhow::anyhow!(e.to_string().replace("round", "step")))?;
    }
    let load = loadavg();
    let opt = args.optimizer.engine()?;
    let (d, k) = (args.dim as usize, args.batch);
    // --verify: a cap no draw reaches (nothing evicted).
    let cap = if args.verify { args.rows * 2 } else { args.rows };
    // --cache-ids: slots for a batch's messages even were all its ids
    // on one lcore.
    let per = phub_proto::spec::rows_per_datagram(
        phub_proto::spec::DEFAULT_CHUNK_BYTES,
        args.dim,
        phub_proto::Dtype::F32,
    );
    let key_cache = if args.cache_ids {
        u32::try_from(k.div_ceil(per.max(1) as usize)).unwrap_or(u32::MAX)
    } else {
        0
    };
    // Rows, index and optimizer state at the cap, with room to spare.
    let words = (d + opt.state_len(d)) as u64;
    let budget = (cap * (words * 4 + 64)).max(1 << 28) * 2;
    let spec = format!(
        "name = \"sparse\"\nworkers = {}\n[optimizer]\nkind = \"sum\"\n[[keys]]\nname = \"emb\"\n\
         kind = \"table\"\ndim = {}\nrows = {}\noptimizer = {}\nkey_cache = {}\n",
        args.workers,
        args.dim,
        cap,
        args.optimizer.spec_toml(),
        key_cache
    );
    let spec = match args.consistency {
        phub_proto::spec::Consistency::Sync => spec,
        phub_proto::spec::Consistency::Async => format!("{spec}[consistency]\nmode = \"async\"\n"),
        phub_proto::spec::Consistency::Bounded { delay } => {
            format!("{spec}[consistency]\nbounded_delay = {delay}\n")
        }
    };
    // --verify: multiples of 2^-10 in [-0.5, 0.5), whose sums over the
    // ranks are exact in any order.
    let grads: Vec<f32> = (0..k * d)
        .map(|i| match args.verify {
            false => (splitmix(i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5,
            true => ((splitmix(i as u64) >> 54) as f32 - 512.0) / 1024.0,
        })
        .collect();
    let table_opt = phub_proto::spec::JobSpec::from_toml(&spec)
        .ok()
        .and_then(|s| s.keys.first().and_then(|k| k.table.as_ref().map(|t| t.optimizer)))
        .context("the benchmark's own spec has its table")?;
    let ran = match args.racks {
        Some(racks) => on_racks(args, (racks, kill), &spec, budget, &grads)?,
        None => on_loopback(args, &spec, budget, &grads)?,
    };
    let Ran {
        ranks: Driven {
            ranks,
            machine_busy_s,
        },
        detail,
        checkpoint_under_load,
        checkpoints,
        restore,
        dense,
        spin,
        cross_rack_bytes,
        failover: ran_failover,
        rss_bytes,
        charged_bytes,
    } = ran;
    // The baseline after phub, the appliance stopped: the same draws.
    let base = match args.baseline.as_deref() {
        Some(_) => {
            let server = super::tcp_rows::Server::start(d, opt)?;
            let driven = drive(args, &grads, &|_, _| {}, |_| {
                let mut c = server.connect()?;
                Ok(Box::new(
                    move |ids: &[u64], grads: &[f32], out: &mut [f32]| -> Result<[u64; 4]> {
                        if !ids.is_empty() {
                            c.push_pull(ids, grads, out)?;
                        }
                        Ok([0; 4])
                    },
                ) as Pusher)
            })?;
            Some(driven)
        }
        None => None,
    };
    let rows_stored = detail.tables.iter().map(|t| t.rows_stored).sum();
    let blocks_made_on_lcore = detail.tables.iter().map(|t| t.blocks_made_on_lcore).sum();
    let evicted: u64 = detail.tables.iter().map(|t| t.evicted_cap + t.evicted_idle).sum();
    let verified = match args.verify {
        false => None,
        true => {
            let why = match evicted {
                0 => verify_rows(args, &table_opt, &grads, &ranks)?,
                n => Some(format!("{n} rows were evicted (the reference keeps every row)")),
            };
            if let Some(why) = &why {
                eprintln!("phub-bench sparse: not verified: {why}");
            }
            Some(why.is_none())
        }
    };
    let rows_moved = f64::from(args.workers) * k as f64 * f64::from(args.steps);
    let rate = |ranks: &[RankFigures]| rows_moved / ranks.iter().map(|r| r.seconds).fold(0f64, f64::max);
    let times0 = |ranks: &[RankFigures]| step_times(&ranks[0].steps_ms);
    let StepTimes {
        median,
        p90,
        p99,
        max,
    } = times0(&ranks);
    let base_times = base.as_ref().map(|b| times0(&b.ranks));
    let base_rate = base.as_ref().map(|b| rate(&b.ranks));
    let cpu_per_row = |busy_s: Option<f64>| busy_s.map(|s| s * 1e6 / rows_moved);
    let report = SparseLocalReport {
        workers: args.workers,
        consistency: args.consistency.to_string(),
        optimizer: args.optimizer,
        lcores: args.lcores,
        rows: args.rows,
        dim: args.dim,
        batch: k,
        zipf: args.zipf,
        steps: args.steps,
        row_updates_per_s: if args.pull_only { 0.0 } else { rate(&ranks) },
        row_lookups_per_s: rate(&ranks),
        pull_only: args.pull_only,
        dense_pull_ms_median: dense,
        pull_vs_dense: dense.map(|m| median / m),
        spin_us: spin.0,
        dense_spin_us: spin.1,
        round_ms_median: median,
        round_ms_max: max,
        round_ms_p90: p90,
        round_ms_p99: p99,
        wire_bytes_per_row: ranks.iter().map(|r| r.bytes).sum::<u64>() as f64 / rows_moved,
        rows_stored,
        blocks_made_on_lcore,
        rss_bytes,
        charged_bytes,
        prefill_rows_per_s: ranks
            .iter()
            .map(|r| r.prefill_s)
            .try_fold(0f64, |m, s| s.map(|s| m.max(s)))
            .map(|s| args.rows as f64 / s),
        row_retransmits: ranks.iter().map(|r| r.retransmits).sum(),
        baseline: args.baseline.clone(),
        baseline_row_updates_per_s: base_rate,
        baseline_round_ms_median: base_times.as_ref().map(|b| b.median),
        baseline_round_ms_p90: base_times.as_ref().map(|b| b.p90),
        baseline_round_ms_p99: base_times.as_ref().map(|b| b.p99),
        speedup_vs_baseline: base_rate.map(|b| rate(&ranks) / b),
        cpu_us_per_row: cpu_per_row(machine_busy_s),
        baseline_cpu_us_per_row: base.as_ref().and_then(|b| cpu_per_row(b.machine_busy_s)),
        verified,
        fixed_ids: args.fixed_ids || args.cache_ids,
        cache_ids: args.cache_ids,
        key_cache_id_bytes_saved_per_row: ranks.iter().map(|r| r.saved).sum::<u64>() as f64 / rows_moved,
        key_cache_prefix_bytes_per_row: ranks.iter().map(|r| r.prefixes).sum::<u64>() as f64 / rows_moved,
        checkpoints,
        restore,
        checkpoint_under_load,
        loadavg_1m_before: load,
        racks: args.racks,
        failover: ran_failover,
        cross_rack_bytes_per_step: cross_rack_bytes.map(|b| b as f64 / f64::from(args.steps + 3)),
        machine: Machine::detect(),
    };
    println!(
        "sparse local: {} workers, {}, {} lcore(s), table of {} rows x {} ({}), {} ids per worker and step ({}), \
         {} steps",
        report.workers,
        report.consistency,
        report.lcores,
        report.rows,
        report.dim,
        opt.name(),
        report.batch,
        report.zipf.map_or("uniform".to_string(), |s| format!("zipf {s}")),
        report.steps
    );
    println!(
        "  {} {:.3e}   step median {:.2} ms, p90 {:.2}, p99 {:.2}, max {:.2}   machine CPU {:.3} us a row",
        if report.pull_only {
            "row lookups/s (pulls only)"
        } else {
            "row updates/s (each with its row read back)"
        },
        report.row_lookups_per_s,
        report.round_ms_median,
        report.round_ms_p90,
        report.round_ms_p99,
        report.round_ms_max,
        report.cpu_us_per_row.unwrap_or(f64::NAN)
    );
    println!(
        "  {:.1} wire bytes per row   {} rows stored ({} row blocks made on the lcores)   {} table messages resent",
        report.wire_bytes_per_row, report.rows_stored, report.blocks_made_on_lcore, report.row_retransmits
    );
    if let Some(rss) = report.rss_bytes {
        println!(
            "  dataplane rss {:.3} GB   the job's admission charge {:.3} GB",
            rss as f64 / 1e9,
            report.charged_bytes as f64 / 1e9
        );
    }
    if let (Some(racks), Some(b)) = (report.racks, report.cross_rack_bytes_per_step) {
        println!(
            "  {racks} virtual racks, replicas {}: {:.1} KB across the spine per step",
            args.replicas,
            b / 1e3
        );
    }
    let f = &report.failover;
    if let (Some(name), Some(ms)) = (&f.killed_appliance, f.failover_ms) {
        println!(
            "  {name} killed: failover {ms:.1} ms (the kill to the first step beyond it), epoch served after {}",
            f.epoch_served_ms.map_or("?".into(), |e| format!("{e:.1} ms"))
        );
    }
    if let (Some(full), Some(bytes)) = (f.full_strength_seen_ms, f.rereplication_bytes) {
        println!(
            "  {} started again: full strength seen {full:.1} ms after (control: {} ms), {:.1} MB copied, \
             longest of {} steps meanwhile {:.2} ms",
            f.killed_appliance.as_deref().unwrap_or("?"),
            f.full_strength_ms.map_or("?".into(), |m| m.to_string()),
            bytes as f64 / 1e6,
            f.rounds_during.unwrap_or(0),
            f.longest_round_during_ms.unwrap_or(f64::NAN)
        );
    }
    if let (Some(m), Some(r)) = (report.dense_pull_ms_median, report.pull_vs_dense) {
        println!(
            "  a dense key of {} x {} elements pulled: step median {m:.2} ms; the table's pull {r:.2}x that",
            report.batch, report.dim
        );
    }
    let us = |s: Option<u64>| s.map_or_else(|| "?".to_string(), |s| s.to_string());
    match (report.spin_us, report.dense_pull_ms_median) {
        (None, _) => {}
        (s, None) => println!("  lcore spin at the end of the steps: {} us", us(s)),
        (s, Some(_)) => println!(
            "  lcore spin at the end of the table's steps: {} us; of the dense pulls: {} us",
            us(s),
            us(report.dense_spin_us)
        ),
    }
    if report.cache_ids {
        println!(
            "  key caching: {:.1} id bytes per row left out, {:.2} prefix bytes per row carried",
            report.key_cache_id_bytes_saved_per_row, report.key_cache_prefix_bytes_per_row
        );
    }
    for (i, c) in report.checkpoints.iter().enumerate() {
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "  checkpoint {} ({}) {:.1} MB in {:.2} s; during it the dataplane's RSS {:.1} -> peak {:.1} MB (+{:.1}), \
             control's {:.1} -> peak {:.1} MB (+{:.1})",
            i + 1,
            if i == 0 { "no file yet" } else { "over the previous file" },
            mb(c.bytes),
            c.seconds,
            mb(c.dataplane_rss_before),
            mb(c.dataplane_rss_peak),
            mb(c.dataplane_rss_peak - c.dataplane_rss_before),
            mb(c.control_rss_before),
            mb(c.control_rss_peak),
            mb(c.control_rss_peak - c.control_rss_before)
        );
    }
    if let Some(u) = &report.checkpoint_under_load {
        let c = &u.checkpoint;
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "  checkpoint under load {:.1} MB in {:.2} s; the dataplane's RSS {:.1} -> peak {:.1} MB (+{:.1}), \
             control's +{:.1} MB; copy on write kept at most {} index entries and {} of rows; steps during it: {} \
             of median {:.2} ms, max {:.2} ms; the other {}: median {:.2} ms, max {:.2} ms",
            mb(c.bytes),
            c.seconds,
            mb(c.dataplane_rss_before),
            mb(c.dataplane_rss_peak),
            mb(c.dataplane_rss_peak - c.dataplane_rss_before),
            mb(c.control_rss_peak - c.control_rss_before),
            u.kept_index_entries.map_or("?".into(), |e| e.to_string()),
            u.kept_row_bytes.map_or("? MB".into(), |b| format!("{:.1} MB", mb(b))),
            u.steps_during,
            u.step_ms_median_during,
            u.step_ms_max_during,
            u.steps_outside,
            u.step_ms_median_outside,
            u.step_ms_max_outside
        );
    }
    if let Some(c) = &report.restore {
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "  restore after a dataplane restart: {:.1} MB in {:.2} s; the new dataplane's RSS {:.1} -> peak {:.1} MB, \
             control's {:.1} -> peak {:.1} MB (+{:.1})",
            mb(c.bytes),
            c.seconds,
            mb(c.dataplane_rss_before),
            mb(c.dataplane_rss_peak),
            mb(c.control_rss_before),
            mb(c.control_rss_peak),
            mb(c.control_rss_peak - c.control_rss_before)
        );
    }
    if let (Some(b), Some(x)) = (report.baseline_row_updates_per_s, report.speedup_vs_baseline) {
        println!(
            "  tcp-ps (a TCP row server, each push applied at once): row updates/s {b:.3e}, step median {:.2} ms, \
             p90 {:.2}, p99 {:.2}, machine CPU {:.3} us a row; phub/tcp-ps {x:.2}x",
            report.baseline_round_ms_median.unwrap_or(f64::NAN),
            report.baseline_round_ms_p90.unwrap_or(f64::NAN),
            report.baseline_round_ms_p99.unwrap_or(f64::NAN),
            report.baseline_cpu_us_per_row.unwrap_or(f64::NAN)
        );
    }
    if let Some(v) = report.verified {
        println!(
            "  verified: {v} (every rank's rows, every step, against the reference table{})",
            if v { "" } else { ": see above" }
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    ensure!(
        report.verified != Some(false),
        "the rows were not the reference's"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_optimizer_option_is_a_table_optimizer_the_engine_accepts() {
        use clap::ValueEnum;
        for o in RowOpt::value_variants() {
            let spec = o.spec().unwrap();
            let engine = o.engine().unwrap();
            // The option's name is the engine's (PROTOCOL.md §10.5's block).
            assert_eq!(o.to_possible_value().unwrap().get_name(), engine.name());
            assert_eq!(spec.name(), engine.name().trim_end_matches("-rowwise"));
        }
    }

    /// The lcores' copy-on-write lines are summed, each lcore's last.
    #[test]
    fn copy_on_write_figures_are_read_from_the_log() {
        let log = "[t INFO  phub_dataplane::lcore] lcore 0: checkpoint stream done; copy on write kept at most 5 index \
                   entries and 100 bytes of rows\n\
                   [t INFO  phub_dataplane::lcore] lcore 1: checkpoint stream left by its reader; copy on write kept \
                   at most 9 index entries and 900 bytes of rows\n\
                   [t INFO  phub_dataplane::lcore] lcore 1: checkpoint stream done; copy on write kept at most 7 index \
                   entries and 30 bytes of rows\n\
                   [t INFO  phub_dataplane::lcore] lcore 0: checkpoint stream done; copy on write kept at most 6 index \
                   entries and 200 bytes of rows\n";
        assert_eq!(kept_from_log(log), Some((13, 230)));
        assert_eq!(kept_from_log("nothing"), None);
    }

    /// `--checkpoint-under-load`: a step is "during" when any part of it
    /// ran between the checkpoint's start and end.
    #[test]
    fn steps_overlapping_the_checkpoint_are_told_apart() {
        let t0 = Instant::now();
        let ms = |n: u64| std::time::Duration::from_millis(n);
        let c = LocalCheckpoint {
            bytes: 1,
            seconds: 0.1,
            dataplane_rss_before: 0,
            dataplane_rss_peak: 0,
            control_rss_before: 0,
            control_rss_peak: 0,
        };
        // Steps of 10 ms at 0, 10, ... 90 ms; the checkpoint from 25 to 52.
        let rank = RankFigures {
            prefill_s: None,
            seconds: 0.1,
            steps_ms: (0..10).map(|i| 10.0 + f64::from(i)).collect(),
            steps_at: (0..10).map(|i| t0 + ms(10 * i)).collect(),
            bytes: 0,
            retransmits: 0,
            saved: 0,
            prefixes: 0,
            digests: Vec::new(),
        };
        let u = under_load_figures((c, t0 + ms(25), t0 + ms(52)), &[rank]);
        // 20 (20..32), 30, 40 and 50 overlap; 10 ends at 21 ms.
        assert_eq!((u.steps_during, u.steps_outside), (4, 6));
        assert_eq!((u.step_ms_median_during, u.step_ms_max_during), (14.0, 15.0));
        assert_eq!((u.step_ms_median_outside, u.step_ms_max_outside), (17.0, 19.0));
    }

    #[test]
    fn zipf_ranks_stay_in_range_and_favour_the_first() {
        for s in [None, Some(0.8), Some(1.0), Some(1.05)] {
            let mut low = 0;
            for i in 0..10_000u64 {
                let u = (splitmix(i) >> 11) as f64 / (1u64 << 53) as f64;
                let r = rank(u, 1000, s);
                assert!(r < 1000);
                low += u64::from(r < 10);
            }
            if s.is_some() {
                assert!(low > 1_500, "zipf {s:?}: {low} of 10,000 in the first 10 ranks");
            } else {
                assert!(low < 300, "uniform: {low} of 10,000 in the first 10 ranks");
            }
        }
    }

    /// `--verify` names the first rank and step whose rows differ, and a
    /// changed value anywhere changes a step's digest.
    #[test]
    fn verify_names_the_first_rank_and_step_whose_rows_differ() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            a: SparseArgs,
        }
        let args = Cli::parse_from(
            "t --local --verify --workers 2 --rows 50 --dim 3 --batch 4 --steps 2 --zipf 1.05".split(' '),
        )
        .a;
        let opt = phub_proto::spec::RowOptimizerSpec::Adagrad {
            lr: 0.01,
            eps: 1e-8,
            initial_accumulator: 0.0,
            rowwise: false,
        };
        let grads: Vec<f32> = (0..12).map(|i| (i as f32 - 6.0) / 1024.0).collect();
        let want = reference_digests(&args, &opt, &grads).unwrap();
        assert_eq!((want.len(), want[0].len()), (5, 2), "steps + 3 untimed, 2 ranks");
        let ranks = |flip: Option<(usize, usize)>| -> Vec<RankFigures> {
            (0..2)
                .map(|r| RankFigures {
                    prefill_s: None,
                    seconds: 1.0,
                    steps_ms: Vec::new(),
                    steps_at: Vec::new(),
                    bytes: 0,
                    retransmits: 0,
                    saved: 0,
                    prefixes: 0,
                    digests: (0..5)
                        .map(|s| want[s][r] ^ u64::from(flip == Some((r, s))))
                        .collect(),
                })
                .collect()
        };
        assert_eq!(verify_rows(&args, &opt, &grads, &ranks(None)).unwrap(), None);
        let why = verify_rows(&args, &opt, &grads, &ranks(Some((1, 3))))
            .unwrap()
            .unwrap();
        assert!(why.contains("rank 1, step 3"), "{why}");
        assert_ne!(digest(&[1.0, 2.0]), digest(&[1.0, 2.000_000_2]));
        // Another optimizer gives other rows; one the engine refuses, an
        // error.
        let sgd = phub_proto::spec::RowOptimizerSpec::Sgd { lr: 0.1 };
        assert!(verify_rows(&args, &sgd, &grads, &ranks(None)).unwrap().is_some());
        let bad = phub_proto::spec::RowOptimizerSpec::Sgd { lr: f32::NAN };
        assert!(verify_rows(&args, &bad, &grads, &ranks(None)).is_err());
    }
}
