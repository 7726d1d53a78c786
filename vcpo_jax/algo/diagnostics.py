"""Sampler-vs-learner log-prob mismatch, measured apart from the policy lag that also moves log w."""
from __future__ import annotations

import jax.numpy as jnp

# Why split by lag: log w = sum_t (learner logp - sampler logp). On a lag-0 row both sides hold the same
# weights, so any difference is numerics alone (bf16 vs f32, TF32, KV-cache vs full forward, kernels); on a
# lag > 0 row it is the policy change plus that same mismatch. Comparing the two says how much of log w
# (and so of ESS) the mismatch explains.


def _masked_mean(x, w):
  total = jnp.sum(w)
  return jnp.where(total > 0, jnp.sum(x * w) / jnp.maximum(total, 1.0), 0.0)


def mismatch_rows(logp_BxT, sampler_logp_BxT, mask_BxT) -> dict:
  """Per-row sums behind the metrics (so a micro-batched learner can collect them chunk by chunk)."""
  f32 = jnp.float32
  mask_BxT = mask_BxT.astype(f32)
  delta_BxT = (logp_BxT.astype(f32) - sampler_logp_BxT.astype(f32)) * mask_BxT
  abs_BxT = jnp.abs(delta_BxT)
  return {"abs_sum_B": jnp.sum(abs_BxT, axis=1), "abs_max_B": jnp.max(abs_BxT, axis=1, initial=0.0),
          "tokens_B": jnp.sum(mask_BxT, axis=1), "logw_B": jnp.sum(delta_BxT, axis=1)}


def mismatch_from_rows(rows: dict, lag_B, valid_B) -> dict:
  """The metrics from mismatch_rows' per-row sums, split into lag-0 rows and lag > 0 rows."""
  f32 = jnp.float32
  valid_B = valid_B.astype(f32) * (rows["tokens_B"] > 0)
  out = {}
  for name, rows_B in (("mismatch/lag0", valid_B * (lag_B == 0)), ("mismatch/lagged", valid_B * (lag_B > 0))):
    tokens = jnp.sum(rows["tokens_B"] * rows_B)
    out[f"{name}/token_abs_mean"] = jnp.where(tokens > 0, jnp.sum(rows["abs_sum_B"] * rows_B) /
                                              jnp.maximum(tokens, 1.0), 0.0)
    out[f"{name}/token_abs_max"] = jnp.max(rows["abs_max_B"] * rows_B, initial=0.0)
    out[f"{name}/seq_logw_mean"] = _masked_mean(rows["logw_B"], rows_B)
    out[f"{name}/seq_logw_abs_mean"] = _masked_mean(jnp.abs(rows["logw_B"]), rows_B)
    out[f"{name}/num_seqs"] = jnp.sum(rows_B)
  return out


def mismatch_metrics(logp_BxT, sampler_logp_BxT, mask_BxT, lag_B, valid_B) -> dict:
  """Per-token |delta| and per-sequence sum of delta (delta = learner - sampler log-prob) on lag-0 rows,
  next to the same quantities on lag > 0 rows. Means over an empty set are 0 (the counts say so)."""
  return mismatch_from_rows(mismatch_rows(logp_BxT, sampler_logp_BxT, mask_BxT), lag_B, valid_B)
