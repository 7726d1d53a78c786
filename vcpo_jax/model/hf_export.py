"""Fast HF export: the HF-layout tensors in the export dtype made on device in one jitted call, then one file write."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import struct
import tempfile
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax.model import config as config_lib
from vcpo_jax.model import hf, hf_config
from vcpo_jax.model import transformer as model_lib
from vcpo_jax.parallel import processes

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
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


@functools.lru_cache(maxsize=None)
def _layout_fn(cfg: config_lib.ModelConfig, dtype: str):
  specs, out_dtype = leaf_specs(cfg), jnp.dtype(dtype)

  def layout(params):
    out = []
    for path, transpose in specs:
      x = hf._get(params, path)
      y = jnp.swapaxes(x, -1, -2) if transpose else x  # HF's [out, in]; a stacked leaf keeps its layer axis
      # copy: an unchanged leaf would otherwise come back as the (soon donated) input buffer itself
      out.append(jnp.copy(y.astype(out_dtype)) if y is x and x.dtype == out_dtype else y.astype(out_dtype))
    return out

  return jax.jit(layout)


def hf_layout(params: Any, cfg: config_lib.ModelConfig, dtype: Optional[str] = None) -> HfLayout:
  """Dispatches the layout (transposes + cast) on the params' devices; returns without waiting for it."""
  dtype = check_dtype(dtype or cfg.param_dtype)
  leaves = [hf._get(params, path) for path, _ in leaf_specs(cfg)]
  if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
    return HfLayout(cfg, dtype, tuple(_layout_fn(cfg, dtype)(params)), on_device=True)
  return HfLayout(cfg, dtype, tuple(leaves), on_device=False)


def export_bytes(cfg: config_lib.ModelConfig, dtype: str) -> int:
  """The tensor bytes of one export in `dtype` (model.safetensors less its header)."""
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
  return sum(x.size for x in jax.tree.leaves(shapes)) * np.dtype(jnp.dtype(check_dtype(dtype))).itemsize


def _host_leaves(layout: HfLayout) -> list[np.ndarray]:
  if layout.on_device:
    return [np.asarray(x) for x in jax.device_get(list(layout.leaves))]  # one transfer for all leaves
  out, dtype = [], np.dtype(jnp.dtype(layout.dtype))
  for (path, transpose), leaf in zip(leaf_specs(layout.cfg), layout.leaves):
    arr = processes.to_host(leaf)  # gathered with the followers, one leaf at a time
    arr = np.swapaxes(arr, -1, -2) if transpose else arr
    out.append(np.ascontiguousarray(arr.astype(dtype, copy=False)))
  return out


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


def write_safetensors(tensors: dict[str, np.ndarray], path: str, dtype: str, reuse: Optional[str] = None) -> None:
  """One .safetensors file (8-byte header length, JSON header, raw little-endian data), sized up front and
  written from the arrays' own buffers, one unbuffered write each: no serialized copy of the model. `reuse`:
  a file of exactly that size is renamed to `path` and overwritten in place (its memory stays allocated)."""
  header, offset = {}, 0
  for name, arr in tensors.items():
    header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  header["__metadata__"] = {"format": "pt"}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  size = 8 + len(blob) + offset
  if reuse is not None and os.path.isfile(reuse) and os.path.getsize(reuse) == size:
    os.replace(reuse, path)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    os.ftruncate(fd, size)
    _write_all(fd, memoryview(struct.pack("<Q", len(blob)) + blob))
    for arr in tensors.values():
      _write_all(fd, memoryview(arr.reshape(-1).view(np.uint8)))
  finally:
    os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
  while len(data):  # a write may take fewer bytes than given (Linux: at most ~2 GiB per call)
    data = data[os.write(fd, data):]


def write_hf(layout: HfLayout, out_dir: str, tokenizer=None, timings: Optional[dict] = None) -> str:
  """Writes a HF directory atomically (temporary sibling directory, then rename); returns out_dir.
  `timings` gets hf_tensors' parts and write_s (model.safetensors), files_s (the rest, the rename). A file
  out_dir/REUSE_NAME (put there by the publisher: an old version's, read by no one) is overwritten in place."""
  out_dir = os.path.abspath(out_dir)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
  timings = {} if timings is None else timings
  try:
    tensors = hf_tensors(layout, timings)
    t0 = time.perf_counter()
    write_safetensors(tensors, os.path.join(tmp, hf._WEIGHTS_FILE), layout.dtype,
                      reuse=os.path.join(out_dir, REUSE_NAME))
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
    timings.update(write_s=t1 - t0, files_s=time.perf_counter() - t1)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def export(params: Any, cfg: config_lib.ModelConfig, out_dir: str, tokenizer=None,
           dtype: Optional[str] = None) -> str:
  """hf_layout then write_hf: the params as a HF directory in `dtype` (default: cfg.param_dtype)."""
  return write_hf(hf_layout(params, cfg, dtype), out_dir, tokenizer)


export_hf = export  # the name the callers know (it lived in hf.py)
