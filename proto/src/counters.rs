//! Counters, each defined once in a table.
//!
//! [`counter_table!`](crate::counter_table) turns a table of counters (name,
//! kind, column, help) into everything that shows them: the serde snapshot
//! struct (one `u64` field per counter, beside the snapshot's other fields),
//! the live struct its one writer bumps (one cell per counter), the table
//! itself as [`CounterDef`]s (for Prometheus names and help, and for
//! phubctl's columns), and adding snapshots up. Adding a counter is one line
//! in its table plus the line that increments it.
//!
//! The tables: [`crate::api::LcoreStats`] (a dataplane lcore) here, and the
//! worker library's `WorkerStats`.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a counter counts, which decides how it is added up and shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Events, messages or packets: a monotonic count.
    Count,
    /// Bytes: a monotonic count, shown in MB in tables.
    Bytes,
    /// A value that is set, not counted (an estimate, a level): never added
    /// up over several sources, and a gauge in Prometheus.
    Gauge,
}

impl Kind {
    /// Whether values of several sources add up to a meaningful total.
    pub const fn sums(self) -> bool {
        !matches!(self, Kind::Gauge)
    }

    /// The Prometheus metric type.
    pub const fn prometheus_type(self) -> &'static str {
        match self {
            Kind::Count | Kind::Bytes => "counter",
            Kind::Gauge => "gauge",
        }
    }
}

/// Whether and how a counter is a column of a CLI table (phubctl's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    /// Not a column.
    Hidden,
    /// Always a column, with this heading.
    Always(&'static str),
    /// A column with this heading once any row's value is not zero.
    IfAny(&'static str),
}

/// One counter of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterDef {
    /// Stable snake_case name: the JSON field, and the Prometheus name's stem.
    pub name: &'static str,
    /// What it counts.
    pub kind: Kind,
    /// Its column in a CLI table.
    pub column: Column,
    /// One sentence saying what it counts (doc, Prometheus HELP).
    pub help: &'static str,
}

/// A live counter cell that a snapshot reads.
pub trait ReadCounter {
    /// The current value.
    fn read(&self) -> u64;
}

impl ReadCounter for AtomicU64 {
    fn read(&self) -> u64 {
        self.load(Ordering::Relaxed)
    }
}

/// One single-writer counter: bumped with a relaxed load and store, not an
/// atomic read-modify-write, since only its owner writes it (no update is
/// lost and the hot path pays no locked instruction). Readers take relaxed
/// snapshots.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`. Only the owner may call this.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0
            .store(self.0.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }

    /// Adds one. Only the owner may call this.
    #[inline]
    pub fn inc(&self) {
        self.add(1);
    }

    /// Sets the value (a gauge). Only the owner may call this.
    #[inline]
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }

    /// Current value.
    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl ReadCounter for Counter {
    fn read(&self) -> u64 {
        self.get()
    }
}

/// Defines a table of counters and what derives from it:
///
/// - the snapshot struct `$Snap` with the given other fields first, then one
///   `u64` field per counter (`#[serde(default)]`, so a snapshot from a
///   side that lacks a newer counter reads 0); the caller's attributes
///   (derives: `Default`, `Serialize`, `Deserialize` are needed) apply;
/// - `$Snap::COUNTERS`, the table as [`CounterDef`]s, in order;
/// - `$Snap::counters(&self)`, each [`CounterDef`] with its value;
/// - `$Snap::add_counters(&mut self, &other)`, adding every counter whose
///   [`Kind::sums`];
/// - the live struct `$Live`, one `$Cell` per counter (a [`Counter`], or an
///   `AtomicU64` where several threads write), with
///   `$Live::fill(&self, &mut $Snap)` writing every counter's current value.
///
/// An entry reads `name: Kind, Column, "help";` with `Kind` a [`Kind`]
/// variant and `Column` one of `Hidden`, `Always("HEADING")`,
/// `IfAny("HEADING")`.
#[macro_export]
macro_rules! counter_table {
    (
        $(#[$smeta:meta])*
        $svis:vis struct $Snap:ident {
            $( $(#[$emeta:meta])* $evis:vis $extra:ident : $ety:ty, )*
        }
        $(#[$lmeta:meta])*
        $lvis:vis struct $Live:ident of $Cell:ty;
        counters {
            $( $name:ident : $kind:ident, $col:ident $(($heading:literal))?, $help:literal; )*
        }
    ) => {
        $(#[$smeta])*
        $svis struct $Snap {
            $( $(#[$emeta])* $evis $extra: $ety, )*
            $( #[doc = $help] #[serde(default)] pub $name: u64, )*
        }

        impl $Snap {
            /// Every counter of this table, in order.
            pub const COUNTERS: &'static [$crate::counters::CounterDef] = &[$(
                $crate::counters::CounterDef {
                    name: stringify!($name),
                    kind: $crate::counters::Kind::$kind,
                    column: $crate::counters::Column::$col $(($heading))?,
                    help: $help,
                }
            ),*];

            /// Every counter's definition with its value, in table order.
            pub fn counters(
                &self,
            ) -> impl Iterator<Item = (&'static $crate::counters::CounterDef, u64)> {
                Self::COUNTERS.iter().zip([$(self.$name),*])
            }

            /// Adds `other`'s counters to these (gauges left as they are).
            pub fn add_counters(&mut self, other: &Self) {
                $(
                    if $crate::counters::Kind::$kind.sums() {
                        self.$name = self.$name.wrapping_add(other.$name);
                    }
                )*
            }
        }

        $(#[$lmeta])*
        #[derive(Debug, Default)]
        $lvis struct $Live {
            $( #[doc = $help] pub $name: $Cell, )*
        }

        impl $Live {
            /// Writes every counter's current value into `snap`.
            #[allow(dead_code)]
            pub fn fill(&self, snap: &mut $Snap) {
                $( snap.$name = $crate::counters::ReadCounter::read(&self.$name); )*
            }
        }
    };
}

#[cfg(test)]
// The macro's items are `pub`, as every table's are.
#[allow(unreachable_pub)]
mod tests {
    use std::collections::HashSet;

    use serde::{Deserialize, Serialize};

    use super::*;

    crate::counter_table! {
        /// A test table.
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        pub struct Snap {
            /// Not a counter.
            pub id: u16,
        }
        /// Its live cells.
        pub struct Live of Counter;
        counters {
            a: Count, Always("A"), "Things counted";
            b: Bytes, IfAny("B"), "Bytes counted";
            g: Gauge, Hidden, "A level";
        }
    }

    #[test]
    fn a_table_gives_the_snapshot_the_live_cells_and_the_sum() {
        let live = Live::default();
        live.a.add(3);
        live.b.inc();
        live.g.set(7);
        let mut s = Snap {
            id: 4,
            ..Snap::default()
        };
        live.fill(&mut s);
        assert_eq!(
            s,
            Snap {
                id: 4,
                a: 3,
                b: 1,
                g: 7
            }
        );
        let names: Vec<_> = s.counters().map(|(d, v)| (d.name, v)).collect();
        assert_eq!(names, [("a", 3), ("b", 1), ("g", 7)]);
        assert_eq!(Snap::COUNTERS[1].column, Column::IfAny("B"));
        assert_eq!(Snap::COUNTERS[0].help, "Things counted");

        let mut t = s.clone();
        t.add_counters(&s);
        assert_eq!((t.a, t.b, t.g), (6, 2, 7), "gauges are not added up");

        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, r#"{"id":4,"a":3,"b":1,"g":7}"#);
        let old: Snap = serde_json::from_str(r#"{"id":1,"a":2}"#).unwrap();
        assert_eq!(
            old,
            Snap {
                id: 1,
                a: 2,
                ..Snap::default()
            }
        );
    }

    #[test]
    fn lcore_counter_names_are_unique_snake_case() {
        let defs = crate::api::LcoreStats::COUNTERS;
        let names: HashSet<_> = defs.iter().map(|d| d.name).collect();
        assert_eq!(names.len(), defs.len());
        for d in defs {
            assert!(
                d.name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{}",
                d.name
            );
            assert!(!d.help.is_empty() && !d.help.ends_with('.'), "{}", d.name);
        }
    }
}
