"""The SGLang wire format both ways: sampling params, versions, context limits, error shapes."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Optional, Sequence

from vcpo_jax.model import sampling_fields

# Keys a real SGLang 0.5.x server accepts inside `sampling_params` (an unknown key is a 400).
SAMPLING_PARAM_KEYS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "n",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "sampling_seed", "min_new_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty",
)
DEFAULT_MAX_NEW_TOKENS = sampling_fields.SamplingFields.max_new_tokens  # SGLang's default when left out.
FINISH_LENGTH, FINISH_STOP, FINISH_ABORT = "length", "stop", "abort"
PAUSE_MODES = ("abort", "retract", "in_place")
FINISH_TYPES = (FINISH_LENGTH, FINISH_STOP, FINISH_ABORT)
# SGLang 0.5.23 context limits (measured): an input of context_length - 6 tokens or more is a 400, and a
# request is silently capped at context_length - 2 tokens in total (prompt + output), finishing "length".
INPUT_MARGIN, TOTAL_MARGIN = 6, 2
# Servers compute log-softmax in float32; the sampled token's logprob can round to a hair above 0.
LOGPROB_TOLERANCE = 1e-4
# update_weights_from_disk's 400 when the weights WERE applied but the prefix cache could not be flushed.
CACHE_NOT_FLUSHED = "cache was not flushed"
_VERSION_RE = re.compile(r"v([0-9]+)")
ADAPTER_PREFIX = "policy-"  # LoRA adapters load as policy-v<version>


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams(sampling_fields.SamplingFields):
  """Validated sampling parameters of one prompt: the per-row fields plus the request-level ones; defaults
  are SGLang's."""
  stop: tuple[str, ...] = ()
  n: int = 1
  skip_special_tokens: bool = True
  spaces_between_special_tokens: bool = True
  no_stop_trim: bool = False
  sampling_seed: int | None = None


def is_int(x) -> bool:
  """An int that is not a bool (JSON true/false arrive as bools)."""
  return isinstance(x, int) and not isinstance(x, bool)


def _want_int(field: str, x) -> int:
  if not is_int(x):
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
    if not isinstance(ids, list) or not all(is_int(i) for i in ids):
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
    if not is_int(t):
      raise RequestError(f"{field}[{i}] must be an integer token id, got {t!r}.")
    if not 0 <= t < vocab_size:
      raise RequestError(f"{field}[{i}]={t} is out of range [0, {vocab_size}).")


# -- versions and context limits ---------------------------------------------------------------------------
def version_to_wire(version: int) -> str:
  """Learner versions are ints; SGLang's weight_version is a string: 7 <-> "v7" (the one mapping)."""
  if isinstance(version, bool) or not hasattr(version, "__index__") or version < 0:
    raise ValueError(f"weight_version must be a non-negative int, got {version!r}")
  return f"v{int(version)}"


def version_from_wire(text: Any) -> int:
  match = _VERSION_RE.fullmatch(text) if isinstance(text, str) else None
  if match is None:
    raise ValueError(f"weight_version must look like 'v<int>', got {text!r}")
  return int(match.group(1))


def adapter_name(version: int) -> str:
  """A learner version's LoRA adapter name, never reused: 12 <-> "policy-v12"."""
  return f"{ADAPTER_PREFIX}{version_to_wire(version)}"


def adapter_version(name: Any) -> int:
  if not isinstance(name, str) or not name.startswith(ADAPTER_PREFIX):
    raise ValueError(f"a LoRA adapter name must look like '{ADAPTER_PREFIX}v<int>', got {name!r}")
  return version_from_wire(name[len(ADAPTER_PREFIX):])


def max_input_len(context_length: int) -> int:
  """The longest input (prompt, or prompt + partial output when resuming) a server accepts."""
  return context_length - INPUT_MARGIN - 1


def fit_max_new_tokens(input_len: int, max_new_tokens: int, context_length: Optional[int]) -> int:
  """max_new_tokens capped so that the request fits the server's limits; 0 means it cannot be sent."""
  if context_length is None:
    return max_new_tokens
  if input_len > max_input_len(context_length):
    return 0
  return max(0, min(max_new_tokens, context_length - TOTAL_MARGIN - input_len))
