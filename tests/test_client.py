"""Tests for the rollout client: response validation, retries onto a good server, abort-resume, versions."""
import asyncio
import json
import math
import os
import signal
import sys
import urllib.request

import numpy as np
import pytest

from tests import embedded_tiny, fake_sglang
from tests import waits
from vcpo_jax.rollout import generate_reply
from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import launcher
from vcpo_jax.rollout.client import pool

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


def _expected(prompt, n):
  """The fake model's uninterrupted continuation, computed here independently of any server."""
  out, lps = [], []
  for _ in range(n):
    tok, lp = fake_sglang.next_token(list(prompt) + out, VOCAB)
    out.append(tok)
    lps.append(lp)
  return out, np.asarray(lps, np.float32)


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


# -- against the real embedded server (python -m vcpo_jax.serving.server) ---------------------------------
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

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=vocab) as client:
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, EMBEDDED_ROOT["weights"], client)
      try:
        task = asyncio.create_task(client.generate([4, 5, 6], sampling, n=2))
        # Both requests must be inside the servers' engines (else the pause finds nothing to abort).
        async def both_in_engines():
          assert not task.done(), "the generations ended before both were seen in the servers' engines"
          infos = await asyncio.gather(*(client.request_json(u, "GET", "/get_model_info") for u in urls))
          return sum(info["num_in_flight"] for _, info in infos) >= 2

        await waits.async_wait_until(both_in_engines, 300, "both requests in the servers' engines")
        await asyncio.sleep(0.02)
        await asyncio.gather(*(client.request_json(u, "POST", "/pause_generation", {"mode": "abort"})
                               for u in urls))
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
