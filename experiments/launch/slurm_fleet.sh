#!/bin/bash
# The whole fleet as ONE heterogeneous Slurm job: learner nodes (het group 0) and rollout-server nodes (het
# group 1); docs/multihost.md. tests/test_slurm_fleet.py submits it to a real two-node Slurm on one machine
# (make test-slurm); tests/test_fleet.py checks its dry mode, which prints every srun step.
#
#   sbatch experiments/launch/slurm_fleet.sh [-- --config.rl.steps=60 ...]      # the resources below
#   sbatch --nodes=4 --gpus-per-node=8 : --nodes=1 --gpus-per-node=4 --cpus-per-task=16 \
#     experiments/launch/slurm_fleet.sh [-- ...]     # each component's resources: learner : servers
#   WORKDIR=/shared/run SHARED_WORKDIR=1 sbatch experiments/launch/slurm_fleet.sh     # weights on disk
#   DRY_RUN=1 SLURM_JOB_NODELIST_HET_GROUP_0=l[1-2] SLURM_JOB_NODELIST_HET_GROUP_1=r1 \
#     bash experiments/launch/slurm_fleet.sh                                          # print, start nothing
#
# The #SBATCH lines are defaults: sbatch's options before a lone `:` override the learner component's (het
# group 0), those after it the servers' (het group 1), so nobody edits this file to fit a cluster. Settings
# (CONFIG, WORKDIR, ENGINE, SERVER_PORT, SERVERS_PER_NODE, MIN_SERVERS, SHARED_WORKDIR, SERVER_MODEL, PYTHON)
# are listed in experiments/launch/slurm_fleet.py. Servers on other nodes than the learner's process 0 read each version
# from WORKDIR/weights: the launch refuses unless SHARED_WORKDIR=1 or the config sends the weights over the
# wire (rollout.publish=wire).
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
