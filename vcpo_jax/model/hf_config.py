"""Qwen2 config.json both ways: our ModelConfig as Hugging Face's config dict, and back."""
from __future__ import annotations

import json
import os
from typing import Any

from vcpo_jax.model import config as config_lib

ARCHITECTURE = "Qwen2ForCausalLM"
_TORCH_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


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
