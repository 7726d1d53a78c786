"""The LoRA study's results.md (docs/results/lora/): the pilot and its pick, accuracy against steps and against
wall-clock seconds per arm, and the pre-registered verdict on LoRA - full fine-tuning at the endpoint.

    python -m experiments.studies.lora.page UNITS --out DIR [--machine_time FILE] [--no_plots]

Pre-registered rule (README.md): endpoint = mean of a run's last 3 held-out greedy evaluations; effect = lora -
full per seed (a seed's two runs share its warm start), in points, with a 95% Student-t interval over the seeds
both arms finished (experiments/stats/verdicts.py). Precondition: full fine-tuning learned (its endpoint - base
has a 95% interval above 0). "LoRA learns like full fine-tuning" when the interval lies inside +-MARGIN_PTS and
no LoRA run collapsed; otherwise "worse" when it lies below 0, "better" when above 0, else "undecided". Fewer
than MIN_PAIRS pairs: not decided. Wall-clock (RL seconds: the sum of the steps' `throughput/step_seconds`, so
evaluation and start-up are left out) is reported, not judged; a resumed unit's first step after its resume
carries that launch's compilation.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from experiments.stats import analysis, loader, report, verdicts
from experiments.studies.horizon import page as horizon
from experiments.studies.lora import pilot, sweep

ARMS = ("full", "lora")
MARGIN_PTS = 5.0
MIN_PAIRS = 3
RULE = __doc__[__doc__.index("Pre-registered rule"):].strip()


def rl_seconds(run: loader.Run) -> dict[int, float]:
  """RL wall-clock seconds at the end of each logged step (step 0: 0)."""
  out, total = {0: 0.0}, 0.0
  seconds = run.series.get("throughput/step_seconds", {})
  for step in sorted(seconds):
    total += seconds[step]
    out[step] = total
  return out


def curve(run: loader.Run) -> list[tuple[int, float, float]]:
  """(step, RL seconds, greedy accuracy) of each evaluation, the base's at (0, 0) included."""
  t = rl_seconds(run)
  steps, acc = run.evals()
  return [(s, t[s], a) for s, a in zip(steps, acc) if s in t]


def finder(runs: list[loader.Run], summaries: dict):
  """verdicts' Finder over this study's finished runs (every unit has the setting's one lag)."""
  def find(arm: str, lag: int) -> dict:
    del lag
    return {r.seed: summaries[r.name] for r in runs if r.arm == arm and summaries[r.name]["done"]}
  return find


def decide(d: verdicts.Diff, learned: bool, lora_collapsed: int) -> str:
  """The pre-registered verdict from the seed-paired lora - full interval (points)."""
  if d.n < MIN_PAIRS:
    return f"not decided yet ({d.n} paired seeds; the rule needs {MIN_PAIRS})"
  if not learned:
    return "not testable here (full fine-tuning did not learn)"
  _, lo, hi = d.bounds
  if lora_collapsed == 0 and -MARGIN_PTS < lo and hi < MARGIN_PTS:
    return "LoRA learns like full fine-tuning"
  return "LoRA learns worse" if hi < 0 else "LoRA learns better" if lo > 0 else "undecided"


def summarize(runs: list[loader.Run]) -> dict:
  """The verdict and its numbers: the paired difference, the precondition, collapses and the time ratio."""
  mine = [r for r in runs if r.arm in ARMS]
  summaries = {r.name: loader.run_summary(r, analysis.COLLAPSE_FRACTION, analysis.ESS_DROP_THRESHOLD) for r in mine}
  find = finder(mine, summaries)
  d = verdicts.diff(find, ("lora", 0), ("full", 0))
  d.label = "lora - full"
  learned = verdicts.Diff("full endpoint - base", [100 * (x["endpoint"] - x["base"]) for x in find("full", 0).values()
                                                   if x["endpoint"] is not None and x["base"] is not None])
  collapsed = {a: sum(s["collapse"] is not None for s in find(a, 0).values()) for a in ARMS}
  ok = learned.n >= 2 and learned.bounds[1] > 0
  numbers = f"{d.text()}; {learned.text()}; collapsed: " + ", ".join(f"{a} {collapsed[a]}/{len(find(a, 0))}"
                                                                      for a in ARMS)
  v = verdicts.Verdict("LoRA vs full fine-tuning", RULE, numbers, decide(d, ok, collapsed["lora"]))
  if mine and d.n >= MIN_PAIRS:
    v = horizon.interim(v, mine, {(a, mine[0].lag) for a in ARMS}, sweep.SEEDS)
  total = {a: {r.seed: max(rl_seconds(r).values()) for r in mine if r.arm == a and r.result is not None}
           for a in ARMS}
  logs = [math.log(total["lora"][s] / total["full"][s]) for s in sorted(set(total["lora"]) & set(total["full"]))
          if total["full"][s] > 0 and total["lora"][s] > 0]
  m, lo, hi = analysis.interval(logs) if logs else (math.nan,) * 3
  return {"verdict": v.verdict, "numbers": v.numbers, "effect_pts": list(d.bounds) if d.n else None,
          "per_seed_pts": d.per_seed, "pairs": d.n, "collapsed": collapsed,
          "full_learned_pts": list(learned.bounds) if learned.n else None,
          "rl_seconds_ratio": [math.exp(x) if math.isfinite(x) else None for x in (m, lo, hi)] if logs else None,
          "units": len(mine), "finished": sum(r.result is not None for r in mine)}


def pilot_table(runs: list[loader.Run]) -> list[str]:
  rows = pilot.pilot_rows(runs)
  if not rows:
    return ["(no pilot run yet)"]
  steps = sorted({s for r in rows for s in r["acc"] if s > 0})
  lines = ["| lr | rank | base % | " + " | ".join(f"step {s} %" for s in steps)
           + f" | score % (steps {'/'.join(map(str, pilot.PICK_STEPS))}) | eligible |",
           "|---|---|---|" + "---|" * (len(steps) + 2)]
  for r in rows:
    cells = [f"{100 * r['acc'][s]:.1f}" if s in r["acc"] else "" for s in steps]
    score = "-" if r["score"] is None else f"{100 * r['score']:.1f}"
    base = f"{100 * r['acc'][0]:.1f}" if 0 in r["acc"] else "-"
    lines.append(f"| {r['lr']:g} | {r['rank']} | {base} | " + " | ".join(cells) + f" | {score} | "
                 f"{r['excluded'] or 'yes'} |")
  kind, lr, rank = pilot.pick(rows, pilot.extended(rows))
  lines += ["", "No pilot run qualifies yet." if kind == "none" else f"Pick: **lr {lr:g}, rank {rank}**."
            if kind == "pick" else f"Pick at the lr grid's edge: the pilot runs lr {lr:g} too (every rank), then picks "
            "again."]
  return lines


def curve_table(runs: list[loader.Run]) -> list[str]:
  """Per arm and evaluation step: the runs' mean RL seconds and accuracy [95% interval] (finished runs)."""
  lines = ["| arm | step | RL seconds (mean) | greedy accuracy % (mean ± 95% CI) | runs |", "|---|---|---|---|---|"]
  for a in ARMS:
    rs = [r for r in runs if r.arm == a and r.result is not None]
    for step in sorted({s for r in rs for s, _, _ in curve(r)}):
      pts = [(t, acc) for r in rs for s, t, acc in curve(r) if s == step]
      lines.append(f"| {a} | {step} | {np.mean([t for t, _ in pts]):.0f} | "
                   f"{analysis.format_mean_ci([acc for _, acc in pts])} | {len(pts)} |")
  return lines


def figure(runs: list[loader.Run], path: str) -> None:
  """Accuracy against RL steps and against RL seconds: thin lines per seed, thick the finished runs' mean."""
  from experiments.stats import plots as plots_lib  # noqa: PLC0415
  plt = plots_lib.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.4), sharey=True)
  for a, color in zip(ARMS, ("tab:blue", "tab:orange")):
    rs = [r for r in runs if r.arm == a]
    for r in rs:
      c = curve(r)
      style = dict(color=color, linewidth=0.7, alpha=0.5, linestyle="-" if r.result is not None else "--")
      axes[0].plot([s for s, _, _ in c], [x for _, _, x in c], **style)
      axes[1].plot([t for _, t, _ in c], [x for _, _, x in c], **style)
    done = [{s: (t, x) for s, t, x in curve(r)} for r in rs if r.result is not None]
    common = sorted(set.intersection(*(set(d) for d in done))) if done else []
    if common:
      acc = [np.mean([d[s][1] for d in done]) for s in common]
      axes[0].plot(common, acc, color=color, linewidth=2.0, label=f"{a} (mean of {len(done)})")
      axes[1].plot([np.mean([d[s][0] for d in done]) for s in common], acc, color=color, linewidth=2.0, label=a)
  axes[0].set_xlabel("RL step")
  axes[1].set_xlabel("RL wall-clock seconds")
  axes[0].set_ylabel("held-out greedy accuracy")
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write(units: str, out: str, machine_time: str = "", plots: bool = True) -> str:
  runs = loader.load_runs(units) if os.path.isdir(units) else []
  s = summarize(runs)
  os.makedirs(out, exist_ok=True)
  cmd = f"python -m experiments.studies.lora.page {units} --out {out}"
  md = ["# LoRA vs full fine-tuning: results", "", f"Generated by `{cmd}` from {s['units']} main units "
        f"({s['finished']} finished) and {sum(r.arm == pilot.ARM for r in runs)} pilot units; unfinished units show "
        "their last logged step. The plan and the rule: README.md.", "", *report._provenance(runs), ""]
  if not runs:
    md += ["**Status: not run.** No unit was found: the study has not run, and there is no result.", ""]
    return report.write_page(md, out, "results.md")
  ratio = s["rl_seconds_ratio"]
  md += ["## Verdict (pre-registered rule: README.md)", "", f"**{s['verdict']}**", "", s["numbers"], "",
         "RL wall-clock seconds to the last step, lora / full, seed-paired (geometric mean [95% interval]; "
         "reported, not judged; the host's load is in the machine time below): "
         + ("-" if not ratio else f"{ratio[0]:.2f}" + (f" [{ratio[1]:.2f}, {ratio[2]:.2f}]"
                                                         if ratio[1] is not None else " (1 seed)")), "",
         "## The pilot (LoRA, seed 0, greedy accuracy)", "", *pilot_table(runs), "",
         "## Accuracy against steps and RL wall-clock seconds", "", *curve_table(runs), ""]
  if plots and any(r.arm in ARMS for r in runs):
    figure(runs, os.path.join(out, "accuracy.png"))
    md += ["![accuracy against steps and wall-clock](accuracy.png)", ""]
  if machine_time and os.path.exists(machine_time):
    with open(machine_time) as f:
      md += ["## Machine time", "", f.read().strip(), ""]
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(s, f, indent=2)
  return report.write_page(md, out, "results.md")


def main(argv=None) -> None:
  report.page_main(__doc__, write, argv, machine_time=("", "experiments.launch.machine_time's table to include"))


if __name__ == "__main__":
  main()
