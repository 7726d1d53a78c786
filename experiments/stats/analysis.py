"""Statistics for the report: t confidence intervals, IQM with stratified bootstrap, collapse and ESS-drop steps.

Definitions (stated on every report page):
- Collapse: the first evaluation step t > 0 from which held-out greedy accuracy stays below
  `fraction` x (the best accuracy at any evaluation before t, the base model's included) at every later
  evaluation to the end of the run. A run that recovers above that line is not collapsed.
- ESS drop: the first step t whose ESS ratio is below `threshold` and stays there in the sense that the
  median over steps t .. t+window-1 is below it too (a lone dip is not a drop; a non-finite ratio counts as 0).
- Lead time (C1): collapse step - ESS-drop step, for runs that have both; its resolution is the evaluation
  interval, since accuracy is only measured at evaluation steps.
- Endpoint: the mean of a run's last ENDPOINT_EVALS held-out evaluations (the base model's excluded), so one
  noisy evaluation does not decide a run's score.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from scipy import stats

COLLAPSE_FRACTION = 0.5
ESS_DROP_THRESHOLD = 0.1
ESS_DROP_WINDOW = 5
ENDPOINT_EVALS = 3


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
  """(mean, half-width of the Student-t interval); half-width NaN with fewer than two values."""
  x = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
  if x.size == 0:
    return math.nan, math.nan
  if x.size == 1:
    return float(x[0]), math.nan
  half = stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
  return float(x.mean()), float(half)


def interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
  """(mean, lower, upper) of the Student-t interval; both bounds NaN with fewer than two values."""
  m, h = mean_ci(values, level)
  return m, m - h, m + h


def endpoint(steps: Sequence[int], values: Sequence[float], n: int = ENDPOINT_EVALS) -> Optional[float]:
  """Mean of the last n evaluations after step 0 (the base); None when the run has fewer than n."""
  after = [float(v) for s, v in sorted(zip(steps, values)) if s > 0]
  return float(np.mean(after[-n:])) if len(after) >= n else None


def format_mean_ci(values: Sequence[Optional[float]], scale: float = 100.0, signed: bool = False) -> str:
  """'m ± h' (one decimal, values x scale; None skipped), 'm (n=1)' for one value, '-' for none."""
  m, h = mean_ci([v * scale for v in values if v is not None])
  if not math.isfinite(m):
    return "-"
  mean = f"{m:+.1f}" if signed else f"{m:.1f}"
  return f"{mean} ± {h:.1f}" if math.isfinite(h) else f"{mean} (n=1)"


def _iqm_rows(x_RxN: np.ndarray) -> np.ndarray:
  """IQM of each row: sort, drop floor(n/4) values at each end (scipy.stats.trim_mean(x, 0.25)), average."""
  n = x_RxN.shape[1]
  cut = int(0.25 * n)
  return np.sort(x_RxN, axis=1)[:, cut:n - cut].mean(axis=1)


def iqm(values: Sequence[float]) -> float:
  """Interquartile mean: the mean of the middle 50% of the values."""
  x = np.asarray(values, np.float64)
  return float(_iqm_rows(x[None, :])[0]) if x.size else math.nan


def bootstrap_iqm(groups: Sequence[Sequence[float]], reps: int = 2000, level: float = 0.95,
                  seed: int = 0) -> tuple[float, float, float]:
  """IQM of all values pooled, and a percentile interval from a stratified bootstrap: each group (e.g. one
  lag) is resampled with replacement on its own, so every resample keeps the groups' sizes."""
  groups = [np.asarray(g, np.float64) for g in groups if len(g)]
  if not groups:
    return math.nan, math.nan, math.nan
  rng = np.random.default_rng(seed)
  draws_RxN = np.concatenate([g[rng.integers(0, g.size, (reps, g.size))] for g in groups], axis=1)
  lo, hi = np.quantile(_iqm_rows(draws_RxN), [0.5 - level / 2, 0.5 + level / 2])
  return iqm(np.concatenate(groups)), float(lo), float(hi)


def collapse_step(steps: Sequence[int], accuracy: Sequence[float],
                  fraction: float = COLLAPSE_FRACTION) -> Optional[int]:
  """See the module docstring. `steps`/`accuracy` are the evaluations in step order, the base (step 0) first."""
  steps, acc = list(steps), [float(a) for a in accuracy]
  for i in range(1, len(steps)):
    line = fraction * max(acc[:i])
    if steps[i] > 0 and all(a < line for a in acc[i:]):
      return int(steps[i])
  return None


def ess_drop_step(steps: Sequence[int], ess_ratio: Sequence[float], threshold: float = ESS_DROP_THRESHOLD,
                  window: int = ESS_DROP_WINDOW) -> Optional[int]:
  """See the module docstring; a drop needs a full window, so the last window-1 steps cannot start one."""
  x = np.asarray([v if v is not None and math.isfinite(v) else 0.0 for v in ess_ratio], np.float64)
  for i in range(len(x) - window + 1):
    if x[i] < threshold and np.median(x[i:i + window]) < threshold:
      return int(steps[i])
  return None


def lead_time(collapse: Optional[int], ess_drop: Optional[int]) -> Optional[int]:
  return None if collapse is None or ess_drop is None else collapse - ess_drop


def band(step_values: Sequence[dict[int, float]], level: float = 0.95):
  """Per step over runs: (steps, mean, lower, upper); steps present in every run only."""
  if not step_values:
    return [], np.array([]), np.array([]), np.array([])
  common = sorted(set.intersection(*(set(d) for d in step_values)))
  mean, lo, hi = [], [], []
  for s in common:
    m, h = mean_ci([d[s] for d in step_values], level)
    mean.append(m)
    lo.append(m - h if math.isfinite(h) else m)
    hi.append(m + h if math.isfinite(h) else m)
  return common, np.array(mean), np.array(lo), np.array(hi)
