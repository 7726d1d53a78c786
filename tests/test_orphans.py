"""No zombie and no leftover process after sandbox calls, reward workers and embedded servers, even as PID 1.

In a container the job is PID 1 of its PID namespace, so whatever its children orphan comes to it; test runs
tests/orphan_check.py in that position (and, where namespaces are unavailable, as a child subreaper).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
from tests import xla_env

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform != "linux", reason="Linux process model")]

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
N = 3  # timed-out calls, and as many normal ones, of each kind
# Ways to become PID 1 of a new PID namespace: as root; else inside a user namespace of one's own.
_UNSHARE = (["unshare", "--pid", "--fork", "--mount-proc"],
            ["unshare", "--user", "--map-current-user", "--pid", "--fork", "--mount-proc"])


def _pid1_prefix():
  """The first unshare command line that works here, and why none does."""
  if shutil.which("unshare") is None:
    return None, "no `unshare` command (util-linux)"
  why = ""
  for prefix in _UNSHARE:
    r = subprocess.run(prefix + ["true"], capture_output=True, text=True, timeout=60)
    if r.returncode == 0:
      return prefix, ""
    why = r.stderr.strip()
  return None, f"PID namespaces unavailable here ({why})"


def _check(prefix, *args):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, _HERE, os.environ.get("PYTHONPATH", "")]))
  env["XLA_FLAGS"] = xla_env.xla_flags()
  r = subprocess.run(prefix + [sys.executable, os.path.join(_HERE, "orphan_check.py"), *args, str(N)],
                     capture_output=True, text=True, timeout=600, env=env, cwd=_ROOT)
  assert r.returncode == 0, r.stderr[-4000:]
  report = json.loads(r.stdout.strip().splitlines()[-1])
  # The calls did what they were made to do: half the sandbox calls hit the wall limit, and the reward pool
  # lost workers to timeouts and to a worker killing itself.
  assert report["sandbox"] == ["timeout", "ok"] * N
  assert report["reward"] == [None, "timeout", "crash", "timeout"] * N
  return report


@pytest.mark.slow
def test_as_pid1_no_zombie_or_leftover_process():
  """N timed-out and N normal sandbox calls, reward workers that time out, die or leave a child, and an embedded
  server that crashes and is started again: afterwards PID 1 has no zombie and no other process."""
  prefix, why = _pid1_prefix()
  if prefix is None:
    pytest.skip(why)
  report = _check(prefix, "--server")
  assert report["pid"] == 1
  assert report["server"][0] == -9  # the crash was a crash
  assert report["leftovers"] == []


def test_as_subreaper_no_zombie_or_leftover_process():
  """The same re-parenting without a namespace: a child subreaper gets the orphans, and reaps every one."""
  report = _check([], "--subreaper")
  assert report["pid"] != 1
  assert report["leftovers"] == []


def test_wait_session_gone_waits_for_every_live_member_of_a_session():
  """A leader that has exited leaves a member behind: the wait reports it for as long as it lives, and returns once
  it is dead (the sandbox relies on this: a SIGKILLed process still dying never outlives a call). Its zombie goes to
  this host's PID 1, which may be slow to reap it: that is waited for only briefly."""
  import time
  from vcpo_jax import orphans
  leader = subprocess.Popen([sys.executable, "-c", "import subprocess\n"
                             "print(subprocess.Popen(['sleep', '60']).pid, flush=True)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
  member = int(leader.stdout.readline())
  try:
    assert orphans.wait_exited(leader.pid)
    assert sorted(pid for pid, _ in orphans.session_members(leader.pid)) == sorted([leader.pid, member])
    start = time.monotonic()
    assert not orphans.wait_session_gone(leader.pid, timeout_s=0.3)
    assert time.monotonic() - start >= 0.3
    os.kill(member, 9)
    gone = orphans.wait_session_gone(leader.pid, timeout_s=30.0, zombie_grace_s=0.5)
    left = [state for pid, state in orphans.session_members(leader.pid) if pid != leader.pid]
    assert gone == (left == []) and all(state == "Z" for state in left), left
  finally:
    leader.wait()
    leader.stdout.close()
