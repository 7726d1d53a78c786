"""SGD + momentum in the optimizer chain, and the per-step update diagnostics against float64 numpy."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vcpo_jax.learner import config as learner_config
from vcpo_jax.learner import optimizer as O
from vcpo_jax.learner import step as Lr
from vcpo_jax.learner import train_state
from vcpo_jax.learner import update_diagnostics as D
from vcpo_jax.model import config as model_config
from vcpo_jax.learner.batch import RLBatch

CFG = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                               num_kv_heads=1, head_dim=8, max_seq_len=32)
B, T, N = 8, 12, 4
LR = 1e3  # large: a one-step param delta must dominate the float32 rounding of the params themselves


def _tree(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(3, 5)) * scale, jnp.float32),
          "b": [jnp.asarray(rng.normal(size=(7,)) * 0.1 * scale, jnp.float32)]}


def _flat64(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def test_norm_and_cosine_match_float64_numpy():
  a, b = _tree(0), _tree(1)
  na, nb, cos = D.norm_and_cosine(a, b)
  fa, fb = _flat64(a), _flat64(b)
  np.testing.assert_allclose(na, np.linalg.norm(fa), rtol=1e-6)
  np.testing.assert_allclose(nb, np.linalg.norm(fb), rtol=1e-6)
  np.testing.assert_allclose(cos, fa @ fb / np.linalg.norm(fa) / np.linalg.norm(fb), rtol=1e-5, atol=1e-6)
  assert abs(float(D.norm_and_cosine(a, jax.tree.map(lambda x: -2 * x, a))[2]) + 1) < 1e-6
  assert np.isnan(D.norm_and_cosine(a, jax.tree.map(jnp.zeros_like, a))[2])  # no direction: NaN, not 0


def _numpy_heavy_ball(grads, lr, momentum):
  m, params, out = 0.0, _flat64(_tree(9)), []
  for g in grads:
    m = momentum * m + _flat64(g)
    params = params - lr * m
    out.append(params)
  return out


def test_sgd_momentum_chain_matches_numpy_and_keeps_the_gradient_scale():
  tx = O.build_optimizer(learning_rate=0.05, name="sgd", momentum=0.9, max_grad_norm=None, ess_scaling=False)
  params = _tree(9)
  state = tx.init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state))
  grads = [_tree(10 + t) for t in range(4)]
  want = _numpy_heavy_ball(grads, 0.05, 0.9)
  for g, w in zip(grads, want):
    updates, state = tx.update(g, state, params, ess_ratio=1.0)
    params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(_flat64(params), w, rtol=1e-5, atol=1e-6)
  # No per-coordinate normalisation: a gradient scaled by c gives an update scaled by c (Adam's does not move).
  for name, ratio in (("sgd", 0.25), ("adamw", 1.0)):
    tx = O.build_optimizer(learning_rate=0.05, name=name, max_grad_norm=None, weight_decay=0.0, ess_scaling=False)
    u1 = _flat64(tx.update(_tree(3), tx.init(params), params, ess_ratio=1.0)[0])
    u2 = _flat64(tx.update(_tree(3, 0.25), tx.init(params), params, ess_ratio=1.0)[0])
    np.testing.assert_allclose(np.linalg.norm(u2) / np.linalg.norm(u1), ratio, rtol=1e-3)


def test_bad_optimizer_fields_name_themselves():
  with pytest.raises(ValueError, match="name"):
    O.build_optimizer(learning_rate=0.1, name="lion")
  with pytest.raises(ValueError, match="momentum"):
    O.build_optimizer(learning_rate=0.1, name="sgd", momentum=1.0)
  from configs import countdown  # noqa: PLC0415
  from vcpo_jax.job import configuration  # noqa: PLC0415
  for field, value in (("name", "lion"), ("momentum", -0.1)):
    c = countdown.get_config()
    c.optim[field] = value
    with pytest.raises(ValueError, match=f"optim.{field}"):
      configuration.validate_config(c)
  with pytest.raises(ValueError, match="update_diagnostics"):
    learner_config.LearnerConfig(update_diagnostics=1)
  c = countdown.get_config()
  c.optim.name = "sgd"
  assert configuration.learner_config(c).update_diagnostics is False
  sft = configuration.build_optimizer(c, sft=True)  # the warm start stays AdamW: Adam's two moments
  assert len([x for x in jax.tree.leaves(sft.init(_tree(0))) if x.shape == (3, 5)]) == 2


@functools.lru_cache(maxsize=None)
def _batch() -> RLBatch:
  """Two groups of four with mixed rewards and off-policy rows (the learner tests' shape)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  for i in range(B):
    start = 2 + i % 3
    mask[i, start:min(T, start + 2 + (3 * i) % 7)] = 1
  sampler = (-3.7 + 0.4 * rng.standard_normal((B, T))).astype(np.float32) * mask
  rewards = np.array([1, 0, 1, 1, 0, 1, 0, 0], np.float32)
  return RLBatch(tokens_BxT=tokens, mask_BxT=mask, sampler_logp_BxT=sampler, rewards_B=rewards,
                 group_B=np.repeat(np.arange(B // N), N).astype(np.int32),
                 lag_B=rng.integers(0, 4, B).astype(np.float32), valid_B=np.ones(B, np.float32))


def _step(lc, tx):
  state = train_state.create_train_state(CFG, tx, jax.random.PRNGKey(0))
  params = jax.tree.map(np.asarray, state.params)
  new, metrics = Lr.make_rl_step(CFG, lc, tx)(state, _batch())
  return _flat64(new.params) - _flat64(params), jax.tree.map(np.asarray, metrics)


@pytest.mark.slow
def test_step_diagnostics_match_float64_numpy_under_sgd_and_adam():
  """VCPO (OPOB + ESS) with diagnostics against two plain steps: OPOB's and the group mean's own (no
  diagnostics), whose param deltas give both updates; norms and cosines recomputed in float64 numpy."""
  sgd = O.build_optimizer(learning_rate=LR, name="sgd", momentum=0.9, max_grad_norm=None, ess=dict(base_ess_ratio=1.0))
  opob = learner_config.LearnerConfig(update_diagnostics=True)
  gm = learner_config.LearnerConfig(advantage="grpo", advantage_options=dict(unbiased_std=False))
  u, m = _step(opob, sgd)
  u_plain, _ = _step(dataclasses.replace(opob, update_diagnostics=False), sgd)
  u_gm, m_gm = _step(gm, sgd)
  np.testing.assert_allclose(u, u_plain, rtol=1e-6, atol=1e-6 * np.abs(u).max())  # diagnostics change nothing
  scale = float(m["lr_scale"])
  assert 0 < scale < 1  # the ESS scale is applied to both updates
  np.testing.assert_allclose(m["update/norm"], np.linalg.norm(u), rtol=1e-4)
  np.testing.assert_allclose(m["update/group_mean_norm"], np.linalg.norm(u_gm), rtol=1e-4)
  cos = u @ u_gm / np.linalg.norm(u) / np.linalg.norm(u_gm)
  assert cos < 0.999  # OPOB's baseline moves the direction here, so the test can tell the two apart
  np.testing.assert_allclose(m["update/cos_group_mean"], cos, rtol=1e-4)
  # First SGD step: update = -lr * scale * g, so the gradients' norms and cosine follow from the deltas.
  np.testing.assert_allclose(m["grad_norm"], np.linalg.norm(u) / (LR * scale), rtol=1e-4)
  np.testing.assert_allclose(m["grad/group_mean_norm"], m_gm["grad_norm"], rtol=1e-4)
  np.testing.assert_allclose(m["grad/cos_group_mean"], cos, rtol=1e-4)
  # Adam's first step from the same gradients: -lr * scale * g / (|g| + eps) per coordinate (bias-corrected).
  g, g_gm = -u / (LR * scale), -u_gm / (LR * scale)
  adam = O.build_optimizer(learning_rate=1.0, weight_decay=0.0, max_grad_norm=None, ess=dict(base_ess_ratio=1.0))
  _, m_adam = _step(opob, adam)
  step = lambda x: -scale * x / (np.abs(x) + 1e-8)  # noqa: E731
  a, a_gm = step(g), step(g_gm)
  np.testing.assert_allclose(m_adam["update/norm"], np.linalg.norm(a), rtol=1e-3)
  np.testing.assert_allclose(m_adam["update/group_mean_norm"], np.linalg.norm(a_gm), rtol=1e-3)
  np.testing.assert_allclose(m_adam["update/cos_group_mean"], a @ a_gm / np.linalg.norm(a) / np.linalg.norm(a_gm),
                             rtol=1e-3)
  np.testing.assert_allclose(m_adam["grad/cos_group_mean"], cos, rtol=1e-4)
