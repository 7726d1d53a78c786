"""Tests for vcpo.py against float64 numpy formulas, brute-force grids and sharded execution."""
import functools

import hypothesis
import hypothesis.strategies as st
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


# --------------------------------------------------------------------------------------------------------
# OPOB
# --------------------------------------------------------------------------------------------------------

def _opob(group, rewards, sq_norms, logw, lengths, tau=8.0, valid=None, **options):
  logw32 = jnp.asarray(logw, jnp.float32)
  adv, base = vcpo.opob_advantages(
      jnp.asarray(rewards, jnp.float32), jnp.asarray(group), jnp.asarray(sq_norms, jnp.float32), logw32,
      vcpo.truncated_weights(logw32, tau), jnp.asarray(lengths, jnp.float32),
      valid_B=None if valid is None else jnp.asarray(valid), **options)
  return np.asarray(adv), np.asarray(base)


# Weights and aggregations act independently, so their cross product is not needed (each combo compiles).
GROUP_CASES = [(w, 'mean', False, True) for w in IS_WEIGHTS] + [
    ('raw', 'median', False, True), ('raw', 'winsorized_mean', False, True), ('raw', 'mean', True, False),
    ('truncated', 'median', True, False), ('reference', 'winsorized_mean', True, False)]


@pytest.mark.parametrize('is_weight,aggregation,norm_len,norm_std', GROUP_CASES)
def test_group_scope_matches_per_group_numpy_loop(is_weight, aggregation, norm_len, norm_std):
  rng = np.random.default_rng(6)
  group, rewards, sq_norms, logw, lengths = random_batch(rng, [4, 4, 6, 2], reward_kind='normal', logw_scale=1.5)
  rewards[group == group[0]] = 0.7  # a zero-std group
  adv, base = _opob(group, rewards, sq_norms, logw, lengths, scope='group', is_weight=is_weight,
                    aggregation=aggregation, normalize_by_length=norm_len, norm_by_std=norm_std)
  for gid in np.unique(group):
    idx = group == gid
    c = np_is_factor(logw[idx], 8.0, is_weight)
    weights = sq_norms[idx] * c ** 2 / (lengths[idx] ** 2 if norm_len else 1.0)
    b = np_aggregate(rewards[idx], weights, aggregation)
    std = rewards[idx].std()
    exp_adv = rewards[idx] - b
    if norm_std:
      exp_adv = exp_adv / std if std > 1e-8 else np.zeros_like(exp_adv)
    np.testing.assert_allclose(base[idx], b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv[idx], exp_adv, rtol=1e-4, atol=1e-5)


def test_minibatch_scope_uses_grpo_advantages_and_one_baseline():
  rng = np.random.default_rng(7)
  group, rewards, sq_norms, logw, lengths = random_batch(rng, [4, 4, 6, 2])
  adv, base = _opob(group, rewards, sq_norms, logw, lengths, scope='minibatch', is_weight='raw')
  grpo = np.zeros_like(rewards)
  for gid in np.unique(group):
    idx = group == gid
    grpo[idx] = (rewards[idx] - rewards[idx].mean()) / (rewards[idx].std(ddof=1) + 1e-6)
  weights = sq_norms * np.exp(2 * logw)
  b = (weights * grpo).sum() / weights.sum()
  np.testing.assert_allclose(base, np.full_like(base, b), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(adv, grpo - b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('scope,aggregation,norm_std', [
    ('group', 'mean', True), ('group', 'mean', False), ('group', 'median', False),
    ('group', 'winsorized_mean', False), ('minibatch', 'mean', True), ('minibatch', 'median', False)])
def test_all_equal_rewards_give_zero_advantages(scope, aggregation, norm_std):
  rng = np.random.default_rng(8)
  group, _, sq_norms, logw, lengths = random_batch(rng, [4, 4, 6, 2])
  adv, _ = _opob(group, np.full(16, 0.3), sq_norms, logw * 50, lengths, scope=scope, aggregation=aggregation,
                 norm_by_std=norm_std)
  assert np.array_equal(adv, np.zeros(16)), adv


def test_extreme_log_weights_give_finite_baseline():
  rng = np.random.default_rng(9)
  group, rewards, sq_norms, _, lengths = random_batch(rng, [8, 8])
  logw = np.tile(np.array([1e4, -1e4, 0.0, 3.0, -1e4, -1e4, 1e4, 1e4 - 0.5]), 2)
  for is_weight, aggregation in [(w, 'mean') for w in IS_WEIGHTS] + [('raw', 'median'), ('raw', 'winsorized_mean')]:
    adv, base = _opob(group, rewards, sq_norms, logw, lengths, is_weight=is_weight, aggregation=aggregation)
    assert np.all(np.isfinite(adv)) and np.all(np.isfinite(base)), (is_weight, aggregation)
  # Raw weights vs a float64 log-domain reference: members with log w = 1e4 dominate their group.
  _, base = _opob(group, rewards, sq_norms, logw, lengths, is_weight='raw', norm_by_std=False)
  for gid in np.unique(group):
    idx = group == gid
    log_w64 = np.log(sq_norms[idx]) + 2 * logw[idx]
    w64 = np.exp(log_w64 - log_w64.max())
    # float32 log W near 2e4 has an ulp of ~2e-3, which bounds the relative accuracy of the weights.
    np.testing.assert_allclose(base[idx], (w64 * rewards[idx]).sum() / w64.sum(), rtol=5e-3, atol=1e-6)


def test_invalid_rows_are_ignored():
  rng = np.random.default_rng(10)
  group, rewards, sq_norms, logw, lengths = random_batch(rng, [4, 4, 6, 2])
  valid = np.ones(16, bool)
  valid[[1, 5]] = False
  adv, base = _opob(group, rewards, sq_norms, logw, lengths, valid=valid, is_weight='raw')
  keep = valid
  adv_sub, base_sub = _opob(group[keep], rewards[keep], sq_norms[keep], logw[keep], lengths[keep], is_weight='raw')
  assert np.all(adv[~valid] == 0) and np.all(base[~valid] == 0)
  np.testing.assert_allclose(adv[keep], adv_sub, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(base[keep], base_sub, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('scope,aggregation', [('group', 'mean'), ('group', 'median'),
                                               ('group', 'winsorized_mean'), ('minibatch', 'mean')])
def test_nan_on_invalid_rows_does_not_reach_valid_rows(scope, aggregation):
  """Padding rows may carry garbage (NaN reward, norm, log-weight): 0 x NaN must not poison the baseline."""
  rng = np.random.default_rng(11)
  group, rewards, sq_norms, logw, lengths = random_batch(rng, [4, 4, 6, 2])
  valid = np.ones(16, bool)
  valid[[1, 5]] = False
  clean, clean_base = _opob(group, np.where(valid, rewards, 0.0), sq_norms, logw, lengths, valid=valid,
                            scope=scope, aggregation=aggregation)
  rewards, sq_norms, logw = rewards.copy(), sq_norms.copy(), logw.copy()
  rewards[1], sq_norms[5], logw[5] = np.nan, np.nan, np.nan
  adv, base = _opob(group, rewards, sq_norms, logw, lengths, valid=valid, scope=scope, aggregation=aggregation)
  assert np.all(np.isfinite(adv)) and np.all(np.isfinite(base)), (adv, base)
  np.testing.assert_allclose(adv, clean, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(base, clean_base, rtol=1e-6, atol=1e-7)


def test_bad_options_raise_value_error_naming_field():
  args = [jnp.ones(4), jnp.zeros(4, jnp.int32), jnp.ones(4), jnp.zeros(4), jnp.ones(4), jnp.ones(4)]
  for field, value in (('scope', 'batch'), ('is_weight', 'clipped'), ('aggregation', 'mode')):
    with pytest.raises(ValueError, match=field):
      vcpo.opob_advantages(*args, **{field: value})
  with pytest.raises(ValueError, match='winsor_quantiles'):
    vcpo.OPOBOptions(winsor_quantiles=(0.9, 0.1))
  with pytest.raises(ValueError, match='logw_B'):
    vcpo.opob_log_weights(jnp.ones(4), None, jnp.ones(4), None, is_weight='raw')


_OBJ_B, _OBJ_D = 16, 5


@hypothesis.settings(max_examples=20, deadline=None, derandomize=True)
@hypothesis.given(seed=st.integers(0, 2 ** 31 - 1), is_weight=st.sampled_from(IS_WEIGHTS),
                  normalize_by_length=st.booleans())
def test_opob_mean_minimises_per_sample_second_moment(seed, is_weight, normalize_by_length):
  """b* = argmin_b sum_i ||c_i (R_i - b) s_i||^2 / L_i^2 with explicit score vectors s_i (design §3)."""
  rng = np.random.default_rng(seed)
  rewards = rng.normal(size=_OBJ_B) * rng.choice([0.1, 1.0, 5.0])
  scores = rng.normal(size=(_OBJ_B, _OBJ_D)) * rng.gamma(1.0, size=(_OBJ_B, 1))
  logw = rng.normal(scale=1.5, size=_OBJ_B)
  lengths = rng.integers(1, 30, size=_OBJ_B).astype(np.float64)
  sq_norms = np.square(scores).sum(-1)
  _, base = _opob(np.zeros(_OBJ_B, np.int32), rewards, sq_norms, logw, lengths, is_weight=is_weight,
                  normalize_by_length=normalize_by_length, aggregation='mean', norm_by_std=False)
  c = np_is_factor(logw, 8.0, is_weight) / (lengths if normalize_by_length else 1.0)

  def objective(b_G):
    vecs_GxBxD = (c[None, :] * (rewards[None, :] - b_G[:, None]))[:, :, None] * scores[None, :, :]
    return np.square(vecs_GxBxD).sum(axis=(1, 2))

  grid = np.linspace(rewards.min(), rewards.max(), 4001)
  f_grid = objective(grid)
  spacing = grid[1] - grid[0]
  assert abs(base[0] - grid[np.argmin(f_grid)]) <= spacing * 1.01 + 1e-5 * abs(grid).max()
  assert objective(base[:1].astype(np.float64))[0] <= f_grid.min() * (1 + 1e-5) + 1e-12


@skip_if_not_enough_devices(8)
def test_opob_under_data_sharding_equals_unsharded():
  """GSPMD: OPOB's sort/segment ops on a batch sharded over 'data' give the single-device result."""
  mesh = Mesh(np.array(jax.devices()[:8]), ('data',))
  rng = np.random.default_rng(12)
  group, rewards, sq_norms, logw, lengths = random_batch(rng, [4, 4, 6, 2], reward_kind='normal')
  args = [jnp.asarray(x, jnp.float32) for x in (rewards, group, sq_norms, logw)]
  args[1] = jnp.asarray(group, jnp.int32)
  args += [vcpo.truncated_weights(args[3]), jnp.asarray(lengths, jnp.float32)]
  fn = jax.jit(lambda *a: vcpo.opob_advantages(*a, aggregation='winsorized_mean'))
  ref = fn(*args)
  sharded = fn(*[jax.device_put(a, NamedSharding(mesh, P('data'))) for a in args])
  for r, s in zip(ref, sharded):
    np.testing.assert_allclose(np.asarray(s), np.asarray(r), rtol=1e-6, atol=1e-7)


def _moment_diagnostics_numpy(rewards, groups, logW, baseline, valid):
  """Float64 reference: per group, sum W (R - b)^2 / sum W (R - mean R)^2 and max W / sum W, then group means."""
  ratios, shares = [], []
  for g in np.unique(groups[valid]):
    rows = valid & (groups == g)
    r, b = rewards[rows].astype(np.float64), baseline[rows].astype(np.float64)
    w = np.exp(logW[rows].astype(np.float64) - logW[rows].max())
    den = np.sum(w * (r - r.mean()) ** 2)
    if den > 1e-12:
      ratios.append(np.sum(w * (r - b) ** 2) / den)
    shares.append(w.max() / w.sum())
  return (np.mean(ratios) if ratios else np.nan), np.mean(shares), len(ratios)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opob_moment_diagnostics_match_float64_numpy(seed):
  rng = np.random.default_rng(seed)
  b, n = 24, 4
  rewards = rng.integers(0, 2, b).astype(np.float32)
  rewards[:n] = 1.0  # one group with equal rewards: no ratio
  groups = np.repeat(np.arange(b // n), n).astype(np.int32)
  sq = rng.lognormal(0.0, 1.0, b).astype(np.float32)
  logw = rng.normal(0.0, 2.0, b).astype(np.float32)
  valid = np.ones(b, bool)
  valid[-3:] = False
  adv, baseline = vcpo.opob_advantages(jnp.asarray(rewards), jnp.asarray(groups), jnp.asarray(sq),
                                       jnp.asarray(logw), None, None, valid_B=jnp.asarray(valid))
  logW = vcpo.opob_log_weights(jnp.asarray(sq), jnp.asarray(logw), None, None)
  got = vcpo.opob_moment_diagnostics(jnp.asarray(rewards), jnp.asarray(groups), logW, baseline, jnp.asarray(valid))
  ratio, share, count = _moment_diagnostics_numpy(rewards, groups, np.asarray(logW), np.asarray(baseline), valid)
  np.testing.assert_allclose(float(got["opob/moment_ratio"]), ratio, rtol=1e-5)
  np.testing.assert_allclose(float(got["opob/max_weight_share"]), share, rtol=1e-5)
  assert float(got["opob/groups_with_ratio"]) == count
  # OPOB's weighted-mean baseline minimises sum W (R - b)^2: it can only match or beat the group mean.
  assert float(got["opob/moment_ratio"]) <= 1.0 + 1e-6
  # The group mean as "baseline" gives exactly 1 wherever the ratio is defined.
  mean_B = np.array([rewards[valid & (groups == g)].mean() if valid[i] else 0.0 for i, g in enumerate(groups)])
  same = vcpo.opob_moment_diagnostics(jnp.asarray(rewards), jnp.asarray(groups), logW,
                                      jnp.asarray(mean_B, jnp.float32), jnp.asarray(valid))
  np.testing.assert_allclose(float(same["opob/moment_ratio"]), 1.0, rtol=1e-5)
