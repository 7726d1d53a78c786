"""Off-policy policy losses, registered with their facts and options: fn(logp, mu, mask, adv_B, prox, options).

Each returns (per_token_loss_BxT, loss_mask_BxT, aux): loss_mask is `mask` minus tokens a loss rejects (MIS,
M2PO); aggregate with it. per_token_loss is already zero outside loss_mask.
"""
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from vcpo_jax import registry
from vcpo_jax.algo import vcpo
from vcpo_jax.algo.ratios import adv_BxT, check_level, in_range_log, lengths, log_ratios, masked, masked_mean, ppo_objective, rollout_is_weights, safe_exp, seq_log_mean

LOSSES = registry.Registry("policy loss")
sg = jax.lax.stop_gradient


# ---------------------------------------------------------------------------------------- option types
@dataclasses.dataclass(frozen=True)
class TISOptions:
  tau: Optional[float] = 8.0          # truncation of the sequence weight (None: only the +-20 log clamp)


@dataclasses.dataclass(frozen=True)
class PPOOptions:
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  rollout_is: str = 'none'            # none | token | sequence | geometric (stop-gradient sampler correction)
  rollout_is_threshold: Optional[float] = 2.0

  def __post_init__(self):
    check_level(self.rollout_is)


@dataclasses.dataclass(frozen=True)
class TokenTISOptions:
  tau: float = 2.0                    # C in min(rho_t, C)
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2


@dataclasses.dataclass(frozen=True)
class MISOptions:
  hi: float = 2.0                     # keep ratios in [lo, hi]
  lo: Optional[float] = None          # None: 1 / hi
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2


@dataclasses.dataclass(frozen=True)
class GeoMISOptions(MISOptions):
  hi: float = 1.001


@dataclasses.dataclass(frozen=True)
class DecoupledOptions:
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  behav_weight_cap: Optional[float] = None   # tokens with pi_prox / mu above it are masked


@dataclasses.dataclass(frozen=True)
class M2POOptions:
  tau: float = 0.04                   # bound on the kept tokens' mean squared log ratio


@dataclasses.dataclass(frozen=True)
class GSPOOptions(PPOOptions):
  clip_eps_low: float = 3e-4
  clip_eps_high: float = 4e-4
  rollout_is: str = 'token'


@dataclasses.dataclass(frozen=True)
class CISPOOptions(PPOOptions):
  clip_eps_low: float = 1.0
  clip_eps_high: float = 0.28
  rollout_is: str = 'token'


@dataclasses.dataclass(frozen=True)
class DualClipOptions(PPOOptions):
  clip_c: float = 3.0                 # lower bound c * A on the objective of negative advantages (c > 1)

  def __post_init__(self):
    super().__post_init__()
    if not self.clip_c > 1.0:
      raise ValueError(f'clip_c must be > 1, got clip_c={self.clip_c!r}')


# ---------------------------------------------------------------------------------------- losses
@LOSSES.register('vcpo', options=TISOptions, seq_coefficient=True, uses_tau=True)
def vcpo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: TISOptions):
  """REINFORCE with sequence TIS: l_t = -sg(wt_i A_i) log pi_t, wt_i = min(exp(clip(log w_i)), tau)."""
  pi_BxT = sg(logp_BxT) if prox_logp_BxT is None else prox_logp_BxT
  logw_B = sg(vcpo.seq_log_weights(pi_BxT, sampler_logp_BxT, mask_BxT))
  wt_B = vcpo.truncated_weights(logw_B, o.tau)
  coef_B = sg(wt_B * adv_B.astype(jnp.float32))
  loss_BxT = masked(-coef_B[:, None] * logp_BxT.astype(jnp.float32), mask_BxT)
  has_tok_B = (lengths(mask_BxT) > 0).astype(jnp.float32)
  n = jnp.maximum(jnp.sum(has_tok_B), 1.0)
  aux = {'is_weight_mean': jnp.sum(wt_B * has_tok_B) / n,
         'is_truncated_frac': (jnp.sum((logw_B > jnp.log(o.tau)) * has_tok_B) / n) if o.tau else jnp.float32(0.0)}
  return loss_BxT, mask_BxT.astype(jnp.float32), aux


LOSSES.alias('seq_tis', 'vcpo')


@LOSSES.register('pg', seq_coefficient=True)
def pg_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: registry.NoOptions):
  """Plain REINFORCE, no off-policy correction (stale samples treated as on-policy): l_t = -sg(A_i) log pi_t."""
  del sampler_logp_BxT, prox_logp_BxT, o
  loss_BxT = masked(-sg(adv_B.astype(jnp.float32))[:, None] * logp_BxT.astype(jnp.float32), mask_BxT)
  return loss_BxT, mask_BxT.astype(jnp.float32), {}


@LOSSES.register('ppo', options=PPOOptions)
def ppo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: PPOOptions):
  """l_t = -w_t PPO(r_t) with an optional stop-gradient rollout IS weight w (token/sequence/geometric)."""
  log_r_BxT, log_rho_BxT = log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  return _is_weighted_ppo(log_r_BxT, log_rho_BxT, mask_BxT, adv_B, o)


def _is_weighted_ppo(log_ratio_BxT, log_rho_BxT, mask_BxT, adv_B, o):
  """-w_t PPO(ratio_t): the clipped objective of a (token or sequence) log-ratio, times the rollout IS weight."""
  w_BxT = rollout_is_weights(log_rho_BxT, mask_BxT, o.rollout_is, o.rollout_is_threshold)
  obj_BxT, clipped_BxT = ppo_objective(log_ratio_BxT, adv_BxT(adv_B), o.clip_eps_low, o.clip_eps_high)
  aux = {'clip_frac': masked_mean(clipped_BxT, mask_BxT), 'is_weight_mean': masked_mean(w_BxT, mask_BxT)}
  return masked(-w_BxT * obj_BxT, mask_BxT), mask_BxT.astype(jnp.float32), aux


@LOSSES.register('dual_clip_ppo', options=DualClipOptions)
def dual_clip_ppo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: DualClipOptions):
  """Dual-clip PPO: for A < 0 the PPO objective is bounded below by c A, l_t = -w_t max(PPO(r_t), c A)."""
  log_r_BxT, log_rho_BxT = log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  w_BxT = rollout_is_weights(log_rho_BxT, mask_BxT, o.rollout_is, o.rollout_is_threshold)
  a_BxT = adv_BxT(adv_B)
  obj_BxT, clipped_BxT = ppo_objective(log_r_BxT, a_BxT, o.clip_eps_low, o.clip_eps_high)
  dual_BxT = (a_BxT < 0) & (obj_BxT < o.clip_c * a_BxT)
  obj_BxT = jnp.where(dual_BxT, o.clip_c * a_BxT, obj_BxT)
  aux = {'clip_frac': masked_mean(clipped_BxT, mask_BxT), 'dual_clip_frac': masked_mean(dual_BxT, mask_BxT),
         'is_weight_mean': masked_mean(w_BxT, mask_BxT)}
  return masked(-w_BxT * obj_BxT, mask_BxT), mask_BxT.astype(jnp.float32), aux


@LOSSES.register('token_tis', options=TokenTISOptions)
def token_tis_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: TokenTISOptions):
  """Token TIS: l_t = -min(rho_t, C) PPO(r_t)."""
  return ppo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT,
                  PPOOptions(o.clip_eps_low, o.clip_eps_high, 'token', o.tau))


def _mis_loss(level, logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: MISOptions):
  log_r_BxT, log_rho_BxT = log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  if level == 'token':
    keep_BxT = in_range_log(log_rho_BxT, o.lo, o.hi)
  else:
    log_x_B = jnp.sum(log_rho_BxT, -1) if level == 'sequence' else seq_log_mean(log_rho_BxT, mask_BxT)
    keep_BxT = jnp.broadcast_to(in_range_log(log_x_B, o.lo, o.hi)[:, None], mask_BxT.shape)
  loss_mask_BxT = mask_BxT.astype(jnp.float32) * keep_BxT
  obj_BxT, clipped_BxT = ppo_objective(log_r_BxT, adv_BxT(adv_B), o.clip_eps_low, o.clip_eps_high)
  aux = {'rejected_frac': 1.0 - masked_mean(keep_BxT, mask_BxT),
         'clip_frac': masked_mean(clipped_BxT, loss_mask_BxT)}
  return masked(-obj_BxT, loss_mask_BxT), loss_mask_BxT, aux


@LOSSES.register('seq_mis', options=MISOptions)
def seq_mis_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: MISOptions):
  """Sequence masked IS: drop sequences whose prod_t rho_t leaves [lo, hi] (lo = 1/hi), PPO on the rest."""
  return _mis_loss('sequence', logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o)


@LOSSES.register('token_mis', options=MISOptions)
def token_mis_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: MISOptions):
  """Token masked IS: drop tokens whose rho_t leaves [lo, hi]."""
  return _mis_loss('token', logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o)


@LOSSES.register('geo_mis', options=GeoMISOptions)
def geo_mis_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: GeoMISOptions):
  """Geometric masked IS: drop sequences whose exp(mean_t log rho_t) leaves [lo, hi]."""
  return _mis_loss('geometric', logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o)


@LOSSES.register('ppo_decoupled', options=DecoupledOptions)
def ppo_decoupled_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: DecoupledOptions):
  """AReaL decoupled PPO: l_t = -(pi_prox/mu)_t PPO(pi/pi_prox); tokens with weight > cap are masked."""
  log_r_BxT, log_rho_BxT = log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  loss_mask_BxT = mask_BxT.astype(jnp.float32)
  if o.behav_weight_cap is not None:
    loss_mask_BxT = loss_mask_BxT * (log_rho_BxT <= jnp.log(jnp.float32(o.behav_weight_cap)))
  w_BxT = safe_exp(log_rho_BxT)
  obj_BxT, clipped_BxT = ppo_objective(log_r_BxT, adv_BxT(adv_B), o.clip_eps_low, o.clip_eps_high)
  aux = {'clip_frac': masked_mean(clipped_BxT, loss_mask_BxT), 'is_weight_mean': masked_mean(w_BxT, loss_mask_BxT),
         'rejected_frac': 1.0 - masked_mean(loss_mask_BxT, mask_BxT)}
  return masked(-w_BxT * obj_BxT, loss_mask_BxT), loss_mask_BxT, aux


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


@LOSSES.register('m2po', options=M2POOptions, batch_global=True)
def m2po_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: M2POOptions):
  """M2PO: l_t = -M_t rho_t r_t A_i (no clipping), M from the second-moment trust mask (over the batch)."""
  log_r_BxT, log_rho_BxT = log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  loss_mask_BxT = m2po_mask(log_rho_BxT, mask_BxT, o.tau) * mask_BxT.astype(jnp.float32)
  loss_BxT = -safe_exp(log_rho_BxT) * safe_exp(log_r_BxT) * adv_BxT(adv_B)
  aux = {'rejected_frac': 1.0 - masked_mean(loss_mask_BxT, mask_BxT)}
  return masked(loss_BxT, loss_mask_BxT), loss_mask_BxT, aux


@LOSSES.register('gspo', options=GSPOOptions)
def gspo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: GSPOOptions):
  """GSPO: s_i = exp(mean_t log r_t); l = -min(s A, clip(s) A), applied per token as sg(s_i) pi_t/sg(pi_t)."""
  log_r_BxT, log_rho_BxT = log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  logp_BxT = logp_BxT.astype(jnp.float32)
  log_s_B = seq_log_mean(log_r_BxT, mask_BxT)
  log_s_BxT = masked(sg(log_s_B)[:, None] + logp_BxT - sg(logp_BxT), mask_BxT)
  return _is_weighted_ppo(log_s_BxT, log_rho_BxT, mask_BxT, adv_B, o)


@LOSSES.register('cispo', options=CISPOOptions)
def cispo_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: CISPOOptions):
  """CISPO: l_t = -sg(clip(r_t, 1-eps_low, 1+eps_high)) A log pi_t (times the rollout IS weight)."""
  log_r_BxT, log_rho_BxT = log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT)
  r_BxT = safe_exp(log_r_BxT)
  clipped_BxT = sg(jnp.clip(r_BxT, 1.0 - o.clip_eps_low, 1.0 + o.clip_eps_high))
  w_BxT = rollout_is_weights(log_rho_BxT, mask_BxT, o.rollout_is, o.rollout_is_threshold)
  loss_BxT = -w_BxT * clipped_BxT * adv_BxT(adv_B) * logp_BxT.astype(jnp.float32)
  aux = {'clip_frac': masked_mean(clipped_BxT != r_BxT, mask_BxT), 'is_weight_mean': masked_mean(w_BxT, mask_BxT)}
  return masked(loss_BxT, mask_BxT), mask_BxT.astype(jnp.float32), aux


@LOSSES.register('topr', seq_coefficient=True)
def topr_loss(logp_BxT, sampler_logp_BxT, mask_BxT, adv_B, prox_logp_BxT, o: registry.NoOptions):
  """TOPR: l_t = -sg(alpha_i) A_i log pi_t, alpha = 1 if A >= 0 else clip(pi(y)/mu(y), 0, 1) (sequence)."""
  del o
  pi_BxT = sg(logp_BxT) if prox_logp_BxT is None else prox_logp_BxT
  logw_B = sg(vcpo.seq_log_weights(pi_BxT, sampler_logp_BxT, mask_BxT))
  adv_B = adv_B.astype(jnp.float32)
  alpha_B = jnp.where(adv_B >= 0, 1.0, safe_exp(jnp.minimum(logw_B, 0.0)))
  loss_BxT = masked(-sg(alpha_B * adv_B)[:, None] * logp_BxT.astype(jnp.float32), mask_BxT)
  return loss_BxT, mask_BxT.astype(jnp.float32), {'alpha_mean': jnp.mean(alpha_B)}
