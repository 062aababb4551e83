#!/usr/bin/env bash
# phub.torch on CUDA tensors, in one go on the lent GPU machine (one NVIDIA
# GPU, 16 cores, no network, no Rust): issue 21's checks, under 8 minutes.
#
#   here:        tools/gpu-bench.sh bundle     # writes .gpubench/bundle.tar.xz
#   the device:  OUT=$OUT tools/gpu-bench.sh run   (run tool: carry [".gpubench"])
#
# `bundle` packs what the device machine lacks and can be carried (the run
# tool carries 64 MiB at most): stripped phub-dataplane and phub-control from
# target/release, and the Python package phub (abi3, with its compiled
# extension) from target/torch-venv or, without torch here, target/python-venv
# (`make release-bins python-venv` first: the bundle needs no torch).
# Add `/.gpubench/` to .git/info/exclude so it stays out of git.
#
# torch is NOT in the bundle: torch with CUDA is about 5 GB, far over what
# travels, and the device machine cannot reach PyPI. `run` looks for a Python
# that already has torch with CUDA there ($PYTHON, else python3, else
# python3 of any venv under /opt or $HOME), else installs torch into a venv
# from a local wheel folder ($PIP_FIND_LINKS or /opt/wheels) if one holds a
# torch wheel, and otherwise stops with exit 2 and a message saying so.
#
# `run` then, each step under its own timeout, output in $OUT/summary.txt:
#   1. nvidia-smi -L, torch's CUDA version and device;
#   2. python/tests/torch/test_cuda.py: the comm hook on CUDA tensors ==
#      on CPU tensors == one process (mean, sum); DistributedOptimizer with
#      CUDA parameters == torch.optim, each optimizer; bf16 CUDA gradients;
#   3. python/bench/bench_cuda_ddp.py: ResNet-50 DDP steps on CUDA tensors,
#      phub's hook (shared memory, 4 lcores) against gloo, W=2 sharing the
#      GPU, medians, the exchange alone and its overlap with backward
#      (the hook's default: the pinned buffer, then the worker's copy);
#   4. the same with --nccl: NCCL as a third exchange (it refuses two ranks
#      on one GPU; the run then says so and measures the others); then,
#      if time is left, the same with one copy (--one-copy: straight into
#      the staging regions), in bf16 (--dtype bf16: a bf16 job,
#      the gradients never float32) and with datagrams (no --shm).
# PLAN=repeat: test_cuda.py, then only the shared-memory step DDP_RUNS
# times (default 3) and the bf16 one BF16_RUNS times (default 2).
# PLAN=bf16 (no test_cuda.py): where the bf16 job's time goes, each once:
# bench_wire16.py --f32-job (host arrays, no CUDA: the bf16 job against a
# float32 job of the same keys), then bench_cuda_ddp.py in f32 and bf16,
# each with one copy and with two (BF16_PLAN_RUNS times, default 1;
# BF16_CASES="NAME:ARGS;..." other cases of bench_cuda_ddp.py, WIRE16=0 no
# bench_wire16.py).
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}

if [[ "$cmd" == bundle ]]; then
  set -e
  STAGE=$(mktemp -d /tmp/phub-gpubench.XXXXXX)
  trap 'rm -rf "$STAGE"' EXIT
  mkdir -p "$STAGE/bin" "$STAGE/py"
  for b in phub-dataplane phub-control; do
    test -x "target/release/$b" || { echo "target/release/$b missing: make release-bins" >&2; exit 1; }
    strip -o "$STAGE/bin/$b" "target/release/$b"
  done
  # Every shared library they load but the C library's (DPDK's above all:
  # the device machine has none); `run` installs those the machine lacks.
  . tools/bundle-common.sh
  mkdir -p "$STAGE/lib"
  bundle_libs "$STAGE/lib" "$STAGE"/bin/*
  bundle_phub_py "$STAGE/py"
  mkdir -p .gpubench
  tar -C "$STAGE" -cJf .gpubench/bundle.tar.xz .
  ls -la .gpubench/bundle.tar.xz
  exit 0
fi

if [[ "$cmd" != run ]]; then
  echo "usage: tools/gpu-bench.sh bundle | OUT=DIR tools/gpu-bench.sh run" >&2
  exit 64
fi

OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
SUM="$OUT/summary.txt"
say() { echo "$*" | tee -a "$SUM"; }
t0=$(date +%s)
stamp() { say "== [$(($(date +%s) - t0)) s] $*"; }

stamp "setup"
ROOT=$(mktemp -d /tmp/phub-gpubench.XXXXXX)
if ! tar -C "$ROOT" -xJf .gpubench/bundle.tar.xz 2>/dev/null; then
  say "no .gpubench/bundle.tar.xz: run \`tools/gpu-bench.sh bundle\` here and carry .gpubench"
  exit 2
fi
# Only the libraries the machine lacks go to /usr/local/lib (not
# LD_LIBRARY_PATH: torch must keep the machine's own libstdc++ and others).
ldconfig -p >"$ROOT/ldcache"
for l in "$ROOT"/lib/*; do
  grep -q "^[[:space:]]$(basename "$l") " "$ROOT/ldcache" || cp "$l" /usr/local/lib/
done
ldconfig
for b in "$ROOT"/bin/*; do
  ldd "$b" | grep -q "not found" && say "MISSING for $(basename "$b"): $(ldd "$b" | grep 'not found' | tr '\n' ' ')"
done
export PYTHONUNBUFFERED=1 PHUB_BIN_DIR="$ROOT/bin" PYTHONPATH="$ROOT/py:$(pwd)/python/examples${PYTHONPATH:+:$PYTHONPATH}"

has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY=""
for c in ${PYTHON:-} python3 /opt/*/bin/python3 /opt/*/*/bin/python3 "$HOME"/*/bin/python3; do
  [[ -n "$c" ]] && command -v "$c" >/dev/null 2>&1 || continue
  if has_cuda_torch "$c"; then PY=$c; break; fi
done
# Else: torch from a local wheel folder, if the machine has one (no index, no network).
WHEELS=${PIP_FIND_LINKS:-/opt/wheels}
if [[ -z "$PY" ]] && ls "$WHEELS"/torch-*.whl >/dev/null 2>&1; then
  stamp "installing torch from $WHEELS (no network)"
  python3 -m venv "$ROOT/venv" && "$ROOT/venv/bin/pip" install -q --no-index --find-links "$WHEELS" torch numpy pytest \
    >"$OUT/pip.log" 2>&1 && has_cuda_torch "$ROOT/venv/bin/python3" && PY="$ROOT/venv/bin/python3"
  [[ -n "$PY" ]] || say "could not install torch from $WHEELS (see pip.log)"
fi
if [[ -z "$PY" ]]; then
  say "no Python with torch and a CUDA device here (tried \$PYTHON, python3, /opt/*, \$HOME/*):"
  say "  torch (about 5 GB with CUDA) cannot be carried and this machine cannot reach PyPI;"
  say "  a GPU session needs a machine image with torch installed. Nothing was run."
  nvidia-smi -L 2>&1 | tee -a "$SUM"
  exit 2
fi
nvidia-smi -L 2>&1 | tee -a "$SUM"
"$PY" -c 'import torch, phub; print("python", __import__("sys").version.split()[0], "torch", torch.__version__,
  "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "phub", phub.__version__)' 2>&1 | tee -a "$SUM"
"$PY" -c 'import pytest' 2>/dev/null && HAVE_PYTEST=1 || HAVE_PYTEST=0

if [[ "${PLAN:-all}" == bf16 ]]; then
  # BF16_PLAN_RUNS (default 1) rounds of every case, the cases alternating.
  for i in $(seq 1 "${BF16_PLAN_RUNS:-1}"); do
    if [[ "${WIRE16:-1}" == 1 ]]; then
      stamp "bf16 job against f32 job, host arrays (bench_wire16.py --f32-job), 4 lcores, shared memory, run $i"
      timeout 120 "$PY" python/bench/bench_wire16.py --workers 2 --lcores 4 --shm --f32-job --trials 8 \
        >"$OUT/wire16-shm-$i.log" 2>&1
      say "bench_wire16.py --shm --f32-job rc=$?"; tail -n 8 "$OUT/wire16-shm-$i.log" | tee -a "$SUM"
    fi
    IFS=';' read -r -a cases <<<"${BF16_CASES:-f32-one:--one-copy;f32-two:--two-copies;bf16-one:--dtype bf16 --one-copy;bf16-two:--dtype bf16 --two-copies}"
    for c in "${cases[@]}"; do
      n=${c%%:*}
      stamp "ResNet-50 DDP on CUDA ($n): phub (shared memory, 4 lcores) vs gloo, run $i"
      # shellcheck disable=SC2086 # the case's arguments
      timeout 120 "$PY" python/bench/bench_cuda_ddp.py --workers 2 --shm --lcores 4 --steps 8 ${c#*:} \
        >"$OUT/bench-$n-$i.log" 2>&1
      say "bench_cuda_ddp.py --shm ${c#*:} rc=$?"; tail -n 15 "$OUT/bench-$n-$i.log" | tee -a "$SUM"
    done
  done
  stamp "done"
  exit 0
fi

stamp "test_cuda.py (correctness on the GPU)"
if [[ $HAVE_PYTEST == 1 ]]; then
  timeout 200 "$PY" -m pytest -q -p no:cacheprovider python/tests/torch/test_cuda.py >"$OUT/test_cuda.log" 2>&1
  say "test_cuda.py rc=$?"; tail -n 15 "$OUT/test_cuda.log" | tee -a "$SUM"
else
  say "pytest is not installed for $PY: test_cuda.py skipped"
fi

if [[ "${PLAN:-all}" == repeat ]]; then
  # The medians and spread the single runs lack: the shared-memory step
  # DDP_RUNS times, then bf16 BF16_RUNS times, nothing else.
  for i in $(seq 1 "${DDP_RUNS:-3}"); do
    stamp "ResNet-50 DDP on CUDA: phub (shared memory, 4 lcores) vs gloo, run $i"
    timeout 120 "$PY" python/bench/bench_cuda_ddp.py --workers 2 --shm --lcores 4 --steps 10 >"$OUT/bench-shm-$i.log" 2>&1
    say "bench_cuda_ddp.py --shm rc=$?"; tail -n 15 "$OUT/bench-shm-$i.log" | tee -a "$SUM"
  done
  for i in $(seq 1 "${BF16_RUNS:-2}"); do
    stamp "ResNet-50 DDP on CUDA, bf16: phub (shared memory, 4 lcores) vs gloo, run $i"
    timeout 120 "$PY" python/bench/bench_cuda_ddp.py --workers 2 --shm --lcores 4 --steps 8 --dtype bf16 \
      >"$OUT/bench-bf16-$i.log" 2>&1
    say "bench_cuda_ddp.py --shm --dtype bf16 rc=$?"; tail -n 15 "$OUT/bench-bf16-$i.log" | tee -a "$SUM"
  done
  stamp "done"
  exit 0
fi

stamp "ResNet-50 DDP on CUDA: phub (shared memory, 4 lcores) vs gloo"
timeout 180 "$PY" python/bench/bench_cuda_ddp.py --workers 2 --shm --lcores 4 --steps 10 >"$OUT/bench-shm.log" 2>&1
say "bench_cuda_ddp.py --shm rc=$?"; tail -n 15 "$OUT/bench-shm.log" | tee -a "$SUM"

if (( $(date +%s) - t0 < 230 )); then
  stamp "ResNet-50 DDP on CUDA: phub (shared memory) vs gloo vs NCCL"
  timeout 120 "$PY" python/bench/bench_cuda_ddp.py --workers 2 --shm --lcores 4 --steps 8 --nccl >"$OUT/bench-nccl.log" 2>&1
  say "bench_cuda_ddp.py --shm --nccl rc=$?"; grep -m2 -i "nccl" "$OUT/bench-nccl.log" | cut -c1-400 | tee -a "$SUM"
  tail -n 15 "$OUT/bench-nccl.log" | tee -a "$SUM"
fi

if (( $(date +%s) - t0 < 300 )); then
  stamp "The same with one copy (straight into the staging regions): what the second copy costs"
  timeout 150 "$PY" python/bench/bench_cuda_ddp.py --workers 2 --shm --one-copy --lcores 4 --steps 8 \
    >"$OUT/bench-one-copy.log" 2>&1
  say "bench_cuda_ddp.py --shm --one-copy rc=$?"; tail -n 15 "$OUT/bench-one-copy.log" | tee -a "$SUM"
fi

if (( $(date +%s) - t0 < 330 )); then
  stamp "ResNet-50 DDP on CUDA, bf16: phub (shared memory, 4 lcores, a bf16 job) vs gloo"
  timeout 150 "$PY" python/bench/bench_cuda_ddp.py --workers 2 --shm --lcores 4 --steps 8 --dtype bf16 \
    >"$OUT/bench-bf16.log" 2>&1
  say "bench_cuda_ddp.py --shm --dtype bf16 rc=$?"; tail -n 15 "$OUT/bench-bf16.log" | tee -a "$SUM"
fi

if (( $(date +%s) - t0 < 380 )); then
  stamp "ResNet-50 DDP on CUDA: phub (datagrams, 4 lcores) vs gloo"
  timeout 150 "$PY" python/bench/bench_cuda_ddp.py --workers 2 --lcores 4 --steps 8 >"$OUT/bench-udp.log" 2>&1
  say "bench_cuda_ddp.py (datagrams) rc=$?"; tail -n 14 "$OUT/bench-udp.log" | tee -a "$SUM"
fi
stamp "done"
