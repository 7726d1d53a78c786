"""The learning-rate pilot's pre-registered pick (docs/results/optimizer/README.md) from its units.

    python -m experiments.studies.optimizer.pilot ROOT     # prints "lr <x>" or "extend <x>" (then exits 3)

Pick: the lr with the highest mean greedy accuracy over the evaluations at PICK_STEPS, among pilot runs that
finished, did not collapse and skipped no update; ties go to the smaller lr. A pick at the grid's edge asks once
for the grid extended beyond it (to EXTEND_BELOW or EXTEND_ABOVE, about 3x the planned grid's ends); after that
extension the pick stands.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

import numpy as np

from experiments.stats import analysis
from experiments.stats import loader as report

ARM = "pilot_sgd_sync"
PICK_STEPS = (50, 75, 100)
EXTEND_BELOW, EXTEND_ABOVE = 0.003, 1.0   # the planned grid 0.01-0.3 extended by ~3x


def score_run(r, pick_steps) -> tuple:
  """(score, why it may not be picked or '', {step: accuracy}) of one pilot run: its mean greedy accuracy over
  pick_steps, excluded when unfinished, collapsed, with skipped updates or without every pick step."""
  steps, acc = r.evals()
  at = dict(zip(steps, acc))
  score = float(np.mean([at[s] for s in pick_steps])) if all(s in at for s in pick_steps) else None
  collapse = analysis.collapse_step(steps, acc) if len(steps) > 1 else None
  skipped = max(r.series.get("skipped_updates", {0: 0.0}).values())
  why = ("not finished" if r.result is None else f"collapsed at step {collapse}" if collapse is not None
         else f"skipped {skipped:g} updates" if skipped else "no score" if score is None else "")
  return score, why, at


def pilot_rows(runs: list[report.Run]) -> list[dict]:
  """One row per pilot run, by lr: its score over PICK_STEPS and whether it may be picked (and why not)."""
  rows = []
  for r in sorted((r for r in runs if r.arm == ARM), key=lambda r: r.config["optim"]["learning_rate"]):
    score, why, at = score_run(r, PICK_STEPS)
    rows.append({"name": r.name, "lr": float(r.config["optim"]["learning_rate"]), "score": score, "excluded": why,
                 "acc": at})
  return rows


def edge_pick(rows: list[dict], extended: bool, below: float, above: float,
              tie: Callable[[dict], tuple] = lambda r: ()) -> tuple[str, Optional[dict], Optional[float]]:
  """The pilots' rule (this study's and the LoRA study's): the eligible row with the best score, ties to the
  larger tie(row), then the smaller lr. ('pick', row, None); ('extend', None, below or above) when that row's lr
  is an end of the lr grid and the grid was not `extended` yet; ('none', None, None) when no row qualifies."""
  ok = [r for r in rows if not r["excluded"]]
  if not ok:
    return "none", None, None
  best = max(ok, key=lambda r: (r["score"], *tie(r), -r["lr"]))
  lrs = sorted({r["lr"] for r in rows})
  if not extended and len(lrs) > 1 and best["lr"] in (lrs[0], lrs[-1]):
    return "extend", None, below if best["lr"] == lrs[0] else above
  return "pick", best, None


def pick(rows: list[dict], extended: bool) -> tuple[str, Optional[float]]:
  """('lr', x): the pick; ('extend', x): run the pilot at x too, then pick again; ('none', None): no run
  qualifies. `extended`: the grid was extended once already (an edge pick then stands)."""
  kind, best, extend_to = edge_pick(rows, extended, EXTEND_BELOW, EXTEND_ABOVE)
  return ("lr", best["lr"]) if kind == "pick" else (kind, extend_to)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("root")
  p.add_argument("--grid", type=int, default=4, help="the planned grid's size (more pilot runs: extended)")
  a = p.parse_args(argv)
  rows = pilot_rows(report.load_runs(a.root))
  kind, lr = pick(rows, extended=len(rows) > a.grid)
  for r in rows:
    print(f"# {r['name']}: lr {r['lr']:g}, score {r['score']}, {r['excluded'] or 'eligible'}", file=sys.stderr)
  print(f"{kind} {lr:g}" if lr is not None else kind)
  return {"lr": 0, "extend": 3}.get(kind, 1)


if __name__ == "__main__":
  sys.exit(main())
