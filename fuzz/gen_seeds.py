#!/usr/bin/env python3
"""Writes the committed seed corpora under fuzz/seeds/ from PROTOCOL.md's format.

seeds/parse: a few well-formed datagrams of every message type and dtype
(small payloads), plus a truncated one. seeds/rows: the same for the table
messages (PROTOCOL.md §10.2). seeds/replica: the replication messages
(PROTOCOL.md §11.3). seeds/spec: job specs in TOML and JSON, table
keys among them.
Run from anywhere; it rewrites the seed files in place.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
MAGIC = int.from_bytes(b"PHUB", "little")
INIT, PUSH, PULL, RESULT, ERROR = 1, 2, 3, 4, 5
F32, BF16, F16 = 0, 1, 2
SIZE = {F32: 4, BF16: 2, F16: 2}


def header(kind, dtype, flags, token, job, rank, count, error, rnd, slot, key, chunk):
    h = struct.pack("<IBBBBQHHHHIIII", MAGIC, 1, kind, dtype, flags, token, job, rank,
                    count, error, rnd, slot, key, chunk)
    h += bytes(46)
    assert len(h) == 86
    return h


def msg(kind, dtype, count, rank=0, rnd=0, flags=0, error=0, slot=3, key=1, chunk=2):
    payload = bytes((i * 7 + 1) & 0xFF for i in range(count * SIZE[dtype]))
    return header(kind, dtype, flags, 0x0123456789ABCDEF, 1, rank, count, error,
                  rnd, slot, key, chunk) + payload


PARSE = {
    "init_rank0_f32": msg(INIT, F32, 16),
    "init_rank1_empty": msg(INIT, F32, 0, rank=1),
    "push_f32": msg(PUSH, F32, 16, rank=2, rnd=5),
    "push_bf16_retransmit": msg(PUSH, BF16, 32, rank=1, rnd=1, flags=1),
    "push_f16": msg(PUSH, F16, 8, rank=3, rnd=2),
    "pull": msg(PULL, BF16, 0, rank=1, rnd=0xFFFFFFFF),
    "result_f16": msg(RESULT, F16, 8, rank=0xFFFF, rnd=9),
    "error_ahead": msg(ERROR, F32, 0, rank=2, rnd=7, error=19),
    "truncated": msg(PUSH, F32, 0)[:40],
}

ROW_PUSH, ROW_END, ROW_PULL, ROW_RESULT, ROW_DONE, ROW_PULL_RESULT = 8, 9, 10, 11, 12, 13


def row_msg(kind, dtype, ids, dim, rank=0, rnd=1, seq=0, flags=0):
    """A table message (PROTOCOL.md §10.2): slot carries dim, chunk the
    sequence number; the payload is the ids, then (for rows) the rows."""
    payload = b"".join(struct.pack("<Q", i) for i in ids)
    if kind in (ROW_PUSH, ROW_RESULT, ROW_PULL_RESULT):
        payload += bytes((i * 5 + 3) & 0xFF for i in range(len(ids) * dim * SIZE[dtype]))
    return header(kind, dtype, flags, 0x0123456789ABCDEF, 1, rank, len(ids), 0,
                  rnd, dim, 1, seq) + payload


ROWS = {
    "row_push_f32": row_msg(ROW_PUSH, F32, [0, 42, 2**64 - 1], 4, rank=1, rnd=3, seq=2),
    "row_push_bf16_retransmit": row_msg(ROW_PUSH, BF16, [7, 9], 16, flags=1),
    "row_end": row_msg(ROW_END, F32, [], 4, seq=3),
    "row_end_empty_round": row_msg(ROW_END, F16, [], 8, seq=0),
    "row_pull": row_msg(ROW_PULL, F32, [1, 2, 3, 4], 4, rnd=0),
    "row_result": row_msg(ROW_RESULT, F32, [0, 42], 4, rank=0xFFFF, seq=1),
    "row_done": row_msg(ROW_DONE, F32, [], 4, rank=0xFFFF, seq=3),
    "row_pull_result_f16": row_msg(ROW_PULL_RESULT, F16, [5], 8, rank=0xFFFF),
    "row_truncated": row_msg(ROW_PUSH, F32, [1], 4)[:90],
}

TABLE_TOML = '''name = "emb"
workers = 2
[optimizer]
kind = "sum"
[[keys]]
name = "w"
elements = 40
[[keys]]
name = "emb"
kind = "table"
dim = 16
rows = 1000000
seed = 7
init = { kind = "uniform", a = -0.05, b = 0.05 }
optimizer = { kind = "adagrad", lr = 0.05, rowwise = true }
evict = { idle_rounds = 100 }
admit_after = 2
'''

TOML = '''name = "toy"
workers = 3
dtype = "bf16"
chunk_bytes = 4096
[optimizer]
kind = "adam"
lr = 0.001
[consistency]
mode = "sync"
[[keys]]
name = "w"
elements = 10
[[keys]]
elements = 1
'''

JSON = [
    {"name": "sgd", "workers": 4, "dtype": "f32", "chunk_bytes": 8192,
     "optimizer": {"kind": "sgd", "lr": 0.1, "weight_decay": 0.0001},
     "keys": [{"name": "conv1.weight", "elements": 9408}, {"elements": 64}]},
    {"name": "mom", "workers": 2, "dtype": "f16", "chunk_bytes": 1024,
     "optimizer": {"kind": "nesterov", "lr": 0.01, "momentum": 0.9},
     "consistency": {"mode": "bounded", "delay": 2},
     "keys": [{"elements": 4294967295}]},
    {"name": "sum", "workers": 256, "optimizer": {"kind": "sum"},
     "keys": [{"elements": 1}]},
]

REPLICATE, REPLICATE_ACK = 14, 15


def replica_msg(kind, count, rnd=3, epoch=0, flags=0, rank=1):
    """A replication message (PROTOCOL.md §11.3): f32, rank is the sending
    appliance's index, the epoch at offset 44."""
    h = header(kind, F32, flags, 0x0123456789ABCDEF, 1, rank, count, 0, rnd, 3, 1, 2)
    h = h[:44] + struct.pack("<I", epoch) + h[48:]
    return h + bytes((i * 3 + 1) & 0xFF for i in range(count * 4))


REPLICAS = {
    "replicate_round0": replica_msg(REPLICATE, 16, rnd=0),
    "replicate_retransmit_epoch2": replica_msg(REPLICATE, 8, epoch=2, flags=1),
    "replicate_ack": replica_msg(REPLICATE_ACK, 0, rank=2),
    "replicate_ack_with_payload": replica_msg(REPLICATE_ACK, 1),
}


def write(d, name, data):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def main():
    for name, data in PARSE.items():
        write(os.path.join(HERE, "seeds", "parse"), name + ".bin", data)
    for name, data in ROWS.items():
        write(os.path.join(HERE, "seeds", "rows"), name + ".bin", data)
    for name, data in REPLICAS.items():
        write(os.path.join(HERE, "seeds", "replica"), name + ".bin", data)
    spec = os.path.join(HERE, "seeds", "spec")
    write(spec, "table.toml", TABLE_TOML.encode())
    write(spec, "table_ftrl.toml", TABLE_TOML.replace(
        'optimizer = { kind = "adagrad", lr = 0.05, rowwise = true }',
        'optimizer = { kind = "ftrl", alpha = 0.1, l1 = 1.0 }').encode())
    write(spec, "adam.toml", TOML.encode())
    write(spec, "adamw.toml", TOML.replace('"adam"', '"adamw"\nweight_decay = 0.01')
          .replace('"bf16"', '"f32"').encode())
    write(spec, "momentum.toml", TOML.replace('kind = "adam"', 'kind = "momentum"\nmomentum = 0.5')
          .replace("chunk_bytes = 4096", "chunk_bytes = 8832").encode())
    for i, j in enumerate(JSON):
        write(spec, "spec%d.json" % i, json.dumps(j, indent=1).encode())


if __name__ == "__main__":
    main()
