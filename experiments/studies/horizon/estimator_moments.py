"""The VCPO gradient estimator's second moment and covariance trace under each baseline, from exact per-sequence scores.

The estimator of one batch is g = (1/B) sum_i x_i with x_i = v_i A_i s_i: s_i the gradient of (1/L_i) sum_t log pi(y_t)
at the learner's params (the `vcpo` loss's seq-mean-token-mean term), v_i the IS weight (1, or the truncated wt_i)
and A_i the advantage (R_i minus a baseline, optionally divided by the group's reward std). Every statistic is a
quadratic form in the coefficients c_i = v_i A_i over the Gram matrix G_ij = <s_i, s_j>, so G is all that is kept:

  second moment  (1/B) sum_i ||x_i||^2            = (1/B) sum_i c_i^2 G_ii
  mean squared   ||(1/B) sum_i x_i||^2            = c^T G c / B^2
  trace of Cov   (1/B) sum_i ||x_i - mean x||^2   = second moment - mean squared

Across independent batches a != b, <g_a, g_b> estimates ||mu||^2 of the expected gradient mu without the noise
term (cross_batch): the signal, and per baseline its cosine with the group mean's. An optimizer that normalises
the gradient's scale (Adam) gains from a baseline only through signal / noise, not through a smaller second moment.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from vcpo_jax.algo import vcpo
from vcpo_jax.model import transformer as M

# Baselines: none (b = 0), the group mean, GRPO as the study computes it, OPOB with each of its IS weightings, and
# "opob_matched": OPOB whose W is exactly the estimator's own per-sample weight, W_i = v_i^2 ||s_i||^2 (length
# normalised, since s_i is the gradient of the mean log-prob): the per-group minimiser of the second moment.
BASELINES = ("none", "group_mean", "grpo", "opob_raw", "opob_reference", "opob_truncated", "opob_matched")
WEIGHTS = ("no_is", "tis")
# normalised: the advantage as the study feeds the loss (OPOB's norm_by_std: (R - b_g) / population std of the group's
# rewards; the group mean divided by that same std; GRPO as verl; none undivided); unnormalised: A_i = R_i - b_g
# exactly as OPOB's derivation has it (GRPO's is then the group mean's, so it is left out).
FORMS = ("normalised", "unnormalised")


def _seq_mean_logp(params, cfg, tokens_T, mask_T):
  logp_T = M.token_logprobs(params, cfg, tokens_T[None], mask_T[None])[0]
  return jnp.sum(jnp.where(mask_T > 0, logp_T, 0.0)) / jnp.maximum(jnp.sum(mask_T), 1.0)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _flat_scores(params, tokens_BxT, mask_BxT, *, cfg):
  flat_grad = lambda tok_T, m_T: ravel_pytree(jax.grad(_seq_mean_logp)(params, cfg, tok_T, m_T))[0]  # noqa: E731
  return jax.vmap(flat_grad)(tokens_BxT, mask_BxT)


def per_sequence_scores(params, cfg, tokens_BxT, mask_BxT, chunk: int = 32) -> jax.Array:
  """S_BxP: row i is the gradient of (1/L_i) sum_t m_t log pi(y_t) over all parameters, flattened (vmap of grad,
  `chunk` rows at a time; rows with no response token give 0). Computed in the params' dtype."""
  tokens_BxT, mask_BxT = np.asarray(tokens_BxT), np.asarray(mask_BxT, np.float32)
  b = tokens_BxT.shape[0]
  pad = -b % chunk  # one compile: the last chunk is padded with empty rows
  tokens_BxT = np.concatenate([tokens_BxT, np.zeros((pad, tokens_BxT.shape[1]), tokens_BxT.dtype)])
  mask_BxT = np.concatenate([mask_BxT, np.zeros((pad, mask_BxT.shape[1]), mask_BxT.dtype)])
  parts = [_flat_scores(params, tokens_BxT[i:i + chunk], mask_BxT[i:i + chunk], cfg=cfg)
           for i in range(0, b + pad, chunk)]
  return jnp.concatenate(parts)[:b]


def gram(S_BxP: jax.Array) -> np.ndarray:
  """G_BxB = S S^T in float64 (a float32 S is multiplied at full float32 precision, then widened)."""
  G = jnp.matmul(S_BxP, S_BxP.T, precision=jax.lax.Precision.HIGHEST)
  return np.asarray(G, np.float64)


def moments(G_BxB: np.ndarray, coef_B: np.ndarray) -> dict[str, float]:
  """Second moment, squared norm of the batch mean and covariance trace of x_i = c_i s_i (float64)."""
  c_B = np.asarray(coef_B, np.float64)
  b = c_B.shape[0]
  second = float(np.sum(c_B ** 2 * np.diag(G_BxB)) / b)
  mean_sq = float(c_B @ G_BxB @ c_B / b ** 2)
  return {"second_moment": second, "mean_grad_sq": mean_sq, "trace_cov": second - mean_sq}


def _group_mean_std(rewards_B: np.ndarray, group_B: np.ndarray):
  """Per-row group mean and population std (float64)."""
  _, seg_B = np.unique(group_B, return_inverse=True)
  n_G = np.bincount(seg_B).astype(np.float64)
  mean_B = (np.bincount(seg_B, rewards_B) / n_G)[seg_B]
  var_B = (np.bincount(seg_B, (rewards_B - mean_B) ** 2) / n_G)[seg_B]
  return mean_B, np.sqrt(var_B)


def advantages(rewards_B, group_B, lengths_B, sq_norms_B, logw_B, *, tau, opob_options: dict) -> dict:
  """{(form, weight, baseline): A_B}. sq_norms_B = ||s_i||^2 of the length-normalised score (G's diagonal);
  OPOB's own W uses ||grad sum_t log pi||^2 = L_i^2 ||s_i||^2, as the learner computes it. OPOB rows take the
  run's options (scope, aggregation, normalize_by_length) with is_weight set by the row; normalised divides by
  the group's population std (OPOB's norm_by_std, whatever the run sets) and the group-mean row uses that same
  std, so the two differ only in the baseline. GRPO is vcpo.grpo_advantages (unbiased std + 1e-6, as verl)."""
  r_B = np.asarray(rewards_B, np.float64)
  lengths_B = np.asarray(lengths_B, np.float32)
  mean_B, std_B = _group_mean_std(r_B, np.asarray(group_B))
  ok_B = std_B > vcpo.STD_ZERO_TOL
  inv_std_B = np.where(ok_B, 1.0 / np.where(ok_B, std_B, 1.0), 0.0)
  wt_B = vcpo.truncated_weights(jnp.asarray(logw_B), tau)
  sum_sq_B = jnp.asarray(np.square(lengths_B) * np.asarray(sq_norms_B, np.float32))
  opts = {k: v for k, v in dict(opob_options).items() if k not in ("is_weight", "norm_by_std")}
  if "winsor_quantiles" in opts:
    opts["winsor_quantiles"] = tuple(opts["winsor_quantiles"])

  def opob(is_weight, norm_by_std, **override):
    adv_B, _ = vcpo.opob_advantages(jnp.asarray(r_B, jnp.float32), jnp.asarray(group_B), sum_sq_B,
                                    jnp.asarray(logw_B), wt_B, jnp.asarray(lengths_B),
                                    **{**opts, **override}, is_weight=is_weight, norm_by_std=norm_by_std)
    return np.asarray(adv_B, np.float64)

  # The matched W_i = v_i^2 L_i^2 ||s_i||^2 / L_i^2, per group, plain weighted mean: b_g = sum W R / sum W.
  matched = dict(scope="group", aggregation="mean", normalize_by_length=True)
  out = {}
  for weight, matched_is in (("no_is", "none"), ("tis", "truncated")):
    out[("unnormalised", weight, "none")] = out[("normalised", weight, "none")] = r_B
    out[("unnormalised", weight, "group_mean")] = r_B - mean_B
    out[("normalised", weight, "group_mean")] = (r_B - mean_B) * inv_std_B
    out[("normalised", weight, "grpo")] = np.asarray(
        vcpo.grpo_advantages(jnp.asarray(r_B, jnp.float32), jnp.asarray(group_B)), np.float64)
    for is_weight in ("raw", "reference", "truncated"):
      for form, norm in (("normalised", True), ("unnormalised", False)):
        out[(form, weight, f"opob_{is_weight}")] = opob(is_weight, norm)
    for form, norm in (("normalised", True), ("unnormalised", False)):
      out[(form, weight, "opob_matched")] = opob(matched_is, norm, **matched)
  return out


def coefficients(sq_norms_B, rewards_B, group_B, lengths_B, logw_B, *, tau, opob_options: dict) -> dict:
  """{"form/weight/baseline": c_B = v_B * A_B} for one batch (sq_norms_B: G's diagonal)."""
  wt_B = np.asarray(vcpo.truncated_weights(jnp.asarray(logw_B), tau), np.float64)
  advs = advantages(rewards_B, group_B, lengths_B, sq_norms_B, logw_B, tau=tau, opob_options=opob_options)
  return {f"{form}/{weight}/{baseline}": (wt_B if weight == "tis" else 1.0) * adv_B
          for (form, weight, baseline), adv_B in advs.items()}


def batch_moments(G_BxB, coefs: dict, logw_B) -> dict:
  """{"form/weight/baseline": moments} for one batch (coefs: `coefficients`), plus its ESS ratio."""
  out = {key: moments(G_BxB, c_B) for key, c_B in coefs.items()}
  out["ess_ratio"] = float(vcpo.ess_ratio(jnp.asarray(logw_B)))
  return out


def batch_means(S_BxP, coefs: dict) -> dict[str, np.ndarray]:
  """{row: g = (1/B) sum_i c_i s_i}, the batch's gradient estimate under each row's coefficients (float64)."""
  keys = list(coefs)
  C_BxR = jnp.asarray(np.stack([coefs[k] for k in keys], axis=1), S_BxP.dtype)
  G_RxP = np.asarray(jnp.matmul(C_BxR.T, S_BxP, precision=jax.lax.Precision.HIGHEST), np.float64)
  return {k: G_RxP[i] / S_BxP.shape[0] for i, k in enumerate(keys)}


def cross_batch(means: list[dict[str, np.ndarray]], ref_of) -> dict[str, dict[str, float]]:
  """The expected gradient mu of each row, seen through independent batches a != b (E <g_a, g_b> = <mu, mu'>,
  no noise term): signal ||mu||^2 with its jackknife standard error over batches and, against row ref_of(row),
  the inner product and cosine. Needs >= 2 batches; a signal that is not positive (noise larger than it) gives a
  NaN cosine, and a noisy one can give a cosine outside [-1, 1]: read it with signal / signal_se."""
  n = len(means)
  if n < 2:
    return {}
  off_NxN = ~np.eye(n, dtype=bool)
  g = {row: np.stack([m[row] for m in means]) for row in means[0]}  # row -> g_NxP, one estimate per batch
  signal_NxN = {row: g_NxP @ g_NxP.T for row, g_NxP in g.items()}  # M[a, b] = <g_a, g_b>

  def jackknife_se(M_NxN) -> float:
    """Standard error of the off-diagonal mean over batches, by leaving one batch out (nan below 3 batches)."""
    if n < 3:
      return float("nan")
    loo = [M_NxN[np.ix_(keep, keep)][~np.eye(n - 1, dtype=bool)].mean()
           for keep in (np.arange(n) != i for i in range(n))]
    return float(np.sqrt((n - 1) / n * np.sum((np.asarray(loo) - np.mean(loo)) ** 2)))

  sig = {row: float(M_NxN[off_NxN].mean()) for row, M_NxN in signal_NxN.items()}
  out = {}
  for row in g:
    ref = ref_of(row)
    dot = float((g[row] @ g[ref].T)[off_NxN].mean())
    cos = dot / np.sqrt(sig[row] * sig[ref]) if sig[row] > 0 and sig[ref] > 0 else float("nan")
    out[row] = {"signal": sig[row], "signal_se": jackknife_se(signal_NxN[row]), "dot_ref": dot, "cos_ref": float(cos)}
  return out
