"""Fast HF export: the HF layout made on device a leaf at a time (into recycled buffers), each written once ready."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax.model import config as config_lib
from vcpo_jax.model import hf, hf_config, safetensors_file
from vcpo_jax.model import transformer as model_lib
from vcpo_jax.parallel import processes

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
REUSE_NAME = ".reuse.safetensors"


@dataclasses.dataclass(frozen=True)
class HfLayout:
  """A model's tensors as the export writes them. `leaves[j]` is the j-th of `leaf_specs(cfg)`: already in HF
  layout and `dtype` when `on_device` (fresh buffers, safe when the params are donated afterwards); else the
  params' own leaves (sharded over processes: gathered one at a time, converted on the host)."""
  cfg: config_lib.ModelConfig
  dtype: str
  leaves: tuple
  on_device: bool


def check_dtype(dtype: str) -> str:
  if dtype not in EXPORT_DTYPES:
    raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
  return dtype


@functools.lru_cache(maxsize=None)
def leaf_specs(cfg: config_lib.ModelConfig) -> tuple[tuple[tuple[str, ...], bool], ...]:
  """(param path, transpose) of every leaf the export reads, in tensor_names order (a stacked leaf once)."""
  return tuple(dict.fromkeys((path, transpose) for path, _, transpose in hf.tensor_names(cfg)))


def _leaf_layout(x, transpose: bool, dtype: str):
  y = jnp.swapaxes(x, -1, -2) if transpose else x  # HF's [out, in]; a stacked leaf keeps its layer axis
  return y.astype(jnp.dtype(dtype))


@functools.lru_cache(maxsize=None)
def _leaf_fn(transpose: bool, dtype: str):
  """One leaf's HF layout, jitted on its own: the leaves run one after another, each ready to be written as
  soon as it is done, while the later ones are still being cast."""
  def layout(x):
    y = _leaf_layout(x, transpose, dtype)
    return jnp.copy(y) if y is x else y  # an unchanged leaf would otherwise be the (soon donated) input itself

  return jax.jit(layout)


@functools.lru_cache(maxsize=None)
def _leaf_into_fn(transpose: bool, dtype: str):
  """_leaf_fn into a donated buffer of the output's shape (the previous version's leaf). On XLA:CPU a fresh
  output's pages are faulted in as they are first written, which cost most of the layout's time
  (benchmarks/cpu/probe_export_layout.py); a recycled buffer's pages are mapped already."""
  def layout_into(x, out):
    return jax.lax.dynamic_update_slice(out, _leaf_layout(x, transpose, dtype), (0,) * out.ndim)

  return jax.jit(layout_into, donate_argnums=1)


def worth_recycling(layout: HfLayout) -> bool:
  """Whether to keep a published layout for the next one to be written into: on CPU devices only. A GPU's
  allocator hands freed memory back without faults, and a kept layout would hold device memory through the
  learner's steps."""
  return layout.on_device and all(isinstance(x, jax.Array) and not x.is_deleted()
                                  and all(d.platform == "cpu" for d in x.devices()) for x in layout.leaves)


def _recyclable(recycle: Optional[HfLayout], leaves: list, cfg: config_lib.ModelConfig, dtype: str):
  """recycle's leaves when they can take this layout: on CPU, the same model and dtype, made on the same
  devices, none deleted; else None."""
  if recycle is None or (recycle.cfg, recycle.dtype) != (cfg, dtype) or not worth_recycling(recycle):
    return None
  for x, old, (_, transpose) in zip(leaves, recycle.leaves, leaf_specs(cfg)):
    shape = x.shape[:-2] + (x.shape[-1], x.shape[-2]) if transpose else x.shape
    if not isinstance(x, jax.Array) or old.shape != shape or old.sharding.device_set != x.sharding.device_set:
      return None
  return recycle.leaves


def hf_layout(params: Any, cfg: config_lib.ModelConfig, dtype: Optional[str] = None,
              recycle: Optional[HfLayout] = None) -> HfLayout:
  """Dispatches the layout (transposes + cast, one jitted call per leaf) on the params' devices; returns
  without waiting for it. `recycle`: a layout no one reads any more (the previous version's, published): its
  buffers are donated and overwritten (it is deleted), where they fit and on CPU (worth_recycling)."""
  dtype = check_dtype(dtype or cfg.param_dtype)
  specs = leaf_specs(cfg)
  leaves = [hf._get(params, path) for path, _ in specs]
  if not all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
    return HfLayout(cfg, dtype, tuple(leaves), on_device=False)
  old = _recyclable(recycle, leaves, cfg, dtype)
  if old is None:
    return HfLayout(cfg, dtype, tuple(_leaf_fn(t, dtype)(x) for x, (_, t) in zip(leaves, specs)), on_device=True)
  return HfLayout(cfg, dtype, tuple(_leaf_into_fn(t, dtype)(x, o) for x, o, (_, t) in zip(leaves, old, specs)),
                  on_device=True)


def export_bytes(cfg: config_lib.ModelConfig, dtype: str) -> int:
  """The tensor bytes of one export in `dtype` (model.safetensors less its header)."""
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
  return sum(x.size for x in jax.tree.leaves(shapes)) * np.dtype(jnp.dtype(check_dtype(dtype))).itemsize


def _leaf_on_host(layout: HfLayout, j: int) -> np.ndarray:
  """Leaf j in HF layout and the export dtype as a host array: a view of its device buffer where that is host
  memory (CPU); over several processes gathered with the followers (one leaf at a time) and converted here."""
  leaf = layout.leaves[j]
  if layout.on_device:
    return np.asarray(jax.device_get(leaf))
  arr = processes.to_host(leaf)
  arr = np.swapaxes(arr, -1, -2) if leaf_specs(layout.cfg)[j][1] else arr
  return np.ascontiguousarray(arr.astype(np.dtype(jnp.dtype(layout.dtype)), copy=False))


def _host_leaves(layout: HfLayout) -> list[np.ndarray]:
  if layout.on_device:
    return [np.asarray(x) for x in jax.device_get(list(layout.leaves))]  # one transfer for all leaves
  return [_leaf_on_host(layout, j) for j in range(len(layout.leaves))]


def hf_tensors(layout: HfLayout, timings: Optional[dict] = None) -> dict[str, np.ndarray]:
  """HF tensor name -> C-contiguous host array (a stacked leaf's layer i is a view of its host copy).
  `timings` gets device_s (the layout's cast and transposes finishing) and host_copy_s (to host memory)."""
  t0 = time.perf_counter()
  if layout.on_device:
    jax.block_until_ready(layout.leaves)
  t1 = time.perf_counter()
  host = dict(zip(leaf_specs(layout.cfg), _host_leaves(layout)))
  if timings is not None:
    timings.update(device_s=t1 - t0, host_copy_s=time.perf_counter() - t1)
  out = {}
  for path, name, transpose in hf.tensor_names(layout.cfg):
    arr = host[(path, transpose)]
    stacked = layout.cfg.scan_layers and path[0] == "layers"
    out[name] = np.ascontiguousarray(arr[int(name.split(".")[2])] if stacked else arr)
  return out


@dataclasses.dataclass(frozen=True)
class _Placed:
  """One HF tensor's place in model.safetensors: the leaf it comes from (layer: its slice of a stacked leaf)."""
  name: str
  leaf: int
  layer: Optional[int]
  shape: tuple[int, ...]
  offset: int
  nbytes: int


def _file_plan(layout: HfLayout) -> tuple[bytes, int, list[_Placed]]:
  """The file's header (8-byte length + JSON), its size and every tensor's place, from shapes and the dtype
  alone: nothing waits for the layout. Tensors in hf.tensor_names order, as safetensors_file.write places them."""
  specs, itemsize = leaf_specs(layout.cfg), np.dtype(jnp.dtype(layout.dtype)).itemsize
  index = {spec: j for j, spec in enumerate(specs)}
  placed, offset = [], 0
  for path, name, transpose in hf.tensor_names(layout.cfg):
    j = index[(path, transpose)]
    shape = tuple(layout.leaves[j].shape)
    if transpose and not layout.on_device:  # the params' own leaf: transposed on the host
      shape = shape[:-2] + (shape[-1], shape[-2])
    layer = int(name.split(".")[2]) if layout.cfg.scan_layers and path[0] == "layers" else None
    shape = shape[1:] if layer is not None else shape
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    placed.append(_Placed(name, j, layer, shape, offset, nbytes))
    offset += nbytes
  header = safetensors_file.header([(p.name, p.shape, p.nbytes) for p in placed], layout.dtype)
  return header, len(header) + offset, placed


def write_layout(layout: HfLayout, path: str, reuse: Optional[str] = None, timings: Optional[dict] = None) -> None:
  """The layout as one .safetensors file, the same bytes as safetensors_file.write(hf_tensors(layout)), each
  leaf written at its tensors' offsets as soon as it is ready: the write of a leaf overlaps the cast and
  transposes of the ones still running. `timings` (the parts overlap): device_s (until the last leaf was
  ready, earlier leaves' writes included), host_copy_s (the ready leaves to host arrays, summed), write_s
  (the writes, summed)."""
  header, size, placed = _file_plan(layout)
  by_leaf: dict[int, list[_Placed]] = {}
  for p in placed:
    by_leaf.setdefault(p.leaf, []).append(p)
  waited = host_s = write_s = 0.0
  t_start = time.perf_counter()
  if layout.on_device and any(d.platform != "cpu" for x in layout.leaves for d in x.devices()):
    for x in layout.leaves:  # every transfer starts once its leaf is done, not when the writer asks for it
      x.copy_to_host_async()
  fd = safetensors_file.open_sized(path, size, reuse)
  try:
    safetensors_file.write_at(fd, header, 0)
    for j in range(len(layout.leaves)):
      t0 = time.perf_counter()
      if layout.on_device:
        layout.leaves[j].block_until_ready()
      t1 = time.perf_counter()
      arr = _leaf_on_host(layout, j)
      t2 = time.perf_counter()
      for p in by_leaf[j]:
        safetensors_file.write_at(fd, arr[p.layer] if p.layer is not None else arr, len(header) + p.offset)
      t3 = time.perf_counter()
      waited, host_s, write_s = t1 - t_start, host_s + t2 - t1, write_s + t3 - t2
  finally:
    os.close(fd)
  if timings is not None:
    timings.update(device_s=waited, host_copy_s=host_s, write_s=write_s)


def write_hf(layout: HfLayout, out_dir: str, tokenizer=None, timings: Optional[dict] = None) -> str:
  """Writes a HF directory atomically (temporary sibling directory, then rename); returns out_dir.
  `timings` gets write_layout's parts (device_s, host_copy_s, write_s: they overlap) and files_s (the rest,
  the rename). A file out_dir/REUSE_NAME (put there by the publisher: an old version's, read by no one) is
  overwritten in place."""
  out_dir = os.path.abspath(out_dir)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
  timings = {} if timings is None else timings
  try:
    write_layout(layout, os.path.join(tmp, hf._WEIGHTS_FILE), os.path.join(out_dir, REUSE_NAME), timings)
    t1 = time.perf_counter()
    eos = bos = stop = None
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
      eos, bos = getattr(tokenizer, "eos_id", None), getattr(tokenizer, "bos_id", None)
      stop = list(getattr(tokenizer, "stop_ids", ())) or eos
    # torch_dtype names the file's dtype; vcpo_compute_dtype stays the model's.
    cfg = dataclasses.replace(layout.cfg, param_dtype=layout.dtype)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_config.hf_config(cfg, bos_token_id=bos, eos_token_id=eos), f, indent=2)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
      # Every stop id, so generate() in transformers and SGLang's default stop set end where we do.
      json.dump({"bos_token_id": bos, "eos_token_id": stop, "do_sample": False}, f, indent=2)
    hf._write_tokenizer(tokenizer, tmp)
    # Readable by a server running as another user.
    for name in os.listdir(tmp):
      os.chmod(os.path.join(tmp, name), 0o644)
    os.chmod(tmp, 0o755)
    hf.replace_directory(tmp, out_dir)
    timings.update(files_s=time.perf_counter() - t1)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def export(params: Any, cfg: config_lib.ModelConfig, out_dir: str, tokenizer=None,
           dtype: Optional[str] = None) -> str:
  """hf_layout then write_hf: the params as a HF directory in `dtype` (default: cfg.param_dtype)."""
  return write_hf(hf_layout(params, cfg, dtype), out_dir, tokenizer)


export_hf = export  # the name the callers know (it lived in hf.py)
