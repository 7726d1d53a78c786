"""The job's learner step lowered and compiled for target devices: XLA's memory per device, buffers, custom calls."""
from __future__ import annotations

import ast
import dataclasses
import logging
import os
import time

from benchmarks.aot import hlo
from vcpo_jax.job import config_file

# The step kinds: the GPU check's three (bench_gpu_step.learner_configs) and the job's own learner.
STEPS = ("grpo", "vcpo_bounded", "vcpo_book_keeping", "job")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Case:
  """One compile: `config` is a bench model name (benchmarks/common/model_choice.py, e.g. "qwen2.5-0.5b": the GPU
  check's) or a config file with its argument ("configs/qwen2_5.py:7b"); overrides are ("model.attention",
  "xla")-style pairs (xla_* keys go to the compiler as options); rows/seq_len default to the job's batch
  (rl.prompts_per_step x rl.group_size) and model.max_seq_len."""
  config: str
  step: str = "job"
  rows: int | None = None
  seq_len: int | None = None
  overrides: tuple[tuple[str, str], ...] = ()
  label: str = ""


def load_config(spec: str):
  from benchmarks.common import model_choice
  if spec in model_choice.MODELS:
    return model_choice.job_config(spec)
  path, _, arg = spec.partition(":")
  full = path if os.path.isabs(path) else os.path.join(REPO_ROOT, path)
  if not os.path.exists(full):
    raise ValueError(f"--config must be one of {model_choice.MODELS} or a config file, got {spec!r}")
  module = config_file.load(full)
  return module.get_config(arg) if arg else module.get_config()


def parse_value(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def apply_overrides(config, overrides) -> dict:
  """Sets each "a.b.c" field of `config` (in place); returns the xla_* compiler options among them."""
  options = {}
  for key, text in overrides:
    if key.startswith("xla_"):  # XLA wants bools as bools ("true" is refused)
      options[key] = {"true": True, "false": False}.get(text.lower(), parse_value(text))
      continue
    node, *path = key.split(".")
    parent = config
    for name in [node] + path[:-1]:
      if name not in parent:
        raise ValueError(f"--set {key}={text}: the config has no field {key!r}")
      parent = parent[name]
    leaf = path[-1] if path else node
    if leaf not in parent:
      raise ValueError(f"--set {key}={text}: the config has no field {key!r}")
    try:
      parent[leaf] = parse_value(text)
    except (TypeError, ValueError) as e:
      raise ValueError(f"--set {key}={text}: {e}") from None
  return options


def learner_config(job, step: str):
  from benchmarks.gpu import bench_gpu_step
  from vcpo_jax.job import configuration
  if step == "job":
    return configuration.learner_config(job)
  configs = bench_gpu_step.learner_configs(job)
  if step not in configs:
    raise ValueError(f"step must be one of {STEPS}, got {step!r}")
  return configs[step]


def abstract_batch(rows: int, seq_len: int, mesh):
  """The RL batch as ShapeDtypeStructs, rows split over the mesh's data x fsdp."""
  import jax
  import jax.numpy as jnp
  from vcpo_jax.learner import batch as batch_lib
  from vcpo_jax.parallel import sharding

  def s(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, ndim=len(shape)))
  return batch_lib.RLBatch(tokens_BxT=s((rows, seq_len), jnp.int32), mask_BxT=s((rows, seq_len), jnp.float32),
                           sampler_logp_BxT=s((rows, seq_len), jnp.float32), rewards_B=s((rows,), jnp.float32),
                           group_B=s((rows,), jnp.int32), lag_B=s((rows,), jnp.int32),
                           valid_B=s((rows,), jnp.float32))


def abstract_state(model_cfg, optimizer, mesh):
  import jax
  from vcpo_jax.learner import train_state
  shardings = train_state.state_shardings(model_cfg, optimizer, mesh)
  state = jax.eval_shape(lambda k: train_state.create_train_state(model_cfg, optimizer, k), jax.random.PRNGKey(0))
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, shardings)


class _Choices(logging.Handler):
  """Collects the automatic choices the step logs while it is traced (remat, gradient path, attention)."""

  def __init__(self):
    super().__init__(logging.INFO)
    self.messages = []

  def emit(self, record):
    msg = record.getMessage()
    if ("auto" in msg or "path" in msg or "attention" in msg) and msg not in self.messages:
      self.messages.append(msg)


def memory(compiled) -> dict:
  """XLA's memory analysis per device; peak = arguments + outputs + temporaries - aliased (bench_step's)."""
  mem = compiled.memory_analysis()
  if mem is None:
    return {}
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "generated_code_size_in_bytes")
  out = {k: int(getattr(mem, k)) for k in keys if hasattr(mem, k)}
  out["peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"] + out["temp_size_in_bytes"]
                       - out["alias_size_in_bytes"])
  return out


def compile_lowered(lowered, options: dict):
  return lowered.compile(compiler_options=options) if options else lowered.compile()


def param_shapes(state) -> set:
  """Per-device shapes of the state's parameters (their gradients and optimizer moments have the same)."""
  import jax
  return {tuple(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(state.params)}


def analyse(compiled, hbm_bytes: int | None, vocab: int, top: int, params: set = frozenset()) -> dict:
  """Memory vs HBM, custom calls, the largest arrays and the f32 [tokens, vocab] arrays of a compiled program."""
  mem = memory(compiled)
  text = compiled.as_text()
  calls = hlo.custom_calls(text)
  out = {"memory": mem, "custom_calls": calls, "attention_kernel": hlo.attention_kernel(calls),
         "attention_bias": hlo.attention_bias(calls), "largest_arrays": hlo.largest_arrays(text, top),
         "f32_vocab_arrays": hlo.f32_vocab_arrays(text, vocab, params)}
  if hbm_bytes and mem:
    out["headroom"] = 1.0 - mem["peak_bytes"] / hbm_bytes
    out["fits"] = mem["peak_bytes"] <= hbm_bytes
  return out


def compile_case(case: Case, devices, target, top: int = 10) -> dict:
  """Builds the job's RL step (its mesh over `devices`, make_rl_step) while compiling for `target`, lowers it on
  abstract inputs and compiles it. A compile that fails (e.g. XLA's "exceeds available HBM") is a result too."""
  from vcpo_jax.job import configuration
  from vcpo_jax.learner import step as learner
  from vcpo_jax.model import hf
  from vcpo_jax.model import remat
  from vcpo_jax.parallel import sharding
  from vcpo_jax.parallel import target as target_lib
  job = load_config(case.config)
  options = apply_overrides(job, case.overrides)
  model_cfg = hf.model_config(job.model)
  lc = learner_config(job, case.step)
  optimizer = configuration.build_optimizer(job)
  mesh = sharding.make_mesh(job.mesh, devices=devices)
  rows = case.rows or job.rl.prompts_per_step * job.rl.group_size
  seq_len = case.seq_len or model_cfg.max_seq_len
  result = {"label": case.label or case.step, "config": case.config, "step": case.step,
            "overrides": dict(case.overrides), "rows": rows, "seq_len": seq_len,
            "micro_batch_size": lc.micro_batch_size, "dtype": model_cfg.dtype, "devices": len(devices),
            "mesh": dict(mesh.shape), "device_kind": target.device_kind, "hbm_bytes": target.memory_bytes}
  remat._logged.clear()  # remat logs a choice once per process; each compile's choice belongs in its result
  handler = _Choices()
  logging.getLogger().addHandler(handler)
  old_level = logging.getLogger().level
  logging.getLogger().setLevel(min(old_level, logging.INFO))
  t0 = time.perf_counter()
  try:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = lc.micro_batch_size if 0 < lc.micro_batch_size < rows else 0
    if rows % shards or (micro and (rows % micro or micro % shards)):  # what the step's call checks on real rows
      raise ValueError(f"algo.micro_batch_size={lc.micro_batch_size} and B={rows} rows: both must be multiples "
                       f"of the mesh's data x fsdp = {shards} (and the micro-batch divide B)")
    with target_lib.compiling_for(target):
      step = learner.make_rl_step(model_cfg, lc, optimizer, mesh)
      state = abstract_state(model_cfg, optimizer, mesh)
      compiled = compile_lowered(step.lower(state, abstract_batch(rows, seq_len, mesh)), options)
    result.update(analyse(compiled, target.memory_bytes, model_cfg.vocab_size, top, param_shapes(state)))
  except Exception as e:  # noqa: BLE001 - a compile that does not fit is the answer for this case
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    result.update(error=f"{type(e).__name__}: {first[:400]}", fits=False)
  finally:
    logging.getLogger().removeHandler(handler)
    logging.getLogger().setLevel(old_level)
  result["compile_s"] = time.perf_counter() - t0
  result["choices"] = handler.messages
  return result
