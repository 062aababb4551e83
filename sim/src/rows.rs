//! Table keys in the simulator (PROTOCOL.md §10): what a case's tables
//! are ([`TableCase`]), what each rank pushes to them (ids and gradient
//! rows as a function of the seed, the rank and the round), and what the
//! rows must be, computed apart from the engine from §10.4's initial
//! values and §10.5's row optimizers.
//!
//! [`TableModel`] follows one (table, lcore) from the messages `handle`
//! said it took, in the order it took them: BSP, each ROW_PUSH's pairs
//! added into the round's accumulator and the optimizer run once per row
//! at completion; async and bounded delay, each pair applied at once.
//! Every ROW_RESULT and ROW_PULL_RESULT that leaves the lcore must carry
//! the model's rows bit for bit, and, without a restore, every BSP round's
//! accumulator must be the sum of every rank's rows placed on that lcore
//! (gradients are small integers: their sums are exact in any order).

use std::collections::HashMap;

use phub_proto::dtype::{decode, encode};
use phub_proto::placement::RowPlacement;
use phub_proto::spec::{Evict, RowInitSpec, RowOptimizerSpec, TableSpec};
use phub_proto::Dtype;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One table key of a case.
#[derive(Debug, Clone, PartialEq)]
pub struct TableCase {
    /// Values per row, D.
    pub dim: u32,
    /// The table's seed (placement and initial values, §10.1, §10.4).
    pub seed: u64,
    /// What a row never pushed reads as (`zeros` or `uniform`).
    pub init: RowInitSpec,
    /// The row optimizer.
    pub optimizer: RowOptimizerSpec,
    /// Distinct ids the ranks draw from (hashed ids, not 0 .. N).
    pub ids: u32,
    /// Ids a rank pushes per round, at most (0 .. this, repeats allowed:
    /// the worker sums them).
    pub touch: u32,
    /// Key-cache slots per rank and lcore (PROTOCOL.md §10.7); 0: none. A
    /// table with slots has each rank push two id sets in turn (odd
    /// rounds the first, even the second), both registered for key
    /// caching when the rank's transport is made.
    pub key_cache: u32,
    /// `admit_after`: a row is stored from its id's N-th push on
    /// (PROTOCOL.md §10.1); `None`: from its first.
    pub admit_after: Option<u32>,
    /// `evict = { idle_rounds = N }`: rows not updated for N of their
    /// lcore's rounds (clocks) are evicted; `None`: never.
    pub idle_rounds: Option<u32>,
    /// `rows`, the table's row cap (each lcore's share is
    /// `ceil(rows / L)`), when it is small enough to be reached: a new row
    /// at an lcore's share evicts one (CLOCK, PROTOCOL.md §10.1); `None`:
    /// [`ROWS_CAP`].
    pub cap: Option<u64>,
}

/// The row cap a simulated table is installed with unless it draws a
/// small one ([`TableCase::cap`]): no lcore's share is ever reached (a
/// case draws at most 256 distinct ids).
pub const ROWS_CAP: u64 = 4096;

impl TableCase {
    /// One or two tables drawn from `rng` ([`TableCase::draw`]).
    pub fn draw_some(rng: &mut ChaCha8Rng, dtype: Dtype, chunk_bytes: u32) -> Vec<TableCase> {
        (0..rng.gen_range(1..=2))
            .map(|_| TableCase::draw(rng, dtype, chunk_bytes))
            .collect()
    }

    /// A table drawn from `rng` for a job of `dtype` and `chunk_bytes`.
    pub fn draw(rng: &mut ChaCha8Rng, dtype: Dtype, chunk_bytes: u32) -> TableCase {
        let size = u32::try_from(dtype.size()).unwrap_or(4);
        let most = ((chunk_bytes - 8) / size).clamp(1, 8);
        let optimizers = row_optimizers();
        let dim = rng.gen_range(1..=most);
        let seed: u64 = rng.gen();
        let mut t = TableCase {
            dim,
            seed,
            // A third of the tables that draw `uniform` take `normal`
            // instead, decided by the seed drawn: no more draws, so every
            // earlier seed's case keeps its shape.
            init: if rng.gen_bool(0.5) {
                RowInitSpec::Zeros
            } else if seed.is_multiple_of(3) {
                RowInitSpec::Normal { std: 0.1 }
            } else {
                RowInitSpec::Uniform { a: -0.5, b: 0.25 }
            },
            optimizer: optimizers[rng.gen_range(0..optimizers.len())],
            ids: rng.gen_range(1..=256),
            touch: rng.gen_range(0..=24),
            key_cache: 0,
            admit_after: None,
            idle_rounds: None,
            cap: None,
        };
        // A quarter of the tables cache their ids, decided by the seed
        // drawn (no more draws: every earlier seed's case keeps its
        // draws): slots for both id sets' messages even were all of a
        // set's ids on one lcore.
        if seed % 4 == 1 {
            let per = phub_proto::spec::rows_per_datagram(chunk_bytes, dim, dtype).max(1);
            t.key_cache = 2 * t.touch.div_ceil(per).max(1);
        }
        // A fifth of the tables admit a row from its 2nd to 4th push, and
        // a fifth (others) evict rows idle 2 to 4 rounds, decided by the
        // seed drawn as well. Idle rounds start at 2: a row updated in a
        // round is then never evicted at that round's end, so whether an
        // id is stored after a push says whether the push was admitted.
        let bits = seed >> 32;
        if bits % 5 == 1 {
            t.admit_after = Some(2 + u32::try_from(bits % 3).unwrap_or(0));
        }
        if (bits >> 8) % 5 == 1 {
            t.idle_rounds = Some(2 + u32::try_from((bits >> 16) % 3).unwrap_or(0));
        }
        // A fifth of the others have a cap of a quarter of their ids, so
        // that rows are evicted at the cap: the model follows which rows
        // the lcore keeps, checking each eviction against the store's
        // count and its cap (which row CLOCK takes depends on the index's
        // order, which the model does not keep).
        if (bits >> 24) % 5 == 1 && t.admit_after.is_none() && t.idle_rounds.is_none() {
            t.cap = Some(u64::from(t.ids / 4).max(1));
        }
        t
    }

    /// The table as a job spec declares it.
    pub fn spec(&self) -> TableSpec {
        TableSpec {
            dim: self.dim,
            rows: Some(self.cap.unwrap_or(ROWS_CAP)),
            seed: self.seed,
            init: self.init,
            optimizer: self.optimizer,
            evict: self.idle_rounds.map(Evict::IdleRounds),
            admit_after: self.admit_after,
            key_cache: self.key_cache,
        }
    }

    /// Rank `rank`'s ids of table `key` in round (clock) `round`: drawn
    /// from the table's ids with more weight on the first (so ranks
    /// collide on them), repeats kept.
    pub fn round_ids(&self, case_seed: u64, key: u32, rank: u16, round: u32) -> Vec<u64> {
        // A caching table's rounds take its two id sets in turn.
        let round = if self.key_cache > 0 {
            1 + round.saturating_sub(1) % 2
        } else {
            round
        };
        let mut rng = ChaCha8Rng::seed_from_u64(
            case_seed ^ (u64::from(key) << 56) ^ (u64::from(rank) << 40) ^ u64::from(round) ^ 0x7ab1e,
        );
        let n = rng.gen_range(0..=self.touch);
        (0..n)
            .map(|_| {
                let u: f64 = rng.gen();
                // Cast: u * u * ids < ids <= 256.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let j = (u * u * f64::from(self.ids)) as u64;
                self.id(j)
            })
            .collect()
    }

    /// The table's id number `j` (a hashed id).
    pub fn id(&self, j: u64) -> u64 {
        phub_proto::placement::mix64(self.seed ^ j.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    /// Rank `rank`'s gradient rows for `ids` (one row per position).
    pub fn grads(&self, key: u32, rank: u16, round: u32, ids: &[u64]) -> Vec<f32> {
        let d = u64::from(self.dim);
        ids.iter()
            .enumerate()
            .flat_map(|(i, &id)| {
                (0..d).map(move |e| {
                    // Repeats of an id in one call get different rows.
                    crate::reference::grad(rank, key, (id ^ (i as u64) << 32) ^ e, round)
                })
            })
            .collect()
    }
}

/// One of each row optimizer (§10.5), with the hyper-parameters the
/// cases use.
pub fn row_optimizers() -> Vec<RowOptimizerSpec> {
    vec![
        RowOptimizerSpec::Sum,
        RowOptimizerSpec::Sgd { lr: 0.25 },
        RowOptimizerSpec::Adagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.1,
            rowwise: false,
        },
        RowOptimizerSpec::Adagrad {
            lr: 0.1,
            eps: 1e-3,
            initial_accumulator: 0.0,
            rowwise: true,
        },
        RowOptimizerSpec::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        RowOptimizerSpec::Ftrl {
            alpha: 0.3,
            beta: 1.0,
            l1: 0.5,
            l2: 0.01,
        },
    ]
}

/// Philox4x32-10 (PROTOCOL.md §10.4, "Bits") of `counter` under `key`.
pub fn philox(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for i in 0..10 {
        if i > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let p = M0 * u64::from(c0);
        let q = M1 * u64::from(c2);
        // Casts: the high and low 32 bits of 64-bit products.
        #[allow(clippy::cast_possible_truncation)]
        let (hp, lp, hq, lq) = ((p >> 32) as u32, p as u32, (q >> 32) as u32, q as u32);
        (c0, c1, c2, c3) = (hq ^ c1 ^ k0, lq, hp ^ c3 ^ k1, lp);
    }
    [c0, c1, c2, c3]
}

/// Element `e` of row `id`'s initial value in table `key` of seed `seed`
/// (§10.4, "Values").
pub fn initial(init: &RowInitSpec, seed: u64, key: u32, id: u64, e: u32) -> f32 {
    // Casts: the low and high 32 bits.
    #[allow(clippy::cast_possible_truncation)]
    let bits = || {
        philox(
            [e, key, id as u32, (id >> 32) as u32],
            [seed as u32, (seed >> 32) as u32],
        )
    };
    match *init {
        RowInitSpec::Zeros => 0.0,
        RowInitSpec::Uniform { a, b } => {
            // Cast: below 2^24, exact.
            #[allow(clippy::cast_precision_loss)]
            let u = (bits()[0] >> 8) as f32 * (1.0 / 16_777_216.0);
            a + (b - a) * u
        }
        RowInitSpec::Normal { std } => {
            let x = bits();
            normal(x[0], x[1], std)
        }
    }
}

/// §10.4's `normal(0, std)` of Philox words `x0` and `x1`, line by line
/// as written there: Box–Muller's first output in binary64 with the
/// section's own logarithm and cosine polynomials, rounded once to
/// binary32.
fn normal(x0: u32, x1: u32, std: f32) -> f32 {
    const LN2: u64 = 0x3fe6_2e42_fefa_39ef;
    const L: [u64; 11] = [
        0x3ff0_0000_0000_0000,
        0x3fd5_5555_5555_5555,
        0x3fc9_9999_9999_999a,
        0x3fc2_4924_9249_2492,
        0x3fbc_71c7_1c71_c71c,
        0x3fb7_45d1_745d_1746,
        0x3fb3_b13b_13b1_3b14,
        0x3fb1_1111_1111_1111,
        0x3fae_1e1e_1e1e_1e1e,
        0x3faa_f286_bca1_af28,
        0x3fa8_6186_1861_8618,
    ];
    const C: [u64; 9] = [
        0x3ff0_0000_0000_0000,
        0xbff3_bd3c_c9be_45de,
        0x3fd0_3c1f_081b_5ac4,
        0xbf95_5d3c_7e3c_bffa,
        0x3f4e_1f50_6891_babb,
        0xbefa_6d1f_2a20_4a8c,
        0x3e9f_9d38_a376_3cc3,
        0xbe3b_6e24_f44b_128f,
        0x3dd2_0c62_c2f2_d7f5,
    ];
    let x = u64::from(x0) + 1;
    let k = 63 - x.leading_zeros();
    // Casts: integers up to 2^32 convert to binary64 exactly; dividing by
    // a power of two is exact.
    #[allow(clippy::cast_precision_loss)]
    let m = x as f64 / (1u64 << k) as f64;
    let r = (m - 1.0) / (m + 1.0);
    let g = r * r;
    let mut p = f64::from_bits(L[10]);
    for j in (0..10).rev() {
        p = p * g + f64::from_bits(L[j]);
    }
    let y = r * p;
    let l = (f64::from(k) - 32.0) * f64::from_bits(LN2) + (y + y);
    let h = x1 >> 30;
    let mut i = x1 & ((1 << 30) - 1);
    if h % 2 == 1 {
        i = (1 << 30) - i;
    }
    let f = f64::from(i) * (1.0 / f64::from(1u32 << 30));
    let q = f * f;
    let mut c = f64::from_bits(C[8]);
    for j in (0..8).rev() {
        c = c * q + f64::from_bits(C[j]);
    }
    if h == 1 || h == 2 {
        c = -c;
    }
    let n = (-2.0 * l).sqrt() * c;
    // Cast: the one rounding to binary32 the section asks for.
    #[allow(clippy::cast_possible_truncation)]
    let v = (n * f64::from(std)) as f32;
    v
}

/// `pow(x, n)` as §5.6 defines it: square and multiply from the lowest
/// bit of `n` up, each product rounded.
fn pow(x: f32, n: f32) -> f32 {
    // Cast: n holds an integer up to 2^24 (Adam's step count).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let mut n = n as u32;
    let (mut p, mut x) = (1.0f32, x);
    loop {
        if n & 1 == 1 {
            p *= x;
        }
        n >>= 1;
        if n == 0 {
            return p;
        }
        x *= x;
    }
}

/// `sum8` of §10.5: eight partial sums, then a fixed tree.
fn sum8(x: impl Iterator<Item = f32>) -> f32 {
    let mut p = [0f32; 8];
    for (e, v) in x.enumerate() {
        p[e % 8] += v;
    }
    ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]))
}

/// A stored row: its values and its optimizer state.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// `w`, D values.
    pub w: Vec<f32>,
    /// Element state (adagrad's `h`; adam's `m`, `v`; ftrl's `z`, `n`),
    /// two per element.
    pub s: Vec<f32>,
    /// Row state (row-wise adagrad's `h`, adam's `t`).
    pub r: f32,
}

impl Row {
    /// A row stored for the first time: its initial values and the
    /// starting state of `opt`'s block.
    pub fn new(w: Vec<f32>, opt: &RowOptimizerSpec) -> Row {
        let d = w.len();
        let (s0, r) = match *opt {
            RowOptimizerSpec::Adagrad {
                initial_accumulator, ..
            } => (initial_accumulator, initial_accumulator),
            _ => (0.0, 0.0),
        };
        Row {
            w,
            s: vec![s0; 2 * d],
            r,
        }
    }

    /// One update with gradient `a` (§10.5's block of `opt`).
    pub fn update(&mut self, opt: &RowOptimizerSpec, a: &[f32]) {
        let d = self.w.len();
        let (s1, s2) = self.s.split_at_mut(d);
        match *opt {
            RowOptimizerSpec::Sum => {
                for (w, a) in self.w.iter_mut().zip(a) {
                    *w += *a;
                }
            }
            RowOptimizerSpec::Sgd { lr } => {
                for (w, a) in self.w.iter_mut().zip(a) {
                    *w -= lr * *a;
                }
            }
            RowOptimizerSpec::Adagrad {
                lr,
                eps,
                rowwise: false,
                ..
            } => {
                for ((w, a), h) in self.w.iter_mut().zip(a).zip(s1) {
                    *h += *a * *a;
                    *w -= lr * *a / (h.sqrt() + eps);
                }
            }
            RowOptimizerSpec::Adagrad {
                lr,
                eps,
                rowwise: true,
                ..
            } => {
                let q = sum8(a.iter().map(|a| *a * *a));
                // Cast: D <= 2^24, exact.
                #[allow(clippy::cast_precision_loss)]
                let dd = d as f32;
                self.r += q / dd;
                let k = lr / (self.r.sqrt() + eps);
                for (w, a) in self.w.iter_mut().zip(a) {
                    *w -= *a * k;
                }
            }
            RowOptimizerSpec::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let (d1, d2) = (1.0 - beta1, 1.0 - beta2);
                if self.r + 1.0 != self.r {
                    self.r += 1.0;
                }
                let c1 = 1.0 / (1.0 - pow(beta1, self.r));
                let c2 = 1.0 / (1.0 - pow(beta2, self.r));
                for (((w, a), m), v) in self.w.iter_mut().zip(a).zip(s1).zip(s2) {
                    *m = beta1 * *m + d1 * *a;
                    *v = beta2 * *v + d2 * (*a * *a);
                    *w -= lr * (*m * c1) / ((*v * c2).sqrt() + eps);
                }
            }
            RowOptimizerSpec::Ftrl { alpha, beta, l1, l2 } => {
                let nl1 = 0.0 - l1;
                for (((w, a), z), n) in self.w.iter_mut().zip(a).zip(s1).zip(s2) {
                    let u = *n + *a * *a;
                    let o = (u.sqrt() - n.sqrt()) / alpha;
                    *z = *z + *a - o * *w;
                    *n = u;
                    let c = *z - z.min(l1).max(nl1);
                    *w = 0.0 - c / ((beta + n.sqrt()) / alpha + l2);
                }
            }
        }
    }
}

/// `v` rounded through the wire type.
fn through_wire(dtype: Dtype, v: &[f32]) -> Vec<f32> {
    let mut bytes = vec![0u8; v.len() * dtype.size()];
    encode(dtype, v, &mut bytes);
    let mut out = vec![0f32; v.len()];
    decode(dtype, &bytes, &mut out);
    out
}

/// What the run knows of one (table, lcore), from what `handle` took.
#[derive(Debug, Clone)]
pub struct TableModel {
    /// The table's key index.
    pub key: u32,
    /// Rows stored, by id.
    pub rows: HashMap<u64, Row>,
    /// BSP: the last completed round.
    pub completed: u32,
    /// BSP: the round's accumulator, ids in first-arrival order.
    pub acc: Vec<(u64, Vec<f32>)>,
    acc_at: HashMap<u64, usize>,
    /// Not BSP: each rank's applied clock.
    pub applied: Vec<u32>,
    /// The store's round: how many times its round advanced (each BSP
    /// round, or each time the slowest clock rose), its idle clock.
    pub round: u32,
    /// Each stored row's last update, in the store's rounds.
    touched: HashMap<u64, u32>,
    /// Each id's pushes while it was not stored (what admission counts).
    pushes: HashMap<u64, u32>,
    /// Rows evicted at the cap since the run last compared the count
    /// with the lcore's ([`TableModel::take_evicted_at_cap`]).
    evicted_at_cap: u64,
    /// The lcore's count of rows evicted at the cap then.
    pub cap_seen: u64,
    /// A table with a small cap ([`TableCase::cap`]), while the run has
    /// the model take a message: the lcore's share of the cap and the ids
    /// it evicted at the cap taking it, in order.
    pub at_cap: Option<AtCap>,
}

/// What a capped table's model replays of one message: the lcore's cap
/// and the ids it evicted, in order (the engine's eviction log).
#[derive(Debug, Clone, Default)]
pub struct AtCap {
    /// Rows the lcore stores at most.
    pub cap: u64,
    /// The ids it evicted at the cap, in order, not replayed yet.
    pub victims: std::collections::VecDeque<u64>,
}

/// Pushes by what they did, and rows evicted, over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PushTally {
    /// Rows stored on their `admit_after`-th push (or first).
    pub created: u64,
    /// Rows stored before it (counters shared with another id).
    pub created_early: u64,
    /// Pushes dropped before admission.
    pub not_admitted: u64,
    /// Rows evicted idle.
    pub evicted: u64,
    /// Rows evicted at the cap.
    pub evicted_at_cap: u64,
}

impl PushTally {
    /// One push's outcome counted.
    pub fn count(&mut self, p: Pushed) {
        match p {
            Pushed::Updated => {}
            Pushed::Created => self.created += 1,
            Pushed::CreatedEarly => self.created_early += 1,
            Pushed::NotAdmitted => self.not_admitted += 1,
        }
    }
}

/// What one push did to its row, as the model and the lcore agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// A stored row updated.
    Updated,
    /// The row stored now, on its `admit_after`-th push or its first.
    Created,
    /// Stored before its `admit_after`-th push: the admission counters
    /// of two ids met (they admit early, never late).
    CreatedEarly,
    /// Not admitted yet: the push is dropped, the id reads as initial.
    NotAdmitted,
}

impl TableModel {
    /// A (table, lcore) at install: nothing stored, round 0.
    pub fn new(key: u32, workers: u16) -> TableModel {
        TableModel {
            key,
            rows: HashMap::new(),
            completed: 0,
            acc: Vec::new(),
            acc_at: HashMap::new(),
            applied: vec![0; usize::from(workers)],
            round: 0,
            touched: HashMap::new(),
            pushes: HashMap::new(),
            evicted_at_cap: 0,
            cap_seen: 0,
            at_cap: None,
        }
    }

    /// Row `id` as a pull reads it, in f32.
    pub fn read(&self, t: &TableCase, id: u64) -> Vec<f32> {
        match self.rows.get(&id) {
            Some(r) => r.w.clone(),
            None => (0..t.dim)
                .map(|e| initial(&t.init, t.seed, self.key, id, e))
                .collect(),
        }
    }

    /// Row `id` as an answer carries it.
    pub fn answer(&self, t: &TableCase, dtype: Dtype, id: u64) -> Vec<f32> {
        through_wire(dtype, &self.read(t, id))
    }

    /// Not BSP: the pair (`id`, `a`) applied at once. `stored`: whether
    /// the lcore stores `id` after the push, which the model checks
    /// against admission (§10.1: a row is stored on its id's
    /// `admit_after`-th push, or earlier when its counters met another
    /// id's; a stored row stays stored through its pushes).
    pub fn apply(&mut self, t: &TableCase, id: u64, a: &[f32], stored: bool) -> Pushed {
        let pushed = if self.rows.contains_key(&id) {
            assert!(
                stored || t.cap.is_some(),
                "table key {}: row {id:#x} stored before a push and not after it",
                self.key
            );
            Pushed::Updated
        } else if let Some(at) = self.at_cap.as_mut() {
            // A capped table: a row created at the cap takes the place of
            // the next id the lcore evicted (CLOCK chose it), which may be
            // a row updated earlier in the same message or round (its
            // update lost) or one still to be updated (then created anew).
            if self.rows.len() as u64 >= at.cap {
                let v = at.victims.pop_front().unwrap_or_else(|| {
                    panic!(
                        "table key {}: row {id:#x} created at the cap ({}) and the lcore evicted none",
                        self.key, at.cap
                    )
                });
                assert!(
                    self.rows.remove(&v).is_some(),
                    "table key {}: the lcore evicted row {v:#x} at the cap, which it did not store",
                    self.key
                );
                self.touched.remove(&v);
                self.evicted_at_cap += 1;
            }
            let init = self.read(t, id);
            self.rows.insert(id, Row::new(init, &t.optimizer));
            Pushed::Created
        } else {
            let n = self.pushes.entry(id).or_insert(0);
            *n += 1;
            let due = t.admit_after.unwrap_or(1);
            if !stored {
                assert!(
                    *n < due,
                    "table key {}: row {id:#x} not stored after its push {n} (admit_after {:?})",
                    self.key,
                    t.admit_after
                );
                return Pushed::NotAdmitted;
            }
            let early = *n < due;
            let init = self.read(t, id);
            self.rows.insert(id, Row::new(init, &t.optimizer));
            if early {
                Pushed::CreatedEarly
            } else {
                Pushed::Created
            }
        };
        self.touched.insert(id, self.round);
        if let Some(row) = self.rows.get_mut(&id) {
            row.update(&t.optimizer, a);
        }
        pushed
    }

    /// The rows evicted at the cap since the last call.
    pub fn take_evicted_at_cap(&mut self) -> u64 {
        std::mem::take(&mut self.evicted_at_cap)
    }

    /// The store's round advances: the rows the lcore no longer stores
    /// (`stored` false) were evicted, each of which must have gone
    /// `idle_rounds` rounds or more without an update (the sweep takes a
    /// row between that and about twice that). Returns how many.
    pub fn advance(&mut self, t: &TableCase, stored: impl Fn(u64) -> bool) -> u64 {
        self.round += 1;
        let mut gone: Vec<u64> = self.rows.keys().copied().filter(|&id| !stored(id)).collect();
        gone.sort_unstable();
        for id in &gone {
            let idle = self.round - self.touched[id];
            assert!(
                t.idle_rounds.is_some_and(|n| idle >= n),
                "table key {}: row {id:#x} evicted {idle} round(s) after its last update (idle_rounds {:?})",
                self.key,
                t.idle_rounds
            );
            self.rows.remove(id);
            self.touched.remove(id);
        }
        gone.len() as u64
    }

    /// BSP: the pair (`id`, `a`) added into the round's accumulator.
    pub fn accumulate(&mut self, id: u64, a: &[f32]) {
        match self.acc_at.get(&id) {
            Some(&i) => {
                for (x, g) in self.acc[i].1.iter_mut().zip(a) {
                    *x += *g;
                }
            }
            None => {
                self.acc_at.insert(id, self.acc.len());
                self.acc.push((id, a.to_vec()));
            }
        }
    }

    /// BSP: the round completes: each accumulated row through the
    /// optimizer once, in first-arrival order (`stored` as for
    /// [`TableModel::apply`], each push counted in `tally`), then the
    /// store's round advances ([`TableModel::advance`], its evictions
    /// counted in `tally` too). Returns the accumulator.
    pub fn complete(
        &mut self,
        t: &TableCase,
        stored: impl Fn(u64) -> bool,
        tally: &mut PushTally,
    ) -> Vec<(u64, Vec<f32>)> {
        let acc = std::mem::take(&mut self.acc);
        self.acc_at.clear();
        for (id, a) in &acc {
            tally.count(self.apply(t, *id, a, stored(*id)));
        }
        self.completed += 1;
        tally.evicted += self.advance(t, stored);
        acc
    }

    /// BSP: the round in progress is lost (a restore: it is not saved).
    pub fn clear_round(&mut self) {
        self.acc.clear();
        self.acc_at.clear();
    }
}

/// BSP: every rank's contribution to table `t`'s round `round` on entry
/// `entry` of `case`, summed per id (the worker's merging of repeats and
/// the lcore's addition are the same exact integer sums): the
/// accumulator the round must complete with.
pub fn expected_round(
    case: &crate::Case,
    t: usize,
    placement: &RowPlacement,
    entry: u32,
    round: u32,
) -> HashMap<u64, Vec<f32>> {
    let (key, dtype) = (crate::table_key(case, t), case.dtype);
    let t = &case.tables[t];
    let d = t.dim as usize;
    let mut sum: HashMap<u64, Vec<f32>> = HashMap::new();
    for rank in 0..case.workers {
        let ids = t.round_ids(case.seed, key, rank, round);
        let g = t.grads(key, rank, round, &ids);
        // Merged on the worker first, then through the wire.
        let mut merged: HashMap<u64, Vec<f32>> = HashMap::new();
        for (i, &id) in ids.iter().enumerate() {
            let row = merged.entry(id).or_insert_with(|| vec![0.0; d]);
            for (x, y) in row.iter_mut().zip(&g[i * d..(i + 1) * d]) {
                *x += *y;
            }
        }
        for (id, row) in merged {
            if placement.entry(id) != entry {
                continue;
            }
            let row = through_wire(dtype, &row);
            let s = sum.entry(id).or_insert_with(|| vec![0.0; d]);
            for (x, y) in s.iter_mut().zip(&row) {
                *x += *y;
            }
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_gives_random123s_known_answers() {
        assert_eq!(
            philox([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    /// PROTOCOL.md §10.4's worked example, bit for bit: rows 42 and 7 of
    /// table 3 of seed 0x0123456789abcdef, `normal(0, 0.1)` and
    /// `uniform(-0.5, 0.5)`.
    #[test]
    fn initial_values_give_the_worked_example() {
        let seed = 0x0123_4567_89ab_cdef;
        let row = |init: &RowInitSpec, id: u64| -> Vec<u32> {
            (0..4).map(|e| initial(init, seed, 3, id, e).to_bits()).collect()
        };
        let normal = RowInitSpec::Normal { std: 0.1 };
        assert_eq!(
            row(&normal, 42),
            [0x3de0_7465, 0xbd2d_9e94, 0xbcb8_d185, 0x3cf9_5aa5]
        );
        assert_eq!(
            row(&normal, 7),
            [0x3d25_668c, 0x3d80_550f, 0xbcb0_3ed8, 0x3e88_c96d]
        );
        let uniform = RowInitSpec::Uniform { a: -0.5, b: 0.5 };
        assert_eq!(
            row(&uniform, 42),
            [0xbe1b_9420, 0x3e70_6740, 0x3ef2_ee60, 0xbe05_fba4]
        );
    }

    /// PROTOCOL.md §10.5's worked examples for sgd and ftrl, bit for bit.
    #[test]
    fn the_row_optimizers_give_the_worked_examples() {
        let sgd = RowOptimizerSpec::Sgd { lr: 0.3 };
        let mut r = Row::new(vec![2.93, 2.62, -1.15, -2.75], &sgd);
        let a: Vec<f32> = [1.31f32, -1.89, 0.69, 0.93]
            .iter()
            .zip([-1.34f32, -1.94, 1.22, 2.41])
            .map(|(x, y)| x + y)
            .collect();
        r.update(&sgd, &a);
        let bits: Vec<u32> = r.w.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, [0x403c_1894, 0x4071_374c, 0xbfdc_8b44, 0xc070_20c5]);
        let ftrl = RowOptimizerSpec::Ftrl {
            alpha: 0.3,
            beta: 1.0,
            l1: 0.7,
            l2: 0.01,
        };
        let mut r = Row::new(vec![0.0; 4], &ftrl);
        let a: Vec<f32> = [1.31f32, -0.42, 0.25, -1.94]
            .iter()
            .zip([-0.36f32, 0.22, 0.69, 0.72])
            .map(|(x, y)| x + y)
            .collect();
        r.update(&ftrl, &a);
        let bits: Vec<u32> = r.w.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, [0xbd1d_4be3, 0, 0xbd17_c823, 0x3d8f_b825]);
    }
}
