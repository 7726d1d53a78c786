"""Per-segment (prompt-group) statistics, jit-able: dense ids, mean/std, weighted mean, quantiles and median."""
import functools
from typing import Optional

import jax
import jax.numpy as jnp


def valid_or_ones(valid_B: Optional[jax.Array], like_B: jax.Array) -> jax.Array:
  if valid_B is None:
    return jnp.ones(like_B.shape, dtype=bool)
  return valid_B.astype(bool)


# Segment ids are dense in [0, B) (see dense_group_ids), num_segments=B static.


def dense_group_ids(group_B: jax.Array) -> jax.Array:
  """Maps arbitrary integer group ids to dense ids in [0, B) (jit-able, order of first sorted appearance)."""
  b = group_B.shape[0]
  _, inverse_B = jnp.unique(group_B, return_inverse=True, size=b)
  return inverse_B.reshape(b).astype(jnp.int32)


def seg_sum(x_B, seg_B):
  return jax.ops.segment_sum(x_B, seg_B, num_segments=seg_B.shape[0])


def seg_max(x_B, seg_B):
  return jax.ops.segment_max(x_B, seg_B, num_segments=seg_B.shape[0])


def seg_min(x_B, seg_B):
  return jax.ops.segment_min(x_B, seg_B, num_segments=seg_B.shape[0])


def _seg_pivot(values_B, seg_B, valid_B):
  """Per-sample pivot (segment max of valid values): centring on it keeps equal values exactly equal."""
  p_G = seg_max(jnp.where(valid_B, values_B, -jnp.inf), seg_B)
  p_B = p_G[seg_B]
  return jnp.where(jnp.isfinite(p_B), p_B, 0.0)


def group_mean_std(values_B: jax.Array, seg_B: jax.Array, valid_B: Optional[jax.Array] = None,
                   unbiased: bool = False):
  """Per-sample (mean, std, count) of its segment's valid values; std population unless `unbiased`."""
  values_B = values_B.astype(jnp.float32)
  valid_B = valid_or_ones(valid_B, values_B)
  vf_B = valid_B.astype(jnp.float32)
  p_B = _seg_pivot(values_B, seg_B, valid_B)
  dev_B = jnp.where(valid_B, values_B - p_B, 0.0)
  n_B = seg_sum(vf_B, seg_B)[seg_B]
  mean_B = p_B + seg_sum(dev_B, seg_B)[seg_B] / jnp.maximum(n_B, 1.0)
  sq_B = jnp.where(valid_B, jnp.square(values_B - mean_B), 0.0)
  dof_B = n_B - 1.0 if unbiased else n_B
  var_B = seg_sum(sq_B, seg_B)[seg_B] / jnp.maximum(dof_B, 1.0)
  std_B = jnp.where(dof_B > 0, jnp.sqrt(var_B), 0.0)
  return mean_B, std_B, n_B


def weighted_mean(values_B: jax.Array, w_B: jax.Array, seg_B: jax.Array) -> jax.Array:
  """Per-sample weighted mean of its segment, sum W v / sum W (0 where the segment's weights are all 0).

  The reference adds 1e-8 to sum W; after max-normalisation sum W >= 1, so that epsilon is dropped (it
  only mattered, as a shrink towards 0, when every raw W of a segment was below ~1e-6).
  """
  values_B = values_B.astype(jnp.float32)
  p_B = _seg_pivot(values_B, seg_B, w_B > 0)
  total_B = seg_sum(w_B, seg_B)[seg_B]
  num_B = seg_sum(w_B * (values_B - p_B), seg_B)[seg_B]
  return jnp.where(total_B > 0, p_B + num_B / jnp.where(total_B > 0, total_B, 1.0), 0.0)


def _segmented_cumsum(x_S: jax.Array, start_S: jax.Array) -> jax.Array:
  """Inclusive cumulative sum restarting wherever start_S is True (avoids cross-segment cancellation)."""
  def combine(a, b):
    a_start, a_sum = a
    b_start, b_sum = b
    return a_start | b_start, jnp.where(b_start, b_sum, a_sum + b_sum)
  return jax.lax.associative_scan(combine, (start_S, x_S))[1]


@functools.partial(jax.jit, static_argnames=('q',))
def weighted_quantile(values_B: jax.Array, w_B: jax.Array, seg_B: jax.Array, q: float) -> jax.Array:
  """Per-sample weighted q-quantile of its segment: the smallest v whose cumulative weight >= q * total.

  This is the inverted-CDF definition (numpy method='inverted_cdf'); the weighted median is q = 0.5.
  Segments whose weights are all zero give 0 (as the reference does).
  """
  b = values_B.shape[0]
  values_B = values_B.astype(jnp.float32)
  order_S = jnp.lexsort((values_B, seg_B))        # by segment, then by value
  v_S, w_S, seg_S = values_B[order_S], w_B[order_S], seg_B[order_S]
  start_S = jnp.concatenate([jnp.ones((1,), bool), seg_S[1:] != seg_S[:-1]])
  cum_S = _segmented_cumsum(w_S, start_S)
  total_S = seg_max(cum_S, seg_S)[seg_S]         # last cum of the segment: consistent with cum_S
  pos_S = jnp.arange(b, dtype=jnp.int32)
  hit_S = cum_S >= q * total_S
  first_G = seg_min(jnp.where(hit_S, pos_S, b), seg_S)
  quant_G = v_S[jnp.clip(first_G, 0, b - 1)]
  total_G = seg_max(cum_S, seg_S)
  quant_G = jnp.where(total_G > 0, quant_G, 0.0)
  return quant_G[seg_B]


def weighted_median(values_B: jax.Array, w_B: jax.Array, seg_B: jax.Array) -> jax.Array:
  """Per-sample weighted (lower) median of its segment."""
  return weighted_quantile(values_B, w_B, seg_B, 0.5)


def winsorized_mean(values_B: jax.Array, w_B: jax.Array, seg_B: jax.Array,
                    quantiles: tuple = (0.05, 0.95)) -> jax.Array:
  """Weighted mean after clamping values to their segment's weighted lo/hi quantiles."""
  lo_B = weighted_quantile(values_B, w_B, seg_B, quantiles[0])
  hi_B = weighted_quantile(values_B, w_B, seg_B, quantiles[1])
  return weighted_mean(jnp.clip(values_B.astype(jnp.float32), lo_B, hi_B), w_B, seg_B)
