"""The dynamic-sampling comparison's page: accuracy against generated tokens, with vs without the filter, and the
verdict by the rule fixed before the runs (below). With no finished pair it writes the skeleton: the plan, the
rule and the commands, saying that nothing has run.

`python -m experiments.studies.dynamic_sampling.page ROOT --out DIR [--machine_time FILE] [--no_plots]` writes
DIR/README.md, DIR/results.json and DIR/accuracy.png (experiments/studies/dynamic_sampling/publish.sh archives a
root's units into DIR/units and runs it on them).

Pre-registered rule:
- A run's generated tokens at step t: the tokens of the samples it consumed up to t (the sum of its
  `throughput/tokens`) plus those of the groups it dropped (`dynamic_sampling/tokens_dropped_total` at t; 0
  without the filter).
- Budget T: the smallest of the finished runs' generated tokens at their last evaluation.
- A run's score: the mean held-out greedy accuracy of its last 3 evaluations (the base excluded) at or under T.
- Effect: `on - off` per seed (a seed's two runs share a warm start), mean and 95% Student-t interval over seeds.
  Verdict: "pays" when the interval lies above 0, "costs" when below, else "not resolved"; fewer than 3
  complete pairs: "not enough runs".
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import numpy as np

from experiments.stats import analysis, loader, report

SEEDS = 3
ARMS = ("off", "on")
SWEEP = "experiments/studies/dynamic_sampling/sweep.py"
LAUNCH = (f"python -m experiments.launch --config=configs/dataset.py:demo --sweep={SWEEP} --root=ROOT --parallel=1\n"
          "experiments/studies/dynamic_sampling/publish.sh ROOT  # archive the units, machine time, this page")
RULE = __doc__[__doc__.index("Pre-registered rule:"):].strip()


def tokens_by_step(run: loader.Run) -> dict[int, float]:
  """Generated tokens up to each logged step (consumed samples' plus dropped groups')."""
  consumed = run.series.get("throughput/tokens", {})
  dropped = run.series.get("dynamic_sampling/tokens_dropped_total", {})
  out, total = {}, 0.0
  for step in sorted(consumed):
    total += consumed[step]
    out[step] = total + dropped.get(step, 0.0)
  return out


def evals_with_tokens(run: loader.Run) -> list[tuple[int, float, float]]:
  """(step, generated tokens, greedy accuracy) of each evaluation after the base."""
  tokens = tokens_by_step(run)
  steps, acc = run.evals()
  return [(s, tokens[s], a) for s, a in zip(steps, acc) if s > 0 and s in tokens]


def score_at(run: loader.Run, budget: float) -> Optional[float]:
  """The mean accuracy of the run's last ENDPOINT_EVALS evaluations within the budget (None: too few)."""
  within = [a for _, t, a in evals_with_tokens(run) if t <= budget]
  n = analysis.ENDPOINT_EVALS
  return float(np.mean(within[-n:])) if len(within) >= n else None


def _over_last(runs: list[loader.Run], key: str, f) -> Optional[float]:
  """f over the runs' last logged values of a filter counter; None where no run logged it (no filter: not
  measured, rather than 0)."""
  values = [r.series[key][max(r.series[key])] for r in runs if r.series.get(key)]
  return float(f(values)) if values else None


def summarize(runs: list[loader.Run]) -> dict:
  """The budget, the paired scores, the effect and the verdict, plus what each arm's filter did."""
  finished = [r for r in runs if r.result is not None and r.arm in ARMS and evals_with_tokens(r)]
  by_seed: dict[int, dict[str, loader.Run]] = {}
  for r in finished:
    by_seed.setdefault(r.seed, {})[r.arm] = r
  pairs = {s: arms for s, arms in sorted(by_seed.items()) if set(arms) == set(ARMS)}
  out: dict = {"pairs": len(pairs), "arms": {}}
  if not pairs:
    out["verdict"] = "not run" if not finished else "not enough runs"
    return out
  budget = min(evals_with_tokens(r)[-1][1] for arms in pairs.values() for r in arms.values())
  scores = {s: {a: score_at(r, budget) for a, r in arms.items()} for s, arms in pairs.items()}
  diffs = [sc["on"] - sc["off"] for sc in scores.values() if None not in sc.values()]
  mean, lo, hi = analysis.interval(diffs)
  if len(diffs) < SEEDS:
    verdict = "not enough runs"
  else:
    verdict = "pays" if lo > 0 else "costs" if hi < 0 else "not resolved"
  out.update(budget=budget, scores={str(s): sc for s, sc in scores.items()}, effect=[mean, lo, hi],
             verdict=verdict)
  for a in ARMS:
    rs = [arms[a] for arms in pairs.values()]
    out["arms"][a] = {
        "tokens_per_step": float(np.mean([evals_with_tokens(r)[-1][1] / evals_with_tokens(r)[-1][0] for r in rs])),
        "samples_per_kept_sample": _over_last(rs, "dynamic_sampling/samples_per_kept_sample", np.mean),
        "zero_spread_groups": float(np.mean([np.mean(list(r.series.get("reward/zero_spread_groups", {}).values()))
                                             for r in rs])),
        "max_lag": float(max(max(r.series.get("lag/max", {0: 0}).values()) for r in rs)),
        "k": float(max(r.lag for r in rs)),
        "prompt_drops_max": _over_last(rs, "dynamic_sampling/prompt_drops_max", max)}
  return out


def _curve_rows(runs: list[loader.Run]) -> list[str]:
  rows = ["| arm | step | generated tokens (mean) | greedy accuracy % (mean [95% CI]) |", "| --- | --- | --- | --- |"]
  for a in ARMS:
    rs = [r for r in runs if r.arm == a and r.result is not None]
    steps = sorted({s for r in rs for s, _, _ in evals_with_tokens(r)})
    for step in steps:
      pts = [(t, acc) for r in rs for s, t, acc in evals_with_tokens(r) if s == step]
      rows.append(f"| {a} | {step} | {np.mean([t for t, _ in pts]):.0f} | "
                  f"{analysis.format_mean_ci([acc for _, acc in pts])} |")
  return rows


def figure(runs: list[loader.Run], path: str, budget: Optional[float] = None) -> None:
  """Held-out greedy accuracy against generated tokens: each finished run thin, colour by arm; the budget T."""
  from experiments.stats import plots as plots_lib  # noqa: PLC0415
  plt = plots_lib.pyplot()
  fig, ax = plt.subplots(figsize=(6.0, 3.6))
  for color, a in zip(("tab:blue", "tab:orange"), ARMS):
    for i, r in enumerate(sorted((r for r in runs if r.arm == a and r.result is not None), key=lambda r: r.seed)):
      pts = evals_with_tokens(r)
      ax.plot([t / 1e3 for _, t, _ in pts], [acc for _, _, acc in pts], color=color, linewidth=1.0, alpha=0.8,
              marker=".", label=a if i == 0 else None)
  if budget:
    ax.axvline(budget / 1e3, color="k", linestyle=":", linewidth=1.0, label="budget T")
  ax.set_xlabel("generated tokens (thousands)")
  ax.set_ylabel("held-out greedy accuracy")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def render(root: str, summary: dict, runs: list[loader.Run], machine_time: str = "", plot: bool = False) -> str:
  source = f"from the runs under `{root}` of:" if summary["pairs"] else "; the runs it reads come from:"
  lines = ["# Dynamic sampling: does it pay at equal generated tokens?", "",
           f"Generated by `experiments/studies/dynamic_sampling/page.py`{' ' if summary['pairs'] else ''}{source}",
           "", "```", LAUNCH, "```", ""]
  if runs:
    lines += [*report._provenance(runs), ""]
  lines += [RULE, ""]
  if summary["pairs"] == 0:
    lines += [f"**Status: {summary['verdict']}.** No finished pair of runs was found: this comparison has not been "
              "run, and there is no result.", ""]
    return "\n".join(lines)
  mean, lo, hi = summary["effect"]
  lines += [f"**Verdict: {summary['verdict']}** ({summary['pairs']} pairs; budget {summary['budget']:.0f} generated "
            f"tokens): on - off = {100 * mean:+.1f} "
            + (f"[{100 * lo:+.1f}, {100 * hi:+.1f}]" if np.isfinite(lo) else "(one pair: no interval)")
            + " points.", "",
            "| seed | off | on |", "| --- | --- | --- |"]
  for seed, sc in summary["scores"].items():
    fmt = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
    lines.append(f"| {seed} | {fmt(sc['off'])} | {fmt(sc['on'])} |")
  lines += ["", "| arm | tokens per step | samples per kept sample | zero-spread groups in batches | max lag (k) | "
            "most drops of one prompt |", "| --- | --- | --- | --- | --- | --- |"]
  for a, s in summary["arms"].items():
    opt = lambda v, f: "-" if v is None else f"{v:{f}}"  # noqa: E731
    lines.append(f"| {a} | {s['tokens_per_step']:.0f} | {opt(s['samples_per_kept_sample'], '.2f')} | "
                 f"{s['zero_spread_groups']:.3f} | {s['max_lag']:.0f} ({s['k']:.0f}) | "
                 f"{opt(s['prompt_drops_max'], '.0f')} |")
  lines += ["", "Accuracy against generated tokens, by evaluation step:", "", *_curve_rows(runs), ""]
  if plot:
    lines += ["![accuracy against generated tokens](accuracy.png)", ""]
  if machine_time:
    lines += ["## Machine time", "", machine_time.strip(), ""]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("root", help="the sweep's root (experiments/studies/dynamic_sampling/sweep.py)")
  p.add_argument("--out", required=True, help="directory for README.md and results.json")
  p.add_argument("--machine_time", default="", help="experiments.launch.machine_time's table to include")
  p.add_argument("--no_plots", action="store_true", help="skip accuracy.png")
  args = p.parse_args(argv)
  runs = loader.load_runs(args.root) if os.path.isdir(args.root) else []
  summary = summarize(runs)
  os.makedirs(args.out, exist_ok=True)
  plot = bool(summary["pairs"]) and not args.no_plots
  if plot:
    figure(runs, os.path.join(args.out, "accuracy.png"), summary.get("budget"))
  table = ""
  if args.machine_time:
    if not os.path.exists(args.machine_time):
      p.error(f"--machine_time {args.machine_time}: no such file")
    with open(args.machine_time) as f:
      table = f.read()
  with open(os.path.join(args.out, "README.md"), "w") as f:
    f.write(render(args.root, summary, runs, table, plot))
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"{args.out}: {summary['verdict']}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
