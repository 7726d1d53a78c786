"""Tests for the weight publisher against real embedded servers on loopback (exported HF dirs, real updates)."""
import asyncio
import os
import signal
import time

import numpy as np
import pytest

from tests import fake_sglang
from vcpo_jax.rollout import client as client_lib, publisher as publisher_lib

pytestmark = pytest.mark.integration
VOCAB = fake_sglang.TINY_MODEL["vocab_size"]
PARAMS = {}  # version -> params, built once


def _params(version):
  if version not in PARAMS:
    PARAMS[version] = fake_sglang.tiny_params(version)
  return PARAMS[version]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  base = tmp_path_factory.mktemp("publisher")
  init_dir = fake_sglang.export_tiny(_params(0), str(base / "init" / "v0"))
  root = str(base / "weights")
  os.makedirs(root)
  cache = str(tmp_path_factory.getbasetemp() / "jax_cache")
  servers = [fake_sglang.start_embedded(init_dir, root, cache, str(base / "logs")) for _ in range(2)]
  try:
    for s in servers:
      s.wait_healthy(180)
    yield {"servers": servers, "root": root, "init_dir": init_dir, "cache": cache, "logs": str(base / "logs")}
  finally:
    for s in servers:
      s.stop()


def test_export_version_replaces_atomically_and_validates(tmp_path):
  def export(params, out_dir):
    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
      f.write(params)

  path = publisher_lib.export_version(export, "a", str(tmp_path), 3)
  publisher_lib.export_version(export, "b", str(tmp_path), 3)
  assert path == str(tmp_path / "v3") and open(os.path.join(path, "config.json")).read() == "b"
  assert sorted(os.listdir(tmp_path)) == ["v3"]
  with pytest.raises(RuntimeError, match="config.json"):
    publisher_lib.export_version(lambda p, d: os.makedirs(d), None, str(tmp_path), 4)
  assert sorted(os.listdir(tmp_path)) == ["v3"]  # the failed export left nothing behind
  with pytest.raises(ValueError, match="keep_last"):
    publisher_lib.WeightPublisher(export, str(tmp_path), ["http://x"], keep_last=0)


async def _generate(client, prompt, max_new=12, **extra):
  params = {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5, **extra}
  return await client.generate(prompt, params, n=2)


def _check_against_model(samples, version):
  for s in samples:
    assert list(s.token_versions) == [version] * len(s.output_ids)
    ref = fake_sglang.reference_logprobs(_params(version), s.prompt_ids, s.output_ids)
    np.testing.assert_allclose(s.output_logprobs, ref, atol=2e-4, rtol=0)


def test_publish_updates_every_server_and_keeps_last_n(cluster):
  urls = [s.url for s in cluster["servers"]]

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      pub = publisher_lib.WeightPublisher(fake_sglang.export_tiny, cluster["root"], client, keep_last=2)
      try:
        for version in (1, 2, 3):
          assert await pub.publish(_params(version), version) == {u: True for u in urls}
          infos = [await client.request_json(u, "GET", "/get_model_info") for u in urls]
          assert [info["weight_version"] for _, info in infos] == [f"v{version}"] * 2
          assert sorted(os.listdir(cluster["root"])) == [f"v{v}" for v in range(max(1, version - 1), version + 1)]
        with pytest.raises(ValueError, match="version must be >= the last published 3"):
          await pub.publish(_params(1), 1)
        groups = await asyncio.gather(*(_generate(client, [3, 4, 5 + i]) for i in range(4)))
      finally:
        await pub.close()
      return groups, client.stats

  groups, stats = asyncio.run(run())
  for samples in groups:
    _check_against_model(samples, 3)  # the servers really run the params exported as v3
  assert {s.server_url for g in groups for s in g} == set(urls)


def test_update_during_generation_gives_two_version_spans(cluster):
  urls = [s.url for s in cluster["servers"]]

  async def attempt(client, pub, version, delay):
    """Publishes `version` while a long generation made with version - 1 is in flight."""
    long = asyncio.create_task(_generate(client, [7, 8, 9], max_new=240))
    while sum(client.stats["outstanding"].values()) < 2:
      await asyncio.sleep(0.001)
    await asyncio.sleep(delay)
    # Freeze generation now (the export below takes longer than the whole generation would).
    await asyncio.gather(*(client.request_json(u, "POST", "/pause_generation", {"mode": "in_place"})
                           for u in urls))
    await pub.publish(_params(version), version)
    return await long

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      pub = publisher_lib.WeightPublisher(fake_sglang.export_tiny, cluster["root"], client, keep_last=2)
      tries = []
      try:
        await pub.publish(_params(4), 4)
        delay = 0.02
        for version in (5, 6, 7):  # the pause must land mid-generation: adapt the delay if it missed
          samples = await attempt(client, pub, version, delay)
          tries.append((version, samples))
          old = [int(np.sum(s.token_versions == version - 1)) for s in samples]
          if all(0 < n < 240 for n in old):
            break
          delay = delay * 3 if min(old) == 0 else delay / 3
      finally:
        await pub.close()
      return tries

  tries = asyncio.run(run())
  for version, samples in tries:
    for s in samples:
      assert len(s.token_versions) == 240 and np.all(np.diff(s.token_versions) >= 0)
      assert set(s.token_versions.tolist()) <= {version - 1, version}
  version, samples = tries[-1]
  for s in samples:
    switch = int(np.sum(s.token_versions == version - 1))
    assert 0 < switch < 240
    # Tokens before the update are pure old version: the learner's recompute with those params matches.
    ref = fake_sglang.reference_logprobs(_params(version - 1), s.prompt_ids, s.output_ids[:switch])
    np.testing.assert_allclose(s.output_logprobs[:switch], ref, atol=2e-4, rtol=0)
    # After it, the weights changed: the new tokens are not what the old params would give.
    ref_all = fake_sglang.reference_logprobs(_params(version - 1), s.prompt_ids, s.output_ids)
    assert np.abs(s.output_logprobs[switch:] - ref_all[switch:]).max() > 1e-2


def test_failed_server_leaves_rotation_and_is_resynced(cluster):
  a, b = cluster["servers"]

  async def run():
    async with client_lib.RolloutClient([a.url, b.url], vocab_size=VOCAB, health_interval=0.3,
                                        backoff_base=0.01) as client:
      pub = publisher_lib.WeightPublisher(fake_sglang.export_tiny, cluster["root"], client, keep_last=2,
                                          timeout=30, resync_interval=0.3)
      try:
        await pub.publish(_params(8), 8)
        os.kill(b.proc.pid, signal.SIGKILL)
        b.proc.wait()
        assert await pub.publish(_params(9), 9) == {a.url: True, b.url: False}
        assert client.available_urls == [a.url] and b.url in pub.out_of_sync
        while_down = await asyncio.gather(*(_generate(client, [1, 2, i + 1]) for i in range(3)))
        # The same port comes back with its start-up weights (v0): it must not serve until re-synced.
        restarted = fake_sglang.start_embedded(cluster["init_dir"], cluster["root"], cluster["cache"],
                                               cluster["logs"], port=b.port)
        cluster["servers"][1] = restarted
        await asyncio.to_thread(restarted.wait_healthy, 180)
        deadline = time.monotonic() + 60
        while client.available_urls != [a.url, b.url] and time.monotonic() < deadline:
          await asyncio.sleep(0.1)
        _, info = await client.request_json(b.url, "GET", "/get_model_info")
        after = await asyncio.gather(*(_generate(client, [2, 3, i + 1]) for i in range(4)))
        return while_down, after, info, dict(pub.stats), client.available_urls
      finally:
        await pub.close()

  while_down, after, info, stats, available = asyncio.run(run())
  assert all(s.server_url == a.url for g in while_down for s in g)
  for samples in while_down + after:
    _check_against_model(samples, 9)
  assert available == [a.url, b.url] and info["weight_version"] == "v9" and stats["resynced"] >= 1
  assert b.url in {s.server_url for g in after for s in g}
