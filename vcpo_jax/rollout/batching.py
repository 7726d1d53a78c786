"""Turns completed rollout groups into right-padded numpy arrays for the learner (no JAX, no learner import)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass
class RolloutArrays:
  """Plain arrays crossing from the rollout side to the learner. B = groups x group_size rows."""
  tokens_BxT: np.ndarray        # int32 [prompt | response | pad]
  mask_BxT: np.ndarray          # float32, 1 exactly on generated tokens
  sampler_logp_BxT: np.ndarray  # float32 sampler log-probs on generated tokens, 0 elsewhere
  version_BxT: np.ndarray       # int32 policy version that produced each generated token, -1 elsewhere
  rewards_B: np.ndarray         # float32
  group_B: np.ndarray           # int32 group id within the batch
  lag_B: np.ndarray             # int32 learner version at consumption - oldest token version
  valid_B: np.ndarray           # float32, 0 on padding rows
  completions: list[str]        # decoded responses, for logging
  indices: list[int]            # prompt (example) indices, one per group


def groups_to_arrays(groups: Sequence, *, seq_len: int, pad_id: int, decode: Callable[[list[int]], str],
                     reward_fn: Callable[[dict, str], float], num_rows: int | None = None,
                     vocab_size: int | None = None) -> RolloutArrays:
  """`groups` carry .example, .samples (prompt_ids, output_ids, output_logprobs, token_versions) and
  .sample_lags. Rows beyond the real samples (to fill `num_rows`) are invalid padding rows. Token ids outside
  [0, vocab_size) and non-finite sampler log-probs are rejected here: inside jit they would be clamped or
  poison the whole batch silently."""
  samples = [(gi, g, s, lag) for gi, g in enumerate(groups) for s, lag in zip(g.samples, g.sample_lags)]
  B = num_rows or len(samples)
  if len(samples) > B:
    raise ValueError(f"batch has {len(samples)} samples but num_rows={B}")
  tokens = np.full((B, seq_len), pad_id, np.int32)
  mask = np.zeros((B, seq_len), np.float32)
  logp = np.zeros((B, seq_len), np.float32)
  version = np.full((B, seq_len), -1, np.int32)
  rewards = np.zeros((B,), np.float32)
  group = np.full((B,), -1, np.int32)
  lag = np.zeros((B,), np.int32)
  valid = np.zeros((B,), np.float32)
  completions = []
  for row, (gi, g, s, sample_lag) in enumerate(samples):
    prompt, out = list(s.prompt_ids), list(s.output_ids)
    end = len(prompt) + len(out)
    if end > seq_len:
      raise ValueError(f"sample of group {g.index} has {end} tokens, more than seq_len={seq_len}")
    ids = np.asarray(prompt + out, np.int64)
    if vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
      bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
      raise ValueError(f"group {g.index}: token id {bad} outside the vocabulary [0, {vocab_size})")
    if not np.all(np.isfinite(np.asarray(s.output_logprobs, np.float64))):
      raise ValueError(f"group {g.index}: non-finite sampler log-prob in output_logprobs")
    tokens[row, :end] = ids
    mask[row, len(prompt):end] = 1.0
    logp[row, len(prompt):end] = np.asarray(s.output_logprobs, np.float32)
    version[row, len(prompt):end] = np.asarray(s.token_versions, np.int32)
    text = decode(out)
    completions.append(text)
    rewards[row] = reward_fn(g.example, text)
    group[row], lag[row], valid[row] = gi, sample_lag, 1.0
  # Padding rows get their own group ids so no group statistic mixes them with real samples.
  pad_rows = np.arange(len(samples), B)
  group[pad_rows] = len(groups) + np.arange(len(pad_rows))
  return RolloutArrays(tokens, mask, logp, version, rewards, group, lag, valid, completions,
                       [g.index for g in groups])
