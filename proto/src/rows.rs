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
    /// Flag bits but the key cache's (RETRANSMIT; SHM is refused by the
    /// engine). [`RowRepr::emit`] writes KEYS_STORE or KEYS_CACHED by
    /// `cache` alone.
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
    /// The key-cache form of the message (PROTOCOL.md §10.7): its flag
    /// and the prefix its payload starts with.
    pub cache: KeyCache,
}

/// A key-cache prefix (PROTOCOL.md §10.7): which slot of the sender's
/// cache on the lcore, and the signature ([`ids_signature`]) of the id
/// list in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheRef {
    /// The id list's signature.
    pub sig: u64,
    /// The slot, below the table's `key_cache`.
    pub slot: u32,
}

/// Bytes of the key-cache prefix: the signature (`u64`), the slot
/// (`u32`) and 4 reserved bytes (zero), all little-endian.
pub const KEY_CACHE_PREFIX: usize = 16;

/// How a table message's ids travel (PROTOCOL.md §10.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyCache {
    /// In the payload, no prefix: the default.
    #[default]
    Off,
    /// In the payload after the prefix; the lcore keeps them in the slot
    /// (flag KEYS_STORE). Only ROW_PUSH and ROW_PULL.
    Store(CacheRef),
    /// Not in the payload: the prefix names the slot that holds them
    /// (flag KEYS_CACHED). ROW_PUSH, ROW_PULL and their answers.
    Cached(CacheRef),
}

impl KeyCache {
    /// The flag bit of this form (none when off).
    pub const fn flag(self) -> u8 {
        match self {
            KeyCache::Off => 0,
            KeyCache::Store(_) => flags::KEYS_STORE,
            KeyCache::Cached(_) => flags::KEYS_CACHED,
        }
    }

    /// The prefix, when there is one.
    pub const fn reference(self) -> Option<CacheRef> {
        match self {
            KeyCache::Off => None,
            KeyCache::Store(r) | KeyCache::Cached(r) => Some(r),
        }
    }
}

/// The signature of an id list (PROTOCOL.md §10.7): `h = mix64(SIG_TAG)`,
/// then `h = mix64(h ^ id)` for each id in order, then `mix64(h ^ n)`
/// with n the number of ids ([`crate::placement::mix64`]).
pub fn ids_signature(ids: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = crate::placement::mix64(SIG_TAG);
    let mut n = 0u64;
    for id in ids {
        h = crate::placement::mix64(h ^ id);
        n += 1;
    }
    crate::placement::mix64(h ^ n)
}

/// The tag [`ids_signature`] starts from: "phubsig\0" little-endian.
pub const SIG_TAG: u64 = u64::from_le_bytes(*b"phubsig\0");

impl RowRepr {
    /// Payload bytes this header announces: `count * (8 + dim *
    /// size(dtype))` with rows, `count * 8` with ids, 0 otherwise. `None`
    /// when that exceeds [`MAX_PAYLOAD`] (or overflows).
    pub fn payload_len(&self) -> Option<usize> {
        payload_len(self.kind, self.dtype, self.count, self.dim, self.cache)
    }

    /// Writes every header field (error, receive-buffer share and reserved
    /// bytes zero); the payload is the caller's ([`write`] writes both).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        h.set_preamble();
        h.set_type_code(self.kind.code());
        h.set_dtype(self.dtype);
        h.set_flags(self.flags & !(flags::KEYS_STORE | flags::KEYS_CACHED) | self.cache.flag());
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

fn payload_len(kind: RowMsgType, dtype: Dtype, count: u16, dim: u32, cache: KeyCache) -> Option<usize> {
    let row = u64::from(dim).checked_mul(dtype.size() as u64)?;
    let id = match cache {
        KeyCache::Cached(_) => 0,
        _ => ROW_ID_BYTES as u64,
    };
    let per = match kind.payload() {
        RowPayloadKind::Rows => id.checked_add(row)?,
        RowPayloadKind::Ids => id,
        RowPayloadKind::Empty => 0,
    };
    let prefix = match cache {
        KeyCache::Off => 0,
        _ => KEY_CACHE_PREFIX as u64,
    };
    let bytes = per.checked_mul(u64::from(count))?.checked_add(prefix)?;
    usize::try_from(bytes).ok().filter(|&b| b <= MAX_PAYLOAD)
}

/// The ids of a row message, read in place (little-endian `u64`s, not
/// necessarily aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ids<'a> {
    bytes: &'a [u8],
}

impl<'a> Ids<'a> {
    /// The ids in `bytes` (little-endian `u64`s, as on the wire), or
    /// `None` when its length is not a multiple of 8: a key cache's slot
    /// holds its ids so (PROTOCOL.md §10.7).
    pub fn from_bytes(bytes: &'a [u8]) -> Option<Ids<'a>> {
        bytes.len().is_multiple_of(ROW_ID_BYTES).then_some(Ids { bytes })
    }

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
    /// `ids` with their rows in `values` (`ids.len()` rows of `dim`
    /// elements of `dtype`, as on the wire), or `None` when `values` has
    /// another length: a cached message's rows with the ids its slot
    /// holds (PROTOCOL.md §10.7).
    pub fn with_ids(ids: Ids<'a>, values: &'a [u8], dim: u32, dtype: Dtype) -> Option<Rows<'a>> {
        let row_bytes = usize::try_from(dim).ok()?.checked_mul(dtype.size())?;
        (ids.len().checked_mul(row_bytes)? == values.len()).then_some(Rows {
            ids,
            values,
            row_bytes,
            dtype,
        })
    }

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

    /// Every row converted to `f32` into `out` (exactly `len() * dim`
    /// long, row after row), as [`Rows::decode_row`] would row by row, in
    /// one pass; false when `out` has another length.
    pub fn decode_all(&self, out: &mut [f32]) -> bool {
        if out.len().checked_mul(self.dtype.size()) != Some(self.values.len()) {
            return false;
        }
        crate::dtype::decode(self.dtype, self.values, out);
        true
    }

    /// Every row converted to `f32` onto the end of `out`, row after row
    /// ([`crate::dtype::decode_extend`]): `len() * dim` values.
    pub fn decode_extend(&self, out: &mut Vec<f32>) {
        crate::dtype::decode_extend(self.dtype, self.values, out);
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
    /// A message in the cached form (PROTOCOL.md §10.7, [`KeyCache::Cached`]):
    /// its `count` rows' wire bytes without their ids (none for a
    /// ROW_PULL); the ids are in the slot the prefix names.
    Cached(&'a [u8]),
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
    if kind.payload() == RowPayloadKind::Empty && count != 0 {
        return Err(DropReason::LengthMismatch);
    }
    let raw = h.flags();
    let (payload, cache) = match (raw & flags::KEYS_STORE != 0, raw & flags::KEYS_CACHED != 0) {
        (false, false) => (&datagram[HEADER_LEN..], KeyCache::Off),
        (true, true) => return Err(DropReason::BadSignature),
        _ if kind.payload() == RowPayloadKind::Empty => return Err(DropReason::BadSignature),
        (store, _) => {
            let all = &datagram[HEADER_LEN..];
            let Some((prefix, rest)) = all.split_first_chunk::<KEY_CACHE_PREFIX>() else {
                return Err(DropReason::LengthMismatch);
            };
            let (sig, tail) = prefix.split_at(8);
            let reference = CacheRef {
                sig: u64::from_le_bytes(sig.try_into().unwrap_or_default()),
                slot: u32::from_le_bytes(tail[..4].try_into().unwrap_or_default()),
            };
            (
                rest,
                if store {
                    KeyCache::Store(reference)
                } else {
                    KeyCache::Cached(reference)
                },
            )
        }
    };
    let len = payload_len(kind, dtype, count, dim, cache).ok_or(DropReason::CountTooLarge)?;
    if datagram.len() - HEADER_LEN != len {
        return Err(DropReason::LengthMismatch);
    }
    let repr = RowRepr {
        kind,
        dtype,
        flags: raw & !(flags::KEYS_STORE | flags::KEYS_CACHED),
        token: h.token(),
        job: h.job(),
        rank: h.rank(),
        count,
        round: h.round(),
        dim,
        key: h.key(),
        seq: h.chunk(),
        cache,
    };
    let n = usize::from(count) * ROW_ID_BYTES;
    let body = match kind.payload() {
        _ if matches!(cache, KeyCache::Cached(_)) => RowPayload::Cached(payload),
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

/// Writes a whole row message into `out`: `repr`'s header, then its
/// key-cache prefix if it has one, then `ids` (unless the form is
/// [`KeyCache::Cached`], which leaves them out) and, for a message with
/// rows, `rows` (`ids.len() * repr.dim` values, encoded as
/// `repr.dtype`). Returns the datagram's length.
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
    let mut payload = &mut out[HEADER_LEN..];
    if let Some(r) = repr.cache.reference() {
        let (prefix, rest) = payload.split_at_mut(KEY_CACHE_PREFIX);
        write_prefix(r, prefix);
        payload = rest;
    }
    let written_ids = match repr.cache {
        KeyCache::Cached(_) => 0,
        _ => ids.len(),
    };
    let (id_bytes, row_bytes) = payload.split_at_mut(written_ids * ROW_ID_BYTES);
    for (dst, id) in id_bytes.chunks_exact_mut(ROW_ID_BYTES).zip(ids) {
        dst.copy_from_slice(&id.to_le_bytes());
    }
    crate::dtype::encode(repr.dtype, rows, row_bytes);
    total
}

/// Writes the key-cache prefix `r` into `out` (exactly
/// [`KEY_CACHE_PREFIX`] bytes): signature, slot, 4 zero bytes.
pub fn write_prefix(r: CacheRef, out: &mut [u8]) {
    let (sig, rest) = out.split_at_mut(8);
    sig.copy_from_slice(&r.sig.to_le_bytes());
    rest[..4].copy_from_slice(&r.slot.to_le_bytes());
    rest[4..].fill(0);
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

/// The flags of an answer sent at once to the message `repr`: FIRST_COPY
/// when it came without RETRANSMIT (PROTOCOL.md §10.2).
pub fn answer_flags(repr: &RowRepr) -> u8 {
    if retransmitted(repr) {
        0
    } else {
        flags::FIRST_COPY
    }
}

/// Whether an answer says it answers the first copy of its message.
pub fn answers_first_copy(repr: &RowRepr) -> bool {
    repr.flags & flags::FIRST_COPY != 0
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
            (0u8..3, any::<u64>(), any::<u32>()),
        )
            .prop_map(
                |(
                    kind,
                    dtype,
                    (flags, token, job, rank),
                    (round, dim, key, seq),
                    salt,
                    (form, sig, slot),
                )| {
                    let reference = CacheRef { sig, slot };
                    let cache = match form {
                        _ if kind.payload() == RowPayloadKind::Empty => KeyCache::Off,
                        1 => KeyCache::Store(reference),
                        2 => KeyCache::Cached(reference),
                        _ => KeyCache::Off,
                    };
                    let flags = flags & !(flags::KEYS_STORE | flags::KEYS_CACHED);
                    let room = (MAX_PAYLOAD - KEY_CACHE_PREFIX) as u32;
                    let per = match kind.payload() {
                        RowPayloadKind::Rows => rows_per_datagram(room, dim, dtype),
                        RowPayloadKind::Ids => room / ROW_ID_BYTES as u32,
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
                        cache,
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
            // The ids a slot would hold, as an lcore resolves them.
            let slot_bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
            let payload = match payload {
                RowPayload::Cached(values) => {
                    prop_assert!(matches!(repr.cache, KeyCache::Cached(_)));
                    let held = Ids::from_bytes(&slot_bytes).unwrap();
                    match repr.kind.payload() {
                        RowPayloadKind::Rows => RowPayload::Rows(Rows::with_ids(held, values, repr.dim, repr.dtype).unwrap()),
                        _ => {
                            prop_assert!(values.is_empty());
                            RowPayload::Ids(held)
                        }
                    }
                }
                p => p,
            };
            match payload {
                RowPayload::Cached(_) => unreachable!(),
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
                    // All at once: the same rows; another length refused.
                    let mut all = vec![0f32; r.len() * repr.dim as usize + 1];
                    prop_assert!(!r.decode_all(&mut all));
                    all.pop();
                    prop_assert!(r.decode_all(&mut all));
                    prop_assert_eq!(&all[..], &rows[..all.len()]);
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

    /// PROTOCOL.md §10.7's worked examples.
    #[test]
    fn signatures_are_the_documented_ones() {
        assert_eq!(SIG_TAG, 0x0067_6973_6275_6870);
        assert_eq!(ids_signature([1, 2, 3]), 0x816a_b0be_c48b_d535);
        assert_eq!(ids_signature([42]), 0xc5cf_54e7_cae6_a929);
        assert_ne!(ids_signature([1, 2, 3]), ids_signature([1, 3, 2]));
        assert_ne!(ids_signature([0]), ids_signature([0, 0]));
    }

    /// A prefix on a message without ids, both cache flags, or a payload
    /// shorter than the prefix: refused before anything is read.
    #[test]
    fn key_cache_forms_are_checked() {
        let repr = RowRepr {
            kind: RowMsgType::RowPull,
            round: 0,
            cache: KeyCache::Cached(CacheRef { sig: 9, slot: 3 }),
            ..push_of_two()
        };
        let mut b = vec![0u8; 200];
        let n = write(&repr, &[5, 6], &[], &mut b);
        assert_eq!(n, HEADER_LEN + KEY_CACHE_PREFIX);
        assert_eq!(parse(&b[..n]).unwrap(), (repr, RowPayload::Cached(&[])));
        assert_eq!(b[field::FLAGS], flags::KEYS_CACHED);
        let mut both = b[..n].to_vec();
        both[field::FLAGS] |= flags::KEYS_STORE;
        assert_eq!(parse(&both).unwrap_err(), DropReason::BadSignature);
        assert_eq!(parse(&b[..n - 1]).unwrap_err(), DropReason::LengthMismatch);
        let end = RowRepr {
            kind: RowMsgType::RowEnd,
            count: 0,
            cache: KeyCache::Off,
            ..repr
        };
        let mut e = [0u8; HEADER_LEN];
        write(&end, &[], &[], &mut e);
        e[field::FLAGS] = flags::KEYS_STORE;
        assert_eq!(parse(&e).unwrap_err(), DropReason::BadSignature);
        // The store form: the prefix, then the ids as without one.
        let store = RowRepr {
            cache: KeyCache::Store(CacheRef { sig: 9, slot: 3 }),
            ..repr
        };
        let n = write(&store, &[5, 6], &[], &mut b);
        assert_eq!(n, HEADER_LEN + KEY_CACHE_PREFIX + 16);
        let (back, p) = parse(&b[..n]).unwrap();
        assert_eq!(back, store);
        let RowPayload::Ids(ids) = p else { panic!("{p:?}") };
        assert_eq!(ids.iter().collect::<Vec<_>>(), [5, 6]);
    }

    /// A ROW_PUSH of two rows of dim 4 in f32, round 1, no key cache.
    fn push_of_two() -> RowRepr {
        RowRepr {
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
            cache: KeyCache::Off,
        }
    }

    #[test]
    fn each_header_fault_has_its_reason() {
        let repr = push_of_two();
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
        // The table reasons are DropReason's 25 to 28, 30 and 31, each
        // told to the sender.
        for (r, code) in DropReason::TABLE.iter().zip([25, 26, 27, 28, 30, 31]) {
            assert_eq!(r.code(), code);
            assert_eq!(DropReason::from_code(r.code()), Some(*r));
            assert!(r.notifies_sender(), "{r}");
        }
        assert_eq!(messages_for(0, 122), 0);
        assert_eq!(messages_for(122, 122), 1);
        assert_eq!(messages_for(123, 122), 2);
    }
}
