"""The real embedded server as the rollout tests start it: the tiny model, its exports, reference log-probs."""
from __future__ import annotations

import asyncio
import contextlib
import os

from vcpo_jax.model import config as model_config

TINY_MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_seq_len=320)
# One jit shape for every request (8 rows, 16 prompt slots, 256 new slots) and one token per decode chunk,
# so long generations are slow enough to interrupt (kill, weight update) mid-way.
# No --max-prompt-len: a resumed request sends prompt + partial output as its prompt.
EMBEDDED_ARGS = ("--context-length", "274", "--min-batch-bucket", "8",
                 "--max-batch", "8", "--min-prompt-bucket", "16", "--min-new-bucket", "256",
                 "--chunk-steps", "1", "--batch-window-ms", "5")


def tiny_params(seed: int):
  """Params of the tiny test model, sharpened so that different seeds give clearly different outputs."""
  import jax
  from vcpo_jax.model import transformer as model
  params = model.init_params(model_config.ModelConfig(**TINY_MODEL), jax.random.PRNGKey(seed))
  return jax.device_get(jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, params))


def export_tiny(params, out_dir: str) -> str:
  from vcpo_jax.model import hf_export
  from vcpo_jax.model import tokenizer
  return hf_export.export_hf(params, model_config.ModelConfig(**TINY_MODEL), out_dir, tokenizer.build_tokenizer())


def reference_logprobs(params, prompt: list[int], output: list[int]):
  """The learner's recompute: model.token_logprobs over prompt + output (padded to one jit shape)."""
  import jax.numpy as jnp
  import numpy as np
  from vcpo_jax.model import transformer as model
  cfg = model_config.ModelConfig(**TINY_MODEL)
  seq = list(prompt) + list(output)
  tokens = jnp.asarray(np.array([seq + [0] * (cfg.max_seq_len - len(seq))], np.int32))
  lp = np.asarray(model.token_logprobs(params, cfg, tokens, jnp.ones_like(tokens)))
  return lp[0, len(prompt):len(seq)]


def start_embedded(model_dir: str, weights_root: str, cache_dir: str, log_dir: str, port: int = 0,
                   weight_version: str = "v0"):
  from vcpo_jax.rollout.servers import launcher
  server = launcher.EmbeddedServer(model_dir, weights_root=weights_root, port=port, log_dir=log_dir,
                                   weight_version=weight_version,
                                   extra_args=EMBEDDED_ARGS + ("--compilation-cache-dir", cache_dir))
  return server.start()


_TINY_PARAMS: dict = {}  # version -> params, built once per test process


def tiny_version(version: int):
  """tiny_params(version), built once per test process (the publishers' tests serve versions 0, 1, 2, ...)."""
  if version not in _TINY_PARAMS:
    _TINY_PARAMS[version] = tiny_params(version)
  return _TINY_PARAMS[version]


@contextlib.contextmanager
def embedded_cluster(base: str, n: int = 2):
  """n embedded servers on version 0 of the tiny model, weights root `base`/weights; yields the publisher's
  view of them (servers, root, init_dir, cache, logs) and stops them afterwards."""
  init_dir = export_tiny(tiny_version(0), os.path.join(base, "init", "v0"))
  root, logs = os.path.join(base, "weights"), os.path.join(base, "logs")
  os.makedirs(root)
  cache = os.environ["JAX_COMPILATION_CACHE_DIR"]  # the suite's (conftest.py): shared by every worker
  servers = [start_embedded(init_dir, root, cache, logs) for _ in range(n)]
  try:
    for s in servers:
      s.wait_healthy(180)
    yield {"servers": servers, "root": root, "init_dir": init_dir, "cache": cache, "logs": logs}
  finally:
    for s in servers:
      s.stop()


async def served_samples(client, groups: int):
  """`groups` seeded groups of 2 ten-token samples through the rollout client (what the servers serve now)."""
  params = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}
  out = await asyncio.gather(*(client.generate([5, 6, 7 + i], params, n=2) for i in range(groups)))
  return [s for g in out for s in g]


def assert_served_by(samples, version: int) -> None:
  """Every token of every sample tagged `version`, its log-prob the learner's recompute under that version."""
  import numpy as np
  for s in samples:
    assert list(s.token_versions) == [version] * len(s.output_ids)
    ref = reference_logprobs(tiny_version(version), s.prompt_ids, s.output_ids)
    np.testing.assert_allclose(s.output_logprobs, ref, atol=2e-4, rtol=0)
