//! What the DPDK dataplane benchmarks share (`dpdk_ring_bench`,
//! `dpdk_memif_gen`): the job (W = 8 workers, `sum`, one f32 key cut into
//! one slot per chunk), the push frames (Ethernet/IPv4/UDP + phub header +
//! payload) from each worker, a generator that sends them round after
//! round as indirect mbufs over per-(slot, rank) templates, and the
//! engine's kernel-only figure (the same pushes, from the same template
//! frames, handed to a `Shard`: no packet I/O).

use std::net::Ipv4Addr;
use std::time::Instant;

use phub_dataplane::backend::dpdk::frame::{self, PeerAddr};
use phub_engine::{InstallKind, JobInstall, Shard};
use phub_ffi::mbuf::Shares;
use phub_ffi::{Mbuf, Mempool};
use phub_proto::layout::SlotChunk;
use phub_proto::spec::Optimizer;
use phub_proto::wire::{field, MsgType, Repr};
use phub_proto::Dtype;

/// Workers.
pub(crate) const W: u16 = 8;
/// The dataplane's address (what the pushes are sent to).
pub(crate) const US: Ipv4Addr = Ipv4Addr::new(10, 79, 0, 1);
/// The dataplane's UDP port (lcore 0).
pub(crate) const BASE_PORT: u16 = 7900;
/// Job id and token.
pub(crate) const JOB: u16 = 1;
pub(crate) const TOKEN: u64 = 7;
/// Bytes in front of the phub header: Ethernet + IPv4 + UDP.
pub(crate) const L2_L4: usize = 42;
/// Where the phub header's round field sits in a frame.
pub(crate) const ROUND_AT: usize = L2_L4 + field::ROUND.start;
/// Pushes per burst.
pub(crate) const BURST: usize = 32;

/// EAL arguments of a benchmark process of its own (no hugepages, 1 GiB of
/// ordinary memory, no PCI, no shared config or telemetry, warnings only),
/// plus `extra`.
pub(crate) fn eal_no_huge(prefix: &str, lcores: &str, extra: &[&str]) -> Vec<String> {
    let mut v = phub_ffi::eal::standalone_args(prefix, 1024, lcores);
    v.extend(extra.iter().map(|e| e.to_string()));
    v
}

/// The job as the engine installs it on its one lcore: slot `s` is chunk
/// `s` of key 0 (what `phub_proto::layout` gives for one key on one lcore).
pub(crate) fn job(elems: u32, slots: usize) -> JobInstall {
    JobInstall {
        id: JOB,
        token: TOKEN,
        workers: W,
        dtype: Dtype::F32,
        optimizer: Optimizer::Sum,
        consistency: Default::default(),
        chunk_elems: elems,
        slots: (0..slots as u32)
            .map(|s| SlotChunk {
                key: 0,
                chunk: s,
                elems,
            })
            .collect(),
    }
}

/// Worker `rank`'s address.
pub(crate) fn from(rank: u16) -> PeerAddr {
    PeerAddr {
        mac: [2, 0, 0, 0, 9, rank as u8],
        ip: Ipv4Addr::new(10, 79, 0, 10 + rank as u8),
        port: 40000,
    }
}

/// Worker `rank`'s frame for `slot` in `round` (round 0: INIT).
pub(crate) fn push(slot: usize, rank: u16, round: u32, vals: &[f32]) -> Vec<u8> {
    let repr = Repr::request(
        if round == 0 { MsgType::Init } else { MsgType::Push },
        JOB,
        TOKEN,
        rank,
        round,
        slot as u32,
    )
    .with_payload(Dtype::F32, vals.len() as u16)
    .with_chunk(0, slot as u32);
    frame::udp_frame(
        &from(rank),
        [2, 0, 0, 0, 0, 1],
        US,
        BASE_PORT,
        &repr.to_datagram(vals),
    )
}

/// A chunk's gradient values.
pub(crate) fn values(elems: usize) -> Vec<f32> {
    (0..elems).map(|e| (e % 13) as f32).collect()
}

/// Every INIT frame (round 0), slot by slot, rank by rank: rank 0 carries
/// the values, the others nothing.
pub(crate) fn init_frames(slots: usize, vals: &[f32]) -> impl Iterator<Item = Vec<u8>> + '_ {
    (0..slots)
        .flat_map(|s| (0..W).map(move |r| (s, r)))
        .map(move |(s, r)| push(s, r, 0, if r == 0 { vals } else { &[][..] }))
}

/// Sends PUSH rounds without copying gradients: each (slot, rank) has one
/// template frame in an mbuf, and each push is an indirect mbuf attached to
/// it. A template's round number is rewritten only once no push of it is
/// in flight (its refcount is back to 1).
pub(crate) struct Generator {
    templates: Vec<Mbuf>,
    /// [`Generator::round_direct`]: references to each template taken in
    /// advance.
    shares: Vec<Option<Shares>>,
    /// Where each template's round field (and UDP checksum, when it has
    /// one) is, so that rewriting it reads no mbuf field (a cache line the
    /// receiver writes when it frees a push).
    round_fields: Vec<RoundField>,
    indirect: Mempool,
    batch: Vec<Mbuf>,
    round: u32,
    /// Times a template was still in flight when its next push was due.
    pub(crate) waits: u64,
}

/// A template's round field and, if it carries one, its UDP checksum.
struct RoundField {
    round: std::ptr::NonNull<[u8; 4]>,
    sum: Option<std::ptr::NonNull<[u8; 2]>>,
}

/// Where a frame's UDP checksum field is.
const UDP_SUM_AT: usize = frame::ETH_LEN + frame::IPV4_LEN + frame::udp::field::CHECKSUM.start;

impl RoundField {
    /// Writes `round` into the template's round field and, if the frame
    /// carries a UDP checksum, updates it for the bytes that changed
    /// ([`frame::udp_checksum_update`]), so that it still verifies; the
    /// round field starts at an even offset of the datagram.
    ///
    /// # Safety
    ///
    /// The template's frame is alive and nobody else reads or writes it
    /// meanwhile (no push of it is in flight).
    unsafe fn set(&self, round: u32) {
        // SAFETY: per the contract; both fields are byte arrays (align 1)
        // inside the template's frame.
        let (at, sum) = unsafe { (&mut *self.round.as_ptr(), self.sum.map(|p| &mut *p.as_ptr())) };
        let new = round.to_le_bytes();
        if let Some(sum) = sum {
            *sum = frame::udp_checksum_update(u16::from_be_bytes(*sum), at, &new).to_be_bytes();
        }
        *at = new;
    }
}

impl Generator {
    /// Templates for `slots` slots from `frames` (data room for a whole
    /// frame), pushes from `indirect`; with `udp_checksums` each carries a
    /// UDP checksum (0 otherwise: none), kept right as rounds are
    /// rewritten, for a receiver that verifies them in software.
    pub(crate) fn new(
        frames: &Mempool,
        indirect: Mempool,
        slots: usize,
        vals: &[f32],
        udp_checksums: bool,
    ) -> Generator {
        let mut templates = (0..slots)
            .flat_map(|s| (0..W).map(move |r| (s, r)))
            .map(|(s, r)| {
                let mut f = push(s, r, 1, vals);
                if udp_checksums {
                    let c = frame::udp_checksum(from(r).ip, US, &f[frame::ETH_LEN + frame::IPV4_LEN..]);
                    f[UDP_SUM_AT..UDP_SUM_AT + 2].copy_from_slice(&c.to_be_bytes());
                }
                let mut m = frames.alloc().expect("an mbuf for a template frame");
                assert!(m.extend_from_slice(&f), "a template fits its mbuf");
                m
            })
            .collect::<Vec<Mbuf>>();
        let round_fields = templates
            .iter_mut()
            .map(|m| {
                let d = m.data_mut().expect("a fresh template is ours alone");
                RoundField {
                    round: std::ptr::NonNull::from(&mut d[ROUND_AT..ROUND_AT + 4]).cast::<[u8; 4]>(),
                    sum: udp_checksums.then(|| {
                        std::ptr::NonNull::from(&mut d[UDP_SUM_AT..UDP_SUM_AT + 2]).cast::<[u8; 2]>()
                    }),
                }
            })
            .collect();
        Generator {
            shares: Vec::new(),
            round_fields,
            templates,
            indirect,
            batch: Vec::with_capacity(BURST),
            round: 1,
            waits: 0,
        }
    }

    /// Pushes sent per round.
    pub(crate) fn per_round(&self) -> usize {
        self.templates.len()
    }

    /// One round: every template once, in bursts of [`BURST`] handed to
    /// `send`, which must take the whole batch (and may do other work, such
    /// as draining what comes back). `send` is also called, with what is
    /// batched so far (perhaps nothing), while a template is in flight.
    pub(crate) fn round(&mut self, send: &mut impl FnMut(&mut Vec<Mbuf>)) {
        let round = self.round;
        for (tm, field) in self.templates.iter_mut().zip(&self.round_fields) {
            while tm.data_mut().is_none() {
                self.waits += 1;
                send(&mut self.batch);
            }
            // SAFETY: the template is ours alone (refcount 1, just checked)
            // and lives as long as self.templates.
            unsafe { field.set(round) };
            self.batch
                .push(Mbuf::indirect(&self.indirect, tm).expect("indirect mbufs"));
            if self.batch.len() == BURST {
                send(&mut self.batch);
            }
        }
        self.round += 1;
    }

    /// The engine alone over this generator's own template frames (the very
    /// memory the dataplane reads pushes from), into `k`, for `secs`
    /// seconds; no push may be in flight. Returns (pushes, seconds).
    pub(crate) fn kernel_only(&mut self, chunk: usize, secs: f64, mut k: Shard<PeerAddr>) -> (u64, f64) {
        // References reserved for round_direct go back first.
        self.shares.clear();
        let slots = self.templates.len() / usize::from(W);
        let elems = chunk / 4;
        let vals = values(elems);
        k.install(job(elems as u32, slots), InstallKind::Plain)
            .expect("installing the kernel-only job");
        for f in init_frames(slots, &vals) {
            k.handle(from(0), &f[L2_L4..], 1);
        }
        k.clear_transmits();
        // Each frame's address and length, found once (reading them from
        // the mbuf per push would add a cache line the dataplane's pushes
        // do not cost the engine).
        let frames: Vec<(std::ptr::NonNull<u8>, usize)> = self
            .templates
            .iter_mut()
            .map(|t| {
                let d = t.data_mut().expect("no push of a template in flight");
                (std::ptr::NonNull::from(&mut d[0]), d.len())
            })
            .collect();
        let t = Instant::now();
        let mut kp = 0u64;
        let mut round = 1u32;
        while t.elapsed().as_secs_f64() < secs {
            for (i, &(p, len)) in frames.iter().enumerate() {
                // SAFETY: no push of any template is in flight (checked
                // above; none is sent until this returns), so the frames are
                // ours alone, alive as long as self.templates; the field is
                // written before the frame is read, never while.
                let f = unsafe {
                    self.round_fields[i].set(round);
                    std::slice::from_raw_parts(p.as_ptr(), len)
                };
                k.handle(from((i % usize::from(W)) as u16), &f[L2_L4..], 1);
                kp += 1;
                if i % usize::from(W) == usize::from(W) - 1 {
                    k.clear_transmits();
                }
            }
            round += 1;
        }
        (kp, t.elapsed().as_secs_f64())
    }

    /// One round as [`Generator::round`], but each push is the template
    /// mbuf itself (a reference reserved in advance, many at a time, so no
    /// mbuf cache line is written per push: only the frame's round field,
    /// as a NIC writes only frames and descriptors). A template is
    /// rewritten only once its previous push's slot-round is `done` (slot-
    /// rounds completed since the first round, from the results: the
    /// receiver frees a push before it answers its slot), since the
    /// refcount no longer says.
    #[allow(dead_code)] // dpdk_memif_gen's; dpdk_ring_bench keeps indirect pushes
    pub(crate) fn round_direct(&mut self, send: &mut impl FnMut(&mut Vec<Mbuf>), done: &dyn Fn() -> u64) {
        const RESERVE: u16 = 4096;
        let round = self.round;
        let slots = (self.templates.len() / usize::from(W)) as u64;
        if self.shares.is_empty() {
            self.shares = (0..self.templates.len()).map(|_| None).collect();
        }
        for (i, tm) in self.templates.iter_mut().enumerate() {
            if round >= 2 {
                let need = u64::from(round - 2) * slots + (i / usize::from(W)) as u64 + 1;
                while done() < need {
                    self.waits += 1;
                    send(&mut self.batch);
                }
            }
            // SAFETY: the pointer is into this template's frame, which
            // lives (and does not move) as long as self.templates; the
            // template's previous push (the only other reader) was freed
            // before its slot's results came back, which `done` counted.
            unsafe { self.round_fields[i].set(round) };
            let sh = &mut self.shares[i];
            if sh.as_ref().is_none_or(|s| s.left() == 0) {
                *sh = Some(tm.reserve(RESERVE).expect("template references"));
            }
            let push = sh.as_mut().and_then(Shares::take).expect("a reserved reference");
            self.batch.push(push);
            if self.batch.len() == BURST {
                send(&mut self.batch);
            }
        }
        self.round += 1;
    }

    /// Hands over what is still batched.
    pub(crate) fn flush(&mut self, send: &mut impl FnMut(&mut Vec<Mbuf>)) {
        if !self.batch.is_empty() {
            send(&mut self.batch);
        }
    }
}
