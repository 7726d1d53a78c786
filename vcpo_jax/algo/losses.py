"""Entry points to the registered estimators and losses (options checked), loss aggregation and the k3 KL term."""
from typing import Any, Callable

import jax.numpy as jnp

from vcpo_jax.algo import advantages
from vcpo_jax.algo import policy_losses
from vcpo_jax.algo import ratios
from vcpo_jax.algo import vcpo
from vcpo_jax.algo.advantages import AdvantageInputs

LOG_CLIP = vcpo.LOG_W_CLIP
AGGREGATIONS = ('seq-mean-token-mean', 'token-mean', 'seq-mean-token-sum-norm')
ADVANTAGE_ESTIMATORS = advantages.ESTIMATORS   # registries: `name in`, iteration, .get(name) -> Entry
POLICY_LOSSES = policy_losses.LOSSES


# ------------------------------------------------------------------------------------- advantage estimators
def advantage_entry(name: str):
  return ADVANTAGE_ESTIMATORS.get(name)


def compute_advantages(name: str, inputs: AdvantageInputs, options: Any = None):
  """(adv_B, aux) of the estimator `name`; aux holds per-row extras for metrics (e.g. OPOB's baseline_B)."""
  entry = ADVANTAGE_ESTIMATORS.get(name)
  return entry.fn(inputs, entry.make_options(options))


def get_advantage_fn(name: str) -> Callable:
  """`fn(inputs: AdvantageInputs, **options) -> adv_B` of the estimator registered under `name`."""
  ADVANTAGE_ESTIMATORS.get(name)
  return lambda inputs, **options: compute_advantages(name, inputs, options)[0]


def needs_grad_norms(name: str, options: Any = None) -> bool:
  """True when the estimator needs per-sequence squared gradient norms (its registered fact)."""
  return ADVANTAGE_ESTIMATORS.get(name).fact('needs_grad_norms', options)


# ------------------------------------------------------------------------------------- policy losses
def kl_k3(logp_BxT, ref_logp_BxT, mask_BxT=None):
  """k3 = pi_ref/pi - log(pi_ref/pi) - 1 >= 0, log-ratio clipped before exp. With a mask, positions off it
  are 0 with zero gradient even when ref_logp there is NaN (masked before the term is formed)."""
  log_ratio_BxT = ref_logp_BxT.astype(jnp.float32) - logp_BxT.astype(jnp.float32)
  if mask_BxT is not None:
    log_ratio_BxT = jnp.where(mask_BxT > 0, log_ratio_BxT, 0.0)
  log_ratio_BxT = jnp.clip(log_ratio_BxT, -LOG_CLIP, LOG_CLIP)
  return jnp.exp(log_ratio_BxT) - log_ratio_BxT - 1.0


def _check_shapes(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B):
  if logp_BxT.shape != sampler_logp_BxT.shape or logp_BxT.shape != mask_BxT.shape:
    raise ValueError(f'logp_BxT, sampler_logp_BxT and mask_BxT must share a shape, got {logp_BxT.shape}, '
                     f'{sampler_logp_BxT.shape}, {mask_BxT.shape}')
  if adv_B.shape != logp_BxT.shape[:1]:
    raise ValueError(f'adv_B must have shape {logp_BxT.shape[:1]}, got adv_B.shape={adv_B.shape}')


def policy_loss_terms(name: str, logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, options: Any = None, *,
                      prox_logp_BxT=None, ref_logp_BxT=None, kl_beta: float = 0.0):
  """(per_token_loss_BxT, loss_mask_BxT, aux) of the loss `name` with typed or mapping options; kl_beta > 0
  adds beta * k3(ref) on loss_mask tokens."""
  entry = POLICY_LOSSES.get(name)
  opts = entry.make_options(options)
  _check_shapes(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B)
  loss_BxT, loss_mask_BxT, aux = entry.fn(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, opts)
  if kl_beta:
    if ref_logp_BxT is None:
      raise ValueError(f'kl_beta={kl_beta} needs ref_logp_BxT')
    k3_BxT = kl_k3(logp_BxT, ref_logp_BxT, loss_mask_BxT)
    loss_BxT = loss_BxT + kl_beta * k3_BxT * loss_mask_BxT
    aux = dict(aux, kl_k3=ratios.masked_mean(k3_BxT, loss_mask_BxT))
  return loss_BxT, loss_mask_BxT, aux


def get_policy_loss(name: str) -> Callable:
  """Loss `fn(logp, sampler_logp, mask, adv_B, *, prox_logp_BxT=None, ref_logp_BxT=None, kl_beta=0.0, **opts)`.

  Returns (per_token_loss_BxT, loss_mask_BxT, aux); unknown options are errors listing the known ones.
  """
  POLICY_LOSSES.get(name)

  def loss_fn(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, ref_logp_BxT=None,
              kl_beta: float = 0.0, **options):
    return policy_loss_terms(name, logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, options,
                             prox_logp_BxT=prox_logp_BxT, ref_logp_BxT=ref_logp_BxT, kl_beta=kl_beta)
  return loss_fn


# ------------------------------------------------------------------------------------- aggregation
def aggregate(per_token_loss_BxT, mask_BxT, mode: str = 'seq-mean-token-mean', max_len=None):
  """Scalar loss. 'seq-mean-token-mean': mean over sequences (with >= 1 token) of their token mean;
  'token-mean': mean over all tokens; 'seq-mean-token-sum-norm': mean over sequences of token sum / max_len
  (Dr.GRPO). max_len is the generation budget (rl.max_new_tokens) and is required: a constant, so a token's
  weight never depends on the other rows of the batch (the longest response would make it do so).
  """
  if mode not in AGGREGATIONS:
    raise ValueError(f'mode must be one of {AGGREGATIONS}, got mode={mode!r}')
  m_BxT = mask_BxT.astype(jnp.float32)
  sum_B = jnp.sum(per_token_loss_BxT.astype(jnp.float32) * m_BxT, axis=-1)
  len_B = jnp.sum(m_BxT, axis=-1)
  if mode == 'token-mean':
    return jnp.sum(sum_B) / jnp.maximum(jnp.sum(len_B), 1.0)
  has_B = (len_B > 0).astype(jnp.float32)
  n_seq = jnp.maximum(jnp.sum(has_B), 1.0)
  if mode == 'seq-mean-token-mean':
    return jnp.sum(sum_B / jnp.maximum(len_B, 1.0)) / n_seq
  if isinstance(max_len, bool) or not isinstance(max_len, (int, float)) or not max_len > 0:
    raise ValueError(f"mode={mode!r} needs max_len, the generation budget (rl.max_new_tokens) > 0; "
                     f"got max_len={max_len!r}")
  return jnp.sum(sum_B) / jnp.float32(max_len) / n_seq
