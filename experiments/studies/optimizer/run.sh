#!/usr/bin/env bash
# The optimizer study in its pre-registered order (docs/results/optimizer/README.md): the lr pilot, its pick
# (the grid extended once if the pick is at an edge), tier 1 (SGD: sync, ESS-only, VCPO) at the picked lr, then
# tier 2 (OPOB-only under AdamW). Resumable: rerun the same command; finished units are skipped, unfinished ones
# resume from their checkpoints. Run it from a clean clone at a fixed commit (the commit is in every unit.json).
#   experiments/studies/optimizer/run.sh ROOT      env: PY (python), PARALLEL (2), FIRST_SEED (0), LR (skip the pilot)
set -u
cd "$(dirname "$0")/../../.."
ROOT=${1:?usage: run.sh ROOT}
PY=${PY:-python}
PARALLEL=${PARALLEL:-2}
FIRST_SEED=${FIRST_SEED:-0}
CONFIG=experiments/studies/claims/config.py:trace
SWEEP=experiments/studies/optimizer/sweep.py
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
LR=${LR:-}
PICKED="$ROOT/pilot_lr.txt"  # the pick, once made, stands: a relaunch (e.g. after a pilot unit failed) keeps it
if [ -z "$LR" ] && [ -s "$PICKED" ]; then LR=$(cat "$PICKED"); fi
if [ -z "$LR" ]; then
  launch part=pilot
  out=$("$PY" -m experiments.studies.optimizer.pilot "$ROOT"); code=$?
  if [ "$code" = 3 ]; then  # an edge pick: the grid once extended beyond it, then the pick stands
    extra=${out#extend }
    launch "part=pilot,lrs=0.01+0.03+0.1+0.3+$extra"
    out=$("$PY" -m experiments.studies.optimizer.pilot "$ROOT"); code=$?  # 5 runs > the 4 planned: extended
  fi
  if [ "$code" != 0 ]; then
    echo "no pilot lr qualifies ($out): the study stops here (README.md: the pilot's rule)"; exit 1
  fi
  LR=${out#lr }
  echo "$LR" > "$PICKED"
fi
echo "== pilot lr: $LR"
launch "part=sgd,lr=$LR"
launch part=opob_only
echo "== $(date -u +%FT%TZ) done"
