"""Splash attention (model/attention_tpu.py), run in Pallas' interpreter on CPU: the same outputs, log-probs and
gradients as the einsum reference path; 'auto' picks it for a TPU target only. (Its TPU compile: test_aot_tpu.)"""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import skip_if_not_enough_devices

from vcpo_jax.model import attention_tpu
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M
from vcpo_jax.parallel import sharding
from vcpo_jax.parallel import target

HIGHEST = jax.lax.Precision.HIGHEST
T = 128  # the kernel's smallest tile


def _qkv(B, H, K, E, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(ks[0], (B, T, H, E)), jax.random.normal(ks[1], (B, T, K, E)),
          jax.random.normal(ks[2], (B, T, K, E)))


@skip_if_not_enough_devices(2)
@pytest.mark.slow
def test_model_logprobs_and_gradients_with_splash_equal_the_einsum_path():
  """Row 1 has three left-pad keys (its first query rows see no key: the mean of v, as the reference gives) and
  right padding. Splash runs under a 2-device mesh, each device on its own row (shard_map), as on a slice."""
  cfg = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                                 num_kv_heads=1, head_dim=8, max_seq_len=T, attention="einsum",
                                 matmul_precision="highest")
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  tokens_BxT = jax.random.randint(jax.random.PRNGKey(1), (2, T), 0, 40)
  t_T = jnp.arange(T)[None]
  keys_BxT = (t_T >= jnp.array([[0], [3]])) & (t_T < jnp.array([[T], [100]]))
  mask_BxT = keys_BxT.astype(jnp.float32)

  def run(c):
    def total(p):
      return jnp.sum(M.token_logprobs(p, c, tokens_BxT, mask_BxT, key_mask_BxT=keys_BxT) * mask_BxT)
    with jax.default_matmul_precision("highest"):
      return jax.jit(lambda p: (M.token_logprobs(p, c, tokens_BxT, mask_BxT, key_mask_BxT=keys_BxT),
                                jax.grad(total)(p)))(params)
  logp_ref, grads_ref = run(cfg)
  with jax.set_mesh(sharding.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])):
    logp, grads = run(dataclasses.replace(cfg, attention="splash"))
  assert np.all(np.isfinite(logp)) and np.any(np.asarray(logp) != 0)
  np.testing.assert_allclose(logp, logp_ref, atol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_auto_picks_splash_for_a_tpu_target_where_the_kernel_applies(caplog):
  q, k, _ = _qkv(1, 4, 2, 8)
  short_q, short_k = q[:, :100], k[:, :100]
  tpu = target.Target("tpu", "TPU v5 lite", 16 * 2**30)
  assert not attention_tpu.chosen("auto", q, k)            # this process' CPU
  with target.compiling_for(tpu):
    assert attention_tpu.chosen("auto", q, k)
    assert not attention_tpu.chosen("auto", short_q, short_k)   # 100 tokens: no 128-multiple tile
    assert not attention_tpu.chosen("xla", q, k)
  with caplog.at_level(logging.WARNING):
    assert not attention_tpu.chosen("splash", short_q, short_k)
  assert any("model.attention='splash' unsupported (query/key length 100/100" in r.getMessage()
             for r in caplog.records)
  assert model_config.ModelConfig(attention="splash").attention == "splash"
