//! Checks PROTOCOL.md §10.4 (initial values of table rows) and §10.5 (row
//! optimizers) against the engine's code, bit for bit.
//!
//! §10.5 states each row optimizer as a block (```` ```row-optimizer NAME
//! ````) in §5.6's notation, with sections for the row's and the elements'
//! state, and for what runs once per table, once per row and once per
//! element. This test runs those blocks with the interpreter of
//! engine/tests/doc_notation (the one that runs §5.6's blocks) beside
//! [`RowOptimizer`]: random rows over many rounds, every value compared bit
//! for bit. It then runs the worked examples (```` ```row-example ````)
//! through both and checks every stated result, and checks that readings
//! the document rules out (a running sum for `sum8`, a per-round step count
//! for Adam, division by `1 - b^t`) disagree with the code and with the
//! examples. For §10.4 it compares the listed constants
//! (```` ```row-init-constants ````) with the code's and the worked example
//! (```` ```row-init-example ````) with what [`TableInit`] computes.

use std::collections::{BTreeMap, HashMap};

use crate::doc_notation::{blocks, doc, doc_pow, eval_row, parse_lines, running_product, Env, Lines};
use phub_engine::table::init::{philox4x32_10, COS_COEFFS, LN2, LN_COEFFS, PHILOX_M, PHILOX_W};
use phub_engine::table::{Init, RowInit, RowOptimizer, RowUpdate, TableInit};
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------
// §10.5's blocks.

/// One row optimizer's block, by section.
#[derive(Debug, Clone, Default)]
struct RowFormula {
    row_state: Lines,
    element_state: Lines,
    per_table: Lines,
    per_row: Lines,
    per_element: Lines,
}

impl RowFormula {
    fn parse(body: &str) -> RowFormula {
        let mut sections: HashMap<&str, String> = HashMap::new();
        let mut current: Option<&str> = None;
        for line in body.lines() {
            let t = line.trim();
            if t.is_empty() {
                continue;
            }
            if let Some(head) = t.strip_suffix(':') {
                assert!(
                    [
                        "row state",
                        "element state",
                        "per table",
                        "per row",
                        "per element"
                    ]
                    .contains(&head),
                    "unknown section `{t}`"
                );
                assert!(!sections.contains_key(head), "two `{t}` sections");
                sections.insert(head, String::new());
                current = Some(head);
                continue;
            }
            let head = current.unwrap_or_else(|| panic!("`{t}` is in no section"));
            let text = sections.get_mut(head).unwrap();
            text.push_str(t);
            text.push('\n');
        }
        let part = |name: &str| sections.get(name).map(|t| parse_lines(t)).unwrap_or_default();
        let f = RowFormula {
            row_state: part("row state"),
            element_state: part("element state"),
            per_table: part("per table"),
            per_row: part("per row"),
            per_element: part("per element"),
        };
        assert!(!f.per_element.is_empty(), "a block updates its elements:\n{body}");
        f
    }

    fn mutated(body: &str, from: &str, to: &str) -> RowFormula {
        assert!(body.contains(from), "`{from}` is not in the block:\n{body}");
        RowFormula::parse(&body.replace(from, to))
    }
}

fn row_formulas(doc: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for (body, name) in blocks(doc, "row-optimizer") {
        assert!(
            out.insert(name.clone(), body).is_none(),
            "two blocks for `{name}`"
        );
    }
    let mut names: Vec<&str> = out.keys().map(String::as_str).collect();
    names.sort_unstable();
    let mut want: Vec<&str> = every_kind().iter().map(RowOptimizer::name).collect();
    want.sort_unstable();
    assert_eq!(names, want, "one ```row-optimizer block per row optimizer");
    out
}

/// The hyper-parameters by the names the blocks use.
fn hyper_parameters(opt: &RowOptimizer) -> Env {
    let pairs: Vec<(&str, f32)> = match *opt {
        RowOptimizer::Sum => vec![],
        RowOptimizer::Sgd { lr } => vec![("lr", lr)],
        RowOptimizer::Adagrad {
            lr,
            eps,
            initial_accumulator,
            ..
        } => vec![("lr", lr), ("eps", eps), ("h0", initial_accumulator)],
        RowOptimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => vec![("lr", lr), ("b1", beta1), ("b2", beta2), ("eps", eps)],
        RowOptimizer::Ftrl { alpha, beta, l1, l2 } => {
            vec![("alpha", alpha), ("beta", beta), ("l1", l1), ("l2", l2)]
        }
    };
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// One of every kind, with hyper-parameters that make wrong readings
/// visible (no powers of two; an l1 that some coordinates cross).
fn every_kind() -> Vec<RowOptimizer> {
    vec![
        RowOptimizer::Sum,
        RowOptimizer::Sgd { lr: 0.3 },
        RowOptimizer::Adagrad {
            lr: 0.3,
            eps: 1e-8,
            initial_accumulator: 0.1,
            rowwise: false,
        },
        RowOptimizer::Adagrad {
            lr: 0.3,
            eps: 1e-3,
            initial_accumulator: 0.1,
            rowwise: true,
        },
        RowOptimizer::Adam {
            lr: 0.3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        RowOptimizer::Ftrl {
            alpha: 0.3,
            beta: 1.0,
            l1: 0.7,
            l2: 0.01,
        },
    ]
}

/// A row as the document describes it: named state of the row and of each
/// element, run by the block's lines.
struct DocRow {
    f: RowFormula,
    pow: fn(f32, u32) -> f32,
    table: Env,
    row: Env,
    elements: Vec<Env>,
}

impl DocRow {
    fn new(f: RowFormula, opt: &RowOptimizer, w: &[f32]) -> DocRow {
        let mut table = hyper_parameters(opt);
        table.insert("D".into(), w.len() as f32);
        for (name, e) in &f.per_table {
            let x = eval_row(e, &table, doc_pow, &[]);
            table.insert(name.clone(), x);
        }
        let mut row = Env::new();
        for (name, e) in &f.row_state {
            row.insert(name.clone(), eval_row(e, &table, doc_pow, &[]));
        }
        let elements = w
            .iter()
            .map(|&w| {
                let mut el = Env::from([("w".to_string(), w)]);
                for (name, e) in &f.element_state {
                    el.insert(name.clone(), eval_row(e, &table, doc_pow, &[]));
                }
                el
            })
            .collect();
        DocRow {
            f,
            pow: doc_pow,
            table,
            row,
            elements,
        }
    }

    /// One update with the round's gradient `a`; returns the new values.
    /// `round` is the round number, a name the document does not use (a
    /// negative check puts it where the row's step count belongs).
    fn update(&mut self, a: &[f32], round: u32) -> Vec<f32> {
        assert_eq!(a.len(), self.elements.len());
        for (el, &g) in self.elements.iter_mut().zip(a) {
            el.insert("a".into(), g);
        }
        let mut env = self.table.clone();
        env.extend(self.row.iter().map(|(k, v)| (k.clone(), *v)));
        env.insert("round".into(), round as f32);
        for (name, e) in &self.f.per_row {
            let x = eval_row(e, &env, self.pow, &self.elements);
            env.insert(name.clone(), x);
        }
        for name in self.row.clone().keys() {
            self.row.insert(name.clone(), env[name]);
        }
        let keep: Vec<String> = std::iter::once("w".to_string())
            .chain(self.f.element_state.iter().map(|(n, _)| n.clone()))
            .collect();
        for el in &mut self.elements {
            let mut scope = env.clone();
            scope.extend(el.iter().map(|(k, v)| (k.clone(), *v)));
            for (name, e) in &self.f.per_element {
                let x = eval_row(e, &scope, self.pow, &[]);
                scope.insert(name.clone(), x);
            }
            for name in &keep {
                el.insert(name.clone(), scope[name]);
            }
        }
        self.elements.iter().map(|el| el["w"]).collect()
    }
}

/// A row as the code keeps it.
struct CodeRow {
    opt: RowOptimizer,
    w: Vec<f32>,
    s: Vec<f32>,
}

impl CodeRow {
    fn new(opt: RowOptimizer, w: &[f32]) -> CodeRow {
        let mut s = vec![f32::NAN; opt.state_len(w.len())];
        opt.init_state(&mut s);
        CodeRow {
            opt,
            w: w.to_vec(),
            s,
        }
    }
    fn update(&mut self, a: &[f32]) -> Vec<f32> {
        self.opt.apply(&mut self.w, &mut self.s, a);
        self.w.clone()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The round's gradient of a row, as §10.5 says: the first contribution
/// copied, each later one added, in arrival order.
fn accumulate(pushes: &[Vec<f32>]) -> Vec<f32> {
    let mut a = pushes[0].clone();
    for p in &pushes[1..] {
        for (x, y) in a.iter_mut().zip(p) {
            *x += *y;
        }
    }
    a
}

/// Mostly moderate, sometimes tiny, huge or a zero of either sign.
fn value(rng: &mut impl Rng) -> f32 {
    match rng.gen_range(0..20) {
        0 => 0.0,
        1 => -0.0,
        2 => rng.gen_range(-1e-30..1e-30),
        3 => rng.gen_range(-1e15..1e15),
        _ => rng.gen_range(-4.0..4.0),
    }
}

/// Runs `opt` on rows of several dims over many rounds in the code and in
/// `formula` (with `pow`); returns how many values differ in their bits.
fn compare(opt: RowOptimizer, formula: &RowFormula, pow: fn(f32, u32) -> f32, seed: u64) -> usize {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut differ = 0;
    for dim in [1usize, 3, 8, 9, 16, 17, 40] {
        let w: Vec<f32> = (0..dim).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let mut c = CodeRow::new(opt, &w);
        let mut d = DocRow::new(formula.clone(), &opt, &w);
        d.pow = pow;
        for round in 1..=12 {
            // Some rounds leave the row alone (it is not updated then).
            if rng.gen_range(0..3) == 0 {
                continue;
            }
            let pushes: Vec<Vec<f32>> = (0..rng.gen_range(1..4))
                .map(|_| (0..dim).map(|_| value(&mut rng)).collect())
                .collect();
            let a = accumulate(&pushes);
            let (got, want) = (c.update(&a), d.update(&a, round));
            differ += bits(&got)
                .iter()
                .zip(bits(&want))
                .filter(|(g, w)| **g != *w)
                .count();
        }
    }
    differ
}

#[test]
fn every_row_optimizer_block_computes_what_the_code_computes_bit_for_bit() {
    let d = doc();
    let formulas = row_formulas(&d);
    for (i, opt) in every_kind().into_iter().enumerate() {
        opt.check().unwrap();
        let f = RowFormula::parse(&formulas[opt.name()]);
        let differ = compare(opt, &f, doc_pow, i as u64);
        assert_eq!(
            differ,
            0,
            "{}: {differ} values differ from PROTOCOL.md's block",
            opt.name()
        );
    }
}

/// The block's state sections say what the code's `state_len` holds.
#[test]
fn the_blocks_state_is_the_codes_state_len() {
    let d = doc();
    let formulas = row_formulas(&d);
    for opt in every_kind() {
        let f = RowFormula::parse(&formulas[opt.name()]);
        for dim in [1usize, 16] {
            assert_eq!(
                opt.state_len(dim),
                f.row_state.len() + dim * f.element_state.len(),
                "{} dim {dim}",
                opt.name()
            );
        }
    }
}

/// Readings the document rules out; each must disagree with the code, or
/// the comparison above proves nothing.
const WRONG_READINGS: [(&str, &str, &str); 6] = [
    ("adagrad-rowwise", "q / D", "q * (1 / D)"),
    (
        "adagrad",
        "lr * a / (sqrt(h) + eps)",
        "lr * (a / (sqrt(h) + eps))",
    ),
    // The step count of the round, not of the row.
    ("adam", "t = t + 1", "t = round"),
    ("adam", "m * c1", "m / (1 - pow(b1, t))"),
    (
        "ftrl",
        "(beta + sqrt(n)) / alpha",
        "beta / alpha + sqrt(n) / alpha",
    ),
    ("ftrl", "z = z + a - o * w", "z = z + a - o"),
];

#[test]
fn the_readings_the_document_rules_out_disagree_with_the_code() {
    let d = doc();
    let formulas = row_formulas(&d);
    let kinds = every_kind();
    let of = |name: &str| *kinds.iter().find(|o| o.name() == name).unwrap();
    for (name, from, to) in WRONG_READINGS {
        let f = RowFormula::mutated(&formulas[name], from, to);
        let differ = compare(of(name), &f, doc_pow, 99);
        assert!(differ > 0, "{name} with `{to}` for `{from}` agrees with the code");
    }
    let f = RowFormula::parse(&formulas["adam"]);
    assert!(
        compare(of("adam"), &f, running_product, 99) > 0,
        "adam with b^t as a running product"
    );
}

/// The running sum of `a * a` (what a plain loop computes) differs from
/// `sum8`: checked on the code directly, since the notation has no loop.
#[test]
fn sum8_is_not_the_running_sum() {
    let opt = every_kind()[3];
    assert_eq!(opt.name(), "adagrad-rowwise");
    let a: Vec<f32> = (0..16).map(|i| 1.0 + i as f32 * 0.37).collect();
    let mut c = CodeRow::new(opt, &[0.0; 16]);
    c.update(&a);
    let running = a.iter().fold(0.0f32, |s, x| s + x * x);
    let h_running = 0.1f32 + running / 16.0;
    assert_ne!(c.s[0].to_bits(), h_running.to_bits(), "{} {h_running}", c.s[0]);
}

// ---------------------------------------------------------------------------
// §10.5's worked examples.

/// One ```row-example block: the optimizer, each row's values before its
/// first update, then per round the contributions in arrival order (row
/// and values) and the results stated (row and bits).
#[derive(Debug)]
struct Example {
    opt: RowOptimizer,
    rows: BTreeMap<u64, Vec<f32>>,
    rounds: Vec<Round>,
}

#[derive(Debug, Default)]
struct Round {
    pushes: Vec<(u64, Vec<f32>)>,
    results: Vec<(u64, Vec<u32>)>,
}

fn decimals(s: &str) -> Vec<f32> {
    s.split_whitespace()
        .map(|x| x.parse().unwrap_or_else(|_| panic!("`{x}` is not a decimal")))
        .collect()
}

fn hex32(s: &str) -> Vec<u32> {
    s.split_whitespace()
        .map(|x| {
            let h = x
                .strip_prefix("0x")
                .unwrap_or_else(|| panic!("`{x}`: 0x and 8 hex digits"));
            assert_eq!(h.len(), 8, "`{x}`: 0x and 8 hex digits");
            u32::from_str_radix(h, 16).unwrap()
        })
        .collect()
}

/// The optimizer of an example line: JSON as a table spec writes it.
fn row_optimizer(json: &str) -> RowOptimizer {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("`{k}` in {json}")) as f32;
    match v["kind"].as_str().unwrap() {
        "sum" => RowOptimizer::Sum,
        "sgd" => RowOptimizer::Sgd { lr: f("lr") },
        "adagrad" => RowOptimizer::Adagrad {
            lr: f("lr"),
            eps: f("eps"),
            initial_accumulator: f("initial_accumulator"),
            rowwise: v["rowwise"].as_bool().unwrap(),
        },
        "adam" => RowOptimizer::Adam {
            lr: f("lr"),
            beta1: f("beta1"),
            beta2: f("beta2"),
            eps: f("eps"),
        },
        "ftrl" => RowOptimizer::Ftrl {
            alpha: f("alpha"),
            beta: f("beta"),
            l1: f("l1"),
            l2: f("l2"),
        },
        k => panic!("unknown row optimizer `{k}`"),
    }
}

fn parse_example(body: &str) -> Example {
    let mut opt = None;
    let mut rows = BTreeMap::new();
    let mut rounds: Vec<Round> = Vec::new();
    let round_of = |rounds: &mut Vec<Round>, r: usize, line: &str| {
        if rounds.len() < r {
            assert_eq!(rounds.len() + 1, r, "rounds in order: `{line}`");
            rounds.push(Round::default());
        }
        r - 1
    };
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        let (head, values) = rest.split_once(':').unwrap_or((rest, ""));
        let h: Vec<&str> = head.split_whitespace().collect();
        match word {
            "optimizer" => opt = Some(row_optimizer(rest.trim())),
            "row" => {
                let [id] = h[..] else {
                    panic!("`{line}`: row ID: values")
                };
                rows.insert(id.parse().unwrap(), decimals(values));
            }
            "push" | "result" => {
                let [r, id] = h[..] else {
                    panic!("`{line}`: {word} ROUND ROW: values")
                };
                let (r, id): (usize, u64) = (r.parse().unwrap(), id.parse().unwrap());
                assert!(rows.contains_key(&id), "`{line}`: row {id} has no initial values");
                let i = round_of(&mut rounds, r, line);
                if word == "push" {
                    assert!(rounds[i].results.is_empty(), "`{line}` after the round's results");
                    rounds[i].pushes.push((id, decimals(values)));
                } else {
                    rounds[i].results.push((id, hex32(values)));
                }
            }
            _ => panic!("unknown example line `{line}`"),
        }
    }
    Example {
        opt: opt.expect("an optimizer line"),
        rows,
        rounds,
    }
}

/// Runs an example through `update` (one per row, per round the row was
/// pushed) and returns, per round, the values of the rows it states.
fn run_example<R>(
    ex: &Example,
    mut new: impl FnMut(&[f32]) -> R,
    mut update: impl FnMut(&mut R, &[f32], u32) -> Vec<f32>,
) -> Vec<Vec<(u64, Vec<u32>)>> {
    let mut rows: BTreeMap<u64, (R, Vec<f32>)> =
        ex.rows.iter().map(|(&id, w)| (id, (new(w), w.clone()))).collect();
    let mut out = Vec::new();
    for (r, round) in ex.rounds.iter().enumerate() {
        let mut by_row: BTreeMap<u64, Vec<Vec<f32>>> = BTreeMap::new();
        for (id, v) in &round.pushes {
            by_row.entry(*id).or_default().push(v.clone());
        }
        for (id, pushes) in &by_row {
            let (row, last) = rows.get_mut(id).unwrap();
            *last = update(row, &accumulate(pushes), r as u32 + 1);
        }
        out.push(
            round
                .results
                .iter()
                .map(|(id, _)| (*id, bits(&rows[id].1)))
                .collect(),
        );
    }
    out
}

fn stated(ex: &Example) -> Vec<Vec<(u64, Vec<u32>)>> {
    ex.rounds.iter().map(|r| r.results.clone()).collect()
}

fn examples(doc: &str) -> Vec<Example> {
    blocks(doc, "row-example")
        .iter()
        .map(|(b, _)| parse_example(b))
        .collect()
}

fn by_formula(ex: &Example, f: &RowFormula) -> Vec<Vec<(u64, Vec<u32>)>> {
    run_example(
        ex,
        |w| DocRow::new(f.clone(), &ex.opt, w),
        |d, a, r| d.update(a, r),
    )
}

fn show(got: &[Vec<(u64, Vec<u32>)>]) -> String {
    let mut s = String::new();
    for (r, rows) in got.iter().enumerate() {
        for (id, b) in rows {
            let hex: Vec<String> = b.iter().map(|x| format!("{x:#010x}")).collect();
            s += &format!("result {} {id}: {}\n", r + 1, hex.join(" "));
        }
    }
    s
}

#[test]
fn every_row_example_is_what_the_code_and_the_blocks_compute() {
    let d = doc();
    let formulas = row_formulas(&d);
    let exs = examples(&d);
    let mut seen: Vec<&str> = exs.iter().map(|e| e.opt.name()).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(
        seen.len(),
        every_kind().len(),
        "an example for every row optimizer: {seen:?}"
    );
    for ex in &exs {
        let name = ex.opt.name();
        ex.opt.check().unwrap();
        let got = run_example(ex, |w| CodeRow::new(ex.opt, w), |c, a, _| c.update(a));
        assert_eq!(got, stated(ex), "{name}: the code gives\n{}", show(&got));
        let f = RowFormula::parse(&formulas[name]);
        assert_eq!(by_formula(ex, &f), stated(ex), "{name}: the block");
    }
}

/// The examples tell the right readings from the wrong ones.
#[test]
fn the_row_examples_catch_the_wrong_readings() {
    let d = doc();
    let formulas = row_formulas(&d);
    let exs = examples(&d);
    let cases = [
        ("adagrad-rowwise", "q / D", "q * (1 / D)"),
        ("adam", "t = t + 1", "t = round"),
        ("adam", "m * c1", "m / (1 - pow(b1, t))"),
        ("ftrl", "z = z + a - o * w", "z = z + a - o"),
        (
            "adagrad",
            "lr * a / (sqrt(h) + eps)",
            "lr * (a / (sqrt(h) + eps))",
        ),
    ];
    for (name, from, to) in cases {
        let ex = exs.iter().find(|e| e.opt.name() == name).unwrap();
        let f = RowFormula::mutated(&formulas[name], from, to);
        assert_ne!(
            by_formula(ex, &f),
            stated(ex),
            "{name}'s example does not tell `{to}` from `{from}`"
        );
    }
    // The sum's example depends on the arrival order.
    let ex = exs.iter().find(|e| e.opt.name() == "sum").unwrap();
    let mut reversed = Example {
        opt: ex.opt,
        rows: ex.rows.clone(),
        rounds: Vec::new(),
    };
    for r in &ex.rounds {
        let mut pushes = r.pushes.clone();
        pushes.reverse();
        reversed.rounds.push(Round {
            pushes,
            results: r.results.clone(),
        });
    }
    let f = RowFormula::parse(&formulas["sum"]);
    assert_ne!(
        by_formula(&reversed, &f),
        stated(ex),
        "sum's example does not depend on the arrival order"
    );
    // FTRL's example has exact zeros (|z| <= l1) and non-zeros.
    let ex = exs.iter().find(|e| e.opt.name() == "ftrl").unwrap();
    let all: Vec<u32> = stated(ex).into_iter().flatten().flat_map(|(_, b)| b).collect();
    assert!(
        all.contains(&0) && all.iter().any(|&b| b != 0),
        "ftrl's example: zeros and non-zeros"
    );
}

// ---------------------------------------------------------------------------
// §10.4: initial values.

#[test]
fn the_listed_init_constants_are_the_codes() {
    let d = doc();
    let [(body, _)] = &blocks(&d, "row-init-constants")[..] else {
        panic!("one ```row-init-constants block")
    };
    let mut listed: HashMap<String, u64> = HashMap::new();
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (name, v) = line
            .split_once(' ')
            .unwrap_or_else(|| panic!("`{line}`: NAME 0xHEX"));
        let v = v
            .trim()
            .strip_prefix("0x")
            .unwrap_or_else(|| panic!("`{line}`: NAME 0xHEX"));
        listed.insert(name.to_string(), u64::from_str_radix(v, 16).unwrap());
    }
    let mut want: HashMap<String, u64> = HashMap::new();
    want.insert("M0".into(), PHILOX_M[0].into());
    want.insert("M1".into(), PHILOX_M[1].into());
    want.insert("W0".into(), PHILOX_W[0].into());
    want.insert("W1".into(), PHILOX_W[1].into());
    want.insert("LN2".into(), LN2.to_bits());
    for (j, &c) in LN_COEFFS.iter().enumerate() {
        want.insert(format!("L{j}"), c);
    }
    for (k, &c) in COS_COEFFS.iter().enumerate() {
        want.insert(format!("C{k}"), c);
    }
    assert_eq!(listed, want);
}

#[test]
fn the_init_example_is_what_the_code_computes() {
    let d = doc();
    let [(body, _)] = &blocks(&d, "row-init-example")[..] else {
        panic!("one ```row-init-example block")
    };
    let (mut seed, mut table, mut init) = (None, None, None);
    let mut checked = 0;
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (word, rest) = line.split_once(' ').unwrap();
        let (head, values) = rest.split_once(':').unwrap_or((rest, ""));
        match word {
            "seed" => seed = Some(u64::from_str_radix(rest.trim().strip_prefix("0x").unwrap(), 16).unwrap()),
            "table" => table = Some(rest.trim().parse::<u32>().unwrap()),
            "init" => {
                let v: serde_json::Value = serde_json::from_str(rest.trim()).unwrap();
                let f = |k: &str| v[k].as_f64().unwrap() as f32;
                init = Some(match v["kind"].as_str().unwrap() {
                    "zeros" => Init::Zeros,
                    "uniform" => Init::Uniform { a: f("a"), b: f("b") },
                    "normal" => Init::Normal { std: f("std") },
                    k => panic!("unknown init `{k}`"),
                });
            }
            "philox" => {
                // philox ELEMENT ROW: four words
                let h: Vec<u64> = head.split_whitespace().map(|x| x.parse().unwrap()).collect();
                let [e, id] = h[..] else { panic!("`{line}`") };
                let s = seed.unwrap();
                let w = philox4x32_10(
                    [e as u32, table.unwrap(), id as u32, (id >> 32) as u32],
                    [s as u32, (s >> 32) as u32],
                );
                assert_eq!(w.to_vec(), hex32(values), "`{line}`");
                checked += 1;
            }
            "row" => {
                let id: u64 = head.trim().parse().unwrap();
                let want = hex32(values);
                let t = TableInit::new(init.unwrap(), seed.unwrap(), table.unwrap()).unwrap();
                let mut got = vec![f32::NAN; want.len()];
                t.fill(id, &mut got);
                let hex: Vec<String> = bits(&got).iter().map(|x| format!("{x:#010x}")).collect();
                assert_eq!(bits(&got), want, "`{line}`: the code gives {}", hex.join(" "));
                checked += 1;
            }
            _ => panic!("unknown line `{line}`"),
        }
    }
    assert!(checked >= 4, "the example checks {checked} lines");
}
