"""Tests for losses.py: every estimator, loss, gradient and aggregation against float64 numpy formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.algo import advantages
from vcpo_jax.algo import losses
from vcpo_jax.algo import vcpo

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


def test_registry_facts_and_option_errors():
  facts = lambda reg, fact, **o: sorted(n for n in reg if reg.get(n).fact(fact, reg.get(n).make_options(o)))
  assert facts(losses.POLICY_LOSSES, 'seq_coefficient') == ['pg', 'seq_tis', 'topr', 'vcpo']
  assert facts(losses.POLICY_LOSSES, 'batch_global') == ['m2po']
  assert facts(losses.POLICY_LOSSES, 'uses_tau') == ['seq_tis', 'vcpo']
  assert facts(losses.ADVANTAGE_ESTIMATORS, 'group_local') == ['dr_grpo', 'grpo', 'opob', 'rloo']
  assert facts(losses.ADVANTAGE_ESTIMATORS, 'batch_global') == ['reinforce']
  assert facts(losses.ADVANTAGE_ESTIMATORS, 'needs_grad_norms') == ['opob']
  opob = losses.ADVANTAGE_ESTIMATORS.get('opob')   # facts may depend on the options
  assert opob.fact('batch_global', opob.make_options({'scope': 'minibatch'}))
  assert not opob.fact('group_local', opob.make_options({'scope': 'minibatch'}))
  reinforce = losses.ADVANTAGE_ESTIMATORS.get('reinforce')
  assert not reinforce.fact('batch_global', reinforce.make_options({'baseline': False}))
  # Unknown options name the option and list the known ones.
  with pytest.raises(ValueError, match=r"'clip_eps_lo'.*known options: \['clip_eps_low', 'clip_eps_high'"):
    losses.POLICY_LOSSES.get('ppo').make_options({'clip_eps_lo': 0.1})
  with pytest.raises(ValueError, match=r"\['baselin'\].*\['baseline'\]"):
    losses.get_advantage_fn('reinforce')(advantages.AdvantageInputs(rewards_B=_j(np.zeros(2)), group_B=jnp.zeros(2)),
                                         baselin=True)
  with pytest.raises(ValueError, match='fact'):
    losses.POLICY_LOSSES.register('x', batch_globl=True)


def test_a_new_loss_is_one_function_and_its_registration():
  """What a new loss needs: an options dataclass, a function, a registration with its facts."""
  import dataclasses
  from vcpo_jax import registry

  reg = registry.Registry('policy loss')

  @dataclasses.dataclass(frozen=True)
  class ScaledOptions:
    scale: float = 2.0

  @reg.register('scaled_pg', options=ScaledOptions, seq_coefficient=True)
  def scaled_pg(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o):
    return -o.scale * adv_B[:, None] * logp_BxT * mask_BxT, mask_BxT, {}

  entry = reg.get('scaled_pg')
  assert entry.fact('seq_coefficient') and not entry.fact('batch_global') and entry.option_names() == ['scale']
  logp, mu, _, _, mask, adv = _batch(17)
  out, _, _ = entry.fn(_j(logp), _j(mu), _j(mask), _j(adv), None, entry.make_options({'scale': 3.0}))
  np.testing.assert_allclose(np.asarray(out), -3.0 * adv[:, None] * logp * mask, rtol=1e-6)


def test_kl_k3_term_is_composable():
  logp, mu, _, ref, mask, adv = _batch(9)
  base, _, _, gbase = _run('vcpo', logp, mu, mask, adv)
  loss, _, aux, grad = _run('vcpo', logp, mu, mask, adv, ref_logp_BxT=_j(ref), kl_beta=0.05)
  k3 = np.exp(ref - logp) - (ref - logp) - 1
  assert np.all(k3 >= 0)
  np.testing.assert_allclose(loss - base, 0.05 * k3 * mask, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(grad - gbase, 0.05 * (1 - np.exp(ref - logp)) * mask, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(aux['kl_k3']), (k3 * mask).sum() / mask.sum(), rtol=1e-5)
  with pytest.raises(ValueError, match='ref_logp_BxT'):
    losses.get_policy_loss('vcpo')(_j(logp), _j(mu), _j(mask), _j(adv), kl_beta=0.1)


def test_kl_k3_is_masked_before_it_is_formed():
  """A NaN reference log-prob off the mask (padding, prompt) must give neither a NaN loss nor a NaN gradient."""
  logp, mu, _, ref, mask, adv = _batch(9)
  ref = np.where(mask > 0, ref, np.nan)
  fn = losses.get_policy_loss('vcpo')
  total = lambda lp: jnp.sum(fn(lp, _j(mu), _j(mask), _j(adv), ref_logp_BxT=_j(ref), kl_beta=0.05)[0])
  grad = np.asarray(jax.grad(total)(_j(logp)))
  assert np.all(np.isfinite(grad)) and np.isfinite(float(total(_j(logp))))
  k3_grad = 0.05 * (1 - np.exp(np.nan_to_num(ref) - logp)) * mask
  np.testing.assert_allclose(grad, -(np.minimum(np.exp(np.clip(np.nansum((logp - mu) * mask, -1), -20, 20)), 8.0)
                                     * adv)[:, None] * mask + k3_grad, rtol=1e-4, atol=1e-6)


def test_dr_grpo_divides_by_the_given_budget_only():
  """'seq-mean-token-sum-norm' (Dr.GRPO): token sums / the generation budget, a constant it must be given (no
  batch statistic such as the longest response or the row width stands in for it)."""
  rng = np.random.default_rng(14)
  x = rng.normal(size=(B, T))
  _, _, _, _, mask, _ = _batch(14)      # responses start after a prompt of 1-3 tokens
  seqs = [i for i in range(B) if mask[i].sum() > 0]
  np.testing.assert_allclose(float(losses.aggregate(_j(x), _j(mask), 'seq-mean-token-sum-norm', max_len=24)),
                             np.mean([(x[i] * mask[i]).sum() / 24 for i in seqs]), rtol=1e-5)
  with pytest.raises(ValueError, match='max_len'):
    losses.aggregate(_j(x), _j(mask), 'seq-mean-token-sum-norm')
  with pytest.raises(ValueError, match='max_len'):
    losses.aggregate(_j(x), _j(mask), 'seq-mean-token-sum-norm', max_len=0)


def test_all_losses_jit_and_stay_finite_for_extreme_ratios():
  logp, mu, prox, _, mask, adv = _batch(10)
  mu = np.where(mask > 0, mu - 1e4 * (np.arange(B)[:, None] % 2), mu)  # log-ratios of ~1e4
  for name in losses.POLICY_LOSSES:
    fn = jax.jit(losses.get_policy_loss(name))
    loss, lmask, aux = fn(_j(logp), _j(mu), _j(mask), _j(adv), prox_logp_BxT=_j(prox))
    assert np.all(np.isfinite(np.asarray(loss))), name
    assert all(np.isfinite(float(v)) for v in aux.values()), name


# --------------------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------------------

def test_aggregations_match_numpy():
  rng = np.random.default_rng(11)
  x = rng.normal(size=(B, T))
  _, _, _, _, mask, _ = _batch(11)
  seqs = [i for i in range(B) if mask[i].sum() > 0]
  np.testing.assert_allclose(float(losses.aggregate(_j(x), _j(mask), 'token-mean')), (x * mask).sum() / mask.sum(),
                             rtol=1e-5)
  np.testing.assert_allclose(float(losses.aggregate(_j(x), _j(mask), 'seq-mean-token-mean')),
                             np.mean([(x[i] * mask[i]).sum() / mask[i].sum() for i in seqs]), rtol=1e-5)
  np.testing.assert_allclose(float(losses.aggregate(_j(x), _j(mask), 'seq-mean-token-sum-norm', max_len=32)),
                             np.mean([(x[i] * mask[i]).sum() / 32 for i in seqs]), rtol=1e-5)
  with pytest.raises(ValueError, match='mode'):
    losses.aggregate(_j(x), _j(mask), 'sum')


# --------------------------------------------------------------------------------------------------------
# advantage estimators
# --------------------------------------------------------------------------------------------------------

def _adv_inputs(seed=12):
  rng = np.random.default_rng(seed)
  group = np.repeat(rng.permutation(50)[:4], [4, 4, 3, 1])[rng.permutation(12)]
  rewards = rng.normal(size=12)
  valid = np.ones(12, bool)
  valid[rng.integers(0, 12)] = False
  return group, rewards, valid


def test_group_estimators_match_numpy_loops():
  group, rewards, valid = _adv_inputs()
  inputs = advantages.AdvantageInputs(rewards_B=_j(rewards), group_B=jnp.asarray(group), valid_B=jnp.asarray(valid))
  got = {name: np.asarray(jax.jit(losses.get_advantage_fn(name))(inputs))
         for name in ('grpo', 'dr_grpo', 'rloo', 'reinforce')}
  exp = {k: np.zeros(12) for k in got}
  for i in np.flatnonzero(valid):
    same = (group == group[i]) & valid
    r = rewards[same]
    if r.size > 1:
      exp['grpo'][i] = (rewards[i] - r.mean()) / (r.std(ddof=1) + 1e-6)
      exp['dr_grpo'][i] = rewards[i] - r.mean()
      others = same.copy()
      others[i] = False
      exp['rloo'][i] = rewards[i] - rewards[others].mean()
    else:
      exp['grpo'][i] = rewards[i] / (1 + 1e-6)
      exp['dr_grpo'][i] = exp['rloo'][i] = rewards[i]
    exp['reinforce'][i] = rewards[i] - rewards[valid].mean()
  for name in got:
    np.testing.assert_allclose(got[name], exp[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_opob_estimator_and_registry_errors():
  group, rewards, valid = _adv_inputs(13)
  rng = np.random.default_rng(13)
  logw = _j(rng.normal(size=12))
  wt = vcpo.truncated_weights(logw)
  inputs = advantages.AdvantageInputs(rewards_B=_j(rewards), group_B=jnp.asarray(group), logw_B=logw, wt_B=wt,
                                  lengths_B=_j(rng.integers(1, 9, 12)), sq_norms_B=_j(rng.gamma(2.0, size=12)),
                                  valid_B=jnp.asarray(valid))
  got = losses.get_advantage_fn('opob')(inputs, aggregation='median', is_weight='truncated')
  exp, _ = vcpo.opob_advantages(inputs.rewards_B, inputs.group_B, inputs.sq_norms_B, logw, wt, inputs.lengths_B,
                                aggregation='median', is_weight='truncated', valid_B=inputs.valid_B)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
  assert losses.needs_grad_norms('opob') and not losses.needs_grad_norms('grpo')
  with pytest.raises(ValueError, match='sq_norms_B'):
    losses.get_advantage_fn('opob')(advantages.AdvantageInputs(rewards_B=_j(rewards), group_B=jnp.asarray(group)))
  with pytest.raises(ValueError, match='grpo'):  # the message lists the known names
    losses.get_advantage_fn('ppo')
  with pytest.raises(ValueError, match='aggregation'):
    losses.get_advantage_fn('opob')(inputs, aggregation='max')
  with pytest.raises(ValueError, match='norm_by_sd'):
    losses.get_advantage_fn('grpo')(inputs, norm_by_sd=True)
  with pytest.raises(ValueError, match='vcpo'):
    losses.get_policy_loss('reinforce_plus')
  with pytest.raises(ValueError, match='tau_max'):
    losses.get_policy_loss('vcpo')(_j(np.zeros((2, 3))), _j(np.zeros((2, 3))), _j(np.ones((2, 3))),
                                   _j(np.zeros(2)), tau_max=3.0)
  with pytest.raises(ValueError, match='adv_B'):
    losses.get_policy_loss('vcpo')(_j(np.zeros((2, 3))), _j(np.zeros((2, 3))), _j(np.ones((2, 3))), _j(np.zeros(3)))
  with pytest.raises(ValueError, match='rollout_is'):
    losses.get_policy_loss('gspo')(_j(np.zeros((2, 3))), _j(np.zeros((2, 3))), _j(np.ones((2, 3))),
                                   _j(np.zeros(2)), rollout_is='seq')


@pytest.mark.slow
def test_dr_grpo_step_divides_by_generation_budget():
  """Dr.GRPO's normalizer is a constant: the learner step's 'seq-mean-token-sum-norm' loss is each response's
  token sum / rl.max_new_tokens (the generation budget, via LearnerConfig.generation_budget), never the
  batch's longest response; whole batch and micro-batch chunks alike, against float64 numpy."""
  from vcpo_jax.learner import config as learner_config
  from vcpo_jax.learner import optimizer as optimizer_lib
  from vcpo_jax.learner import step as step_lib
  from vcpo_jax.learner import train_state
  from vcpo_jax.learner.batch import RLBatch
  from vcpo_jax.model import config as model_config
  from tests import model_jit

  cfg = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                                 num_kv_heads=1, head_dim=8, max_seq_len=32)
  rows, width, budget = 8, 12, 16            # every response is shorter than the budget (longest: 6 tokens)
  rng = np.random.default_rng(21)
  tokens_BxT = rng.integers(1, cfg.vocab_size, (rows, width)).astype(np.int32)
  mask_BxT = np.zeros((rows, width), np.float32)
  for i in range(rows - 1):                  # the last row has no response: it is not a sequence of the mean
    mask_BxT[i, 2:2 + 1 + i % 6] = 1
  rewards_B = rng.normal(size=rows).astype(np.float32)
  batch = RLBatch(tokens_BxT=tokens_BxT, mask_BxT=mask_BxT, sampler_logp_BxT=np.full((rows, width), -3.0, np.float32),
                  rewards_B=rewards_B, group_B=np.repeat(np.arange(rows // 4), 4).astype(np.int32),
                  lag_B=np.zeros(rows, np.float32), valid_B=np.ones(rows, np.float32))
  opt = optimizer_lib.build_optimizer(learning_rate=0.0, weight_decay=0.0, ess_scaling=False)
  params = model_jit.init_params(cfg, jax.random.PRNGKey(0))
  logp_BxT = np.asarray(model_jit.token_logprobs(params, cfg, jnp.asarray(tokens_BxT), jnp.asarray(mask_BxT)),
                        np.float64)
  # pg with reinforce advantages (A = R): loss = mean over non-empty rows of -R_i sum_t m_t logp_t / budget.
  seqs = [i for i in range(rows) if mask_BxT[i].sum() > 0]
  want = np.mean([-float(rewards_B[i]) * (logp_BxT[i] * mask_BxT[i]).sum() / budget for i in seqs])
  assert mask_BxT.sum(-1).max() < budget     # the old normalizer (the longest response) would differ
  for micro in (0, 4):
    lc = learner_config.LearnerConfig(advantage="reinforce", advantage_options=dict(baseline=False),
                                      policy_loss="pg", aggregation="seq-mean-token-sum-norm",
                                      generation_budget=budget, micro_batch_size=micro)
    state = train_state.create_train_state(cfg, opt, jax.random.PRNGKey(0))
    state = train_state.with_params(state, jax.tree.map(jnp.copy, params))  # the step donates the state
    _, metrics = step_lib.make_rl_step(cfg, lc, opt)(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=2e-5, err_msg=f"micro_batch_size={micro}")
  with pytest.raises(ValueError, match="generation_budget"):
    learner_config.LearnerConfig(aggregation="seq-mean-token-sum-norm")
  with pytest.raises(ValueError, match="generation_budget"):
    learner_config.LearnerConfig(aggregation="seq-mean-token-sum-norm", generation_budget=0)
