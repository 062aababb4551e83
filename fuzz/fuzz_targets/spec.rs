//! Fuzz target: arbitrary UTF-8 through `JobSpec::from_toml` and
//! `JobSpec::from_json`.
//!
//! Neither may panic. A spec either accepts must validate, survive a JSON
//! round trip unchanged, give chunk sizes within the wire's limits, and be
//! placed and costed (layout over two lcores, the memory model's charge)
//! without overflow.
#![no_main]

use libfuzzer_sys::fuzz_target;
use phub_proto::layout::layout;
use phub_proto::memory::{data_bytes, MemoryModel, ResultStore};
use phub_proto::spec::JobSpec;
use phub_proto::wire::MAX_PAYLOAD;

fn check(spec: &JobSpec) {
    spec.validate().expect("an accepted spec validates");
    let json = serde_json::to_string(spec).expect("a spec serializes");
    let back = JobSpec::from_json(&json).expect("a serialized spec parses");
    assert_eq!(&back, spec);
    let elems = spec.chunk_elems() as usize;
    assert!(elems >= 1 && elems * spec.dtype.size() <= MAX_PAYLOAD);
    assert!(elems <= usize::from(u16::MAX), "a chunk's count fits the header");
    let _ = data_bytes(spec, ResultStore::Slot);
    let model = MemoryModel::default();
    let lay = layout(spec, &mut [0, 0], model.chunk_cost(spec, ResultStore::Slot));
    let _ = model.job_cost(spec, &lay, ResultStore::Slot).total();
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(spec) = JobSpec::from_toml(text) {
        check(&spec);
    }
    if let Ok(spec) = JobSpec::from_json(text) {
        check(&spec);
    }
});
