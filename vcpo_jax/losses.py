"""Advantage estimators and off-policy policy losses registered by name, loss aggregation and k3 KL."""
import dataclasses
import functools
import inspect
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from vcpo_jax import vcpo

LOG_CLIP = vcpo.LOG_W_CLIP   # every ratio is formed in log space and clipped to +-20 before exp
ROLLOUT_IS_LEVELS = ('none', 'token', 'sequence', 'geometric')
AGGREGATIONS = ('seq-mean-token-mean', 'token-mean', 'seq-mean-token-sum-norm')
sg = jax.lax.stop_gradient


# ----------------------------------------------------------------------------------------------------------
# Advantage estimators: fn(inputs, **options) -> adv_B
# ----------------------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
  """Per-sequence inputs shared by every estimator (B sequences; optional fields only some need)."""
  rewards_B: jax.Array
  group_B: jax.Array                        # prompt-group ids (any ints; dense ids not required)
  logw_B: Optional[jax.Array] = None        # sequence log IS weight (vcpo.seq_log_weights)
  wt_B: Optional[jax.Array] = None          # truncated weight (vcpo.truncated_weights)
  lengths_B: Optional[jax.Array] = None     # response lengths L_i
  sq_norms_B: Optional[jax.Array] = None    # ||grad sum_t m_t log pi||^2 per sequence (OPOB only)
  valid_B: Optional[jax.Array] = None       # False on padding rows (advantage 0, excluded from statistics)


def grpo(inputs: AdvantageInputs, *, norm_by_std: bool = True, unbiased_std: bool = True,
         eps: float = vcpo.GRPO_EPS) -> jax.Array:
  """(R - mean_g) / (std_g + eps) as in verl (unbiased std; singleton groups: mean 0, std 1)."""
  return vcpo.grpo_advantages(inputs.rewards_B, inputs.group_B, inputs.valid_B, norm_by_std=norm_by_std,
                              unbiased_std=unbiased_std, eps=eps)


def dr_grpo(inputs: AdvantageInputs) -> jax.Array:
  """Dr.GRPO: R - mean_g, no std division (pair it with 'seq-mean-token-sum-norm')."""
  return grpo(inputs, norm_by_std=False)


def rloo(inputs: AdvantageInputs) -> jax.Array:
  """RLOO: R_i - mean_{j != i in g} R_j = n/(n-1) (R_i - mean_g); singleton groups keep R (verl)."""
  rewards_B = inputs.rewards_B.astype(jnp.float32)
  valid_B = inputs.valid_B if inputs.valid_B is not None else jnp.ones(rewards_B.shape, bool)
  seg_B = vcpo.dense_group_ids(inputs.group_B)
  mean_B, _, n_B = vcpo.group_mean_std(rewards_B, seg_B, valid_B)
  adv_B = jnp.where(n_B > 1, (rewards_B - mean_B) * n_B / jnp.maximum(n_B - 1.0, 1.0), rewards_B)
  return jnp.where(valid_B, adv_B, 0.0)


def reinforce(inputs: AdvantageInputs, *, baseline: bool = True) -> jax.Array:
  """REINFORCE with the (valid) batch-mean reward as baseline, or raw rewards with baseline=False."""
  rewards_B = inputs.rewards_B.astype(jnp.float32)
  valid_B = inputs.valid_B if inputs.valid_B is not None else jnp.ones(rewards_B.shape, bool)
  if baseline:
    mean = jnp.sum(jnp.where(valid_B, rewards_B, 0.0)) / jnp.maximum(jnp.sum(valid_B), 1)
    rewards_B = rewards_B - mean
  return jnp.where(valid_B, rewards_B, 0.0)


def opob(inputs: AdvantageInputs, **options) -> jax.Array:
  """VCPO's off-policy optimal baseline (options: see vcpo.OPOBOptions)."""
  if inputs.sq_norms_B is None:
    raise ValueError("advantage estimator 'opob' needs inputs.sq_norms_B (per-sequence squared grad norms)")
  opts = vcpo.OPOBOptions(**options)
  adv_B, _ = vcpo.opob_advantages(
      inputs.rewards_B, inputs.group_B, inputs.sq_norms_B, inputs.logw_B, inputs.wt_B, inputs.lengths_B,
      scope=opts.scope, is_weight=opts.is_weight, normalize_by_length=opts.normalize_by_length,
      aggregation=opts.aggregation, norm_by_std=opts.norm_by_std, winsor_quantiles=tuple(opts.winsor_quantiles),
      valid_B=inputs.valid_B)
  return adv_B


ADVANTAGE_ESTIMATORS: Dict[str, Callable] = {
    'grpo': grpo, 'dr_grpo': dr_grpo, 'rloo': rloo, 'reinforce': reinforce, 'opob': opob}


def _lookup(kind: str, registry: Dict[str, Callable], name: str) -> Callable:
  if name not in registry:
    raise ValueError(f'unknown {kind} name={name!r}; known names: {sorted(registry)}')
  return registry[name]


def _check_options(kind: str, name: str, fn: Callable, options: dict, allowed_extra=()):
  """Unknown keyword options raise ValueError naming them (instead of a TypeError deep inside)."""
  params = inspect.signature(fn).parameters
  if any(p.kind == p.VAR_KEYWORD for p in params.values()):
    allowed = {f.name for f in dataclasses.fields(vcpo.OPOBOptions)} if fn is opob else None
  else:
    allowed = {k for k, p in params.items() if p.kind == p.KEYWORD_ONLY}
  if allowed is None:
    return
  bad = sorted(set(options) - allowed - set(allowed_extra))
  if bad:
    raise ValueError(f'{kind} {name!r} got unknown option(s) {bad}; accepted: {sorted(allowed | set(allowed_extra))}')


def get_advantage_fn(name: str) -> Callable:
  """The estimator `fn(inputs: AdvantageInputs, **options) -> adv_B` registered under `name`."""
  fn = _lookup('advantage estimator', ADVANTAGE_ESTIMATORS, name)

  @functools.wraps(fn)
  def checked(inputs: AdvantageInputs, **options):
    _check_options('advantage estimator', name, fn, options)
    return fn(inputs, **options)
  return checked


def needs_grad_norms(name: str) -> bool:
  """True when the estimator needs per-sequence squared gradient norms (the learner's extra pass)."""
  _lookup('advantage estimator', ADVANTAGE_ESTIMATORS, name)
  return name == 'opob'


# ----------------------------------------------------------------------------------------------------------
# Ratio helpers (log space, clipped before exp)
# ----------------------------------------------------------------------------------------------------------

def _masked(x_BxT, mask_BxT):
  return jnp.where(mask_BxT > 0, x_BxT, 0.0)


def _safe_exp(log_x):
  return jnp.exp(jnp.clip(log_x, -LOG_CLIP, LOG_CLIP))


def _log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT):
  """(log r_t = pi - prox, log rho_t = sg(prox - mu)); prox defaults to sg(pi), making r == 1."""
  logp_BxT = logp_BxT.astype(jnp.float32)
  prox_BxT = sg(logp_BxT) if prox_logp_BxT is None else sg(prox_logp_BxT.astype(jnp.float32))
  log_r_BxT = _masked(logp_BxT - prox_BxT, mask_BxT)
  log_rho_BxT = sg(_masked(prox_BxT - sampler_logp_BxT.astype(jnp.float32), mask_BxT))
  return log_r_BxT, log_rho_BxT


def _lengths(mask_BxT):
  return jnp.sum(mask_BxT.astype(jnp.float32), axis=-1)


def _seq_log_mean(log_x_BxT, mask_BxT):
  return jnp.sum(log_x_BxT, axis=-1) / jnp.maximum(_lengths(mask_BxT), 1.0)


def rollout_is_weights(log_rho_BxT, mask_BxT, level: str = 'token', threshold: Optional[float] = 2.0):
  """Stop-gradient truncated IS weight per token: token rho_t, sequence prod rho, or geometric mean."""
  if level not in ROLLOUT_IS_LEVELS:
    raise ValueError(f'rollout_is must be one of {ROLLOUT_IS_LEVELS}, got rollout_is={level!r}')
  if level == 'none':
    return jnp.ones_like(log_rho_BxT)
  if level == 'token':
    log_w_BxT = log_rho_BxT
  else:
    log_w_B = jnp.sum(log_rho_BxT, -1) if level == 'sequence' else _seq_log_mean(log_rho_BxT, mask_BxT)
    log_w_BxT = jnp.broadcast_to(log_w_B[:, None], log_rho_BxT.shape)
  w_BxT = _safe_exp(log_w_BxT)
  if threshold is not None:
    w_BxT = jnp.minimum(w_BxT, threshold)
  return sg(_masked(w_BxT, mask_BxT))


def _ppo_objective(log_r_BxT, adv_BxT, eps_low, eps_high):
  """min(r A, clip(r, 1-eps_low, 1+eps_high) A) and whether the clipped branch is the binding one."""
  r_BxT = _safe_exp(log_r_BxT)
  clipped_BxT = jnp.clip(r_BxT, 1.0 - eps_low, 1.0 + eps_high)
  obj_BxT = jnp.minimum(r_BxT * adv_BxT, clipped_BxT * adv_BxT)
  is_clipped_BxT = clipped_BxT * adv_BxT < r_BxT * adv_BxT
  return obj_BxT, is_clipped_BxT


def _masked_mean(x_BxT, mask_BxT):
  m = mask_BxT.astype(jnp.float32)
  return jnp.sum(x_BxT.astype(jnp.float32) * m) / jnp.maximum(jnp.sum(m), 1.0)


def _in_range_log(log_x, lo, hi):
  """lo <= exp(log_x) <= hi decided in log space; lo None means 1/hi."""
  lo = 1.0 / hi if lo is None else lo
  return (log_x >= jnp.log(jnp.float32(lo))) & (log_x <= jnp.log(jnp.float32(hi)))


# ----------------------------------------------------------------------------------------------------------
# Policy losses: fn(logp, sampler_logp, mask, adv_B, *, prox_logp_BxT=None, **options)
#   -> (per_token_loss_BxT, loss_mask_BxT, aux). loss_mask is `mask` minus tokens a loss rejects (MIS, M2PO);
#   aggregate with it. per_token_loss is already zero outside loss_mask.
# ----------------------------------------------------------------------------------------------------------

def vcpo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, tau: Optional[float] = 8.0):
  """REINFORCE with sequence TIS: l_t = -sg(wt_i A_i) log pi_t, wt_i = min(exp(clip(log w_i)), tau)."""
  pi_BxT = sg(logp_BxT) if prox_logp_BxT is None else prox_logp_BxT
  logw_B = sg(vcpo.seq_log_weights(pi_BxT, sampler_logp_BxT, mask_BxT))
  wt_B = vcpo.truncated_weights(logw_B, tau)
  coef_B = sg(wt_B * adv_B.astype(jnp.float32))
  loss_BxT = _masked(-coef_B[:, None] * logp_BxT.astype(jnp.float32), mask_BxT)
  has_tok_B = (_lengths(mask_BxT) > 0).astype(jnp.float32)
  n = jnp.maximum(jnp.sum(has_tok_B), 1.0)
  aux = {'is_weight_mean': jnp.sum(wt_B * has_tok_B) / n,
         'is_truncated_frac': (jnp.sum((logw_B > jnp.log(tau)) * has_tok_B) / n) if tau else jnp.float32(0.0)}
  return loss_BxT, mask_BxT.astype(jnp.float32), aux


def ppo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, clip_eps_low: float = 0.2,
             clip_eps_high: float = 0.2, rollout_is: str = 'none', rollout_is_threshold: Optional[float] = 2.0):
  """l_t = -w_t PPO(r_t) with an optional stop-gradient rollout IS weight w (token/sequence/geometric)."""
  log_r_BxT, log_rho_BxT = _log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  w_BxT = rollout_is_weights(log_rho_BxT, mask_BxT, rollout_is, rollout_is_threshold)
  obj_BxT, clipped_BxT = _ppo_objective(log_r_BxT, adv_B[:, None].astype(jnp.float32), clip_eps_low, clip_eps_high)
  aux = {'clip_frac': _masked_mean(clipped_BxT, mask_BxT), 'is_weight_mean': _masked_mean(w_BxT, mask_BxT)}
  return _masked(-w_BxT * obj_BxT, mask_BxT), mask_BxT.astype(jnp.float32), aux


def token_tis_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, tau: float = 2.0,
                   clip_eps_low: float = 0.2, clip_eps_high: float = 0.2):
  """Token TIS: l_t = -min(rho_t, C) PPO(r_t)."""
  return ppo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT=prox_logp_BxT,
                  clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, rollout_is='token',
                  rollout_is_threshold=tau)


def _mis_loss(level, logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, hi, lo, eps_low, eps_high):
  log_r_BxT, log_rho_BxT = _log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  if level == 'token':
    keep_BxT = _in_range_log(log_rho_BxT, lo, hi)
  else:
    log_x_B = jnp.sum(log_rho_BxT, -1) if level == 'sequence' else _seq_log_mean(log_rho_BxT, mask_BxT)
    keep_BxT = jnp.broadcast_to(_in_range_log(log_x_B, lo, hi)[:, None], mask_BxT.shape)
  loss_mask_BxT = mask_BxT.astype(jnp.float32) * keep_BxT
  obj_BxT, clipped_BxT = _ppo_objective(log_r_BxT, adv_B[:, None].astype(jnp.float32), eps_low, eps_high)
  aux = {'rejected_frac': 1.0 - _masked_mean(keep_BxT, mask_BxT), 'clip_frac': _masked_mean(clipped_BxT, loss_mask_BxT)}
  return _masked(-obj_BxT, loss_mask_BxT), loss_mask_BxT, aux


def seq_mis_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, hi: float = 2.0,
                 lo: Optional[float] = None, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2):
  """Sequence masked IS: drop sequences whose prod_t rho_t leaves [lo, hi] (lo = 1/hi), PPO on the rest."""
  return _mis_loss('sequence', logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, hi, lo,
                   clip_eps_low, clip_eps_high)


def token_mis_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, hi: float = 2.0,
                   lo: Optional[float] = None, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2):
  """Token masked IS: drop tokens whose rho_t leaves [lo, hi]."""
  return _mis_loss('token', logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, hi, lo,
                   clip_eps_low, clip_eps_high)


def geo_mis_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, hi: float = 1.001,
                 lo: Optional[float] = None, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2):
  """Geometric masked IS: drop sequences whose exp(mean_t log rho_t) leaves [lo, hi]."""
  return _mis_loss('geometric', logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, hi, lo,
                   clip_eps_low, clip_eps_high)


def ppo_decoupled_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None,
                       clip_eps_low: float = 0.2, clip_eps_high: float = 0.2,
                       behav_weight_cap: Optional[float] = None):
  """AReaL decoupled PPO: l_t = -(pi_prox/mu)_t PPO(pi/pi_prox); tokens with weight > cap are masked."""
  log_r_BxT, log_rho_BxT = _log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  loss_mask_BxT = mask_BxT.astype(jnp.float32)
  if behav_weight_cap is not None:
    loss_mask_BxT = loss_mask_BxT * (log_rho_BxT <= jnp.log(jnp.float32(behav_weight_cap)))
  w_BxT = _safe_exp(log_rho_BxT)
  obj_BxT, clipped_BxT = _ppo_objective(log_r_BxT, adv_B[:, None].astype(jnp.float32), clip_eps_low, clip_eps_high)
  aux = {'clip_frac': _masked_mean(clipped_BxT, loss_mask_BxT), 'is_weight_mean': _masked_mean(w_BxT, loss_mask_BxT),
         'rejected_frac': 1.0 - _masked_mean(loss_mask_BxT, mask_BxT)}
  return _masked(-w_BxT * obj_BxT, loss_mask_BxT), loss_mask_BxT, aux


def m2po_mask(log_rho_BxT, mask_BxT, tau: float = 0.04):
  """M2PO: mask the tokens with the largest (log mu - log pi_prox)^2 until the kept mean is <= tau (global)."""
  d2_N = jnp.where(mask_BxT > 0, jnp.square(log_rho_BxT), -jnp.inf).reshape(-1)
  n_total = d2_N.shape[0]
  order_N = jnp.argsort(-d2_N)                      # largest first, masked-out (-inf) last
  sorted_N = jnp.where(jnp.isfinite(d2_N[order_N]), d2_N[order_N], 0.0)
  n_valid = jnp.sum(mask_BxT > 0)
  suffix_N = jnp.cumsum(sorted_N[::-1])[::-1]      # sum of the kept set when the top-k are masked
  k_N = jnp.arange(n_total)
  kept_mean_N = suffix_N / jnp.maximum(n_valid - k_N, 1)
  ok_N = (kept_mean_N <= tau) & (k_N < n_valid)
  k_star = jnp.where(jnp.any(ok_N), jnp.argmax(ok_N), n_valid)   # smallest such k (mask all if none)
  rank_N = jnp.zeros((n_total,), jnp.int32).at[order_N].set(jnp.arange(n_total, dtype=jnp.int32))
  keep_N = rank_N >= k_star
  return (keep_N.reshape(mask_BxT.shape) & (mask_BxT > 0)).astype(jnp.float32)


def m2po_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, tau: float = 0.04):
  """M2PO: l_t = -M_t rho_t r_t A_i (no clipping), M from the second-moment trust mask."""
  log_r_BxT, log_rho_BxT = _log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  loss_mask_BxT = m2po_mask(log_rho_BxT, mask_BxT, tau) * mask_BxT.astype(jnp.float32)
  loss_BxT = -_safe_exp(log_rho_BxT) * _safe_exp(log_r_BxT) * adv_B[:, None].astype(jnp.float32)
  aux = {'rejected_frac': 1.0 - _masked_mean(loss_mask_BxT, mask_BxT)}
  return _masked(loss_BxT, loss_mask_BxT), loss_mask_BxT, aux


def gspo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, clip_eps_low: float = 3e-4,
              clip_eps_high: float = 4e-4, rollout_is: str = 'token', rollout_is_threshold: Optional[float] = 2.0):
  """GSPO: s_i = exp(mean_t log r_t); l = -min(s A, clip(s) A), applied per token as sg(s_i) pi_t/sg(pi_t)."""
  log_r_BxT, log_rho_BxT = _log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  logp_BxT = logp_BxT.astype(jnp.float32)
  log_s_B = _seq_log_mean(log_r_BxT, mask_BxT)
  log_s_BxT = _masked(sg(log_s_B)[:, None] + logp_BxT - sg(logp_BxT), mask_BxT)
  w_BxT = rollout_is_weights(log_rho_BxT, mask_BxT, rollout_is, rollout_is_threshold)
  obj_BxT, clipped_BxT = _ppo_objective(log_s_BxT, adv_B[:, None].astype(jnp.float32), clip_eps_low, clip_eps_high)
  aux = {'clip_frac': _masked_mean(clipped_BxT, mask_BxT), 'is_weight_mean': _masked_mean(w_BxT, mask_BxT)}
  return _masked(-w_BxT * obj_BxT, mask_BxT), mask_BxT.astype(jnp.float32), aux


def cispo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, clip_eps_low: float = 1.0,
               clip_eps_high: float = 0.28, rollout_is: str = 'token', rollout_is_threshold: Optional[float] = 2.0):
  """CISPO: l_t = -sg(clip(r_t, 1-eps_low, 1+eps_high)) A log pi_t (times the rollout IS weight)."""
  log_r_BxT, log_rho_BxT = _log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  r_BxT = _safe_exp(log_r_BxT)
  clipped_BxT = sg(jnp.clip(r_BxT, 1.0 - clip_eps_low, 1.0 + clip_eps_high))
  w_BxT = rollout_is_weights(log_rho_BxT, mask_BxT, rollout_is, rollout_is_threshold)
  loss_BxT = -w_BxT * clipped_BxT * adv_B[:, None].astype(jnp.float32) * logp_BxT.astype(jnp.float32)
  aux = {'clip_frac': _masked_mean(clipped_BxT != r_BxT, mask_BxT), 'is_weight_mean': _masked_mean(w_BxT, mask_BxT)}
  return _masked(loss_BxT, mask_BxT), mask_BxT.astype(jnp.float32), aux


def topr_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None):
  """TOPR: l_t = -sg(alpha_i) A_i log pi_t, alpha = 1 if A >= 0 else clip(pi(y)/mu(y), 0, 1) (sequence)."""
  pi_BxT = sg(logp_BxT) if prox_logp_BxT is None else prox_logp_BxT
  logw_B = sg(vcpo.seq_log_weights(pi_BxT, sampler_logp_BxT, mask_BxT))
  adv_B = adv_B.astype(jnp.float32)
  alpha_B = jnp.where(adv_B >= 0, 1.0, _safe_exp(jnp.minimum(logw_B, 0.0)))
  loss_BxT = _masked(-sg(alpha_B * adv_B)[:, None] * logp_BxT.astype(jnp.float32), mask_BxT)
  return loss_BxT, mask_BxT.astype(jnp.float32), {'alpha_mean': jnp.mean(alpha_B)}


POLICY_LOSSES: Dict[str, Callable] = {
    'vcpo': vcpo_loss, 'seq_tis': vcpo_loss, 'ppo': ppo_loss, 'token_tis': token_tis_loss,
    'seq_mis': seq_mis_loss, 'token_mis': token_mis_loss, 'geo_mis': geo_mis_loss,
    'ppo_decoupled': ppo_decoupled_loss, 'm2po': m2po_loss, 'gspo': gspo_loss, 'cispo': cispo_loss,
    'topr': topr_loss}


def kl_k3(logp_BxT, ref_logp_BxT):
  """k3 = pi_ref/pi - log(pi_ref/pi) - 1 >= 0, with the log-ratio clipped before exp."""
  log_ratio_BxT = jnp.clip(ref_logp_BxT.astype(jnp.float32) - logp_BxT.astype(jnp.float32), -LOG_CLIP, LOG_CLIP)
  return jnp.exp(log_ratio_BxT) - log_ratio_BxT - 1.0


def get_policy_loss(name: str) -> Callable:
  """Loss `fn(logp, sampler_logp, mask, adv_B, *, prox_logp_BxT=None, ref_logp_BxT=None, kl_beta=0.0, **opts)`.

  Returns (per_token_loss_BxT, loss_mask_BxT, aux); kl_beta > 0 adds beta * k3(ref) on loss_mask tokens.
  """
  fn = _lookup('policy loss', POLICY_LOSSES, name)

  @functools.wraps(fn)
  def loss_fn(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, *, prox_logp_BxT=None, ref_logp_BxT=None,
              kl_beta: float = 0.0, **options):
    _check_options('policy loss', name, fn, options)
    if logp_BxT.shape != sampler_logp_BxT.shape or logp_BxT.shape != mask_BxT.shape:
      raise ValueError(f'logp_BxT, sampler_logp_BxT and mask_BxT must share a shape, got {logp_BxT.shape}, '
                       f'{sampler_logp_BxT.shape}, {mask_BxT.shape}')
    if adv_B.shape != logp_BxT.shape[:1]:
      raise ValueError(f'adv_B must have shape {logp_BxT.shape[:1]}, got adv_B.shape={adv_B.shape}')
    loss_BxT, loss_mask_BxT, aux = fn(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT=prox_logp_BxT,
                                      **options)
    if kl_beta:
      if ref_logp_BxT is None:
        raise ValueError(f'kl_beta={kl_beta} needs ref_logp_BxT')
      k3_BxT = kl_k3(logp_BxT, ref_logp_BxT)
      loss_BxT = loss_BxT + _masked(kl_beta * k3_BxT, loss_mask_BxT)
      aux = dict(aux, kl_k3=_masked_mean(k3_BxT, loss_mask_BxT))
    return loss_BxT, loss_mask_BxT, aux
  return loss_fn


def aggregate(per_token_loss_BxT, mask_BxT, mode: str = 'seq-mean-token-mean', max_len: Optional[int] = None):
  """Scalar loss. 'seq-mean-token-mean': mean over sequences (with >= 1 token) of their token mean;
  'token-mean': mean over all tokens; 'seq-mean-token-sum-norm': mean over sequences of token sum / max_len
  (Dr.GRPO; max_len defaults to T)."""
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
  max_len = per_token_loss_BxT.shape[-1] if max_len is None else max_len
  if not max_len > 0:
    raise ValueError(f'max_len must be positive, got max_len={max_len!r}')
  return jnp.sum(sum_B) / max_len / n_seq
