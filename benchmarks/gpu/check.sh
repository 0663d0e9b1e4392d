#!/usr/bin/env bash
# The one-command GPU check of jrollout (issue 19); see benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/check.sh [--dry-run] [--budget SECONDS]
#
# Stages, each bounded with `timeout`, all within --budget (default 480 s;
# the dry run 900 s):
#   install  pip install --no-deps -e . (the image's jax/torch untouched);
#            wheels in .whl/ (gymnax and its needs) go to a --target folder
#   env      versions, devices, memory settings, one JAX<->torch round trip
#   tests    the whole suite on the default (GPU) backend, a per-test time
#            limit, not stopping at failures: tests.xml (junit), tests.txt
#   bench    python -m benchmarks.gpu.bench: the hot-path rows at W2 and at
#            the GPU workload, torch on the same GPU, the PPO example with
#            many vmapped seeds: RESULTS.md, results.png
# and SUMMARY.md (what ran, how long, what failed). Everything goes to $OUT
# (default: ./gpu_check_out), with the whole log in check.log.
#
# --dry-run: JAX and torch on the CPU, test_api.py alone, --quick sizes
# (CI runs it: tests/test_gpu_check.py). Exit status: 0 when every stage
# passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$(pwd)

DRY=0
BUDGET=
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --budget) BUDGET=$2; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# The dry run is not timed: it gets room for a busy 2-core CI machine.
BENCH_LIMIT=180
if [ "$DRY" = 1 ]; then BENCH_LIMIT=400; fi
BUDGET=${BUDGET:-$([ "$DRY" = 1 ] && echo 900 || echo 480)}
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
STAGES=$WORK/stages.tsv
LOG=$OUT/check.log
: > "$LOG"
: > "$STAGES"
START=$(date +%s)

# JAX and a torch simulator share one GPU: JAX must not preallocate 75% of
# it when it starts, and its share is capped (both spellings of the
# fraction, older and newer JAX). The tests run in several processes too.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-.45}
export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-$XLA_PYTHON_CLIENT_MEM_FRACTION}
export PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
fi

log() { echo "$*" | tee -a "$LOG"; }

record() {  # record NAME STATUS SECONDS BUDGET WHAT
  printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$STAGES"
}

# stage NAME BUDGET WHAT EXTRA_LOG -- COMMAND...: runs COMMAND under
# `timeout` (SIGINT first, so pytest and the bench write their reports),
# its output to the terminal and check.log (and EXTRA_LOG unless it is "-").
FAILED=0
stage() {
  local name=$1 budget=$2 what=$3 extra=$4
  shift 5
  local left=$((START + BUDGET - $(date +%s) - 10))
  if [ "$budget" -gt "$left" ]; then budget=$left; fi
  if [ "$budget" -lt 15 ]; then
    log "=== $name: skipped, ${left}s of the budget left"
    record "$name" "skipped (no time left)" 0 "$budget" "$what"
    FAILED=1
    return
  fi
  log "=== $name (at most ${budget}s): $what"
  local t0 rc
  t0=$(date +%s)
  if [ "$extra" = "-" ]; then
    timeout -s INT -k 20 "$budget" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
  else
    : > "$extra"
    timeout -s INT -k 20 "$budget" "$@" 2>&1 | tee -a "$LOG" "$extra"
    rc=${PIPESTATUS[0]}
  fi
  record "$name" "$rc" "$(($(date +%s) - t0))" "$budget" "$what"
  log "=== $name: exit $rc after $(($(date +%s) - t0))s"
  if [ "$rc" != 0 ]; then FAILED=1; fi
}

# --- install (here, not in a stage: its exports must reach later stages)
t0=$(date +%s)
what=""
if ls .whl/*.whl > /dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl >> "$LOG" 2>&1
  then
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
    what="wheels $(cd .whl && echo *.whl) to PYTHONPATH; "
  else
    what="installing .whl/*.whl FAILED; "
  fi
fi
# Asked from / : in the checkout, the current folder would shadow an install.
where=$(cd / && "$PY" -c "import jrollout, os; print(os.path.dirname(
    os.path.dirname(os.path.abspath(jrollout.__file__))))" 2>/dev/null)
if [ "$where" = "$ROOT" ]; then
  what="${what}jrollout already importable from this checkout"
  rc=0
elif "$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$LOG" 2>&1
then
  what="${what}pip install --no-deps --no-build-isolation -e ."
  rc=0
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  what="${what}pip install -e . FAILED, using PYTHONPATH=$ROOT"
  rc=1
fi
log "=== install: $what"
record install "$rc" "$(($(date +%s) - t0))" - "$what"

# --- env
expect=(--expect-gpu)
if [ "$DRY" = 1 ]; then expect=(); fi
stage env 60 "versions, devices, a JAX<->torch round trip" "$OUT/env.txt" -- \
  "$PY" -m benchmarks.gpu.env "${expect[@]}"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi >> "$OUT/env.txt" 2>&1
fi

# --- tests
PER_TEST=120
WORKERS=${WORKERS:-8}
# Left out: the CPU suite's smoke run (the bench stage measures on the GPU)
# and the CI dry run of this script.
tests=(tests --ignore tests/test_benchmarks_smoke.py
       --ignore tests/test_gpu_check.py)
if [ "$DRY" = 1 ]; then
  PER_TEST=60
  WORKERS=1
  tests=(tests/test_api.py)
fi
# A per-test limit where pytest-timeout is installed; the stage's own
# `timeout` bounds the whole run either way.
limit=()
if "$PY" -c "import pytest_timeout" 2> /dev/null; then
  limit=(--timeout "$PER_TEST")
fi
parallel=()
if [ "$WORKERS" -gt 1 ] && "$PY" -c "import xdist" 2> /dev/null; then
  parallel=(-n "$WORKERS")
fi
stage tests 270 "pytest ${tests[*]} ${limit[*]} ${parallel[*]}" \
  "$OUT/tests.txt" -- \
  "$PY" -m pytest "${tests[@]}" "${limit[@]}" "${parallel[@]}" \
  -p no:cacheprovider -q -rfEs --junitxml "$OUT/tests.xml"

# --- bench
bench=(--out "$OUT")
if [ "$DRY" = 1 ]; then
  bench+=(--quick --ppo-seeds 2 --ppo-updates 1)
fi
stage bench "$BENCH_LIMIT" "python -m benchmarks.gpu.bench ${bench[*]}" - -- \
  "$PY" -m benchmarks.gpu.bench "${bench[@]}"

record total "$FAILED" "$(($(date +%s) - START))" "$BUDGET" \
  "$([ "$DRY" = 1 ] && echo "dry run (CPU)" || echo "GPU run")"
"$PY" -m benchmarks.gpu.summary "$OUT" "$STAGES" | tee -a "$LOG"
rm -rf "$WORK"
exit "$FAILED"
