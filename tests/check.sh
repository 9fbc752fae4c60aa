#!/usr/bin/env bash
# `make check`: the quick tier, at most 3 minutes on 2 cores, for use before each commit. It
# touches every module of the package: equivalence with one process on one grid per schedule
# family (2 ranks, uniform split), data parallelism plain and sharded with unrouted experts, the
# tensor axis at t2 (with and without sequence parallelism) and its refusals,
# strict mode's refusals, the planner, the CLI and a hostile row per class of error, with the
# sweeps marked `slow` (whole schedule grids, the planner against full simulations) left to
# `make test` (tests/run_all.sh), the whole suite, which CI runs.
#
#   bash tests/check.sh [--modules] [pytest args]
#
# --modules also lists the package's modules none of the tier's functions ran in (a profiler
# in each test process, conftest.py's PIPEFLOW_TEST_TOUCHED: slower) and fails if there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/mpi_env.sh
touched=""
if [[ "${1:-}" == "--modules" ]]; then
  shift
  touched=$(mktemp -d "${TMPDIR:-/tmp}/pipeflow-touched.XXXXXX")
  export PIPEFLOW_TEST_TOUCHED="$touched"
fi
start=$(date +%s)
failed=()
echo "== check: serial (pytest -n 2)"
python -m pytest -q -p no:cacheprovider -m "not mpi and not slow" -n 2 --dist loadfile "$@" \
  tests/test_engine.py tests/test_cli.py tests/test_layout.py tests/test_gpu_checks.py \
  tests/test_zero_bubble.py tests/test_partition.py tests/test_precision.py \
  tests/test_figures.py tests/test_recipe.py tests/test_hostile.py tests/test_planner.py \
  tests/test_schedule.py tests/test_v_schedules.py tests/test_data.py tests/test_logs.py \
  tests/test_checkpoint.py tests/test_recompute.py tests/test_auto_schedule.py \
  tests/test_gpt.py tests/test_layers_rng.py tests/test_waiting.py tests/test_comm.py \
  tests/test_hostmem.py tests/test_planner_calibrate.py tests/test_grid.py \
  "tests/test_hf.py::test_logits_match_transformers[llama-none]" \
  "tests/test_hf.py::test_logits_match_transformers[mixtral-none]" \
  "tests/test_hf.py::test_state_dict_round_trip_and_ties[llama-False]" \
  "tests/test_hf_cli.py::test_pretrained_run_starts_from_the_folder_and_exports_what_it_trained" \
  tests/test_prepare.py::test_a_large_text_file_in_blocks_tokenizes_as_a_whole \
  tests/test_sample.py::test_sample_continues_a_checkpoint_like_build_sequential \
  -k "not time_partition and not watchdog_allows" || failed+=("serial")
echo "== check: mpirun -n 2"
timeout -k 10 150 "$MPIRUN" $OVERSUB -n 2 python -m pytest -q -p no:cacheprovider \
  --capture=sys --with-mpi -m "mpi and not gpu and not slow" "$@" \
  tests/test_engine_mpi.py tests/test_collective_order_mpi.py tests/test_strict_mpi.py \
  tests/test_shard_mpi.py tests/test_data_parallel_mpi.py tests/test_aux_loss_mpi.py \
  tests/test_generate_mpi.py tests/test_tensor_mpi.py \
  -k "(tensor_grid and untied and sgd) or refused_on_every_rank or (pipeline_trains and uniform) or (unrouted and 1f1b) or equal_size \
      or (sharded_trains and 1f1b) or (grid_trains and 1f1b and untied and noclip) \
      or different_grid or aux or greedy" || failed+=("mpirun -n 2")
echo "== check: done in $(( $(date +%s) - start )) s"
if [[ -n "$touched" ]]; then
  python - "$touched" <<'EOF' || failed+=("--modules")
"""Each module with a function must have run one, the others (an __init__) been imported;
__main__.py runs only under `python -m` (its whole body is a call of the CLI's main)."""
import ast, pathlib, sys

seen = {tuple(line.split(" ", 1)) for f in pathlib.Path(sys.argv[1]).glob("touched.*.txt")
        for line in f.read_text().splitlines()}
never = []
for path in sorted(pathlib.Path("pipeflow").rglob("*.py")):
    if path.name == "__main__.py":
        continue
    has_def = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(ast.parse(path.read_text())))
    if ("ran" if has_def else "imported", str(path)) not in seen:
        never.append(f"{path} ({'no function of it ran' if has_def else 'never imported'})")
print("\n".join(f"not touched by the check tier: {n}" for n in never) or
      "== check: every module of pipeflow/ touched", file=sys.stderr if never else sys.stdout)
sys.exit(1 if never else 0)
EOF
  rm -rf "$touched"
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
