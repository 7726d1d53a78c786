"""The /generate exchange, client side: the request body sent and the validated reply (tokens, logprobs, versions)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from vcpo_jax.rollout import protocol


class BadResponseError(ValueError):
  """A response that breaks the protocol; `kind` names the broken field (used as a stats key)."""

  def __init__(self, kind: str, message: str):
    super().__init__(f"bad /generate response ({kind}): {message}")
    self.kind = kind


@dataclasses.dataclass
class Segment:
  """The validated content of one /generate response."""
  output_ids: list[int]
  logprobs: list[float]
  versions: list[int]
  finish_type: str


def generate_payload(input_ids: list[int], sampling_params: dict, rid: str,
                     lora_path: Optional[str] = None) -> dict:
  """The /generate body the client sends: token ids in, per-token logprobs and version spans out; with
  `lora_path`, the LoRA adapter (its name) that serves the request."""
  body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True, "rid": rid}
  if lora_path is not None:
    body["lora_path"] = lora_path
  return body


def _parse_versions(meta: dict, n: int, fallback: Optional[int]) -> list[int]:
  spans = meta.get("weight_versions")
  if spans is None:
    # Client-side tagging for servers without spans: the older of the reported and dispatched versions.
    candidates = [] if fallback is None else [fallback]
    if meta.get("weight_version") is not None:
      try:
        candidates.append(protocol.version_from_wire(meta["weight_version"]))
      except ValueError as e:
        raise BadResponseError("version", str(e)) from None
    if not candidates:
      raise BadResponseError("version", "meta_info has neither weight_versions nor weight_version")
    return [min(candidates)] * n
  if not isinstance(spans, list):
    raise BadResponseError("version", f"weight_versions must be a list, got {spans!r:.200}")
  versions, cursor = [], 0
  for span in spans:
    if not isinstance(span, dict) or not all(protocol.is_int(span.get(k)) for k in ("start", "end")):
      raise BadResponseError("version", f"weight_versions span needs int start/end, got {span!r:.200}")
    if span["start"] != cursor or span["end"] < span["start"]:
      raise BadResponseError("version", f"weight_versions spans must tile [0, {n}), got {spans!r:.300}")
    try:
      version = protocol.version_from_wire(span.get("version"))
    except ValueError as e:
      raise BadResponseError("version", str(e)) from None
    versions.extend([version] * (span["end"] - span["start"]))
    cursor = span["end"]
  if cursor != n:
    raise BadResponseError("version", f"weight_versions cover {cursor} tokens, output has {n}")
  return versions


def _parse_logprobs(entries: Any, ids: list[int]) -> list[float]:
  n = len(ids)
  if not isinstance(entries, list) or len(entries) != n:
    got = len(entries) if isinstance(entries, list) else repr(entries)[:100]
    raise BadResponseError("length", f"output_token_logprobs has {got} entries, output_ids has {n}")
  logprobs = []
  for i, entry in enumerate(entries):
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
      raise BadResponseError("logprob", f"output_token_logprobs[{i}]={entry!r:.100} is not [lp, id, ...]")
    lp, tok = entry[0], entry[1]
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
      raise BadResponseError("logprob", f"output_token_logprobs[{i}][0]={lp!r} is not a finite number")
    if lp > protocol.LOGPROB_TOLERANCE:
      raise BadResponseError("logprob", f"output_token_logprobs[{i}][0]={lp!r} is > 0")
    if tok != ids[i]:
      raise BadResponseError("token_mismatch", f"output_token_logprobs[{i}][1]={tok!r} != output_ids[{i}]={ids[i]}")
    logprobs.append(min(float(lp), 0.0))
  return logprobs


def parse_generate_response(body: Any, *, vocab_size: int, max_new_tokens: int,
                            fallback_version: Optional[int] = None) -> Segment:
  """Validates one single-prompt /generate response; raises BadResponseError naming the field."""
  if not isinstance(body, dict):
    raise BadResponseError("shape", f"expected a JSON object, got {type(body).__name__}")
  ids, meta = body.get("output_ids"), body.get("meta_info")
  if not isinstance(ids, list) or not all(protocol.is_int(t) for t in ids):
    raise BadResponseError("shape", f"output_ids must be a list of ints, got {ids!r:.200}")
  if not isinstance(meta, dict):
    raise BadResponseError("shape", f"meta_info must be an object, got {meta!r:.200}")
  n = len(ids)
  bad_ids = [t for t in ids if not 0 <= t < vocab_size]
  if bad_ids:
    raise BadResponseError("out_of_vocab", f"output_ids {bad_ids[:5]} outside [0, {vocab_size})")
  if n > max_new_tokens:
    raise BadResponseError("length", f"{n} output_ids but max_new_tokens was {max_new_tokens}")
  if meta.get("completion_tokens") != n:
    raise BadResponseError(
        "length", f"completion_tokens={meta.get('completion_tokens')!r} but len(output_ids)={n}")
  logprobs = _parse_logprobs(meta.get("output_token_logprobs"), ids)
  finish = meta.get("finish_reason")
  if not isinstance(finish, dict) or finish.get("type") not in protocol.FINISH_TYPES:
    raise BadResponseError(
        "finish_reason", f"finish_reason must have type in {protocol.FINISH_TYPES}, got {finish!r:.200}")
  versions = _parse_versions(meta, n, fallback_version)
  return Segment(ids, logprobs, versions, finish["type"])
