"""A step's metrics from its consumed groups: rewards, lengths and throughput, tool episodes, the lag histogram."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from vcpo_jax.rollout import dynamic_sampling, overlong, types
from vcpo_jax.tasks.environments import tool_calls


def step_metrics(groups: Sequence[types.Group], *, seconds: float, max_lag: Optional[int],
                 shaping: Optional[overlong.Shaping] = None) -> dict[str, float]:
  """Every group metric of one step (the RL loop's one call): reward/, response_length/, throughput/,
  tools/ (multi-turn runs only) and lag/frac_0..k."""
  return {**batch_metrics(groups, seconds, shaping), **episode_metrics(groups), **lag_metrics(groups, max_lag)}


def batch_metrics(groups: Sequence[types.Group], seconds: float,
                  shaping: Optional[overlong.Shaping] = None) -> dict[str, float]:
  """Reward (the verifier's outcome) and response-length statistics of a step's samples (generated tokens only),
  its throughput, the share of its groups whose outcomes do not spread (no advantage: 0 with dynamic sampling)
  and of its samples cut by the length limit; with the length penalty on, its mean."""
  rewards = np.asarray([r for g in groups for r in g.rewards], np.float32)
  lengths = np.asarray([types.output_mask(g, s, len(s.output_ids)).sum() for g in groups for s in g.samples],
                       np.float32)
  flat = [dynamic_sampling.verdict(g.rewards, dynamic_sampling.DEFAULT_TOLERANCE) != "keep"
          for g in groups]
  out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
         "reward/zero_spread_groups": float(np.mean(flat)),
         "response_length/mean": float(lengths.mean()),
         "response_length/truncated_fraction": float(np.mean([overlong.truncated(s) for g in groups
                                                                for s in g.samples])),
         "throughput/tokens": float(lengths.sum()),
         "throughput/tokens_per_s": float(lengths.sum() / max(seconds, 1e-9)),
         "throughput/step_seconds": seconds}
  if shaping is not None and shaping.penalty:
    out["reward/overlong_penalty_mean"] = float(np.mean(overlong.length_penalty(
        lengths, shaping.max_length, shaping.cache_length)))
  return out


def episode_metrics(groups: Sequence[types.Group]) -> dict[str, float]:
  """Per-step episode metrics (TensorBoard `tools/...`); {} when no sample is a multi-turn episode."""
  samples = [s for g in groups for s in g.samples if getattr(s, "output_mask", None) is not None]
  if not samples:
    return {}
  calls = np.asarray([s.tool_calls for s in samples], np.float64)
  errors = np.asarray([s.tool_errors for s in samples], np.float64)
  tool_tokens = [float(np.sum(np.asarray(s.output_mask) == 0)) for s in samples]
  # The fixed kinds every step, and a tool's own kinds (e.g. tools/errors/tool/syntax_error) in steps that saw one.
  own = sorted({k for s in samples for k in (s.tool_error_kinds or {}) if k.startswith("tool/")})
  kinds = (*tool_calls.ERROR_KINDS, "reward", *own)
  return {"tools/calls_per_episode": float(calls.mean()),
          "tools/errors_per_episode": float(errors.mean()),
          "tools/error_rate": float(errors.sum() / max(calls.sum(), 1.0)),
          "tools/turns_per_episode": float(np.mean([s.num_turns for s in samples])),
          "tools/max_turns": float(max(s.num_turns for s in samples)),
          "tools/turn_capped_fraction": float(np.mean([s.turn_capped for s in samples])),
          "tools/tool_tokens_per_episode": float(np.mean(tool_tokens)),
          **{f"tools/errors/{kind}": float(np.mean([_count(s, kind) for s in samples])) for kind in kinds}}


def _count(sample, kind: str) -> int:
  """Failed calls of `kind` in the episode; 'tool' includes the tools' own kinds ('tool/<kind>')."""
  return sum(n for k, n in (sample.tool_error_kinds or {}).items() if k == kind or k.startswith(kind + "/"))


def lag_histogram(lags: Sequence[int], max_lag: int) -> np.ndarray:
  """Fractions of lags equal to 0..max_lag (float64 [max_lag + 1]; a lag above k lands in the last bin)."""
  lags_N = np.minimum(np.asarray(list(lags), np.int64), max_lag)
  counts_K = np.bincount(lags_N, minlength=max_lag + 1).astype(np.float64)
  return counts_K / max(counts_K.sum(), 1.0)


def lag_metrics(groups: Sequence[Any], max_lag: int | None) -> dict[str, float]:
  """lag/frac_0..lag/frac_k: the step's per-sample lag histogram (fractions), logged every step in every mode
  (max_lag None: bins up to the largest lag seen)."""
  lags = [lag for g in groups for lag in (getattr(g, "sample_lags", None) or [])]
  if not lags:
    return {}
  k = max(lags) if max_lag is None else max_lag
  return {f"lag/frac_{j}": float(f) for j, f in enumerate(lag_histogram(lags, k))}
