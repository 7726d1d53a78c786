"""Embedded server processes: a bad model dir reports the server's own error; servers exit with their parent."""
import os
import subprocess
import sys
import time

import pytest

from tests import waits
from vcpo_jax.model import config as model_config
from vcpo_jax.parallel import placement
from vcpo_jax.rollout.servers import launcher

pytestmark = pytest.mark.integration


def test_server_that_cannot_start_reports_its_output(tmp_path):
  (tmp_path / "model").mkdir()
  server = launcher.EmbeddedServer(str(tmp_path / "model"), weights_root=str(tmp_path), log_dir=str(tmp_path))
  with pytest.raises(launcher.ServerStartError, match="config.json"):
    server.start().wait_healthy(timeout=120)


_PARENT = """
import sys, time
from vcpo_jax.rollout.servers import launcher
s = launcher.EmbeddedServer(sys.argv[1], weights_root=sys.argv[2], log_dir=sys.argv[2]).start()
s.wait_healthy(timeout=300)
print(s.proc.pid, flush=True)
time.sleep(600)
"""


def test_server_exits_when_its_parent_is_killed(tmp_path):
  """A healthy server whose parent (a trainer) is SIGKILLed must not outlive it: its watchdog ends it."""
  import jax
  from vcpo_jax.model import hf_export
  from vcpo_jax.model import tokenizer
  from vcpo_jax.model import transformer as model
  cfg = model_config.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=16, max_seq_len=64)
  model_dir = hf_export.export_hf(model.init_params(cfg, jax.random.PRNGKey(0)), cfg, str(tmp_path / "v0"),
                           tokenizer.build_tokenizer())
  parent = subprocess.Popen([sys.executable, "-c", _PARENT, model_dir, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
  server_pid = int(parent.stdout.readline())
  os.kill(server_pid, 0)  # healthy and running
  parent.kill()
  waits.wait_process(parent, 60, "the killed parent to exit")
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


P, F = placement.PREALLOCATE_VAR, placement.MEM_FRACTION_VAR


def test_server_environment_never_preallocates_and_takes_the_plan(tmp_path, monkeypatch):
  """The child environment, read back from the process itself (a tiny stand-in for the server module)."""
  monkeypatch.setenv(F, "0.9")  # e.g. inherited from a learner's own setting: must not reach the server
  server = launcher.EmbeddedServer("unused", weights_root=str(tmp_path), log_dir=str(tmp_path),
                                   env={"CUDA_VISIBLE_DEVICES": "1", F: None})
  server.argv = [sys.executable, "-c", f"import os, json; print(json.dumps({{k: os.environ.get(k) for k in "
                 f"('CUDA_VISIBLE_DEVICES', {P!r}, {F!r})}}))"]
  server.start()
  server.proc.wait(timeout=60)
  server._log.close()
  import json
  assert json.loads(server.output()) == {"CUDA_VISIBLE_DEVICES": "1", P: "false", F: None}


_AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)), flush=True)"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_server_process_runs_on_its_cpus_and_the_caller_keeps_its_own(tmp_path):
  """The child's CPU mask, read back from the process itself; the starting thread's mask is restored."""
  mine = os.sched_getaffinity(0)
  cpu = max(mine)
  server = launcher.EmbeddedServer("unused", weights_root=str(tmp_path), log_dir=str(tmp_path),
                                   cpus=frozenset({cpu}))
  server.argv = [sys.executable, "-c", _AFFINITY]
  server.start()
  server.proc.wait(timeout=60)
  server._log.close()
  assert server.output().strip() == str([cpu])
  assert os.sched_getaffinity(0) == mine


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_unavailable_server_cpus_are_a_config_error_and_start_nothing(tmp_path):
  server = launcher.EmbeddedServer("unused", weights_root=str(tmp_path), log_dir=str(tmp_path),
                                   cpus=frozenset({4096}))
  server.argv = [sys.executable, "-c", _AFFINITY]
  mine = os.sched_getaffinity(0)
  with pytest.raises(ValueError, match="rollout.server_cpus='4096'"):
    server.start()
  assert server.proc is None and os.sched_getaffinity(0) == mine
