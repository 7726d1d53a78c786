"""Compiled learner step on abstract inputs: trace + XLA compile seconds and XLA temporaries per token.

Nothing is allocated: the train state and the batch are jax.ShapeDtypeStruct trees and the step is only
`jit(...).lower(...).compile()`d, so the Qwen2.5-0.5B shape (24 layers, vocab 151,936) is measurable on a
CPU; `memory_analysis()` of the compiled executable gives XLA's temporaries. One variant per knob setting that
exists in this checkout (layers under scan, remat policy, chunked LM head), for the VCPO and GRPO steps.

  python -m benchmarks.cpu.bench_compile --model=qwen2.5-0.5b --B=8 --T=1024 --out=benchmarks/results/compile_before.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time
from typing import Any, Mapping

from benchmarks.common import environment
from benchmarks.common import model_choice
from benchmarks.common import records
from benchmarks.cpu import compile_report

# (B, T) of the full figure and of --quick (which also shrinks the model: the smoke test stays fast).
FULL_SHAPE, QUICK_SHAPE = (8, 1024), (4, 32)
QUICK_MODEL = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=16, max_seq_len=64)
# Knobs of the model config compared when the field exists at this commit: field -> values tried besides
# the default. Absent fields are reported as absent (the "before" figures have none of them).
MODEL_KNOBS: Mapping[str, tuple[Any, ...]] = {
    "scan_layers": (False, True),                     # model.py (HS)
    "remat": ("none", "dots", "dots_no_batch", "full"),
    "logits_chunk": (0,),                             # lm_head.py (HH): 0 = full [tokens, vocab] logits
}


def job_model_config(name: str, quick: bool):
  """The figure's ModelConfig: the job's (model_choice.model_config), shrunk under --quick."""
  cfg = model_choice.model_config(name)
  if quick:
    cfg = dataclasses.replace(cfg, **QUICK_MODEL)
  return cfg


def learner_configs(name: str) -> dict:
  """{'vcpo': the job's learner, 'grpo': plain GRPO + PPO}, both on the whole batch (no micro-batching)."""
  from vcpo_jax.job import configuration
  from vcpo_jax.learner import config as learner_config
  vcpo = dataclasses.replace(configuration.learner_config(model_choice.job_config(name)), micro_batch_size=0)
  grpo = learner_config.LearnerConfig(advantage="grpo", policy_loss="ppo", aggregation=vcpo.aggregation)
  return {"vcpo": vcpo, "grpo": grpo}


def abstract_batch(b: int, t: int, group: int):
  """An RLBatch of jax.ShapeDtypeStruct (what the job feeds the step, dtypes included)."""
  from vcpo_jax.learner import batch as batch_lib
  import jax
  import jax.numpy as jnp
  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  del group  # the group ids are data; only their shape matters here
  return batch_lib.RLBatch(tokens_BxT=s((b, t), jnp.int32), mask_BxT=s((b, t), jnp.float32),
                         sampler_logp_BxT=s((b, t), jnp.float32), rewards_B=s((b,), jnp.float32),
                         group_B=s((b,), jnp.int32), lag_B=s((b,), jnp.int32), valid_B=s((b,), jnp.float32))


def abstract_state(model_cfg, optimizer):
  from vcpo_jax.learner import train_state
  import jax
  return jax.eval_shape(lambda k: train_state.create_train_state(model_cfg, optimizer, k), jax.random.PRNGKey(0))


def step_fn(model_cfg, lc, optimizer):
  """The function make_rl_step jits (same precision context), without its host-side checks."""
  import jax
  from vcpo_jax.learner import step as learner

  def fn(state, batch):
    with jax.default_matmul_precision(model_cfg.matmul_precision):
      return learner.rl_step(state, batch, model_cfg=model_cfg, learner_cfg=lc, optimizer=optimizer)
  return fn


def memory_bytes(compiled) -> dict:
  mem = compiled.memory_analysis()
  if mem is None:
    return {}
  return {k: int(getattr(mem, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                             "output_size_in_bytes", "alias_size_in_bytes",
                                             "generated_code_size_in_bytes") if hasattr(mem, k)}


def compile_one(model_cfg, lc, optimizer, b: int, t: int) -> dict:
  """Seconds to trace+lower and to XLA-compile the step on abstract inputs, and its memory analysis.

  Wall seconds and this process's CPU seconds (all threads): on a shared machine the wall time grows with
  the load while the CPU time does not, so cpu_s is the figure compared across runs."""
  import jax
  state, batch = abstract_state(model_cfg, optimizer), abstract_batch(b, t, group=b)
  c0, t0 = time.process_time(), time.perf_counter()
  lowered = jax.jit(step_fn(model_cfg, lc, optimizer), donate_argnums=0).lower(state, batch)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  c2, t2 = time.process_time(), time.perf_counter()
  mem = memory_bytes(compiled)
  tokens = b * t
  return {"lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2), "total_s": round(t2 - t0, 2),
          "cpu_s": round(c2 - c0, 2), "tokens": tokens, "memory": mem,
          "temp_mb_per_token": mem["temp_size_in_bytes"] / tokens / 1e6 if "temp_size_in_bytes" in mem else None}


def temp_fit(b: int, t: int, temp_bytes: int, b2: int, temp2_bytes: int, predict_tokens: int = 64 * 1024) -> dict:
  """Temporaries = fixed + per_token * tokens, from two batch sizes at one length.

  Why a fit: part of the temporaries scales with the parameters (gradients, optimizer update), not with the
  tokens; divided by B*T it reads as a per-token cost that a bigger batch would not pay again."""
  if b == b2:
    raise ValueError(f"temp_fit needs two batch sizes, got b={b} and b2={b2}")
  per_token = (temp_bytes - temp2_bytes) / ((b - b2) * t)
  fixed = temp_bytes - per_token * b * t
  return {"B2": b2, "temp_bytes_B2": temp2_bytes, "per_token_mb": per_token / 1e6, "fixed_gb": fixed / 1e9,
          "predict_tokens": predict_tokens, "predicted_gb": (fixed + per_token * predict_tokens) / 1e9}


def present_knobs(model_cfg) -> dict:
  fields = {f.name for f in dataclasses.fields(model_cfg)}
  return {k: v for k, v in MODEL_KNOBS.items() if k in fields}


def label(step: str, overrides: Mapping[str, Any]) -> str:
  return " ".join([step] + [f"{k}={v}" for k, v in overrides.items()]) if overrides else f"{step} (defaults)"


def variants(model_cfg, *, unrolled: bool = True) -> list[tuple[str, str, dict]]:
  """(label, step, model overrides). First the headline pair, VCPO and GRPO: the job's defaults, with layers
  under scan where the model has scan_layers. Then (unrolled=True) both steps unrolled, and the VCPO step
  with one other knob changed on top of the headline's (scanned: cheap to compile)."""
  knobs = present_knobs(model_cfg)
  head = {"scan_layers": True} if "scan_layers" in knobs and not model_cfg.scan_layers else {}
  out = [(label(s, head), s, head) for s in ("vcpo", "grpo")]
  if "scan_layers" in knobs and unrolled:
    out += [(label(s, {"scan_layers": False}), s, {"scan_layers": False}) for s in ("vcpo", "grpo")]
  for knob, values in knobs.items():
    if knob == "scan_layers":
      continue
    for v in values:
      if v != getattr(model_cfg, knob):
        out.append((label("vcpo", {**head, knob: v}), "vcpo", {**head, knob: v}))
  return out


def measure(name: str, *, quick: bool, b: int | None = None, t: int | None = None, layers=None,
            only_defaults: bool = False, unrolled: bool = True, time_limit_s: float | None = None,
            steps: tuple[str, ...] = ("vcpo", "grpo"), fit: bool = True, base_overrides=None) -> dict:
  """Every variant at every depth in `layers` (default: the model's own); only_defaults: the headline pair
  only; unrolled=False: no unrolled variants (minutes each at 24 layers); fit: the headline pair compiled
  again at B/2 for the per-token slope of the temporaries (temp_fit). Stops starting new compiles once
  time_limit_s would be passed by one more compile as long as the longest so far (the rest are recorded as
  skipped: a job killed at its limit would lose every row)."""
  import jax
  from vcpo_jax.job import configuration
  jax.config.update("jax_enable_compilation_cache", False)  # a cache hit would time nothing
  b, t = (b or (QUICK_SHAPE if quick else FULL_SHAPE)[0]), (t or (QUICK_SHAPE if quick else FULL_SHAPE)[1])
  base = job_model_config(name, quick)
  base = dataclasses.replace(base, max_seq_len=max(base.max_seq_len, t), **(base_overrides or {}))
  optimizer = configuration.build_optimizer(model_choice.job_config(name))
  lcs = learner_configs(name)
  rows, start, longest = [], time.perf_counter(), 0.0
  fits = lambda: time_limit_s is None or time.perf_counter() - start + longest <= time_limit_s
  for depth in layers or (base.num_layers,):
    cfg = dataclasses.replace(base, num_layers=depth)
    todo = variants(cfg, unrolled=unrolled)[:2] if only_defaults else variants(cfg, unrolled=unrolled)
    headline = {v[0] for v in todo[:2]}
    for label, step, overrides in [v for v in todo if v[1] in steps]:
      row = {"variant": label, "step": step, "layers": depth, "B": b, "T": t, "overrides": overrides}
      if not fits():
        rows.append({**row, "error": "skipped: time limit spent"})
        continue
      try:
        load_before = os.getloadavg()[0]  # the machine is shared: compile seconds scale with its load
        row.update(compile_one(dataclasses.replace(cfg, **overrides), lcs[step], optimizer, b, t))
        row["load_avg_1min"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
        longest = max(longest, row["total_s"])
        if fit and label in headline and b >= 2 and "temp_size_in_bytes" in row["memory"] and fits():
          half = compile_one(dataclasses.replace(cfg, **overrides), lcs[step], optimizer, b // 2, t)
          row["temp_fit"] = temp_fit(b, t, row["memory"]["temp_size_in_bytes"], b // 2,
                                     half["memory"]["temp_size_in_bytes"])
      except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"[:400]
      print(f"[compile] {json.dumps(row)}", flush=True)
      rows.append(row)
  return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
          "commit": environment.git_commit(), "backend": jax.default_backend(), "cpu_model": environment.cpu_model(),
          "cpu_cores": os.cpu_count(), "versions": environment.package_versions(("jax", "jaxlib", "flax")),
          "model": name, "quick": quick, "model_config": base.to_dict(),
          "knobs_present": sorted(present_knobs(base)), "rows": rows}


def produce(quick: bool) -> list[dict]:
  # Always the 0.5B shape (the goals' shape; compiling allocates nothing), or tiny when asked for.
  name = "tiny" if model_choice.resolve_model() == "tiny" else "qwen2.5-0.5b"
  limit = float(os.environ.get("BENCH_JOB_LIMIT_S", "0")) or None
  fn = lambda: compile_report.figures(measure(name, quick=quick, only_defaults=quick, unrolled=False, fit=not quick,
                               time_limit_s=None if limit is None else 0.9 * limit - 20))
  return records.run_figure("compile_vcpo_seconds", "VCPO step trace+compile CPU seconds (abstract inputs)", fn,
                            goal=compile_report.COMPILE_GOAL)


def parse_sets(items) -> dict:
  """['remat=full', 'scan_layers=true'] -> {'remat': 'full', 'scan_layers': True} (JSON value, else a string)."""
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ValueError(f"--set must look like FIELD=VALUE, got {item!r}")
    try:
      out[key] = json.loads(value)
    except ValueError:
      out[key] = value
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--json", default=None, help="figures in the suite's format (as every bench_*.py)")
  parser.add_argument("--model", default=None, choices=model_choice.MODELS)
  parser.add_argument("--B", type=int, default=None)
  parser.add_argument("--T", type=int, default=None)
  parser.add_argument("--layers", default=None, help="comma list of depths, e.g. 2,24 (default the model's)")
  parser.add_argument("--only-defaults", action="store_true", help="the headline VCPO and GRPO steps only")
  parser.add_argument("--no-unrolled", action="store_true", help="no unrolled variants (minutes at 24 layers)")
  parser.add_argument("--steps", default="vcpo,grpo", help="comma list of vcpo, grpo")
  parser.add_argument("--no-fit", action="store_true", help="no second compile at B/2 (per-token slope)")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="model config field for every variant, e.g. --set remat=full (JSON values)")
  parser.add_argument("--out", default=None, help="write the raw rows here (.json) and a table (.md beside)")
  args = parser.parse_args(argv)
  if args.model:
    os.environ[model_choice.MODEL_ENV] = args.model
  if args.out is None and args.B is None and args.T is None and args.layers is None:  # as a suite job
    return records.emit_figures(produce(args.quick), args.json)
  layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
  result = measure(model_choice.resolve_model(), quick=args.quick, b=args.B, t=args.T, layers=layers,
                   only_defaults=args.only_defaults, unrolled=not args.no_unrolled,
                   steps=tuple(args.steps.split(",")), fit=not args.no_fit, base_overrides=parse_sets(args.set))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
      f.write("\n")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
      f.write(compile_report.render_markdown(result))
  print(compile_report.render_markdown(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(compile_report.figures(result), f, indent=2, default=float)
  return result


if __name__ == "__main__":
  main()
