"""Test setup: 8 fake CPU devices (set before jax initialises), strict numerics guard rails, GPU-run rules.

The suite runs on CPU unless JAX_PLATFORMS says otherwise (`JAX_PLATFORMS=cuda make test` on a GPU machine):
tests marked `cpu_only` then skip with their reason, and every float32 matmul is true float32 (on GPUs the
default is TF32), so tests that compare implementations compare like with like.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several test processes (pytest-xdist) and the servers they start may share one accelerator.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# Explicit precision for every comparison in the suite (the model's own dots also carry
# model.matmul_precision); this covers the rest (per-sequence norms, oracles, reference computations).
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  backend = jax.default_backend()
  if backend == "cpu":
    return
  for item in items:
    marker = item.get_closest_marker("cpu_only")
    if marker is not None:
      why = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "needs the CPU backend")
      item.add_marker(pytest.mark.skip(reason=f"cpu_only on {backend}: {why}"))


def skip_if_not_enough_devices(n: int):
  return pytest.mark.skipif(len(jax.devices()) < n, reason=f"needs {n} devices")
