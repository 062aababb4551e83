//! The data path does not allocate: rounds of pushes, completions, resends
//! and drops, handled and drained, leave the allocation count where it was.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use phub_dataplane::kernels::{self, Kernels};
use phub_dataplane::{JobInstall, Shard};
use phub_proto::layout::SlotChunk;
use phub_proto::spec::Optimizer;
use phub_proto::wire::{self, MsgType, Repr, HEADER_LEN};
use phub_proto::Dtype;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call unchanged to the system allocator; the only
// addition is a relaxed counter increment, which cannot affect soundness.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract for `l`.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` was allocated by `System` with layout `l` (above).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `p` came from `System` with layout `l`; the caller upholds
        // `realloc`'s contract for the new size.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn handling_and_draining_allocates_nothing() {
    const W: u16 = 4;
    const N: usize = 2048;
    for dtype in Dtype::ALL {
        let mut shard: Shard<u16> = Shard::new(0, Kernels::best());
        shard
            .install(JobInstall {
                id: 3,
                token: 5,
                workers: W,
                dtype,
                optimizer: Optimizer::Adam {
                    lr: 1e-3,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.0,
                },
                slots: vec![SlotChunk {
                    key: 0,
                    chunk: 0,
                    elems: N as u32,
                }],
            })
            .unwrap();
        // Every packet of 20 rounds, built before counting starts.
        let n = N.min(wire::MAX_PAYLOAD / dtype.size());
        assert_eq!(n, N);
        let values = vec![0.25f32; N];
        let mut packets = Vec::new();
        for round in 0..20u32 {
            for rank in 0..W {
                let carries = round > 0 || rank == 0;
                let count = if carries { N } else { 0 };
                let repr = Repr {
                    kind: if round == 0 { MsgType::Init } else { MsgType::Push },
                    dtype,
                    flags: 0,
                    token: 5,
                    job: 3,
                    rank,
                    count: count as u16,
                    error: 0,
                    round,
                    slot: 0,
                    key: 0,
                    chunk: 0,
                };
                let mut b = vec![0u8; HEADER_LEN + count * dtype.size()];
                repr.emit(&mut wire::Header::new_unchecked(&mut b[..]));
                kernels::encode(dtype, &values[..count], &mut b[HEADER_LEN..]);
                packets.push((rank, b.clone()));
                packets.push((rank, b)); // a duplicate of each, resent or dropped
            }
            packets.push((0, vec![0u8; 10])); // truncated garbage
        }
        let before = ALLOCS.load(Ordering::Relaxed);
        let mut sent = 0u64;
        for (rank, p) in &packets {
            shard.handle(*rank, p, 0);
            for t in shard.transmits() {
                sent += t.to.count() as u64 + t.payload.len() as u64 + u64::from(t.header[0]);
            }
            shard.clear_transmits();
        }
        let after = ALLOCS.load(Ordering::Relaxed);
        assert!(sent > 0);
        assert_eq!(shard.counters().rounds_completed.get(), 20);
        assert_eq!(
            after,
            before,
            "{dtype}: the data path allocated {} times",
            after - before
        );
    }
}
