"""One sequence the engine generates (a prompt times one of its samples) and what it produced so far."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

from vcpo_jax.model import sampling


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
  adapter_slot: int = -1  # its slot in the engine's adapter stack (-1: the base), held until it finishes
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

  def take(self, t, version: str, stop_string_check: StopStringCheck | None) -> int:
    """A decode step's tokens for this unfinished row (a slot_pool.Tokens), each tagged with the weights' version;
    finishes the row at a stop string, a stop token or its length. Returns how many tokens it took."""
    if t.prompt_logprobs is not None and self.prompt_logprobs is None:  # a resumed row keeps its first
      self.prompt_logprobs = t.prompt_logprobs[:len(self.spec.prompt) - 1]
    self.output_ids += t.ids
    self.logprobs += t.logprobs
    self.versions += [version] * len(t.ids)
    if t.ids:
      self.updated.set()
    hit = stop_string_check(self) if self.stop_strings and stop_string_check is not None else None
    if hit is not None:
      keep, matched = hit
      del self.output_ids[keep:], self.logprobs[keep:], self.versions[keep:]
      self.finish("stop", matched)
    elif t.done and t.stopped:
      self.finish("stop", self.output_ids[-1])
    elif t.done:
      self.finish("length")
    return len(t.ids)

  def finish(self, reason: str, matched=None):
    if self.finish_reason is None:
      self.finish_reason, self.matched, self.finished_at = reason, matched, time.monotonic()
      self.done.set()
      self.updated.set()


# Given a row's output ids, returns (number of tokens to keep, matched stop string) or None.
StopStringCheck = Callable[[Row], "tuple[int, str] | None"]
