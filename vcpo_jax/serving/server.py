"""Embedded SGLang-protocol server (aiohttp) with the JAX sampler behind it, for CPU runs and tests.

  python -m vcpo_jax.serving.server --model-path DIR --port 30000 [--weights-root ROOT] [--max-batch 64]

Requests share one continuous-batching pool (engine.py: rows join and leave between decode chunks).
Speaks the subset in docs/embedded-server.md and behaves like SGLang 0.5.23 where the job depends
on it: context limits (an input of context_length - 6 tokens or more is a 400; prompt + output is capped
at context_length - 2, finishing "length"); update_weights_from_disk with flush_cache (the default) while
requests run or wait answers 400 "cache was not flushed" AFTER applying the weights (new tokens carry the
new version, /get_model_info keeps the old one); /flush_cache is a 400 unless idle. Deliberate differences:
- output_token_logprobs are log-probs of the raw model at every temperature (SGLang's, with
  SGLANG_RETURN_ORIGINAL_LOGPROB=1), which is what the learner recomputes (see sampling.py).
- output_ids and logprobs always include a matched stop token; `no_stop_trim` only affects `text`.
- n > 1: sample j draws from random stream j of the request's seed (so a seeded request still yields n
  different samples; sample 0 equals the same request with n = 1); SGLang ignores sampling_seed unless
  started with --enable-deterministic-inference.
- No prefix cache (cached_tokens is 0): an in_place update cannot serve stale cached prefixes to new
  requests. top_logprobs_num and non-neutral penalties are refused with 400; unknown top-level /generate
  keys are a 400 (SGLang ignores them); `stream` is served for one prompt with n = 1.
- /health answers at once (SGLang's runs a generation); /get_model_info has extra fields (vocab_size,
  eos_token_ids, paused, num_in_flight, ...) that the client must not rely on.
- model_path of update_weights_from_disk must lie under --weights-root (default: the parent of
  --model-path), and the new model must have the same config as the served one (SGLang checks nothing).
- LoRA (--enable-lora, docs/embedded-server.md): a `lora_path` that is not loaded is a 400 (SGLang reloads a
  once-loaded adapter from its path), and adapters live in a fixed stack of --max-loras-per-batch slots.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import uuid
from typing import Any

import jax
from aiohttp import web

from vcpo_jax.model import hf
from vcpo_jax.model import sampling
from vcpo_jax.rollout import protocol
from vcpo_jax.serving import adapter_http, adapters as adapters_lib
from vcpo_jax.serving import requests as server_protocol
from vcpo_jax.serving import weight_tensor, weight_wire
from vcpo_jax.serving.sequence import Row
from vcpo_jax.serving.rows import (ServerState, exit_with_parent, load_state, make_rows, parse_args,
                                          row_response)

log = logging.getLogger("vcpo_jax.serving.server")
P = protocol

_UPDATE_KEYS = ("model_path", "weight_version", "abort_all_requests", "flush_cache", "load_format",
                "torch_empty_cache", "keep_pause", "is_async")
# SGLang 0.5.23's own words (the publisher looks for protocol.CACHE_NOT_FLUSHED in them).
_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache.")


async def _json_body(request: web.Request) -> Any:
  raw = await request.read()
  if not raw.strip():
    return {}
  try:
    return json.loads(raw)
  except json.JSONDecodeError as e:
    raise P.RequestError(f"request body is not valid JSON: {e}") from None


async def handle_generate(request: web.Request) -> web.StreamResponse:
  st: ServerState = request.app["state"]
  encode = None if st.tokenizer is None else (lambda text: st.tokenizer.encode(text).ids)
  req = server_protocol.parse_generate_request(
      await _json_body(request), vocab_size=st.vocab_size, encode=encode, context_length=st.context_length,
      max_prompt_len=st.max_prompt_len)
  names = [name for name, sp in zip(req.lora_paths or [None] * len(req.params), req.params) for _ in range(sp.n)]
  rows = make_rows(req, st)
  if any(n is not None for n in names):
    if st.adapters is None:
      raise P.RequestError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    held = []
    try:
      for row, name in zip(rows, names):  # each row holds its adapter to the end (an unload waits for it)
        row.adapter_slot = st.adapters.acquire(name)
        held.append(name)
    except adapters_lib.AdapterError as e:
      for name in held:
        await st.adapters.release(name)
      raise P.RequestError(str(e)) from None
    try:
      return await _generate(request, req, rows, st)
    finally:
      for name in held:
        await st.adapters.release(name)
  return await _generate(request, req, rows, st)


async def _generate(request: web.Request, req: server_protocol.GenerateRequest, rows: list[Row],
                    st: ServerState) -> web.StreamResponse:
  row_params = [sp for sp in req.params for _ in range(sp.n)]
  samples = [j for sp in req.params for j in range(sp.n)]
  st.engine.submit(rows)
  try:
    if req.stream:
      return await _stream(request, rows[0], row_params[0], req, st)
    await asyncio.gather(*(r.done.wait() for r in rows))
  except asyncio.CancelledError:  # client went away: free the batch slots
    for r in rows:
      r.finish(P.FINISH_ABORT)
    raise
  out = [row_response(r, sp, req, st, j) for r, sp, j in zip(rows, row_params, samples)]
  return web.json_response(out[0] if req.single and len(out) == 1 else out)


async def _stream(request, row: Row, sp, req: server_protocol.GenerateRequest,
                  st: ServerState) -> web.StreamResponse:
  resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
  await resp.prepare(request)
  sent = -1
  while True:
    await row.updated.wait()
    row.updated.clear()
    if len(row.output_ids) != sent or row.finish_reason is not None:
      sent = len(row.output_ids)
      data = json.dumps(row_response(row, sp, req, st, 0))
      await resp.write(f"data: {data}\n\n".encode())
    if row.finish_reason is not None:
      break
  await resp.write(b"data: [DONE]\n\n")
  await resp.write_eof()
  return resp


async def handle_health(request: web.Request) -> web.Response:
  return web.Response(status=200)


async def handle_health_generate(request: web.Request) -> web.Response:
  st: ServerState = request.app["state"]
  if st.engine.pause_mode is None:
    row = Row(spec=sampling.RowSpec(prompt=(0,), max_new_tokens=1, temperature=0.0), rid=uuid.uuid4().hex)
    st.engine.submit([row])
    await row.done.wait()
  return web.Response(status=200)


async def handle_model_info(request: web.Request) -> web.Response:
  st: ServerState = request.app["state"]
  e = st.engine
  return web.json_response({
      "model_path": st.model_path, "tokenizer_path": st.model_path, "is_generation": True,
      "preferred_sampling_params": None, "weight_version": st.reported_version, "vocab_size": st.vocab_size,
      "max_batch": e.max_batch, "context_length": st.context_length, "max_prompt_len": st.max_prompt_len,
      "eos_token_ids": list(st.eos_ids), "paused": e.pause_mode, "num_in_flight": e.num_in_flight,
      **e.stats,
  })


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
    body = await _json_body(request)
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
  body = await _json_body(request)
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
  body = await _json_body(request)
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
  body = await _json_body(request)
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


@web.middleware
async def error_middleware(request: web.Request, handler):
  try:
    return await handler(request)
  except P.RequestError as e:
    return web.json_response(e.body, status=400)
  except web.HTTPNotFound:
    return web.json_response({"detail": "Not Found"}, status=404)
  except web.HTTPMethodNotAllowed:
    return web.json_response({"detail": "Method Not Allowed"}, status=405)


def build_app(state: ServerState) -> web.Application:
  app = web.Application(middlewares=[error_middleware], client_max_size=64 * 2**20)
  app["state"] = state
  app.router.add_post("/generate", handle_generate)
  app.router.add_get("/health", handle_health)
  app.router.add_get("/health_generate", handle_health_generate)
  app.router.add_get("/get_model_info", handle_model_info)
  app.router.add_post("/update_weights_from_disk", handle_update_weights)
  app.router.add_post("/update_weight_version", handle_update_weight_version)
  app.router.add_post("/pause_generation", handle_pause)
  app.router.add_post("/continue_generation", handle_continue)
  app.router.add_post("/abort_request", handle_abort)
  app.router.add_route("GET", "/flush_cache", handle_flush_cache)
  app.router.add_route("POST", "/flush_cache", handle_flush_cache)
  weight_wire.add_routes(app)
  weight_tensor.add_routes(app)
  adapter_http.add_routes(app)

  async def on_startup(app):
    app["state"].engine.start()

  async def on_cleanup(app):
    await app["state"].engine.stop()

  app.on_startup.append(on_startup)
  app.on_cleanup.append(on_cleanup)
  return app


def main(argv=None):
  args = parse_args(argv)
  logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  if args.compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
  if args.parent_pid:
    exit_with_parent(args.parent_pid)
  try:
    state = load_state(args)
  except (ValueError, OSError, KeyError) as e:
    print(f"error: cannot serve --model-path {args.model_path!r}: {e}", file=sys.stderr)
    sys.exit(2)
  cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "all"
  log.info("serving %s (vocab %d) on http://%s:%d, CPUs %s", state.model_path, state.vocab_size, args.host,
           args.port, cpus)
  web.run_app(build_app(state), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
  main()
