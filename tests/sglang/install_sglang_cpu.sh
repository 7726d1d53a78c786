#!/usr/bin/env bash
# Installs SGLang 0.5.23 with its CPU engine into a cached venv (no GPU, no CUDA packages); prints the venv path.
#
# Usage: tests/sglang/install_sglang_cpu.sh          (idempotent: a finished install is reused)
# Environment: SGLANG_CPU_HOME=~/.cache/vcpo_jax/sglang-cpu   where the venv lives
#              PYTHON=python3.11                               interpreter for the venv (3.11: the torch wheel is cp311)
# Takes about 3 minutes on 2 cores the first time. Only for tests and CPU experiments: on GPU nodes install SGLang
# with its own instructions. Why each step is needed is said beside it.
set -euo pipefail

HOME_DIR="${SGLANG_CPU_HOME:-$HOME/.cache/vcpo_jax/sglang-cpu}"
V="$HOME_DIR/venv"
SGLANG_VERSION=0.5.23
STAMP="$V/.vcpo-sglang-$SGLANG_VERSION"
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

# CPU-only torch has no pinned memory, which SGLang's LoRA asks for (sglang#31894): a start-up patch makes pinning a
# no-op in CPU-engine processes (see its docstring). Refreshed on every run, so that an existing install gets it.
install_cpu_patches() {
  local site
  site="$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp "$HERE/sglang_cpu_patch/vcpo_sglang_cpu_pin.py" "$HERE/sglang_cpu_patch/vcpo_sglang_cpu_pin.pth" "$site/"
}

if [[ -f "$STAMP" ]]; then
  install_cpu_patches
  echo "$V"
  exit 0
fi
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "install_sglang_cpu.sh: PYTHON=$PY is not Python 3.11 (the CPU torch wheel is cp311)" >&2
  exit 2
fi
mkdir -p "$HOME_DIR"
rm -rf "$V"
"$PY" -m venv "$V"
pip=("$V/bin/python" -m pip install -q)
"${pip[@]}" -U pip

# torch first, pinned to the CPU build, so that nothing below can pull a CUDA torch.
"${pip[@]}" "torch==2.13.0"
echo "torch==2.13.0" > "$HOME_DIR/constraints.txt"

# sglang without its declared dependencies: they pin a newer torch and CUDA-only wheels (flashinfer, sglang-kernel).
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION"

# What the HTTP server, tokenizer manager and scheduler import at start-up, with the versions 0.5.23 declares.
"${pip[@]}" -c "$HOME_DIR/constraints.txt" \
  aiohttp anthropic "blobfile==3.0.0" build "compressed-tensors==0.18.0" datasets distro easydict einops fastapi \
  gguf interegular IPython "llguidance>=1.7.6,<2" "mistral_common>=1.11.5" msgspec ninja "numba==0.65.1" numpy \
  nvidia-ml-py "openai==2.8.0" "openai-harmony==0.0.4" orjson packaging partial_json_parser pillow \
  "prometheus-client>=0.20.0" psutil pybase64 pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex \
  requests scipy "sentencepiece==0.2.1" setproctitle "soundfile==0.13.1" tiktoken "tokenizers==0.23.2" tqdm \
  "transformers==5.19.0" "uvicorn>=0.51" uvloop watchfiles "xgrammar==0.2.7" xxhash zstandard \
  "apache-tvm-ffi==0.1.11" modelscope

# torchvision is imported via transformers' image processors; 0.28.0 exists only as a CUDA build whose _C.so cannot
# load here. Its module-level fake-op registrations then raise at import: register them only when the ops loaded.
"${pip[@]}" --no-deps "torchvision==0.28.0"
META="$("$V/bin/python" -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py"
sed -i 's/^@torch.library.register_fake("torchvision::\([a-z_]*\)")/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$META"

# sgl_kernel: the compiled CPU kernels are not on PyPI; our stub (see its docstring) goes into site-packages.
SITE="$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$SITE/sgl_kernel"
cp -r "$REPO/third_party/sgl_kernel_stub/sgl_kernel" "$SITE/sgl_kernel"

install_cpu_patches
SGLANG_USE_CPU_ENGINE=1 "$V/bin/python" -c 'import sglang.launch_server' >/dev/null
touch "$STAMP"
echo "$V"
