"""Ratio helpers shared by the policy losses: log-space ratios clamped before exp, rollout IS weights, PPO clip."""
from typing import Optional

import jax
import jax.numpy as jnp

from vcpo_jax.algo import vcpo

LOG_CLIP = vcpo.LOG_W_CLIP   # every ratio is formed in log space and clipped to +-20 before exp
ROLLOUT_IS_LEVELS = ('none', 'token', 'sequence', 'geometric')
sg = jax.lax.stop_gradient


def masked(x_BxT, mask_BxT):
  return jnp.where(mask_BxT > 0, x_BxT, 0.0)


def safe_exp(log_x):
  return jnp.exp(jnp.clip(log_x, -LOG_CLIP, LOG_CLIP))


def masked_mean(x_BxT, mask_BxT):
  m = mask_BxT.astype(jnp.float32)
  return jnp.sum(x_BxT.astype(jnp.float32) * m) / jnp.maximum(jnp.sum(m), 1.0)


def log_ratios(logp_BxT, sampler_logp_BxT, mask_BxT, prox_logp_BxT):
  """(log r_t = pi - prox, log rho_t = sg(prox - mu)); prox defaults to sg(pi), making r == 1."""
  logp_BxT = logp_BxT.astype(jnp.float32)
  prox_BxT = sg(logp_BxT) if prox_logp_BxT is None else sg(prox_logp_BxT.astype(jnp.float32))
  log_r_BxT = masked(logp_BxT - prox_BxT, mask_BxT)
  log_rho_BxT = sg(masked(prox_BxT - sampler_logp_BxT.astype(jnp.float32), mask_BxT))
  return log_r_BxT, log_rho_BxT


def lengths(mask_BxT):
  return jnp.sum(mask_BxT.astype(jnp.float32), axis=-1)


def seq_log_mean(log_x_BxT, mask_BxT):
  return jnp.sum(log_x_BxT, axis=-1) / jnp.maximum(lengths(mask_BxT), 1.0)


def check_level(level):
  if level not in ROLLOUT_IS_LEVELS:
    raise ValueError(f'rollout_is must be one of {ROLLOUT_IS_LEVELS}, got rollout_is={level!r}')


def rollout_is_weights(log_rho_BxT, mask_BxT, level: str = 'token', threshold: Optional[float] = 2.0):
  """Stop-gradient truncated IS weight per token: token rho_t, sequence prod rho, or geometric mean."""
  check_level(level)
  if level == 'none':
    return jnp.ones_like(log_rho_BxT)
  if level == 'token':
    log_w_BxT = log_rho_BxT
  else:
    log_w_B = jnp.sum(log_rho_BxT, -1) if level == 'sequence' else seq_log_mean(log_rho_BxT, mask_BxT)
    log_w_BxT = jnp.broadcast_to(log_w_B[:, None], log_rho_BxT.shape)
  w_BxT = safe_exp(log_w_BxT)
  if threshold is not None:
    w_BxT = jnp.minimum(w_BxT, threshold)
  return sg(masked(w_BxT, mask_BxT))


def ppo_objective(log_r_BxT, adv_BxT, eps_low, eps_high):
  """min(r A, clip(r, 1-eps_low, 1+eps_high) A) and whether the clipped branch is the binding one."""
  r_BxT = safe_exp(log_r_BxT)
  clipped_BxT = jnp.clip(r_BxT, 1.0 - eps_low, 1.0 + eps_high)
  obj_BxT = jnp.minimum(r_BxT * adv_BxT, clipped_BxT * adv_BxT)
  is_clipped_BxT = clipped_BxT * adv_BxT < r_BxT * adv_BxT
  return obj_BxT, is_clipped_BxT


def in_range_log(log_x, lo, hi):
  """lo <= exp(log_x) <= hi decided in log space; lo None means 1/hi."""
  lo = 1.0 / hi if lo is None else lo
  return (log_x >= jnp.log(jnp.float32(lo))) & (log_x <= jnp.log(jnp.float32(hi)))


def adv_BxT(adv_B):
  return adv_B[:, None].astype(jnp.float32)
