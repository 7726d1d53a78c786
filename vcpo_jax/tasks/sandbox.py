"""A sandbox for model-written Python: each call runs in a fresh, isolated, resource-limited process (stdlib only)."""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import logging
import os
import random
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

# What `SandboxResult.kind` can be, so a tool can count errors by kind.
KINDS = ("ok", "nonzero_exit", "syntax_error", "memory", "cpu_limit", "timeout", "output_limit", "killed",
         "code_too_long", "spawn_failed")
# The variables the sandboxed process sees: nothing of the caller's environment.
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
# World-writable places a process under an unprivileged uid could still write to; with a mount namespace they
# are one throwaway tmpfs (capped at `disk_bytes`) that disappears with the sandbox.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_CLONE = {"user": 0x10000000, "network": 0x40000000, "pid": 0x20000000, "mount": 0x00020000, "ipc": 0x08000000}
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
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
        [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(settings), str(status_w), code],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=SANDBOX_ENV,
        close_fds=True, pass_fds=(status_w,), start_new_session=True)
  except (OSError, ValueError) as e:
    os.close(status_r)
    return SandboxResult("spawn_failed", "", f"error: cannot start the sandbox: {e}\n")
  finally:
    os.close(status_w)
  try:
    (out, err, status), truncated, killed_for = _collect(proc, status_r, limits, start + limits.wall_seconds)
  finally:
    _kill_group(proc)  # whatever is left; the leader is not reaped yet, so its group id cannot be reused
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
  """The caller's interpreter, unless privileges are dropped and other users cannot reach it or its stdlib."""
  if not drop_privileges or all(map(_others_can_enter, (sys.executable, os.path.dirname(os.__file__)))):
    return sys.executable
  return "/usr/bin/python3"


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


# ---- The launcher: this file run as `python -I -S sandbox.py SETTINGS STATUS_FD CODE` in a new session. ----

def _launch(settings: dict, status_fd: int, code: str):
  """Enters new namespaces, runs the code under a supervisor, then kills its whole process group (itself too)."""
  os.set_inheritable(status_fd, False)  # the code never sees the status pipe

  def report(**fields):
    try:
      os.write(status_fd, (json.dumps(fields) + "\n").encode())
    except OSError:
      pass  # the caller stopped reading: it has given up on this run

  libc = ctypes.CDLL(None, use_errno=True)
  try:
    _die_with_parent(libc)
    if os.getppid() != settings["caller"]:
      return  # the caller died before the line above
    isolation = _unshare(libc)
    if settings["require_network"] and "network" not in isolation:
      report(isolation=isolation, setup_error="no network namespace on this host (require_network_isolation)")
    elif "pid" in isolation:
      init = os.fork()  # pid 1 of the new pid namespace: when it exits, every process left in it is killed
      if init == 0:
        try:
          _die_with_parent(libc)
          _supervise(settings, code, report, libc, isolation)
        except BaseException as e:  # noqa: BLE001 -- reported, then this process ends
          report(setup_error=f"{type(e).__name__}: {e}")
        finally:
          os._exit(0)
      os.waitpid(init, 0)
    else:
      _supervise(settings, code, report, libc, isolation)
  except BaseException as e:  # noqa: BLE001
    report(setup_error=f"{type(e).__name__}: {e}")
  finally:
    os.killpg(0, signal.SIGKILL)


def _die_with_parent(libc):
  """If the caller dies (or is killed) mid-run, the sandbox goes with it instead of running on unwatched."""
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _unshare(libc) -> list[str]:
  isolation = []
  if os.geteuid() != 0:  # a user namespace lets a non-root caller create the others
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(_CLONE["user"]) == 0:
      try:
        for path, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
          with open(f"/proc/self/{path}", "w") as f:
            f.write(text)
        isolation.append("user")
      except OSError:
        pass
  return isolation + [name for name in ("network", "pid", "mount", "ipc") if libc.unshare(_CLONE[name]) == 0]


def _supervise(settings, code, report, libc, isolation):
  cwd = os.getcwd()
  if "mount" in isolation and _mount_private_dirs(libc, settings["disk"]):
    isolation.append("tmp")
    cwd = "/tmp"
    if "pid" in isolation and libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) == 0:
      isolation.append("proc")  # /proc shows only the sandbox's own processes
  if settings["uid"] is not None:
    isolation.append("uid")
  if settings["uid"] is not None or "user" in isolation:
    isolation.append("processes")  # RLIMIT_NPROC counts a uid (or user namespace) of its own
  report(isolation=isolation)
  worker = os.fork()
  if worker == 0:
    try:
      _exec_code(settings, code, report, libc, cwd, "processes" in isolation)
    except BaseException as e:  # noqa: BLE001 -- any failure before exec is a setup failure, reported
      report(setup_error=f"{type(e).__name__}: {e}")
    os._exit(126)
  while True:  # as pid 1, also reap the orphans the code leaves behind
    pid, wait_status, usage = os.wait4(-1, 0)
    if pid == worker:
      report(status=wait_status, cpu=usage.ru_utime + usage.ru_stime)
      return


def _mount_private_dirs(libc, disk_bytes: int) -> bool:
  """A fresh tmpfs on /tmp (bound onto the other world-writable dirs), never propagated to the host."""
  if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
    return False  # without private propagation a mount here would appear on the host: mount nothing
  options = f"size={disk_bytes},mode=1777".encode()
  if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
    return False
  for path in PRIVATE_DIRS[1:]:
    if os.path.isdir(path) and not os.path.islink(path):
      libc.mount(b"/tmp", path.encode(), None, _MS_BIND, None)
  return True


def _exec_code(settings, code, report, libc, cwd, limit_processes):
  os.chdir(cwd)
  limits = {resource.RLIMIT_CPU: (settings["cpu"], settings["cpu"] + 1), resource.RLIMIT_CORE: (0, 0),
            resource.RLIMIT_AS: settings["memory"], resource.RLIMIT_FSIZE: settings["file"],
            resource.RLIMIT_NOFILE: settings["open_files"]}
  if limit_processes:
    limits[resource.RLIMIT_NPROC] = settings["processes"]
  for which, value in limits.items():
    resource.setrlimit(which, value if isinstance(value, tuple) else (value, value))
  if settings["uid"] is not None:
    os.setgroups([])
    os.setgid(settings["uid"])
    os.setuid(settings["uid"])
  _die_with_parent(libc)  # again: a change of uid clears it
  libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid binary gives privileges back
  try:
    compile(code, "<string>", "exec")
  except (SyntaxError, ValueError) as e:
    sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
    sys.stderr.flush()
    report(syntax_error=True)
    os._exit(1)
  os.execve(settings["python"], [settings["python"], "-I", "-S", "-c", code], dict(SANDBOX_ENV, HOME=cwd, TMPDIR=cwd))


if __name__ == "__main__":
  _launch(json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
