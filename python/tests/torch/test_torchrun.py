"""phub.torch.init() under torchrun (`make test-torch`).

- `torchrun --nproc-per-node=2 python/examples/torchrun_train.py` against
  the local appliance trains (the loss falls) and ends with the same
  parameters on both ranks: with ``PHUB_JOB_SPEC`` (rank 0 admits the job,
  the other rank learns its id and token through the process group's
  store, rank 0 evicts it at the end) and with ``PHUB_JOB``/``PHUB_TOKEN``
  (a job admitted beforehand, left admitted).
- Without a process group, init() finds torchrun's agent store.
- init()'s errors name the missing environment variable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

import phub
import phub.torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "torchrun_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
PHUB_ENV = ("PHUB_JOB", "PHUB_TOKEN", "PHUB_JOB_SPEC", "PHUB_CONTROL_URL", "PHUB_CONTROL")


def env_for(appliance: Any, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PHUB_ENV}
    env["PHUB_CONTROL_URL"] = appliance.control_url
    env["PHUB_OPERATOR_TOKEN"] = appliance.operator_token or ""
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def torchrun(args: list[str], env: dict[str, str], timeout: float = 300,
             cwd: Optional[Path] = None) -> subprocess.CompletedProcess[str]:
    if not TORCHRUN.exists():
        pytest.skip(f"{TORCHRUN} not found (torch's launcher, installed with torch)")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node=2", *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert r.returncode == 0, f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


def result(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("result ")]
    assert len(lines) == 1, r.stdout + r.stderr
    return json.loads(lines[0][len("result "):])


def trained(res: dict[str, Any]) -> None:
    assert res["world"] == 2
    assert res["last_loss"] < 0.5 * res["first_loss"], f"the loss did not fall enough: {res}"
    assert res["max_param_diff"] == 0.0, f"the ranks' parameters differ: {res}"


def test_torchrun_ddp_rank0_admits_from_a_spec_file(appliance: Any, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    subprocess.run([sys.executable, str(EXAMPLE), "--mode", "ddp", "--write-spec", str(spec), "--workers", "2"],
                   check=True, capture_output=True)
    before = {j["id"] for j in phub.admin.jobs(appliance.control_url)}
    r = torchrun([str(EXAMPLE), "--mode", "ddp", "--epochs", "3"], env_for(appliance, PHUB_JOB_SPEC=str(spec)))
    res = result(r)
    trained(res)
    assert res["job"] not in before and "admitted by rank 0" in r.stdout
    # Rank 0 evicted the job it admitted once both ranks were done.
    assert res["job"] not in {j["id"] for j in phub.admin.jobs(appliance.control_url)}


def test_torchrun_server_joins_an_admitted_job(appliance: Any) -> None:
    sys.path.insert(0, str(EXAMPLES))
    import train_digits as td

    cfg = td.Config()
    spec = phub.torch.job_spec(td.make_model(cfg.seed), 2, optimizer=td.make_optimizer(cfg, td.make_model(0).parameters()))
    job, token = appliance.admit(spec)
    r = torchrun([str(EXAMPLE), "--mode", "server", "--epochs", "3"],
                 env_for(appliance, PHUB_JOB=str(job), PHUB_TOKEN=token))
    res = result(r)
    trained(res)
    assert res["job"] == job and "given" in r.stdout
    # Not init()'s to evict.
    assert job in {j["id"] for j in phub.admin.jobs(appliance.control_url)}
    appliance.evict(job)


AGENT_STORE_SCRIPT = """
import json, numpy as np, torch.distributed as dist, phub.torch
s = phub.torch.init({spec!r})
s.worker.init(0, np.zeros(4, dtype="float32")).wait()
h = s.worker.push_pull(0, np.full(4, float(s.rank + 1), dtype="float32"))
with open(f"{{s.rank}}.out", "w") as f:  # torchrun's ranks share stdout
    print("got", s.rank, h.wait().tolist(), dist.is_initialized(), file=f)
s.finish()
"""


def test_init_without_a_process_group_uses_torchruns_agent_store(appliance: Any, tmp_path: Path) -> None:
    spec = phub.admin.job_spec("agent-store", 2, [4], optimizer="sum")
    script = tmp_path / "s.py"
    script.write_text(AGENT_STORE_SCRIPT.format(spec=json.dumps(spec)))
    before = {j["id"] for j in phub.admin.jobs(appliance.control_url)}
    r = torchrun([str(script)], env_for(appliance), cwd=tmp_path)
    got = [(tmp_path / f"{rank}.out").read_text().strip() for rank in range(2)]
    assert got == ["got 0 [3.0, 3.0, 3.0, 3.0] False", "got 1 [3.0, 3.0, 3.0, 3.0] False"], r.stdout + r.stderr
    assert {j["id"] for j in phub.admin.jobs(appliance.control_url)} == before  # evicted by rank 0


def test_init_errors_name_the_missing_variable(monkeypatch: pytest.MonkeyPatch, appliance: Any) -> None:
    for k in (*PHUB_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(phub.UsageError, match=r"\$RANK is not set: run under torchrun"):
        phub.torch.init()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(phub.UsageError, match=r"\$WORLD_SIZE is not set"):
        phub.torch.init()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(phub.UsageError, match=r"\$PHUB_CONTROL_URL is not set"):
        phub.torch.init()
    monkeypatch.setenv("PHUB_CONTROL_URL", appliance.control_url)
    with pytest.raises(phub.UsageError, match=r"no job: set \$PHUB_JOB and \$PHUB_TOKEN .* or \$PHUB_JOB_SPEC"):
        phub.torch.init()
    monkeypatch.setenv("PHUB_JOB", "7")
    with pytest.raises(phub.UsageError, match=r"\$PHUB_TOKEN is not set"):
        phub.torch.init()
    monkeypatch.setenv("PHUB_JOB", "seven")
    with pytest.raises(phub.UsageError, match=r"\$PHUB_JOB = 'seven': expected the job id"):
        phub.torch.init()
    monkeypatch.delenv("PHUB_JOB")
    monkeypatch.setenv("PHUB_JOB_SPEC", "/nonexistent/spec.toml")
    with pytest.raises(phub.UsageError, match=r"PHUB_JOB_SPEC = '/nonexistent/spec.toml': no such file"):
        phub.torch.init()
    monkeypatch.setenv("PHUB_JOB_SPEC", 'name = "x"\nworkers = 3\n')
    with pytest.raises(phub.UsageError, match=r"workers = 3 but WORLD_SIZE = 2"):
        phub.torch.init()
    monkeypatch.setenv("PHUB_JOB_SPEC", json.dumps(phub.admin.job_spec("x", 2, [4])))
    with pytest.raises(phub.UsageError, match=r"need a shared store: call torch.distributed.init_process_group"):
        phub.torch.init()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(phub.UsageError, match=r"RANK = 2 with WORLD_SIZE = 2"):
        phub.torch.init()
