//! Shared-memory regions for workers on the appliance's host.
//!
//! A worker on the same host as the kernel-UDP dataplane (started with
//! `--shm`) can leave its gradient chunks in shared memory and send only
//! the header ([`crate::wire::flags::SHM`]); the lcore sums them from there,
//! writes each completed chunk's result once into its result region, and
//! answers with headers alone. No payload byte crosses a socket.
//!
//! Per job and lcore the dataplane creates, in [`DIR`]:
//! - one staging region per rank, written only by that rank's worker;
//! - one result region, written only by the lcore.
//!
//! Both hold one chunk per slot of the job on that lcore, chunk `s` at
//! [`slot_offset`]`(s)`, each [`chunk_stride`] bytes (the chunk's wire
//! bytes rounded up to 64, so every chunk starts cache-line aligned).
//!
//! The protocol's own ordering keeps writer and reader apart, with the
//! datagrams as the hand-over: a worker writes chunk `s` of round `r + 1`
//! only after it received round `r`'s result of `s`; the lcore writes a
//! result only when every rank has pushed that round, so after every rank
//! has read the previous one.
//!
//! Names are derived from the dataplane's base UDP port, the job, a keyed
//! hash of the job's token (the token itself never appears) and the lcore;
//! files are mode 0600: only processes of the dataplane's user that know
//! the token find and open them.

use siphasher::sip::SipHasher13;
use std::hash::Hasher;

use crate::Dtype;

/// Where the regions live.
pub const DIR: &str = "/dev/shm";

/// Which region of a (job, lcore).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The staging region of one rank (its gradient chunks).
    Staging(u16),
    /// The lcore's results.
    Results,
}

/// Bytes from one chunk's start to the next: the chunk's wire bytes
/// rounded up to a multiple of 64.
pub fn chunk_stride(chunk_elems: u32, dtype: Dtype) -> usize {
    (chunk_elems as usize * dtype.size()).div_ceil(64) * 64
}

/// Where slot `slot`'s chunk starts in a region.
pub fn slot_offset(slot: u32, chunk_elems: u32, dtype: Dtype) -> usize {
    slot as usize * chunk_stride(chunk_elems, dtype)
}

/// Length of a region of a (job, lcore) with `slots` slots.
pub fn region_len(slots: usize, chunk_elems: u32, dtype: Dtype) -> usize {
    slots * chunk_stride(chunk_elems, dtype)
}

/// The two SipHash keys of [`token_tag`] (`b"phub-shm"`, `b"regions1"`).
pub const TAG_KEYS: (u64, u64) = (0x7068_7562_2d73_686d, 0x7265_6769_6f6e_7331);

/// The token's tag in region names: SipHash-1-3 under fixed keys, so a
/// name does not give the token away.
pub fn token_tag(token: u64) -> u64 {
    let mut h = SipHasher13::new_with_keys(TAG_KEYS.0, TAG_KEYS.1);
    h.write(&token.to_le_bytes());
    h.finish()
}

/// The file name (in [`DIR`]) of a region.
pub fn region_name(base_port: u16, job: u16, token: u64, lcore: u16, part: Part) -> String {
    let tag = token_tag(token);
    match part {
        Part::Staging(rank) => format!("phub-{base_port}-j{job}-{tag:016x}-l{lcore}-r{rank}"),
        Part::Results => format!("phub-{base_port}-j{job}-{tag:016x}-l{lcore}-res"),
    }
}

/// The path of a region.
pub fn region_path(base_port: u16, job: u16, token: u64, lcore: u16, part: Part) -> std::path::PathBuf {
    std::path::Path::new(DIR).join(region_name(base_port, job, token, lcore, part))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_are_cache_lines_and_names_hide_the_token() {
        assert_eq!(chunk_stride(2048, Dtype::F32), 8192);
        assert_eq!(chunk_stride(1000, Dtype::F32), 4032);
        assert_eq!(chunk_stride(3, Dtype::Bf16), 64);
        assert_eq!(slot_offset(3, 1000, Dtype::F32), 3 * 4032);
        assert_eq!(region_len(5, 2048, Dtype::F16), 5 * 4096);
        let token = 0x1234_5678_9abc_def0_u64;
        let n = region_name(7000, 3, token, 1, Part::Staging(2));
        assert!(n.starts_with("phub-7000-j3-") && n.ends_with("-l1-r2"), "{n}");
        assert!(!n.contains(&format!("{token:x}")));
        assert_ne!(token_tag(token), token_tag(token + 1));
        assert!(region_name(7000, 3, token, 1, Part::Results).ends_with("-l1-res"));
    }
}
