"""Micro-batch-1 VCPO gradient (one backward per sequence, reference-style buffers): the float64 test oracle and
the benchmark baseline (kept out of the installed package)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M

IS_WEIGHTS = ("none", "truncated", "raw", "reference")
_STD_ZERO = 1e-8


def _tree_axpy(a, x, y):
  """y + a * x over matching pytrees."""
  return jax.tree.map(lambda xi, yi: yi + a * xi, x, y)


def _sq_norm(tree):
  return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


def oracle_grads(params, cfg: model_config.ModelConfig, tokens_BxT, mask_BxT, sampler_logp_BxT, rewards_B,
                 group_size: int, *, tau: float | None = 8.0, is_weight: str = "raw", norm_by_std: bool = True):
  """Gradient of the VCPO loss -(1/B) sum_i wt_i A_i (1/L_i) sum_t m_t log pi(y_t), group-scope OPOB (mean).

  Rows form contiguous groups of `group_size`. Per sequence one backward gives s_i; per group the loop keeps
  sum wt R s / L and sum wt s / L plus sum W and sum W R (W = ||s||^2 x IS factor), then subtracts b_g times
  the second buffer: A_i = (R_i - b_g) / sigma_g (population std; 0 when sigma_g <= 1e-8). B counts the
  rows with at least one response token. Works in the params' dtype (float64 under jax.enable_x64).
  Returns (grads, stats) with stats logw_B, sq_norms_B, baseline_B, adv_B.
  """
  if is_weight not in IS_WEIGHTS:
    raise ValueError(f"is_weight must be one of {IS_WEIGHTS}, got is_weight={is_weight!r}")
  b, t = tokens_BxT.shape
  if group_size < 1 or b % group_size:
    raise ValueError(f"group_size={group_size} must divide the batch rows B={b}")
  dtype = jax.tree.leaves(params)[0].dtype
  mask_BxT = mask_BxT.astype(dtype)
  n_groups = b // group_size
  lengths_B = jnp.sum(mask_BxT, axis=1)
  n_seq = jnp.maximum(jnp.sum(lengths_B > 0), 1).astype(dtype)

  def seq_logp(p, tok_T, m_T):
    return jnp.sum(M.token_logprobs(p, cfg, tok_T[None], m_T[None]).astype(dtype))

  score = jax.value_and_grad(seq_logp)
  zeros = jax.tree.map(jnp.zeros_like, params)

  def member(carry, row):
    g_r, s_buf, sum_w, sum_wr = carry
    tok_T, m_T, mu_T, r = row
    lp, s_i = score(params, tok_T, m_T)
    logw = lp - jnp.sum(m_T * mu_T)
    wt = jnp.exp(jnp.clip(logw, -20.0, 20.0))
    wt = wt if tau is None else jnp.minimum(wt, tau)
    sq = _sq_norm(s_i)
    factor = {"none": 1.0, "truncated": wt ** 2, "raw": jnp.exp(2 * logw),
              "reference": wt ** 2 * jnp.exp(2 * logw)}[is_weight]
    w_big = sq * factor
    inv_len = 1.0 / jnp.maximum(jnp.sum(m_T), 1.0)
    g_r = _tree_axpy(wt * r * inv_len, s_i, g_r)
    s_buf = _tree_axpy(wt * inv_len, s_i, s_buf)
    return (g_r, s_buf, sum_w + w_big, sum_wr + w_big * r), (logw, sq)

  def group(total, rows):
    init = (zeros, zeros, jnp.zeros((), dtype), jnp.zeros((), dtype))
    (g_r, s_buf, sum_w, sum_wr), (logw_n, sq_n) = jax.lax.scan(member, init, rows)
    base = jnp.where(sum_w > 0, sum_wr / jnp.where(sum_w > 0, sum_w, 1.0), 0.0)
    r_n = rows[3]
    sigma = jnp.sqrt(jnp.mean(jnp.square(r_n - jnp.mean(r_n))))
    scale = jnp.where(sigma > _STD_ZERO, 1.0 / jnp.where(sigma > _STD_ZERO, sigma, 1.0), 0.0) if norm_by_std \
        else jnp.ones((), dtype)
    coef = -scale / n_seq
    total = jax.tree.map(lambda tot, gr, sb: tot + coef * (gr - base * sb), total, g_r, s_buf)
    adv_n = (r_n - base) * scale
    return total, (logw_n, sq_n, jnp.broadcast_to(base, r_n.shape), adv_n)

  shape = lambda x: x.reshape((n_groups, group_size) + x.shape[1:])
  rows = (shape(tokens_BxT), shape(mask_BxT), shape(sampler_logp_BxT.astype(dtype)),
          shape(rewards_B.astype(dtype)))
  grads, (logw, sq, base, adv) = jax.lax.scan(group, zeros, rows)
  stats = {"logw_B": logw.reshape(b), "sq_norms_B": sq.reshape(b), "baseline_B": base.reshape(b),
           "adv_B": adv.reshape(b)}
  return grads, stats
