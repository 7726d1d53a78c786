"""The code sandbox contains what model-written code can do: each attack is run in a real process, counted by kind."""
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from vcpo_jax.tasks.environments import sandbox
from vcpo_jax.tasks.environments.sandbox import KINDS, SandboxLimits, run_python, sandbox_launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A uid range of the tests' own, so leftover processes of the sandbox can be found by uid.
UID_BASE = 2_100_000_000 + os.getpid() % 100_000
# Wall limits leave room for a loaded machine (2 cores shared by many processes): a run that should end by
# itself is not cut by the wall clock.
FAST = SandboxLimits(wall_seconds=10.0, cpu_seconds=1, processes=8, uid_base=UID_BASE, uid_count=1)
TIGHT = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, processes=8, uid_base=UID_BASE, uid_count=1)

pytestmark = pytest.mark.integration


def _sandbox_processes() -> list[int]:
  """Pids of live processes running as the tests' sandbox uid (none may outlive a call)."""
  pids = []
  for entry in pathlib.Path("/proc").iterdir():
    try:
      status = (entry / "status").read_text()
    except OSError:
      continue
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    if str(UID_BASE) in uids:
      pids.append(int(entry.name))
  return pids


@pytest.fixture(autouse=True)
def _nothing_left_behind():
  yield
  if os.geteuid() == 0:
    assert _sandbox_processes() == []


def test_normal_code_returns_its_output():
  result = run_python("print(2**100)", FAST)
  assert (result.kind, result.exit_code, result.stdout) == ("ok", 0, f"{2**100}\n")
  assert result.kind in KINDS and not result.stdout_truncated


def test_a_caller_whose_interpreter_lives_under_tmp(monkeypatch):
  """A clone with its venv under /tmp: the sandbox's own /tmp hides that path, so it runs the real file."""
  venv = tempfile.mkdtemp(dir="/tmp", prefix="vcpo sandbox venv ")
  try:
    os.symlink(os.path.realpath(sys.executable), os.path.join(venv, "python"))
    monkeypatch.setattr(sys, "executable", os.path.join(venv, "python"))
    result = run_python("print(2 + 2)", FAST)
    assert (result.kind, result.stdout) == ("ok", "4\n"), result.stderr
    for drop_privileges in (False, True):  # a non-root caller keeps its interpreter; root may need another
      chosen = sandbox._default_python(drop_privileges)
      assert not chosen.startswith("/tmp/") and os.access(chosen, os.X_OK), chosen
  finally:
    shutil.rmtree(venv)


def test_nonzero_exit_and_stderr():
  result = run_python("import sys\nprint('x', file=sys.stderr)\nsys.exit(3)", FAST)
  assert (result.kind, result.exit_code, result.stderr) == ("nonzero_exit", 3, "x\n")


def test_syntax_error():
  result = run_python("print(", FAST)
  assert result.kind == "syntax_error"
  assert "SyntaxError" in result.stderr


def test_infinite_loop_hits_the_cpu_limit():
  # A generous wall limit, so the CPU limit (1 CPU second) ends it even on a loaded machine.
  result = run_python("while True:\n  pass", SandboxLimits(wall_seconds=30, cpu_seconds=1, uid_base=UID_BASE,
                                                                uid_count=1))
  assert result.kind == "cpu_limit"
  assert result.wall_seconds < 30


def test_sleeping_code_hits_the_wall_limit():
  result = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_seconds=1, uid_base=UID_BASE, uid_count=1))
  assert result.kind == "timeout"
  assert result.wall_seconds < 10


def test_memory_bomb():
  # bytearray zero-fills every page it gets: on a loaded 2-core host the page faults alone can pass FAST's one
  # CPU-second, so this test gives the bomb CPU room enough that only the address-space limit can stop it.
  limits = SandboxLimits(wall_seconds=30.0, cpu_seconds=10, processes=8, uid_base=UID_BASE, uid_count=1)
  result = run_python("blocks = []\nwhile True:\n  blocks.append(bytearray(16 << 20))", limits)
  assert result.kind == "memory"
  assert "MemoryError" in result.stderr


def test_fork_bomb_is_contained():
  # Every process forks for ever; the process limit refuses most forks and the wall limit ends them all (the
  # autouse fixture checks that none is left).
  code = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"
  result = run_python(code, TIGHT)
  assert result.kind in ("timeout", "cpu_limit", "killed")
  if "processes" not in result.isolation:
    pytest.skip(f"no process limit on this host (isolation: {result.isolation})")
  counted = run_python("import os, signal\nn = 0\ntry:\n  while True:\n    if os.fork() == 0:\n      signal.pause()\n"
                       "    n += 1\nexcept OSError:\n  print(n)", FAST)
  assert (counted.kind, counted.stderr) == ("ok", "") and 0 < int(counted.stdout) < FAST.processes


def test_100_mb_of_output_is_cut():
  code = "import sys\nfor _ in range(100):\n  sys.stdout.write('x' * (1 << 20))"
  result = run_python(code, TIGHT)
  assert result.kind == "output_limit"
  assert result.stdout_truncated and result.stdout == "x" * FAST.output_bytes


def test_writes_outside_its_directory_land_nowhere():
  name = f"vcpo_sandbox_probe_{uuid.uuid4().hex}"
  targets = [os.path.join(tempfile.gettempdir(), name), f"/var/tmp/{name}", str(ROOT / name)]
  code = ("import os\nprint('cwd', os.getcwd(), os.listdir('.'))\nfor path in %r:\n  try:\n"
          "    open(path, 'w').write('x')\n    print('wrote', path)\n  except OSError as e:\n"
          "    print('refused', path, type(e).__name__)" % (targets,))
  result = run_python(code, FAST)
  assert result.kind == "ok", result.stderr
  assert not any(os.path.exists(path) for path in targets), result.stdout
  if os.geteuid() == 0:
    assert "uid" in result.isolation
    # The repository is not writable; where the clone lives under a directory the sandbox replaces with its own
    # tmpfs (a clone under /tmp), it is not even there.
    hidden = "tmp" in result.isolation and any(
        os.path.realpath(ROOT).startswith(d + "/") for d in sandbox_launcher.PRIVATE_DIRS)
    assert f"refused {ROOT / name} {'FileNotFoundError' if hidden else 'PermissionError'}" in result.stdout
  assert result.stdout.splitlines()[0].endswith(" []")  # it starts in an empty directory


def test_no_connection_to_a_loopback_server():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = ("import socket\ntry:\n  socket.create_connection(('127.0.0.1', %d), timeout=0.5)\n  print('connected')\n"
            "except OSError as e:\n  print('refused', type(e).__name__)" % port)
    result = run_python(code, FAST)
    if not result.network_isolated:
      pytest.skip(f"no network namespace on this host (isolation: {result.isolation})")
    assert result.kind == "ok" and result.stdout.startswith("refused"), result.stdout
    with pytest.raises(BlockingIOError):
      server.accept()


def test_killing_its_parent_leaves_the_caller_and_its_supervisor_alive():
  # Its parent (the supervisor), the caller by pid, every process it may signal (-1), then its own group.
  code = ("import os, signal\nfor pid in (os.getppid(), %d, -1):\n  try:\n    os.kill(pid, signal.SIGKILL)\n"
          "    print('killed', pid, flush=True)\n  except OSError as e:\n"
          "    print('refused', pid, type(e).__name__, flush=True)\nos.killpg(0, signal.SIGKILL)\n" % os.getpid())
  result = run_python(code, FAST)
  # The supervisor outlived the attempts and reported how the code ended: killed with its own process group.
  assert (result.kind, result.exit_code) == ("killed", -9), (result, result.stdout)
  assert result.stdout.count("refused") == 3, result.stdout  # none could be killed
  assert run_python("print(1)", FAST).stdout == "1\n"  # and the sandbox still works


def test_the_callers_environment_is_not_readable(monkeypatch):
  secret = uuid.uuid4().hex
  monkeypatch.setenv("VCPO_SANDBOX_TEST_SECRET", secret)
  code = ("import os\nprint(dict(os.environ))\nfor pid in os.listdir('/proc') + ['%d']:\n"
          "  for name in ('environ', 'cmdline'):\n    try:\n      print(open(f'/proc/{pid}/{name}', 'rb').read())\n"
          "    except OSError:\n      pass" % os.getpid())
  result = run_python(code, FAST)
  assert result.kind == "ok", result.stderr
  assert "PATH" in result.stdout and secret not in result.stdout and "VCPO_SANDBOX_TEST_SECRET" not in result.stdout


def test_a_process_that_leaves_the_group_does_not_hold_the_call():
  code = ("import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\nelse:\n  print('parent done')")
  result = run_python(code, SandboxLimits(wall_seconds=20, uid_base=UID_BASE, uid_count=1))
  assert result.kind == "ok" and result.stdout == "parent done\n"
  if "pid" in result.isolation:
    assert result.wall_seconds < 10  # the pid namespace ends with its supervisor: no wait for the sleeper


def test_bad_limits_are_refused():
  with pytest.raises(ValueError, match="wall_seconds"):
    SandboxLimits(wall_seconds=0)


def _wait_until(predicate, timeout_s: float) -> bool:
  end = time.monotonic() + timeout_s
  while time.monotonic() < end:
    if predicate():
      return True
    time.sleep(0.05)
  return predicate()


@pytest.mark.skipif(os.geteuid() != 0, reason="finds the sandbox's processes by the uid it runs them as (root only)")
def test_the_sandbox_dies_with_its_caller():
  script = ("from vcpo_jax.tasks.environments.sandbox import SandboxLimits, run_python\n"
            "run_python('import time\\ntime.sleep(60)', SandboxLimits(wall_seconds=60, uid_base=%d, uid_count=1))"
            % UID_BASE)
  caller = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(ROOT)))
  try:
    assert _wait_until(_sandbox_processes, 30), "the sandboxed code never started"
  finally:
    caller.kill()
    caller.wait()
  assert _wait_until(lambda: not _sandbox_processes(), 10), _sandbox_processes()
