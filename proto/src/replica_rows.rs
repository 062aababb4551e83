//! Replicas of a job's tables (PROTOCOL.md §11.9): where a backup
//! appliance keeps an entry's rows ([`entry_backup`]), and the two
//! appliance-to-appliance messages that keep a backup's rows bit-identical
//! to their primary's, REPLICATE_ROWS and REPLICATE_ROWS_ACK
//! ([`RowReplicaType`]), as zero-copy views over UDP payloads in the
//! manner of [`crate::replica`].
//!
//! Layer: pure. [`parse`] never panics and never allocates.
//!
//! A BSP round of a table on one entry (an lcore's share of the table,
//! §10.1) is replicated whole: the round's accumulated rows, in the order
//! their ids first arrived at the primary, cut into fragments of
//! [`rows_per_fragment`] rows, each one REPLICATE_ROWS; the backup applies
//! them once it holds them all, with the same store operations in the
//! same order, and answers one REPLICATE_ROWS_ACK.
//!
//! A new backup of an entry (an appliance back, or a backup left when
//! another member adopts the entry) first gets each table's whole state
//! from the entry's primary (a **state copy**): the copy stream
//! ([`write_copy_head`] and the row store's checkpoint) in
//! REPLICATE_TABLE_STATE fragments of [`STATE_BYTES`] bytes, sent a window
//! at a time; the backup acknowledges how many it holds from the first
//! without a gap (REPLICATE_TABLE_STATE_ACK), all of them once the state is
//! installed.

use crate::layout::ChunkRange;
use crate::replica::{backup_runs, place};
use crate::spec::ROW_ID_BYTES;
use crate::wire::{flags, DropReason, Header, HEADER_LEN, MAX_PAYLOAD};
use crate::Dtype;

/// Message types of table replication (PROTOCOL.md §11.9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowReplicaType {
    /// Primary to backup: one fragment of a table round's accumulated
    /// rows on one entry.
    Rows,
    /// Backup to primary: the backup applied that round of that table on
    /// that entry.
    RowsAck,
    /// Primary to new backup: one fragment of a table's state copy on one
    /// entry.
    TableState,
    /// New backup to primary: the fragments of the copy it holds from the
    /// first without a gap (all of them: the copy is installed).
    TableStateAck,
}

impl RowReplicaType {
    /// Both, in code order.
    pub const ALL: [RowReplicaType; 4] = [
        RowReplicaType::Rows,
        RowReplicaType::RowsAck,
        RowReplicaType::TableState,
        RowReplicaType::TableStateAck,
    ];

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            RowReplicaType::Rows => 18,
            RowReplicaType::RowsAck => 19,
            RowReplicaType::TableState => 20,
            RowReplicaType::TableStateAck => 21,
        }
    }

    /// The table replication message type a wire code names, if any.
    pub const fn from_code(code: u8) -> Option<RowReplicaType> {
        match code {
            18 => Some(RowReplicaType::Rows),
            19 => Some(RowReplicaType::RowsAck),
            20 => Some(RowReplicaType::TableState),
            21 => Some(RowReplicaType::TableStateAck),
            _ => None,
        }
    }

    /// Upper-case name as PROTOCOL.md writes it.
    pub const fn name(self) -> &'static str {
        match self {
            RowReplicaType::Rows => "REPLICATE_ROWS",
            RowReplicaType::RowsAck => "REPLICATE_ROWS_ACK",
            RowReplicaType::TableState => "REPLICATE_TABLE_STATE",
            RowReplicaType::TableStateAck => "REPLICATE_TABLE_STATE_ACK",
        }
    }
}

/// Bytes of a REPLICATE_ROWS payload before its ids: the primary's
/// completion time (`u64`), the round's fragment count and the table's
/// dim (`u32` each), little-endian.
pub const ROWS_PREFIX: usize = 16;

/// Rows one REPLICATE_ROWS carries at most for a table of `dim` values a
/// row (`f32`, with their `u64` ids, after the prefix). 0 when not even one
/// fits (a `dim` no table has: spec validation keeps a row and its id
/// within a datagram).
pub const fn rows_per_fragment(dim: u32) -> usize {
    let row = ROW_ID_BYTES + 4 * dim as usize;
    (MAX_PAYLOAD - ROWS_PREFIX) / row
}

/// The fragments of a round of `rows` rows of `dim` values: at least one
/// (an empty round is replicated too: its store's round advances). `None`
/// when `dim` fits no row or the count passes `u32`.
pub fn fragments_of(rows: usize, dim: u32) -> Option<u32> {
    let per = rows_per_fragment(dim);
    if per == 0 {
        return None;
    }
    u32::try_from(rows.div_ceil(per).max(1)).ok()
}

/// A table replication message's header fields, decoded and validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowReplicaRepr {
    /// Message type.
    pub kind: RowReplicaType,
    /// Flag bits (RETRANSMIT on a resent REPLICATE_ROWS).
    pub flags: u8,
    /// The job's token.
    pub token: u64,
    /// Job id.
    pub job: u16,
    /// The sending appliance's index in the job's appliance list: in
    /// REPLICATE_ROWS the entry's home (the appliance whose lcore the
    /// entry is at admission), in REPLICATE_ROWS_ACK the backup's. Header
    /// field `rank`.
    pub from: u16,
    /// REPLICATE_ROWS: the rows in this fragment; REPLICATE_TABLE_STATE:
    /// the copy stream's bytes in it; the ACKs: 0.
    pub count: u16,
    /// The table round replicated (acknowledged); in a state copy, the
    /// primary's last completed round, whose state it is.
    pub round: u32,
    /// The entry e whose rows these are (PROTOCOL.md §10.1). Header field
    /// `slot`.
    pub entry: u32,
    /// The table's key index.
    pub key: u32,
    /// REPLICATE_ROWS and REPLICATE_TABLE_STATE: this fragment's index,
    /// 0 .. n − 1; REPLICATE_ROWS_ACK: 0; REPLICATE_TABLE_STATE_ACK: the
    /// fragments held from the first without a gap, n once installed.
    /// Header field `chunk`.
    pub fragment: u32,
    /// The job layout's epoch the sender holds. Header field `epoch`.
    pub epoch: u32,
}

impl RowReplicaRepr {
    /// Writes every header field (dtype `f32`, error, receive-buffer share
    /// and reserved bytes zero); the payload is the caller's.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        h.set_preamble();
        h.set_type_code(self.kind.code());
        h.set_dtype(Dtype::F32);
        h.set_flags(self.flags);
        h.set_token(self.token);
        h.set_job(self.job);
        h.set_rank(self.from);
        h.set_count(self.count);
        h.set_error(0);
        h.set_round(self.round);
        h.set_slot(self.entry);
        h.set_key(self.key);
        h.set_chunk(self.fragment);
        h.set_epoch(self.epoch);
        h.set_fragment(0, 0);
    }

    /// The header as a fresh array.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        self.emit(&mut Header::new_unchecked(&mut b[..]));
        b
    }

    /// Whether the RETRANSMIT flag is set (statistics only).
    pub fn retransmitted(&self) -> bool {
        self.flags & flags::RETRANSMIT != 0
    }
}

/// A REPLICATE_ROWS payload, checked to be whole: its prefix, then
/// `count` ids and `count` rows of `dim` `f32`s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowsFragment<'a> {
    /// The primary's clock when the round completed there (nanoseconds,
    /// its own epoch): the time the backup's store takes the round at, so
    /// that eviction by `idle_s` evicts the same rows on both.
    pub at_ns: u64,
    /// n, the round's fragment count (at least 1).
    pub fragments: u32,
    /// D, the table's dim.
    pub dim: u32,
    ids: &'a [u8],
    rows: &'a [u8],
}

impl<'a> RowsFragment<'a> {
    /// The fragment's ids, in order.
    pub fn ids(&self) -> impl ExactSizeIterator<Item = u64> + 'a {
        self.ids
            .chunks_exact(ROW_ID_BYTES)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    /// Its rows, `dim` values each, decoded into `out` (cleared first).
    pub fn rows_into(&self, out: &mut Vec<f32>) {
        out.clear();
        out.extend(
            self.rows
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))),
        );
    }

    /// Rows it carries.
    pub fn len(&self) -> usize {
        self.ids.len() / ROW_ID_BYTES
    }

    /// Whether it carries no row (an empty round's one fragment).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Writes a REPLICATE_ROWS payload onto `out`: the prefix, then `ids` and
/// their `rows` (`dim` values each, as `f32` little-endian).
pub fn write_fragment(out: &mut Vec<u8>, at_ns: u64, fragments: u32, dim: u32, ids: &[u64], rows: &[f32]) {
    debug_assert_eq!(rows.len(), ids.len() * dim as usize, "a row per id");
    out.extend_from_slice(&at_ns.to_le_bytes());
    out.extend_from_slice(&fragments.to_le_bytes());
    out.extend_from_slice(&dim.to_le_bytes());
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
    for v in rows {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Bytes of a REPLICATE_TABLE_STATE payload before its slice of the copy
/// stream: the stream's length B (`u64`), the fragment count n and the
/// table's dim (`u32` each), little-endian.
pub const STATE_PREFIX: usize = 16;

/// Bytes of the copy stream one REPLICATE_TABLE_STATE carries (every
/// fragment but the last; the last 1 to this many): S.
pub const STATE_BYTES: usize = MAX_PAYLOAD - STATE_PREFIX;

/// The fragments of a copy stream of `bytes` bytes: ⌈B / S⌉. `None` for
/// an empty stream (a copy holds its head at least) or a count past
/// `u32`.
pub fn state_fragments(bytes: u64) -> Option<u32> {
    if bytes == 0 {
        return None;
    }
    u32::try_from(bytes.div_ceil(STATE_BYTES as u64)).ok()
}

/// A REPLICATE_TABLE_STATE payload, checked to be whole: its prefix, then
/// `count` bytes of the copy stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateFragment<'a> {
    /// B, the copy stream's length.
    pub total: u64,
    /// n, its fragment count (at least 1).
    pub fragments: u32,
    /// D, the table's dim.
    pub dim: u32,
    /// Its slice of the stream.
    pub bytes: &'a [u8],
}

/// Writes a REPLICATE_TABLE_STATE payload onto `out`: the prefix, then
/// `bytes`, the stream's slice.
pub fn write_state_fragment(out: &mut Vec<u8>, total: u64, fragments: u32, dim: u32, bytes: &[u8]) {
    out.extend_from_slice(&total.to_le_bytes());
    out.extend_from_slice(&fragments.to_le_bytes());
    out.extend_from_slice(&dim.to_le_bytes());
    out.extend_from_slice(bytes);
}

/// The samples of eviction by `idle_s` a state copy carries at most (the
/// store's ring).
pub const COPY_MAX_SAMPLES: usize = 32;

/// What a table's state copy carries beside the row store's checkpoint:
/// the clock of its eviction by idle time, which a checkpoint does not
/// keep (a restart starts it over) but a backup must hold to evict the
/// same rows as its primary.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyHead {
    /// The idle sweep's rounds (0: the store has no idle sweep).
    pub idle_rounds: u32,
    /// With `idle_s`: when sampled rounds completed, (round, nanoseconds
    /// on the primary's clock), oldest first, at most
    /// [`COPY_MAX_SAMPLES`].
    pub samples: Vec<(u32, u64)>,
}

/// Writes a copy stream's head onto `out` (PROTOCOL.md §11.9): `u32`
/// the idle sweep's rounds, `u32` T, then T samples of `u32` round and
/// `u64` nanoseconds, little-endian; the row store's checkpoint follows.
pub fn write_copy_head(out: &mut Vec<u8>, head: &CopyHead) {
    out.extend_from_slice(&head.idle_rounds.to_le_bytes());
    // Cast: at most COPY_MAX_SAMPLES (debug-checked).
    debug_assert!(head.samples.len() <= COPY_MAX_SAMPLES);
    #[allow(clippy::cast_possible_truncation)]
    out.extend_from_slice(&(head.samples.len() as u32).to_le_bytes());
    for &(round, ns) in &head.samples {
        out.extend_from_slice(&round.to_le_bytes());
        out.extend_from_slice(&ns.to_le_bytes());
    }
}

/// Reads a copy stream's head: the head and the rest of the stream (the
/// row store's checkpoint), or what is wrong with it.
pub fn read_copy_head(stream: &[u8]) -> Result<(CopyHead, &[u8]), String> {
    let word = |at: usize| -> Result<u32, String> {
        stream
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .ok_or_else(|| format!("a state copy of {} bytes ends in its head", stream.len()))
    };
    let idle_rounds = word(0)?;
    let t = word(4)? as usize;
    if t > COPY_MAX_SAMPLES {
        return Err(format!(
            "a state copy with {t} idle-time samples (at most {COPY_MAX_SAMPLES})"
        ));
    }
    let end = 8 + 12 * t;
    let body = stream
        .get(8..end)
        .ok_or_else(|| format!("a state copy of {} bytes ends in its head", stream.len()))?;
    let samples = body
        .chunks_exact(12)
        .map(|s| {
            (
                u32::from_le_bytes(s[..4].try_into().expect("4 bytes")),
                u64::from_le_bytes(s[4..].try_into().expect("8 bytes")),
            )
        })
        .collect();
    Ok((CopyHead { idle_rounds, samples }, &stream[end..]))
}

/// A table replication message's payload, by its type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowReplicaPayload<'a> {
    /// REPLICATE_ROWS.
    Rows(RowsFragment<'a>),
    /// REPLICATE_TABLE_STATE.
    State(StateFragment<'a>),
    /// The ACKs.
    None,
}

/// Whether a datagram's type byte is a table replication message's (18
/// to 21).
pub fn is_row_replica_message(datagram: &[u8]) -> bool {
    datagram.len() >= HEADER_LEN
        && datagram
            .get(crate::wire::field::TYPE)
            .is_some_and(|&t| RowReplicaType::from_code(t).is_some())
}

/// Parses a table replication message: the header checks of PROTOCOL.md
/// §7 step 1 (magic, version, a known type, `dtype` `f32`), then its
/// length: a REPLICATE_ROWS's payload is its prefix and `count` rows of
/// the prefix's dim with their ids (dim 0, or fragment count 0:
/// `length_mismatch`); a REPLICATE_TABLE_STATE's is its prefix and
/// `count` bytes (dim 0, a stream of 0 bytes, or a fragment count other
/// than the stream's: `length_mismatch`); an ACK has none and `count` 0.
pub fn parse(datagram: &[u8]) -> Result<(RowReplicaRepr, RowReplicaPayload<'_>), DropReason> {
    let h = Header::new_checked(datagram)?;
    h.check_phub_v1()?;
    let kind = RowReplicaType::from_code(h.type_code()).ok_or(DropReason::UnknownType)?;
    let dtype = Dtype::from_code(h.dtype_code()).ok_or(DropReason::UnknownDtype)?;
    if dtype != Dtype::F32 {
        return Err(DropReason::DtypeMismatch);
    }
    let payload = &datagram[HEADER_LEN..];
    if payload.len() > MAX_PAYLOAD {
        return Err(DropReason::CountTooLarge);
    }
    let count = h.count();
    let repr = RowReplicaRepr {
        kind,
        flags: h.flags(),
        token: h.token(),
        job: h.job(),
        from: h.rank(),
        count,
        round: h.round(),
        entry: h.slot(),
        key: h.key(),
        fragment: h.chunk(),
        epoch: h.epoch(),
    };
    let prefix = || -> Result<(u64, u32, u32, &[u8]), DropReason> {
        let (prefix, rest) = payload
            .split_at_checked(ROWS_PREFIX)
            .ok_or(DropReason::LengthMismatch)?;
        let word = |at: usize| u32::from_le_bytes(prefix[at..at + 4].try_into().expect("4 bytes"));
        let first = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
        Ok((first, word(8), word(12), rest))
    };
    match kind {
        RowReplicaType::RowsAck | RowReplicaType::TableStateAck => {
            if count != 0 || !payload.is_empty() {
                return Err(DropReason::LengthMismatch);
            }
            Ok((repr, RowReplicaPayload::None))
        }
        RowReplicaType::Rows => {
            let (at_ns, fragments, dim, rest) = prefix()?;
            let n = usize::from(count);
            let row = 4 * dim as usize;
            if dim == 0 || fragments == 0 || rest.len() != n * (ROW_ID_BYTES + row) {
                return Err(DropReason::LengthMismatch);
            }
            let (ids, rows) = rest.split_at(n * ROW_ID_BYTES);
            Ok((
                repr,
                RowReplicaPayload::Rows(RowsFragment {
                    at_ns,
                    fragments,
                    dim,
                    ids,
                    rows,
                }),
            ))
        }
        RowReplicaType::TableState => {
            let (total, fragments, dim, bytes) = prefix()?;
            if dim == 0 || state_fragments(total) != Some(fragments) || bytes.len() != usize::from(count) {
                return Err(DropReason::LengthMismatch);
            }
            Ok((
                repr,
                RowReplicaPayload::State(StateFragment {
                    total,
                    fragments,
                    dim,
                    bytes,
                }),
            ))
        }
    }
}

/// Each appliance's entries (PROTOCOL.md §10.1), from the appliances'
/// lcore counts in layout order: its lcores, numbered after the earlier
/// appliances'.
pub fn entry_parts(lcores: &[usize]) -> Vec<ChunkRange> {
    lcores
        .iter()
        .scan(0u64, |at, &l| {
            let r = ChunkRange {
                first: *at,
                count: l as u64,
            };
            *at += l as u64;
            Some(r)
        })
        .collect()
}

/// Where backup appliance `b` keeps entry `entry` of appliance `p`'s
/// entries `part` (its lcores as entries of §10.1, `first` the entries of
/// the appliances before it): its lcore among `lcores`, cut as a backup
/// cuts a part's chunks (PROTOCOL.md §11.2, [`backup_runs`] over the
/// entries). `None` when `entry` is not in `part`.
pub fn entry_backup(part: ChunkRange, lcores: usize, entry: u64) -> Option<usize> {
    part.range().contains(&entry).then_some(())?;
    place(&backup_runs(part, lcores), entry).map(|(l, _)| l)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows_repr(count: u16) -> RowReplicaRepr {
        RowReplicaRepr {
            kind: RowReplicaType::Rows,
            flags: 0,
            token: 9,
            job: 3,
            from: 1,
            count,
            round: 4,
            entry: 2,
            key: 1,
            fragment: 0,
            epoch: 5,
        }
    }

    #[test]
    fn a_fragment_round_trips() {
        let ids = [7u64, 1 << 40];
        let rows = [1.5f32, -2.0, 0.25, 3.0];
        let mut d = rows_repr(2).to_bytes().to_vec();
        write_fragment(&mut d, 123_456, 3, 2, &ids, &rows);
        let (r, f) = parse(&d).unwrap();
        assert_eq!(r, rows_repr(2));
        let RowReplicaPayload::Rows(f) = f else {
            panic!("{f:?}")
        };
        assert_eq!((f.at_ns, f.fragments, f.dim, f.len()), (123_456, 3, 2, 2));
        assert_eq!(f.ids().collect::<Vec<_>>(), ids);
        let mut out = Vec::new();
        f.rows_into(&mut out);
        assert_eq!(out, rows);
        // One byte short, or a count the payload does not hold: refused.
        assert_eq!(parse(&d[..d.len() - 1]).unwrap_err(), DropReason::LengthMismatch);
        let mut e = rows_repr(3).to_bytes().to_vec();
        write_fragment(&mut e, 0, 1, 2, &ids, &rows);
        assert_eq!(parse(&e).unwrap_err(), DropReason::LengthMismatch);
    }

    #[test]
    fn an_ack_has_no_payload() {
        let ack = RowReplicaRepr {
            kind: RowReplicaType::RowsAck,
            count: 0,
            ..rows_repr(0)
        };
        let d = ack.to_bytes();
        assert_eq!(parse(&d).unwrap(), (ack, RowReplicaPayload::None));
        let mut longer = d.to_vec();
        longer.push(0);
        assert_eq!(parse(&longer).unwrap_err(), DropReason::LengthMismatch);
        assert!(is_row_replica_message(&d) && !crate::replica::is_replica_message(&d));
    }

    #[test]
    fn a_state_fragment_round_trips_and_its_shape_is_checked() {
        let head = CopyHead {
            idle_rounds: 7,
            samples: vec![(3, 1_000), (9, 2_000_000_000)],
        };
        let mut stream = Vec::new();
        write_copy_head(&mut stream, &head);
        stream.extend_from_slice(b"rows");
        let (back, rest) = read_copy_head(&stream).unwrap();
        assert_eq!((back, rest), (head, &b"rows"[..]));
        assert!(read_copy_head(&stream[..10])
            .unwrap_err()
            .contains("ends in its head"));
        // S = 8816 bytes a fragment: a stream of S + 1 bytes is two.
        assert_eq!(STATE_BYTES, 8816);
        assert_eq!(state_fragments(0), None);
        assert_eq!(state_fragments(8816), Some(1));
        assert_eq!(state_fragments(8817), Some(2));
        let repr = RowReplicaRepr {
            kind: RowReplicaType::TableState,
            count: 4,
            fragment: 1,
            ..rows_repr(0)
        };
        let mut d = repr.to_bytes().to_vec();
        write_state_fragment(&mut d, 8817, 2, 16, b"tail");
        let (r, f) = parse(&d).unwrap();
        assert_eq!(r, repr);
        assert_eq!(
            f,
            RowReplicaPayload::State(StateFragment {
                total: 8817,
                fragments: 2,
                dim: 16,
                bytes: b"tail",
            })
        );
        // A fragment count that is not the stream's, or bytes other than
        // `count`: refused.
        let mut e = repr.to_bytes().to_vec();
        write_state_fragment(&mut e, 8817, 3, 16, b"tail");
        assert_eq!(parse(&e).unwrap_err(), DropReason::LengthMismatch);
        assert_eq!(parse(&d[..d.len() - 1]).unwrap_err(), DropReason::LengthMismatch);
    }

    #[test]
    fn fragments_fill_a_datagram() {
        // D = 16: (8832 - 16) / (8 + 64) = 122 rows a fragment.
        assert_eq!(rows_per_fragment(16), 122);
        assert_eq!(fragments_of(0, 16), Some(1));
        assert_eq!(fragments_of(122, 16), Some(1));
        assert_eq!(fragments_of(123, 16), Some(2));
        let full = rows_per_fragment(16);
        let ids = vec![1u64; full];
        let rows = vec![0f32; full * 16];
        let mut d = rows_repr(u16::try_from(full).unwrap()).to_bytes().to_vec();
        write_fragment(&mut d, 0, 1, 16, &ids, &rows);
        assert!(d.len() - HEADER_LEN <= MAX_PAYLOAD);
        assert!(parse(&d).is_ok());
    }

    #[test]
    fn an_entry_is_backed_up_where_a_backup_cuts_its_part() {
        // Appliance p's entries 3, 4, 5 on a backup with 2 lcores: lcore 0
        // keeps entry 3, lcore 1 entries 4 and 5 (as chunks, §11.2).
        let part = ChunkRange { first: 3, count: 3 };
        assert_eq!(entry_backup(part, 2, 3), Some(0));
        assert_eq!(entry_backup(part, 2, 4), Some(1));
        assert_eq!(entry_backup(part, 2, 5), Some(1));
        assert_eq!(entry_backup(part, 2, 6), None);
        // More backup lcores than entries: some keep none.
        let one = ChunkRange { first: 0, count: 1 };
        assert_eq!(entry_backup(one, 3, 0), Some(2));
    }
}
