"""The fake server's LoRA endpoints (fake_sglang.py --enable-lora): SGLang's shapes and refusals, faults on demand.

POST /fake/lora {"mode": m, "count": c} makes the next c loads: "hang" (never answer; nothing lands),
"refuse" (a 400 with success false) or "land_then_hang" (the adapter lands, the answer never comes).
GET /fake/lora/stats: loaded names, the most ever loaded at once, requests per adapter, unloads that came
while a request still named the adapter, and the event log.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os

LORA_MODES = ("good", "hang", "refuse", "land_then_hang")


class FakeLora:
  """Adapters by name with in-flight counts; an unload waits for the requests holding it (as SGLang's)."""

  def __init__(self, max_lora_rank: int, target_modules: list[str], max_loras_per_batch: int = 8):
    self.max_lora_rank, self.target_modules = max_lora_rank, list(target_modules)
    self.max_loras_per_batch = max_loras_per_batch
    self.loaded: dict[str, str] = {}
    self.in_flight = collections.Counter()
    self.requests = collections.Counter()
    self.mode, self.count = "good", 0
    self.max_loaded, self.unloads_in_flight = 0, 0
    self.events: list[list] = []
    self.changed = asyncio.Condition()

  def server_info(self) -> dict:
    return {"lora": {"enable_lora": True, "max_lora_rank": self.max_lora_rank,
                     "lora_target_modules": self.target_modules, "max_loras_per_batch": self.max_loras_per_batch,
                     "lora_strict_loading": True}}

  def _take_mode(self) -> str:
    if self.count == 0:
      return "good"
    self.count -= 1
    return self.mode

  def _refusal(self, config: dict, name: str):
    """SGLang's checks of a new adapter: a loaded name, the rank, the target modules."""
    if name in self.loaded:
      return f"Failed to load LoRA adapter {name} because it is already loaded"
    targets = config.get("target_modules") or []
    if config.get("r", 0) > self.max_lora_rank or not set(targets) <= set(self.target_modules):
      return (f"LoRA adapter {name} with rank {config.get('r')} is incompatible with the current LoRA memory pool "
              "configuration. Please ensure that the LoRA adapter's rank is within the configured "
              "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
    return None

  async def _load(self, name: str, config_fn, where: str):
    from aiohttp import web
    mode = self._take_mode()
    if mode == "hang":
      await asyncio.sleep(3600)
    if mode == "refuse":
      return web.json_response({"success": False, "error_message": "fake refusal"}, status=400)
    try:
      config = config_fn()
    except (OSError, ValueError, RuntimeError) as e:
      return web.json_response({"success": False, "error_message": str(e)}, status=400)
    problem = self._refusal(config, name)
    if problem is not None:
      return web.json_response({"success": False, "error_message": problem}, status=400)
    self.loaded[name] = where
    self.max_loaded = max(self.max_loaded, len(self.loaded))
    self.events.append(["load", name])
    if mode == "land_then_hang":
      await asyncio.sleep(3600)
    return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.loaded)})

  async def load(self, request):
    body = await request.json()

    def config():
      with open(os.path.join(body["lora_path"], "adapter_config.json")) as f:
        return json.load(f)
    return await self._load(body["lora_name"], config, body["lora_path"])

  async def load_from_tensors(self, request):
    body = await request.json()

    def config():  # the handles mapped and every sha256 checked, as SGLang's worker does
      import base64
      import hashlib
      import pickle
      import torch.multiprocessing  # noqa: F401 -- registers the shared-memory reductions
      tensors = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
      want = body.get("expected_checksums") or {}
      got = {k: hashlib.sha256(v.contiguous().flatten().view(-1).numpy().tobytes()).hexdigest()
             for k, v in tensors.items()}
      if want and got != want:
        raise RuntimeError(f"[LORA-CHECK] adapter sync MISMATCH: {sorted(k for k in got if got[k] != want.get(k))}")
      return body["config_dict"]
    return await self._load(body["lora_name"], config, "__tensor__")

  async def unload(self, request):
    from aiohttp import web
    name = (await request.json())["lora_name"]
    if name not in self.loaded:
      return web.json_response({"success": False, "error_message": f"LoRA with name {name} does not exist. "
                                f"Loaded LoRAs: {list(self.loaded)}"}, status=400)
    if self.in_flight[name]:
      self.unloads_in_flight += 1
    self.events.append(["unload", name, self.in_flight[name]])
    async with self.changed:
      await self.changed.wait_for(lambda: self.in_flight[name] == 0)
    del self.loaded[name]
    return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.loaded)})

  def wrap_generate(self, generate):
    """/generate with lora_path: an unknown name is SGLang's 400; the request holds its adapter to the end."""
    from aiohttp import web

    async def handler(request):
      name = (await request.json()).get("lora_path")
      self.requests[name] += 1
      if name is not None and name not in self.loaded:
        return web.json_response({"error": {"message": f"Got LoRA adapter that has never been loaded: {name}\n"
                                                        f"All loaded adapters: {list(self.loaded)}."}}, status=400)
      self.in_flight[name] += 1
      try:
        return await generate(request)
      finally:
        self.in_flight[name] -= 1
        async with self.changed:
          self.changed.notify_all()
    return handler

  async def set_mode(self, request):
    import fake_sglang  # the fake server's own module: it imports this one only when started with --enable-lora
    return await fake_sglang.set_fault_mode(request, LORA_MODES, 1, self, "mode", "count")

  async def stats(self, _):
    from aiohttp import web
    return web.json_response({"loaded": sorted(self.loaded), "max_loaded": self.max_loaded,
                              "requests": {str(k): v for k, v in self.requests.items()},
                              "unloads_in_flight": self.unloads_in_flight, "events": self.events})

  def routes(self) -> list:
    from aiohttp import web
    return [web.post("/load_lora_adapter", self.load),
            web.post("/load_lora_adapter_from_tensors", self.load_from_tensors),
            web.post("/unload_lora_adapter", self.unload), web.post("/fake/lora", self.set_mode),
            web.get("/fake/lora/stats", self.stats)]
