"""What a served model's shapes are (config.json + safetensors headers), to refuse a mismatched update."""
from __future__ import annotations

import glob
import json
import os
import struct
from typing import Optional

# config.json fields that decide tensor shapes or how SGLang reads them.
SHAPE_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "tie_word_embeddings")


def safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
  """Tensor name -> shape from one .safetensors file's header (8-byte length, then JSON); no data read."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def read_spec(model_dir: str) -> dict:
  """{"config": {shape keys}, "tensors": {name: shape}} of a Hugging Face directory."""
  with open(os.path.join(model_dir, "config.json")) as f:
    cfg = json.load(f)
  files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {model_dir}")
  tensors: dict[str, tuple[int, ...]] = {}
  for path in files:
    tensors.update(safetensors_shapes(path))
  return {"config": {k: cfg.get(k) for k in SHAPE_KEYS}, "tensors": tensors}


def info_mismatch(info: dict, reference: dict) -> Optional[str]:
  """A sentence naming the first shape field a server's /get_model_info reports that differs from reference's.

  Only fields the server reports are compared (real SGLang reports few; the embedded server, vocab_size).
  """
  for key in SHAPE_KEYS:
    if key in info and info[key] is not None and info[key] != reference["config"].get(key):
      return f"it serves {key}={info[key]!r}, the starting weights have {reference['config'].get(key)!r}"
  return None


def spec_mismatch(new: dict, served: dict, other: str = "the served model has") -> Optional[str]:
  """A sentence naming the first difference between two specs (both values), or None when they match."""
  for key in SHAPE_KEYS:
    if new["config"].get(key) != served["config"].get(key):
      return f"config.json {key}={new['config'].get(key)!r}, {other} {served['config'].get(key)!r}"
  missing = sorted(set(served["tensors"]) - set(new["tensors"]))
  extra = sorted(set(new["tensors"]) - set(served["tensors"]))
  if missing or extra:
    return f"tensors missing {missing[:3]} / unexpected {extra[:3]} compared with {other.rsplit(' ', 1)[0]}"
  for name, shape in new["tensors"].items():
    if tuple(shape) != tuple(served["tensors"][name]):
      return f"tensor {name} has shape {list(shape)}, {other} {list(served['tensors'][name])}"
  return None


def manifest_mismatch(tensors, reference: dict) -> Optional[str]:
  """The first difference between what a transport would send (items with .name and .shape, e.g.
  wire_pack.WireTensor) and the served checkpoint's tensors, or None."""
  served = reference["tensors"]
  names = {t.name for t in tensors}
  missing, extra = sorted(set(served) - names), sorted(names - set(served))
  if missing or extra:
    return f"tensors missing {missing[:3]} / unexpected {extra[:3]} compared with the served checkpoint"
  for t in tensors:
    if tuple(t.shape) != tuple(served[t.name]):
      return f"tensor {t.name} has shape {list(t.shape)}, the served checkpoint has {list(served[t.name])}"
  return None
