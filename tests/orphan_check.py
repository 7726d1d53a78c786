"""Runs sandbox calls, reward-pool calls and embedded-server restarts, then prints what is left of them (JSON).

Run: python tests/orphan_check.py [--subreaper] [--server] N. test_orphans.py runs it as PID 1 of a PID namespace
of its own (`unshare --pid --fork`), as a container runs a job; with --subreaper it marks itself a child
subreaper instead (the same re-parenting, no namespace needed). The reward functions live here, importable by
name, because a "process" pool sends a function by reference.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

_PR_SET_CHILD_SUBREAPER = 36


def normal(x):
  return x + 1


def hang(x):
  time.sleep(60)


def kill_self(x):
  os.kill(os.getpid(), signal.SIGKILL)


def hang_with_child(x):
  subprocess.Popen(["sleep", "60"])  # in the worker's process group: killed with it, orphaned to us
  time.sleep(60)


def _sandbox_kinds(n: int) -> list[str]:
  from vcpo_jax.tasks.environments import sandbox
  quick, slow = sandbox.SandboxLimits(wall_seconds=0.5), sandbox.SandboxLimits(wall_seconds=20)
  kinds = []
  for _ in range(n):
    kinds.append(sandbox.run_python("while True: pass", quick).kind)
    kinds.append(sandbox.run_python("import subprocess; subprocess.Popen(['sleep', '60']); print(1)", slow).kind)
  return kinds


def _reward_errors(n: int) -> list:
  import orphan_check  # this file as a module: the worker imports the functions from it
  from vcpo_jax.calls.offload import CallPool
  pool = CallPool("process", workers=2, timeout_s=1.0, name="reward")
  try:
    fns = [orphan_check.normal, orphan_check.hang, orphan_check.kill_self, orphan_check.hang_with_child]
    return [pool.call_blocking(fn, 1).error for _ in range(n) for fn in fns]
  finally:
    pool.close()


def _server_restarts() -> list[str]:
  """Starts an embedded server on a tiny model, kills it (a crash), stops it, starts a new one, stops it."""
  import jax
  from vcpo_jax.model import config as model_config, hf_export, tokenizer, transformer
  from vcpo_jax.rollout.servers import launcher
  cfg = model_config.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                                 num_kv_heads=2, head_dim=8, max_seq_len=64)
  root = tempfile.mkdtemp(prefix="orphan_check_")
  model_dir = os.path.join(root, "m0")
  hf_export.export_hf(transformer.init_params(cfg, jax.random.PRNGKey(0)), cfg, model_dir, tokenizer.build_tokenizer())
  codes = []
  for crash in (True, False):
    server = launcher.EmbeddedServer(model_dir, weights_root=root, log_dir=root).start().wait_healthy(300)
    if crash:
      os.kill(server.proc.pid, signal.SIGKILL)
      server.proc.wait()
    server.stop()
    codes.append(server.proc.returncode)
  return codes


def leftovers() -> list[list]:
  """[pid, state, command] of every other process in this PID namespace (PID 1) or below this process."""
  me, procs = os.getpid(), {}
  for entry in os.listdir("/proc"):
    if entry.isdigit() and int(entry) != me:
      try:
        with open(f"/proc/{entry}/stat") as f:
          head, rest = f.read().rsplit(")", 1)
        procs[int(entry)] = (rest.split()[0], int(rest.split()[1]), head.split("(", 1)[1])
      except (OSError, IndexError, ValueError):
        continue
  if me == 1:
    return [[pid, state, name] for pid, (state, _, name) in sorted(procs.items())]
  mine, todo = [], [me]
  while todo:
    parent = todo.pop()
    for pid, (state, ppid, name) in procs.items():
      if ppid == parent:
        mine.append([pid, state, name])
        todo.append(pid)
  return mine


def main(argv: list[str]) -> None:
  if "--subreaper" in argv:
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
      raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
  n = int(argv[-1])
  report = {"pid": os.getpid(), "sandbox": _sandbox_kinds(n), "reward": _reward_errors(n)}
  if "--server" in argv:
    report["server"] = _server_restarts()
  time.sleep(0.5)  # anything dying late would show as a zombie below
  report["leftovers"] = leftovers()
  print(json.dumps(report))


if __name__ == "__main__":
  main(sys.argv[1:])
