#!/usr/bin/env bash
# The LoRA study in its pre-registered order (docs/results/lora/README.md): the pilot over lr x rank, its pick
# (the lr grid extended once if the pick is at an edge), then full fine-tuning vs LoRA at the pick, seed-major.
# Resumable: rerun the same command; finished units are skipped, unfinished ones resume from their checkpoints.
# Run it from a clean clone at a fixed commit (the commit is in every unit.json).
#   experiments/studies/lora/run.sh ROOT      env: PY (python), PARALLEL (2), FIRST_SEED (0), PICK (lr=..,rank=..:
#                                             skip the pilot)
set -u
cd "$(dirname "$0")/../../.."
ROOT=${1:?usage: run.sh ROOT}
CONFIG=experiments/studies/claims/config.py
SWEEP=experiments/studies/lora/sweep.py
PILOT_LRS=0.0005+0.002+0.008   # sweep.PILOT_LRS
source experiments/studies/common.sh  # launch, pilot_pick
PICK=${PICK:-}
pilot_pick "$ROOT/pilot_pick.txt" experiments.studies.lora.pilot "$PILOT_LRS" run  # every rank's grid extended
echo "== pilot pick: $PICK"
launch "part=main,$PICK"
echo "== $(date -u +%FT%TZ) done"
