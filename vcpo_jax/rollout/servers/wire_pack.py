"""Weight buckets for the wire: the exporter's HF tensors packed, in the served dtype, into flat uint8 buffers.

SGLang's `load_format="flattened_bucket"` reads one uint8 buffer per bucket: the tensors back to back in the
order of `names`, with no padding, each tensor's byte offset a multiple of its itemsize. Sorting a bucket's
tensors by itemsize, largest first, meets that rule for any mix of dtypes (every size is a multiple of its own
itemsize, so the running offset stays a multiple of each smaller one).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax.model import config as config_lib
from vcpo_jax.model import hf
from vcpo_jax.model import transformer as model_lib

SERVED_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class WireTensor:
  """One HF tensor: its name, shape and dtype on the wire, and where it lives in our params."""
  name: str
  shape: tuple[int, ...]
  dtype: str
  path: tuple[str, ...]
  layer: Optional[int]     # the layer of a stacked (scan) leaf, else None
  transpose: bool

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(jnp.dtype(self.dtype)).itemsize


def manifest(cfg: config_lib.ModelConfig, dtype: str) -> list[WireTensor]:
  """Every tensor the exporter writes, in its order, with HF's shapes, cast to `dtype` on the wire."""
  if dtype not in SERVED_DTYPES:
    raise ValueError(f"the served dtype must be one of {SERVED_DTYPES}, got {dtype!r}")
  params = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
  out = []
  for layer, (path, name, transpose) in hf.tensors_with_layer(cfg):
    shape = tuple(hf.get_path(params, path).shape)
    if layer is not None:
      shape = shape[1:]
    out.append(WireTensor(name, shape[::-1] if transpose else shape, dtype, path, layer, transpose))
  return out


def plan_buckets(tensors: Sequence[WireTensor], bucket_bytes: int) -> list[list[WireTensor]]:
  """Consecutive tensors grouped into buckets of at most bucket_bytes (a larger tensor goes alone), each
  bucket ordered by itemsize, largest first (the alignment rule above)."""
  if bucket_bytes < 1:
    raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
  buckets: list[list[WireTensor]] = []
  current: list[WireTensor] = []
  size = 0
  for t in tensors:
    if current and size + t.nbytes > bucket_bytes:
      buckets.append(current)
      current, size = [], 0
    current.append(t)
    size += t.nbytes
  if current:
    buckets.append(current)
  itemsize = lambda t: np.dtype(jnp.dtype(t.dtype)).itemsize
  return [sorted(b, key=itemsize, reverse=True) for b in buckets]


def bucket_offsets(bucket: Sequence[WireTensor]) -> list[int]:
  """Byte offset of each tensor in the bucket; raises where one would break the alignment rule."""
  offsets, offset = [], 0
  for t in bucket:
    itemsize = np.dtype(jnp.dtype(t.dtype)).itemsize
    if offset % itemsize:
      raise ValueError(f"tensor {t.name} ({t.dtype}) would start at byte {offset}, not a multiple of {itemsize}")
    offsets.append(offset)
    offset += t.nbytes
  return offsets


def _as_bytes(x):
  """x's bytes, flat (little-endian, as torch's view(uint8) on the receiving side)."""
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1) if x.dtype.itemsize > 1 else x.reshape(-1)


def _leaf_bytes(leaf, t: WireTensor):
  x = leaf[t.layer] if t.layer is not None else leaf
  return _as_bytes((x.T if t.transpose else x).astype(jnp.dtype(t.dtype)))


def pack_fn(bucket: Sequence[WireTensor]):
  """A jitted (params -> uint8[bucket bytes]) for one bucket; on a mesh its output may be sharded like the
  params (one_device_copy gives the broadcast its whole buffer)."""
  bucket = tuple(bucket)
  bucket_offsets(bucket)

  def pack(params):
    parts = [_leaf_bytes(hf.get_path(params, t.path), t) for t in bucket]
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

  return jax.jit(pack)


def pack_layout_fn(bucket: Sequence[WireTensor], specs: Sequence[tuple[tuple[str, ...], bool]]):
  """pack_fn for the export's HF layout (hf_export.HfLayout.leaves, in `specs` order): its leaves are already
  transposed and cast, so a bucket only slices layers and concatenates bytes."""
  bucket = tuple(bucket)
  bucket_offsets(bucket)
  position = {spec: j for j, spec in enumerate(specs)}

  def pack(leaves):
    parts = []
    for t in bucket:
      x = leaves[position[(t.path, t.transpose)]]
      parts.append(_as_bytes((x[t.layer] if t.layer is not None else x).astype(jnp.dtype(t.dtype))))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

  return jax.jit(pack)


def one_device_copy(packed_N: jax.Array) -> jax.Array:
  """The whole packed bucket on one device: DLPack takes no multi-device array, and a bucket packed from
  FSDP-sharded params comes out sharded too (its first shard would be a fraction of the bytes)."""
  if len(packed_N.sharding.device_set) == 1:
    return packed_N
  first = packed_N.addressable_shards[0]
  return first.data if packed_N.sharding.is_fully_replicated else jax.device_put(packed_N, first.device)


def pack_named(bucket: Sequence[WireTensor], tensors: dict[str, np.ndarray]) -> np.ndarray:
  """The same bytes from HF-named host arrays already in the wire dtype (hf_export.hf_tensors)."""
  bucket_offsets(bucket)
  return np.concatenate([np.ascontiguousarray(tensors[t.name]).astype(jnp.dtype(t.dtype), copy=False)
                         .reshape(-1).view(np.uint8) for t in bucket])


def unpack(buffer_u8: np.ndarray, names: Sequence[str], dtypes: Sequence[str],
           shapes: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
  """The receiving side: a bucket's bytes back into named arrays (checks the alignment rule and the size)."""
  buffer_u8 = np.asarray(buffer_u8).reshape(-1)
  out, offset = {}, 0
  for name, dtype, shape in zip(names, dtypes, shapes):
    if dtype not in SERVED_DTYPES:
      raise ValueError(f"tensor {name}: dtype {dtype!r} is not one of {SERVED_DTYPES}")
    np_dtype = np.dtype(jnp.dtype(dtype))
    if offset % np_dtype.itemsize:
      raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
    size = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
    if offset + size > buffer_u8.size:
      raise ValueError(f"tensor {name} ends at byte {offset + size}, past the bucket's {buffer_u8.size}")
    out[name] = buffer_u8[offset:offset + size].view(np_dtype).reshape(tuple(shape))
    offset += size
  if offset != buffer_u8.size:
    raise ValueError(f"the bucket has {buffer_u8.size} bytes, its tensors {offset}")
  return out
