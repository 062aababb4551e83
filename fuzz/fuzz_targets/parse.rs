//! Fuzz target: arbitrary bytes through `phub_proto::wire::parse`.
//!
//! Parsing must never panic. An accepted datagram must be exactly header plus
//! the announced payload (none with the SHM flag: it is in shared memory),
//! and emitting the parsed fields must give back the received header except
//! the receive-buffer share (a RESULT's, written apart from the fields) and
//! the reserved bytes, which are emitted as zero.
#![no_main]

use libfuzzer_sys::fuzz_target;
use phub_proto::wire::{self, field, DropReason, Header, HEADER_LEN, MAX_PAYLOAD};

fuzz_target!(|data: &[u8]| {
    match wire::parse(data) {
        Ok((repr, payload)) => {
            assert_eq!(payload.len(), repr.datagram_payload_len());
            assert_eq!(data.len(), HEADER_LEN + payload.len());
            assert!(payload.len() <= MAX_PAYLOAD);
            assert_eq!(payload, &data[HEADER_LEN..]);

            // Re-emitting the fields gives the input's header, the share and
            // the reserved bytes zeroed.
            let out = repr.to_bytes();
            let fields = ..field::RX_SHARE.start;
            assert_eq!(out[fields], data[fields]);
            assert!(out[field::RX_SHARE.start..field::RESERVED.end].iter().all(|&b| b == 0));

            // Emitting over the input itself changes nothing but the share and
            // the reserved bytes, and the result parses to the same fields
            // and payload.
            let mut copy = data.to_vec();
            repr.emit(&mut Header::new_unchecked(&mut copy[..]));
            assert_eq!(copy[fields], data[fields]);
            assert_eq!(copy[HEADER_LEN..], data[HEADER_LEN..]);
            let (back, back_payload) = wire::parse(&copy).expect("re-emitted header parses");
            assert_eq!(back, repr);
            assert_eq!(back_payload, payload);

            // The view's accessors agree with the decoded fields.
            let h = Header::new_checked(data).expect("accepted datagrams hold a header");
            assert_eq!(h.type_code(), repr.kind.code());
            assert_eq!(h.dtype_code(), repr.dtype.code());
            assert_eq!(
                (h.flags(), h.token(), h.job(), h.rank(), h.count(), h.error()),
                (repr.flags, repr.token, repr.job, repr.rank, repr.count, repr.error)
            );
            assert_eq!(
                (h.round(), h.slot(), h.key(), h.chunk()),
                (repr.round, repr.slot, repr.key, repr.chunk)
            );
            let share = &data[field::RX_SHARE];
            assert_eq!(h.rx_share(), u32::from_le_bytes([share[0], share[1], share[2], share[3]]));
        }
        Err(reason) => {
            // parse makes only the header checks; the rest are the engine's.
            assert!(reason.code() <= DropReason::LengthMismatch.code(), "{reason}");
            assert_eq!(reason == DropReason::Truncated, data.len() < HEADER_LEN);
            // After a successful checked constructor no accessor may panic.
            if let Ok(h) = Header::new_checked(data) {
                let _ = (h.magic(), h.version(), h.type_code(), h.dtype_code(), h.flags());
                let _ = (h.token(), h.job(), h.rank(), h.count(), h.error());
                let _ = (h.round(), h.slot(), h.key(), h.chunk(), h.rx_share(), h.payload());
            }
        }
    }
});
