"""LoRA against full fine-tuning: learner step time and optimizer state at the 0.5B shape, 7B compile-only memory.

Run: `python -m benchmarks.cpu.bench_lora` (writes benchmarks/results/results-lora.md). The 7B figure compiles the sharded
RL step on abstract inputs over 8 fake CPU devices in a subprocess (XLA's memory analysis, as
tests/test_remat_auto.py does); the step times run in this process on one CPU device.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

COMMAND = "python -m benchmarks.cpu.bench_lora"
OUT = pathlib.Path(__file__).resolve().parents[1] / "results" / "results-lora.md"
RANK, ALPHA = 16, 32.0
STEP_SHAPE = dict(b=8, t=64, timed_steps=3)  # bench_step.py's 0.5B quick batch: one group of 8 rows x 64 tokens
LONG_ROWS = (8, 8192)  # rows x tokens of the compile-only memory check


def _lora(cfg, rank: int):
  from vcpo_jax.model import config as model_config
  return dataclasses.replace(cfg, lora=model_config.LoraConfig(rank=rank, alpha=ALPHA) if rank else
                             model_config.LoraConfig())


def _tree_bytes(tree) -> int:
  import jax
  import numpy as np
  return int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def step_times() -> dict:
  """Median learner step seconds (same batch, same base weights) and optimizer-state bytes, full vs LoRA."""
  import jax
  import numpy as np
  from benchmarks.common import model_choice
  from benchmarks.cpu import bench_step
  from vcpo_jax.learner import config as learner_config
  from vcpo_jax.learner import optimizer as O
  from vcpo_jax.learner import step as Lr
  from vcpo_jax.learner import train_state

  base_cfg = dataclasses.replace(model_choice.model_config("qwen2.5-0.5b"), max_seq_len=STEP_SHAPE["t"],
                                 remat="none")
  lc = learner_config.LearnerConfig(micro_batch_size=0)  # VCPO's defaults: OPOB, per-sequence norms
  opt = O.build_optimizer(learning_rate=1e-6)
  out = {"model": "qwen2.5-0.5b", "rows": STEP_SHAPE["b"], "tokens_per_row": STEP_SHAPE["t"],
         "learner": "LearnerConfig() defaults (advantage=opob, grad_path=auto), AdamW"}
  batch = None
  for name, rank in (("full", 0), ("lora", RANK)):
    cfg = _lora(base_cfg, rank)
    state = train_state.create_train_state(cfg, opt, jax.random.PRNGKey(0))
    if batch is None:
      batch = bench_step.make_batch(cfg, train_state.base_params(state), STEP_SHAPE["b"], STEP_SHAPE["t"])
    step = Lr.make_rl_step(cfg, lc, opt)
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    times = []
    for _ in range(STEP_SHAPE["timed_steps"]):
      t0 = time.perf_counter()
      state, m = step(state, batch)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t0)
    out[name] = {"step_s": float(np.median(times)), "step_s_all": times, "first_step_s": first,
                 "trained_params": _tree_bytes(state.params) // np.dtype(np.float32).itemsize,
                 "opt_state_bytes": _tree_bytes(state.opt_state), "loss": float(m["loss"])}
    del state
  return out


def compile_memory() -> dict:
  """XLA's per-device bytes of the 7B RL step at 8 x 8192 rows, fsdp 8 (compile only), full vs LoRA."""
  import jax
  import jax.numpy as jnp
  from flax import linen as nn
  from configs import qwen2_5
  from vcpo_jax.job import configuration
  from vcpo_jax.learner import batch as batch_lib
  from vcpo_jax.learner import step as learner, train_state
  from vcpo_jax.model import hf, remat
  from vcpo_jax.parallel import sharding

  job = qwen2_5.get_config("7b")
  devices, gb = qwen2_5.LONG_ROWS_DEVICES
  rows, seq_len = LONG_ROWS
  lc = dataclasses.replace(configuration.learner_config(job), micro_batch_size=0)
  opt = configuration.build_optimizer(job)
  mesh = sharding.make_mesh(dict(data=1, fsdp=devices, tensor=1), devices=jax.devices()[:devices])
  out = {"model": "qwen2.5-7b (configs/qwen2_5.py:7b)", "rows": rows, "tokens_per_row": seq_len,
         "mesh": f"fsdp {devices}", "remat_budget_gb": gb}
  for name, rank in (("full", 0), ("lora", RANK)):
    cfg = _lora(dataclasses.replace(hf.model_config(job.model), max_seq_len=seq_len, remat_budget_gb=gb), rank)
    state = jax.eval_shape(lambda k, cfg=cfg: train_state.create_train_state(cfg, opt, k), jax.random.PRNGKey(0))
    s = jax.ShapeDtypeStruct
    batch = batch_lib.RLBatch(tokens_BxT=s((rows, seq_len), jnp.int32), mask_BxT=s((rows, seq_len), jnp.float32),
                              sampler_logp_BxT=s((rows, seq_len), jnp.float32), rewards_B=s((rows,), jnp.float32),
                              group_B=s((rows,), jnp.int32), lag_B=s((rows,), jnp.int32),
                              valid_B=s((rows,), jnp.float32))
    chosen = []

    def fn(state, batch, cfg=cfg, chosen=chosen):
      with jax.default_matmul_precision(cfg.matmul_precision):
        shards = train_state.batch_rows(mesh)
        state_b = remat.state_bytes_per_device(state)
        chosen.append(remat.resolve(cfg, -(-rows // shards), seq_len, state_b).remat)
        return learner.rl_step(state, batch, model_cfg=cfg, learner_cfg=lc, optimizer=opt, row_shards=shards)

    state_sh = train_state.state_shardings(cfg, opt, mesh, sharding.DEFAULT_RULES)
    jitted = jax.jit(fn, in_shardings=(state_sh, sharding.batch_sharding(mesh, ndim=1)),
                     out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=0)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), nn.logical_axis_rules(list(sharding.DEFAULT_RULES)):
      mem = jitted.lower(state, batch).compile().memory_analysis()
    per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                  - mem.alias_size_in_bytes)
    out[name] = {"per_device_gb": per_device / 1e9, "state_gb_per_device": _tree_bytes(state) / devices / 1e9,
                 "temp_gb": mem.temp_size_in_bytes / 1e9, "remat": chosen[0],
                 "opt_state_gb": _tree_bytes(state.opt_state) / 1e9, "compile_s": time.perf_counter() - t0}
  return out


def _memory_in_subprocess() -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  root = pathlib.Path(__file__).resolve().parents[2]
  proc = subprocess.run([sys.executable, "-m", "benchmarks.cpu.bench_lora", "--memory-json"], env=env, cwd=root,
                        capture_output=True, text=True, check=True)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def render(step: dict, mem: dict, seconds: float) -> str:
  f, lo = step["full"], step["lora"]
  mf, ml = mem["full"], mem["lora"]
  time_ratio = lo["step_s"] / f["step_s"]
  opt_ratio = lo["opt_state_bytes"] / f["opt_state_bytes"]
  rows = [
      ("learner step, 0.5B shape, CPU, LoRA / full", f"{time_ratio:.3f}x", "<= 0.75x", time_ratio <= 0.75,
       f"{lo['step_s']:.2f} s vs {f['step_s']:.2f} s (median of {STEP_SHAPE['timed_steps']})"),
      ("optimizer state, 0.5B shape, LoRA / full", f"{100 * opt_ratio:.3f}%", "<= 2%", opt_ratio <= 0.02,
       f"{lo['opt_state_bytes'] / 1e6:.1f} MB vs {f['opt_state_bytes'] / 1e6:.1f} MB"),
      (f"7B RL step, {mem['rows']} x {mem['tokens_per_row']} rows, {mem['mesh']}: XLA GB per device",
       f"{ml['per_device_gb']:.1f} GB", f"well below full ({mf['per_device_gb']:.1f} GB)",
       ml["per_device_gb"] < 0.75 * mf["per_device_gb"],
       f"remat {ml['remat']} vs {mf['remat']}; state {ml['state_gb_per_device']:.1f} vs "
       f"{mf['state_gb_per_device']:.1f} GB/device; temporaries {ml['temp_gb']:.1f} vs {mf['temp_gb']:.1f} GB"),
  ]
  lines = [
      "# LoRA vs full fine-tuning: learner step, optimizer state, 7B memory", "",
      f"Command: `{COMMAND}` (writes this file; {seconds:.0f} s).", "",
      f"LoRA: rank {RANK}, alpha {ALPHA:g}, all seven linear layers of every decoder layer (model.lora defaults).",
      f"Host: {platform.machine()}, {os.cpu_count()} CPUs, shared with other jobs while it ran (loaded), so "
      "the step seconds are not a speed of this machine; both arms ran back to back in one process on the same "
      "batch, so their ratio is the figure to read.", "",
      "| figure | measured | goal | met | details |", "| --- | --- | --- | --- | --- |"]
  lines += [f"| {a} | {b} | {c} | {'yes' if d else 'NO'} | {e} |" for a, b, c, d, e in rows]
  lines += ["", "## Details", "", "```json", json.dumps({"step": step, "memory_7b": mem}, indent=2), "```", ""]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--memory-json", action="store_true", help="(internal) print the 7B memory figures")
  args = parser.parse_args(argv)
  if args.memory_json:
    print(json.dumps(compile_memory()))
    return
  t0 = time.time()
  mem = _memory_in_subprocess()
  step = step_times()
  OUT.write_text(render(step, mem, time.time() - t0))
  print(OUT.read_text())


if __name__ == "__main__":
  main()
