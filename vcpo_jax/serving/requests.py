"""Server side of /generate: request bodies into token-id prompts and params, with SGLang's context limits."""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Callable, Optional, Sequence

from vcpo_jax.rollout.protocol import (INPUT_MARGIN, TOTAL_MARGIN, RequestError, SamplingParams,
                                       check_token_ids, parse_sampling_params, unknown_field_error)

# Top-level /generate keys we understand. `stream` is served as server-sent events.
GENERATE_KEYS = (
    "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "rid", "stream", "lora_path",
)
# Top-level SGLang keys we do not implement but accept when they ask for nothing (null/false/empty).
INERT_KEYS = ("return_hidden_states", "custom_logit_processor", "image_data", "priority",
              "log_metrics", "data_parallel_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room",
              "token_ids_logprob", "modalities", "session_params")


async def json_body(request) -> Any:
  """An aiohttp request's JSON body ({} when empty); invalid JSON is a RequestError (a 400)."""
  raw = await request.read()
  if not raw.strip():
    return {}
  try:
    return json.loads(raw)
  except json.JSONDecodeError as e:
    raise RequestError(f"request body is not valid JSON: {e}") from None


def weight_version_spans(versions: Sequence[str]) -> list[dict]:
  """Run-length spans [{version, start, end}] of the per-token policy versions."""
  spans: list[dict] = []
  for i, v in enumerate(versions):
    if spans and spans[-1]["version"] == v:
      spans[-1]["end"] = i + 1
    else:
      spans.append({"version": v, "start": i, "end": i + 1})
  return spans


@dataclasses.dataclass
class GenerateRequest:
  """A validated /generate request: prompts as token ids, one SamplingParams per prompt."""
  prompts: list[list[int]]
  params: list[SamplingParams]
  rids: list[str]
  single: bool  # one prompt given as a str / flat id list: answer an object, not a list (if n == 1)
  return_logprob: bool
  logprob_start_len: int
  return_text_in_logprobs: bool
  stream: bool
  lora_paths: list[Optional[str]] = dataclasses.field(default_factory=list)  # per prompt: adapter name or None


def _as_list(value, n: int, field: str) -> list:
  if isinstance(value, list):
    if len(value) != n:
      raise RequestError(f"{field} has {len(value)} entries for {n} prompts.")
    return value
  return [value] * n


def _prompts(body: dict, vocab_size: int, encode: Callable[[str], list[int]] | None
             ) -> tuple[list[list[int]], bool]:
  """Token-id prompts from `input_ids` (wins) or `text`; and whether a single prompt was given."""
  if body.get("input_ids") is not None:
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
      raise RequestError("input_ids must be a non-empty list of token ids or of lists of token ids.")
    single = not isinstance(ids[0], list)
    prompts = [ids] if single else ids
    for i, p in enumerate(prompts):
      field = "input_ids" if single else f"input_ids[{i}]"
      if not isinstance(p, list) or not p:
        raise RequestError(f"{field} must be a non-empty list of token ids.")
      check_token_ids(p, vocab_size, field)
    return prompts, single
  if body.get("text") is not None:
    text = body["text"]
    single = isinstance(text, str)
    texts = [text] if single else text
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
      raise RequestError("text must be a string or a non-empty list of strings.")
    if encode is None:
      raise RequestError("text prompts need a tokenizer; the model directory has no tokenizer.json.")
    prompts = []
    for i, t in enumerate(texts):
      try:
        prompts.append(list(encode(t)))
      except Exception as e:  # tokenizer failures are the text's fault
        raise RequestError(f"text[{i}] cannot be tokenized: {e}") from None
      if not prompts[-1]:
        raise RequestError(f"text[{i}] encodes to no tokens.")
    return prompts, single
  raise RequestError("Either text or input_ids should be provided.")


def parse_generate_request(body: Any, *, vocab_size: int, context_length: int,
                           max_prompt_len: Optional[int] = None,
                           encode: Callable[[str], list[int]] | None = None) -> GenerateRequest:
  """Validates a /generate body into token-id prompts and per-prompt params; errors name the field.

  Limits as SGLang's: an input of context_length - 6 tokens or more is refused, and max_new_tokens is
  capped so that prompt + output <= context_length - 2 (the request then finishes "length").
  `max_prompt_len` is an extra, optional limit of ours. `encode` turns `text` prompts into ids (None:
  text prompts are refused).
  """
  if not isinstance(body, dict):
    raise RequestError("request body must be a JSON object.")
  for key, value in body.items():
    if key in INERT_KEYS:
      if value:
        raise RequestError(f"{key} is not supported by this server, got {value!r}.")
    elif key not in GENERATE_KEYS:
      raise unknown_field_error(key, GENERATE_KEYS)
  prompts, single = _prompts(body, vocab_size, encode)
  params = [parse_sampling_params(d, vocab_size=vocab_size)
            for d in _as_list(body.get("sampling_params"), len(prompts), "sampling_params")]
  rids = _as_list(body.get("rid"), len(prompts), "rid")
  rids = [uuid.uuid4().hex if r is None else r for r in rids]
  if not all(isinstance(r, str) for r in rids):
    raise RequestError(f"rid must be a string or a list of strings, got {body.get('rid')!r}.")
  flags = {}
  for key in ("return_logprob", "return_text_in_logprobs", "stream"):
    flags[key] = body.get(key) or False
    if not isinstance(flags[key], bool):
      raise RequestError(f"{key} must be a boolean, got {body.get(key)!r}.")
  start = body.get("logprob_start_len", -1)
  start = -1 if start is None else start
  if isinstance(start, bool) or not isinstance(start, int) or start < -1:
    raise RequestError(f"logprob_start_len must be an integer >= -1, got {start!r}.")
  if body.get("top_logprobs_num"):
    raise RequestError(f"top_logprobs_num is not supported by this server, got {body['top_logprobs_num']!r}.")
  for i, (p, sp) in enumerate(zip(prompts, params)):
    field = "input_ids" if single else f"prompt {i}"
    if len(p) >= context_length - INPUT_MARGIN:
      raise RequestError(f"The input ({len(p)} tokens, {field}) is longer than the model's context length "
                         f"({context_length} tokens) allows: at most {context_length - INPUT_MARGIN - 1}.")
    if max_prompt_len is not None and len(p) > max_prompt_len:
      raise RequestError(f"{field} has {len(p)} tokens, more than max_prompt_len={max_prompt_len}.")
    cap = context_length - TOTAL_MARGIN - len(p)
    if sp.max_new_tokens > cap:  # silently, as SGLang does: the request ends with "length"
      params[i] = dataclasses.replace(sp, max_new_tokens=cap, min_new_tokens=min(sp.min_new_tokens, cap))
    if start >= len(p):
      raise RequestError(f"logprob_start_len={start} must be smaller than the prompt length {len(p)}.")
  if flags["stream"] and (len(prompts) > 1 or params[0].n > 1):
    raise RequestError("stream is supported for one prompt with n=1 only.")
  lora_paths = _as_list(body.get("lora_path"), len(prompts), "lora_path")
  if not all(p is None or (isinstance(p, str) and p) for p in lora_paths):
    raise RequestError(f"lora_path must be an adapter name or a list of them (one per prompt), "
                       f"got {body.get('lora_path')!r}.")
  return GenerateRequest(prompts, params, rids, single, flags["return_logprob"], start,
                         flags["return_text_in_logprobs"], flags["stream"], lora_paths)
