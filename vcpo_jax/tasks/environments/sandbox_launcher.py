"""The sandbox's launcher (`python -I -S sandbox_launcher.py SETTINGS STATUS_FD CODE`): namespaces, uid, rlimits."""
from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

# Run as a script under -I -S (no site, no PYTHONPATH): the stdlib only, nothing of the package.

# The variables the sandboxed process sees: nothing of the caller's environment.
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
# World-writable places a process under an unprivileged uid could still write to; with a mount namespace they
# are one throwaway tmpfs (capped at `disk_bytes`) that disappears with the sandbox.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_CLONE = {"user": 0x10000000, "network": 0x40000000, "pid": 0x20000000, "mount": 0x00020000, "ipc": 0x08000000}
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38


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
