"""Time to accuracy (claim C5) from job logs: `python -m experiments.wallclock NAME=LOG [NAME=LOG ...] --at 0.45`.

Reads the job's own log lines (absl format; `vcpo_jax.main` writes them to stderr and units to log.txt): the
RL phase starts at the "base model:" line; each "step N eval {...}" line gives an accuracy at a wall time.
Prints, per run, the RL phase's wall time, every evaluation's elapsed seconds, and the first elapsed time
at which held-out accuracy reached each threshold.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import re
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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("runs", nargs="+", help="NAME=LOG_FILE")
  p.add_argument("--at", default="0.40,0.45,0.50", help="comma-separated accuracy thresholds")
  p.add_argument("--metric", default="eval/greedy_accuracy")
  args = p.parse_args(argv)
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
