"""Per-step update diagnostics: the step's update against the one group-mean advantages would give."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from vcpo_jax.learner.config import LearnerConfig

# The reference estimator: (R - group mean) / the group's population std, the form OPOB's norm_by_std=True
# advantages take (the same division), so against OPOB it differs only in the baseline.
GROUP_MEAN = ("grpo", {"norm_by_std": True, "unbiased_std": False})


def group_mean_config(lc: LearnerConfig) -> LearnerConfig:
  """lc with group-mean advantages (same loss, aggregation, tau), no diagnostics of its own."""
  name, options = GROUP_MEAN
  return dataclasses.replace(lc, advantage=name, advantage_options=options, update_diagnostics=False)


def tree_dot(a, b) -> jax.Array:
  """sum over leaves of <a, b>, accumulated in float32."""
  return sum(jnp.vdot(x.astype(jnp.float32).ravel(), y.astype(jnp.float32).ravel())
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def norm_and_cosine(a, b) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(||a||, ||b||, cos(a, b)); the cosine is NaN when either is zero (no direction to compare)."""
  na, nb = jnp.sqrt(tree_dot(a, a)), jnp.sqrt(tree_dot(b, b))
  ok = (na > 0) & (nb > 0)
  cos = jnp.where(ok, tree_dot(a, b) / jnp.where(ok, na * nb, 1.0), jnp.nan)
  return na, nb, cos


def metrics(grads, group_mean_grads, updates, group_mean_updates) -> dict:
  """update/norm, update/group_mean_norm, update/cos_group_mean and the same for the gradient (grad_norm
  itself is logged by the step). With params of lower precision than float32 the updates are the rounding of
  a float32 master step (optimizer.float32_master), so these read that rounding."""
  _, g_gm, g_cos = norm_and_cosine(grads, group_mean_grads)
  u, u_gm, u_cos = norm_and_cosine(updates, group_mean_updates)
  return {"update/norm": u, "update/group_mean_norm": u_gm, "update/cos_group_mean": u_cos,
          "grad/group_mean_norm": g_gm, "grad/cos_group_mean": g_cos}
