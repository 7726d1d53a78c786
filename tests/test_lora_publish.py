"""Publishing LoRA adapters (rollout/servers/lora.py) to fake SGLang servers with faults injected: never-reused
names, routing only after a confirmed load, unloads only of adapters nothing in flight names, at most k + 2
kept, and a failed load or unload out of routing until resynced."""
import asyncio
import json
import os
import sys
import urllib.request

import numpy as np
import pytest

from tests import fake_sglang
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import admin, launcher, lora, publisher as publisher_lib

pytestmark = pytest.mark.integration
VOCAB = 64
TARGETS = ["q_proj", "v_proj"]


def peft(version: int, rank: int = 4, targets=TARGETS):
  """A PEFT adapter of a 2-layer model (hidden 32), its values a function of `version`."""
  rng = np.random.default_rng(version)
  tensors = {}
  for i in range(2):
    for m in targets:
      prefix = f"base_model.model.model.layers.{i}.self_attn.{m}"
      tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, 32)).astype(np.float32)
      tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((32, rank)).astype(np.float32)
  config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
            "base_model_name_or_path": "tiny", "bias": "none", "task_type": "CAUSAL_LM"}
  return config, tensors


def start(log_dir, port=None, *extra):
  port = port or launcher.free_port()
  url = f"http://127.0.0.1:{port}"
  argv = [sys.executable, fake_sglang.__file__, "--port", str(port), "--vocab-size", str(VOCAB),
          "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS, *extra]
  return url, fake_sglang.launch_server(argv, url, log_path=os.path.join(log_dir, f"fake{port}.log"))


def call(url, path, body=None):
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=10) as resp:
    return json.loads(resp.read())


@pytest.fixture
def pair(tmp_path):
  """Two fake LoRA servers, 20 ms a token."""
  servers = [start(str(tmp_path), None, "--token-delay", "0.02") for _ in range(2)]
  yield [u for u, _ in servers], [p for _, p in servers]
  for _, p in servers:
    fake_sglang.stop_server(p)


def make(client, root, *, max_lag=1, timeout=2.0, transport="disk"):
  sync = lora.AdapterSync(client, peft, str(root), max_kept=max_lag + 2, timeout_s=timeout, transport=transport)
  return publisher_lib.WeightPublisher(lambda p, d: None, str(root), client, adapters=sync, resync_interval=60)


async def generate(client, max_new=5, n=2, prompt=(3, 4, 5)):
  return await client.generate(list(prompt), {"max_new_tokens": max_new, "temperature": 1.0}, n=n)


def test_names_are_never_reused_and_every_request_names_its_adapter(pair, tmp_path):
  urls, _ = pair

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB, health_interval=0.2) as client:
      pub = make(client, tmp_path / "root")
      try:
        for version in (1, 2, 3):
          assert await pub.publish(version, version) == {u: True for u in urls}
          samples = await generate(client, n=4)
          assert all(list(s.token_versions) == [version] * 5 for s in samples)
          assert sorted(os.listdir(tmp_path / "root")) == [f"policy-v{version}"]  # old directories removed
        with pytest.raises(ValueError, match="policy-v3 was loaded before"):
          await pub.publish(3, 3)
        assert pub.adapters.used == ["policy-v1", "policy-v2", "policy-v3"]
      finally:
        await pub.close()

  asyncio.run(run())
  for url in urls:
    stats = call(url, "/fake/lora/stats")
    assert stats["loaded"] == ["policy-v3"] and "None" not in stats["requests"]
    loads = [e[1] for e in stats["events"] if e[0] == "load"]
    assert loads == ["policy-v1", "policy-v2", "policy-v3"]  # each name loaded once


def test_a_restarted_job_unloads_an_earlier_runs_adapter_of_the_same_name_first(pair, tmp_path):
  """A job restarted from a checkpoint publishes names an earlier run already loaded on servers given by URL
  (it got further than the checkpoint): each is unloaded first, then loaded with this run's contents."""
  urls, _ = pair

  async def run(versions, root):
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB, health_interval=0.2) as client:
      pub = make(client, root)
      try:
        for version in versions:
          assert await pub.publish(version, version) == {u: True for u in urls}
          samples = await generate(client, n=2)
          assert all(list(s.token_versions) == [version] * 5 for s in samples)
      finally:
        await pub.close()

  asyncio.run(run((1, 2, 3), tmp_path / "first"))  # the crashed run left policy-v2 and policy-v3 loaded
  asyncio.run(run((2, 3, 4), tmp_path / "second"))  # the restart from the checkpoint of step 2
  for url in urls:
    stats = call(url, "/fake/lora/stats")
    assert stats["loaded"] == ["policy-v4"]
    events = [e[:2] for e in stats["events"] if e[0] in ("load", "unload")]
    assert events[events.index(["load", "policy-v3"]) + 1:] == [
        ["unload", "policy-v2"], ["load", "policy-v2"], ["unload", "policy-v3"], ["load", "policy-v3"],
        ["unload", "policy-v2"], ["load", "policy-v4"], ["unload", "policy-v3"]], events


def test_a_server_is_routed_to_only_after_it_confirms_and_a_failed_load_resyncs(pair, tmp_path):
  urls, _ = pair
  slow, good = urls

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB, health_interval=0.2) as client:
      pub = make(client, tmp_path / "root", timeout=1.0)
      try:
        await pub.publish(1, 1)
        for mode in ("hang", "refuse", "land_then_hang"):
          call(slow, "/fake/lora", {"mode": mode, "count": 1})
          version = pub.latest_version + 1
          assert await pub.publish(version, version) == {slow: False, good: True}
          assert slow in pub.out_of_sync and not client.is_enabled(slow)
          samples = await generate(client, n=6)
          assert {s.server_url for s in samples} == {good}
          assert all(list(s.token_versions) == [version] * 5 for s in samples)
          assert await pub.resync() == [slow]  # the landed load of land_then_hang is unloaded first
          assert client.is_enabled(slow) and pub.adapters.current in client.server_adapters(slow)
          samples = await generate(client, n=8)
          assert {s.server_url for s in samples} == set(urls)
        call(slow, "/fake/lora", {"mode": "refuse", "count": 2})
        call(good, "/fake/lora", {"mode": "refuse", "count": 2})
        with pytest.raises(publisher_lib.PublishError, match="every server rejected adapter policy-v5"):
          await pub.publish(5, 5)
        return pub.stats
      finally:
        await pub.close()

  stats = asyncio.run(run())
  assert stats["adapter_failures"] >= 5 and stats["resynced"] == 3
  assert call(slow, "/fake/lora/stats")["unloads_in_flight"] == 0


def test_unload_only_when_nothing_in_flight_and_at_most_k_plus_2_kept(pair, tmp_path):
  urls, _ = pair

  async def run():
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB, health_interval=0.2) as client:
      pub = make(client, tmp_path / "root", max_lag=1, timeout=20.0)
      try:
        await pub.publish(1, 1)
        longs = []
        for version in (2, 3, 4, 5):  # each publish while the previous versions' long requests run
          longs.append(asyncio.create_task(generate(client, max_new=40 + 10 * version, n=2,
                                                    prompt=(1, 2, version))))
          await asyncio.sleep(0.3)
          assert await pub.publish(version, version) == {u: True for u in urls}
          for url in urls:
            assert len(client.server_adapters(url)) <= 3
        done = await asyncio.gather(*longs)
        await pub.publish(6, 6)  # nothing in flight: every old adapter goes
        return done
      finally:
        await pub.close()

  done = asyncio.run(run())
  for version, samples in zip((1, 2, 3, 4), done):
    for s in samples:  # each long request kept the adapter it started with, to the end
      assert list(s.token_versions) == [version] * len(s.output_ids) and s.finish_reason == "length"
  for url in urls:
    stats = call(url, "/fake/lora/stats")
    assert stats["unloads_in_flight"] == 0 and stats["max_loaded"] <= 3
    assert stats["loaded"] == ["policy-v6"]


def test_a_server_killed_mid_load_leaves_routing_and_comes_back_on_the_current_adapter(tmp_path):
  (slow, proc), (good, good_proc) = start(str(tmp_path)), start(str(tmp_path))
  port = int(slow.rsplit(":", 1)[1])

  async def run():
    nonlocal proc
    async with client_lib.RolloutClient([slow, good], vocab_size=VOCAB, health_interval=0.2) as client:
      pub = make(client, tmp_path / "root", timeout=30.0)
      try:
        await pub.publish(1, 1)
        call(slow, "/fake/lora", {"mode": "hang", "count": 1})
        task = asyncio.create_task(pub.publish(2, 2))
        await asyncio.sleep(0.5)
        fake_sglang.stop_server(proc)  # killed while the load is pending
        assert await asyncio.wait_for(task, 10) == {slow: False, good: True}
        assert {s.server_url for s in await generate(client, n=4)} == {good}
        _, proc = start(str(tmp_path), port)  # restarted: no adapter at all
        for _ in range(50):
          if client.stats["available"][slow] is False and not client.server_adapters(slow):
            break
          await asyncio.sleep(0.1)
        assert await pub.resync() == [slow]
        samples = await generate(client, n=8)
        assert {s.server_url for s in samples} == {slow, good}
        assert all(list(s.token_versions) == [2] * 5 for s in samples)
      finally:
        await pub.close()

  try:
    asyncio.run(run())
    assert call(slow, "/fake/lora/stats")["loaded"] == ["policy-v2"]
  finally:
    fake_sglang.stop_server(proc)
    fake_sglang.stop_server(good_proc)


def test_tensor_transport_sends_checksums_the_server_checks(pair, tmp_path):
  pytest.importorskip("torch")
  urls, _ = pair

  async def run():
    # the fake imports torch at the first load: its loop stalls (slow loaded hosts) longer than a probe waits
    async with client_lib.RolloutClient(urls, vocab_size=VOCAB, health_timeout=60.0) as client:
      pub = make(client, tmp_path / "root", transport="tensor", timeout=60.0)
      try:
        assert await pub.publish(1, 1) == {u: True for u in urls}
        assert not os.listdir(tmp_path / "root")  # nothing on disk
        assert all(list(s.token_versions) == [1] * 5 for s in await generate(client, n=4))
        assert await pub.publish(2, 2) == {u: True for u in urls}
        assert all(list(s.token_versions) == [2] * 5 for s in await generate(client, n=4))
        call(urls[0], "/fake/lora", {"mode": "refuse", "count": 1})
        assert await pub.publish(3, 3) == {urls[0]: False, urls[1]: True}
        assert await pub.resync() == [urls[0]]  # the handles pickled again for it
        body = pub.adapters._body(pub.adapters._load[1])
        body["expected_checksums"] = {k: "0" * 64 for k in body["expected_checksums"]}
        with pytest.raises(admin.Rejected, match="MISMATCH"):  # the server checks every sha256
          await pub.adapters.admin.call(urls[0], "POST", "/load_lora_adapter_from_tensors",
                                        dict(body, lora_name="bad"))
      finally:
        await pub.close()

  asyncio.run(run())


def test_bad_input_is_refused_in_one_line(tmp_path):
  client = client_lib.RolloutClient(["http://127.0.0.1:1"], vocab_size=VOCAB)
  with pytest.raises(ValueError, match="rollout.publish"):
    lora.AdapterSync(client, peft, str(tmp_path), max_kept=3, timeout_s=1, transport="wire")
  with pytest.raises(ValueError, match="max_lag"):
    lora.AdapterSync(client, peft, str(tmp_path), max_kept=1, timeout_s=1)
