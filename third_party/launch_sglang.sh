#!/usr/bin/env bash
# Starts one real SGLang server for vcpo_jax rollouts (a GPU node, or this CPU box with DEVICE=cpu).
#
# Usage: third_party/launch_sglang.sh MODEL_DIR [PORT] [-- extra sglang.launch_server flags]
# Environment (all optional):
#   HOST=0.0.0.0        bind address (SGLang's own default is 127.0.0.1: loopback only)
#   TP=1                tensor-parallel GPUs for this server (--tp-size)
#   MEM_FRACTION=0.85   --mem-fraction-static: weights + KV pool share of GPU memory (cpu: of host memory, default 0.05)
#   WEIGHT_VERSION=v0   --weight-version: MUST be "v<int>" (the client rejects SGLang's default "default")
#   SEED=0              --random-seed
#   DTYPE=auto          --dtype (float32 for log-prob checks against the learner; CPU default float32)
#   RADIX_CACHE=1       0 adds --disable-radix-cache (needed only for in-place weight updates, docs/sglang.md)
#   METRICS=1           add --enable-metrics (Prometheus /metrics)
#   DEVICE=cuda         cpu: SGLang's CPU engine (tests/sglang/install_sglang_cpu.sh installs it)
#   PYTHON=python3      interpreter that has sglang installed
# Always set: SGLANG_RETURN_ORIGINAL_LOGPROB=1, so log-probs are the raw model's at any temperature (the
# learner's); without it SGLang returns log_softmax(logits / T). The client checks which it gets.
# Every flag below was checked against sgl-project/sglang python/sglang/srt/server_args.py (see README.md).
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,18p' "$0"
  exit 2
fi
MODEL_DIR="$1"; shift
PORT="${1:-30000}"; [[ $# -gt 0 ]] && shift
[[ "${1:-}" == "--" ]] && shift

if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  echo "launch_sglang.sh: MODEL_DIR=$MODEL_DIR has no config.json (the job's starting weights are" \
       "WORKDIR/base: see docs/sglang.md)" >&2
  exit 2
fi
if [[ ! "${WEIGHT_VERSION:-v0}" =~ ^v[0-9]+$ ]]; then
  echo "launch_sglang.sh: WEIGHT_VERSION=${WEIGHT_VERSION} must look like v<int> (e.g. v0)" >&2
  exit 2
fi

export SGLANG_RETURN_ORIGINAL_LOGPROB=1
args=(
  --model-path "$MODEL_DIR"
  --host "${HOST:-0.0.0.0}"
  --port "$PORT"
  --weight-version "${WEIGHT_VERSION:-v0}"
  --random-seed "${SEED:-0}"
)
if [[ "${DEVICE:-cuda}" == "cpu" ]]; then
  # CPU engine: torch attention and sampling (the compiled CPU kernels are not on PyPI), no CUDA graphs, a
  # small KV pool (--max-total-tokens, in tokens). --mem-fraction-static is then the share of host memory the
  # weights and that pool may take: 0.05 fits the tiny test models; a 0.5B float32 model needs MEM_FRACTION=0.2.
  export SGLANG_USE_CPU_ENGINE=1
  args+=(--device cpu --attention-backend torch_native --sampling-backend pytorch --disable-cuda-graph
         --dtype "${DTYPE:-float32}" --max-total-tokens "${MAX_TOTAL_TOKENS:-16384}"
         --mem-fraction-static "${MEM_FRACTION:-0.05}" --max-running-requests "${MAX_RUNNING:-128}" --chunked-prefill-size 512)
else
  args+=(--tp-size "${TP:-1}" --mem-fraction-static "${MEM_FRACTION:-0.85}" --dtype "${DTYPE:-auto}")
fi
# LoRA on the CPU engine: only the torch_native LoRA backend runs without triton (the default csgmv needs a GPU).
if [[ "${DEVICE:-cuda}" == "cpu" && " $* " == *" --enable-lora "* && " $* " != *" --lora-backend "* ]]; then
  args+=(--lora-backend torch_native)
fi
[[ "${RADIX_CACHE:-1}" == "0" ]] && args+=(--disable-radix-cache)
[[ "${METRICS:-0}" == "1" ]] && args+=(--enable-metrics)

echo "+ ${PYTHON:-python3} -m sglang.launch_server ${args[*]} $*" >&2
exec "${PYTHON:-python3}" -m sglang.launch_server "${args[@]}" "$@"
