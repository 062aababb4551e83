//! phub-control's daemon against fake dataplanes (`fake`), one test
//! binary (`cargo test -p phub-control --test daemon`; one file's tests
//! with a filter, e.g. `-- failover::`): admission, joins, views and
//! checkpoints (`daemon`), appliances added, removed and drained
//! (`appliances`), heartbeats, failover and re-replication (`failover`),
//! and the counter table's renderings (`counter_table`).

mod client;
mod fake;

mod appliances;
mod counter_table;
mod daemon;
mod failover;
