"""The embedded server's control handlers (SGLang 0.5.23's shapes): weights from disk, the weight version, pause,
continue, abort and flush_cache."""
from __future__ import annotations

import logging
import os

from aiohttp import web

from vcpo_jax.model import hf
from vcpo_jax.rollout import protocol
from vcpo_jax.serving import requests as server_protocol
from vcpo_jax.serving.rows import ServerState

log = logging.getLogger("vcpo_jax.serving.server")  # one logger for all the server's lines
P = protocol

_UPDATE_KEYS = ("model_path", "weight_version", "abort_all_requests", "flush_cache", "load_format",
                "torch_empty_cache", "keep_pause", "is_async")
# SGLang 0.5.23's own words (the publisher looks for protocol.CACHE_NOT_FLUSHED in them).
_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache.")


def _bool_field(body: dict, key: str, default: bool) -> bool:
  value = body.get(key, default)
  if not isinstance(value, bool):
    raise P.RequestError(f"{key} must be a boolean, got {value!r}.")
  return value


def _update_error(message: str) -> web.Response:
  return web.json_response({"success": False, "message": message}, status=400)


async def handle_update_weights(request: web.Request) -> web.Response:
  st: ServerState = request.app["state"]
  try:
    body = await server_protocol.json_body(request)
    if not isinstance(body, dict):
      raise P.RequestError("request body must be a JSON object.")
    for key in body:
      if key not in _UPDATE_KEYS:
        raise P.unknown_field_error(key, _UPDATE_KEYS)
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
      raise P.RequestError(f"model_path must be a non-empty string, got {path!r}.")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
      raise P.RequestError(f"weight_version must be a string, got {version!r}.")
    abort_all = _bool_field(body, "abort_all_requests", False)
    flush = _bool_field(body, "flush_cache", True)
    real = os.path.realpath(path)
    if os.path.commonpath([real, st.weights_root]) != st.weights_root:
      raise P.RequestError(f"model_path={path!r} is outside the weights root {st.weights_root!r}.")
    if not os.path.isdir(real):
      raise P.RequestError(f"model_path={path!r} is not a directory.")
  except P.RequestError as e:
    return _update_error(str(e))
  try:
    num_paused, busy = await st.engine.update_weights(lambda: hf.import_hf(real), version, abort_all=abort_all)
  except Exception as e:  # any loader failure (bad json, safetensors, shapes) is the request's fault
    return _update_error(f"failed to load weights from model_path={path!r}: {e}")
  if flush and busy:  # as SGLang: the weights are live, but the reported version stays the old one
    log.warning("weights from %s applied with %d requests in flight; cache not flushed", real, busy)
    return _update_error(_NOT_FLUSHED)
  if version is not None:
    st.reported_version = version
  log.info("weights updated from %s, weight_version=%s", real, st.engine.weight_version)
  return web.json_response({"success": True, "message": f"Succeeded to update model weights from {path}.",
                            "num_paused_requests": num_paused})


async def handle_update_weight_version(request: web.Request) -> web.Response:
  st: ServerState = request.app["state"]
  body = await server_protocol.json_body(request)
  if not isinstance(body, dict):
    raise P.RequestError("request body must be a JSON object.")
  version = body.get("new_version")
  if not isinstance(version, str) or not version:
    raise P.RequestError(f"new_version must be a non-empty string, got {version!r}.")
  if _bool_field(body, "abort_all_requests", True):
    st.engine.abort()
  st.engine.weight_version = st.reported_version = version
  return web.json_response({"success": True, "message": f"Weight version updated to {version}."})


async def handle_pause(request: web.Request) -> web.Response:
  st: ServerState = request.app["state"]
  body = await server_protocol.json_body(request)
  mode = body.get("mode", "abort") if isinstance(body, dict) else None
  if mode not in P.PAUSE_MODES:
    raise P.RequestError(f"mode must be one of {list(P.PAUSE_MODES)}, got {mode!r}.")
  num = await st.engine.pause(mode)
  return web.json_response({"message": "Generation paused successfully.", "num_paused_requests": num})


async def handle_continue(request: web.Request) -> web.Response:
  request.app["state"].engine.resume()
  return web.json_response({"message": "Generation continued successfully."})


async def handle_abort(request: web.Request) -> web.Response:
  st: ServerState = request.app["state"]
  body = await server_protocol.json_body(request)
  if not isinstance(body, dict):
    raise P.RequestError("request body must be a JSON object.")
  if _bool_field(body, "abort_all", False):
    st.engine.abort()
  elif isinstance(body.get("rid"), str):
    st.engine.abort(body["rid"])
  else:
    raise P.RequestError(f"rid must be a string (or set abort_all), got {body.get('rid')!r}.")
  return web.Response(status=200)


async def handle_flush_cache(request: web.Request) -> web.Response:
  # No prefix cache to flush, but the same answer as SGLang's, which flushes only when idle.
  if request.app["state"].engine.num_in_flight:
    return web.Response(status=400, text="Cache not flushed: requests are still running or queued.\n")
  return web.Response(text="Cache flushed.\n")
