"""Figure 5: async (k = 2, 4) / sync (k = 0) RL steps per hour of the main job with embedded servers.

Each run is the real CLI (`python -m vcpo_jax.main --config=configs/countdown.py`) with a few overrides
(a short warm start done once and its cached base copied into the later runs' workdirs; evaluation and
checkpoints pushed out of the timed window). The job appends one line per learner step to
workdir/metrics.jsonl; we watch that file and stamp each step with our own clock when its line appears
(TensorBoard events are flushed too rarely to be read live). Start-up, compilation and the first `skip`
steps are left out, so the figure is the steady-state rate; a run is stopped once it has enough steps
or its time share is spent, and whatever steps it logged are used.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from benchmarks.common import model_choice
from benchmarks.common import records
from benchmarks.common import summary
from vcpo_jax.rollout.servers import launcher

TITLE = "async / sync RL steps per hour (main job)"
GOAL = ">= 1.5"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_STEPS = 1000   # rl.steps of a run: never reached, the run is stopped once measured


@dataclasses.dataclass(frozen=True)
class AsyncSetup:
  lags: tuple[int, ...]         # k values; the first must be 0 (the reference)
  measured_steps: int           # steady-state steps wanted per run
  skip: int                     # first steps left out of the rate (compilation, pipeline fill)
  budget_s: float               # all runs together; each gets an equal share of what is left
  overrides: tuple[str, ...]    # extra --config.* flags shared by every run
  config: str = "configs/countdown.py"


FULL = AsyncSetup(lags=(0, 2, 4), measured_steps=6, skip=2, budget_s=400,
                  overrides=("sft.steps=20", "eval_every=100000", "checkpoint_every=100000", "task.eval_size=16"))
QUICK = AsyncSetup(lags=(0, 2), measured_steps=3, skip=2, budget_s=260,
                   overrides=("sft.steps=5", "eval_every=100000", "checkpoint_every=100000",
                              "rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=16", "task.eval_size=8",
                              "algo.micro_batch_size=8"))
# The Qwen2.5-0.5B shape from random weights (--model qwen2.5-0.5b): no warm start, bf16 compute, short
# generations so a run's steps are learner + rollout time of a real-size model, not of 512 random tokens.
_QWEN_OVERRIDES = ("sft.steps=0", "eval_every=100000", "checkpoint_every=100000", "task.eval_size=8",
                   "model.dtype=bfloat16", "model.matmul_precision=default", "model.max_seq_len=256")
QWEN = AsyncSetup(lags=(0, 2, 4), measured_steps=6, skip=2, budget_s=400, config="configs/qwen2_5.py:0.5b",
                  overrides=_QWEN_OVERRIDES + ("rl.max_new_tokens=128",))
QWEN_QUICK = AsyncSetup(lags=(0, 2), measured_steps=3, skip=2, budget_s=260, config="configs/qwen2_5.py:0.5b",
                        overrides=_QWEN_OVERRIDES + ("rl.max_new_tokens=32", "rl.prompts_per_step=2"))


# configs/tiny.py (--model tiny): seconds per run, a smoke check of the async path rather than a figure.
TINY = AsyncSetup(lags=(0, 2), measured_steps=4, skip=2, budget_s=200, config="configs/tiny.py",
                  overrides=("eval_every=100000", "checkpoint_every=100000"))


def setup_for(quick: bool) -> AsyncSetup:
  name = model_choice.resolve_model()
  if name == "main":
    return QUICK if quick else FULL
  if name == "tiny":
    return TINY
  return QWEN_QUICK if quick else QWEN


def read_steps(path: str) -> list[int]:
  """Step numbers of the complete lines of a metrics.jsonl file (a torn last line is ignored)."""
  if not os.path.exists(path):
    return []
  steps = []
  with open(path) as f:
    for line in f:
      if not line.endswith("\n"):
        break
      try:
        steps.append(int(json.loads(line)["step"]))
      except (ValueError, KeyError, TypeError):
        continue
  return steps


def _steady_steps(times: dict[int, float], skip: int) -> list[int]:
  steps = sorted(times)[skip:]
  if len(steps) < 2:
    raise ValueError(f"need >= 2 logged steps after skip={skip}; got steps {sorted(times)}")
  return steps


def step_intervals(times: dict[int, float], skip: int) -> list[float]:
  """Seconds per step between consecutive steady-state logged steps. Steps first seen in the same poll share
  a stamp (fast steps on an accelerator); such a group counts once, at its last step, so every interval
  spans real time (a zero interval would be an infinite rate)."""
  steps = _steady_steps(times, skip)
  last_of_stamp = {}
  for step in steps:
    last_of_stamp[times[step]] = step
  marks = sorted(last_of_stamp.values())
  return [(times[b] - times[a]) / (b - a) for a, b in zip(marks, marks[1:])]


def steps_per_hour(times: dict[int, float], skip: int) -> float:
  """Steady-state rate: logged steps over the wall time they spanned."""
  steps = _steady_steps(times, skip)
  span = times[steps[-1]] - times[steps[0]]
  if span <= 0:
    raise ValueError(f"logged wall times do not advance: {span}")
  return 3600.0 * (steps[-1] - steps[0]) / span


def train_command(workdir: str, max_lag: int, overrides: Sequence[str], steps: int = MAX_STEPS,
                  config: str = "configs/countdown.py") -> list[str]:
  flags = [f"--config.rl.max_lag={max_lag}", f"--config.rl.steps={steps}"] + [f"--config.{o}" for o in overrides]
  return [sys.executable, "-m", "vcpo_jax.main", f"--config={config}", f"--workdir={workdir}"] + flags


def watch_training(cmd: Sequence[str], workdir: str, *, want_steps: int, time_limit_s: float,
                   poll_s: float = 0.05) -> tuple[dict[int, float], str]:
  """Runs `cmd`, stamping each new metrics.jsonl step with time.monotonic(); stops the process tree when
  `want_steps` steps are in, the time limit passes, or it exits. Returns (times, how it ended)."""
  os.makedirs(workdir, exist_ok=True)
  log_path = os.path.join(workdir, "bench_stdout_stderr.log")
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  times: dict[int, float] = {}
  with open(log_path, "w") as log:
    # Device memory is the job's own business (rollout.*_memory_fraction): what is timed is what it does.
    env = dict(os.environ, VCPO_PROGRESS="0")
    proc = subprocess.Popen(list(cmd), cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + time_limit_s
    ended = "time limit"
    try:
      while time.monotonic() < deadline:
        now = time.monotonic()
        for step in read_steps(metrics_path):
          times.setdefault(step, now)
        if len(times) >= want_steps:
          ended = "enough steps"
          break
        if proc.poll() is not None:
          ended = f"exited with code {proc.returncode}"
          break
        time.sleep(poll_s)
    finally:
      if proc.poll() is None:
        launcher.end_process_tree(proc)
  if ended.startswith("exited") and proc.returncode != 0:
    with open(log_path) as f:
      ended += ": " + f.read()[-800:].strip()
  return times, ended


def produce(quick: bool) -> list[dict]:
  return records.run_figure("async_speedup", TITLE, lambda: _measure(setup_for(quick)), goal=GOAL)


def _one_run(tmp: str, k: int, base: str | None, setup: AsyncSetup, time_limit_s: float) -> tuple[float, dict]:
  workdir = os.path.join(tmp, f"k{k}")
  if base is not None:  # reuse the first run's warm start (SFT) instead of redoing it
    shutil.copytree(base, os.path.join(workdir, "base"))
  want = setup.skip + setup.measured_steps + 1
  times, ended = watch_training(train_command(workdir, k, setup.overrides, config=setup.config), workdir,
                                want_steps=want,
                                time_limit_s=time_limit_s)
  info = {"ended": ended, "logged_steps": len(times), "time_limit_s": round(time_limit_s)}
  try:
    rate = steps_per_hour(times, setup.skip)
  except ValueError as e:
    raise RuntimeError(f"k={k}: {e}; run ended: {ended}") from None
  intervals = step_intervals(times, setup.skip)
  info.update(steps_per_hour=rate, seconds_per_step=summary.summarize(intervals).to_dict(), intervals_s=intervals)
  return rate, info


def _measure(setup: AsyncSetup) -> list[dict]:
  if setup.lags[0] != 0:
    raise ValueError(f"lags must start with 0 (the sync reference), got lags={setup.lags}")
  rates, errors = {}, {}
  details = {"measured_steps": setup.measured_steps, "skip": setup.skip, "overrides": list(setup.overrides),
             "config": setup.config,
             "timed": "wall time at which each step's metrics.jsonl line appeared (steady state)"}
  # The suite's runner says how long this job may take; keep a margin for start-up and writing results.
  budget_s = min(setup.budget_s, float(os.environ.get("BENCH_JOB_LIMIT_S", "inf")) - 40)
  details["budget_s"] = budget_s
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
    base = None
    for i, k in enumerate(setup.lags):
      share = (budget_s - (time.monotonic() - start)) / (len(setup.lags) - i)
      try:
        rates[k], details[f"k{k}"] = _one_run(tmp, k, base, setup, share)
      except Exception as e:  # noqa: BLE001 - one failed run must not lose the others
        errors[k] = f"{type(e).__name__}: {str(e)[-600:]}"
        details[f"k{k}"] = {"error": errors[k]}
      candidate = os.path.join(tmp, f"k{k}", "base")
      if base is None and os.path.exists(os.path.join(candidate, "warm_start.json")):
        base = candidate
  return speedup_figures(setup, rates, errors, details)


def speedup_figures(setup: AsyncSetup, rates: dict, errors: dict, details: dict) -> list[dict]:
  """One figure per k > 0: paired per-step ratios sync/async (rounds = i-th steady-state step of each run)."""
  figures = []
  for k in setup.lags[1:]:
    key, title = f"async_speedup_k{k}", f"async k={k} / sync k=0 RL steps per hour (main job)"
    missing = {j: errors[j] for j in (0, k) if j in errors}
    if missing:
      figures.append(records.failed_figure(key, title, "; ".join(f"k={j}: {e}" for j, e in missing.items()),
                                           goal=GOAL, details=details))
      continue
    n = min(len(details["k0"]["intervals_s"]), len(details[f"k{k}"]["intervals_s"]))
    paired = summary.ratio_samples(details["k0"]["intervals_s"][:n], details[f"k{k}"]["intervals_s"][:n])
    figures.append(records.figure(
        key, title, unit="x", goal=GOAL, stats=summary.summarize(paired), details=details,
        note=f"median of paired per-step ratios; whole-window rates {rates[k]:.0f} vs {rates[0]:.0f} steps/h "
             f"(ratio {rates[k] / rates[0]:.2f}x); one run each, first {setup.skip} steps left out"))
  return figures


if __name__ == "__main__":
  records.module_main(produce, __doc__)
