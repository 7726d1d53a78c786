"""Benchmark plumbing: timing with warm-up and repeats, robust statistics, figure records, environment, tables."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

# Why interleaving: the machine is shared and noisy, so a ratio is measured as per-round ratios of
# calls timed back to back (A, B, A, B, ...), which cancels slow drifts in load better than timing
# all of A and then all of B.

VERSION_PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "flax", "optax", "torch", "transformers")

# Which model the figures use: "main" (alias "countdown") is the main CPU job's model (configs/countdown.py);
# "tiny" is configs/tiny.py's (seconds per figure: smoke runs); "qwen2.5-0.5b" is the Qwen2.5-0.5B shape
# (configs/qwen2_5.py:0.5b, random weights, bfloat16 compute as real-model runs use); "auto" picks main on CPU
# and the 0.5B shape on an accelerator. Children read it from BENCH_MODEL.
MODELS = ("auto", "main", "countdown", "tiny", "qwen2.5-0.5b")
ALIASES = {"countdown": "main"}
SMALL_MODELS = ("main", "tiny")   # CPU-sized: their figures use the CPU job's batch sizes
MODEL_ENV = "BENCH_MODEL"


def resolve_model(choice: str | None = None, backend: str | None = None) -> str:
  """'main', 'tiny' or 'qwen2.5-0.5b' for a --model choice (default: $BENCH_MODEL, else auto) on `backend`."""
  choice = choice or os.environ.get(MODEL_ENV) or "auto"
  if choice not in MODELS:
    raise ValueError(f"--model must be one of {MODELS}, got {choice!r}")
  if choice != "auto":
    return ALIASES.get(choice, choice)
  if backend is None:
    import jax
    backend = jax.default_backend()
  return "main" if backend == "cpu" else "qwen2.5-0.5b"


def small_model(name: str | None = None) -> bool:
  """Whether the figures' model is CPU-sized (main or tiny), i.e. uses the CPU job's sizes."""
  return resolve_model(name) in SMALL_MODELS


def job_config(name: str | None = None):
  """The training job config whose model and learner the figures use (see MODELS)."""
  name = resolve_model(name)
  if name == "main":
    from configs import countdown
    return countdown.get_config()
  if name == "tiny":
    from configs import tiny
    return tiny.get_config()
  from configs import qwen2_5
  config = qwen2_5.get_config("0.5b")
  config.model.update(dtype="bfloat16", matmul_precision="default")
  return config


def model_config(name: str | None = None):
  from vcpo_jax.model import hf
  return hf.model_config(job_config(name).model)


@dataclasses.dataclass(frozen=True)
class Stats:
  """Median and range of repeated measurements (seconds, or a ratio)."""
  median: float
  min: float
  max: float
  n: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def summarize(samples: Sequence[float]) -> Stats:
  """Median, min and max of a non-empty list of finite numbers."""
  values = [float(x) for x in samples]
  if not values:
    raise ValueError("samples must be non-empty")
  bad = [x for x in values if not math.isfinite(x)]
  if bad:
    raise ValueError(f"samples must be finite, got {bad[:3]}")
  return Stats(median=statistics.median(values), min=min(values), max=max(values), n=len(values))


def block(tree):
  """Waits for every array in a pytree (jax arrays have block_until_ready; others pass through)."""
  try:
    import jax
    return jax.block_until_ready(tree)
  except ImportError:  # pragma: no cover - jax is always installed here
    return tree


def time_once(fn: Callable[[], Any], sync: Callable[[Any], Any] = block) -> float:
  """Wall seconds of one call, including waiting for its asynchronous results."""
  start = time.perf_counter()
  sync(fn())
  return time.perf_counter() - start


def time_calls(fns: Mapping[str, Callable[[], Any]], *, warmup: int = 1, repeats: int = 5,
               sync: Callable[[Any], Any] = block) -> dict[str, list[float]]:
  """Per-call wall times of several thunks, interleaved round by round after `warmup` untimed rounds."""
  if warmup < 0:
    raise ValueError(f"warmup must be >= 0, got {warmup}")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  for _ in range(warmup):
    for fn in fns.values():
      sync(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      times[name].append(time_once(fn, sync))
  return times


def ratio_samples(num: Sequence[float], den: Sequence[float]) -> list[float]:
  """Per-round ratios num[i] / den[i] of interleaved measurements."""
  if len(num) != len(den) or not num:
    raise ValueError(f"num and den must be non-empty and of equal length, got {len(num)} and {len(den)}")
  if any(d <= 0 for d in den):
    raise ValueError("den must be positive")
  return [a / b for a, b in zip(num, den)]


def goal_met(value: float | None, goal: str | None) -> bool | None:
  """Checks a value against a goal written as '<= x', '< x', '>= x' or '> x'; None if not checkable."""
  if value is None or not goal or not math.isfinite(value):
    return None
  op, _, rhs = goal.strip().partition(" ")
  try:
    bound = float(rhs)
  except ValueError as e:
    raise ValueError(f"goal must look like '<= 1.3', got goal={goal!r}") from e
  checks = {"<=": value <= bound, "<": value < bound, ">=": value >= bound, ">": value > bound}
  if op not in checks:
    raise ValueError(f"goal must start with one of {sorted(checks)}, got goal={goal!r}")
  return checks[op]


def figure(key: str, title: str, *, value: float | None = None, unit: str = "", goal: str | None = None,
           stats: Stats | None = None, details: Mapping[str, Any] | None = None, note: str = "",
           error: str | None = None) -> dict:
  """One row of the results table. `value` is the headline (the median unless stats is None)."""
  if stats is not None and value is None:
    value = stats.median
  return {
      "key": key, "title": title, "value": value, "unit": unit, "goal": goal,
      "goal_met": None if error else goal_met(value, goal),
      "stats": stats.to_dict() if stats is not None else None,
      "details": dict(details or {}), "note": note, "error": error,
  }


def failed_figure(key: str, title: str, error: str, goal: str | None = None, note: str = "",
                  details: Mapping[str, Any] | None = None) -> dict:
  return figure(key, title, goal=goal, error=error, note=note, details=details)


def timing_details(times: Mapping[str, Sequence[float]]) -> dict:
  """Per-thunk {median, min, max, n} in seconds, for the details column of a figure."""
  return {name: summarize(t).to_dict() for name, t in times.items()}


def run_subprocess(cmd: Sequence[str], *, timeout: float, cwd: str | None = None,
                   env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
  """subprocess.run, but on timeout the child and every process it started are ended (by pid).

  Why by pid and not only by process group: a training run starts its rollout servers in sessions of
  their own, which a process-group signal would not reach.
  """
  proc = subprocess.Popen(list(cmd), cwd=cwd, env=None if env is None else dict(env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    end_process_tree(proc)
    raise
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def descendants(pid: int) -> list[int]:
  """Pids of every live descendant of `pid` (Linux /proc; empty elsewhere)."""
  children: dict[int, list[int]] = {}
  for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(entry))
  out, todo = [], [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      out.append(child)
      todo.append(child)
  return out


def end_process_tree(proc: subprocess.Popen, grace_s: float = 5.0):
  """SIGTERM the child and its descendants (collected before signalling), then SIGKILL what is left."""
  pids = [proc.pid] + descendants(proc.pid)
  for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid in pids:
      try:
        os.kill(pid, sig)
      except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
      time.sleep(0.1)
      proc.poll()
    if not any(_alive(p) for p in pids):
      break
  try:
    proc.communicate(timeout=grace_s)
  except subprocess.TimeoutExpired:
    pass


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
  except OSError:
    return False


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def package_versions(names: Sequence[str] = VERSION_PACKAGES) -> dict[str, str | None]:
  out = {}
  for name in names:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def git_commit(root: str | None = None) -> str:
  """Short HEAD commit of the checkout ('+uncommitted' when tracked files differ); $BENCH_COMMIT overrides
  (a copy of the tree without .git)."""
  if os.environ.get("BENCH_COMMIT"):
    return os.environ["BENCH_COMMIT"]
  root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10)
    sha = run("rev-parse", "--short", "HEAD").stdout.strip()
    dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return (sha + ("+uncommitted" if dirty else "")) if sha else "unknown"


def environment() -> dict:
  """Date, machine and software versions; the jax backend and devices are read from a live jax."""
  import jax
  devices = jax.devices()
  return {
      "model": resolve_model(backend=jax.default_backend()),
      "commit": git_commit(),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
      "cpu_model": cpu_model(),
      "cpu_cores": os.cpu_count(),
      "load_avg": [round(x, 1) for x in os.getloadavg()],  # 1, 5, 15 min: a shared machine's timings follow it
      "python": sys.version.split()[0],
      "platform": platform.platform(),
      "backend": jax.default_backend(),
      "devices": f"{len(devices)} x {devices[0].device_kind}",
      "versions": package_versions(),
  }


def _fmt(x: float | None, unit: str = "") -> str:
  if x is None:
    return "-"
  if unit == "%":
    return f"{100 * x:.2f}%"
  ax = abs(x)
  if ax != 0 and (ax >= 1e5 or ax < 1e-3):
    s = f"{x:.3g}"
  elif ax >= 100:
    s = f"{x:.0f}"
  else:
    s = f"{x:.3g}" if ax < 1 else f"{x:.2f}"
  return f"{s}{unit}" if unit in ("x",) else (f"{s} {unit}" if unit else s)


def _fmt_goal(goal: str | None, unit: str) -> str:
  """'>= 0.5' with unit '%' reads '>= 50.00%'; other goals keep their number and gain the unit."""
  if not goal:
    return "-"
  op, _, rhs = goal.strip().partition(" ")
  try:
    return f"{op} {_fmt(float(rhs), unit)}"
  except ValueError:
    return goal


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(results: Mapping[str, Any]) -> str:
  """The results table (headline figures) followed by per-figure details, as markdown."""
  env = results.get("environment", {})
  lines = ["# vcpo_jax benchmark results", ""]
  if env:
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items())
    lines += [f"- date: {env.get('date_utc')}",
              f"- machine: {env.get('cpu_model')}, {env.get('cpu_cores')} cores; {env.get('platform')}"
              + (f"; load average at the start {env['load_avg']}" if env.get("load_avg") else ""),
              f"- backend: {env.get('backend')} ({env.get('devices')}); model: {env.get('model', 'main')}",
              f"- commit: {env.get('commit', 'unknown')}",
              f"- versions: python {env.get('python')}, {versions}"]
  if results.get("command"):
    lines.append(f"- regenerate: `{results['command']}`")
  for key in ("mode", "wall_seconds", "note"):
    if key in results:
      lines.append(f"- {key.replace('_', ' ')}: {results[key]}")
  lines += ["", "| figure | median | min - max | n | goal | met | notes |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
  for fig in results.get("figures", []):
    unit = fig.get("unit", "")
    st = fig.get("stats")
    rng = f"{_fmt(st['min'], unit)} - {_fmt(st['max'], unit)}" if st else "-"
    met = {True: "yes", False: "NO", None: "-"}[fig.get("goal_met")]
    if fig.get("error"):
      value, met, note = "not measured", "-", f"error: {fig['error']}"
    else:
      value, note = _fmt(fig.get("value"), unit), fig.get("note", "")
    lines.append("| " + " | ".join(_cell(c) for c in (
        fig["title"], value, rng, st["n"] if st else "-", _fmt_goal(fig.get("goal"), unit), met, note)) + " |")
  if any(k in {f["key"] for f in results.get("figures", [])} for g in GOALS for k in g.keys):
    lines += goals_table(results)
  details = [f for f in results.get("figures", []) if f.get("details")]
  if details:
    lines += ["", "## Details", ""]
    for fig in details:
      lines.append(f"- **{fig['key']}**: `{json.dumps(fig['details'], sort_keys=True, default=str)}`")
  return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Goal:
  """A goal of the project's issues and the figure that measures it."""
  text: str
  keys: tuple[str, ...]          # figure keys that measure it, first found wins
  needs: str                     # "any" (measurable on this CPU) or "gpu" (the goal is set for an H100)


GOALS = (
    Goal("compile of the VCPO step at 24 layers <= 10 s (0.5B shape, abstract inputs)", ("compile_vcpo_seconds",),
         "any"),
    Goal("XLA temporaries <= 0.1 MB per token (0.5B shape, VCPO step; B=8 x T=1024, all / tokens)",
         ("compile_vcpo_temp_mb_per_token",), "any"),
    Goal("XLA temporaries <= 0.1 MB per token (as above, per extra token: fit over B, fixed part apart)",
         ("compile_vcpo_temp_mb_per_extra_token",), "any"),
    Goal("GRPO-step MFU >= 45% (H100, 0.5B shape)", ("grpo_mfu",), "gpu"),
    Goal("VCPO / GRPO step time <= 1.05x (H100, 0.5B shape)", ("learner_vcpo_over_grpo",), "gpu"),
    Goal("decode at B=256 >= 50% of the memory floor (H100, 0.5B shape)",
         ("decode_floor_fraction_b256",), "gpu"),
)


def goal_row(goal: Goal, figures: Sequence[Mapping[str, Any]], env: Mapping[str, Any]) -> tuple[str, str, str]:
  """(goal, where it lands, measured on) for the goals table."""
  by_key = {f["key"]: f for f in figures}
  fig = next((by_key[k] for k in goal.keys if k in by_key), None)
  if fig is None:
    return goal.text, "not in this run", "-"
  if fig.get("error"):
    return goal.text, f"not measured: {fig['error'][:120]}", "-"
  met = {True: "met", False: "NOT met", None: "-"}[fig.get("goal_met")]
  lands = f"{_fmt(fig.get('value'), fig.get('unit', ''))} ({met})"
  backend = env.get("backend", "?")
  model = env.get("model", "?")
  where = (f"{backend} (compile only, abstract inputs)" if fig["key"].startswith("compile_")
           else f"{backend}, model {model}")
  if goal.needs == "gpu" and backend != "gpu":
    where += "; unverified on GPU"
  elif goal.needs == "gpu" and model != "qwen2.5-0.5b":
    where += "; not the goal's model"
  return goal.text, lands, where


def goals_table(results: Mapping[str, Any]) -> list[str]:
  figures = results.get("figures", [])
  env = results.get("environment", {})
  lines = ["", "## Goals (issue 12)", "", "| goal | where it lands | measured on |", "| --- | --- | --- |"]
  for goal in GOALS:
    lines.append("| " + " | ".join(_cell(c) for c in goal_row(goal, figures, env)) + " |")
  return lines


def run_figure(key: str, title: str, fn: Callable[[], list[dict]], goal: str | None = None) -> list[dict]:
  """Calls a figure producer; any exception becomes a failed figure with its message (the run goes on)."""
  try:
    return list(fn())
  except Exception as e:  # noqa: BLE001 - a benchmark failure must not stop the suite
    traceback.print_exc()
    return [failed_figure(key, title, f"{type(e).__name__}: {e}", goal=goal)]


def module_main(produce: Callable[[bool], list[dict]], description: str, argv=None) -> list[dict]:
  """Entry of a bench_*.py module: `--quick` and `--json out.json` (figures written there)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (smoke test)")
  parser.add_argument("--json", default=None, help="write the figures as a JSON list to this path")
  parser.add_argument("--model", default=None, choices=MODELS, help=f"default ${MODEL_ENV} or auto")
  args = parser.parse_args(argv)
  if args.model:
    os.environ[MODEL_ENV] = args.model
  return emit_figures(produce(args.quick), args.json)


def emit_figures(figures: list[dict], json_path: str | None) -> list[dict]:
  """A bench module's figures as JSON: written to json_path, or printed when there is none."""
  text = json.dumps(figures, indent=2, default=float)
  if json_path:
    with open(json_path, "w") as f:
      f.write(text)
  else:
    print(text)
  return figures


if __name__ == "__main__":
  # run.py asks a child process for this, so the parent never initialises (and preallocates) an accelerator.
  print(json.dumps(environment()))
