"""VCPO core: sequence importance weights, effective sample size and the off-policy optimal baseline (OPOB)."""
import dataclasses
import functools
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from vcpo_jax.algo import segments as seg  # group statistics

AxisName = Optional[Union[str, Sequence[str]]]

LOG_W_CLIP = 20.0      # exp(+-20) is the widest range a truncated weight may take (paper's clamp)
_LOG_BIG = 1e30        # stands in for +inf log-weights so max-normalisation stays finite
STD_ZERO_TOL = 1e-8    # a group's reward std at or below this counts as zero (reference threshold)
GRPO_EPS = 1e-6        # verl's epsilon in (R - mean) / (std + eps)

SCOPES = ('group', 'minibatch')
IS_WEIGHTS = ('none', 'truncated', 'raw', 'reference')
AGGREGATIONS = ('mean', 'median', 'winsorized_mean')


# ----------------------------------------------------------------------------------------------------------
# Importance weights and ESS
# ----------------------------------------------------------------------------------------------------------

def seq_log_weights(logp_BxT: jax.Array, sampler_logp_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """log w_i = sum_t m_t (pi_t - mu_t) in float32; masked positions never contribute (even if NaN/inf)."""
  diff_BxT = logp_BxT.astype(jnp.float32) - sampler_logp_BxT.astype(jnp.float32)
  return jnp.sum(jnp.where(mask_BxT > 0, diff_BxT, 0.0), axis=-1)


def truncated_weights(logw_B: jax.Array, tau: Optional[float] = 8.0) -> jax.Array:
  """wt_i = min(exp(clip(log w_i, -20, 20)), tau); tau None or inf keeps only the clamp."""
  wt_B = jnp.exp(jnp.clip(logw_B.astype(jnp.float32), -LOG_W_CLIP, LOG_W_CLIP))
  if tau is None or tau == float('inf'):
    return wt_B
  if not tau > 0:
    raise ValueError(f'tau must be positive or None, got tau={tau!r}')
  return jnp.minimum(wt_B, jnp.float32(tau))


def _ess_sums(logw_B: jax.Array, valid_B: Optional[jax.Array], axis_name: AxisName):
  """(log S1, log S2, n) with S_k = sum_i exp(k (log w_i - max log w)); the max cancels in the ESS."""
  valid_B = seg.valid_or_ones(valid_B, logw_B)
  logw_B = jnp.minimum(logw_B.astype(jnp.float32), _LOG_BIG)
  logw_B = jnp.where(valid_B, logw_B, -jnp.inf)
  m = jnp.max(logw_B)
  n = jnp.sum(valid_B.astype(jnp.float32))
  if axis_name is not None:
    m = jax.lax.pmax(m, axis_name)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # no valid sample (or only -inf): all exp terms below are 0
  d_B = logw_B - m
  s1 = jnp.sum(jnp.exp(d_B))
  s2 = jnp.sum(jnp.exp(2.0 * d_B))
  if axis_name is not None:
    s1, s2, n = jax.lax.psum((s1, s2, n), axis_name)
  return jnp.log(s1), jnp.log(s2), n


@functools.partial(jax.jit, static_argnames=('axis_name',))
def log_ess(logw_B: jax.Array, valid_B: Optional[jax.Array] = None, axis_name: AxisName = None) -> jax.Array:
  """log ESS = 2 LSE(log w) - LSE(2 log w) over the global batch.

  Under jit with GSPMD shardings the reductions are already global; inside shard_map/pmap pass the data
  `axis_name` so the per-shard sums are combined with pmax/psum. No valid sample gives -inf.
  """
  log_s1, log_s2, _ = _ess_sums(logw_B, valid_B, axis_name)
  return jnp.where(jnp.isneginf(log_s1), -jnp.inf, 2.0 * log_s1 - log_s2)


@functools.partial(jax.jit, static_argnames=('axis_name',))
def ess(logw_B: jax.Array, valid_B: Optional[jax.Array] = None, axis_name: AxisName = None) -> jax.Array:
  """Effective sample size (sum w)^2 / sum w^2, in [1, B_valid] (0 with no valid sample)."""
  return jnp.exp(log_ess(logw_B, valid_B, axis_name))


@functools.partial(jax.jit, static_argnames=('axis_name',))
def ess_ratio(logw_B: jax.Array, valid_B: Optional[jax.Array] = None, axis_name: AxisName = None) -> jax.Array:
  """rho = ESS / B_valid in (0, 1]; 0 when there is no valid sample, NaN when a log-weight is NaN."""
  log_s1, log_s2, n = _ess_sums(logw_B, valid_B, axis_name)
  ratio = jnp.exp(2.0 * log_s1 - log_s2) / jnp.maximum(n, 1.0)
  return jnp.where(n > 0, jnp.minimum(ratio, 1.0), 0.0)  # min: rounding may overshoot 1 by an ulp


class ImportanceStats(NamedTuple):
  logw_B: jax.Array     # sequence log-weights
  wt_B: jax.Array       # truncated weights used in the gradient
  ess: jax.Array        # global effective sample size of the untruncated weights
  ess_ratio: jax.Array  # ESS / B_valid, the input of optimizer.scale_by_ess


def importance_stats(logp_BxT: jax.Array, sampler_logp_BxT: jax.Array, mask_BxT: jax.Array, *,
                     tau: Optional[float] = 8.0, valid_B: Optional[jax.Array] = None,
                     axis_name: AxisName = None) -> ImportanceStats:
  """Everything the learner needs from the log-probs: log w, truncated w, ESS and ESS ratio."""
  logw_B = seq_log_weights(jax.lax.stop_gradient(logp_BxT), sampler_logp_BxT, mask_BxT)
  return ImportanceStats(logw_B=logw_B, wt_B=truncated_weights(logw_B, tau),
                         ess=ess(logw_B, valid_B, axis_name=axis_name),
                         ess_ratio=ess_ratio(logw_B, valid_B, axis_name=axis_name))


def grpo_advantages(rewards_B: jax.Array, group_B: jax.Array, valid_B: Optional[jax.Array] = None, *,
                    norm_by_std: bool = True, unbiased_std: bool = True, eps: float = GRPO_EPS) -> jax.Array:
  """GRPO as in verl: (R - mean_g) / (std_g + eps), std unbiased; singleton groups use mean 0, std 1."""
  return _grpo_advantages(rewards_B, group_B, valid_B, bool(norm_by_std), bool(unbiased_std), float(eps))


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _grpo_advantages(rewards_B, group_B, valid_B, norm_by_std, unbiased_std, eps):
  rewards_B = rewards_B.astype(jnp.float32)
  valid_B = seg.valid_or_ones(valid_B, rewards_B)
  seg_B = seg.dense_group_ids(group_B)
  mean_B, std_B, n_B = seg.group_mean_std(rewards_B, seg_B, valid_B, unbiased=unbiased_std)
  single_B = n_B <= 1
  mean_B = jnp.where(single_B, 0.0, mean_B)
  adv_B = rewards_B - mean_B
  if norm_by_std:
    adv_B = adv_B / (jnp.where(single_B, 1.0, std_B) + eps)
  return jnp.where(valid_B, adv_B, 0.0)


# ----------------------------------------------------------------------------------------------------------
# OPOB: weights, weighted aggregations, advantages
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OPOBOptions:
  """OPOB switches; defaults follow the authors' scripts (group, mean, raw w, no length norm, std norm)."""
  scope: str = 'group'                  # 'group': one b per prompt group (values R); 'minibatch': one b (values GRPO A)
  is_weight: str = 'raw'                # W = ||s||^2 x {1, wt^2, w^2, wt^2 w^2 ('reference')}
  normalize_by_length: bool = False     # W /= L^2
  aggregation: str = 'mean'             # 'mean' | 'median' | 'winsorized_mean'
  norm_by_std: bool = True              # divide by the group's population reward std (0 std -> advantage 0)
  winsor_quantiles: tuple = (0.05, 0.95)

  def __post_init__(self):
    _check_choice('scope', self.scope, SCOPES)
    _check_choice('is_weight', self.is_weight, IS_WEIGHTS)
    _check_choice('aggregation', self.aggregation, AGGREGATIONS)
    lo, hi = self.winsor_quantiles
    if not 0.0 <= lo <= hi <= 1.0:
      raise ValueError(f'winsor_quantiles must satisfy 0 <= lo <= hi <= 1, got winsor_quantiles={self.winsor_quantiles!r}')


def _check_choice(field: str, value, choices):
  if value not in choices:
    raise ValueError(f'{field} must be one of {choices}, got {field}={value!r}')


def opob_log_weights(sq_norms_B: jax.Array, logw_B: Optional[jax.Array], wt_B: Optional[jax.Array],
                     lengths_B: Optional[jax.Array], *, is_weight: str = 'raw',
                     normalize_by_length: bool = False) -> jax.Array:
  """log W_i with W_i = ||s_i||^2 * IS factor (/ L_i^2); raw w stays in log space so w^2 never overflows.

  sq_norms must be >= 0 (0 gives W = 0, i.e. log W = -inf). Empty responses use L = 1 (their norm is 0).
  """
  _check_choice('is_weight', is_weight, IS_WEIGHTS)
  logW_B = jnp.log(sq_norms_B.astype(jnp.float32))
  if is_weight in ('raw', 'reference'):
    if logw_B is None:
      raise ValueError(f'logw_B is required for is_weight={is_weight!r}')
    logW_B = logW_B + 2.0 * jnp.minimum(logw_B.astype(jnp.float32), _LOG_BIG)
  if is_weight in ('truncated', 'reference'):
    if wt_B is None:
      raise ValueError(f'wt_B is required for is_weight={is_weight!r}')
    logW_B = logW_B + 2.0 * jnp.log(wt_B.astype(jnp.float32))
  if normalize_by_length:
    if lengths_B is None:
      raise ValueError('lengths_B is required for normalize_by_length=True')
    logW_B = logW_B - 2.0 * jnp.log(jnp.maximum(lengths_B.astype(jnp.float32), 1.0))
  return logW_B


def normalized_weights(logW_B: jax.Array, seg_B: jax.Array, valid_B: Optional[jax.Array] = None) -> jax.Array:
  """W_i / max_{j in seg} W_j computed from log W (exact zeros stay zero; all-zero segments stay zero)."""
  valid_B = seg.valid_or_ones(valid_B, logW_B)
  logW_B = jnp.where(valid_B, logW_B.astype(jnp.float32), -jnp.inf)
  m_B = seg.seg_max(logW_B, seg_B)[seg_B]
  m_B = jnp.where(jnp.isfinite(m_B), m_B, 0.0)
  return jnp.where(jnp.isneginf(logW_B), 0.0, jnp.exp(logW_B - m_B))


def opob_baseline(values_B: jax.Array, seg_B: jax.Array, logW_B: jax.Array, valid_B: Optional[jax.Array] = None,
                  *, aggregation: str = 'mean', winsor_quantiles: tuple = (0.05, 0.95)) -> jax.Array:
  """Per-sample baseline b of its segment, aggregating `values_B` with weights exp(logW_B)."""
  _check_choice('aggregation', aggregation, AGGREGATIONS)
  w_B = normalized_weights(logW_B, seg_B, valid_B)
  if aggregation == 'mean':
    return seg.weighted_mean(values_B, w_B, seg_B)
  if aggregation == 'median':
    return seg.weighted_median(values_B, w_B, seg_B)
  return seg.winsorized_mean(values_B, w_B, seg_B, winsor_quantiles)


def opob_advantages(rewards_B: jax.Array, group_B: jax.Array, sq_norms_B: jax.Array,
                    logw_B: Optional[jax.Array], wt_B: Optional[jax.Array], lengths_B: Optional[jax.Array], *,
                    scope: str = 'group', is_weight: str = 'raw', normalize_by_length: bool = False,
                    aggregation: str = 'mean', norm_by_std: bool = True,
                    winsor_quantiles: Sequence[float] = (0.05, 0.95),
                    valid_B: Optional[jax.Array] = None):
  """OPOB advantages and baselines, (adv_B, baseline_B).

  scope 'group': b_g from rewards, A_i = (R_i - b_g) / sigma_g (population std of the group's rewards,
  A = 0 where sigma_g <= 1e-8) or R_i - b_g without norm_by_std.
  scope 'minibatch': values are GRPO advantages (norm_by_std selects their std division), one b for the
  minibatch, A_i = v_i - b (as in the reference, no further std division).
  Invalid rows (valid_B False) get A = 0, b = 0 and carry no weight. Options are static (one compile each).
  """
  opts = OPOBOptions(scope=scope, is_weight=is_weight, normalize_by_length=normalize_by_length,
                     aggregation=aggregation, norm_by_std=norm_by_std,
                     winsor_quantiles=tuple(float(q) for q in winsor_quantiles))
  return _opob_advantages(rewards_B, group_B, sq_norms_B, logw_B, wt_B, lengths_B, valid_B, opts)


@functools.partial(jax.jit, static_argnames=('opts',))
def _opob_advantages(rewards_B, group_B, sq_norms_B, logw_B, wt_B, lengths_B, valid_B, opts: OPOBOptions):
  valid_B = seg.valid_or_ones(valid_B, rewards_B)
  # Invalid rows carry no weight, but 0 x NaN is NaN: their (garbage) rewards must not enter the sums at all.
  rewards_B = jnp.where(valid_B, rewards_B.astype(jnp.float32), 0.0)
  logW_B = opob_log_weights(sq_norms_B, logw_B, wt_B, lengths_B, is_weight=opts.is_weight,
                            normalize_by_length=opts.normalize_by_length)
  seg_B = seg.dense_group_ids(group_B)
  if opts.scope == 'group':
    values_B = rewards_B
    base_seg_B = seg_B
  else:
    values_B = grpo_advantages(rewards_B, group_B, valid_B, norm_by_std=opts.norm_by_std)
    base_seg_B = jnp.zeros_like(seg_B)
  baseline_B = opob_baseline(values_B, base_seg_B, logW_B, valid_B, aggregation=opts.aggregation,
                             winsor_quantiles=opts.winsor_quantiles)
  adv_B = values_B - baseline_B
  if opts.scope == 'group' and opts.norm_by_std:
    _, std_B, _ = seg.group_mean_std(rewards_B, seg_B, valid_B)
    ok_B = std_B > STD_ZERO_TOL
    adv_B = jnp.where(ok_B, adv_B / jnp.where(ok_B, std_B, 1.0), 0.0)
  return jnp.where(valid_B, adv_B, 0.0), jnp.where(valid_B, baseline_B, 0.0)


@jax.jit
def opob_moment_diagnostics(rewards_B: jax.Array, group_B: jax.Array, logW_B: jax.Array, baseline_B: jax.Array,
                            valid_B: Optional[jax.Array] = None) -> dict[str, jax.Array]:
  """Does OPOB's baseline lower the objective it is derived to minimise, here? Per prompt group g,

    moment_ratio_g     = sum_i W_i (R_i - b_g)^2 / sum_i W_i (R_i - mean_g R)^2   (1: no better than the mean)
    max_weight_share_g = max_i W_i / sum_i W_i                                   (1: one sample holds all of W)

  then their means over the groups where each is defined (a group whose rewards are all equal has no ratio;
  NaN when no group has one). W as the estimator weighted the baseline (log W from opob_log_weights).
  """
  valid_B = seg.valid_or_ones(valid_B, rewards_B)
  seg_B = seg.dense_group_ids(group_B)
  w_B = normalized_weights(logW_B, seg_B, valid_B)  # per-group scale: both ratios are scale-free
  r_B = jnp.where(valid_B, rewards_B.astype(jnp.float32), 0.0)
  mean_B, _, _ = seg.group_mean_std(r_B, seg_B, valid_B)
  num_G = seg.seg_sum(w_B * jnp.square(r_B - baseline_B.astype(jnp.float32)), seg_B)
  den_G = seg.seg_sum(w_B * jnp.square(r_B - mean_B), seg_B)
  total_G = seg.seg_sum(w_B, seg_B)
  max_G = seg.seg_max(w_B, seg_B)
  has_ratio_G = den_G > 1e-12
  has_w_G = total_G > 0
  ratio = jnp.sum(jnp.where(has_ratio_G, num_G / jnp.where(has_ratio_G, den_G, 1.0), 0.0)) / jnp.sum(has_ratio_G)
  share = jnp.sum(jnp.where(has_w_G, max_G / jnp.where(has_w_G, total_G, 1.0), 0.0)) / jnp.sum(has_w_G)
  return {"opob/moment_ratio": ratio, "opob/max_weight_share": share,
          "opob/groups_with_ratio": jnp.sum(has_ratio_G).astype(jnp.float32)}
