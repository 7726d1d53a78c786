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

import jax
from aiohttp import web

from vcpo_jax.model import sampling
from vcpo_jax.rollout import protocol
from vcpo_jax.serving import adapter_http, adapters as adapters_lib, control_http
from vcpo_jax.serving import requests as server_protocol
from vcpo_jax.serving import weight_tensor, weight_wire
from vcpo_jax.serving.sequence import Row
from vcpo_jax.serving.rows import (ServerState, exit_with_parent, load_state, make_rows, parse_args,
                                          row_response)

log = logging.getLogger("vcpo_jax.serving.server")
P = protocol

async def handle_generate(request: web.Request) -> web.StreamResponse:
  st: ServerState = request.app["state"]
  encode = None if st.tokenizer is None else (lambda text: st.tokenizer.encode(text).ids)
  req = server_protocol.parse_generate_request(
      await server_protocol.json_body(request), vocab_size=st.vocab_size, encode=encode, context_length=st.context_length,
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
  app.router.add_post("/update_weights_from_disk", control_http.handle_update_weights)
  app.router.add_post("/update_weight_version", control_http.handle_update_weight_version)
  app.router.add_post("/pause_generation", control_http.handle_pause)
  app.router.add_post("/continue_generation", control_http.handle_continue)
  app.router.add_post("/abort_request", control_http.handle_abort)
  app.router.add_route("GET", "/flush_cache", control_http.handle_flush_cache)
  app.router.add_route("POST", "/flush_cache", control_http.handle_flush_cache)
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
