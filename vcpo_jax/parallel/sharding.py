"""Device mesh, logical axis rules and directly-sharded state creation (multi-host set-up: multihost.py)."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axes. Parameters shard their "embed" dim over fsdp and their head/mlp/vocab dims over
# tensor; activations shard the batch over data x fsdp.
DEFAULT_RULES: tuple[tuple[str, object], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),  # the stacked layers axis of params under scan (model.scan_layers): replicated
    ("lora_rank", None),  # an adapter's rank axis (model.lora): small, replicated
)


def make_mesh(shape: Mapping[str, int], devices: Sequence | None = None) -> Mesh:
  """`shape` maps each of data/fsdp/tensor to a size; one size may be -1 (fill with the rest)."""
  unknown = sorted(set(shape) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"unknown mesh axis {unknown}; known axes: {list(MESH_AXES)}")
  devices = list(jax.devices() if devices is None else devices)
  sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got mesh={dict(shape)}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"mesh={dict(shape)} does not divide {len(devices)} devices")
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f"mesh={dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, "
                     f"have {len(devices)}")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_shardings(logical_specs, mesh: Mesh, rules=DEFAULT_RULES):
  return nn.logical_to_mesh_sharding(logical_specs, mesh, list(rules))


def create_sharded(init_fn: Callable[[], object], mesh: Mesh, rules=DEFAULT_RULES):
  """Creates the (boxed-initialised) state directly sharded; returns (unboxed state, shardings)."""
  abstract = jax.eval_shape(init_fn)
  shardings = logical_shardings(nn.get_partition_spec(abstract), mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(list(rules)):
    state = jax.jit(lambda: nn.unbox(init_fn()), out_shardings=shardings)()
  return state, shardings


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading (batch) dim over data x fsdp, the rest replicated."""
  return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
