"""The study's arms as config overrides; every arm states its loss, advantage and ESS switch.

Baselines use GRPO advantages and no ESS scaling (as docs/results/study/README.md states the arms); loss
options are each loss's registered defaults unless stated. Every arm sets the learning rate explicitly so
the lr-confound controls (sync at the effective learning rates ESS scaling produces) sit beside them.
"""
from __future__ import annotations

from experiments.launch.sweep import Sweep, arm, chain

# Effective-lr multipliers for the sync controls. ESS scaling (rule sqrt) gives lr * sqrt(rho / base):
# rho ~ 0.25 / 0.06 / 0.01 -> 0.5 / 0.25 / 0.1. The report prints each ESS arm's measured mean lr scale.
LR_CONTROL_MULTIPLIERS = (0.5, 0.25, 0.1)

_GRPO = {"algo.advantage": "grpo", "algo.ess.enabled": False}


OPOB_IS_WEIGHT = "algo.advantage_options.opob.is_weight"


def overrides(lr: float, opob_is_weight: str = "raw") -> dict[str, dict]:
  """name -> overrides of every arm except the lag (set by the sweep). opob_is_weight: the OPOB weight of the
  `vcpo` and `opob_only` arms (raw: W = w^2 ||s||^2, the first study's; reference: wt^2 w^2 ||s||^2, what the
  authors' code computes); `vcpo_truncated` always uses W = wt^2 ||s||^2."""
  baseline = lambda loss: {"algo.policy_loss": loss, **_GRPO, "optim.learning_rate": lr}  # noqa: E731
  opob = lambda ess, is_weight=opob_is_weight: {  # noqa: E731
      "algo.policy_loss": "vcpo", "algo.advantage": "opob", "algo.ess.enabled": ess, "algo.tis_threshold": 8.0,
      OPOB_IS_WEIGHT: is_weight, "optim.learning_rate": lr}
  return {
      # k = 0 only: the on-policy reference (importance weights are 1, so no correction is needed).
      "sync": baseline("pg"),
      # Stale samples treated as on-policy: no importance weight at all.
      "no_correction": baseline("pg"),
      "seq_tis": {**baseline("seq_tis"), "algo.tis_threshold": 8.0},
      "token_tis": baseline("token_tis"),
      "seq_mis": baseline("seq_mis"),
      "ppo_decoupled": baseline("ppo_decoupled"),
      "m2po": baseline("m2po"),
      "gspo": baseline("gspo"),
      "cispo": baseline("cispo"),
      # VCPO's two components alone and together (sequence TIS, tau = 8, in all three).
      "ess_only": {**baseline("seq_tis"), "algo.tis_threshold": 8.0, "algo.ess.enabled": True},
      "opob_only": opob(False),
      "vcpo": opob(True),
      "vcpo_truncated": opob(True, "truncated"),
  }


ASYNC_ARMS = ("no_correction", "seq_tis", "token_tis", "seq_mis", "ppo_decoupled", "m2po", "gspo", "cispo",
              "ess_only", "opob_only", "vcpo")


def arms(names, lr: float, opob_is_weight: str = "raw") -> Sweep:
  table = overrides(lr, opob_is_weight)
  unknown = [n for n in names if n not in table]
  if unknown:
    raise ValueError(f"unknown arms {unknown}; known: {sorted(table)}")
  return chain(*(arm(n, table[n]) for n in names))


def lr_controls(lr: float, multipliers=LR_CONTROL_MULTIPLIERS) -> Sweep:
  """Sync (k = 0) at lr * m: separates 'ESS scaling helps' from 'a smaller step helps'."""
  sync = overrides(lr)["sync"]
  return chain(*(arm(f"sync_lr{m:g}x", {**sync, "optim.learning_rate": lr * m, "rl.max_lag": 0})
                 for m in multipliers))
