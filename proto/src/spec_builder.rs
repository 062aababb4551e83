//! Job specs built in code rather than written by a user: the tests', the
//! simulator's and the tools' one way to make a [`JobSpec`] (and, with
//! [`JobSpec::to_toml`], the text a tenant would send), instead of a
//! `fn spec(...)` of their own each.
//!
//! Nothing here checks the spec: [`JobSpec::validate`] does, as for a spec
//! parsed from text.

use crate::dtype::Dtype;
use crate::spec::{Appliances, Consistency, JobSpec, KeySpec, Optimizer, PlacementSpec, DEFAULT_CHUNK_BYTES};

impl JobSpec {
    /// A job named `name` of `workers` ranks over keys of these element
    /// counts (unnamed), summed (`[optimizer] kind = "sum"`), everything
    /// else at the defaults a spec without it gets: `f32`,
    /// [`DEFAULT_CHUNK_BYTES`], BSP, no checkpoints, one appliance. The
    /// `with_*` methods change the rest.
    pub fn new(name: &str, workers: u32, elements: &[u64]) -> JobSpec {
        JobSpec {
            name: name.to_string(),
            workers,
            dtype: Dtype::F32,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            optimizer: Optimizer::Sum,
            consistency: Consistency::Sync,
            keys: elements
                .iter()
                .map(|&elements| KeySpec::dense("", elements))
                .collect(),
            checkpoint_interval_s: None,
            placement: None,
        }
    }

    /// With this optimizer.
    pub fn with_optimizer(mut self, optimizer: Optimizer) -> JobSpec {
        self.optimizer = optimizer;
        self
    }

    /// With this element type.
    pub fn with_dtype(mut self, dtype: Dtype) -> JobSpec {
        self.dtype = dtype;
        self
    }

    /// With chunks of this many payload bytes.
    pub fn with_chunk_bytes(mut self, chunk_bytes: u32) -> JobSpec {
        self.chunk_bytes = chunk_bytes;
        self
    }

    /// With this consistency model.
    pub fn with_consistency(mut self, consistency: Consistency) -> JobSpec {
        self.consistency = consistency;
        self
    }

    /// With the keys named, in order (keys past the names stay unnamed).
    pub fn with_key_names(mut self, names: &[&str]) -> JobSpec {
        for (k, n) in self.keys.iter_mut().zip(names) {
            k.name = (*n).to_string();
        }
        self
    }

    /// Sharded over these appliances (`[placement] appliances = ...`).
    pub fn sharded_over(mut self, appliances: Appliances) -> JobSpec {
        self.placement = Some(PlacementSpec {
            appliances,
            hierarchical: false,
            ranks_per_rack: None,
            replicas: 1,
        });
        self
    }

    /// Hierarchical over these appliances, one rack each (`hierarchical =
    /// true`), the workers spread evenly unless
    /// [`JobSpec::with_ranks_per_rack`] says otherwise.
    pub fn hierarchical_over(mut self, appliances: Appliances) -> JobSpec {
        self.placement = Some(PlacementSpec {
            appliances,
            hierarchical: true,
            ranks_per_rack: None,
            replicas: 1,
        });
        self
    }

    /// With this many workers in each rack, in rack order; after
    /// [`JobSpec::hierarchical_over`] (panics without a placement).
    pub fn with_ranks_per_rack(mut self, ranks: &[u32]) -> JobSpec {
        let p = self
            .placement
            .as_mut()
            .expect("ranks per rack are set on a placement: call hierarchical_over first");
        p.ranks_per_rack = Some(ranks.to_vec());
        self
    }

    /// With every chunk on `replicas` appliances (`[placement] replicas`,
    /// PROTOCOL.md §11); after [`JobSpec::sharded_over`] (panics without a
    /// placement).
    pub fn with_replicas(mut self, replicas: u32) -> JobSpec {
        let p = self
            .placement
            .as_mut()
            .expect("replicas are set on a placement: call sharded_over first");
        p.replicas = replicas;
        self
    }

    /// The spec as a tenant writes it in TOML; [`JobSpec::from_toml`]
    /// reads it back equal.
    pub fn to_toml(&self) -> String {
        // A spec's fields are strings, numbers, tables and arrays of
        // tables: nothing the TOML writer refuses.
        toml::to_string(self).expect("a job spec serialises as TOML")
    }
}

impl Appliances {
    /// These appliances, by name, in this order.
    pub fn named(names: &[&str]) -> Appliances {
        Appliances::Names(names.iter().map(|n| (*n).to_string()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What [`JobSpec::to_toml`] writes, [`JobSpec::from_toml`] reads
    /// back the same, with every builder field set.
    #[test]
    fn a_built_spec_reads_back_from_its_toml() {
        let plain = JobSpec::new("plain", 3, &[10, 20]);
        assert_eq!(JobSpec::from_toml(&plain.to_toml()).unwrap(), plain);
        let full = JobSpec::new("full", 4, &[5000, 3])
            .with_optimizer(Optimizer::Sgd {
                lr: 0.125,
                weight_decay: 0.0,
            })
            .with_dtype(Dtype::Bf16)
            .with_chunk_bytes(1024)
            .with_key_names(&["census", "grads"])
            .hierarchical_over(Appliances::named(&["a", "b"]))
            .with_ranks_per_rack(&[1, 3]);
        // A hierarchical job is BSP; the other modes on one appliance.
        let bounded = JobSpec::new("bounded", 2, &[7])
            .with_consistency(Consistency::Bounded { delay: 2 })
            .sharded_over(Appliances::Count(2));
        for spec in [full, bounded, plain.clone().with_consistency(Consistency::Async)] {
            let text = spec.to_toml();
            assert_eq!(JobSpec::from_toml(&text).unwrap(), spec, "{text}");
            assert!(spec.validate().is_ok(), "{text}");
        }
        // The defaults are a spec's without those lines.
        let bare = "name = \"plain\"\nworkers = 3\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 10\n\
                    [[keys]]\nelements = 20\n";
        assert_eq!(JobSpec::from_toml(bare).unwrap(), plain);
    }
}
