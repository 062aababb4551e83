//! The notation of PROTOCOL.md's optimizer blocks (§5.6 and §10.5), shared
//! by the tests that run them: fenced blocks, `name = expression` lines in
//! `f32` arithmetic, and an interpreter of them.
//!
//! Functions: `sqrt`, `pow(x, n)` (§5.6), `min` and `max` (§10.5: `x` if
//! `x < y` (`x > y`), else `y`) and the row reduction `sum8(x)` (§10.5),
//! which evaluates `x` once per element of a row.
// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::collections::HashMap;

pub(crate) fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../PROTOCOL.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// The bodies of the fenced blocks whose info string starts with `tag`,
/// each with the rest of its info string.
pub(crate) fn blocks(doc: &str, tag: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(l) = lines.next() {
        let Some(info) = l.strip_prefix("```") else {
            continue;
        };
        let mut words = info.split_whitespace();
        if words.next() != Some(tag) {
            continue;
        }
        let rest = words.collect::<Vec<_>>().join(" ");
        let body: Vec<&str> = lines.by_ref().take_while(|b| b.trim_end() != "```").collect();
        out.push((body.join("\n"), rest));
    }
    out
}

// ---------------------------------------------------------------------------
// The document's notation: `name = expression`, f32 arithmetic.

#[derive(Debug, Clone)]
pub(crate) enum Expr {
    Num(f32),
    Var(String),
    Bin(Box<Expr>, char, Box<Expr>),
    Call(String, Vec<Expr>),
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Tok {
    Num(f32),
    Name(String),
    Op(char),
}

pub(crate) fn tokens(s: &str) -> Vec<Tok> {
    let c: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch.is_ascii_digit() || ch == '.' {
            let start = i;
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '.') {
                // An exponent's sign belongs to the number.
                if (c[i] == 'e' || c[i] == 'E') && i + 1 < c.len() && matches!(c[i + 1], '+' | '-') {
                    i += 1;
                }
                i += 1;
            }
            let text: String = c[start..i].iter().collect();
            out.push(Tok::Num(
                text.parse()
                    .unwrap_or_else(|_| panic!("`{text}` is not a number")),
            ));
        } else if ch.is_ascii_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Tok::Name(c[start..i].iter().collect()));
        } else if "+-*/(),=".contains(ch) {
            out.push(Tok::Op(ch));
            i += 1;
        } else {
            panic!("unexpected `{ch}` in `{s}`");
        }
    }
    out
}

/// Recursive descent: `*` and `/` bind tighter than `+` and `-`; operators
/// of one precedence associate to the left.
struct Parser {
    t: Vec<Tok>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.t.get(self.at)
    }
    fn next(&mut self) -> Tok {
        let t = self
            .t
            .get(self.at)
            .cloned()
            .expect("unexpected end of expression");
        self.at += 1;
        t
    }
    fn expect(&mut self, op: char) {
        assert_eq!(self.next(), Tok::Op(op));
    }
    fn expr(&mut self) -> Expr {
        let mut e = self.term();
        while let Some(Tok::Op(op @ ('+' | '-'))) = self.peek().cloned() {
            self.at += 1;
            e = Expr::Bin(Box::new(e), op, Box::new(self.term()));
        }
        e
    }
    fn term(&mut self) -> Expr {
        let mut e = self.factor();
        while let Some(Tok::Op(op @ ('*' | '/'))) = self.peek().cloned() {
            self.at += 1;
            e = Expr::Bin(Box::new(e), op, Box::new(self.factor()));
        }
        e
    }
    fn factor(&mut self) -> Expr {
        match self.next() {
            Tok::Num(x) => Expr::Num(x),
            Tok::Op('(') => {
                let e = self.expr();
                self.expect(')');
                e
            }
            Tok::Name(n) if self.peek() == Some(&Tok::Op('(')) => {
                self.at += 1;
                let mut args = vec![self.expr()];
                while self.peek() == Some(&Tok::Op(',')) {
                    self.at += 1;
                    args.push(self.expr());
                }
                self.expect(')');
                Expr::Call(n, args)
            }
            Tok::Name(n) => Expr::Var(n),
            t => panic!("unexpected {t:?}"),
        }
    }
}

/// `pow(x, n)` as §5.6 defines it: square-and-multiply from the lowest bit
/// of `n`, each product rounded to `f32`.
pub(crate) fn doc_pow(mut x: f32, mut n: u32) -> f32 {
    let mut p = 1.0f32;
    loop {
        if n % 2 == 1 {
            p *= x;
        }
        n /= 2;
        if n == 0 {
            return p;
        }
        x *= x;
    }
}

/// `x` multiplied `n` times: the reading of `b^t` the document must rule out.
pub(crate) fn running_product(x: f32, n: u32) -> f32 {
    (0..n).fold(1.0f32, |p, _| p * x)
}

pub(crate) type Env = HashMap<String, f32>;

pub(crate) fn eval(e: &Expr, env: &Env, pow: fn(f32, u32) -> f32) -> f32 {
    eval_row(e, env, pow, &[])
}

/// [`eval`] within a row: `sum8(x)` evaluates `x` in each of `elements`
/// (a name is looked up in the element's environment, then in `env`).
pub(crate) fn eval_row(e: &Expr, env: &Env, pow: fn(f32, u32) -> f32, elements: &[Env]) -> f32 {
    let eval = |e: &Expr, env: &Env, pow: fn(f32, u32) -> f32| eval_row(e, env, pow, elements);
    match e {
        Expr::Num(x) => *x,
        Expr::Var(n) => *env.get(n).unwrap_or_else(|| panic!("`{n}` is not defined")),
        Expr::Bin(a, op, b) => {
            let (a, b) = (eval(a, env, pow), eval(b, env, pow));
            match op {
                '+' => a + b,
                '-' => a - b,
                '*' => a * b,
                '/' => a / b,
                _ => unreachable!(),
            }
        }
        Expr::Call(f, args) => match (f.as_str(), &args[..]) {
            ("sqrt", [x]) => eval(x, env, pow).sqrt(),
            ("min", [x, y]) => {
                let (x, y) = (eval(x, env, pow), eval(y, env, pow));
                if x < y {
                    x
                } else {
                    y
                }
            }
            ("max", [x, y]) => {
                let (x, y) = (eval(x, env, pow), eval(y, env, pow));
                if x > y {
                    x
                } else {
                    y
                }
            }
            ("sum8", [x]) => {
                assert!(!elements.is_empty(), "sum8 outside a row");
                let mut p = [0.0f32; 8];
                for (i, el) in elements.iter().enumerate() {
                    let mut scope = env.clone();
                    scope.extend(el.iter().map(|(k, v)| (k.clone(), *v)));
                    p[i % 8] += eval(x, &scope, pow);
                }
                ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]))
            }
            ("pow", [x, n]) => {
                let n = eval(n, env, pow);
                assert!(n >= 1.0 && n.fract() == 0.0, "pow's exponent {n}");
                pow(eval(x, env, pow), n as u32)
            }
            _ => panic!("unknown function {f} with {} arguments", args.len()),
        },
    }
}

pub(crate) type Lines = Vec<(String, Expr)>;

pub(crate) fn parse_lines(text: &str) -> Lines {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            let t = tokens(l);
            let (Some(Tok::Name(name)), Some(Tok::Op('='))) = (t.first(), t.get(1)) else {
                panic!("`{l}` is not `name = expression`")
            };
            let mut p = Parser {
                t: t[2..].to_vec(),
                at: 0,
            };
            let e = p.expr();
            assert_eq!(p.at, p.t.len(), "trailing tokens in `{l}`");
            (name.clone(), e)
        })
        .collect()
}
