"""GPU check, learner: GRPO-step MFU, VCPO / GRPO on the bounded and book-keeping paths, peak device memory.

Each step (GRPO, VCPO book-keeping, VCPO bounded) runs in a process of its own, so the device's peak memory
is that step's alone; it is recorded beside XLA's compile-time estimate (arguments + temporaries + outputs -
aliased). MFU = model FLOPs (6·N·tokens + attention) / GRPO step time / the bf16 matmul peak measured last,
in this run, on the same device. The steps run one after another (the device is not shared), so a ratio's
rounds pair the i-th step of each.

  python -m benchmarks.gpu.bench_gpu_step --json /tmp/steps.json --model qwen2.5-0.5b   # B=64 x T=512
  python -m benchmarks.gpu.bench_gpu_step --quick --model tiny                        # seconds, on a CPU
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import model_choice
from benchmarks.common import records
from benchmarks.common import summary

VARIANTS = ("grpo", "vcpo_book_keeping", "vcpo_bounded")
MFU_GOAL = ">= 0.45"
RATIO_GOAL = "<= 1.1"
PEAK_RESERVE_S = 20.0    # kept for the matmul peak at the end of the module's time limit
MIN_CHILD_S = 30.0       # kept for each variant still to run after the current one
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shape(quick: bool) -> tuple[int, int, int]:
  """(B, T, timed repeats): the goals' 0.5B shape is B=64 x T=512 in the job's micro-batches of 8 rows."""
  if quick or model_choice.small_model():
    return 8, 32, 2
  return 64, 512, 5


def learner_configs(config) -> dict:
  """GRPO (PPO clipping) and the job's VCPO learner on each per-sequence-norm path, same micro-batching."""
  from benchmarks.cpu import bench_flops
  from vcpo_jax.job import configuration
  lc = configuration.learner_config(config)
  return {"grpo": bench_flops.grpo_config(lc),
          "vcpo_book_keeping": dataclasses.replace(lc, grad_path="book_keeping"),
          "vcpo_bounded": dataclasses.replace(lc, grad_path="bounded")}


def device_memory() -> dict:
  """The default device's allocator statistics (empty where the backend keeps none, as on CPU)."""
  import jax
  stats = jax.local_devices()[0].memory_stats() or {}
  return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def run_variant(variant: str, quick: bool) -> dict:
  """One step variant in this process: compile, one warm-up step, timed steps; memory before and after."""
  import jax
  from benchmarks.cpu import bench_flops
  from benchmarks.cpu import bench_step
  from benchmarks.common import timing
  from vcpo_jax.job import configuration
  from vcpo_jax.learner import step as learner
  from vcpo_jax.learner import train_state
  from vcpo_jax.model import hf
  config = model_choice.job_config()
  model_cfg = hf.model_config(config.model)
  optimizer = configuration.build_optimizer(config)
  lc = learner_configs(config)[variant]
  B, T, repeats = shape(quick)
  batch = jax.device_put(bench_flops.synthetic_batch(B, T, min(config.rl.group_size, B), model_cfg.vocab_size))
  state = train_state.create_train_state(model_cfg, optimizer, jax.random.PRNGKey(0))

  def fn(state, batch):  # as learner.make_rl_step's, unsharded; jitted here so the executable can be inspected
    with jax.default_matmul_precision(model_cfg.matmul_precision):
      return learner.rl_step(state, batch, model_cfg=model_cfg, learner_cfg=lc, optimizer=optimizer)
  before = device_memory()
  t0 = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=0).lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  holder = {"state": state}

  def step():
    holder["state"], metrics = compiled(holder["state"], batch)
    return holder["state"], metrics
  seconds = timing.time_calls({"step": step}, warmup=1, repeats=repeats)["step"]
  return {"variant": variant, "seconds": seconds, "compile_s": compile_s, "shape": f"B={B}, T={T}",
          "learner_config": dataclasses.asdict(lc), "xla_memory": bench_step._memory(compiled),
          "device_memory_before": before, "device_memory_after": device_memory(),
          "analytic_flops": bench_flops.analytic_step_flops(model_cfg, state.params, B, T),
          "backend": jax.default_backend()}


def child_limit(deadline: float, variants_left: int) -> float:
  """The time left, less the matmul peak's reserve and MIN_CHILD_S for each variant after this one (a slow
  compile may use more than an equal share; a hung one still leaves the others their minimum)."""
  return max(10.0, deadline - time.monotonic() - PEAK_RESERVE_S - MIN_CHILD_S * (variants_left - 1))


def min_limit_s() -> float:
  """The least module time limit that gives every variant MIN_CHILD_S and keeps the matmul peak's reserve."""
  return PEAK_RESERVE_S + MIN_CHILD_S * len(VARIANTS)


def run_children(quick: bool, limit_s: float) -> tuple[dict, dict]:
  """Each variant in a child process under its own time limit: ({variant: result}, {variant: error})."""
  from benchmarks.cpu import run as run_lib
  if limit_s < min_limit_s():
    raise ValueError(f"BENCH_JOB_LIMIT_S={limit_s:.0f} leaves the {len(VARIANTS)} variants less than "
                     f"{MIN_CHILD_S:.0f} s each after the matmul peak's {PEAK_RESERVE_S:.0f} s: give the steps "
                     f"part at least {min_limit_s():.0f} s of its own")
  deadline = time.monotonic() + limit_s
  results, errors = {}, {}
  for i, variant in enumerate(VARIANTS):
    limit = child_limit(deadline, len(VARIANTS) - i)
    with tempfile.TemporaryDirectory(prefix=f"gpu_step_{variant}_") as tmp:
      out = os.path.join(tmp, "out.json")
      cmd = [sys.executable, "-m", "benchmarks.gpu.bench_gpu_step", "--variant", variant, "--json", out]
      cmd += ["--quick"] if quick else []
      try:
        proc = run_lib.run_subprocess(cmd, timeout=limit, cwd=REPO_ROOT, env=run_lib.child_env())
      except subprocess.TimeoutExpired:
        errors[variant] = f"timed out after {limit:.0f} s"
        continue
      if proc.returncode != 0 or not os.path.exists(out):
        errors[variant] = f"exit code {proc.returncode}: {run_lib.tail(proc.stderr or proc.stdout)}"
        continue
      with open(out) as f:
        results[variant] = json.load(f)
  return results, errors


def matmul_peak(quick: bool) -> tuple[float, dict]:
  """bf16 matmul peak (FLOP/s) of this device, at the model's matmul precision."""
  from benchmarks.cpu import bench_flops
  setup = bench_flops.QUICK if quick else bench_flops.FULL
  sizes, details = bench_flops.matmul_peak(setup, "bfloat16", "default")
  return max(details["sweep"][n]["flop_per_s"] for n in sizes), details


def figures(results: dict, errors: dict, peak: float | None, peak_details: dict) -> list[dict]:
  """The module's figures from the children's results (a missing variant gives error figures)."""
  figs = []
  if peak is not None:
    figs.append(records.figure("gpu_matmul_peak", "bf16 matmul peak (best size, same run)", unit="TFLOP/s",
                               value=peak / 1e12, details=peak_details))
  grpo = results.get("grpo")
  for variant in VARIANTS:
    if variant in errors:
      figs.append(records.failed_figure(f"step_seconds_{variant}", f"{variant} learner step", errors[variant]))
      continue
    r = results[variant]
    mem, est = r["device_memory_after"], r["xla_memory"].get("peak_estimate_bytes")
    peak_bytes = mem.get("peak_bytes_in_use")
    figs.append(records.figure(
        f"step_seconds_{variant}", f"{variant} learner step ({r['shape']})", unit="s",
        stats=summary.summarize(r["seconds"]), details={k: r[k] for k in ("compile_s", "learner_config")},
        note=f"compile {r['compile_s']:.1f} s"))
    figs.append(records.figure(
        f"peak_memory_{variant}", f"peak device memory, {variant} step", unit="GB",
        value=None if peak_bytes is None else peak_bytes / 1e9,
        details={"xla_memory": r["xla_memory"], "device_memory_before": r["device_memory_before"],
                 "device_memory_after": mem},
        note=(f"XLA's compile-time estimate {est / 1e9:.3g} GB (arguments + temporaries + outputs - aliased)"
              if est else "XLA gives no estimate")
             + ("" if peak_bytes is not None else f"; the {r['backend']} backend keeps no allocator statistics")))
  if grpo is not None:
    for variant, path in (("vcpo_book_keeping", "book-keeping"), ("vcpo_bounded", "bounded")):
      if variant in results:
        figs.append(records.figure(
            f"{variant}_over_grpo", f"VCPO ({path} path) / GRPO learner step time", unit="x", goal=RATIO_GOAL,
            stats=summary.summarize(summary.ratio_samples(results[variant]["seconds"], grpo["seconds"])),
            note=f"{grpo['shape']}, the job's micro-batching; steps timed one after another, round i paired"))
    if peak is not None:
      mfu = [grpo["analytic_flops"] / t / peak for t in grpo["seconds"]]
      figs.append(records.figure(
          "grpo_mfu", "GRPO step MFU: model FLOPs (6N*tokens + attention) / step time / bf16 matmul peak",
          unit="%", goal=MFU_GOAL, stats=summary.summarize(mfu),
          details={"analytic_flops": grpo["analytic_flops"], "matmul_peak_flop_per_s": peak},
          note=f"{grpo['shape']}; {grpo['analytic_flops'] / summary.summarize(grpo['seconds']).median / 1e12:.3g}"
               f" TFLOP/s of a measured {peak / 1e12:.3g}"))
  return figs


def produce(quick: bool, limit_s: float) -> list[dict]:
  results, errors = run_children(quick, limit_s)
  peak, peak_details = None, {}
  try:
    peak, peak_details = matmul_peak(quick)
  except Exception as e:  # noqa: BLE001 - the step figures stand without it
    errors["matmul_peak"] = f"{type(e).__name__}: {e}"
  figs = figures(results, errors, peak, peak_details)
  if "matmul_peak" in errors:
    figs.append(records.failed_figure("gpu_matmul_peak", "bf16 matmul peak", errors["matmul_peak"]))
  return figs


def main(argv=None):
  parser = records.bench_parser(__doc__.splitlines()[0], "write the figures (or one variant's result) here")
  parser.add_argument("--variant", default=None, choices=VARIANTS, help="run one step variant (a child)")
  return records.child_or_parent_main(
      parser, argv, lambda a: run_variant(a.variant, a.quick) if a.variant else None, produce)


if __name__ == "__main__":
  main()
