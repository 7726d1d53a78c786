"""rollout.publish=tensor against a real SGLang 0.5.23 server (CPU, float32): handles to shared memory through
/update_weights_from_tensor give the log-probs of a disk publish of the same weights; outside begin/end it is
refused."""
import asyncio
import os

import pytest

from tests.sglang.conftest import requires_sglang, start_servers
from tests.sglang.test_sglang_protocol import _cfg, export, params_of
from tests.sglang.test_sglang_wire import PROBE, _probe
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import admin, publisher as publisher_lib, tensor as tensor_lib

pytestmark = [pytest.mark.sglang, requires_sglang, pytest.mark.integration, pytest.mark.timeout(1800)]
CONTEXT = 96


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  base = tmp_path_factory.mktemp("tensor")
  export(params_of(0), str(base / "start"))
  [srv] = start_servers(str(base / "start"), str(base), 1)
  try:
    yield srv, str(base / "start"), str(base / "weights")
  finally:
    srv.stop()


def test_handles_give_the_disk_publish_log_probs(server):
  srv, start, root = server

  async def run():
    session = admin.AdminSession(30.0, lambda *a: None)
    async with client_lib.RolloutClient([srv.url], vocab_size=_cfg().vocab_size, context_length=CONTEXT) as client:
      sender = tensor_lib.TensorSender(_cfg(), "float32", bucket_mb=0.5, timeout_s=60.0)
      pub = publisher_lib.WeightPublisher(export, root, client, reference_dir=start, wire=sender)
      try:
        await pub.publish(params_of(1), 1)  # the first load, by disk
        by_disk = await _probe(session, srv.url)
        await pub.publish(params_of(2), 2)
        await pub.publish(params_of(1), 3)  # v1's weights again, as handles
        by_tensor = await _probe(session, srv.url)
        info = await session.call(srv.url, "GET", "/get_model_info")
      finally:
        await pub.close()
        await session.close()
      return by_disk, by_tensor, info, dict(pub.stats), len(sender.buckets)

  by_disk, by_tensor, info, stats, buckets = asyncio.run(run())
  assert stats["tensor_versions"] == 2 and stats["tensor_failures"] == 0 and buckets > 1
  assert info["weight_version"] == "v3" and sorted(os.listdir(root)) == ["v1"]
  assert len(by_disk) == len(PROBE) - 1 and by_disk == by_tensor  # identical served log-probs


def test_an_update_from_tensor_outside_begin_end_is_refused(server):
  srv, _, _ = server
  torch = tensor_lib.require_torch()
  [payload] = tensor_lib.serialize([("model.norm.weight", torch.zeros(_cfg().hidden_size).share_memory_())])

  async def run():
    session = admin.AdminSession(30.0, lambda *a: None)
    try:
      before = await session.call(srv.url, "GET", "/get_model_info")
      with pytest.raises(admin.Rejected, match="must run between begin_weight_update"):
        await session.call(srv.url, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
      return before["weight_version"], (await session.call(srv.url, "GET", "/get_model_info"))["weight_version"]
    finally:
      await session.close()

  before, after = asyncio.run(run())
  assert before == after
