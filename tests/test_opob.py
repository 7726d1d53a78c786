"""OPOB (vcpo.opob_advantages) against float64 numpy formulas, brute-force grids and sharded execution."""
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.conftest import skip_if_not_enough_devices
from test_vcpo import IS_WEIGHTS, np_aggregate, np_is_factor, random_batch
from vcpo_jax.algo import vcpo


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
