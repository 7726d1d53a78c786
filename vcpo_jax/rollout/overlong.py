"""Overlong shaping (DAPO): a soft penalty by response length in generated tokens, and truncated rows masked out.

DAPO (arXiv 2503.14476, eq. 13), with L_max = max_length and L_cache = cache_length, |y| the tokens the model
generated (an episode's tool-output tokens are not counted):
  R_length(y) = 0                                   if |y| <= L_max - L_cache
              = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
              = -1                                  if |y| > L_max
added to the verifier's outcome of the kept groups' samples only (after the dynamic-sampling filter, which
judges the outcome alone). mask_truncated: a sample that ended by running out of room (finish_reason 'length';
for an episode also a turn cap or no room for the next turn) keeps its reward in its group's statistics but
contributes no token to the loss.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from vcpo_jax.calls.settings import Rule, int_at_least, read_section, setting

SECTION = "rl.overlong"
_BOOL = Rule(lambda v: isinstance(v, bool), "must be True or False")


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
  """The config section rl.overlong (overlong_config builds it, checked; shaping() resolves its defaults)."""
  penalty: bool = setting(False, _BOOL)  # Adds R_length to each kept sample's reward.
  max_length: int = setting(0, int_at_least(0, " (0: rl.max_new_tokens)"))  # L_max, in generated tokens.
  # L_cache, in generated tokens.
  cache_length: int = setting(0, int_at_least(0, " (0: a fifth of max_length, DAPO's 4096 of 20480)"))
  mask_truncated: bool = setting(False, _BOOL)  # Rows cut by the length limit leave the loss, not the statistics.


@dataclasses.dataclass(frozen=True)
class Shaping:
  """The resolved section: what job/batching.py applies to a step's rows."""
  penalty: bool
  max_length: int
  cache_length: int
  mask_truncated: bool


def overlong_config(section: Optional[Mapping[str, Any]] = None) -> OverlongConfig:
  """The section typed; an unknown field or a bad value is an error naming rl.overlong.<field>."""
  return read_section(OverlongConfig, SECTION, section)


def shaping(section: Optional[Mapping[str, Any]], max_new_tokens: int) -> Optional[Shaping]:
  """The resolved shaping (None when it does nothing); cache_length above max_length is an error naming it."""
  cfg = overlong_config(section)
  max_length = cfg.max_length or max_new_tokens
  cache_length = cfg.cache_length or max(1, max_length // 5)
  if cache_length > max_length:  # checked when off too: turning it on later must not be what fails
    raise ValueError(f"invalid config: {SECTION}.cache_length={cfg.cache_length!r}: must be <= max_length "
                     f"({max_length}{' = rl.max_new_tokens' if not cfg.max_length else ''})")
  if not (cfg.penalty or cfg.mask_truncated):
    return None
  return Shaping(cfg.penalty, max_length, cache_length, cfg.mask_truncated)


def length_penalty(lengths_N: Sequence[int] | np.ndarray, max_length: int, cache_length: int) -> np.ndarray:
  """R_length of each response length (float64 [N]); 0 up to L_max - L_cache, linear to -1 at L_max, -1 beyond."""
  if cache_length < 1 or cache_length > max_length:
    raise ValueError(f"cache_length must be in [1, max_length={max_length}], got {cache_length!r}")
  len_N = np.asarray(lengths_N, np.float64)
  start = float(max_length - cache_length)
  ramp_N = (start - len_N) / float(cache_length)
  return np.where(len_N <= start, 0.0, np.where(len_N <= max_length, ramp_N, -1.0))


def truncated(sample: Any) -> bool:
  """The sample ended without a stop token (cut by the length limit, or an episode out of turns or room)."""
  return getattr(sample, "finish_reason", "stop") == "length"
