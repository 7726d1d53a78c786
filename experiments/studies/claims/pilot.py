"""The calibration pilot's table: `python -m experiments.studies.claims.pilot RUN_ROOT [--out DIR]` writes DIR/pilot.md and
DIR/pilot.json (default DIR = RUN_ROOT) from the units of experiments/studies/claims/sweeps/pilot.py.

Per unit, over the steady steps (every sample at lag k; all steps for sync):
- ESS ratio: median, 10th percentile, minimum and the share of steps below 0.2 ("dips");
- sequence KL between the sampler and the learner at lag k, KL(mu || pi) ~ -mean_i log w_i over the batch
  (mismatch/lagged/seq_logw_mean), its median; per step of lag: that / k; KL at lag 1 (the ramp's steps
  whose lagged samples are all at lag 1) and k x KL at lag 1, to compare with the KL at lag k (equal if the
  KL grew linearly with the lag);
- endpoint (mean of the last 3 held-out greedy evaluations) and its difference from sync at the same lr;
- the time per RL step and the unit's wall time (for sizing the study).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Optional

import numpy as np

from experiments.launch import workunit
from experiments.stats import analysis, loader, report

STEADY_SHARE = 0.999  # a step is steady when this share of its samples is at lag k
DIP = 0.2


def _values(series: dict, key: str, steps) -> list[float]:
  s = series.get(key, {})
  return [s[t] for t in steps if t in s and math.isfinite(s[t])]


def _median(x) -> Optional[float]:
  return float(np.median(x)) if len(x) else None


def _wall_minutes(workdir: str, record: dict) -> Optional[float]:
  """Minutes from the last launch to result.json (warm start included when this unit computed it)."""
  import datetime  # noqa: PLC0415
  path = os.path.join(workdir, workunit.RESULT)
  if not record.get("launches") or not os.path.exists(path):
    return None
  start = datetime.datetime.fromisoformat(record["launches"][-1]["time"]).timestamp()
  return (os.path.getmtime(path) - start) / 60


def unit_row(run: loader.Run, root: str) -> dict:
  k, series = run.lag, run.series
  steps = sorted(series.get("ess_ratio", {}))
  at_k = series.get(f"lag/frac_{k}", {})
  steady = [t for t in steps if k == 0 or at_k.get(t, 0.0) >= STEADY_SHARE]
  ess = _values(series, "ess_ratio", steady)
  kl = [-v for v in _values(series, "mismatch/lagged/seq_logw_mean", steady)] if k else []
  lag_max = series.get("lag/max", {})
  ramp1 = [t for t in steps if lag_max.get(t) == 1 and series.get("lag/frac_1", {}).get(t, 0) > 0]
  kl1 = [-v for v in _values(series, "mismatch/lagged/seq_logw_mean", ramp1)]
  reward = [series["reward/mean"][t] for t in steps[-10:] if t in series.get("reward/mean", {})]
  step_s = list(series.get("throughput/step_seconds", {}).values())
  acc_steps, acc = run.evals()
  return {
      "unit": run.name, "arm": run.arm, "k": k, "lr": run.config["optim"]["learning_rate"], "seed": run.seed,
      "steps_done": max(steps) if steps else 0, "steps": run.config["rl"]["steps"], "done": run.result is not None,
      "steady_steps": len(steady), "base": series.get(loader.ACC, {}).get(0),
      "evals": {int(s): a for s, a in zip(acc_steps, acc)}, "endpoint": analysis.endpoint(acc_steps, acc),
      "collapse": analysis.collapse_step(acc_steps, acc) if len(acc_steps) > 1 else None,
      "train_reward_last10": float(np.mean(reward)) if reward else None,
      "response_length": _median(list(series.get("response_length/mean", {}).values())),
      "ess_median": _median(ess), "ess_p10": float(np.percentile(ess, 10)) if ess else None,
      "ess_min": min(ess) if ess else None, "ess_dip_share": float(np.mean(np.asarray(ess) < DIP)) if ess else None,
      "seq_kl_at_k": _median(kl), "seq_kl_per_lag_step": _median(kl) / k if kl else None,
      "seq_kl_lag1": _median(kl1), "k_x_seq_kl_lag1": k * _median(kl1) if kl1 else None,
      "step_seconds": float(np.mean(step_s[1:])) if len(step_s) > 1 else None,
      "wall_minutes": _wall_minutes(os.path.join(root, run.name), run.record),
      "git_sha": (run.record.get("launches") or [{}])[-1].get("git_sha"),
  }


def _f(v, spec="{:.3g}") -> str:
  return "-" if v is None else spec.format(v)


def table(rows: list[dict]) -> list[str]:
  sync = {r["lr"]: r for r in rows if r["arm"] == "sync"}
  lines = ["| lr | arm | k | steps (steady) | base % | endpoint % | Δ vs sync (pts) | collapsed | train reward (last 10) "
           "| ESS ratio median | p10 | min | share < 0.2 | seq KL at k | KL / k | KL at lag 1 | k x KL at lag 1 "
           "| response tokens | s / step | unit min |", "|" + "---|" * 20]
  for r in sorted(rows, key=lambda r: (r["lr"], r["k"], r["arm"])):
    ref = sync.get(r["lr"])
    delta = (100 * (r["endpoint"] - ref["endpoint"]) if r["arm"] != "sync" and ref and ref["endpoint"] is not None
             and r["endpoint"] is not None else None)
    lines.append(
        f"| {r['lr']:g} | {r['arm']} | {r['k']} | {r['steps_done']}/{r['steps']} ({r['steady_steps']}) "
        f"| {_f(r['base'] and 100 * r['base'], '{:.1f}')} | {_f(r['endpoint'] and 100 * r['endpoint'], '{:.1f}')} "
        f"| {_f(delta, '{:+.1f}')} | {r['collapse'] if r['collapse'] is not None else 'no'} "
        f"| {_f(r['train_reward_last10'], '{:.3f}')} | {_f(r['ess_median'])} | {_f(r['ess_p10'])} | {_f(r['ess_min'])} "
        f"| {_f(r['ess_dip_share'], '{:.2f}')} | {_f(r['seq_kl_at_k'])} | {_f(r['seq_kl_per_lag_step'])} "
        f"| {_f(r['seq_kl_lag1'])} | {_f(r['k_x_seq_kl_lag1'])} | {_f(r['response_length'], '{:.1f}')} "
        f"| {_f(r['step_seconds'], '{:.2f}')} | {_f(r['wall_minutes'], '{:.1f}')} |")
  return lines


# Per-step cost of the OPOB arms relative to seq-TIS (per-sequence gradient norms): the first study measured
# 3.6-3.8 vs 3.5 RL minutes per 60 steps (docs/results/study/first_study/report.md); 1.25 leaves a margin.
OPOB_COST = 1.25
PARALLEL = 2


def estimate(rows: list[dict], sweep_spec: str, config: str) -> dict:
  """Machine hours of a sweep on this machine alone, from the pilot's finished units: per unit, steps x the
  pilot's mean seconds per step (x OPOB_COST for OPOB arms) + its evaluations and start-up (the pilot's
  unit time not spent in steps, per evaluation), plus one warm start per seed; units run PARALLEL at once."""
  from experiments.launch import local as launch  # noqa: PLC0415
  done = [r for r in rows if r["done"] and r["step_seconds"] and r["wall_minutes"]]
  if not done:
    return {}
  per_step = float(np.median([r["step_seconds"] for r in done]))
  # A unit that computed the warm start also spent it: the one with the longest non-step time is that unit.
  overhead = sorted(60 * r["wall_minutes"] - r["step_seconds"] * r["steps"] for r in done)
  per_eval = max(overhead[0], 0.0) / (1 + max(r["steps"] for r in done) // 20)
  warm_start = max(overhead[-1] - overhead[0], 0.0)
  units = workunit.prepare(launch.load_sweep(sweep_spec), config, "/nonexistent", validate=False)
  seconds, seeds = 0.0, set()
  for u in units:
    c = u.config
    cost = OPOB_COST if c["algo"]["advantage"] == "opob" else 1.0
    seconds += c["rl"]["steps"] * per_step * cost + (1 + c["rl"]["steps"] // c["eval_every"]) * per_eval
    seeds.add(c["seed"])
  hours = (seconds / PARALLEL + len(seeds) * warm_start) / 3600
  return {"sweep": sweep_spec, "units": len(units), "seconds_per_step": per_step, "seconds_per_eval": per_eval,
          "warm_start_seconds": warm_start, "parallel": PARALLEL, "opob_cost": OPOB_COST, "machine_hours": hours}


DEFAULT_CONFIG = "experiments/studies/claims/config.py"


def write(root: str, out: str, estimate_sweep: Optional[list] = None, config: str = DEFAULT_CONFIG) -> str:
  runs = loader.load_runs(root)
  rows = [unit_row(r, root) for r in runs]
  os.makedirs(out, exist_ok=True)
  shas = sorted({r["git_sha"] for r in rows if r["git_sha"]})
  with open(os.path.join(out, "pilot.json"), "w") as f:
    json.dump({"root": os.path.abspath(root), "source_commits": shas, "units": rows}, f, indent=1)
  md = ["# Calibration pilot (generated)", "",
        f"`python -m experiments.studies.claims.pilot {root} --out <this directory>"
        f"{''.join(' --estimate=' + e for e in estimate_sweep or [])}"
        f"{' --config=' + config if estimate_sweep and config != DEFAULT_CONFIG else ''}` from {len(rows)} units "
        f"({sum(r['done'] for r in rows)} finished); source commit(s) in pilot.json. Definitions: "
        "experiments/studies/claims/pilot.py. Steady steps: every sample at lag k (all steps for sync). Endpoint: mean of the "
        "last 3 held-out greedy evaluations. Seq KL: -mean log w over the batch, KL(sampler || learner) per "
        "sequence, in nats.", "", *table(rows), ""]
  if estimate_sweep:
    md += ["## The study's machine time, estimated from these units", ""]
  for est_sweep in estimate_sweep or []:
    est = estimate(rows, est_sweep, config)
    md += [
           f"`{est.get('sweep')}`: {est.get('units')} units, ~{_f(est.get('machine_hours'), '{:.1f}')} h of this "
           f"machine alone ({PARALLEL} units at once; {_f(est.get('seconds_per_step'), '{:.2f}')} s per step as "
           f"measured here, x{OPOB_COST:g} for OPOB arms; {_f(est.get('seconds_per_eval'), '{:.0f}')} s per "
           f"evaluation and start-up; {_f(est.get('warm_start_seconds'), '{:.0f}')} s per seed's warm start). "
           "The pilot ran niced on a shared machine, so this is an upper estimate.", ""]
    with open(os.path.join(out, "pilot.json")) as f:
      data = json.load(f)
    data.setdefault("study_estimates", []).append(est)
    with open(os.path.join(out, "pilot.json"), "w") as f:
      json.dump(data, f, indent=1)
  return report.write_page(md, out, "pilot.md")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("root")
  parser.add_argument("--out", help="output directory (default: ROOT)")
  parser.add_argument("--estimate", action="append", help="a sweep file[:arg] whose machine time to estimate "
                      "from the pilot (repeatable)")
  parser.add_argument("--config", default=DEFAULT_CONFIG, help="the estimated sweeps' config")
  args = parser.parse_args(argv)
  print(write(args.root, args.out or args.root, args.estimate, args.config))


if __name__ == "__main__":
  main()
