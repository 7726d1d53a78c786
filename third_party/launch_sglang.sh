#!/usr/bin/env bash
# Starts one real SGLang server for vcpo_jax rollouts on a GPU node (SGLang is installed there, not here).
#
# Usage: third_party/launch_sglang.sh MODEL_DIR [PORT] [-- extra sglang.launch_server flags]
# Environment (all optional):
#   HOST=0.0.0.0        bind address (SGLang's own default is 127.0.0.1: loopback only)
#   TP=1                tensor-parallel GPUs for this server (--tp-size)
#   MEM_FRACTION=0.85   --mem-fraction-static: weights + KV pool share of GPU memory
#   WEIGHT_VERSION=v0   --weight-version: MUST be "v<int>" (the client rejects SGLang's default "default")
#   SEED=0              --random-seed
#   METRICS=1           add --enable-metrics (Prometheus /metrics)
#   PYTHON=python3      interpreter that has sglang installed
# Every flag below was checked against sgl-project/sglang python/sglang/srt/server_args.py (see README.md).
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,12p' "$0"
  exit 2
fi
MODEL_DIR="$1"; shift
PORT="${1:-30000}"; [[ $# -gt 0 ]] && shift
[[ "${1:-}" == "--" ]] && shift

if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  echo "launch_sglang.sh: MODEL_DIR=$MODEL_DIR has no config.json (export one with vcpo_jax.hf.export_hf)" >&2
  exit 2
fi
if [[ ! "${WEIGHT_VERSION:-v0}" =~ ^v[0-9]+$ ]]; then
  echo "launch_sglang.sh: WEIGHT_VERSION=${WEIGHT_VERSION} must look like v<int> (e.g. v0)" >&2
  exit 2
fi

args=(
  --model-path "$MODEL_DIR"
  --host "${HOST:-0.0.0.0}"
  --port "$PORT"
  --tp-size "${TP:-1}"
  --mem-fraction-static "${MEM_FRACTION:-0.85}"
  --weight-version "${WEIGHT_VERSION:-v0}"
  --random-seed "${SEED:-0}"
)
[[ "${METRICS:-0}" == "1" ]] && args+=(--enable-metrics)

echo "+ ${PYTHON:-python3} -m sglang.launch_server ${args[*]} $*" >&2
exec "${PYTHON:-python3}" -m sglang.launch_server "${args[@]}" "$@"
