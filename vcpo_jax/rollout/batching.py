"""Turns completed, scored rollout groups into the learner's RLBatch of right-padded numpy rows."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vcpo_jax.learner.batch import RLBatch
from vcpo_jax.rollout.types import Group


def _check_sample(g: Group, ids: np.ndarray, logprobs, mask: np.ndarray, seq_len: int,
                  vocab_size: int | None) -> None:
  if ids.size > seq_len:
    raise ValueError(f"sample of group {g.index} has {ids.size} tokens, more than seq_len={seq_len}")
  if vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
    raise ValueError(f"group {g.index}: token id {bad} outside the vocabulary [0, {vocab_size})")
  if not np.all(np.isfinite(np.asarray(logprobs, np.float64)[mask > 0])):
    raise ValueError(f"group {g.index}: non-finite sampler log-prob in output_logprobs")


def _output_mask(g: Group, s, length: int) -> np.ndarray:
  """1 on generated tokens, 0 on an episode's tool-output tokens (Sample.output_mask; None: all generated)."""
  m = getattr(s, "output_mask", None)
  if m is None:
    return np.ones((length,), np.float32)
  m = np.asarray(m, np.float32)
  if m.shape != (length,) or not np.all((m == 0) | (m == 1)):
    raise ValueError(f"group {g.index}: output_mask must be 0/1 of shape ({length},), got {m!r:.200}")
  return m


def groups_to_batch(groups: Sequence[Group], *, seq_len: int, pad_id: int, num_rows: int | None = None,
                    vocab_size: int | None = None) -> RLBatch:
  """One row per sample, [prompt | response | pad], the mask 1 on generated tokens only (an episode's
  tool outputs inside the response are 0); rows beyond the real samples (to fill `num_rows`) are
  invalid padding rows. Groups must be consumed (.sample_lags) and scored (.rewards). Token ids outside
  [0, vocab_size) and non-finite sampler log-probs are rejected here: inside jit they would be clamped or
  poison the whole batch silently."""
  for g in groups:
    if g.rewards is None or len(g.rewards) != len(g.samples):
      raise ValueError(f"group {g.index} is not scored: backends call types.score_group as a group completes")
    if len(g.sample_lags) != len(g.samples):
      raise ValueError(f"group {g.index} has {len(g.sample_lags)} sample_lags for {len(g.samples)} samples")
  rows = [(gi, g, j) for gi, g in enumerate(groups) for j in range(len(g.samples))]
  B = num_rows or len(rows)
  if len(rows) > B:
    raise ValueError(f"batch has {len(rows)} samples but num_rows={B}")
  tokens = np.full((B, seq_len), pad_id, np.int32)
  mask = np.zeros((B, seq_len), np.float32)
  logp = np.zeros((B, seq_len), np.float32)
  version = np.full((B, seq_len), -1, np.int32)
  rewards, lag, valid = np.zeros((B,), np.float32), np.zeros((B,), np.float32), np.zeros((B,), np.float32)
  group = np.full((B,), -1, np.int32)
  for row, (gi, g, j) in enumerate(rows):
    s = g.samples[j]
    ids = np.asarray(list(s.prompt_ids) + list(s.output_ids), np.int64)
    start, end = len(s.prompt_ids), ids.size
    out_mask = _output_mask(g, s, end - start)
    _check_sample(g, ids, s.output_logprobs, out_mask, seq_len, vocab_size)
    tokens[row, :end] = ids
    mask[row, start:end] = out_mask
    # Tool-output tokens (mask 0) carry no sampler log-prob and no version, whatever the sample holds there.
    logp[row, start:end] = np.where(out_mask > 0, np.asarray(s.output_logprobs, np.float32), 0.0)
    version[row, start:end] = np.where(out_mask > 0, np.asarray(s.token_versions, np.int32), -1)
    rewards[row], group[row], lag[row], valid[row] = g.rewards[j], gi, g.sample_lags[j], 1.0
  # Padding rows get their own group ids so no group statistic mixes them with real samples.
  pad_rows = np.arange(len(rows), B)
  group[pad_rows] = len(groups) + np.arange(len(pad_rows))
  return RLBatch(tokens_BxT=tokens, mask_BxT=mask, sampler_logp_BxT=logp, rewards_B=rewards, group_B=group,
                 lag_B=lag, valid_B=valid, version_BxT=version)
