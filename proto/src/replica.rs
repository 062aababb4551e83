//! Replicas of a job's chunks (PROTOCOL.md §11): which appliances hold a
//! chunk besides its primary ([`replica_set`], the **replica ring**), where
//! a backup appliance keeps the chunks it backs up ([`backup_runs`]), and
//! the appliance-to-appliance messages that keep backups bit-identical
//! to their primary, REPLICATE and REPLICATE_ACK, and that bring a new
//! backup level, REPLICATE_STATE and REPLICATE_STATE_ACK (§11.7)
//! ([`ReplicaMsgType`]), as zero-copy views over UDP payloads in the
//! manner of [`crate::rows`].
//!
//! Layer: pure. [`parse`] never panics and never allocates; the placement
//! functions allocate their answer only.
//!
//! A replication message has the common 86-byte header of [`crate::wire`]
//! with a type code [`crate::wire::MsgType`] does not name (14 to 17), so an
//! appliance that does not replicate drops it as `unknown_type`. Its
//! `rank` is the sending appliance's index in the job's appliance list and
//! its `epoch` ([`crate::wire::field::EPOCH`]) the job layout's epoch; the
//! checks that need the job (token, epoch, roles, addresses, rounds) are
//! the engine's, with one reason of their own, [`DropReason::WrongEpoch`].

use crate::layout::ChunkRange;
use crate::wire::{flags, DropReason, Header, HEADER_LEN, MAX_PAYLOAD};
use crate::Dtype;

/// Most replicas of a chunk, its primary included (`[placement] replicas`).
pub const MAX_REPLICAS: u8 = 3;

/// Message types of replication (PROTOCOL.md §11.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaMsgType {
    /// Primary to backup: a round's aggregate of one chunk (the `f32` sum
    /// of its W contributions, before the optimizer), or round 0's initial
    /// values.
    Replicate,
    /// Backup to primary: the backup applied that round of that chunk.
    ReplicateAck,
    /// Primary to a new backup: one fragment of a chunk's full state
    /// (its last completed round's parameters, optimizer state and stored
    /// result), PROTOCOL.md §11.7.
    ReplicateState,
    /// New backup to primary: the backup installed the whole state copy
    /// of that chunk at that round.
    StateAck,
}

impl ReplicaMsgType {
    /// Both, in code order.
    pub const ALL: [ReplicaMsgType; 4] = [
        ReplicaMsgType::Replicate,
        ReplicaMsgType::ReplicateAck,
        ReplicaMsgType::ReplicateState,
        ReplicaMsgType::StateAck,
    ];

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            ReplicaMsgType::Replicate => 14,
            ReplicaMsgType::ReplicateAck => 15,
            ReplicaMsgType::ReplicateState => 16,
            ReplicaMsgType::StateAck => 17,
        }
    }

    /// The replication message type a wire code names, if any.
    pub const fn from_code(code: u8) -> Option<ReplicaMsgType> {
        match code {
            14 => Some(ReplicaMsgType::Replicate),
            15 => Some(ReplicaMsgType::ReplicateAck),
            16 => Some(ReplicaMsgType::ReplicateState),
            17 => Some(ReplicaMsgType::StateAck),
            _ => None,
        }
    }

    /// Upper-case name as PROTOCOL.md writes it.
    pub const fn name(self) -> &'static str {
        match self {
            ReplicaMsgType::Replicate => "REPLICATE",
            ReplicaMsgType::ReplicateAck => "REPLICATE_ACK",
            ReplicaMsgType::ReplicateState => "REPLICATE_STATE",
            ReplicaMsgType::StateAck => "REPLICATE_STATE_ACK",
        }
    }

    /// Whether a message of this type acknowledges (a REPLICATE_ACK's
    /// payload holds only further acknowledgements, [`acks`]; a
    /// REPLICATE_STATE_ACK has none).
    pub const fn is_ack(self) -> bool {
        matches!(self, ReplicaMsgType::ReplicateAck | ReplicaMsgType::StateAck)
    }
}

/// Acknowledgements one REPLICATE_ACK carries at most: the header's, and
/// up to this many less one in its payload (PROTOCOL.md §11.3).
pub const MAX_ACKS: usize = 128;

/// Bytes of one further acknowledgement in a REPLICATE_ACK's payload:
/// the primary slot and the round, `u32` little-endian each.
pub const ACK_ENTRY_LEN: usize = 8;

/// The further acknowledgements of a REPLICATE_ACK's `payload` (which
/// [`parse`] checked to be whole entries): (primary slot, round) each.
pub fn acks(payload: &[u8]) -> impl Iterator<Item = (u32, u32)> + '_ {
    payload.chunks_exact(ACK_ENTRY_LEN).map(|e| {
        let word = |at: usize| u32::from_le_bytes([e[at], e[at + 1], e[at + 2], e[at + 3]]);
        (word(0), word(4))
    })
}

/// Appends one further acknowledgement (primary slot `slot`, round
/// `round`) to a REPLICATE_ACK's payload `out`.
pub fn push_ack(out: &mut Vec<u8>, slot: u32, round: u32) {
    out.extend_from_slice(&slot.to_le_bytes());
    out.extend_from_slice(&round.to_le_bytes());
}

/// A replication message's header fields, decoded and validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaRepr {
    /// Message type.
    pub kind: ReplicaMsgType,
    /// Element type of the payload: `f32` in both (checked by the engine).
    pub dtype: Dtype,
    /// Flag bits (RETRANSMIT on a resent REPLICATE).
    pub flags: u8,
    /// The job's token.
    pub token: u64,
    /// Job id.
    pub job: u16,
    /// The sending appliance's index in the job's appliance list (layout
    /// order). Header field `rank`.
    pub from: u16,
    /// REPLICATE: the chunk's length (0 in round 0 is never used: round
    /// 0 carries the initial values). REPLICATE_ACK: 0.
    pub count: u16,
    /// The round replicated (acknowledged).
    pub round: u32,
    /// REPLICATE: the chunk's backup slot on the receiving lcore;
    /// REPLICATE_ACK: its primary slot on the receiving lcore.
    pub slot: u32,
    /// The chunk's key index.
    pub key: u32,
    /// The chunk's index within its key.
    pub chunk: u32,
    /// The job layout's epoch the sender holds. Header field `epoch`.
    pub epoch: u32,
    /// REPLICATE_STATE: this fragment's index in the copy (header field
    /// `fragment`); 0 in the others.
    pub fragment: u8,
    /// REPLICATE_STATE: the copy's fragment count (header field
    /// `fragments`); 0 in the others.
    pub fragments: u8,
}

impl ReplicaRepr {
    /// Payload bytes this header announces.
    pub fn payload_len(&self) -> usize {
        usize::from(self.count) * self.dtype.size()
    }

    /// Writes every header field (error, receive-buffer share and reserved
    /// bytes zero); the payload is the caller's.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        h.set_preamble();
        h.set_type_code(self.kind.code());
        h.set_dtype(self.dtype);
        h.set_flags(self.flags);
        h.set_token(self.token);
        h.set_job(self.job);
        h.set_rank(self.from);
        h.set_count(self.count);
        h.set_error(0);
        h.set_round(self.round);
        h.set_slot(self.slot);
        h.set_key(self.key);
        h.set_chunk(self.chunk);
        h.set_epoch(self.epoch);
        h.set_fragment(self.fragment, self.fragments);
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

/// Whether a datagram's type byte is a replication message's (14 to 17).
pub fn is_replica_message(datagram: &[u8]) -> bool {
    datagram.len() >= HEADER_LEN
        && datagram
            .get(crate::wire::field::TYPE)
            .is_some_and(|&t| ReplicaMsgType::from_code(t).is_some())
}

/// Classifies a received replication message: its header fields and
/// payload read in place, or why it must be dropped. Checks, in §7's
/// order: truncated, magic, version, type, dtype, `count` within
/// [`MAX_PAYLOAD`] (`count_too_large`), the datagram's length against it
/// (`length_mismatch`; a REPLICATE_STATE_ACK has `count` 0 and no payload,
/// a REPLICATE_ACK's `count` is twice its further acknowledgements, in
/// `f32` words, at most [`MAX_ACKS`] − 1 of them). The fragment fields are read from a REPLICATE_STATE
/// only (0 in the others' representation); whether they fit the chunk's
/// state is the engine's check (`count_mismatch`).
/// Never panics, never allocates.
pub fn parse(datagram: &[u8]) -> Result<(ReplicaRepr, &[u8]), DropReason> {
    let h = Header::new_checked(datagram)?;
    h.check_phub_v1()?;
    let kind = ReplicaMsgType::from_code(h.type_code()).ok_or(DropReason::UnknownType)?;
    let dtype = Dtype::from_code(h.dtype_code()).ok_or(DropReason::UnknownDtype)?;
    let count = h.count();
    let len = usize::from(count) * dtype.size();
    if len > MAX_PAYLOAD {
        return Err(DropReason::CountTooLarge);
    }
    let payload = &datagram[HEADER_LEN..];
    let bad_ack = match kind {
        ReplicaMsgType::StateAck => count != 0,
        ReplicaMsgType::ReplicateAck => {
            dtype != Dtype::F32 || len % ACK_ENTRY_LEN != 0 || len / ACK_ENTRY_LEN >= MAX_ACKS
        }
        _ => false,
    };
    if payload.len() != len || bad_ack {
        return Err(DropReason::LengthMismatch);
    }
    let repr = ReplicaRepr {
        kind,
        dtype,
        flags: h.flags(),
        token: h.token(),
        job: h.job(),
        from: h.rank(),
        count,
        round: h.round(),
        slot: h.slot(),
        key: h.key(),
        chunk: h.chunk(),
        epoch: h.epoch(),
        fragment: 0,
        fragments: 0,
    };
    let repr = if kind == ReplicaMsgType::ReplicateState {
        ReplicaRepr {
            fragment: h.fragment(),
            fragments: h.fragments(),
            ..repr
        }
    } else {
        repr
    };
    Ok((repr, payload))
}

/// The replica ring of a job's appliances (PROTOCOL.md §11.1): its
/// appliances interleaved by rack. `racks[i]` is appliance i's rack label
/// (appliances in layout order); racks are taken in the order of their
/// first appliance, and the ring lists each rack's first appliance, then
/// each rack's second, and so on, a rack that has run out skipped. With
/// one rack (every label equal) it is the layout order.
pub fn replica_ring<R: Eq>(racks: &[R]) -> Vec<usize> {
    // Per rack (in order of first appearance), its appliances in order.
    let mut by_rack: Vec<(&R, Vec<usize>)> = Vec::new();
    for (i, r) in racks.iter().enumerate() {
        match by_rack.iter_mut().find(|(label, _)| *label == r) {
            Some((_, members)) => members.push(i),
            None => by_rack.push((r, vec![i])),
        }
    }
    let depth = by_rack.iter().map(|(_, m)| m.len()).max().unwrap_or(0);
    let ring: Vec<usize> = (0..depth)
        .flat_map(|d| by_rack.iter().filter_map(move |(_, m)| m.get(d).copied()))
        .collect();
    debug_assert_eq!(ring.len(), racks.len(), "the ring lists every appliance once");
    ring
}

/// The replica set of the chunks whose primary is appliance `primary`
/// (PROTOCOL.md §11.1): `primary` first, then its `replicas - 1` backups.
/// Walking the replica ring ([`replica_ring`]) from the appliance after
/// `primary`: first every appliance whose rack is not yet in the set, in
/// walk order (its rack joins the set), until the set is full; then, if it
/// is not, the appliances not yet in it, in walk order.
///
/// # Panics
///
/// When `primary` is not an index of `racks`, or `replicas` is 0 or more
/// than `racks.len()`: the spec and the install are checked before.
pub fn replica_set<R: Eq>(racks: &[R], primary: usize, replicas: usize) -> Vec<usize> {
    assert!(primary < racks.len(), "appliance {primary} of {}", racks.len());
    assert!(
        (1..=racks.len()).contains(&replicas),
        "{replicas} replicas over {} appliances",
        racks.len()
    );
    let ring = replica_ring(racks);
    let at = ring
        .iter()
        .position(|&a| a == primary)
        .expect("every appliance is on the ring");
    let walk: Vec<usize> = (1..ring.len()).map(|k| ring[(at + k) % ring.len()]).collect();
    let mut set = vec![primary];
    for &a in &walk {
        if set.len() < replicas && !set.iter().any(|&s| racks[s] == racks[a]) {
            set.push(a);
        }
    }
    for &a in &walk {
        if set.len() < replicas && !set.contains(&a) {
            set.push(a);
        }
    }
    debug_assert_eq!(set.len(), replicas);
    set
}

/// Where a backup appliance with `lcores` lcores keeps the chunks of
/// `part` (a primary appliance's chunks, the run its lcores hold
/// together): cut into `lcores` runs in lcore order, lcore j holding
/// `first + floor(j n / L) .. first + floor((j + 1) n / L)` for n chunks
/// over L lcores (PROTOCOL.md §11.2). Chunk g then lives on the lcore whose
/// run holds it, in slot g − that run's first.
///
/// # Panics
///
/// When `lcores` is 0.
pub fn backup_runs(part: ChunkRange, lcores: usize) -> Vec<ChunkRange> {
    assert!(lcores >= 1, "a backup appliance has an lcore");
    let l = lcores as u128;
    let n = u128::from(part.count);
    // Cast: each bound is at most n, a u64.
    #[allow(clippy::cast_possible_truncation)]
    let cut = |j: u128| (j * n / l) as u64;
    (0..l)
        .map(|j| ChunkRange {
            first: part.first + cut(j),
            count: cut(j + 1) - cut(j),
        })
        .collect()
}

/// The lcore and slot of chunk `seq` in runs `runs` (a layout's or
/// [`backup_runs`]'), if they hold it.
pub fn place(runs: &[ChunkRange], seq: u64) -> Option<(usize, u64)> {
    let l = runs.partition_point(|r| r.first + r.count <= seq);
    let r = runs.get(l)?;
    r.range().contains(&seq).then(|| (l, seq - r.first))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_ack_carries_fewer_than_max_acks_further_acknowledgements() {
        let r = ReplicaRepr {
            kind: ReplicaMsgType::ReplicateAck,
            dtype: Dtype::F32,
            flags: 0,
            token: 1,
            job: 1,
            from: 0,
            count: 0,
            round: 3,
            slot: 0,
            key: 0,
            chunk: 0,
            epoch: 0,
            fragment: 0,
            fragments: 0,
        };
        for (n, ok) in [(MAX_ACKS - 1, true), (MAX_ACKS, false)] {
            let more = ReplicaRepr {
                count: u16::try_from(2 * n).unwrap(),
                ..r
            };
            let mut d = more.to_bytes().to_vec();
            for k in 0..u32::try_from(n).unwrap() {
                push_ack(&mut d, k, 3);
            }
            assert_eq!(parse(&d).is_ok(), ok, "{n} further acknowledgements");
        }
        // Not in f32 words: refused.
        let half = ReplicaRepr {
            dtype: Dtype::Bf16,
            count: 8,
            ..r
        };
        let mut d = half.to_bytes().to_vec();
        d.extend_from_slice(&[0; 16]);
        assert_eq!(parse(&d).err(), Some(DropReason::LengthMismatch));
    }

    #[test]
    fn codes_round_trip_and_are_no_other_message_type() {
        for t in ReplicaMsgType::ALL {
            assert_eq!(ReplicaMsgType::from_code(t.code()), Some(t));
            assert_eq!(crate::wire::MsgType::from_code(t.code()), None);
            assert_eq!(crate::rows::RowMsgType::from_code(t.code()), None);
        }
    }

    #[test]
    fn without_racks_the_backups_are_the_next_appliances_round_the_ring() {
        let one = [""; 4];
        assert_eq!(replica_set(&one, 0, 1), [0]);
        assert_eq!(replica_set(&one, 0, 2), [0, 1]);
        assert_eq!(replica_set(&one, 3, 2), [3, 0]);
        assert_eq!(replica_set(&one, 2, 3), [2, 3, 0]);
    }

    #[test]
    fn other_racks_come_first_and_backups_spread() {
        let racks = ["r1", "r1", "r2", "r2"];
        assert_eq!(replica_ring(&racks), [0, 2, 1, 3]);
        // Each appliance backs up exactly one, on the other rack.
        let sets: Vec<_> = (0..4).map(|p| replica_set(&racks, p, 2)).collect();
        assert_eq!(sets, [vec![0, 2], vec![1, 3], vec![2, 1], vec![3, 0]]);
        // Three replicas over two racks: the third shares a rack.
        assert_eq!(replica_set(&racks, 0, 3), [0, 2, 1]);
        // Three racks, three replicas: one per rack.
        let three = ["a", "b", "c", "a", "b", "c"];
        for p in 0..6 {
            let s = replica_set(&three, p, 3);
            let mut labels: Vec<_> = s.iter().map(|&a| three[a]).collect();
            labels.sort_unstable();
            assert_eq!(labels, ["a", "b", "c"], "primary {p}: {s:?}");
        }
    }

    proptest! {
        #[test]
        fn a_replica_set_is_distinct_appliances_primary_first(
            racks in prop::collection::vec(0u8..4, 1..12),
            p in 0usize..12,
            r in 1usize..=3,
        ) {
            let (p, r) = (p % racks.len(), r.min(racks.len()));
            let s = replica_set(&racks, p, r);
            prop_assert_eq!(s.len(), r);
            prop_assert_eq!(s[0], p);
            let mut d = s.clone();
            d.sort_unstable();
            d.dedup();
            prop_assert_eq!(d.len(), r);
            // As many racks as there can be.
            let mut all = racks.clone();
            all.sort_unstable();
            all.dedup();
            let mut used: Vec<u8> = s.iter().map(|&a| racks[a]).collect();
            used.sort_unstable();
            used.dedup();
            prop_assert_eq!(used.len(), r.min(all.len()));
        }

        #[test]
        fn backup_runs_cover_the_part_once_in_order(first in 0u64..1 << 40, count in 0u64..10_000, l in 1usize..64) {
            let runs = backup_runs(ChunkRange { first, count }, l);
            prop_assert_eq!(runs.len(), l);
            let mut at = first;
            for r in &runs {
                prop_assert_eq!(r.first, at);
                prop_assert!(r.count <= count / l as u64 + 1);
                at += r.count;
            }
            prop_assert_eq!(at, first + count);
            for g in [first, first + count / 2, (first + count).saturating_sub(1)] {
                if count > 0 {
                    let (j, s) = place(&runs, g).unwrap();
                    prop_assert_eq!(runs[j].first + s, g);
                }
            }
            prop_assert_eq!(place(&runs, first + count), None);
        }

        #[test]
        fn parse_never_panics_and_takes_what_emit_writes(
            bytes in prop::collection::vec(any::<u8>(), 0..200),
            round in any::<u32>(), slot in any::<u32>(), epoch in any::<u32>(), count in 0u16..40,
        ) {
            let _ = parse(&bytes);
            let r = ReplicaRepr {
                kind: ReplicaMsgType::Replicate,
                dtype: Dtype::F32,
                flags: flags::RETRANSMIT,
                token: 7,
                job: 3,
                from: 1,
                count,
                round,
                slot,
                key: 2,
                chunk: 5,
                epoch,
                fragment: 0,
                fragments: 0,
            };
            let mut d = r.to_bytes().to_vec();
            d.resize(HEADER_LEN + r.payload_len(), 0);
            prop_assert!(is_replica_message(&d));
            let (back, payload) = parse(&d).unwrap();
            prop_assert_eq!(back, r);
            prop_assert_eq!(payload.len(), usize::from(count) * 4);
            // One element short, or an ACK with half a further
            // acknowledgement: refused.
            prop_assert_eq!(parse(&d[..d.len().saturating_sub(1)]).err().is_some(), true);
            let ack = ReplicaRepr { kind: ReplicaMsgType::ReplicateAck, count: 0, ..r };
            prop_assert_eq!(parse(&ack.to_bytes()).unwrap().0, ack);
            let bad = ReplicaRepr { kind: ReplicaMsgType::ReplicateAck, count: 1, ..r };
            let mut d = bad.to_bytes().to_vec();
            d.extend_from_slice(&[0; 4]);
            prop_assert_eq!(parse(&d).err(), Some(DropReason::LengthMismatch));
            // Whole further acknowledgements are read back in order.
            let n = u32::from(count % 8);
            let more = ReplicaRepr { kind: ReplicaMsgType::ReplicateAck, count: 2 * (count % 8), ..r };
            let mut d = more.to_bytes().to_vec();
            for k in 0..n {
                push_ack(&mut d, slot ^ k, round.wrapping_add(k));
            }
            let (back, payload) = parse(&d).unwrap();
            prop_assert_eq!(back, more);
            let got: Vec<(u32, u32)> = acks(payload).collect();
            let want: Vec<(u32, u32)> = (0..n).map(|k| (slot ^ k, round.wrapping_add(k))).collect();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn a_state_fragment_keeps_its_index_and_count_and_an_ack_carries_none(
            round in any::<u32>(), fragment in any::<u8>(), fragments in any::<u8>(),
            count in 0u16..40, half in any::<bool>(),
        ) {
            let dtype = if half { Dtype::Bf16 } else { Dtype::F32 };
            let r = ReplicaRepr {
                kind: ReplicaMsgType::ReplicateState,
                dtype,
                flags: 0,
                token: 9,
                job: 4,
                from: 2,
                count,
                round,
                slot: 3,
                key: 1,
                chunk: 0,
                epoch: 2,
                fragment,
                fragments,
            };
            let mut d = r.to_bytes().to_vec();
            prop_assert_eq!(d[crate::wire::field::FRAGMENT], fragment);
            prop_assert_eq!(d[crate::wire::field::FRAGMENTS], fragments);
            d.resize(HEADER_LEN + r.payload_len(), 0);
            let (back, payload) = parse(&d).unwrap();
            prop_assert_eq!(back, r);
            prop_assert_eq!(payload.len(), usize::from(count) * dtype.size());
            // The fragment bytes of any other type are not read.
            let mut ack = d[..HEADER_LEN].to_vec();
            ack[crate::wire::field::TYPE] = ReplicaMsgType::StateAck.code();
            ack[crate::wire::field::COUNT].fill(0);
            let (back, _) = parse(&ack).unwrap();
            prop_assert_eq!((back.kind, back.fragment, back.fragments), (ReplicaMsgType::StateAck, 0, 0));
            ack.extend_from_slice(&[0; 2]);
            ack[crate::wire::field::COUNT.start] = 1;
            prop_assert!(parse(&ack).is_err());
        }
    }
}
