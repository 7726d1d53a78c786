"""The embedded SGLang-protocol server as a real process on loopback: weight updates, pause, retract and abort
while requests run, and the project's client resuming against it, checked against the model itself."""
import time

import numpy as np
import pytest

from tests import waits
from tests.server_harness import LONG, PROMPT, long_request, ref_greedy, ref_logprobs, spans_and_prefix_logprobs

pytestmark = pytest.mark.integration  # every test here talks to (or starts) a server process


def test_update_weights_changes_outputs_and_version(server):
  greedy = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
  before = server.generate(greedy)
  status, out = server.call("POST", "/update_weights_from_disk",
                            {"model_path": server.dirs["outside"], "weight_version": "bad"})
  assert status == 400 and out["success"] is False and "outside the weights root" in out["message"]
  status, out = server.call("POST", "/update_weights_from_disk",
                            {"model_path": server.dirs["m0"] + "/../nope", "weight_version": "bad"})
  assert status == 400 and out["success"] is False
  assert server.info()["weight_version"] == "v0"
  try:
    server.use_weights("m1", "v1")
    after = server.generate(greedy)
    assert server.info()["weight_version"] == "v1"
    assert after["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 10}]
    assert after["output_ids"] != before["output_ids"]
    assert after["output_ids"] == ref_greedy(server.params["m1"], PROMPT, 10)
    np.testing.assert_allclose([e[0] for e in after["meta_info"]["output_token_logprobs"]],
                               ref_logprobs(server.params["m1"], PROMPT, after["output_ids"]),
                               atol=1e-5, rtol=0)
  finally:
    server.use_weights("m0", "v0")


def test_update_with_flush_while_requests_run_is_sglangs_400(server):
  """SGLang 0.5.23: the default flush_cache with a request in flight answers 400 "cache was not flushed",
  yet the new weights ARE live (new tokens carry v1) while /get_model_info still reports v0."""
  fut = long_request(server, "unflushed")
  try:
    assert server.call("POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    status, out = server.call("POST", "/update_weights_from_disk",
                              {"model_path": server.dirs["m1"], "weight_version": "v1"})
    assert status == 400 and out["success"] is False and "cache was not flushed" in out["message"]
    assert server.info()["weight_version"] == "v0"
    assert server.call("POST", "/flush_cache")[0] == 400  # only when idle
  finally:
    assert server.call("POST", "/continue_generation", {})[0] == 200
  out = fut.result(timeout=120)
  assert [s["version"] for s in out["meta_info"]["weight_versions"]] == ["v0", "v1"]
  assert server.info()["weight_version"] == "v0" and server.call("POST", "/flush_cache")[0] == 200
  server.use_weights("m0", "v0")


def test_pause_in_place_update_continue_gives_two_spans(server):
  fut = long_request(server, "straddle")
  try:
    status, out = server.call("POST", "/pause_generation", {"mode": "in_place"})
    assert status == 200 and out["num_paused_requests"] == 1
    held = server.info()["num_generated_tokens"]
    time.sleep(0.2)
    assert server.info()["num_generated_tokens"] == held and not fut.done()  # really paused
    server.use_weights("m1", "v1", flush_cache=False)
  finally:
    assert server.call("POST", "/continue_generation", {})[0] == 200
  out = fut.result(timeout=120)
  spans = spans_and_prefix_logprobs(server, out)
  assert len(out["output_ids"]) == LONG and out["meta_info"]["finish_reason"]["type"] == "length"
  assert [s["version"] for s in spans] == ["v0", "v1"]
  assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < LONG and spans[1]["end"] == LONG
  server.use_weights("m0", "v0")


def test_retract_resumes_the_same_random_stream(server):
  plain = server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True,
                                                                    "sampling_seed": 9}})
  fut = long_request(server, "retracted", seed=9)
  try:
    assert server.call("POST", "/pause_generation", {"mode": "retract"})[0] == 200
  finally:
    assert server.call("POST", "/continue_generation", {})[0] == 200
  out = fut.result(timeout=120)
  assert out["output_ids"] == plain["output_ids"]
  assert out["meta_info"]["weight_versions"] == [{"version": "v0", "start": 0, "end": LONG}]


def test_abort_returns_partial_output(server):
  fut = long_request(server, "doomed")
  assert server.call("POST", "/abort_request", {"rid": "doomed"})[0] == 200
  out = fut.result(timeout=60)
  meta = out["meta_info"]
  assert meta["finish_reason"]["type"] == "abort"
  assert 0 < len(out["output_ids"]) < LONG
  assert len(meta["output_token_logprobs"]) == len(out["output_ids"]) == meta["completion_tokens"]
  spans_and_prefix_logprobs(server, out)
  # Pause in abort mode aborts whatever is running, too.
  fut = long_request(server, "doomed-too")
  try:
    assert server.call("POST", "/pause_generation", {"mode": "abort"})[0] == 200
    assert fut.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
  finally:
    server.call("POST", "/continue_generation", {})


def test_update_without_pause_waits_for_in_flight(server):
  fut = long_request(server, "finish-first")
  try:
    server.use_weights("m1", "v1")
    out = fut.result(timeout=60)
    # Had the update not waited, the tail of the request would carry v1.
    assert out["meta_info"]["weight_versions"] == [{"version": "v0", "start": 0, "end": LONG}]
  finally:
    server.use_weights("m0", "v0")


def test_rollout_client_against_embedded_server(server):
  """The project's client (abort-resume included) speaks to this server end to end."""
  import asyncio
  from vcpo_jax.rollout.client import client as client_lib

  async def run():
    async with client_lib.RolloutClient([server.url], vocab_size=128) as c:
      short = await c.generate(PROMPT, {"max_new_tokens": 8, "sampling_seed": 3, "ignore_eos": True}, n=2)
      start = (await asyncio.to_thread(server.info))["num_generated_tokens"]
      task = asyncio.create_task(
          c.generate(PROMPT, {"max_new_tokens": LONG, "sampling_seed": 4, "ignore_eos": True}))
      async def first_token_out():
        assert not task.done(), "the long request finished before its first token was seen"
        return (await asyncio.to_thread(server.info))["num_generated_tokens"] - start >= 1

      await waits.async_wait_until(first_token_out, 60, "the long request's first token", interval_s=0.005)
      assert (await asyncio.to_thread(server.call, "POST", "/abort_request", {"abort_all": True}))[0] == 200
      return short, (await waits.wait_for(task, 120, "the aborted request to resume and finish"))[0]

  short, resumed = asyncio.run(run())
  params = server.params["m0"]
  assert resumed.num_resumes >= 1 and len(resumed.output_ids) == LONG
  for s in short + [resumed]:
    assert s.finish_reason == "length" and set(s.token_versions.tolist()) == {0}
    np.testing.assert_allclose(s.output_logprobs, ref_logprobs(params, PROMPT, s.output_ids),
                               atol=1e-5, rtol=0)
