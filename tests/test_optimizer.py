"""Tests for optimizer.py: the ESS-scaled chain against independently built AdamW steps."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vcpo_jax.learner import optimizer

LR, WD, CLIP = 3e-2, 0.1, 1.0


def _params():
  rng = np.random.default_rng(0)
  return {'w': jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), 'b': jnp.asarray(rng.normal(size=(4,)), jnp.float32)}


def _grads(step):
  rng = np.random.default_rng(100 + step)
  return {'w': jnp.asarray(rng.normal(size=(3, 4)) * 2.0, jnp.float32),
          'b': jnp.asarray(rng.normal(size=(4,)) * 0.1, jnp.float32)}


RATIOS = [1.0, 0.5, 0.09, 0.7, 0.3, 1.0]


def _run_chain(tx, ratios, params=None, ess=None):
  params = _params() if params is None else params
  state = tx.init(params)
  step = jax.jit(lambda g, s, p, r, e: tx.update(g, s, p, ess_ratio=r, ess=e))
  for t, r in enumerate(ratios):
    updates, state = step(_grads(t), state, params, jnp.float32(r), jnp.float32(8.0 if ess is None else ess[t]))
    params = optax.apply_updates(params, updates)
  return params, state


def _numpy_adamw(lrs, b1=0.9, b2=0.999, eps=1e-8):
  """Float64 AdamW with global-norm clipping and the lr of step t equal to lrs[t]."""
  p = {k: np.asarray(v, np.float64) for k, v in _params().items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t, lr in enumerate(lrs):
    g = {k: np.asarray(x, np.float64) for k, x in _grads(t).items()}
    norm = np.sqrt(sum(np.square(x).sum() for x in g.values()))
    g = {k: x * min(1.0, CLIP / norm) for k, x in g.items()}
    for k in p:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * np.square(g[k])
      mhat, vhat = m[k] / (1 - b1 ** (t + 1)), v[k] / (1 - b2 ** (t + 1))
      p[k] = p[k] - lr * (mhat / (np.sqrt(vhat) + eps) + WD * p[k])
  return p


@pytest.mark.parametrize('rule,fn', [('sqrt', np.sqrt), ('linear', lambda s: s)])
@pytest.mark.slow
def test_chain_equals_adamw_with_scaled_learning_rate(rule, fn):
  base = 0.8
  tx = optimizer.build_optimizer(learning_rate=LR, weight_decay=WD, max_grad_norm=CLIP,
                                 ess=dict(base_ess_ratio=base, rule=rule))
  got, state = _run_chain(tx, RATIOS)
  scales = [fn(min(1.0, r / base)) for r in RATIOS]

  # Independent construction 1: optax.adamw with its learning rate overwritten each step.
  ref_tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.inject_hyperparams(optax.adamw)(
      learning_rate=LR, weight_decay=WD))
  params, ref_state = _params(), None
  ref_state = ref_tx.init(params)
  for t, s in enumerate(scales):
    ref_state[1].hyperparams['learning_rate'] = jnp.float32(LR * s)
    updates, ref_state = ref_tx.update(_grads(t), ref_state, params)
    params = optax.apply_updates(params, updates)
  # Independent construction 2: float64 numpy AdamW.
  np_params = _numpy_adamw([LR * s for s in scales])
  for k in got:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(params[k]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[k]), np_params[k], rtol=1e-4, atol=1e-5)
  assert float(optimizer.last_ess_scale(state)) == pytest.approx(scales[-1], rel=1e-6)


def test_auto_base_takes_first_valid_ratio():
  tx = optimizer.scale_by_ess('auto')
  state = tx.init(None)
  assert np.isnan(float(state.base_ess_ratio))
  ones = {'x': jnp.ones(3)}
  upd, state = tx.update(ones, state, ess_ratio=jnp.float32(np.nan))
  assert float(state.last_scale) == 0.0 and np.all(np.asarray(upd['x']) == 0) and np.isnan(float(state.base_ess_ratio))
  upd, state = tx.update(ones, state, ess_ratio=0.4)
  assert float(state.base_ess_ratio) == pytest.approx(0.4) and float(state.last_scale) == pytest.approx(1.0)
  upd, state = tx.update(ones, state, ess_ratio=0.1)
  assert float(state.base_ess_ratio) == pytest.approx(0.4)
  np.testing.assert_allclose(np.asarray(upd['x']), np.full(3, np.sqrt(0.25)), rtol=1e-6)
  assert int(state.count) == 3


def test_trigger_gives_full_step_above_threshold():
  tx = optimizer.scale_by_ess(0.5, 'sqrt', trigger=1 / 3)
  state = tx.init(None)
  g = {'x': jnp.full((2,), 2.0)}
  upd, state = tx.update(g, state, ess_ratio=0.25)   # ratio/base = 0.5 >= 1/3: full step
  np.testing.assert_allclose(np.asarray(upd['x']), [2.0, 2.0])
  upd, state = tx.update(g, state, ess_ratio=0.1)    # ratio/base = 0.2 < 1/3: sqrt(0.2)
  np.testing.assert_allclose(np.asarray(upd['x']), np.full(2, 2.0 * np.sqrt(0.2)), rtol=1e-6)
  assert float(state.last_scale) == pytest.approx(np.sqrt(0.2))


def test_zero_trigger_and_zero_floor_are_off():
  off = optimizer.scale_by_ess(0.5, 'sqrt', trigger=0.0, min_ess_floor=0.0, min_ess_factor=0.0)
  g = {'x': jnp.full((2,), 2.0)}
  upd, _ = off.update(g, off.init(None), ess_ratio=0.1)   # no ess needed with the brake off
  np.testing.assert_allclose(np.asarray(upd['x']), np.full(2, 2.0 * np.sqrt(0.2)), rtol=1e-6)


def test_min_ess_brake_and_nan_handling():
  tx = optimizer.scale_by_ess(1.0, 'linear', min_ess_floor=1.1, min_ess_factor=0.5)
  state = tx.init(None)
  g = {'x': jnp.ones(())}
  cases = [  # (ess_ratio, ess, expected scale)
      (0.6, 5.0, 0.6), (0.6, 1.05, 0.3), (0.6, 1.1, 0.3), (0.6, np.nan, 0.3),
      (np.nan, 5.0, 0.0), (np.inf, 5.0, 0.0), (-np.inf, 5.0, 0.0), (2.0, 5.0, 1.0), (0.0, 5.0, 0.0)]
  step = jax.jit(lambda s, r, e: tx.update(g, s, ess_ratio=r, ess=e))
  for ratio, ess, expected in cases:
    upd, state = step(state, jnp.float32(ratio), jnp.float32(ess))
    assert float(upd['x']) == pytest.approx(expected), (ratio, ess)
    assert float(state.last_scale) == pytest.approx(expected)


def test_non_finite_ratio_never_gives_full_step_in_chain():
  tx = optimizer.build_optimizer(learning_rate=LR)
  params = _params()
  state = tx.init(params)
  updates, state = tx.update(_grads(0), state, params, ess_ratio=jnp.float32(np.nan))
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  assert float(optimizer.last_ess_scale(state)) == 0.0


def test_chain_without_ess_scaling_accepts_and_ignores_ess_args():
  tx = optimizer.build_optimizer(learning_rate=LR, weight_decay=WD, ess_scaling=False)
  got, state = _run_chain(tx, [0.01, 0.02, np.nan])
  expected = _numpy_adamw([LR] * 3)
  for k in got:
    np.testing.assert_allclose(np.asarray(got[k]), expected[k], rtol=1e-4, atol=1e-5)
  assert optimizer.last_ess_scale(state) is None


def test_bad_arguments_raise_value_error_naming_field():
  with pytest.raises(ValueError, match='rule'):
    optimizer.scale_by_ess(1.0, 'cubic')
  for bad in (0.0, -1.0, 'half', float('nan')):
    with pytest.raises(ValueError, match='base_ess_ratio'):
      optimizer.scale_by_ess(bad)
  for bad in (-1.0, float('inf'), 'high', True):
    with pytest.raises(optimizer.ArgumentError, match=re.escape(f'trigger={bad!r}')):
      optimizer.scale_by_ess(1.0, trigger=bad)
  with pytest.raises(optimizer.ArgumentError, match='min_ess_floor=-0.1'):
    optimizer.scale_by_ess(1.0, min_ess_floor=-0.1)
  with pytest.raises(optimizer.ArgumentError, match='min_ess_factor=2.0'):
    optimizer.scale_by_ess(1.0, min_ess_floor=1.1, min_ess_factor=2.0)
  tx = optimizer.scale_by_ess(1.0, min_ess_floor=1.1, min_ess_factor=0.5)
  with pytest.raises(ValueError, match='ess'):
    tx.update({'x': jnp.ones(())}, tx.init(None), ess_ratio=0.5)
  with pytest.raises(ValueError, match='ess_ratio'):
    tx.update({'x': jnp.ones(())}, tx.init(None))
  with pytest.raises(optimizer.ArgumentError, match="name='linear_decay'"):
    optimizer.learning_rate_schedule('linear_decay', learning_rate=1.0)
  with pytest.raises(optimizer.ArgumentError, match='decay_steps=3'):
    optimizer.learning_rate_schedule('cosine', learning_rate=1.0, warmup_steps=5, decay_steps=3)
  for field, bad in (('warmup_steps', -1), ('decay_steps', 1.5), ('final_lr_fraction', -0.5)):
    with pytest.raises(optimizer.ArgumentError, match=re.escape(f'{field}={bad!r}')):
      optimizer.learning_rate_schedule('constant', learning_rate=1.0, **{field: bad})


def test_learning_rate_schedules():
  const = optimizer.learning_rate_schedule('constant', learning_rate=2e-3)
  warm = optimizer.learning_rate_schedule('warmup_constant', learning_rate=2e-3, warmup_steps=4)
  cos = optimizer.learning_rate_schedule('cosine', learning_rate=2e-3, warmup_steps=2, decay_steps=12,
                                         final_lr_fraction=0.05)
  for t in range(15):
    assert float(const(t)) == pytest.approx(2e-3)
    assert float(warm(t)) == pytest.approx(2e-3 * min(t, 4) / 4, abs=1e-9)
    if t <= 2:
      exp = 2e-3 * t / 2
    else:
      frac = min(t - 2, 10) / 10
      exp = 1e-4 + (2e-3 - 1e-4) * 0.5 * (1 + np.cos(np.pi * frac))
    assert float(cos(t)) == pytest.approx(exp, rel=1e-5, abs=1e-9)
  # A schedule plugs into the chain and is scaled by the ESS factor on top.
  tx = optimizer.build_optimizer(learning_rate=warm, weight_decay=0.0, max_grad_norm=None, ess=dict(base_ess_ratio=1.0))
  params = {'x': jnp.zeros(())}
  state = tx.init(params)
  for t in range(3):
    upd, state = tx.update({'x': jnp.ones(())}, state, params, ess_ratio=0.25)
  # Adam's normalised step for a constant gradient is ~1, so update ~ -lr(t=2) * sqrt(0.25).
  assert float(upd['x']) == pytest.approx(-2e-3 * 2 / 4 * 0.5, rel=1e-4)


def test_bfloat16_params_get_float32_state_and_small_steps_accumulate():
  """bf16 params at lr 1e-6: one Adam step (~1e-6) is below half a bf16 ulp of 7e-4 (1.9e-6), so without a
  float32 master copy every step rounds away and the params never move; the moments must be float32."""
  params = {'w': jnp.full((4,), 7e-4, jnp.bfloat16)}
  tx = optimizer.build_optimizer(learning_rate=1e-6, weight_decay=0.0, max_grad_norm=None, ess_scaling=False)
  state = tx.init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating))
  start = np.asarray(params['w'], np.float64)
  for _ in range(3):
    updates, state = tx.update({'w': jnp.ones((4,), jnp.bfloat16)}, state, params)
    params = optax.apply_updates(params, updates)
  assert params['w'].dtype == jnp.bfloat16
  moved = np.asarray(params['w'], np.float64) - start
  assert np.all(moved < 0), moved   # three accumulated steps of ~-1e-6 cross the rounding boundary
  np.testing.assert_allclose(moved, -3e-6, atol=2e-6)


def test_master_copy_made_under_jit_equals_the_bfloat16_params():
  """bf16 params drawn inside the same jit as optimizer.init: XLA may keep the
  unrounded float32 for the master (excess precision); the master must hold the bf16 values exactly, or the
  first update moves every param by up to half an ulp at any learning rate (here lr = 0)."""
  tx = optimizer.build_optimizer(learning_rate=0.0, weight_decay=0.0, ess_scaling=False)

  @jax.jit
  def init(key):
    params = {'w': 0.02 * jax.random.normal(key, (256,), jnp.bfloat16)}   # as flax initialises bf16 params
    return params, tx.init(params)

  params, state = init(jax.random.PRNGKey(0))
  np.testing.assert_array_equal(np.asarray(state.master['w']), np.asarray(params['w'], np.float32))
  updates, _ = jax.jit(tx.update)({'w': jnp.ones((256,), jnp.bfloat16)}, state, params)
  np.testing.assert_array_equal(np.asarray(optax.apply_updates(params, updates)['w'], np.float32),
                                np.asarray(params['w'], np.float32))
  reset = jax.jit(optimizer.reset_master)(state, params)
  np.testing.assert_array_equal(np.asarray(reset.master['w']), np.asarray(params['w'], np.float32))
