"""Report figures (matplotlib, Agg): per-lag curves with 95% CI bands over seeds, and the IQM aggregate."""
from __future__ import annotations

import math

import numpy as np

from experiments.stats import analysis


def pyplot():
  try:
    import matplotlib  # noqa: PLC0415  (optional: `pip install -e .[report]` or requirements-dev.txt)
  except ImportError as e:
    raise ImportError("plots need matplotlib: pip install 'matplotlib==3.11.2' (the `report` extra)") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  return plt


def curves_figure(arms: dict, curves, title: str, path: str) -> None:
  """One panel per (metric, title, log, bounds); one line per arm (mean over seeds) with its 95% t band,
  clipped to the metric's bounds. Log-scale metrics are averaged in log space (a geometric mean)."""
  plt = pyplot()
  fig, axes = plt.subplots(1, len(curves), figsize=(5.2 * len(curves), 3.8), squeeze=False)
  for ax, (key, label, log, bounds) in zip(axes[0], curves):
    for i, (arm, runs) in enumerate(arms.items()):
      per_run = []
      for run in runs:
        values = run.series.get(key, {})
        if log:
          values = {s: math.log10(v) for s, v in values.items() if math.isfinite(v) and v > 0}
        if values:
          per_run.append(values)
      steps, mean, lo, hi = analysis.band(per_run)
      if not steps:
        continue
      if log:
        mean, lo, hi = 10 ** mean, 10 ** lo, 10 ** hi
      lo, hi = np.clip(lo, *bounds), np.clip(hi, *bounds)
      color = f"C{i % 10}"
      marker = "o" if len(steps) <= 30 else None
      ax.plot(steps, mean, color=color, marker=marker, markersize=3, label=f"{arm} (n={len(per_run)})")
      ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("RL step")
    ax.set_title(label)
    if log:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def aggregate_figure(rows: list[tuple[str, float, float, float]], path: str) -> None:
  """rows: (arm, IQM, low, high) in percent; horizontal bars with the bootstrap interval."""
  plt = pyplot()
  rows = [r for r in rows if math.isfinite(r[1])]
  fig, ax = plt.subplots(figsize=(7, 0.45 * max(len(rows), 2) + 1.4))
  y = np.arange(len(rows))
  ax.barh(y, [r[1] for r in rows], color="C0", alpha=0.6)
  err = np.array([[r[1] - r[2] for r in rows], [r[3] - r[1] for r in rows]])
  ax.errorbar([r[1] for r in rows], y, xerr=np.nan_to_num(err), fmt="none", color="k", capsize=3)
  ax.set_yticks(y, [r[0] for r in rows])
  ax.set_xlabel("IQM of final held-out greedy accuracy (%)")
  ax.set_title("runs at k > 0; 95% stratified bootstrap interval", fontsize=9)
  ax.grid(axis="x", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
