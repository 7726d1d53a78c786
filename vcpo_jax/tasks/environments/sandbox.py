"""A sandbox for model-written Python: each call runs in a fresh, isolated, resource-limited process (stdlib only)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from vcpo_jax import orphans
from vcpo_jax.tasks.environments import sandbox_launcher

# What `SandboxResult.kind` can be, so a tool can count errors by kind.
KINDS = ("ok", "nonzero_exit", "syntax_error", "memory", "cpu_limit", "timeout", "output_limit", "killed",
         "code_too_long", "spawn_failed")
_LAUNCHER = os.path.abspath(sandbox_launcher.__file__)  # run as a script: it enters the namespaces
_DRAIN_S = 0.25  # how long to keep reading after the sandbox's process group is gone or killed
_UIDS = itertools.count(random.randrange(1 << 30))  # distinct uids for concurrent calls (each its own NPROC count)
_log = logging.getLogger(__name__)
_warned = set()


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  wall_seconds: float = 5.0       # whole call, start-up included; then the process group is killed
  cpu_seconds: int = 2            # RLIMIT_CPU of the sandboxed process (SIGXCPU)
  memory_bytes: int = 256 << 20   # RLIMIT_AS (address space) per process
  output_bytes: int = 16 << 10    # per stream (stdout, stderr); more kills the sandbox (output_limit)
  file_bytes: int = 1 << 20       # RLIMIT_FSIZE: the largest file it may write
  disk_bytes: int = 16 << 20      # size of its private tmpfs (all files together), where a mount namespace exists
  processes: int = 8              # RLIMIT_NPROC (processes and threads of its uid)
  open_files: int = 64            # RLIMIT_NOFILE
  max_code_bytes: int = 64 << 10  # longer code is refused before anything starts (an argv string is <= 128 KiB)
  python: str = ""                # "": the caller's interpreter if its uid can run it, else /usr/bin/python3
  uid_base: int = 2_000_000_000   # as root, each call runs as a uid from [uid_base, uid_base + uid_count)
  uid_count: int = 1 << 16
  require_network_isolation: bool = False  # True: refuse to run (spawn_failed) where no network namespace exists

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type in ("int", "float") and not value > 0:
        raise ValueError(f"SandboxLimits.{field.name} must be > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  kind: str                       # one of KINDS
  stdout: str
  stderr: str
  exit_code: int | None = None    # the code's exit status, -N if signal N ended it, None if it did not run to an end
  stdout_truncated: bool = False
  stderr_truncated: bool = False
  isolation: tuple[str, ...] = ()  # in force: network, pid, mount, ipc, user (namespaces), tmp, proc, uid, processes
  wall_seconds: float = 0.0

  @property
  def network_isolated(self) -> bool:
    return "network" in self.isolation


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
  """Runs `code` with `limits`; never raises on anything the code does, and never waits past the wall limit."""
  start = time.monotonic()
  if len(code.encode("utf-8", "surrogatepass")) > limits.max_code_bytes:
    return SandboxResult("code_too_long", "", f"error: code longer than {limits.max_code_bytes} bytes\n")
  if "\0" in code:
    return SandboxResult("syntax_error", "", "SyntaxError: source code cannot contain null bytes\n")
  workdir = None
  try:
    workdir = tempfile.mkdtemp(prefix="vcpo_sandbox_")
    return _run(code, limits, workdir, start)
  except OSError as e:  # the host's resources (fds, disk, processes) ran out: no process of the code is left
    return SandboxResult("spawn_failed", "", f"error: cannot run the sandbox: {e}\n")
  finally:
    if workdir is not None:
      shutil.rmtree(workdir, ignore_errors=True)


def _run(code: str, limits: SandboxLimits, workdir: str, start: float) -> SandboxResult:
  uid = None
  if os.geteuid() == 0:
    uid = limits.uid_base + next(_UIDS) % limits.uid_count
    os.chown(workdir, uid, uid)
  settings = dict(python=limits.python or _default_python(uid is not None), cpu=limits.cpu_seconds,
                  memory=limits.memory_bytes, file=limits.file_bytes, disk=limits.disk_bytes, uid=uid,
                  processes=limits.processes, open_files=limits.open_files, caller=os.getpid(),
                  require_network=limits.require_network_isolation)
  status_r, status_w = os.pipe()
  try:
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", _LAUNCHER, json.dumps(settings), str(status_w), code],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
        env=sandbox_launcher.SANDBOX_ENV, close_fds=True, pass_fds=(status_w,), start_new_session=True)
  except (OSError, ValueError) as e:
    os.close(status_r)
    return SandboxResult("spawn_failed", "", f"error: cannot start the sandbox: {e}\n")
  finally:
    os.close(status_w)
  try:
    (out, err, status), truncated, killed_for = _collect(proc, status_r, limits, start + limits.wall_seconds)
  finally:
    _kill_group(proc)  # whatever is left; the leader is not reaped yet, so its group id cannot be reused
    orphans.reap_session(proc.pid)  # what the kill orphaned, where this process is PID 1 (a container)
    if orphans.wait_exited(proc.pid):  # unreaped, so its session id is still its own
      orphans.wait_session_gone(proc.pid)  # none of the code's processes outlives the call, even a dying one
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    os.close(status_r)
  report = {}
  for line in status.decode("utf-8", "replace").splitlines():
    try:
      report.update(json.loads(line))
    except ValueError:
      pass  # a line cut short by a kill
  isolation = tuple(report.get("isolation", ()))
  if isolation and "network" not in isolation and "network" not in _warned:
    _warned.add("network")
    _log.warning("code sandbox: no network namespace on this host (isolation: %s); sandboxed code can open "
                 "network connections", ",".join(isolation))
  kind, exit_code = _classify(report, killed_for, err, limits)
  if "setup_error" in report:
    err += f"error: sandbox setup failed: {report['setup_error']}\n".encode()
  return SandboxResult(kind, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), exit_code,
                       "out" in truncated, "err" in truncated, isolation, time.monotonic() - start)


def _default_python(drop_privileges: bool) -> str:
  """The caller's interpreter (its real file: -I -S ignores a venv), unless it or its stdlib lies under a
  directory the sandbox replaces with its own tmpfs (a venv under /tmp), or privileges are dropped and other
  users cannot reach them."""
  paths = [os.path.realpath(p) for p in (sys.executable, os.path.dirname(os.__file__))]
  hidden = any(p.startswith(d + "/") for p in paths for d in sandbox_launcher.PRIVATE_DIRS)
  if hidden or (drop_privileges and not all(map(_others_can_enter, paths))):
    return "/usr/bin/python3"
  return paths[0]


def _others_can_enter(path: str) -> bool:
  real = os.path.realpath(path)
  parts = real.split("/")
  return all(os.stat("/".join(parts[:i]) or "/").st_mode & 0o001 for i in range(1, len(parts) + 1))


def _collect(proc, status_r, limits, deadline):
  """Reads stdout, stderr and the status pipe with byte caps until all close, killing at the deadline or cap."""
  names = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err", status_r: "status"}
  caps = {"out": limits.output_bytes, "err": limits.output_bytes, "status": 1 << 16}
  bufs = {name: bytearray() for name in caps}
  truncated, killed_for, drain_until = set(), None, None
  with selectors.DefaultSelector() as sel:
    for fd in names:
      os.set_blocking(fd, False)
      sel.register(fd, selectors.EVENT_READ)
    while sel.get_map():
      now = time.monotonic()
      if now >= (drain_until or deadline):
        if drain_until is not None:
          break  # something outside the group (a process that left it) still holds a pipe: stop waiting for it
        killed_for, drain_until = "timeout", now + _DRAIN_S
        _kill_group(proc)
        continue
      for key, _ in sel.select((drain_until or deadline) - now):
        name = names[key.fd]
        try:
          chunk = os.read(key.fd, 1 << 16)
        except BlockingIOError:
          continue
        if not chunk:
          sel.unregister(key.fd)
          if name == "status" and drain_until is None:
            drain_until = now + _DRAIN_S  # the launcher's group is gone: output should close at once
          continue
        room = caps[name] - len(bufs[name])
        bufs[name] += chunk[:room]
        if len(chunk) > room:
          truncated.add(name)
          if name != "status" and killed_for is None:
            killed_for, drain_until = "output_limit", now + _DRAIN_S
            _kill_group(proc)
  return (bytes(bufs["out"]), bytes(bufs["err"]), bytes(bufs["status"])), truncated, killed_for


def _kill_group(proc):
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _classify(report, killed_for, err, limits):
  """The error kind and exit code from the launcher's report, the parent's own kill reason and stderr."""
  wait_status = report.get("status")
  exit_code = None if wait_status is None else os.waitstatus_to_exitcode(wait_status)
  if killed_for:
    return killed_for, exit_code
  if "setup_error" in report or "isolation" not in report:
    return "spawn_failed", None  # the launcher failed, or died before it started anything
  if report.get("syntax_error"):
    return "syntax_error", exit_code
  if exit_code is None:
    return "killed", None  # the launcher died before reporting (killed from outside)
  if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and report["cpu"] >= limits.cpu_seconds):
    return "cpu_limit", exit_code
  if exit_code < 0:
    return "killed", exit_code
  if exit_code == 0:
    return "ok", 0
  last = err.rstrip().rsplit(b"\n", 1)[-1]
  return ("memory" if last.startswith(b"MemoryError") else "nonzero_exit"), exit_code

