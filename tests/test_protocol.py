"""Request validation of the SGLang protocol subset: what is accepted, and errors that name the field."""
import dataclasses

import pytest

from vcpo_jax.model import sampling_fields
from vcpo_jax.rollout import protocol as P
from vcpo_jax.serving import requests as server_protocol

LIMITS = dict(vocab_size=100, max_prompt_len=8, context_length=22)


def parse(body, **kw):
  return server_protocol.parse_generate_request(body, **{**LIMITS, **kw})


def test_defaults_are_sglangs():
  sp = P.parse_sampling_params(None)
  assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.n) == (128, 1.0, 1.0, -1, 0.0, 1)
  assert P.parse_sampling_params({"temperature": None}).temperature == 1.0  # null means default


def test_wire_params_extend_the_per_row_fields():
  """One definition: every per-row sampling field is a wire key with the same default, parsed as given."""
  row_fields = [f.name for f in dataclasses.fields(sampling_fields.SamplingFields)]
  assert set(row_fields) <= {f.name for f in dataclasses.fields(P.SamplingParams)} <= set(P.SAMPLING_PARAM_KEYS)
  assert sampling_fields.field_values(P.parse_sampling_params(None)) == dataclasses.asdict(
      sampling_fields.SamplingFields())
  given = {"max_new_tokens": 9, "temperature": 0.5, "top_p": 0.75, "top_k": 3, "min_p": 0.25,
           "min_new_tokens": 2, "stop_token_ids": [4, 5], "ignore_eos": True}
  assert sorted(given) == sorted(row_fields)
  assert sampling_fields.field_values(P.parse_sampling_params(given)) == dict(given, stop_token_ids=(4, 5))


def test_single_batch_and_text_prompts():
  one = parse({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
  assert one.single and one.prompts == [[1, 2, 3]] and one.params[0].max_new_tokens == 4
  assert one.logprob_start_len == -1 and not one.return_logprob and len(one.rids[0]) == 32
  many = parse({"input_ids": [[1], [2, 3]], "text": "ignored: input_ids wins", "rid": ["a", "b"],
                "sampling_params": [{"n": 2}, {"temperature": 0}]})
  assert not many.single and many.prompts == [[1], [2, 3]] and many.rids == ["a", "b"]
  assert [p.n for p in many.params] == [2, 1] and many.params[1].temperature == 0.0
  text = parse({"text": ["ab", "c"]}, encode=lambda t: [ord(ch) - 90 for ch in t])
  assert text.prompts == [[7, 8], [9]] and not text.single


def test_context_limits_are_sglangs():
  """SGLang 0.5.23 (measured): input >= context_length - 6 is a 400; prompt + output is silently capped
  at context_length - 2, default or explicit max_new_tokens alike."""
  assert parse({"input_ids": [1] * 5}).params[0].max_new_tokens == 15
  capped = parse({"input_ids": [1] * 5, "sampling_params": {"max_new_tokens": 16, "min_new_tokens": 16}})
  assert (capped.params[0].max_new_tokens, capped.params[0].min_new_tokens) == (15, 15)
  assert parse({"input_ids": [1] * 15}, max_prompt_len=None).params[0].max_new_tokens == 5
  with pytest.raises(P.RequestError, match="context length"):
    parse({"input_ids": [1] * 16}, max_prompt_len=None)


def test_client_side_fit_matches_the_server_limits():
  for input_len in range(1, 25):
    for max_new in (0, 1, 5, 30):
      fit = P.fit_max_new_tokens(input_len, max_new, 22)
      try:
        params = parse({"input_ids": [1] * input_len, "sampling_params": {"max_new_tokens": max_new}},
                       max_prompt_len=None).params[0]
      except P.RequestError:
        assert fit == 0 and input_len > P.max_input_len(22)
        continue
      assert fit == params.max_new_tokens  # what the client asks for is what the server would allow
  assert P.fit_max_new_tokens(100, 7, None) == 7


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": [1], "sampling_params": {"nope": 1}}, "unknown field `nope`"),
    ({"input_ids": [1], "nope": 1}, "unknown field `nope`"),
    ({"input_ids": [1], "lora_path": 5}, "lora_path"),
    ({"input_ids": [1, 100]}, "input_ids[1]=100"),
    ({"input_ids": [[1], []]}, "input_ids[1]"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1] * 9}, "max_prompt_len=8"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params has 1 entries"),
    ({"input_ids": [1], "rid": 5}, "rid"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1, 2], "logprob_start_len": 2}, "logprob_start_len=2"),
    ({"input_ids": [1], "top_logprobs_num": 3}, "top_logprobs_num"),
    ({"input_ids": [1], "stream": True, "sampling_params": {"n": 2}}, "stream"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"min_p": 1.5}}, "min_p"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "n must be at least 1"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [100]}}, "stop_token_ids[0]=100"),
    ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}}, "min_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}}, "temperature"),
    ({"text": "abc"}, "tokenizer"),
    ({}, "Either text or input_ids"),
])
def test_bad_requests_name_the_field(body, needle):
  with pytest.raises(P.RequestError) as e:
    parse(body)
  assert needle in str(e.value)
  assert needle in P.error_message(e.value.body)  # whichever of the two shapes it uses


def test_error_message_reads_every_shape():
  assert P.error_message({"error": {"message": "a"}}) == "a"
  assert P.error_message({"error": "b"}) == "b"
  assert P.error_message({"object": "error", "message": "c", "type": "Bad Request", "code": 400}) == "c"
  assert P.error_message({"detail": "Not Found"}) == "Not Found"


def test_weight_version_spans():
  assert server_protocol.weight_version_spans([]) == []
  assert server_protocol.weight_version_spans(["v1", "v1", "v2"]) == [{"version": "v1", "start": 0, "end": 2},
                                                         {"version": "v2", "start": 2, "end": 3}]
