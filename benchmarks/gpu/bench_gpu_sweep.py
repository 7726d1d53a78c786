"""GPU check, sweep: the GEMM ceiling at the model's own shapes, the GRPO step per lever combination, VCPO at the best.

Stages, each child process under its own time limit within the part's deadline (BENCH_JOB_LIMIT_S):
1. ceiling: the bf16 matmul peak (square sizes, as the steps part measures it) and every GEMM of the learner
   step at its real shape (gpu_sweep_levers.gemm_shapes) per micro-batch size the levers use, timed by the
   profiler's kernel times; the ceiling is their FLOPs over their time, each weighted by its count per step.
2. levers: the GRPO step for each combination in gpu_sweep_levers.LEVERS (priority order; skipped when the
   time left is the final stage's reserve); each records its step times, MFU against
   the same-run peak and against the ceiling at its micro-batch, XLA's memory estimate, the allocator's peak,
   remat='auto''s choice, and the top ops of one profiled step.
3. VCPO (bounded, book-keeping) at the fastest lever: VCPO / GRPO step time; then the combined best.

  python -m benchmarks.gpu.bench_gpu_sweep --json /tmp/sweep.json --model qwen2.5-0.5b   # on the GPU
  python -m benchmarks.gpu.bench_gpu_sweep --quick --model tiny                          # seconds, on a CPU
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.gpu import bench_gpu_step
from benchmarks.gpu import gpu_sweep_levers as levers_lib
from benchmarks.gpu import gpu_sweep_report as report
from benchmarks.common import model_choice
from benchmarks.common import summary

CEILING_LIMIT_S = 60.0
VCPO_LIMIT_S = 60.0
FINAL_RESERVE_S = 150.0   # kept for the combined best and VCPO at the best, out of the levers' stage
QUICK_FINAL_RESERVE_S = 60.0
GEMM_REPEATS = 10
REPO_ROOT = bench_gpu_step.REPO_ROOT


def micro_tokens(lc, rows: int, seq_len: int) -> int:
  micro = lc.micro_batch_size if lc.micro_batch_size and lc.micro_batch_size < rows else rows
  return micro * seq_len


def run_ceiling(quick: bool) -> dict:
  """bf16 matmul peak and the real-shape GEMM ceiling per micro-batch token count."""
  import jax
  import jax.numpy as jnp
  from benchmarks.common import timing
  from benchmarks.gpu import xla_profile
  peak, peak_details = bench_gpu_step.matmul_peak(quick)
  config = model_choice.job_config()
  cfg = model_choice.model_config()
  rows, seq_len, _ = bench_gpu_step.shape(quick)
  lc = bench_gpu_step.learner_configs(config)["grpo"]
  micros = {lc.micro_batch_size or rows} | {int(v) for lever in levers_lib.LEVERS for k, v in lever.overrides
                                             if k == "algo.micro_batch_size"}
  # Up to 8k tokens: at 32k the full-vocabulary head GEMM alone is 20 GB of f32 output (a lever's step reads
  # the ceiling of the largest count measured at or below its micro-batch).
  token_counts = sorted({min(m, rows) * seq_len for m in micros if quick or min(m, rows) * seq_len <= 8192})
  repeats = 2 if quick else GEMM_REPEATS
  ceilings = {}
  with tempfile.TemporaryDirectory(prefix="gemm_trace_") as tmp:
    for tokens in token_counts:
      shapes = levers_lib.gemm_shapes(cfg, tokens)
      calls = []
      for i, (name, m, k, n, count) in enumerate(shapes):
        a = jnp.ones((m, k), jnp.bfloat16)
        b = jnp.ones((k, n), jnp.bfloat16)
        fn = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)  # noqa: E731
        fn.__name__ = f"gemm_{i}"
        calls.append((jax.jit(fn), a, b))
        jax.block_until_ready(calls[-1][0](a, b))  # compiled (and autotuned) outside the trace

      def run_all():
        out = None
        for f, a, b in calls:
          for _ in range(repeats):
            out = f(a, b)
        return out
      path = xla_profile.trace_steps(run_all, 1, os.path.join(tmp, str(tokens)))
      by_module = xla_profile.module_times(path)
      rows_out, flops, seconds = [], 0.0, 0.0
      for i, (name, m, k, n, count) in enumerate(shapes):
        ns, how = by_module.get(f"jit_gemm_{i}"), "profiler kernel time"
        if not ns:  # the trace named no op of this module: wall clock, dispatch included (an upper bound)
          f, a, b = calls[i]
          ns, how = 1e9 * repeats * min(timing.time_calls({"g": lambda: f(a, b)}, repeats=repeats)["g"]), "wall"
        t = ns / repeats / 1e9
        rows_out.append({"gemm": name, "m": m, "k": k, "n": n, "count": count, "seconds": t, "timed_by": how,
                         "flop_per_s": 2.0 * m * k * n / t})
        if t:
          flops += count * 2.0 * m * k * n
          seconds += count * t
      ceilings[str(tokens)] = {"flop_per_s": flops / seconds if seconds else None, "gemms": rows_out}
  return {"peak": peak, "peak_details": peak_details, "ceilings": ceilings, "backend": jax.default_backend()}


def run_step(name: str, overrides, learner: str, quick: bool, profile: bool) -> dict:
  """One GRPO (or VCPO) step of a lever combination in this process: compile with its XLA options, one warm-up
  step, timed steps, one profiled step; memory before and after."""
  import jax
  from benchmarks.cpu import bench_flops
  from benchmarks.cpu import bench_step
  from benchmarks.common import timing
  from benchmarks.gpu import xla_profile
  from benchmarks.aot import compile_step
  from vcpo_jax.job import configuration
  from vcpo_jax.learner import step as learner_lib
  from vcpo_jax.learner import train_state
  from vcpo_jax.model import hf
  from vcpo_jax.model import remat as remat_lib
  config = model_choice.job_config()
  levers_lib.add_model_fields(config, overrides)
  options = compile_step.apply_overrides(config, overrides)
  model_cfg = hf.model_config(config.model)
  optimizer = configuration.build_optimizer(config)
  lc = bench_gpu_step.learner_configs(config)[learner]
  rows, seq_len, repeats = bench_gpu_step.shape(quick)
  repeats = min(repeats, 3)
  batch = jax.device_put(bench_flops.synthetic_batch(rows, seq_len, min(config.rl.group_size, rows),
                                                     model_cfg.vocab_size))
  state = train_state.create_train_state(model_cfg, optimizer, jax.random.PRNGKey(0))
  tokens = micro_tokens(lc, rows, seq_len)
  micro = tokens // seq_len < rows
  remat = remat_lib.resolve(model_cfg, tokens // seq_len, seq_len,
                            remat_lib.state_bytes_per_device(state, grad_copies=2 if micro else 1)).remat

  def fn(state, batch):  # as learner.make_rl_step's, unsharded
    with jax.default_matmul_precision(model_cfg.matmul_precision):
      return learner_lib.rl_step(state, batch, model_cfg=model_cfg, learner_cfg=lc, optimizer=optimizer)
  before = bench_gpu_step.device_memory()
  t0 = time.perf_counter()
  compiled = compile_step.compile_lowered(jax.jit(fn, donate_argnums=0).lower(state, batch), options)
  compile_s = time.perf_counter() - t0
  holder = {"state": state}

  def step():
    holder["state"], metrics = compiled(holder["state"], batch)
    return metrics
  seconds = timing.time_calls({"step": step}, warmup=1, repeats=repeats)["step"]
  result = {"name": name, "learner": learner, "overrides": [list(p) for p in overrides], "seconds": seconds,
            "compile_s": compile_s, "rows": rows, "seq_len": seq_len, "micro_tokens": tokens, "remat": remat,
            "xla_memory": bench_step._memory(compiled), "device_memory_before": before,
            "analytic_flops": bench_flops.analytic_step_flops(model_cfg, state.params, rows, seq_len),
            "backend": jax.default_backend()}
  if profile:
    with tempfile.TemporaryDirectory(prefix="sweep_trace_") as tmp:
      path = xla_profile.trace_steps(step, 1, tmp)
      result["top_ops"] = xla_profile.top_ops(path, compiled.as_text(), steps=1)
  result["device_memory_after"] = bench_gpu_step.device_memory()
  return result


def child(args: list[str], limit: float, out: str) -> tuple[dict | None, str | None]:
  """Runs this module with `args` in a child process under `limit` seconds: (result, error)."""
  from benchmarks.cpu import run as run_lib
  cmd = [sys.executable, "-m", "benchmarks.gpu.bench_gpu_sweep", "--json", out] + args
  try:
    proc = run_lib.run_subprocess(cmd, timeout=limit, cwd=REPO_ROOT, env=run_lib.child_env())
  except subprocess.TimeoutExpired:
    return None, f"timed out after {limit:.0f} s"
  if proc.returncode != 0 or not os.path.exists(out):
    return None, f"exit code {proc.returncode}: {run_lib.tail(proc.stderr or proc.stdout)}"
  with open(out) as f:
    return json.load(f), None


def produce(quick: bool, limit_s: float) -> list[dict]:
  deadline = time.monotonic() + limit_s
  left = lambda reserve=0.0: deadline - time.monotonic() - reserve  # noqa: E731
  quick_arg = ["--quick"] if quick else []
  results, errors = {}, {}
  with tempfile.TemporaryDirectory(prefix="gpu_sweep_") as tmp:
    def step(name, overrides, learner, limit, profile=True):
      key = name if learner == "grpo" else f"{learner}@{name}"
      budget = min(limit, left())
      if budget < 10:
        errors[key] = "skipped: the sweep's time limit was spent"
        return
      args = ["--child", "step", "--name", name, "--overrides", json.dumps(overrides), "--learner", learner]
      result, error = child(args + quick_arg + (["--profile"] if profile else []), budget,
                            os.path.join(tmp, f"{key}.json"))
      if result:
        results[key] = result
      else:
        errors[key] = error

    ceiling, error = child(["--child", "ceiling"] + quick_arg, min(CEILING_LIMIT_S, left()),
                           os.path.join(tmp, "ceiling.json"))
    if error:
      errors["ceiling"] = error
    reserve = QUICK_FINAL_RESERVE_S if quick else FINAL_RESERVE_S
    for lever in levers_lib.LEVERS:
      if left(reserve) < 10:
        errors[lever.name] = "skipped: its time went to the final stage's reserve"
        continue
      step(lever.name, list(lever.overrides), "grpo", min(lever.limit_s, left(reserve)))
    # VCPO first (its ratio is a goal), at the fastest lever so far; then the combination, if time is left.
    best = report.best_lever(results) or "baseline"
    overrides = results[best]["overrides"] if best in results else list(levers_lib.LEVERS[0].overrides)
    for learner in ("vcpo_bounded", "vcpo_book_keeping"):
      step(best, overrides, learner, VCPO_LIMIT_S, profile=False)
    combined = levers_lib.combined({k: summary.summarize(r["seconds"]).median for k, r in results.items()
                                    if "@" not in k})
    if combined is not None:
      step(combined.name, list(combined.overrides), "grpo", combined.limit_s)
  return report.figures(ceiling, results, errors, combined, vcpo_at=best)


def main(argv=None):
  from benchmarks.common import records  # noqa: PLC0415
  parser = records.bench_parser(__doc__.splitlines()[0], "write the figures (or a child's result) here")
  parser.add_argument("--child", default=None, choices=("ceiling", "step"), help="run one stage (a child)")
  parser.add_argument("--name", default="baseline")
  parser.add_argument("--overrides", default="[]", help="JSON list of [field, value] pairs")
  parser.add_argument("--learner", default="grpo", choices=bench_gpu_step.VARIANTS)
  parser.add_argument("--profile", action="store_true", help="profile one step: its top ops")

  def child(a):
    if a.child == "ceiling":
      return run_ceiling(a.quick)
    return run_step(a.name, [tuple(p) for p in json.loads(a.overrides)], a.learner, a.quick,
                    a.profile) if a.child else None

  return records.child_or_parent_main(parser, argv, child, produce)


if __name__ == "__main__":
  main()
