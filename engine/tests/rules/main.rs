//! The engine's rules, one test binary (`cargo test -p phub-engine --test
//! rules`; one file's tests with a filter, e.g. `-- table_store::`): the
//! round and consistency rules, replication, failover and
//! re-replication on hand-wired appliances, PROTOCOL.md's optimizer
//! formulas run as written, shared memory and the row store. One binary
//! links (and instantiates the engine's generic code) once: as eleven,
//! they took about 70 s of a cold build's CPU more.

mod doc_notation;
mod replica_world;

mod clock_replica_rules;
mod consistency_rules;
mod engine_rules;
mod failover_rules;
mod hier_replica_rules;
mod protocol_optimizers;
mod protocol_row_optimizers;
mod replica_memory;
mod replica_rules;
mod replica_table_rules;
mod rereplication_rules;
mod shm;
mod table_rules;
mod table_store;
