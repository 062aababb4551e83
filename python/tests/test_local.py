"""phub.local's rank endings: run_rank and exit_rank end a spawned process
with its exit code, without the interpreter's finalization."""

from __future__ import annotations

import atexit
import multiprocessing as mp
from pathlib import Path

from phub.local import run_rank


def _rank(out: str, fail: bool) -> None:
    # Written by an atexit handler: only if the interpreter finalizes.
    atexit.register(Path(out + ".atexit").write_text, "finalized")
    Path(out).write_text("ran")
    if fail:
        raise RuntimeError("this rank fails")


def test_run_rank_ends_a_spawned_rank_with_its_code_and_no_finalization(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    codes = []
    for name, fail in (("ok", False), ("bad", True)):
        p = ctx.Process(target=run_rank, args=(_rank, str(tmp_path / name), fail))
        p.start()
        p.join(60)
        codes.append(p.exitcode)
    assert codes == [0, 1]
    assert (tmp_path / "ok").read_text() == "ran" and (tmp_path / "bad").read_text() == "ran"
    assert not list(tmp_path.glob("*.atexit")), "the interpreter finalized (atexit ran)"
