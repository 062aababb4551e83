//! Checks `PROTOCOL.md` against the code it documents: the header field table
//! (offsets and sizes from [`phub_proto::wire::field`]), the message-type,
//! dtype and drop-reason tables (every code listed, none extra), the size
//! constants, the join response's JSON (§4: what [`JoinResponse`]
//! serialises to, its layout what [`layout`] computes), and the hex example
//! (byte for byte what [`Repr::to_bytes`] emits for the values the example
//! states), and §10's tables of table keys: their spec fields, message
//! types and drop reasons, their join answer and the worked example of
//! row placement; and §11's replicas: the placement field, the message
//! types and drop reason, the replica sets and backup runs of its examples.
//! §5.6's optimizer formulas and worked examples need the engine:
//! engine/tests/rules/protocol_optimizers.rs checks them.

use std::ops::Range;

use phub_proto::api::JoinResponse;
use phub_proto::layout::ChunkRange;
use phub_proto::layout::{layout, Placement};
use phub_proto::memory::{MemoryModel, ResultStore};
use phub_proto::placement::{row_hash, table_key, RowPlacement};
use phub_proto::replica::{backup_runs, replica_set, ReplicaMsgType, MAX_REPLICAS};
use phub_proto::replica_rows::{entry_backup, rows_per_fragment, RowReplicaType};
use phub_proto::rows::{RowMsgType, MAX_ROW_MESSAGES};
use phub_proto::spec::rows_per_datagram;
use phub_proto::wire::{self, field, DropReason, MsgType, Repr};
use phub_proto::Dtype;

fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../PROTOCOL.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// Splits a markdown table row into trimmed cells, backticks removed.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().replace('`', "")).collect()
}

/// The body rows of the one table whose header row is exactly `header`.
fn table(doc: &str, header: &str) -> Vec<Vec<String>> {
    let lines: Vec<&str> = doc.lines().collect();
    let starts: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].trim() == header).collect();
    assert_eq!(
        starts.len(),
        1,
        "PROTOCOL.md must have exactly one table headed `{header}`"
    );
    let start = starts[0];
    let sep = lines.get(start + 1).map(|l| l.trim()).unwrap_or("");
    assert!(
        sep.starts_with('|') && sep.chars().all(|c| matches!(c, '|' | '-' | ':' | ' ')),
        "table `{header}` lacks its separator row"
    );
    let width = cells(header).len();
    let rows: Vec<Vec<String>> = lines[start + 2..]
        .iter()
        .take_while(|l| l.trim_start().starts_with('|'))
        .map(|l| cells(l))
        .collect();
    for r in &rows {
        assert_eq!(
            r.len(),
            width,
            "row {r:?} of table `{header}` has the wrong number of cells"
        );
    }
    assert!(!rows.is_empty(), "table `{header}` is empty");
    rows
}

fn num(s: &str) -> usize {
    s.parse()
        .unwrap_or_else(|_| panic!("`{s}` is not a decimal number"))
}

#[test]
fn field_table_matches_wire_field() {
    let one = |at: usize| at..at + 1;
    let expected: [(&str, Range<usize>, &str); 22] = [
        ("magic", field::MAGIC, "u32"),
        ("version", one(field::VERSION), "u8"),
        ("type", one(field::TYPE), "u8"),
        ("dtype", one(field::DTYPE), "u8"),
        ("flags", one(field::FLAGS), "u8"),
        ("token", field::TOKEN, "u64"),
        ("job", field::JOB, "u16"),
        ("rank", field::RANK, "u16"),
        ("count", field::COUNT, "u16"),
        ("error", field::ERROR, "u16"),
        ("round", field::ROUND, "u32"),
        ("slot", field::SLOT, "u32"),
        ("key", field::KEY, "u32"),
        ("chunk", field::CHUNK, "u32"),
        ("rx_share", field::RX_SHARE, "u32"),
        ("epoch", field::EPOCH, "u32"),
        ("fragment", one(field::FRAGMENT), "u8"),
        ("fragments", one(field::FRAGMENTS), "u8"),
        ("entry", field::ENTRY, "u32"),
        ("update_rank", field::UPDATE_RANK, "u16"),
        ("update_clock", field::UPDATE_CLOCK, "u32"),
        ("reserved", field::RESERVED, "u8[26]"),
    ];
    let rows = table(&doc(), "| offset | size | field | type | meaning |");
    let names: Vec<&str> = rows.iter().map(|r| r[2].as_str()).collect();
    let want: Vec<&str> = expected.iter().map(|e| e.0).collect();
    assert_eq!(names, want, "field rows, in offset order");
    for (row, (name, range, ty)) in rows.iter().zip(&expected) {
        assert_eq!(num(&row[0]), range.start, "offset of `{name}`");
        assert_eq!(num(&row[1]), range.len(), "size of `{name}`");
        assert_eq!(row[3], *ty, "type of `{name}`");
        assert!(!row[4].is_empty(), "`{name}` has no meaning");
    }
    // The fields tile the header with no gap or overlap.
    let mut at = 0;
    for (_, range, _) in &expected {
        assert_eq!(range.start, at);
        at = range.end;
    }
    assert_eq!(at, wire::HEADER_LEN);
    assert_eq!(field::PAYLOAD, wire::HEADER_LEN);
}

#[test]
fn constants_are_stated() {
    let d = doc();
    assert_eq!(wire::HEADER_LEN, 86);
    assert!(d.contains(&format!("**{}-byte header**", wire::HEADER_LEN)));
    assert!(d.contains(&format!("**Largest payload: {} bytes**", wire::MAX_PAYLOAD)));
    assert!(d.contains(&format!("{:#x}", wire::MAGIC)), "magic as hex");
    assert!(d.contains(&format!("# phub wire protocol, version {}", wire::VERSION)));
    assert!(d.contains(&format!("rank = {:#06x}", wire::APPLIANCE_RANK)));
    let per = |t: Dtype| wire::MAX_PAYLOAD / t.size();
    assert!(d.contains(&format!(
        "at most {} `f32` or {} `bf16`/`f16`",
        per(Dtype::F32),
        per(Dtype::Bf16)
    )));
    let flags = table(&d, "| bit | name | meaning |");
    let want = [
        (wire::flags::RETRANSMIT, "RETRANSMIT"),
        (wire::flags::SHM, "SHM"),
        (wire::flags::KEYS_STORE, "KEYS_STORE"),
        (wire::flags::KEYS_CACHED, "KEYS_CACHED"),
        (wire::flags::PROBE, "PROBE"),
        (wire::flags::FIRST_COPY, "FIRST_COPY"),
        (wire::flags::RESYNC, "RESYNC"),
        (wire::flags::CATCH_UP, "CATCH_UP"),
    ];
    assert_eq!(flags.len(), want.len());
    for (row, (bit, name)) in flags.iter().zip(want) {
        assert!(row[0].contains(&format!("{bit:#04x}")), "{name}");
        assert_eq!(row[1], name);
    }
    let (k0, k1) = phub_proto::shm::TAG_KEYS;
    assert!(d.contains(&format!("{k0:#x}, {k1:#x}")), "shared-memory tag keys");
}

#[test]
fn message_types_match() {
    let rows = table(&doc(), "| code | type | direction | payload |");
    let listed: Vec<(u8, String)> = rows.iter().map(|r| (num(&r[0]) as u8, r[1].clone())).collect();
    let want: Vec<(u8, String)> = MsgType::ALL
        .iter()
        .map(|t| (t.code(), t.name().to_string()))
        .collect();
    assert_eq!(listed, want);
    for r in &rows {
        let t = MsgType::from_code(num(&r[0]) as u8).unwrap();
        let dir = match t {
            MsgType::Init | MsgType::Push | MsgType::Pull => "worker → appliance",
            MsgType::Result | MsgType::Error => "appliance → worker",
            MsgType::Partial => "rack appliance → home appliance",
            MsgType::PartialResult => "home appliance → rack appliance",
        };
        assert_eq!(r[2], dir, "direction of {}", t.name());
    }
}

#[test]
fn dtypes_match() {
    let rows = table(&doc(), "| code | dtype | size | encoding |");
    let listed: Vec<(usize, String, usize)> = rows
        .iter()
        .map(|r| (num(&r[0]), r[1].clone(), num(&r[2])))
        .collect();
    let want: Vec<(usize, String, usize)> = Dtype::ALL
        .iter()
        .map(|t| (usize::from(t.code()), t.name().to_string(), t.size()))
        .collect();
    assert_eq!(listed, want);
}

#[test]
fn drop_reasons_match() {
    let rows = table(&doc(), "| code | name | meaning | ERROR sent |");
    let listed: Vec<(u16, String)> = rows.iter().map(|r| (num(&r[0]) as u16, r[1].clone())).collect();
    let want: Vec<(u16, String)> = DropReason::ALL
        .iter()
        .map(|r| (r.code(), r.name().to_string()))
        .collect();
    assert_eq!(listed, want, "every reason, in code order, none extra");
    // The reasons that answer with an ERROR are exactly those the engine uses.
    for r in &rows {
        let reason = DropReason::from_code(num(&r[0]) as u16).unwrap();
        let yes = reason.notifies_sender();
        assert_eq!(r[3], if yes { "yes" } else { "no" }, "ERROR sent for {reason}");
        assert!(!r[2].is_empty(), "{reason} has no meaning");
    }
}

#[test]
fn hex_example_is_what_repr_emits() {
    let d = doc();
    let blocks: Vec<&str> = d
        .split("```hex\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .collect();
    assert_eq!(blocks.len(), 1, "exactly one ```hex block");
    let mut bytes = Vec::new();
    for line in blocks[0].lines() {
        let pairs: Vec<&str> = line.split(' ').collect();
        assert!(pairs.len() <= 16, "more than 16 bytes on `{line}`");
        for p in pairs {
            assert!(
                p.len() == 2
                    && p.bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "`{p}` is not a lowercase hex byte"
            );
            bytes.push(u8::from_str_radix(p, 16).unwrap());
        }
    }
    // The values the example's text states.
    let repr = Repr::request(MsgType::Push, 1, 0x0123_4567_89ab_cdef, 2, 5, 3)
        .with_payload(Dtype::F32, 2048)
        .with_chunk(0, 7);
    assert!(d.contains(
        "A PUSH from rank 2 of job 1 (token 0x0123456789abcdef) for round 5, slot 3,\n\
         key 0, chunk 7, with 2048 `f32` elements (flags 0, error 0)."
    ));
    assert_eq!(bytes, repr.to_bytes().to_vec());
    // And it parses back to the same values once the payload is attached.
    let mut datagram = bytes.clone();
    datagram.resize(wire::HEADER_LEN + repr.payload_len(), 0);
    let (back, payload) = wire::parse(&datagram).unwrap();
    assert_eq!(back, repr);
    assert_eq!(payload.len(), 8192);
    assert!(d.contains(&format!("= {} bytes", datagram.len())));
}

#[test]
fn join_response_json_is_what_the_api_sends() {
    let d = doc();
    let (r, sent) = stated_join_response(&d, "json join-response");
    assert!(sent.contains(r#""lr":0.1,"#), "{sent}");
    // The layout is the one placement gives on the two lcores the text names.
    assert!(d.contains("on an appliance with two lcores"));
    let model = MemoryModel::default();
    assert_eq!(
        r.layout,
        layout(&r.spec, &mut [0, 0], model.chunk_cost(&r.spec, ResultStore::Slot))
    );
    // Every chunk is where the rule puts it: key 0's three chunks, then key 1's.
    let p = Placement::new(&r.spec, r.layout.clone()).unwrap();
    let places: Vec<(u16, u32)> = (0..2)
        .flat_map(|k| p.places(k).map(|pl| (pl.lcore, pl.slot)).collect::<Vec<_>>())
        .collect();
    assert_eq!(places, [(0, 0), (0, 1), (1, 0), (1, 1)]);
    assert!(d.contains("key 0's chunks are 0, 1, 2\n  and key 1's chunk is 3"));
    // What the text says of it.
    assert!(d.contains(&format!("a job of W = {} with two keys of", r.spec.workers)));
    let elems: Vec<u64> = r.spec.keys.iter().map(|k| k.elements).collect();
    assert!(d.contains(&format!("keys of {} and {}", elems[0], elems[1])));
    assert!(d.contains(&format!("chunks of {} bytes", r.spec.chunk_bytes)));
}

#[test]
fn sharded_join_response_json_is_what_the_api_sends_and_the_rule_places_it() {
    let d = doc();
    let (r, _) = stated_join_response(&d, "json join-response-sharded");
    // The layout is placement over the union of a's two lcores and b's one.
    let model = MemoryModel::default();
    assert_eq!(
        r.layout,
        layout(
            &r.spec,
            &mut [0, 0, 0],
            model.chunk_cost(&r.spec, ResultStore::Slot)
        ),
        "{}",
        serde_json::to_string(&layout(
            &r.spec,
            &mut [0, 0, 0],
            model.chunk_cost(&r.spec, ResultStore::Slot)
        ))
        .unwrap()
    );
    let counts: Vec<usize> = r.appliances.iter().map(|a| a.lcores as usize).collect();
    assert_eq!(counts.iter().sum::<usize>(), r.layout.lcores.len());
    assert_eq!(r.dataplane.host, r.appliances[0].host);
    // What the text says of each chunk's home, port and slot.
    let p = Placement::new(&r.spec, r.layout.clone()).unwrap();
    let homes: Vec<(&str, u16, u32)> = (0..p.chunks().total())
        .map(|g| {
            let pl = p.place_of(g).unwrap();
            let (mut l, mut i) = (usize::from(pl.lcore), 0);
            while l >= counts[i] {
                l -= counts[i];
                i += 1;
            }
            let a = &r.appliances[i];
            (a.name.as_str(), a.base_port + l as u16, pl.slot)
        })
        .collect();
    assert_eq!(
        homes,
        [("a", 9000, 0), ("a", 9001, 0), ("a", 9001, 1), ("b", 9000, 0)]
    );
    assert!(d.contains(
        "chunk 0 goes to\n  `a` port 9000 slot 0, chunks 1 and 2 to `a` port 9001 slots 0 and 1,\n  and chunk 3 to `b` port 9000 slot 0."
    ));
    // Each part is what its appliance installs.
    for part in r.layout.split(&counts) {
        assert!(Placement::part(&r.spec, part).is_ok());
    }
}

/// The one fenced block tagged `tag`.
/// The join answer of the doc's one block tagged `tag`: the API's type
/// reads it and writes back exactly the same fields and numbers (an `f32`
/// as the shortest decimal that reads back as it), and its spec is valid.
/// Also what the API writes, for checks of its text.
fn stated_join_response(d: &str, tag: &str) -> (JoinResponse, String) {
    let stated: serde_json::Value = serde_json::from_str(block(d, tag)).unwrap();
    let r: JoinResponse = serde_json::from_value(stated.clone()).unwrap();
    let sent = serde_json::to_string(&r).unwrap();
    assert_eq!(serde_json::from_str::<serde_json::Value>(&sent).unwrap(), stated);
    r.spec.validate().unwrap();
    (r, sent)
}

fn block<'a>(d: &'a str, tag: &str) -> &'a str {
    let blocks: Vec<&str> = d
        .split(&format!("```{tag}\n"))
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .collect();
    assert_eq!(blocks.len(), 1, "exactly one ```{tag} block");
    blocks[0]
}

#[test]
fn table_message_types_match() {
    let rows = table(&doc(), "| code | message | direction | payload |");
    let listed: Vec<(u8, String)> = rows.iter().map(|r| (num(&r[0]) as u8, r[1].clone())).collect();
    let want: Vec<(u8, String)> = RowMsgType::ALL
        .iter()
        .map(|t| (t.code(), t.name().to_string()))
        .collect();
    assert_eq!(listed, want);
    for r in &rows {
        let t = RowMsgType::from_code(num(&r[0]) as u8).unwrap();
        let dir = if t.from_worker() {
            "worker → appliance"
        } else {
            "appliance → worker"
        };
        assert_eq!(r[2], dir, "direction of {}", t.name());
        // Codes of table messages are no dense message's.
        assert_eq!(MsgType::from_code(t.code()), None);
    }
    let d = doc();
    assert!(d.contains(&format!("(n at most {MAX_ROW_MESSAGES},\n`MAX_ROW_MESSAGES`)")));
    // The figures of "How many fit".
    let r = |dim, dtype| rows_per_datagram(8192, dim, dtype);
    assert!(d.contains(&format!(
        "R = {} for D = 8, {} for\nD = 16 and {} for D = 64 in `f32`; {} for D = 16 in `bf16`.",
        r(8, Dtype::F32),
        r(16, Dtype::F32),
        r(64, Dtype::F32),
        r(16, Dtype::Bf16)
    )));
}

#[test]
fn table_drop_reasons_match() {
    let rows = table(&doc(), "| code | name | meaning (table messages) | ERROR sent |");
    let listed: Vec<(u16, String)> = rows.iter().map(|r| (num(&r[0]) as u16, r[1].clone())).collect();
    let want: Vec<(u16, String)> = DropReason::TABLE
        .iter()
        .map(|r| (r.code(), r.name().to_string()))
        .collect();
    assert_eq!(listed, want, "every table reason, in code order, none extra");
    for r in &rows {
        let reason = DropReason::from_code(num(&r[0]) as u16).unwrap();
        assert_eq!(
            r[3],
            if reason.notifies_sender() { "yes" } else { "no" },
            "{reason}"
        );
        assert!(!r[2].is_empty());
    }
}

#[test]
fn table_spec_fields_are_those_the_spec_reads() {
    let rows = table(&doc(), "| field | default | accepted | meaning |");
    let names: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(
        names,
        [
            "name",
            "kind",
            "dim",
            "rows",
            "seed",
            "init",
            "optimizer",
            "evict",
            "admit_after",
            "key_cache"
        ]
    );
    // The TOML example of §10.1 is a table key the spec reads.
    let d = doc();
    let example = block(&d, "toml");
    let text = format!("name = \"x\"\nworkers = 1\n[optimizer]\nkind = \"sum\"\n{example}");
    let spec = phub_proto::spec::JobSpec::from_toml(&text).unwrap();
    let t = spec.keys[0].table.as_ref().unwrap();
    assert_eq!(
        (t.dim, t.rows, t.seed, t.admit_after),
        (16, Some(1_000_000), 7, Some(2))
    );
}

#[test]
fn table_join_response_is_what_the_api_sends_and_rows_go_where_the_example_says() {
    let d = doc();
    let (r, _) = stated_join_response(&d, "json join-response-table");
    // The table takes no chunk: the layout is §4.1's, the dense keys placed
    // as without it.
    let model = MemoryModel::default();
    assert_eq!(
        r.layout,
        layout(
            &r.spec,
            &mut [0, 0, 0],
            model.chunk_cost(&r.spec, ResultStore::Slot)
        )
    );
    let p = Placement::new(&r.spec, r.layout.clone()).unwrap();
    let seq: Vec<(u32, usize)> = (0..3u32).map(|k| (k, p.places(k).count())).collect();
    assert_eq!(seq, [(0, 3), (1, 0), (2, 1)]);
    assert!(d.contains("key 0's chunks are 0, 1, 2 and key 2's\n  chunk is 3"));
    let emb = r.spec.tables().next().unwrap();
    assert_eq!((emb.key, emb.name, emb.spec.seed), (1, "emb", 7));
    assert!(d.contains("(seed 7, k = 1, L = 3: `a` with two\nlcores, `b` with one)"));
    // The worked example's rows, each where the code puts it.
    let place = RowPlacement::from_join(&r, 1).unwrap();
    assert!(RowPlacement::from_join(&r, 0).is_err(), "key 0 is dense");
    let rows = table(&d, "| id | entry | appliance | port |");
    assert!(rows.len() >= 6);
    let mut entries = std::collections::BTreeSet::new();
    for row in &rows {
        let id: u64 = row[0].parse().unwrap();
        let pl = place.place(id);
        let a = &r.appliances[pl.appliance as usize];
        assert_eq!(num(&row[1]) as u32, pl.entry, "id {id}");
        assert_eq!(row[2], a.name, "id {id}");
        assert_eq!(
            num(&row[3]),
            usize::from(a.base_port) + pl.lcore as usize,
            "id {id}"
        );
        entries.insert(pl.entry);
    }
    assert_eq!(entries.len(), 3, "the example reaches every lcore");
    let tk = table_key(7, 1);
    let h = row_hash(tk, 42);
    assert!(d.contains(&format!(
        "For id 42: tk = {tk:#018x}, h = {h:#018x}, entry = (h × 3) >> 64 = {}.",
        place.entry(42)
    )));
}

#[test]
fn replica_message_types_and_drop_reason_match() {
    let d = doc();
    let rows = table(&d, "| code | message | from → to | payload (replication) |");
    let listed: Vec<(u8, String)> = rows.iter().map(|r| (num(&r[0]) as u8, r[1].clone())).collect();
    let want: Vec<(u8, String)> = ReplicaMsgType::ALL
        .iter()
        .map(|t| (t.code(), t.name().to_string()))
        .collect();
    assert_eq!(listed, want);
    for r in &rows {
        let t = ReplicaMsgType::from_code(num(&r[0]) as u8).unwrap();
        let dir = match t {
            ReplicaMsgType::Replicate => "primary → backup",
            ReplicaMsgType::ReplicateAck | ReplicaMsgType::StateAck => "backup → primary",
            ReplicaMsgType::ReplicateState => "primary → backup",
        };
        assert_eq!(r[2], dir, "direction of {}", t.name());
        // No dense or table message has these codes.
        assert_eq!(MsgType::from_code(t.code()), None);
        assert_eq!(RowMsgType::from_code(t.code()), None);
    }
    let rows = table(
        &d,
        "| code | name | meaning (replication and epochs) | ERROR sent |",
    );
    let listed: Vec<(u16, String)> = rows.iter().map(|r| (num(&r[0]) as u16, r[1].clone())).collect();
    let want: Vec<(u16, String)> = [DropReason::WrongEpoch]
        .iter()
        .map(|r| (r.code(), r.name().to_string()))
        .collect();
    assert_eq!(
        listed, want,
        "every replication reason, in code order, none extra"
    );
    for r in &rows {
        let reason = DropReason::from_code(num(&r[0]) as u16).unwrap();
        assert_eq!(
            r[3],
            if reason.notifies_sender() { "yes" } else { "no" },
            "{reason}"
        );
    }
}

#[test]
fn table_replica_message_types_and_entry_example_match() {
    let d = doc();
    let rows = table(&d, "| code | message | from → to | payload (table replication) |");
    let listed: Vec<(u8, String)> = rows.iter().map(|r| (num(&r[0]) as u8, r[1].clone())).collect();
    let want: Vec<(u8, String)> = RowReplicaType::ALL
        .iter()
        .map(|t| (t.code(), t.name().to_string()))
        .collect();
    assert_eq!(listed, want);
    for r in &rows {
        let t = RowReplicaType::from_code(num(&r[0]) as u8).unwrap();
        let dir = match t {
            RowReplicaType::Rows | RowReplicaType::TableState => "primary → backup",
            RowReplicaType::RowsAck | RowReplicaType::TableStateAck => "backup → primary",
        };
        assert_eq!(r[2], dir, "direction of {}", t.name());
        // No other message has these codes.
        assert_eq!(MsgType::from_code(t.code()), None);
        assert_eq!(RowMsgType::from_code(t.code()), None);
        assert_eq!(ReplicaMsgType::from_code(t.code()), None);
    }
    // P for D = 16, as the text says.
    assert!(d.contains("(122 for D = 16)"));
    assert_eq!(rows_per_fragment(16), 122);
    // S, the copy stream's bytes a REPLICATE_TABLE_STATE carries.
    assert!(d.contains("S = 8832 − 16 = 8816"));
    assert_eq!(phub_proto::replica_rows::STATE_BYTES, 8816);
    // Appliance p's entries 3, 4, 5 on a backup of two lcores.
    let part = ChunkRange { first: 3, count: 3 };
    let rows = table(&d, "| entry | backup lcore |");
    assert_eq!(rows.len(), 3);
    for r in &rows {
        assert_eq!(
            entry_backup(part, 2, num(&r[0]) as u64),
            Some(num(&r[1])),
            "entry {}",
            r[0]
        );
    }
}

#[test]
fn replicas_field_is_what_the_spec_checks() {
    let rows = table(&doc(), "| placement field | default | accepted | meaning |");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0][0], "replicas");
    assert_eq!(rows[0][1], "1");
    assert!(
        rows[0][2].starts_with(&format!("1 to {MAX_REPLICAS},")),
        "{:?}",
        rows[0][2]
    );
    let half = phub_proto::spec::MAX_HIERARCHICAL_HALF_CHUNK_BYTES;
    assert!(
        rows[0][2].contains(&format!("at most {half}")),
        "{:?}",
        rows[0][2]
    );
}

#[test]
fn replica_set_example_is_what_the_rule_computes() {
    let rows = table(
        &doc(),
        "| primary | rack | backups (replicas = 2) | backups (replicas = 3) |",
    );
    let names: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    let racks: Vec<&str> = rows.iter().map(|r| r[1].as_str()).collect();
    assert_eq!(names, ["a", "b", "c", "d"]);
    for (p, r) in rows.iter().enumerate() {
        for (col, replicas) in [(2, 2), (3, 3)] {
            let set = replica_set(&racks, p, replicas);
            let backups: Vec<&str> = set[1..].iter().map(|&a| names[a]).collect();
            assert_eq!(
                r[col],
                backups.join(", "),
                "primary {}, replicas = {replicas}",
                names[p]
            );
        }
    }
    assert!(doc().contains("the ring is\n`a`, `c`, `b`, `d`"));
}

#[test]
fn backup_runs_example_is_what_the_rule_computes() {
    let v: serde_json::Value = serde_json::from_str(block(&doc(), "json backup-runs")).unwrap();
    let part: ChunkRange = serde_json::from_value(v["part"].clone()).unwrap();
    let lcores = v["lcores"].as_u64().unwrap() as usize;
    let runs: Vec<ChunkRange> = serde_json::from_value(v["runs"].clone()).unwrap();
    assert_eq!(backup_runs(part, lcores), runs);
}

#[test]
fn epoch_moved_example_is_what_a_drain_makes() {
    use phub_proto::api::DataAddr;
    use phub_proto::failover::EpochView;
    let v: EpochView = serde_json::from_str(block(&doc(), "json epoch-moved")).unwrap();
    let data = DataAddr {
        host: "10.0.0.4".into(),
        base_port: 9000,
    };
    assert_eq!(EpochView::default().with_moved(1, "d", data), v);
    assert_eq!(v.check(3), Ok(()));
    assert_eq!(
        v.moved_to(1).and_then(|m| m.lcore_addr(1)),
        Some("10.0.0.4:9001".parse().unwrap())
    );
}

#[test]
fn epoch_joined_example_is_what_a_return_makes_and_its_sets_are_as_stated() {
    use phub_proto::failover::{EpochView, ReplicaLayout};
    let v: EpochView = serde_json::from_str(block(&doc(), "json epoch-joined")).unwrap();
    let e1 = EpochView::default().with_down(1).unwrap();
    assert_eq!(e1.with_joined(1).unwrap(), v);
    // The example of §11.7: 3 appliances of one lcore, one rack, R = 2.
    let runs = vec![
        ChunkRange { first: 0, count: 2 },
        ChunkRange { first: 2, count: 2 },
        ChunkRange { first: 4, count: 2 },
    ];
    let l = ReplicaLayout::new(runs, &[1, 1, 1], vec![""; 3], 2).unwrap();
    assert_eq!(l.set_in(1, &v), [2, 1]);
    assert_eq!(l.set_in(0, &v), [0, 1]);
    let e3 = v.with_down(2).unwrap();
    assert_eq!(l.set_in(1, &e3), [1]);
    assert_eq!(l.set_in(2, &e3), [0]);
    let d = doc();
    assert!(d.contains("epoch 2: 1's part is set [2, 1] (2 serves it, 1 backs it up), 0's is\n[0, 1]"));
}

#[test]
fn replica_strength_example_reads_as_a_job_detail_s_replicas() {
    use phub_proto::api::{ReplicaStrength, Strength};
    let stated: serde_json::Value = serde_json::from_str(block(&doc(), "json replica-strength")).unwrap();
    let r: ReplicaStrength = serde_json::from_value(stated.clone()).unwrap();
    assert_eq!((r.wanted, r.live, r.state), (2, 2, Strength::FullStrength));
    let x = r.rereplication.as_ref().unwrap();
    assert_eq!(
        (x.appliance.as_str(), x.epoch, x.full_strength_ms()),
        ("b", 2, Some(250))
    );
    let sent = serde_json::to_value(&r).unwrap();
    assert_eq!(sent, stated);
}
