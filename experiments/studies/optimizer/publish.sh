#!/usr/bin/env bash
# Archives the optimizer study's finished units into the repository and regenerates its page from them (and the
# horizon study's archived units); prints the machine time of its runs (machine_time.json keeps earlier roots'
# rows). Run from the repository root whose docs should change (not the study's clean clone):
#   experiments/studies/optimizer/publish.sh ROOT          env: PY (python)
set -eu
ROOT=${1:?usage: publish.sh ROOT}
OUT=docs/results/optimizer
source experiments/studies/archive_and_time.sh  # PY, the units, the machine time
"$PY" -m experiments.studies.optimizer.results "$OUT/units" --horizon docs/results/horizon/units --out "$OUT"
