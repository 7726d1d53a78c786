"""Hugging Face Qwen2 checkpoints in: tensor names, safetensors reading, the job's ModelConfig (hf_export writes)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid

import jax
import numpy as np
import safetensors

from vcpo_jax.model import config as config_lib
from vcpo_jax.model import hf_config
from vcpo_jax.model import transformer as model_lib


_WEIGHTS_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def _layer_names(i: int, scan: bool = False) -> list[tuple[tuple[str, ...], str, bool]]:
  """(param path, HF tensor name, transpose) for one decoder layer; under scan the path is the stacked
  leaf's (`layers/...`, layer i of its leading axis)."""
  pre = f"model.layers.{i}"
  out = []
  for proj in ("q_proj", "k_proj", "v_proj"):
    out.append((("self_attn", proj, "kernel"), f"{pre}.self_attn.{proj}.weight", True))
    out.append((("self_attn", proj, "bias"), f"{pre}.self_attn.{proj}.bias", False))
  out.append((("self_attn", "o_proj", "kernel"), f"{pre}.self_attn.o_proj.weight", True))
  for proj in ("gate_proj", "up_proj", "down_proj"):
    out.append((("mlp", proj, "kernel"), f"{pre}.mlp.{proj}.weight", True))
  out.append((("input_layernorm", "scale"), f"{pre}.input_layernorm.weight", False))
  out.append((("post_attention_layernorm", "scale"), f"{pre}.post_attention_layernorm.weight", False))
  return [(("layers" if scan else f"layers_{i}",) + path, name, t) for path, name, t in out]


def tensor_names(cfg: config_lib.ModelConfig) -> list[tuple[tuple[str, ...], str, bool]]:
  """The full mapping between our param paths and HF tensor names (per-layer HF tensors either way)."""
  names = [(("embed_tokens",), "model.embed_tokens.weight", False)]
  for i in range(cfg.num_layers):
    names += _layer_names(i, cfg.scan_layers)
  names.append((("norm", "scale"), "model.norm.weight", False))
  if not cfg.tie_word_embeddings:
    names.append((("lm_head", "kernel"), "lm_head.weight", True))
  return names


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _write_tokenizer(tokenizer, out_dir: str):
  if tokenizer is None:
    return
  if isinstance(tokenizer, (str, os.PathLike)):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
      src = os.path.join(tokenizer, name)
      if os.path.exists(src):
        shutil.copy2(src, os.path.join(out_dir, name))
  else:
    tokenizer.save(out_dir)


def replace_directory(src: str, dst: str) -> None:
  """Moves the finished directory src to dst by rename; an existing dst is swapped out first, so a reader
  sees either the old or the new directory, never a half-written one."""
  if os.path.exists(dst):
    trash = f"{dst}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dst, trash)
    os.rename(src, dst)
    shutil.rmtree(trash, ignore_errors=True)
  else:
    os.rename(src, dst)


# Fields a config section may state next to model.hf_path; they must agree with the checkpoint's config.json.
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "tie_word_embeddings")
# Fields that stay ours: sequence budget, dtypes and precision are choices of the run, not of the checkpoint.
_RUN_FIELDS = ("max_seq_len", "param_dtype", "dtype", "matmul_precision", "scan_layers", "remat", "remat_budget_gb",
               "attention", "causal_flag", "lm_head", "logits_chunk", "logits_token_tile", "head_dtype",
               "lora")


def model_config(section) -> config_lib.ModelConfig:
  """The job's ModelConfig from its `model` config section. With model.hf_path the architecture comes from
  that directory's config.json (a stated shape field that disagrees is an error); max_seq_len, dtypes and
  matmul precision always come from the section."""
  d = dict(section.to_dict() if hasattr(section, "to_dict") else section)
  path = d.pop("hf_path", "") or ""
  if not path:
    return config_lib.ModelConfig.from_dict(d)
  cfg = hf_config.config_from_hf(hf_config.read_config(path))
  for field in _SHAPE_FIELDS:
    if field in d and d[field] != getattr(cfg, field):
      raise ValueError(f"invalid config: model.{field}={d[field]!r} but {path}/config.json gives "
                       f"{getattr(cfg, field)!r} (pick the matching configs/qwen2_5.py variant)")
  return dataclasses.replace(cfg, **{k: d[k] for k in _RUN_FIELDS if k in d})


def weight_files(model_dir: str) -> dict[str, str]:
  """Tensor name -> safetensors file: model.safetensors, or the shards named by model.safetensors.index.json."""
  index = os.path.join(model_dir, _INDEX_FILE)
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
  single = os.path.join(model_dir, _WEIGHTS_FILE)
  if not os.path.isfile(single):
    raise FileNotFoundError(f"no {_WEIGHTS_FILE} or {_INDEX_FILE} in model directory {model_dir!r}")
  with safetensors.safe_open(single, "np") as f:
    return {name: single for name in f.keys()}


def _ignorable(name: str, cfg: config_lib.ModelConfig) -> bool:
  """Tensors a checkpoint may carry that are not parameters here: RoPE buffers, a tied head's copy."""
  return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def _leaf_layouts(cfg: config_lib.ModelConfig):
  """(param path, its shape, stacked under scan, one layer's shape, [(HF name, transpose)] in layer order) for
  every parameter leaf."""
  expected = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
  leaves: dict = {}
  for path, name, transpose in tensor_names(cfg):
    leaves.setdefault(path, []).append((name, transpose))
  for path, parts in leaves.items():
    want = tuple(_get(expected, path).shape)
    stacked = cfg.scan_layers and path[0] == "layers"
    yield path, want, stacked, (want[1:] if stacked else want), parts


def _check_shape(name: str, shape, layer_shape: tuple, transpose: bool) -> None:
  want_hf = layer_shape[::-1] if transpose else layer_shape
  if tuple(shape) != want_hf:
    raise ValueError(f"tensor {name!r} has shape {tuple(shape)}, expected {want_hf}")


def import_hf(model_dir: str, *, cfg: config_lib.ModelConfig | None = None, shardings=None):
  """Reads a HF Qwen2/Qwen2.5 directory; returns (params, cfg). Errors name the tensor and both shapes.

  cfg: defaults to the directory's config.json; parameters are cast to cfg.param_dtype.
  shardings: a pytree of jax Shardings like the params; then each parameter is built directly in its
  sharding, every device reading only its own slice of the tensor from disk (no whole-model host copy).
  Without it, parameters are host numpy arrays.
  """
  cfg = cfg or hf_config.config_from_hf(hf_config.read_config(model_dir))
  files = weight_files(model_dir)
  names = tensor_names(cfg)
  missing = [n for _, n, _ in names if n not in files]
  if missing:
    raise ValueError(f"missing tensor {missing[0]!r} in {model_dir} ({len(missing)} missing in all)")
  extra = sorted(set(files) - {n for _, n, _ in names} - {n for n in files if _ignorable(n, cfg)})
  if extra:
    raise ValueError(f"unexpected tensors in {model_dir}: {extra[:5]}{'...' if len(extra) > 5 else ''}")
  dtype = np.dtype(cfg.jnp_param_dtype)
  params: dict = {}
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(safetensors.safe_open(f, "np")) for f in sorted(set(files.values()))}
    for path, want, stacked, layer_shape, parts in _leaf_layouts(cfg):
      tensors = []
      for name, transpose in parts:
        tensors.append(handles[files[name]].get_slice(name))
        _check_shape(name, tensors[-1].get_shape(), layer_shape, transpose)

      def read_one(tensor, index, transpose=parts[0][1], ndim=len(layer_shape)):
        index = tuple(index) + (slice(None),) * (ndim - len(index))
        block = tensor[index[::-1] if transpose else index]
        return np.ascontiguousarray(block.T if transpose else block).astype(dtype, copy=False)

      def read(index, tensors=tensors, stacked=stacked, ndim=len(want), read_one=read_one):
        if not stacked:
          return read_one(tensors[0], index)
        index = tuple(index) + (slice(None),) * (ndim - len(index))  # [layers, *one layer's index]
        return np.stack([read_one(tensors[i], index[1:]) for i in range(len(tensors))[index[0]]])

      if shardings is None:
        _set(params, path, read(()))
      else:
        _set(params, path, jax.make_array_from_callback(want, _get(shardings, path), read))
  return params, cfg


# Public names for the weight wire (rollout/servers/wire_pack.py packs the same tensors the exporter writes).
get_path = _get
set_path = _set
WEIGHTS_FILE = _WEIGHTS_FILE


def tensors_with_layer(cfg: config_lib.ModelConfig):
  """(layer index of a stacked leaf or None, (path, HF name, transpose)) for every tensor, in export order."""
  for path, name, transpose in tensor_names(cfg):
    layer = int(name.split(".")[2]) if cfg.scan_layers and path[0] == "layers" else None
    yield layer, (path, name, transpose)


def params_from_hf_tensors(tensors: dict[str, np.ndarray], cfg: config_lib.ModelConfig) -> dict:
  """Host params from HF-named arrays (a wire update's tensors); errors name the tensor and both shapes."""
  dtype = np.dtype(cfg.jnp_param_dtype)
  params: dict = {}
  for path, _, stacked, layer_shape, parts in _leaf_layouts(cfg):
    blocks = []
    for name, transpose in parts:
      if name not in tensors:
        raise ValueError(f"missing tensor {name!r}")
      arr = np.asarray(tensors[name])
      _check_shape(name, arr.shape, layer_shape, transpose)
      blocks.append(np.ascontiguousarray(arr.T if transpose else arr).astype(dtype, copy=False))
    _set(params, path, np.stack(blocks) if stacked else blocks[0])
  return params
