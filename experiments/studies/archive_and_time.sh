# What the studies' publish.sh scripts share (sourced, from the repository root; the sourcing script sets ROOT and
# OUT, PY comes from the environment): archive ROOT's finished units into OUT/units and write the machine time of
# the study's runs to OUT/machine_time.md (OUT/machine_time.json keeps the rows of earlier roots).
set -o pipefail  # a failing machine_time fails the publish, tee or not
PY=${PY:-python}
"$PY" -m experiments.launch.archive save "$ROOT" "$OUT/units"
"$PY" -m experiments.launch.machine_time "$ROOT" --ledger "$OUT/machine_time.json" | tee "$OUT/machine_time.md"
