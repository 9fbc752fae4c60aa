#!/usr/bin/env bash
# Every test: serial first (spread over PIPEFLOW_TEST_WORKERS processes, 2 by default, by
# pytest-xdist, one file a worker at a time), then the multi-rank tests under mpirun with 2 and
# 4 ranks. Each mpirun has an outer time limit, and every test a pytest-timeout
# (pyproject.toml) that ends its rank, and so the whole job, so a hang fails fast instead of
# stalling CI. With PIPEFLOW_TEST_TIMES=DIR set, each job writes its JUnit XML there, and
# `python tests/timings.py DIR` rewrites tests/README.md's table of times from them.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/mpi_env.sh
times_dir=${PIPEFLOW_TEST_TIMES:-}
if [[ -n "$times_dir" ]]; then mkdir -p "$times_dir"; fi

junit() {   # junit NAME: pytest's option writing this job's XML, when times are kept
  if [[ -n "$times_dir" ]]; then echo "--junitxml=$times_dir/$1.xml"; fi
}

echo "== serial tests"
workers=${PIPEFLOW_TEST_WORKERS:-2}
spread=()
if [[ "$workers" -gt 1 ]]; then spread=(-n "$workers" --dist loadfile); fi
python -m pytest -q -p no:cacheprovider -m "not mpi" "${spread[@]}" $(junit serial) "$@"

# The multi-rank tests. `--capture=sys` leaves the ranks' own stderr alone: a watchdog's or an
# abort's report ends the job and must reach the log, which pytest's default fd capture would
# swallow with the process. The files that take longest run one mpirun job each; the small
# ones share one job per rank count (each job pays about 4 s of start-up: Python, torch, MPI
# and collection). A failure in a shared job is named by its test id; an abort or a hang
# (ended by the watchdog or the test's timeout) ends that job only, the others still run and
# are reported, and conftest.py prints each file's name as it starts, so the log says which
# file the job was in. No job runs every file: the whole 4-rank suite in one job took 14 min
# on 2 cores (one job per file about 3).
mapfile -t MPI_FILES < <(grep -l "mark.mpi" tests/test_*.py)
ALONE=(test_engine_mpi test_data_parallel_mpi test_hf_mpi test_recompute_mpi test_trainer_mpi
       test_compile_mpi test_shard_mpi test_generate_mpi test_collective_order_mpi
       test_hf_cli_mpi)
JOBS=()      # one entry a job: its files, space-separated
small=()
for f in "${MPI_FILES[@]}"; do
  base=$(basename "$f" .py)
  if [[ " ${ALONE[*]} " == *" $base "* ]]; then JOBS+=("$f"); else small+=("$f"); fi
done
if [[ ${#small[@]} -gt 0 ]]; then JOBS+=("${small[*]}"); fi
failed=()

run_job() {   # run_job N "FILES" [pytest args]: one mpirun job; a failure is recorded
  local n="$1" files="$2" rc=0 name
  shift 2
  name="${PIPEFLOW_STRICT_COMM:+strict-}n$n-$(basename "${files%% *}" .py)"
  # shellcheck disable=SC2086   # FILES is a list of paths without spaces
  timeout -k 15 900 "$MPIRUN" $OVERSUB -n "$n" \
    python -m pytest -q -p no:cacheprovider --capture=sys --with-mpi -m "mpi and not gpu" \
    $(junit "$name") $files "$@" || rc=$?
  # Exit 5 (no test collected) is a failure unless the caller's own -k or -m chose none here.
  if [[ $rc -eq 5 && $# -gt 0 ]]; then rc=0; fi
  if [[ $rc -ne 0 ]]; then
    failed+=("${PIPEFLOW_STRICT_COMM:+strict }mpirun -n $n $files (exit $rc)")
  fi
}

for n in 2 4; do
  echo "== mpirun -n $n: ${#MPI_FILES[@]} files in ${#JOBS[@]} jobs"
  for job in "${JOBS[@]}"; do
    echo "-- $job"
    run_job "$n" "$job" "$@"
  done
done
# Strict mode: the MPI backend under NCCL's rules (synchronous sends, order-matched links,
# agreed collectives, no device synchronize in a step, one thread): the equivalence, trainer
# and checkpoint tests again, so CPU CI fails where a GPU run with NCCL would. Two jobs: the
# trainer's runs apart, the library's files together.
STRICT_FILES="tests/test_engine_mpi.py tests/test_data_parallel_mpi.py \
tests/test_checkpoint_mpi.py tests/test_shard_mpi.py tests/test_collective_order_mpi.py"
export PIPEFLOW_STRICT_COMM=1
echo "== strict mode (PIPEFLOW_STRICT_COMM=1), mpirun -n 2"
run_job 2 "$STRICT_FILES" "$@"
run_job 2 tests/test_trainer_mpi.py "$@"
echo "== strict mode (PIPEFLOW_STRICT_COMM=1), mpirun -n 4: the trainer (2x2: ties, fp16, clip)"
run_job 4 tests/test_trainer_mpi.py "$@"
unset PIPEFLOW_STRICT_COMM
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "== the first GPU run's script, dry run on the CPU"
bash tests/gpu/first_run.sh --device cpu --out "${TMPDIR:-/tmp}/pipeflow-first-run.$$"
