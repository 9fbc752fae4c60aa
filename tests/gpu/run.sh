#!/usr/bin/env bash
# The GPU path's tests, on one machine: one rank over NCCL, then 2 and 4 ranks sharing the
# GPU over MPI (over NCCL where each rank has a GPU of its own). Under 2.5 minutes on one GPU.
#
#   bash tests/gpu/run.sh                 # on a CUDA machine
#   bash tests/gpu/run.sh --device cpu    # the same cases on 1 and 2 CPU ranks: CI's dry run
set -euo pipefail
cd "$(dirname "$0")/../.."
DEVICE=cuda
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    *) echo "usage: $0 [--device cuda|cpu]" >&2; exit 2 ;;
  esac
done
export PIPEFLOW_TEST_DEVICE="$DEVICE"
source tests/mpi_env.sh
require_device "$DEVICE" tests/gpu/run.sh

# The CPU dry run checks the script and the tests with 2 ranks only (the main suite already
# runs every grid on 4 CPU ranks); on a GPU, 2 and 4 ranks share it.
RANKS="2 4"
[[ "$DEVICE" == cuda* ]] || RANKS="2"
# Limits within first_run.sh's step (160 s): 35 + 2 x 55 s at most, both multiplied by
# PIPEFLOW_LIMIT_SCALE (first_run.sh sets it: 4 on the CPU, where the step's limit grows alike).
S=${PIPEFLOW_LIMIT_SCALE:-1}
# `--capture=sys` keeps the ranks' own stderr (a watchdog's or an abort's report) out of pytest's capture, which
# would swallow it with the process.
PYTEST=(python -m pytest -q -p no:cacheprovider --capture=sys)
echo "== gpu tests, one rank ($DEVICE)"
timeout -k 5 $(( 35 * S )) "${PYTEST[@]}" -m "gpu and not mpi" tests/gpu --ignore=tests/gpu/test_nccl_ops.py
for n in $RANKS; do
  echo "== gpu tests, mpirun -n $n ($DEVICE)"
  timeout -k 5 $(( 55 * S )) "$MPIRUN" $OVERSUB -n "$n" "${PYTEST[@]}" --with-mpi -m "gpu and mpi" tests/gpu
done
