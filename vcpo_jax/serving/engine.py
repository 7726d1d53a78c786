"""Asyncio engine of the embedded server: continuous batching (rows join and leave a slot pool between chunks)."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from vcpo_jax.model import config as model_config
from vcpo_jax.model import lora as lora_lib
from vcpo_jax.serving import adapters as adapters_lib
from vcpo_jax.serving import slot_pool
from vcpo_jax.serving.sequence import Row, StopStringCheck

log = logging.getLogger(__name__)


class Engine:
  """Decodes rows in a pool of `max_batch` slots; between chunks, finished rows leave, queued rows join, and
  pause/abort/weight swaps take effect. Every token is tagged with the weight version that produced it.

  With `lora` (the server's --enable-lora settings) it holds a stack of lora.num_slots adapters on the device
  (all zeros: the base) and applies each row's `adapter_slot` in its prefill and every decode step, so one
  batch mixes adapters. The stack is model/lora.py's at rank max_rank with alpha = rank (scale 1): the trees
  set_adapter_slot takes have B pre-scaled (serving/adapters.py)."""

  def __init__(self, params, cfg, weight_version: str, *, max_batch: int = 64, chunk_steps: int = 8,
               batch_window_s: float = 0.005, max_gather_s: float = 0.05, min_batch: int = 8,
               min_prompt_len: int = 16, num_slots: int | None = None, cache_dtype: str | None = None,
               stop_string_check: StopStringCheck | None = None, lora: adapters_lib.Settings | None = None):
    if max_batch < 1:
      raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if chunk_steps < 1:
      raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
    self.params, self.cfg, self.weight_version = jax.device_put(params), cfg, weight_version
    self.max_batch, self.chunk_steps = max_batch, chunk_steps
    self.batch_window_s, self.max_gather_s = batch_window_s, max_gather_s
    # Smallest pool / join / prompt buckets: larger minimums mean fewer distinct shapes, so fewer compiles.
    self._pool_kwargs = dict(max_rows=max_batch, num_slots=num_slots or cfg.max_seq_len, chunk_steps=chunk_steps,
                             cache_dtype=cache_dtype, min_rows=min_batch, min_prompt_len=min_prompt_len)
    self._pool_cfg, self.adapter_stack = cfg, None  # the kernels' config: the stack's LoRA settings with LoRA
    if lora is not None:
      stack_cfg = model_config.LoraConfig(rank=lora.max_rank, alpha=lora.max_rank, target_modules=lora.targets)
      self._pool_cfg = dataclasses.replace(cfg, lora=stack_cfg)
      self.adapter_stack = jax.device_put(lora_lib.empty_stack(self._pool_cfg, stack_cfg, lora.num_slots))
    self.pool = self._new_pool()
    self._stop_string_check = stop_string_check
    self._pending: collections.deque[Row] = collections.deque()
    self._joining: list[Row] = []
    self._wake = asyncio.Event()
    self._resume = asyncio.Event()
    self._resume.set()
    self._idle = asyncio.Event()  # no row in the pool
    self._idle.set()
    self._quiet = asyncio.Event()  # nothing will change until resumed: idle, or parked at a control point
    self._quiet.set()
    self._draining = False  # a weight update waits for the rows in the pool: admit no new ones
    self._update_lock = asyncio.Lock()
    self.pause_mode: str | None = None
    self.stats = {"max_batch_rows_seen": 0, "max_batch_requests_seen": 0, "num_batches": 0, "num_chunks": 0,
                  "num_generated_tokens": 0, "num_requests": 0}
    self._task: asyncio.Task | None = None

  def _new_pool(self) -> slot_pool.SlotPool:
    return slot_pool.SlotPool(self._pool_cfg, **self._pool_kwargs)

  def set_adapter_slot(self, i: int, tree) -> None:
    """Puts an adapter (the stack's layout, B pre-scaled) into slot i, or zeros (None). Takes effect from the
    next chunk (a chunk in flight keeps the stack it started with); no unfinished row may use slot i (the
    registry unloads only adapters no request holds, and loads into free slots)."""
    if self.adapter_stack is None:
      raise ValueError("set_adapter_slot: this engine has no adapter stack (start it with lora settings)")
    users = [r.rid for r in self._running + list(self._pending) if r.finish_reason is None and r.adapter_slot == i]
    assert not users, f"adapter slot {i} changed under live rows of {users}"
    if tree is None:
      tree = jax.tree.map(lambda x: jnp.zeros(x.shape[:-3] + x.shape[-2:], x.dtype), self.adapter_stack)
    self.adapter_stack = lora_lib.put(self.adapter_stack, i, jax.tree.map(jnp.asarray, tree))

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
  def _running(self) -> list[Row]:
    """Rows in the pool, and those being prefilled into it right now (an abort must see them too)."""
    rows = [r for r in self.pool.owners if r is not None]
    return rows + [r for r in self._joining if r not in rows]

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
    hit = [r for r in self._running + list(self._pending)
           if r.finish_reason is None and (rid is None or r.rid == rid)]
    for r in hit:
      r.finish("abort")
    self._pending = collections.deque(r for r in self._pending if r.finish_reason is None)
    self._wake.set()
    return len(hit)

  async def pause(self, mode: str) -> int:
    """Stops decoding at the next chunk boundary; returns the number of rows held in flight."""
    self.pause_mode = mode
    self._resume.clear()
    if mode == "abort":
      self.abort()
    self._wake.set()
    self._quiet.clear()  # the loop sets it once parked (it may be mid-chunk now)
    await self._quiet.wait()
    return sum(r.finish_reason is None for r in self._running + list(self._pending))

  def resume(self):
    self.pause_mode = None
    self._resume.set()
    self._wake.set()

  async def update_weights(self, load: Callable[[], tuple], version: str | None, *,
                           abort_all: bool) -> tuple[int, int]:
    """Loads new params (in a thread), then swaps them in. Unpaused, waits for the rows in the pool to
    finish (or aborts them) and admits none meanwhile; paused in place, they continue on the new weights
    after resume. Returns (rows held by the pause, rows running or queued at the swap)."""
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
          self._wake.set()
          await self._idle.wait()
        finally:
          self._draining = False
      else:
        self._wake.set()
        self._quiet.clear()
        await self._quiet.wait()
        num_paused = sum(r.finish_reason is None for r in self._running + list(self._pending))
      busy = sum(r.finish_reason is None for r in self._running + list(self._pending))
      self.params = params
      if version is not None:
        self.weight_version = version
      self._wake.set()
      return num_paused, busy

  # ---- the loop ----------------------------------------------------------------------------------
  def _settle(self):
    """Frees the slots of finished rows; a retract pause sends the others back to the queue front."""
    retracted = []
    for slot, row in enumerate(self.pool.owners):
      if row is not None and (row.finish_reason is not None or self.pause_mode == "retract"):
        self.pool.release(slot)
        if row.finish_reason is None:  # re-prefills prompt + partial output after resume
          retracted.append(row)
    self._pending.extendleft(reversed(retracted))
    if not self._running:
      self._idle.set()

  async def _loop(self):
    while True:
      try:
        await self._loop_body()
      except Exception:  # the loop must outlive any one failure, or every pause and request waits forever
        log.exception("engine loop failed; aborting its %d rows (clients resume them)", self.num_in_flight)
        self._fail_rows()

  def _fail_rows(self):
    for r in self._running + list(self._pending):
      r.finish("abort")
    self._pending.clear()
    self._joining = []
    self.pool = self._new_pool()
    self._idle.set()

  async def _loop_body(self):
    while True:
      self._settle()
      can_join = bool(self._pending) and not self._draining and self.pause_mode is None
      if self.pause_mode is not None or (not self._running and not can_join):
        self._quiet.set()
        self._wake.clear()
        await self._wake.wait()
        continue
      if not self._running:
        await self._gather()  # an empty pool: let a burst join in one prefill
        self._settle()
        if self.pause_mode is not None or self._draining:
          continue
      self._quiet.clear()
      joining = []
      while self._pending and len(joining) < self.pool.num_free and not self._draining:
        row = self._pending.popleft()
        if len(row.spec.prompt) + row.spec.max_new_tokens > self.pool.S:  # the server's limits prevent it
          log.warning("row of %s needs more than the %d cache slots per row: aborted", row.rid, self.pool.S)
          row.finish("abort")
        elif row.finish_reason is None:
          joining.append(row)
      if joining or self._running:
        self._idle.clear()
        await self._iterate(joining)

  async def _gather(self):
    """Waits a window, and more windows while rows keep coming (a burst split 127 + 1 costs two prefills)."""
    deadline = time.monotonic() + self.max_gather_s
    await asyncio.sleep(self.batch_window_s)
    while len(self._pending) < self.max_batch and time.monotonic() < deadline:
      seen = len(self._pending)
      await asyncio.sleep(self.batch_window_s)
      if len(self._pending) == seen:
        return

  async def _iterate(self, joining: list[Row]):
    """Prefills `joining` into free slots, then decodes one chunk of every row in the pool."""
    version, params, stack = self.weight_version, self.params, self.adapter_stack
    if joining:
      self.stats["num_batches"] += 1
    self._joining = joining
    try:
      joined, chunk = await asyncio.to_thread(self._compute, params, stack, joining)
    except Exception:  # a failed step must not kill the server: abort its rows, start a fresh pool
      log.exception("decode step of %d joining and %d running rows failed", len(joining), len(self._running))
      for r in joining + self._running:
        r.finish("abort")
      self.pool = self._new_pool()
      return
    finally:
      self._joining = []
    for t in joined + chunk:
      self._record(t, version)
    if chunk:
      live = [t.owner for t in chunk]
      self.stats["num_chunks"] += 1
      self.stats["max_batch_rows_seen"] = max(self.stats["max_batch_rows_seen"], len(live))
      self.stats["max_batch_requests_seen"] = max(self.stats["max_batch_requests_seen"],
                                                  len({r.request_no for r in live}))

  def _compute(self, params, stack, joining: list[Row]):
    joined = []
    if joining:
      joined = self.pool.join(params, [r.remaining_spec() for r in joining], joining, stack,
                              [r.adapter_slot for r in joining])
    for t in joined:
      if t.done:
        self.pool.release(t.slot)
    return joined, self.pool.step(params, stack)

  def _record(self, t: slot_pool.Tokens, version: str):
    row: Row = t.owner
    if row.finish_reason is None:
      self.stats["num_generated_tokens"] += row.take(t, version, self._stop_string_check)
    if row.finish_reason is not None:
      # By identity, not t.slot: a join's tokens carry the slot from before the chunk, and the chunk's step
      # may have compacted the pool since (the slot index then names another row, or none).
      slot = next((s for s, owner in enumerate(self.pool.owners) if owner is row), None)
      if slot is not None:
        self.pool.release(slot)
