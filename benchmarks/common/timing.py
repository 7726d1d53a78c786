"""Wall-clock timing with warm-up rounds and interleaved repeats."""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from benchmarks.common import summary

# Why interleaving: the machine is shared and noisy, so a ratio is measured as per-round ratios of
# calls timed back to back (A, B, A, B, ...), which cancels slow drifts in load better than timing
# all of A and then all of B.


def block(tree):
  """Waits for every array in a pytree (jax arrays have block_until_ready; others pass through)."""
  try:
    import jax
    return jax.block_until_ready(tree)
  except ImportError:  # pragma: no cover - jax is always installed here
    return tree


def time_once(fn: Callable[[], Any], sync: Callable[[Any], Any] = block) -> float:
  """Wall seconds of one call, including waiting for its asynchronous results."""
  start = time.perf_counter()
  sync(fn())
  return time.perf_counter() - start


def time_calls(fns: Mapping[str, Callable[[], Any]], *, warmup: int = 1, repeats: int = 5,
               sync: Callable[[Any], Any] = block) -> dict[str, list[float]]:
  """Per-call wall times of several thunks, interleaved round by round after `warmup` untimed rounds."""
  if warmup < 0:
    raise ValueError(f"warmup must be >= 0, got {warmup}")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  for _ in range(warmup):
    for fn in fns.values():
      sync(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      times[name].append(time_once(fn, sync))
  return times


def timing_details(times: Mapping[str, Sequence[float]]) -> dict:
  """Per-thunk {median, min, max, n} in seconds, for the details column of a figure."""
  return {name: summary.summarize(t).to_dict() for name, t in times.items()}
