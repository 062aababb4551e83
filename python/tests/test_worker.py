"""phub.Worker against a local appliance, NumPy only (no torch): `make test-python`."""

from __future__ import annotations

import array
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

import phub
from phub import admin

Workers = Callable[..., list[phub.Worker]]


def init_all(ws: list[phub.Worker], key: int, arrays: list[np.ndarray]) -> None:
    hs = [w.init(key, a) for w, a in zip(ws, arrays)]
    for h in hs:
        h.wait()


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 values (exact for values bf16 represents)."""
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


# -- exchange ---------------------------------------------------------------

def test_init_broadcasts_rank0_values(workers: Workers) -> None:
    ws = workers([("w", 5000)], 3)
    arrays = [np.full(5000, r + 1, np.float32) for r in range(3)]
    arrays[0][:] = np.arange(5000)
    hs = [w.init(0, a) for w, a in zip(ws, arrays)]
    for h, a in zip(hs, arrays):
        assert h.round == 0 and h.key == 0 and h.pending
        assert h.wait() is a  # the output array itself, written in place
        assert not h.pending
    for a in arrays:
        np.testing.assert_array_equal(a, np.arange(5000, dtype=np.float32))
    assert all(w.key_round(0) == 0 for w in ws)


def test_push_pull_sums_exactly_over_rounds_and_keys(workers: Workers) -> None:
    # Key sizes: one element, one full chunk (2048 f32), a partial last chunk, several chunks.
    sizes = [1, 2048, 2049, 50_000]
    ws = workers(sizes, 3)
    for k, n in enumerate(sizes):
        init_all(ws, k, [np.zeros(n, np.float32) for _ in ws])
    rng = np.random.default_rng(7)
    for rnd in range(1, 6):
        grads = [[rng.integers(-1000, 1000, n).astype(np.float32) for n in sizes] for _ in ws]
        outs = [[np.empty(n, np.float32) for n in sizes] for _ in ws]
        handles = [[w.push_pull(k, grads[r][k], outs[r][k]) for k in range(len(sizes))] for r, w in enumerate(ws)]
        for r, hs in enumerate(handles):
            for k, h in enumerate(hs):
                assert h.round == rnd
                assert h.wait() is outs[r][k]
        for k in range(len(sizes)):
            want = sum(grads[r][k] for r in range(len(ws)))
            for r in range(len(ws)):
                np.testing.assert_array_equal(outs[r][k], want)  # exact: integers in f32


def test_push_pull_lends_its_output_over_datagrams(workers: Workers) -> None:
    """push_pull over datagrams lends the output to the I/O thread
    (Handle.lent): in place, and into another array with the gradient
    copied (reusable at once); an unaligned output, a gradient partly
    overlapping its output and lend=False go the copying way. Every result
    exact; wait_in_place only for the copying way."""
    sizes = [1, 2049, 50_000]
    ws = workers(sizes, 2)
    for k, n in enumerate(sizes):
        init_all(ws, k, [np.zeros(n, np.float32) for _ in ws])
    rng = np.random.default_rng(13)
    for rnd in range(1, 4):
        grads = [[rng.integers(-1000, 1000, n).astype(np.float32) for n in sizes] for _ in ws]
        want = [grads[0][k] + grads[1][k] for k in range(len(sizes))]
        bufs = [g.copy() for g in grads[0]]
        hs0 = [ws[0].push_pull(k, b) for k, b in enumerate(bufs)]  # in place
        outs = [np.empty(n, np.float32) for n in sizes]
        sent = [g.copy() for g in grads[1]]
        hs1 = [ws[1].push_pull(k, g, o) for k, (g, o) in enumerate(zip(sent, outs))]
        for g in sent:
            g[:] = 7.0  # reused at once: the push took a copy
        for h0, h1 in zip(hs0, hs1):
            assert h0.lent and h1.lent and h0.round == h1.round == rnd
        with pytest.raises(phub.UsageError, match="was lent"):
            hs0[2].wait_in_place()
        for k in range(len(sizes)):
            assert hs0[k].wait() is bufs[k] and hs1[k].wait() is outs[k]
            np.testing.assert_array_equal(bufs[k], want[k])
            np.testing.assert_array_equal(outs[k], want[k])
    # The copying way: lend=False (results read in place), an unaligned
    # output, a gradient partly overlapping its output.
    n = sizes[1]
    unaligned = np.frombuffer(bytearray(4 * n + 1), dtype=np.float32, offset=1, count=n)
    both = np.zeros(n + 1, np.float32)
    both[:n] = 3.0
    h0 = ws[0].push_pull(1, np.full(n, 1.0, np.float32), lend=False)
    h1 = ws[1].push_pull(1, np.full(n, 2.0, np.float32), unaligned)
    assert not h0.lent and not h1.lent
    res = h0.wait_in_place()
    got = np.concatenate([np.frombuffer(b, dtype=np.float32)[:c] for b, _, c in res.spans])
    np.testing.assert_array_equal(got, 3.0)
    res.release()
    np.testing.assert_array_equal(h1.wait(), 3.0)
    h0 = ws[0].push_pull(1, both[:n], both[1:])
    h1 = ws[1].push_pull(1, np.full(n, 2.0, np.float32))
    assert not h0.lent and h1.lent
    h0.wait(), h1.wait()
    np.testing.assert_array_equal(both[1:], 5.0)


def test_exchange_lends_arrays_in_place_and_with_outputs(workers: Workers, in_threads: Any) -> None:
    """Worker.exchange: every key's round in one call, the arrays lent to
    the I/O thread, in place ((key, grad)) or into an output ((key, grad,
    out)): each result is the ranks' exact sum, as push_pull's."""
    sizes = [1, 2049, 50_000]
    ws = workers(sizes, 2)
    for k, n in enumerate(sizes):
        init_all(ws, k, [np.zeros(n, np.float32) for _ in ws])
    rng = np.random.default_rng(11)
    for rnd in range(1, 4):
        grads = [[rng.integers(-1000, 1000, n).astype(np.float32) for n in sizes] for _ in ws]
        bufs = [[g.copy() for g in gs] for gs in grads]
        outs = [[np.empty(n, np.float32) for n in sizes] for _ in ws]
        # Rank 0 in place, rank 1 into outputs but for key 0 (in place).
        reqs = [[(k, bufs[0][k]) for k in range(len(sizes))],
                [(0, bufs[1][0])] + [(k, bufs[1][k], outs[1][k]) for k in range(1, len(sizes))]]
        assert in_threads([lambda w=w, rq=rq: w.exchange(rq) for w, rq in zip(ws, reqs)]) == [None, None]
        for k in range(len(sizes)):
            want = grads[0][k] + grads[1][k]
            np.testing.assert_array_equal(bufs[0][k], want)
            np.testing.assert_array_equal(bufs[1][k] if k == 0 else outs[1][k], want)
            if k > 0:
                np.testing.assert_array_equal(bufs[1][k], grads[1][k])  # a lent gradient is only read
    w0 = ws[0]
    unaligned = np.frombuffer(bytearray(5), dtype=np.float32, offset=1, count=1)
    with pytest.raises(phub.UsageError, match="lent in place"):
        w0.exchange([(0, unaligned)])
    with pytest.raises(phub.UsageError, match="overlaps"):
        b = np.zeros(2 * 2049, np.float32)
        w0.exchange([(1, b[:2049], b[1:2050])])
    with pytest.raises(phub.UsageError, match="tuple"):
        w0.exchange([(0,)])


def test_exchange_start_keeps_several_in_flight_and_claims_their_arrays(workers: Workers) -> None:
    """Worker.exchange_start: two exchanges per rank in flight at once
    (a DDP hook's buckets), waited in either order or ended by being
    dropped; exact sums; their arrays claimed until then."""
    sizes = [1, 2049, 50_000]
    ws = workers(sizes, 2)
    for k, n in enumerate(sizes):
        init_all(ws, k, [np.zeros(n, np.float32) for _ in ws])
    # init copied: each key keeps its datagrams and a result buffer.
    assert ws[0].stats()["spare_bytes"] >= 2 * 4 * sum(sizes)
    rng = np.random.default_rng(12)
    for rnd in range(1, 4):
        grads = [[rng.integers(-1000, 1000, n).astype(np.float32) for n in sizes] for _ in ws]
        bufs = [[g.copy() for g in gs] for gs in grads]
        outs = [np.empty(sizes[2], np.float32) for _ in ws]
        # Per rank: key 0 in place, then keys 1 (in place) and 2 (into out),
        # all started before any is waited; returns at once (no rank waits
        # for the other here).
        pend = [(w.exchange_start([(0, b[0])]), w.exchange_start([(1, b[1]), (2, b[2], o)]))
                for w, b, o in zip(ws, bufs, outs)]
        assert pend[0][1].keys == [1, 2]
        with pytest.raises(phub.UsageError, match="overlaps the output array of key 1"):
            ws[0].push_pull(1, np.ones(2049, np.float32), bufs[0][1])
        with pytest.raises(phub.UsageError, match="overlaps the output array of key 2"):
            ws[0].exchange_start([(2, outs[0])])
        if rnd == 2:
            # Dropped without a wait: each drop blocks until its requests end.
            for r in (1, 0):
                del pend[r]
        else:
            for first, second in pend:
                second.wait()
                first.wait()
            with pytest.raises(phub.UsageError, match="already waited"):
                pend[0][0].wait()
        for r in range(2):
            for k in range(3):
                want = grads[0][k] + grads[1][k]
                np.testing.assert_array_equal(outs[r] if k == 2 else bufs[r][k], want)
            np.testing.assert_array_equal(bufs[r][2], grads[r][2])  # a lent gradient is only read
        assert all(w.key_round(k) == rnd for w in ws for k in range(3))
        # Lent: each key keeps its headers' buffer only.
        assert ws[0].stats()["spare_bytes"] < 4 * sum(sizes) // 10
    # A bad request fails at start, naming itself; nothing stays claimed.
    with pytest.raises(phub.UsageError, match="tuple"):
        ws[0].exchange_start([(0,)])


def test_push_pull_in_place_by_default(workers: Workers) -> None:
    w0, w1 = workers([1000])
    init_all([w0, w1], 0, [np.zeros(1000, np.float32)] * 2)
    g0 = np.arange(1000, dtype=np.float32)
    g1 = np.ones(1000, np.float32)
    h0, h1 = w0.push_pull(0, g0), w1.push_pull(0, g1)
    assert h0.wait() is g0 and w1.wait(h1) is g1
    np.testing.assert_array_equal(g0, np.arange(1000) + 1)
    np.testing.assert_array_equal(g1, g0)


def test_mean_job(workers: Workers) -> None:
    ws = workers([3000], 4, optimizer="mean")
    init_all(ws, 0, [np.zeros(3000, np.float32) for _ in ws])
    grads = [np.full(3000, 2.0 * r, np.float32) for r in range(4)]
    hs = [w.push_pull(0, g) for w, g in zip(ws, grads)]
    for h in hs:
        h.wait()
    for g in grads:
        np.testing.assert_allclose(g, 3.0)  # (0 + 2 + 4 + 6) / 4


def test_server_side_sgd(workers: Workers) -> None:
    ws = workers([4096], 2, optimizer={"kind": "sgd", "lr": 0.5})
    p = [np.linspace(-1, 1, 4096, dtype=np.float32), np.zeros(4096, np.float32)]
    start = p[0].copy()
    init_all(ws, 0, p)
    np.testing.assert_array_equal(p[1], start)
    g = [np.full(4096, 1.0, np.float32), np.full(4096, 3.0, np.float32)]
    hs = [w.push_pull(0, gi, pi) for w, gi, pi in zip(ws, g, p)]
    for h in hs:
        h.wait()
    for pi in p:
        np.testing.assert_allclose(pi, start - 0.5 * 2.0, rtol=0, atol=1e-6)


def test_other_buffer_protocol_objects(workers: Workers) -> None:
    w0, w1 = workers([16])
    a0 = array.array("f", range(16))
    a1 = bytearray(64)  # 16 float32 zeros, as raw bytes: cast through a memoryview
    m1 = memoryview(a1).cast("f")
    init_all([w0, w1], 0, [a0, m1])  # type: ignore[list-item]
    assert list(m1) == list(range(16))
    h0 = w0.push_pull(0, array.array("f", [1.0] * 16), a0)
    h1 = w1.push_pull(0, memoryview(bytearray(np.full(16, 2.0, np.float32).tobytes())).cast("f"), m1)
    h0.wait(), h1.wait()
    assert list(a0) == [3.0] * 16 and list(m1) == [3.0] * 16


def test_unaligned_float32_goes_through_scratch(workers: Workers) -> None:
    w0, w1 = workers([100])
    raw = bytearray(401)
    unaligned = np.frombuffer(raw, dtype=np.float32, offset=1, count=100)
    assert unaligned.ctypes.data % 4 != 0
    init_all([w0, w1], 0, [np.zeros(100, np.float32), np.zeros(100, np.float32)])
    unaligned[:] = 5.0
    h0 = w0.push_pull(0, unaligned)  # in place, unaligned: read by copy, written back on wait
    h1 = w1.push_pull(0, np.ones(100, np.float32))
    h0.wait(), h1.wait()
    np.testing.assert_array_equal(unaligned, 6.0)


def test_float16_job(workers: Workers) -> None:
    w0, w1 = workers([3000], dtype="f16")
    p0 = np.zeros(3000, np.float16)
    p1 = np.zeros(3000, np.float32)  # float32 works with every job
    init_all([w0, w1], 0, [p0, p1])
    g0 = (np.arange(3000) % 100).astype(np.float16)
    g1 = np.full(3000, 0.5, np.float32)
    h0, h1 = w0.push_pull(0, g0, p0), w1.push_pull(0, g1, p1)
    h0.wait(), h1.wait()
    want = (np.arange(3000) % 100 + 0.5).astype(np.float32)
    np.testing.assert_array_equal(p0.astype(np.float32), want)
    np.testing.assert_array_equal(p1, want)
    with pytest.raises(phub.UsageError, match="float64"):
        w0.push_pull(0, np.zeros(3000, np.float64))


def test_bfloat16_job_takes_bits_as_int16(workers: Workers) -> None:
    w0, w1 = workers([1000], dtype="bf16")
    init_all([w0, w1], 0, [np.zeros(1000, np.uint16), np.zeros(1000, np.int16)])
    v0 = (np.arange(1000) % 64).astype(np.float32)
    b0 = bf16_bits(v0)
    b1 = bf16_bits(np.full(1000, 0.25, np.float32)).view(np.int16)
    h0, h1 = w0.push_pull(0, b0), w1.push_pull(0, b1)
    h0.wait(), h1.wait()
    np.testing.assert_array_equal(from_bf16_bits(b0), v0 + 0.25)
    np.testing.assert_array_equal(from_bf16_bits(b1.view(np.uint16)), v0 + 0.25)
    # float16 is not bfloat16: refused, with what is accepted.
    with pytest.raises(phub.UsageError, match="bfloat16 bits"):
        w0.push_pull(0, np.zeros(1000, np.float16))


def test_sixteen_bit_arrays_in_place_unaligned_overlapping_and_mixed(workers: Workers) -> None:
    """16-bit arrays go in place as the wire's bits; the cases that cannot
    (unaligned, a gradient overlapping another output, a float32 gradient
    with a 16-bit output) give the same results through a copy."""
    w0, w1 = workers([256], dtype="f16")
    base = np.zeros(256, np.float16)
    init_all([w0, w1], 0, [base.copy(), base.copy()])
    want = np.arange(256, dtype=np.float32) % 32 + 1.0

    # Unaligned: its own bytes at an odd address.
    raw = bytearray(2 * 256 + 1)
    unaligned = np.frombuffer(raw, dtype=np.float16, offset=1, count=256)
    assert unaligned.ctypes.data % 2 != 0
    unaligned[:] = (np.arange(256) % 32).astype(np.float16)
    h0 = w0.push_pull(0, unaligned)
    h1 = w1.push_pull(0, np.ones(256, np.float16))
    h0.wait(), h1.wait()
    np.testing.assert_array_equal(unaligned.astype(np.float32), want)

    # The gradient shifted by one element inside the output's memory.
    buf = np.zeros(257, np.float16)
    buf[1:] = (np.arange(256) % 32).astype(np.float16)
    out, grad = buf[:256], buf[1:]
    h0 = w0.push_pull(0, grad, out)
    h1 = w1.push_pull(0, np.ones(256, np.float16))
    h0.wait(), h1.wait()
    np.testing.assert_array_equal(out.astype(np.float32), want)

    # float32 gradient, float16 output (and the reverse).
    o0, o1 = np.zeros(256, np.float16), np.zeros(256, np.float32)
    h0 = w0.push_pull(0, (np.arange(256) % 32).astype(np.float32), o0)
    h1 = w1.push_pull(0, np.ones(256, np.float16), o1)
    h0.wait(), h1.wait()
    np.testing.assert_array_equal(o0.astype(np.float32), want)
    np.testing.assert_array_equal(o1, want)


def test_pull_returns_the_last_result(workers: Workers) -> None:
    w0, w1 = workers([500])
    init_all([w0, w1], 0, [np.zeros(500, np.float32)] * 2)
    for _ in range(3):
        hs = [w.push_pull(0, np.full(500, 1.5, np.float32), np.empty(500, np.float32)) for w in (w0, w1)]
        for h in hs:
            h.wait()
    out = np.zeros(500, np.float32)
    assert w0.pull(0, out) == 3
    np.testing.assert_array_equal(out, 3.0)


def test_properties_spec_and_stats(workers: Workers) -> None:
    w0, w1 = workers([("a", 10), ("b", 20)], optimizer={"kind": "momentum", "lr": 0.1})
    assert (w0.rank, w1.rank, w0.workers, w0.keys) == (0, 1, 2, 2)
    assert w0.dtype_name == "f32" and w0.optimizer == "momentum"
    assert w0.key_len(1) == 20 and w0.key_len(2) is None and w0.key_round(0) is None
    spec = w0.spec()
    assert spec["keys"][1] == {"name": "b", "elements": 20}
    assert spec["optimizer"]["kind"] == "momentum"
    assert "job=" in repr(w0) and ":" in w0.local_addr
    init_all([w0, w1], 0, [np.zeros(10, np.float32)] * 2)
    s = w0.stats()
    assert s["chunks_sent"] >= 1 and s["results_accepted"] >= 1 and s["timeouts"] == 0


def test_shared_memory_with_a_shm_appliance() -> None:
    """LocalAppliance(shm=True): workers on this machine exchange through
    /dev/shm by default ("auto"), exactly; "off" sticks to datagrams."""
    from phub.local import LocalAppliance

    with LocalAppliance(lcores=2, memory_budget="256MiB", shm=True) as app:
        jid, token = app.admit(admin.job_spec("pytest-shm", 2, [5000, 3], optimizer="sum", dtype="f16"))
        w0 = phub.Worker.join(app.control_url, jid, token, 0)
        w1 = phub.Worker.join(app.control_url, jid, token, 1, shm="off")
        assert w0.shm and not w1.shm
        for k, n in enumerate([5000, 3]):
            init_all([w0, w1], k, [np.zeros(n, np.float32)] * 2)
            want = (np.arange(n) % 50).astype(np.float32) + 2.0
            h0 = w0.push_pull(k, (np.arange(n) % 50).astype(np.float32))  # in place
            h1 = w1.push_pull(k, np.full(n, 2.0, np.float32))
            np.testing.assert_array_equal(h0.wait(), want)
            np.testing.assert_array_equal(h1.wait(), want)
        s0, s1 = w0.stats(), w1.stats()
        assert s0["shm"] is True and s0["shm_results"] == s0["results_accepted"] > 0
        assert s1["shm"] is False and s1["shm_results"] == 0


def test_values_staged_in_place_through_the_buffer_protocol() -> None:
    """Worker.stage: rank 0 writes its gradient straight into its staging
    regions (numpy views of the spans' buffers) and pushes headers only;
    the results are exact. A staged key is busy until pushed or released;
    a worker without shared memory stages nothing."""
    from phub.local import LocalAppliance

    with LocalAppliance(lcores=2, memory_budget="256MiB", shm=True) as app:
        keys = [20000, 3]
        jid, token = app.admit(admin.job_spec("pytest-staged", 2, keys, optimizer="sum"))
        w0 = phub.Worker.join(app.control_url, jid, token, 0)
        w1 = phub.Worker.join(app.control_url, jid, token, 1, shm="off")
        assert w0.shm and not w1.shm
        assert w1.stage(0) is None
        for rnd in range(1, 4):
            for k, n in enumerate(keys):
                if rnd == 1:
                    init_all([w0, w1], k, [np.zeros(n, np.float32)] * 2)
                g0 = (np.arange(n) % 50).astype(np.float32) * rnd
                st = w0.stage(k)
                assert st is not None and st.key == k and st.round == rnd
                with pytest.raises(phub.PhubError, match="already has a request in flight"):
                    w0.stage(k)
                covered = 0
                for buf, first, count in st.spans:
                    assert first == covered and buf.nbytes == 4 * count
                    np.frombuffer(buf, dtype=np.float32)[:] = g0[first:first + count]
                    covered += count
                assert covered == n
                regions = st.regions
                assert regions and all(r.nbytes > 0 and r.same_mapping(regions[0]) for r in regions)
                out0 = np.empty(n, np.float32)
                h0 = w0.push_pull_staged(st, out0)
                with pytest.raises(phub.UsageError, match="already pushed or released"):
                    w0.push_pull_staged(st, out0)
                h1 = w1.push_pull(k, np.full(n, 2.0, np.float32))
                want = g0 + 2.0
                np.testing.assert_array_equal(h0.wait(), want)
                np.testing.assert_array_equal(h1.wait(), want)
        s0 = w0.stats()
        assert s0["shm_results"] == s0["results_accepted"] > 0
        # Released without a push: the key is free again.
        st = w0.stage(0)
        assert st is not None
        st.release()
        w0.stage(0).release()
        # Results left in place: read from the spans, exact; the key is
        # busy until they and their buffers are gone; the output untouched.
        for k, n in enumerate(keys):
            st = w0.stage(k)
            g0 = np.full(n, 3.0, np.float32)
            for buf, first, count in st.spans:
                np.frombuffer(buf, dtype=np.float32)[:] = g0[first:first + count]
            out0 = np.zeros(n, np.float32)
            h0 = w0.push_pull_staged(st, out0)
            h1 = w1.push_pull(k, np.full(n, 2.0, np.float32))
            res = h0.wait_in_place()
            h1.wait()
            got = np.empty(n, np.float32)
            spans = res.spans
            for buf, first, count in spans:
                assert buf.readonly
                view = np.frombuffer(buf, dtype=np.float32)
                with pytest.raises(ValueError):
                    view[0] = 1.0
                got[first:first + count] = view
            np.testing.assert_array_equal(got, np.full(n, 5.0, np.float32))
            assert not out0.any()
            assert res.regions and all(r.readonly for r in res.regions)
            with pytest.raises(phub.PhubError, match="already has a request in flight"):
                w0.stage(k)
            res.release()
            with pytest.raises(phub.UsageError, match="already released"):
                res.spans
            with pytest.raises(phub.PhubError, match="already has a request in flight"):
                w0.stage(k)  # a span's buffer still holds the results
            del spans, buf, view
            w0.stage(k).release()
        # Pushed without an output: only wait_in_place reads the results;
        # wait says so, lets them go and frees the key.
        for k, n in enumerate(keys):
            for waited_in_place in (True, False):
                st = w0.stage(k)
                for buf, first, count in st.spans:
                    np.frombuffer(buf, dtype=np.float32)[:] = 4.0
                h0 = w0.push_staged(st)
                with pytest.raises(phub.UsageError, match="already pushed or released"):
                    w0.push_staged(st)
                h1 = w1.push_pull(k, np.full(n, 1.0, np.float32))
                if waited_in_place:
                    res = h0.wait_in_place()
                    got = np.concatenate([np.frombuffer(b, dtype=np.float32) for b, _, _ in res.spans])
                    np.testing.assert_array_equal(got, np.full(n, 5.0, np.float32))
                    res.release()
                else:
                    with pytest.raises(phub.UsageError, match="only be read in place"):
                        h0.wait()
                np.testing.assert_array_equal(h1.wait(), np.full(n, 5.0, np.float32))
                w0.stage(k).release()


def test_shm_on_without_a_shm_appliance_fails_the_join(appliance: Any, job: Callable[..., tuple[int, str]]) -> None:
    jid, token = job([10])
    with pytest.raises(phub.JoinError, match="shm = on.*/dev/shm/phub-"):
        phub.Worker.join(appliance.control_url, jid, token, 0, shm="on")
    with pytest.raises(phub.UsageError, match="accepted: off, auto, on"):
        phub.Worker.join(appliance.control_url, jid, token, 0, shm="sometimes")
    # Control took rank 0's join before the worker found no shared memory:
    # rank 0 now takes its place with rejoin, like a restarted worker.
    assert not phub.Worker.join(appliance.control_url, jid, token, 1).shm  # auto: datagrams


# -- consistency modes (PROTOCOL.md §5.8) ------------------------------------

def test_async_job_takes_the_same_calls_and_each_rank_has_its_clock(workers: Workers) -> None:
    n = 3000
    ws = workers([("w", n)], 2, consistency="async")
    assert [(w.consistency, w.bounded_delay) for w in ws] == [("async", None)] * 2
    assert ws[0].clock() is None
    init_all(ws, 0, [np.arange(n, dtype=np.float32), np.zeros(n, np.float32)])
    assert [w.clock() for w in ws] == [0, 0]
    # Rank 0 runs five clocks while rank 1 pushes nothing: async waits for
    # no one, and with sum each push is a delta added to the stored values.
    out = np.empty(n, np.float32)
    for c in range(1, 6):
        h = ws[0].push_pull(0, np.ones(n, np.float32), out)
        assert h.round == c
        h.wait()
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) + c)
    assert (ws[0].clock(), ws[1].clock()) == (5, 0)
    ws[1].push_pull(0, np.full(n, 10, np.float32), out).wait()
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) + 15)
    assert ws[1].clock() == 1 and ws[1].pull(0, out) == 1 and ws[0].pull(0, out) == 5


def test_bounded_delay_holds_the_leader_until_the_slowest_catches_up(
    appliance: Any, job: Callable[..., tuple[int, str]]
) -> None:
    n = 100
    jid, token = job([n], workers=2, consistency=1)
    ws = [phub.Worker.join(appliance.control_url, jid, token, r) for r in range(2)]
    assert [(w.consistency, w.bounded_delay) for w in ws] == [("bounded_delay", 1)] * 2
    init_all(ws, 0, [np.zeros(n, np.float32), np.zeros(n, np.float32)])
    out0, out1 = np.empty(n, np.float32), np.empty(n, np.float32)
    ws[0].push_pull(0, np.ones(n, np.float32), out0).wait()  # clock 1 <= 0 + τ
    held = ws[0].push_pull(0, np.ones(n, np.float32), out0)  # clock 2 > 0 + τ: held
    deadline = time.monotonic() + 5
    while admin.job(appliance.control_url, jid)["held"] != 1:
        assert time.monotonic() < deadline, admin.job(appliance.control_url, jid)
        time.sleep(0.02)
    assert ws[0].clock() == 1
    ws[1].push_pull(0, np.full(n, 10, np.float32), out1).wait()  # rank 1's clock 1 releases rank 0
    held.wait()
    np.testing.assert_array_equal(out0, np.full(n, 12, np.float32))
    np.testing.assert_array_equal(out1, np.full(n, 12, np.float32))
    assert (ws[0].clock(), ws[1].clock()) == (2, 1)
    detail = admin.job(appliance.control_url, jid)
    assert detail["held"] == 0 and detail["max_lead"] == 2 and detail["clocks"] == [[2, 2], [1, 1]]


def test_shared_memory_and_mean_are_refused_outside_bsp(appliance: Any, job: Callable[..., tuple[int, str]]) -> None:
    jid, token = job([10], workers=1, consistency="async")
    with pytest.raises(phub.JoinError, match="shared memory is for BSP jobs only; job .* is async"):
        phub.Worker.join(appliance.control_url, jid, token, 0, shm="on")
    with pytest.raises(admin.AdminError, match="mean") as e:
        job([10], workers=1, optimizer="mean", consistency=2)
    assert e.value.status == 400
    with pytest.raises(TypeError, match="consistency"):
        admin.job_spec("x", 1, [10], consistency=2.5)


# -- concurrency --------------------------------------------------------------

def test_wait_releases_the_gil(workers: Workers) -> None:
    """A Python thread runs while another is blocked in wait()."""
    w0, w1 = workers([10_000], timeout=5.0)
    init_all([w0, w1], 0, [np.zeros(10_000, np.float32)] * 2)
    g0 = np.full(10_000, 1.0, np.float32)
    h0 = w0.push_pull(0, g0)
    done: dict[str, Any] = {}

    def waiter() -> None:
        try:
            done["out"] = h0.wait()  # blocks until rank 1 pushes, below
        except BaseException as e:  # pragma: no cover - reported by the asserts
            done["error"] = e

    t = threading.Thread(target=waiter)
    t.start()
    spins = 0
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        spins += 1
    # Had wait() held the GIL, this thread could not have spun until rank 0's
    # request timed out (5 s), and the waiter would have failed.
    assert t.is_alive(), done
    assert spins > 10_000
    w1.push_pull(0, np.full(10_000, 2.0, np.float32)).wait()
    t.join(10)
    assert not t.is_alive() and "error" not in done, done
    np.testing.assert_array_equal(done["out"], 3.0)


def test_keys_move_while_python_works(workers: Workers) -> None:
    """Several keys in flight complete in the background while Python computes,
    before anyone calls wait()."""
    sizes = [200_000] * 4 + [1000] * 8
    w0, w1 = workers(sizes)
    for k, n in enumerate(sizes):
        init_all([w0, w1], k, [np.zeros(n, np.float32)] * 2)
    before = w0.stats()["results_accepted"]
    grads = [[np.full(n, float(r + 1), np.float32) for n in sizes] for r in range(2)]
    handles = [[w.push_pull(k, grads[r][k]) for k in range(len(sizes))] for r, w in enumerate((w0, w1))]
    chunks = sum(-(-n // 2048) for n in sizes)
    # Python works (a pure-Python loop holding the GIL between bytecodes)...
    acc, deadline = 0, time.monotonic() + 10
    while w0.stats()["results_accepted"] - before < chunks and time.monotonic() < deadline:
        acc += sum(range(1000))
    # ... and every chunk's result arrived meanwhile.
    assert w0.stats()["results_accepted"] - before == chunks
    assert acc > 0
    for hs in handles:
        for h in hs:
            h.wait()
    for r in range(2):
        for g in grads[r]:
            np.testing.assert_array_equal(g, 3.0)


def test_threads_share_a_worker(workers: Workers) -> None:
    sizes = [5000] * 6
    w0, w1 = workers(sizes)
    for k in range(6):
        init_all([w0, w1], k, [np.zeros(5000, np.float32)] * 2)
    outs = {r: [np.zeros(5000, np.float32) for _ in sizes] for r in range(2)}

    def run(w: phub.Worker) -> None:
        # Same key order on both ranks; the GIL is released in wait.
        hs = [w.push_pull(k, np.full(5000, k, np.float32), outs[w.rank][k]) for k in range(6)]
        for h in hs:
            h.wait()

    ts = [threading.Thread(target=run, args=(w,)) for w in (w0, w1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    for r in range(2):
        for k in range(6):
            np.testing.assert_array_equal(outs[r][k], 2.0 * k)


# -- errors -----------------------------------------------------------------

def test_join_errors_carry_controls_message(appliance: Any, job: Callable[..., tuple[int, str]]) -> None:
    jid, token = job([10])
    with pytest.raises(phub.JoinError, match="wrong token"):
        phub.Worker.join(appliance.control_url, jid, "0000000000000001", 0)
    with pytest.raises(phub.JoinError, match="rank"):
        phub.Worker.join(appliance.control_url, jid, token, 7)
    with pytest.raises(phub.JoinError, match="HTTP 404"):
        phub.Worker.join(appliance.control_url, 999, token, 0)
    with pytest.raises(phub.JoinError):
        phub.Worker.join("http://127.0.0.1:1", jid, token, 0)
    with pytest.raises(phub.UsageError, match="hex digits"):
        phub.Worker.join(appliance.control_url, jid, "xyz", 0)
    with pytest.raises(phub.UsageError, match="window"):
        phub.Worker.join(appliance.control_url, jid, token, 0, window=0)
    # Every phub error is a RuntimeError.
    assert issubclass(phub.JoinError, phub.PhubError) and issubclass(phub.PhubError, RuntimeError)
    # The token as an int works too.
    w = phub.Worker.join(appliance.control_url, jid, int(token, 16), 0)
    assert w.rank == 0


def test_usage_errors(workers: Workers) -> None:
    w0, w1 = workers([100, 200])
    with pytest.raises(phub.UsageError, match="init"):
        w0.push_pull(0, np.zeros(100, np.float32))
    with pytest.raises(phub.UsageError, match="key 5 does not exist"):
        w0.init(5, np.zeros(100, np.float32))
    with pytest.raises(phub.UsageError, match="key 0 has 100 elements but `array` has 99"):
        w0.init(0, np.zeros(99, np.float32))
    with pytest.raises(phub.UsageError, match="read-only"):
        ro = np.zeros(100, np.float32)
        ro.flags.writeable = False
        w0.init(0, ro)
    with pytest.raises(phub.UsageError, match="C-contiguous"):
        w0.init(0, np.zeros(200, np.float32)[::2])
    with pytest.raises(phub.UsageError, match="buffer"):
        w0.init(0, [0.0] * 100)  # type: ignore[arg-type]
    with pytest.raises(phub.UsageError, match="float64"):
        w0.init(0, np.zeros(100, np.float64))
    shared = np.zeros(300, np.float32)
    h0 = w0.init(0, shared[:100])
    with pytest.raises(phub.UsageError, match="in flight"):
        w0.init(0, np.zeros(100, np.float32))
    # Outputs of requests in flight may not overlap (nor may a gradient read
    # from one).
    with pytest.raises(phub.UsageError, match="`out` overlaps the output array of key 0"):
        w0.init(1, shared[50:250])
    with pytest.raises(phub.UsageError, match="`grad` overlaps"):
        w0.push_pull(1, shared[:200], np.zeros(200, np.float32))
    w1.init(0, np.zeros(100, np.float32)).wait()
    h0.wait()
    with pytest.raises(phub.UsageError, match="already waited"):
        h0.wait()
    with pytest.raises(phub.UsageError, match="`out` has 3"):
        w0.push_pull(0, np.zeros(100, np.float32), np.zeros(3, np.float32))


def test_timeout_when_a_rank_never_pushes(workers: Workers) -> None:
    w0, w1 = workers([100], timeout=0.5)
    init_all([w0, w1], 0, [np.zeros(100, np.float32)] * 2)
    h = w0.push_pull(0, np.ones(100, np.float32))
    t = time.monotonic()
    with pytest.raises(phub.PhubTimeoutError, match="no result from the appliance"):
        h.wait()
    assert time.monotonic() - t < 5


def test_dropping_a_handle_frees_the_key(workers: Workers) -> None:
    w0, w1 = workers([100])
    init_all([w0, w1], 0, [np.zeros(100, np.float32)] * 2)
    # Kept by the worker (lend=False): abandoned, out is left as it was and
    # the round completes in the background.
    out = np.full(100, -1.0, np.float32)
    h = w0.push_pull(0, np.ones(100, np.float32), out, lend=False)
    assert not h.lent
    w1.push_pull(0, np.ones(100, np.float32)).wait()
    del h
    deadline = time.monotonic() + 5
    while w0.key_round(0) != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w0.key_round(0) == 1
    np.testing.assert_array_equal(out, -1.0)
    # Lent (the default over datagrams): the I/O thread writes out, so the
    # drop waits for the round, and out holds its result.
    h = w0.push_pull(0, np.ones(100, np.float32), out)
    assert h.lent and "lent=True" in repr(h)
    # The other rank pushes only after the drop began: the round cannot be
    # complete unless the drop waited for it.
    late = threading.Timer(0.3, lambda: w1.push_pull(0, np.ones(100, np.float32)).wait())
    late.start()
    del h
    assert w0.key_round(0) == 2
    late.join()
    np.testing.assert_array_equal(out, 2.0)
    hs = [w.push_pull(0, np.ones(100, np.float32)) for w in (w0, w1)]
    for h in hs:
        assert h.round == 3
        np.testing.assert_array_equal(h.wait(), 2.0)


def test_admission_errors(appliance: Any) -> None:
    op = appliance.operator_token
    bad = admin.job_spec("bad", 2, [10], optimizer={"kind": "sgd", "lr": -0.1})
    with pytest.raises(admin.AdminError, match="optimizer.lr") as e:
        admin.admit(appliance.control_url, bad, operator_token=op)
    assert e.value.status == 400 and isinstance(e.value, phub.PhubError)
    # TOML text works as well as a dict.
    jid, token = admin.admit(
        appliance.control_url,
        'name = "toml"\nworkers = 1\n[optimizer]\nkind = "sum"\n[[keys]]\nelements = 4\n',
        operator_token=op,
    )
    assert len(token) == 16 and any(j["id"] == jid for j in admin.jobs(appliance.control_url))
    assert admin.job(appliance.control_url, jid)["spec"]["name"] == "toml"
    assert appliance.evict(jid)["id"] == jid
    if op is not None:  # a phub-control with operator authentication
        with pytest.raises(admin.AdminError, match="operator token") as e:
            admin.admit(appliance.control_url, bad, operator_token="wrong")
        assert e.value.status == 403


# -- sparse tables ----------------------------------------------------------

def table_key(name: str = "emb", dim: int = 4, **kw: Any) -> dict[str, Any]:
    return {"name": name, "kind": "table", "dim": dim, "rows": 10_000, **kw}


def test_table_rows_push_pull_from_numpy(workers: Workers, in_threads: Any) -> None:
    """Two ranks push rows of a `sum` table from NumPy (uint64 and int64 ids,
    a repeated id summed on the worker); each gets the rows after the round,
    and a pull reads them; a rank with nothing pushes an empty round."""
    ws = workers([8, table_key(optimizer={"kind": "sum"})])
    assert [w.table_dim("emb") for w in ws] == [4, 4]
    ids = [np.array([3, 1_000_000_007, 3], np.uint64), np.array([3, 42], np.int64)]
    grads = [np.arange(12, dtype=np.float32).reshape(3, 4), np.full((2, 4), 0.5, np.float32)]
    outs = [np.zeros((3, 4), np.float32), np.zeros((2, 4), np.float32)]
    rounds = in_threads([lambda r=r, w=w: w.push_pull_rows("emb", ids[r], grads[r], outs[r]) for r, w in enumerate(ws)])
    assert rounds == [1, 1]
    row3 = grads[0][0] + grads[0][2] + 0.5
    np.testing.assert_array_equal(outs[0], np.stack([row3, grads[0][1], row3]))
    np.testing.assert_array_equal(outs[1], np.stack([row3, np.full(4, 0.5, np.float32)]))
    got = np.zeros((3, 4), np.float32)
    assert ws[1].pull_rows("emb", np.array([42, 3, 7], np.uint64), got) == 1
    np.testing.assert_array_equal(got, np.stack([np.full(4, 0.5, np.float32), row3, np.zeros(4, np.float32)]))
    # Round 2: rank 0 pushes one row, rank 1 nothing.
    in_threads([lambda r=r, w=w: w.push_rows("emb", ids[0][:1] if r == 0 else np.empty(0, np.uint64),
                                             np.ones((1 - r, 4), np.float32)) for r, w in enumerate(ws)])
    assert [w.table_round("emb") for w in ws] == [2, 2]
    ws[0].pull_rows("emb", np.array([3], np.uint64), got[:1])
    np.testing.assert_array_equal(got[0], row3 + 1)
    assert ws[0].catch_up_rows("emb") == 2
    assert ws[1].catch_up_tables() == 2
    assert [w.table_round("emb") for w in ws] == [2, 2]


def test_table_pushes_started_together_end_in_any_order(workers: Workers) -> None:
    """push_rows_start: each rank's pushes of two tables in flight at once,
    waited in either order, the rows summed as push_rows's; a table is busy
    until its push is waited; a push dropped unwaited is waited by its drop."""
    ws = workers([table_key("a", optimizer={"kind": "sum"}), table_key("b", dim=2, optimizer={"kind": "sum"})])
    ids = np.array([5, 9], np.uint64)
    ga, gb = np.ones((2, 4), np.float32), np.full((2, 2), 0.25, np.float32)
    started = [(w.push_rows_start("a", ids, ga), w.push_rows_start("b", ids, gb)) for w in ws]
    assert [p.round for pa_pb in started for p in pa_pb] == [1, 1, 1, 1] and started[0][0].pending
    with pytest.raises(phub.PhubError, match="busy|in flight|claimed"):
        ws[0].pull_rows("a", ids, np.zeros((2, 4), np.float32))
    for pa, pb in started:
        assert pb.wait() == 1 and pa.wait() == 1
    assert not started[0][0].pending
    with pytest.raises(phub.UsageError, match="already waited"):
        started[0][0].wait()
    got = np.zeros((2, 4), np.float32)
    ws[0].pull_rows("a", ids, got)
    np.testing.assert_array_equal(got, np.full((2, 4), 2.0, np.float32))
    gotb = np.zeros((2, 2), np.float32)
    ws[1].pull_rows("b", ids, gotb)
    np.testing.assert_array_equal(gotb, np.full((2, 2), 0.5, np.float32))
    # Dropped unwaited: the drops wait, and round 2 is the table's.
    pushes = [w.push_rows_start("a", ids, ga) for w in ws]
    del pushes
    assert [w.table_round("a") for w in ws] == [2, 2]
    ws[0].pull_rows("a", ids, got)
    np.testing.assert_array_equal(got, np.full((2, 4), 4.0, np.float32))


def test_table_pulls_started_together_write_their_rows_when_waited(workers: Workers) -> None:
    """pull_rows_start: two tables' pulls in flight at once, each ``out``
    written only by its wait (in either order), the table busy until then;
    a wrong ``out`` is refused at the start; a pull dropped unwaited frees
    the table."""
    ws = workers([table_key("a", optimizer={"kind": "sum"}), table_key("b", dim=2, optimizer={"kind": "sum"})])
    ids = np.array([5, 9], np.uint64)
    pushes = [w.push_rows_start("a", ids, np.ones((2, 4), np.float32)) for w in ws]
    del pushes  # their drops wait: round 1 of "a" is in
    out_a, out_b = np.zeros((2, 4), np.float32), np.zeros((2, 2), np.float32)
    pa, pb = ws[0].pull_rows_start("a", ids, out_a), ws[0].pull_rows_start("b", ids[::-1].copy(), out_b)
    assert pa.pending and pb.pending
    with pytest.raises(phub.PhubError, match="busy|in flight|claimed"):
        ws[0].push_rows_start("a", ids, np.ones((2, 4), np.float32))
    assert pb.wait() == 0 and not out_a.any()  # b never pushed: its initial zeros
    assert pa.wait() == 1 and not pa.pending
    np.testing.assert_array_equal(out_a, np.full((2, 4), 2.0, np.float32))
    with pytest.raises(phub.UsageError, match="already waited"):
        pa.wait()
    with pytest.raises(phub.UsageError, match=r"out has 6 values; expected len\(ids\) \* dim = 2 \* 4"):
        ws[0].pull_rows_start("a", ids, np.zeros(6, np.float32))
    del pa, pb
    p = ws[1].pull_rows_start("a", ids, np.zeros((2, 4), np.float32))
    del p
    got = np.zeros((2, 4), np.float32)
    assert ws[1].pull_rows("a", ids, got) == 1
    np.testing.assert_array_equal(got, out_a)


def test_table_rows_in_place_unaligned_and_shared_arrays(workers: Workers, in_threads: Any) -> None:
    """Table calls read aligned float32 gradients and write aligned float32
    rows in place; an unaligned array, gradients that are the output array
    itself, and an output resized while its pull is in flight give the
    same rows through copies (or a clear refusal)."""
    ws = workers([table_key(optimizer={"kind": "sum"})])
    ids = np.array([4, 8, 15], np.uint64)

    def unaligned(n: int, fill: float = 0.0) -> np.ndarray:
        a = np.frombuffer(bytearray(4 * n + 1), dtype=np.float32, offset=1, count=n)
        assert a.ctypes.data % 4 != 0
        a[:] = fill
        return a

    # Rank 0: gradients unaligned, rows into an unaligned array; rank 1:
    # its gradients are its output (the rows after the round replace them).
    g0, out0 = unaligned(12, 1.0), unaligned(12)
    buf1 = np.full(12, 2.0, np.float32)
    in_threads([lambda: ws[0].push_pull_rows("emb", ids, g0, out0),
                lambda: ws[1].push_pull_rows("emb", ids, buf1, buf1)])
    np.testing.assert_array_equal(out0, 3.0)
    np.testing.assert_array_equal(buf1, 3.0)
    got = unaligned(12)
    assert ws[0].pull_rows("emb", ids, got) == 1
    np.testing.assert_array_equal(got, 3.0)
    p = ws[1].pull_rows_start("emb", ids, got)
    assert p.wait() == 1
    np.testing.assert_array_equal(got, 3.0)
    # An output resized meanwhile: refused, and the table free again.
    out = np.zeros(12, np.float32)
    p = ws[0].pull_rows_start("emb", ids, out)
    out.resize(24, refcheck=False)
    with pytest.raises(phub.UsageError, match=r"out has 24 values now, the pull's rows 12"):
        p.wait()
    assert ws[0].pull_rows("emb", ids, np.zeros(12, np.float32)) == 1


def test_cached_ids_are_named_by_signature_and_give_the_same_rows(workers: Workers, in_threads: Any) -> None:
    """Key caching (PROTOCOL.md §10.7): rank 0 registers its ids; its later
    pushes and pulls of them (any order) leave the ids out, and every row
    is what the uncached rank 1 reads."""
    ws = workers([table_key(optimizer={"kind": "sum"}, key_cache=4)])
    ids = np.array([5, 9, 1_000_000_007, 12], np.uint64)
    sig, lists = ws[0].cache_ids("emb", ids)
    assert sig > 0 and 1 <= lists <= 4
    grads = np.ones((4, 4), np.float32)
    outs = [np.zeros((4, 4), np.float32) for _ in ws]
    for step in range(3):
        in_threads([lambda w=w, o=o: w.push_pull_rows("emb", ids, grads, o) for w, o in zip(ws, outs)])
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(outs[0], np.full((4, 4), 2.0 * (step + 1), np.float32))
    got = np.zeros((4, 4), np.float32)
    ws[0].pull_rows("emb", ids[::-1].copy(), got)
    np.testing.assert_array_equal(got, outs[0][::-1])
    s = ws[0].stats()
    assert s["key_cache_id_bytes_saved"] > 0 and s["key_cache_misses"] == 0
    assert ws[1].stats()["key_cache_id_bytes_saved"] == 0
    ws[0].uncache_ids("emb", ids)
    with pytest.raises(phub.PhubError, match="key_cache = 0"):
        workers([table_key()])[0].cache_ids("emb", ids)


def test_table_row_errors_name_the_problem(workers: Workers) -> None:
    w0, _ = workers([table_key()])
    out = np.zeros((2, 4), np.float32)
    with pytest.raises(phub.UsageError, match="row ids are native uint64 or int64"):
        w0.pull_rows("emb", np.array([1.0, 2.0]), out)
    with pytest.raises(phub.UsageError, match=r"`ids`\[1\] = -5: row ids are >= 0"):
        w0.pull_rows("emb", np.array([1, -5], np.int64), out)
    with pytest.raises(phub.PhubError, match="nope"):
        w0.pull_rows("nope", np.array([1, 2], np.uint64), out)
    with pytest.raises(phub.PhubError, match="out"):
        w0.pull_rows("emb", np.array([1, 2, 3], np.uint64), out)
    with pytest.raises(phub.UsageError, match="float32"):
        w0.push_rows("emb", np.array([1], np.uint64), np.ones(4, np.float64))


def test_sparse_logistic_regression_example_matches_one_process(appliance: Any) -> None:
    """python/examples/sparse_lr.py, small: FTRL on a phub table trained by
    two workers reaches the held-out log-loss of the same FTRL in one
    process on the same steps, well below the click rate's alone."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import sparse_lr

    cfg = sparse_lr.Config(examples=8192, test=4096, vocab=2000, epochs=2)
    out = sparse_lr.run(cfg, 2, appliance, quiet=True)
    assert abs(out["phub_log_loss"] - out["one_process_log_loss"]) < 1e-4, out
    assert out["phub_log_loss"] < out["prior_log_loss"] - 0.05, out
    assert out["test_features_nonzero"] > 0, out


# -- typing -----------------------------------------------------------------

def test_stub_matches_the_module() -> None:
    """python/phub/_native.pyi declares exactly what the extension module has."""
    import ast
    from pathlib import Path

    import phub._native as native

    stub = ast.parse((Path(phub.__file__).parent / "_native.pyi").read_text())
    assert (Path(phub.__file__).parent / "py.typed").exists()
    classes = {n.name: n for n in stub.body if isinstance(n, ast.ClassDef)}
    public = {n for n in dir(native) if not n.startswith("_")}
    assert public == set(classes), public ^ set(classes)
    for name in ("Worker", "Handle"):
        declared = {f.name for f in classes[name].body if isinstance(f, ast.FunctionDef)}
        actual = {n for n in dir(getattr(native, name)) if not n.startswith("_")}
        assert declared == actual, (name, declared ^ actual)
        for n in actual:
            assert getattr(getattr(native, name), n).__doc__, f"{name}.{n} has no docstring"


def test_admin_paths_come_from_the_route_table() -> None:
    """phub.admin spells no path: each comes from phub-proto's routes, which
    phub-control's router parses."""
    from phub import _native

    assert _native._control_route("admit") == ("POST", "/v1/jobs")
    assert _native._control_route("jobs") == ("GET", "/v1/jobs")
    assert _native._control_route("job", 3) == ("GET", "/v1/jobs/3")
    assert _native._control_route("evict", 65535) == ("DELETE", "/v1/jobs/65535")
    with pytest.raises(phub.UsageError, match="want 0..=65535"):
        _native._control_route("job", 65536)
    with pytest.raises(phub.UsageError, match="want admit, jobs, job or evict"):
        _native._control_route("stats")
    with pytest.raises(phub.UsageError, match="give its id"):
        _native._control_route("evict")
