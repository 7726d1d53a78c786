"""Host side of continuous batching: rows join free decode slots and leave between chunks (pool_kernels.py).

The pool's batch size follows its load: it grows to the next size min_rows * 4**i (at most `max_rows`) when
rows join and compacts when at most a quarter of its slots are live, so a few rows do not pay for a large pool.
Pool and join sizes step by 4, not 2: every pool size is one decode compile, every (join, prompt) size one
prefill compile and every (pool, join, prompt) size one small placement compile, and on the 2-core CPU main
job the compiles of a 2x ladder outweighed the padding they saved (docs/embedded-server.md).
Every row's tokens depend on its own prompt, parameters and random stream only, not on its slot or on the
other rows (the same per-row keys as sampling.py: a row resumed with sample_offset draws what it would have).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


from vcpo_jax.model import config as model_config
from vcpo_jax.model import sampling
from vcpo_jax.model import sampling_fields
from vcpo_jax.serving import pool_kernels as pk


GROWTH = 4  # ratio between consecutive pool sizes and between join sizes


@dataclasses.dataclass
class Tokens:
  """What one row produced in a join or a chunk."""
  slot: int
  owner: Any
  ids: list[int]
  logprobs: list[float]
  done: bool
  stopped: bool
  prompt_logprobs: list[float] | None = None  # joins only: log p(prompt[t] | prompt[:t]) for t >= 1


class SlotPool:
  """A pool of decode slots with one KV cache; `owner` is whatever the caller tracks a row by."""

  def __init__(self, cfg: model_config.ModelConfig, *, max_rows: int, num_slots: int, chunk_steps: int,
               cache_dtype: str | None = None, min_rows: int = 8, min_join: int | None = None,
               min_prompt_len: int = 16):
    if max_rows < 1 or chunk_steps < 1 or num_slots < 2:
      raise ValueError(f"need max_rows >= 1, chunk_steps >= 1, num_slots >= 2; got {max_rows}, {chunk_steps}, "
                       f"{num_slots}")
    self.cfg, self.max_rows, self.S, self.C = cfg, max_rows, num_slots, chunk_steps
    self.cache_dtype = jnp.dtype(cache_dtype or cfg.dtype)
    self.min_rows, self.min_prompt_len = min(min_rows, max_rows), min_prompt_len
    # Smallest prefill batch: filler rows cost prefill compute, each distinct size one compile.
    self.min_join = self.min_rows if min_join is None else max(1, min_join)
    self.K = 4
    self.state: pk.PoolState | None = None
    self.owners: list[Any] = []
    self._num_gen = np.zeros((0,), np.int64)
    self._resize(self.min_rows)

  @property
  def num_live(self) -> int:
    return sum(o is not None for o in self.owners)

  @property
  def num_free(self) -> int:
    return self.max_rows - self.num_live

  def release(self, slot: int):
    """Frees a slot (a finished, aborted or retracted row); the next chunk no longer decodes it."""
    self.owners[slot] = None

  def _size_for(self, n: int) -> int:
    return min(sampling.bucket(n, self.min_rows, GROWTH), self.max_rows)

  def _resize(self, B: int):
    if self.state is None:
      self.state = pk.empty(cfg=self.cfg, B=B, S=self.S, C=self.C, K=self.K, cache_dtype=self.cache_dtype)
      self.owners, self._num_gen = [None] * B, np.zeros((B,), np.int64)
      return
    live = [s for s, o in enumerate(self.owners) if o is not None]
    src = np.full((B,), -1, np.int32)
    src[:len(live)] = live
    self.state = pk.take(self.state, jnp.asarray(src), cfg=self.cfg)
    self.owners = [self.owners[s] for s in live] + [None] * (B - len(live))
    self._num_gen = np.concatenate([self._num_gen[live], np.zeros((B - len(live),), np.int64)])

  def _check(self, specs: Sequence[sampling.RowSpec]):
    sampling._validate_rows(specs, self.cfg)
    for r, spec in enumerate(specs):
      if len(spec.prompt) + spec.max_new_tokens > self.S:
        raise ValueError(f"rows[{r}]: prompt {len(spec.prompt)} + max_new_tokens {spec.max_new_tokens} exceeds "
                         f"the {self.S} cache slots per row")

  def join(self, params, specs: Sequence[sampling.RowSpec], owners: Sequence[Any], adapter=None,
           adapter_slots: Sequence[int] | None = None) -> list[Tokens]:
    """Prefills rows into free slots (at most num_free) and returns their token 0 and prompt log-probs.
    With `adapter` (a stack, model/lora.py) row j uses adapter slot adapter_slots[j] (-1: the base) from
    now on; self.cfg.lora must then be the stack's."""
    if len(specs) > self.num_free:
      raise ValueError(f"{len(specs)} rows joining a pool with {self.num_free} free slots")
    self._check(specs)
    if self.num_live + len(specs) > len(self.owners):
      self._resize(self._size_for(self.num_live + len(specs)))
    K = sampling.bucket(max(len(r.stop_token_ids) for r in specs), 4)
    if K > self.K:  # wider stop-id table: one more decode shape
      pad = jnp.full((len(self.owners), K - self.K), self.cfg.vocab_size, jnp.int32)
      rows = self.state.rows._replace(stop_ids_BxK=jnp.concatenate([self.state.rows.stop_ids_BxK, pad], 1))
      self.state, self.K = self.state._replace(rows=rows), K
    B, V = len(self.owners), self.cfg.vocab_size
    J = min(sampling.bucket(len(specs), self.min_join, GROWTH), B)
    P = min(sampling.bucket(max(len(r.prompt) for r in specs), self.min_prompt_len), self.S)
    free = [s for s, o in enumerate(self.owners) if o is None][:len(specs)]
    tokens = np.zeros((J, P), np.int32)
    for j, r in enumerate(specs):
      tokens[j, :len(r.prompt)] = r.prompt
    lens = np.array([len(r.prompt) for r in specs] + [1] * (J - len(specs)), np.int32)
    slots = np.array(free + [B] * (J - len(specs)), np.int32)
    rows, seeds = sampling_fields.row_arrays(specs, J, self.K, V)
    adapter_J = None
    if adapter is not None:
      adapter_J = np.full((J,), -1, np.int32)
      adapter_J[:len(specs)] = list(adapter_slots) if adapter_slots is not None else -1
      adapter_J = jnp.asarray(adapter_J)
    self.state, out = pk.admit(params, self.state, jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(slots),
                               jax.tree.map(jnp.asarray, rows), jnp.asarray(seeds), adapter, adapter_J,
                               cfg=self.cfg)
    token, logp, done, stopped, prompt_logp = jax.device_get(out)
    result = []
    for j, (spec, slot, owner) in enumerate(zip(specs, free, owners)):
      self.owners[slot] = owner
      made = spec.max_new_tokens > 0
      self._num_gen[slot] = int(made)
      result.append(Tokens(slot, owner, [int(token[j])] if made else [], [float(logp[j])] if made else [],
                           bool(done[j]), bool(stopped[j]), prompt_logp[j, 1:len(spec.prompt)].tolist()))
    return result

  def step(self, params, adapter=None) -> list[Tokens]:
    """One chunk of up to chunk_steps tokens for every live row (with `adapter`, each its own slot of the
    stack); returns what each live row produced."""
    live = np.array([o is not None for o in self.owners])
    if not live.any():
      return []
    if live.sum() * 4 <= len(self.owners) and len(self.owners) > self.min_rows:
      self._resize(self._size_for(int(live.sum())))
      live = np.array([o is not None for o in self.owners])
    self.state = pk.steps(params, self.state, jnp.asarray(live), adapter, cfg=self.cfg)
    s = self.state
    ids, logp, num_gen, done, stopped = jax.device_get(
        (s.out_ids_BxC, s.out_logp_BxC, s.num_gen_B, s.done_B, s.stopped_B))
    result = []
    for slot in np.flatnonzero(live):
      n = int(num_gen[slot] - self._num_gen[slot])
      self._num_gen[slot] = int(num_gen[slot])
      result.append(Tokens(int(slot), self.owners[slot], ids[slot, :n].tolist(), logp[slot, :n].tolist(),
                           bool(done[slot]), bool(stopped[slot])))
    return result


def generate(params, cfg: model_config.ModelConfig, specs: Sequence[sampling.RowSpec], *, max_rows: int,
             num_slots: int | None = None, chunk_steps: int = 8, cache_dtype: str | None = None,
             min_rows: int = 8, min_join: int | None = None) -> list[sampling.RowResult]:
  """Runs rows through a pool of `max_rows` slots, queued rows joining as others finish (continuous)."""
  pool = SlotPool(cfg, max_rows=max_rows, num_slots=num_slots or cfg.max_seq_len, chunk_steps=chunk_steps,
                  cache_dtype=cache_dtype, min_rows=min_rows, min_join=min_join)
  out = [sampling.RowResult([], [], False, None, None, []) for _ in specs]
  queue = list(range(len(specs)))

  def record(t: Tokens):
    r = out[t.owner]
    r.output_ids += t.ids
    r.logprobs += t.logprobs
    if t.prompt_logprobs is not None:
      r.prompt_logprobs = t.prompt_logprobs
    if t.done:
      r.finished, r.finish_reason = True, "stop" if t.stopped else "length"
      r.matched_token = r.output_ids[-1] if t.stopped else None
      pool.release(t.slot)

  while queue or pool.num_live:
    if queue and pool.num_free:
      joining, queue = queue[:pool.num_free], queue[pool.num_free:]
      for t in pool.join(params, [specs[i] for i in joining], joining):
        record(t)
    for t in pool.step(params):
      record(t)
  return out
