"""Hugging Face Qwen2 checkpoint export/import: config.json + model.safetensors + tokenizer files."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from typing import Any

import jax
import numpy as np
import safetensors.numpy

from vcpo_jax import model as model_lib

ARCHITECTURE = "Qwen2ForCausalLM"
_WEIGHTS_FILE = "model.safetensors"
_TORCH_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _layer_names(i: int) -> list[tuple[tuple[str, ...], str, bool]]:
  """(param path, HF tensor name, transpose) for one decoder layer."""
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
  return [((f"layers_{i}",) + path, name, t) for path, name, t in out]


def tensor_names(cfg: model_lib.ModelConfig) -> list[tuple[tuple[str, ...], str, bool]]:
  """The full mapping between our param paths and HF tensor names."""
  names = [(("embed_tokens",), "model.embed_tokens.weight", False)]
  for i in range(cfg.num_layers):
    names += _layer_names(i)
  names.append((("norm", "scale"), "model.norm.weight", False))
  if not cfg.tie_word_embeddings:
    names.append((("lm_head", "kernel"), "lm_head.weight", True))
  return names


def hf_config(cfg: model_lib.ModelConfig, *, bos_token_id=None, eos_token_id=None) -> dict[str, Any]:
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
      "vcpo_matmul_precision": cfg.matmul_precision,
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


def export_hf(params, cfg: model_lib.ModelConfig, out_dir: str, tokenizer=None) -> str:
  """Writes a HF directory atomically (temporary sibling directory, then rename); returns out_dir."""
  out_dir = os.path.abspath(out_dir)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
  try:
    params = jax.device_get(params)
    tensors = {}
    for path, name, transpose in tensor_names(cfg):
      arr = np.asarray(_get(params, path))
      tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
    safetensors.numpy.save_file(tensors, os.path.join(tmp, _WEIGHTS_FILE), metadata={"format": "pt"})
    eos = bos = stop = None
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
      eos, bos = getattr(tokenizer, "eos_id", None), getattr(tokenizer, "bos_id", None)
      stop = list(getattr(tokenizer, "stop_ids", ())) or eos
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_config(cfg, bos_token_id=bos, eos_token_id=eos), f, indent=2)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
      # Every stop id, so generate() in transformers and SGLang's default stop set end where we do.
      json.dump({"bos_token_id": bos, "eos_token_id": stop, "do_sample": False}, f, indent=2)
    _write_tokenizer(tokenizer, tmp)
    # Readable by a server running as another user (safetensors writes its file 0600).
    for name in os.listdir(tmp):
      os.chmod(os.path.join(tmp, name), 0o644)
    os.chmod(tmp, 0o755)
    replace_directory(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def config_from_hf(d: dict[str, Any], *, max_seq_len: int | None = None) -> model_lib.ModelConfig:
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
  return model_lib.ModelConfig(
      vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
      num_layers=d["num_hidden_layers"], num_heads=heads,
      num_kv_heads=d.get("num_key_value_heads", heads),
      head_dim=d.get("head_dim") or d["hidden_size"] // heads, rope_theta=float(rope_theta),
      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
      max_seq_len=max_seq_len or d.get("max_position_embeddings", 2048),
      param_dtype=dtype, dtype=d.get("vcpo_compute_dtype", dtype),
      matmul_precision=d.get("vcpo_matmul_precision", "highest"))


def import_hf(model_dir: str):
  """Reads a HF Qwen2 directory; returns (params, cfg). Errors name the tensor and both shapes."""
  cfg_path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
  with open(cfg_path) as f:
    cfg = config_from_hf(json.load(f))
  weights = os.path.join(model_dir, _WEIGHTS_FILE)
  if not os.path.isfile(weights):
    raise FileNotFoundError(f"no {_WEIGHTS_FILE} in model directory {model_dir!r}")
  tensors = safetensors.numpy.load_file(weights)
  expected = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))
  params: dict = {}
  used = set()
  for path, name, transpose in tensor_names(cfg):
    want = tuple(_get(expected, path).shape)
    want_hf = want[::-1] if transpose else want
    if name not in tensors:
      raise ValueError(f"missing tensor {name!r} (expected shape {want_hf}) in {weights}")
    arr = tensors[name]
    if tuple(arr.shape) != want_hf:
      raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {want_hf}")
    used.add(name)
    _set(params, path, np.ascontiguousarray(arr.T) if transpose else arr)
  extra = sorted(set(tensors) - used)
  if extra:
    raise ValueError(f"unexpected tensors in {weights}: {extra[:5]}{'...' if len(extra) > 5 else ''}")
  return params, cfg
