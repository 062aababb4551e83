//! `f32` <-> wire elements: phub-proto's codec, which the dataplane uses too.

pub(crate) use phub_proto::dtype::{decode, encode};
