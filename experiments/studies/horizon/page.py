"""The horizon study's results (docs/results/horizon/): C2 and C4 by the page's pre-registered rules, sync's
convergence check, the step at which each arm comes within 5 points of sync's level, OPOB's logged moment ratio,
the mechanism measurements and the curves, from the study's unit directories.

`python -m experiments.studies.horizon.page ROOT --out DIR` writes DIR/results.md, accuracy.png and curves.png; DIR/mechanism/<unit>/
variance.json files (experiments.studies.horizon.variance) are summarised when present.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np

from experiments.stats import analysis, claims, loader, report, verdicts
from experiments.studies.horizon import mechanism as mechanism_summary
from experiments.studies.horizon.sweep import EXTEND_STEPS, K  # C2's lag; an unconverged seed's extension

C4_LAG = 32
CONVERGED_PTS = 1.5      # sync has converged: endpoint within 1.5 points of the 3 evaluations before it
STEPS = 450              # the pre-registered length
C2_SEEDS, C4_SEEDS = 4, 3  # the pre-registered seeds a verdict waits for (tier 1: seeds 0-3; C4: seeds 0-2)
LEVEL_PTS = 5.0          # "comes within 5 points of sync's final level"
ARMS = (("sync", 0), ("vcpo", K), ("ess_only", K), ("seq_tis", K), ("vcpo", C4_LAG), ("seq_tis", C4_LAG))


def after_base(run: loader.Run, upto: Optional[int] = None) -> list[float]:
  steps, acc = run.evals()
  return [a for s, a in zip(steps, acc) if 0 < s <= (upto or s)]


def convergence(run: loader.Run, upto: Optional[int] = None) -> Optional[tuple[float, float, bool]]:
  """(last-3 mean, mean of the 3 evaluations before, converged) of a run's greedy accuracy up to step `upto`
  (default: its end); None below 6 evaluations."""
  acc = after_base(run, upto)
  if len(acc) < 2 * analysis.ENDPOINT_EVALS:
    return None
  n = analysis.ENDPOINT_EVALS
  last, before = float(np.mean(acc[-n:])), float(np.mean(acc[-2 * n:-n]))
  return last, before, abs(last - before) * 100 <= CONVERGED_PTS


def to_extend(sync_runs: list[loader.Run], planned_steps: int) -> list[int]:
  """Seeds whose finished sync run has not converged at the planned length (extended runs are not re-checked)."""
  out = []
  for r in sync_runs:
    c = convergence(r)
    if r.result is not None and c is not None and not c[2] and int(r.config["rl"]["steps"]) <= planned_steps:
      out.append(r.seed)
  return sorted(out)


def steps_to_level(runs: list[loader.Run], level: float, pts: float = LEVEL_PTS) -> Optional[int]:
  """The first evaluation step at which the seed-mean greedy accuracy is within `pts` of (or above) `level`."""
  steps, mean, _, _ = analysis.band([r.series.get(loader.ACC, {}) for r in runs])
  return next((int(s) for s, m in zip(steps, mean) if m >= level - pts / 100), None)


def last_step(run: loader.Run) -> int:
  """The last RL step a run has logged (0 before its first)."""
  return max(run.series.get("loss", {0: 0}))


def median_of(run: loader.Run, key: str) -> Optional[float]:
  values = [v for v in run.series.get(key, {}).values() if math.isfinite(v)]
  return float(np.median(values)) if values else None


def interim(v: verdicts.Verdict, runs: list[loader.Run], arms, planned_seeds: int) -> verdicts.Verdict:
  """Marks a verdict reached before its planned seeds have finished in every arm (or while units of its arms
  still run or extend) as interim: more seeds can still change it, a precondition's included."""
  if v.verdict.startswith(("pending", "not decided yet", "not testable yet")):
    return v
  mine = [r for r in runs if (r.arm, r.lag) in arms]
  left = sum(r.result is None for r in mine)
  finished = {(r.seed, r.arm, r.lag) for r in mine if r.result is not None}
  done = {seed for seed, _, _ in finished if all((seed, *arm) in finished for arm in arms)}
  if left or len(done) < planned_seeds:
    running = f"; {left} of {len(mine)} units still running" if left else ""
    v.verdict = f"interim ({len(done)} of {planned_seeds} planned seeds finished{running}): {v.verdict}"
  return v


def c2(find, pending: list[int]) -> verdicts.Verdict:
  """The page's C2 rule. Its precondition that uncorrected staleness degrades at k = 8 is the powered study's
  C1 (same setting); sync learning is checked here."""
  learned, learned_text = verdicts.sync_learned(find)
  d = verdicts.diff(find, ("vcpo", K), ("sync", 0))
  c, n = verdicts.collapses(find, "vcpo", K)
  numbers = f"{d.text()}; vcpo collapsed {c}/{n}; {learned_text}"
  rule = (f"VCPO - sync (endpoint, seed-paired) has a 95% interval inside +-{verdicts.EQUIVALENCE_PTS:g} points "
          "and 0 VCPO runs collapse; refuted if a VCPO run collapses or the interval lies outside; needs sync to "
          "learn and every sync seed converged (or extended)")
  if not n:
    return verdicts.Verdict("C2", rule, numbers, "not testable yet (no finished VCPO runs)")
  if d.n < 2:
    return verdicts.Verdict("C2", rule, numbers, f"not decided yet ({d.n} paired seed; the rule needs an interval)")
  if pending:
    return verdicts.Verdict("C2", rule, numbers, f"pending: sync has not converged for seeds {pending}; every arm "
                                                 f"of those seeds is extended by {EXTEND_STEPS} steps first")
  if not learned:
    return verdicts.Verdict("C2", rule, numbers, "not testable here (sync did not learn)")
  return verdicts.Verdict("C2", rule, numbers, verdicts.equivalence(d, c))


def convergence_table(sync_runs: list[loader.Run], planned_steps: int) -> list[str]:
  """One row per sync seed at its end; an extended seed also shows the check at the planned length."""
  lines = ["| sync seed | at step | endpoint % (last 3 evals) | 3 evals before % | difference (pts) | converged |",
           "|---|---|---|---|---|---|"]
  for r in sync_runs:
    steps = int(r.config["rl"]["steps"])
    ends = ([planned_steps] if steps > planned_steps else []) + ([steps] if r.result is not None else [])
    for end in ends:
      c = convergence(r, end)
      if c is not None:
        lines.append(f"| {r.seed} | {end} | {100 * c[0]:.1f} | {100 * c[1]:.1f} | {100 * (c[0] - c[1]):+.1f} | "
                     f"{'yes' if c[2] else 'no'} |")
    if r.result is None:
      lines.append(f"| {r.seed} | {steps} (running, step {last_step(r)}) | - | - | - | - |")
  return lines


def endpoint_table(groups, summaries, arms=ARMS) -> list[str]:
  """Endpoint % per seed of each (arm, k) in `arms`, the mean with its 95% interval and the collapsed count."""
  seeds = sorted({r.seed for arm, k in arms for r in groups.get(k, {}).get(arm, [])})
  lines = ["| arm | k | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± 95% CI | collapsed |",
           "|---|---|" + "---|" * (len(seeds) + 2)]
  for arm, k in arms:
    runs = {r.seed: r for r in groups.get(k, {}).get(arm, [])}
    if not runs:
      continue
    cells, done = [], []
    for s in seeds:
      r = runs.get(s)
      x = summaries.get(r.name) if r else None
      if x is None:
        cells.append("")
      elif not x["done"]:
        cells.append(f"(step {last_step(r)})")
      else:
        cells.append(f"{100 * x['endpoint']:.1f}")
        done.append(x)
    collapsed = sum(x["collapse"] is not None for x in done)
    lines.append(f"| {arm} | {k} | " + " | ".join(cells) +
                 f" | {analysis.format_mean_ci([x['endpoint'] for x in done])} | {collapsed}/{len(done)} |")
  return lines


def level_rows(groups, find) -> list[str]:
  ends = [x["endpoint"] for x in find("sync", 0).values()]
  if not ends:
    return ["(no finished sync run yet)"]
  level = float(np.mean(ends))
  lines = [f"Sync's final level (mean endpoint over {len(ends)} seeds): {100 * level:.1f}%. First evaluation step "
           f"at which the seed-mean greedy accuracy of the finished runs is at least {100 * level - LEVEL_PTS:.1f}%:",
           "", "| arm | k | finished runs | step |", "|---|---|---|---|"]
  for arm, k in ARMS:
    runs = [r for r in groups.get(k, {}).get(arm, []) if r.result is not None]
    if runs:
      step = steps_to_level(runs, level)
      lines.append(f"| {arm} | {k} | {len(runs)} | {step if step is not None else 'never'} |")
  return lines


def opob_table(groups, summaries) -> list[str]:
  lines = ["| unit | steps logged | median opob/moment_ratio | median opob/max_weight_share | median ESS ratio | "
           "mean lr scale |", "|---|---|---|---|---|---|"]
  for k in (K, C4_LAG):
    for r in groups.get(k, {}).get("vcpo", []):
      x = summaries[r.name]
      lines.append(f"| {r.name} | {len(r.series.get('opob/moment_ratio', {}))} | "
                   f"{report._fmt(median_of(r, 'opob/moment_ratio'))} | "
                   f"{report._fmt(median_of(r, 'opob/max_weight_share'))} | {report._fmt(x['median_ess'])} | "
                   f"{report._fmt(x['lr_scale'])} |")
  return lines


def accuracy_figure(arms: dict, path: str) -> None:
  """One panel per arm: each seed's greedy accuracy to its last evaluation, and the finished seeds' mean."""
  from experiments.stats import plots as plots_lib  # noqa: PLC0415
  plt = plots_lib.pyplot()
  fig, axes = plt.subplots(1, len(arms), figsize=(4.2 * len(arms), 3.4), squeeze=False, sharey=True)
  for ax, (name, runs) in zip(axes[0], arms.items()):
    for r in runs:
      steps, acc = r.evals()
      ax.plot(steps, acc, linewidth=0.8, alpha=0.7, linestyle="-" if r.result is not None else "--",
              label=f"seed {r.seed}")
    done = [r.series.get(loader.ACC, {}) for r in runs if r.result is not None]
    steps, mean, _, _ = analysis.band(done)
    if steps:
      ax.plot(steps, mean, color="k", linewidth=2.0, label=f"mean of {len(done)}")
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  axes[0][0].set_ylabel("held-out greedy accuracy")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def c5_verdict(out: str) -> verdicts.Verdict:
  """C5 as `experiments.studies.wallclock.page --out` wrote it into out/c5.json (its own page: c5.md), or not run yet."""
  path = os.path.join(out, "c5.json")
  if not os.path.exists(path):
    return verdicts.Verdict("C5", verdicts.RULES["C5"], "no C5 runs (README.md: C5 on separate cores)",
                            "not run yet")
  with open(path) as f:
    c5 = json.load(f)
  return verdicts.Verdict("C5", verdicts.RULES["C5"], f"{c5['numbers']} ([c5.md](c5.md))", c5["verdict"])


def write(root: str, out: str, plots: bool = True, planned: int = STEPS,
          seeds: tuple[int, int] = (C2_SEEDS, C4_SEEDS)) -> str:
  runs = loader.load_runs(root)
  if not runs:
    raise ValueError(f"no work units under {root!r}")
  os.makedirs(out, exist_ok=True)
  summaries = {r.name: loader.run_summary(r, analysis.COLLAPSE_FRACTION, analysis.ESS_DROP_THRESHOLD) for r in runs}
  groups = loader.group_runs(runs)
  find = claims.finder(groups, summaries)
  sync_runs = groups.get(0, {}).get("sync", [])
  pending = to_extend(sync_runs, planned)
  verdict_list = [interim(c2(find, pending), runs, {("sync", 0), ("vcpo", K)}, seeds[0]),
                  interim(verdicts.c4(find, lags=(C4_LAG,)), runs, {("sync", 0), ("vcpo", C4_LAG)}, seeds[1]),
                  c5_verdict(out)]
  md = ["# Horizon study: results", "",
        f"Generated by `python -m experiments.studies.horizon.page {root} --out {out}` from {len(runs)} units "
        f"({sum(r.result is not None for r in runs)} finished); unfinished units show their last logged step.",
        "", *report._provenance(runs), "", "## Verdicts (pre-registered rules: README.md)", "",
        "| claim | rule | numbers | verdict |", "|---|---|---|---|",
        *(f"| {v.claim} | {v.rule} | {v.numbers} | **{v.verdict}** |" for v in verdict_list), "",
        "## Endpoint greedy accuracy % (mean of the last 3 evaluations) per seed", "",
        *endpoint_table(groups, summaries), "", "## Sync has converged", "",
        *convergence_table(sync_runs, planned), "",
        "## Also reported", "",
        verdicts.diff(find, ("vcpo", K), ("ess_only", K)).text(), "",
        verdicts.diff(find, ("vcpo", K), ("seq_tis", K)).text(), "",
        verdicts.diff(find, ("vcpo", C4_LAG), ("seq_tis", C4_LAG)).text(), "", *level_rows(groups, find), "",
        "OPOB's logged second-moment ratio per VCPO run (1 = no better than the group mean):", "",
        *opob_table(groups, summaries), "", "## Mechanism: the estimator per baseline", "",
        "Relative to the group mean with the same IS weight: the second moment, the signal (the expected "
        "gradient's squared norm, from pairs of independent batches) and the batch mean's signal / noise (SNR); "
        "cos: the cosine of the expected gradient with the group mean's. Mean [95% t interval] over units.", "",
        *mechanism_summary.section(out), ""]
  if plots:
    from experiments.stats import plots as plots_lib  # noqa: PLC0415  (matplotlib only when plotting)
    arms = {f"{arm} (k={k})": groups[k][arm] for arm, k in ARMS if groups.get(k, {}).get(arm)}
    accuracy_figure(arms, os.path.join(out, "accuracy.png"))
    finished = {name: [r for r in rs if r.result is not None] for name, rs in arms.items()}
    plots_lib.curves_figure({n: rs for n, rs in finished.items() if rs}, report.CURVES,
                            "finished units: seed means over the steps they share, 95% t bands",
                            os.path.join(out, "curves.png"))
    md += ["Held-out greedy accuracy, every unit to its last evaluation (thin: seeds, dashed while running; "
           "thick: the mean of the finished seeds over the steps they share):", "", "![accuracy](accuracy.png)", "",
           "![curves](curves.png)", ""]
  return report.write_page(md, out, "results.md")


def main(argv=None) -> None:
  p = report.page_parser(__doc__)
  p.add_argument("root", help="the study's unit directories (a run root or an archive)")
  p.add_argument("--steps", type=int, default=STEPS, help="the planned run length (the convergence check's)")
  args = p.parse_args(argv)
  write(args.root, args.out, plots=not args.no_plots, planned=args.steps)
  print(f"wrote {os.path.join(args.out, 'results.md')}")


if __name__ == "__main__":
  main()
