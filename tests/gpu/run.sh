#!/usr/bin/env bash
# The GPU path's tests, on one machine: one rank over NCCL, then 2 and 4 ranks sharing the
# GPU over MPI (over NCCL where each rank has a GPU of its own). Under 8 minutes on one GPU.
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
echo "== gpu tests, one rank ($DEVICE)"
timeout -k 15 120 python -m pytest -q -p no:cacheprovider -m "gpu and not mpi" tests/gpu
for n in $RANKS; do
  echo "== gpu tests, mpirun -n $n ($DEVICE)"
  timeout -k 15 180 "$MPIRUN" $OVERSUB -n "$n" \
    python -m pytest -q -p no:cacheprovider --with-mpi -m "gpu and mpi" tests/gpu
done
if [[ "$DEVICE" != cuda* ]]; then
  echo "== benchmarks/bench_gpu.py, dry run"
  timeout -k 15 120 python benchmarks/bench_gpu.py all --device "$DEVICE" --tiny --output '' \
    > /dev/null
fi
