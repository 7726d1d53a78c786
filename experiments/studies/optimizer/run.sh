#!/usr/bin/env bash
# The optimizer study in its pre-registered order (docs/results/optimizer/README.md): the lr pilot, its pick
# (the grid extended once if the pick is at an edge), tier 1 (SGD: sync, ESS-only, VCPO) at the picked lr, then
# tier 2 (OPOB-only under AdamW). Resumable: rerun the same command; finished units are skipped, unfinished ones
# resume from their checkpoints. Run it from a clean clone at a fixed commit (the commit is in every unit.json).
#   experiments/studies/optimizer/run.sh ROOT      env: PY (python), PARALLEL (2), FIRST_SEED (0), LR (skip the pilot)
set -u
cd "$(dirname "$0")/../../.."
ROOT=${1:?usage: run.sh ROOT}
CONFIG=experiments/studies/claims/config.py:trace
SWEEP=experiments/studies/optimizer/sweep.py
source experiments/studies/common.sh  # launch, pilot_pick
PICK=${LR:-}
pilot_pick "$ROOT/pilot_lr.txt" experiments.studies.optimizer.pilot 0.01+0.03+0.1+0.3 lr "lr "
LR=$PICK
echo "== pilot lr: $LR"
launch "part=sgd,lr=$LR"
launch part=opob_only
echo "== $(date -u +%FT%TZ) done"
