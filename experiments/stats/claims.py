"""The numbers behind each claim C1-C4 (as docs/results/study/README.md states them), paired by seed: a report section, not a verdict.

Units of one seed share that seed's warm start (experiments/launch/local.py), so the comparison of two arms is
made seed by seed: d_s = final_a(s) - final_b(s), reported as mean ± 95% Student-t interval over seeds with
every d_s listed. A claim's verdict (docs/results/) is written by a person from these rows and the curves.
"""
from __future__ import annotations

from typing import Callable

from experiments.stats import analysis

Summary = dict  # loader.run_summary's dict
Finder = Callable[[str, int], dict]  # (arm, lag) -> {seed: summary}

# (claim, label, (arm a, lag a or None = the study's largest lag), (arm b, lag b)): a - b
COMPARISONS = (
    ("C1", "no correction at k vs sync", ("no_correction", None), ("sync", 0)),
    ("C1", "seq-TIS at k vs sync", ("seq_tis", None), ("sync", 0)),
    ("C2", "VCPO at k vs sync", ("vcpo", None), ("sync", 0)),
    ("C2", "VCPO at k vs sync at the lr VCPO's ESS scaling averaged (0.5x)", ("vcpo", None), ("sync_lr0.5x", 0)),
    ("C2", "VCPO with OPOB is_weight=truncated at k vs sync", ("vcpo_truncated", None), ("sync", 0)),
    ("C3", "VCPO vs ESS scaling only (OPOB's share)", ("vcpo", None), ("ess_only", None)),
    ("C3", "VCPO vs OPOB only (ESS scaling's share)", ("vcpo", None), ("opob_only", None)),
    ("C3", "ESS scaling only vs seq-TIS (ESS scaling added to seq-TIS)", ("ess_only", None), ("seq_tis", None)),
    ("C3", "OPOB only vs seq-TIS (OPOB replacing GRPO advantages)", ("opob_only", None), ("seq_tis", None)),
    ("C3", "ESS scaling only at k vs sync", ("ess_only", None), ("sync", 0)),
    ("C3", "OPOB only at k vs sync", ("opob_only", None), ("sync", 0)),
    ("C3", "VCPO vs seq-TIS", ("vcpo", None), ("seq_tis", None)),
    ("C3", "VCPO vs no correction", ("vcpo", None), ("no_correction", None)),
)


def paired(a: dict[int, Summary], b: dict[int, Summary], key: str = "final") -> list[float]:
  """a[s][key] - b[s][key] for every seed s both finished, in seed order."""
  return [a[s][key] - b[s][key] for s in sorted(set(a) & set(b))
          if a[s].get(key) is not None and b[s].get(key) is not None]


METRIC_TITLES = {"final": "final greedy acc", "endpoint": "endpoint greedy acc (mean of the last 3 evals)"}


def comparison_rows(find: Finder, k: int, key: str = "final") -> list[str]:
  lines = [f"| claim | comparison (lag k = {k}) | seeds | Δ {METRIC_TITLES[key]}, pts (mean ± 95% CI) | per seed |",
           "|---|---|---|---|---|"]
  for claim, label, (arm_a, lag_a), (arm_b, lag_b) in COMPARISONS:
    a, b = find(arm_a, k if lag_a is None else lag_a), find(arm_b, k if lag_b is None else lag_b)
    d = paired(a, b, key)
    if d:
      lines.append(f"| {claim} | {label} | {len(d)} | {analysis.format_mean_ci(d, signed=True)} | {', '.join(f'{100 * x:+.1f}' for x in d)} |")
  return lines


def stability_rows(find: Finder, lags: list[int], arms: list[str]) -> list[str]:
  """Per arm and lag: finished seeds, how many collapsed, the worst final and the worst drop from the base."""
  lines = ["| arm | lag | seeds | collapsed | worst final greedy acc % | worst final - base (pts) | "
           "min ESS ratio | mean lr scale |", "|---|---|---|---|---|---|---|---|"]
  for arm in arms:
    for lag in lags:
      runs = [s for s in find(arm, lag).values() if s["done"]]
      if not runs:
        continue
      worst = min(r["final"] for r in runs)
      drop = min(r["final"] - r["base"] for r in runs if r["base"] is not None)
      mins = [r["min_ess"] for r in runs if r["min_ess"] is not None]
      scales = [r["lr_scale"] for r in runs if r["lr_scale"] is not None]
      lines.append(f"| {arm} | {lag} | {len(runs)} | {sum(r['collapse'] is not None for r in runs)} | "
                   f"{100 * worst:.1f} | {100 * drop:+.1f} | {min(mins) if mins else float('nan'):.3g} | "
                   f"{sum(scales) / len(scales) if scales else float('nan'):.2f} |")
  return lines


def finder(groups, summaries) -> Finder:
  """(arm, lag) -> {seed: summary} of the finished runs."""
  def find(arm: str, lag: int) -> dict[int, Summary]:
    return {r.seed: summaries[r.name] for r in groups.get(lag, {}).get(arm, []) if summaries[r.name]["done"]}
  return find


def section(groups, summaries, key: str = "final", k: int | None = None) -> list[str]:
  """Markdown lines: paired comparisons of `key` at lag k (default: the largest), and stability per arm and lag."""
  lags = sorted(groups)
  stale = [k for k in lags if k > 0]
  if not stale:
    return []

  find = finder(groups, summaries)
  arms = sorted({a for lag in lags for a in groups[lag]})
  return [f"Seed-paired differences of the {METRIC_TITLES[key]} (both units of a pair share the seed's "
          "warm start); a verdict needs the interval to exclude 0.", "",
          *comparison_rows(find, k if k is not None else max(stale), key), "", *stability_rows(find, lags, arms)]



# The arms the claims compare, in legend order: (arm, lag or None = the largest lag).
FOCUS = (("sync", 0), ("sync_lr0.5x", 0), ("no_correction", None), ("seq_tis", None), ("ess_only", None),
         ("opob_only", None), ("vcpo", None), ("vcpo_truncated", None))


def focus_arms(groups, k: int | None = None) -> dict:
  """{'arm (k=K)': runs} for the FOCUS arms that have runs (stale arms at lag k, default the largest), for one
  uncluttered figure."""
  k = max(groups) if k is None else k
  out = {}
  for arm, lag in FOCUS:
    lag = k if lag is None else lag
    runs = groups.get(lag, {}).get(arm, [])
    if runs:
      out[f"{arm} (k={lag})"] = runs
  return out
