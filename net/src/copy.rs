//! Copies into memory that is written once and not read again soon: a
//! round's results going into the caller's output (the worker writes a
//! whole model's worth of them per round, and the training step reads them
//! only after the round). An ordinary store first reads each line it
//! writes into the cache (a read for ownership), so such a copy moves
//! every byte of the destination twice over the memory bus; streaming
//! stores write whole lines without reading them (BENCHMARKS.md, "Results
//! copied out with streaming stores").

/// Shortest copy that streams; shorter ones (a chunk's tail, small keys)
/// take ordinary stores, as would a destination read again at once.
pub const STREAM_MIN: usize = 4096;

/// Copies `src` into `dst` (the same length), with streaming stores where
/// it is long enough to pay (x86_64, at least [`STREAM_MIN`] bytes), and
/// fenced so that a thread told of the copy afterwards sees all of it.
///
/// # Panics
/// If the lengths differ.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    // SAFETY: `src` is a live slice of `dst.len()` bytes, and cannot
    // overlap `dst`, which is borrowed exclusively.
    unsafe { copy_streaming_from(dst, src.as_ptr()) }
}

/// [`copy_streaming`] from a raw source: `dst.len()` bytes at `src` (e.g.
/// in a shared-memory region, to which no reference may be made).
///
/// # Safety
/// `src..src + dst.len()` must be readable and must not overlap `dst`.
pub unsafe fn copy_streaming_from(dst: &mut [u8], src: *const u8) {
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAM_MIN {
        // SAFETY: the caller's contract; SSE2 is part of x86_64.
        unsafe { stream_sse2(dst, src) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
}

/// # Safety
/// As [`copy_streaming_from`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
unsafe fn stream_sse2(dst: &mut [u8], src: *const u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let n = dst.len();
    let d = dst.as_mut_ptr();
    // Ordinary stores up to `dst`'s first 16-byte boundary and after its
    // last whole 64 bytes; streaming stores between.
    let head = d.align_offset(16).min(n);
    let body = (n - head) / 64 * 64;
    // SAFETY: head <= n: inside both buffers (the caller's contract).
    unsafe { std::ptr::copy_nonoverlapping(src, d, head) };
    let mut i = head;
    while i < head + body {
        // SAFETY: i + 64 <= head + body <= n: inside both buffers; `d + i`
        // is 16-byte aligned (from `head`, in steps of 64).
        unsafe {
            let s = src.add(i).cast::<__m128i>();
            let t = d.add(i).cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(t, a);
            _mm_stream_si128(t.add(1), b);
            _mm_stream_si128(t.add(2), c);
            _mm_stream_si128(t.add(3), e);
        }
        i += 64;
    }
    // SAFETY: i <= n; the rest of both buffers.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), d.add(i), n - i) };
    // Streaming stores are weakly ordered: fenced before anything that
    // tells another thread the copy is done.
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_exactly_at_every_length_and_alignment() {
        let src: Vec<u8> = (0..3 * STREAM_MIN + 200)
            .map(|i| i.to_le_bytes()[0] ^ 0x5A)
            .collect();
        for len in (0..300).chain([
            STREAM_MIN - 1,
            STREAM_MIN,
            STREAM_MIN + 1,
            8192,
            8192 + 63,
            3 * STREAM_MIN,
        ]) {
            for at in [0usize, 1, 5, 16, 63] {
                for from in [0usize, 3] {
                    let mut dst = vec![0xAAu8; len + at + 64];
                    copy_streaming(&mut dst[at..at + len], &src[from..from + len]);
                    assert_eq!(
                        &dst[at..at + len],
                        &src[from..from + len],
                        "len {len} at {at} from {from}"
                    );
                    assert!(
                        dst[..at].iter().chain(&dst[at + len..]).all(|&b| b == 0xAA),
                        "len {len} at {at}: outside written"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn lengths_must_match() {
        copy_streaming(&mut [0u8; 8], &[0u8; 9]);
    }
}
