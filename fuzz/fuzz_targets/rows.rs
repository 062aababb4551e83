//! Fuzz target: arbitrary bytes through `phub_proto::rows::parse` (the
//! row messages of table keys, PROTOCOL.md §10.2).
//!
//! Parsing must never panic. An accepted datagram must be exactly the
//! header plus the payload its count, dim, dtype and key-cache form
//! (PROTOCOL.md §10.7) announce; every view of its payload stays in
//! bounds; writing the parsed fields and the payload back gives the same
//! bytes except the error, receive-buffer share and reserved fields (and
//! the prefix's 4 reserved bytes: written as zero); and a dense parse
//! refuses it as `unknown_type`. Refusals are the header checks' or, for
//! the cache flags, `bad_signature`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use phub_proto::rows::{self, KeyCache, RowPayload, KEY_CACHE_PREFIX};
use phub_proto::wire::{self, field, DropReason, HEADER_LEN, MAX_PAYLOAD};

fuzz_target!(|data: &[u8]| {
    match rows::parse(data) {
        Ok((repr, payload)) => {
            let len = repr.payload_len().expect("an accepted message's payload fits");
            assert!(len <= MAX_PAYLOAD);
            assert_eq!(data.len(), HEADER_LEN + len);
            assert!(rows::is_row_message(data));
            assert_eq!(wire::parse(data).unwrap_err(), DropReason::UnknownType);
            let (ids, values): (Vec<u64>, Vec<f32>) = match payload {
                RowPayload::Rows(r) => {
                    let dim = repr.dim as usize;
                    let mut values = vec![0f32; r.len() * dim];
                    for i in 0..r.len() {
                        assert!(r.decode_row(i, &mut values[i * dim..(i + 1) * dim]));
                    }
                    assert!(r.row(r.len()).is_none() && r.ids().get(r.len()).is_none());
                    (r.ids().iter().collect(), values)
                }
                RowPayload::Ids(i) => (i.iter().collect(), Vec::new()),
                RowPayload::Empty => (Vec::new(), Vec::new()),
                // The cached form: rows without ids (a slot holds them);
                // any ids of the count write back the same.
                RowPayload::Cached(bytes) => {
                    assert!(matches!(repr.cache, KeyCache::Cached(_)));
                    let size = repr.dtype.size();
                    assert_eq!(bytes.len() % size, 0);
                    let mut values = vec![0f32; bytes.len() / size];
                    phub_proto::dtype::decode(repr.dtype, bytes, &mut values);
                    (vec![0; usize::from(repr.count)], values)
                }
            };
            assert_eq!(ids.len(), usize::from(repr.count));
            // Written back: the same header fields and ids; rows equal as
            // values (a NaN's payload bits may change through f32).
            let mut out = vec![0u8; data.len()];
            assert_eq!(rows::write(&repr, &ids, &values, &mut out), data.len());
            assert_eq!(out[..field::ERROR.start], data[..field::ERROR.start]);
            assert_eq!(
                out[field::ROUND.start..field::RX_SHARE.start],
                data[field::ROUND.start..field::RX_SHARE.start]
            );
            let prefix = match repr.cache {
                KeyCache::Off => 0,
                _ => KEY_CACHE_PREFIX,
            };
            // The signature and slot, then (but in the cached form) the ids.
            assert_eq!(out[HEADER_LEN..HEADER_LEN + prefix.min(12)], data[HEADER_LEN..HEADER_LEN + prefix.min(12)]);
            if !matches!(repr.cache, KeyCache::Cached(_)) {
                let id_bytes = HEADER_LEN + prefix..HEADER_LEN + prefix + ids.len() * 8;
                assert_eq!(out[id_bytes.clone()], data[id_bytes]);
            }
            let (back, _) = rows::parse(&out).expect("written back, it parses");
            assert_eq!(back, repr);
        }
        Err(reason) => {
            assert!(
                reason.code() <= DropReason::LengthMismatch.code() || reason == DropReason::BadSignature,
                "{reason}"
            );
            assert_eq!(reason == DropReason::Truncated, data.len() < HEADER_LEN);
        }
    }
});
