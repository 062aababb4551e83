//! Workloads the suites drive: sum jobs trained by real workers (the
//! phub-worker library) with every element checked, and floods of bad input.

use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use phub_http::Client;
use phub_proto::api::AdmitResponse;
use phub_proto::routes::control;
use phub_proto::spec::{JobSpec, Optimizer};
use phub_worker::{Worker, WorkerConfig, WorkerStats};

/// A sum job's spec with these keys.
pub fn sum_spec(name: &str, workers: u16, chunk_bytes: Option<u32>, keys: &[u64]) -> String {
    let spec = JobSpec::new(name, u32::from(workers), keys);
    match chunk_bytes {
        Some(c) => spec.with_chunk_bytes(c),
        None => spec,
    }
    .to_toml()
}

/// Small-integer gradient: sums are exact in f32 in any order.
pub fn grad(rank: u16, key: u32, elem: usize, round: u32) -> f32 {
    ((elem as u32 % 7) * (u32::from(rank) + 1) + round % 5 + key % 3) as f32 - 6.0
}

/// Rank 0's initial value of an element.
pub fn init(key: u32, elem: usize) -> f32 {
    (elem % 1000) as f32 * 0.5 + key as f32
}

/// An element after `round` of a sum job.
pub fn expected(workers: u16, key: u32, elem: usize, round: u32) -> f32 {
    if round == 0 {
        init(key, elem)
    } else {
        (0..workers).map(|r| grad(r, key, elem, round)).sum()
    }
}

/// An SGD job's spec (learning rate [`SGD_LR`]) with these keys.
pub fn sgd_spec(name: &str, workers: u16, keys: &[u64]) -> String {
    JobSpec::new(name, u32::from(workers), keys)
        .with_optimizer(Optimizer::Sgd {
            lr: SGD_LR,
            weight_decay: 0.0,
        })
        .to_toml()
}

/// The learning rate of [`sgd_spec`]: a power of two, so `lr * mean` is
/// exact.
pub const SGD_LR: f32 = 0.125;

/// Rank 0's initial values of a key of `n` elements.
pub fn init_values(key: u32, n: u64) -> Vec<f32> {
    (0..n as usize).map(|e| init(key, e)).collect()
}

/// What SGD on the appliance makes of `rounds` rounds of [`grad`] from
/// `workers` ranks (mean gradient, summed in any order exactly), starting
/// from `init`: the reference a run with faults must equal bit for bit.
pub fn sgd_reference(workers: u16, key: u32, init: &[f32], rounds: u32) -> Vec<f32> {
    let mut w = init.to_vec();
    for r in 1..=rounds {
        for (e, v) in w.iter_mut().enumerate() {
            let sum: f32 = (0..workers).map(|rank| grad(rank, key, e, r)).sum();
            *v -= SGD_LR * (sum * (1.0 / f32::from(workers)));
        }
    }
    w
}

/// The client of the server at `url` (phub-control, a dataplane's
/// management API), sending `token` when given; panics on a TLS setting it
/// cannot use.
pub fn client(url: &str, token: Option<&str>) -> Client {
    Client::plain(url)
        .unwrap_or_else(|e| panic!("a client of {url}: {e}"))
        .with_token(token.map(str::to_string))
}

/// Admits a job through phub-control, with the operator token when control
/// has one; panics with control's answer if it refuses.
pub fn admit(url: &str, operator_token: Option<&str>, spec: &str) -> AdmitResponse {
    client(url, operator_token)
        .send(&control::admit(spec))
        .unwrap_or_else(|e| panic!("admitting at {url}: {e}"))
}

/// A PARTIAL (PROTOCOL.md §9.2) forged by someone who holds only
/// hierarchical job `job`'s token, as a worker does: rack 0's partial of
/// round 0, every element `value` in place of rank 0's initial values, for
/// the first chunk whose home slot is on appliance `appliance`. Returns the
/// UDP port of that home lcore and the datagram. The home is read from
/// control's map of the job (`GET /v1/jobs/{id}/map`: a hierarchical job's
/// layout is its home layout) and the chunk from its keys' maps.
pub fn forged_partial(url: &str, job: &AdmitResponse, appliance: &str, value: f32) -> (u16, Vec<u8>) {
    use phub_proto::api::JobMap;
    use phub_proto::wire::{MsgType, Repr};
    let control = client(url, None);
    let get = |key: Option<u32>| -> JobMap {
        control
            .send(&control::map(job.id, key))
            .unwrap_or_else(|e| panic!("the map of job {}: {e}", job.id))
    };
    let map = get(None);
    let home = map
        .lcores
        .iter()
        .find(|l| l.appliance == appliance && l.slots > 0)
        .unwrap_or_else(|| {
            panic!(
                "appliance {appliance} is home to no chunk of job {}: {map:?}",
                job.id
            )
        });
    for k in 0..map.keys_total {
        let key = get(Some(key_index(k))).keys.remove(0);
        let Some(run) = key
            .runs
            .iter()
            .find(|r| r.appliance == appliance && r.lcore == home.lcore && r.slot == 0)
        else {
            continue;
        };
        let elems = (key.elements - u64::from(run.chunk) * u64::from(map.chunk_elems))
            .min(u64::from(map.chunk_elems));
        let values = vec![value; elems as usize];
        // Cast: a chunk's elements fit one datagram (JobSpec::validate).
        #[allow(clippy::cast_possible_truncation)]
        let repr = Repr::request(MsgType::Partial, job.id, job.token, 0, 0, 0)
            .with_payload(phub_proto::Dtype::F32, elems as u16)
            .with_chunk(key.key, run.chunk);
        return (home.port, repr.to_datagram(&values));
    }
    panic!(
        "no key of job {} has a chunk in home slot 0 of {appliance}'s lcore {}",
        job.id, home.lcore
    )
}

/// Key `k` of a map's `keys_total` as the map's route names it.
pub fn key_index(k: u64) -> u32 {
    u32::try_from(k).expect("key indices are u32 on the wire")
}

/// Runs `workers` worker threads through `rounds` rounds of a sum job
/// over `keys`, checking every element of every result exactly.
pub fn train(url: &str, job: &AdmitResponse, workers: u16, keys: &[u64], rounds: u32) {
    std::thread::scope(|s| {
        for rank in 0..workers {
            s.spawn(move || {
                let cfg = WorkerConfig::default();
                train_rank(url, job.id, job.token, rank, workers, keys, cfg, |r| r <= rounds)
            });
        }
    });
}

/// One round of every key: `grads[k]` pushed, the result into
/// `params[k]`, all sent before any is waited for; each key's outcome.
pub fn push_pull_keys(
    w: &Worker,
    params: &mut [Vec<f32>],
    grads: &[Vec<f32>],
) -> Vec<Result<(), phub_worker::WorkerError>> {
    let hs: Vec<_> = params
        .iter_mut()
        .zip(grads)
        .enumerate()
        .map(|(k, (p, g))| w.push_pull(k as u32, g, p).unwrap())
        .collect();
    hs.into_iter().map(|h| w.wait(h)).collect()
}

/// Every element of `params` is round `round`'s sum of `workers` ranks
/// ([`expected`]); `who` names the rank in a failure.
pub fn assert_round(workers: u16, params: &[Vec<f32>], round: u32, who: &str) {
    for (k, p) in params.iter().enumerate() {
        for (e, v) in p.iter().enumerate() {
            assert_eq!(
                *v,
                expected(workers, k as u32, e, round),
                "{who} round {round} key {k} elem {e}"
            );
        }
    }
}

/// Rank `rank`'s gradients of `keys` in round `round`.
pub fn round_grads(rank: u16, keys: &[u64], round: u32) -> Vec<Vec<f32>> {
    keys.iter()
        .enumerate()
        .map(|(k, &n)| (0..n as usize).map(|e| grad(rank, k as u32, e, round)).collect())
        .collect()
}

/// Rank `rank`'s buffers of `keys` before its INITs: rank 0's initial
/// values, -1 elsewhere (what the appliance's answers overwrite).
pub fn initial_params(rank: u16, keys: &[u64]) -> Vec<Vec<f32>> {
    keys.iter()
        .enumerate()
        .map(|(k, &n)| {
            (0..n as usize)
                .map(|e| if rank == 0 { init(k as u32, e) } else { -1.0 })
                .collect()
        })
        .collect()
}

/// One rank of a sum job of `workers` ranks over `keys`: joins, sends its
/// initial values (rank 0's from [`init`]; the others' are overwritten by
/// them) and checks they came back as rank 0's, then trains round after
/// round while `more(round)` says so, checking every element of every
/// result exactly (panics, naming rank, round, key and element, on the
/// first wrong one). Every rank must stop at the same round. Returns the
/// rounds done and the worker's counters.
#[allow(clippy::too_many_arguments)]
pub fn train_rank(
    url: &str,
    job: u16,
    token: u64,
    rank: u16,
    workers: u16,
    keys: &[u64],
    cfg: WorkerConfig,
    mut more: impl FnMut(u32) -> bool,
) -> (u32, WorkerStats) {
    let w = Worker::join_with(url, job, token, rank, cfg)
        .unwrap_or_else(|e| panic!("rank {rank} joining job {job} at {url}: {e}"));
    let mut params = init_keys(&w, rank, keys);
    let mut round = 0;
    loop {
        if round > 0 {
            let grads = round_grads(rank, keys, round);
            for r in push_pull_keys(&w, &mut params, &grads) {
                r.unwrap_or_else(|e| panic!("rank {rank} round {round} of job {job}: {e}"));
            }
        }
        assert_round(workers, &params, round, &format!("job {job} rank {rank}"));
        if !more(round + 1) {
            return (round, w.stats());
        }
        round += 1;
    }
}

/// Round 0 of rank `rank` on `keys`: every key's INIT (rank 0's values
/// [`initial_params`]), each answered; the values it holds after.
pub fn init_keys(w: &Worker, rank: u16, keys: &[u64]) -> Vec<Vec<f32>> {
    let mut params = initial_params(rank, keys);
    let hs: Vec<_> = params
        .iter_mut()
        .enumerate()
        .map(|(k, p)| w.init(k as u32, p).unwrap())
        .collect();
    for h in hs {
        w.wait(h).unwrap();
    }
    params
}

/// Random, truncated and wrong-token datagrams at every data port of the
/// appliance at `ip` until `stop`; returns how many were sent.
pub fn flood(stop: &AtomicBool, ip: &str, base_port: u16, lcores: u16) -> u64 {
    let s = UdpSocket::bind("0.0.0.0:0").unwrap();
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut sent = 0u64;
    let mut buf = [0u8; 1200];
    let mut h = phub_proto::wire::Repr::request(phub_proto::wire::MsgType::Push, 1, 0, 0, 1, 0);
    while !stop.load(Ordering::Relaxed) {
        for b in buf.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let len = (x % 1200) as usize;
        let to = (ip, base_port + (sent % u64::from(lcores)) as u16);
        match sent % 3 {
            0 => s.send_to(&buf[..len], to).unwrap(),
            1 => s.send_to(&buf[..len.min(40)], to).unwrap(),
            _ => {
                h.token = x;
                s.send_to(&h.to_bytes(), to).unwrap()
            }
        };
        sent += 1;
        if sent.is_multiple_of(32) {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    sent
}
