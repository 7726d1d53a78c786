"""TensorBoard scalars and histograms (tensorboardX) and the tqdm progress display."""
from __future__ import annotations

import math
import os
import re
import sys
from typing import Mapping

import numpy as np
import tqdm


def _import_summary_writer():
  """tensorboardX's SummaryWriter without torch: tensorboardX imports torch, when installed, only to accept torch
  tensors, which we never log; that import was ~1.7 s of every job's and server's 3.8 s start-up (python -X
  importtime -c 'import vcpo_jax.main'). A torch imported before (or after) is left as it is."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX imports
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


SummaryWriter = _import_summary_writer()

HIST_PREFIX = "hist/"
# TensorBoard tags allow only these characters; others ('@' in eval/pass@k) become '_', here rather than in
# tensorboardX, which logs a line for every such tag it writes.
_TAG_CHARS = re.compile(r"[^-/\w.]")


def split_metrics(metrics: Mapping) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """Scalars vs histogram arrays (keys under 'hist/'), moved to host."""
  scalars, hists = {}, {}
  for key, value in metrics.items():
    arr = np.asarray(value)
    if key.startswith(HIST_PREFIX):
      hists[key[len(HIST_PREFIX):]] = arr.reshape(-1)
    elif arr.size == 1:
      scalars[key] = float(arr.reshape(()))
  return scalars, hists


class MetricsWriter:
  """Writes on process 0 only; other processes get a no-op writer."""

  def __init__(self, logdir: str, enabled: bool = True):
    self.enabled = enabled
    self._writer = SummaryWriter(logdir) if enabled else None
    if enabled:
      os.makedirs(logdir, exist_ok=True)

  def write(self, step: int, metrics: Mapping, prefix: str = ""):
    if not self.enabled:
      return
    scalars, hists = split_metrics(metrics)
    for key, value in scalars.items():
      if math.isfinite(value):
        self._writer.add_scalar(_TAG_CHARS.sub("_", prefix + key), value, step)
    for key, arr in hists.items():
      arr = arr[np.isfinite(arr)]
      if arr.size:
        self._writer.add_histogram(prefix + key, arr, step)

  def flush(self):
    if self.enabled:
      self._writer.flush()

  def close(self):
    if self.enabled:
      self._writer.close()


class Progress:
  """One progress bar line: step, reward, accuracy, ESS, lag, tokens/s."""

  FIELDS = (("reward", "reward/mean", "{:.3f}"), ("acc", "eval/greedy_accuracy", "{:.3f}"),
            ("ess", "ess_ratio", "{:.2f}"), ("lag", "lag/mean", "{:.2f}"), ("tok/s", "throughput/tokens_per_s",
                                                                           "{:.0f}"))

  def __init__(self, total: int, initial: int = 0, enabled: bool = True):
    self._bar = tqdm.tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, desc="rl")
    self._last: dict[str, float] = {}

  def update(self, step: int, scalars: Mapping[str, float]):
    self._last.update(scalars)
    parts = {name: fmt.format(self._last[key]) for name, key, fmt in self.FIELDS if key in self._last}
    self._bar.set_postfix(parts, refresh=False)
    self._bar.update(step - self._bar.n)

  def close(self):
    self._bar.close()
