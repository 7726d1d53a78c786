"""The horizon page's mechanism section: experiments.studies.horizon.variance's per-unit results, averaged and answered."""
from __future__ import annotations

import json
import math
import os

import numpy as np

from experiments.stats import analysis

ROWS = ("group_mean", "grpo", "none", "opob_raw", "opob_reference", "opob_truncated", "opob_matched")
METRICS = (("second_moment_rel", "2nd moment"), ("signal_rel", "signal"), ("signal_z", "signal z"),
           ("cos_ref", "cos"), ("snr_rel", "SNR"))
VCPO_ROW = "normalised/tis/opob_reference"  # what the VCPO runs train with: the TIS weight, normalised advantages
RESOLVED_Z = 2.0                           # a signal counts as measured where its z is above this


def _cell(vals: list[float]) -> str:
  """A table cell from unit_means' finite values: mean [95% CI], the mean alone for one unit, "-" for none."""
  if not vals:
    return "-"
  m, lo, hi = analysis.interval(vals)
  return f"{m:.3f} [{lo:.3f}, {hi:.3f}]" if math.isfinite(lo) else f"{m:.3f}"


def load(out: str) -> tuple[dict, list[str]]:
  """({(row, metric): {unit: [value per checkpoint step]}}, one description per unit) from
  out/mechanism/<unit>/variance.json; steps the tool skipped (no "summary") are left out."""
  root = os.path.join(out, "mechanism")
  units = sorted(u for u in os.listdir(root) if os.path.exists(os.path.join(root, u, "variance.json"))) \
      if os.path.isdir(root) else []
  per_unit, info = {}, []
  for u in units:
    with open(os.path.join(root, u, "variance.json")) as f:
      res = json.load(f)
    steps = [s for s, r in res["steps"].items() if "summary" in r]
    info.append(f"{u} (steps {', '.join(steps)}, {res['steps'][steps[0]]['batches']} batches each; ESS ratio "
                f"{np.mean([res['steps'][s]['summary']['ess_ratio'] for s in steps]):.3f})")
    for s in steps:
      for key, row in res["steps"][s]["summary"]["rows"].items():
        for metric, _ in METRICS:
          per_unit.setdefault((key, metric), {}).setdefault(u, []).append(row.get(metric, float("nan")))
  return per_unit, info


def unit_means(per_unit: dict, key: str, metric: str) -> list[float]:
  """Each unit's mean over its checkpoint steps, for one row and metric; units without a finite value left out."""
  vals = [float(np.mean(v)) for v in per_unit.get((key, metric), {}).values()]
  return [v for v in vals if math.isfinite(v)]


def rows(per_unit: dict, info: list[str]) -> list[str]:
  """Per (form, IS weight, baseline): each metric's mean over a unit's steps, then mean [95% CI] over units."""
  head = " | ".join(label for _, label in METRICS)
  lines = [f"Units: {'; '.join(info)}.", "",
           f"| form | IS weight | baseline | {head} |", "|---|---|---|" + "---|" * len(METRICS)]
  keys = sorted({k for k, _ in per_unit}, key=lambda k: (k.split("/")[0], k.split("/")[1],
                                                          ROWS.index(k.split("/")[2])))
  for key in keys:
    cells = [_cell(unit_means(per_unit, key, metric)) for metric, _ in METRICS]
    lines.append(f"| {' | '.join(key.split('/'))} | {' | '.join(cells)} |")
  return lines


def _change(vals: list[float]) -> str:
  """How a ratio to the group mean's compares with 1, by its 95% interval over units."""
  m, lo, hi = analysis.interval(vals)
  if not math.isfinite(lo):
    return f"{m:.3f} of the group mean's (1 unit: no interval)"
  span = f"{m:.3f} [{lo:.3f}, {hi:.3f}] of the group mean's"
  if hi < 1:
    return f"{span}: {1 - m:.0%} lower (95% interval {1 - hi:.0%} to {1 - lo:.0%})"
  if lo > 1:
    return f"{span}: {m - 1:.0%} higher (95% interval {lo - 1:.0%} to {hi - 1:.0%})"
  return f"{span}: not distinguishable from it"


def answer(per_unit: dict) -> list[str]:
  """The page's answer: does OPOB (as VCPO runs it) lower the estimator's second moment here, by how much, and
  does the signal-to-noise ratio the optimizer responds to follow? Empty until a unit is measured."""
  vcpo = unit_means(per_unit, VCPO_ROW, "second_moment_rel")
  if not vcpo:
    return []
  lines = [f"**Answer ({len(vcpo)} units).** Under the estimator VCPO trains with (TIS weight, advantages "
           f"normalised by the group's reward std), OPOB with is_weight=reference has a second moment "
           f"{_change(vcpo)}."]
  matched = unit_means(per_unit, "normalised/tis/opob_matched", "second_moment_rel")
  if matched:
    lines.append(f"The exact per-group minimiser (`opob_matched`) reaches {_change(matched)}.")
  no_is = unit_means(per_unit, "normalised/no_is/opob_reference", "second_moment_rel")
  if no_is:
    lines.append(f"Without the IS weight (whose W the reference weighting no longer matches) OPOB reference has "
                 f"{_change(no_is)}.")
  z = unit_means(per_unit, VCPO_ROW, "signal_z")
  snr = unit_means(per_unit, VCPO_ROW, "snr_rel")
  resolved = sum(v > RESOLVED_Z for v in z)
  tail = (f"OPOB's expected gradient is resolved (signal z > {RESOLVED_Z:g}) in {resolved} of {len(z)} units "
          f"(median z {np.median(z):.2f})" if z else "OPOB's signal was not measured")
  if snr:
    tail += f"; its batch signal / noise is {_change(snr)}"
  lines.append(tail + ". Adam's update is invariant to a common scale of the gradient, so a lower second moment "
               "helps only through a higher signal / noise, which these batches "
               + ("do measure." if resolved == len(z) and z else "cannot settle."))
  return [" ".join(lines)]


def section(out: str) -> list[str]:
  """The mechanism table and its answer, or a line saying nothing was measured yet."""
  per_unit, info = load(out)
  if not info:
    return ["(not measured yet)"]
  return [*answer(per_unit), "", *rows(per_unit, info)]
