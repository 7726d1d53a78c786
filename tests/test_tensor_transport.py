"""rollout.publish=tensor: handles to shared memory through /update_weights_from_tensor, against real embedded
servers (served weights, a server killed mid-send); the payload's round trip and its restricted unpickling."""
import asyncio
import base64
import os
import pickle

import numpy as np
import pytest

from tests import embedded_tiny
from tests import waits
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf_export
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import admin, publisher as publisher_lib, tensor as tensor_lib
from vcpo_jax.serving import weight_tensor

VOCAB = embedded_tiny.TINY_MODEL["vocab_size"]
CFG = model_config.ModelConfig(**embedded_tiny.TINY_MODEL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_buckets_handles_carry_the_exporters_tensors_bit_for_bit(dtype):
  """Sender and receiver in one process: the payload names shared memory, and what the server's restricted
  unpickler maps back is each HF tensor as the export writes it."""
  torch = tensor_lib.require_torch()
  sender = tensor_lib.TensorSender(CFG, dtype, bucket_mb=0.01)
  layout = hf_export.hf_layout(embedded_tiny.tiny_params(4), CFG, dtype)
  want = hf_export.hf_tensors(layout)
  got = {}
  for i, bucket in enumerate(sender.buckets):
    buffer = sender._buffer(layout, i)
    assert buffer.is_shared() and buffer.numel() == sum(t.nbytes for t in bucket)
    [payload] = tensor_lib.serialize(tensor_lib.named_views(torch, buffer, bucket))
    got.update(weight_tensor._load(payload))
  assert sorted(got) == sorted(want) and len(sender.buckets) > 2
  for name in want:
    assert got[name].dtype == want[name].dtype and np.array_equal(got[name].view(np.uint8), want[name].view(np.uint8))


def test_the_server_unpickles_only_tensor_handles():
  class Gadget:
    def __reduce__(self):
      return (os.system, ("true",))

  payload = base64.b64encode(pickle.dumps([("x", Gadget())])).decode()
  with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle posix.system"):
    weight_tensor._load(payload)


@pytest.mark.integration
def test_two_servers_serve_the_weights_sent_as_handles_and_a_killed_one_is_resynced_from_disk(cluster):
  """Versions 2 and 3 go as handles (float32: the servers run exactly the learner's weights); in version 4 one
  server dies after the first bucket: the publish fails it in time, resyncs the survivor from a disk export,
  and the restarted one is brought back by disk before it is routed to again."""
  servers = cluster["servers"]
  urls = [s.url for s in servers]

  class KillMidway(tensor_lib.TensorSender):
    victim = None

    async def _post(self, admin, i, body):
      if self.victim is not None and i == 1:  # bucket 1 landed on both, the paused servers wait for bucket 2
        self.victim.kill()
        self.victim = None
      return await super()._post(admin, i, body)

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB) as client:
      sender = KillMidway(CFG, "float32", bucket_mb=0.01, timeout_s=20.0)
      pub = publisher_lib.WeightPublisher(embedded_tiny.export_tiny, cluster["root"], client,
                                          reference_dir=cluster["init_dir"], wire=sender, resync_interval=0.5)
      try:
        pub.adopt(0, cluster["init_dir"])
        for version in (2, 3):
          assert await pub.publish(embedded_tiny.tiny_version(version), version) == {u: True for u in urls}
        assert pub.stats["tensor_versions"] == 2 and os.listdir(cluster["root"]) == []  # no file written
        sent = await embedded_tiny.served_samples(client, 4)
        sender.victim = servers[1].proc
        assert await pub.publish(embedded_tiny.tiny_version(4), 4) == {urls[0]: True, urls[1]: False}
        assert pub.stats["tensor_failures"] == 1 and pub.stats["disk_resync_exports"] == 1
        assert not client.is_enabled(urls[1]) and urls[1] in pub.out_of_sync
        survivor = await embedded_tiny.served_samples(client, 2)
        servers[1].start()
        servers[1].wait_healthy(180)
        await waits.async_wait_until(lambda: urls[1] not in pub.out_of_sync, 120, "the restarted server resynced")
        late = await embedded_tiny.served_samples(client, 4)
      finally:
        await pub.close()
      return sent, survivor, late

  sent, survivor, late = asyncio.run(run())
  embedded_tiny.assert_served_by(sent, 3)
  assert {s.server_url for s in sent} == set(urls)
  embedded_tiny.assert_served_by(survivor, 4)
  assert {s.server_url for s in survivor} == {urls[0]}
  embedded_tiny.assert_served_by(late, 4)


@pytest.mark.integration
def test_an_update_from_tensor_outside_begin_end_is_refused(cluster):
  url = cluster["servers"][0].url
  torch = tensor_lib.require_torch()
  [payload] = tensor_lib.serialize([("model.norm.weight", torch.zeros(32).share_memory_())])

  async def run():
    session = admin.AdminSession(10.0, lambda *a: None)
    try:
      with pytest.raises(admin.Rejected, match="must run between begin_weight_update"):
        await session.call(url, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
      return (await session.call(url, "GET", "/get_model_info"))["weight_version"]
    finally:
      await session.close()

  assert asyncio.run(run()) == "v0"
