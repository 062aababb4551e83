//! Model profiles: the per-tensor parameter counts `phub-bench run` pushes.
//!
//! Layer: tooling (pure, no I/O). A [`Profile`] is a list of tensors in layer
//! order, each with its element count; `phub-bench` turns it into a job spec
//! with one key per tensor. What matters for a parameter server is the
//! *shape* of the list: a long tail of tiny tensors (biases, batch-norm
//! scales) that carry few bytes, and a few huge ones (the last convolutions,
//! the classifier, the embeddings) that carry most of them.
//!
//! The real models are **computed here from the published architectures'
//! layer shapes**, not pasted as tables of numbers:
//!
//! - `resnet50`: He et al., "Deep Residual Learning for Image Recognition"
//!   (2015), Table 1, 50-layer column, as built by torchvision's `resnet50`:
//!   a 7x7/64 stem convolution, four stages of bottleneck blocks (3, 4, 6, 3
//!   blocks of 1x1 -> 3x3 -> 1x1 convolutions with 64, 128, 256, 512 planes
//!   and expansion 4, a 1x1 projection shortcut in each stage's first block),
//!   and a 2048 -> 1000 classifier. Convolutions have no bias; every
//!   convolution is followed by batch normalisation, whose trainable tensors
//!   are gamma and beta (running statistics are buffers, not gradients).
//!   161 tensors, 25,557,032 parameters.
//! - `vgg16`: Simonyan and Zisserman, "Very Deep Convolutional Networks"
//!   (2014), configuration D, as torchvision's `vgg16`: thirteen 3x3
//!   convolutions with bias (64, 64, M, 128, 128, M, 256 x3, M, 512 x3, M,
//!   512 x3, M) and three fully connected layers 25088 -> 4096 -> 4096 ->
//!   1000 with bias. 32 tensors, 138,357,544 parameters.
//! - `bert-large`: Devlin et al., "BERT" (2018), BERT-large uncased as in
//!   Hugging Face's `BertModel`: 24 layers, hidden 1024, 16 heads,
//!   intermediate 4096, vocabulary 30522, 512 positions, 2 token types.
//!   Embeddings (word, position, token type, LayerNorm gamma/beta); per
//!   layer Q, K, V and attention-output dense weights and biases, attention
//!   LayerNorm, intermediate and output dense, output LayerNorm (16
//!   tensors); the pooler's dense layer. 391 tensors, 335,141,888
//!   parameters (no pre-training heads).
//! - `bert-base`: the same architecture at BERT-base's size: 12 layers,
//!   hidden 768, 12 heads, intermediate 3072. 199 tensors, 109,482,240
//!   parameters.
//!
//! Synthetic profiles: `synthetic:N` (one key of N floats) and
//! `uniform:K:N` (K keys of N floats each). N and K accept the decimal
//! suffixes k, M and G (`synthetic:25.6M`).

use std::fmt;

/// One tensor: a name and its element count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// Name, as the framework calls it (e.g. `layer1.0.conv1.weight`).
    pub name: String,
    /// Elements (parameters).
    pub elements: u64,
}

/// A model: its tensors in layer order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// The name it was loaded by (e.g. `resnet50`, `synthetic:100000`).
    pub name: String,
    /// Tensors in layer order (key i = tensor i).
    pub tensors: Vec<Tensor>,
}

/// Why a profile name was not understood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileError(String);

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProfileError {}

/// The names [`load`] accepts, for help texts and error messages.
pub const NAMES: &str = "resnet50, vgg16, bert-base, bert-large, synthetic:N, uniform:K:N";

impl Profile {
    /// Total elements.
    pub fn elements(&self) -> u64 {
        self.tensors.iter().map(|t| t.elements).sum()
    }

    /// Total bytes as f32.
    pub fn bytes_f32(&self) -> u64 {
        self.elements() * 4
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the profile has no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Largest tensor's elements.
    pub fn largest(&self) -> u64 {
        self.tensors.iter().map(|t| t.elements).max().unwrap_or(0)
    }

    /// Fraction of the bytes carried by the largest `n` tensors.
    pub fn share_of_largest(&self, n: usize) -> f64 {
        let mut e: Vec<u64> = self.tensors.iter().map(|t| t.elements).collect();
        e.sort_unstable_by(|a, b| b.cmp(a));
        let top: u64 = e.iter().take(n).sum();
        top as f64 / self.elements().max(1) as f64
    }

    /// A sum-mode job spec (JSON, as phub-control's admission route takes
    /// it) with one key per tensor.
    pub fn job_json(&self, name: &str, workers: usize, chunk_bytes: u32) -> serde_json::Value {
        let keys: Vec<serde_json::Value> = self
            .tensors
            .iter()
            .map(|t| serde_json::json!({ "name": t.name, "elements": t.elements }))
            .collect();
        serde_json::json!({
            "name": name,
            "workers": workers,
            "dtype": "f32",
            "chunk_bytes": chunk_bytes,
            "optimizer": { "kind": "sum" },
            "keys": keys,
        })
    }
}

/// Parses `N` with an optional decimal suffix k, M or G (`25.6M`).
pub fn parse_count(s: &str) -> Result<u64, ProfileError> {
    let t = s.trim();
    let bad = || ProfileError(format!("{s:?}: expected a count like 100000, 64k, 25.6M or 1G"));
    let (num, mult) = match t.chars().last() {
        Some('k') | Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('G') => (&t[..t.len() - 1], 1e9),
        _ => (t, 1.0),
    };
    if mult == 1.0 {
        return num.parse().map_err(|_| bad());
    }
    let x: f64 = num.parse().map_err(|_| bad())?;
    if !x.is_finite() || x < 0.0 {
        return Err(bad());
    }
    Ok((x * mult).round() as u64)
}

/// Loads a profile by name: one of [`NAMES`].
pub fn load(name: &str) -> Result<Profile, ProfileError> {
    let count = |s: &str| parse_count(s).map_err(|e| ProfileError(format!("model {name:?}: {e}")));
    let tensors = match name {
        "resnet50" | "resnet-50" => resnet50(),
        "vgg16" | "vgg-16" => vgg16(),
        "bert-base" | "bert_base" | "bertbase" => bert(768, 3072, 12),
        "bert-large" | "bert_large" | "bertlarge" => bert(1024, 4096, 24),
        _ => {
            if let Some(n) = name.strip_prefix("synthetic:") {
                let n = positive(count(n)?, name)?;
                vec![Tensor {
                    name: "synthetic".into(),
                    elements: n,
                }]
            } else if let Some(rest) = name.strip_prefix("uniform:") {
                let (k, n) = rest.split_once(':').ok_or_else(|| {
                    ProfileError(format!(
                        "{name:?}: expected uniform:K:N (K keys of N floats each)"
                    ))
                })?;
                let k = positive(count(k)?, name)?;
                let n = positive(count(n)?, name)?;
                if k > 1 << 20 {
                    return Err(ProfileError(format!("{name:?}: at most 1048576 keys")));
                }
                (0..k)
                    .map(|i| Tensor {
                        name: format!("uniform.{i}"),
                        elements: n,
                    })
                    .collect()
            } else {
                return Err(ProfileError(format!("unknown model {name:?}; accepted: {NAMES}")));
            }
        }
    };
    Ok(Profile {
        name: name.to_string(),
        tensors,
    })
}

fn positive(n: u64, name: &str) -> Result<u64, ProfileError> {
    if n == 0 || n > u64::from(u32::MAX) {
        Err(ProfileError(format!(
            "{name:?}: counts must be 1..=4294967295 (a key's elements fit u32)"
        )))
    } else {
        Ok(n)
    }
}

/// Builds tensors in order.
#[derive(Default)]
struct Net(Vec<Tensor>);

impl Net {
    fn push(&mut self, name: String, elements: u64) {
        self.0.push(Tensor { name, elements });
    }

    /// A convolution without bias: `out x in x k x k`.
    fn conv(&mut self, name: &str, cin: u64, cout: u64, k: u64) {
        self.push(format!("{name}.weight"), cout * cin * k * k);
    }

    /// A convolution with bias.
    fn conv_bias(&mut self, name: &str, cin: u64, cout: u64, k: u64) {
        self.conv(name, cin, cout, k);
        self.push(format!("{name}.bias"), cout);
    }

    /// Batch normalisation's trainable tensors (gamma, beta).
    fn bn(&mut self, name: &str, c: u64) {
        self.push(format!("{name}.weight"), c);
        self.push(format!("{name}.bias"), c);
    }

    /// A dense layer `in -> out` with bias.
    fn linear(&mut self, name: &str, cin: u64, cout: u64) {
        self.push(format!("{name}.weight"), cout * cin);
        self.push(format!("{name}.bias"), cout);
    }

    /// LayerNorm's gamma and beta.
    fn layer_norm(&mut self, name: &str, c: u64) {
        self.push(format!("{name}.weight"), c);
        self.push(format!("{name}.bias"), c);
    }
}

/// ResNet-50 v1.5 (torchvision): see the module docs.
fn resnet50() -> Vec<Tensor> {
    let mut n = Net::default();
    n.conv("conv1", 3, 64, 7);
    n.bn("bn1", 64);
    let mut inplanes = 64;
    for (stage, (blocks, planes)) in [(3u64, 64u64), (4, 128), (6, 256), (3, 512)]
        .into_iter()
        .enumerate()
    {
        let out = planes * 4;
        for b in 0..blocks {
            let p = format!("layer{}.{b}", stage + 1);
            n.conv(&format!("{p}.conv1"), inplanes, planes, 1);
            n.bn(&format!("{p}.bn1"), planes);
            n.conv(&format!("{p}.conv2"), planes, planes, 3);
            n.bn(&format!("{p}.bn2"), planes);
            n.conv(&format!("{p}.conv3"), planes, out, 1);
            n.bn(&format!("{p}.bn3"), out);
            if b == 0 {
                // Projection shortcut: the first block changes the width
                // (and, from stage 2 on, the stride).
                n.conv(&format!("{p}.downsample.0"), inplanes, out, 1);
                n.bn(&format!("{p}.downsample.1"), out);
            }
            inplanes = out;
        }
    }
    n.linear("fc", 2048, 1000);
    n.0
}

/// VGG-16, configuration D (torchvision): see the module docs.
fn vgg16() -> Vec<Tensor> {
    const CFG: [u64; 13] = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512];
    let mut n = Net::default();
    let mut cin = 3;
    // torchvision numbers the layers of `features` including ReLUs and
    // max-pools; the convolutions sit at these indices.
    const INDEX: [u32; 13] = [0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28];
    for (&cout, idx) in CFG.iter().zip(INDEX) {
        n.conv_bias(&format!("features.{idx}"), cin, cout, 3);
        cin = cout;
    }
    // Five 2x2 max-pools take 224x224 to 7x7.
    n.linear("classifier.0", 512 * 7 * 7, 4096);
    n.linear("classifier.3", 4096, 4096);
    n.linear("classifier.6", 4096, 1000);
    n.0
}

/// BERT (Hugging Face `BertModel`) with hidden size `hidden`, intermediate
/// size `inter` and `layers` layers: see the module docs.
fn bert(hidden: u64, inter: u64, layers: usize) -> Vec<Tensor> {
    let mut n = Net::default();
    n.push("embeddings.word_embeddings.weight".into(), 30522 * hidden);
    n.push("embeddings.position_embeddings.weight".into(), 512 * hidden);
    n.push("embeddings.token_type_embeddings.weight".into(), 2 * hidden);
    n.layer_norm("embeddings.LayerNorm", hidden);
    for l in 0..layers {
        let p = format!("encoder.layer.{l}");
        for m in ["query", "key", "value"] {
            n.linear(&format!("{p}.attention.self.{m}"), hidden, hidden);
        }
        n.linear(&format!("{p}.attention.output.dense"), hidden, hidden);
        n.layer_norm(&format!("{p}.attention.output.LayerNorm"), hidden);
        n.linear(&format!("{p}.intermediate.dense"), hidden, inter);
        n.linear(&format!("{p}.output.dense"), inter, hidden);
        n.layer_norm(&format!("{p}.output.LayerNorm"), hidden);
    }
    n.linear("pooler.dense", hidden, hidden);
    n.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resnet50_matches_the_published_counts() {
        let p = load("resnet50").unwrap();
        assert_eq!(p.len(), 161);
        // torchvision's resnet50: sum(p.numel() for p in m.parameters()).
        assert_eq!(p.elements(), 25_557_032);
        assert_eq!(p.tensors[0].name, "conv1.weight");
        assert_eq!(p.tensors[0].elements, 64 * 3 * 7 * 7);
        assert_eq!(p.tensors.last().unwrap().name, "fc.bias");
        // The long tail: 107 of 161 tensors (batch norm, fc.bias) hold about
        // 0.2% of the parameters; the ten largest hold more than half.
        let tiny = p.tensors.iter().filter(|t| t.elements <= 2048).count();
        assert_eq!(tiny, 107);
        assert!(p.share_of_largest(10) > 0.5);
        assert_eq!(p.largest(), 512 * 512 * 9);
    }

    #[test]
    fn vgg16_matches_the_published_counts() {
        let p = load("vgg16").unwrap();
        assert_eq!(p.len(), 32);
        assert_eq!(p.elements(), 138_357_544);
        assert_eq!(p.largest(), 25088 * 4096);
        assert!(p.share_of_largest(1) > 0.74);
    }

    #[test]
    fn bert_large_matches_the_published_counts() {
        let p = load("bert-large").unwrap();
        assert_eq!(p.len(), 391);
        assert_eq!(p.elements(), 335_141_888);
        assert_eq!(p.tensors[0].elements, 30522 * 1024);
    }

    #[test]
    fn bert_base_matches_the_published_counts() {
        let p = load("bert-base").unwrap();
        assert_eq!(p.len(), 199);
        // bert-base-uncased's BertModel: sum(p.numel() for p in m.parameters()).
        assert_eq!(p.elements(), 109_482_240);
        assert_eq!(p.tensors[0].elements, 30522 * 768);
    }

    #[test]
    fn synthetic_and_uniform() {
        let s = load("synthetic:100000").unwrap();
        assert_eq!((s.len(), s.elements()), (1, 100_000));
        let s = load("synthetic:25.6M").unwrap();
        assert_eq!(s.elements(), 25_600_000);
        let u = load("uniform:10:4k").unwrap();
        assert_eq!((u.len(), u.elements()), (10, 40_000));
        assert!(u.tensors.iter().all(|t| t.elements == 4000));
        assert_eq!(u.tensors[3].name, "uniform.3");
    }

    #[test]
    fn bad_names_say_what_is_accepted() {
        for bad in [
            "resnet",
            "synthetic:",
            "synthetic:0",
            "synthetic:x",
            "uniform:3",
            "uniform:0:5",
        ] {
            let e = load(bad).unwrap_err().to_string();
            assert!(e.contains(bad.split(':').next().unwrap()), "{bad}: {e}");
        }
        assert!(load("resnet").unwrap_err().to_string().contains(NAMES));
        assert!(load("synthetic:5000000000").is_err());
    }

    #[test]
    fn job_json_is_a_valid_spec() {
        let p = load("resnet50").unwrap();
        let j = p.job_json("bench", 2, 8192);
        let spec = phub_proto::spec::JobSpec::from_json(&j.to_string()).unwrap();
        assert_eq!(spec.keys.len(), 161);
        assert_eq!(spec.workers, 2);
        assert_eq!(spec.keys.iter().map(|k| k.elements).sum::<u64>(), 25_557_032);
    }
}
