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
PY=${PY:-python}
PARALLEL=${PARALLEL:-2}
FIRST_SEED=${FIRST_SEED:-0}
CONFIG=experiments/studies/claims/config.py
SWEEP=experiments/studies/lora/sweep.py
PILOT_LRS=0.0005+0.002+0.008   # sweep.PILOT_LRS
mkdir -p "$ROOT"
# With the kernel's autogroup scheduling, `nice` ranks processes only within their session: a study started
# under setsid would still take half the cores from the work beside it. Lower the session's weight as well.
{ echo 19 > /proc/self/autogroup; } 2>/dev/null || true
launch() {  # one part of the sweep; units of every part share the root's cached warm starts
  echo "== $(date -u +%FT%TZ) launch $1"
  nice -n 19 "$PY" -m experiments.launch --config="$CONFIG" --sweep="$SWEEP:$1,first_seed=$FIRST_SEED" \
    --root="$ROOT" --parallel="$PARALLEL" --warm_starts_from="$ROOT"
  code=$?  # 130: stopped (units interrupted): stop here rather than pick from an unfinished pilot
  if [ "$code" = 130 ] || [ "$code" = 2 ]; then echo "launch stopped or refused (exit $code)"; exit "$code"; fi
}
PICK=${PICK:-}
PICKED="$ROOT/pilot_pick.txt"  # the pick, once made, stands: a relaunch (e.g. after a main unit failed) keeps it
if [ -z "$PICK" ] && [ -s "$PICKED" ]; then PICK=$(cat "$PICKED"); fi
if [ -z "$PICK" ]; then
  launch part=pilot
  out=$("$PY" -m experiments.studies.lora.pilot "$ROOT"); code=$?
  if [ "$code" = 3 ]; then  # an edge pick: the lr grid once extended beyond it (every rank), then the pick stands
    launch "part=pilot,lrs=$PILOT_LRS+${out#extend }"
    out=$("$PY" -m experiments.studies.lora.pilot "$ROOT"); code=$?  # 4 lrs > the 3 planned: extended
  fi
  if [ "$code" != 0 ]; then
    echo "no pilot run qualifies ($out): the study stops here (README.md: the pilot's rule)"; exit 1
  fi
  PICK=$out
  echo "$PICK" > "$PICKED"
fi
echo "== pilot pick: $PICK"
launch "part=main,$PICK"
echo "== $(date -u +%FT%TZ) done"
