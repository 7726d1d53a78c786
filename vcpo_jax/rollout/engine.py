"""Asyncio batching engine of the embedded server: windowed batches, decoded in chunks between controls."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Callable, Sequence

import jax

from vcpo_jax import sampling

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Row:
  """One sequence to generate (a prompt times one of its `n` samples) and everything produced so far."""
  spec: sampling.RowSpec
  rid: str
  stop_strings: tuple[str, ...] = ()
  output_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[str] = dataclasses.field(default_factory=list)
  prompt_logprobs: list[float] | None = None
  finish_reason: str | None = None  # "length" | "stop" | "abort"
  matched: int | str | None = None
  request_no: int = 0  # which submit() call it came from (for the batching statistics)
  created: float = dataclasses.field(default_factory=time.monotonic)
  finished_at: float | None = None
  done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
  updated: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

  def remaining_spec(self) -> sampling.RowSpec:
    """The spec to (re)start from: prompt + tokens so far, with the budget and random stream advanced."""
    done = len(self.output_ids)
    s = self.spec
    return dataclasses.replace(
        s, prompt=tuple(s.prompt) + tuple(self.output_ids), max_new_tokens=s.max_new_tokens - done,
        min_new_tokens=max(s.min_new_tokens - done, 0), sample_offset=s.sample_offset + done)

  def finish(self, reason: str, matched=None):
    if self.finish_reason is None:
      self.finish_reason, self.matched, self.finished_at = reason, matched, time.monotonic()
      self.done.set()
      self.updated.set()


# Given a row's output ids, returns (number of tokens to keep, matched stop string) or None.
StopStringCheck = Callable[[Row], "tuple[int, str] | None"]


class Engine:
  """Collects rows, runs them as one jitted batch, and honours pause/abort/weight swaps between chunks."""

  def __init__(self, params, cfg, weight_version: str, *, max_batch: int = 64, chunk_steps: int = 8,
               batch_window_s: float = 0.005, max_gather_s: float = 0.05, min_batch: int = 8,
               min_prompt_len: int = 16,
               min_new_tokens: int = 16,
               stop_string_check: StopStringCheck | None = None):
    if max_batch < 1:
      raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if chunk_steps < 1:
      raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
    self.params, self.cfg, self.weight_version = jax.device_put(params), cfg, weight_version
    self.max_batch, self.chunk_steps = max_batch, chunk_steps
    self.batch_window_s, self.max_gather_s = batch_window_s, max_gather_s
    # Smallest bucket sizes: larger minimums mean fewer distinct shapes, so fewer jit compiles.
    self._bucket_kwargs = dict(min_batch=min_batch, min_prompt_len=min_prompt_len,
                               min_new_tokens=min_new_tokens)
    self._stop_string_check = stop_string_check
    self._pending: collections.deque[Row] = collections.deque()
    self._running: list[Row] = []
    self._wake = asyncio.Event()
    self._resume = asyncio.Event()
    self._resume.set()
    self._idle = asyncio.Event()  # no batch in flight
    self._idle.set()
    self._quiet = asyncio.Event()  # nothing will change until resumed: idle, or parked at a control point
    self._quiet.set()
    self._draining = False  # a weight update waits for in-flight rows: start no new batch
    self._update_lock = asyncio.Lock()
    self.pause_mode: str | None = None
    self.stats = {"max_batch_rows_seen": 0, "max_batch_requests_seen": 0, "num_batches": 0,
                  "num_generated_tokens": 0, "num_requests": 0}
    self._task: asyncio.Task | None = None

  # ---- lifecycle -------------------------------------------------------------------------------
  def start(self):
    self._task = asyncio.get_running_loop().create_task(self._loop())

  async def stop(self):
    self.abort()
    if self._task is not None:
      self._task.cancel()
      try:
        await self._task
      except asyncio.CancelledError:
        pass

  @property
  def num_in_flight(self) -> int:
    return len(self._running) + len(self._pending)

  # ---- requests and controls ---------------------------------------------------------------------
  def submit(self, rows: Sequence[Row]):
    self.stats["num_requests"] += 1
    for r in rows:
      r.request_no = self.stats["num_requests"]
    self._pending.extend(rows)
    self._wake.set()

  def abort(self, rid: str | None = None) -> int:
    """Aborts every row (rid None) or the rows of one request id; returns how many were aborted."""
    hit = [r for r in list(self._running) + list(self._pending)
           if r.finish_reason is None and (rid is None or r.rid == rid)]
    for r in hit:
      r.finish("abort")
    self._pending = collections.deque(r for r in self._pending if r.finish_reason is None)
    return len(hit)

  async def pause(self, mode: str) -> int:
    """Stops decoding at the next chunk boundary; returns the number of rows held in flight."""
    self.pause_mode = mode
    self._resume.clear()
    if mode == "abort":
      self.abort()
    self._wake.set()
    await self._quiet.wait()
    return sum(r.finish_reason is None for r in self._running + list(self._pending))

  def resume(self):
    self.pause_mode = None
    self._resume.set()
    self._wake.set()

  async def update_weights(self, load: Callable[[], tuple], version: str | None, *,
                           abort_all: bool) -> tuple[int, int]:
    """Loads new params (in a thread), then swaps them in. Unpaused, waits for in-flight rows to finish
    (or aborts them); paused in place, in-flight rows continue on the new weights after resume.
    Returns (rows held by the pause, rows running or queued at the swap: SGLang cannot flush its cache)."""
    async with self._update_lock:
      params, cfg = await asyncio.to_thread(load)
      if cfg != self.cfg:
        raise ValueError(f"model config of the new weights differs from the served one: {cfg} vs {self.cfg}")
      params = await asyncio.to_thread(jax.device_put, params)
      if abort_all:
        self.abort()
      num_paused = 0
      if self.pause_mode is None:
        self._draining = True
        try:
          await self._idle.wait()
        finally:
          self._draining = False
      else:
        await self._quiet.wait()
        num_paused = sum(r.finish_reason is None for r in self._running + list(self._pending))
      busy = sum(r.finish_reason is None for r in self._running + list(self._pending))
      self.params = params
      if version is not None:
        self.weight_version = version
      self._wake.set()
      return num_paused, busy

  # ---- the loop ----------------------------------------------------------------------------------
  async def _loop(self):
    while True:
      if not self._pending or self.pause_mode is not None or self._draining:
        self._wake.clear()
        await self._wake.wait()
        continue
      await self._gather()
      if self.pause_mode is not None or self._draining:
        continue
      rows = []
      while self._pending and len(rows) < self.max_batch:
        row = self._pending.popleft()
        if row.finish_reason is None:
          rows.append(row)
      if rows:
        try:
          await self._run_batch(rows)
        except Exception:  # a failed batch must not kill the server: abort its rows and go on
          log.exception("batch of %d rows failed", len(rows))
          for r in rows:
            r.finish("abort")
        finally:
          self._running = []
          self._idle.set()
          self._quiet.set()

  async def _gather(self):
    """Lets a burst of requests join one batch: waits a window, and more windows while rows keep coming.

    Why: every distinct batch bucket costs a jit compile, and a burst split as 127 + 1 costs two batches.
    """
    deadline = time.monotonic() + self.max_gather_s
    await asyncio.sleep(self.batch_window_s)
    while len(self._pending) < self.max_batch and time.monotonic() < deadline:
      seen = len(self._pending)
      await asyncio.sleep(self.batch_window_s)
      if len(self._pending) == seen:
        return

  async def _run_batch(self, rows: list[Row]):
    self._idle.clear()
    self._quiet.clear()
    self._running = rows
    self.stats["num_batches"] += 1
    self.stats["max_batch_rows_seen"] = max(self.stats["max_batch_rows_seen"], len(rows))
    self.stats["max_batch_requests_seen"] = max(self.stats["max_batch_requests_seen"],
                                                len({r.request_no for r in rows}))
    version, params = self.weight_version, self.params
    specs = [r.remaining_spec() for r in rows]
    batch = await asyncio.to_thread(sampling.start_batch, params, self.cfg, specs, **self._bucket_kwargs)
    prompt_logp = None
    consumed = [0] * len(rows)
    while True:
      ids, logp, num_gen, done, stopped = await asyncio.to_thread(sampling.progress, batch)
      if prompt_logp is None:
        prompt_logp = await asyncio.to_thread(lambda: jax.device_get(batch.prompt_logp_BxP))
        self._record_prompt_logprobs(rows, prompt_logp, batch)
      for b, row in enumerate(rows):
        if row.finish_reason is not None:
          continue
        n = int(num_gen[b])
        new = range(consumed[b], n)
        row.output_ids += ids[b, new].tolist()
        row.logprobs += logp[b, new].tolist()
        row.versions += [version] * len(new)
        consumed[b] = n
        self.stats["num_generated_tokens"] += len(new)
        if len(new):
          row.updated.set()
        self._finish_if_done(row, bool(done[b]), bool(stopped[b]))
      if all(r.finish_reason is not None for r in rows):
        return
      if self.pause_mode is not None:
        if self.pause_mode == "retract":
          # Back to the queue front; they re-prefill prompt + partial output after resume.
          self._pending.extendleft(reversed([r for r in rows if r.finish_reason is None]))
          return
        self._quiet.set()
        await self._resume.wait()
        self._quiet.clear()
        continue
      version, params = self.weight_version, self.params
      await asyncio.to_thread(sampling.decode_chunk, params, batch, self.chunk_steps)

  def _record_prompt_logprobs(self, rows, prompt_logp, batch):
    P = prompt_logp.shape[1]
    for b, row in enumerate(rows):
      if row.prompt_logprobs is None:  # a resumed row keeps those of its first prefill
        first = P - batch.prompt_lens[b]  # left padding of this row
        row.prompt_logprobs = prompt_logp[b, first + 1:first + len(row.spec.prompt)].tolist()

  def _finish_if_done(self, row: Row, done: bool, stopped: bool):
    if row.stop_strings and self._stop_string_check is not None:
      hit = self._stop_string_check(row)
      if hit is not None:
        keep, matched = hit
        del row.output_ids[keep:], row.logprobs[keep:], row.versions[keep:]
        row.finish("stop", matched)
        return
    if done:
      if stopped:
        row.finish("stop", row.output_ids[-1])
      else:
        row.finish("length")
