#!/usr/bin/env bash
# Everything a first GPU run must check, in one go (under 8 minutes on one GPU), with one
# summary file. Run it first on the day a GPU is lent:
#
#   bash tests/gpu/first_run.sh [--out DIR]                 # on a CUDA machine
#   bash tests/gpu/first_run.sh --device cpu [--out DIR]    # CI's dry run of the same steps
#
# Steps (each timed, each its own line in DIR/summary.md, the run goes on past a failure):
#   1. the GPU tests (tests/gpu/run.sh): one rank over NCCL, 2 and 4 ranks sharing the GPU
#      over MPI, under strict mode (NCCL's rules: synchronous sends, no device sync in a step);
#   2. the trainer on the device, every schedule, bf16 and fp16, dropout, ties with clip:
#      stopped by SIGUSR1 and resumed = uninterrupted = the library loop (tests/test_trainer_mpi.py);
#   3. `pipeflow train` from the command line for 20 steps (the loss must fall), saved, and
#      resumed to 30 steps from its checkpoint;
#   4. the CUDA-aware MPI paths, where MPI reports them (PIPEFLOW_CUDA_AWARE_MPI=1);
#   5. benchmarks/bench_gpu.py against the plain loop (GPT 350M and 760M; --tiny on the CPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=cuda
OUT=runs/first_run
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "usage: $0 [--device cuda|cpu] [--out DIR]" >&2; exit 2 ;;
  esac
done
export PIPEFLOW_TEST_DEVICE="$DEVICE"
source tests/mpi_env.sh
require_device "$DEVICE" first_run.sh || exit 2
if [[ "$DEVICE" == cuda* ]]; then
  TINY=""
else
  export CUDA_VISIBLE_DEVICES=""       # the CPU, even on a machine with a GPU
  TINY="--tiny"
fi
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
{
  echo "# first run: $(date -u +%FT%TZ), device $DEVICE"
  python - <<'PY'
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else "-"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, GPU {gpu}")
PY
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---|"
} > "$SUMMARY"
failures=0

step() {   # step NAME LIMIT_S COMMAND...: run, time, log, and add a row
  local name="$1" limit="$2"; shift 2
  local log="$OUT/$name.log" start rc
  echo "== $name"
  start=$(date +%s)
  timeout -k 15 "$limit" "$@" > "$log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  tail -n 3 "$log"
  if [[ $rc -eq 0 ]]; then
    echo "| $name | ok | $took |" >> "$SUMMARY"
  else
    failures=$((failures + 1))
    echo "| $name | FAILED (exit $rc, see $name.log) | $took |" >> "$SUMMARY"
  fi
}

PYTEST=(python -m pytest -q -p no:cacheprovider --capture=sys --with-mpi -m "mpi and not gpu")

# 1. The GPU tests, strict mode on the MPI paths.
step gpu-tests 300 env PIPEFLOW_STRICT_COMM=1 bash tests/gpu/run.sh --device "$DEVICE"

# 2. The trainer's own path on the device, strict (on the CPU the main suite runs it).
if [[ "$DEVICE" == cuda* ]]; then
  step trainer 300 env PIPEFLOW_STRICT_COMM=1 \
    "$MPIRUN" $OVERSUB -n 2 "${PYTEST[@]}" tests/test_trainer_mpi.py
else
  echo "| trainer | not run here: run_all.sh runs it on the CPU, strict too | 0 |" >> "$SUMMARY"
fi

# 3. pipeflow train from the command line: 20 steps, then resumed to 30 from its checkpoint.
RUN_DIR="$OUT/train"
rm -rf "$RUN_DIR"
SMALL=(--set train.log_every=5 --set train.eval_batches=1)
[[ -n "$TINY" ]] && SMALL+=(--set model.d_model=32 --set model.n_layers=2 --set train.batch_size=8)
step train-20 240 "$MPIRUN" $OVERSUB -n 2 pipeflow train examples/gpt_small.toml --steps 20 \
  --set "train.save_dir=\"$RUN_DIR\"" --set train.save_every=10 \
  --set "train.metrics=\"$RUN_DIR/metrics.jsonl\"" "${SMALL[@]}"
step train-resume 240 "$MPIRUN" $OVERSUB -n 2 pipeflow train examples/gpt_small.toml --steps 30 --resume \
  --set "train.save_dir=\"$RUN_DIR\"" --set "train.metrics=\"$RUN_DIR/metrics.jsonl\"" \
  "${SMALL[@]}"
step loss-falls 30 python - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line]
losses = [r["loss"] for r in rows if "loss" in r]
steps = [r["step"] for r in rows if "loss" in r]
assert steps[-1] == 29, f"the resumed run did not reach step 29: {steps}"
assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over steps {steps[0]}..{steps[-1]}")
PY

# 4. CUDA-aware MPI, where MPI says it is (point-to-point takes device memory; reductions
#    stay staged through the host).
if python -c "import sys; from pipeflow.comm.cuda import cuda_aware_mpi; \
              sys.exit(0 if cuda_aware_mpi() else 1)" 2>/dev/null && [[ "$DEVICE" == cuda* ]]; then
  step cuda-aware-mpi 180 env PIPEFLOW_CUDA_AWARE_MPI=1 \
    "$MPIRUN" $OVERSUB -n 2 python -m pytest -q -p no:cacheprovider --with-mpi \
    -m "gpu and mpi" tests/gpu
else
  echo "| cuda-aware-mpi | not run: MPI does not report CUDA support | 0 |" >> "$SUMMARY"
fi

# 5. Speed and memory against the plain loop.
step bench-gpu 300 python benchmarks/bench_gpu.py all --device "$DEVICE" $TINY \
  --output "$OUT/bench_gpu.md"

echo >> "$SUMMARY"
echo "$failures step(s) failed" >> "$SUMMARY"
echo "== summary: $SUMMARY"
cat "$SUMMARY"
[[ $failures -eq 0 ]]
