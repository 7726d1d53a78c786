"""Robust statistics of repeated measurements: median and range, per-round ratios."""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Stats:
  """Median and range of repeated measurements (seconds, or a ratio)."""
  median: float
  min: float
  max: float
  n: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def summarize(samples: Sequence[float]) -> Stats:
  """Median, min and max of a non-empty list of finite numbers."""
  values = [float(x) for x in samples]
  if not values:
    raise ValueError("samples must be non-empty")
  bad = [x for x in values if not math.isfinite(x)]
  if bad:
    raise ValueError(f"samples must be finite, got {bad[:3]}")
  return Stats(median=statistics.median(values), min=min(values), max=max(values), n=len(values))


def ratio_samples(num: Sequence[float], den: Sequence[float]) -> list[float]:
  """Per-round ratios num[i] / den[i] of interleaved measurements."""
  if len(num) != len(den) or not num:
    raise ValueError(f"num and den must be non-empty and of equal length, got {len(num)} and {len(den)}")
  if any(d <= 0 for d in den):
    raise ValueError("den must be positive")
  return [a / b for a, b in zip(num, den)]
