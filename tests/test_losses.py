"""The policy losses (algo/policy_losses.py): values and d loss / d logp against float64 numpy formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.algo import losses

B, T = 6, 10


def _batch(seed=0, prox_scale=0.15):
  rng = np.random.default_rng(seed)
  logp = -rng.gamma(1.0, 1.0, size=(B, T))
  mu = logp + rng.normal(scale=0.4, size=(B, T))
  prox = logp + rng.normal(scale=prox_scale, size=(B, T))
  ref = logp + rng.normal(scale=0.3, size=(B, T))
  mask = np.zeros((B, T))
  for i in range(B - 1):                       # [prompt | response | pad]; the last row is empty
    start = rng.integers(1, 4)
    mask[i, start:start + rng.integers(2, T - start + 1)] = 1.0
  mu = np.where(mask > 0, mu, np.nan)          # garbage outside the response must not leak
  adv = rng.normal(size=B)
  return logp, mu, prox, ref, mask, adv


def _j(x):
  return jnp.asarray(x, jnp.float32)


def np_ppo_obj(log_r, adv, lo, hi):
  r = np.exp(np.clip(log_r, -20, 20))
  return np.minimum(r * adv, np.clip(r, 1 - lo, 1 + hi) * adv)


def np_ppo_grad(log_r, adv, lo, hi):
  """d/dlog r of min(r A, clip(r) A): r A where the unclipped branch binds, else 0."""
  r = np.exp(log_r)
  unclipped = r * adv <= np.clip(r, 1 - lo, 1 + hi) * adv
  return np.where(unclipped, r * adv, 0.0)


def _seq_mean(x, mask):
  return (x * mask).sum(-1) / np.maximum(mask.sum(-1), 1)


def _run(name, logp, mu, mask, adv, prox=None, **opts):
  fn = losses.get_policy_loss(name)
  out = fn(_j(logp), _j(mu), _j(mask), _j(adv), prox_logp_BxT=None if prox is None else _j(prox), **opts)
  grad = jax.grad(lambda lp: jnp.sum(fn(lp, _j(mu), _j(mask), _j(adv), prox_logp_BxT=None if prox is None
                                        else _j(prox), **opts)[0]))(_j(logp))
  return np.asarray(out[0]), np.asarray(out[1]), out[2], np.asarray(grad)


# --------------------------------------------------------------------------------------------------------
# policy losses: values and d loss / d logp against numpy formulas
# --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name', ['vcpo', 'seq_tis'])
@pytest.mark.parametrize('use_prox', [False, True])
def test_vcpo_loss(name, use_prox):
  logp, mu, prox, _, mask, adv = _batch(1)
  mu = np.where(mask > 0, mu - 0.4 * np.arange(B)[:, None], mu)  # some sequences hit the tau=8 truncation
  loss, lmask, aux, grad = _run(name, logp, mu, mask, adv, prox if use_prox else None, tau=8.0)
  pi = prox if use_prox else logp
  logw = np.nansum((pi - mu) * mask, -1)
  wt = np.minimum(np.exp(np.clip(logw, -20, 20)), 8.0)
  assert (logw > np.log(8.0)).any() and (logw < np.log(8.0)).any()
  np.testing.assert_allclose(loss, -(wt * adv)[:, None] * logp * mask, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, -(wt * adv)[:, None] * mask, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(lmask, mask)
  np.testing.assert_allclose(float(aux['is_weight_mean']), wt[:B - 1].mean(), rtol=1e-5)
  # The coefficient sg(wt A) is a constant: no gradient reaches the advantages or the proximal log-probs.
  fn = losses.get_policy_loss(name)
  g_adv, g_prox = jax.grad(lambda a, p: jnp.sum(fn(_j(logp), _j(mu), _j(mask), a, prox_logp_BxT=p)[0]),
                           argnums=(0, 1))(_j(adv), _j(prox))
  assert not np.any(np.asarray(g_adv)) and not np.any(np.asarray(g_prox))


def test_vcpo_gradient_through_toy_model_matches_formula():
  """grad of aggregated 'vcpo' loss = -(1/B) sum_i wt_i A_i (1/L_i) grad sum_t m_t log pi (numpy float64)."""
  rng = np.random.default_rng(2)
  V = 5
  theta = rng.normal(size=(T, V))
  tokens = rng.integers(0, V, size=(B, T))
  _, mu, _, _, mask, adv = _batch(2)
  mask[-1, 3:6] = 1.0  # every row has a response here, so B' = B

  def logp_fn(th):
    logsm_TxV = jax.nn.log_softmax(th, axis=-1)
    return logsm_TxV[jnp.arange(T)[None, :], jnp.asarray(tokens)]

  fn = losses.get_policy_loss('vcpo')
  mu_f = np.where(mask > 0, np.nan_to_num(mu, nan=-1.0), 0.0)

  def total(th):
    per_tok, lmask, _ = fn(logp_fn(th), _j(mu_f), _j(mask), _j(adv))
    return losses.aggregate(per_tok, lmask, 'seq-mean-token-mean')

  got = np.asarray(jax.grad(total)(_j(theta)))
  th = theta.astype(np.float64)
  sm = np.exp(th - th.max(-1, keepdims=True))
  sm /= sm.sum(-1, keepdims=True)
  logp = np.log(sm)[np.arange(T)[None, :], tokens]
  wt = np.minimum(np.exp(np.clip(((logp - mu_f) * mask).sum(-1), -20, 20)), 8.0)
  expected = np.zeros_like(th)
  for i in range(B):
    score = np.zeros_like(th)
    for t in range(T):
      if mask[i, t]:
        score[t] += np.eye(V)[tokens[i, t]] - sm[t]
    expected += -wt[i] * adv[i] / mask[i].sum() * score / B
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('use_prox', [False, True])
def test_token_tis_and_ppo(use_prox):
  logp, mu, prox, _, mask, adv = _batch(3, prox_scale=0.3)
  pi_old = prox if use_prox else logp
  loss, _, _, grad = _run('token_tis', logp, mu, mask, adv, prox if use_prox else None, tau=2.0)
  w = np.minimum(np.exp(np.nan_to_num(pi_old - mu)), 2.0) * mask
  log_r = (logp - pi_old) * mask
  np.testing.assert_allclose(loss, -w * np_ppo_obj(log_r, adv[:, None], 0.2, 0.2) * mask, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, -w * np_ppo_grad(log_r, adv[:, None], 0.2, 0.2) * mask, rtol=1e-5, atol=1e-6)
  if use_prox:  # the ratios really leave the clip range, so the clipped branch is exercised
    assert (np.abs(np.exp(log_r) - 1) > 0.2)[mask > 0].any()
  for level, agg in (('sequence', lambda x: x.sum(-1)), ('geometric', lambda x: _seq_mean(x, mask))):
    loss, _, _, _ = _run('ppo', logp, mu, mask, adv, prox, rollout_is=level, rollout_is_threshold=1.5)
    w = np.minimum(np.exp(agg(np.nan_to_num(prox - mu) * mask)), 1.5)[:, None] * mask
    np.testing.assert_allclose(loss, -w * np_ppo_obj((logp - prox) * mask, adv[:, None], 0.2, 0.2) * mask,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('name,level,hi', [('seq_mis', 'sequence', 2.0), ('token_mis', 'token', 1.3),
                                           ('geo_mis', 'geometric', 1.05)])
def test_masked_is_losses(name, level, hi):
  logp, mu, prox, _, mask, adv = _batch(4)
  log_rho = np.nan_to_num(prox - mu) * mask
  x = {'token': log_rho, 'sequence': log_rho.sum(-1)[:, None] + 0 * mask,
       'geometric': _seq_mean(log_rho, mask)[:, None] + 0 * mask}[level]
  keep = (np.exp(x) >= 1 / hi) & (np.exp(x) <= hi)
  exp_mask = mask * keep
  assert 0 < exp_mask.sum() < mask.sum()  # thresholds chosen so something is kept and something rejected
  loss, lmask, aux, grad = _run(name, logp, mu, mask, adv, prox, hi=hi)
  log_r = (logp - prox) * mask
  np.testing.assert_array_equal(lmask, exp_mask)
  np.testing.assert_allclose(loss, -np_ppo_obj(log_r, adv[:, None], 0.2, 0.2) * exp_mask, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, -np_ppo_grad(log_r, adv[:, None], 0.2, 0.2) * exp_mask, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(aux['rejected_frac']), 1 - exp_mask.sum() / mask.sum(), rtol=1e-5)


def test_ppo_decoupled():
  logp, mu, prox, _, mask, adv = _batch(5, prox_scale=0.3)
  rho = np.exp(np.nan_to_num(prox - mu)) * mask
  srt = np.sort(rho[mask > 0])
  cap = float(srt[len(srt) * 2 // 3] + srt[len(srt) * 2 // 3 + 1]) / 2  # between two weights: no ties
  keep = mask * (rho <= cap)
  loss, lmask, _, grad = _run('ppo_decoupled', logp, mu, mask, adv, prox, behav_weight_cap=cap)
  log_r = (logp - prox) * mask
  np.testing.assert_array_equal(lmask, keep)
  np.testing.assert_allclose(loss, -rho * np_ppo_obj(log_r, adv[:, None], 0.2, 0.2) * keep, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, -rho * np_ppo_grad(log_r, adv[:, None], 0.2, 0.2) * keep, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_m2po_mask_is_minimal_and_meets_threshold():
  logp, mu, prox, _, mask, adv = _batch(6)
  d2 = np.square(np.nan_to_num(mu - prox)) * mask
  tau = float(np.mean(d2[mask > 0])) * 0.5
  loss, lmask, _, grad = _run('m2po', logp, mu, mask, adv, prox, tau=tau)
  # Brute force: drop the largest d2 one at a time until the kept mean is <= tau.
  vals = np.sort(d2[mask > 0])[::-1]
  k = next(k for k in range(len(vals)) if vals[k:].mean() <= tau)
  assert lmask.sum() == len(vals) - k and k > 0
  kept_d2 = d2[lmask > 0]
  assert kept_d2.mean() <= tau and kept_d2.max() <= vals[k - 1]
  assert np.all(lmask <= mask)
  rho = np.exp(np.nan_to_num(prox - mu))
  r = np.exp(logp - prox)
  np.testing.assert_allclose(loss, -rho * r * adv[:, None] * lmask, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, -rho * r * adv[:, None] * lmask, rtol=1e-5, atol=1e-6)
  _, lmask_all, _, _ = _run('m2po', logp, mu, mask, adv, prox, tau=1e9)
  np.testing.assert_array_equal(lmask_all, mask)


def test_gspo():
  logp, mu, prox, _, mask, adv = _batch(7, prox_scale=0.002)
  loss, _, _, grad = _run('gspo', logp, mu, mask, adv, prox, rollout_is='token', rollout_is_threshold=2.0)
  log_s = _seq_mean((logp - prox) * mask, mask)[:, None]
  w = np.minimum(np.exp(np.nan_to_num(prox - mu)), 2.0) * mask
  np.testing.assert_allclose(loss, -w * np_ppo_obj(log_s + 0 * mask, adv[:, None], 3e-4, 4e-4) * mask,
                             rtol=1e-4, atol=1e-6)
  # Token-level GSPO gradient: s_i A_i on every token of an unclipped sequence, 0 where the clip binds.
  exp_grad = -w * np_ppo_grad(log_s + 0 * mask, adv[:, None], 3e-4, 4e-4) * mask
  np.testing.assert_allclose(grad, exp_grad, rtol=1e-4, atol=1e-6)
  clipped_rows = np.all(exp_grad[:B - 1] * mask[:B - 1] == 0, axis=-1)
  assert clipped_rows.any() and not clipped_rows.all()


def test_cispo_and_topr():
  logp, mu, prox, _, mask, adv = _batch(8, prox_scale=0.3)
  loss, _, _, grad = _run('cispo', logp, mu, mask, adv, prox, clip_eps_low=0.2, clip_eps_high=0.28,
                          rollout_is='none')
  c = np.clip(np.exp((logp - prox) * mask), 0.8, 1.28)
  np.testing.assert_allclose(loss, -c * adv[:, None] * logp * mask, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, -c * adv[:, None] * mask, rtol=1e-5, atol=1e-6)
  loss, _, _, grad = _run('topr', logp, mu, mask, adv)
  w = np.exp(np.nansum((logp - mu) * mask, -1))
  alpha = np.where(adv >= 0, 1.0, np.clip(w, 0, 1))
  np.testing.assert_allclose(grad, -(alpha * adv)[:, None] * mask, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(loss, -(alpha * adv)[:, None] * logp * mask, rtol=1e-5, atol=1e-6)


def test_pg_is_plain_reinforce_without_off_policy_correction():
  """'pg': l_t = -A_i log pi_t whatever the sampler's log-probs (stale samples treated as on-policy)."""
  logp, mu, prox, _, mask, adv = _batch(15)
  loss, lmask, aux, grad = _run('pg', logp, mu, mask, adv, prox)
  np.testing.assert_allclose(loss, -adv[:, None] * logp * mask, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad, -adv[:, None] * mask, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(lmask, mask)
  far, _, _, far_grad = _run('pg', logp, mu - 50.0, mask, adv)   # a very stale sampler changes nothing
  np.testing.assert_array_equal(far, loss)
  np.testing.assert_array_equal(far_grad, grad)
  assert aux == {}


def np_dual_clip_obj(log_r, adv, lo, hi, c):
  obj = np_ppo_obj(log_r, adv, lo, hi)
  return np.where(adv < 0, np.maximum(obj, c * adv), obj)


def test_dual_clip_ppo():
  """Dual-clip PPO: for A < 0 the objective is max(PPO, c A), so a huge ratio cannot blow up the loss."""
  logp, mu, prox, _, mask, adv = _batch(16, prox_scale=0.3)
  logp = np.where(np.arange(T)[None, :] % 3 == 0, logp + 2.0, logp)   # some ratios far above 1 + eps
  log_r = (logp - prox) * mask
  for c in (3.0, 1.5):
    loss, _, aux, grad = _run('dual_clip_ppo', logp, mu, mask, adv, prox, clip_c=c)
    obj = np_dual_clip_obj(log_r, adv[:, None], 0.2, 0.2, c)
    dual = (adv[:, None] < 0) & (np_ppo_obj(log_r, adv[:, None], 0.2, 0.2) < c * adv[:, None]) & (mask > 0)
    assert dual.any() and not dual[mask > 0].all()
    np.testing.assert_allclose(loss, -obj * mask, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, -np.where(dual, 0.0, np_ppo_grad(log_r, adv[:, None], 0.2, 0.2)) * mask,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(aux['dual_clip_frac']), dual.sum() / mask.sum(), rtol=1e-5)
  with pytest.raises(ValueError, match='clip_c'):
    _run('dual_clip_ppo', logp, mu, mask, adv, prox, clip_c=0.5)
