//! phub-bench: benchmarks that print figures and ratios measured in the same
//! run (never timed assertions).
//!
//! `phub-bench kernels` measures the aggregation kernels on one core, in GB/s
//! (1e9 bytes per second) of gradient input bytes, against two baselines
//! over the same bytes in the same run: a read-only streaming pass and a
//! memcpy. See BENCHMARKS.md for how to read the figures.
//!
//! `phub-bench run` measures a whole appliance end to end: W emulated
//! workers exchange a real model's tensors (ResNet-50, VGG-16, BERT-large
//! or synthetic) every round; see `phub_tools::bench`.
//!
//! Adding a measurement: write a function that builds a [`Case`] (a name, a
//! dtype, the input bytes per pass and a closure running one pass; see
//! [`tall_case`]), push it into the `cases` of [`kernel_records`] so it is
//! timed round-robin with the baselines and gets `ratio_to_read` and
//! `ratio_to_memcpy` for free, or add a subcommand to [`Command`].

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context, Result};
use clap::{Args, Parser, Subcommand};
use phub_engine::kernels::Kernels;
use phub_engine::optim::{self, ChunkBufs};
use phub_proto::spec::Optimizer;
use phub_proto::Dtype;
use phub_tools::bench::{local, run, sparse, torch};
use phub_tools::membw::ReadPass;
use phub_tools::sys::Machine;
use serde::Serialize;

/// Workers per chunk in the tall aggregation.
const WORKERS: usize = 8;
/// Payload bytes of one worker's contribution to one chunk.
const CHUNK_BYTES: usize = 8192;

#[derive(Parser, Debug)]
#[command(
    name = "phub-bench",
    version,
    about = "phub benchmarks: figures and same-run ratios"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Aggregation kernels (every family x every dtype) vs read-only pass and memcpy, one core.
    Kernels(KernelsArgs),
    /// W emulated workers exchange a model with an appliance: round time, goodput, efficiency.
    Run(Box<run::RunArgs>),
    /// Sparse tables: row updates and lookups per second (`--engine-only`: the row store alone).
    Sparse(sparse::SparseArgs),
    /// PyTorch DDP on virtual racks: gloo's all-reduce against phub's comm hook, same links, same run.
    Torch(torch::TorchArgs),
    /// One emulated worker process (started by `run --procs`).
    #[command(hide = true)]
    BenchWorker {
        /// The worker's plan, JSON.
        #[arg(long)]
        plan: String,
    },
    /// phub-dataplane's program, same flags (started by `run --local`).
    #[command(hide = true, disable_help_flag = true)]
    ServeDataplane {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// phub-control's program (started by `run --local`).
    #[command(hide = true)]
    ServeControl(local::ControlArgs),
    /// The TCP parameter server of `run --baseline tcp-ps`.
    #[command(hide = true)]
    ServeTcpPs {
        /// Address to listen on (port 0: a free one, printed).
        #[arg(long)]
        listen: std::net::SocketAddr,
        /// Workers to wait for.
        #[arg(long)]
        workers: usize,
    },
}

#[derive(Args, Debug, Serialize)]
struct KernelsArgs {
    /// Also write every measurement as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Total input bytes of the out-of-cache case, in MiB (far beyond the LLC).
    #[arg(long, value_name = "N", default_value_t = 512)]
    out_mib: usize,
    /// Total input bytes of the in-cache case, in KiB (must fit in L2 with the accumulators).
    #[arg(long, value_name = "N", default_value_t = 256)]
    in_kib: usize,
    /// Timed repetitions per measurement; the best is reported (the median too).
    #[arg(long, value_name = "N", default_value_t = 9)]
    reps: usize,
}

/// One measurement.
#[derive(Debug, Clone, Serialize)]
struct Record {
    /// Kernel family (`scalar`, `avx2`, `avx512`) or baseline (`read`, `memcpy`).
    kernel: String,
    /// Element type, or `bytes` for the baselines.
    dtype: String,
    /// `in` (inputs stay in L2) or `out` (inputs far beyond the LLC).
    cache: &'static str,
    /// Best repetition, GB/s of input bytes.
    gbps: f64,
    /// Median repetition, GB/s of input bytes.
    median_gbps: f64,
    /// `gbps` over the read-only pass's `gbps`, same cache case, same run.
    ratio_to_read: f64,
    /// `gbps` over the memcpy's `gbps`, same cache case, same run.
    ratio_to_memcpy: f64,
    /// Input bytes per pass.
    input_bytes: u64,
    /// Passes per timed repetition.
    passes_per_rep: u64,
    /// Every repetition, GB/s, in the order measured.
    reps_gbps: Vec<f64>,
}

/// One thing to time: a pass over `bytes` input bytes, and what it measured.
struct Case<'a> {
    kernel: String,
    dtype: String,
    bytes: u64,
    pass: Box<dyn FnMut() + 'a>,
    passes_per_rep: u64,
    /// GB/s of every timed repetition, in order.
    rates: Vec<f64>,
}

impl<'a> Case<'a> {
    fn new(kernel: &str, dtype: &str, bytes: u64, pass: impl FnMut() + 'a) -> Case<'a> {
        Case {
            kernel: kernel.to_string(),
            dtype: dtype.to_string(),
            bytes,
            pass: Box::new(pass),
            passes_per_rep: 1,
            rates: Vec::new(),
        }
    }

    /// Warm-up: touches every page, trains the caches and calibrates how
    /// many passes make one repetition last at least `min_rep`.
    fn warm_up(&mut self, min_rep: Duration) {
        let mut passes = 0u64;
        let t = Instant::now();
        while passes == 0 || t.elapsed() < min_rep / 4 {
            (self.pass)();
            passes += 1;
        }
        let per_pass = t.elapsed().as_secs_f64() / passes as f64;
        self.passes_per_rep = ((min_rep.as_secs_f64() / per_pass).ceil() as u64).max(1);
    }

    /// One timed repetition.
    fn rep(&mut self) {
        let t = Instant::now();
        for _ in 0..self.passes_per_rep {
            (self.pass)();
        }
        let secs = t.elapsed().as_secs_f64();
        self.rates
            .push((self.bytes * self.passes_per_rep) as f64 / secs / 1e9);
    }

    fn record(&self, cache: Cache) -> Record {
        let mut sorted = self.rates.clone();
        sorted.sort_by(f64::total_cmp);
        Record {
            kernel: self.kernel.clone(),
            dtype: self.dtype.clone(),
            cache: cache.name(),
            gbps: sorted.last().copied().unwrap_or(0.0),
            median_gbps: sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
            ratio_to_read: f64::NAN,
            ratio_to_memcpy: f64::NAN,
            input_bytes: self.bytes,
            passes_per_rep: self.passes_per_rep,
            reps_gbps: self.rates.clone(),
        }
    }
}

/// Times every case, `reps` rounds, one repetition of each case per round
/// (round-robin), so that a slow spell on this shared machine hits every
/// case alike and the ratios between them stay meaningful.
fn measure_interleaved(cases: &mut [Case<'_>], cache: Cache, reps: usize) {
    for c in cases.iter_mut() {
        c.warm_up(cache.min_rep());
    }
    for _ in 0..reps {
        for c in cases.iter_mut() {
            c.rep();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cache {
    In,
    Out,
}

impl Cache {
    fn name(self) -> &'static str {
        match self {
            Cache::In => "in",
            Cache::Out => "out",
        }
    }

    /// Minimum duration of one timed repetition.
    fn min_rep(self) -> Duration {
        match self {
            Cache::In => Duration::from_millis(20),
            // One pass over hundreds of MiB is long enough by itself.
            Cache::Out => Duration::from_millis(1),
        }
    }
}

/// The tall aggregation's inputs: `chunks * WORKERS` separate buffers of
/// `CHUNK_BYTES`, like received packet payloads. Input `c * WORKERS + w` is
/// worker `w`'s contribution to chunk `c`.
struct Tall {
    chunks: usize,
    inputs: Vec<Vec<u8>>,
}

impl Tall {
    /// About `total` input bytes (at least one chunk). Every 16-bit word is a
    /// moderate-magnitude normal value as f16 and as bf16, and every 32-bit
    /// word a normal f32, so no dtype sees subnormals, infinities or NaNs.
    fn new(total: usize) -> Tall {
        let chunks = (total / (WORKERS * CHUNK_BYTES)).max(1);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let inputs = (0..chunks * WORKERS)
            .map(|_| {
                let mut buf = vec![0u8; CHUNK_BYTES];
                for w in buf.chunks_exact_mut(8) {
                    // xorshift64*
                    state ^= state >> 12;
                    state ^= state << 25;
                    state ^= state >> 27;
                    let r = state.wrapping_mul(0x2545_f491_4f6c_dd1d);
                    let mut word = 0u64;
                    for k in 0..4 {
                        let bits = (r >> (16 * k)) as u16;
                        // f16 exponent 5..15 (2^-10..1), random mantissa and sign.
                        let v = (bits & 0x8000) | (0x1400 + (bits & 0x7fff) % 0x2800);
                        word |= u64::from(v) << (16 * k);
                    }
                    w.copy_from_slice(&word.to_le_bytes());
                }
                buf
            })
            .collect();
        Tall { chunks, inputs }
    }

    fn input_bytes(&self) -> u64 {
        (self.inputs.len() * CHUNK_BYTES) as u64
    }

    /// The inputs of chunk `c`.
    fn chunk(&self, c: usize) -> &[Vec<u8>] {
        &self.inputs[c * WORKERS..(c + 1) * WORKERS]
    }

    /// One accumulator per chunk for `dtype`.
    fn accumulators(&self, dtype: Dtype) -> Vec<Vec<f32>> {
        vec![vec![0.0f32; CHUNK_BYTES / dtype.size()]; self.chunks]
    }

    /// One round of the tall aggregation: per chunk, copy input 0 into the
    /// accumulator, then add inputs 1..WORKERS.
    fn aggregate(&self, k: &Kernels, dtype: Dtype, accs: &mut [Vec<f32>]) {
        for (c, acc) in accs.iter_mut().enumerate() {
            let inputs = self.chunk(c);
            k.copy(dtype, acc, &inputs[0]);
            for src in &inputs[1..] {
                k.add(dtype, acc, src);
            }
        }
        black_box(accs);
    }
}

/// The read-only pass: every input byte once, in the order the kernels read them.
fn read_case(tall: &Tall) -> Case<'_> {
    let r = ReadPass::best();
    Case::new("read", "bytes", tall.input_bytes(), move || {
        let mut x = 0u64;
        for buf in &tall.inputs {
            x ^= r.run(buf);
        }
        black_box(x);
    })
}

/// memcpy of every input into one destination buffer of the same total size.
fn memcpy_case(tall: &Tall) -> Case<'_> {
    let mut dst = vec![0u8; tall.inputs.len() * CHUNK_BYTES];
    Case::new("memcpy", "bytes", tall.input_bytes(), move || {
        for (d, src) in dst.chunks_exact_mut(CHUNK_BYTES).zip(&tall.inputs) {
            d.copy_from_slice(src);
        }
        black_box(&mut dst);
    })
}

/// The tall aggregation with one kernel family and dtype.
fn tall_case(tall: &Tall, k: Kernels, dtype: Dtype) -> Case<'_> {
    let mut accs = tall.accumulators(dtype);
    Case::new(k.kind().name(), dtype.name(), tall.input_bytes(), move || {
        tall.aggregate(&k, dtype, &mut accs)
    })
}

/// The tall aggregation with the last contribution summed straight into a
/// separate output buffer per chunk, as a round's final sum is written where
/// the result leaves from (the result region with shared memory; a payload
/// buffer): one accumulator reused for every chunk (it stays in the cache),
/// input 0 copied into it, inputs 1..W-1 added, and `acc + input W-1` written
/// to the chunk's output with ordinary stores (`final:store`: each output
/// line is read for ownership, then written back, W + 2 lines moved per W
/// read) or streaming stores (`final:stream`: W + 1). The read pass over the
/// same inputs moves W, so the bounds are W/(W+2) and W/(W+1) of it.
fn final_case(tall: &Tall, stream: bool) -> Case<'_> {
    let k = Kernels::best();
    let n = CHUNK_BYTES / Dtype::F32.size();
    let mut acc = vec![0.0f32; n];
    let mut outs = vec![vec![0.0f32; n]; tall.chunks];
    let name = if stream { "final:stream" } else { "final:store" };
    Case::new(name, Dtype::F32.name(), tall.input_bytes(), move || {
        for (c, out) in outs.iter_mut().enumerate() {
            let inputs = tall.chunk(c);
            k.copy(Dtype::F32, &mut acc, &inputs[0]);
            for src in &inputs[1..WORKERS - 1] {
                k.add(Dtype::F32, &mut acc, src);
            }
            let (a, b) = (bytemuck::cast_slice(&acc), &inputs[WORKERS - 1][..]);
            if stream {
                k.sum_f32_stream(out, a, b, 1.0);
            } else {
                k.sum_f32(out, a, b, 1.0);
            }
        }
        black_box(&mut outs);
    })
}

/// A whole round per chunk as the engine runs it with `f32` on the wire:
/// aggregate the W inputs with the best kernels, then the optimizer's fused
/// pass over the chunk. Sum's pass does nothing, so "round:sum" against
/// "round:adam" is the cost of the fused Adam pass over a plain sum.
fn round_case(tall: &Tall, opt: Optimizer) -> Case<'_> {
    let k = Kernels::best();
    let dtype = Dtype::F32;
    let mut accs = tall.accumulators(dtype);
    let n = CHUNK_BYTES / dtype.size();
    let per = |b: usize| vec![vec![0.01f32; n * b]; tall.chunks];
    let (mut params, mut s1, mut s2) = (
        per(usize::from(opt.keeps_params())),
        per(opt.state_buffers().min(1)),
        per(opt.state_buffers().saturating_sub(1)),
    );
    let mut t = 0u32;
    Case::new(
        &format!("round:{}", opt.name()),
        dtype.name(),
        tall.input_bytes(),
        move || {
            t += 1;
            for (c, acc) in accs.iter_mut().enumerate() {
                let inputs = tall.chunk(c);
                k.copy(dtype, acc, &inputs[0]);
                for src in &inputs[1..] {
                    k.add(dtype, acc, src);
                }
                optim::step(
                    &opt,
                    WORKERS as u32,
                    t,
                    ChunkBufs {
                        acc,
                        params: &mut params[c],
                        s1: &mut s1[c],
                        s2: &mut s2[c],
                    },
                );
            }
            black_box(&mut params);
        },
    )
}

/// Fills `ratio_to_read` and `ratio_to_memcpy` from the baselines of the same cache case.
fn fill_ratios(records: &mut [Record]) {
    for cache in [Cache::In, Cache::Out] {
        let base = |name: &str| {
            records
                .iter()
                .find(|r| r.cache == cache.name() && r.kernel == name)
                .map_or(f64::NAN, |r| r.gbps)
        };
        let (read, memcpy) = (base("read"), base("memcpy"));
        for r in records.iter_mut().filter(|r| r.cache == cache.name()) {
            r.ratio_to_read = r.gbps / read;
            r.ratio_to_memcpy = r.gbps / memcpy;
        }
    }
}

/// Every measurement of `phub-bench kernels`.
fn kernel_records(args: &KernelsArgs) -> Vec<Record> {
    let mut records = Vec::new();
    for (cache, bytes) in [(Cache::In, args.in_kib << 10), (Cache::Out, args.out_mib << 20)] {
        let tall = Tall::new(bytes);
        eprintln!(
            "cache {}: {} chunks x {} workers x {} B = {:.1} MiB of inputs",
            cache.name(),
            tall.chunks,
            WORKERS,
            CHUNK_BYTES,
            tall.input_bytes() as f64 / (1 << 20) as f64
        );
        let mut cases = vec![read_case(&tall), memcpy_case(&tall)];
        for dtype in Dtype::ALL {
            for k in Kernels::available() {
                cases.push(tall_case(&tall, k, dtype));
            }
        }
        cases.push(final_case(&tall, false));
        cases.push(final_case(&tall, true));
        cases.push(round_case(&tall, Optimizer::Sum));
        cases.push(round_case(
            &tall,
            Optimizer::Adam {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        ));
        measure_interleaved(&mut cases, cache, args.reps);
        records.extend(cases.iter().map(|c| c.record(cache)));
    }
    fill_ratios(&mut records);
    records
}

fn print_table(records: &[Record]) {
    println!(
        "{:<8} {:<6} {:<5} {:>9} {:>9} {:>7} {:>8}",
        "kernel", "dtype", "cache", "GB/s", "median", "x read", "x memcpy"
    );
    for cache in ["in", "out"] {
        for r in records.iter().filter(|r| r.cache == cache) {
            println!(
                "{:<8} {:<6} {:<5} {:>9.2} {:>9.2} {:>7.2} {:>8.2}",
                r.kernel, r.dtype, r.cache, r.gbps, r.median_gbps, r.ratio_to_read, r.ratio_to_memcpy
            );
        }
    }
    for cache in ["in", "out"] {
        let gbps = |k: &str| {
            records
                .iter()
                .find(|r| r.cache == cache && r.kernel == k)
                .map(|r| r.gbps)
        };
        if let (Some(sum), Some(adam)) = (gbps("round:sum"), gbps("round:adam")) {
            println!(
                "cache {cache}: a round with the fused Adam pass costs {:.2}x a round with plain sum",
                sum / adam
            );
        }
    }
    println!("GB/s = 1e9 input bytes per second, best of the repetitions (median beside it);");
    println!("ratios use the best figures of the same cache case in this run.");
}

/// Metadata for the JSON report.
#[derive(Debug, Serialize)]
struct Meta<'a> {
    tool: &'static str,
    machine: Machine,
    /// Target features enabled at compile time (`cfg!(target_feature)`).
    compile_target_features: Vec<&'static str>,
    /// Features detected at runtime.
    runtime_features: Vec<&'static str>,
    kernels_available: Vec<&'static str>,
    read_pass: &'static str,
    date_unix_s: u64,
    args: &'a KernelsArgs,
    argv: Vec<String>,
    unit: &'static str,
    statistic: &'static str,
    workers: usize,
    chunk_bytes: usize,
}

fn compile_target_features() -> Vec<&'static str> {
    let mut v = Vec::new();
    macro_rules! check {
        ($($f:tt),*) => { $( if cfg!(target_feature = $f) { v.push($f); } )* };
    }
    check!("sse2", "sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "neon");
    v
}

fn runtime_features() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! check {
            ($($f:tt),*) => { $( if is_x86_feature_detected!($f) { v.push($f); } )* };
        }
        check!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512bf16",
            "avx512fp16"
        );
    }
    v
}

fn kernels_cmd(args: &KernelsArgs) -> Result<()> {
    ensure!(args.reps >= 1, "--reps must be at least 1, got {}", args.reps);
    ensure!(
        args.out_mib >= 1,
        "--out-mib must be at least 1, got {}",
        args.out_mib
    );
    ensure!(
        args.in_kib >= (WORKERS * CHUNK_BYTES) >> 10,
        "--in-kib must be at least {} (one chunk of {} workers x {} B), got {}",
        (WORKERS * CHUNK_BYTES) >> 10,
        WORKERS,
        CHUNK_BYTES,
        args.in_kib
    );
    let machine = Machine::detect();
    eprintln!(
        "machine: {} ({} logical CPUs); kernels: {}; read pass: {}",
        machine.cpu_model,
        machine.logical_cpus,
        Kernels::available()
            .iter()
            .map(|k| k.kind().name())
            .collect::<Vec<_>>()
            .join(", "),
        ReadPass::best().name()
    );
    let started = Instant::now();
    let records = kernel_records(args);
    print_table(&records);
    eprintln!("total {:.1} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let meta = Meta {
            tool: "phub-bench kernels",
            machine,
            compile_target_features: compile_target_features(),
            runtime_features: runtime_features(),
            kernels_available: Kernels::available().iter().map(|k| k.kind().name()).collect(),
            read_pass: ReadPass::best().name(),
            date_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            args,
            argv: std::env::args().collect(),
            unit: "GB/s = 1e9 bytes of gradient input per second, one core",
            statistic: "gbps = best repetition, median_gbps = median; ratios from best",
            workers: WORKERS,
            chunk_bytes: CHUNK_BYTES,
        };
        let json = serde_json::json!({ "meta": meta, "records": records });
        let text = serde_json::to_string_pretty(&json)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match &cli.command {
        Command::Kernels(args) => kernels_cmd(args),
        Command::Run(args) => run::run(args),
        Command::Sparse(args) => sparse::run(args),
        Command::Torch(args) => torch::run(args),
        Command::BenchWorker { plan } => run::worker_process(plan),
        Command::ServeDataplane { args } => local::serve_dataplane(args),
        Command::ServeControl(args) => local::serve_control(args),
        Command::ServeTcpPs { listen, workers } => phub_tools::bench::tcp_ps::serve(*listen, *workers),
    }
}
