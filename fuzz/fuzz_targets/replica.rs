//! Fuzz target: arbitrary bytes through `phub_proto::replica::parse` (the
//! replication messages, PROTOCOL.md §11.3).
//!
//! Parsing must never panic. An accepted datagram must be exactly the
//! header plus the `count` elements its dtype announces (none for a
//! REPLICATE_STATE_ACK; whole further acknowledgements, fewer than
//! `MAX_ACKS`, for a REPLICATE_ACK), the fragment fields read from a
//! REPLICATE_STATE only; writing the parsed fields back gives the same header
//! except the error, receive-buffer share and reserved fields (written as
//! zero); and a dense parse refuses it as `unknown_type`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use phub_proto::replica::{self, ReplicaMsgType};
use phub_proto::wire::{self, field, DropReason, HEADER_LEN, MAX_PAYLOAD};

fuzz_target!(|data: &[u8]| {
    match replica::parse(data) {
        Ok((repr, payload)) => {
            assert!(repr.payload_len() <= MAX_PAYLOAD);
            assert_eq!(payload.len(), repr.payload_len());
            assert_eq!(data.len(), HEADER_LEN + repr.payload_len());
            match repr.kind {
                ReplicaMsgType::StateAck => assert!(payload.is_empty()),
                ReplicaMsgType::ReplicateAck => {
                    assert_eq!(payload.len() % replica::ACK_ENTRY_LEN, 0);
                    assert!(replica::acks(payload).count() < replica::MAX_ACKS);
                }
                _ => {}
            }
            // Only a REPLICATE_STATE reads the fragment fields.
            if repr.kind == ReplicaMsgType::ReplicateState {
                assert_eq!(repr.fragment, data[field::FRAGMENT]);
                assert_eq!(repr.fragments, data[field::FRAGMENTS]);
            } else {
                assert_eq!((repr.fragment, repr.fragments), (0, 0));
            }
            assert!(replica::is_replica_message(data));
            assert_eq!(wire::parse(data).unwrap_err(), DropReason::UnknownType);
            let out = repr.to_bytes();
            assert_eq!(out[..field::ERROR.start], data[..field::ERROR.start]);
            assert_eq!(
                out[field::ROUND.start..field::RX_SHARE.start],
                data[field::ROUND.start..field::RX_SHARE.start]
            );
            assert_eq!(out[field::EPOCH], data[field::EPOCH]);
            let mut back = out.to_vec();
            back.extend_from_slice(payload);
            assert_eq!(replica::parse(&back).expect("written back, it parses").0, repr);
        }
        Err(reason) => {
            assert!(reason.code() <= DropReason::LengthMismatch.code(), "{reason}");
            assert_eq!(reason == DropReason::Truncated, data.len() < HEADER_LEN);
        }
    }
});
