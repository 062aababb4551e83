//! phub-rack-agent: the worker-host side of phub-hwtests. The suite starts
//! it on each worker host (`ssh HOST phub-rack-agent ...` on a lab rack,
//! `ip netns exec NS phub-rack-agent ...` on the virtual one) and reads the
//! one JSON line it prints. Install it on every worker host of a lab rack.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use phub_hwtests::agent::{self, Amount, Blast, TrainReport};
use phub_hwtests::workload::train_rank;
use phub_worker::WorkerConfig;

/// The worker-host side of phub-hwtests.
#[derive(Debug, Parser)]
#[command(name = "phub-rack-agent", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Sends PUSHes with a token nobody holds to every data port; prints
    /// `{"sent": N, "secs": S}`.
    Blast {
        /// The appliance's data address.
        #[arg(long)]
        to: String,
        /// UDP port of lcore 0.
        #[arg(long)]
        base_port: u16,
        /// Ports to send to, from base_port on.
        #[arg(long)]
        queues: u16,
        /// Payload bytes after the header.
        #[arg(long, default_value_t = 8192)]
        payload: usize,
        /// Job id sent to lcore 0's port; lcore q's port gets job + q.
        #[arg(long)]
        job: u16,
        /// Send flat out for this many seconds...
        #[arg(long, conflicts_with = "count", required_unless_present = "count")]
        secs: Option<u32>,
        /// ...or exactly this many datagrams to each port.
        #[arg(long)]
        count: Option<u64>,
        /// Pause after every 32 rounds over the ports, microseconds.
        #[arg(long, default_value_t = 0)]
        pause_us: u64,
    },
    /// Trains one rank of a sum job (phub-hwtests' workload), checking every
    /// element of every result; prints `{"rank": R, "rounds": N, "stats": {...}}`.
    Train {
        /// phub-control's URL.
        #[arg(long)]
        control: String,
        /// Job id.
        #[arg(long)]
        job: u16,
        /// Job token, hex.
        #[arg(long)]
        token: String,
        /// This worker's rank.
        #[arg(long)]
        rank: u16,
        /// Ranks in the job.
        #[arg(long)]
        workers: u16,
        /// Elements of each key, comma-separated, as in the job's spec.
        #[arg(long, value_delimiter = ',', required = true)]
        keys: Vec<u64>,
        /// Rounds to train.
        #[arg(long)]
        rounds: u32,
    },
}

fn main() -> ExitCode {
    let line = match Cli::parse().cmd {
        Cmd::Blast {
            to,
            base_port,
            queues,
            payload,
            job,
            secs,
            count,
            pause_us,
        } => {
            let amount = match (secs, count) {
                (Some(s), _) => Amount::Secs(s),
                (None, Some(n)) => Amount::PerPort(n),
                (None, None) => unreachable!("clap requires --secs or --count"),
            };
            let b = Blast {
                to,
                base_port,
                queues,
                payload,
                job,
                amount,
                pause_us,
            };
            match agent::blast(&b) {
                Ok(r) => serde_json::to_string(&r),
                Err(e) => {
                    eprintln!("phub-rack-agent blast: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        Cmd::Train {
            control,
            job,
            token,
            rank,
            workers,
            keys,
            rounds,
        } => {
            let Ok(token) = u64::from_str_radix(&token, 16) else {
                eprintln!("phub-rack-agent train: --token {token:?}: expected up to 16 hex digits");
                return ExitCode::FAILURE;
            };
            // Every element of every result is checked (panics on the first
            // wrong one, naming it).
            let cfg = WorkerConfig::default();
            let (done, stats) = train_rank(&control, job, token, rank, workers, &keys, cfg, |r| r <= rounds);
            serde_json::to_string(&TrainReport {
                rank,
                rounds: done,
                stats,
            })
        }
    };
    println!("{}", line.expect("a report serializes"));
    ExitCode::SUCCESS
}
