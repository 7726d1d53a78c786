"""LoRA at server launch (rollout/servers/lora_launch.py): SGLang's flags from the config, and one-line refusals
of servers that cannot serve the job's adapters, before anything starts."""
import asyncio
import sys

import ml_collections
import pytest

from experiments.launch import fleet
from tests import fake_sglang, test_lora_publish as publish_test
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import admin, launcher, lora_launch, publisher as publisher_lib

CONFIG = """
import ml_collections
def get_config():
  return ml_collections.ConfigDict({"model": {"lora": {"rank": 0, "alpha": 16.0,
                                              "target_modules": "q_proj,k_proj,v_proj,o_proj"}},
                                    "rl": {"max_lag": 1}, "rollout": {"publish": "disk"}})
"""


def config(rank=8, targets=("q_proj", "v_proj"), max_lag=2):
  return ml_collections.ConfigDict({"model": {"lora": {"rank": rank, "target_modules": list(targets)}},
                                    "rl": {"max_lag": max_lag}})


def test_flags_follow_the_config_and_count_the_base_slot():
  lora = lora_launch.from_config(config())
  assert lora_launch.server_flags(lora) == (
      "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj",
      "--lora-strict-loading", "--max-loras-per-batch", "5")  # k + 2 adapters + the base slot
  assert lora.max_kept == 4
  assert lora_launch.from_config(config(rank=0)) is None
  assert lora_launch.from_config(ml_collections.ConfigDict({"model": {}})) is None  # no model.lora at all
  assert lora_launch.from_config(config(targets=())).target_modules == lora_launch.ALL_TARGETS
  with pytest.raises(lora_launch.LoraLaunchError, match=r"model.lora.rank=-1"):
    lora_launch.from_config(config(rank=-1))
  with pytest.raises(lora_launch.LoraLaunchError, match=r"model.lora.target_modules=\('q_proj', 'qkv'\)"):
    lora_launch.from_config(config(targets=("q_proj", "qkv")))


def test_fleet_servers_get_the_flags_of_the_config_and_its_overrides(tmp_path):
  path = tmp_path / "lora_cfg.py"
  path.write_text(CONFIG)
  assert fleet.config_server_flags(str(path), []) == ()
  flags = fleet.config_server_flags(str(path), ["--config.model.lora.rank=16", "--config.rl.max_lag=3"])
  assert flags == ("--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "k_proj",
                   "v_proj", "o_proj", "--lora-strict-loading", "--max-loras-per-batch", "6")
  f = fleet.Fleet(config=str(path), workdir=str(tmp_path), learner_hosts=("localhost",),
                  server_hosts=("127.0.0.1",), server_ports=(1234,), coordinator_port=1, server_flags=flags)
  server = fleet.processes(f)[0]
  assert server.argv[-len(flags) - 1:] == ("--", *flags)  # fleet_server passes what follows -- to the engine
  bare = tmp_path / "bare_cfg.py"
  bare.write_text(CONFIG.replace('"lora": {"rank": 0, "alpha": 16.0,\n', '"mlp": {"rank": 0, "alpha": 16.0,\n'))
  with pytest.raises(fleet.LayoutError, match="has no 'lora' section"):
    fleet.config_server_flags(str(bare), ["--config.model.lora.rank=16"])
  tiny = fleet.config_server_flags("configs/tiny.py", ["--config.model.lora.rank=16"])  # the config has one
  assert tiny[:3] == ("--enable-lora", "--max-lora-rank", "16")


@pytest.mark.integration
def test_servers_without_fitting_lora_are_refused_in_one_line(tmp_path):
  plain_port = launcher.free_port()
  plain = f"http://127.0.0.1:{plain_port}"
  plain_proc = fake_sglang.launch_server([sys.executable, fake_sglang.__file__, "--port", str(plain_port)], plain)
  lora_url, lora_proc = publish_test.start(str(tmp_path))  # max rank 8, targets q_proj v_proj

  async def check(urls, cfg):
    session = admin.AdminSession(5.0, lambda *_: None)
    try:
      await lora_launch.check_servers(session, urls, lora_launch.from_config(cfg))
    finally:
      await session.close()

  try:
    asyncio.run(check([lora_url], config()))  # fits
    with pytest.raises(lora_launch.LoraLaunchError) as e:
      asyncio.run(check([lora_url, plain], config()))
    assert str(e.value).count("\n") == 0 and f"{plain} was launched without LoRA" in str(e.value)
    assert lora_url not in str(e.value)
    with pytest.raises(lora_launch.LoraLaunchError, match="max_lora_rank=8 < model.lora.rank=16"):
      asyncio.run(check([lora_url], config(rank=16)))
    with pytest.raises(lora_launch.LoraLaunchError, match=r"without \['k_proj'\]"):
      asyncio.run(check([lora_url], config(targets=("q_proj", "k_proj"))))

    async def refused():  # an adapter the server refuses (rank 16 > its 8): the publish says why, in one line
      async with client_lib.RolloutClient([lora_url], vocab_size=publish_test.VOCAB) as client:
        sync = publish_test.lora.AdapterSync(client, lambda v: publish_test.peft(v, rank=16), str(tmp_path / "r"),
                                             max_kept=3, timeout_s=5.0)
        pub = publisher_lib.WeightPublisher(lambda p, d: None, str(tmp_path / "r"), client, adapters=sync)
        try:
          await pub.publish(1, 1)
        finally:
          await pub.close()
    with pytest.raises(publisher_lib.PublishError, match="every server rejected adapter policy-v1.*rank 16 is "
                                                         "incompatible"):
      asyncio.run(refused())
  finally:
    fake_sglang.stop_server(plain_proc)
    fake_sglang.stop_server(lora_proc)


@pytest.mark.integration
def test_a_lora_job_checks_servers_given_by_url_before_its_first_publish(tmp_path):
  """The http backend with model.lora and rollout.server_urls: a server launched without LoRA stops the start
  in one line before any adapter is written or sent; rollout.publish=wire is refused with LoRA."""
  import dataclasses
  import os

  import jax
  from configs import tiny
  from vcpo_jax.job import warm_start
  from vcpo_jax.model import hf_export, lora as lora_model, transformer
  from vcpo_jax.rollout import backend as backend_lib, http_backend
  port = launcher.free_port()
  url = f"http://127.0.0.1:{port}"
  proc = fake_sglang.launch_server([sys.executable, fake_sglang.__file__, "--port", str(port)], url)
  try:
    c = tiny.get_config()
    c.model.lora.rank = 4
    c.rollout.server_urls = url
    model_cfg, tok, task, _ = warm_start.starting_point(c)
    base = dataclasses.replace(model_cfg, lora=type(model_cfg.lora)())
    hf_export.write_hf(hf_export.hf_layout(transformer.init_params(base, jax.random.PRNGKey(0)), base),
                       str(tmp_path / "base"), tok)
    ctx = backend_lib.RolloutContext(model_cfg=model_cfg, tokenizer=tok, prompts=iter(()), rewarder=None,
                                     workdir=str(tmp_path), batch_rows=8, task=task)
    b = http_backend.HttpBackend.from_config(c, ctx)
    adapter = lora_model.init_adapter(jax.random.PRNGKey(1), model_cfg)

    async def start():
      try:
        await b.start(0, adapter)
      finally:
        await b.close()
    with pytest.raises(lora_launch.LoraLaunchError) as e:
      asyncio.run(start())
    assert str(e.value).count("\n") == 0 and f"{url} was launched without LoRA" in str(e.value)
    assert not os.path.exists(os.path.join(b.weights_root, "adapters"))  # nothing written, nothing sent
    c.rollout.publish = "wire"
    with pytest.raises(ValueError, match="rollout.publish='wire' with model.lora.rank=4"):
      http_backend.HttpBackend.from_config(c, ctx)
  finally:
    fake_sglang.stop_server(proc)


@pytest.mark.parametrize("mode,adapter_alone", [("http", True), ("emulate", False)])
def test_a_lora_job_gives_servers_the_adapter_and_the_emulator_merged_weights(mode, adapter_alone):
  """RLRun.rollout_params with model.lora: the http backend (fact `adapters`) gets the adapter alone; the
  emulator, which has no servers to apply one, the base with the adapter merged in."""
  import dataclasses
  import types

  import jax
  import numpy as np
  from configs import tiny
  from vcpo_jax.job import train
  from vcpo_jax.model import config as model_config, lora as lora_model, transformer
  c = tiny.get_config(mode if mode == "emulate" else "")
  c.model.lora.rank = 4
  cfg = model_config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=8, max_seq_len=32,
                                 lora=model_config.LoraConfig(rank=4, alpha=8.0))
  base = transformer.init_params(dataclasses.replace(cfg, lora=model_config.LoraConfig()), jax.random.PRNGKey(0))
  adapter = jax.tree.map(lambda x: x + 0.1, lora_model.init_adapter(jax.random.PRNGKey(1), cfg))
  run = types.SimpleNamespace(config=c, model_cfg=cfg, state=types.SimpleNamespace(params=adapter, base=base))
  got = train.RLRun.rollout_params(run)
  want = adapter if adapter_alone else lora_model.merge(base, adapter, cfg)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), got, want)


def test_both_fleet_launches_give_their_servers_the_jobs_lora_flags():
  """xm_fleet's local fleet and slurm_fleet's: with --config.model.lora.rank the servers get LoRA's flags after
  `--` (fleet_server hands them to the engine); without, none."""
  from experiments.launch import slurm_fleet, xm_fleet
  from tests.test_fleet import SLURM_ENV
  want = lora_launch.server_flags(lora_launch.LoraServing(8, lora_launch.ALL_TARGETS, 1))
  for extra in ([], ["--config.model.lora.rank=8"]):
    fleets = [xm_fleet.local_fleet("configs/tiny.py", "/w", 1, 2, list(extra), ports=[1, 2, 3]),
              slurm_fleet.fleet_from_env({**SLURM_ENV, "CONFIG": "configs/tiny.py"}, list(extra))]
    for f in fleets:
      servers = [p for p in fleet.processes(f) if p.name.startswith("server")]
      assert servers
      for p in servers:
        if extra:
          assert p.argv[-len(want) - 1:] == ("--", *want)
        else:
          assert "--enable-lora" not in p.argv
