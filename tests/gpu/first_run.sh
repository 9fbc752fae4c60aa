#!/usr/bin/env bash
# Everything a first GPU run must check, in one go (at most 8 minutes on one GPU: every step's
# limit is cut to what is left of BUDGET_S, and a step with nothing left is reported as not
# run), with one summary file. Run it first on the day a GPU is lent, from a clean checkout:
#
#   bash tests/gpu/first_run.sh [--out DIR]                 # on a CUDA machine
#   bash tests/gpu/first_run.sh --device cpu [--out DIR]    # CI's dry run of the same steps
#
# Nothing needs installing: pipeflow is imported from this checkout (PYTHONPATH), the CLI runs
# as `python -m pipeflow`, and the launcher is the one of the MPI mpi4py was built against
# (tests/mpi_env.sh), so a wheel's mpirun cannot shadow the machine's own MPI.
#
# Steps (each timed, each its own line in DIR/summary.md, the run goes on past a failure):
#   0. every NCCL operation one GPU can run, over a 1-rank NCCL group (send to itself,
#      all-reduce, reduce-scatter, all-gather, the gradient reducer from autograd's thread,
#      the sharded optimizer, the engine): a summary row each (on the CPU: gloo, and the send
#      to itself skipped);
#   1. the GPU tests (tests/gpu/run.sh): one rank over NCCL, 2 and 4 ranks sharing the GPU
#      over MPI, under strict mode, point-to-point pinned to host staging
#      (PIPEFLOW_CUDA_AWARE_MPI=0);
#   2. the trainer on the device, every schedule, bf16 and fp16, dropout, ties with clip,
#      deterministic kernels: stopped by SIGUSR1 and resumed = uninterrupted = the library loop
#      (tests/test_trainer_mpi.py);
#   3. `pipeflow train` from the command line for 20 steps (the loss must fall), saved, and
#      resumed to 30 steps from its checkpoint;
#   4. point-to-point in device memory (PIPEFLOW_CUDA_AWARE_MPI=1), where MPI reports CUDA
#      support (else a row says it did not run);
#   5. the host synchronisations of steps 3-5, each with its stack
#      (torch.cuda.set_sync_debug_mode("warn"); at most 2 a step: tests/gpu/audit.py syncs);
#   6. the data group's reductions against the last backward: a profile of each of 2 ranks
#      (audit.py overlap), a bucket launched before backward reaches the first layer;
#   7. generation: no host synchronisation a token on one rank (audit.py generate-syncs), on
#      2 ranks sharing the GPU over MPI equal to one rank, and the MPI path that
#      withdraws a posted receive, with changing sequence lengths (tests/gpu/test_gpu.py);
#   8. memory: num_alloc_retries, reserved minus allocated and the peak, with and without
#      expandable_segments (audit.py memory);
#   9. benchmarks/bench_gpu.py against the plain loop (GPT 350M and 760M; --tiny on the CPU).
# (Step 0 also sends a message of bf16, int64 and bool tensors, a non-contiguous view and a
# zero-size tensor through TorchDistCommunicator to itself, in one batch.)
#
# Limits are a GPU's. Under `--device cpu` every limit and the budget are multiplied by
# PIPEFLOW_LIMIT_SCALE (default 4; tests/gpu/run.sh's inner limits too, each inside its
# step's), so a loaded 2-core machine passes what a quiet one passes: the limits guard a
# GPU's budget, not a CPU's speed.
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
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"     # this checkout, installed or not
source tests/mpi_env.sh
if [[ "$DEVICE" == cuda* ]]; then SCALE=1; else SCALE=${PIPEFLOW_LIMIT_SCALE:-4}; fi
export PIPEFLOW_LIMIT_SCALE=$SCALE
BUDGET_S=${BUDGET_S:-$(( 480 * SCALE ))}
DEADLINE=$(( $(date +%s) + BUDGET_S ))
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
  local name="$1" limit=$(( $2 * SCALE )); shift 2
  local log="$OUT/$name.log" start rc left
  left=$(( DEADLINE - $(date +%s) - 5 ))
  if (( left < 10 )); then
    failures=$((failures + 1))
    echo "| $name | NOT RUN: the ${BUDGET_S} s budget is spent | 0 |" >> "$SUMMARY"
    return
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit $limit s)"
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
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

# 0. Every NCCL operation that fits one GPU, a row each.
step nccl-ops 45 python -m pytest -q -p no:cacheprovider --capture=sys -rA -m gpu \
  tests/gpu/test_nccl_ops.py --junitxml "$OUT/nccl-ops.xml"
python - "$OUT/nccl-ops.xml" "$DEVICE" >> "$SUMMARY" <<'PY' || true
import sys, xml.etree.ElementTree as ET
device = sys.argv[2]
for case in ET.parse(sys.argv[1]).iter("testcase"):
    name = case.get("name").removeprefix("test_").replace("_", " ")
    skipped, failed = case.find("skipped"), case.find("failure") or case.find("error")
    result = ("FAILED" if failed is not None else
              f"skipped: {skipped.get('message', '')}" if skipped is not None else
              "ok" + ("" if device.startswith("cuda") else " (gloo on the CPU; NCCL on a GPU)"))
    print(f"| nccl: {name} | {result} | {float(case.get('time', 0)):.0f} |")
PY

# 1. The GPU tests, strict mode on the MPI paths, point-to-point staged through the host.
step gpu-tests 160 env PIPEFLOW_STRICT_COMM=1 PIPEFLOW_CUDA_AWARE_MPI=0 \
  bash tests/gpu/run.sh --device "$DEVICE"

# 2. The trainer's own path on the device, strict (on the CPU the main suite runs it).
if [[ "$DEVICE" == cuda* ]]; then
  step trainer 80 env PIPEFLOW_STRICT_COMM=1 PIPEFLOW_DETERMINISTIC=1 \
    "$MPIRUN" $OVERSUB -n 2 "${PYTEST[@]}" tests/test_trainer_mpi.py
else
  echo "| trainer | not run here: run_all.sh runs it on the CPU, strict too | 0 |" >> "$SUMMARY"
fi

# 3. pipeflow train from the command line: 20 steps, then resumed to 30 from its checkpoint.
RUN_DIR="$OUT/train"
rm -rf "$RUN_DIR"
SMALL=(--set train.log_every=5 --set train.eval_batches=1)
[[ -n "$TINY" ]] && SMALL+=(--set model.d_model=32 --set model.n_layers=2 --set train.batch_size=8)
step train-20 40 "$MPIRUN" $OVERSUB -n 2 python -m pipeflow train examples/gpt_small.toml --steps 20 \
  --set "train.save_dir=\"$RUN_DIR\"" --set train.save_every=10 \
  --set "train.metrics=\"$RUN_DIR/metrics.jsonl\"" "${SMALL[@]}"
step train-resume 35 "$MPIRUN" $OVERSUB -n 2 python -m pipeflow train examples/gpt_small.toml \
  --steps 30 --resume \
  --set "train.save_dir=\"$RUN_DIR\"" --set "train.metrics=\"$RUN_DIR/metrics.jsonl\"" \
  "${SMALL[@]}"
step loss-falls 10 python - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line]
losses = [r["loss"] for r in rows if "loss" in r]
steps = [r["step"] for r in rows if "loss" in r]
assert steps[-1] == 29, f"the resumed run did not reach step 29: {steps}"
assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over steps {steps[0]}..{steps[-1]}")
PY

# 4. CUDA-aware MPI, where MPI says it is (point-to-point takes device memory; reductions
#    stay staged through the host): the other point-to-point path, pinned.
if python -c "import sys; from pipeflow.comm.cuda import cuda_aware_mpi; \
              sys.exit(0 if cuda_aware_mpi() else 1)" 2>/dev/null && [[ "$DEVICE" == cuda* ]]; then
  step cuda-aware-mpi 40 env PIPEFLOW_CUDA_AWARE_MPI=1 \
    "$MPIRUN" $OVERSUB -n 2 python -m pytest -q -p no:cacheprovider --capture=sys --with-mpi \
    -m "gpu and mpi" tests/gpu
else
  echo "| cuda-aware-mpi | not run: MPI does not report CUDA support | 0 |" >> "$SUMMARY"
fi

# 5.-8. Host syncs, overlap, generation and MPI's withdrawn receives, memory.
step sync-audit 30 python tests/gpu/audit.py syncs --device "$DEVICE"
step generate-syncs 20 python tests/gpu/audit.py generate-syncs --device "$DEVICE"
step overlap 30 "$MPIRUN" $OVERSUB -n 2 python tests/gpu/audit.py overlap --device "$DEVICE" \
  --out "$OUT"
GPU_MPI=(python -m pytest -q -p no:cacheprovider --capture=sys --with-mpi -m "gpu and mpi")
step generate-2-ranks 30 "$MPIRUN" $OVERSUB -n 2 "${GPU_MPI[@]}" tests/gpu/test_gpu.py \
  -k generation
step mpi-withdraw 30 "$MPIRUN" $OVERSUB -n 2 "${GPU_MPI[@]}" tests/gpu/test_gpu.py -k withdraw
step memory 40 python tests/gpu/audit.py memory --device "$DEVICE"

# 9. Speed against the plain loop.
step bench-gpu 90 python benchmarks/bench_gpu.py all --device "$DEVICE" $TINY \
  --output "$OUT/bench_gpu.md"

echo >> "$SUMMARY"
echo "$failures step(s) failed" >> "$SUMMARY"
echo "== summary: $SUMMARY"
cat "$SUMMARY"
[[ $failures -eq 0 ]]
