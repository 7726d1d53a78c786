"""Low-rank adapters: creation, stacks of N adapters for per-row serving, and merging into the base weights."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from vcpo_jax.model.config import LINEAR_MODULES, LoraConfig, ModelConfig

# An adapter is a pytree laid out like the model's params, holding only the targeted linear layers:
#   {"layers_0": {"self_attn": {"q_proj": {"lora_A": [I, R], "lora_B": [R, O]}, ...}, "mlp": {...}}, ...}
# (under model.scan_layers one "layers" subtree whose leaves lead with the layers axis L). The model's forward
# and decode take it as `adapter` (flax collection "lora"): y = x W + (alpha / R) (x A) B.
# A stack of N adapters (serving: each row of a batch picks one by `adapter_B`) has the same tree with a slot
# axis N in front of each layer's [I, R] / [R, O] (after L under scan). Slot index -1 is the base (no adapter);
# an all-zero slot is the base too (empty_stack's slots are).
__all__ = ["LoraConfig", "LINEAR_MODULES", "scale", "init_adapter", "empty_stack", "put", "fit", "merge",
           "logical_axes", "count"]

_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def scale(lora_cfg: LoraConfig) -> float:
  """alpha / rank (PEFT's and SGLang's scaling without rsLoRA)."""
  return lora_cfg.scale


def module_dims(model_cfg: ModelConfig) -> dict[str, tuple[int, int, tuple[str, str]]]:
  """Linear layer name -> (in features, out features, the kernel's logical axes), as model.layers builds them."""
  d, f = model_cfg.hidden_size, model_cfg.intermediate_size
  q, kv = model_cfg.num_heads * model_cfg.head_dim, model_cfg.num_kv_heads * model_cfg.head_dim
  return {"q_proj": (d, q, ("embed", "q_heads")), "k_proj": (d, kv, ("embed", "kv_heads")),
          "v_proj": (d, kv, ("embed", "kv_heads")), "o_proj": (q, d, ("q_heads", "embed")),
          "gate_proj": (d, f, ("embed", "mlp")), "up_proj": (d, f, ("embed", "mlp")),
          "down_proj": (f, d, ("mlp", "embed"))}


def _layer_keys(model_cfg: ModelConfig) -> list[str]:
  return ["layers"] if model_cfg.scan_layers else [f"layers_{i}" for i in range(model_cfg.num_layers)]


def _build(model_cfg: ModelConfig, lora_cfg: LoraConfig, leaf_fn):
  """The adapter tree with leaf_fn(key, name, 'lora_A' | 'lora_B', shape, axes) at every leaf."""
  if not lora_cfg.rank:
    raise ValueError("model.lora.rank is 0: there is no adapter to build (set model.lora.rank > 0)")
  dims, r = module_dims(model_cfg), lora_cfg.rank
  lead = ((model_cfg.num_layers,), ("layers",)) if model_cfg.scan_layers else ((), ())
  tree = {}
  for key in _layer_keys(model_cfg):
    layer = tree.setdefault(key, {})
    for name in lora_cfg.target_modules:
      i, o, (in_axis, out_axis) = dims[name]
      layer.setdefault(_PARENT[name], {})[name] = {
          "lora_A": leaf_fn(key, name, "lora_A", lead[0] + (i, r), lead[1] + (in_axis, "lora_rank")),
          "lora_B": leaf_fn(key, name, "lora_B", lead[0] + (r, o), lead[1] + ("lora_rank", out_axis))}
  return tree


def init_adapter(rng, model_cfg: ModelConfig, lora_cfg: LoraConfig | None = None, *, boxed: bool = False):
  """A fresh adapter: A uniform in +-1/sqrt(I) (PEFT's kaiming-uniform, a = sqrt(5)), B zeros, so the model
  with it equals the base. boxed=True wraps leaves in nn.LogicallyPartitioned (for sharded creation)."""
  lora_cfg = model_cfg.lora if lora_cfg is None else lora_cfg
  dtype = model_cfg.jnp_param_dtype
  counter = iter(range(1 << 30))

  def leaf(key, name, kind, shape, axes):
    if kind == "lora_B":
      value = jnp.zeros(shape, dtype)
    else:
      bound = 1.0 / math.sqrt(shape[-2])
      value = jax.random.uniform(jax.random.fold_in(rng, next(counter)), shape, jnp.float32, -bound,
                                 bound).astype(dtype)
    return nn.LogicallyPartitioned(value, names=axes) if boxed else value
  return _build(model_cfg, lora_cfg, leaf)


def logical_axes(model_cfg: ModelConfig, lora_cfg: LoraConfig | None = None):
  """Logical axis names of every adapter leaf (the kernel's in/out axis, 'lora_rank' replicated)."""
  lora_cfg = model_cfg.lora if lora_cfg is None else lora_cfg
  return _build(model_cfg, lora_cfg, lambda key, name, kind, shape, axes: nn.PartitionSpec(*axes))


def empty_stack(model_cfg: ModelConfig, lora_cfg: LoraConfig | None, n: int, dtype=None):
  """N all-zero adapter slots (each serves as the base until `put` fills it), in the compute dtype unless
  `dtype` says otherwise."""
  lora_cfg = model_cfg.lora if lora_cfg is None else lora_cfg
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"empty_stack: n must be an int >= 1, got {n!r}")
  dtype = model_cfg.jnp_dtype if dtype is None else dtype
  lead = 1 if model_cfg.scan_layers else 0

  def leaf(key, name, kind, shape, axes):
    return jnp.zeros(shape[:lead] + (n,) + shape[lead:], dtype)
  return _build(model_cfg, lora_cfg, leaf)


def put(stack, i: int, adapter):
  """The stack with slot i replaced by `adapter` (same targets and rank; cast to the stack's dtype)."""
  s_paths = jax.tree_util.tree_structure(stack)
  if jax.tree_util.tree_structure(adapter) != s_paths:
    raise ValueError("lora.put: the adapter's modules differ from the stack's (target_modules must match)")

  def one(s, a):
    if s.shape[:-3] + s.shape[-2:] != a.shape:
      raise ValueError(f"lora.put: adapter leaf {a.shape} does not fit stack leaf {s.shape} (rank must match)")
    n = s.shape[-3]
    if not 0 <= i < n:
      raise ValueError(f"lora.put: slot {i} outside the stack's {n} slots")
    return s.at[..., i, :, :].set(a.astype(s.dtype))
  return jax.tree.map(one, stack, adapter)


def fit(adapter, model_cfg: ModelConfig, from_cfg: LoraConfig, to_cfg: LoraConfig | None = None):
  """`adapter` (made under from_cfg) in to_cfg's shape, computing the same function: rank padded with zeros,
  B rescaled by from_cfg.scale / to_cfg.scale, to_cfg's targets that from_cfg lacks all-zero. For putting
  adapters of other ranks or alphas into one stack (which applies one scale)."""
  to_cfg = model_cfg.lora if to_cfg is None else to_cfg
  if from_cfg.rank > to_cfg.rank or not set(from_cfg.target_modules) <= set(to_cfg.target_modules):
    raise ValueError(f"lora.fit: an adapter of rank {from_cfg.rank} on {list(from_cfg.target_modules)} does "
                     f"not fit rank {to_cfg.rank} on {list(to_cfg.target_modules)}")
  ratio, pad = from_cfg.scale / to_cfg.scale, to_cfg.rank - from_cfg.rank

  def leaf(key, name, kind, shape, axes):
    if name not in from_cfg.target_modules:
      return jnp.zeros(shape, model_cfg.jnp_param_dtype)
    x = adapter[key][_PARENT[name]][name][kind]
    if kind == "lora_A":
      return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return jnp.pad((x.astype(jnp.float32) * ratio).astype(x.dtype), [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)])
  return _build(model_cfg, to_cfg, leaf)


def merge(params, adapter, model_cfg: ModelConfig, lora_cfg: LoraConfig | None = None):
  """Full weights with the adapter folded in: kernel + (alpha / R) A B for every targeted layer (what a
  full-weight publish or export of the adapted policy needs)."""
  s = scale(model_cfg.lora if lora_cfg is None else lora_cfg)
  out = jax.tree.map(lambda x: x, params)  # new containers, the same arrays

  def walk(p, a):
    for k, v in a.items():
      if "lora_A" in v:
        kernel = p[k]["kernel"]
        delta = jnp.einsum("...ir,...ro->...io", v["lora_A"].astype(jnp.float32),
                           v["lora_B"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        p[k] = {**p[k], "kernel": (kernel.astype(jnp.float32) + s * delta).astype(kernel.dtype)}
      else:
        p[k] = dict(p[k])
        walk(p[k], v)
  walk(out, adapter)
  return out


def count(adapter) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(adapter))
