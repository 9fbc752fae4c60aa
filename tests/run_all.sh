#!/usr/bin/env bash
# Every test: serial first, then the multi-rank tests under mpirun with 2 and 4 ranks.
# Each mpirun has an outer time limit, and every test a pytest-timeout (pyproject.toml) that
# ends its rank, and so the whole job, so a hang fails fast instead of stalling CI.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
# Open MPI refuses root without these; MPICH ignores them.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN=${MPIRUN:-mpirun}
OVERSUB=""
if "$MPIRUN" --version 2>&1 | grep -q "Open MPI"; then OVERSUB="--oversubscribe"; fi

echo "== serial tests"
python -m pytest -q -p no:cacheprovider -m "not mpi" "$@"
for n in 2 4; do
  echo "== mpirun -n $n"
  timeout -k 15 1500 "$MPIRUN" $OVERSUB -n "$n" \
    python -m pytest -q -p no:cacheprovider --with-mpi -m "mpi and not gpu" "$@"
done
echo "== the GPU tests' dry run on the CPU"
bash tests/gpu/run.sh --device cpu
