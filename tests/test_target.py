"""The compile target: the running device by default, a named one inside compiling_for, read by the auto choices."""
import dataclasses

import jax
import jax.numpy as jnp

from vcpo_jax.model import attention, config as model_config, remat
from vcpo_jax.parallel import target


def test_current_is_the_running_device_outside_compiling_for():
  t = target.current()
  assert t.platform == jax.default_backend() == "cpu"
  assert t.device_kind == jax.local_devices()[0].device_kind


def test_compiling_for_a_tpu_sets_the_remat_budget_and_nests():
  v5e = target.Target("tpu", "TPU v5 lite", target.kind_memory_bytes("TPU v5 lite"))
  h100 = target.Target("gpu", "NVIDIA H100 80GB HBM3", target.kind_memory_bytes("NVIDIA H100 80GB HBM3"))
  cfg = model_config.ModelConfig(remat="auto")
  with target.compiling_for(v5e):
    gb, source = remat.budget_gb(cfg)
    assert gb == 16 * 2**30 / 1e9 and "TPU v5 lite" in source
    with target.compiling_for(h100):
      assert remat.budget_gb(cfg)[0] == 80.0
    assert target.current() is v5e
  assert target.current().platform == "cpu"
  assert remat.budget_gb(cfg) == (remat.DEFAULT_DEVICE_GB, "default (cpu reports no memory limit)")
  assert remat.budget_gb(dataclasses.replace(cfg, remat_budget_gb=3.0)) == (3.0, "model.remat_budget_gb")


def test_cudnn_is_considered_only_for_a_gpu_target():
  q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  assert "not gpu" in attention.cudnn_unsupported(q, q)
  with target.compiling_for(target.Target("gpu", "NVIDIA H100", 80 * 10**9)):
    assert attention.cudnn_unsupported(q, q) is None
    assert "dtype" in attention.cudnn_unsupported(q.astype(jnp.float32), q)


def test_kind_table_matches_substrings_and_leaves_unknown_kinds_unknown():
  assert target.kind_memory_bytes("TPU v5p") == 95 * 2**30
  assert target.kind_memory_bytes("TPU v4") == 32 * 2**30
  assert target.kind_memory_bytes("cpu") is None
