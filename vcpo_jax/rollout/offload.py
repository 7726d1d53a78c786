"""Calls kept off the rollout event loop (rewards, tool calls): a bounded pool, a timeout per call, errors by kind.

A reward function or a tool may be slow, hang, raise or (if it is the user's or the model's code) crash its
process. The rollout client's asyncio loop also generates every episode and publishes weights, so such a call
must never run on it. `CallPool.call` runs `fn(*args)` elsewhere and always comes back, by the timeout at the
latest, with an `Outcome`: the value, or an error kind that the caller counts (never an exception).

Three kinds, one interface:
- "inline": on the calling thread (tests; functions known to be instant).
- "thread": a bounded thread pool, for functions that need the caller's objects (a per-episode environment).
  A call past its timeout is reported as one, but Python cannot stop a thread: it keeps its worker until it
  returns, so a pool whose threads all hang stops answering (each call then times out). Use it for trusted code.
- "process": worker processes (`python -m vcpo_jax.rollout.offload`), each calling in its main thread, so
  libraries that time themselves out with signals (math-verify) work; a call past its timeout, or one that
  kills its process, costs that worker, which is replaced. Functions and arguments travel pickled: a function
  is sent by reference (module and name), so it must be importable in a fresh process.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
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

KINDS = ("inline", "thread", "process")
ERROR_KINDS = ("timeout", "exception", "crash")
_HEADER = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What a call came back with: `value` when `error` is None, else the error kind and a one-line detail."""
  value: Any = None
  error: Optional[str] = None  # None or one of ERROR_KINDS
  detail: str = ""

  @property
  def ok(self) -> bool:
    return self.error is None


def _one_line(e: BaseException) -> str:
  return " ".join(f"{type(e).__name__}: {e}".split())[:300]


class CallPool:
  """Runs `fn(*args)` off the event loop with a per-call timeout; counts calls and errors by kind."""

  def __init__(self, kind: str = "thread", *, workers: int = 2, timeout_s: float = 30.0,
               memory_mb: int = 0, initializer: Optional[Callable[[], Any]] = None,
               start_timeout_s: float = 120.0, name: str = "pool"):
    if kind not in KINDS:
      raise ValueError(f"{name}.pool={kind!r}: must be one of {KINDS}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
      raise ValueError(f"{name}.workers must be an int >= 1, got {workers!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
      raise ValueError(f"{name}.timeout_s must be a number > 0, got {timeout_s!r}")
    self.kind, self.workers, self.timeout_s, self.name = kind, workers, float(timeout_s), name
    self._lock = threading.Lock()
    self._counts = {"calls": 0, **{f"errors/{k}": 0 for k in ERROR_KINDS}}
    # Thread and process kinds wait in these threads (a process call blocks one thread on its worker's pipe).
    self._threads = (concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"{name}-call")
                     if kind != "inline" else None)
    self._procs: Optional[_Workers] = (
        _Workers(workers, memory_mb=memory_mb, initializer=initializer, start_timeout_s=start_timeout_s)
        if kind == "process" else None)

  # -- calling ------------------------------------------------------------------------------------
  async def call(self, fn: Callable, *args) -> Outcome:
    """fn(*args) in the pool, awaited without blocking the event loop."""
    if self.kind == "inline":
      return self.call_blocking(fn, *args)
    if self.kind == "process":
      return await asyncio.get_running_loop().run_in_executor(self._threads, self._process_call, fn, args)
    future = asyncio.get_running_loop().run_in_executor(self._threads, _capture, fn, args)
    try:
      outcome = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
    except asyncio.TimeoutError:
      outcome = Outcome(error="timeout", detail=f"no answer within {self.timeout_s:g} s")
    return self._count(outcome)

  def call_blocking(self, fn: Callable, *args) -> Outcome:
    """fn(*args) from synchronous code (e.g. an evaluation in a worker thread)."""
    if self.kind == "inline":
      return self._count(_capture(fn, args))
    if self.kind == "process":
      return self._threads.submit(self._process_call, fn, args).result()
    future = self._threads.submit(_capture, fn, args)
    try:
      outcome = future.result(timeout=self.timeout_s)
    except concurrent.futures.TimeoutError:
      outcome = Outcome(error="timeout", detail=f"no answer within {self.timeout_s:g} s")
    return self._count(outcome)

  def map_blocking(self, fn: Callable, arg_tuples) -> list[Outcome]:
    """fn over many argument tuples, up to `workers` at a time; outcomes in order."""
    arg_tuples = list(arg_tuples)
    if self.kind == "inline":
      return [self.call_blocking(fn, *args) for args in arg_tuples]
    with concurrent.futures.ThreadPoolExecutor(self.workers) as callers:
      return list(callers.map(lambda args: self.call_blocking(fn, *args), arg_tuples))

  def _process_call(self, fn: Callable, args: tuple) -> Outcome:
    return self._count(self._procs.call(fn, args, self.timeout_s))

  def _count(self, outcome: Outcome) -> Outcome:
    with self._lock:
      self._counts["calls"] += 1
      if outcome.error is not None:
        self._counts[f"errors/{outcome.error}"] += 1
    return outcome

  @property
  def stats(self) -> dict[str, int]:
    with self._lock:
      return dict(self._counts)

  def close(self) -> None:
    if self._threads is not None:
      self._threads.shutdown(wait=False, cancel_futures=True)
    if self._procs is not None:
      self._procs.close()


def _capture(fn: Callable, args: tuple) -> Outcome:
  try:
    return Outcome(value=fn(*args))
  except Exception as e:  # the function's own failure is an outcome, not the caller's exception
    return Outcome(error="exception", detail=_one_line(e))


# ------------------------------------------------------------------------------- worker processes
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
    cmd = [sys.executable, "-m", "vcpo_jax.rollout.offload", str(int(memory_mb))]
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
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass


class _Workers:
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

  def call(self, fn: Callable, args: tuple, timeout_s: float) -> Outcome:
    try:
      fn_bytes = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
      pickle.dumps(args)
    except Exception as e:
      return Outcome(error="exception", detail=f"cannot send to a worker process: {_one_line(e)}")
    worker = self._idle.get()
    try:
      if worker is None or worker.proc.poll() is not None:
        worker = self._spawn()
        if worker is None:
          return Outcome(error="crash", detail="a worker process failed to start (its initializer failed)")
      number = self._load(worker, fn_bytes)
      if number is None:
        self._retire(worker)
        worker = None
        return Outcome(error="exception", detail="a worker process could not load the function (not importable?)")
      reply = worker.request(("call", number, args), timeout_s)
      if reply is None:
        died = worker.died or worker.proc.poll() is not None
        self._retire(worker)
        worker = None
        if died:
          return Outcome(error="crash", detail="the worker process died during the call")
        return Outcome(error="timeout", detail=f"no answer within {timeout_s:g} s (worker replaced)")
      status, payload = reply
      return Outcome(value=payload) if status == "ok" else Outcome(error="exception", detail=payload)
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
      reply = ("error", _one_line(e))
    _write_frame(frames_out, reply)


if __name__ == "__main__":
  _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
