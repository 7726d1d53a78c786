"""LoRA on a real SGLang 0.5.23 CPU server: the adapter publisher end to end, and the served log-probs.

The server starts with the job's LoRA flags (install_sglang_cpu.sh's pin-memory patch makes that possible on
CPU-only torch); a PEFT adapter for the tiny checkpoint is published as policy-v1 (disk) and again as policy-v2
(tensors) by the rollout client's publisher; its served log-probs differ from the base's and equal those of a
second server launched on the merged weights (W + alpha / r * B A) within the tolerance the suite uses for disk
publishes.
"""
import asyncio
import json
import os
import shutil

import numpy as np
import pytest

from tests import embedded_tiny
from tests.sglang.conftest import SGLangServer, requires_sglang
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import admin, launcher, lora, lora_launch, publisher as publisher_lib

pytestmark = [pytest.mark.sglang, requires_sglang, pytest.mark.integration, pytest.mark.timeout(1200)]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SERVING = lora_launch.LoraServing(rank=8, target_modules=TARGETS, max_lag=1)
VOCAB = embedded_tiny.TINY_MODEL["vocab_size"]
ATOL = 1e-4  # the suite's tolerance for served vs recomputed log-probs of a disk publish (float32)


def adapter(version: int, rank: int = 4):
  """A PEFT adapter of the tiny checkpoint on every linear layer (values a function of `version`)."""
  from vcpo_jax.serving import adapters  # noqa: PLC0415
  from vcpo_jax.model import config as model_config  # noqa: PLC0415
  cfg = model_config.ModelConfig(**embedded_tiny.TINY_MODEL)
  rng, dims, tensors = np.random.default_rng(version), adapters.module_dims(cfg), {}
  for i in range(cfg.num_layers):
    for m in TARGETS:
      prefix = f"base_model.model.model.layers.{i}.{adapters.PARENT[m]}.{m}"
      tensors[f"{prefix}.lora_A.weight"] = 0.3 * rng.standard_normal((rank, dims[m][0])).astype(np.float32)
      tensors[f"{prefix}.lora_B.weight"] = 0.3 * rng.standard_normal((dims[m][1], rank)).astype(np.float32)
  return {"peft_type": "LORA", "r": rank, "lora_alpha": 2.0 * rank, "target_modules": list(TARGETS),
          "bias": "none", "task_type": "CAUSAL_LM"}, tensors


def merged_dir(base: str, out: str, config: dict, tensors: dict) -> str:
  """The base checkpoint with the adapter folded in: W [out, in] += alpha / r * B @ A (float64, then float32)."""
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  shutil.copytree(base, out)
  weights = load_file(os.path.join(base, "model.safetensors"))
  scale = config["lora_alpha"] / config["r"]
  for key in {k.rsplit(".lora_", 1)[0] for k in tensors}:
    name = key.removeprefix("base_model.model.") + ".weight"
    delta = tensors[f"{key}.lora_B.weight"].astype(np.float64) @ tensors[f"{key}.lora_A.weight"].astype(np.float64)
    weights[name] = (weights[name].astype(np.float64) + scale * delta).astype(weights[name].dtype)
  save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  return out


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("lora")
  base = embedded_tiny.export_tiny(embedded_tiny.tiny_version(0), str(tmp / "base"))
  merged = merged_dir(base, str(tmp / "merged"), *adapter(1))
  # One after the other: a server measures the host's free memory while it loads (the other's load skews it);
  # the KV pool stays capped by launch_sglang.sh's --max-total-tokens.
  with_lora = SGLangServer(base, launcher.free_port(), str(tmp / "lora.log"),
                           flags=lora_launch.server_flags(SERVING), MEM_FRACTION="0.3").wait_ready()
  try:
    plain = SGLangServer(merged, launcher.free_port(), str(tmp / "merged.log"), MEM_FRACTION="0.3").wait_ready()
    try:
      yield with_lora, plain, tmp
    finally:
      plain.stop()
  finally:
    with_lora.stop()


async def _score(client, url, prompt, output, lora_path=None):
  """The server's log-probs of `output` after `prompt` (its input_token_logprobs), with or without an adapter."""
  body = {"input_ids": list(prompt) + list(output), "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
          "return_logprob": True, "logprob_start_len": len(prompt) - 1}
  if lora_path is not None:
    body["lora_path"] = lora_path
  status, out = await client.request_json(url, "POST", "/generate", body)
  assert status == 200, out
  return np.array([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])


def test_adapter_published_to_real_sglang_serves_the_merged_weights(servers):
  with_lora, plain, tmp = servers

  async def run():
    session = admin.AdminSession(30.0, lambda *_: None)
    try:
      await lora_launch.check_servers(session, [with_lora.url], SERVING)
      with pytest.raises(lora_launch.LoraLaunchError, match="launched without LoRA"):
        await lora_launch.check_servers(session, [plain.url], SERVING)
    finally:
      await session.close()
    async with client_lib.RolloutClient([with_lora.url], vocab_size=VOCAB) as client:
      sync = lora.AdapterSync(client, adapter, str(tmp / "adapters"), max_kept=SERVING.max_kept, timeout_s=120.0)
      pub = publisher_lib.WeightPublisher(lambda p, d: None, str(tmp / "adapters"), client, adapters=sync)
      try:
        assert await pub.publish(1, 1) == {with_lora.url: True}
        params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
        samples = [s for i in range(3) for s in await client.generate([5, 6, 7 + i], params, n=2)]
        gaps, base_gaps = [], []
        for s in samples:
          assert list(s.token_versions) == [1] * len(s.output_ids)  # from the adapter's name, not "v0"
          merged = await _score(client, plain.url, s.prompt_ids, s.output_ids)
          base = await _score(client, with_lora.url, s.prompt_ids, s.output_ids)
          gaps.append(float(np.abs(s.output_logprobs - merged).max()))
          base_gaps.append(float(np.abs(s.output_logprobs - base).max()))
        # The same adapter again, by tensors (shared-memory handles, sha256 checked by the server), as policy-v2.
        by_tensor = lora.AdapterSync(client, lambda v: adapter(1), str(tmp / "t"), max_kept=SERVING.max_kept,
                                     timeout_s=120.0, transport="tensor")
        tensor_pub = publisher_lib.WeightPublisher(lambda p, d: None, str(tmp / "t"), client, adapters=by_tensor)
        try:
          assert await tensor_pub.publish(2, 2) == {with_lora.url: True}
          for s in [s for i in range(2) for s in await client.generate([9, 8, 7 + i], params, n=2)]:
            assert list(s.token_versions) == [2] * len(s.output_ids)
            merged = await _score(client, plain.url, s.prompt_ids, s.output_ids)
            gaps.append(float(np.abs(s.output_logprobs - merged).max()))
        finally:
          await tensor_pub.close()
        refused = lora.AdapterSync(client, lambda v: adapter(v, rank=16), str(tmp / "big"), max_kept=3,
                                   timeout_s=120.0)
        big = publisher_lib.WeightPublisher(lambda p, d: None, str(tmp / "big"), client, adapters=refused)
        try:
          with pytest.raises(publisher_lib.PublishError, match="rank 16 is incompatible"):
            await big.publish(3, 3)
        finally:
          await big.close()
        return gaps, base_gaps
      finally:
        await pub.close()

  gaps, base_gaps = asyncio.run(run())
  print(json.dumps({"max_gap_vs_merged": max(gaps), "min_gap_vs_base": min(base_gaps)}))
  assert max(gaps) < ATOL, gaps
  assert min(base_gaps) > 1e-2, base_gaps  # the adapter changes what is served
