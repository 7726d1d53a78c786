"""Losses by name: registry facts, option errors, a new loss, the KL term, Dr. GRPO, aggregation, extremes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_losses import B, T, _batch, _j, _run
from vcpo_jax.algo import advantages
from vcpo_jax.algo import losses


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


@pytest.mark.slow
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
