"""In-process lag emulation: rollouts for learner step t come from the params of step t - k (ring buffer)."""
from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable, Sequence

import ml_collections
import numpy as np

from vcpo_jax.model import sampling
from vcpo_jax.rollout import backend, episodes, types

# (params, prompts, seeds) -> rows with .output_ids and .logprobs (sampling.generate's RowResult), or
# multi-turn episodes.Episode rows (tool tasks)
LocalGenerate = Callable[[object, list[list[int]], list[int]], Sequence]


class LagEmulator:
  """Deterministic controlled staleness with no servers: every sample of step t has lag exactly
  min(t - first_version, k). Holds at most k + 1 parameter versions (host memory: (k+1) x params)."""

  def __init__(self, generate: LocalGenerate, *, max_lag: int, group_size: int, seed: int):
    if not isinstance(max_lag, int) or max_lag < 0:
      raise ValueError(f"max_lag must be an int >= 0, got {max_lag!r}")
    if not isinstance(group_size, int) or group_size < 1:
      raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    self.max_lag, self.group_size, self.seed = max_lag, group_size, seed
    self._generate = generate
    self._ring: collections.OrderedDict[int, object] = collections.OrderedDict()

  def push(self, version: int, params) -> None:
    """Records the params of learner version `version` (versions must increase by one)."""
    if self._ring and version != next(reversed(self._ring)) + 1:
      raise ValueError(f"versions must be pushed in order: got {version} after {next(reversed(self._ring))}")
    self._ring[version] = params
    while len(self._ring) > self.max_lag + 1:
      self._ring.popitem(last=False)

  def behaviour_version(self, step: int) -> int:
    if step not in self._ring:
      raise ValueError(f"learner version {step} was never pushed (have {list(self._ring)})")
    return max(step - self.max_lag, next(iter(self._ring)))

  def rollout(self, step: int, examples: Sequence[dict]) -> list[types.Group]:
    """Generates group_size samples per example with the params of version behaviour_version(step)."""
    version = self.behaviour_version(step)
    prompts = [[int(t) for t in e["prompt_ids"]] for e in examples for _ in range(self.group_size)]
    # One seed per (example index, sample): the same example always draws the same random streams.
    seeds = [int(np.random.default_rng([self.seed, int(e.get("index", i)), s]).integers(2**31 - 1))
             for i, e in enumerate(examples) for s in range(self.group_size)]
    rows = self._generate(self._ring[version], prompts, seeds)
    groups = []
    for gi, example in enumerate(examples):
      samples = []
      for s in range(self.group_size):
        row = rows[gi * self.group_size + s]
        if isinstance(row, episodes.Episode):  # a multi-turn episode: tool tokens keep mask 0, version -1
          sample = row.to_sample(prompts[gi * self.group_size])
          sample.token_versions = np.where(sample.output_mask > 0, version, -1).astype(np.int64)
          samples.append(sample)
          continue
        n = len(row.output_ids)
        samples.append(types.Sample(
            prompt_ids=prompts[gi * self.group_size], output_ids=list(row.output_ids),
            output_logprobs=np.asarray(row.logprobs, np.float32), token_versions=np.full((n,), version, np.int64),
            finish_reason=row.finish_reason or "length", server_url="in-process"))
      group = types.Group(index=int(example.get("index", gi)), example=example, start_version=version,
                                  deadline=version + self.max_lag, samples=samples, consumed_version=step)
      group.sample_lags = [types.sample_lag(s, step, version) for s in samples]
      groups.append(group)
    return groups


class EmulatedBackend(backend.RolloutBackend):
  """The lag emulator behind the backend seam: step t draws rl.prompts_per_step prompts and trains on groups
  sampled (and scored, right where they are generated) with the params of step t - k. No servers.

  The ring buffer is not checkpointed (k+1 copies of the params): after a resume the lag ramps up again.
  """

  def __init__(self, emulator: LagEmulator, ctx: backend.RolloutContext, *, batch_groups: int):
    self.emulator, self.ctx, self.batch_groups = emulator, ctx, batch_groups

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, ctx: backend.RolloutContext) -> "EmulatedBackend":
    rl = config.rl
    runner = episodes.runner_for(ctx.task, ctx.tokenizer,
                                 max_new_tokens=rl.max_new_tokens)
    if runner is None:
      generate = lambda params, prompts, seeds: sampling.generate(  # noqa: E731
          params, ctx.model_cfg, prompts, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
          stop_token_ids=ctx.tokenizer.stop_ids, seeds=seeds)
    else:
      generate = lambda params, prompts, seeds: runner.run_local(  # noqa: E731
          params, ctx.model_cfg, prompts, seeds, temperature=rl.temperature)
    emulator = LagEmulator(generate, max_lag=rl.max_lag, group_size=rl.group_size, seed=config.seed)
    return cls(emulator, ctx, batch_groups=rl.prompts_per_step)

  async def start(self, version: int, params: Any) -> None:
    self.emulator.push(version, params)

  async def next_groups(self, version: int) -> list[types.Group]:
    examples = [next(self.ctx.prompts) for _ in range(self.batch_groups)]
    # In a worker thread, so the event loop (and Ctrl-C) stays responsive during generation.
    groups = await asyncio.to_thread(self.emulator.rollout, version, examples)
    return [types.score_group(g, self.ctx.score) for g in groups]

  async def publish(self, version: int, params: Any) -> None:
    self.emulator.push(version, params)
