"""The weight wire against real SGLang 0.5.23 servers (CPU, float32, gloo): two servers in one group, the same
log-probs as a disk publish, refusals, a server killed mid-broadcast, and the async job with publish=wire."""
import asyncio
import json
import os

import numpy as np
import pytest

from tests.sglang.conftest import SGLangServer, requires_sglang, start_servers
from tests.sglang import test_sglang_job as job
from tests.sglang.test_sglang_protocol import _cfg, export, params_of
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import admin, publisher as publisher_lib, wire as wire_lib

pytestmark = [pytest.mark.sglang, requires_sglang, pytest.mark.integration, pytest.mark.timeout(3600)]
CONTEXT = 96
PROBE = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
  base = tmp_path_factory.mktemp("wire")
  export(params_of(0), str(base / "start"))
  servers = start_servers(str(base / "start"), str(base), 2)
  try:
    yield servers, str(base / "start"), str(base / "weights"), str(base)
  finally:
    for s in servers:
      s.stop()


async def _probe(session, url):
  """The served prompt log-probs of a fixed prompt (every token after the first)."""
  body = await session.call(url, "POST", "/generate", {
      "input_ids": PROBE, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
      "return_logprob": True, "logprob_start_len": 0})
  return [e[0] for e in body["meta_info"]["input_token_logprobs"][1:]]


class _Sender(wire_lib.WireSender):
  """The real sender; kills `victim` (a real SGLang server) when bucket 2 of a version is being packed."""
  victim = None

  def _bucket_tensor(self, params, i):
    if self.victim is not None and i == 2:
      self.victim.kill()
      self.victim = None
    return super()._bucket_tensor(params, i)


def _publisher(root, client, start, sender, **kw):
  return publisher_lib.WeightPublisher(export, root, client, reference_dir=start, wire=sender, **kw)


def test_wire_gives_the_disk_publish_log_probs_on_two_servers_in_one_group(fleet):
  servers, start, root, _ = fleet
  urls = [s.url for s in servers]

  async def run():
    session = admin.AdminSession(30.0, lambda *a: None)
    async with client_lib.RolloutClient(urls, vocab_size=_cfg().vocab_size, context_length=CONTEXT) as client:
      sender = _Sender(_cfg(), "float32", bucket_mb=0.5, backend="gloo", timeout_s=30.0)
      pub = _publisher(root, client, start, sender)
      try:
        await pub.publish(params_of(1), 1)  # the first load, by disk
        by_disk = [await _probe(session, u) for u in urls]
        await pub.publish(params_of(2), 2)
        await pub.publish(params_of(1), 3)  # v1's weights again, over the wire
        by_wire = [await _probe(session, u) for u in urls]
        infos = [await session.call(u, "GET", "/get_model_info") for u in urls]
      finally:
        await pub.close()
        await session.close()
      return by_disk, by_wire, infos, dict(pub.stats), len(sender.buckets)

  by_disk, by_wire, infos, stats, buckets = asyncio.run(run())
  assert stats["wire_versions"] == 2 and stats["wire_failures"] == 0 and stats["wire_groups"] == 1 and buckets > 1
  assert [i["weight_version"] for i in infos] == ["v3", "v3"]
  assert sorted(os.listdir(root)) == ["v1"]  # nothing written for the wire versions
  for disk, wire in zip(by_disk, by_wire):
    assert disk == wire  # the same weights by either path: identical served log-probs
  import jax.numpy as jnp  # noqa: PLC0415
  from vcpo_jax.model import transformer  # noqa: PLC0415
  tokens = jnp.asarray([PROBE], jnp.int32)
  ref = np.asarray(transformer.token_logprobs(params_of(1), _cfg(), tokens, jnp.ones_like(tokens)))[0, 1:]
  np.testing.assert_allclose(by_wire[0], ref, atol=1e-4)  # and they are the learner's float32 weights


def test_an_update_outside_begin_end_is_refused_and_the_server_goes_on(fleet):
  servers, _, _, _ = fleet
  url = servers[0].url
  body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[_cfg().hidden_size]],
          "group_name": wire_lib.GROUP_NAME, "load_format": "flattened_bucket"}

  async def run():
    session = admin.AdminSession(30.0, lambda *a: None)
    try:
      before = await session.call(url, "GET", "/get_model_info")
      with pytest.raises(admin.Rejected, match="must run between begin_weight_update"):
        await session.call(url, "POST", "/update_weights_from_distributed", body)
      after = await session.call(url, "GET", "/get_model_info")
      return before["weight_version"], after["weight_version"], await _probe(session, url)
    finally:
      await session.close()

  before, after, probe = asyncio.run(run())
  assert before == after and len(probe) == len(PROBE) - 1


def test_a_server_killed_mid_broadcast_fails_in_time_and_is_resynced_from_disk(fleet):
  servers, start, root, base = fleet
  urls = [s.url for s in servers]

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=_cfg().vocab_size, context_length=CONTEXT) as client:
      sender = _Sender(_cfg(), "float32", bucket_mb=0.5, backend="gloo", timeout_s=30.0)
      pub = _publisher(root, client, start, sender, resync_interval=1.0)
      try:
        await pub.publish(params_of(4), 4)
        assert await pub.publish(params_of(5), 5) == {u: True for u in urls}
        sender.victim = servers[1]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        result = await pub.publish(params_of(6), 6)
        took = loop.time() - t0
        stats = dict(pub.stats)
        session = admin.AdminSession(30.0, lambda *a: None)
        survivor = (await session.call(urls[0], "GET", "/get_model_info"))["weight_version"]
        await session.close()
        # the killed server comes back on its port (on the starting weights) and is resynced from disk
        servers[1] = SGLangServer(start, servers[1].port, os.path.join(base, "sglang1-restart.log")).wait_ready()
        deadline = loop.time() + 300
        while urls[1] in pub.out_of_sync and loop.time() < deadline:
          await asyncio.sleep(1.0)
        back = urls[1] not in pub.out_of_sync
        after = await pub.publish(params_of(7), 7)
        final = dict(pub.stats)
      finally:
        await pub.close()
      return took, result, stats, survivor, back, after, final

  took, result, stats, survivor, back, after, final = asyncio.run(run())
  assert result == {urls[0]: True, urls[1]: False}
  assert took < 120  # the 30 s wire deadline and a disk resync, not SGLang's 30-minute group timeout
  assert stats["wire_failures"] == 1 and stats["disk_resync_exports"] == 1 and survivor == "v6"
  assert back and after == {u: True for u in urls} and final["wire_groups"] >= 2


def test_the_async_job_trains_with_publish_wire(tmp_path, fleet):
  servers, _, _, _ = fleet
  work = str(tmp_path / "job")
  urls = ",".join(s.url for s in servers)
  job._run("vcpo_jax.main", work, "--config.rl.steps=6", f"--config.rollout.server_urls={urls}",
           "--config.rollout.publish=wire", "--config.rollout.wire_bucket_mb=1")
  rows = job._metrics(work)
  assert [r["step"] for r in rows] == list(range(1, 7))
  consumed = [json.loads(line) for line in open(os.path.join(work, "consumed.jsonl"))]
  indices = [i for c in consumed for i in c["indices"]]
  assert len(indices) == len(set(indices)) == 6 * 4
  assert rows[-1]["rollout/publish_wire_versions"] == 6 and rows[-1].get("rollout/publish_wire_failures", 0) == 0
  assert max(r[k] for r in rows for k in r if k.startswith("rollout/max_lag_seen")) <= 2
