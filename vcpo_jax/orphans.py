"""Reaps the processes a job ended that were re-parented to it (the job is PID 1 or a subreaper, as in a container).

When a process dies, its children go to the nearest subreaper ancestor, else to PID 1 of the PID namespace. On a
host that is init, which reaps them; in a container (`docker run IMAGE python -m vcpo_jax.main`) it is the job
itself, and every child of a killed sandbox, reward worker or server would stay a zombie until the process table
fills. Each of those starts in a session of its own (`start_new_session`), so "a child of mine in that session"
names exactly the leftovers of one thing the job ended. Reaping is by pid, never `wait(-1)`: that would steal the
exit status of children that `subprocess` and others wait for themselves.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time

_PR_GET_CHILD_SUBREAPER = 37


def _stat(pid: int) -> tuple[str, int, int] | None:
  """(state, parent pid, session id) of `pid` from /proc, or None if it is gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return None
  return fields[0], int(fields[1]), int(fields[3])


def adopts_orphans() -> bool:
  """Whether orphans come to this process: it is PID 1 of its namespace or a child subreaper (Linux)."""
  if os.getpid() == 1:
    return True
  try:
    flag = ctypes.c_int(0)
    return ctypes.CDLL(None).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and bool(flag.value)
  except (OSError, AttributeError):
    return False


def children_in_session(session: int) -> list[int]:
  """This process's children (zombies included) in session `session`."""
  me, found = os.getpid(), []
  for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
    if entry.isdigit():
      stat = _stat(int(entry))
      if stat is not None and stat[1] == me and stat[2] == session:
        found.append(int(entry))
  return found


def session_members(session: int) -> list[tuple[int, str]]:
  """(pid, state) of every process this one can see in session `session`, zombies included."""
  found = []
  for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
    if entry.isdigit():
      stat = _stat(int(entry))
      if stat is not None and stat[2] == session:
        found.append((int(entry), stat[0]))
  return found


def wait_session_gone(leader: int, timeout_s: float = 5.0, zombie_grace_s: float = 0.5) -> bool:
  """Waits until no process but `leader` (a child killed with its group, not reaped yet, so its session id is not
  reused) is left in its session; whether none is. A SIGKILLed process can run on for a moment (a pid namespace's
  init first kills and reaps all it holds), so without this wait a caller could return while the code it ran still
  exists. Zombies left to a PID 1 that is slow to reap them are waited for only `zombie_grace_s`."""
  start = time.monotonic()
  while True:
    left = [state for pid, state in session_members(leader) if pid != leader]
    if not left:
      return True
    waited = time.monotonic() - start
    if waited >= timeout_s or (waited >= zombie_grace_s and all(state == "Z" for state in left)):
      return False
    time.sleep(0.002)


def wait_exited(pid: int, timeout_s: float = 10.0) -> bool:
  """Waits up to `timeout_s` for child `pid` to exit, leaving it unreaped: then its children have been re-parented,
  and its pid (its session's id too) cannot be reused by a new session leader while we reap that session."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
        return True
    except ChildProcessError:
      return False  # already reaped, or not our child
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.005)


def reap_session(leader: int, timeout_s: float = 10.0) -> int:
  """Kills and reaps every process of the session that child `leader` leads (it was started with
  `start_new_session` and has been killed) that was re-parented to this one; how many. Call it before reaping the
  leader itself (`Popen.wait`). A no-op, without waiting, where orphans go elsewhere."""
  if not adopts_orphans() or not wait_exited(leader, timeout_s):
    return 0
  reaped = 0
  while True:  # reaping one re-parents its own children to us: look again until none is left
    pids = [pid for pid in children_in_session(leader) if pid != leader]
    if not pids:
      return reaped
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)  # still ours (unreaped), so the pid is not someone else's yet
        os.waitpid(pid, 0)
        reaped += 1
      except (ProcessLookupError, ChildProcessError):
        pass
