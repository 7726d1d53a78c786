"""Does RL improve tool use? Seeds of a tool job, then held-out accuracy and tool metrics over seeds.

    python -m experiments.studies.tools.run --root=runs/tools --seeds=0,1,2 --out=docs/results/tools \
        [--config=configs/countdown_tools.py:search | --config=configs/code_tools.py] [-- --config.x=y]

Runs `vcpo_jax.main --config=<config>` (default configs/countdown_tools.py) once per seed, one at a time (a
finished seed, one whose workdir holds result.json, is not rerun), timing each whole job (warm start
included). Then writes to --out: results.json (per seed: base and final held-out greedy/sampled accuracy, the
gain, minutes, tool metrics and failed calls per episode by kind at the start and end of the run, and
`along`: those at ALONG points of the run; over seeds: mean and 95% Student-t interval of each), README.md
(those numbers as tables, with the command) and curve.png (held-out accuracy, calls/episode, error rate and
turns/episode per RL step, mean over seeds with the 95% band).
"""
from __future__ import annotations

import json
import math
import os
import sys
import types

import numpy as np

from experiments.launch import timed_job
from experiments.stats import analysis, plots

CONFIG = "configs/countdown_tools.py"
TITLE = "Tool use: does RL improve it?"
ACCURACY = ("eval/greedy_accuracy", "eval/sampled_accuracy")
# Rollout metrics reported at the run's start and end: short name -> the job's metric.
TOOLS = {"calls_per_episode": "tools/calls_per_episode", "error_rate": "tools/error_rate",
         "turns_per_episode": "tools/turns_per_episode", "rollout_reward": "reward/mean"}
# The run's start and end for the per-step tool metrics: the mean over this many steps (one step is noisy).
WINDOW = 10
# Points along the run (evenly spaced RL steps, first and last included) where the tool metrics are reported.
ALONG = 5
ERRORS = "tools/errors/"  # + kind: failed calls of that kind per episode (a tool's own kinds: tool/<kind>)
CURVES = (("eval/greedy_accuracy", "held-out greedy accuracy", False, (0.0, 1.0)),
          ("eval/sampled_accuracy", "held-out sampled accuracy (T = 1)", False, (0.0, 1.0)),
          ("tools/calls_per_episode", "calls / episode (rollouts)", False, (0.0, 8.0)),
          ("tools/error_rate", "failed / answered calls", False, (0.0, 1.0)),
          ("tools/turns_per_episode", "model turns / episode", False, (0.0, 8.0)))


def command(workdir: str, seed: int, overrides: list[str], config: str = CONFIG) -> list[str]:
  return [sys.executable, "-m", "vcpo_jax.main", f"--config={config}", f"--workdir={workdir}",
          f"--config.seed={seed}", *overrides]


def run_seed(root: str, seed: int, overrides: list[str], config: str = CONFIG) -> str:
  """Runs (or resumes) one seed's job; its wall time goes to timing.json (minutes over every launch)."""
  workdir = os.path.join(root, f"seed{seed}")
  return timed_job.run(workdir, command(workdir, seed, overrides, config))


def load_run(workdir: str) -> types.SimpleNamespace:
  """series: metric -> {step: value}, the base model's accuracy at step 0; plus the result and minutes."""
  with open(os.path.join(workdir, "result.json")) as f:
    result = json.load(f)
  series: dict = {k: {0: float(result["base"][k])} for k in ACCURACY}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      for k, v in row.items():
        if k.startswith(("eval/", "tools/", "reward/")) and isinstance(v, (int, float)):
          series.setdefault(k, {})[int(row["step"])] = float(v)
  return types.SimpleNamespace(series=series, result=result, minutes=timed_job.minutes(workdir))


def window_mean(values: dict, first: bool, steps=None) -> float:
  """The mean over the first (or last) WINDOW of `steps` (default: the series' own); a step the series lacks
  counts 0 (a tool's own error kind is logged only in steps that saw one)."""
  steps = sorted(values if steps is None else steps)
  steps = steps[:WINDOW] if first else steps[-WINDOW:]
  return float(np.mean([values.get(s, 0.0) for s in steps])) if steps else math.nan


def error_kinds(runs: dict) -> list[str]:
  """Every failure kind some run logged (tools/errors/<kind>), in name order."""
  return sorted({k[len(ERRORS):] for run in runs.values() for k in run.series if k.startswith(ERRORS)})


def along(run: types.SimpleNamespace, kinds: list[str]) -> dict:
  """RL step -> the tool metrics (TOOLS, and errors/<kind>) averaged over the WINDOW steps up to it, at ALONG
  evenly spaced steps of the run."""
  steps = sorted(run.series.get(TOOLS["calls_per_episode"], {}))
  if not steps:
    return {}
  points = sorted({steps[int(round(i * (len(steps) - 1) / max(ALONG - 1, 1)))] for i in range(ALONG)})
  out = {}
  for point in points:
    window = [s for s in steps if s <= point][-WINDOW:]
    row = {name: float(np.mean([run.series.get(k, {}).get(s, 0.0) for s in window])) for name, k in TOOLS.items()}
    row.update({f"errors/{kind}": float(np.mean([run.series.get(ERRORS + kind, {}).get(s, 0.0) for s in window]))
                for kind in kinds})
    out[str(point)] = row
  return out


def summarize(runs: dict[int, types.SimpleNamespace]) -> dict:
  per_seed, kinds, alongs = {}, error_kinds(runs), {}
  for seed, run in runs.items():
    row = {"minutes": run.minutes, "rl_steps": int(run.result["steps"])}
    for k in ACCURACY:
      name = k.split("/")[1]
      base, final = float(run.result["base"][k]), float(run.result["final"][k])
      row.update({f"base_{name}": base, f"final_{name}": final, f"gain_{name}": final - base})
    for name, k in TOOLS.items():
      row[f"start_{name}"] = window_mean(run.series.get(k, {}), first=True)
      row[f"end_{name}"] = window_mean(run.series.get(k, {}), first=False)
    steps = run.series.get(TOOLS["calls_per_episode"], {})
    for kind in kinds:
      row[f"start_errors/{kind}"] = window_mean(run.series.get(ERRORS + kind, {}), True, steps)
      row[f"end_errors/{kind}"] = window_mean(run.series.get(ERRORS + kind, {}), False, steps)
    per_seed[str(seed)] = row
    alongs[str(seed)] = along(run, kinds)
  keys = next(iter(per_seed.values())).keys()
  over = {}
  for k in keys:
    mean, low, high = analysis.interval([r[k] for r in per_seed.values()])
    over[k] = {"mean": mean, "ci95": [low, high]}
  # Along the run: the mean over seeds at each point all seeds have (seeds of one config share their steps).
  points = set.intersection(*(set(a) for a in alongs.values())) if alongs else set()
  over_along = {p: {k: float(np.mean([alongs[s][p][k] for s in alongs])) for k in next(iter(alongs.values()))[p]}
                for p in sorted(points, key=int)}
  return {"seeds": per_seed, "over_seeds": over, "error_kinds": kinds, "along": over_along}


def _pct(x: float) -> str:
  return f"{100 * x:.1f}"


def readme(summary: dict, cmd: str, eval_size: int, title: str = TITLE) -> str:
  seeds, over = summary["seeds"], summary["over_seeds"]
  lines = [f"# {title}", "",
           "Generated by `experiments/studies/tools/run.py` from the runs of:", "", "```", cmd, "```", "",
           f"Held-out accuracy on {eval_size} problems (percent), base = the warm start, final = after RL:", "",
           "| seed | base greedy | final greedy | gain | base sampled | final sampled | gain | minutes |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for seed, r in seeds.items():
    lines.append(f"| {seed} | {_pct(r['base_greedy_accuracy'])} | {_pct(r['final_greedy_accuracy'])} | "
                 f"{100 * r['gain_greedy_accuracy']:+.1f} | {_pct(r['base_sampled_accuracy'])} | "
                 f"{_pct(r['final_sampled_accuracy'])} | {100 * r['gain_sampled_accuracy']:+.1f} | "
                 f"{r['minutes']:.1f} |")

  def ci(k, scale=100.0, fmt="{:.1f}"):
    m, (lo, hi) = over[k]["mean"], over[k]["ci95"]
    return f"{fmt.format(scale * m)} [{fmt.format(scale * lo)}, {fmt.format(scale * hi)}]"

  lines += ["", "Mean over seeds [95% Student-t interval]:", "",
            "| | greedy | sampled |", "| --- | --- | --- |",
            f"| base | {ci('base_greedy_accuracy')} | {ci('base_sampled_accuracy')} |",
            f"| final | {ci('final_greedy_accuracy')} | {ci('final_sampled_accuracy')} |",
            f"| gain (points) | {ci('gain_greedy_accuracy')} | {ci('gain_sampled_accuracy')} |", "",
            f"Rollout episodes (the job's `tools/*` and `reward/mean` metrics it logged), mean of the first and the "
            f"last {WINDOW} RL steps:", "",
            "| | first steps | last steps |", "| --- | --- | --- |"]
  # A job without tools logs no tools/* metrics: only the rows some seed logged.
  for name, k in ((n, k) for n, k in TOOLS.items() if math.isfinite(over["start_" + n]["mean"])):
    lines.append(f"| `{k}` | {ci('start_' + name, 1.0, '{:.3f}')} | {ci('end_' + name, 1.0, '{:.3f}')} |")
  kinds = [k for k in summary.get("error_kinds", [])
           if any(over[f"{when}_errors/{k}"]["mean"] > 0 for when in ("start", "end"))]
  if kinds:
    lines += ["", "Failed calls per episode by kind (`tools/errors/<kind>`; `tool` counts every failure of the "
              "tool itself, `tool/<kind>` the tool's own kinds), first and last steps:", "",
              "| kind | first steps | last steps |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {ci('start_errors/' + k, 1.0, '{:.3f}')} | {ci('end_errors/' + k, 1.0, '{:.3f}')} |"
              for k in kinds]
  if summary.get("along"):
    cols = list(TOOLS) + [f"errors/{k}" for k in kinds]
    lines += ["", f"Along the run (mean over seeds of the {WINDOW} RL steps up to each step):", "",
              "| step | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    lines += [f"| {p} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |" for p, row in summary["along"].items()]
  lines += ["", f"Minutes per run (whole job, warm start included): {ci('minutes', 1.0)}.", "",
            "![learning curve](curve.png)", ""]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = timed_job.driver_parser(__doc__, root="runs/tools", out="docs/results/tools")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--config", default=CONFIG, help="the job's config file[:arg]")
  parser.add_argument("--title", default=TITLE, help="the page's heading")
  args, overrides = timed_job.parse_driver(parser, argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  runs = {}
  for seed in seeds:
    workdir = os.path.join(args.root, f"seed{seed}")
    if not args.report_only:
      print(f"seed {seed}: {' '.join(command(workdir, seed, overrides, args.config))}", flush=True)
      run_seed(args.root, seed, overrides, args.config)
    runs[seed] = load_run(workdir)
  summary = summarize(runs)
  with open(os.path.join(args.root, f"seed{seeds[0]}", "config.json")) as f:
    eval_size = int(json.load(f)["task"]["eval_size"])
  summary["eval_size"] = eval_size
  cmd = timed_job.driver_command(
      "experiments.studies.tools.run", [f"--root={args.root}", f"--seeds={args.seeds}", f"--out={args.out}"]
      + ([f"--config={args.config}"] if args.config != CONFIG else [])
      + ([f"--title='{args.title}'"] if args.title != TITLE else []), overrides)
  summary["command"] = cmd
  timed_job.write_page(args.out, summary, readme(summary, cmd, eval_size, args.title))
  with open(os.path.join(args.root, f"seed{seeds[0]}", "config.json")) as f:
    task_name = json.load(f)["task"].get("name", "countdown_tools")
  plots.curves_figure({"async VCPO, k = 2": list(runs.values())}, CURVES,
                      f"{task_name}: {len(runs)} seeds, 95% bands", os.path.join(args.out, "curve.png"))
  print(json.dumps(summary["over_seeds"], indent=1))


if __name__ == "__main__":
  main()
