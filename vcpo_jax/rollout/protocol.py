"""SGLang /generate protocol subset: accepted keys, request and sampling-param validation, error shapes."""
from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any, Callable, Mapping, Sequence

# Keys a real SGLang 0.5.x server accepts inside `sampling_params` (an unknown key is a 400).
SAMPLING_PARAM_KEYS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "n",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "sampling_seed", "min_new_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty",
)
# Top-level /generate keys we understand. `stream` is served as server-sent events.
GENERATE_KEYS = (
    "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "rid", "stream",
)
# Top-level SGLang keys we do not implement but accept when they ask for nothing (null/false/empty).
INERT_KEYS = ("return_hidden_states", "lora_path", "custom_logit_processor", "image_data", "priority",
              "log_metrics", "data_parallel_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room",
              "token_ids_logprob", "modalities", "session_params")
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when the request leaves it out.
FINISH_LENGTH, FINISH_STOP, FINISH_ABORT = "length", "stop", "abort"
PAUSE_MODES = ("abort", "retract", "in_place")


class RequestError(ValueError):
  """A bad request; `body` is the JSON error body to send with HTTP 400."""

  def __init__(self, message: str, body: dict | None = None):
    super().__init__(message)
    self.body = body if body is not None else error_body(message)


def error_body(message: str) -> dict:
  """SGLang's usual 400 shape: {"error": {"message": ...}}."""
  return {"error": {"message": message}}


def unknown_field_error(key: str, expected: Sequence[str]) -> RequestError:
  """SGLang's string-shaped 400 for an unknown key: {"error": "unknown field `k`, expected one of ..."}."""
  msg = f"unknown field `{key}`, expected one of " + ", ".join(f"`{k}`" for k in expected)
  return RequestError(msg, {"error": msg})


def error_message(body: Any) -> str:
  """The human message inside any error shape SGLang (or a router in front of it) sends back."""
  if isinstance(body, Mapping):
    err = body.get("error")
    if isinstance(err, Mapping) and "message" in err:
      return str(err["message"])
    if isinstance(err, str):
      return err
    for key in ("message", "detail"):
      if key in body:
        return str(body[key])
  return str(body)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Validated sampling parameters of one prompt; defaults are SGLang's."""
  max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  min_p: float = 0.0
  min_new_tokens: int = 0
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  n: int = 1
  ignore_eos: bool = False
  skip_special_tokens: bool = True
  spaces_between_special_tokens: bool = True
  no_stop_trim: bool = False
  sampling_seed: int | None = None


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _want_int(field: str, x) -> int:
  if not _is_int(x):
    raise RequestError(f"{field} must be an integer, got {x!r}.")
  return x


def _want_float(field: str, x) -> float:
  if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
    raise RequestError(f"{field} must be a finite number, got {x!r}.")
  return float(x)


def _want_bool(field: str, x) -> bool:
  if not isinstance(x, bool):
    raise RequestError(f"{field} must be a boolean, got {x!r}.")
  return x


def parse_sampling_params(d: Mapping[str, Any] | None, *, vocab_size: int | None = None) -> SamplingParams:
  """Validates one `sampling_params` dict (None means defaults). Raises RequestError naming the field."""
  if d is None:
    d = {}
  if not isinstance(d, Mapping):
    raise RequestError(f"sampling_params must be an object, got {type(d).__name__}.")
  for key in d:
    if key not in SAMPLING_PARAM_KEYS:
      raise unknown_field_error(key, SAMPLING_PARAM_KEYS)
  g = {k: v for k, v in d.items() if v is not None}  # SGLang treats explicit null as "use the default"
  out: dict[str, Any] = {}
  if "max_new_tokens" in g:
    out["max_new_tokens"] = _want_int("max_new_tokens", g["max_new_tokens"])
    if out["max_new_tokens"] < 0:
      raise RequestError(f"max_new_tokens must be at least 0, got {out['max_new_tokens']}.")
  if "temperature" in g:
    out["temperature"] = _want_float("temperature", g["temperature"])
    if out["temperature"] < 0:
      raise RequestError(f"temperature must be non-negative, got {out['temperature']}.")
  if "top_p" in g:
    out["top_p"] = _want_float("top_p", g["top_p"])
    if not 0.0 < out["top_p"] <= 1.0:
      raise RequestError(f"top_p must be in (0, 1], got {out['top_p']}.")
  if "top_k" in g:
    out["top_k"] = _want_int("top_k", g["top_k"])
    if out["top_k"] < 1 and out["top_k"] != -1:
      raise RequestError(f"top_k must be -1 (disable), or at least 1, got {out['top_k']}.")
  if "min_p" in g:
    out["min_p"] = _want_float("min_p", g["min_p"])
    if not 0.0 <= out["min_p"] <= 1.0:
      raise RequestError(f"min_p must be in [0, 1], got {out['min_p']}.")
  if "n" in g:
    out["n"] = _want_int("n", g["n"])
    if out["n"] < 1:
      raise RequestError(f"n must be at least 1, got {out['n']}.")
  max_new = out.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
  if "min_new_tokens" in g:
    out["min_new_tokens"] = _want_int("min_new_tokens", g["min_new_tokens"])
    if not 0 <= out["min_new_tokens"] <= max_new:
      raise RequestError(f"min_new_tokens must be in [0, max_new_tokens={max_new}], "
                         f"got {out['min_new_tokens']}.")
  for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
    if key in g:
      out[key] = _want_bool(key, g[key])
  if "sampling_seed" in g:
    out["sampling_seed"] = _want_int("sampling_seed", g["sampling_seed"])
  if "stop" in g:
    stop = [g["stop"]] if isinstance(g["stop"], str) else g["stop"]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
      raise RequestError(f"stop must be a non-empty string or a list of them, got {g['stop']!r}.")
    out["stop"] = tuple(stop)
  if "stop_token_ids" in g:
    ids = g["stop_token_ids"]
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
      raise RequestError(f"stop_token_ids must be a list of integers, got {ids!r}.")
    if vocab_size is not None:
      check_token_ids(ids, vocab_size, "stop_token_ids")
    out["stop_token_ids"] = tuple(ids)
  for key in ("frequency_penalty", "presence_penalty"):
    if key in g and _want_float(key, g[key]) != 0.0:
      raise RequestError(f"{key} is not supported by this server (only 0.0), got {g[key]!r}.")
  if "repetition_penalty" in g and _want_float("repetition_penalty", g["repetition_penalty"]) != 1.0:
    raise RequestError(f"repetition_penalty is not supported by this server (only 1.0), "
                       f"got {g['repetition_penalty']!r}.")
  return SamplingParams(**out)


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str = "input_ids") -> None:
  """Rejects ids outside [0, vocab_size): a real SGLang server crashes on them instead of answering."""
  for i, t in enumerate(ids):
    if not _is_int(t):
      raise RequestError(f"{field}[{i}] must be an integer token id, got {t!r}.")
    if not 0 <= t < vocab_size:
      raise RequestError(f"{field}[{i}]={t} is out of range [0, {vocab_size}).")


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


def parse_generate_request(body: Any, *, vocab_size: int, max_prompt_len: int, max_total_len: int,
                           encode: Callable[[str], list[int]] | None = None) -> GenerateRequest:
  """Validates a /generate body into token-id prompts and per-prompt params; errors name the field.

  `encode` turns `text` prompts into ids (None: text prompts are refused).
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
  raw_params = _as_list(body.get("sampling_params"), len(prompts), "sampling_params")
  for i, (p, sp) in enumerate(zip(prompts, params)):
    field = "input_ids" if single else f"prompt {i}"
    if len(p) > max_prompt_len:
      raise RequestError(f"{field} has {len(p)} tokens, more than max_prompt_len={max_prompt_len}.")
    if (raw_params[i] or {}).get("max_new_tokens") is None:  # the default shrinks to fit; explicit does not
      sp = params[i] = dataclasses.replace(sp, max_new_tokens=max(0, min(sp.max_new_tokens,
                                                                        max_total_len - len(p))))
    if len(p) + sp.max_new_tokens > max_total_len:
      raise RequestError(
          f"max_new_tokens={sp.max_new_tokens} plus {len(p)} prompt tokens exceeds the maximum context "
          f"length max_total_len={max_total_len}.")
    if start >= len(p):
      raise RequestError(f"logprob_start_len={start} must be smaller than the prompt length {len(p)}.")
  if flags["stream"] and (len(prompts) > 1 or params[0].n > 1):
    raise RequestError("stream is supported for one prompt with n=1 only.")
  return GenerateRequest(prompts, params, rids, single, flags["return_logprob"], start,
                         flags["return_text_in_logprobs"], flags["stream"])
