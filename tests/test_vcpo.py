"""vcpo.py against float64 numpy formulas: importance weights, ESS, groups, GRPO, weighted aggregations."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.conftest import skip_if_not_enough_devices
from vcpo_jax.algo import segments
from vcpo_jax.algo import vcpo

IS_WEIGHTS = ('none', 'truncated', 'raw', 'reference')


# --------------------------------------------------------------------------------------------------------
# float64 numpy references (written from the formulas, independent of the jax code paths)
# --------------------------------------------------------------------------------------------------------

def np_ess(logw):
  w = np.exp(np.asarray(logw, np.float64))
  return w.sum() ** 2 / np.square(w).sum()


def np_weighted_quantile(values, weights, q):
  """Reference semantics: sort, cumulative weights, first index with cum >= q * total; 0 for zero total."""
  values = np.asarray(values, np.float64)
  weights = np.asarray(weights, np.float64)
  total = weights.sum()
  if total == 0:
    return 0.0
  order = np.argsort(values, kind='stable')
  cum = np.cumsum(weights[order])
  idx = min(int(np.searchsorted(cum, q * total, side='left')), len(values) - 1)
  return values[order][idx]


def np_aggregate(values, weights, aggregation, quantiles=(0.05, 0.95)):
  values = np.asarray(values, np.float64)
  weights = np.asarray(weights, np.float64)
  if aggregation == 'median':
    return np_weighted_quantile(values, weights, 0.5)
  if aggregation == 'winsorized_mean':
    lo = np_weighted_quantile(values, weights, quantiles[0])
    hi = np_weighted_quantile(values, weights, quantiles[1])
    values = np.clip(values, lo, hi)
  return (weights * values).sum() / weights.sum() if weights.sum() > 0 else 0.0


def np_is_factor(logw, tau, is_weight):
  """Per-sample multiplier c_i of the score in the estimator whose 2nd moment OPOB minimises."""
  logw = np.asarray(logw, np.float64)
  wt = np.minimum(np.exp(np.clip(logw, -20, 20)), tau)
  return {'none': np.ones_like(logw), 'truncated': wt, 'raw': np.exp(logw), 'reference': wt * np.exp(logw)}[is_weight]


def random_batch(rng, group_sizes, reward_kind='binary', logw_scale=1.0):
  group = np.concatenate([np.full(n, gid) for gid, n in zip(rng.permutation(1000)[:len(group_sizes)], group_sizes)])
  perm = rng.permutation(len(group))  # groups need not be contiguous
  group = group[perm]
  b = len(group)
  rewards = (rng.random(b) < 0.5).astype(np.float64) if reward_kind == 'binary' else rng.normal(size=b)
  sq_norms = rng.gamma(2.0, 3.0, size=b)
  logw = rng.normal(scale=logw_scale, size=b)
  lengths = rng.integers(1, 50, size=b).astype(np.float64)
  return group, rewards, sq_norms, logw, lengths


# --------------------------------------------------------------------------------------------------------
# importance weights and ESS
# --------------------------------------------------------------------------------------------------------

def test_seq_log_weights_matches_numpy_and_ignores_masked_garbage():
  rng = np.random.default_rng(0)
  logp = rng.normal(size=(4, 9)).astype(np.float32)
  mu = rng.normal(size=(4, 9)).astype(np.float32)
  mask = (rng.random((4, 9)) < 0.6).astype(np.float32)
  expected = ((logp.astype(np.float64) - mu) * mask).sum(-1)
  mu_garbage = np.where(mask > 0, mu, np.nan).astype(np.float32)
  mu_garbage[0, np.argmin(mask[0])] = -np.inf if mask[0].min() == 0 else mu_garbage[0, 0]
  got = vcpo.seq_log_weights(jnp.asarray(logp), jnp.asarray(mu_garbage), jnp.asarray(mask))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_truncated_weights_clamp_and_tau():
  logw = np.array([-1e4, -25.0, -1.0, 0.0, 1.5, 3.0, 25.0, 1e4], np.float32)
  expected = np.minimum(np.exp(np.clip(logw.astype(np.float64), -20, 20)), 8.0)
  np.testing.assert_allclose(np.asarray(vcpo.truncated_weights(jnp.asarray(logw))), expected, rtol=1e-6)
  untrunc = np.asarray(vcpo.truncated_weights(jnp.asarray(logw), tau=None))
  np.testing.assert_allclose(untrunc, np.exp(np.clip(logw.astype(np.float64), -20, 20)), rtol=1e-6)
  assert np.all(np.isfinite(untrunc))
  with pytest.raises(ValueError, match='tau'):
    vcpo.truncated_weights(jnp.asarray(logw), tau=-1.0)


def test_ess_matches_float64_numpy_for_moderate_values():
  rng = np.random.default_rng(1)
  for scale in (0.1, 1.0, 3.0, 8.0):
    logw = rng.normal(scale=scale, size=64)
    valid = rng.random(64) < 0.8
    exp_ess = np_ess(logw[valid])
    got_ess = float(vcpo.ess(jnp.asarray(logw, jnp.float32), jnp.asarray(valid)))
    got_ratio = float(vcpo.ess_ratio(jnp.asarray(logw, jnp.float32), jnp.asarray(valid)))
    np.testing.assert_allclose(got_ess, exp_ess, rtol=2e-4)
    np.testing.assert_allclose(got_ratio, exp_ess / valid.sum(), rtol=2e-4)
    np.testing.assert_allclose(float(vcpo.log_ess(jnp.asarray(logw, jnp.float32), jnp.asarray(valid))),
                               np.log(exp_ess), atol=2e-4)


def test_ess_extreme_log_weights_are_finite():
  logw = jnp.array([1e4, -1e4, 0.0, 1e4 - 1.0, 5.0, -3.0], jnp.float32)
  ratio = float(vcpo.ess_ratio(logw))
  assert np.isfinite(ratio) and 0.0 < ratio <= 1.0
  # Two dominant weights exp(1e4) and exp(1e4 - 1): ESS = (1 + e^-1)^2 / (1 + e^-2) in float64.
  np.testing.assert_allclose(float(vcpo.ess(logw)), (1 + np.exp(-1)) ** 2 / (1 + np.exp(-2)), rtol=1e-5)
  assert float(vcpo.ess_ratio(jnp.full((7,), -1e4))) == pytest.approx(1.0)
  assert float(vcpo.ess_ratio(jnp.array([jnp.inf, 0.0, 1.0]))) == pytest.approx(1 / 3)
  assert float(vcpo.ess_ratio(jnp.zeros(4), jnp.zeros(4, bool))) == 0.0
  assert np.isnan(float(vcpo.ess_ratio(jnp.array([0.0, jnp.nan]))))


def test_importance_stats_bundle():
  rng = np.random.default_rng(11)
  logp = rng.normal(size=(5, 7))
  mu = logp + rng.normal(scale=1.0, size=(5, 7))
  mask = (rng.random((5, 7)) < 0.7).astype(np.float64)
  valid = np.array([True, True, False, True, True])
  stats = jax.jit(lambda a, b, m, v: vcpo.importance_stats(a, b, m, tau=2.0, valid_B=v))(
      jnp.asarray(logp, jnp.float32), jnp.asarray(mu, jnp.float32), jnp.asarray(mask, jnp.float32), jnp.asarray(valid))
  logw = ((logp - mu) * mask).sum(-1)
  np.testing.assert_allclose(np.asarray(stats.logw_B), logw, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(stats.wt_B), np.minimum(np.exp(logw), 2.0), rtol=1e-5)
  np.testing.assert_allclose(float(stats.ess), np_ess(logw[valid]), rtol=1e-4)
  np.testing.assert_allclose(float(stats.ess_ratio), np_ess(logw[valid]) / 4, rtol=1e-4)


@skip_if_not_enough_devices(8)
def test_ess_sharded_over_data_axis_equals_unsharded():
  mesh = Mesh(np.array(jax.devices()[:8]), ('data',))
  rng = np.random.default_rng(2)
  logw = jnp.asarray(rng.normal(scale=30.0, size=64), jnp.float32).at[3].set(1e4)
  valid = jnp.asarray(rng.random(64) < 0.7).at[3].set(True)
  ref = np.array([vcpo.log_ess(logw, valid), vcpo.ess_ratio(logw, valid)])

  sharding = NamedSharding(mesh, P('data'))
  f_gspmd = jax.jit(lambda lw, v: jnp.stack([vcpo.log_ess(lw, v), vcpo.ess_ratio(lw, v)]))
  got_gspmd = f_gspmd(jax.device_put(logw, sharding), jax.device_put(valid, sharding))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P('data'), P('data')), out_specs=P())
  def f_shmap(lw, v):
    return jnp.stack([vcpo.log_ess(lw, v, axis_name='data'), vcpo.ess_ratio(lw, v, axis_name='data')])

  got_shmap = jax.jit(f_shmap)(logw, valid)
  np.testing.assert_allclose(np.asarray(got_gspmd), ref, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got_shmap), ref, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------
# groups, GRPO, weighted aggregations
# --------------------------------------------------------------------------------------------------------

def test_dense_group_ids_preserve_partition():
  group = jnp.array([1005, 7, 7, -3, 1005, 42, -3, 7])
  dense = np.asarray(segments.dense_group_ids(group))
  assert dense.min() >= 0 and dense.max() < 8
  g = np.asarray(group)
  assert np.array_equal(g[:, None] == g[None, :], dense[:, None] == dense[None, :])


def test_grpo_advantages_match_numpy():
  rng = np.random.default_rng(3)
  group, rewards, *_ = random_batch(rng, [4, 4, 1, 3, 4], reward_kind='normal')
  for norm in (True, False):
    got = np.asarray(vcpo.grpo_advantages(jnp.asarray(rewards, jnp.float32), jnp.asarray(group), norm_by_std=norm))
    for gid in np.unique(group):
      idx = group == gid
      r = rewards[idx]
      mean, std = (r.mean(), r.std(ddof=1)) if r.size > 1 else (0.0, 1.0)
      exp = (r - mean) / (std + 1e-6) if norm else r - mean
      np.testing.assert_allclose(got[idx], exp, rtol=1e-4, atol=1e-5)


def test_weighted_quantiles_match_numpy_inverted_cdf():
  rng = np.random.default_rng(4)
  values = rng.normal(size=33)
  weights = rng.gamma(0.5, size=33)
  qs = (0.05, 0.3, 0.5, 0.95)

  @jax.jit
  def quantiles(v, w):
    seg = jnp.zeros(v.shape, jnp.int32)
    return jnp.stack([segments.weighted_quantile(v, w, seg, q)[0] for q in qs] + [segments.weighted_median(v, w, seg)[0]])

  got = np.asarray(quantiles(jnp.asarray(values, jnp.float32), jnp.asarray(weights, jnp.float32)))
  exp = [np.quantile(values, q, method='inverted_cdf', weights=weights) for q in qs + (0.5,)]
  np.testing.assert_allclose(got, exp, rtol=1e-6)
  # Unit weights: lower median of an even count, as the cumulative rule implies.
  vals = jnp.array([4.0, 1.0, 3.0, 2.0])
  assert float(segments.weighted_median(vals, jnp.ones(4), jnp.zeros(4, jnp.int32))[0]) == 2.0


def test_segmented_median_and_winsorized_mean_vs_numpy_loop():
  rng = np.random.default_rng(5)
  group, values, _, _, _ = random_batch(rng, [5, 8, 3, 8, 1, 7], reward_kind='normal')
  weights = rng.gamma(0.7, size=group.size)
  weights[rng.random(group.size) < 0.2] = 0.0  # exact zero weights must never be picked
  weights[group == group[0]] = 0.0             # a segment with zero total gives 0

  @jax.jit
  def aggregates(v, w, g):
    seg = segments.dense_group_ids(g)
    return (segments.weighted_median(v, w, seg), segments.winsorized_mean(v, w, seg, (0.1, 0.9)),
            segments.weighted_mean(v, w, seg))

  med, win, mean = map(np.asarray, aggregates(jnp.asarray(values, jnp.float32), jnp.asarray(weights, jnp.float32),
                                              jnp.asarray(group)))
  for gid in np.unique(group):
    idx = group == gid
    np.testing.assert_allclose(med[idx], np_aggregate(values[idx], weights[idx], 'median'), rtol=1e-6)
    np.testing.assert_allclose(win[idx], np_aggregate(values[idx], weights[idx], 'winsorized_mean', (0.1, 0.9)),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mean[idx], np_aggregate(values[idx], weights[idx], 'mean'), rtol=1e-5, atol=1e-6)
