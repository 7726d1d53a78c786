"""Test setup: 8 fake CPU devices (set before jax initialises), strict numerics guard rails, GPU-run rules,
one persistent compilation cache per run, shared by the test processes and the jobs they start.

The suite runs on CPU unless JAX_PLATFORMS says otherwise (`JAX_PLATFORMS=cuda make test` on a GPU machine):
tests marked `cpu_only` then skip with their reason, and every float32 matmul is true float32 (on GPUs the
default is TF32), so tests that compare implementations compare like with like.
"""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of small programs and runs each a few times, so on CPU LLVM's optimisation passes
# are most of its time (measured, -n 0: tests/test_bounded_norms.py + tests/test_grad_path_job.py 289 s -> 121 s;
# tests/test_model.py 126 s -> 97 s). Off for the tests and the jobs they start; no fast-math either way, and
# the benchmarks, which time programs, never run under them. VCPO_TEST_XLA_OPT=1 keeps XLA's defaults.
# XLA:CPU's older fusion emitters compile a third faster than its MLIR ones (a one-op program: 25 -> 17 ms;
# tests/test_lora_learner.py + tests/test_bounded_norms.py, -n 0: 218 -> 137 CPU-s, the same results).
CPU_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                    "--xla_cpu_use_fusion_emitters=false")
if os.environ["JAX_PLATFORMS"] == "cpu" and os.environ.get("VCPO_TEST_XLA_OPT") != "1":
  _flags = os.environ["XLA_FLAGS"].split()
  os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in CPU_FAST_COMPILE if f.split("=")[0] not in
                                              {g.split("=")[0] for g in _flags}])
# Several test processes (pytest-xdist) and the servers they start may share one accelerator.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Most of a tiny job's CPU time is XLA compiles (measured: 51 CPU s cold, 13 CPU s with every compile in
# the cache), and the suite compiles the same programs many times over: the test processes and the processes they
# start (vcpo_jax.main, servers, experiment units) share one persistent compilation cache per run, made by the
# first process of the run (xdist's controller; its workers inherit it) and removed by it at exit. A cache hit
# still traces and lowers (jit's own caching and memory_analysis() are unchanged); the benchmarks that time
# compiles turn the cache off themselves. Set JAX_COMPILATION_CACHE_DIR to use a cache of your own.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the run's first process: its workers and jobs inherit it
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="vcpo_jax_test_jax_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the default skips compiles < 1 s
# No size bound: with one, every write lists and stats the whole cache under a file lock that all the run's
# processes share, so a write costs O(entries) and the processes queue on the lock (7 test files, -n 2: 212 s ->
# 134 s wall, 335 -> 237 CPU-s). Unlocked, a process may read an entry another is still writing: jax then warns
# that the entry does not decompress and compiles the program itself.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402

pytest_plugins = ["timing_plugin"]  # VCPO_TEST_TIMES=FILE: what each test costs (tests/timing_plugin.py)

jax.config.update("jax_numpy_rank_promotion", "raise")
# Explicit precision for every comparison in the suite (the model's own dots also carry
# model.matmul_precision); this covers the rest (per-sequence norms, oracles, reference computations).
jax.config.update("jax_default_matmul_precision", "highest")


# Tests marked `extra` (the dry GPU check, the TPU compile check) run under `make test-extra`, which sets
# VCPO_TEST_EXTRA=1 and which CI runs after `make test`; `make test` skips them, naming the target.
EXTRA_TIER = os.environ.get("VCPO_TEST_EXTRA") == "1"


def _slow_files_first(items):
  """Files with a `slow` test (the jobs) run first, each file's tests kept together and in order: xdist hands
  them out while every worker is busy, so the suite does not end on one long job with the other worker idle."""
  slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
  items.sort(key=lambda item: item.path not in slow)  # stable: the collection order within each group


def pytest_collection_modifyitems(config, items):
  _slow_files_first(items)
  if not EXTRA_TIER:
    for item in items:
      if item.get_closest_marker("extra") is not None:
        item.add_marker(pytest.mark.skip(reason="run by `make test-extra` (CI runs it after make test)"))
  backend = jax.default_backend()
  if backend == "cpu":
    return
  for item in items:
    marker = item.get_closest_marker("cpu_only")
    if marker is not None:
      why = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "needs the CPU backend")
      item.add_marker(pytest.mark.skip(reason=f"cpu_only on {backend}: {why}"))


def _is_controller(config) -> bool:
  return not hasattr(config, "workerinput")  # an xdist worker has workerinput; the controller or -n 0 has not


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist starts its workers
def pytest_sessionstart(session):
  if _is_controller(session.config):
    from calibration import loop_seconds  # noqa: PLC0415
    session.config._calibration_start = loop_seconds()


def pytest_sessionfinish(session, exitstatus):
  """The jobs' RAM-backed weight versions (rollout.publish_dir "": /dev/shm/vcpo-<hash>, linked as
  WORKDIR/weights) outlive their workdirs: freed here for every workdir under this run's temporary directories."""
  if not _is_controller(session.config):
    return
  try:
    base = session.config._tmp_path_factory.getbasetemp()
  except (AttributeError, ValueError):
    return
  for root, dirs, _ in os.walk(base):
    for name in dirs:
      path = os.path.join(root, name)
      target = os.path.realpath(path)
      if name == "weights" and os.path.islink(path) and target.startswith("/dev/shm/vcpo-"):
        shutil.rmtree(target, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  """The host's speed at the suite's start and end: a suite timing is read against it (README's "Quick start")."""
  if _is_controller(config) and hasattr(config, "_calibration_start"):
    from calibration import ITERATIONS, loop_seconds  # noqa: PLC0415
    terminalreporter.write_line(f"calibration: {config._calibration_start:.2f} s at the start, {loop_seconds():.2f} s "
                                f"at the end ({ITERATIONS:,}-iteration Python loop, tests/calibration.py)")


def skip_if_not_enough_devices(n: int):
  return pytest.mark.skipif(len(jax.devices()) < n, reason=f"needs {n} devices")



# `make test-fast` (VCPO_TEST_TIER=unit) runs the unit tier: tests marked neither `slow` nor `integration`.
# A unit test must not start a process or a server: starting either raises while tests run, so an unmarked test fails
# clearly instead of silently slowing the tier.
UNIT_TIER = os.environ.get("VCPO_TEST_TIER") == "unit"


def _refuse(*args, **kwargs):
  raise RuntimeError("the unit tier (make test-fast) starts no process or server: mark this test "
                     "@pytest.mark.integration (or slow)")


@pytest.fixture(scope="session", autouse=True)
def _unit_tier_starts_nothing():
  """Session-scoped and autouse, so it is in force before any module's fixtures (servers) start."""
  if not UNIT_TIER:
    yield
    return
  import subprocess
  from aiohttp import web
  try:  # matplotlib builds its font cache with `fc-list` on first import: let it, before processes are refused
    import matplotlib.font_manager  # noqa: F401
  except ImportError:
    pass
  saved = subprocess.Popen.__init__, web.BaseSite.start
  subprocess.Popen.__init__, web.BaseSite.start = _refuse, _refuse
  try:
    yield
  finally:
    subprocess.Popen.__init__, web.BaseSite.start = saved


@pytest.fixture()
def cluster(tmp_path):
  """Two embedded servers on the tiny model's version 0 (embedded_tiny.embedded_cluster), stopped afterwards."""
  from tests import embedded_tiny  # noqa: PLC0415  (its imports only where a test asks for servers)
  with embedded_tiny.embedded_cluster(str(tmp_path)) as c:
    yield c


@pytest.fixture(scope="session")
def server(tmp_path_factory):
  """The embedded server of tests/test_server_*.py (server_harness.serve): one per test process, shared by those
  files; each test leaves it as it found it (weights m0, version v0). tests/sglang's files use their own."""
  from tests import server_harness  # noqa: PLC0415  (its imports only where a test asks for the server)
  yield from server_harness.serve(tmp_path_factory)
