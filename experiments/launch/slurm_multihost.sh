#!/bin/bash
# The learner as one JAX process per node under SLURM (docs/multihost.md). UNTESTED: written for SLURM +
# CUDA 12 nodes; it has not been run on a cluster (this project's runs are 2 processes on localhost, see
# tests/test_multihost.py). jax.distributed reads the SLURM environment (distributed.auto=True): process
# count and id from SLURM_NTASKS / SLURM_PROCID, the coordinator on the first node of SLURM_JOB_NODELIST.
#
#   sbatch experiments/launch/slurm_multihost.sh [--config.x=y ...]
#
# WORKDIR must be on a filesystem every node sees (checkpoints, the warm start, exported weights), and the
# rollout servers must read WORKDIR/weights at the same path: start SGLang on rollout nodes
# (third_party/launch_sglang.sh) and pass their URLs, e.g. --config.rollout.server_urls=http://r1:30000.
#SBATCH --job-name=vcpo-multihost
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
WORKDIR=${WORKDIR:-$PWD/runs/multihost-$SLURM_JOB_ID}
CONFIG=${CONFIG:-configs/countdown.py}

# --kill-on-bad-exit: a process that fails takes the step down at once (the job's own heartbeat,
# distributed.heartbeat_timeout_s, ends the others too, but slower).
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
  .venv/bin/python -m vcpo_jax.main --config="$CONFIG" --workdir="$WORKDIR" \
    --config.distributed.auto=True --config.mesh.data=-1 "$@"
