"""model.remat='auto': the remat policy of least recomputation whose estimated step memory fits the device."""
from __future__ import annotations

import dataclasses
import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp

from vcpo_jax.model import transformer as M
from vcpo_jax.parallel import target

# Least recomputation first (and most memory): none keeps every intermediate; dots keeps every dot's output;
# dots_no_batch only the weight matmuls' (attention's batched dots are recomputed); full keeps each layer's
# input alone and recomputes the whole layer in the backward.
ORDER = ("none", "dots", "dots_no_batch", "full")
# Budget where the backend reports no memory limit (CPU): one 80 GB GPU, the documented device of the configs.
DEFAULT_DEVICE_GB = 80.0
_logged: set = set()


@functools.lru_cache(maxsize=256)
def residual_bytes(cfg, layers: int, rows: int, seq_len: int) -> int:
  """Bytes the learner's forward (token log-probs, `layers` layers unrolled) keeps for its backward: jax's
  own residuals of its vjp on abstract shapes (nothing is computed), parameters themselves not counted."""
  c = dataclasses.replace(cfg, num_layers=layers, scan_layers=False, max_seq_len=max(cfg.max_seq_len, seq_len))
  params = jax.eval_shape(lambda: M.init_params(c, jax.random.PRNGKey(0)))

  def kept(p, tokens_BxT):
    mask_BxT = jnp.ones(tokens_BxT.shape, jnp.float32)
    _, vjp = jax.vjp(lambda q: jnp.sum(M.token_logprobs(q, c, tokens_BxT, mask_BxT)), p)
    ids = {id(x) for x in jax.tree.leaves(p)}
    return [r for r in jax.tree.leaves(vjp) if id(r) not in ids]

  with nn.logical_axis_rules([]):  # global shapes, whatever mesh the caller traces under
    out = jax.eval_shape(kept, params, jax.ShapeDtypeStruct((rows, seq_len), jnp.int32))
  return sum(x.size * x.dtype.itemsize for x in out)


def activation_bytes(cfg, policy: str, rows: int, seq_len: int) -> dict:
  """Per-device activation memory of a backward over `rows` x `seq_len` under `policy`: the layers' kept
  residuals (one layer's from 1 vs 2 layers, times the depth), the rest of the model's (embedding, head), and
  one layer's full residuals twice (recomputed forward and its cotangents: the backward's working set)."""
  cfg = dataclasses.replace(cfg, remat_budget_gb=0.0)  # no shape depends on it: one cached trace for every budget
  one, two = (residual_bytes(dataclasses.replace(cfg, remat=policy), n, rows, seq_len) for n in (1, 2))
  per_layer = two - one
  working = 2 * (residual_bytes(dataclasses.replace(cfg, remat="none"), 2, rows, seq_len)
                 - residual_bytes(dataclasses.replace(cfg, remat="none"), 1, rows, seq_len))
  return {"layers": cfg.num_layers * per_layer, "rest": one - per_layer, "working": working}


def state_bytes_per_device(state, grad_copies: int = 1) -> float:
  """Bytes per device of the train state (params, optimizer state, reference), `grad_copies` gradients (2 with
  a micro-batch accumulator) and the update's new parameters, sharded over the mesh's fsdp x tensor axes."""
  leaves = jax.tree.leaves(state)
  total = sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves)
  params = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.params))
  return (total + (grad_copies + 1) * params) / param_shards()


def param_shards() -> int:
  """Devices one parameter is split over: the fsdp x tensor axes of the mesh being traced under (1 if none)."""
  shape = dict(jax.sharding.get_abstract_mesh().shape or {})
  return max(1, shape.get("fsdp", 1) * shape.get("tensor", 1))


def row_shards() -> int:
  """Devices the rows are split over: the data x fsdp axes of the mesh being traced under (1 if none)."""
  shape = dict(jax.sharding.get_abstract_mesh().shape or {})
  return max(1, shape.get("data", 1) * shape.get("fsdp", 1))


def budget_gb(cfg) -> tuple[float, str]:
  """(GB per device, where it comes from): model.remat_budget_gb, else the device's memory limit."""
  if cfg.remat_budget_gb:
    return float(cfg.remat_budget_gb), "model.remat_budget_gb"
  t = target.current()
  if t.memory_bytes:
    return t.memory_bytes / 1e9, t.memory_source
  return DEFAULT_DEVICE_GB, f"default ({t.memory_source})"


def estimate_gb(cfg, policy: str, rows: int, seq_len: int, state_bytes: float) -> float:
  a = activation_bytes(cfg, policy, rows, seq_len)
  return (state_bytes + a["layers"] + a["rest"] + a["working"]) / 1e9


def choose(cfg, rows: int, seq_len: int, state_bytes: float) -> tuple[str, str]:
  """(policy, reason) for a backward over `rows` x `seq_len` per device; cfg.remat must be 'auto'."""
  budget, source = budget_gb(cfg)
  est = {}
  for policy in ORDER:
    est[policy] = estimate_gb(cfg, policy, rows, seq_len, state_bytes)
    if est[policy] <= budget:
      over = "".join(f", {p} ~{g:.1f} GB" for p, g in est.items() if p != policy)
      return policy, (f"~{est[policy]:.1f} GB per device <= {budget:.1f} GB ({source}) for {rows} rows x "
                      f"{seq_len} tokens per device{over and '; over it:' + over[1:]}")
  return "full", (f"no policy fits {budget:.1f} GB ({source}) for {rows} rows x {seq_len} tokens per device: "
                  + ", ".join(f"{p} ~{g:.1f} GB" for p, g in est.items()) + " (full: the least memory)")


def resolve(cfg, rows: int, seq_len: int, state_bytes: float):
  """cfg with remat='auto' replaced by the chosen policy (logged once per shape); other configs unchanged."""
  if cfg.remat != "auto":
    return cfg
  policy, reason = choose(cfg, rows, seq_len, state_bytes)
  key = (policy, reason)
  log = logging.warning if reason.startswith("no policy") else logging.info
  if key not in _logged:
    _logged.add(key)
    log("model.remat=auto -> %r (%s)", policy, reason)
  return dataclasses.replace(cfg, remat=policy)
