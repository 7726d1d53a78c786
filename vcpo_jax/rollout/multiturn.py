"""A multi-turn episode's bookkeeping: per-token record, where a turn ends, per-turn seeds, a trace cut into turns."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from vcpo_jax.rollout import types


class Environment(Protocol):
  """What a multi-turn environment offers (tasks.environments.base.EnvironmentFactory, e.g. the calculator's, or a
  stateless tasks.environments.tool_calls.ToolEnvironment): the call marker, the turn cap, and each episode's environment."""
  stop_strings: tuple[str, ...]
  max_turns: int

  def start(self, example: Optional[dict]) -> Any:
    """The environment of one episode: respond(turn_text) -> a reply (.text, .error, optional .kind) to the
    turn's call, or None when the turn makes none; error_reply(kind) -> the reply of a call that failed outside
    it ('timeout', 'tool'); optional reward(completion_text) -> the episode's reward or None (the task's)."""


@dataclasses.dataclass
class Episode:
  """An episode under construction: the response tokens after the prompt, with per-token bookkeeping."""
  output_ids: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  mask: list = dataclasses.field(default_factory=list)
  turns: int = 0
  tool_calls: int = 0
  tool_errors: int = 0
  error_kinds: dict = dataclasses.field(default_factory=dict)  # failure kind -> count
  turn_capped: bool = False
  finish_reason: str = "length"
  num_resumes: int = 0
  server_url: str = ""
  env_reward: Optional[float] = None  # the environment's episode reward (None: the task's reward applies)

  def add_generated(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
    if not len(ids) == len(logprobs) == len(versions):
      raise ValueError(f"turn has {len(ids)} ids, {len(logprobs)} log-probs and {len(versions)} versions")
    self.output_ids += [int(t) for t in ids]
    self.logprobs += [float(x) for x in logprobs]
    self.versions += [int(v) for v in versions]
    self.mask += [1.0] * len(ids)

  def add_tool(self, ids: Sequence[int]) -> None:
    self.output_ids += [int(t) for t in ids]
    self.logprobs += [0.0] * len(ids)
    self.versions += [-1] * len(ids)
    self.mask += [0.0] * len(ids)

  def to_sample(self, prompt_ids: Sequence[int]) -> types.Sample:
    return types.Sample(
        prompt_ids=[int(t) for t in prompt_ids], output_ids=list(self.output_ids),
        output_logprobs=np.asarray(self.logprobs, np.float32), token_versions=np.asarray(self.versions, np.int64),
        finish_reason=self.finish_reason, server_url=self.server_url, num_resumes=self.num_resumes,
        output_mask=np.asarray(self.mask, np.float32), num_turns=self.turns, tool_calls=self.tool_calls,
        tool_errors=self.tool_errors, turn_capped=self.turn_capped, tool_error_kinds=dict(self.error_kinds),
        env_reward=self.env_reward)


def turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
  """A fresh seed per turn (turn 0 keeps the sample's): later turns must not replay turn 0's random draws."""
  if seed is None or turn == 0:
    return seed
  return int(np.random.default_rng([int(seed) % 2**63, int(turn)]).integers(2**31 - 1))


def first_stop(ids: Sequence[int], decode: Callable[[Sequence[int]], str], stops: Sequence[str]) -> Optional[int]:
  """The fewest leading tokens whose text contains a stop string, or None (no stop string in the text)."""
  if not stops or not any(s in decode(ids) for s in stops):
    return None
  lo, hi = 1, len(ids)
  while lo < hi:
    mid = (lo + hi) // 2
    if any(s in decode(ids[:mid]) for s in stops):
      hi = mid
    else:
      lo = mid + 1
  return lo


def trace_segments(env: Environment, text: str, example: Optional[dict] = None) -> list[tuple[str, bool]]:
  """A written episode (turns and tool replies as one text, e.g. a warm-start trace) cut the way episodes are
  built: a turn ends at its first stop string (first_stop, characters as tokens) and the environment's reply
  to its call follows as a tool segment. Returns (text, is_tool) pairs in order; ValueError for a text no
  episode could hold (text after a turn without a call or after the max_turns-th turn, or after a call but
  other than its reply). The replies are those of one episode's environment, started from `example`."""
  episode_env = env.start(example)
  segments, rest, turns = [], text, 0
  while rest:
    cut = first_stop(rest, str, env.stop_strings)
    turn, rest = (rest, "") if cut is None else (rest[:cut], rest[cut:])
    segments.append((turn, False))
    turns += 1
    if not rest:  # the last turn (it may end at a call: the reply would follow)
      break
    reply = episode_env.respond(turn)
    if reply is None or turns >= env.max_turns:
      raise ValueError(f"trace goes on after turn {turns} (max_turns={env.max_turns}), where an episode ends: "
                       f"{text!r}")
    if not rest.startswith(reply.text):
      raise ValueError(f"trace turn {turns} calls the tool, but what follows is not its reply "
                       f"{reply.text!r}: {rest[:len(reply.text) + 16]!r}")
    segments.append((reply.text, True))
    rest = rest[len(reply.text):]
  return segments
