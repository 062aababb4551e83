//! One emulated training worker: joins the job, initialises every key
//! (round 0), then each round pushes the whole model's gradients in layer
//! order with `push_pull` on every key, all keys in flight at once as a
//! training step would have them, and waits for every result.
//!
//! Gradients are small integers, so sums are exact in f32 in any order and
//! `--verify` checks every element of every result against the closed form
//! of the sum over ranks: element e of key k gets
//! `p(k, e) * (rank + 1) + round % 5 - 8` from each rank, where
//! `p(k, e) = (31 e + 17 k) mod 13`; the sum over W ranks is
//! `p * W (W + 1) / 2 + W (round % 5 - 8)`. Consecutive rounds differ, so a
//! stale result fails, and a chunk placed at the wrong offset or key fails
//! too (the pattern's period, 13, divides no chunk size).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use phub_worker::{ShmMode, Worker, WorkerConfig, WorkerStats};
use serde::{Deserialize, Serialize};

use crate::profiles::Profile;
use crate::sys::cpu_seconds;

/// What one worker does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    /// phub-control's URL.
    pub control_url: String,
    /// Job id.
    pub job: u16,
    /// Job token.
    pub token: u64,
    /// This worker's rank.
    pub rank: u16,
    /// Model name (a [`crate::profiles`] name).
    pub model: String,
    /// Untimed rounds before the timed ones.
    pub warmup: u32,
    /// Timed rounds.
    pub rounds: u32,
    /// Check every result.
    pub verify: bool,
    /// Window override (chunks); `None`: the worker library's default.
    pub window: Option<usize>,
    /// Use `Worker::exchange` (buffers lent) rather than handles (copies).
    pub exchange: bool,
    /// UDP GSO sends.
    pub gso: bool,
    /// UDP GRO receives.
    pub gro: bool,
    /// Fault injection in the worker's transport (a
    /// [`phub_worker::FaultSpec`], e.g. `loss=0.05,seed=3`); `None`: off.
    #[serde(default)]
    pub inject: Option<String>,
    /// Exchange through shared memory with the dataplane on this host
    /// ([`phub_worker::ShmMode::On`]: the join fails without it); `false`:
    /// datagrams ([`phub_worker::ShmMode::Off`]).
    #[serde(default)]
    pub shm: bool,
    /// Emulated compute before each round's exchange, ms (0: none).
    #[serde(default)]
    pub compute_ms: f64,
    /// Mean of an exponential jitter added to each round's compute, ms
    /// (0: none); drawn from a generator seeded by the rank.
    #[serde(default)]
    pub jitter_exp_ms: f64,
    /// This rank's compute (and jitter) is multiplied by this (1: as the
    /// others; `--slow-rank0 2` makes rank 0 a persistent straggler).
    #[serde(default = "one")]
    pub compute_factor: f64,
    /// Occasional slow rounds (`--spike p=P,x=X`); `None`: none.
    #[serde(default)]
    pub spike: Option<Spike>,
    /// The rack this worker says at join (`WorkerConfig::rack`; the
    /// virtual racks' label of its rack); `None`: not said.
    #[serde(default)]
    pub rack: Option<String>,
}

/// `--spike p=P,x=X`: with probability `p` a round's compute (jitter
/// included) takes `x` times as long.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spike {
    /// Probability that a round spikes, 0 to 1.
    pub p: f64,
    /// How many times as long a spiked round's compute takes, at least 1.
    pub x: f64,
}

impl std::str::FromStr for Spike {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (mut p, mut x) = (None, None);
        for part in s.split(',') {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: expected KEY=VALUE (p=P,x=X)"))?;
            let slot = match k.trim() {
                "p" => &mut p,
                "x" => &mut x,
                other => return Err(format!("unknown key {other:?}: accepted: p, x")),
            };
            if slot.is_some() {
                return Err(format!("{k} given twice"));
            }
            let n: f64 = v.trim().parse().map_err(|_| format!("{k}={v:?}: not a number"))?;
            *slot = Some(n);
        }
        let p = p.ok_or("p missing: expected p=P,x=X")?;
        let x = x.ok_or("x missing: expected p=P,x=X")?;
        if !(0.0..=1.0).contains(&p) {
            return Err(format!("p={p}: a probability, from 0 to 1"));
        }
        if !(x >= 1.0 && x.is_finite()) {
            return Err(format!("x={x}: a factor, at least 1"));
        }
        Ok(Spike { p, x })
    }
}

impl std::fmt::Display for Spike {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "p={},x={}", self.p, self.x)
    }
}

fn one() -> f64 {
    1.0
}

/// A uniform draw in (0, 1) from the xorshift generator `state`.
fn uniform(state: &mut u64) -> f64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    ((*state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Emulated compute of one round: `compute_ms` plus an exponential draw of
/// mean `jitter_exp_ms`, times `x` with probability `p` (`spike`), times
/// `factor`; `state` is a xorshift generator.
fn compute_time(plan: &Plan, state: &mut u64) -> std::time::Duration {
    Compute {
        ms: plan.compute_ms,
        jitter_exp_ms: plan.jitter_exp_ms,
        spike: plan.spike,
        factor: plan.compute_factor,
    }
    .draw(state)
}

/// An emulated training step's compute (`phub-bench run` and `phub-demo`
/// sleep it before each exchange).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Compute {
    /// Fixed part, ms.
    pub ms: f64,
    /// Mean of an exponential jitter added to it, ms (0: none).
    pub jitter_exp_ms: f64,
    /// Occasional slow steps.
    pub spike: Option<Spike>,
    /// The whole multiplied by this (a persistent straggler: 2).
    pub factor: f64,
}

impl Compute {
    /// One step's compute; `state` is a xorshift generator (non-zero).
    pub fn draw(&self, state: &mut u64) -> std::time::Duration {
        let mut ms = self.ms;
        if self.jitter_exp_ms > 0.0 {
            ms += -self.jitter_exp_ms * uniform(state).ln();
        }
        if let Some(s) = self.spike {
            if uniform(state) < s.p {
                ms *= s.x;
            }
        }
        std::time::Duration::from_secs_f64((ms * self.factor).max(0.0) / 1e3)
    }

    /// A generator state for `rank`, different per rank, never zero.
    pub fn seed(rank: u16) -> u64 {
        0x9e37_79b9_7f4a_7c15_u64 ^ (u64::from(rank) + 1).wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// `exp:M`: an exponential jitter of mean M ms.
pub fn parse_exp_jitter(s: &str) -> Result<f64, String> {
    match s.strip_prefix("exp:").map(str::parse::<f64>) {
        Some(Ok(m)) if m >= 0.0 && m.is_finite() => Ok(m),
        _ => Err(format!("{s:?}: expected exp:M, M the mean in ms")),
    }
}

/// Progress reported while running.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Event {
    /// Joined and initialised; warm-up done; waiting for the start signal.
    Ready,
    /// A round finished (warm-up rounds included, `timed` says which).
    Round {
        /// Round number (1-based; warm-up rounds come first).
        round: u32,
        /// Whether this round is one of the timed ones.
        timed: bool,
        /// Milliseconds from the first push_pull to the last result.
        ms: f64,
    },
}

/// What one worker measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    /// Rank.
    pub rank: u16,
    /// Exchange time of each timed round, ms.
    pub round_ms: Vec<f64>,
    /// Seconds from the start signal to the end of the last timed round.
    pub timed_secs: f64,
    /// `Some(true)` if every checked element was exact, `None` when not asked.
    pub verified: Option<bool>,
    /// Elements that differed from the reference.
    pub mismatches: u64,
    /// The first difference, described.
    pub first_mismatch: Option<String>,
    /// Rounds (0: the initial values) in which some element differed, in
    /// order (`--verify`; empty when every round was exact).
    #[serde(default)]
    pub mismatched_rounds: Vec<u32>,
    /// The worker library's counters at the end.
    pub stats: WorkerStats,
    /// The window the worker used (chunks).
    pub window: usize,
    /// CPU seconds of this process over the timed rounds (meaningful when
    /// the worker is a process of its own).
    pub cpu_s: Option<f64>,
}

/// The pattern p(k, e) for e in 0..n, written into `out` by `f(p)`.
fn fill(key: u32, out: &mut [f32], f: impl Fn(u32) -> f32) {
    let mut p = (17 * (key % 13)) % 13;
    for x in out.iter_mut() {
        *x = f(p);
        p += 31 % 13;
        if p >= 13 {
            p -= 13;
        }
    }
}

/// Rank 0's initial value of element e of key k.
fn init_value(key: u32, p: u32) -> f32 {
    (p + key % 7) as f32
}

fn round_term(round: u32) -> f32 {
    (round % 5) as f32 - 8.0
}

/// Counts differences of `got` from `want(p)`; remembers the first.
fn check(
    key: u32,
    round: u32,
    got: &[f32],
    want: impl Fn(u32) -> f32,
    mismatches: &mut u64,
    first: &mut Option<String>,
) {
    let mut p = (17 * (key % 13)) % 13;
    for (e, &g) in got.iter().enumerate() {
        let w = want(p);
        if g != w {
            *mismatches += 1;
            if first.is_none() {
                *first = Some(format!(
                    "round {round}, key {key}, element {e}: got {g}, expected {w}"
                ));
            }
        }
        p += 31 % 13;
        if p >= 13 {
            p -= 13;
        }
    }
}

/// Runs `plan`: join, init, warm-up, [`Event::Ready`], `go()` (blocks until
/// every worker is ready; `false` aborts), timed rounds.
pub fn run(
    plan: &Plan,
    profile: &Profile,
    mut on_event: impl FnMut(Event),
    go: impl FnOnce() -> bool,
) -> Result<Outcome> {
    let mut config = WorkerConfig {
        gso: plan.gso,
        gro: plan.gro,
        shm: if plan.shm { ShmMode::On } else { ShmMode::Off },
        rack: plan.rack.clone(),
        ..WorkerConfig::default()
    };
    if let Some(w) = plan.window {
        config.window = w;
    }
    if let Some(spec) = &plan.inject {
        let spec: phub_worker::FaultSpec = spec
            .parse()
            .map_err(|e: String| anyhow::anyhow!("rank {}: --inject {spec:?}: {e}", plan.rank))?;
        config.inject = Some(spec);
    }
    let w = Worker::join_with(&plan.control_url, plan.job, plan.token, plan.rank, config)
        .with_context(|| format!("rank {} joining job {}", plan.rank, plan.job))?;
    let window = w.window();
    let workers = w.workers();
    let mut params: Vec<Vec<f32>> = profile
        .tensors
        .iter()
        .enumerate()
        .map(|(k, t)| {
            let mut v = vec![0f32; t.elements as usize];
            fill(k as u32, &mut v, |p| init_value(k as u32, p));
            v
        })
        .collect();
    let (mut mismatches, mut first) = (0u64, None);
    {
        let hs = params
            .iter_mut()
            .enumerate()
            .map(|(k, p)| w.init(k as u32, p))
            .collect::<Result<Vec<_>, _>>()?;
        for h in hs {
            w.wait(h)?;
        }
    }
    let mut mismatched_rounds = Vec::new();
    if plan.verify {
        for (k, p) in params.iter().enumerate() {
            let k = k as u32;
            check(k, 0, p, |p| init_value(k, p), &mut mismatches, &mut first);
        }
        if mismatches > 0 {
            mismatched_rounds.push(0);
        }
    }
    let factor = (plan.rank as f32) + 1.0;
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0f32; p.len()]).collect();
    let fill_grads = |grads: &mut Vec<Vec<f32>>, round: u32| {
        for (k, g) in grads.iter_mut().enumerate() {
            fill(k as u32, g, |p| p as f32 * factor + round_term(round));
        }
    };
    fill_grads(&mut grads, 1);
    let sum_w = (workers * (workers + 1) / 2) as f32;
    let total = plan.warmup + plan.rounds;
    let mut round_ms = Vec::with_capacity(plan.rounds as usize);
    let mut rng = Compute::seed(plan.rank);
    let mut go = Some(go);
    let mut timed_start = Instant::now();
    let mut cpu0 = None;
    let mut start = |on_event: &mut dyn FnMut(Event)| -> Result<()> {
        on_event(Event::Ready);
        if let Some(g) = go.take() {
            if !g() {
                bail!("rank {}: aborted before the timed rounds", plan.rank);
            }
        }
        Ok(())
    };
    for round in 1..=total {
        let timed = round > plan.warmup;
        if timed && round == plan.warmup + 1 {
            start(&mut on_event)?;
            cpu0 = cpu_seconds(std::process::id());
            timed_start = Instant::now();
        }
        if plan.verify && round > 1 {
            fill_grads(&mut grads, round);
        }
        // The training step's compute, before its gradients are exchanged.
        let compute = compute_time(plan, &mut rng);
        if !compute.is_zero() {
            std::thread::sleep(compute);
        }
        let t = Instant::now();
        if plan.exchange {
            w.exchange(|x| {
                for (k, (p, g)) in params.iter_mut().zip(&grads).enumerate() {
                    x.push_pull(k as u32, g, p)?;
                }
                Ok::<(), phub_worker::WorkerError>(())
            })
            .and_then(|r| r)
            .with_context(|| format!("rank {} round {round}: exchange", plan.rank))?;
        } else {
            let hs = params
                .iter_mut()
                .zip(&grads)
                .enumerate()
                .map(|(k, (p, g))| w.push_pull(k as u32, g, p))
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("rank {} round {round}: push_pull", plan.rank))?;
            for h in hs {
                let key = h.key();
                w.wait(h)
                    .with_context(|| format!("rank {} round {round} key {key}", plan.rank))?;
            }
        }
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if timed {
            round_ms.push(ms);
        }
        if plan.verify {
            let before = mismatches;
            let c = workers as f32 * round_term(round);
            for (k, p) in params.iter().enumerate() {
                check(
                    k as u32,
                    round,
                    p,
                    |p| p as f32 * sum_w + c,
                    &mut mismatches,
                    &mut first,
                );
            }
            if mismatches > before {
                mismatched_rounds.push(round);
            }
        }
        on_event(Event::Round { round, timed, ms });
    }
    if plan.rounds == 0 {
        // No timed rounds: still take part in the start barrier.
        start(&mut on_event)?;
        cpu0 = cpu_seconds(std::process::id());
        timed_start = Instant::now();
    }
    let timed_secs = timed_start.elapsed().as_secs_f64();
    let cpu_s = cpu0.zip(cpu_seconds(std::process::id())).map(|(a, b)| b - a);
    let stats = w.stats();
    drop(w);
    Ok(Outcome {
        rank: plan.rank,
        round_ms,
        timed_secs,
        verified: plan.verify.then_some(mismatches == 0),
        mismatches,
        first_mismatch: first,
        mismatched_rounds,
        stats,
        window,
        cpu_s,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn compute_time_has_the_asked_mean_and_factor() {
        let mut plan: Plan = serde_json::from_value(serde_json::json!({
            "control_url": "http://x", "job": 1, "token": 1, "rank": 0, "model": "m",
            "warmup": 0, "rounds": 1, "verify": false, "window": null, "exchange": true,
            "gso": true, "gro": true, "compute_ms": 10.0, "jitter_exp_ms": 5.0
        }))
        .unwrap();
        assert_eq!(plan.compute_factor, 1.0, "an older plan without the field");
        let mut state = 7u64;
        let n = 20_000;
        let mean: f64 = (0..n)
            .map(|_| compute_time(&plan, &mut state).as_secs_f64() * 1e3)
            .sum::<f64>()
            / n as f64;
        assert!((mean - 15.0).abs() < 0.3, "mean {mean} ms, expected 15");
        plan.compute_factor = 2.0;
        plan.jitter_exp_ms = 0.0;
        assert_eq!(
            compute_time(&plan, &mut state),
            std::time::Duration::from_millis(20)
        );
    }

    use super::*;

    #[test]
    fn spike_parses_and_names_the_problem() {
        assert_eq!("p=0.1,x=5".parse::<Spike>().unwrap(), Spike { p: 0.1, x: 5.0 });
        assert_eq!(" x = 2 , p=1".parse::<Spike>().unwrap(), Spike { p: 1.0, x: 2.0 });
        assert_eq!(Spike { p: 0.1, x: 5.0 }.to_string(), "p=0.1,x=5");
        let err = |s: &str| s.parse::<Spike>().unwrap_err();
        assert!(err("p=0.1").contains("x missing"), "{}", err("p=0.1"));
        assert!(err("x=5").contains("p missing"));
        assert!(err("p=1.5,x=5").contains("p=1.5"));
        assert!(err("p=0.1,x=0.5").contains("at least 1"));
        assert!(err("p=0.1,x=inf").contains("at least 1"));
        assert!(err("p=0.1,x=five").contains("not a number"));
        assert!(err("p=0.1,x=5,y=2").contains("unknown key \"y\""));
        assert!(err("p=0.1,p=0.2,x=5").contains("twice"));
        assert!(err("0.1,5").contains("KEY=VALUE"));
        assert!(err("").contains("KEY=VALUE"));
    }

    #[test]
    fn spike_multiplies_about_p_of_the_rounds() {
        let mut plan: Plan = serde_json::from_value(serde_json::json!({
            "control_url": "http://x", "job": 1, "token": 1, "rank": 0, "model": "m",
            "warmup": 0, "rounds": 1, "verify": false, "window": null, "exchange": true,
            "gso": true, "gro": true, "compute_ms": 10.0
        }))
        .unwrap();
        assert_eq!(plan.spike, None, "an older plan without the field");
        plan.spike = Some(Spike { p: 0.1, x: 5.0 });
        let mut state = 11u64;
        let n = 20_000;
        let times: Vec<f64> = (0..n)
            .map(|_| compute_time(&plan, &mut state).as_secs_f64() * 1e3)
            .collect();
        let spiked = times.iter().filter(|&&t| (t - 50.0).abs() < 1e-6).count();
        let plain = times.iter().filter(|&&t| (t - 10.0).abs() < 1e-6).count();
        assert_eq!(spiked + plain, n, "every round 10 ms or 50 ms");
        let share = spiked as f64 / n as f64;
        assert!((share - 0.1).abs() < 0.01, "{share} of the rounds spiked");
    }

    #[test]
    fn pattern_and_closed_form_sum() {
        let mut a = vec![0f32; 40];
        fill(3, &mut a, |p| p as f32);
        for (e, x) in a.iter().enumerate() {
            assert_eq!(*x as usize, (31 * e + 17 * 3) % 13);
        }
        // Sum over ranks of p (r + 1) + c equals p W (W + 1) / 2 + W c.
        let (w, round) = (4u32, 7u32);
        let mut want = vec![0f32; 40];
        let sum_w = (w * (w + 1) / 2) as f32;
        fill(3, &mut want, |p| p as f32 * sum_w + w as f32 * round_term(round));
        let mut got = vec![0f32; 40];
        for r in 0..w {
            let mut g = vec![0f32; 40];
            fill(3, &mut g, |p| p as f32 * (r as f32 + 1.0) + round_term(round));
            for (s, x) in got.iter_mut().zip(&g) {
                *s += x;
            }
        }
        assert_eq!(got, want);
        let (mut n, mut first) = (0, None);
        check(
            3,
            round,
            &got,
            |p| p as f32 * sum_w + w as f32 * round_term(round),
            &mut n,
            &mut first,
        );
        assert_eq!(n, 0);
        got[5] += 1.0;
        check(
            3,
            round,
            &got,
            |p| p as f32 * sum_w + w as f32 * round_term(round),
            &mut n,
            &mut first,
        );
        assert_eq!(n, 1);
        assert!(first.unwrap().contains("element 5"));
    }
}
