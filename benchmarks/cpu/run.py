"""`make bench`: runs every figure in its own process, one after another, and writes results.json + results.md.

Each figure module runs as `python -m benchmarks.<module> --json <file> [--quick]` under a time limit, so
a crash, a hang or leftover memory in one figure cannot spoil the others; a figure that fails is recorded
with its error and the suite goes on.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

from benchmarks.common import environment
from benchmarks.common import markdown
from benchmarks.common import model_choice
from vcpo_jax.rollout.servers import launcher
from benchmarks.common import records

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
QUICK_OUT_DIR = os.path.join(REPO_ROOT, "benchmarks", "results", "quick")  # git-ignored
COMPILATION_CACHE_DIR = os.path.join(REPO_ROOT, "benchmarks", "results", "jax_cache")  # git-ignored
SUITE_BUDGET_S = 19.5 * 60   # the whole suite must fit in 20 minutes on the 2-core CPU machine
MIN_JOB_S = 30             # a job given less than this is skipped rather than started


@dataclasses.dataclass(frozen=True)
class Job:
  name: str                      # --only name
  module: str                    # python -m target
  title: str                     # table title if the job fails before producing figures
  timeout_s: float
  quick_timeout_s: float
  quick_flag: bool = True        # whether the module understands --quick


# Per-job limits; the suite as a whole is held to SUITE_BUDGET_S (a job's limit shrinks to what is left).
JOBS = (
    Job("step", "benchmarks.cpu.bench_step", "VCPO / GRPO / two-pass / micro-batch-1 oracle step", 420, 240),
    Job("flops", "benchmarks.cpu.bench_flops", "learner FLOP/s / matmul peak; GRPO MFU; VCPO / GRPO", 200, 150),
    # The 0.5B shape compiled on abstract inputs (nothing allocated); 24 unrolled layers compile in minutes.
    Job("compile", "benchmarks.cpu.bench_compile", "compiled step: compile seconds, temporaries per token", 540, 150),
    # Compile-only memory of bounded / book-keeping VCPO vs GRPO: 0.5B per-token slope, 7B per device (fsdp=8).
    # 483 s measured at load 7.5 (B=4..32 live-range compiles): the limit leaves room for a loaded machine.
    Job("bounded", "benchmarks.cpu.bench_bounded", "bounded VCPO memory vs GRPO and book-keeping", 1200, 1200),
    Job("arith", "benchmarks.cpu.bench_arith", "ESS + OPOB arithmetic share of the VCPO step", 120, 120),
    Job("decode", "benchmarks.cpu.bench_decode", "decode tokens/s: ours / HF generate; vs the memory floor", 300, 180),
    Job("async", "benchmarks.cpu.bench_async", "async / sync RL steps per hour", 460, 300),
)


def tail(text: str, n: int = 600) -> str:
  text = text.strip()
  return text if len(text) <= n else "..." + text[-n:]


def normalize_figures(job: Job, payload: Any) -> list[dict]:
  """Accepts a list of figure dicts (our format); anything else is kept whole as one figure's details."""
  if isinstance(payload, list) and payload and all(isinstance(f, dict) and "key" in f and "title" in f
                                                    for f in payload):
    return payload
  if isinstance(payload, dict) and isinstance(payload.get("figures"), list):
    return normalize_figures(job, payload["figures"])
  return [records.figure(job.name, job.title, details={"raw": payload},
                         note="module output not in the figure format; raw output kept in details")]


def child_env() -> dict:
  """The children's environment: the repo importable, and a persistent XLA compilation cache (so a second
  run of the suite spends its time measuring, not compiling; compilation is never timed either way)."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
  env.setdefault("JAX_COMPILATION_CACHE_DIR", COMPILATION_CACHE_DIR)
  env.setdefault("VCPO_PROGRESS", "0")
  return env


def run_subprocess(cmd: Sequence[str], *, timeout: float, cwd: str | None = None,
                   env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
  """subprocess.run, but on timeout the child and every process it started are ended
  (launcher.end_process_tree: by pid too, so servers in sessions of their own go as well)."""
  proc = subprocess.Popen(list(cmd), cwd=cwd, env=None if env is None else dict(env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    launcher.end_process_tree(proc)
    raise
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_job(job: Job, *, quick: bool, python: str = sys.executable, limit_s: float | None = None,
            limit_scale: float = 1.0,
            runner: Callable[..., subprocess.CompletedProcess] = run_subprocess) -> list[dict]:
  """Runs one figure module in a subprocess; failures (exit code, timeout, bad JSON) become error figures."""
  with tempfile.TemporaryDirectory(prefix=f"bench_{job.name}_") as tmp:
    out = os.path.join(tmp, "out.json")
    cmd = [python, "-m", job.module, "--json", out] + (["--quick"] if quick and job.quick_flag else [])
    limit = (job.quick_timeout_s if quick else job.timeout_s) * limit_scale
    if limit_s is not None:
      limit = min(limit, limit_s)
    env = dict(child_env(), BENCH_JOB_LIMIT_S=str(int(limit)))  # lets a long job fit its runs to the limit
    start = time.perf_counter()
    try:
      proc = runner(cmd, cwd=REPO_ROOT, env=env, timeout=limit)
    except subprocess.TimeoutExpired:
      return [records.failed_figure(job.name, job.title, f"timed out after {limit:.0f} s")]
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or not os.path.exists(out):
      return [records.failed_figure(job.name, job.title,
                                    f"exit code {proc.returncode}: {tail(proc.stderr or proc.stdout)}")]
    try:
      with open(out) as f:
        figures = normalize_figures(job, json.load(f))
    except (OSError, ValueError) as e:
      return [records.failed_figure(job.name, job.title, f"unreadable output: {e}")]
  for fig in figures:
    fig.setdefault("details", {})["job_seconds"] = round(seconds, 1)
  return figures


def probe_environment(python: str = sys.executable) -> dict:
  """Environment read in a child process (environment.py's __main__); errors are recorded, not raised."""
  try:
    proc = subprocess.run([python, "-m", "benchmarks.common.environment"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    return json.loads(proc.stdout.strip().splitlines()[-1])
  except Exception as e:  # noqa: BLE001
    return {"error": f"environment probe failed: {e}", "versions": environment.package_versions(),
            "cpu_model": environment.cpu_model(), "cpu_cores": os.cpu_count()}


def select_jobs(only: str | None, jobs: Sequence[Job] | None = None) -> list[Job]:
  jobs = JOBS if jobs is None else jobs
  if not only:
    return list(jobs)
  names = [n.strip() for n in only.split(",") if n.strip()]
  known = {j.name: j for j in jobs}
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"--only has unknown figure(s) {unknown}; known: {sorted(known)}")
  return [known[n] for n in names]


def write_results(results: dict, out_dir: str) -> tuple[str, str]:
  os.makedirs(out_dir, exist_ok=True)
  json_path, md_path = os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.md")
  with open(json_path, "w") as f:
    json.dump(results, f, indent=2, default=float)
    f.write("\n")
  with open(md_path, "w") as f:
    f.write(markdown.render_markdown(results))
  return json_path, md_path


def command_line(argv: Sequence[str] | None) -> str:
  """The command that regenerates these results (written into results.md)."""
  args = list(sys.argv[1:] if argv is None else argv)
  return " ".join([".venv/bin/python -m benchmarks.cpu.run"] + args)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test)")
  parser.add_argument("--only", default=None, help=f"comma list of {[j.name for j in JOBS]}")
  parser.add_argument("--out-dir", default=None,
                      help=f"default {DEFAULT_OUT_DIR} (full) or {QUICK_OUT_DIR} (--quick)")
  parser.add_argument("--budget-s", type=float, default=SUITE_BUDGET_S,
                      help="wall-clock budget of the whole suite; a job's limit shrinks to what is left")
  parser.add_argument("--limit-scale", type=float, default=1.0,
                      help="multiplies every job's time limit and the suite budget (a loaded machine: its "
                           "load average over its cores, e.g. 3)")
  parser.add_argument("--model", default=None, choices=model_choice.MODELS,
                      help="model of the figures: main = countdown (the main CPU job's), tiny (configs/tiny.py), "
                           "qwen2.5-0.5b (the Qwen2.5-0.5B shape), auto (default: main on CPU, qwen2.5-0.5b on "
                           "an accelerator); the compile figure is always the 0.5B shape (or tiny)")
  args = parser.parse_args(argv)
  if args.model:
    os.environ[model_choice.MODEL_ENV] = args.model  # the environment probe and every figure's child read it
  jobs = select_jobs(args.only)
  out_dir = args.out_dir or (QUICK_OUT_DIR if args.quick else DEFAULT_OUT_DIR)
  start = time.perf_counter()
  env = probe_environment()
  # The children resolve "auto" the same way from the probed backend; fixing it here keeps them in step.
  if env.get("model"):
    os.environ[model_choice.MODEL_ENV] = env["model"]
  results = {"environment": env, "mode": "quick" if args.quick else "full", "command": command_line(argv),
             "figures": []}
  for job in jobs:
    left = args.budget_s * args.limit_scale - (time.perf_counter() - start)
    print(f"[bench] {job.name}: python -m {job.module} ({left:.0f} s of the suite budget left)", flush=True)
    t0 = time.perf_counter()
    if left < MIN_JOB_S:
      figures = [records.failed_figure(job.name, job.title, f"skipped: suite budget of {args.budget_s:.0f} s spent")]
    else:
      figures = run_job(job, quick=args.quick, limit_s=left, limit_scale=args.limit_scale)
    results["figures"].extend(figures)
    for fig in figures:
      status = f"ERROR {fig['error']}" if fig.get("error") else f"{fig.get('value')} {fig.get('unit', '')}"
      print(f"[bench]   {fig['key']}: {status}", flush=True)
    print(f"[bench]   ({time.perf_counter() - t0:.0f} s)", flush=True)
    results["wall_seconds"] = round(time.perf_counter() - start, 1)
    write_results(results, out_dir)  # after every job, so a killed run still leaves what it measured
  json_path, md_path = write_results(results, out_dir)
  print(markdown.render_markdown(results))
  print(f"[bench] wrote {json_path} and {md_path}")
  return results


if __name__ == "__main__":
  main()
