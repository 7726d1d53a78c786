"""A "process" CallPool's worker processes (`python -m vcpo_jax.calls.offload_process`), replaced if late or dead."""
from __future__ import annotations

import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from vcpo_jax import orphans

# Requests and replies are pickles framed by their length; the worker's stdin and original stdout carry them.
_HEADER = struct.Struct("<Q")


def one_line(e: BaseException) -> str:
  """An exception as the one-line detail of a failed call."""
  return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _write_frame(fd: int, obj: Any) -> None:
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  view = memoryview(_HEADER.pack(len(data)) + data)
  while view:
    view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: Optional[float]) -> Optional[bytes]:
  """n bytes from fd, or None at EOF or past the deadline (None: wait forever)."""
  chunks, got = [], 0
  while got < n:
    if deadline is not None:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        return None
    chunk = os.read(fd, n - got)
    if not chunk:
      return None
    chunks.append(chunk)
    got += len(chunk)
  return b"".join(chunks)


def _read_frame(fd: int, deadline: Optional[float]) -> Any:
  header = _read_exact(fd, _HEADER.size, deadline)
  if header is None:
    return None
  body = _read_exact(fd, _HEADER.unpack(header)[0], deadline)
  return None if body is None else pickle.loads(body)


class _Worker:
  """One worker process and its two pipes."""

  def __init__(self, memory_mb: int):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the caller's modules
    cmd = [sys.executable, "-m", "vcpo_jax.calls.offload_process", str(int(memory_mb))]
    # stdin/stdout carry frames; the worker's own prints go to its stderr (the job's log).
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
                                 start_new_session=True)
    self.loaded: dict[bytes, int] = {}  # pickled function -> its number in this worker

  def request(self, message: tuple, timeout_s: float) -> Any:
    """The worker's reply; None if it died (self.died is then set) or did not answer in time."""
    deadline = time.monotonic() + timeout_s
    self.died = False
    try:
      _write_frame(self.proc.stdin.fileno(), message)
      reply = _read_frame(self.proc.stdout.fileno(), deadline)
    except (BrokenPipeError, pickle.UnpicklingError, EOFError, OSError):
      reply = None
    # No reply before the deadline: the pipe closed, so the worker is gone (it may not be reaped yet).
    self.died = reply is None and time.monotonic() < deadline
    return reply

  def kill(self) -> None:
    try:
      os.killpg(self.proc.pid, 9)  # the worker leads its own session: its children go with it
    except (ProcessLookupError, PermissionError):
      pass
    for f in (self.proc.stdin, self.proc.stdout):
      try:
        f.close()
      except OSError:
        pass
    orphans.reap_session(self.proc.pid)  # what the kill orphaned, where this process is PID 1 (a container)
    if orphans.wait_exited(self.proc.pid):
      orphans.wait_session_gone(self.proc.pid)  # its children finish dying before the call returns
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass


class Workers:
  """Idle worker processes; a call takes one, and a worker that timed out or died is replaced."""

  def __init__(self, n: int, *, memory_mb: int, initializer, start_timeout_s: float):
    if initializer is not None:
      pickle.dumps(initializer)  # an unpicklable initializer is a start-up error, not a per-call one
    self._memory_mb, self._init, self._start_timeout = memory_mb, initializer, start_timeout_s
    self._idle: queue.Queue = queue.Queue()
    self._all: set = set()
    self._lock = threading.Lock()
    self._closed = False
    for _ in range(n):
      self._idle.put(None)  # a slot; the process starts on first use

  def _spawn(self) -> Optional[_Worker]:
    worker = _Worker(self._memory_mb)
    with self._lock:
      self._all.add(worker)
    if self._init is not None:
      reply = worker.request(("init", self._init), self._start_timeout)
      if not (isinstance(reply, tuple) and reply[0] == "ok"):
        self._retire(worker)
        return None
    return worker

  def _retire(self, worker: _Worker) -> None:
    worker.kill()
    with self._lock:
      self._all.discard(worker)

  def _load(self, worker: _Worker, fn_bytes: bytes) -> Optional[int]:
    """The function's number in `worker`, sending it first if new: its first use (importing its module) is
    bounded by the start-up timeout, not by the call's."""
    if fn_bytes not in worker.loaded:
      reply = worker.request(("load", fn_bytes, len(worker.loaded)), self._start_timeout)
      if not (isinstance(reply, tuple) and reply[0] == "ok"):
        return None
      worker.loaded[fn_bytes] = len(worker.loaded)
    return worker.loaded[fn_bytes]

  def call(self, fn: Callable, args: tuple, timeout_s: float) -> tuple[Any, Optional[str], str]:
    """fn(*args) in an idle worker: (value, error kind or None, detail), the fields of an offload.Outcome."""
    try:
      fn_bytes = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
      pickle.dumps(args)
    except Exception as e:
      return None, "exception", f"cannot send to a worker process: {one_line(e)}"
    worker = self._idle.get()
    try:
      if worker is None or worker.proc.poll() is not None:
        worker = self._spawn()
        if worker is None:
          return None, "crash", "a worker process failed to start (its initializer failed)"
      number = self._load(worker, fn_bytes)
      if number is None:
        self._retire(worker)
        worker = None
        return None, "exception", "a worker process could not load the function (not importable?)"
      reply = worker.request(("call", number, args), timeout_s)
      if reply is None:
        died = worker.died or worker.proc.poll() is not None
        self._retire(worker)
        worker = None
        if died:
          return None, "crash", "the worker process died during the call"
        return None, "timeout", f"no answer within {timeout_s:g} s (worker replaced)"
      status, payload = reply
      return (payload, None, "") if status == "ok" else (None, "exception", payload)
    finally:
      self._idle.put(None if self._closed else worker)

  def close(self) -> None:
    self._closed = True
    with self._lock:
      workers = list(self._all)
    for worker in workers:
      self._retire(worker)


def _serve(memory_mb: int) -> None:
  """A worker's loop: read (kind, ...) frames on stdin, answer each on the original stdout."""
  frames_out = os.dup(1)
  os.dup2(2, 1)  # print() in a called function must not corrupt the frame stream
  sys.stdout = sys.stderr
  if memory_mb > 0:
    import resource
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  functions = {}
  while True:
    message = _read_frame(0, None)
    if message is None:
      return
    try:
      if message[0] == "init":
        value = message[1]()
      elif message[0] == "load":
        functions[message[2]] = pickle.loads(message[1])
        value = None
      else:
        value = functions[message[1]](*message[2])
      pickle.dumps(value)  # an unpicklable result is the function's error, not the worker's death
      reply = ("ok", value)
    except Exception as e:
      reply = ("error", one_line(e))
    _write_frame(frames_out, reply)


if __name__ == "__main__":
  _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
