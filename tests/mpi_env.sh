# Sourced by the test scripts (run_all.sh, gpu/run.sh, gpu/first_run.sh): one torch thread a
# rank, the launcher, and the switches Open MPI needs (MPICH ignores them).
export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # Open MPI refuses root
MPIRUN=${MPIRUN:-mpirun}
OVERSUB=""
if "$MPIRUN" --version 2>&1 | grep -q "Open MPI"; then OVERSUB="--oversubscribe"; fi

require_device() {   # require_device DEVICE SCRIPT: a CUDA device, when one is asked for
  if [[ "$1" == cuda* ]]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
      '$2: no CUDA device; use --device cpu for the dry run')"
  fi
}
