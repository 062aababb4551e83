//! The phub wire header: zero-copy views over UDP payloads.
//!
//! Byte order: every multi-byte field of the header is **little-endian**, and
//! so are the payload's elements. This is the one place that says so.
//!
//! A datagram is a fixed [`HEADER_LEN`]-byte header followed by `count`
//! elements of the job's [`Dtype`]. The header is 86 bytes so that, behind
//! Ethernet (14), IPv4 (20) and UDP (8) headers, the payload starts at byte
//! 128 of the frame: 64-byte aligned, as the SIMD kernels read it in place.
//!
//! Received bytes go through [`parse`] (or [`Header::new_checked`] and
//! [`Repr::parse`]), which classifies them into a valid message or a
//! [`DropReason`] without panicking or allocating. Sent bytes are written with
//! [`Repr::emit`].

use crate::Dtype;

/// Named byte ranges of the header fields.
pub mod field {
    use std::ops::Range;

    /// `u32`, always [`MAGIC`](super::MAGIC): the bytes `P H U B`.
    pub const MAGIC: Range<usize> = 0..4;
    /// `u8`, protocol version, [`VERSION`](super::VERSION).
    pub const VERSION: usize = 4;
    /// `u8`, message type ([`MsgType`](super::MsgType) code).
    pub const TYPE: usize = 5;
    /// `u8`, element type ([`Dtype`](crate::Dtype) code).
    pub const DTYPE: usize = 6;
    /// `u8`, flag bits ([`flags`](super::flags)).
    pub const FLAGS: usize = 7;
    /// `u64`, the job's secret token.
    pub const TOKEN: Range<usize> = 8..16;
    /// `u16`, job id.
    pub const JOB: Range<usize> = 16..18;
    /// `u16`, sender's worker rank (`0xffff` when the appliance sends).
    pub const RANK: Range<usize> = 18..20;
    /// `u16`, number of payload elements.
    pub const COUNT: Range<usize> = 20..22;
    /// `u16`, error code in ERROR messages, zero otherwise.
    pub const ERROR: Range<usize> = 22..24;
    /// `u32`, round number (0 is the initial broadcast).
    pub const ROUND: Range<usize> = 24..28;
    /// `u32`, slot index on the lcore that owns the chunk.
    pub const SLOT: Range<usize> = 28..32;
    /// `u32`, key index within the job.
    pub const KEY: Range<usize> = 32..36;
    /// `u32`, chunk index within the key.
    pub const CHUNK: Range<usize> = 36..40;
    /// `u32`, in a RESULT from an lcore that states its receive buffer:
    /// the bytes of it this job's workers may fill together (0: not
    /// stated; 0 in every other message).
    pub const RX_SHARE: Range<usize> = 40..44;
    /// `u32`, the job layout's epoch (PROTOCOL.md §11.5): what replication
    /// messages carry; 0 in every other message, and not checked in them
    /// yet.
    pub const EPOCH: Range<usize> = 44..48;
    /// `u8`, in a REPLICATE_STATE (PROTOCOL.md §11.7): this fragment's
    /// index in the chunk's state copy; 0 in every other message.
    pub const FRAGMENT: usize = 48;
    /// `u8`, in a REPLICATE_STATE: how many fragments the copy has; 0 in
    /// every other message.
    pub const FRAGMENTS: usize = 49;
    /// `u32`, in a table message of a replicated job and its answers and
    /// ERRORs (PROTOCOL.md §11.9): the entry e the message is for; 0 in
    /// every other message, and not checked in them.
    pub const ENTRY: Range<usize> = 50..54;
    /// `u16`, in a REPLICATE of an async or bounded-delay job (PROTOCOL.md
    /// §11.10): the worker rank whose push the update is; 0 in every other
    /// message.
    pub const UPDATE_RANK: Range<usize> = 54..56;
    /// `u32`, in such a REPLICATE: that push's clock; 0 in every other
    /// message.
    pub const UPDATE_CLOCK: Range<usize> = 56..60;
    /// Reserved, sent as zero, ignored on receipt.
    pub const RESERVED: Range<usize> = 60..86;
    /// First payload byte.
    pub const PAYLOAD: usize = 86;
}

/// Length of the fixed header in bytes.
pub const HEADER_LEN: usize = field::PAYLOAD;
/// The magic number, `b"PHUB"` read as a little-endian `u32`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"PHUB");
/// The protocol version this code speaks.
pub const VERSION: u8 = 1;
/// Rank carried in RESULT messages (ERROR echoes the refused message's rank).
pub const APPLIANCE_RANK: u16 = 0xffff;
/// Largest payload in bytes: a 9000-byte jumbo frame less IPv4 (20), UDP (8)
/// and the phub header, rounded down to a multiple of 64.
pub const MAX_PAYLOAD: usize = (9000 - 20 - 8 - HEADER_LEN) / 64 * 64;

// The payload starts 64-byte aligned behind Ethernet, IPv4 and UDP, and the
// largest message fits a 9000-byte jumbo frame: checked at compile time.
const _: () = assert!((14 + 20 + 8 + HEADER_LEN).is_multiple_of(64));
const _: () = assert!(MAX_PAYLOAD.is_multiple_of(64) && 20 + 8 + HEADER_LEN + MAX_PAYLOAD <= 9000);

/// Flag bits of the header's `flags` byte.
pub mod flags {
    /// The sender is retransmitting this message (statistics only).
    pub const RETRANSMIT: u8 = 0x01;
    /// The payload is not in the datagram but in the job's shared-memory
    /// region on the appliance's host ([`crate::shm`]): the datagram is the
    /// header alone, `count` still says how many elements the chunk has, and
    /// the bytes are at the slot's offset in the sender's staging region (a
    /// PUSH or INIT) or in the lcore's result region (a RESULT). Only
    /// workers on the appliance's host can use it.
    pub const SHM: u8 = 0x02;
    /// Table messages only (PROTOCOL.md §10.7): the message carries its
    /// ids after a key-cache prefix (signature and slot), and the lcore
    /// keeps them in that slot of the sender's cache.
    pub const KEYS_STORE: u8 = 0x04;
    /// Table messages only (PROTOCOL.md §10.7): the message carries a
    /// key-cache prefix in place of its ids, which the lcore holds in that
    /// slot of the sender's cache under that signature.
    pub const KEYS_CACHED: u8 = 0x08;
    /// PULL only (PROTOCOL.md §6.1, "A stalled rank"): a probe of where an
    /// lcore stands, answered as any PULL, which does not lift §5.4 rule
    /// 0 for the sender after a restore.
    pub const PROBE: u8 = 0x10;
    /// Table answers only (PROTOCOL.md §10.2): a ROW_RESULT or
    /// ROW_PULL_RESULT sent at once in answer to a message that arrived
    /// without RETRANSMIT. A worker that retransmitted that message learns
    /// that its first copy was answered: the retransmission was spurious
    /// (§10.3, "Loss timer").
    pub const FIRST_COPY: u8 = 0x20;
    /// PULL only (PROTOCOL.md §5.4 rule 0): the rank pulls after this
    /// lcore refused it `ahead` (or its probe found the lcore behind), so
    /// it pulls every key: the PULL lifts rule 0 for it. A PULL without it
    /// (sent before the rank learned of a restore, say) does not.
    pub const RESYNC: u8 = 0x40;
    /// REPLICATE_ROWS only (PROTOCOL.md §11.9 item 4): a round the entry's
    /// primary completed while the receiving backup's state copy ran,
    /// sent to catch the backup up; applied as any round, but the backup
    /// stays short of holding every answered round (it may not serve the
    /// entry) until it applies a round without it.
    pub const CATCH_UP: u8 = 0x80;
}

/// Message types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgType {
    /// Worker to appliance, round 0: rank 0 carries the initial parameters,
    /// other ranks carry no payload.
    Init,
    /// Worker to appliance, round >= 1: a gradient chunk.
    Push,
    /// Worker to appliance: ask for the last completed result of a chunk.
    Pull,
    /// Appliance to worker: the result of a completed round.
    Result,
    /// Appliance to worker: the worker's message was refused (code in `error`).
    Error,
    /// Rack appliance to a chunk's home appliance (hierarchical jobs,
    /// PROTOCOL.md §9): the rack's sum of its workers' contributions, `f32`.
    Partial,
    /// Home appliance to a rack appliance (PROTOCOL.md §9): a chunk's result,
    /// in the job's dtype.
    PartialResult,
}

impl MsgType {
    /// All message types.
    pub const ALL: [MsgType; 7] = [
        MsgType::Init,
        MsgType::Push,
        MsgType::Pull,
        MsgType::Result,
        MsgType::Error,
        MsgType::Partial,
        MsgType::PartialResult,
    ];

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            MsgType::Init => 1,
            MsgType::Push => 2,
            MsgType::Pull => 3,
            MsgType::Result => 4,
            MsgType::Error => 5,
            MsgType::Partial => 6,
            MsgType::PartialResult => 7,
        }
    }

    /// The type a wire code names, if any.
    pub const fn from_code(code: u8) -> Option<MsgType> {
        match code {
            1 => Some(MsgType::Init),
            2 => Some(MsgType::Push),
            3 => Some(MsgType::Pull),
            4 => Some(MsgType::Result),
            5 => Some(MsgType::Error),
            6 => Some(MsgType::Partial),
            7 => Some(MsgType::PartialResult),
            _ => None,
        }
    }

    /// Upper-case name as PROTOCOL.md writes it.
    pub const fn name(self) -> &'static str {
        match self {
            MsgType::Init => "INIT",
            MsgType::Push => "PUSH",
            MsgType::Pull => "PULL",
            MsgType::Result => "RESULT",
            MsgType::Error => "ERROR",
            MsgType::Partial => "PARTIAL",
            MsgType::PartialResult => "PARTIAL_RESULT",
        }
    }
}

macro_rules! drop_reasons {
    ($( $(#[$doc:meta])* $name:ident = $code:literal, $label:literal; )*) => {
        /// Why a received datagram was dropped. Each has a counter on every
        /// lcore; the code is what an ERROR message carries.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u16)]
        pub enum DropReason {
            $( $(#[$doc])* $name = $code, )*
        }

        impl DropReason {
            /// Every reason, in code order.
            pub const ALL: &'static [DropReason] = &[$(DropReason::$name),*];

            /// Wire code (also the index into per-reason counters).
            pub const fn code(self) -> u16 {
                self as u16
            }

            /// The reason for a code, if it names one.
            pub const fn from_code(code: u16) -> Option<DropReason> {
                match code {
                    $( $code => Some(DropReason::$name), )*
                    _ => None,
                }
            }

            /// Stable snake_case name, used in stats and metrics.
            pub const fn name(self) -> &'static str {
                match self {
                    $( DropReason::$name => $label, )*
                }
            }
        }
    };
}

drop_reasons! {
    /// Shorter than the header.
    Truncated = 1, "truncated";
    /// The first four bytes are not `PHUB`.
    BadMagic = 2, "bad_magic";
    /// A protocol version this appliance does not speak.
    BadVersion = 3, "bad_version";
    /// The type byte names no message type.
    UnknownType = 4, "unknown_type";
    /// The dtype byte names no element type.
    UnknownDtype = 5, "unknown_dtype";
    /// `count` elements would not fit in a jumbo frame.
    CountTooLarge = 6, "count_too_large";
    /// Payload length is not `count` times the element size (or, with the
    /// SHM flag, not zero).
    LengthMismatch = 7, "length_mismatch";
    /// RESULT or ERROR sent to the appliance, which only takes worker messages.
    NotForAppliance = 8, "not_for_appliance";
    /// No job with this id is installed on this lcore.
    UnknownJob = 9, "unknown_job";
    /// The token does not match the job's.
    BadToken = 10, "bad_token";
    /// The rank is not below the job's worker count.
    RankOutOfRange = 11, "rank_out_of_range";
    /// The dtype differs from the job's.
    DtypeMismatch = 12, "dtype_mismatch";
    /// The slot is outside the job's slots on this lcore.
    SlotOutOfRange = 13, "slot_out_of_range";
    /// Key or chunk index does not match the slot's chunk.
    ChunkMismatch = 14, "chunk_mismatch";
    /// The element count does not match the slot's chunk length (or an INIT
    /// from a rank other than 0 carries a payload, or a PULL does).
    CountMismatch = 15, "count_mismatch";
    /// INIT for a round other than 0, or PUSH for round 0.
    WrongTypeForRound = 16, "wrong_type_for_round";
    /// A second contribution of the same worker to the round in progress.
    Duplicate = 17, "duplicate";
    /// A PARTIAL or PARTIAL_RESULT of a round older than the last completed
    /// one (a rank's INIT or PUSH of an older round is answered with the
    /// stored result: PROTOCOL.md §5.4 rule 5).
    Stale = 18, "stale";
    /// A round beyond the one in progress, or an INIT or PUSH to an lcore
    /// restored from a checkpoint from a rank that has not pulled since.
    Ahead = 19, "ahead";
    /// A PULL for a chunk with no completed round yet.
    NothingToPull = 20, "nothing_to_pull";
    /// The SHM flag on a job (or lcore) without shared-memory regions.
    NoSharedMemory = 21, "no_shared_memory";
    /// The job was evicted from this appliance within the last minute, and
    /// the message carries the token it had: nothing more will answer it.
    Evicted = 22, "evicted";
    /// The appliance is shutting down cleanly: for its last moments it
    /// answers every message of an installed job (with its token) with
    /// this, and tells every rank it knows once, so that no worker waits
    /// out its timeout for an answer that will not come.
    ShuttingDown = 23, "shutting_down";
    /// A PARTIAL from an address other than that of the claimed rack
    /// appliance's lcore holding the chunk, a PARTIAL_RESULT from an
    /// address other than the chunk's home lcore's (PROTOCOL.md §9.3,
    /// §9.4), or appliance-to-appliance traffic for a job this appliance
    /// holds no such part of; likewise for replication messages (§11.4).
    WrongPeer = 24, "wrong_peer";
    /// A table message (PROTOCOL.md §10.3) whose `key` is not the index of
    /// a table key of the job (a dense key, or beyond the keys).
    UnknownTable = 25, "unknown_table";
    /// A table message whose dim (`slot` field) is not the table's `dim`.
    DimMismatch = 26, "dim_mismatch";
    /// A table message with more rows or ids than fit one datagram of the
    /// job's `chunk_bytes` at the table's dim, a sequence number or message
    /// count beyond [`crate::rows::MAX_ROW_MESSAGES`], a ROW_PUSH sequence
    /// number not below the count its round's ROW_END stated, or a ROW_END
    /// stating another count than an earlier one of the same round.
    BadRowCount = 27, "bad_row_count";
    /// A table message with an id the placement (PROTOCOL.md §10.1) puts
    /// on another lcore (or another appliance).
    RowOutOfPlace = 28, "row_out_of_place";
    /// The message's `epoch` (header offset 44) is not the epoch of the
    /// replicated job's layout this appliance has installed (PROTOCOL.md
    /// §11.5): a replication message's is counted only, a worker's is
    /// answered with an ERROR carrying the appliance's epoch.
    WrongEpoch = 29, "wrong_epoch";
    /// A table message naming, by its key-cache prefix (PROTOCOL.md
    /// §10.7), a slot of the sender's cache that does not hold an id list
    /// of that signature and count (never stored, overwritten, or lost
    /// with a restart): the worker sends the ids again.
    UnknownSignature = 30, "unknown_signature";
    /// A table message whose key-cache prefix is wrong (PROTOCOL.md
    /// §10.7): a slot beyond the table's `key_cache`, a signature that is
    /// not its ids', both cache flags, or a cache flag on a message
    /// without ids.
    BadSignature = 31, "bad_signature";
    /// A push of a replicated async or bounded-delay job that would be
    /// applied while the lcore's log of updates on their way to the
    /// chunks' backups is full, or while a backup of the chunk takes its
    /// state copy (PROTOCOL.md §11.10): not applied, not answered; the
    /// worker resends it on its timer.
    Backlog = 32, "backlog";
}

impl DropReason {
    /// Whether the appliance tells a token-authenticated sender about this
    /// refusal with an ERROR message: the reasons that mean the worker's view
    /// of the job is wrong. Duplicates and stale rounds are normal under loss
    /// and are only counted; unauthenticated packets are never answered.
    pub const fn notifies_sender(self) -> bool {
        matches!(
            self,
            DropReason::SlotOutOfRange
                | DropReason::ChunkMismatch
                | DropReason::CountMismatch
                | DropReason::DtypeMismatch
                | DropReason::WrongTypeForRound
                | DropReason::Ahead
                | DropReason::NothingToPull
                | DropReason::Evicted
                | DropReason::ShuttingDown
                | DropReason::UnknownTable
                | DropReason::DimMismatch
                | DropReason::BadRowCount
                | DropReason::RowOutOfPlace
                | DropReason::WrongEpoch
                | DropReason::UnknownSignature
                | DropReason::BadSignature
        )
    }

    /// The reasons only table messages are dropped for (PROTOCOL.md
    /// §10.3's table), in code order.
    pub const TABLE: [DropReason; 6] = [
        DropReason::UnknownTable,
        DropReason::DimMismatch,
        DropReason::BadRowCount,
        DropReason::RowOutOfPlace,
        DropReason::UnknownSignature,
        DropReason::BadSignature,
    ];

    /// Number of reasons; counters are indexed by `code()`, so arrays of
    /// counters have `COUNT + 1` entries (code 0 is unused).
    pub const COUNT: usize = DropReason::ALL.len();
}

impl std::fmt::Display for DropReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A view of a phub header over any byte buffer.
///
/// [`Header::new_checked`] verifies the buffer is at least [`HEADER_LEN`]
/// long, after which no accessor can panic. [`Header::new_unchecked`] is for
/// buffers the caller sized itself (emitting); its accessors panic on a
/// buffer shorter than the header.
#[derive(Debug, Clone, Copy)]
pub struct Header<T: AsRef<[u8]>> {
    buf: T,
}

macro_rules! get_le {
    ($self:ident, $ty:ty, $range:expr) => {{
        let b = $self.buf.as_ref();
        let mut a = [0u8; std::mem::size_of::<$ty>()];
        a.copy_from_slice(&b[$range]);
        <$ty>::from_le_bytes(a)
    }};
}

impl<T: AsRef<[u8]>> Header<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buf: T) -> Header<T> {
        Header { buf }
    }

    /// Wraps received bytes, checking only that the header fits.
    pub fn new_checked(buf: T) -> Result<Header<T>, DropReason> {
        if buf.as_ref().len() < HEADER_LEN {
            return Err(DropReason::Truncated);
        }
        Ok(Header { buf })
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buf
    }

    /// Magic field.
    pub fn magic(&self) -> u32 {
        get_le!(self, u32, field::MAGIC)
    }
    /// Version field.
    pub fn version(&self) -> u8 {
        self.buf.as_ref()[field::VERSION]
    }
    /// Whether the header is phub's, of this version: the checks every
    /// message kind starts with (dense chunks and table rows alike).
    pub fn check_phub_v1(&self) -> Result<(), DropReason> {
        if self.magic() != MAGIC {
            return Err(DropReason::BadMagic);
        }
        if self.version() != VERSION {
            return Err(DropReason::BadVersion);
        }
        Ok(())
    }
    /// Raw message type byte.
    pub fn type_code(&self) -> u8 {
        self.buf.as_ref()[field::TYPE]
    }
    /// Raw dtype byte.
    pub fn dtype_code(&self) -> u8 {
        self.buf.as_ref()[field::DTYPE]
    }
    /// Flags byte.
    pub fn flags(&self) -> u8 {
        self.buf.as_ref()[field::FLAGS]
    }
    /// Token field.
    pub fn token(&self) -> u64 {
        get_le!(self, u64, field::TOKEN)
    }
    /// Job id field.
    pub fn job(&self) -> u16 {
        get_le!(self, u16, field::JOB)
    }
    /// Rank field.
    pub fn rank(&self) -> u16 {
        get_le!(self, u16, field::RANK)
    }
    /// Element count field.
    pub fn count(&self) -> u16 {
        get_le!(self, u16, field::COUNT)
    }
    /// Error code field.
    pub fn error(&self) -> u16 {
        get_le!(self, u16, field::ERROR)
    }
    /// Round field.
    pub fn round(&self) -> u32 {
        get_le!(self, u32, field::ROUND)
    }
    /// Slot field.
    pub fn slot(&self) -> u32 {
        get_le!(self, u32, field::SLOT)
    }
    /// Key field.
    pub fn key(&self) -> u32 {
        get_le!(self, u32, field::KEY)
    }
    /// Chunk index field.
    pub fn chunk(&self) -> u32 {
        get_le!(self, u32, field::CHUNK)
    }
    /// The receive-buffer share a RESULT states ([`field::RX_SHARE`]; 0:
    /// none). Not part of [`Repr`]: only the appliance's lcore writes it,
    /// after emitting the rest, and only the worker's window reads it.
    pub fn rx_share(&self) -> u32 {
        get_le!(self, u32, field::RX_SHARE)
    }
    /// The layout epoch the sender holds ([`field::EPOCH`]). Not part of
    /// [`Repr`]: only replication messages carry one yet
    /// ([`crate::replica::ReplicaRepr`]).
    pub fn epoch(&self) -> u32 {
        get_le!(self, u32, field::EPOCH)
    }
    /// The entry a replicated job's table message is for ([`field::ENTRY`]).
    pub fn entry(&self) -> u32 {
        get_le!(self, u32, field::ENTRY)
    }
    /// An update's worker rank ([`field::UPDATE_RANK`]).
    pub fn update_rank(&self) -> u16 {
        get_le!(self, u16, field::UPDATE_RANK)
    }
    /// An update's clock ([`field::UPDATE_CLOCK`]).
    pub fn update_clock(&self) -> u32 {
        get_le!(self, u32, field::UPDATE_CLOCK)
    }
    /// A state copy's fragment index ([`field::FRAGMENT`]).
    pub fn fragment(&self) -> u8 {
        self.buf.as_ref()[field::FRAGMENT]
    }
    /// A state copy's fragment count ([`field::FRAGMENTS`]).
    pub fn fragments(&self) -> u8 {
        self.buf.as_ref()[field::FRAGMENTS]
    }
    /// Bytes after the header.
    pub fn payload(&self) -> &[u8] {
        &self.buf.as_ref()[HEADER_LEN..]
    }
}

macro_rules! set_le {
    ($self:ident, $range:expr, $v:expr) => {{
        $self.buf.as_mut()[$range].copy_from_slice(&$v.to_le_bytes());
    }};
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Header<T> {
    /// Sets the magic and version fields and zeroes the receive-buffer
    /// share, the epoch, the fragment fields and the reserved bytes.
    pub fn set_preamble(&mut self) {
        set_le!(self, field::MAGIC, MAGIC);
        self.buf.as_mut()[field::VERSION] = VERSION;
        self.buf.as_mut()[field::RX_SHARE.start..field::RESERVED.end].fill(0);
    }
    /// Sets the message type.
    pub fn set_type(&mut self, t: MsgType) {
        self.buf.as_mut()[field::TYPE] = t.code();
    }
    /// Sets the raw message type byte (a row message's, [`crate::rows`]).
    pub fn set_type_code(&mut self, code: u8) {
        self.buf.as_mut()[field::TYPE] = code;
    }
    /// Sets the element type.
    pub fn set_dtype(&mut self, d: Dtype) {
        self.buf.as_mut()[field::DTYPE] = d.code();
    }
    /// Sets the flags byte.
    pub fn set_flags(&mut self, f: u8) {
        self.buf.as_mut()[field::FLAGS] = f;
    }
    /// Sets the token.
    pub fn set_token(&mut self, v: u64) {
        set_le!(self, field::TOKEN, v)
    }
    /// Sets the job id.
    pub fn set_job(&mut self, v: u16) {
        set_le!(self, field::JOB, v)
    }
    /// Sets the rank.
    pub fn set_rank(&mut self, v: u16) {
        set_le!(self, field::RANK, v)
    }
    /// Sets the element count.
    pub fn set_count(&mut self, v: u16) {
        set_le!(self, field::COUNT, v)
    }
    /// Sets the error code.
    pub fn set_error(&mut self, v: u16) {
        set_le!(self, field::ERROR, v)
    }
    /// Sets the round.
    pub fn set_round(&mut self, v: u32) {
        set_le!(self, field::ROUND, v)
    }
    /// Sets the slot.
    pub fn set_slot(&mut self, v: u32) {
        set_le!(self, field::SLOT, v)
    }
    /// Sets the key.
    pub fn set_key(&mut self, v: u32) {
        set_le!(self, field::KEY, v)
    }
    /// Sets the chunk index.
    pub fn set_chunk(&mut self, v: u32) {
        set_le!(self, field::CHUNK, v)
    }
    /// Sets the receive-buffer share a RESULT states.
    pub fn set_rx_share(&mut self, v: u32) {
        set_le!(self, field::RX_SHARE, v)
    }
    /// Sets the layout epoch.
    pub fn set_epoch(&mut self, v: u32) {
        set_le!(self, field::EPOCH, v)
    }
    /// Sets the entry a replicated job's table message is for.
    pub fn set_entry(&mut self, v: u32) {
        set_le!(self, field::ENTRY, v)
    }
    /// Sets an update's worker rank and clock (a REPLICATE of an async or
    /// bounded-delay job).
    pub fn set_update(&mut self, rank: u16, clock: u32) {
        set_le!(self, field::UPDATE_RANK, rank);
        set_le!(self, field::UPDATE_CLOCK, clock)
    }
    /// Sets a state copy's fragment index and count.
    pub fn set_fragment(&mut self, index: u8, count: u8) {
        self.buf.as_mut()[field::FRAGMENT] = index;
        self.buf.as_mut()[field::FRAGMENTS] = count;
    }
    /// Bytes after the header, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buf.as_mut()[HEADER_LEN..]
    }
}

/// A header's fields, decoded and validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// Message type.
    pub kind: MsgType,
    /// Element type of the payload.
    pub dtype: Dtype,
    /// Flag bits.
    pub flags: u8,
    /// Job's token.
    pub token: u64,
    /// Job id.
    pub job: u16,
    /// Sender's rank ([`APPLIANCE_RANK`] from the appliance).
    pub rank: u16,
    /// Number of payload elements.
    pub count: u16,
    /// Error code (ERROR only; zero otherwise).
    pub error: u16,
    /// Round.
    pub round: u32,
    /// Slot on the owning lcore.
    pub slot: u32,
    /// Key index.
    pub key: u32,
    /// Chunk index within the key.
    pub chunk: u32,
}

impl Repr {
    /// Validates a checked header and the length of what follows it.
    ///
    /// Checks, in order: magic, version, type, dtype, count bound, payload
    /// length. Job-level checks (token, slot, ...) are the engine's.
    pub fn parse<T: AsRef<[u8]>>(h: &Header<T>) -> Result<Repr, DropReason> {
        h.check_phub_v1()?;
        let kind = MsgType::from_code(h.type_code()).ok_or(DropReason::UnknownType)?;
        let dtype = Dtype::from_code(h.dtype_code()).ok_or(DropReason::UnknownDtype)?;
        let count = h.count();
        let bytes = usize::from(count) * dtype.size();
        if bytes > MAX_PAYLOAD {
            return Err(DropReason::CountTooLarge);
        }
        let expected = if h.flags() & flags::SHM != 0 { 0 } else { bytes };
        if h.payload().len() != expected {
            return Err(DropReason::LengthMismatch);
        }
        Ok(Repr {
            kind,
            dtype,
            flags: h.flags(),
            token: h.token(),
            job: h.job(),
            rank: h.rank(),
            count,
            error: h.error(),
            round: h.round(),
            slot: h.slot(),
            key: h.key(),
            chunk: h.chunk(),
        })
    }

    /// Bytes of payload this header announces (in the datagram, or in
    /// shared memory with [`flags::SHM`]).
    pub fn payload_len(&self) -> usize {
        usize::from(self.count) * self.dtype.size()
    }

    /// A worker's message of `kind` (INIT, PUSH or PULL) from `rank` of job
    /// `job` (token `token`), round `round`, for slot `slot`: f32 with no
    /// elements, key and chunk 0, no flags, no error. The `with_*` methods
    /// set the rest.
    pub const fn request(kind: MsgType, job: u16, token: u64, rank: u16, round: u32, slot: u32) -> Repr {
        Repr {
            kind,
            dtype: Dtype::F32,
            flags: 0,
            token,
            job,
            rank,
            count: 0,
            error: 0,
            round,
            slot,
            key: 0,
            chunk: 0,
        }
    }

    /// This header with `count` elements of `dtype`.
    pub const fn with_payload(self, dtype: Dtype, count: u16) -> Repr {
        Repr { dtype, count, ..self }
    }

    /// This header naming chunk `chunk` of key `key`.
    pub const fn with_chunk(self, key: u32, chunk: u32) -> Repr {
        Repr { key, chunk, ..self }
    }

    /// This header with flag bits `flags`.
    pub const fn with_flags(self, flags: u8) -> Repr {
        Repr { flags, ..self }
    }

    /// Whether the payload is in shared memory ([`flags::SHM`]).
    pub fn shm(&self) -> bool {
        self.flags & flags::SHM != 0
    }

    /// Payload bytes in the datagram itself: [`Repr::payload_len`], or zero
    /// with [`flags::SHM`].
    pub fn datagram_payload_len(&self) -> usize {
        if self.shm() {
            0
        } else {
            self.payload_len()
        }
    }

    /// Writes every header field (the payload is the caller's).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Header<T>) {
        h.set_preamble();
        h.set_type(self.kind);
        h.set_dtype(self.dtype);
        h.set_flags(self.flags);
        h.set_token(self.token);
        h.set_job(self.job);
        h.set_rank(self.rank);
        h.set_count(self.count);
        h.set_error(self.error);
        h.set_round(self.round);
        h.set_slot(self.slot);
        h.set_key(self.key);
        h.set_chunk(self.chunk);
    }

    /// The header as a fresh array.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        self.emit(&mut Header::new_unchecked(&mut b[..]));
        b
    }

    /// A whole datagram, for tests and simulations: this header, then
    /// `values` encoded as its dtype (pass none for a header alone, as with
    /// [`flags::SHM`]). `count` is written as the header says, not taken
    /// from `values`, so a test can build a datagram whose lengths
    /// disagree. Allocates; not for the data path.
    #[cfg(feature = "testing")]
    pub fn to_datagram(&self, values: &[f32]) -> Vec<u8> {
        let mut d = vec![0u8; HEADER_LEN + values.len() * self.dtype.size()];
        let mut h = Header::new_unchecked(&mut d[..]);
        self.emit(&mut h);
        crate::dtype::encode(self.dtype, values, h.payload_mut());
        d
    }
}

/// Classifies a received datagram: its header fields and payload, or why it
/// must be dropped. Never panics, never allocates.
pub fn parse(datagram: &[u8]) -> Result<(Repr, &[u8]), DropReason> {
    let h = Header::new_checked(datagram)?;
    let repr = Repr::parse(&h)?;
    Ok((repr, &datagram[HEADER_LEN..]))
}

#[cfg(test)]
// Tests cast small, literal sizes.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_repr() -> impl Strategy<Value = Repr> {
        (
            (
                prop::sample::select(MsgType::ALL.to_vec()),
                prop::sample::select(Dtype::ALL.to_vec()),
                any::<u8>(),
                any::<u64>(),
                any::<u16>(),
                any::<u16>(),
            ),
            (
                any::<u16>(),
                any::<u16>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
            ),
        )
            .prop_map(
                |((kind, dtype, flags, token, job, rank), (count, error, round, slot, key, chunk))| {
                    let count = count % (MAX_PAYLOAD / dtype.size() + 1) as u16;
                    Repr {
                        kind,
                        dtype,
                        flags,
                        token,
                        job,
                        rank,
                        count,
                        error,
                        round,
                        slot,
                        key,
                        chunk,
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn emit_then_parse_round_trips(repr in any_repr(), fill in any::<u8>()) {
            let mut buf = vec![fill; HEADER_LEN + repr.datagram_payload_len()];
            repr.emit(&mut Header::new_unchecked(&mut buf[..]));
            let (back, payload) = parse(&buf).unwrap();
            prop_assert_eq!(back, repr);
            prop_assert_eq!(payload.len(), repr.datagram_payload_len());
            prop_assert!(buf[field::RX_SHARE.start..field::RESERVED.end].iter().all(|&b| b == 0));
        }

        #[test]
        fn parse_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2 * HEADER_LEN)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn any_prefix_of_a_valid_header_is_truncated(repr in any_repr(), cut in 0..HEADER_LEN) {
            let bytes = repr.to_bytes();
            prop_assert_eq!(parse(&bytes[..cut]).unwrap_err(), DropReason::Truncated);
        }
    }

    fn valid() -> Vec<u8> {
        let r = Repr {
            kind: MsgType::Push,
            dtype: Dtype::F32,
            flags: 0,
            token: 7,
            job: 1,
            rank: 0,
            count: 4,
            error: 0,
            round: 1,
            slot: 0,
            key: 0,
            chunk: 0,
        };
        let mut b = r.to_bytes().to_vec();
        b.extend_from_slice(&[0u8; 16]);
        b
    }

    #[test]
    fn each_header_fault_has_its_reason() {
        assert!(parse(&valid()).is_ok());
        let mut b = valid();
        b[0] ^= 1;
        assert_eq!(parse(&b).unwrap_err(), DropReason::BadMagic);
        let mut b = valid();
        b[field::VERSION] = 2;
        assert_eq!(parse(&b).unwrap_err(), DropReason::BadVersion);
        let mut b = valid();
        b[field::TYPE] = 0;
        assert_eq!(parse(&b).unwrap_err(), DropReason::UnknownType);
        let mut b = valid();
        b[field::DTYPE] = 9;
        assert_eq!(parse(&b).unwrap_err(), DropReason::UnknownDtype);
        let mut b = valid();
        b.push(0);
        assert_eq!(parse(&b).unwrap_err(), DropReason::LengthMismatch);
        let mut b = valid();
        b[field::COUNT].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(parse(&b).unwrap_err(), DropReason::CountTooLarge);
        assert_eq!(parse(&valid()[..10]).unwrap_err(), DropReason::Truncated);
    }

    #[test]
    fn drop_reason_codes_are_dense_and_round_trip() {
        for (i, r) in DropReason::ALL.iter().enumerate() {
            assert_eq!(usize::from(r.code()), i + 1);
            assert_eq!(DropReason::from_code(r.code()), Some(*r));
        }
        assert_eq!(DropReason::from_code(0), None);
    }
}
