"""Rollout types every backend shares: one completed generation (Sample) and one prompt's group."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass
class Sample:
  """One completed generation or multi-turn episode; output_logprobs are the sampler's per-token logprobs.

  An episode's output interleaves generated tokens with tool-output tokens: output_mask is 1 on generated
  tokens and 0 on tool tokens, whose log-prob is 0 and version -1 (no sampler made them). None: all generated.
  """
  prompt_ids: list[int]
  output_ids: list[int]
  output_logprobs: np.ndarray  # float32 [L]
  token_versions: np.ndarray  # int64 [L], policy version that produced each output token (-1: tool token)
  finish_reason: str  # "length" | "stop" (an abort is resumed, never returned)
  server_url: str  # server that produced the last segment ("in-process" for local generation)
  num_resumes: int = 0
  output_mask: Optional[np.ndarray] = None  # float32 [L]: 1 generated, 0 tool output; None = all generated
  num_turns: int = 1  # model turns (one /generate each, resumes not counted)
  tool_calls: int = 0  # calls the environment answered
  tool_errors: int = 0  # answered calls that failed (malformed, division by zero, ...)
  turn_capped: bool = False  # ended by the environment's max_turns with a call still unanswered
  tool_error_kinds: Optional[dict] = None  # failed calls by kind (tasks.environments.tool_calls.ERROR_KINDS)
  env_reward: Optional[float] = None  # the environment's episode reward; None: the task's reward scores it

  @property
  def min_version(self) -> Optional[int]:
    versions = generated_versions(self)
    return int(versions.min()) if len(versions) else None


def generated_versions(sample: Any) -> np.ndarray:
  """Versions of the sample's generated tokens (tool-output tokens, mask 0, have none)."""
  versions = np.asarray(getattr(sample, "token_versions", ()), np.int64)
  mask = getattr(sample, "output_mask", None)
  return versions if mask is None else versions[np.asarray(mask) > 0]


def output_mask(group: Any, sample: Any, length: int) -> np.ndarray:
  """1 on generated tokens, 0 on an episode's tool-output tokens (Sample.output_mask; None: all generated)."""
  m = getattr(sample, "output_mask", None)
  if m is None:
    return np.ones((length,), np.float32)
  m = np.asarray(m, np.float32)
  if m.shape != (length,) or not np.all((m == 0) | (m == 1)):
    raise ValueError(f"group {group.index}: output_mask must be 0/1 of shape ({length},), got {m!r:.200}")
  return m


@dataclasses.dataclass
class Group:
  """n samples of one prompt, with the staleness record of each sample."""
  index: int  # admission order (the prompt example's index)
  example: dict  # the prompt example; example["prompt_ids"] was generated from
  start_version: int  # learner version when generation started
  deadline: int  # last learner version allowed to consume this group
  samples: list = dataclasses.field(default_factory=list)  # Sample-like: .token_versions
  consumed_version: Optional[int] = None
  sample_lags: list[int] = dataclasses.field(default_factory=list)  # consumed_version - oldest token version
  rewards: Optional[list[float]] = None  # one per sample, set by rewards.Rewarder when the group completes
  completions: Optional[list[str]] = None  # decoded responses (host-side record, for logs and debugging)

  @property
  def prompt_ids(self) -> list[int]:
    return [int(t) for t in self.example["prompt_ids"]]


def sample_lag(sample: Any, consumed_version: int, start_version: int) -> int:
  """Learner version at consumption minus the oldest policy version among the sample's generated tokens
  (every turn of an episode; tool outputs carry no version)."""
  versions = generated_versions(sample)
  oldest = int(versions.min()) if len(versions) else start_version
  return consumed_version - oldest
