"""learner: RL step vs the float64 micro-batch-1 oracle, path agreement, metrics, NaN skipping, masked rows."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vcpo_jax.learner import config as learner_config
from vcpo_jax.learner import grad_norms as G
from vcpo_jax.learner import optimizer as O
from vcpo_jax.learner import step as Lr
from vcpo_jax.learner import train_state
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M
from benchmarks.common import oracle
from vcpo_jax.learner.batch import RLBatch

CFG = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, max_seq_len=32)
B, T, N = 8, 12, 4  # rows, length, group size
LR = 1e3  # large: the one-step delta must dominate float32 rounding of the params themselves
U32 = 2.0**-24  # float32 unit roundoff
# Two float32 computations of one gradient that sum its B*T token terms in different orders differ by
# ~ U32 sqrt(B*T) of a leaf's scale (random-walk rounding); 8x that for the backward's chained dots (sizes
# <= 40): 4.7e-6. A 0.1% error in any visible part of a leaf's gradient is well above it.
GRAD_TOL = 8 * U32 * np.sqrt(B * T)


def _sgd_ess():
  """Plain SGD then ESS scaling: params move by -lr sqrt(min(1, rho)) g, so the step exposes g itself."""
  return optax.chain(optax.sgd(LR), O.scale_by_ess(base_ess_ratio=1.0, rule="sqrt"))


@functools.lru_cache(maxsize=None)
def _batch(seed: int = 0) -> RLBatch:
  """Two groups of four; prompts of 2-4 tokens, unequal responses, one off-policy row past tau=8."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  for i in range(B):
    start = 2 + i % 3
    mask[i, start:min(T, start + 2 + (3 * i) % 7)] = 1
    tokens[i, start + 2 + (3 * i) % 7:] = 0
  sampler = (-3.7 + 0.4 * rng.standard_normal((B, T))).astype(np.float32) * mask
  sampler[5] -= 2.0 * mask[5]  # log w_5 > log 8: truncated
  rewards = np.array([1, 0, 1, 1, 0, 1, 0, 0], np.float32)
  return RLBatch(tokens_BxT=tokens, mask_BxT=mask, sampler_logp_BxT=sampler, rewards_B=rewards,
                    group_B=np.repeat(np.arange(B // N), N).astype(np.int32),
                    lag_B=rng.integers(0, 4, B).astype(np.float32), valid_B=np.ones(B, np.float32))


@functools.lru_cache(maxsize=None)
def _params():
  return jax.jit(functools.partial(M.init_params, CFG))(jax.random.PRNGKey(0))


def _logp(params, batch):
  return jax.jit(functools.partial(M.token_logprobs, cfg=CFG))(params, tokens_BxT=batch.tokens_BxT,
                                                                 mask_BxT=batch.mask_BxT)


@functools.lru_cache(maxsize=None)
def _step(lc: learner_config.LearnerConfig):
  opt = _sgd_ess()
  return Lr.make_rl_step(CFG, lc, opt), opt


def _run(lc: learner_config.LearnerConfig, batch=None):
  step, opt = _step(lc)
  state = train_state.create_train_state(CFG, opt, jax.random.PRNGKey(0))
  return step(state, _batch() if batch is None else batch)


def _np_ess_ratio(logw_B):
  w = np.exp(np.asarray(logw_B, np.float64) - np.max(logw_B))
  return w.sum() ** 2 / (w ** 2).sum() / len(w)


def _assert_tree_close(got, want, tol, what=""):
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    scale = max(np.max(np.abs(w)), 1e-12)
    np.testing.assert_allclose(g / scale, w / scale, atol=tol, err_msg=f"{what} {path}")


@pytest.mark.slow
def test_rl_step_matches_float64_oracle():
  """Golden value: one VCPO step (book-keeping path, float32) vs micro-batch-1 oracle in float64.

  Authors' settings (the LearnerConfig defaults): group scope, mean, raw w, std normalisation, tau 8.
  """
  is_weight, norm_by_std = "raw", True
  lc = learner_config.LearnerConfig()
  state, metrics = _run(lc)
  batch, params = _batch(), _params()
  with jax.enable_x64(True):
    p64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
    g64, stats = jax.jit(functools.partial(
        oracle.oracle_grads, cfg=CFG, group_size=N, tau=8.0, is_weight=is_weight, norm_by_std=norm_by_std))(
        p64, tokens_BxT=batch.tokens_BxT, mask_BxT=batch.mask_BxT, sampler_logp_BxT=batch.sampler_logp_BxT,
        rewards_B=batch.rewards_B)
    g64 = jax.tree.map(np.asarray, g64)
    stats = jax.tree.map(np.asarray, stats)
  assert stats["logw_B"][5] > np.log(8.0)  # the truncation branch is exercised
  rho = _np_ess_ratio(stats["logw_B"])
  np.testing.assert_allclose(metrics["ess_ratio"], rho, rtol=1e-5)
  np.testing.assert_allclose(metrics["lr_scale"], np.sqrt(min(rho, 1.0)), rtol=1e-5)
  np.testing.assert_allclose(metrics["baseline"], stats["baseline_B"].mean(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["hist/seq_grad_norm_B"], np.sqrt(stats["sq_norms_B"]), rtol=1e-5)
  # OPOB's second-moment diagnostics from the oracle's float64 W = w^2 ||s||^2 and baseline.
  r, groups = np.asarray(batch.rewards_B, np.float64), np.arange(B) // N
  W = np.exp(2 * stats["logw_B"]) * stats["sq_norms_B"]
  ratios = [np.sum(W[g] * (r[g] - stats["baseline_B"][g]) ** 2) / np.sum(W[g] * (r[g] - r[g].mean()) ** 2)
            for g in (groups == k for k in range(B // N)) if np.ptp(r[g]) > 0]
  np.testing.assert_allclose(metrics["opob/moment_ratio"], np.mean(ratios), rtol=1e-4)
  np.testing.assert_allclose(metrics["opob/max_weight_share"],
                             np.mean([W[groups == k].max() / W[groups == k].sum() for k in range(B // N)]), rtol=1e-4)
  want = jax.tree.map(lambda p, g: np.asarray(p, np.float64) - LR * np.sqrt(min(rho, 1.0)) * g, params, g64)
  delta = jax.tree.map(lambda a, p: np.asarray(a, np.float64) - np.asarray(p, np.float64), state.params, params)
  want_delta = jax.tree.map(lambda w, p: w - np.asarray(p, np.float64), want, params)
  _assert_tree_close(delta, want_delta, 1e-5, "param delta")


@pytest.mark.slow
def test_two_pass_path_equals_bookkeeping():
  """The same gradient along both paths: one SGD step (x the ESS scale) compared as param deltas."""
  s1, m1 = _run(learner_config.LearnerConfig())
  s2, m2 = _run(learner_config.LearnerConfig(grad_path="two_pass"))
  # GRAD_TOL of each leaf's scale, the k-projection bias included: softmax cancels it up to RoPE's rotation, so
  # its gradient is a sum with cancellation whose error is the largest relative to its own scale (~1e-6).
  params = _params()
  delta = lambda s: jax.tree.map(lambda a, p: np.asarray(a, np.float64) - np.asarray(p, np.float64), s, params)
  _assert_tree_close(delta(s1.params), delta(s2.params), GRAD_TOL, "book_keeping vs two_pass")
  # Scalars: float32 reductions of <= ~4e3 terms; u sqrt(n) ~ 4e-6.
  for key in ("loss", "ess", "baseline", "seq_grad_norm/p50", "grad_norm"):
    np.testing.assert_allclose(m1[key], m2[key], rtol=1e-5, err_msg=key)


@pytest.mark.slow
def test_grpo_step_matches_numpy_advantages():
  """advantage 'grpo' + seq-TIS loss: params move by -lr sqrt(rho) g, g from numpy float64 advantages."""
  state, metrics = _run(learner_config.LearnerConfig(advantage="grpo"))
  batch, params = _batch(), _params()
  r = batch.rewards_B.astype(np.float64).reshape(-1, N)
  adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
  logp = np.asarray(_logp(params, batch), np.float64)
  logw = ((logp - batch.sampler_logp_BxT) * batch.mask_BxT).sum(1)
  wt = np.minimum(np.exp(logw), 8.0)
  c_B = -wt * adv / (batch.mask_BxT.sum(1) * B)
  g = jax.jit(functools.partial(G.weighted_logp_grad, cfg=CFG))(
      params, tokens_BxT=batch.tokens_BxT, mask_BxT=batch.mask_BxT, c_B=jnp.asarray(c_B, jnp.float32))
  scale = np.sqrt(min(_np_ess_ratio(logw), 1.0))
  delta = jax.tree.map(lambda a, p: np.asarray(a) - np.asarray(p), state.params, params)
  _assert_tree_close(delta, jax.tree.map(lambda x: -LR * scale * np.asarray(x), g), 1e-5, "grpo delta")
  assert "baseline" not in metrics and "seq_grad_norm/p50" not in metrics


def test_metrics_are_flat_finite_and_complete():
  _, metrics = _run(learner_config.LearnerConfig())
  for key in ("ess", "ess_ratio", "lr_scale", "baseline", "loss", "grad_norm", "seq_grad_norm/p10",
              "seq_grad_norm/p50", "seq_grad_norm/p90", "seq_grad_norm/max", "is/logw_max", "is/logw_p99",
              "is/frac_truncated", "entropy", "lag/mean", "lag/max", "skipped_updates"):
    assert np.ndim(metrics[key]) == 0 and np.isfinite(metrics[key]), key
  for key in ("hist/logw_B", "hist/seq_grad_norm_B", "hist/lag_B"):
    assert np.shape(metrics[key]) == (B,), key
  batch = _batch()
  np.testing.assert_allclose(metrics["lag/max"], batch.lag_B.max())
  np.testing.assert_allclose(metrics["is/frac_truncated"], 1.0 / B)
  np.testing.assert_allclose(metrics["is/logw_max"], np.max(metrics["hist/logw_B"]), rtol=1e-6)


@pytest.mark.parametrize("field", ["sampler_logp_BxT", "rewards_B"])
def test_nonfinite_input_skips_update(field):
  batch = _batch()
  bad = np.array(getattr(batch, field))
  bad[(2, 4) if bad.ndim == 2 else 3] = np.nan  # a masked (response) position / one reward
  step, opt = _step(learner_config.LearnerConfig())
  state = train_state.create_train_state(CFG, opt, jax.random.PRNGKey(0))
  before = jax.tree.map(np.array, state)
  new, metrics = step(state, batch.replace(**{field: bad}))
  assert int(new.skipped_updates) == 1 and int(new.step) == 1 and float(metrics["update_applied"]) == 0.0
  _assert_tree_close(new.params, before.params, 0.0, "params")
  for got, want in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(before.opt_state)):
    np.testing.assert_array_equal(got, want)
  good, metrics = step(new, batch)  # the next finite batch updates normally
  assert int(good.skipped_updates) == 1 and float(metrics["update_applied"]) == 1.0


def test_rows_masked_out_of_the_loss_keep_their_rewards_in_the_baseline():
  """rl.overlong.mask_truncated empties a valid row's mask (row 0, and all of group 1): the step stays finite, the
  masked rows' tokens do not matter, their rewards do (they stay in their group's baseline and std)."""
  batch = _batch()
  mask = np.array(batch.mask_BxT)
  mask[[0, 4, 5, 6, 7]] = 0.0
  masked = batch.replace(mask_BxT=mask)
  state, metrics = _run(learner_config.LearnerConfig(), masked)
  assert float(metrics["update_applied"]) == 1.0 and np.isfinite(metrics["loss"])
  tokens = np.array(batch.tokens_BxT)
  tokens[0] = (tokens[0] + 7) % CFG.vocab_size
  other_tokens, _ = _run(learner_config.LearnerConfig(), masked.replace(tokens_BxT=tokens))
  _assert_tree_close(other_tokens.params, state.params, 0.0, "masked row's tokens")
  rewards = np.array(batch.rewards_B)
  rewards[0] = 0.0
  other_reward, _ = _run(learner_config.LearnerConfig(), masked.replace(rewards_B=rewards))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(other_reward.params),
                                                     jax.tree.leaves(state.params)))
