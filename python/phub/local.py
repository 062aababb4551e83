"""Start a local phub appliance (phub-dataplane + phub-control) for examples and tests.

Like ``phub-demo`` does: phub-dataplane with the kernel-UDP backend on
loopback (data ports picked by the OS), phub-control on a free port with a
state file in a temporary folder. Both are stopped with SIGTERM (then
SIGKILL) on :meth:`LocalAppliance.stop` or when the ``with`` block ends::

    from phub.local import LocalAppliance
    with LocalAppliance(lcores=2) as app:
        job, token = app.admit(spec)
        w = phub.Worker.join(app.control_url, job, token, 0)

``LocalAppliance(shm=True)`` starts phub-dataplane with ``--shm``: workers
on this machine then exchange through shared memory (headers only on the
sockets).

:func:`run_rank` and :func:`exit_rank` end a rank process (one started
with ``multiprocessing``'s ``spawn``, or by ``torchrun``) without the
interpreter's finalization, where torch's gloo threads can abort it.

The binaries are looked for in ``bin_dir``, then ``$PHUB_BIN_DIR``, then
``target/release`` of the current folder and of the folders above it, then
``$PATH``. Build them with ``cargo build --release -p phub --bins``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Tuple

from . import admin
from ._native import PhubError

__all__ = ["LocalAppliance", "exit_rank", "find_binary", "run_rank"]


def exit_rank(code: int = 0) -> NoReturn:
    """Ends this process now with ``code``, as a forked ``multiprocessing``
    child ends: phub.torch's completer threads closed (if it is loaded),
    stdout and stderr flushed, then ``os._exit`` (no ``atexit`` handlers,
    no interpreter finalization). Call it last in a rank process that used
    torch.distributed with gloo, after ``destroy_process_group()``: gloo's
    worker threads may still be destroying their last collective's work,
    which takes the GIL, and a thread taking the GIL while the interpreter
    finalizes is ended with a forced unwind that aborts the process
    ("terminate called without an active exception", exit code -6; seen
    in 8 of 80 two-rank runs of DDP over gloo here)."""
    torch_mod = sys.modules.get("phub.torch")
    if torch_mod is not None:
        torch_mod._close_completers()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run_rank(target: Callable[..., Any], *args: Any) -> NoReturn:
    """Runs ``target(*args)`` and ends the process with :func:`exit_rank`:
    0; a ``SystemExit``'s code (its message printed, code 1, if it is not
    a number); or 1 after printing any other exception. The ``Process``
    target of a spawned rank: ``ctx.Process(target=run_rank, args=(main,
    rank, ...))`` (``main`` a module-level function, as ``spawn`` needs)."""
    try:
        target(*args)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            exit_rank(e.code or 0)
        print(e.code, file=sys.stderr)
        exit_rank(1)
    except BaseException:  # noqa: BLE001 - the rank's failure, printed, is its exit code
        traceback.print_exc()
        exit_rank(1)
    exit_rank(0)


def find_binary(name: str, bin_dir: Optional[os.PathLike[str] | str] = None) -> Path:
    """Where the phub binary ``name`` is (see the module's doc for the order)."""
    dirs: list[Path] = []
    if bin_dir is not None:
        dirs.append(Path(bin_dir))
    if os.environ.get("PHUB_BIN_DIR"):
        dirs.append(Path(os.environ["PHUB_BIN_DIR"]))
    here = Path.cwd().resolve()
    for d in [here, *here.parents]:
        dirs.append(d / "target" / "release")
    for d in dirs:
        p = d / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    found = shutil.which(name)
    if found:
        return Path(found)
    raise PhubError(
        f"{name} not found in {', '.join(str(d) for d in dirs[:3])}, ... or $PATH: "
        "build it with `cargo build --release -p phub --bins` (or set PHUB_BIN_DIR)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalAppliance:
    """A phub-dataplane and a phub-control on loopback, as child processes.

    ``lcores``: dataplane queues (threads); ``memory_budget``: memory jobs may
    take, every byte admission counts (e.g. ``"1GiB"``); ``pin``: pin lcore threads to CPUs (off by default:
    the appliance shares the machine with its workers here);
    ``busy_poll``: spin on empty queues; ``shm``: start phub-dataplane with
    ``--shm``, so that workers on this machine pass chunks and results
    through shared memory (``/dev/shm``) and send headers only (workers
    joining with the default ``shm="auto"`` pick it up); ``workdir``: where
    logs and the state file go (a new temporary folder by default, removed
    on stop if the appliance ended cleanly).
    """

    def __init__(
        self,
        lcores: int = 2,
        *,
        bin_dir: Optional[os.PathLike[str] | str] = None,
        memory_budget: str = "1GiB",
        pin: bool = False,
        busy_poll: bool = False,
        shm: bool = False,
        workdir: Optional[os.PathLike[str] | str] = None,
        start_timeout: float = 15.0,
    ) -> None:
        self.lcores = int(lcores)
        self.memory_budget = memory_budget
        self.pin = pin
        self.busy_poll = busy_poll
        self.shm = shm
        self.start_timeout = start_timeout
        self._dataplane_bin = find_binary("phub-dataplane", bin_dir)
        self._control_bin = find_binary("phub-control", bin_dir)
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="phub-local-"))
        self._procs: list[Tuple[str, subprocess.Popen[bytes]]] = []
        self.control_url = ""
        self.mgmt_url = ""

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")
        try:
            p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        self._procs.append((name, p))
        return p

    def _wait_http(self, url: str, name: str, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=0.5):
                    return
            except OSError:
                pass
            if proc.poll() is not None:
                raise PhubError(f"{name} exited ({proc.returncode}) before it answered; its log:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise PhubError(f"{name} did not answer at {url} within {self.start_timeout} s; its log:\n{self.log(name)}")
            time.sleep(0.05)

    def start(self) -> "LocalAppliance":
        """Starts both processes and waits until they answer."""
        mgmt, ctl = _free_port(), _free_port()
        self.mgmt_url = f"http://127.0.0.1:{mgmt}"
        self.control_url = f"http://127.0.0.1:{ctl}"
        args = [
            str(self._dataplane_bin), "--backend", "udp", "--base-port", "0",
            "--lcores", str(self.lcores), "--mgmt", f"127.0.0.1:{mgmt}",
            "--memory-budget", self.memory_budget,
        ]
        if not self.pin:
            args.append("--no-pin")
        if self.busy_poll:
            args.append("--busy-poll")
        if self.shm:
            args.append("--shm")
        try:
            dp = self._spawn("phub-dataplane", args)
            self._wait_http(f"{self.mgmt_url}/v1/info", "phub-dataplane", dp)
            cp = self._spawn("phub-control", [
                str(self._control_bin), "--listen", f"127.0.0.1:{ctl}",
                "--dataplane", self.mgmt_url, "--state", str(self.workdir / "control-state.json"),
            ])
            self._wait_http(f"{self.control_url}/v1/jobs", "phub-control", cp)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def operator_token(self) -> Optional[str]:
        """The operator token phub-control created beside its state file (None
        with a phub-control that has none)."""
        try:
            return (self.workdir / "control-state.json.operator-token").read_text().strip() or None
        except OSError:
            return None

    def admit(self, spec: admin.Spec) -> Tuple[int, str]:
        """Admits a job (a spec dict or TOML/JSON text); returns ``(job_id, token)``."""
        return admin.admit(self.control_url, spec, operator_token=self.operator_token)

    def evict(self, job_id: int) -> Any:
        """Evicts a job; returns its summary."""
        return admin.evict(self.control_url, job_id, operator_token=self.operator_token)

    def log(self, name: str) -> str:
        """The log of ``phub-dataplane`` or ``phub-control`` so far."""
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"

    def pid(self, name: str) -> int:
        """The process id of ``phub-dataplane`` or ``phub-control`` (e.g. to
        read its memory from ``/proc``); raises :class:`PhubError` when that
        process is not running."""
        for n, p in self._procs:
            if n == name and p.poll() is None:
                return p.pid
        started = ", ".join(n for n, _ in self._procs) or "none"
        raise PhubError(f"{name} is not running in this LocalAppliance (started: {started})")

    def dataplane_stats(self) -> Any:
        """The dataplane's counters (``GET /v1/stats`` of its management API)."""
        return admin._request("GET", f"{self.mgmt_url}/v1/stats")

    def stop(self) -> None:
        """Stops control, then the dataplane (SIGTERM, SIGKILL after 5 s)."""
        clean = True
        for name, p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    clean = False
                    p.kill()
                    p.wait()
        self._procs.clear()
        if clean and self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalAppliance":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self.stop()
