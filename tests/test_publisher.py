"""Tests for the weight publisher against real embedded servers on loopback (exported HF dirs, real updates)."""
import asyncio
import os
import signal

import numpy as np
import pytest

from tests import embedded_tiny
from tests import waits
from vcpo_jax.model import config as model_config
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import publisher as publisher_lib
from vcpo_jax.rollout.servers import weight_store

pytestmark = pytest.mark.integration
VOCAB = embedded_tiny.TINY_MODEL["vocab_size"]
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  with embedded_tiny.embedded_cluster(str(tmp_path_factory.mktemp("publisher"))) as c:
    yield c


def test_export_version_replaces_atomically_and_validates(tmp_path):
  def export(params, out_dir):
    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
      f.write(params)

  path = weight_store.export_version(export, "a", str(tmp_path), 3)
  weight_store.export_version(export, "b", str(tmp_path), 3)
  assert path == str(tmp_path / "v3") and open(os.path.join(path, "config.json")).read() == "b"
  assert sorted(os.listdir(tmp_path)) == ["v3"]
  with pytest.raises(RuntimeError, match="config.json"):
    weight_store.export_version(lambda p, d: os.makedirs(d), None, str(tmp_path), 4)
  assert sorted(os.listdir(tmp_path)) == ["v3"]  # the failed export left nothing behind
  with pytest.raises(ValueError, match="keep_last"):
    publisher_lib.WeightPublisher(export, str(tmp_path), ["http://x"], keep_last=0)


async def _generate(client, prompt, max_new=12, **extra):
  params = {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5, **extra}
  return await client.generate(prompt, params, n=2)


def test_publish_updates_every_server_and_keeps_last_n(cluster):
  urls = [s.url for s in cluster["servers"]]

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, cluster["root"], client, keep_last=2)
      try:
        for version in (1, 2, 3):
          assert await pub.publish(embedded_tiny.tiny_version(version), version) == {u: True for u in urls}
          infos = [await client.request_json(u, "GET", "/get_model_info") for u in urls]
          assert [info["weight_version"] for _, info in infos] == [f"v{version}"] * 2
          assert sorted(os.listdir(cluster["root"])) == [f"v{v}" for v in range(max(1, version - 1), version + 1)]
        with pytest.raises(ValueError, match="version must be >= the last published 3"):
          await pub.publish(embedded_tiny.tiny_version(1), 1)
        groups = await asyncio.gather(*(_generate(client, [3, 4, 5 + i]) for i in range(4)))
      finally:
        await pub.close()
      return groups, client.stats

  groups, stats = asyncio.run(run())
  for samples in groups:
    embedded_tiny.assert_served_by(samples, 3)  # the servers really run the params exported as v3
  assert {s.server_url for g in groups for s in g} == set(urls)


def test_update_during_generation_tags_every_token_with_the_weights_that_made_it(cluster):
  """Requests in flight when an update comes are cut (pause abort) and resumed on the new weights: each
  token's log-prob is the recompute under the params its version tag names. (The old publisher's
  pause(in_place) + update with the default flush_cache gets SGLang's 400 here: the embedded server is
  now as strict, so this test fails against it.)"""
  urls = [s.url for s in cluster["servers"]]

  async def attempt(client, pub, version, delay):
    """Publishes `version` while a long generation made with version - 1 is in flight."""
    long = asyncio.create_task(_generate(client, [7, 8, 9], max_new=240))
    await waits.async_wait_until(lambda: sum(client.stats["outstanding"].values()) >= 2, 120,
                                 "the long generation's 2 requests outstanding", interval_s=0.001)
    await asyncio.sleep(delay)
    # Freeze generation now (the export below takes longer than the whole generation would).
    await asyncio.gather(*(client.request_json(u, "POST", "/pause_generation", {"mode": "in_place"})
                           for u in urls))
    await pub.publish(embedded_tiny.tiny_version(version), version)
    return await waits.wait_for(long, 300, "the long generation to finish after the update")

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, cluster["root"], client, keep_last=2)
      tries = []
      try:
        await pub.publish(embedded_tiny.tiny_version(4), 4)
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
      return tries, client.stats, pub.stats

  tries, stats, pub_stats = asyncio.run(run())
  for version, samples in tries:
    for s in samples:
      assert len(s.token_versions) == 240 and np.all(np.diff(s.token_versions) >= 0)
      assert set(s.token_versions.tolist()) <= {version - 1, version}
  version, samples = tries[-1]
  for s in samples:
    switch = int(np.sum(s.token_versions == version - 1))
    assert 0 < switch < 240 and s.num_resumes >= 1
    old = embedded_tiny.reference_logprobs(embedded_tiny.tiny_version(version - 1), s.prompt_ids, s.output_ids[:switch])
    np.testing.assert_allclose(s.output_logprobs[:switch], old, atol=2e-4, rtol=0)
    new = embedded_tiny.reference_logprobs(embedded_tiny.tiny_version(version), s.prompt_ids, s.output_ids)[switch:]
    np.testing.assert_allclose(s.output_logprobs[switch:], new, atol=2e-4, rtol=0)
  assert stats["aborted_resumed"] >= 2 and pub_stats["server_failures"] == 0
  assert stats["publish_published"] == len(tries) + 1 and len(pub_stats) and stats["publish_last_pause_s"] > 0


def test_update_with_other_shapes_is_refused_before_it_is_sent(cluster, tmp_path):
  """SGLang accepts an update with other shapes (success: true) and serves garbage: refuse it first."""
  import dataclasses
  from vcpo_jax.model import hf_export
  from vcpo_jax.model import tokenizer
  from vcpo_jax.model import transformer as model
  urls = [s.url for s in cluster["servers"]]
  wide = dataclasses.replace(model_config.ModelConfig(**embedded_tiny.TINY_MODEL), intermediate_size=128)

  def export_wide(params, out_dir):
    import jax
    hf_export.export_hf(model.init_params(wide, jax.random.PRNGKey(0)), wide, out_dir, tokenizer.build_tokenizer())

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      before = [(await client.request_json(u, "GET", "/get_model_info"))[1]["weight_version"] for u in urls]
      pub = publisher_lib.WeightPublisher(export_wide, str(tmp_path / "w"), client)
      try:
        with pytest.raises(publisher_lib.PublishError, match="intermediate_size=128.*has 64"):
          await pub.publish(None, 50)
      finally:
        await pub.close()
      after = [(await client.request_json(u, "GET", "/get_model_info"))[1]["weight_version"] for u in urls]
      return before, after, pub.stats

  before, after, stats = asyncio.run(run())
  assert before == after and stats["refused_shapes"] == 1 and stats["server_failures"] == 0
  assert os.listdir(tmp_path / "w") == []  # the refused export is removed


def _wide_export(intermediate_size=128):
  """An exporter of the tiny model with another MLP width (the shapes a served tiny model refuses)."""
  import dataclasses
  from vcpo_jax.model import hf_export
  from vcpo_jax.model import tokenizer
  wide = dataclasses.replace(model_config.ModelConfig(**embedded_tiny.TINY_MODEL), intermediate_size=intermediate_size)

  def export(params, out_dir):
    import jax
    from vcpo_jax.model import transformer as model
    hf_export.export_hf(model.init_params(wide, jax.random.PRNGKey(0)), wide, out_dir, tokenizer.build_tokenizer())
  return export


def _files(path):
  return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def test_refused_republish_keeps_the_last_good_directory_and_resync_sends_it(cluster):
  """A refused publish of an already published version neither overwrites root/vN nor stays on
  disk, and a server re-synced afterwards gets the good vN (log-probs of the published params)."""
  a, b = cluster["servers"]
  root, exporter = cluster["root"], {"fn": embedded_tiny.export_tiny}

  async def run():
    async with client_lib.RolloutClient([a.url, b.url], vocab_size=VOCAB) as client:
      pub = publisher_lib.WeightPublisher(lambda p, d: exporter["fn"](p, d), root, client, keep_last=2,
                                          resync_interval=3600)
      try:
        assert await pub.publish(embedded_tiny.tiny_version(10), 10) == {a.url: True, b.url: True}
        good = _files(os.path.join(root, "v10"))
        exporter["fn"] = _wide_export()
        with pytest.raises(publisher_lib.PublishError, match="intermediate_size=128.*has 64"):
          await pub.publish(None, 10)
        after_refusal, leftovers = _files(os.path.join(root, "v10")), os.listdir(root)
        pub.out_of_sync[b.url] = "injected: missed v10"  # as a server that was down during the update
        back = await pub.resync()
        samples = await asyncio.gather(*(_generate(client, [4, 5, 6 + i]) for i in range(4)))
        return good, after_refusal, leftovers, back, samples, dict(pub.stats)
      finally:
        await pub.close()

  good, after_refusal, leftovers, back, samples, stats = asyncio.run(run())
  assert after_refusal == good and not [n for n in leftovers if n.startswith(".")]
  assert back == [b.url] and stats["refused_shapes"] == 1
  for group in samples:
    embedded_tiny.assert_served_by(group, 10)  # both servers, b included, run the good v10
  assert b.url in {s.server_url for g in samples for s in g}
  # Exported files are readable by a server running as another user.
  for name in good:
    assert os.stat(os.path.join(root, "v10", name)).st_mode & 0o777 == 0o644, name


def test_servers_serving_another_model_are_refused_at_start(cluster, tmp_path):
  """Embedded: the reference is the job's own starting weights, and a server whose model
  differs from them (here its model_path, readable) is refused before anything is published."""
  urls = [s.url for s in cluster["servers"]]
  reference = str(tmp_path / "start")
  _wide_export()(None, reference)

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, str(tmp_path / "w"), client,
                                          reference_dir=reference)
      try:
        with pytest.raises(publisher_lib.PublishError) as refused:
          await pub.check_servers()
        same = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, str(tmp_path / "w2"), client,
                                             reference_dir=cluster["init_dir"])
        await same.check_servers()  # the model they do serve passes
        await same.close()
        return str(refused.value)
      finally:
        await pub.close()

  message = asyncio.run(run())
  assert "\n" not in message and all(u in message for u in urls)
  assert "intermediate_size=64, the starting weights have 128" in message
  with pytest.raises(ValueError, match="reference_dir='/nonexistent'"):
    publisher_lib.WeightPublisher(embedded_tiny.export_tiny, str(tmp_path / "w3"), urls, reference_dir="/nonexistent")


def test_failed_server_leaves_rotation_and_is_resynced(cluster):
  a, b = cluster["servers"]

  async def run():
    async with client_lib.RolloutClient([a.url, b.url], vocab_size=VOCAB, health_interval=0.3,
                                        backoff_base=0.01) as client:
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, cluster["root"], client, keep_last=2,
                                          timeout=30, resync_interval=0.3)
      try:
        await pub.publish(embedded_tiny.tiny_version(8), 8)
        os.kill(b.proc.pid, signal.SIGKILL)
        waits.wait_process(b.proc, 60, "the SIGKILLed server to exit")
        assert await pub.publish(embedded_tiny.tiny_version(9), 9) == {a.url: True, b.url: False}
        assert client.available_urls == [a.url] and b.url in pub.out_of_sync
        while_down = await asyncio.gather(*(_generate(client, [1, 2, i + 1]) for i in range(3)))
        # The same port comes back with its start-up weights (v0): it must not serve until re-synced.
        restarted = embedded_tiny.start_embedded(cluster["init_dir"], cluster["root"], cluster["cache"],
                                               cluster["logs"], port=b.port)
        cluster["servers"][1] = restarted
        await asyncio.to_thread(restarted.wait_healthy, 180)
        await waits.async_wait_until(lambda: client.available_urls == [a.url, b.url], 60,
                                     "the restarted server back in rotation", interval_s=0.1)
        _, info = await client.request_json(b.url, "GET", "/get_model_info")
        after = await asyncio.gather(*(_generate(client, [2, 3, i + 1]) for i in range(4)))
        return while_down, after, info, dict(pub.stats), client.available_urls
      finally:
        await pub.close()

  while_down, after, info, stats, available = asyncio.run(run())
  assert all(s.server_url == a.url for g in while_down for s in g)
  for samples in while_down + after:
    embedded_tiny.assert_served_by(samples, 9)
  assert available == [a.url, b.url] and info["weight_version"] == "v9" and stats["resynced"] >= 1
  assert b.url in {s.server_url for g in after for s in g}
