"""Figure 5: async (k = 2, 4) / sync (k = 0) RL steps per hour of the main job with embedded servers.

Each run is the real CLI (`python -m vcpo_jax.main --config=configs/countdown.py`) with a few overrides
(fewer steps; the warm start is done once and its cached base copied into the other runs' workdirs).
Step times are the wall times TensorBoard recorded for each step's scalars, so start-up, compilation and
the first `skip` steps and the last one (the job evaluates after its final step) are excluded, so the
figure is the steady-state rate.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import struct
import sys
import tempfile
from typing import Iterator, Sequence

from benchmarks import common

TITLE = "async / sync RL steps per hour (main job)"
GOAL = ">= 1.5"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class AsyncSetup:
  lags: tuple[int, ...]         # k values; the first must be 0 (the reference)
  steps: int                    # RL steps per run
  skip: int                     # first steps left out of the rate (compilation, pipeline fill)
  overrides: tuple[str, ...]    # extra --config.* flags shared by every run
  run_timeout_s: float


FULL = AsyncSetup(lags=(0, 2, 4), steps=14, skip=3, run_timeout_s=130,
                  overrides=("sft.steps=100", "eval_every=1000", "checkpoint_every=1000"))
QUICK = AsyncSetup(lags=(0, 2), steps=6, skip=2, run_timeout_s=120,
                   overrides=("sft.steps=5", "eval_every=1000", "checkpoint_every=1000", "rl.prompts_per_step=4",
                              "rl.group_size=4", "rl.max_new_tokens=16", "task.eval_size=8"))


def tfrecord_payloads(path: str) -> Iterator[bytes]:
  """Records of a TFRecord file (u64 length, u32 crc, payload, u32 crc); a torn last record is dropped."""
  with open(path, "rb") as f:
    while True:
      header = f.read(12)
      if len(header) < 12:
        return
      (length,) = struct.unpack("<Q", header[:8])
      payload = f.read(length)
      if len(payload) < length or len(f.read(4)) < 4:
        return
      yield payload


def scalar_events(logdir: str) -> list[tuple[str, int, float, float]]:
  """(tag, step, wall_time, value) of every scalar in every event file under `logdir`."""
  from tensorboardX.proto import event_pb2
  out = []
  for path in sorted(glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)):
    for payload in tfrecord_payloads(path):
      event = event_pb2.Event.FromString(payload)
      for v in event.summary.value:
        if v.WhichOneof("value") == "simple_value":
          out.append((v.tag, int(event.step), float(event.wall_time), float(v.simple_value)))
  return out


def step_wall_times(events: Sequence[tuple[str, int, float, float]], tag_prefix: str = "") -> dict[int, float]:
  """Earliest wall time at which each step wrote a scalar (optionally only tags starting with a prefix)."""
  times: dict[int, float] = {}
  for tag, step, wall, _ in events:
    if tag.startswith(tag_prefix):
      times[step] = min(wall, times.get(step, wall))
  return times


def _steady_steps(times: dict[int, float], skip: int, drop_last: bool) -> list[int]:
  """Logged steps without the first `skip` (compilation) and, optionally, the last (the job evaluates there)."""
  steps = sorted(times)[skip:]
  if drop_last:
    steps = steps[:-1]
  if len(steps) < 2:
    raise ValueError(f"need >= 2 logged steps after skip={skip}, drop_last={drop_last}; got {sorted(times)}")
  return steps


def step_intervals(times: dict[int, float], skip: int, drop_last: bool = False) -> list[float]:
  """Seconds per step between consecutive steady-state logged steps."""
  steps = _steady_steps(times, skip, drop_last)
  return [(times[b] - times[a]) / (b - a) for a, b in zip(steps, steps[1:])]


def steps_per_hour(times: dict[int, float], skip: int, drop_last: bool = False) -> float:
  """Steady-state rate: logged steps over the wall time they spanned."""
  steps = _steady_steps(times, skip, drop_last)
  span = times[steps[-1]] - times[steps[0]]
  if span <= 0:
    raise ValueError(f"logged wall times do not advance: {span}")
  return 3600.0 * (steps[-1] - steps[0]) / span


def train_command(workdir: str, max_lag: int, steps: int, overrides: Sequence[str]) -> list[str]:
  flags = [f"--config.rl.max_lag={max_lag}", f"--config.rl.steps={steps}"] + [f"--config.{o}" for o in overrides]
  return [sys.executable, "-m", "vcpo_jax.main", "--config=configs/countdown.py", f"--workdir={workdir}"] + flags


def run_training(workdir: str, max_lag: int, setup: AsyncSetup) -> None:
  env = dict(os.environ, VCPO_PROGRESS="0")
  proc = common.run_subprocess(train_command(workdir, max_lag, setup.steps, setup.overrides), cwd=REPO_ROOT,
                               env=env, timeout=setup.run_timeout_s)
  if proc.returncode != 0:
    raise RuntimeError(f"k={max_lag} training exited {proc.returncode}: {proc.stderr.strip()[-800:]}")


def produce(quick: bool) -> list[dict]:
  return common.run_figure("async_speedup", TITLE, lambda: _measure(QUICK if quick else FULL), goal=GOAL)


def _measure(setup: AsyncSetup) -> list[dict]:
  if setup.lags[0] != 0:
    raise ValueError(f"lags must start with 0 (the sync reference), got lags={setup.lags}")
  rates, errors = {}, {}
  details = {"steps": setup.steps, "skip": setup.skip, "overrides": list(setup.overrides),
             "timed": "TensorBoard wall time of each RL step's scalars (steady state)"}
  with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
    base = None
    for k in setup.lags:
      workdir = os.path.join(tmp, f"k{k}")
      try:
        if base is not None:  # reuse the first run's warm start (SFT) instead of redoing it
          shutil.copytree(base, os.path.join(workdir, "base"))
        run_training(workdir, k, setup)
        base = base or os.path.join(workdir, "base")
        times = step_wall_times(scalar_events(workdir))
        rates[k] = steps_per_hour(times, setup.skip, drop_last=True)
        intervals = step_intervals(times, setup.skip, drop_last=True)
        details[f"k{k}"] = {"steps_per_hour": rates[k], "logged_steps": len(times),
                            "seconds_per_step": common.summarize(intervals).to_dict()}
      except Exception as e:  # noqa: BLE001 - one failed run must not lose the others
        errors[k] = f"{type(e).__name__}: {str(e)[-600:]}"
        details[f"k{k}"] = {"error": errors[k]}
  figures = []
  for k in setup.lags[1:]:
    key, title = f"async_speedup_k{k}", f"async k={k} / sync k=0 RL steps per hour (main job)"
    missing = {j: errors[j] for j in (0, k) if j in errors}
    if missing:
      figures.append(common.failed_figure(key, title, "; ".join(f"k={j}: {e}" for j, e in missing.items()),
                                          goal=GOAL))
      continue
    figures.append(common.figure(
        key, title, unit="x", goal=GOAL, value=rates[k] / rates[0], details=details,
        note=f"{rates[k]:.0f} vs {rates[0]:.0f} steps/h; one run each, {setup.steps} steps, first "
             f"{setup.skip} and last left out; per-step spread in details"))
  return figures


if __name__ == "__main__":
  common.module_main(produce, __doc__)
