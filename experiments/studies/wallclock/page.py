"""Time to accuracy (claim C5) from job logs: `python -m experiments.studies.wallclock.page NAME=LOG [NAME=LOG ...] --at 0.45`,
or a C5 sweep's verdict: `python -m experiments.studies.wallclock.page --root=RUNS --out=DIR` (writes DIR/c5.md).

Reads the job's own log lines (absl format; `vcpo_jax.main` writes them to stderr and units to log.txt): the
RL phase starts at the "base model:" line; each "step N eval {...}" line gives an accuracy at a wall time.
Prints, per run, the RL phase's wall time, every evaluation's elapsed seconds, and the first elapsed time
at which held-out accuracy reached each threshold.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import os
import re
import statistics
import sys

_STAMP = r"[IWEF]\d{4} (\d\d:\d\d:\d\d\.\d+) +\d+ [\w.]+:\d+\] "
_START = re.compile(_STAMP + r"base model:")
_EVAL = re.compile(_STAMP + r"step (\d+) eval (\{[^}]*\})")
_DONE = re.compile(_STAMP + r"done: ")


def _seconds(stamp: str) -> float:
  t = datetime.datetime.strptime(stamp, "%H:%M:%S.%f")
  return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6


def parse(text: str) -> dict:
  """{'rl_seconds', 'evals': [(step, elapsed_s, {metric: value})]}; elapsed from the RL phase's start."""
  start = _START.search(text)
  if start is None:
    raise ValueError("no 'base model:' line: not a vcpo_jax.main log, or the RL phase never started")
  t0 = _seconds(start.group(1))
  elapsed = lambda stamp: (_seconds(stamp) - t0) % 86400  # noqa: E731  (runs may cross midnight)
  evals = [(int(m.group(2)), elapsed(m.group(1)), ast.literal_eval(m.group(3))) for m in _EVAL.finditer(text)]
  done = _DONE.search(text, start.end())
  return {"rl_seconds": elapsed(done.group(1)) if done else None, "evals": evals}


def first_reaching(evals, threshold: float, metric: str):
  """(step, elapsed seconds) of the first evaluation with metric >= threshold, or None."""
  return next(((s, t) for s, t, m in evals if m.get(metric, -1.0) >= threshold), None)


def c5_runs(root: str, metric: str = "eval/greedy_accuracy") -> tuple[list[dict], list[str]]:
  """The runs under a C5 sweep's root as verdicts.c5 takes them, and the names left out with why (unfinished;
  resumed, so that its wall clock spans two launches)."""
  from experiments.launch import workunit
  from experiments.stats import analysis, loader  # noqa: PLC0415  (numpy and the job config code)
  runs, left_out = [], []
  for run in loader.load_runs(root):
    launches = len(run.record.get("launches", []))
    log_path = os.path.join(root, run.name, workunit.LOG)
    if run.result is None or not os.path.exists(log_path):
      left_out.append(f"{run.name} (unfinished)")
      continue
    if launches > 1:
      left_out.append(f"{run.name} (resumed: {launches} launches, so its wall clock is not one run's)")
      continue
    with open(log_path, errors="replace") as f:
      parsed = parse(f.read())
    steps, acc = run.evals(metric)
    runs.append({"name": run.name, "lag": run.lag, "seed": run.seed, "endpoint": analysis.endpoint(steps, acc),
                 "rl_seconds": parsed["rl_seconds"], "rl_steps": int(run.config["rl"]["steps"]),
                 "phases": {p: _median(_phase_series(run.series, p)) for p in MEDIANS},
                 "evals": [(t, m[metric]) for _, t, m in parsed["evals"] if metric in m],
                 "steps": [s for s, _, m in parsed["evals"] if metric in m]})
  return runs, left_out


PHASES = ("wait", "learn", "publish")  # a step's seconds waiting for rollouts, updating, publishing (train.py)
LOOP_CPU = "learn_loop_cpu"  # the event loop's CPU seconds during the update (client work beside the learner)
MEDIANS = (*PHASES, LOOP_CPU)  # the throughput/<name>_seconds series each run's table cells come from


def _phase_series(series: dict, phase: str):
  """A phase's per-step seconds. publish: the learner's wait for it (publish_blocked) where the run logged
  that; a background publish's own duration (publish_seconds) overlaps the next step."""
  if phase == "publish" and "throughput/publish_blocked_seconds" in series:
    return series["throughput/publish_blocked_seconds"]
  return series.get(f"throughput/{phase}_seconds")


def _median(series) -> float | None:
  return statistics.median(series.values()) if series else None


def steps_per_hour_rows(runs: list[dict]) -> list[str]:
  """Per lag: RL steps per hour of the RL phase (its evaluations included, the same in every mode), its
  seed-paired ratio to sync's, and the step's phases (medians over steps, mean over runs). For sync the overlap
  ceiling is step / max(wait, learn + publish): the speed-up a perfect overlap of generation and update gives."""
  from experiments.stats import analysis  # noqa: PLC0415
  rate = {(r["lag"], r["seed"]): 3600 * r["rl_steps"] / r["rl_seconds"] for r in runs if r.get("rl_seconds")}
  lines = ["| k | runs | RL steps per hour (mean ± 95% CI) | / sync's, seed-paired (mean ± 95% CI) | "
           "step s: wait for rollouts | learn | publish | overlap ceiling (sync) | event-loop CPU s during learn |",
           "|---" * 9 + "|"]
  for k in sorted({lag for lag, _ in rate}):
    mine = {s: v for (lag, s), v in rate.items() if lag == k}
    m, h = analysis.mean_ci([v / rate[(0, s)] for s, v in mine.items() if (0, s) in rate])
    ratio = "-" if not math.isfinite(m) else f"{m:.2f}" + (f" ± {h:.2f}" if math.isfinite(h) else " (n=1)")
    phase = {p: [r["phases"][p] for r in runs if r["lag"] == k and (r.get("phases") or {}).get(p) is not None]
             for p in MEDIANS}
    mean = {p: sum(v) / len(v) if v else None for p, v in phase.items()}
    cell = lambda p: "-" if mean[p] is None else f"{mean[p]:.2f}"  # noqa: E731
    ceiling, step = "-", [mean[p] for p in PHASES]
    if k == 0 and None not in step and max(mean["wait"], mean["learn"] + mean["publish"]) > 0:
      ceiling = f"{sum(step) / max(mean['wait'], mean['learn'] + mean['publish']):.2f}x"
    lines.append(f"| {k} | {len(mine)} | {analysis.format_mean_ci(list(mine.values()), scale=1.0)} | "
                 f"{ratio if k else '1'} | {' | '.join(cell(p) for p in PHASES)} | {ceiling} | {cell(LOOP_CPU)} |")
  return lines


def per_seed_target_rows(runs: list[dict]) -> list[str]:
  """Not pre-registered: each seed timed against its own target (its sync run's endpoint - 2 points), since the
  rule's pooled target can sit above a seed whose warm start is weaker; the seed-paired log time ratio per k."""
  from experiments.stats import verdicts  # noqa: PLC0415
  below = verdicts.C5_TARGET_BELOW_SYNC_PTS / 100
  target = {r["seed"]: r["endpoint"] - below for r in runs if r["lag"] == 0 and r["endpoint"] is not None}
  lags = sorted({r["lag"] for r in runs})
  time = {(r["lag"], r["seed"]): verdicts.time_to(r["evals"], target[r["seed"]])
          for r in runs if r["seed"] in target}
  fmt = lambda t: "-" if t is None else f"{t:.0f}"  # noqa: E731
  lines = ["| seed | own target % | " + " | ".join(f"k={k}: s to target" for k in lags) + " |",
           "|---" * (2 + len(lags)) + "|"]
  for seed in sorted(target):
    cells = [fmt(time.get((k, seed))) if (k, seed) in time else "no run" for k in lags]
    lines.append(f"| {seed} | {100 * target[seed]:.1f} | " + " | ".join(cells) + " |")
  sync = {s: t for (lag, s), t in time.items() if lag == 0}
  for k in (k for k in lags if k != 0):
    d = verdicts.log_time_ratio(k, {s: t for (lag, s), t in time.items() if lag == k}, sync)
    lines.append(f"- {d.text()}")
  return lines


def write_c5(root: str, out: str) -> str:
  """out/c5.md (+ c5.json): every run's time to the target and the pre-registered C5 verdict."""
  from experiments.stats import verdicts  # noqa: PLC0415
  runs, left_out = c5_runs(root)
  v = verdicts.c5(runs)
  lines = ["# C5: time to a held-out accuracy target, learner and server on separate cores", "",
           f"Generated by `python -m experiments.studies.wallclock.page --root={root} --out={out}`.", "",
           f"**Verdict: {v.verdict}.** Rule: {v.rule}", "", f"Numbers: {v.numbers}", "",
           "| run | k | seed | RL phase s | endpoint % | evals (step: s, greedy %) |", "|---|---|---|---|---|---|"]
  for r in sorted(runs, key=lambda r: (r["lag"], r["seed"])):
    curve = ", ".join(f"{s}: {t:.0f}, {100 * a:.1f}" for s, (t, a) in zip(r["steps"], r["evals"]))
    rl = "-" if r["rl_seconds"] is None else f"{r['rl_seconds']:.0f}"
    end = "-" if r["endpoint"] is None else f"{100 * r['endpoint']:.1f}"
    lines.append(f"| {r['name']} | {r['lag']} | {r['seed']} | {rl} | {end} | {curve} |")
  lines += ["", *steps_per_hour_rows(runs)]
  lines += ["", ("Also reported, not pre-registered: each seed timed against its own target, its sync run's "
                 "endpoint - 2 points (\"-\": never reached within the run)."), "", *per_seed_target_rows(runs)]
  if left_out:
    lines += ["", "Left out: " + "; ".join(left_out) + "."]
  md = "\n".join(lines) + "\n"
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "c5.md"), "w") as f:
    f.write(md)
  with open(os.path.join(out, "c5.json"), "w") as f:
    json.dump({"runs": runs, "left_out": left_out, "verdict": v.verdict, "numbers": v.numbers}, f, indent=1)
  return md


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("runs", nargs="*", help="NAME=LOG_FILE")
  p.add_argument("--at", default="0.40,0.45,0.50", help="comma-separated accuracy thresholds")
  p.add_argument("--metric", default="eval/greedy_accuracy")
  p.add_argument("--root", help="a C5 sweep's root (experiments/studies/wallclock/sweep.py): write its verdict to --out")
  p.add_argument("--out", help="with --root: the directory for c5.md and c5.json")
  args = p.parse_args(argv)
  if args.root:
    if not args.out or args.runs:
      p.error("--root needs --out and no NAME=LOG arguments")
    print(write_c5(args.root, args.out), end="")
    return 0
  if not args.runs:
    p.error("give NAME=LOG_FILE runs, or --root and --out")
  thresholds = [float(x) for x in args.at.split(",")]
  print(f"| run | RL phase s | {' | '.join(f'first {args.metric} >= {x:g} (s, step)' for x in thresholds)} "
        f"| evals (step: s, acc) |")
  print("|---|---|" + "---|" * len(thresholds) + "---|")
  for spec in args.runs:
    name, _, path = spec.partition("=")
    if not path:
      p.error(f"runs must be NAME=LOG_FILE, got {spec!r}")
    with open(path, errors="replace") as f:
      run = parse(f.read())
    cells = []
    for x in thresholds:
      hit = first_reaching(run["evals"], x, args.metric)
      cells.append(f"{hit[1]:.0f} (step {hit[0]})" if hit else "never")
    curve = ", ".join(f"{s}: {t:.0f}, {m.get(args.metric, float('nan')):.3f}" for s, t, m in run["evals"])
    rl = f"{run['rl_seconds']:.0f}" if run["rl_seconds"] is not None else "unfinished"
    print(f"| {name} | {rl} | {' | '.join(cells)} | {curve} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
