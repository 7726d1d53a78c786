"""Embedded server processes: a bad model dir reports the server's own error; servers exit with their parent."""
import os
import subprocess
import sys
import time

import pytest

from vcpo_jax.rollout import launcher

pytestmark = pytest.mark.integration


def test_server_that_cannot_start_reports_its_output(tmp_path):
  (tmp_path / "model").mkdir()
  server = launcher.EmbeddedServer(str(tmp_path / "model"), weights_root=str(tmp_path), log_dir=str(tmp_path))
  with pytest.raises(launcher.ServerStartError, match="config.json"):
    server.start().wait_healthy(timeout=120)


_PARENT = """
import sys, time
from vcpo_jax.rollout import launcher
s = launcher.EmbeddedServer(sys.argv[1], weights_root=sys.argv[2], log_dir=sys.argv[2]).start()
s.wait_healthy(timeout=300)
print(s.proc.pid, flush=True)
time.sleep(600)
"""


def test_server_exits_when_its_parent_is_killed(tmp_path):
  """A healthy server whose parent (a trainer) is SIGKILLed must not outlive it: its watchdog ends it."""
  import jax
  from vcpo_jax import hf, model, tokenizer
  cfg = model.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=16, max_seq_len=64)
  model_dir = hf.export_hf(model.init_params(cfg, jax.random.PRNGKey(0)), cfg, str(tmp_path / "v0"),
                           tokenizer.build_tokenizer())
  parent = subprocess.Popen([sys.executable, "-c", _PARENT, model_dir, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
  server_pid = int(parent.stdout.readline())
  os.kill(server_pid, 0)  # healthy and running
  parent.kill()
  parent.wait()
  deadline = time.time() + 60
  while time.time() < deadline:
    try:
      os.kill(server_pid, 0)
    except ProcessLookupError:
      return
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{server_pid}/stat") as f:
      if f.read().split()[2] == "Z":
        return
    time.sleep(0.5)
  pytest.fail(f"server {server_pid} outlived its killed parent")
