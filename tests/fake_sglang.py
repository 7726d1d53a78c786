"""A tiny SGLang-protocol test server that misbehaves on demand (malformed-response tests only).

Run: python tests/fake_sglang.py --port N --vocab-size V [--mode good] [--token-delay S] [--info JSON]
Its "model" is a deterministic function of the context, so a resumed request continues exactly as an
uninterrupted one would. POST /fake/mode {"mode": m, "count": c} makes the next c /generate answers
(c = -1: all) misbehave in mode m; GET /fake/stats counts the /generate and update requests it received
and names the last model_path it was updated from. --info adds fields to /get_model_info (another model).
Also holds `launch_server`, the process helper the rollout tests share (the embedded server they start:
embedded_tiny.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

from vcpo_jax.rollout import protocol
from vcpo_jax.serving import requests as server_protocol

MODES = ("good", "malformed_json", "nan_logprob", "positive_logprob", "wrong_length", "oov_ids",
         "token_mismatch", "http_500", "missing_version", "no_spans", "abort_half", "list_body",
         "drop_connection", "scaled_logprobs")
# What /update_weights_from_disk does (POST /fake/update {"mode": m, "count": c}): apply and report the new
# version; answer SGLang's "cache was not flushed" 400 (weights live, version not reported); or say success
# while /get_model_info keeps the old version; or drop the connection unanswered.
UPDATE_MODES = ("good", "not_flushed", "stale_info", "drop_connection")


def next_token(context: list[int], vocab_size: int) -> tuple[int, float]:
  """The fake model: next token and its logprob, a pure function of the context."""
  tok = (sum(context) * 31 + 7 * len(context)) % vocab_size
  return tok, -0.1 * (1 + tok % 7)


def launch_server(argv: list[str], url: str, *, timeout: float = 120.0, log_path=None) -> subprocess.Popen:
  """Starts a server process and waits until GET /get_model_info answers 200; kills it on failure."""
  log = open(log_path, "wb") if log_path else subprocess.DEVNULL
  proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"server {argv} exited with {proc.returncode} (log: {log_path})")
    try:
      with urllib.request.urlopen(url + "/get_model_info", timeout=1) as resp:
        if resp.status == 200:
          return proc
    except OSError:
      time.sleep(0.1)
  proc.kill()
  raise RuntimeError(f"server {argv} not healthy after {timeout}s (log: {log_path})")


def stop_server(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    proc.kill()
  proc.wait(timeout=30)


async def set_fault_mode(request, modes: tuple[str, ...], default_count: int, target, mode_attr: str,
                         count_attr: str):
  """A POST /fake/... {"mode": m, "count": c} handler's body: m checked against `modes`, then set on `target`."""
  from aiohttp import web
  body = await request.json()
  if body.get("mode") not in modes:
    return web.json_response({"error": f"mode must be one of {modes}"}, status=400)
  setattr(target, mode_attr, body["mode"])
  setattr(target, count_attr, body.get("count", default_count))
  return web.json_response({"success": True})


class FakeServer:
  """State of one fake server: misbehaviour mode, weight version, pause flag."""

  def __init__(self, vocab_size: int, token_delay: float, version: str, mode: str, context_length: int,
               info: dict = None):
    self.vocab_size, self.token_delay, self.version = vocab_size, token_delay, version
    self.reported_version, self.context_length = version, context_length
    self.mode, self.mode_count = mode, -1
    self.update_mode, self.update_count = "good", 0
    self.update_requests = 0
    self.last_model_path = None  # where the last applied update came from
    self.info = {"model_path": "fake", **(info or {})}  # "fake": not a directory the learner can read
    self.running = asyncio.Event()
    self.running.set()
    self.generate_requests = 0
    self.lora = None  # fake_lora.FakeLora with --enable-lora

  def take_mode(self) -> str:
    if self.mode_count == 0:
      return "good"
    if self.mode_count > 0:
      self.mode_count -= 1
    return self.mode

  async def generate(self, request):
    from aiohttp import web
    body = await request.json()
    self.generate_requests += 1
    mode = self.take_mode()
    if mode == "http_500":
      return web.json_response({"error": {"message": "fake internal error"}}, status=500)
    ids = list(body["input_ids"])
    max_new = body.get("sampling_params", {}).get("max_new_tokens", 128)
    temperature = body.get("sampling_params", {}).get("temperature", 1.0)
    if mode == "drop_connection":  # as a keep-alive connection the server closed while idle
      request.transport.close()
      return web.Response(status=500)
    if len(ids) >= self.context_length - protocol.INPUT_MARGIN:  # SGLang's limits
      return web.json_response({"error": {"message": f"The input ({len(ids)} tokens) is longer than the "
                                                     f"model's context length ({self.context_length} tokens)."}},
                               status=400)
    max_new = min(max_new, self.context_length - protocol.TOTAL_MARGIN - len(ids))
    out, lps, versions = [], [], []
    for _ in range(max_new):
      await self.running.wait()
      if self.token_delay:
        await asyncio.sleep(self.token_delay)
      tok, lp = next_token(ids + out, self.vocab_size)
      out.append(tok)
      lps.append(lp)
      versions.append(self.version)
    finish = {"type": "length", "length": len(out)}
    if mode == "abort_half":
      out, lps, versions = out[:len(out) // 2], lps[:len(out) // 2], versions[:len(out) // 2]
      finish = {"type": "abort", "message": "Aborted"}
    if mode == "scaled_logprobs" and temperature not in (0, 1.0):  # not the raw model's
      lps = [lp / temperature for lp in lps]
    entries = [[lp, t, None] for lp, t in zip(lps, out)]
    meta = {"id": body.get("rid", "x"), "finish_reason": finish, "prompt_tokens": len(ids),
            "completion_tokens": len(out), "cached_tokens": 0, "weight_version": self.version,
            "weight_versions": server_protocol.weight_version_spans(versions), "output_token_logprobs": entries, "e2e_latency": 0.0}
    start = body.get("logprob_start_len", -1)
    if start is not None and start >= 0:  # the raw model's log-probs of the prompt tokens
      meta["input_token_logprobs"] = [[None if i == 0 else next_token(ids[:i], self.vocab_size)[1], ids[i], None]
                                      for i in range(start, len(ids))]
    result = {"text": "", "output_ids": out, "meta_info": meta}
    if mode == "malformed_json":
      return web.Response(text=json.dumps(result)[:-7], content_type="application/json")
    if out and mode == "nan_logprob":
      entries[0][0] = float("nan")
    if out and mode == "positive_logprob":
      entries[-1][0] = 0.5
    if mode == "wrong_length":
      meta["completion_tokens"] = len(out) + 1
    if out and mode == "oov_ids":
      out[0] = entries[0][1] = self.vocab_size + 3
    if out and mode == "token_mismatch":
      entries[-1][1] = (out[-1] + 1) % self.vocab_size
    if mode == "missing_version":
      del meta["weight_versions"], meta["weight_version"]
    if mode == "no_spans":
      del meta["weight_versions"]
    if mode == "list_body":
      result = [result]
    return web.Response(text=json.dumps(result), content_type="application/json")

  async def set_mode(self, request):
    return await set_fault_mode(request, MODES, -1, self, "mode", "mode_count")

  async def update_weights(self, request):
    from aiohttp import web
    body = await request.json()
    self.update_requests += 1
    if not os.path.isfile(os.path.join(body.get("model_path", ""), "config.json")):
      return web.json_response({"success": False, "message": "no config.json"}, status=400)
    mode = "good"
    if self.update_count:
      mode, self.update_count = self.update_mode, self.update_count - 1
    if mode == "drop_connection":  # as a keep-alive connection SGLang closed while idle: nothing happened
      request.transport.close()
      return web.Response(status=500)
    self.version = body.get("weight_version", self.version)
    self.last_model_path = body["model_path"]
    if mode == "not_flushed":
      return web.json_response({"success": False, "message": "Weights were updated, but the cache was not "
                                "flushed because requests are still running or queued."}, status=400)
    if mode == "good":
      self.reported_version = self.version
    return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

  async def set_update_mode(self, request):
    return await set_fault_mode(request, UPDATE_MODES, 1, self, "update_mode", "update_count")

  def app(self):
    from aiohttp import web

    async def ok(_):
      return web.json_response({})

    async def health(_):  # as SGLang's /health of a paused server: it runs a generation, which waits
      return web.json_response({}, status=200 if self.running.is_set() else 503)

    async def pause(_):
      self.running.clear()
      return web.json_response({})

    async def resume(_):
      self.running.set()
      return web.json_response({})

    async def info(_):
      return web.json_response({**self.info, "weight_version": self.reported_version})

    async def stats(_):
      return web.json_response({"generate_requests": self.generate_requests,
                                "update_requests": self.update_requests,
                                "last_model_path": self.last_model_path})

    async def server_info(_):
      lora = self.lora.server_info() if self.lora is not None else {"lora": {"enable_lora": None}}
      return web.json_response({"version": "fake", **lora})

    app = web.Application()
    generate = self.generate
    if self.lora is not None:
      app.add_routes(self.lora.routes())
      generate = self.lora.wrap_generate(self.generate)
    app.add_routes([web.post("/generate", generate), web.get("/health", health),
                    web.get("/get_server_info", server_info),
                    web.post("/fake/update", self.set_update_mode),
                    web.get("/get_model_info", info), web.post("/fake/mode", self.set_mode),
                    web.get("/fake/stats", stats), web.post("/pause_generation", pause),
                    web.post("/continue_generation", resume), web.post("/abort_request", ok),
                    web.post("/update_weights_from_disk", self.update_weights)])
    return app


def main() -> None:
  from aiohttp import web
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--vocab-size", type=int, default=64)
  parser.add_argument("--token-delay", type=float, default=0.0)
  parser.add_argument("--weight-version", default="v0")
  parser.add_argument("--mode", default="good", choices=MODES)
  parser.add_argument("--context-length", type=int, default=4096)
  parser.add_argument("--info", type=json.loads, default={}, help="extra /get_model_info fields (JSON)")
  parser.add_argument("--enable-lora", action="store_true")
  parser.add_argument("--max-lora-rank", type=int, default=16)
  parser.add_argument("--lora-target-modules", nargs="*", default=["q_proj", "k_proj", "v_proj", "o_proj"])
  args = parser.parse_args()

  async def make_app():
    server = FakeServer(args.vocab_size, args.token_delay, args.weight_version, args.mode,
                        args.context_length, args.info)
    if args.enable_lora:
      sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
      import fake_lora
      server.lora = fake_lora.FakeLora(args.max_lora_rank, args.lora_target_modules)
    return server.app()

  web.run_app(make_app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
  sys.exit(main())
