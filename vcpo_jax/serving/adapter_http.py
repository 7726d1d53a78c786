"""The embedded server's LoRA endpoints (SGLang 0.5.23's shapes): load from disk or tensors, unload, server info."""
from __future__ import annotations

import base64
import hashlib
import io
import json
from typing import Any

from aiohttp import web

from vcpo_jax.serving import adapters as adapters_lib

_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def _answer(loaded: Any = None, error: str | None = None) -> web.Response:
  if error is not None:
    return web.json_response({"success": False, "error_message": error, "loaded_adapters": None}, status=400)
  return web.json_response({"success": True, "error_message": None, "loaded_adapters": loaded})


async def _body(request: web.Request, keys: tuple[str, ...]) -> dict:
  try:
    body = json.loads(await request.read() or b"{}")
  except json.JSONDecodeError as e:
    raise adapters_lib.AdapterError(f"request body is not valid JSON: {e}") from None
  if not isinstance(body, dict):
    raise adapters_lib.AdapterError("request body must be a JSON object.")
  for key in keys:
    if not isinstance(body.get(key), str) or not body[key]:
      raise adapters_lib.AdapterError(f"{key} must be a non-empty string, got {body.get(key)!r}.")
  return body


def _endpoint(keys: tuple[str, ...], act):
  """A LoRA endpoint: the registry (an error without --enable-lora), the body's required string keys, then
  `await act(registry, body)`; an AdapterError answers in SGLang's 400 shape."""
  async def handle(request: web.Request) -> web.Response:
    registry = request.app["state"].adapters
    try:
      if registry is None:
        raise adapters_lib.AdapterError(_NOT_ENABLED)
      body = await _body(request, keys)
      return _answer(await act(registry, body))
    except adapters_lib.AdapterError as e:
      return _answer(error=str(e))
  return handle


def _tensors(body: dict) -> tuple[dict, dict]:
  """config_dict and the tensors behind `serialized_named_tensors` (handles only), each checked against
  `expected_checksums` (sha256 of its bytes) when given, as SGLang's worker checks them."""
  import torch  # noqa: F401 -- the handles' rebuilders
  from vcpo_jax.serving import weight_tensor
  payloads = body.get("serialized_named_tensors")
  if not (isinstance(payloads, list) and payloads and all(isinstance(p, str) for p in payloads)):
    raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
  tensors = weight_tensor._HandlesOnly(io.BytesIO(base64.b64decode(payloads[0], validate=True))).load()
  if isinstance(tensors, list):
    tensors = dict(tensors)
  if not isinstance(tensors, dict):
    raise ValueError("the payload must hold {name: tensor}")
  expected = body.get("expected_checksums")
  if expected is not None:
    got = {k: hashlib.sha256(v.detach().cpu().contiguous().flatten().view(-1).numpy().tobytes()).hexdigest()
           for k, v in tensors.items()}
    bad = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
    if bad:
      raise ValueError(f"[LORA-CHECK] adapter sync MISMATCH of {len(expected)} expected: {bad[:5]}")
  config = body.get("config_dict")
  if not isinstance(config, dict):
    raise ValueError(f"config_dict must be an object, got {config!r:.100}")
  return config, {k: v.detach().cpu().float().numpy() for k, v in tensors.items()}


handle_load = _endpoint(("lora_name", "lora_path"), lambda registry, body: registry.load(
    body["lora_name"], body["lora_path"], lambda: adapters_lib.read_peft(body["lora_path"])))
handle_load_tensors = _endpoint(("lora_name",), lambda registry, body: registry.load(
    body["lora_name"], "__tensor__", lambda: _tensors(body)))
handle_unload = _endpoint(("lora_name",), lambda registry, body: registry.unload(body["lora_name"]))


async def handle_server_info(request: web.Request) -> web.Response:
  st = request.app["state"]
  settings = st.adapters.settings if st.adapters is not None else None
  return web.json_response({"version": "embedded", "model_path": st.model_path, "context_length": st.context_length,
                            **adapters_lib.server_info(settings)})


def add_routes(app: web.Application) -> None:
  app.router.add_post("/load_lora_adapter", handle_load)
  app.router.add_post("/load_lora_adapter_from_tensors", handle_load_tensors)
  app.router.add_post("/unload_lora_adapter", handle_unload)
  app.router.add_get("/get_server_info", handle_server_info)
  app.router.add_get("/server_info", handle_server_info)
