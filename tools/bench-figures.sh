#!/usr/bin/env bash
# The end-to-end figures of BENCHMARKS.md ("End to end: phub-bench run"), in
# the order they were taken: three interleaved runs of ResNet-50 with W = 1
# and W = 2 (and of a baseline build when BASE names its phub-bench), the
# ablations, worker processes, the sweeps with their plots, VGG-16,
# BERT-large and a verified run. JSON goes to $OUT (default target/bench),
# the sweeps' JSON and SVG to docs/bench. About 3 minutes on the 2-vCPU
# development VM.
#
#   cargo build --release -p phub-tools --bin phub-bench
#   tools/bench-figures.sh                       # this build only
#   BASE=/path/to/old/phub-bench tools/bench-figures.sh
#
# The baseline build of BENCHMARKS.md is commit 693aa8a's worker and UDP
# backend with this phub-bench (see there); it has no same-run ceiling and
# no Worker::exchange, hence `--no-ceiling --api handles` for it.
set -euo pipefail
cd "$(dirname "$0")/.."
B=target/release/phub-bench
OUT=${OUT:-target/bench}
D=docs/bench
mkdir -p "$OUT" "$D"
row() { grep -A1 "^model" | tail -1; }
log() { echo "== $(date +%T) load $(cut -d' ' -f1 /proc/loadavg) $*"; }
for i in 1 2 3; do
  for w in 1 2; do
    log "resnet50 W=$w #$i"
    $B run --local --model resnet50 --workers $w --rounds 20 --quiet --json "$OUT/r50-w$w-$i.json" 2>&1 | row
    if [ -n "${BASE:-}" ]; then
      log "baseline W=$w #$i"
      (cd /tmp && "$BASE" run --local --model resnet50 --workers $w --rounds 10 --quiet --no-ceiling \
        --api handles --json "$OLDPWD/$OUT/base-w$w-$i.json" 2>&1 | row)
    fi
  done
done
for w in 1 2; do
  for v in "--api handles" "--no-gso --no-gro" "--no-gso" "--no-gro" "--window 1024" ""; do
    log "ablation W=$w $v"
    # shellcheck disable=SC2086 # $v is several flags on purpose
    $B run --local --model resnet50 --workers $w --rounds 10 --quiet --no-ceiling $v \
      --json "$OUT/abl-w$w-$(echo "$v" | tr -d ' -').json" 2>&1 | row
  done
done
log "procs W=2"
$B run --local --model resnet50 --workers 2 --procs --rounds 10 --quiet --json "$OUT/r50-w2-procs.json" 2>&1 | row
log "sweep workers"
$B run --local --model resnet50 --rounds 10 --quiet --sweep workers=1,2,4 \
  --json $D/resnet50-workers.json --plot $D/resnet50-workers.svg 2>&1 | grep -A4 "^model"
log "sweep chunk"
$B run --local --model resnet50 --rounds 10 --quiet --sweep chunk=1024,2048,4096,8192,8832 \
  --json $D/resnet50-chunk.json --plot $D/resnet50-chunk.svg 2>&1 | grep -A6 "^model"
for w in 1 2; do
  log "sweep model size W=$w"
  $B run --local --rounds 10 --quiet --workers $w --model x \
    --sweep model=synthetic:1M,synthetic:4M,synthetic:16M,synthetic:64M \
    --json $D/size-w$w.json --plot $D/size-w$w.svg 2>&1 | grep -A5 "^model"
done
log "sweep lcores"
$B run --local --model resnet50 --workers 2 --rounds 10 --quiet --sweep lcores=1,2 \
  --json $D/resnet50-lcores.json --plot $D/resnet50-lcores.svg 2>&1 | grep -A3 "^model"
log "sweep window W=2"
$B run --local --model resnet50 --workers 2 --rounds 10 --quiet --no-ceiling \
  --sweep window=16,32,63,128,256,512,1024 \
  --json $D/resnet50-window-w2.json --plot $D/resnet50-window-w2.svg 2>&1 | grep -A8 "^model"
log "vgg16"
$B run --local --model vgg16 --rounds 5 --warmup 1 --quiet --json "$OUT/vgg16.json" 2>&1 | row
log "bert-large"
$B run --local --model bert-large --rounds 3 --warmup 1 --quiet --json "$OUT/bert.json" 2>&1 | row
log "verify resnet50 W=2"
$B run --local --model resnet50 --workers 2 --rounds 5 --verify --quiet --no-ceiling \
  --json "$OUT/r50-w2-verify.json" 2>&1 | row
log done
