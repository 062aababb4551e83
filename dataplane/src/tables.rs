//! A job's table keys at install (PROTOCOL.md §10.1): where this
//! appliance's lcores are among the job's L lcores, and what each lcore is
//! told of each table ([`TableInstall`]).
//!
//! Every lcore of the job holds a part of every table. On one appliance
//! lcore i is entry i of L = its lcore count; a job sharded over several
//! appliances says where this one's lcores are (`InstallJob::entries`, set
//! by phub-control): lcore i is entry `first + i` of `total`. A sharded
//! job with tables whose install does not say is refused: its rows would
//! be placed on other lcores than its workers send them to.

use phub_engine::engine::TableInstall;
use phub_proto::api::{Entries, InstallJob};

/// Where `req`'s lcores are among the job's, on a dataplane of `n`
/// lcores, or why the install cannot place its tables.
pub fn entries(req: &InstallJob, n: usize) -> Result<Entries, String> {
    let own = u32::try_from(n).map_err(|_| format!("{n} lcores: more than a u32"))?;
    let appliances = req.spec.placement.as_ref().map_or(1, |p| p.count());
    match req.entries {
        None if appliances > 1 && req.spec.tables().next().is_some() => {
            let t = req.spec.tables().next().map_or(0, |t| t.key);
            Err(format!(
                "keys[{t}] is a table and placement.appliances names {appliances} appliances, but the \
                 install has no entries (this appliance's first lcore among the job's, and their count): \
                 accepted from a phub-control that sends them"
            ))
        }
        None => Ok(Entries { first: 0, total: own }),
        Some(e) => {
            if u64::from(e.first) + u64::from(own) > u64::from(e.total) {
                return Err(format!(
                    "entries = {{ first = {}, total = {} }}: this appliance's {own} lcores from entry {} \
                     pass the job's {} (accepted: first + {own} <= total)",
                    e.first, e.total, e.first, e.total
                ));
            }
            Ok(e)
        }
    }
}

/// What lcore `lcore` of this appliance is told of `req`'s tables.
pub fn installs(req: &InstallJob, entries: Entries, lcore: usize) -> Vec<TableInstall> {
    // Cast: lcore < n, and first + n <= total, a u32 (checked by entries()).
    #[allow(clippy::cast_possible_truncation)]
    let entry = entries.first + lcore as u32;
    debug_assert!(entry < entries.total, "entry {entry} of {}", entries.total);
    req.spec
        .tables()
        .map(|t| TableInstall {
            key: t.key,
            spec: t.spec.clone(),
            chunk_bytes: req.spec.chunk_bytes,
            lcores: entries.total,
            entry,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use phub_proto::layout::{ChunkRange, Layout};
    use phub_proto::spec::JobSpec;

    fn install(appliances: &str, entries: Option<Entries>) -> InstallJob {
        let spec = JobSpec::from_toml(&format!(
            "name = \"t\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n\
             [[keys]]\nelements = 8\n\
             [[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 4\nrows = 100\n{appliances}"
        ))
        .unwrap();
        InstallJob {
            id: 1,
            token: 5,
            spec,
            layout: Layout {
                chunk_elems: 8,
                lcores: vec![
                    ChunkRange { first: 0, count: 1 },
                    ChunkRange { first: 1, count: 0 },
                ],
            },
            hierarchy: None,
            replication: None,
            entries,
        }
    }

    /// One appliance: its lcores are the job's. Several: the install must
    /// say where this one's are, within the job's count; each lcore is
    /// then told its entry and L.
    #[test]
    fn entries_are_the_appliances_own_or_the_installs() {
        let one = install("", None);
        assert_eq!(entries(&one, 2).unwrap(), Entries { first: 0, total: 2 });
        let sharded = "[placement]\nappliances = [\"a\", \"b\"]\n";
        let e = entries(&install(sharded, None), 2).unwrap_err();
        assert!(
            e.contains("keys[1] is a table") && e.contains("no entries"),
            "{e}"
        );
        let told = Entries { first: 1, total: 3 };
        let req = install(sharded, Some(told));
        assert_eq!(entries(&req, 2).unwrap(), told);
        let t = installs(&req, told, 1);
        assert_eq!((t.len(), t[0].key, t[0].entry, t[0].lcores), (1, 1, 2, 3));
        let e = entries(&install(sharded, Some(Entries { first: 2, total: 3 })), 2).unwrap_err();
        assert!(e.contains("first + 2 <= total"), "{e}");
    }
}
