"""The rollout client against fake servers: bad requests, liveness, retries onto a good server, abort-resume."""
import asyncio
import json
import sys
import urllib.request

import numpy as np
import pytest

from tests import fake_sglang
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import launcher
from vcpo_jax.rollout.client import pool

VOCAB = 64


def _expected(prompt, n):
  """The fake model's uninterrupted continuation, computed here independently of any server."""
  out, lps = [], []
  for _ in range(n):
    tok, lp = fake_sglang.next_token(list(prompt) + out, VOCAB)
    out.append(tok)
    lps.append(lp)
  return out, np.asarray(lps, np.float32)


def test_bad_requests_fail_before_anything_is_sent():
  async def run():
    # Nothing listens on this port: any send would be a connection error, not a ValueError.
    async with client_lib.RolloutClient([f"http://127.0.0.1:{launcher.free_port()}"], vocab_size=VOCAB,
                                        max_prompt_len=8) as client:
      cases = [([1, VOCAB], {"max_new_tokens": 2}, "vocab_size"), ([1, -2], {"max_new_tokens": 2}, "vocab_size"),
               ([], {"max_new_tokens": 2}, "prompt_ids"), ([1.5], {"max_new_tokens": 2}, "prompt_ids"),
               (list(range(9)), {"max_new_tokens": 2}, "max_prompt_len"),
               ([1], {"max_new_tokens": 2, "n": 2}, "n"), ([1], {"temperature": 1.0}, "max_new_tokens"),
               ([1], {"max_new_tokens": 2, "bogus": 1}, "bogus"),
               ([1], {"max_new_tokens": 2, "top_p": 0.0}, "top_p")]
      for prompt, params, field in cases:
        with pytest.raises(ValueError, match=field):
          await client.generate(prompt, params)
      with pytest.raises(ValueError, match="n must"):
        await client.generate([1], {"max_new_tokens": 2}, n=0)
      assert client.stats.get("requests", 0) == 0
  asyncio.run(run())
  with pytest.raises(ValueError, match="vocab_size"):
    client_lib.RolloutClient(["http://x"], vocab_size=0)
  with pytest.raises(ValueError, match="urls"):
    client_lib.RolloutClient(["http://x", "http://x/"], vocab_size=3)


def _start_fake(log_dir, *extra):
  port = launcher.free_port()
  url = f"http://127.0.0.1:{port}"
  argv = [sys.executable, fake_sglang.__file__, "--port", str(port), "--vocab-size", str(VOCAB),
          "--weight-version", "v2", *extra]
  return url, fake_sglang.launch_server(argv, url, log_path=log_dir / f"fake{port}.log")


@pytest.fixture(scope="module")
def fake_pair(tmp_path_factory):
  """Two fake servers on loopback: the first one is told to misbehave, the second stays good."""
  log_dir = tmp_path_factory.mktemp("fake_logs")
  procs, urls = [], []
  for i in range(2):
    port = launcher.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, fake_sglang.__file__, "--port", str(port), "--vocab-size", str(VOCAB),
            "--weight-version", "v2"]
    procs.append(fake_sglang.launch_server(argv, url, log_path=log_dir / f"fake{i}.log"))
    urls.append(url)
  yield urls
  for p in procs:
    fake_sglang.stop_server(p)


@pytest.mark.integration
def test_liveness_uses_model_info_so_a_paused_server_stays_up(fake_pair):
  """SGLang's /health runs a generation (503 after 20 s while paused); /get_model_info answers at once."""
  bad, good = fake_pair

  async def run():
    async with client_lib.RolloutClient([bad, good], vocab_size=VOCAB) as client:
      await client.request_json(bad, "POST", "/pause_generation", {"mode": "in_place"})
      try:
        health, _ = await client.request_json(bad, "GET", "/health")
        await client.check_health()
        return health, client.available_urls, client.stats
      finally:
        await client.request_json(bad, "POST", "/continue_generation", {})

  health, available, stats = asyncio.run(run())
  assert health == 503 and available == [bad, good] and stats.get("marked_down", 0) == 0


@pytest.mark.integration
def test_connection_dropped_on_reuse_is_retried_not_a_dead_server(fake_pair):
  bad, _ = fake_pair
  _set_mode(bad, "drop_connection", count=1)

  async def run():
    async with client_lib.RolloutClient([bad], vocab_size=VOCAB, backoff_base=0.001) as client:
      samples = await client.generate([3, 1], {"max_new_tokens": 4})
      return samples, client.stats

  try:
    (s,), stats = asyncio.run(run())
  finally:
    _set_mode(bad, "good")
  assert stats["stale_connection_retries"] == 1 and stats.get("marked_down", 0) == 0
  assert stats.get("connection_errors", 0) == 0 and s.server_url == bad and s.output_ids == _expected([3, 1], 4)[0]


@pytest.mark.integration
def test_sample_log_records_every_completed_sample(fake_pair, tmp_path):
  _, good = fake_pair
  log = tmp_path / "samples.jsonl"

  async def run():
    async with client_lib.RolloutClient([good], vocab_size=VOCAB, sample_log=str(log)) as client:
      return await client.generate([4, 2], {"max_new_tokens": 3}, n=2)

  samples = asyncio.run(run())
  rows = [json.loads(line) for line in log.read_text().splitlines()]
  assert [r["output_ids"] for r in rows] == [s.output_ids for s in samples]
  assert rows[0]["versions"] == [2, 2, 2] and rows[0]["prompt_ids"] == [4, 2]
  np.testing.assert_allclose(rows[0]["logprobs"], samples[0].output_logprobs, atol=1e-6)


@pytest.mark.integration
def test_resumed_requests_stay_inside_the_context_limits(tmp_path):
  """prompt + partial output can exceed SGLang's input limit although the prompt fit: the client caps every
  segment's max_new_tokens and ends a sample that cannot continue as "length" (never a 400)."""
  url, proc = _start_fake(tmp_path, "--context-length", "40", "--mode", "abort_half")

  async def run():
    async with client_lib.RolloutClient([url], vocab_size=VOCAB, context_length=40,
                                        backoff_base=0.001) as client:
      samples = await asyncio.gather(*(client.generate([1] * n, {"max_new_tokens": 30}) for n in (5, 20, 33)))
      with pytest.raises(ValueError, match="context_length=40"):
        await client.generate([1] * 34, {"max_new_tokens": 1})
      return samples, client.stats

  try:
    samples, stats = asyncio.run(run())
  finally:
    fake_sglang.stop_server(proc)
  for (s,) in samples:
    total = len(s.prompt_ids) + len(s.output_ids)
    assert s.finish_reason == "length" and total <= 38 and s.num_resumes >= 1
    ids, _ = _expected(s.prompt_ids, len(s.output_ids))
    assert s.output_ids == ids
  assert stats["context_capped"] >= 1 and stats.get("retries", 0) == 0


@pytest.mark.integration
def test_raw_logprob_check_tells_scaled_from_raw(tmp_path):
  url, proc = _start_fake(tmp_path)

  async def run():
    async with client_lib.RolloutClient([url], vocab_size=VOCAB) as client:
      await client.check_raw_logprobs(0.7, [1, 2, 3])
      _set_mode(url, "scaled_logprobs")
      with pytest.raises(pool.RolloutError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1"):
        await client.check_raw_logprobs(0.7, [1, 2, 3])
      return client.stats

  try:
    stats = asyncio.run(run())
  finally:
    fake_sglang.stop_server(proc)
  assert stats["raw_logprob_checks"] == 1


def _set_mode(url, mode, count=-1):
  req = urllib.request.Request(url + "/fake/mode", data=json.dumps({"mode": mode, "count": count}).encode(),
                               headers={"Content-Type": "application/json"})
  urllib.request.urlopen(req, timeout=5).read()


def _requests_seen(url):
  return json.loads(urllib.request.urlopen(url + "/fake/stats", timeout=5).read())["generate_requests"]


@pytest.mark.integration
@pytest.mark.parametrize("mode,kind", [
    ("malformed_json", "json"), ("nan_logprob", "logprob"), ("positive_logprob", "logprob"),
    ("wrong_length", "length"), ("oov_ids", "out_of_vocab"), ("token_mismatch", "token_mismatch"),
    ("missing_version", "version"), ("list_body", "shape"), ("http_500", None)])
def test_bad_server_is_counted_and_every_sample_comes_from_the_good_one(fake_pair, mode, kind):
  bad, good = fake_pair
  _set_mode(bad, mode)

  async def run():
    async with client_lib.RolloutClient([bad, good], vocab_size=VOCAB, backoff_base=0.001,
                                        max_failures_in_a_row=1000) as client:
      prompts = [[1, 2, 3], [4, 5], [6]]
      groups = await asyncio.gather(*(client.generate(p, {"max_new_tokens": 6}, n=2) for p in prompts))
      return prompts, groups, client.stats

  before = _requests_seen(bad)
  try:
    prompts, groups, stats = asyncio.run(run())
  finally:
    _set_mode(bad, "good")
  hits_on_bad = _requests_seen(bad) - before
  assert hits_on_bad >= 1  # routing did send it work, so the checks were exercised
  failures = stats["server_errors"] if kind is None else stats["bad_responses"][kind]
  assert failures == hits_on_bad and stats["retries"] == hits_on_bad
  for prompt, samples in zip(prompts, groups):
    assert len(samples) == 2
    ids, lps = _expected(prompt, 6)
    for s in samples:
      assert s.server_url == good and s.output_ids == ids and s.finish_reason == "length"
      np.testing.assert_allclose(s.output_logprobs, lps, rtol=0, atol=1e-7)
      assert s.output_logprobs.dtype == np.float32 and list(s.token_versions) == [2] * 6
  assert stats["samples_completed"] == 6


@pytest.mark.integration
def test_aborted_generation_resumes_to_the_uninterrupted_result(fake_pair):
  bad, good = fake_pair
  _set_mode(bad, "abort_half", count=2)
  _set_mode(good, "abort_half", count=1)

  async def run():
    async with client_lib.RolloutClient([bad, good], vocab_size=VOCAB) as client:
      samples = await client.generate([9, 8, 7], {"max_new_tokens": 16}, n=1)
      return samples, client.stats

  try:
    samples, stats = asyncio.run(run())
  finally:
    _set_mode(bad, "good")
    _set_mode(good, "good")
  ids, lps = _expected([9, 8, 7], 16)
  (s,) = samples
  # Three aborts (16 -> 8 left, 8 -> 4 left, 4 -> 2 left), then a full answer.
  assert s.num_resumes == 3 and stats["aborted_resumed"] == 3
  assert s.output_ids == ids and s.prompt_ids == [9, 8, 7] and s.finish_reason == "length"
  np.testing.assert_allclose(s.output_logprobs, lps, rtol=0, atol=1e-7)
  assert len(s.token_versions) == 16


@pytest.mark.integration
def test_dead_server_is_routed_around_and_counted(fake_pair):
  _, good = fake_pair
  dead = f"http://127.0.0.1:{launcher.free_port()}"

  async def run():
    async with client_lib.RolloutClient([dead, good], vocab_size=VOCAB, backoff_base=0.001) as client:
      samples = await asyncio.gather(*(client.generate([i + 1], {"max_new_tokens": 3}) for i in range(4)))
      await client.check_health()
      return samples, client.stats, client.available_urls

  samples, stats, available = asyncio.run(run())
  assert all(s.server_url == good for (s,) in samples)
  assert stats["connection_errors"] >= 1 and stats["marked_down"] == 1 and available == [good]


@pytest.mark.integration
def test_slow_server_times_out_and_the_sample_is_redone_elsewhere(fake_pair, tmp_path):
  _, good = fake_pair
  port = launcher.free_port()
  slow = f"http://127.0.0.1:{port}"
  argv = [sys.executable, fake_sglang.__file__, "--port", str(port), "--vocab-size", str(VOCAB),
          "--weight-version", "v2", "--token-delay", "0.5"]
  proc = fake_sglang.launch_server(argv, slow, log_path=tmp_path / "slow.log")

  async def run():
    async with client_lib.RolloutClient([slow, good], vocab_size=VOCAB, request_timeout=0.3,
                                        backoff_base=0.001) as client:
      samples = await asyncio.gather(*(client.generate([i + 2], {"max_new_tokens": 4}) for i in range(2)))
      return samples, client.stats

  try:
    samples, stats = asyncio.run(run())
  finally:
    fake_sglang.stop_server(proc)
  assert stats["timeouts"] >= 1 and stats["retries"] == stats["timeouts"]
  for i, (s,) in enumerate(samples):
    assert s.server_url == good and s.output_ids == _expected([i + 2], 4)[0]
