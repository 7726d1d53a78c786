"""The rollout client against the real embedded server: end to end, resumes across a weight update, a killed server."""
import asyncio
import json
import os
import signal
import urllib.request

import numpy as np
import pytest

from tests import embedded_tiny
from tests import waits
from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.client import client as client_lib

EMBEDDED_ROOT = {}


@pytest.fixture(scope="module")
def embedded_pair(tmp_path_factory):
  base = tmp_path_factory.mktemp("client_e2e")
  model_dir = embedded_tiny.export_tiny(embedded_tiny.tiny_params(0), str(base / "weights" / "v0"))
  cache = os.environ["JAX_COMPILATION_CACHE_DIR"]  # the suite's (conftest.py): shared by every worker
  servers = [embedded_tiny.start_embedded(model_dir, str(base / "weights"), cache, str(base / "logs"))
             for _ in range(2)]
  try:
    for s in servers:
      s.wait_healthy(180)
    EMBEDDED_ROOT["weights"] = str(base / "weights")
    yield servers
  finally:
    for s in servers:
      s.stop()


def _check_real(samples, params, max_new, version=0):
  for s in samples:
    assert len(s.output_ids) == max_new and s.finish_reason == "length"
    assert list(s.token_versions) == [version] * max_new
    ref = embedded_tiny.reference_logprobs(params, s.prompt_ids, s.output_ids)
    np.testing.assert_allclose(s.output_logprobs, ref, atol=2e-4, rtol=0)


@pytest.mark.integration
def test_end_to_end_with_the_embedded_server(embedded_pair):
  urls = [s.url for s in embedded_pair]
  vocab = embedded_tiny.TINY_MODEL["vocab_size"]
  sampling = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=vocab) as client:
      groups = await asyncio.gather(*(client.generate([5, 6, i + 1], sampling, n=3) for i in range(4)))
      again = await client.generate([5, 6, 1], sampling, n=3)
      # The server's input limit (context_length 274 - 6) is a 400: reported at once, never retried.
      with pytest.raises(client_lib.ServerRequestError, match="400.*context length"):
        await client.generate([1] * 268, dict(sampling, max_new_tokens=2))
      return groups, again, client.stats

  groups, again, stats = asyncio.run(run())
  params = embedded_tiny.tiny_params(0)
  for samples in groups:
    _check_real(samples, params, 10)
    assert len({tuple(s.output_ids) for s in samples}) == 3  # seed + i: three different samples
  assert [s.output_ids for s in again] == [s.output_ids for s in groups[0]]  # seeded: reproducible
  assert {s.server_url for g in groups for s in g} == set(urls)  # both servers got work
  assert stats.get("retries", 0) == 0 and stats["samples_completed"] == 15


@pytest.mark.integration
def test_generation_aborted_for_a_weight_update_resumes_on_the_new_weights(embedded_pair):
  """pause(abort) cuts requests short; the client resubmits prompt + partial output, and the resumed part
  runs on the new weights: old tokens match the old params' recompute, new ones the new params'."""
  from vcpo_jax.rollout.servers import publisher as publisher_lib
  urls = [s.url for s in embedded_pair]
  vocab = embedded_tiny.TINY_MODEL["vocab_size"]
  params = {0: embedded_tiny.tiny_params(0), 1: embedded_tiny.tiny_params(1)}
  sampling = {"max_new_tokens": 240, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 21}

  async def pause_all(client, mode):
    replies = await asyncio.gather(*(client.request_json(u, "POST", "/pause_generation", {"mode": mode})
                                     for u in urls))
    return sum(reply["num_paused_requests"] for _, reply in replies)

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=vocab) as client:
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, EMBEDDED_ROOT["weights"], client)
      try:
        for _ in range(5):  # a loaded host may let both generations end before the freeze below: start again
          task = asyncio.create_task(client.generate([4, 5, 6], sampling, n=2))

          async def both_in_engines():
            infos = await asyncio.gather(*(client.request_json(u, "GET", "/get_model_info") for u in urls))
            return task.done() or sum(info["num_in_flight"] for _, info in infos) >= 2

          await waits.async_wait_until(both_in_engines, 300, "both requests in the servers' engines")
          # Frozen in place mid-generation (the reply counts the rows held), then aborted: no timing decides
          # whether the abort finds them.
          if not task.done() and await pause_all(client, "in_place") >= 2:
            break
          await asyncio.gather(*(client.request_json(u, "POST", "/continue_generation", {}) for u in urls))
          await waits.wait_for(task, 300, "generations that ended before the freeze")
        else:
          raise AssertionError("the generations ended before they could be frozen, 5 times")
        await pause_all(client, "abort")
        await pub.publish(params[1], 1)  # pause(in_place) -> update -> continue: the resumed part runs on v1
        return await waits.wait_for(task, 300, "the aborted generations to finish on the new weights"), client.stats
      finally:
        await pub.close()

  samples, stats = asyncio.run(run())
  assert stats["aborted_resumed"] >= 2
  for s in samples:
    v = s.token_versions
    assert s.num_resumes >= 1 and len(v) == 240 and s.finish_reason == "length", (s.num_resumes, v.tolist())
    assert np.all(np.diff(v) >= 0) and set(v.tolist()) <= {0, 1} and v[-1] == 1
    cut = int(np.sum(v == 0))
    np.testing.assert_allclose(s.output_logprobs[:cut],
                               embedded_tiny.reference_logprobs(params[0], s.prompt_ids, s.output_ids[:cut]),
                               atol=2e-4, rtol=0)
    np.testing.assert_allclose(s.output_logprobs[cut:],
                               embedded_tiny.reference_logprobs(params[1], s.prompt_ids, s.output_ids)[cut:],
                               atol=2e-4, rtol=0)


@pytest.mark.integration
def test_server_killed_mid_generation_loses_and_duplicates_nothing(embedded_pair):
  victim, survivor = embedded_pair
  vocab = embedded_tiny.TINY_MODEL["vocab_size"]
  sampling = {"max_new_tokens": 240, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
  prompts = [[9, i + 1] for i in range(6)]

  async def run():
    async with client_lib.RolloutClient([victim.url, survivor.url], vocab_size=vocab,
                                        backoff_base=0.01) as client:
      tasks = [asyncio.create_task(client.generate(p, sampling, n=2)) for p in prompts]
      await waits.async_wait_until(lambda: client.stats["outstanding"][victim.url] >= 6, 300,
                                   "6 requests outstanding at the victim server", interval_s=0.001)
      os.kill(victim.proc.pid, signal.SIGKILL)
      groups = await waits.wait_for(asyncio.gather(*tasks), 300, "every group to finish on the survivor")
      return groups, client.stats

  # Earlier tests may have published newer weights; by convention version v runs tiny_params(v).
  info = json.loads(urllib.request.urlopen(survivor.url + "/get_model_info", timeout=10).read())
  version = protocol.version_from_wire(info["weight_version"])
  groups, stats = asyncio.run(run())
  waits.wait_process(victim.proc, 60, "the SIGKILLed server to exit")
  assert stats["connection_errors"] >= 1 and stats["marked_down"] >= 1
  assert stats["available"][victim.url] is False
  # Every sample completed exactly once, all of those cut off were redone on the survivor.
  assert [len(g) for g in groups] == [2] * 6 and stats["samples_completed"] == 12
  assert sum(s.server_url == survivor.url for g in groups for s in g) >= 6
  params = embedded_tiny.tiny_params(version)
  for prompt, samples in zip(prompts, groups):
    assert all(s.prompt_ids == prompt for s in samples)
    _check_real(samples, params, 240, version)
