//! Checks PROTOCOL.md §5.6 against the appliance, bit for bit.
//!
//! The section states each optimizer as a code block (```` ```optimizer
//! NAME ````) of `name = expression` lines in `f32` arithmetic. This test
//! parses those blocks and runs them, as written, beside the engine
//! ([`Shard`]): random chunks over several rounds, every result compared
//! bit for bit. It then runs the document's worked examples (```` ```example
//! ````) through the engine and checks every result it states. Negative
//! checks show the test can fail: the formulas the document used to give
//! (Adam's `m / (1 - b1^t)`, AdamW's `w -= lr * wd * w`, `g / W`, `b^t` as a
//! running product) disagree with the engine and with the examples.
//!
//! It lives in phub-engine, not beside proto/tests/protocol_doc.rs,
//! because it needs the engine; phub-proto stays free of it.

use std::collections::HashMap;

use crate::doc_notation::{blocks, doc, doc_pow, eval, parse_lines, running_product, Env, Lines};
use phub_engine::kernels::{self, Kernels};
use phub_engine::{InstallKind, JobInstall, Shard, Verdict};
use phub_proto::layout::SlotChunk;
use phub_proto::spec::Optimizer;
use phub_proto::wire::{self, MsgType, Repr};
use phub_proto::Dtype;
use rand::{Rng, SeedableRng};

/// One optimizer's block: what is computed once per round, then per
/// element (the two parts are separated by a blank line).
#[derive(Debug, Clone)]
struct Formula {
    per_round: Lines,
    per_element: Lines,
}

impl Formula {
    fn parse(body: &str) -> Formula {
        let (per_round, per_element) = match body.split_once("\n\n") {
            Some((r, e)) => (parse_lines(r), parse_lines(e)),
            None => (Vec::new(), parse_lines(body)),
        };
        Formula {
            per_round,
            per_element,
        }
    }

    /// Replaces `from` by `to` in the block's text (a negative check's
    /// mutation); panics when `from` is not there.
    fn mutated(body: &str, from: &str, to: &str) -> Formula {
        assert!(body.contains(from), "`{from}` is not in the block:\n{body}");
        Formula::parse(&body.replace(from, to))
    }
}

/// The document's optimizer state of one chunk.
struct DocChunk {
    formula: Formula,
    pow: fn(f32, u32) -> f32,
    hyper: Env,
    workers: u32,
    w: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

fn hyper_parameters(opt: &Optimizer) -> Env {
    let mut h = Env::new();
    let mut set = |k: &str, x: f32| {
        h.insert(k.to_string(), x);
    };
    match *opt {
        Optimizer::Sum | Optimizer::Mean => {}
        Optimizer::Sgd { lr, weight_decay } => {
            set("lr", lr);
            set("wd", weight_decay);
        }
        Optimizer::Momentum {
            lr,
            momentum,
            weight_decay,
        }
        | Optimizer::Nesterov {
            lr,
            momentum,
            weight_decay,
        } => {
            set("lr", lr);
            set("mu", momentum);
            set("wd", weight_decay);
        }
        Optimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        }
        | Optimizer::Adamw {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            set("lr", lr);
            set("b1", beta1);
            set("b2", beta2);
            set("eps", eps);
            set("wd", weight_decay);
        }
    }
    h
}

impl DocChunk {
    fn new(formula: Formula, opt: &Optimizer, workers: u32, init: &[f32]) -> DocChunk {
        DocChunk {
            formula,
            pow: doc_pow,
            hyper: hyper_parameters(opt),
            workers,
            w: init.to_vec(),
            m: vec![0.0; init.len()],
            v: vec![0.0; init.len()],
        }
    }

    /// Completes round `t` with accumulator `a`; returns the results.
    fn round(&mut self, t: u32, a: &[f32]) -> Vec<f32> {
        let mut env = self.hyper.clone();
        env.insert("W".into(), self.workers as f32);
        env.insert("t".into(), t as f32);
        for (name, e) in &self.formula.per_round {
            let x = eval(e, &env, self.pow);
            env.insert(name.clone(), x);
        }
        let mut out = Vec::with_capacity(a.len());
        for (i, &acc) in a.iter().enumerate() {
            let mut el = env.clone();
            for (k, x) in [("a", acc), ("w", self.w[i]), ("m", self.m[i]), ("v", self.v[i])] {
                el.insert(k.into(), x);
            }
            for (name, e) in &self.formula.per_element {
                let x = eval(e, &el, self.pow);
                el.insert(name.clone(), x);
            }
            self.w[i] = el["w"];
            self.m[i] = el["m"];
            self.v[i] = el["v"];
            out.push(*el.get("result").expect("the block sets `result`"));
        }
        out
    }
}

/// Every optimizer's block, by spec name; exactly one per optimizer.
fn doc_formulas(doc: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for (body, name) in blocks(doc, "optimizer") {
        assert!(
            out.insert(name.clone(), body).is_none(),
            "two blocks for `{name}`"
        );
    }
    let mut names: Vec<&str> = out.keys().map(String::as_str).collect();
    names.sort_unstable();
    let mut want: Vec<&str> = every_kind().iter().map(Optimizer::name).collect();
    want.sort_unstable();
    assert_eq!(names, want, "one ```optimizer block per optimizer");
    out
}

/// One optimizer of each kind, with hyper-parameters that make wrong
/// readings visible: no power of two, betas whose powers round.
fn every_kind() -> Vec<Optimizer> {
    vec![
        Optimizer::Sum,
        Optimizer::Mean,
        Optimizer::Sgd {
            lr: 0.3,
            weight_decay: 0.01,
        },
        Optimizer::Momentum {
            lr: 0.3,
            momentum: 0.9,
            weight_decay: 0.01,
        },
        Optimizer::Nesterov {
            lr: 0.3,
            momentum: 0.9,
            weight_decay: 0.01,
        },
        Optimizer::Adam {
            lr: 0.3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        Optimizer::Adamw {
            lr: 0.3,
            beta1: 0.5,
            beta2: 0.75,
            eps: 1e-3,
            weight_decay: 0.1,
        },
    ]
}

// ---------------------------------------------------------------------------
// The engine.

const TOKEN: u64 = 0x5eed;
const JOB: u16 = 7;

/// One job of one chunk of `n` elements on one shard.
struct Engine {
    shard: Shard<u32>,
    opt: Optimizer,
    workers: u16,
    n: usize,
}

impl Engine {
    fn new(kernels: Kernels, opt: Optimizer, workers: u16, n: usize) -> Engine {
        let mut shard = Shard::new(0, kernels);
        shard
            .install(
                JobInstall {
                    id: JOB,
                    token: TOKEN,
                    workers,
                    dtype: Dtype::F32,
                    optimizer: opt,
                    consistency: Default::default(),
                    chunk_elems: n as u32,
                    slots: vec![SlotChunk {
                        key: 0,
                        chunk: 0,
                        elems: n as u32,
                    }],
                },
                InstallKind::Plain,
            )
            .unwrap();
        Engine {
            shard,
            opt,
            workers,
            n,
        }
    }

    fn send(&mut self, kind: MsgType, rank: u16, round: u32, values: &[f32]) -> Verdict {
        let repr =
            Repr::request(kind, JOB, TOKEN, rank, round, 0).with_payload(Dtype::F32, values.len() as u16);
        self.shard.handle(u32::from(rank), &repr.to_datagram(values), 0)
    }

    /// The result every rank got for `round`, which must have just completed.
    fn results(&mut self, round: u32) -> Vec<f32> {
        let mut got: Vec<Vec<f32>> = Vec::new();
        for t in self.shard.transmits() {
            let mut b = t.header.to_vec();
            b.extend_from_slice(t.payload);
            let (repr, payload) = wire::parse(&b).unwrap();
            assert_eq!((repr.kind, repr.round), (MsgType::Result, round));
            let mut v = vec![0f32; payload.len() / 4];
            kernels::decode(Dtype::F32, payload, &mut v);
            for _ in t.to {
                got.push(v.clone());
            }
        }
        self.shard.clear_transmits();
        assert_eq!(got.len(), usize::from(self.workers), "a result to every rank");
        assert!(got.windows(2).all(|p| bits(&p[0]) == bits(&p[1])));
        assert_eq!(got[0].len(), self.n);
        got.swap_remove(0)
    }

    /// Round 0: rank 0's INIT carries `init`, the others' nothing.
    fn init(&mut self, init: &[f32]) -> Vec<f32> {
        for rank in 0..self.workers {
            let v = if rank == 0 { init } else { &[] };
            self.send(MsgType::Init, rank, 0, v);
        }
        self.results(0)
    }

    /// Round `round`: the pushes in the order given.
    fn round(&mut self, round: u32, pushes: &[(u16, Vec<f32>)]) -> Vec<f32> {
        for (i, (rank, v)) in pushes.iter().enumerate() {
            let want = if i + 1 == pushes.len() {
                Verdict::Completed
            } else {
                Verdict::Aggregated
            };
            assert_eq!(
                self.send(MsgType::Push, *rank, round, v),
                want,
                "{}",
                self.opt.name()
            );
        }
        self.results(round)
    }
}

/// A round's pushes in arrival order: (rank, values).
type Pushes = Vec<(u16, Vec<f32>)>;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The accumulator the document's §5.6 describes: the first contribution to
/// arrive copied, each later one added, in arrival order.
fn accumulate(pushes: &[(u16, Vec<f32>)]) -> Vec<f32> {
    let mut a = pushes[0].1.clone();
    for (_, p) in &pushes[1..] {
        for (x, y) in a.iter_mut().zip(p) {
            *x += *y;
        }
    }
    a
}

/// A random value: mostly moderate, sometimes tiny, huge, or a zero of
/// either sign.
fn value(rng: &mut impl Rng) -> f32 {
    match rng.gen_range(0..20) {
        0 => 0.0,
        1 => -0.0,
        2 => rng.gen_range(-1e-30..1e-30),
        3 => rng.gen_range(-1e20..1e20),
        _ => rng.gen_range(-4.0..4.0),
    }
}

/// Runs `opt` for `rounds` rounds over random chunks of `n` elements with
/// `workers` workers (random arrival order) in the engine and in the
/// document's `formula`; returns the number of results whose bits differ.
fn compare(kernels: Kernels, opt: Optimizer, formula: Formula, pow: fn(f32, u32) -> f32, seed: u64) -> usize {
    const N: usize = 700;
    const W: u16 = 3;
    const ROUNDS: u32 = 9;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let init: Vec<f32> = (0..N).map(|_| value(&mut rng)).collect();
    let mut e = Engine::new(kernels, opt, W, N);
    assert_eq!(bits(&e.init(&init)), bits(&init));
    let mut d = DocChunk::new(formula, &opt, u32::from(W), &init);
    d.pow = pow;
    let mut differ = 0;
    for round in 1..=ROUNDS {
        let mut ranks: Vec<u16> = (0..W).collect();
        for i in (1..ranks.len()).rev() {
            ranks.swap(i, rng.gen_range(0..=i));
        }
        let pushes: Pushes = ranks
            .iter()
            .map(|&r| (r, (0..N).map(|_| value(&mut rng)).collect()))
            .collect();
        let got = e.round(round, &pushes);
        let want = d.round(round, &accumulate(&pushes));
        differ += bits(&got)
            .iter()
            .zip(&bits(&want))
            .filter(|(g, w)| g != w)
            .count();
    }
    differ
}

#[test]
fn every_optimizer_block_computes_what_the_engine_computes_bit_for_bit() {
    let d = doc();
    let formulas = doc_formulas(&d);
    for kernels in Kernels::available() {
        for (i, opt) in every_kind().into_iter().enumerate() {
            let f = Formula::parse(&formulas[opt.name()]);
            let differ = compare(kernels, opt, f, doc_pow, i as u64);
            assert_eq!(
                differ,
                0,
                "{} ({:?} kernels): {differ} results differ from PROTOCOL.md's block",
                opt.name(),
                kernels.kind()
            );
        }
    }
}

/// Mutations of the document's blocks into readings it must rule out; each
/// must disagree with the engine, or the comparison above proves nothing.
#[test]
fn the_formulas_the_document_used_to_give_disagree_with_the_engine() {
    let d = doc();
    let formulas = doc_formulas(&d);
    let kinds = every_kind();
    let of = |name: &str| *kinds.iter().find(|o| o.name() == name).unwrap();
    let cases: [(&str, &str, &str); 6] = [
        // §5.6 before: `m / (1 - b1^t)` and `v / (1 - b2^t)`.
        ("adam", "m * c1", "m / (1 - pow(b1, t))"),
        ("adam", "v * c2", "v / (1 - pow(b2, t))"),
        // §5.6 before: AdamW's `w -= lr * wd * w` first.
        ("adamw", "u = w * keep", "u = w - lr * wd * w"),
        // The mean as a division by W.
        ("mean", "a * s", "a / W"),
        ("sgd", "a * s", "a / W"),
        ("nesterov", "lr * (g + mu * m)", "lr * g + lr * mu * m"),
    ];
    for (name, from, to) in cases {
        let f = Formula::mutated(&formulas[name], from, to);
        let differ = compare(Kernels::best(), of(name), f, doc_pow, 99);
        assert!(
            differ > 0,
            "{name} with `{to}` for `{from}` agrees with the engine"
        );
    }
    // `b^t` as a running product.
    let f = Formula::parse(&formulas["adam"]);
    let differ = compare(Kernels::best(), of("adam"), f, running_product, 99);
    assert!(
        differ > 0,
        "adam with b^t as a running product agrees with the engine"
    );
}

// ---------------------------------------------------------------------------
// The worked examples.

/// One ```example block: an optimizer, W, rank 0's initial values, then per
/// round the pushes in arrival order and the expected result bits.
#[derive(Debug)]
struct Example {
    opt: Optimizer,
    workers: u16,
    init: Vec<f32>,
    rounds: Vec<(Pushes, Vec<u32>)>,
}

fn decimals(s: &str) -> Vec<f32> {
    s.split_whitespace()
        .map(|x| x.parse().unwrap_or_else(|_| panic!("`{x}` is not a decimal")))
        .collect()
}

fn parse_example(body: &str) -> Example {
    let (mut opt, mut workers, mut init) = (None, None, None);
    let mut rounds: Vec<(Pushes, Vec<u32>)> = Vec::new();
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        let rest = rest.trim();
        match word {
            "optimizer" => opt = Some(serde_json::from_str::<Optimizer>(rest).unwrap()),
            "workers" => workers = Some(rest.parse::<u16>().unwrap()),
            "init" => init = Some(decimals(rest)),
            "push" => {
                // push ROUND RANK: values
                let (head, values) = rest.split_once(':').expect("push ROUND RANK: values");
                let h: Vec<u32> = head.split_whitespace().map(|x| x.parse().unwrap()).collect();
                let [round, rank] = h[..] else { panic!("`{line}`") };
                if rounds.len() < round as usize {
                    assert_eq!(rounds.len() + 1, round as usize, "rounds in order: `{line}`");
                    rounds.push((Vec::new(), Vec::new()));
                }
                rounds[round as usize - 1].0.push((rank as u16, decimals(values)));
            }
            "result" => {
                // result ROUND: hex bits
                let (head, values) = rest.split_once(':').expect("result ROUND: bits");
                let round: usize = head.trim().parse().unwrap();
                assert_eq!(round, rounds.len(), "`{line}` follows its round's pushes");
                rounds[round - 1].1 = values
                    .split_whitespace()
                    .map(|x| {
                        let h = x
                            .strip_prefix("0x")
                            .unwrap_or_else(|| panic!("`{x}`: 0x and 8 hex digits"));
                        assert_eq!(h.len(), 8, "`{x}`: 0x and 8 hex digits");
                        u32::from_str_radix(h, 16).unwrap()
                    })
                    .collect();
            }
            _ => panic!("unknown example line `{line}`"),
        }
    }
    let ex = Example {
        opt: opt.expect("an optimizer line"),
        workers: workers.expect("a workers line"),
        init: init.expect("an init line"),
        rounds,
    };
    assert!(!ex.rounds.is_empty());
    for (pushes, want) in &ex.rounds {
        assert_eq!(pushes.len(), usize::from(ex.workers), "one push per rank a round");
        assert_eq!(want.len(), ex.init.len(), "a result per element");
    }
    ex
}

fn examples(doc: &str) -> Vec<Example> {
    blocks(doc, "example")
        .iter()
        .map(|(b, _)| parse_example(b))
        .collect()
}

/// The example's results as `formula` (with `pow`) computes them.
fn by_formula(ex: &Example, formula: Formula, pow: fn(f32, u32) -> f32) -> Vec<Vec<u32>> {
    let mut d = DocChunk::new(formula, &ex.opt, u32::from(ex.workers), &ex.init);
    d.pow = pow;
    ex.rounds
        .iter()
        .enumerate()
        .map(|(r, (pushes, _))| bits(&d.round(r as u32 + 1, &accumulate(pushes))))
        .collect()
}

#[test]
fn every_worked_example_is_what_the_engine_and_the_blocks_compute() {
    let d = doc();
    let formulas = doc_formulas(&d);
    let exs = examples(&d);
    let mut seen: Vec<&str> = exs.iter().map(|e| e.opt.name()).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 7, "an example for every optimizer: {seen:?}");
    for ex in &exs {
        let name = ex.opt.name();
        for kernels in Kernels::available() {
            let mut e = Engine::new(kernels, ex.opt, ex.workers, ex.init.len());
            e.init(&ex.init);
            for (r, (pushes, want)) in ex.rounds.iter().enumerate() {
                let got = bits(&e.round(r as u32 + 1, pushes));
                assert_eq!(
                    got,
                    *want,
                    "{name} round {}: the engine gives {}",
                    r + 1,
                    got.iter()
                        .map(|b| format!("{b:#010x}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                );
            }
        }
        let want: Vec<Vec<u32>> = ex.rounds.iter().map(|(_, w)| w.clone()).collect();
        assert_eq!(
            by_formula(ex, Formula::parse(&formulas[name]), doc_pow),
            want,
            "{name}: the block"
        );
    }
}

/// The examples themselves tell the right reading from the wrong ones: a
/// worker that got one of these wrong fails the example.
#[test]
fn the_worked_examples_catch_the_wrong_readings() {
    let d = doc();
    let formulas = doc_formulas(&d);
    let exs = examples(&d);
    let stated = |ex: &Example| -> Vec<Vec<u32>> { ex.rounds.iter().map(|(_, w)| w.clone()).collect() };
    let cases: [(&str, &str, &str); 6] = [
        ("adam", "m * c1", "m / (1 - pow(b1, t))"),
        ("adam", "v * c2", "v / (1 - pow(b2, t))"),
        ("adamw", "u = w * keep", "u = w - lr * wd * w"),
        ("mean", "a * s", "a / W"),
        ("sgd", "a * s", "a / W"),
        ("momentum", "a * s", "a / W"),
    ];
    for (name, from, to) in cases {
        let ex = exs.iter().find(|e| e.opt.name() == name).unwrap();
        let f = Formula::mutated(&formulas[name], from, to);
        assert_ne!(
            by_formula(ex, f, doc_pow),
            stated(ex),
            "{name}'s example does not tell `{to}` from `{from}`"
        );
    }
    // AdamW's example runs enough rounds for b^t to round differently.
    let ex = exs.iter().find(|e| e.opt.name() == "adamw").unwrap();
    assert_ne!(
        by_formula(ex, Formula::parse(&formulas["adamw"]), running_product),
        stated(ex),
        "adamw's example does not tell b^t from a running product"
    );
    // The sum's example depends on the arrival order.
    let ex = exs.iter().find(|e| e.opt.name() == "sum").unwrap();
    let mut reversed: Vec<Vec<u32>> = Vec::new();
    for (pushes, _) in &ex.rounds {
        let mut p = pushes.clone();
        p.reverse();
        reversed.push(bits(&accumulate(&p)));
    }
    assert_ne!(
        reversed,
        stated(ex),
        "sum's example does not depend on the arrival order"
    );
}
