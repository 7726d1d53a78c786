"""One process of the two-process (multi-host on localhost) check; run by tests/test_multihost.py with
XLA_FLAGS giving each process 4 CPU devices."""
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax import model as M, sharding

CFG = M.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_seq_len=64)


def main(process_id: int, port: str, out_path: str):
  sharding.initialize_distributed(f"localhost:{port}", 2, process_id)
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


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
