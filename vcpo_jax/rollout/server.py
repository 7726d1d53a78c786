"""Embedded SGLang-protocol server (aiohttp) with the JAX sampler behind it, for CPU runs and tests.

  python -m vcpo_jax.rollout.server --model-path DIR --port 30000 [--weights-root ROOT] [--max-batch 64]

Speaks the subset in shared/design/sglang-protocol.md. Where it knowingly differs from SGLang:
- output_token_logprobs are log-probs of the raw model (temperature 1, no top-k/top-p/min-p), which is
  what the learner recomputes (see sampling.py).
- output_ids and logprobs always include a matched stop token; `no_stop_trim` only affects `text`.
- n > 1: sample j draws from random stream j of the request's seed (so a seeded request still yields n
  different samples; sample 0 equals the same request with n = 1).
- No prefix cache (cached_tokens is 0, flush_cache is a no-op); top_logprobs_num and non-neutral
  penalties are refused with 400; `stream` is served for one prompt with n = 1.
- model_path of update_weights_from_disk must lie under --weights-root (default: the parent of
  --model-path), and the new model must have the same config as the served one.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import sys
import threading
import time
import uuid
from typing import Any

import jax
import tokenizers
from aiohttp import web

from vcpo_jax import hf, sampling
from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.engine import Engine, Row

log = logging.getLogger("vcpo_jax.rollout.server")
P = protocol

_UPDATE_KEYS = ("model_path", "weight_version", "abort_all_requests", "flush_cache", "load_format",
                "torch_empty_cache", "keep_pause", "is_async")


@dataclasses.dataclass
class ServerState:
  engine: Engine
  tokenizer: tokenizers.Tokenizer | None
  model_path: str
  weights_root: str
  vocab_size: int
  eos_ids: tuple[int, ...]
  max_prompt_len: int
  max_total_len: int
  rng: random.Random


def make_rows(req: P.GenerateRequest, st: ServerState) -> list[Row]:
  """Prompt-major rows [p0s0, p0s1, p1s0, ...]; sample j of a prompt draws from stream j of its seed."""
  rows = []
  for prompt, sp, rid in zip(req.prompts, req.params, req.rids):
    seed = sp.sampling_seed if sp.sampling_seed is not None else st.rng.getrandbits(32)
    stop_ids = tuple(dict.fromkeys(sp.stop_token_ids + st.eos_ids))
    for j in range(sp.n):
      spec = sampling.RowSpec(
          prompt=tuple(prompt), max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
          top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, min_new_tokens=sp.min_new_tokens,
          stop_token_ids=stop_ids, ignore_eos=sp.ignore_eos, seed=seed, stream=j)
      rows.append(Row(spec=spec, rid=rid, stop_strings=sp.stop))
  return rows


def _decode(tok: tokenizers.Tokenizer | None, ids: list[int], skip_special: bool = True) -> str:
  return tok.decode(ids, skip_special_tokens=skip_special) if tok is not None else ""


def stop_string_check(tok: tokenizers.Tokenizer | None):
  """Finds the earliest stop string in a row's text and the fewest tokens whose text contains it."""
  def check(row: Row):
    text = _decode(tok, row.output_ids, skip_special=False)
    hits = [(text.find(s), s) for s in row.stop_strings if s in text]
    if not hits:
      return None
    _, matched = min(hits)
    lo, hi = 1, len(row.output_ids)
    while lo < hi:
      mid = (lo + hi) // 2
      if matched in _decode(tok, row.output_ids[:mid], skip_special=False):
        hi = mid
      else:
        lo = mid + 1
    return lo, matched
  return check


def row_response(row: Row, sp: protocol.SamplingParams, req: P.GenerateRequest, st: ServerState,
                 sample: int) -> dict:
  ids = list(row.output_ids)
  text_ids = ids
  if row.finish_reason == P.FINISH_STOP and isinstance(row.matched, int) and not sp.no_stop_trim:
    text_ids = ids[:-1]
  text = _decode(st.tokenizer, text_ids, sp.skip_special_tokens)
  if row.finish_reason == P.FINISH_STOP and isinstance(row.matched, str) and not sp.no_stop_trim:
    text = text[:text.find(row.matched)] if row.matched in text else text
  if row.finish_reason == P.FINISH_LENGTH:
    finish = {"type": "length", "length": len(ids)}
  elif row.finish_reason == P.FINISH_STOP:
    finish = {"type": "stop", "matched": row.matched}
  elif row.finish_reason == P.FINISH_ABORT:
    finish = {"type": "abort", "message": "Aborted"}
  else:
    finish = None  # still running (stream chunks)
  end = row.finished_at if row.finished_at is not None else time.monotonic()
  meta = {
      "id": row.rid if sp.n == 1 else f"{row.rid}-{sample}",
      "finish_reason": finish,
      "prompt_tokens": len(row.spec.prompt),
      "completion_tokens": len(ids),
      "cached_tokens": 0,
      "weight_version": row.versions[-1] if row.versions else st.engine.weight_version,
      "weight_versions": P.weight_version_spans(row.versions),
      "e2e_latency": end - row.created,
  }
  if req.return_logprob:
    piece = (lambda t: _decode(st.tokenizer, [t], False)) if req.return_text_in_logprobs else (lambda t: None)
    meta["output_token_logprobs"] = [[lp, t, piece(t)] for lp, t in zip(row.logprobs, ids)]
    if req.logprob_start_len >= 0:
      prompt = row.spec.prompt
      lps = [None] + list(row.prompt_logprobs or [])
      meta["input_token_logprobs"] = [[lps[i], prompt[i], piece(prompt[i])]
                                      for i in range(req.logprob_start_len, len(prompt))]
  return {"text": text, "output_ids": ids, "meta_info": meta}


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
  req = P.parse_generate_request(await _json_body(request), vocab_size=st.vocab_size, encode=encode,
                                 max_prompt_len=st.max_prompt_len, max_total_len=st.max_total_len)
  rows = make_rows(req, st)
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


async def _stream(request, row: Row, sp, req: P.GenerateRequest, st: ServerState) -> web.StreamResponse:
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
      "preferred_sampling_params": None, "weight_version": e.weight_version, "vocab_size": st.vocab_size,
      "max_batch": e.max_batch, "max_prompt_len": st.max_prompt_len, "max_total_len": st.max_total_len,
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
    real = os.path.realpath(path)
    if os.path.commonpath([real, st.weights_root]) != st.weights_root:
      raise P.RequestError(f"model_path={path!r} is outside the weights root {st.weights_root!r}.")
    if not os.path.isdir(real):
      raise P.RequestError(f"model_path={path!r} is not a directory.")
  except P.RequestError as e:
    return _update_error(str(e))
  try:
    num_paused = await st.engine.update_weights(lambda: hf.import_hf(real), version, abort_all=abort_all)
  except Exception as e:  # any loader failure (bad json, safetensors, shapes) is the request's fault
    return _update_error(f"failed to load weights from model_path={path!r}: {e}")
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
  st.engine.weight_version = version
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
  return web.Response(text="Cache flushed.\n")  # no prefix cache to flush


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

  async def on_startup(app):
    app["state"].engine.start()

  async def on_cleanup(app):
    await app["state"].engine.stop()

  app.on_startup.append(on_startup)
  app.on_cleanup.append(on_cleanup)
  return app


def _eos_ids(model_dir: str) -> tuple[int, ...]:
  """EOS ids from config.json and generation_config.json (int or list; null means none)."""
  ids: list[int] = []
  for name in ("config.json", "generation_config.json"):
    path = os.path.join(model_dir, name)
    if os.path.isfile(path):
      with open(path) as f:
        eos = json.load(f).get("eos_token_id")
      ids += [eos] if isinstance(eos, int) else list(eos or [])
  return tuple(dict.fromkeys(ids))


def load_state(args: argparse.Namespace) -> ServerState:
  """Loads the model and tokenizer; raises ValueError/OSError with a clear message on a bad directory."""
  model_dir = os.path.realpath(args.model_path)
  if not os.path.isdir(model_dir):
    raise ValueError(f"--model-path {args.model_path!r} is not a directory")
  params, cfg = hf.import_hf(model_dir)
  tok_file = os.path.join(model_dir, "tokenizer.json")
  tokenizer = tokenizers.Tokenizer.from_file(tok_file) if os.path.isfile(tok_file) else None
  max_total = args.max_total_len or cfg.max_seq_len
  max_prompt = args.max_prompt_len or max_total - 1
  if max_total > cfg.max_seq_len:
    raise ValueError(f"--max-total-len {max_total} exceeds the model's max_seq_len {cfg.max_seq_len}")
  engine = Engine(params, cfg, args.weight_version, max_batch=args.max_batch, chunk_steps=args.chunk_steps,
                  batch_window_s=args.batch_window_ms / 1000.0, max_gather_s=args.max_gather_ms / 1000.0,
                  min_batch=args.min_batch_bucket,
                  min_prompt_len=args.min_prompt_bucket, min_new_tokens=args.min_new_bucket,
                  stop_string_check=stop_string_check(tokenizer))
  weights_root = os.path.realpath(args.weights_root or os.path.dirname(model_dir))
  state = ServerState(engine, tokenizer, model_dir, weights_root, cfg.vocab_size, _eos_ids(model_dir),
                      max_prompt, max_total, random.Random(args.seed))
  return state


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model-path", required=True, help="Hugging Face directory (config.json + safetensors)")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=30000)
  p.add_argument("--weights-root", default=None,
                 help="update_weights_from_disk only loads directories under this (default: the parent of "
                      "--model-path)")
  p.add_argument("--max-batch", type=int, default=64, help="rows decoded together in one jitted batch")
  p.add_argument("--max-prompt-len", type=int, default=None)
  p.add_argument("--max-total-len", type=int, default=None, help="prompt + max_new_tokens limit")
  p.add_argument("--weight-version", default="v0")
  p.add_argument("--chunk-steps", type=int, default=8,
                 help="decode steps between control points (pause/abort/weight swap take effect there)")
  p.add_argument("--batch-window-ms", type=float, default=5.0,
                 help="gather a batch for this long, and again while requests keep arriving")
  p.add_argument("--max-gather-ms", type=float, default=50.0, help="never gather a batch for longer")
  p.add_argument("--min-batch-bucket", type=int, default=8,
                 help="smallest batch shape; batch, prompt and new-token sizes are padded to powers of two "
                      "at least these minimums, so jit compiles a few shapes only")
  p.add_argument("--min-prompt-bucket", type=int, default=16)
  p.add_argument("--min-new-bucket", type=int, default=16)
  p.add_argument("--compilation-cache-dir", default=None,
                 help="JAX persistent compilation cache: restarted servers skip the jit compiles")
  p.add_argument("--seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
  p.add_argument("--parent-pid", type=int, default=None,
                 help="exit when this process is gone (a trainer killed with SIGKILL leaves no orphan server)")
  return p.parse_args(argv)


def _exit_with_parent(pid: int, interval_s: float = 1.0):
  """Watchdog thread: the server's own process exits once `pid` no longer exists."""
  def watch():
    while True:
      time.sleep(interval_s)
      try:
        os.kill(pid, 0)
      except ProcessLookupError:
        log.warning("parent process %d is gone; exiting", pid)
        os._exit(0)
      except PermissionError:
        pass
  threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def main(argv=None):
  args = parse_args(argv)
  logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  if args.compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
  if args.parent_pid:
    _exit_with_parent(args.parent_pid)
  try:
    state = load_state(args)
  except (ValueError, OSError, KeyError) as e:
    print(f"error: cannot serve --model-path {args.model_path!r}: {e}", file=sys.stderr)
    sys.exit(2)
  log.info("serving %s (vocab %d) on http://%s:%d", state.model_path, state.vocab_size, args.host, args.port)
  web.run_app(build_app(state), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
  main()
