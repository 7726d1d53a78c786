# Quick start: `make train` and `make test` each create .venv if missing, install, and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= workdir/countdown
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one per core on the 2-core CI machine; PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
BENCH_ARGS ?=

.PHONY: train test test-extra test-slurm test-fast test-sglang bench install-gpu gpu-wheels gpu-check gpu-check-unit gpu-check-dry reproduce-quick clean-venv docs \
  aot-gpu aot-gpu-levers aot-tpu test-aot gpu-sweep gpu-sweep-dry

# --no-compile: Python writes the bytecode of what is imported on first import; compiling every file of every
# wheel at install took half of the install (`pip install -q [--no-compile] -r requirements.txt`, then
# requirements-dev.txt, in fresh venvs with a warm pip cache on 2 cores: 38 s -> 19 s and 65 s -> 32 s).
PIP_INSTALL := $(PY) -m pip install -q --no-compile

$(VENV)/.runtime: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP_INSTALL) -r requirements.txt
	$(PIP_INSTALL) --no-deps -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PIP_INSTALL) -r requirements-dev.txt
	touch $@

# On a CUDA 12 machine: `make install-gpu train`; adds the CUDA plugin (and CUDA wheels) to the pinned jax.
install-gpu: $(VENV)/.runtime requirements-gpu.txt
	$(PIP_INSTALL) -r requirements-gpu.txt

train: $(VENV)/.runtime
	$(PY) -m vcpo_jax.main --config=configs/countdown.py --workdir=$(WORKDIR)

test: $(VENV)/.dev
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS) tests

# The extra tier: tests marked `extra` (the dry GPU check end to end, the Slurm launch on a real Slurm; ~5 min), which `make test` skips and CI runs
# after it (.ci/run).
test-extra: $(VENV)/.dev
	VCPO_TEST_EXTRA=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) -m extra $(PYTEST_ARGS) tests

# The Slurm launch on a real Slurm (tests/test_slurm_fleet.py, ~3 min; docs/multihost.md): a two-node cluster
# on this machine. Opt-in (not in CI: it installs system packages and starts root daemons). Needs root; installs
# Debian's slurm-wlm and munge first where they are missing; skipped with the reason where it cannot run.
test-slurm: $(VENV)/.dev
	VCPO_TEST_EXTRA=1 VCPO_TEST_SLURM=1 VCPO_TEST_SLURM_INSTALL=1 $(PY) -m pytest -q -rs -n 0 $(PYTEST_ARGS) tests/test_slurm_fleet.py

# The unit tier: no job processes, no servers (tests marked slow or integration are left out; conftest.py
# fails a unit test that starts a process or a server).
test-fast: $(VENV)/.dev
	VCPO_TEST_TIER=unit $(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not slow and not integration" $(PYTEST_ARGS) tests

# Opt-in, not part of `make test` or CI: real SGLang 0.5.23 servers on CPU (installs a cached venv under
# ~/.cache/vcpo_jax/sglang-cpu the first time, ~5 min; the suite then takes ~27 min on 2 busy cores).
test-sglang: $(VENV)/.dev
	tests/sglang/install_sglang_cpu.sh
	SGLANG_PYTHON="$$(tests/sglang/install_sglang_cpu.sh | tail -n 1)/bin/python" VCPO_TEST_SGLANG=1 \
	  $(PY) -m pytest -q -s -m sglang $(PYTEST_ARGS) tests/sglang

# make bench MODEL=qwen2.5-0.5b|countdown|tiny (default auto: countdown on CPU, the 0.5B shape on a GPU)
bench: $(VENV)/.dev
	$(PY) -m benchmarks.cpu.run $(if $(MODEL),--model=$(MODEL)) $(BENCH_ARGS)

# The GPU check (benchmarks/gpu/gpu_check.py; docs/gpu.md): `make gpu-wheels` here (needs PyPI) downloads the wheels a
# bare GPU machine lacks (GPU_MISSING, at requirements.txt's versions where it pins them; grain's own needs
# array-record and portpicker at the versions the pins resolve to) for that machine's CPython 3.12 on x86-64;
# `make gpu-check` there (no network) installs them into a folder of their own and runs the check with the
# machine's python3 and its JAX.
GPU_WHEELS ?= .gpu_wheels
GPU_PYTHON_VERSION ?= 3.12
GPU_PYTHON ?= python3
GPU_MISSING = grain ml_collections tensorboardX math-verify latex2sympy2_extended antlr4-python3-runtime
GPU_WHEEL_PINS = $(shell grep -iE '^($(subst $() ,|,$(GPU_MISSING)))==' requirements.txt) array-record==0.8.6 \
  portpicker==1.6.0
GPU_CHECK_ARGS ?=

gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform any -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	du -ch $(GPU_WHEELS)/*.whl

gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu.gpu_check --wheels $(GPU_WHEELS) $(GPU_CHECK_ARGS)

# The check's second call: the shortened job and the unit tier on the GPU (with the first they outgrow one
# 600 s device call).
gpu-check-unit:
	$(GPU_PYTHON) -m benchmarks.gpu.gpu_check --wheels $(GPU_WHEELS) --parts env,job,unit --budget-s 410 $(GPU_CHECK_ARGS)

# The same code path on a CPU, small shapes (tests/test_gpu_check.py runs it).
gpu-check-dry: $(VENV)/.dev
	$(PY) -m benchmarks.gpu.gpu_check --dry $(GPU_CHECK_ARGS)

# The check's third call: the levers' sweep of the GRPO step (benchmarks/gpu/bench_gpu_sweep.py, <= 8 min), and its
# dry run on a CPU (tiny model, every lever; tests/test_gpu_check.py runs it).
gpu-sweep:
	$(GPU_PYTHON) -m benchmarks.gpu.gpu_check --wheels $(GPU_WHEELS) --parts env,sweep --budget-s 505 $(GPU_CHECK_ARGS)

gpu-sweep-dry: $(VENV)/.dev
	$(PY) -m benchmarks.gpu.gpu_check --dry --parts env,sweep $(GPU_CHECK_ARGS)

# Ahead-of-time compiles on this CPU machine, no accelerator (benchmarks/aot/; docs/gpu-aot.md, docs/tpu.md): each
# in a venv of its own with the pinned jax's GPU (CUDA 12 plugin, ~3 GB of NVIDIA wheels) or TPU (libtpu) build.
# AOT_ARGS adds options (e.g. AOT_ARGS="--steps grpo --variant base --variant xla:model.attention=xla").
AOT_ARGS ?=
AOT_GPU_VENV ?= .venv-aot-gpu
AOT_TPU_VENV ?= .venv-aot-tpu

$(AOT_GPU_VENV)/.installed: requirements.txt requirements-gpu.txt pyproject.toml
	test -x $(AOT_GPU_VENV)/bin/python || $(PYTHON) -m venv $(AOT_GPU_VENV)
	$(AOT_GPU_VENV)/bin/python -m pip install -q --no-compile -r requirements.txt -r requirements-gpu.txt
	$(AOT_GPU_VENV)/bin/python -m pip install -q --no-compile --no-deps -e .
	touch $@

# libtpu comes with jax[tpu] at requirements.txt's jax (PyPI wheels, ~100 MB); pytest and pytest-timeout at
# requirements-dev.txt's pins run its compile test (test-aot).
$(AOT_TPU_VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	test -x $(AOT_TPU_VENV)/bin/python || $(PYTHON) -m venv $(AOT_TPU_VENV)
	$(AOT_TPU_VENV)/bin/python -m pip install -q --no-compile -r requirements.txt \
	  "jax[tpu]==$$(sed -n 's/^jax==//p' requirements.txt)" $$(grep -E '^pytest(-timeout)?==' requirements-dev.txt)
	$(AOT_TPU_VENV)/bin/python -m pip install -q --no-compile --no-deps -e .
	touch $@

aot-gpu: $(AOT_GPU_VENV)/.installed
	JAX_PLATFORMS=cpu $(AOT_GPU_VENV)/bin/python -m benchmarks.aot.gpu $(AOT_ARGS)

# The GPU sweep's levers (benchmarks/gpu/gpu_sweep_levers.py), each compiled for the H100: benchmarks/aot/results-gpu-levers.md.
aot-gpu-levers: $(AOT_GPU_VENV)/.installed
	JAX_PLATFORMS=cpu $(AOT_GPU_VENV)/bin/python -m benchmarks.aot.levers $(AOT_ARGS)

aot-tpu: $(AOT_TPU_VENV)/.installed
	JAX_PLATFORMS=cpu $(AOT_TPU_VENV)/bin/python -m benchmarks.aot.tpu $(AOT_ARGS)

# The TPU compile test (tests/test_aot_tpu.py, ~1 compile; not in `make test`, which has no libtpu: it skips there):
# the 0.5B step compiled for a v5e 2x2 slice fits with 10% headroom. Where the TPU venv cannot be built (no
# registry, no libtpu wheel for this platform) it runs in .venv and is skipped with that reason.
test-aot: $(VENV)/.dev
	@if $(MAKE) $(AOT_TPU_VENV)/.installed; then \
	  $(AOT_TPU_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider $(PYTEST_ARGS) tests/test_aot_tpu.py; \
	else \
	  echo "test-aot: could not build $(AOT_TPU_VENV) (jax[tpu] / libtpu): the test is skipped"; \
	  $(PY) -m pytest -q -rs -n 0 $(PYTEST_ARGS) tests/test_aot_tpu.py; \
	fi

# The results pipeline end to end in <= 15 min on 2 cores (experiments/studies/claims/sweeps/quick.py: 1 seed, 3 arms,
# k in {0, 64}, shortened runs); a relaunch skips finished units. Page: $(QUICK_ROOT)/report/report.md.
QUICK_ROOT ?= workdir/quick
$(VENV)/.report: $(VENV)/.runtime pyproject.toml
	$(PIP_INSTALL) -e '.[report]'
	touch $@

reproduce-quick: $(VENV)/.report
	$(PY) -m experiments.launch --config=configs/countdown.py:emulate --sweep=experiments/studies/claims/sweeps/quick.py \
	  --root=$(QUICK_ROOT)
	$(PY) -m experiments.stats.report $(QUICK_ROOT) --out $(QUICK_ROOT)/report

# docs/configuration.md from configs/countdown.py and the registries (tests/test_docs.py checks it is current).
docs: $(VENV)/.runtime
	$(PY) -m vcpo_jax.job.config_reference

clean-venv:
	rm -rf $(VENV)
