"""Bounded waits for tests: poll a condition until it holds or a deadline passes, then fail naming what was awaited."""
import asyncio
import inspect
import os
import subprocess
import time


def _timed_out(what: str, timeout_s: float) -> AssertionError:
  return AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.01):
  """Calls predicate() until it returns a true value (returned); AssertionError naming `what` after timeout_s.
  A predicate may itself raise (e.g. "the process died") to fail early."""
  deadline = time.monotonic() + timeout_s
  while True:
    value = predicate()
    if value:
      return value
    if time.monotonic() > deadline:
      raise _timed_out(what, timeout_s)
    time.sleep(interval_s)


async def async_wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.002):
  """wait_until inside an event loop: predicate() may return a value or an awaitable of one."""
  deadline = time.monotonic() + timeout_s
  while True:
    value = predicate()
    if inspect.isawaitable(value):
      value = await value
    if value:
      return value
    if time.monotonic() > deadline:
      raise _timed_out(what, timeout_s)
    await asyncio.sleep(interval_s)


async def wait_for(awaitable, timeout_s: float, what: str):
  """asyncio.wait_for whose timeout fails naming `what`."""
  try:
    return await asyncio.wait_for(awaitable, timeout_s)
  except asyncio.TimeoutError:
    raise _timed_out(what, timeout_s) from None


def wait_process(proc: subprocess.Popen, timeout_s: float, what: str) -> int:
  """proc.wait with a bound: on timeout the process is killed (not left behind) and the test fails."""
  try:
    return proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait(timeout=30)
    raise _timed_out(what, timeout_s) from None


def live_pids(match) -> list[tuple[int, str]]:
  """(pid, command line) of the live processes (not zombies, not this one) whose command line `match` accepts:
  what a test that started processes checks is gone."""
  found = []
  for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
      with open(f"/proc/{entry}/stat") as f:
        zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
      continue
    if int(entry) != os.getpid() and not zombie and match(cmd):
      found.append((int(entry), cmd))
  return found
