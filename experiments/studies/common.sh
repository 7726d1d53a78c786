# What the studies' run.sh scripts share (sourced, from the repository root): the session's CPU weight, `launch`
# and the pilot's pick. The sourcing script sets ROOT, CONFIG and SWEEP; PY, PARALLEL and FIRST_SEED come from the
# environment.
PY=${PY:-python}
PARALLEL=${PARALLEL:-2}
FIRST_SEED=${FIRST_SEED:-0}
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
# pilot_pick FILE MODULE GRID NOUN [PREFIX]: sets PICK. A PICK already set (the environment's) stands, else the
# one stored in FILE (once made, a pick stands: a relaunch, e.g. after a unit failed, keeps it), else the pilot
# part runs and MODULE picks (PREFIX cut from its answer), once extending the lr grid GRID at an edge pick.
pilot_pick() {
  if [ -z "$PICK" ] && [ -s "$1" ]; then PICK=$(cat "$1"); fi
  if [ -n "$PICK" ]; then return; fi
  launch part=pilot
  out=$("$PY" -m "$2" "$ROOT"); code=$?
  if [ "$code" = 3 ]; then  # an edge pick: the lr grid once extended beyond it, then the pick stands
    launch "part=pilot,lrs=$3+${out#extend }"
    out=$("$PY" -m "$2" "$ROOT"); code=$?  # more lrs than planned: extended
  fi
  if [ "$code" != 0 ]; then
    echo "no pilot $4 qualifies ($out): the study stops here (README.md: the pilot's rule)"; exit 1
  fi
  PICK=${out#"${5:-}"}
  echo "$PICK" > "$1"
}
