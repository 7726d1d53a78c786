"""Test setup: 8 fake CPU devices (set before jax initialises) and strict numerics guard rails."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def skip_if_not_enough_devices(n: int):
  return pytest.mark.skipif(len(jax.devices()) < n, reason=f"needs {n} devices")
