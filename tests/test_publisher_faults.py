"""The weight publisher against fake servers that misbehave on demand, and a refused publish in the RL loop."""
import asyncio
import os

import pytest

from tests import embedded_tiny, fake_sglang
from tests import waits
from test_publisher import VOCAB, _files, _wide_export
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import publisher as publisher_lib
from vcpo_jax.rollout.servers import launcher

pytestmark = pytest.mark.integration  # fake servers in processes, as test_publisher.py


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
  import test_background_publish as loop_test  # its Run: RLRun's surface that rl_loop uses
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
