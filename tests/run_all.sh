#!/usr/bin/env bash
# Every test: serial first, then the multi-rank tests under mpirun with 2 and 4 ranks.
# Each mpirun has an outer time limit, and every test a pytest-timeout (pyproject.toml) that
# ends its rank, and so the whole job, so a hang fails fast instead of stalling CI.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/mpi_env.sh

echo "== serial tests"
python -m pytest -q -p no:cacheprovider -m "not mpi" "$@"

# The multi-rank tests, one mpirun job per file (`--capture=sys` leaves the ranks' own stderr
# alone: a watchdog's or an abort's report ends the job and must reach the log, which
# pytest's default fd capture would swallow with the process): a failure or a hang (ended
# by the test's timeout) ends only that file's job, the other files still run and are reported, and no job
# runs hundreds of engines in one process (the whole 4-rank suite in one job took 14 min on
# 2 cores, one job per file about 3).
mapfile -t MPI_FILES < <(grep -l "mark.mpi" tests/test_*.py)
failed=()

run_file() {   # run_file N FILE [pytest args]: one mpirun job; a failure is recorded
  local n="$1" f="$2" rc=0
  shift 2
  timeout -k 15 900 "$MPIRUN" $OVERSUB -n "$n" \
    python -m pytest -q -p no:cacheprovider --capture=sys --with-mpi -m "mpi and not gpu" \
    "$f" "$@" || rc=$?
  # Exit 5 (no test collected) is a failure unless the caller's own -k or -m chose none here.
  if [[ $rc -eq 5 && $# -gt 0 ]]; then rc=0; fi
  if [[ $rc -ne 0 ]]; then
    failed+=("${PIPEFLOW_STRICT_COMM:+strict }mpirun -n $n $f (exit $rc)")
  fi
}

for n in 2 4; do
  echo "== mpirun -n $n: ${#MPI_FILES[@]} files"
  for f in "${MPI_FILES[@]}"; do
    echo "-- $f"
    run_file "$n" "$f" "$@"
  done
done
# Strict mode: the MPI backend under NCCL's rules (synchronous sends, order-matched links,
# agreed collectives, no device synchronize in a step, one thread): the equivalence, trainer
# and checkpoint tests again, so CPU CI fails where a GPU run with NCCL would.
STRICT_FILES=(tests/test_engine_mpi.py tests/test_data_parallel_mpi.py tests/test_trainer_mpi.py
              tests/test_checkpoint_mpi.py tests/test_shard_mpi.py tests/test_collective_order_mpi.py)
export PIPEFLOW_STRICT_COMM=1
for n in 2 4; do
  files=("${STRICT_FILES[@]}")
  if [[ $n -eq 4 ]]; then files=(tests/test_trainer_mpi.py); fi   # 2x2: ties, fp16, clip
  echo "== strict mode (PIPEFLOW_STRICT_COMM=1), mpirun -n $n: ${files[*]}"
  for f in "${files[@]}"; do
    run_file "$n" "$f" "$@"
  done
done
unset PIPEFLOW_STRICT_COMM
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "== the first GPU run's script, dry run on the CPU"
bash tests/gpu/first_run.sh --device cpu --out "${TMPDIR:-/tmp}/pipeflow-first-run.$$"
