"""The /generate exchange (rollout/generate_reply.py): good replies parsed, each broken field named, versions."""
import math

import pytest

from tests import fake_sglang
from vcpo_jax.rollout import generate_reply
from vcpo_jax.rollout import protocol

VOCAB = 64


def _good_body(prompt, n, version="v3"):
  ctx, out, entries = list(prompt), [], []
  for _ in range(n):
    tok, lp = fake_sglang.next_token(ctx + out, VOCAB)
    out.append(tok)
    entries.append([lp, tok, None])
  return {"text": "", "output_ids": out,
          "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(ctx),
                        "completion_tokens": n, "cached_tokens": 0, "weight_version": version,
                        "weight_versions": [{"version": version, "start": 0, "end": n}],
                        "output_token_logprobs": entries, "e2e_latency": 0.01}}


def test_version_mapping_round_trips_and_rejects_garbage():
  for v in (0, 7, 123456):
    assert protocol.version_from_wire(protocol.version_to_wire(v)) == v
  assert protocol.version_to_wire(7) == "v7"
  for bad in ("7", "v", "v-1", "v1.5", "V7", None, 7, "v7 "):
    with pytest.raises(ValueError, match="weight_version"):
      protocol.version_from_wire(bad)
  for bad in (-1, 1.0, True, "v1"):
    with pytest.raises(ValueError, match="weight_version"):
      protocol.version_to_wire(bad)


def test_parse_accepts_a_good_response_and_reads_two_spans():
  body = _good_body([1, 2, 3], 5)
  body["meta_info"]["weight_versions"] = [{"version": "v3", "start": 0, "end": 2},
                                          {"version": "v4", "start": 2, "end": 5}]
  seg = generate_reply.parse_generate_response(body, vocab_size=VOCAB, max_new_tokens=5)
  assert seg.output_ids == body["output_ids"]
  assert seg.logprobs == [e[0] for e in body["meta_info"]["output_token_logprobs"]]
  assert seg.versions == [3, 3, 4, 4, 4] and seg.finish_type == "length"


def _broken(kind):
  body = _good_body([5, 6], 4)
  meta = body["meta_info"]
  entries = meta["output_token_logprobs"]
  if kind == "nan":
    entries[1][0] = float("nan")
  elif kind == "inf":
    entries[1][0] = -math.inf
  elif kind == "positive":
    entries[0][0] = 0.3
  elif kind == "string_logprob":
    entries[0][0] = "-0.1"
  elif kind == "completion_tokens":
    meta["completion_tokens"] = 5
  elif kind == "short_logprobs":
    entries.pop()
  elif kind == "oov":
    body["output_ids"][2] = entries[2][1] = VOCAB
  elif kind == "negative_id":
    body["output_ids"][2] = entries[2][1] = -1
  elif kind == "mismatch":
    entries[3][1] = (entries[3][1] + 1) % VOCAB
  elif kind == "no_version":
    del meta["weight_versions"], meta["weight_version"]
  elif kind == "gap_spans":
    meta["weight_versions"] = [{"version": "v3", "start": 0, "end": 1}, {"version": "v3", "start": 2, "end": 4}]
  elif kind == "short_spans":
    meta["weight_versions"] = [{"version": "v3", "start": 0, "end": 3}]
  elif kind == "bad_version":
    meta["weight_versions"][0]["version"] = "latest"
  elif kind == "finish":
    meta["finish_reason"] = None
  elif kind == "list":
    body = [body]
  elif kind == "float_ids":
    body["output_ids"] = [float(t) for t in body["output_ids"]]
  elif kind == "too_many":
    pass  # checked with max_new_tokens=3 below
  return body


@pytest.mark.parametrize("kind,field", [
    ("nan", "logprob"), ("inf", "logprob"), ("positive", "logprob"), ("string_logprob", "logprob"),
    ("completion_tokens", "length"), ("short_logprobs", "length"), ("oov", "out_of_vocab"),
    ("negative_id", "out_of_vocab"), ("mismatch", "token_mismatch"), ("no_version", "version"),
    ("gap_spans", "version"), ("short_spans", "version"), ("bad_version", "version"),
    ("finish", "finish_reason"), ("list", "shape"), ("float_ids", "shape"), ("too_many", "length")])
def test_parse_rejects_each_broken_field(kind, field):
  max_new = 3 if kind == "too_many" else 4
  with pytest.raises(generate_reply.BadResponseError) as info:
    generate_reply.parse_generate_response(_broken(kind), vocab_size=VOCAB, max_new_tokens=max_new)
  assert info.value.kind == field
  assert isinstance(info.value, ValueError)


def test_parse_falls_back_to_the_older_of_reported_and_dispatched_version():
  body = _good_body([1], 3, version="v5")
  del body["meta_info"]["weight_versions"]
  parse = generate_reply.parse_generate_response
  assert parse(body, vocab_size=VOCAB, max_new_tokens=3).versions == [5, 5, 5]
  assert parse(body, vocab_size=VOCAB, max_new_tokens=3, fallback_version=4).versions == [4, 4, 4]
  del body["meta_info"]["weight_version"]
  assert parse(body, vocab_size=VOCAB, max_new_tokens=3, fallback_version=6).versions == [6, 6, 6]
