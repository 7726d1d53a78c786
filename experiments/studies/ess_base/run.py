"""The on-policy (lag 0) ESS ratio with real sampler numerics: short synchronous jobs, float32 and bfloat16.

    python -m experiments.studies.ess_base.run --root=workdir/ess_base --out=docs/results/ess_base [--report_only] [-- --config.x=y]

For the main job's model (configs/countdown.py:sync) and the study's setting (experiments/studies/claims/config.py:trace
switched to the http backend at k = 0), with model.dtype float32 and bfloat16, runs one short job each: a short
warm start, then RL_STEPS synchronous steps whose rollouts come from the embedded server (its KV-cache decode
at the model's compute dtype) and are scored by the learner's full forward. With k = 0 every row is lag 0, so
the step's `ess_ratio` is the ESS ratio of numerics alone, and `mismatch/lag0/*` its per-token and
per-sequence |log w|. A run whose workdir holds result.json is not rerun. Writes results.json (per run and
step statistic: median, p10 (numpy's linear interpolation), min over RL steps) and README.md to --out.
"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from experiments.launch import timed_job

# name -> (config, its overrides). The study's config is lag emulation: here the same model, task and warm
# start with real rollouts at k = 0.
# Warm starts shorter than the configs' own (200 and 400 steps) keep the four jobs near 12 minutes on 2 cores.
SFT_STEPS = {"main": 100, "study": 200}
SETTINGS = {
    "main": ("configs/countdown.py:sync", [f"--config.sft.steps={SFT_STEPS['main']}"]),
    "study": ("experiments/studies/claims/config.py:trace", ["--config.rl.mode=http", "--config.rl.max_lag=0",
                                                     f"--config.sft.steps={SFT_STEPS['study']}"]),
}
DTYPES = ("float32", "bfloat16")
RL_STEPS = 20
# Short jobs: a small evaluation set (the job evaluates its base and its end) and no intermediate checkpoints.
COMMON = [f"--config.rl.steps={RL_STEPS}", "--config.task.eval_size=16", "--config.eval_every=0",
          "--config.checkpoint_every=0"]
# Per-step metrics collected (short name -> the job's metric).
METRICS = {"ess_ratio": "ess_ratio", "lr_scale": "lr_scale", "lag_max": "lag/max",
           "seq_logw_abs_mean": "mismatch/lag0/seq_logw_abs_mean", "seq_logw_mean": "mismatch/lag0/seq_logw_mean",
           "token_abs_mean": "mismatch/lag0/token_abs_mean", "token_abs_max": "mismatch/lag0/token_abs_max",
           "lag0_seqs": "mismatch/lag0/num_seqs", "logw_max": "is/logw_max", "logw_p99": "is/logw_p99",
           "response_len": "response_length/mean"}
THRESHOLD = 0.95  # below it the sqrt rule with base 1.0 shrinks every step by sqrt(ratio) or more


def run_name(setting: str, dtype: str) -> str:
  return f"{setting}_{dtype}"


def command(setting: str, dtype: str, workdir: str, overrides: list[str]) -> list[str]:
  config, own = SETTINGS[setting]
  return [sys.executable, "-m", "vcpo_jax.main", f"--config={config}", f"--workdir={workdir}",
          f"--config.model.dtype={dtype}", *own, *COMMON, *overrides]


def run_one(root: str, setting: str, dtype: str, overrides: list[str]) -> str:
  """Runs (or resumes) one job unless its workdir holds result.json; wall minutes accumulate in timing.json."""
  workdir = os.path.join(root, run_name(setting, dtype))
  return timed_job.run(workdir, command(setting, dtype, workdir, overrides))


def load_steps(workdir: str) -> dict[str, np.ndarray]:
  """METRICS' short names -> float64 per RL step (step order; NaN where a step did not log it)."""
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      if "ess_ratio" in row:  # an RL step (step 0 holds the base model's evaluation)
        rows[int(row["step"])] = row  # a resumed job rewrites a step: the last one counts
  return {name: np.array([float(rows[s].get(key, math.nan)) for s in sorted(rows)], np.float64)
          for name, key in METRICS.items()}


def stats(x_S: np.ndarray) -> dict:
  x_S = x_S[np.isfinite(x_S)]
  if not len(x_S):
    return {"median": math.nan, "p10": math.nan, "min": math.nan, "max": math.nan, "mean": math.nan}
  return {"median": float(np.median(x_S)), "p10": float(np.percentile(x_S, 10)), "min": float(np.min(x_S)),
          "max": float(np.max(x_S)), "mean": float(np.mean(x_S))}


def summarize_run(workdir: str) -> dict:
  steps = load_steps(workdir)
  minutes = timed_job.minutes(workdir)
  rho_S = steps["ess_ratio"]
  out = {"rl_steps": int(len(rho_S)), "minutes": minutes, "ess_ratio_per_step": [float(r) for r in rho_S],
         "steps_below_threshold": int(np.sum(rho_S < THRESHOLD)),
         # The sqrt rule with base 1.0 (the default): the factor on every step.
         "scale_base1": stats(np.sqrt(np.clip(rho_S, 0.0, 1.0)))}
  out.update({name: stats(x_S) for name, x_S in steps.items()})
  return out


def summarize(root: str) -> dict:
  runs = {}
  for setting in SETTINGS:
    for dtype in DTYPES:
      workdir = os.path.join(root, run_name(setting, dtype))
      if os.path.exists(os.path.join(workdir, "result.json")):
        runs[run_name(setting, dtype)] = summarize_run(workdir)
  below = sorted(name for name, r in runs.items() if r["ess_ratio"]["median"] < THRESHOLD)
  return {"rl_steps": RL_STEPS, "threshold": THRESHOLD, "runs": runs, "median_below_threshold": below}


def _f(x: float, fmt: str = "{:.4f}") -> str:
  return "-" if not math.isfinite(x) else fmt.format(x)


def readme(summary: dict, cmd: str) -> str:
  runs = summary["runs"]
  lines = ["# On-policy ESS ratio: the base of the step scaling", "",
           "Generated by `experiments/studies/ess_base/run.py`:", "", "```", cmd, "```", "",
           f"Synchronous jobs (k = 0, http backend, embedded server) of {summary['rl_steps']} RL steps after a "
           "short warm start: every row is lag 0, so the sequence IS weights differ from 1 by the sampler's and "
           "the learner's numerics alone (the server's KV-cache decode vs the learner's full forward, both at "
           f"`model.dtype`). `main` = configs/countdown.py:sync (warm start {SFT_STEPS['main']} steps), "
           f"`study` = experiments/studies/claims/config.py:trace with `rl.mode=http rl.max_lag=0` (warm start "
           f"{SFT_STEPS['study']} steps).", "",
           "ESS ratio of the step (`ess_ratio`) over RL steps, and the step scale of the sqrt rule with "
           "base 1.0, sqrt(min(1, ratio)); minutes: the whole job's wall time, warm start included:", "",
           f"| run | steps | median | p10 | min | 1 - median | 1 - min | steps < {summary['threshold']} | "
           "scale (base 1.0) median | min | minutes |", "|" + " --- |" * 11]
  for name, r in runs.items():
    e, s = r["ess_ratio"], r["scale_base1"]
    lines.append(f"| {name} | {r['rl_steps']} | {_f(e['median'])} | {_f(e['p10'])} | {_f(e['min'])} | "
                 f"{_f(1 - e['median'], '{:.1e}')} | {_f(1 - e['min'], '{:.1e}')} | "
                 f"{r['steps_below_threshold']} | {_f(s['median'])} | {_f(s['min'])} | "
                 f"{_f(r['minutes'], '{:.1f}')} |")
  lines += ["", "Lag-0 mismatch (`mismatch/lag0/*`, per step; median over steps [max]): per-sequence |log w| "
            "mean, the step's 99th percentile and max of log w (`is/logw_p99`, `is/logw_max`), per-token "
            "|delta| mean and max, and the mean response length in tokens:", "",
            "| run | seq \\|log w\\| mean | log w p99 | log w max | token \\|delta\\| mean | token \\|delta\\| max | "
            "response tokens | lag-0 rows / step | max lag |", "|" + " --- |" * 9]
  for name, r in runs.items():
    lines.append(f"| {name} | {_f(r['seq_logw_abs_mean']['median'], '{:.2e}')} "
                 f"[{_f(r['seq_logw_abs_mean']['max'], '{:.2e}')}] | "
                 f"{_f(r['logw_p99']['median'], '{:.2e}')} [{_f(r['logw_p99']['max'], '{:.2e}')}] | "
                 f"{_f(r['logw_max']['median'], '{:.2e}')} [{_f(r['logw_max']['max'], '{:.2e}')}] | "
                 f"{_f(r['token_abs_mean']['median'], '{:.2e}')} [{_f(r['token_abs_mean']['max'], '{:.2e}')}] | "
                 f"{_f(r['token_abs_max']['median'], '{:.2e}')} [{_f(r['token_abs_max']['max'], '{:.2e}')}] | "
                 f"{_f(r['response_len']['median'], '{:.1f}')} | {_f(r['lag0_seqs']['median'], '{:.0f}')} | "
                 f"{_f(r['lag_max']['max'], '{:.0f}')} |")
  lines += ["", verdict(summary), ""]
  return "\n".join(lines)


def verdict(summary: dict) -> str:
  """The page's conclusion: which settings' median lag-0 ratio is below the threshold, and the largest shrink."""
  runs, t = summary["runs"], summary["threshold"]
  if not runs:
    return "No finished runs."
  below = summary["median_below_threshold"]
  worst = min(runs, key=lambda name: runs[name]["scale_base1"]["median"])
  steps = sum(r["steps_below_threshold"] for r in runs.values())
  total = sum(r["rl_steps"] for r in runs.values())
  tail = (f"The largest shrink from numerics alone: {worst}, median step scale "
          f"{_f(runs[worst]['scale_base1']['median'])} with base 1.0 (lowest {_f(runs[worst]['scale_base1']['min'])}); "
          f"{steps} of {total} steps have a ratio below {t}.")
  if below:
    return f"Median lag-0 ratio below {t} in: {', '.join(below)}. {tail}"
  lowest = min(r["scale_base1"]["min"] for r in runs.values())
  return (f"No setting has a median lag-0 ratio below {t}. {tail} A base estimated from lag-0 rows (in place of "
          f"1.0) would therefore raise no step by more than a factor 1 / {_f(lowest)}, so none is offered.")


def main(argv=None) -> dict:
  parser = timed_job.driver_parser(__doc__, root="workdir/ess_base", out="docs/results/ess_base")
  args, overrides = timed_job.parse_driver(parser, argv)
  if not args.report_only:
    for setting in SETTINGS:
      for dtype in DTYPES:
        workdir = os.path.join(args.root, run_name(setting, dtype))
        print(f"{run_name(setting, dtype)}: {' '.join(command(setting, dtype, workdir, overrides))}", flush=True)
        run_one(args.root, setting, dtype, overrides)
  summary = summarize(args.root)
  cmd = timed_job.driver_command("experiments.studies.ess_base.run", [f"--root={args.root}", f"--out={args.out}"],
                                 overrides)
  summary["command"] = cmd
  timed_job.write_page(args.out, summary, readme(summary, cmd))
  print(json.dumps({k: v["ess_ratio"] for k, v in summary["runs"].items()}, indent=1))
  return summary


if __name__ == "__main__":
  main()
