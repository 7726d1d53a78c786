"""Advantage estimators, registered with their facts: fn(inputs, options) -> (adv_B, per-row aux for metrics)."""
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from vcpo_jax import registry
from vcpo_jax.algo import segments
from vcpo_jax.algo import vcpo

ESTIMATORS = registry.Registry("advantage estimator")


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


def _valid(inputs: AdvantageInputs):
  return inputs.valid_B if inputs.valid_B is not None else jnp.ones(inputs.rewards_B.shape, bool)


@dataclasses.dataclass(frozen=True)
class GRPOOptions:
  norm_by_std: bool = True       # divide by the group's reward std
  unbiased_std: bool = True      # verl's torch.std (n - 1)
  eps: float = vcpo.GRPO_EPS


@ESTIMATORS.register("grpo", options=GRPOOptions, group_local=True)
def grpo(inputs: AdvantageInputs, o: GRPOOptions):
  """(R - mean_g) / (std_g + eps) as in verl (unbiased std; singleton groups: mean 0, std 1)."""
  return vcpo.grpo_advantages(inputs.rewards_B, inputs.group_B, inputs.valid_B, norm_by_std=o.norm_by_std,
                              unbiased_std=o.unbiased_std, eps=o.eps), {}


@ESTIMATORS.register("dr_grpo", group_local=True)
def dr_grpo(inputs: AdvantageInputs, o: registry.NoOptions):
  """Dr.GRPO: R - mean_g, no std division (pair it with 'seq-mean-token-sum-norm')."""
  del o
  return grpo(inputs, GRPOOptions(norm_by_std=False))


@ESTIMATORS.register("rloo", group_local=True)
def rloo(inputs: AdvantageInputs, o: registry.NoOptions):
  """RLOO: R_i - mean_{j != i in g} R_j = n/(n-1) (R_i - mean_g); singleton groups keep R (verl)."""
  del o
  rewards_B, valid_B = inputs.rewards_B.astype(jnp.float32), _valid(inputs)
  seg_B = segments.dense_group_ids(inputs.group_B)
  mean_B, _, n_B = segments.group_mean_std(rewards_B, seg_B, valid_B)
  adv_B = jnp.where(n_B > 1, (rewards_B - mean_B) * n_B / jnp.maximum(n_B - 1.0, 1.0), rewards_B)
  return jnp.where(valid_B, adv_B, 0.0), {}


@dataclasses.dataclass(frozen=True)
class ReinforceOptions:
  baseline: bool = True          # subtract the batch-mean reward (a batch-global statistic)


@ESTIMATORS.register("reinforce", options=ReinforceOptions, batch_global=lambda o: o.baseline)
def reinforce(inputs: AdvantageInputs, o: ReinforceOptions):
  """REINFORCE with the (valid) batch-mean reward as baseline, or raw rewards with baseline=False."""
  rewards_B, valid_B = inputs.rewards_B.astype(jnp.float32), _valid(inputs)
  rewards_B = jnp.where(valid_B, rewards_B, 0.0)
  if o.baseline:
    rewards_B = rewards_B - jnp.sum(rewards_B) / jnp.maximum(jnp.sum(valid_B), 1)
  return jnp.where(valid_B, rewards_B, 0.0), {}


@ESTIMATORS.register("opob", options=vcpo.OPOBOptions, needs_grad_norms=True,
                     group_local=lambda o: o.scope == "group", batch_global=lambda o: o.scope == "minibatch")
def opob(inputs: AdvantageInputs, o: vcpo.OPOBOptions):
  """VCPO's off-policy optimal baseline (options: vcpo.OPOBOptions); aux carries the baseline."""
  if inputs.sq_norms_B is None:
    raise ValueError("advantage estimator 'opob' needs inputs.sq_norms_B (per-sequence squared grad norms)")
  adv_B, baseline_B = vcpo.opob_advantages(
      inputs.rewards_B, inputs.group_B, inputs.sq_norms_B, inputs.logw_B, inputs.wt_B, inputs.lengths_B,
      scope=o.scope, is_weight=o.is_weight, normalize_by_length=o.normalize_by_length, aggregation=o.aggregation,
      norm_by_std=o.norm_by_std, winsor_quantiles=tuple(o.winsor_quantiles), valid_B=inputs.valid_B)
  extras = {"baseline_B": baseline_B}
  if o.scope == "group":  # the baseline is on the rewards' scale: the step logs its second-moment diagnostics
    extras["opob_logW_B"] = vcpo.opob_log_weights(inputs.sq_norms_B, inputs.logw_B, inputs.wt_B, inputs.lengths_B,
                                                  is_weight=o.is_weight, normalize_by_length=o.normalize_by_length)
  return adv_B, extras
