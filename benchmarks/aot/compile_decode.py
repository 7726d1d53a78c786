"""The embedded server's decode chunk (serving/pool_kernels.steps) compiled for one chip: memory vs its HBM."""
from __future__ import annotations

import time

from benchmarks.aot import compile_step


def compile_decode(config: str, device, target, *, max_batch: int = 64, chunk_steps: int = 8,
                   overrides=(), top: int = 10) -> dict:
  """`steps` over a pool of `max_batch` rows whose KV cache holds model.max_seq_len slots each (the server's
  --max-batch and --context-length defaults), parameters in model.param_dtype (what the server loads), cache
  in the compute dtype, all on `device` (the server runs on one chip)."""
  import jax
  import jax.numpy as jnp
  from vcpo_jax.model import hf
  from vcpo_jax.model import transformer as model_lib
  from vcpo_jax.parallel import target as target_lib
  from vcpo_jax.serving import pool_kernels
  job = compile_step.load_config(config)
  options = compile_step.apply_overrides(job, overrides)
  cfg = hf.model_config(job.model)
  one = jax.sharding.SingleDeviceSharding(device)

  def on_device(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)
  S = cfg.max_seq_len
  result = {"label": f"decode {max_batch} rows", "config": config, "step": "decode", "overrides": dict(overrides),
            "rows": max_batch, "seq_len": S, "micro_batch_size": 0, "dtype": cfg.dtype, "devices": 1,
            "mesh": {}, "device_kind": target.device_kind, "hbm_bytes": target.memory_bytes,
            "kv_cache_bytes": 2 * cfg.num_layers * max_batch * S * cfg.num_kv_heads * cfg.head_dim
                              * jnp.dtype(cfg.jnp_dtype).itemsize}
  t0 = time.perf_counter()
  try:
    with target_lib.compiling_for(target):
      params = on_device(jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0))))
      pool = on_device(jax.eval_shape(lambda: pool_kernels.empty(cfg=cfg, B=max_batch, S=S, C=chunk_steps, K=4,
                                                                 cache_dtype=cfg.jnp_dtype)))
      live = jax.ShapeDtypeStruct((max_batch,), jnp.bool_, sharding=one)
      lowered = pool_kernels.steps.lower(params, pool, live, cfg=cfg)
      compiled = compile_step.compile_lowered(lowered, options)
    params_shapes = {tuple(x.shape) for x in jax.tree.leaves(params)}
    result.update(compile_step.analyse(compiled, target.memory_bytes, cfg.vocab_size, top, params_shapes))
  except Exception as e:  # noqa: BLE001 - a decode that does not fit the chip is the answer for this case
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    result.update(error=f"{type(e).__name__}: {first[:400]}", fits=False)
  result["compile_s"] = time.perf_counter() - t0
  result["choices"] = []
  return result
