"""Adapters as standard PEFT LoRA directories (adapter_config.json + adapter_model.safetensors), both ways."""
from __future__ import annotations

import json
import os
import struct
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from vcpo_jax.model import lora, safetensors_file
from vcpo_jax.model.config import LINEAR_MODULES, LoraConfig, ModelConfig
from vcpo_jax.parallel import processes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_BY_CODE = {safetensors_file.DTYPE_NAMES[name]: dtype for name, dtype in _DTYPES.items()}
# PEFT's config fields whose non-default values change the adapter's meaning: refused on reading.
_MUST_BE = {"bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
            "layers_to_transform": None, "modules_to_save": None}


def tensor_name(layer: int, module: str, kind: str) -> str:
  """PEFT's saved name, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
  return f"base_model.model.model.layers.{layer}.{lora._PARENT[module]}.{module}.{kind}.weight"


def _leaf(adapter, cfg: ModelConfig, layer: int, module: str, kind: str):
  key = "layers" if cfg.scan_layers else f"layers_{layer}"
  x = adapter[key][lora._PARENT[module]][module][kind]
  return x[layer] if cfg.scan_layers else x


def write_adapter(adapter, model_cfg: ModelConfig, lora_cfg: LoraConfig | None, out_dir: str,
                  dtype: str = "bfloat16", base_model: str = "") -> str:
  """Writes `adapter` as a PEFT LoRA directory: lora_A.weight [r, in], lora_B.weight [out, r] per targeted
  layer (torch's [out, in] layout), r = rank, lora_alpha = alpha. base_model: the base's path or hub name
  (adapter_config.json's base_model_name_or_path). Returns out_dir."""
  config, tensors = to_peft(adapter, model_cfg, lora_cfg, dtype, base_model)
  os.makedirs(out_dir, exist_ok=True)
  _atomic_write(os.path.join(out_dir, WEIGHTS_FILE), _safetensors_bytes(tensors, dtype))
  _atomic_write(os.path.join(out_dir, CONFIG_FILE), json.dumps(config, indent=2).encode())
  return out_dir


def host_copy(adapter):
  """The adapter's leaves as host numpy arrays, each gathered over the processes that hold its shards."""
  return jax.tree.map(processes.to_host, adapter)


def to_peft(adapter, model_cfg: ModelConfig, lora_cfg: LoraConfig | None = None, dtype: str = "float32",
            base_model: str = "") -> tuple[dict, dict]:
  """(adapter_config.json's dict, {PEFT tensor name: numpy array}) of `adapter`: what write_adapter writes,
  and what the job publishes to servers (rollout/servers/lora.py)."""
  lora_cfg = model_cfg.lora if lora_cfg is None else lora_cfg
  if dtype not in _DTYPES:
    raise ValueError(f"write_adapter: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
  np_dtype = _DTYPES[dtype]
  host = jax.device_get(adapter)
  tensors = {}
  for i in range(model_cfg.num_layers):
    for module in lora_cfg.target_modules:
      for kind in ("lora_A", "lora_B"):
        x = np.asarray(jnp.asarray(_leaf(host, model_cfg, i, module, kind)).astype(jnp.dtype(np_dtype)))
        tensors[tensor_name(i, module, kind)] = np.ascontiguousarray(x.T)  # ours [in, r] / [r, out]
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
            "target_modules": list(lora_cfg.target_modules), "lora_dropout": 0.0, "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
            "inference_mode": True, "base_model_name_or_path": base_model or None}
  return config, tensors


def _safetensors_bytes(tensors: dict, dtype: str) -> bytes:
  head = safetensors_file.header([(name, x.shape, x.nbytes) for name, x in tensors.items()], dtype)
  return head + b"".join(x.tobytes() for x in tensors.values())


def _atomic_write(path: str, data: bytes):
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
  with os.fdopen(fd, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def _read_safetensors(path: str) -> dict:
  with open(path, "rb") as f:
    data = f.read()
  (n,) = struct.unpack("<Q", data[:8])
  header = json.loads(data[8:8 + n])
  out = {}
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    if meta["dtype"] not in _BY_CODE:
      raise ValueError(f"{path}: tensor {name} has dtype {meta['dtype']}, not one of {sorted(_BY_CODE)}")
    start, end = meta["data_offsets"]
    out[name] = np.frombuffer(data[8 + n + start:8 + n + end], _BY_CODE[meta["dtype"]]).reshape(meta["shape"])
  return out


def _read_config(adapter_dir: str, model_cfg: ModelConfig) -> LoraConfig:
  path = os.path.join(adapter_dir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ValueError(f"{adapter_dir} is not a PEFT adapter directory: no {CONFIG_FILE}")
  with open(path) as f:
    c = json.load(f)
  if c.get("peft_type") != "LORA":
    raise ValueError(f"{path}: peft_type {c.get('peft_type')!r} is not 'LORA'")
  for key, want in _MUST_BE.items():
    if c.get(key, want) != want:
      raise ValueError(f"{path}: {key}={c[key]!r} is not supported (must be {want!r})")
  for key in ("rank_pattern", "alpha_pattern"):
    if c.get(key):
      raise ValueError(f"{path}: {key}={c[key]!r} is not supported (one rank and alpha for all layers)")
  targets = c.get("target_modules")
  if isinstance(targets, str) or not isinstance(targets, list):
    raise ValueError(f"{path}: target_modules={targets!r} must be a list of {list(LINEAR_MODULES)}")
  try:  # LINEAR_MODULES' order; LoraConfig names the field and value that do not fit
    cfg = LoraConfig(rank=c.get("r"), alpha=c.get("lora_alpha"),
                     target_modules=tuple(m for m in LINEAR_MODULES if m in targets) + tuple(
                         m for m in targets if m not in LINEAR_MODULES))
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
  if not cfg.rank:
    raise ValueError(f"{path}: r=0 is not an adapter")
  limit = model_cfg.lora
  if limit.rank and cfg.rank > limit.rank:
    raise ValueError(f"{path}: r={cfg.rank} is above this model's model.lora.rank={limit.rank}")
  if limit.rank and not set(cfg.target_modules) <= set(limit.target_modules):
    raise ValueError(f"{path}: target_modules {sorted(set(cfg.target_modules) - set(limit.target_modules))} "
                     f"are not in this model's model.lora.target_modules {list(limit.target_modules)}")
  return cfg


def read_adapter(adapter_dir: str, model_cfg: ModelConfig):
  """(adapter, lora_cfg) from a PEFT LoRA directory, in model_cfg's layout and param dtype. Refuses, with a
  one-line error, a directory that is not a plain LoRA adapter of this model: another PEFT type or an option
  that changes its meaning (rsLoRA, DoRA, bias, per-layer ranks), a rank above model.lora.rank or a target
  outside model.lora.target_modules (when set), a missing, extra or misshapen tensor."""
  cfg = _read_config(adapter_dir, model_cfg)
  tensors = _read_safetensors(os.path.join(adapter_dir, WEIGHTS_FILE))
  dims = lora.module_dims(model_cfg)
  want = {}
  for i in range(model_cfg.num_layers):
    for module in cfg.target_modules:
      fan_in, fan_out, _ = dims[module]
      want[tensor_name(i, module, "lora_A")] = (cfg.rank, fan_in)
      want[tensor_name(i, module, "lora_B")] = (fan_out, cfg.rank)
  extra, missing = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
  if extra or missing:
    more = lambda names: "..." if len(names) > 3 else ""  # noqa: E731
    raise ValueError(f"{adapter_dir}: tensors do not fit this model (missing {missing[:3]}{more(missing)}, "
                     f"unexpected {extra[:3]}{more(extra)})")
  for name, shape in want.items():
    if tuple(tensors[name].shape) != shape:
      raise ValueError(f"{adapter_dir}: {name} has shape {list(tensors[name].shape)}, this model needs "
                       f"{list(shape)}")
  dtype = model_cfg.jnp_param_dtype

  def leaf(key, module, kind, shape, axes):
    layers = range(model_cfg.num_layers) if key == "layers" else [int(key.split("_")[1])]
    xs = [jnp.asarray(tensors[tensor_name(i, module, kind)].T, dtype) for i in layers]
    return jnp.stack(xs) if key == "layers" else xs[0]
  return lora._build(model_cfg, cfg, leaf), cfg
