"""Multi-host on localhost: two processes with jax.distributed, 4 CPU devices each, one global mesh; the
sharded forward over the global batch equals a single-process forward."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import multihost_worker as worker
from vcpo_jax import model as M
from vcpo_jax.rollout.launcher import free_port

pytestmark = pytest.mark.integration


@pytest.mark.cpu_only(reason="each process fakes 4 CPU devices (XLA_FLAGS host device count)")
def test_two_process_forward_equals_single_process(tmp_path):
  port = str(free_port())
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  procs = [subprocess.Popen([sys.executable, "-m", "tests.multihost_worker", str(i), port,
                             str(tmp_path / f"logp{i}.npy")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  for p in procs:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
  params = M.init_params(worker.CFG, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, worker.CFG.vocab_size)
  want = np.asarray(M.token_logprobs(params, worker.CFG, tokens, jnp.ones_like(tokens)))
  for i in range(2):
    np.testing.assert_allclose(np.load(tmp_path / f"logp{i}.npy"), want, atol=1e-5)
