"""Tests for the weight publisher against real embedded servers on loopback (exported HF dirs, real updates)."""
import asyncio
import os
import signal

import numpy as np
import pytest

from tests import embedded_tiny, fake_sglang
from tests import waits
from vcpo_jax.model import config as model_config
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import publisher as publisher_lib
from vcpo_jax.rollout.servers import launcher, weight_store

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


def _fake_update_mode(url, mode, count=1):
  import json
  import urllib.request
  req = urllib.request.Request(url + "/fake/update", data=json.dumps({"mode": mode, "count": count}).encode(),
                               headers={"Content-Type": "application/json"})
  urllib.request.urlopen(req, timeout=5).read()


def test_unconfirmed_update_leaves_rotation_and_unflushed_cache_is_retried(tmp_path):
  """A server that says success but reports another version is out of rotation, counted, and re-synced;
  SGLang's "cache was not flushed" 400 (weights live, version not advanced) is retried after a new pause."""
  procs, urls = _fake_servers(tmp_path, 2)

  def export(params, out_dir):
    embedded_tiny.export_tiny(embedded_tiny.tiny_version(0), out_dir)

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB, health_interval=0.2) as client:
      pub = publisher_lib.WeightPublisher(export, str(tmp_path / "w"), client, resync_interval=0.2)
      try:
        assert await pub.publish(None, 1) == {u: True for u in urls}
        _fake_update_mode(urls[0], "drop_connection")
        _fake_update_mode(urls[1], "drop_connection")
        assert await pub.publish(None, 2) == {u: True for u in urls}  # retried, not a failed server
        _fake_update_mode(urls[0], "stale_info")
        _fake_update_mode(urls[1], "not_flushed")
        result = await pub.publish(None, 3)
        out_of_rotation = client.available_urls
        await waits.async_wait_until(lambda: len(client.available_urls) >= 2, 30,
                                     "both servers back in rotation after the resync", interval_s=0.05)
        infos = [(await client.request_json(u, "GET", "/get_model_info"))[1] for u in urls]
        return result, out_of_rotation, client.available_urls, infos, dict(pub.stats), client.stats
      finally:
        await pub.close()

  result, out_of_rotation, available, infos, stats, client_stats = _run_then_stop(run, procs)
  assert result == {urls[0]: False, urls[1]: True} and out_of_rotation == [urls[1]]
  assert stats["version_mismatches"] == 1 and stats["cache_not_flushed_retries"] == 1
  assert stats["resynced"] == 1 and available == urls and [i["weight_version"] for i in infos] == ["v3", "v3"]
  assert stats["stale_connection_retries"] == 2
  assert client_stats["publish_version_mismatches"] == 1 and client_stats["publish_server_failures"] == 1


def _fake_servers(tmp_path, n, info=None):
  import json
  import sys
  procs, urls = [], []
  for i in range(n):
    port = launcher.free_port()
    urls.append(f"http://127.0.0.1:{port}")
    procs.append(fake_sglang.launch_server(
        [sys.executable, fake_sglang.__file__, "--port", str(port), "--vocab-size", str(VOCAB),
         "--info", json.dumps(info or {})], urls[-1], log_path=tmp_path / f"fake{i}.log"))
  return procs, urls


def _stop(procs) -> None:
  for p in procs:
    fake_sglang.stop_server(p)


def _run_then_stop(run, procs):
  """asyncio.run(run()), the fake servers stopped afterwards whatever happens."""
  try:
    return asyncio.run(run())
  finally:
    _stop(procs)


def _fake_stats(url):
  import json
  import urllib.request
  with urllib.request.urlopen(url + "/fake/stats", timeout=5) as r:
    return json.loads(r.read())


def test_refusals_with_unreadable_model_path_never_reach_the_server(tmp_path):
  """A fake server whose model_path is not readable here: the first publish is checked
  against the job's starting weights, not adopted as the reference; a refused re-publish of v1 leaves
  root/v1 as it was, and the resync sends that good directory."""
  procs, urls = _fake_servers(tmp_path, 1)
  reference = embedded_tiny.export_tiny(embedded_tiny.tiny_version(0), str(tmp_path / "start"))
  exporter = {"fn": _wide_export()}
  root = tmp_path / "w"

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      pub = publisher_lib.WeightPublisher(lambda p, d: exporter["fn"](p, d), str(root), client,
                                          reference_dir=reference, resync_interval=3600)
      try:
        await pub.check_servers()  # nothing comparable reported: passes (with a warning)
        with pytest.raises(publisher_lib.PublishError, match="intermediate_size=128.*has 64"):
          await pub.publish(None, 1)
        first = (_fake_stats(urls[0]), os.listdir(root))
        exporter["fn"] = lambda p, d: embedded_tiny.export_tiny(embedded_tiny.tiny_version(1), d)
        assert await pub.publish(None, 1) == {urls[0]: True}
        good = _files(root / "v1")
        exporter["fn"] = _wide_export(96)
        with pytest.raises(publisher_lib.PublishError, match="intermediate_size=96"):
          await pub.publish(None, 1)
        second = (_files(root / "v1"), os.listdir(root))
        pub.out_of_sync[urls[0]] = "injected"
        assert await pub.resync() == [urls[0]]
        return first, good, second, _fake_stats(urls[0]), dict(pub.stats), client.stats
      finally:
        await pub.close()

  first, good, second, stats_after, stats, client_stats = _run_then_stop(run, procs)
  assert first == ({"generate_requests": 0, "update_requests": 0, "last_model_path": None}, [])
  assert second == (good, ["v1"])
  assert stats_after["update_requests"] == 2 and stats_after["last_model_path"] == str(root / "v1")
  assert stats["refused_shapes"] == 2 and client_stats["publish_refused_shapes"] == 2


def test_server_reporting_another_model_is_refused_at_start(tmp_path):
  """Fake server: what /get_model_info reports is cross-checked against the starting weights."""
  procs, urls = _fake_servers(tmp_path, 2, info={"vocab_size": 2 * VOCAB})
  reference = embedded_tiny.export_tiny(embedded_tiny.tiny_version(0), str(tmp_path / "start"))

  async def run():
    pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, str(tmp_path / "w"), urls, reference_dir=reference)
    try:
      with pytest.raises(publisher_lib.PublishError) as refused:
        await pub.check_servers()
      return str(refused.value)
    finally:
      await pub.close()

  message = _run_then_stop(run, procs)
  assert f"vocab_size={2 * VOCAB}, the starting weights have {VOCAB}" in message and urls[1] in message


def test_refused_publish_ends_the_job_after_the_steps_metrics(tmp_path):
  """A refusal in the RL loop first writes the step (metrics with the refusal counter), then
  ends the job with one line naming the field and both values."""
  from tests import test_background_publish as loop_test  # its Run: RLRun's surface that rl_loop uses
  from vcpo_jax.job import train
  from vcpo_jax.rollout import backend as backend_lib, http_backend
  procs, urls = _fake_servers(tmp_path, 1)

  class Backend(backend_lib.RolloutBackend):  # the HTTP backend's publish and stats over a fake server
    def __init__(self):
      self.client = self.pub = None
      self.closed = False

    def load_state_dict(self, state):
      pass

    async def start(self, version, params):
      self.client = client_lib.RolloutClient(urls, vocab_size=VOCAB)
      await self.client.start()
      self.pub = publisher_lib.WeightPublisher(
          lambda p, d: (_wide_export() if p == "wide" else embedded_tiny.export_tiny)(embedded_tiny.tiny_version(0), d),
          str(tmp_path / "w"), self.client)  # the reference: the first export (v1)

    async def next_groups(self, version):
      return []

    async def publish(self, version, params):
      await self.pub.publish("wide" if version == 2 else None, version)

    def stats(self):
      return http_backend.flat_metrics(self.client.stats)

    def state_dict(self):
      return {}

    async def close(self):
      await self.pub.close()
      await self.client.close()
      self.closed = True

  class Run(loop_test.Run):  # RLRun's surface that rl_loop uses, on the backend above
    def __init__(self):
      super().__init__(steps=5)
      self.backend = Backend()

    def make_backend(self):
      return self.backend

  def refusals(run):
    return [(step, extra.get("rollout/publish_refused_shapes", 0.0)) for step, extra in run.written]

  run = Run()
  try:
    with pytest.raises(publisher_lib.PublishError):
      asyncio.run(train.rl_loop(run, run.make_backend()))
    written = refusals(run)
    assert written == [(1, 0.0), (2, 1.0)] and run.backend.closed  # step 2 written, with the refusal
    run.step, run.written[:] = 0, []
    with pytest.raises(SystemExit) as stopped:  # as the job's entry point sees it
      train.run_rl_loop(run)
  finally:
    _stop(procs)
  assert refusals(run) == written
  message = str(stopped.value.code)
  assert "\n" not in message and "step 2" in message and "intermediate_size=128" in message and "64" in message
