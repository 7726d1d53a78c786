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
- "process": worker processes (`python -m vcpo_jax.calls.offload_process`), each calling in its main thread, so
  libraries that time themselves out with signals (math-verify) work; a call past its timeout, or one that
  kills its process, costs that worker, which is replaced. Functions and arguments travel pickled: a function
  is sent by reference (module and name), so it must be importable in a fresh process.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable, Optional

from vcpo_jax.calls.offload_process import Workers, one_line

KINDS = ("inline", "thread", "process")
ERROR_KINDS = ("timeout", "exception", "crash")


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What a call came back with: `value` when `error` is None, else the error kind and a one-line detail."""
  value: Any = None
  error: Optional[str] = None  # None or one of ERROR_KINDS
  detail: str = ""

  @property
  def ok(self) -> bool:
    return self.error is None


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
    self._procs: Optional[Workers] = (
        Workers(workers, memory_mb=memory_mb, initializer=initializer, start_timeout_s=start_timeout_s)
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
    return self._count(Outcome(*self._procs.call(fn, args, self.timeout_s)))

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
    return Outcome(error="exception", detail=one_line(e))

