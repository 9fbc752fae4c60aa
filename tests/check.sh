#!/usr/bin/env bash
# `make check`: the quick tier, at most 3 minutes on 2 cores, for use before each commit. It
# touches every part of the engine once: equivalence with one process on one grid per
# schedule family (2 ranks, uniform split, micro-batches 4), data parallelism plain and sharded
# with unrouted experts, strict mode's refusals, the planner, the CLI and a hostile row per
# class of error. `make test` (tests/run_all.sh) is the whole suite, which CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/mpi_env.sh
start=$(date +%s)
echo "== check: serial"
python -m pytest -q -p no:cacheprovider -m "not mpi" "$@" \
  tests/test_engine.py tests/test_cli.py tests/test_layout.py tests/test_gpu_checks.py \
  tests/test_zero_bubble.py tests/test_partition.py tests/test_precision.py \
  tests/test_figures.py tests/test_recipe.py \
  tests/test_hostile.py tests/test_planner.py tests/test_schedule.py tests/test_v_schedules.py \
  -k "not time_partition and not watchdog_allows and not slow"
echo "== check: mpirun -n 2"
timeout -k 10 150 "$MPIRUN" $OVERSUB -n 2 python -m pytest -q -p no:cacheprovider \
  --capture=sys --with-mpi -m "mpi and not gpu" "$@" \
  tests/test_engine_mpi.py tests/test_collective_order_mpi.py tests/test_strict_mpi.py \
  tests/test_shard_mpi.py tests/test_data_parallel_mpi.py tests/test_aux_loss_mpi.py \
  tests/test_generate_mpi.py \
  -k "(pipeline_trains and uniform) or (unrouted and 1f1b) or equal_size \
      or (sharded_trains and 1f1b) or (grid_trains and 1f1b and untied and noclip) \
      or different_grid or aux or greedy"
echo "== check: done in $(( $(date +%s) - start )) s"
