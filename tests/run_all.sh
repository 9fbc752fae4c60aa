#!/usr/bin/env bash
# Every test: serial first (spread over PIPEFLOW_TEST_WORKERS processes, 2 by default, by
# pytest-xdist, one file a worker at a time), then the multi-rank tests under mpirun with 2 and
# 4 ranks, strict mode, and the first GPU run's script dry on the CPU. Each mpirun has an outer
# time limit, and every test a pytest-timeout (pyproject.toml) that ends its rank, and so the
# whole job, so a hang fails fast instead of stalling CI. Every job runs even after another
# failed; the end lists each job's wall time and names the ones that failed.
#
#   PIPEFLOW_TEST_PARTS="serial n2 n4 strict gpu"   the parts to run (default: all of them)
#   PIPEFLOW_TEST_TIMES=DIR                         each job's JUnit XML into DIR, for
#                                                   `python tests/timings.py DIR`
# Arguments go to every pytest (e.g. `-k NAME`); a job they leave empty is not a failure,
# and the GPU dry run (no pytest) runs only without them.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/mpi_env.sh
times_dir=${PIPEFLOW_TEST_TIMES:-}
if [[ -n "$times_dir" ]]; then mkdir -p "$times_dir"; fi
parts=" ${PIPEFLOW_TEST_PARTS:-serial n2 n4 strict gpu} "
for part in $parts; do
  if [[ " serial n2 n4 strict gpu " != *" $part "* ]]; then
    echo "run_all.sh: unknown part '$part' in PIPEFLOW_TEST_PARTS: expected some of" \
         "serial n2 n4 strict gpu" >&2
    exit 2
  fi
done
failed=()
timed=()     # "SECONDS  JOB", one a job, for the summary

junit() {   # junit NAME: pytest's option writing this job's XML, when times are kept
  if [[ -n "$times_dir" ]]; then echo "--junitxml=$times_dir/$1.xml"; fi
}

note_load() {   # note_load NAME: the load average as job NAME ends, beside its XML
  if [[ -n "$times_dir" ]]; then
    echo "$1 $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || true)" >> "$times_dir/load.txt"
  fi
}

finish_job() {   # finish_job NAME RC START [ARGS...]: record the job's time and its failure
  local name="$1" rc="$2" start="$3"
  shift 3
  # Exit 5 (no test collected) is a failure unless the caller's own -k or -m chose none here.
  if [[ $rc -eq 5 && $# -gt 0 ]]; then rc=0; fi
  timed+=("$(printf '%5d s  %s' $(( $(date +%s) - start )) "$name")")
  if [[ $rc -ne 0 ]]; then failed+=("$name (exit $rc)"); fi
}

if [[ "$parts" == *" serial "* ]]; then
  echo "== serial tests"
  workers=${PIPEFLOW_TEST_WORKERS:-2}
  spread=()
  # The files longest first (tests/README.md's times), each whole on one worker.
  mapfile -t order < <(python tests/timings.py --longest-first)
  if [[ "$workers" -gt 1 ]]; then
    spread=(-n "$workers" --dist loadfile --no-loadscope-reorder)
  fi
  start=$(date +%s) rc=0
  # shellcheck disable=SC2046   # junit's option is one word or none
  python -m pytest -q -p no:cacheprovider -m "not mpi" "${spread[@]}" $(junit serial) \
    "${order[@]}" "$@" || rc=$?
  finish_job "serial (pytest -n $workers)" "$rc" "$start" "$@"
  note_load serial
fi

# The multi-rank tests. `--capture=sys` leaves the ranks' own stderr alone: a watchdog's or an
# abort's report ends the job and must reach the log, which pytest's default fd capture would
# swallow with the process. The files share a few mpirun jobs per rank count, each job about
# a minute on 2 cores (every job pays about 4 s of start-up: Python, torch, MPI and
# collection): the engine's file alone, then families that share their imports and fixtures
# (data parallelism, Hugging Face, recomputation/compile/trainer, the tensor axis), then every other file in
# one job, a new file included. A failure in a shared job is named by its test id; an abort or
# a hang (ended by the watchdog or the test's timeout) ends that job only, the others still
# run, the report names the test that job had begun last (conftest.py writes it to
# PIPEFLOW_TEST_CURRENT), and the files it never reached run in a job of their own. No job
# runs every file: the whole 4-rank suite in one job took 14 min on 2 cores (Nov 2026,
# before `wait = "auto"`).
mapfile -t MPI_FILES < <(grep -l "mark.mpi" tests/test_*.py)
FAMILIES=("test_engine_mpi"
        "test_data_parallel_mpi test_shard_mpi test_collective_order_mpi"
        "test_hf_mpi test_hf_cli_mpi test_generate_mpi"
        "test_recompute_mpi test_compile_mpi test_trainer_mpi"
        "test_tensor_mpi test_tensor_hf_dense_mpi test_tensor_hf_fused_mpi test_tensor_hf_moe_mpi test_tensor_hub_mpi
         test_generate_tensor_mpi")
JOBS=()      # one entry a job: its files, space-separated
grouped=" ${FAMILIES[*]} "
for group in "${FAMILIES[@]}"; do
  files=()
  for base in $group; do
    if [[ ! -f tests/$base.py ]]; then
      echo "run_all.sh: FAMILIES names tests/$base.py, which is not there: update FAMILIES" >&2
      exit 2
    fi
    files+=("tests/$base.py")
  done
  JOBS+=("${files[*]}")
done
small=()
for f in "${MPI_FILES[@]}"; do
  if [[ "$grouped" != *" $(basename "$f" .py) "* ]]; then small+=("$f"); fi
done
if [[ ${#small[@]} -gt 0 ]]; then JOBS+=("${small[*]}"); fi
current=$(mktemp "${TMPDIR:-/tmp}/pipeflow-current.XXXXXX")
trap 'rm -f "$current"' EXIT

not_reached() {   # not_reached "FILES" LAST: the files after LAST's file in FILES
  local f rest=() reached=1
  for f in $1; do
    if [[ $reached -eq 0 ]]; then rest+=("$f"); fi
    if [[ "$f" == "${2%%::*}" ]]; then reached=0; fi
  done
  echo "${rest[*]}"
}

run_job() {   # run_job N "FILES" [pytest args]: one mpirun job; a failure is recorded
  local n="$1" files="$2" rc=0 name start label last rest
  shift 2
  name="${PIPEFLOW_STRICT_COMM:+strict-}n$n-$(basename "${files%% *}" .py)"
  label="${PIPEFLOW_STRICT_COMM:+strict }mpirun -n $n $files"
  start=$(date +%s)
  : > "$current"
  # shellcheck disable=SC2046,SC2086   # FILES is a list of paths without spaces
  PIPEFLOW_TEST_CURRENT="$current" timeout -k 15 900 "$MPIRUN" $OVERSUB -n "$n" \
    python -m pytest -q -p no:cacheprovider --capture=sys --with-mpi -m "mpi and not gpu" \
    $(junit "$name") $files "$@" || rc=$?
  # A job that ran to its end names its failures itself (pytest's summary); one that ended
  # early (an abort, the watchdog, a test's timeout, the outer timeout) is named here by the
  # test it had begun last, and the files it never reached run in a job of their own.
  last=$(cat "$current") rest=""
  if [[ $rc -ne 0 && "$last" != ":finished" ]]; then
    label+=" [ended in ${last:-its start-up, before any test}]"
    if [[ -n "$last" ]]; then rest=$(not_reached "$files" "$last"); fi
  fi
  finish_job "$label" "$rc" "$start" "$@"
  note_load "$name"
  if [[ -n "$rest" ]]; then
    echo "-- the files that job never reached: $rest"
    run_job "$n" "$rest" "$@"
  fi
}

for n in 2 4; do
  if [[ "$parts" != *" n$n "* ]]; then continue; fi
  echo "== mpirun -n $n: ${#MPI_FILES[@]} files in ${#JOBS[@]} jobs"
  for job in "${JOBS[@]}"; do
    echo "-- $job"
    run_job "$n" "$job" "$@"
  done
done
# Strict mode: the MPI backend under NCCL's rules (synchronous sends, order-matched links,
# agreed collectives, no device synchronize in a step, one thread): the equivalence, trainer
# and checkpoint tests again, so CPU CI fails where a GPU run with NCCL would: one job on 2
# ranks, and the trainer on 4.
if [[ "$parts" == *" strict "* ]]; then
  STRICT_FILES="tests/test_engine_mpi.py tests/test_data_parallel_mpi.py \
tests/test_checkpoint_mpi.py tests/test_shard_mpi.py tests/test_collective_order_mpi.py tests/test_tensor_mpi.py \
tests/test_tensor_hf_moe_mpi.py tests/test_trainer_mpi.py"
  export PIPEFLOW_STRICT_COMM=1
  echo "== strict mode (PIPEFLOW_STRICT_COMM=1), mpirun -n 2"
  run_job 2 "$STRICT_FILES" "$@"
  echo "== strict mode (PIPEFLOW_STRICT_COMM=1), mpirun -n 4: the trainer (2x2: ties, fp16, clip)"
  run_job 4 tests/test_trainer_mpi.py "$@"
  unset PIPEFLOW_STRICT_COMM
fi
if [[ "$parts" == *" gpu "* && $# -eq 0 ]]; then
  echo "== the first GPU run's script, dry run on the CPU"
  start=$(date +%s) rc=0
  bash tests/gpu/first_run.sh --device cpu --out "${TMPDIR:-/tmp}/pipeflow-first-run.$$" \
    || rc=$?
  finish_job "tests/gpu/first_run.sh --device cpu" "$rc" "$start"
fi
echo "== wall time per job"
printf '%s\n' "${timed[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
