"""VCPO_TEST_TIMES=FILE: what each test costs, and when the host's CPUs sat idle (a pytest plugin).

One line per test, appended as it ends (a stopped run keeps what it measured): wall s, CPU s of the test process
and the processes it waited for, the test process's XLA compiles and their seconds, its start (epoch s), the
xdist worker, the node id. CPU seconds, unlike wall time, do not grow with a busy host: they rank the tests by
what they cost. FILE.cpu gets, every second, the epoch time and the fraction of the host's CPU time that was busy
(from /proc/stat), so the moments the suite left cores idle can be matched to the tests running then.
"""
import os
import resource
import threading
import time

import jax
import pytest

TIMES_FILE = os.environ.get("VCPO_TEST_TIMES")
_COMPILES = [0, 0.0]  # XLA compiles in this process (cache hits are not compiles) and their seconds


def _cpu() -> float:
  own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _count_compile(event, seconds, **_):
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1
    _COMPILES[1] += seconds


def _host_ticks() -> tuple[int, int]:
  """(busy, total) jiffies of all CPUs since boot; idle and iowait count as not busy."""
  with open("/proc/stat") as f:
    fields = [int(x) for x in f.readline().split()[1:]]
  return sum(fields) - fields[3] - fields[4], sum(fields)


def _sample_host(path: str, stop: threading.Event):
  busy0, total0 = _host_ticks()
  while not stop.wait(1.0):
    busy, total = _host_ticks()
    with open(path, "a") as f:
      f.write(f"{time.time():.1f}\t{(busy - busy0) / max(total - total0, 1):.3f}\n")
    busy0, total0 = busy, total


if TIMES_FILE:
  jax.monitoring.register_event_duration_secs_listener(_count_compile)

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    start, t0, c0, n0, s0 = time.time(), time.perf_counter(), _cpu(), _COMPILES[0], _COMPILES[1]
    yield
    with open(TIMES_FILE, "a") as f:
      f.write(f"{time.perf_counter() - t0:.2f}\t{_cpu() - c0:.2f}\t{_COMPILES[0] - n0}\t{_COMPILES[1] - s0:.2f}\t"
              f"{start:.1f}\t{os.environ.get('PYTEST_XDIST_WORKER', '-')}\t{item.nodeid}\n")

  def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput") and os.path.exists("/proc/stat"):  # the controller, once
      stop = threading.Event()
      threading.Thread(target=_sample_host, args=(TIMES_FILE + ".cpu", stop), daemon=True).start()
      session.config._host_sampler_stop = stop

  def pytest_sessionfinish(session):
    if hasattr(session.config, "_host_sampler_stop"):
      session.config._host_sampler_stop.set()
