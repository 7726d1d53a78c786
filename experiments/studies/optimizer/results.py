"""The optimizer study's results.md (docs/results/optimizer/): the pilot, the SGD test of OPOB, C3 with the
OPOB-only arm, the update diagnostics and the direction test, by the page's pre-registered rules, from archived or
running units.

    python -m experiments.studies.optimizer.results UNITS --horizon docs/results/horizon/units --out DIR
"""
from __future__ import annotations

import math
import os

import numpy as np

from experiments.stats import analysis, claims, verdicts
from experiments.stats import loader, report
from experiments.studies.horizon import page as horizon_page
from experiments.studies.optimizer import direction, pilot, sweep

K = sweep.K
SGD_ARMS = (("sgd_sync", 0), ("sgd_ess_only", K), ("sgd_vcpo", K))
C3_ARMS = (("sync", 0), ("vcpo", K), ("ess_only", K), ("seq_tis", K), ("opob_only", K))
DIAGNOSTIC_ARMS = (*SGD_ARMS, ("opob_only", K))
NORMS = (("update/norm", "update norm"), ("grad_norm", "gradient norm"))  # each arm's own, median over steps
RATIOS = (("update/norm", "update/group_mean_norm", "update norm / group mean's"),
          ("grad_norm", "grad/group_mean_norm", "gradient norm / group mean's"))
COSINES = (("update/cos_group_mean", "update cos"), ("grad/cos_group_mean", "gradient cos"))


def sgd_rule(find) -> verdicts.Verdict:
  """Tier 1's rule: SGD sync learned; OPOB helps under SGD if VCPO - ESS-only has its interval above 0."""
  sync = lambda arm, lag: find("sgd_sync" if arm == "sync" else arm, lag)  # noqa: E731
  learned, learned_text = verdicts.sync_learned(sync)
  d = verdicts.diff(find, ("sgd_vcpo", K), ("sgd_ess_only", K))
  rule = ("precondition: SGD sync learned (endpoint - base, 95% interval above 0). OPOB helps under SGD if "
          "sgd_vcpo - sgd_ess_only has a 95% interval above 0; refuted if it lies below 0")
  numbers = f"{d.text()}; SGD {learned_text}"
  if d.n < 2:
    return verdicts.Verdict("OPOB under SGD", rule, numbers, f"not decided yet ({d.n} paired seeds)")
  if not learned:
    return verdicts.Verdict("OPOB under SGD", rule, numbers, "not testable here (SGD sync did not learn)")
  lo, hi = d.bounds[1:]
  verdict = ("OPOB helps under SGD" if lo > 0 else "OPOB does not help under SGD (refuted)" if hi < 0
             else "undecided: the interval includes 0")
  return verdicts.Verdict("OPOB under SGD", rule, numbers, verdict)


def pilot_table(runs) -> list[str]:
  rows = pilot.pilot_rows(runs)
  if not rows:
    return ["(no pilot run yet)"]
  steps = sorted({s for r in rows for s in r["acc"] if s > 0})
  lines = ["| lr | base % | " + " | ".join(f"step {s} %" for s in steps) + " | score % (steps 50-100) | eligible |",
           "|---|---|" + "---|" * (len(steps) + 2)]
  for r in rows:
    cells = [f"{100 * r['acc'][s]:.1f}" if s in r["acc"] else "" for s in steps]
    score = "-" if r["score"] is None else f"{100 * r['score']:.1f}"
    base = f"{100 * r['acc'][0]:.1f}" if 0 in r["acc"] else "-"
    lines.append(f"| {r['lr']:g} | {base} | " + " | ".join(cells) + f" | {score} | {r['excluded'] or 'yes'} |")
  kind, lr = pilot.pick(rows, extended=len(rows) > len(sweep.PILOT_LRS))
  lines += ["", "No pilot run qualifies yet." if lr is None else f"Pick: **lr {lr:g}**." if kind == "lr"
            else f"Pick at the grid's edge: the pilot runs lr {lr:g} too, then picks again."]
  return lines


def _median_ratio(run, top: str, bottom: str):
  a, b = run.series.get(top, {}), run.series.get(bottom, {})
  values = [a[s] / b[s] for s in a if s in b and b[s] > 0 and math.isfinite(a[s])]
  return float(np.median(values)) if values else None


def diagnostics_table(groups) -> list[str]:
  """Per arm: each run's median over steps, then the mean [95% CI] over runs (finished or not)."""
  head = [t for _, t in NORMS] + [t for _, _, t in RATIOS] + [t for _, t in COSINES]
  lines = ["| arm | k | optimizer | runs | " + " | ".join(head) + " |", "|---|---|---|---|" + "---|" * len(head)]
  for arm, k in DIAGNOSTIC_ARMS:
    runs = [r for r in groups.get(k, {}).get(arm, []) if "update/norm" in r.series]
    if not runs:
      continue
    cols = [[horizon_page.median_of(r, key) for r in runs] for key, _ in NORMS]
    cols += [[_median_ratio(r, a, b) for r in runs] for a, b, _ in RATIOS]
    cols += [[horizon_page.median_of(r, key) for r in runs] for key, _ in COSINES]
    cells = []
    for values in cols:
      values = [v for v in values if v is not None]
      m, lo, hi = analysis.interval(values) if values else (float("nan"),) * 3
      cells.append("-" if not values else f"{m:.4g} [{lo:.4g}, {hi:.4g}]" if math.isfinite(lo) else f"{m:.4g}")
    lines.append(f"| {arm} | {k} | {runs[0].config['optim'].get('name', 'adamw')} | {len(runs)} | "
                 + " | ".join(cells) + " |")
  return lines


def write(units: str, horizon: str, out: str, plots: bool = True) -> str:
  mine = loader.load_runs(units) if os.path.isdir(units) else []
  theirs = [r for r in loader.load_runs(horizon) if (r.arm, r.lag) in C3_ARMS]
  runs = mine + theirs
  os.makedirs(out, exist_ok=True)
  summaries = {r.name: loader.run_summary(r, analysis.COLLAPSE_FRACTION, analysis.ESS_DROP_THRESHOLD) for r in runs}
  groups = loader.group_runs(runs)
  find = claims.finder(groups, summaries)
  sgd = horizon_page.interim(sgd_rule(find), mine, set(SGD_ARMS), sweep.SEEDS)
  c3 = horizon_page.interim(verdicts.c3(find), mine, {("opob_only", K)}, sweep.SEEDS)
  md = ["# Optimizer study: results", "",
        f"Generated by `python -m experiments.studies.optimizer.results {units} --horizon {horizon} --out "
        f"{out}` from {len(mine)} units of this study ({sum(r.result is not None for r in mine)} finished) and the "
        f"horizon study's k = 8 units; unfinished units show their last logged step.", "",
        *report._provenance(mine), "", "## Verdicts (pre-registered rules: README.md)", "",
        "| claim | rule | numbers | verdict |", "|---|---|---|---|",
        *(f"| {v.claim} | {v.rule} | {v.numbers} | **{v.verdict}** |" for v in (sgd, c3)), "",
        "## The learning-rate pilot (SGD sync, seed 0, greedy accuracy)", "", *pilot_table(mine), "",
        f"## Tier 1: SGD + momentum, endpoint % (mean of the last 3 evaluations, {sweep.SGD_STEPS} steps)", "",
        *horizon_page.endpoint_table(groups, summaries, SGD_ARMS), "",
        verdicts.diff(find, ("sgd_vcpo", K), ("sgd_sync", 0)).text(), "",
        verdicts.diff(find, ("sgd_ess_only", K), ("sgd_sync", 0)).text(), "",
        f"## Tier 2: C3 under AdamW, endpoint % ({sweep.OPOB_ONLY_STEPS} steps; all but opob_only are the horizon "
        "study's units)", "", *horizon_page.endpoint_table(groups, summaries, C3_ARMS), "",
        verdicts.diff(find, ("opob_only", K), ("seq_tis", K)).text() + " (OPOB's contribution alone)", "",
        verdicts.diff(find, ("vcpo", K), ("opob_only", K)).text() + " (the ESS step's on top of OPOB)", "",
        "## Update diagnostics", "",
        "Against the update the same step would take with group-mean advantages (same batch, optimizer state and "
        "ESS scale): each run's median over steps, then the mean [95% t interval] over runs. 'Adam removes the "
        "scale' predicts for VCPO a gradient-norm ratio below 1 with an update-norm ratio near 1 under AdamW "
        "(opob_only), and the two ratios alike under SGD; the shared optimizer history (momentum, Adam's moments) "
        "pulls the update ratio toward 1 in both, so compare the arms' own update norms too (README.md).", "",
        *diagnostics_table(groups), "", "## Direction: does a larger turn from the group-mean gradient go with a "
        "better or a worse endpoint?", "", *direction.section(groups, summaries), ""]
  if plots:
    arms = {f"{arm} (k={k})": groups[k][arm] for arm, k in (*SGD_ARMS, ("opob_only", K))
            if groups.get(k, {}).get(arm)}
    pilots = [r for r in mine if r.arm == pilot.ARM]
    if pilots:
      arms["pilot (lr in legend: seed)"] = pilots
    if arms:
      horizon_page.accuracy_figure(arms, os.path.join(out, "accuracy.png"))
      md += ["Held-out greedy accuracy per unit (thin: seeds, dashed while running; thick: the finished seeds' "
             "mean):", "", "![accuracy](accuracy.png)", ""]
  return report.write_page(md, out, "results.md")


def main(argv=None) -> None:
  report.page_main(__doc__, write, argv, horizon=("docs/results/horizon/units", "the horizon study's archived units"))


if __name__ == "__main__":
  main()
