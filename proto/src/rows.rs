//! Row-sparse messages of table keys (PROTOCOL.md §10.2): zero-copy views
//! over UDP payloads, as [`crate::wire`] is for dense chunks.
//!
//! A row message has the common 86-byte header of [`crate::wire`]; its type
//! code is one of [`RowMsgType`] (8 to 13, which [`crate::wire::MsgType`]
//! does not name, so an appliance that does not serve tables drops them as
//! `unknown_type`). Some header fields mean something else for a row
//! message ([`RowRepr`]): `slot` carries the row dimension D, `chunk` the
//! message sequence number (or a ROW_END's message count), `key` the
//! table's key index, `count` the number of rows or ids.
//!
//! The payload of ROW_PUSH, ROW_RESULT and ROW_PULL_RESULT is `count` ids
//! (little-endian `u64`) followed by `count` rows of D elements of the
//! job's dtype, in the ids' order ([`Rows`]); a ROW_PULL's is the ids
//! alone ([`Ids`]); ROW_END and ROW_DONE have none.
//!
//! [`parse`] classifies received bytes without panicking or allocating: a
//! valid message with its payload read in place, or the
//! [`DropReason`](crate::wire::DropReason) of the header checks. The
//! checks that need the job (token, table, dim, placement, rounds) are the
//! engine's; their table-specific reasons are [`DropReason`]'s codes 25
//! to 28 ([`DropReason::TABLE`]), counted beside the others.

use crate::spec::ROW_ID_BYTES;
use crate::wire::{flags, DropReason, Header, HEADER_LEN, MAX_PAYLOAD};
use crate::Dtype;

/// The most ROW_PUSH messages one rank may send to one lcore for one
/// table and round (or clock): their sequence numbers are 0 to
/// `MAX_ROW_MESSAGES - 1`, so the appliance's record of which it has is a
/// bitmap of this many bits per rank (PROTOCOL.md §10.3).
pub const MAX_ROW_MESSAGES: u32 = 1024;

/// What a row message's payload holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowPayloadKind {
    /// `count` ids, then `count` rows of `dim` elements.
    Rows,
    /// `count` ids.
    Ids,
    /// Nothing; `count` is 0.
    Empty,
}

/// Message types of table keys (PROTOCOL.md §10.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowMsgType {
    /// Worker to appliance: (id, gradient row) pairs of one round or clock.
    RowPush,
    /// Worker to appliance: the rank has sent all its ROW_PUSH messages of
    /// the round to this lcore; `chunk` says how many.
    RowEnd,
    /// Worker to appliance: ids whose rows the rank wants.
    RowPull,
    /// Appliance to worker: the answer to one ROW_PUSH, its ids with their
    /// rows after the update.
    RowResult,
    /// Appliance to worker: the answer to a ROW_END, the round (clock) is
    /// complete on this lcore.
    RowDone,
    /// Appliance to worker: the answer to a ROW_PULL, its ids with their
    /// rows.
    RowPullResult,
}

impl RowMsgType {
    /// All row message types, in code order.
    pub const ALL: [RowMsgType; 6] = [
        RowMsgType::RowPush,
        RowMsgType::RowEnd,
        RowMsgType::RowPull,
        RowMsgType::RowResult,
        RowMsgType::RowDone,
        RowMsgType::RowPullResult,
    ];

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            RowMsgType::RowPush => 8,
            RowMsgType::RowEnd => 9,
            RowMsgType::RowPull => 10,
            RowMsgType::RowResult => 11,
            RowMsgType::RowDone => 12,
            RowMsgType::RowPullResult => 13,
        }
    }

    /// The row message type a wire code names, if any.
    pub const fn from_code(code: u8) -> Option<RowMsgType> {
        match code {
            8 => Some(RowMsgType::RowPush),
            9 => Some(RowMsgType::RowEnd),
            10 => Some(RowMsgType::RowPull),
            11 => Some(RowMsgType::RowResult),
            12 => Some(RowMsgType::RowDone),
            13 => Some(RowMsgType::RowPullResult),
            _ => None,
        }
    }

    /// Upper-case name as PROTOCOL.md writes it.
    pub const fn name(self) -> &'static str {
        match self {
            RowMsgType::RowPush => "ROW_PUSH",
            RowMsgType::RowEnd => "ROW_END",
            RowMsgType::RowPull => "ROW_PULL",
            RowMsgType::RowResult => "ROW_RESULT",
            RowMsgType::RowDone => "ROW_DONE",
            RowMsgType::RowPullResult => "ROW_PULL_RESULT",
        }
    }

    /// What the payload holds.
    pub const fn payload(self) -> RowPayloadKind {
        match self {
            RowMsgType::RowPush | RowMsgType::RowResult | RowMsgType::RowPullResult => RowPayloadKind::Rows,
            RowMsgType::RowPull => RowPayloadKind::Ids,
            RowMsgType::RowEnd | RowMsgType::RowDone => RowPayloadKind::Empty,
        }
    }

    /// Whether a worker sends it (else the appliance does).
    pub const fn from_worker(self) -> bool {
        matches!(
            self,
            RowMsgType::RowPush | RowMsgType::RowEnd | RowMsgType::RowPull
        )
    }
}

/// A row message's header fields, decoded and validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowRepr {
    /// Message type.
    pub kind: RowMsgType,
    /// Element type of the rows.
    pub dtype: Dtype,
    /// Flag bits (RETRANSMIT only; SHM is refused by the engine).
    pub flags: u8,
    /// The job's token.
    pub token: u64,
    /// Job id.
    pub job: u16,
    /// Sender's rank (0xffff from the appliance).
    pub rank: u16,
    /// Rows (ROW_PUSH, ROW_RESULT, ROW_PULL_RESULT) or ids (ROW_PULL) in
    /// the payload; 0 in ROW_END and ROW_DONE. Header field `count`.
    pub count: u16,
    /// Round (BSP) or the rank's clock (async, bounded delay). Header
    /// field `round`.
    pub round: u32,
    /// Elements per row, the table's `dim`. Header field `slot`.
    pub dim: u32,
    /// The table's index among the job's keys. Header field `key`.
    pub key: u32,
    /// ROW_PUSH and ROW_RESULT: the message's sequence number within the
    /// rank's round (clock) to this lcore, 0 to n − 1. ROW_END and
    /// ROW_DONE: n, the number of ROW_PUSH messages of the round. ROW_PULL
    /// and ROW_PULL_RESULT: a number the worker chooses, echoed. Header
    /// field `chunk`.
    pub seq: u32,
}

impl RowRepr {
    /// Payload bytes this header announces: `count * (8 + dim *
    /// size(dtype))` with rows, `count * 8` with ids, 0 otherwise. `None`
    /// when that exceeds [`MAX_PAYLOAD`] (or overflows).
    pub fn payload_len(&self) -> Option<usize> {
        payload_len(self.kind, self.dtype, self.count, self.dim)
    }

    /// Writes every header field (error, receive-buffer share and reserved
    /// bytes zero); the payload is the caller's ([`write`] writes both).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        h.set_preamble();
        h.set_type_code(self.kind.code());
        h.set_dtype(self.dtype);
        h.set_flags(self.flags);
        h.set_token(self.token);
        h.set_job(self.job);
        h.set_rank(self.rank);
        h.set_count(self.count);
        h.set_error(0);
        h.set_round(self.round);
        h.set_slot(self.dim);
        h.set_key(self.key);
        h.set_chunk(self.seq);
    }
}

fn payload_len(kind: RowMsgType, dtype: Dtype, count: u16, dim: u32) -> Option<usize> {
    let per = match kind.payload() {
        RowPayloadKind::Rows => {
            (ROW_ID_BYTES as u64).checked_add(u64::from(dim).checked_mul(dtype.size() as u64)?)?
        }
        RowPayloadKind::Ids => ROW_ID_BYTES as u64,
        RowPayloadKind::Empty => 0,
    };
    let bytes = per.checked_mul(u64::from(count))?;
    usize::try_from(bytes).ok().filter(|&b| b <= MAX_PAYLOAD)
}

/// The ids of a row message, read in place (little-endian `u64`s, not
/// necessarily aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ids<'a> {
    bytes: &'a [u8],
}

impl<'a> Ids<'a> {
    /// Number of ids.
    pub fn len(&self) -> usize {
        self.bytes.len() / ROW_ID_BYTES
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Id `i`, if `i < len()`.
    pub fn get(&self, i: usize) -> Option<u64> {
        let at = i.checked_mul(ROW_ID_BYTES)?;
        let b: [u8; ROW_ID_BYTES] = self.bytes.get(at..at + ROW_ID_BYTES)?.try_into().ok()?;
        Some(u64::from_le_bytes(b))
    }

    /// The ids in order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + Clone + 'a {
        self.bytes.chunks_exact(ROW_ID_BYTES).map(|c| {
            let mut b = [0u8; ROW_ID_BYTES];
            b.copy_from_slice(c);
            u64::from_le_bytes(b)
        })
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

/// The (id, row) pairs of a row message, read in place: the ids, then the
/// rows as one `count x dim` block of wire elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows<'a> {
    ids: Ids<'a>,
    values: &'a [u8],
    row_bytes: usize,
    dtype: Dtype,
}

impl<'a> Rows<'a> {
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The ids, in row order.
    pub fn ids(&self) -> Ids<'a> {
        self.ids
    }

    /// Every row's wire bytes, row after row.
    pub fn values(&self) -> &'a [u8] {
        self.values
    }

    /// Row `i`'s wire bytes (`dim` elements of the dtype), if `i < len()`.
    pub fn row(&self, i: usize) -> Option<&'a [u8]> {
        if i >= self.len() {
            return None;
        }
        let at = i.checked_mul(self.row_bytes)?;
        self.values.get(at..at.checked_add(self.row_bytes)?)
    }

    /// Row `i` converted to `f32` into `out` (exactly `dim` long); false
    /// when there is no row `i` or `out` has another length.
    pub fn decode_row(&self, i: usize, out: &mut [f32]) -> bool {
        match self.row(i) {
            Some(r) if out.len() * self.dtype.size() == r.len() => {
                crate::dtype::decode(self.dtype, r, out);
                true
            }
            _ => false,
        }
    }
}

/// A row message's payload, by its type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowPayload<'a> {
    /// ROW_PUSH, ROW_RESULT, ROW_PULL_RESULT.
    Rows(Rows<'a>),
    /// ROW_PULL.
    Ids(Ids<'a>),
    /// ROW_END, ROW_DONE.
    Empty,
}

/// Whether a datagram's type byte is a row message's (8 to 13). Whoever
/// receives both kinds looks at it to choose [`parse`] or
/// [`crate::wire::parse`]; a datagram shorter than the header is neither.
pub fn is_row_message(datagram: &[u8]) -> bool {
    datagram.len() >= HEADER_LEN
        && datagram
            .get(crate::wire::field::TYPE)
            .is_some_and(|&t| RowMsgType::from_code(t).is_some())
}

/// Classifies a received row message: its header fields and payload read
/// in place, or why it must be dropped. Checks, in §7's order: truncated,
/// magic, version, type (a row type, else `unknown_type`), dtype, the
/// announced payload within [`MAX_PAYLOAD`] (`count_too_large`), and the
/// datagram's length against it (`length_mismatch`; ROW_END and ROW_DONE
/// have `count` 0 and no payload). Never panics, never allocates.
pub fn parse(datagram: &[u8]) -> Result<(RowRepr, RowPayload<'_>), DropReason> {
    let h = Header::new_checked(datagram)?;
    h.check_phub_v1()?;
    let kind = RowMsgType::from_code(h.type_code()).ok_or(DropReason::UnknownType)?;
    let dtype = Dtype::from_code(h.dtype_code()).ok_or(DropReason::UnknownDtype)?;
    let (count, dim) = (h.count(), h.slot());
    let len = payload_len(kind, dtype, count, dim).ok_or(DropReason::CountTooLarge)?;
    let payload = &datagram[HEADER_LEN..];
    if payload.len() != len || (kind.payload() == RowPayloadKind::Empty && count != 0) {
        return Err(DropReason::LengthMismatch);
    }
    let repr = RowRepr {
        kind,
        dtype,
        flags: h.flags(),
        token: h.token(),
        job: h.job(),
        rank: h.rank(),
        count,
        round: h.round(),
        dim,
        key: h.key(),
        seq: h.chunk(),
    };
    let n = usize::from(count) * ROW_ID_BYTES;
    let body = match kind.payload() {
        RowPayloadKind::Empty => RowPayload::Empty,
        RowPayloadKind::Ids => RowPayload::Ids(Ids { bytes: payload }),
        RowPayloadKind::Rows => {
            let (ids, values) = payload.split_at(n);
            RowPayload::Rows(Rows {
                ids: Ids { bytes: ids },
                values,
                // dim * size <= MAX_PAYLOAD when count >= 1; with no rows
                // it is never used to index.
                row_bytes: usize::try_from(dim)
                    .unwrap_or(usize::MAX)
                    .saturating_mul(dtype.size()),
                dtype,
            })
        }
    };
    debug_assert_eq!(HEADER_LEN + len, datagram.len());
    Ok((repr, body))
}

/// Writes a whole row message into `out`: `repr`'s header, then `ids`
/// and, for a message with rows, `rows` (`ids.len() * repr.dim` values,
/// encoded as `repr.dtype`). Returns the datagram's length.
///
/// # Panics
///
/// When `ids.len()` is not `repr.count`, `rows` has not `count * dim`
/// values (none for a ROW_PULL, ROW_END or ROW_DONE), the payload would
/// exceed [`MAX_PAYLOAD`], or `out` is too short: the sender's own bug.
pub fn write(repr: &RowRepr, ids: &[u64], rows: &[f32], out: &mut [u8]) -> usize {
    let len = repr
        .payload_len()
        .expect("a row message's payload fits MAX_PAYLOAD");
    assert_eq!(
        ids.len(),
        usize::from(repr.count),
        "ids against the header's count"
    );
    let values = match repr.kind.payload() {
        RowPayloadKind::Rows => ids.len() * repr.dim as usize,
        RowPayloadKind::Ids => 0,
        RowPayloadKind::Empty => {
            assert!(ids.is_empty(), "{} carries no ids", repr.kind.name());
            0
        }
    };
    assert_eq!(rows.len(), values, "row values against count x dim");
    let total = HEADER_LEN + len;
    assert!(
        out.len() >= total,
        "{} bytes of room for a {total}-byte message",
        out.len()
    );
    let out = &mut out[..total];
    repr.emit(&mut Header::new_unchecked(&mut *out));
    let (id_bytes, row_bytes) = out[HEADER_LEN..].split_at_mut(ids.len() * ROW_ID_BYTES);
    for (dst, id) in id_bytes.chunks_exact_mut(ROW_ID_BYTES).zip(ids) {
        dst.copy_from_slice(&id.to_le_bytes());
    }
    crate::dtype::encode(repr.dtype, rows, row_bytes);
    total
}

/// ROW_PUSH messages needed for `rows` rows at `per` rows a datagram
/// ([`crate::spec::rows_per_datagram`]): `ceil(rows / per)`, 0 for no
/// rows (the rank then sends its ROW_END with a count of 0).
pub fn messages_for(rows: u64, per: u32) -> u64 {
    assert!(per >= 1, "at least one row fits a datagram (spec validation)");
    rows.div_ceil(u64::from(per))
}

/// Whether the RETRANSMIT flag is set (statistics only, as for dense
/// messages).
pub fn retransmitted(repr: &RowRepr) -> bool {
    repr.flags & flags::RETRANSMIT != 0
}

#[cfg(test)]
// Tests cast small, literal sizes.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use crate::spec::rows_per_datagram;
    use crate::wire::field;
    use proptest::prelude::*;

    fn any_repr() -> impl Strategy<Value = (RowRepr, Vec<u64>, Vec<f32>)> {
        (
            prop::sample::select(RowMsgType::ALL.to_vec()),
            prop::sample::select(Dtype::ALL.to_vec()),
            (any::<u8>(), any::<u64>(), any::<u16>(), any::<u16>()),
            (any::<u32>(), 1u32..64, any::<u32>(), any::<u32>()),
            any::<u64>(),
        )
            .prop_map(
                |(kind, dtype, (flags, token, job, rank), (round, dim, key, seq), salt)| {
                    let per = match kind.payload() {
                        RowPayloadKind::Rows => rows_per_datagram(MAX_PAYLOAD as u32, dim, dtype),
                        RowPayloadKind::Ids => (MAX_PAYLOAD / ROW_ID_BYTES) as u32,
                        RowPayloadKind::Empty => 0,
                    };
                    let count = if per == 0 {
                        0
                    } else {
                        (salt % u64::from(per + 1)) as u16
                    };
                    let ids: Vec<u64> = (0..u64::from(count))
                        .map(|i| salt.rotate_left(i as u32) ^ i)
                        .collect();
                    let values = if kind.payload() == RowPayloadKind::Rows {
                        usize::from(count) * dim as usize
                    } else {
                        0
                    };
                    // Small integers: exact in every dtype.
                    let rows: Vec<f32> = (0..values).map(|i| (i % 97) as f32 - 48.0).collect();
                    let repr = RowRepr {
                        kind,
                        dtype,
                        flags,
                        token,
                        job,
                        rank,
                        count,
                        round,
                        dim,
                        key,
                        seq,
                    };
                    (repr, ids, rows)
                },
            )
    }

    proptest! {
        #[test]
        fn write_then_parse_round_trips((repr, ids, rows) in any_repr()) {
            let mut buf = vec![0xa5u8; HEADER_LEN + MAX_PAYLOAD + 7];
            let n = write(&repr, &ids, &rows, &mut buf);
            let (back, payload) = parse(&buf[..n]).unwrap();
            prop_assert_eq!(back, repr);
            prop_assert!(buf[field::ERROR].iter().chain(&buf[field::RX_SHARE.start..field::RESERVED.end]).all(|&b| b == 0));
            match payload {
                RowPayload::Rows(r) => {
                    prop_assert_eq!(r.ids().iter().collect::<Vec<_>>(), ids.clone());
                    let mut got = vec![0f32; repr.dim as usize];
                    for i in 0..r.len() {
                        prop_assert!(r.decode_row(i, &mut got));
                        let d = repr.dim as usize;
                        prop_assert_eq!(&got[..], &rows[i * d..(i + 1) * d]);
                        prop_assert_eq!(r.ids().get(i), Some(ids[i]));
                    }
                    prop_assert!(r.row(r.len()).is_none());
                    prop_assert!(!r.decode_row(r.len(), &mut got));
                }
                RowPayload::Ids(i) => prop_assert_eq!(i.iter().collect::<Vec<_>>(), ids),
                RowPayload::Empty => prop_assert_eq!(repr.count, 0),
            }
            // Any prefix is refused, and so is one more byte.
            for cut in [0, HEADER_LEN - 1, n.saturating_sub(1)] {
                if cut < n {
                    prop_assert!(parse(&buf[..cut]).is_err());
                }
            }
            prop_assert_eq!(parse(&buf[..n + 1]).unwrap_err(), DropReason::LengthMismatch);
        }

        #[test]
        fn parse_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..3 * HEADER_LEN)) {
            let _ = parse(&bytes);
        }

        /// Bytes behind a valid row header in any amount, with any count
        /// and dim: accepted only when the length is exactly what they
        /// announce, and then every accessor stays in bounds.
        #[test]
        fn parse_accepts_exactly_the_announced_length(
            (repr, _, _) in any_repr(),
            count in any::<u16>(),
            dim in any::<u32>(),
            extra in 0usize..600,
        ) {
            let repr = RowRepr { count, dim, ..repr };
            let mut buf = vec![1u8; HEADER_LEN + extra];
            repr.emit(&mut Header::new_unchecked(&mut buf[..]));
            match parse(&buf) {
                Ok((r, p)) => {
                    prop_assert_eq!(Some(extra), r.payload_len());
                    if let RowPayload::Rows(rows) = p {
                        for i in 0..=rows.len() {
                            let _ = (rows.row(i), rows.ids().get(i));
                        }
                    }
                }
                Err(e) => prop_assert!(matches!(e, DropReason::CountTooLarge | DropReason::LengthMismatch), "{e}"),
            }
        }
    }

    #[test]
    fn each_header_fault_has_its_reason() {
        let repr = RowRepr {
            kind: RowMsgType::RowPush,
            dtype: Dtype::F32,
            flags: 0,
            token: 7,
            job: 1,
            rank: 0,
            count: 2,
            round: 1,
            dim: 4,
            key: 1,
            seq: 0,
        };
        let mut good = vec![0u8; 200];
        let n = write(&repr, &[5, 9], &[1.0; 8], &mut good);
        good.truncate(n);
        assert_eq!(n, HEADER_LEN + 2 * (8 + 16));
        assert!(parse(&good).is_ok());
        assert!(is_row_message(&good));
        let fault = |at: usize, v: u8| {
            let mut b = good.clone();
            b[at] = v;
            parse(&b).unwrap_err()
        };
        assert_eq!(fault(0, 0), DropReason::BadMagic);
        assert_eq!(fault(field::VERSION, 2), DropReason::BadVersion);
        assert_eq!(
            fault(field::TYPE, crate::wire::MsgType::Push.code()),
            DropReason::UnknownType
        );
        assert_eq!(fault(field::TYPE, 14), DropReason::UnknownType);
        assert_eq!(fault(field::DTYPE, 3), DropReason::UnknownDtype);
        // 2 rows of dim 4 in bf16 announce 32 payload bytes, not 48.
        assert_eq!(
            fault(field::DTYPE, Dtype::Bf16.code()),
            DropReason::LengthMismatch
        );
        // Count 0xff02: far beyond the largest payload.
        assert_eq!(fault(field::COUNT.start + 1, 0xff), DropReason::CountTooLarge);
        assert_eq!(fault(field::SLOT.start + 3, 0xff), DropReason::CountTooLarge);
        assert_eq!(parse(&good[..HEADER_LEN - 1]).unwrap_err(), DropReason::Truncated);
        // A dense PUSH is not a row message, and a row message is no dense one.
        assert!(!is_row_message(
            &crate::wire::Repr::request(crate::wire::MsgType::Push, 1, 7, 0, 1, 0).to_bytes()
        ));
        assert_eq!(crate::wire::parse(&good).unwrap_err(), DropReason::UnknownType);
        // A ROW_END with a count or a payload.
        let end = RowRepr {
            kind: RowMsgType::RowEnd,
            count: 0,
            seq: 3,
            ..repr
        };
        let mut b = [0u8; HEADER_LEN];
        write(&end, &[], &[], &mut b);
        assert_eq!(parse(&b).unwrap().0, end);
        let mut with_count = b;
        with_count[field::COUNT.start] = 1;
        assert_eq!(parse(&with_count).unwrap_err(), DropReason::LengthMismatch);
        let mut longer = b.to_vec();
        longer.push(0);
        assert_eq!(parse(&longer).unwrap_err(), DropReason::LengthMismatch);
    }

    /// The fuzz target's seeds (fuzz/gen_seeds.py writes them from
    /// PROTOCOL.md's format) are what this parser reads: all well formed
    /// but the one cut short.
    #[test]
    fn the_fuzz_seeds_parse() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/rows");
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            let got = parse(&bytes);
            if path.to_string_lossy().contains("truncated") {
                assert_eq!(got.unwrap_err(), DropReason::LengthMismatch, "{path:?}");
            } else {
                let (repr, _) = got.unwrap_or_else(|e| panic!("{path:?}: {e}"));
                assert_eq!(repr.key, 1, "{path:?}");
            }
            n += 1;
        }
        assert_eq!(n, 9);
    }

    #[test]
    fn codes_are_dense_and_disjoint_from_the_dense_ones() {
        for (i, t) in RowMsgType::ALL.iter().enumerate() {
            assert_eq!(usize::from(t.code()), crate::wire::MsgType::ALL.len() + 1 + i);
            assert_eq!(RowMsgType::from_code(t.code()), Some(*t));
            assert_eq!(crate::wire::MsgType::from_code(t.code()), None);
        }
        // The table reasons are DropReason's 25 to 28, each told to the
        // sender.
        for (i, r) in DropReason::TABLE.iter().enumerate() {
            assert_eq!(usize::from(r.code()), 25 + i);
            assert_eq!(DropReason::from_code(r.code()), Some(*r));
            assert!(r.notifies_sender(), "{r}");
        }
        assert_eq!(messages_for(0, 122), 0);
        assert_eq!(messages_for(122, 122), 1);
        assert_eq!(messages_for(123, 122), 2);
    }
}
