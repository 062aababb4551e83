//! phub-worker: the library a training process links to exchange tensors
//! with a phub appliance.
//!
//! Layer: client library, with I/O. A [`Worker`] joins a job through
//! phub-control's HTTP API ([`Worker::join`]), learns where every chunk of
//! every key lives, and then exchanges keys (tensors) with the dataplane
//! over UDP: [`Worker::init`] for the initial broadcast (round 0),
//! [`Worker::push_pull`] for each later round, [`Worker::pull`] to catch up
//! after a rejoin. Calls return a [`Handle`] at once; [`Worker::wait`] blocks
//! until the key's result is in, so several keys can be in flight together.
//! [`Worker::exchange`] runs a whole step's `push_pull`s with the caller's
//! buffers lent to the library instead of copied (the fast path).
//!
//! Values are `f32` slices for any job (encoded into the job's wire type
//! and decoded back), or, for a bf16 or f16 job, slices of that type
//! ([`half::bf16`], [`half::f16`]: see [`Element`]), whose bits are the
//! wire's: a mixed-precision caller's gradients go out and its results come
//! back without a conversion or a `float32` copy.
//!
//! I/O: one thread per worker, batched system calls with UDP GSO/GRO
//! ([`net`]), a window sized from the job ([`auto_window`]). For tests and
//! soaks, a seeded fault injector can lose, duplicate and reorder the
//! worker's datagrams in both directions ([`WorkerConfig::inject`]; off by
//! default).
//!
//! On the appliance's host, with a dataplane started with `--shm`, chunks
//! and results can go through shared memory (`/dev/shm` regions the
//! dataplane creates per job) while only headers cross the socket:
//! [`WorkerConfig::shm`], [`ShmMode`] (automatic by default).
//!
//! Sparse tables (keys of `kind = "table"`, PROTOCOL.md §10) are
//! addressed by name, their rows by `u64` ids: [`Worker::push_pull_rows`]
//! pushes one round's gradient rows and returns each id's row after the
//! update, [`Worker::push_rows`] pushes without the rows,
//! [`Worker::pull_rows`] reads rows at any time, [`Worker::catch_up_rows`]
//! learns a table's round after a rejoin. Rows go by datagrams over
//! the same socket and I/O thread, each id to the lcore the table's
//! placement puts it on (`transport/row_plan.rs`, `transport/rows.rs`).
//!
//! The same calls serve every consistency mode ([`Worker::consistency`],
//! PROTOCOL.md §5.8): in an async or bounded-delay job a key's round is
//! this rank's clock on it ([`Worker::key_round`], [`Worker::clock`]), each
//! `push_pull` carries the next one, and its result is the key's values
//! when the appliance answered. Shared memory is for BSP jobs only.
//!
//! Invariants (the worker's side of PROTOCOL.md §6):
//! - At most one request per key is in flight, and a key's round r+1 is sent
//!   only once this worker holds the result of round r (in async and
//!   bounded-delay jobs, r is the rank's clock; a retransmission carries
//!   the same clock, and only a RESULT of clock r completes it).
//! - At most [`WorkerConfig::window`] chunks are outstanding (sent without a
//!   result) across all keys; a late chunk is retransmitted unchanged but for
//!   the RETRANSMIT flag: at once when results of chunks sent after it to
//!   the same lcore are in (fast retransmission), or after a loss timer
//!   adapted to the measured round trip once no result comes in at all.
//! - Every request ends: with its result, with the appliance's refusal, or
//!   with [`WorkerError::Timeout`] once no result at all has come back for
//!   [`WorkerConfig::timeout`]. Nothing hangs.
//! - Only RESULTs carrying this job's id and token, for the round and chunk
//!   waited for, are accepted.
//!
//! Failover (a replicated job, PROTOCOL.md §11.6): every chunk goes where
//! [`phub_proto::failover::ReplicaLayout::serve`] puts it in the epoch the
//! worker holds, with that epoch in its header. An ERROR `wrong_epoch`
//! naming a newer epoch, or a chunk retransmitted three times unanswered,
//! has the I/O thread ask control for the epoch (`epoch.rs`, on a helper
//! thread); a newer one re-addresses every chunk still unanswered and
//! sends it at once, same round, as a first transmission on a fresh path.
//! An ERROR naming an older epoch leaves the chunk to the loss timer; a
//! RESULT from the old primary for the round waited for still answers.
//!
//! ```no_run
//! use phub_worker::Worker;
//!
//! # fn main() -> Result<(), phub_worker::WorkerError> {
//! let w = Worker::join("http://127.0.0.1:7700", 1, 0x0123_4567_89ab_cdef, 0)?;
//! let n = w.key_len(0).unwrap() as usize;
//! let mut params = vec![0.5f32; n];
//! w.wait(w.init(0, &mut params)?)?; // every rank now holds rank 0's values
//! let grad = vec![0.1f32; n];
//! let h = w.push_pull(0, &grad, &mut params)?; // round 1; other keys may go too
//! w.wait(h)?; // params = the new parameters
//! # Ok(())
//! # }
//! ```
//!
//! All ranks must start requests for their keys in the same order (as a
//! training loop does): with a bounded window, two ranks that each fill their
//! window with a different key would wait on each other until the timeout.
//!
//! # Which path a call takes, and who copies
//!
//! Every call claims its key (`keys.rs`: one request per key in flight),
//! has its chunks encoded on the caller's thread (`encode.rs`), and hands
//! the request to the I/O thread (`io.rs`), whose sans-IO transport
//! (`transport/`) sends, resends and matches results. What differs is
//! where a request's datagrams come from (`Tx`, `transport/request.rs`)
//! and where its results go (`Sink`); "datagram" is a chunk that crosses
//! the socket with its payload, "shm" one whose payload goes through the
//! dataplane's shared-memory regions ([`WorkerConfig::shm`]) while its
//! header crosses the socket.
//!
//! | call | path | send (`Tx`): the gradient is copied | receive (`Sink`): the result is copied |
//! | --- | --- | --- | --- |
//! | [`Worker::init`], [`Worker::push_pull`], [`Worker::push_pull_in_place`] | datagram | `Owned`: encoded into a buffer by the caller's thread | `Owned`: decoded into a buffer by the I/O thread, then into `out` by [`Worker::wait`] |
//! | the same | shm | `Staged`: encoded into the staging region by the caller's thread | `Direct`: left in the result regions; decoded into `out` by [`Worker::wait`] on the caller's thread |
//! | [`Worker::pull`] | datagram (also with shm) | `Owned`: headers only, no payload | `Owned`: decoded (from the datagram, or with shm from the result region) into a buffer by the I/O thread, then into `out` by `pull` |
//! | [`Exchange::push_pull`] ([`Worker::exchange`]) | datagram | `Borrowed`: not copied when the caller's elements are the wire's (sent from the caller's buffer); otherwise `Owned`, encoded by the caller's thread | `Borrowed`: decoded straight into the caller's `out` by the I/O thread |
//! | the same | shm | as above, then copied into the staging region by the I/O thread when first sent | `Borrowed`: read from the result region into `out` by the I/O thread |
//! | [`Exchange::push_pull_in_place`] | datagram or shm | as [`Exchange::push_pull`], from the one buffer | `Borrowed`: into the same buffer, each chunk once its push has left (Python's `Worker.exchange`) |
//! | [`Worker::stage`] + [`Worker::push_pull_staged`] | shm only | `Staged`: the caller writes the staging region itself (no copy by the library) | `Direct`: decoded into `out` by [`Worker::wait`] |
//! | [`Worker::stage`] + [`Worker::push_staged`] | shm only | the same | `Direct`: left where it arrived; [`Worker::wait_in_place`] names the spans ([`Results`]) |
//!
//! A chunk of a `Staged` request whose mapping was replaced meanwhile (the
//! dataplane restarted) is copied back out of its own mapping by the I/O
//! thread and sent into the new one or as a datagram; a RESULT that comes as
//! a datagram for a `Direct` request lands in its buffer. `push_pull_in_place`
//! stays a method of its own: one slice cannot be lent as both `&[E]` and
//! `&mut [E]` to `push_pull`.
//!
//! # Layout
//!
//! | file | what |
//! | --- | --- |
//! | `config.rs` | [`WorkerConfig`], the environment variables that override it, [`auto_window`] |
//! | `join.rs` | [`Worker::join`], [`Worker::rejoin`], [`Worker::from_join`]: the HTTP join, the checks of its answer, the socket, window, shared memory and I/O thread it sets up |
//! | `worker.rs` | [`Worker`], [`Handle`]: accessors, `init`, `push_pull`, `pull`, `wait`, handing requests to the I/O thread |
//! | `keys.rs` | where each key stands: claims, rounds, spare buffers (the one owner of a key's state) |
//! | `encode.rs` | a key's chunks as datagrams, headers or staged chunks; direct results copied out |
//! | `exchange.rs` | [`Exchange`]: the lent path |
//! | `staged.rs` | [`Staged`], [`Results`]: values written and results read in place |
//! | `io.rs` | the I/O thread: socket, commands, shared-memory watch, a replicated job's epoch, outcomes to waiters |
//! | `epoch.rs` | a replicated job's epoch fetched from control (`GET /v1/jobs/{id}/epoch`) on a helper thread, for the I/O thread |
//! | `transport/` | the sans-IO transport: requests (`request.rs`), the flow window (`window.rs`), congestion (`congestion.rs`), round trips (`rto.rs`), a replicated job's routing by epoch (`route.rs`); table rows: what a push or pull of rows sends (`row_plan.rs`), their sending, resending and answers (`rows.rs`) |
//! | `tables.rs` | the table calls by name: [`Worker::push_pull_rows`], [`Worker::push_rows`], [`Worker::pull_rows`], [`Worker::catch_up_rows`], each table's round |
//! | `elem.rs`, `codec.rs` | element types and wire encoding (f32, bf16, f16) |
//! | `net.rs`, `shm.rs`, `inject.rs`, `stats.rs` | batched UDP, the shared-memory regions, fault injection, counters |
//! | `sim.rs`, `sim_rows.rs` | the dense and row transports for the simulator (feature `sim`) |
// Casts that may truncate or drop a sign are checked here rather than in
// Cargo.toml: `[lints] workspace = true` cannot be mixed with crate-level
// lint keys there. Each remaining `as` names its bound in a `// Cast:` note.
#![warn(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod codec;
mod config;
mod elem;
mod encode;
mod epoch;
mod error;
mod exchange;
mod inject;
mod io;
mod join;
mod keys;
pub mod net;
mod shm;
#[cfg(feature = "sim")]
pub mod sim;
#[cfg(feature = "sim")]
pub mod sim_rows;
mod staged;
mod stats;
mod tables;
mod transport;
mod worker;

pub use config::{
    auto_window, WorkerConfig, ASSUMED_LCORE_RCVBUF, CONGESTION_ENV, IN_FLIGHT_PER_LCORE, MIN_AUTO_WINDOW,
    RACK_ENV, SPIN_ENV,
};
pub use elem::Element;
pub use error::WorkerError;
pub use exchange::{Detached, Exchange};
/// The 16-bit element types ([`half::bf16`], [`half::f16`]) of the
/// version this library is built with.
pub use half;
pub use inject::INJECT_ENV;
pub use phub_proto::api::JoinResponse;
pub use phub_proto::fault::FaultSpec;
pub use phub_proto::spec::Consistency;
pub use shm::{ShmMode, SHM_ENV};
pub use staged::{Results, Staged, StagingMemory, StagingSpan};
pub use stats::WorkerStats;
pub use tables::{CachedIds, RowsPull, RowsPush};
pub use worker::{Handle, Worker, MAX_CLOCK};
