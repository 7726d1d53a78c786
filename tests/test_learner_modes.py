"""The learner step across layouts and modes: sharded, micro-batched, SFT, book-keeping losses, bfloat16, bad input."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import skip_if_not_enough_devices
from test_learner import B, CFG, T, _assert_tree_close, _batch, _logp, _params, _run, _step
from vcpo_jax.algo import losses as L
from vcpo_jax.learner import batch as batch_lib
from vcpo_jax.learner import config as learner_config
from vcpo_jax.learner import optimizer as O
from vcpo_jax.learner import step as Lr
from vcpo_jax.learner import train_state
from vcpo_jax.model import transformer as M
from benchmarks.common import oracle
from vcpo_jax.parallel import sharding


@pytest.mark.slow
@skip_if_not_enough_devices(8)
@pytest.mark.parametrize("mesh_shape", [dict(data=2, fsdp=2, tensor=2), dict(data=8)])
def test_sharded_step_equals_unsharded(mesh_shape):
  # SGD (not Adam): Adam's first step g / (|g| + eps) amplifies float32 reduction-order noise in the
  # near-zero k-bias gradient, which says nothing about the sharding.
  lc = learner_config.LearnerConfig()
  want, want_m = _run(lc)
  opt = _step(lc)[1]
  mesh = sharding.make_mesh(mesh_shape)
  state = train_state.create_train_state(CFG, opt, jax.random.PRNGKey(0), mesh=mesh)
  kernel = state.params["layers_0"]["mlp"]["up_proj"]["kernel"]
  assert len(kernel.sharding.device_set) == 8
  got, got_m = Lr.make_rl_step(CFG, lc, opt, mesh=mesh)(state, _batch())
  params = _params()
  delta = lambda s: jax.tree.map(lambda a, p: np.asarray(a, np.float64) - np.asarray(p, np.float64), s, params)
  _assert_tree_close(delta(got.params), delta(want.params), 1e-5, "param delta")
  for key in ("ess_ratio", "baseline", "loss", "grad_norm"):
    np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-5, err_msg=key)


def test_sft_step_is_masked_nll_and_learns():
  opt = O.build_optimizer(learning_rate=3e-2, ess_scaling=False)
  state = train_state.create_train_state(CFG, opt, jax.random.PRNGKey(0))
  batch = _batch()
  lp = np.asarray(_logp(state.params, batch), np.float64)
  want = -lp.sum() / batch.mask_BxT.sum()
  step = train_state.make_sft_step(CFG, opt)
  losses = []
  for _ in range(5):
    state, metrics = step(state, batch.tokens_BxT, batch.mask_BxT)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses[0], want, rtol=1e-5)
  assert losses[-1] < losses[0] - 0.5 and int(state.step) == 5


def test_bad_config_and_batch_name_the_field():
  with pytest.raises(ValueError, match="advantage"):
    learner_config.LearnerConfig(advantage="ppo_gae")
  with pytest.raises(ValueError, match="aggregation"):
    learner_config.LearnerConfig(aggregation="sum")
  with pytest.raises(ValueError, match="tis_threshold"):
    learner_config.LearnerConfig(tis_threshold=0.0)
  with pytest.raises(ValueError, match="scope"):
    learner_config.LearnerConfig(advantage_options=dict(scope="batch"))
  with pytest.raises(ValueError, match="grad_path"):
    learner_config.LearnerConfig(grad_path="three_pass")
  batch = _batch()
  with pytest.raises(ValueError, match="rewards_B"):
    batch_lib.check_batch(batch.replace(rewards_B=np.zeros(B + 1, np.float32)))
  with pytest.raises(ValueError, match="group_size"):
    oracle.oracle_grads(_params(), CFG, batch.tokens_BxT, batch.mask_BxT, batch.sampler_logp_BxT,
                        batch.rewards_B, group_size=3)


@pytest.mark.slow
@skip_if_not_enough_devices(8)
def test_micro_batched_step_equals_whole_batch():
  """Chunks of whole groups (scan) give the whole-batch step; with 2 data shards each chunk spans both."""
  mesh_shape = dict(data=2, tensor=4)
  batch = _batch().replace(group_B=np.repeat(np.arange(B // 2), 2).astype(np.int32))  # groups of 2
  want, want_m = _run(learner_config.LearnerConfig(), batch)
  lc = learner_config.LearnerConfig(micro_batch_size=4)
  opt = _step(learner_config.LearnerConfig())[1]
  mesh = sharding.make_mesh(mesh_shape)
  state = train_state.create_train_state(CFG, opt, jax.random.PRNGKey(0), mesh=mesh)
  got, got_m = Lr.make_rl_step(CFG, lc, opt, mesh=mesh)(state, batch)
  params = _params()
  delta = lambda s: jax.tree.map(lambda a, p: np.asarray(a, np.float64) - np.asarray(p, np.float64), s, params)
  _assert_tree_close(delta(got.params), delta(want.params), 1e-5, "param delta")
  for key in ("loss", "ess_ratio", "baseline", "grad_norm", "entropy", "seq_grad_norm/p50", "opob/moment_ratio",
              "opob/max_weight_share"):
    np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-5, err_msg=key)
  np.testing.assert_allclose(got_m["hist/logw_B"], want_m["hist/logw_B"], rtol=1e-5, atol=1e-5)


def test_micro_batch_misuse_names_the_field():
  with pytest.raises(ValueError, match="micro_batch_size"):
    learner_config.LearnerConfig(advantage="reinforce", micro_batch_size=4)
  with pytest.raises(ValueError, match="micro_batch_size"):
    learner_config.LearnerConfig(advantage_options=dict(scope="minibatch"), micro_batch_size=4)
  with pytest.raises(ValueError, match="splits prompt group"):
    learner_config.check_chunks(_batch(), micro_batch_size=2)  # groups of 4 in chunks of 2
  with pytest.raises(ValueError, match="micro_batch_size"):
    learner_config.check_chunks(_batch(), micro_batch_size=3)


@pytest.mark.parametrize("name", [n for n in L.POLICY_LOSSES
                                  if L.POLICY_LOSSES.get(n).fact("seq_coefficient")])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_bookkeeping_losses_have_per_sequence_coefficients(name, aggregation):
  """The book-keeping path assumes d loss / d logp_t is one constant per sequence on its response tokens."""
  batch = _batch()
  lc = learner_config.LearnerConfig(policy_loss=name, aggregation=aggregation, generation_budget=T)
  logp = jnp.asarray(batch.sampler_logp_BxT + 0.3 * batch.mask_BxT * np.cos(np.arange(T))[None, :])
  adv = jnp.linspace(-1.0, 1.0, B)
  dlogp = np.asarray(jax.grad(lambda lp: Lr._policy_loss(lp, batch, jnp.asarray(batch.mask_BxT), adv, lc)[0])(logp))
  for i in range(B):
    on = dlogp[i][batch.mask_BxT[i] > 0]
    np.testing.assert_allclose(on, np.full_like(on, on[0]), rtol=1e-6, atol=1e-9, err_msg=f"{name} row {i}")
    assert np.all(dlogp[i][batch.mask_BxT[i] == 0] == 0)


@pytest.mark.slow
def test_bfloat16_params_and_compute_train():
  """Mixed precision: bf16 params and compute, float32 optimizer state (the float32 master copy)
  and float32 log-probs, IS log-weights and loss. Two REINFORCE steps at lr 1e-5 move the master by <= lr
  each and the bf16 params follow it (bf16 Adam alone rounds such steps away); then, at lr 3e-3, the loss
  on the fixed batch goes down step after step. One compile: the lr is a schedule."""
  cfg = dataclasses.replace(CFG, param_dtype="bfloat16", dtype="bfloat16")
  small, steps = 1e-5, 2
  opt = O.build_optimizer(learning_rate=optax.piecewise_constant_schedule(small, {steps: 300.0}),
                          weight_decay=0.0, ess_scaling=False)
  state = train_state.create_train_state(cfg, opt, jax.random.PRNGKey(0))
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(state.opt_state)} <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}
  p0 = jax.tree.map(lambda x: np.asarray(x, np.float32), state.params)
  master = lambda: jax.tree.leaves(state.opt_state.master)
  for m, p in zip(master(), jax.tree.leaves(p0)):
    np.testing.assert_array_equal(np.asarray(m), p)  # the master starts at the bf16 values exactly
  step = Lr.make_rl_step(cfg, learner_config.LearnerConfig(advantage="grpo", policy_loss="pg"), opt)
  losses = []
  for i in range(steps + 4):
    state, metrics = step(state, _batch())
    assert float(metrics["update_applied"]) == 1.0
    losses.append(float(metrics["loss"]))
    if i == steps - 1:   # still at the small lr
      moved = max(float(np.max(np.abs(np.asarray(m) - p))) for m, p in zip(master(), jax.tree.leaves(p0)))
      assert 0.5 * small < moved <= steps * small * 1.01  # Adam: <= lr per step
      for m, p in zip(master(), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(m.astype(jnp.bfloat16), np.float32), np.asarray(p, np.float32))
      assert any(np.any(np.asarray(p, np.float32) != q) for p, q in zip(jax.tree.leaves(state.params),
                                                                        jax.tree.leaves(p0)))
  for key in ("loss", "is/logw_max", "hist/logw_B", "ess", "entropy"):
    assert metrics[key].dtype == jnp.float32, key
  big = losses[steps:]
  assert all(b < a for a, b in zip(big, big[1:])), losses
  logp = jax.eval_shape(functools.partial(M.token_logprobs, cfg=cfg), state.params,
                        tokens_BxT=_batch().tokens_BxT, mask_BxT=_batch().mask_BxT)
  assert logp.dtype == jnp.float32
