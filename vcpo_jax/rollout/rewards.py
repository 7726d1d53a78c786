"""The task's reward as the rollout side applies it: one object, built once per job, scoring off the event loop.

A task gives a reward function `(example, completion_text) -> float` (`Task.reward_function()`); the job wraps
it here with the tokenizer's decoding and a `CallPool` (config section `reward`, typed as `RewardConfig`), and
hands the one `Rewarder` to the rollout backend (which scores each group as it completes) and to the
evaluation. A reward that raises, times out, kills its worker or is not a finite number scores 0 and is counted
(`reward/errors/<kind>`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import pickle
from typing import Any, Callable, Mapping, Sequence

from vcpo_jax.calls import offload
from vcpo_jax.calls.offload import CallPool, Outcome
from vcpo_jax.calls.settings import int_at_least, number_above, one_of, read_section, setting
from vcpo_jax.rollout.types import Group

RewardFn = Callable[[dict, str], float]


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """The config section `reward`: the pool the task's reward runs in (reward_config builds it, checked)."""
  # thread: in-process, for trusted fast rewards; process: worker processes, killable, for slow or untrusted
  # verifiers; inline: on the calling thread (instant rewards, tests)
  pool: str = setting("thread", one_of(*offload.KINDS))
  workers: int = setting(2, int_at_least(1))  # concurrent reward calls
  timeout_s: float = setting(30.0, number_above(0, " (seconds)"))  # per call
  memory_mb: int = setting(0, int_at_least(0))  # process pool: address-space limit per worker


def reward_config(section: Mapping[str, Any] | None = None) -> RewardConfig:
  """The `reward` section typed; an unknown field or a bad value is an error naming reward.<field>."""
  return read_section(RewardConfig, "reward", section)


def _as_reward(outcome: Outcome) -> tuple[float, str | None]:
  """(reward, error kind or None): a non-number or a non-finite number is a 'bad_value' error."""
  if outcome.error is not None:
    return 0.0, outcome.error
  value = outcome.value
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
    return 0.0, "bad_value"
  return float(value), None


class Rewarder:
  """Decodes completions and scores them with `reward_fn` in `pool`; never raises for a failed reward."""

  def __init__(self, reward_fn: RewardFn, decode: Callable[[Sequence[int]], str], pool: CallPool):
    if pool.kind == "process":
      try:
        pickle.dumps(reward_fn)
      except Exception as e:
        raise ValueError(f"reward.pool='process' needs a picklable reward function (a module-level function or "
                         f"a functools.partial of one); {reward_fn!r} is not: {e}") from None
    self.reward_fn, self.decode, self.pool = reward_fn, decode, pool
    self._errors: dict[str, int] = {}

  @classmethod
  def for_task(cls, task, tokenizer, settings: RewardConfig = RewardConfig()) -> "Rewarder":
    """The job's rewarder: the task's reward function, the tokenizer's decoding, the `reward` config section."""
    from vcpo_jax.model.tokenizer import completion_text
    if not isinstance(settings, RewardConfig):  # a plain dict would skip the section's checks
      raise TypeError(f"settings must be a RewardConfig (rewards.reward_config(section)), got {type(settings)}")
    pool = CallPool(settings.pool, workers=settings.workers, timeout_s=settings.timeout_s,
                    memory_mb=settings.memory_mb, initializer=task.reward_initializer(), name="reward")
    return cls(task.reward_function(), lambda ids: completion_text(tokenizer, ids), pool)

  def _record(self, outcomes: Sequence[Outcome]) -> list[float]:
    rewards = []
    for outcome in outcomes:
      reward, error = _as_reward(outcome)
      if error == "bad_value":  # the pool counted the call as fine; the value is not a reward
        self._errors["bad_value"] = self._errors.get("bad_value", 0) + 1
      rewards.append(reward)
    return rewards

  async def score_group(self, group: Group) -> Group:
    """Sets group.rewards and group.completions; the event loop keeps running while the rewards compute. A
    sample with an episode reward (its environment's, sample.env_reward) keeps it."""
    texts = [self.decode(list(s.output_ids)) for s in group.samples]
    given = [getattr(s, "env_reward", None) for s in group.samples]
    outcomes = await asyncio.gather(*(self.pool.call(self.reward_fn, group.example, t) if g is None
                                      else _given(g) for t, g in zip(texts, given)))
    group.rewards, group.completions = self._record(outcomes), texts
    return group

  def score_blocking(self, examples: Sequence[dict], output_ids: Sequence[Sequence[int]],
                     env_rewards: Sequence[float | None] | None = None) -> list[float]:
    """Rewards for many (example, ids) pairs from synchronous code (the held-out evaluation); env_rewards:
    episode rewards that replace the task's where not None."""
    texts = [self.decode(list(ids)) for ids in output_ids]
    given = list(env_rewards) if env_rewards is not None else [None] * len(texts)
    todo = [i for i, g in enumerate(given) if g is None]
    outcomes = [Outcome(value=g) for g in given]
    for i, outcome in zip(todo, self.pool.map_blocking(self.reward_fn, [(examples[i], texts[i]) for i in todo])):
      outcomes[i] = outcome
    return self._record(outcomes)

  def stats(self) -> dict[str, float]:
    """reward/calls and reward/errors/<kind> (timeout, exception, crash, bad_value), cumulative."""
    counts = {**self.pool.stats, "errors/bad_value": self._errors.get("bad_value", 0)}
    return {f"reward/{k}": float(v) for k, v in counts.items()}

  def close(self) -> None:
    self.pool.close()


async def _given(value: float) -> Outcome:
  return Outcome(value=value)


def inline(reward_fn: RewardFn, decode: Callable[[Sequence[int]], str] = str, **pool_options: Any) -> Rewarder:
  """A rewarder that scores on the calling thread (tests, in-process tools)."""
  return Rewarder(reward_fn, decode, CallPool("inline", **pool_options))
