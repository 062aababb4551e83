//! The simulator's soak: random jobs from a range of seeds, on every core
//! or `--threads N`, until all ran; prints the figures (seeds, steps,
//! virtual and wall time, datagrams) and every seed that failed, with the
//! command that replays it. `cargo run --release -p phub-sim --example
//! soak -- --seeds 10000 [--from 0] [--threads 2] [--replicated]`
//! (`--replicated`: only the seeds whose job is replicated); exits 1 if a
//! seed failed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

fn main() {
    let mut seeds = 10_000u64;
    let mut from = 0u64;
    let mut threads = std::thread::available_parallelism().map_or(1, usize::from);
    let mut only_replicated = false;
    let mut args = std::env::args().skip(1).peekable();
    while let Some(flag) = args.next() {
        if flag == "--replicated" {
            only_replicated = true;
            continue;
        }
        let value = args.next().and_then(|v| v.parse::<u64>().ok());
        match (flag.as_str(), value) {
            ("--seeds", Some(v)) => seeds = v,
            ("--from", Some(v)) => from = v,
            ("--threads", Some(v)) if v > 0 => threads = usize::try_from(v).unwrap_or(1),
            _ => {
                eprintln!(
                    "usage: soak [--seeds N (10000)] [--from FIRST (0)] [--threads N (every core)] [--replicated]; \
                     got {flag}"
                );
                std::process::exit(2);
            }
        }
    }
    // Failing seeds print their own panic; the summary names them.
    let next = AtomicU64::new(from);
    let skipped = AtomicU64::new(0);
    // (totals, failed seeds, seeds with tables, replicated seeds, of them
    // async or bounded delay)
    let totals = Mutex::new((
        phub_sim::Outcome::default(),
        Vec::<u64>::new(),
        0u64,
        0u64,
        0u64,
        0u64,
    ));
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= from + seeds {
                    break;
                }
                let case = phub_sim::Case::draw(seed);
                if only_replicated && case.replication.is_none() {
                    skipped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let run = std::panic::catch_unwind(|| phub_sim::run(&case));
                let mut t = totals.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                match run {
                    Ok(o) => {
                        t.0.steps += o.steps;
                        t.0.virtual_us += o.virtual_us;
                        t.0.net.sent += o.net.sent;
                        t.0.net.lost += o.net.lost;
                        t.0.retransmits += o.retransmits;
                        t.0.restored += o.restored;
                        t.0.lcores_found_behind += o.lcores_found_behind;
                        t.0.rejoined += o.rejoined;
                        t.0.tables_caught_up += o.tables_caught_up;
                        t.0.table_pushes += o.table_pushes;
                        t.0.table_pulls += o.table_pulls;
                        t.0.rows_checked += o.rows_checked;
                        t.0.rows.created += o.rows.created;
                        t.0.rows.created_early += o.rows.created_early;
                        t.0.rows.not_admitted += o.rows.not_admitted;
                        t.0.rows.evicted += o.rows.evicted;
                        t.0.rows.evicted_at_cap += o.rows.evicted_at_cap;
                        t.0.lists_named += o.lists_named;
                        t.0.stream_slices_served_between += o.stream_slices_served_between;
                        if !case.tables.is_empty() {
                            t.2 += 1;
                        }
                        if case.replication.is_some() {
                            t.3 += 1;
                            t.0.replica_kills += o.replica_kills;
                            t.0.epochs += o.epochs;
                            t.0.returns += o.returns;
                            t.0.drains += o.drains;
                            t.0.full_strength += o.full_strength;
                            t.0.backups_checked += o.backups_checked;
                            t.0.tables_adopted += o.tables_adopted;
                            t.0.table_backups_checked += o.table_backups_checked;
                            t.0.table_copies += o.table_copies;
                            t.0.control_restarts += o.control_restarts;
                            t.0.updates_replicated += o.updates_replicated;
                            if case.consistency != phub_proto::spec::Consistency::Sync {
                                t.4 += 1;
                            }
                            if case.racks >= 2 {
                                t.5 += 1;
                            }
                            t.0.replaced += o.replaced;
                            t.0.jobs_failed += o.jobs_failed;
                            t.0.stalls += o.stalls;
                            t.0.ranks_stopped += o.ranks_stopped;
                        }
                    }
                    Err(_) => t.1.push(seed),
                }
            });
        }
    });
    let wall = start.elapsed();
    let (o, mut failed, with_tables, replicated, clocked, hierarchical) = totals
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    failed.sort_unstable();
    println!(
        "seeds {from}..{}: {} passed, {} failed, {} skipped; {} steps, {:.1} s of virtual time, {} datagrams sent \
         ({} lost, {} chunks sent again), {} restores ({} times a stalled rank's PULL found one), {} rejoins; {with_tables} passed seeds with tables: \
         {} rejoined ranks caught their tables up, {} table pushes ({} pulls of their ids before them), {} rows checked, {} rows created ({} before their admit_after-th push, {} pushes not admitted), {} evicted idle, {} evicted at the cap, {} cached id lists named, {} table checkpoint slices streamed with traffic between them; {replicated} passed replicated seeds: {} kills, {} epochs, \
         {} returns, {} drains, {} dead ones replaced, {} back to full strength, {} control restarts, {hierarchical} hierarchical, {} async or bounded-delay ({} updates applied on backups), {} backups checked, {} table entries adopted, {} table copies installed, {} backup tables checked, {} jobs failed (a part lost; {} ranks stopped), {} stalled and gone back to their checkpoints; {:.1} s wall \
         on {threads} threads",
        from + seeds,
        seeds - failed.len() as u64 - skipped.load(Ordering::Relaxed),
        failed.len(),
        skipped.load(Ordering::Relaxed),
        o.steps,
        o.virtual_us as f64 / 1e6,
        o.net.sent,
        o.net.lost,
        o.retransmits,
        o.restored,
        o.lcores_found_behind,
        o.rejoined,
        o.tables_caught_up,
        o.table_pushes,
        o.table_pulls,
        o.rows_checked,
        o.rows.created + o.rows.created_early,
        o.rows.created_early,
        o.rows.not_admitted,
        o.rows.evicted,
        o.rows.evicted_at_cap,
        o.lists_named,
        o.stream_slices_served_between,
        o.replica_kills,
        o.epochs,
        o.returns,
        o.drains,
        o.replaced,
        o.full_strength,
        o.control_restarts,
        clocked,
        o.updates_replicated,
        o.backups_checked,
        o.tables_adopted,
        o.table_copies,
        o.table_backups_checked,
        o.jobs_failed,
        o.ranks_stopped,
        o.stalls,
        wall.as_secs_f64()
    );
    for seed in &failed {
        println!("failed: seed {seed}: PHUB_SIM_SEED={seed} cargo test -p phub-sim --test seeds random_jobs");
    }
    if !failed.is_empty() {
        std::process::exit(1);
    }
}
