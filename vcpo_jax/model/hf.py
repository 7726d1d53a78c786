"""Hugging Face Qwen2 checkpoint export/import: config.json + model.safetensors + tokenizer files."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from typing import Any

import jax
import numpy as np
import safetensors

from vcpo_jax.model import config as config_lib
from vcpo_jax.model import transformer as model_lib


ARCHITECTURE = "Qwen2ForCausalLM"
_WEIGHTS_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_TORCH_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


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


def hf_config(cfg: config_lib.ModelConfig, *, bos_token_id=None, eos_token_id=None) -> dict[str, Any]:
  if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
    raise ValueError(f"Qwen2 requires head_dim * num_heads == hidden_size; got model.head_dim={cfg.head_dim}, "
                     f"model.num_heads={cfg.num_heads}, model.hidden_size={cfg.hidden_size}")
  return {
      "architectures": [ARCHITECTURE],
      "model_type": "qwen2",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "rope_scaling": None,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "use_sliding_window": False,
      "sliding_window": None,
      "max_window_layers": cfg.num_layers,
      "attention_dropout": 0.0,
      "initializer_range": 0.02,
      "use_cache": True,
      "bos_token_id": bos_token_id,
      "eos_token_id": eos_token_id,
      "torch_dtype": _TORCH_DTYPE[cfg.param_dtype],
      "dtype": _TORCH_DTYPE[cfg.param_dtype],
      # Ours, ignored by transformers/SGLang: the compute dtype to use when re-imported.
      "vcpo_compute_dtype": cfg.dtype,
      "vcpo_head_dtype": cfg.head_dtype,
      "vcpo_matmul_precision": cfg.matmul_precision,
      "vcpo_scan_layers": cfg.scan_layers,
      "vcpo_remat": cfg.remat,
      "vcpo_attention": cfg.attention,
      "vcpo_causal_flag": cfg.causal_flag,
      "vcpo_logits_chunk": cfg.logits_chunk,
      "vcpo_lm_head": cfg.lm_head,
      "vcpo_logits_token_tile": cfg.logits_token_tile,
  }


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


def config_from_hf(d: dict[str, Any], *, max_seq_len: int | None = None) -> config_lib.ModelConfig:
  archs = d.get("architectures")
  if archs != [ARCHITECTURE]:
    raise ValueError(f"config.json architectures={archs!r}; only {[ARCHITECTURE]} is supported")
  if d.get("use_sliding_window"):
    raise ValueError("config.json use_sliding_window=true is not supported")
  heads = d["num_attention_heads"]
  dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
  if dtype not in _TORCH_DTYPE:
    raise ValueError(f"config.json torch_dtype={dtype!r}; supported: {sorted(_TORCH_DTYPE)}")
  rope_theta = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
  return config_lib.ModelConfig(
      vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
      num_layers=d["num_hidden_layers"], num_heads=heads,
      num_kv_heads=d.get("num_key_value_heads", heads),
      head_dim=d.get("head_dim") or d["hidden_size"] // heads, rope_theta=float(rope_theta),
      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
      max_seq_len=max_seq_len or d.get("max_position_embeddings", 2048),
      param_dtype=dtype, dtype=d.get("vcpo_compute_dtype", dtype),
      matmul_precision=d.get("vcpo_matmul_precision", "highest"),
      scan_layers=bool(d.get("vcpo_scan_layers", False)), remat=d.get("vcpo_remat", "none"),
      attention=d.get("vcpo_attention", "auto"), logits_chunk=int(d.get("vcpo_logits_chunk", 2048)),
      causal_flag=bool(d.get("vcpo_causal_flag", config_lib.ModelConfig.causal_flag)),
      lm_head=d.get("vcpo_lm_head", config_lib.ModelConfig.lm_head),
      logits_token_tile=int(d.get("vcpo_logits_token_tile", config_lib.ModelConfig.logits_token_tile)),
      head_dtype=d.get("vcpo_head_dtype", ""))


def read_config(model_dir: str) -> dict[str, Any]:
  path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
  with open(path) as f:
    return json.load(f)


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
  cfg = config_from_hf(read_config(path))
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


def import_hf(model_dir: str, *, cfg: config_lib.ModelConfig | None = None, shardings=None):
  """Reads a HF Qwen2/Qwen2.5 directory; returns (params, cfg). Errors name the tensor and both shapes.

  cfg: defaults to the directory's config.json; parameters are cast to cfg.param_dtype.
  shardings: a pytree of jax Shardings like the params; then each parameter is built directly in its
  sharding, every device reading only its own slice of the tensor from disk (no whole-model host copy).
  Without it, parameters are host numpy arrays.
  """
  cfg = cfg or config_from_hf(read_config(model_dir))
  files = weight_files(model_dir)
  expected = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
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
    leaves: dict = {}  # param path -> [(HF name, transpose)], in layer order for a stacked leaf
    for path, name, transpose in names:
      leaves.setdefault(path, []).append((name, transpose))
    for path, parts in leaves.items():
      want = tuple(_get(expected, path).shape)
      stacked = cfg.scan_layers and path[0] == "layers"
      layer_shape = want[1:] if stacked else want
      tensors = []
      for name, transpose in parts:
        want_hf = layer_shape[::-1] if transpose else layer_shape
        tensors.append(handles[files[name]].get_slice(name))
        if tuple(tensors[-1].get_shape()) != want_hf:
          raise ValueError(f"tensor {name!r} has shape {tuple(tensors[-1].get_shape())}, expected {want_hf}")

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
  expected = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
  dtype = np.dtype(cfg.jnp_param_dtype)
  leaves: dict = {}
  for path, name, transpose in tensor_names(cfg):
    leaves.setdefault(path, []).append((name, transpose))
  params: dict = {}
  for path, parts in leaves.items():
    want = tuple(_get(expected, path).shape)
    stacked = cfg.scan_layers and path[0] == "layers"
    layer_shape = want[1:] if stacked else want
    blocks = []
    for name, transpose in parts:
      if name not in tensors:
        raise ValueError(f"missing tensor {name!r}")
      arr = np.asarray(tensors[name])
      want_hf = layer_shape[::-1] if transpose else layer_shape
      if tuple(arr.shape) != want_hf:
        raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {want_hf}")
      blocks.append(np.ascontiguousarray(arr.T if transpose else arr).astype(dtype, copy=False))
    _set(params, path, np.stack(blocks) if stacked else blocks[0])
  return params
