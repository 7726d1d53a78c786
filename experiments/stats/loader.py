"""Finished and running units of a sweep root as `Run`s: their config, record, result and metric series."""
from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Optional

import numpy as np

from experiments.launch import workunit
from experiments.stats import analysis

ACC = "eval/greedy_accuracy"
SAMPLED = "eval/sampled_accuracy"


@dataclasses.dataclass
class Run:
  name: str
  arm: str
  lag: int
  seed: int
  config: dict
  record: dict
  result: Optional[dict]                       # None while unfinished
  series: dict[str, dict[int, float]]          # metric -> {step: value}; ACC includes the base at step 0

  def evals(self, key: str = ACC) -> tuple[list[int], list[float]]:
    steps = sorted(self.series.get(key, {}))
    return steps, [self.series[key][s] for s in steps]


def _read_json(path: str) -> Optional[dict]:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def read_metrics(path: str) -> dict[str, dict[int, float]]:
  """metrics.jsonl -> {metric: {step: value}}; a step logged twice (after a resume) keeps its last line."""
  series: dict[str, dict[int, float]] = collections.defaultdict(dict)
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          row = json.loads(line)
          for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
              series[key][int(row["step"])] = float(value)
  return dict(series)


def load_run(workdir: str) -> Optional[Run]:
  record = _read_json(os.path.join(workdir, workunit.RECORD)) or {}
  config = record.get("config") or _read_json(os.path.join(workdir, workunit.JOB_CONFIG))
  if config is None:
    return None
  name = os.path.basename(workdir.rstrip("/"))
  result = _read_json(os.path.join(workdir, workunit.RESULT))
  series = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  base = result["base"] if result else (_read_json(os.path.join(workdir, workunit.WARM_START_MARKER)) or {})
  for key in (ACC, SAMPLED):
    if key in base:
      series.setdefault(key, {})[0] = float(base[key])
  return Run(name=name, arm=str(record.get("labels", {}).get("arm", name.split("-k")[0])),
             lag=int(config["rl"]["max_lag"]), seed=int(config["seed"]), config=config, record=record,
             result=result, series=series)


def load_runs(root: str) -> list[Run]:
  runs = []
  for name in sorted(os.listdir(root)):
    path = os.path.join(root, name)
    if os.path.isdir(path):
      run = load_run(path)
      if run is not None:
        runs.append(run)
  return runs


def run_summary(run: Run, fraction: float, ess_threshold: float) -> dict:
  steps, acc = run.evals()
  ess = run.series.get("ess_ratio", {})
  ess_steps = sorted(ess)
  collapse = analysis.collapse_step(steps, acc, fraction) if len(steps) > 1 else None
  drop = analysis.ess_drop_step(ess_steps, [ess[s] for s in ess_steps], ess_threshold) if ess_steps else None
  final = run.result["final"] if run.result else {}
  lr_scale = list(run.series.get("lr_scale", {}).values())
  seconds = run.series.get("throughput/step_seconds", {})
  at_k = list(run.series.get(f"lag/frac_{run.lag}", {}).values())
  return {"final": final.get(ACC), "final_sampled": final.get(SAMPLED), "base": run.series.get(ACC, {}).get(0),
          "endpoint": analysis.endpoint(*run.evals(ACC)), "endpoint_sampled": analysis.endpoint(*run.evals(SAMPLED)),
          "median_ess": float(np.median(list(ess.values()))) if ess else None,
          "lag_at_k": float(np.mean(at_k)) if at_k else None,  # mean over steps of the share of samples at lag k
          "min_ess": min(ess.values()) if ess else None, "lr_scale": float(np.mean(lr_scale)) if lr_scale else None,
          "collapse": collapse, "ess_drop": drop, "lead": analysis.lead_time(collapse, drop),
          "rl_minutes": sum(seconds.values()) / 60 if seconds else None, "done": run.result is not None,
          "steps": int(run.config["rl"]["steps"])}


def group_runs(runs: list[Run]) -> dict[int, dict[str, list[Run]]]:
  out: dict[int, dict[str, list[Run]]] = collections.defaultdict(lambda: collections.defaultdict(list))
  for run in sorted(runs, key=lambda r: (r.lag, r.arm, r.seed)):
    out[run.lag][run.arm].append(run)
  return out
