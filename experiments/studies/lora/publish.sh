#!/usr/bin/env bash
# Archives the LoRA study's finished units into the repository and regenerates its page from them; writes the
# machine time of its runs (machine_time.json keeps earlier roots' rows). Run from the repository root whose docs
# should change (not the study's clean clone):
#   experiments/studies/lora/publish.sh ROOT          env: PY (python)
set -eu
ROOT=${1:?usage: publish.sh ROOT}
OUT=docs/results/lora
source experiments/studies/archive_and_time.sh  # PY, the units, the machine time
"$PY" -m experiments.studies.lora.page "$OUT/units" --out "$OUT" --machine_time "$OUT/machine_time.md"
