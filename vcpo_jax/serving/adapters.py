"""The embedded server's LoRA adapters: names -> slots of a fixed-size stack, PEFT checked as SGLang checks it.

SGLang 0.5.23's endpoints and refusals: `/load_lora_adapter` {lora_name, lora_path} refuses a loaded name, a
rank above --max-lora-rank, targets outside --lora-target-modules and, with --lora-strict-loading, missing or
unexpected tensors; `/unload_lora_adapter` {lora_name} waits for the requests holding the adapter while it
holds the update lock (a pending unload blocks the next load); `/generate` with `lora_path` (the name)
holds the adapter to the end. Answers: {"success", "error_message", "loaded_adapters": {name: path}}, 400
on failure. Deliberate difference: a name that is not loaded is a 400 in /generate (SGLang silently reloads
a once-loaded disk adapter from its path).

The seam to the engine (model work of its own): `engine.set_adapter_slot(i, tree_or_None)` puts an adapter
into slot i of the stack (None empties it), and a row's `adapter_slot` (-1: the base) picks its slot. Every
tree has the stack's layout (model/lora.py): each launch target, rank --max-lora-rank, B pre-scaled by the
adapter's alpha / r, so that the stack applies x A B with scale 1 (a lower rank is zero-padded; a target the
adapter lacks is zeros: both exact).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import re
from typing import Any, Callable, Optional

import numpy as np

PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
log = logging.getLogger(__name__)
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(lora_A|lora_B)\.weight")


class AdapterError(ValueError):
  """A refused load, unload or request (SGLang's message)."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """The server's launch flags: --max-lora-rank, --lora-target-modules, --max-loras-per-batch (the stack's
  slots), --lora-strict-loading."""
  max_rank: int
  targets: tuple[str, ...]
  num_slots: int
  strict: bool = True

  def __post_init__(self):
    bad = [t for t in self.targets if t not in PARENT]
    if bad or not self.targets:
      raise ValueError(f"--lora-target-modules {list(self.targets)}: each must be one of {list(PARENT)}")
    if self.max_rank < 1 or self.num_slots < 1:
      raise ValueError(f"--max-lora-rank ({self.max_rank}) and --max-loras-per-batch ({self.num_slots}) must be >= 1")


def module_dims(cfg) -> dict[str, tuple[int, int]]:
  """Linear layer -> (in, out) features of the served model."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, f),
          "up_proj": (d, f), "down_proj": (f, d)}


def read_peft(path: str) -> tuple[dict, dict]:
  """adapter_config.json and adapter_model.safetensors of a PEFT directory."""
  from safetensors.numpy import load_file
  with open(os.path.join(path, "adapter_config.json")) as f:
    config = json.load(f)
  return config, load_file(os.path.join(path, "adapter_model.safetensors"))


def _targets(config: dict, name: str) -> list[str]:
  targets = config.get("target_modules")
  if isinstance(targets, str):
    targets = list(PARENT) if targets in ("all-linear", "all") else [targets]
  if not isinstance(targets, list) or not targets:
    raise AdapterError(f"Failed to load LoRA adapter {name}: adapter_config.json has no target_modules")
  return targets


def check(config: dict, tensors: dict, cfg, s: Settings, name: str) -> None:
  """SGLang's refusals of a new adapter (its words where it has them)."""
  if config.get("peft_type", "LORA") != "LORA":
    raise AdapterError(f"Failed to load LoRA adapter {name}: peft_type {config.get('peft_type')!r} is not LORA")
  if config.get("use_dora"):
    raise AdapterError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
  r, targets = config.get("r"), _targets(config, name)
  if isinstance(r, bool) or not isinstance(r, int) or r < 1 or r > s.max_rank or not set(targets) <= set(s.targets):
    raise AdapterError(
        f"LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory pool configuration. "
        "Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the "
        "target modules are included in `--lora-target-modules`.")
  dims = module_dims(cfg)
  want = {}
  for i in range(cfg.num_layers):
    for m in targets:
      prefix = f"base_model.model.model.layers.{i}.{PARENT[m]}.{m}"
      want[f"{prefix}.lora_A.weight"] = (r, dims[m][0])
      want[f"{prefix}.lora_B.weight"] = (dims[m][1], r)
  missing = sorted(set(want) - set(tensors))
  extra = sorted(set(tensors) - set(want))
  wrong = sorted(k for k in set(want) & set(tensors) if tuple(tensors[k].shape) != want[k])
  if wrong:
    k = wrong[0]
    raise AdapterError(f"Failed to load LoRA adapter {name}: {k} has shape {tuple(tensors[k].shape)}, the model "
                       f"needs {want[k]}")
  if s.strict and (missing or extra):
    raise AdapterError(f"Failed to load LoRA adapter {name} (--lora-strict-loading): missing {missing[:3]}"
                       f"{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")


def to_tree(config: dict, tensors: dict, cfg, s: Settings) -> dict:
  """The stack's layout (model/lora.py): A [I, R] and B [R, O] per layer and launch target, at rank
  s.max_rank (zero-padded), B times alpha / r; zeros for targets the adapter lacks. Under scan_layers one
  "layers" subtree with the layers axis first."""
  r, scale = config["r"], float(config.get("lora_alpha", config["r"])) / config["r"]
  dims, out = module_dims(cfg), {}
  for i in range(cfg.num_layers):
    layer = out.setdefault(f"layers_{i}", {})
    for m in s.targets:
      a = np.zeros((dims[m][0], s.max_rank), np.float32)
      b = np.zeros((s.max_rank, dims[m][1]), np.float32)
      prefix = f"base_model.model.model.layers.{i}.{PARENT[m]}.{m}"
      if f"{prefix}.lora_A.weight" in tensors:
        a[:, :r] = np.asarray(tensors[f"{prefix}.lora_A.weight"], np.float32).T
        b[:r, :] = scale * np.asarray(tensors[f"{prefix}.lora_B.weight"], np.float32).T
      layer.setdefault(PARENT[m], {})[m] = {"lora_A": a, "lora_B": b}
  if getattr(cfg, "scan_layers", False):
    layers = [out[f"layers_{i}"] for i in range(cfg.num_layers)]
    import jax
    return {"layers": jax.tree.map(lambda *xs: np.stack(xs), *layers)}
  return out


class Registry:
  """Adapters by name, each in a slot of the engine's stack, with the requests in flight that hold it."""

  def __init__(self, settings: Settings, model_cfg, set_slot: Callable[[int, Optional[dict]], None]):
    self.settings, self.cfg, self._set_slot = settings, model_cfg, set_slot
    self.slots: list[Optional[str]] = [None] * settings.num_slots
    self.paths: dict[str, str] = {}
    self.refs: collections.Counter = collections.Counter()
    self.unloading: set[str] = set()
    self.ever: set[str] = set()
    self._lock = asyncio.Lock()  # loads and unloads one at a time: a pending unload blocks the next load
    self._released = asyncio.Condition()

  def loaded(self) -> dict[str, str]:
    return {n: self.paths[n] for n in self.slots if n is not None}

  async def load(self, name: str, path: str, read: Callable[[], tuple[dict, dict]]) -> dict[str, str]:
    """Reads (read() -> config, tensors), checks and puts the adapter in a free slot."""
    async with self._lock:
      if name in self.paths:
        raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
      try:
        config, tensors = await asyncio.to_thread(read)
      except Exception as e:  # noqa: BLE001 -- any unreadable adapter is the request's fault
        raise AdapterError(f"Failed to load LoRA adapter {name} from {path}: {e}") from None
      check(config, tensors, self.cfg, self.settings, name)
      if None not in self.slots:
        raise AdapterError(f"Failed to load LoRA adapter {name}: all {self.settings.num_slots} slots "
                           f"(--max-loras-per-batch) hold adapters {self.slots}; unload one first")
      slot = self.slots.index(None)
      tree = await asyncio.to_thread(to_tree, config, tensors, self.cfg, self.settings)
      await asyncio.to_thread(self._set_slot, slot, tree)
      self.slots[slot], self.paths[name] = name, path
      self.ever.add(name)
      log.info("LoRA adapter %s loaded into slot %d (from %s)", name, slot, path)
      return self.loaded()

  async def unload(self, name: str) -> dict[str, str]:
    """Stops new requests from naming it, waits for those holding it, then empties its slot."""
    async with self._lock:
      if name not in self.paths:
        raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loaded())}")
      self.unloading.add(name)
      try:
        async with self._released:
          await self._released.wait_for(lambda: self.refs[name] == 0)
        slot = self.slots.index(name)
        await asyncio.to_thread(self._set_slot, slot, None)
        self.slots[slot] = None
        del self.paths[name]
        log.info("LoRA adapter %s unloaded from slot %d", name, slot)
      finally:
        self.unloading.discard(name)
      return self.loaded()

  def acquire(self, name: Optional[str]) -> int:
    """The slot of `name` (-1: the base), held until release(name)."""
    if name is None:
      return -1
    if name not in self.paths or name in self.unloading:
      if name not in self.ever:
        raise AdapterError(f"Got LoRA adapter that has never been loaded: {name}\n"
                           f"All loaded adapters: {list(self.loaded())}.")
      raise AdapterError(f"The following requested LoRA adapters are not loaded: {name}\n"
                         f"Loaded adapters: {list(self.loaded())}.")
    self.refs[name] += 1
    return self.slots.index(name)

  async def release(self, name: Optional[str]) -> None:
    if name is None:
      return
    self.refs[name] -= 1
    async with self._released:
      self._released.notify_all()


def server_info(settings: Optional[Settings]) -> dict[str, Any]:
  """The LoRA fields of /get_server_info (SGLang's names)."""
  if settings is None:
    return {"enable_lora": False}
  return {"enable_lora": True, "max_lora_rank": settings.max_rank, "lora_target_modules": list(settings.targets),
          "max_loras_per_batch": settings.num_slots, "lora_strict_loading": settings.strict}
