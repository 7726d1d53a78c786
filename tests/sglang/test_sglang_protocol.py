"""Client and publisher against a real SGLang 0.5.23 server (CPU, float32): protocol, publishing, resync."""
import asyncio
import os
import sys

import numpy as np
import pytest

from tests.sglang.conftest import requires_sglang, start_servers
from vcpo_jax.model import config as model_config
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import publisher as publisher_lib

pytestmark = [pytest.mark.sglang, requires_sglang, pytest.mark.integration, pytest.mark.timeout(1800)]
CONTEXT = 96  # the countdown model's max_seq_len, exported as max_position_embeddings
PARAMS = {}


def _cfg():
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
  import countdown  # noqa: PLC0415
  return model_config.ModelConfig.from_dict(countdown.get_config().model)


def params_of(version: int):
  """Version v's weights by convention: a sharpened random init with seed v (different outputs per version)."""
  if version not in PARAMS:
    import jax  # noqa: PLC0415
    from vcpo_jax.model import transformer as model  # noqa: PLC0415
    p = model.init_params(_cfg(), jax.random.PRNGKey(version))
    PARAMS[version] = jax.device_get(jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p))
  return PARAMS[version]


def export(params, out_dir):
  from vcpo_jax.model import hf_export  # noqa: PLC0415
  from vcpo_jax.model import tokenizer
  hf_export.export_hf(params, _cfg(), out_dir, tokenizer.build_tokenizer())


def reference_logprobs(version, prompt, output):
  """The learner's recompute (float32) of each output token's log-prob under version's params."""
  import jax.numpy as jnp  # noqa: PLC0415
  from vcpo_jax.model import transformer as model  # noqa: PLC0415
  cfg = _cfg()
  seq = list(prompt) + list(output)
  tokens = jnp.asarray(np.array([seq + [0] * (cfg.max_seq_len - len(seq))], np.int32))
  lp = np.asarray(model.token_logprobs(params_of(version), cfg, tokens, jnp.ones_like(tokens)))
  return lp[0, len(prompt):len(seq)]


def check_tags(samples, atol=1e-4):
  """Every token's log-prob is the recompute under the params its version tag names; returns the worst gap."""
  worst = 0.0
  for s in samples:
    for version in sorted(set(s.token_versions.tolist())):
      ref = reference_logprobs(version, s.prompt_ids, s.output_ids)
      at = s.token_versions == version
      gap = float(np.abs(s.output_logprobs[at] - ref[at]).max())
      assert gap < atol, (version, gap, s.token_versions.tolist())
      worst = max(worst, gap)
  return worst


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  base = tmp_path_factory.mktemp("sglang")
  export(params_of(0), str(base / "start"))
  (srv,) = start_servers(str(base / "start"), str(base), 1)
  try:
    yield srv, str(base / "weights")
  finally:
    srv.stop()


def _client(url, **kw):
  return client_lib.RolloutClient([url], vocab_size=_cfg().vocab_size, context_length=CONTEXT, **kw)


def test_update_while_generating_tags_every_token_with_its_weights(server):
  srv, root = server
  sampling = {"max_new_tokens": 60, "temperature": 1.0, "ignore_eos": True}
  prompts = [[5, 6, 7, 8, 9, 10 + i] for i in range(6)]

  async def run():
    async with _client(srv.url) as client:
      pub = publisher_lib.WeightPublisher(export, root, client)
      try:
        await pub.publish(params_of(1), 1)
        for version in (2, 3, 4):  # until some sample straddles an update
          tasks = [asyncio.create_task(client.generate(p, sampling, n=2)) for p in prompts]
          await asyncio.sleep(0.3)
          await pub.publish(params_of(version), version)
          groups = await asyncio.gather(*tasks)
          if any(len(set(s.token_versions.tolist())) == 2 for g in groups for s in g):
            break
        # The same prompts once more: the prefix cache must not serve KV of older weights.
        again = await client.generate(prompts[0], sampling, n=2)
        return groups, again, version, client.stats, pub.pause_seconds
      finally:
        await pub.close()

  groups, again, version, stats, pauses = asyncio.run(run())
  samples = [s for g in groups for s in g]
  assert any(len(set(s.token_versions.tolist())) == 2 for s in samples) and stats["aborted_resumed"] >= 1
  worst = check_tags(samples + again)
  assert all(set(s.token_versions.tolist()) == {version} for s in again)
  print(f"\nabort-mode update: pause {np.mean(pauses[1:]):.2f} s (max {max(pauses):.2f}); worst |lp - learner| "
        f"{worst:.2e} over {len(samples)} samples, {stats['aborted_resumed']} resumed")


def test_other_shapes_are_refused_before_sending(server, tmp_path):
  import dataclasses  # noqa: PLC0415
  srv, _ = server
  wide = dataclasses.replace(_cfg(), intermediate_size=2 * _cfg().intermediate_size)

  def export_wide(params, out_dir):
    import jax  # noqa: PLC0415
    from vcpo_jax.model import hf_export  # noqa: PLC0415
    from vcpo_jax.model import tokenizer
    from vcpo_jax.model import transformer as model
    hf_export.export_hf(model.init_params(wide, jax.random.PRNGKey(0)), wide, out_dir, tokenizer.build_tokenizer())

  async def run():
    async with _client(srv.url) as client:
      before = (await client.request_json(srv.url, "GET", "/get_model_info"))[1]["weight_version"]
      pub = publisher_lib.WeightPublisher(export_wide, str(tmp_path), client)
      try:
        with pytest.raises(publisher_lib.PublishError, match="intermediate_size"):
          await pub.publish(None, 99)
      finally:
        await pub.close()
      return before, (await client.request_json(srv.url, "GET", "/get_model_info"))[1]["weight_version"]

  before, after = asyncio.run(run())
  assert before == after


def test_refused_updates_never_touch_the_last_good_weights(server, tmp_path):
  """With the served model_path unreadable by the learner, the reference is the job's own starting
  weights; a mismatched first publish and a refused re-publish of v200 never reach the server nor change
  root/v200, and a resync afterwards serves the good v200 (log-probs match its params)."""
  import dataclasses  # noqa: PLC0415
  import shutil  # noqa: PLC0415
  srv, _ = server
  start = os.path.join(os.path.dirname(server[1]), "start")
  reference = str(tmp_path / "reference")
  shutil.copytree(start, reference)
  wide = dataclasses.replace(_cfg(), intermediate_size=2 * _cfg().intermediate_size)
  exporter = {"fn": None}

  def export_wide(params, out_dir):
    import jax  # noqa: PLC0415
    from vcpo_jax.model import hf_export  # noqa: PLC0415
    from vcpo_jax.model import tokenizer  # noqa: PLC0415
    from vcpo_jax.model import transformer as model  # noqa: PLC0415
    hf_export.export_hf(model.init_params(wide, jax.random.PRNGKey(0)), wide, out_dir, tokenizer.build_tokenizer())

  def files(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}

  async def version_of(client):
    return (await client.request_json(srv.url, "GET", "/get_model_info"))[1]["weight_version"]

  async def run():
    async with _client(srv.url) as client:
      pub = publisher_lib.WeightPublisher(lambda p, d: exporter["fn"](p, d), str(tmp_path / "w"), client,
                                          reference_dir=reference, resync_interval=3600)
      try:
        await pub.check_servers()
        before = await version_of(client)
        exporter["fn"] = export_wide
        with pytest.raises(publisher_lib.PublishError, match="intermediate_size"):
          await pub.publish(None, 200)
        first = (await version_of(client), os.listdir(tmp_path / "w"))
        exporter["fn"] = export
        await pub.publish(params_of(200), 200)
        good = files(tmp_path / "w" / "v200")
        exporter["fn"] = export_wide
        with pytest.raises(publisher_lib.PublishError, match="intermediate_size"):
          await pub.publish(None, 200)
        second = (files(tmp_path / "w" / "v200"), os.listdir(tmp_path / "w"))
        pub.out_of_sync[srv.url] = "injected: missed v200"
        back = await pub.resync()
        samples = await client.generate([5, 6, 7, 8], {"max_new_tokens": 24, "temperature": 1.0,
                                                       "ignore_eos": True}, n=2)
        return before, first, good, second, back, samples
      finally:
        await pub.close()

  os.rename(start, start + ".hidden")  # the servers' disk, not readable by the learner
  try:
    before, first, good, second, back, samples = asyncio.run(run())
  finally:
    os.rename(start + ".hidden", start)
  assert first == (before, []) and second == (good, ["v200"]) and back == [srv.url]
  assert all(set(s.token_versions.tolist()) == {200} for s in samples)
  check_tags(samples)


def test_paused_server_is_alive_and_idle_connections_are_retried(server):
  srv, _ = server

  async def run():
    # Keep pooled connections longer than SGLang does (5 s), so the next request reuses a dropped one.
    async with _client(srv.url, keepalive_timeout=30.0, health_timeout=3.0) as client:
      await client.generate([3, 4, 5], {"max_new_tokens": 4})
      await client.request_json(srv.url, "POST", "/pause_generation", {"mode": "in_place"})
      try:
        await client.check_health()
        paused_ok = client.available_urls == [srv.url]
      finally:
        await client.request_json(srv.url, "POST", "/continue_generation", {})
      await asyncio.sleep(6.5)
      samples = await client.generate([3, 4, 6], {"max_new_tokens": 4}, n=2)
      return paused_ok, samples, client.stats

  paused_ok, samples, stats = asyncio.run(run())
  assert paused_ok and len(samples) == 2
  assert stats.get("marked_down", 0) == 0 and stats.get("connection_errors", 0) == 0
  print(f"\nstale pooled connections retried: {stats.get('stale_connection_retries', 0)}")


def test_requests_stay_inside_the_context_limits(server):
  srv, _ = server

  async def run():
    async with _client(srv.url) as client:
      status, _ = await client.request_json(srv.url, "POST", "/generate", {
          "input_ids": [5] * (CONTEXT - 6), "sampling_params": {"max_new_tokens": 1}})
      long = await client.generate([5] * (CONTEXT - 10), {"max_new_tokens": 30, "ignore_eos": True})
      with pytest.raises(ValueError, match="context_length"):
        await client.generate([5] * (CONTEXT - 6), {"max_new_tokens": 1})
      return status, long

  status, (s,) = asyncio.run(run())
  assert status == 400  # SGLang's input limit, which the client never crosses
  assert s.finish_reason == "length" and len(s.prompt_ids) + len(s.output_ids) <= CONTEXT - 2


def test_raw_logprobs_at_temperature_below_one(server):
  srv, _ = server

  async def run():
    async with _client(srv.url) as client:
      await client.check_raw_logprobs(0.6, [5, 6, 7, 8])
      return client.stats

  assert asyncio.run(run())["raw_logprob_checks"] == 1


def test_in_place_updates_need_no_abort_but_mix_weights(tmp_path):
  """Option (a), measured: pause(in_place) + update(flush_cache false) on a server without a radix cache.
  Requests straddling the update get two spans, but their new-version tokens attend to KV the old weights
  computed, so they do not match the new params: the reason the publisher aborts and resumes instead."""
  export(params_of(0), str(tmp_path / "start"))
  (srv,) = start_servers(str(tmp_path / "start"), str(tmp_path), 1, RADIX_CACHE="0")
  sampling = {"max_new_tokens": 80, "temperature": 1.0, "ignore_eos": True}

  async def run():
    async with _client(srv.url) as client:
      pub = publisher_lib.WeightPublisher(export, str(tmp_path / "w"), client, pause_mode="in_place")
      try:
        await pub.publish(params_of(1), 1)
        for version, delay in ((2, 0.05), (3, 0.2), (4, 0.5)):  # until some sample straddles an update
          tasks = [asyncio.create_task(client.generate([5, 6, 7, 8, 9, 10 + i], sampling, n=2)) for i in range(8)]
          await asyncio.sleep(delay)
          await pub.publish(params_of(version), version)
          samples = [s for g in await asyncio.gather(*tasks) for s in g]
          if any(len(set(s.token_versions.tolist())) == 2 for s in samples):
            break
        fresh = await client.generate([5, 6, 7, 8, 9, 10], sampling)
        return samples, version, fresh, client.stats, pub.pause_seconds
      finally:
        await pub.close()

  try:
    samples, version, fresh, stats, pauses = asyncio.run(run())
  finally:
    srv.stop()
  check_tags(fresh)  # without a radix cache a new request runs on the new weights only
  straddled = [s for s in samples if len(set(s.token_versions.tolist())) == 2]
  gaps = []
  for s in straddled:
    at = s.token_versions == version
    ref = reference_logprobs(version, s.prompt_ids, s.output_ids)
    gaps.append(float(np.abs(s.output_logprobs[at] - ref[at]).max()))
  assert stats.get("aborted_resumed", 0) == 0
  print(f"\nin-place update: pause {np.mean(pauses[1:]):.2f} s; {len(straddled)} straddling samples, worst "
        f"new-version gap {max(gaps, default=0):.2e}")
  assert straddled and max(gaps) > 1e-4
