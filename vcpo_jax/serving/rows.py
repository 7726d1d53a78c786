"""The embedded server's glue: command line, loaded state, /generate request -> engine rows -> response."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import threading
import time

import tokenizers

from vcpo_jax.model import hf
from vcpo_jax.model import sampling
from vcpo_jax.model import sampling_fields
from vcpo_jax.rollout import protocol
from vcpo_jax.serving import adapters as adapters_lib
from vcpo_jax.serving import requests as SP
from vcpo_jax.serving.engine import Engine
from vcpo_jax.serving.sequence import Row

P = protocol


@dataclasses.dataclass
class ServerState:
  engine: Engine
  tokenizer: tokenizers.Tokenizer | None
  model_path: str
  weights_root: str
  vocab_size: int
  eos_ids: tuple[int, ...]
  context_length: int  # SGLang's limits: input < context_length - 6, prompt + output <= context_length - 2
  max_prompt_len: int | None  # an optional extra limit of ours
  rng: random.Random
  reported_version: str = ""  # /get_model_info's weight_version: advanced only by a fully successful update
  adapters: "adapters_lib.Registry | None" = None  # with --enable-lora


def make_rows(req: SP.GenerateRequest, st: ServerState) -> list[Row]:
  """Prompt-major rows [p0s0, p0s1, p1s0, ...]; sample j of a prompt draws from stream j of its seed."""
  rows = []
  for prompt, sp, rid in zip(req.prompts, req.params, req.rids):
    seed = sp.sampling_seed if sp.sampling_seed is not None else st.rng.getrandbits(32)
    stop_ids = tuple(dict.fromkeys(sp.stop_token_ids + st.eos_ids))
    for j in range(sp.n):
      fields = dict(sampling_fields.field_values(sp), stop_token_ids=stop_ids)
      spec = sampling.RowSpec(prompt=tuple(prompt), seed=seed, stream=j, **fields)
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


def row_response(row: Row, sp: protocol.SamplingParams, req: SP.GenerateRequest, st: ServerState,
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
      "weight_versions": SP.weight_version_spans(row.versions),
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
  context_length = args.context_length or cfg.max_seq_len
  if not P.INPUT_MARGIN < context_length <= cfg.max_seq_len:
    raise ValueError(f"--context-length {context_length} must be in ({P.INPUT_MARGIN}, the model's max_seq_len "
                     f"{cfg.max_seq_len}]")
  settings = lora_settings(args)
  engine = Engine(params, cfg, args.weight_version, max_batch=args.max_batch, chunk_steps=args.chunk_steps,
                  batch_window_s=args.batch_window_ms / 1000.0, max_gather_s=args.max_gather_ms / 1000.0,
                  min_batch=args.min_batch_bucket, min_prompt_len=args.min_prompt_bucket,
                  num_slots=context_length, cache_dtype=args.kv_cache_dtype,
                  stop_string_check=stop_string_check(tokenizer), lora=settings)
  weights_root = os.path.realpath(args.weights_root or os.path.dirname(model_dir))
  return ServerState(engine, tokenizer, model_dir, weights_root, cfg.vocab_size, _eos_ids(model_dir),
                     context_length, args.max_prompt_len, random.Random(args.seed), args.weight_version,
                     None if settings is None else adapters_lib.Registry(settings, cfg, engine.set_adapter_slot))


def lora_settings(args: argparse.Namespace) -> "adapters_lib.Settings | None":
  """With --enable-lora: the adapter stack's settings (the engine's stack, the registry's checks)."""
  if not args.enable_lora:
    return None
  if args.max_lora_rank is None or not args.lora_target_modules:
    raise ValueError("--enable-lora needs --max-lora-rank and --lora-target-modules (adapters arrive at run time)")
  return adapters_lib.Settings(args.max_lora_rank, tuple(args.lora_target_modules), args.max_loras_per_batch,
                               args.lora_strict_loading)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description="Embedded SGLang-protocol rollout server (python -m vcpo_jax.serving.server).")
  p.add_argument("--model-path", required=True, help="Hugging Face directory (config.json + safetensors)")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=30000)
  p.add_argument("--weights-root", default=None,
                 help="update_weights_from_disk only loads directories under this (default: the parent of "
                      "--model-path)")
  p.add_argument("--max-batch", type=int, default=64,
                 help="slots of the continuous-batching pool: rows decoded together; queued rows join as "
                      "others finish (the KV cache holds max-batch x context-length entries)")
  p.add_argument("--kv-cache-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                 help="KV cache dtype (default: the model's compute dtype)")
  p.add_argument("--context-length", type=int, default=None,
                 help="as SGLang's (default: the model's max_seq_len): inputs up to context_length - 7 tokens, "
                      "prompt + output capped at context_length - 2")
  p.add_argument("--max-prompt-len", type=int, default=None, help="an extra prompt limit (not in SGLang)")
  p.add_argument("--weight-version", default="v0")
  p.add_argument("--chunk-steps", type=int, default=8,
                 help="decode steps between control points (pause/abort/weight swap take effect there)")
  p.add_argument("--batch-window-ms", type=float, default=5.0,
                 help="gather a batch for this long, and again while requests keep arriving")
  p.add_argument("--max-gather-ms", type=float, default=50.0, help="never gather a batch for longer")
  p.add_argument("--min-batch-bucket", type=int, default=8,
                 help="smallest pool and prefill batch; pool, prefill and prompt sizes are padded to powers of "
                      "two at least these minimums, so jit compiles a few shapes only")
  p.add_argument("--min-prompt-bucket", type=int, default=16)
  p.add_argument("--min-new-bucket", type=int, default=16,
                 help="ignored (the windowed engine's new-token bucket; the pool's cache is context-length long)")
  p.add_argument("--compilation-cache-dir", default=None,
                 help="JAX persistent compilation cache: restarted servers skip the jit compiles")
  p.add_argument("--seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
  p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters loaded at run time (SGLang's flags)")
  p.add_argument("--max-lora-rank", type=int, default=None)
  p.add_argument("--lora-target-modules", nargs="*", default=None, help="q_proj ... down_proj")
  p.add_argument("--max-loras-per-batch", type=int, default=8, help="slots of the adapter stack")
  p.add_argument("--lora-strict-loading", action=argparse.BooleanOptionalAction, default=False,
                 help="refuse adapters with missing or unexpected tensors")
  p.add_argument("--parent-pid", type=int, default=None,
                 help="exit when this process is gone (a trainer killed with SIGKILL leaves no orphan server)")
  return p.parse_args(argv)


def exit_with_parent(pid: int, interval_s: float = 1.0):
  """Watchdog thread: the server's own process exits once `pid` no longer exists."""
  def watch():
    while True:
      time.sleep(interval_s)
      try:
        os.kill(pid, 0)
      except ProcessLookupError:
        print(f"parent process {pid} is gone; exiting", file=sys.stderr, flush=True)
        os._exit(0)
      except PermissionError:
        pass
  threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()
