"""One process of the two-process (multi-host on localhost) checks; run by tests/test_multihost.py with
XLA_FLAGS giving each process 4 CPU devices. Modes: `forward` (the sharded forward over a global batch fed per
process) and `hung_leader` (process 0 hangs; process 1 must stop waiting for its rows with a clear error)."""
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vcpo_jax.job import batching
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M
from vcpo_jax.parallel import processes
from vcpo_jax.parallel import sharding

CFG = model_config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_seq_len=64)


def forward(process_id: int, out_path: str):
  assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  params, _ = sharding.create_sharded(lambda: M.init_params(CFG, jax.random.PRNGKey(0), boxed=True), mesh)
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, CFG.vocab_size))
  local = tokens[process_id * 4:(process_id + 1) * 4]  # each host feeds its own rows
  global_tokens = jax.make_array_from_process_local_data(sharding.batch_sharding(mesh), local, tokens.shape)
  with jax.set_mesh(mesh), nn.logical_axis_rules(list(sharding.DEFAULT_RULES)):
    logp = jax.jit(lambda p, t: M.token_logprobs(p, CFG, t, jnp.ones_like(t)),
                   out_shardings=sharding.replicated(mesh))(params, global_tokens)
  np.save(out_path, np.asarray(logp))


def hung_leader(process_id: int):
  if process_id == 0:
    time.sleep(8)  # "hung": never sends the rows
    return
  mesh = sharding.make_mesh({"data": -1})
  try:
    batching.feed_rows(None, 0, mesh, 8, timeout_s=2.0)
  except processes.ProcessGroupError as e:
    print(f"ProcessGroupError: {e}", flush=True)
    sys.exit(3)


def main(process_id: int, port: str, mode: str, out_path: str = ""):
  processes.initialize(ml_collections.ConfigDict(dict(
      auto=False, coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
      heartbeat_timeout_s=5, timeout_s=2.0)))
  if mode == "forward":
    forward(process_id, out_path)
  else:
    hung_leader(process_id)


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])
