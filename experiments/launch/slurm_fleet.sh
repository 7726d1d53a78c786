#!/bin/bash
# The whole fleet as ONE heterogeneous Slurm job: learner nodes (het group 0) and rollout-server nodes (het
# group 1); docs/multihost.md. Written for Slurm + CUDA 12 nodes and NOT run on a cluster here: what is
# tested is its dry mode (tests/test_fleet.py), which prints every srun step's command and environment.
#
#   sbatch experiments/launch/slurm_fleet.sh [-- --config.rl.steps=60 ...]
#   WORKDIR=/shared/run SHARED_WORKDIR=1 sbatch experiments/launch/slurm_fleet.sh     # weights on disk
#   DRY_RUN=1 SLURM_JOB_NODELIST_HET_GROUP_0=l[1-2] SLURM_JOB_NODELIST_HET_GROUP_1=r1 \
#     bash experiments/launch/slurm_fleet.sh                                          # print, start nothing
#
# Settings (CONFIG, WORKDIR, ENGINE, SERVER_PORT, SERVERS_PER_NODE, MIN_SERVERS, SHARED_WORKDIR, SERVER_MODEL,
# PYTHON) are listed in experiments/launch/slurm_fleet.py. Servers on other nodes than the learner's process
# 0 read each version from WORKDIR/weights: the launch refuses unless SHARED_WORKDIR=1 or the config sends
# the weights over the wire (rollout.publish=wire). Change the node counts and resources below to yours.
#SBATCH --job-name=vcpo-fleet
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH hetjob
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}"
exec "${PYTHON:-.venv/bin/python}" -m experiments.launch.slurm_fleet "$@"
