#!/usr/bin/env bash
# Archives the dynamic-sampling study's finished units into the repository, writes the machine time of its runs
# (machine_time.json keeps earlier roots' rows) and regenerates its page from the archived units. Run from the
# repository root whose docs should change (not the study's clean clone):
#   experiments/studies/dynamic_sampling/publish.sh ROOT          env: PY (python)
set -eu
ROOT=${1:?usage: publish.sh ROOT}
PY=${PY:-python}
OUT=docs/results/dynamic_sampling
"$PY" -m experiments.launch.archive save "$ROOT" "$OUT/units"
"$PY" -m experiments.launch.machine_time "$ROOT" --ledger "$OUT/machine_time.json" | tee "$OUT/machine_time.md"
"$PY" -m experiments.studies.dynamic_sampling.page "$OUT/units" --out "$OUT" --machine_time "$OUT/machine_time.md"
