# Sourced by the test scripts (run_all.sh, gpu/run.sh, gpu/first_run.sh): one torch thread a
# rank, the launcher, and the switches Open MPI needs (MPICH ignores them).
export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # Open MPI refuses root
# The launcher of the MPI that mpi4py was built against: a machine's own Open MPI can be
# shadowed on PATH by the `mpich` wheel's mpirun (or the other way round), and a job started by
# the other MPI's launcher runs every rank as a world of one.
pick_mpirun() {
  local want cand
  want=$(python -c "from mpi4py import MPI; v = MPI.Get_library_version(); \
print('Open MPI' if 'Open MPI' in v else 'MPICH|HYDRA' if 'MPICH' in v else '')" 2>/dev/null)
  for cand in $(which -a mpirun mpiexec 2>/dev/null); do
    if [[ -z "$want" ]] || "$cand" --version 2>&1 | grep -qEi "$want"; then
      echo "$cand"; return
    fi
  done
  echo mpirun
}
MPIRUN=${MPIRUN:-$(pick_mpirun)}
OVERSUB=""
if "$MPIRUN" --version 2>&1 | grep -q "Open MPI"; then OVERSUB="--oversubscribe"; fi

require_device() {   # require_device DEVICE SCRIPT: a CUDA device, when one is asked for
  if [[ "$1" == cuda* ]]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
      '$2: no CUDA device; use --device cpu for the dry run')"
  fi
}
