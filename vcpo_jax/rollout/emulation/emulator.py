"""In-process lag emulation: step t trains on rollouts from the params of step t - lag (ring buffer of k + 1)."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import ml_collections
import numpy as np

from vcpo_jax.model import sampling
from vcpo_jax.rollout import backend, dynamic_sampling, episodes, multiturn, types
from vcpo_jax.rollout.emulation import lag_model as lag_model_lib, ring_store

# (params, prompts, seeds) -> rows with .output_ids and .logprobs (sampling.generate's RowResult), or
# multiturn.Episode rows (tool tasks; their generate also takes each row's example: pass_examples)
LocalGenerate = Callable[[object, list[list[int]], list[int]], Sequence]


class LagEmulator:
  """Deterministic controlled staleness with no servers. Lag model 'fixed' (lag_model None): every sample of
  step t has lag exactly min(t - first_version, k); 'pipeline' (a lag_model.PipelineLagModel): group i of step
  t has the lag the simulated async pipeline gives it, clamped the same way. Holds at most k + 1 parameter
  versions (host memory: (k+1) x params)."""

  def __init__(self, generate: LocalGenerate, *, max_lag: int, group_size: int, seed: int,
               lag_model: lag_model_lib.PipelineLagModel | None = None, pass_examples: bool = False):
    if not isinstance(max_lag, int) or max_lag < 0:
      raise ValueError(f"max_lag must be an int >= 0, got {max_lag!r}")
    if not isinstance(group_size, int) or group_size < 1:
      raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    self.max_lag, self.group_size, self.seed = max_lag, group_size, seed
    self._generate, self.lag_model = generate, lag_model
    self.pass_examples = pass_examples  # generate also takes each row's example (multi-turn environments)
    self._ring: collections.OrderedDict[int, object] = collections.OrderedDict()

  def push(self, version: int, params) -> None:
    """Records the params of learner version `version` (versions must increase by one)."""
    if self._ring and version != next(reversed(self._ring)) + 1:
      raise ValueError(f"versions must be pushed in order: got {version} after {next(reversed(self._ring))}")
    self._ring[version] = params
    while len(self._ring) > self.max_lag + 1:
      self._ring.popitem(last=False)

  @property
  def versions(self) -> list[int]:
    return list(self._ring)

  def params(self, version: int):
    return self._ring[version]

  def behaviour_version(self, step: int) -> int:
    if step not in self._ring:
      raise ValueError(f"learner version {step} was never pushed (have {list(self._ring)})")
    return max(step - self.max_lag, next(iter(self._ring)))

  def group_versions(self, step: int, num_groups: int) -> list[int]:
    """The policy version each of the step's groups is sampled from (oldest: behaviour_version(step))."""
    oldest = self.behaviour_version(step)
    if self.lag_model is None:
      return [oldest] * num_groups
    lags = self.lag_model.lags(step)
    # The model's batch has rl.prompts_per_step groups; a short last batch takes its first lags.
    return [max(step - lag, oldest) for lag in lags[:num_groups]] + [oldest] * max(0, num_groups - len(lags))

  def rollout(self, step: int, examples: Sequence[dict], slots: Optional[Sequence[int]] = None) -> list[types.Group]:
    """Generates group_size samples per example, group i with the params of group_versions(step)[slots[i]]
    (slots: the batch positions the examples fill, default 0, 1, ...; a refill takes its slot's version)."""
    slots = list(range(len(examples))) if slots is None else list(slots)
    every = self.group_versions(step, max(slots, default=-1) + 1)
    versions = [every[s] for s in slots]
    prompts = [[int(t) for t in e["prompt_ids"]] for e in examples for _ in range(self.group_size)]
    # One seed per (example index, sample): the same example always draws the same random streams.
    seeds = [int(np.random.default_rng([self.seed, int(e.get("index", i)), s]).integers(2**31 - 1))
             for i, e in enumerate(examples) for s in range(self.group_size)]
    rows = [None] * len(prompts)
    for version in sorted(set(versions)):  # one generate call per policy version (one in 'fixed')
      at = [r for r in range(len(prompts)) if versions[r // self.group_size] == version]
      args = [self._ring[version], [prompts[r] for r in at], [seeds[r] for r in at]]
      if self.pass_examples:
        args.append([examples[r // self.group_size] for r in at])
      for r, row in zip(at, self._generate(*args)):
        rows[r] = row
    groups = []
    for gi, example in enumerate(examples):
      version = versions[gi]
      samples = []
      for s in range(self.group_size):
        row = rows[gi * self.group_size + s]
        if isinstance(row, multiturn.Episode):  # a multi-turn episode: tool tokens keep mask 0, version -1
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmulatedBackendConfig(backend.SamplingFields):
  """The config fields the emulate backend reads, named as in the config (backend.read_config builds it)."""
  emulation: Optional[Mapping[str, Any]] = backend.config_field("rl", None)  # lag_model and its options


class EmulatedBackend(backend.RolloutBackend):
  """The lag emulator behind the backend seam: step t draws rl.prompts_per_step prompts and trains on groups
  sampled (and scored, right where they are generated) with the params of step t - k. No servers.

  Each checkpoint also saves the ring's past versions (WORKDIR/emulation_ring: the k before the checkpoint's
  own, whose params the train state holds, and the previous checkpoint's k until the next one commits; none at
  k = 0): a resumed run samples from the same past policies as an uninterrupted one, instead of ramping its lag
  up again from 0.

  With a group filter (rl.dynamic_sampling) a dropped group's slot is refilled at once with the next prompt,
  sampled with that slot's version (in 'fixed', t - k: what a steady asynchronous pipeline refilling at once
  gives), until every slot holds a kept group; the filter's counters travel in the checkpoint.
  """

  def __init__(self, emulator: LagEmulator, ctx: backend.RolloutContext, *, batch_groups: int,
               group_filter: Optional[dynamic_sampling.GroupFilter] = None):
    self.emulator, self.ctx, self.batch_groups = emulator, ctx, batch_groups
    self.group_filter = group_filter
    self.store = ring_store.RingStore(os.path.join(ctx.workdir, "emulation_ring"))
    self._checkpoint_versions: list[int] = []  # the past versions the latest checkpoint (saved or restored) names

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, ctx: backend.RolloutContext) -> "EmulatedBackend":
    return cls.build(backend.read_config(EmulatedBackendConfig, config), ctx)

  @classmethod
  def build(cls, cfg: EmulatedBackendConfig, ctx: backend.RolloutContext) -> "EmulatedBackend":
    """The emulator and its lag model from the backend's own config fields."""
    runner = episodes.runner_for(ctx.task, ctx.tokenizer,
                                 max_new_tokens=cfg.max_new_tokens)
    if runner is None:
      generate = lambda params, prompts, seeds: sampling.generate(  # noqa: E731
          params, ctx.model_cfg, prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
          stop_token_ids=ctx.tokenizer.stop_ids, seeds=seeds)
    else:
      generate = lambda params, prompts, seeds, examples: runner.run_local(  # noqa: E731
          params, ctx.model_cfg, prompts, seeds, temperature=cfg.temperature, examples=examples)
    em = cfg.emulation or {}
    options = {k: v for k, v in dict(em).items() if k != "lag_model"}
    lag_model = lag_model_lib.make_lag_model(em.get("lag_model", "fixed"), max_lag=cfg.max_lag,
                                             batch_groups=cfg.prompts_per_step, group_size=cfg.group_size,
                                             seed=cfg.seed, options=options)
    emulator = LagEmulator(generate, max_lag=cfg.max_lag, group_size=cfg.group_size, seed=cfg.seed,
                           lag_model=lag_model, pass_examples=runner is not None)
    group_filter = dynamic_sampling.GroupFilter.from_section(cfg.dynamic_sampling, batch_groups=cfg.prompts_per_step)
    return cls(emulator, ctx, batch_groups=cfg.prompts_per_step, group_filter=group_filter)

  def state_dict(self) -> dict:
    """Saves the ring's past versions (called at each checkpoint, with the prompt iterator's state)."""
    past = self.emulator.versions[:-1]  # the newest is the checkpoint's own train state
    for v in past:
      self.store.save(v, self.emulator.params(v))
    # The previous checkpoint's versions stay until this one commits: a failed write must not orphan them.
    self.store.prune(set(past) | set(self._checkpoint_versions))
    self._checkpoint_versions = past
    out = {"ring_versions": past}
    if self.group_filter is not None:
      out["dynamic_sampling"] = self.group_filter.state_dict()
    return out

  def load_state_dict(self, state: dict) -> None:
    self._checkpoint_versions = [int(v) for v in state.get("ring_versions", [])]
    if self.group_filter is not None and "dynamic_sampling" in state:
      self.group_filter.load_state_dict(state["dynamic_sampling"])

  async def start(self, version: int, params: Any) -> None:
    # The checkpoint's ring ends at `version` (the restored params): load the consecutive versions before it.
    for v in self.store.available([v for v in self._checkpoint_versions if v < version]):
      self.emulator.push(v, self.store.load(v, like=params))
    self.emulator.push(version, params)

  async def _scored_rollout(self, version: int, slots: Sequence[int]) -> list[types.Group]:
    examples = [next(self.ctx.prompts) for _ in slots]
    # In a worker thread, so the event loop (and Ctrl-C) stays responsive during generation.
    groups = await asyncio.to_thread(self.emulator.rollout, version, examples, slots)
    return list(await asyncio.gather(*(self.ctx.rewarder.score_group(g) for g in groups)))

  async def next_groups(self, version: int) -> list[types.Group]:
    groups = await self._scored_rollout(version, range(self.batch_groups))
    if self.group_filter is None:
      return groups
    batch: list[Optional[types.Group]] = [None] * self.batch_groups
    todo = list(range(self.batch_groups))
    while todo:
      for slot, group in zip(todo, groups):
        if self.group_filter.judge(group):
          batch[slot] = group
      todo = [slot for slot in todo if batch[slot] is None]
      if todo:
        self.group_filter.check_cap(version)
        groups = await self._scored_rollout(version, todo)
    self.group_filter.close_step()
    return batch

  def stats(self) -> dict[str, float]:
    return dict(self.group_filter.last) if self.group_filter is not None else {}

  async def publish(self, version: int, params: Any) -> None:
    self.emulator.push(version, params)
