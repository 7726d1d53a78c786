"""The LoRA pilot's pre-registered pick (docs/results/lora/README.md) of a learning rate and a rank from its units.

    python -m experiments.studies.lora.pilot ROOT   # prints "lr=<x>,rank=<r>" (exit 0) or "extend <x>" (exit 3)

Pick: the (lr, rank) with the highest mean held-out greedy accuracy over the evaluations at PICK_STEPS, among
pilot runs that finished, did not collapse (accuracy below half its base, experiments/stats/analysis.py) and
skipped no update; ties go to the smaller rank, then the smaller lr. A pick at the lr grid's edge asks once for
the grid extended one step (4x) beyond it, at every rank (EXTEND_BELOW or EXTEND_ABOVE); after that extension
the pick stands. No run qualifying stops the study (exit 1).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional


from experiments.stats import loader
from experiments.studies.lora import sweep
from experiments.studies.optimizer import pilot as optimizer_pilot

ARM = "pilot_lora"
PICK_STEPS = (60, 80, 100)
EXTEND_BELOW, EXTEND_ABOVE = sweep.PILOT_LRS[0] / 4, sweep.PILOT_LRS[-1] * 4   # 1.25e-4 and 3.2e-2


def pilot_rows(runs: list[loader.Run]) -> list[dict]:
  """One row per pilot run, by (lr, rank): its score over PICK_STEPS and whether it may be picked (and why not)."""
  rows = []
  for r in (r for r in runs if r.arm == ARM):
    score, why, at = optimizer_pilot.score_run(r, PICK_STEPS)
    rows.append({"name": r.name, "lr": float(r.config["optim"]["learning_rate"]),
                 "rank": int(r.config["model"]["lora"]["rank"]), "score": score, "excluded": why, "acc": at})
  return sorted(rows, key=lambda row: (row["lr"], row["rank"]))


def extended(rows: list[dict]) -> bool:
  """Whether the lr grid was extended already: the pilot ran more learning rates than planned."""
  return len({r["lr"] for r in rows}) > len(sweep.PILOT_LRS)


def pick(rows: list[dict], extended: bool) -> tuple[str, Optional[float], Optional[int]]:
  """('pick', lr, rank); ('extend', lr, None): run the pilot at lr too (every rank), then pick again; ('none',
  None, None): no run qualifies. `extended`: the grid was extended once already (an edge pick then stands)."""
  kind, best, extend_to = optimizer_pilot.edge_pick(rows, extended, EXTEND_BELOW, EXTEND_ABOVE,
                                                    tie=lambda r: (-r["rank"],))
  return (kind, best["lr"], best["rank"]) if kind == "pick" else (kind, extend_to, None)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("root")
  a = p.parse_args(argv)
  rows = pilot_rows(loader.load_runs(a.root))
  kind, lr, rank = pick(rows, extended(rows))
  for r in rows:
    print(f"# {r['name']}: lr {r['lr']:g}, rank {r['rank']}, score {r['score']}, {r['excluded'] or 'eligible'}",
          file=sys.stderr)
  print({"pick": f"lr={lr:g},rank={rank}", "extend": f"extend {lr:g}"}.get(kind, "none"))
  return {"pick": 0, "extend": 3}.get(kind, 1)


if __name__ == "__main__":
  sys.exit(main())
