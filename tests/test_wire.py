"""The weight wire against real embedded servers in one real gloo group: served weights, refusals, a server
killed mid-broadcast."""
import asyncio
import os

import pytest

from tests import embedded_tiny
from tests import waits
from vcpo_jax.model import config as model_config
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import admin, publisher as publisher_lib, wire as wire_lib

pytestmark = pytest.mark.integration
VOCAB = embedded_tiny.TINY_MODEL["vocab_size"]
CFG = model_config.ModelConfig(**embedded_tiny.TINY_MODEL)


def _sender(bucket_mb=0.01, cls=wire_lib.WireSender):
  return cls(CFG, "float32", bucket_mb=bucket_mb, backend="gloo", timeout_s=20.0)


def test_two_servers_in_one_group_serve_the_wire_published_weights(cluster):
  urls = [s.url for s in cluster["servers"]]

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      sender = _sender()
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, cluster["root"], client,
                                          reference_dir=cluster["init_dir"], wire=sender)
      try:
        assert await pub.publish(embedded_tiny.tiny_version(1), 1) == {u: True for u in urls}  # the first load: by disk
        assert pub.stats["wire_versions"] == 0 and sorted(os.listdir(cluster["root"])) == ["v1"]
        for version in (2, 3):
          assert await pub.publish(embedded_tiny.tiny_version(version), version) == {u: True for u in urls}
          infos = [await client.request_json(u, "GET", "/get_model_info") for u in urls]
          assert [info["weight_version"] for _, info in infos] == [f"v{version}"] * 2
        assert sorted(os.listdir(cluster["root"])) == ["v1"]  # no file for a wire version
        assert pub.stats["wire_versions"] == 2 and pub.stats["wire_groups"] == 1 and len(sender.buckets) > 2
        samples = await embedded_tiny.served_samples(client, 2 * len(urls))
      finally:
        await pub.close()
      return samples

  samples = asyncio.run(run())
  embedded_tiny.assert_served_by(samples, 3)  # float32 on the wire: the servers run exactly the learner's v3
  assert {s.server_url for s in samples} == set(cluster["servers"][i].url for i in range(2))


def test_an_update_outside_begin_end_or_the_group_is_refused(cluster):
  url = cluster["servers"][0].url
  body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "g",
          "load_format": "flattened_bucket"}

  async def run():
    session = admin.AdminSession(10.0, lambda *a: None)
    try:
      with pytest.raises(admin.Rejected, match="must run between begin_weight_update"):
        await session.call(url, "POST", "/update_weights_from_distributed", body)
      await session.call(url, "POST", "/begin_weight_update", {})
      with pytest.raises(admin.Rejected, match="Group g not in"):
        await session.call(url, "POST", "/update_weights_from_distributed", body)
      await session.call(url, "POST", "/end_weight_update", {})
      info = await session.call(url, "GET", "/get_model_info")
      assert info["weight_version"] == "v0"
    finally:
      await session.close()

  asyncio.run(run())


class _KillMidway(wire_lib.WireSender):
  """Kills one server once the first buckets of the second wire version went out."""
  victim = None
  sent = 0

  def _bucket_tensor(self, params, i):
    _KillMidway.sent += 1
    if self.victim is not None and i == 2 and _KillMidway.sent > len(self.buckets):
      self.victim.kill()
      self.victim = None
    return super()._bucket_tensor(params, i)


def test_a_server_killed_mid_broadcast_is_failed_in_time_and_the_rest_resynced_from_disk(cluster):
  servers = cluster["servers"]
  urls = [s.url for s in servers]

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      sender = _sender(cls=_KillMidway)
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, cluster["root"], client,
                                          reference_dir=cluster["init_dir"], wire=sender, resync_interval=0.5)
      try:
        await pub.publish(embedded_tiny.tiny_version(1), 1)
        assert await pub.publish(embedded_tiny.tiny_version(2), 2) == {u: True for u in urls}
        sender.victim = servers[1].proc
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        result = await pub.publish(embedded_tiny.tiny_version(3), 3)
        took = loop.time() - t0
        assert result == {urls[0]: True, urls[1]: False}
        assert pub.stats["wire_failures"] == 1 and pub.stats["disk_resync_exports"] == 1
        assert urls[1] in pub.out_of_sync and not client.is_enabled(urls[1])
        # the survivor was half-updated by the wire, then resynced from the v3 export
        assert sorted(os.listdir(cluster["root"])) == ["v1", "v3"]
        samples = await embedded_tiny.served_samples(client, 2)
        assert {s.server_url for s in samples} == {urls[0]}
        # the killed server comes back on its port: resynced from disk, then routed to again
        servers[1].start()
        servers[1].wait_healthy(180)
        await waits.async_wait_until(lambda: urls[1] not in pub.out_of_sync, 120, "the restarted server resynced")
        assert await pub.publish(embedded_tiny.tiny_version(4), 4) == {u: True for u in urls}
        assert pub.stats["wire_groups"] == 2 and pub.stats["wire_versions"] == 2
        late = await embedded_tiny.served_samples(client, 4)
      finally:
        await pub.close()
      return took, samples, late

  took, samples, late = asyncio.run(run())
  assert took < 60  # within the wire's deadline (20 s) plus the disk resync, not SGLang's 30 minutes
  embedded_tiny.assert_served_by(samples, 3)
  embedded_tiny.assert_served_by(late, 4)


def test_the_async_job_trains_with_publish_wire(tmp_path):
  """The job (embedded server, k = 2) with rollout.publish=wire: versions after the first go over the group."""
  import json
  from configs import tiny
  from vcpo_jax.job import train
  config = tiny.get_config()
  config.rl.max_lag = 2
  config.rollout.publish = "wire"
  result = train.train_and_evaluate(config, str(tmp_path))
  assert result["steps"] == 3
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3] and max(r["lag/max"] for r in rows) <= 2
  assert rows[-1]["rollout/publish_wire_versions"] >= 1
  assert rows[-1].get("rollout/publish_wire_failures", 0) == 0
  consumed = [i for line in open(tmp_path / "consumed.jsonl") for i in json.loads(line)["indices"]]
  assert len(consumed) == len(set(consumed))
