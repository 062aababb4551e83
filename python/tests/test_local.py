"""phub.local's rank endings: run_rank and exit_rank end a spawned process
with its exit code, without the interpreter's finalization."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

import pytest

from phub import PhubError
from phub.local import run_rank


def _rank(out: str, fail: object) -> None:
    # Written by an atexit handler: only if the interpreter finalizes.
    atexit.register(Path(out + ".atexit").write_text, "finalized")
    Path(out).write_text("ran")
    if fail == "raise":
        raise RuntimeError("this rank fails")
    if fail is not None:
        sys.exit(fail)


def test_run_rank_ends_a_spawned_rank_with_its_code_and_no_finalization(tmp_path: Path) -> None:
    """Returning: 0; raising: 1; sys.exit(3): 3; sys.exit("why"): 1; and
    never through the interpreter's finalization (no atexit handler ran)."""
    ctx = mp.get_context("spawn")
    codes = []
    cases = {"ok": None, "raise": "raise", "three": 3, "why": "why"}
    for name, fail in cases.items():
        p = ctx.Process(target=run_rank, args=(_rank, str(tmp_path / name), fail))
        p.start()
        p.join(60)
        codes.append(p.exitcode)
    assert codes == [0, 1, 3, 1]
    assert all((tmp_path / name).read_text() == "ran" for name in cases)
    assert not list(tmp_path.glob("*.atexit")), "the interpreter finalized (atexit ran)"


def test_pid_names_a_running_daemon(appliance: Any) -> None:
    """LocalAppliance.pid: the daemon's process (its /proc entry runs the
    binary); a name it did not start is refused, naming those it did."""
    for name in ("phub-dataplane", "phub-control"):
        pid = appliance.pid(name)
        assert name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    with pytest.raises(PhubError, match=r"phub-etcd is not running .*started: phub-dataplane, phub-control"):
        appliance.pid("phub-etcd")
