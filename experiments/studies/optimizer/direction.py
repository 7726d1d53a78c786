"""The direction test: does a run whose OPOB turns the gradient further from the group mean's end better or worse?

Per finished OPOB run (sgd_vcpo under SGD, opob_only under AdamW): its turn, 1 - the median over steps of the
cosine between its gradient and the gradient the same batch gives with group-mean advantages, and OPOB's effect on
its seed, its endpoint minus that of the seed's run of the arm without OPOB (sgd_ess_only, seq_tis: the pairs
the verdicts compare). The slope of effect on turn within arms (each arm its own intercept: the optimizers
differ), a 95% t interval with n - arms - 1 degrees of freedom. Pre-registered rule: README.md.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import stats

from experiments.stats import claims
from experiments.studies.optimizer import sweep

K = sweep.K
PAIRS = (("sgd_vcpo", "sgd_ess_only"), ("opob_only", "seq_tis"))  # (OPOB arm, its group-mean twin), both at k
COS = "grad/cos_group_mean"
TURN_UNIT = 0.1  # the slope is reported per 0.1 of turn (1 - cos): the runs' turns span ~0.1-0.3


def points(groups, summaries) -> list[dict]:
  """{arm, seed, turn, effect} per finished OPOB run whose twin on its seed finished too."""
  out, find = [], claims.finder(groups, summaries)
  for arm, twin in PAIRS:
    twins = find(twin, K)
    for run in groups.get(K, {}).get(arm, []):
      mine, other = summaries[run.name], twins.get(run.seed)
      cos = [v for v in run.series.get(COS, {}).values() if math.isfinite(v)]
      if not (mine["done"] and other and cos and mine["endpoint"] is not None and other["endpoint"] is not None):
        continue
      out.append({"arm": arm, "seed": run.seed, "turn": 1.0 - float(np.median(cos)),
                  "effect": mine["endpoint"] - other["endpoint"]})
  return out


def within_slope(arm_N, x_N, y_N, level: float = 0.95):
  """(slope, lower, upper, dof) of y on x with one intercept per arm (OLS on within-arm deviations); None when
  there are no residual degrees of freedom or x does not vary within any arm."""
  arm_N, x_N, y_N = np.asarray(arm_N), np.asarray(x_N, np.float64), np.asarray(y_N, np.float64)
  dx_N, dy_N = x_N.copy(), y_N.copy()
  for a in np.unique(arm_N):
    m = arm_N == a
    dx_N[m] -= x_N[m].mean()
    dy_N[m] -= y_N[m].mean()
  sxx = float(dx_N @ dx_N)
  dof = len(x_N) - len(np.unique(arm_N)) - 1
  if dof < 1 or sxx <= 0:
    return None
  slope = float(dx_N @ dy_N) / sxx
  resid_N = dy_N - slope * dx_N
  se = math.sqrt(float(resid_N @ resid_N) / dof / sxx)
  h = float(stats.t.ppf(0.5 + level / 2, dof)) * se
  return slope, slope - h, slope + h, dof


def verdict(fit) -> str:
  if fit is None:
    return "not enough runs (needs residual degrees of freedom and turns that vary within an arm)"
  _, lo, hi, _ = fit
  return ("a larger turn goes with a worse endpoint" if hi < 0 else "a larger turn goes with a better endpoint"
          if lo > 0 else "not resolved: the interval includes 0")


def section(groups, summaries) -> list[str]:
  pts = points(groups, summaries)
  lines = ["Per finished OPOB run: its turn (1 - median gradient cosine with the group-mean gradient) and OPOB's "
           "effect on its seed (its endpoint - its group-mean twin's: sgd_vcpo - sgd_ess_only, opob_only - "
           "seq_tis). Slope of effect on turn within arms (README.md's rule).", "",
           "| arm | seed | turn | effect pts |", "|---|---|---|---|"]
  lines += [f"| {p['arm']} | {p['seed']} | {p['turn']:.3f} | {100 * p['effect']:+.1f} |" for p in pts]
  fit = within_slope([p["arm"] for p in pts], [p["turn"] for p in pts], [p["effect"] for p in pts])
  scale = 100 * TURN_UNIT
  numbers = ("-" if fit is None else
             f"{scale * fit[0]:+.1f} [{scale * fit[1]:+.1f}, {scale * fit[2]:+.1f}] pts per {TURN_UNIT:g} of turn, "
             f"n = {len(pts)}, {fit[3]} dof")
  return lines + ["", f"Slope: {numbers}. Verdict: **{verdict(fit)}**.", "",
                  "What this can support: whether, across seeds, the runs whose OPOB turned the gradient further "
                  "ended further above or below their twins. What it cannot: that the turn causes the difference "
                  "(the turn is measured, not set: a seed's data shape both), or anything about arms whose gradient "
                  "is the group mean's (their turn is 0 by construction)."]
