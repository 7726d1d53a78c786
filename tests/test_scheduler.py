"""Tests for the staleness-bounded scheduler, against a simulated asynchronous generate with random timing."""
import asyncio
import dataclasses
import itertools
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from vcpo_jax.rollout import rewards
from vcpo_jax.rollout.client import scheduler as sched_lib


@dataclasses.dataclass
class FakeSample:
  token_versions: np.ndarray


async def _yield(times):
  for _ in range(times):
    await asyncio.sleep(0)


class SimulatedServers:
  """Generation whose tokens take random event-loop turns; each token is tagged with the live version."""

  def __init__(self, rng, max_tokens=6, max_token_turns=20):
    self.rng, self.version = rng, 0
    self.max_tokens, self.max_token_turns = max_tokens, max_token_turns
    self.calls = []

  async def _one(self):
    versions = []
    for _ in range(self.rng.randint(0, self.max_tokens)):
      await _yield(self.rng.randint(0, self.max_token_turns))
      versions.append(self.version)
    return FakeSample(np.asarray(versions, np.int64))

  async def generate(self, prompt_ids, sampling_params, n):
    self.calls.append((list(prompt_ids), dict(sampling_params), self.version))
    return await asyncio.gather(*(self._one() for _ in range(n)))


def _prompts(count):
  return iter([{"prompt_ids": [i + 1], "id": i} for i in range(count)])


async def _train(sched, servers, rng, first_version, steps, k, train_turns=30, min_turns=0):
  """The trainer side: publish v, take batch v, 'train' for a while. Returns the consumed groups."""
  consumed = []
  for v in range(first_version, first_version + steps):
    servers.version = v
    batch = await sched.next_batch(v)
    for g in batch:
      assert g.consumed_version == v and g.start_version <= v <= g.deadline == g.start_version + k
      for s, lag in zip(g.samples, g.sample_lags):
        oldest = s.token_versions.min() if len(s.token_versions) else g.start_version
        assert lag == v - oldest and 0 <= lag <= k
    consumed.append(batch)
    if not batch:
      break
    await _yield(rng.randint(min_turns, train_turns))
  return consumed


@settings(max_examples=60, deadline=None)
@given(batch_groups=st.integers(1, 4), k=st.integers(0, 5), n=st.integers(1, 3), seed=st.integers(0, 2**31),
       extra=st.integers(0, 7), max_inflight=st.one_of(st.none(), st.integers(0, 6)))
def test_lag_bound_holds_and_every_prompt_is_consumed_once(batch_groups, k, n, seed, extra, max_inflight):
  rng = random.Random(seed)
  num_prompts = batch_groups * 6 + extra
  servers = SimulatedServers(rng)
  inflight = None if max_inflight is None else batch_groups + max_inflight

  async def run():
    sched = sched_lib.RolloutScheduler(servers.generate, _prompts(num_prompts), sampling_params={"max_new_tokens": 4},
                                       group_size=n, batch_groups=batch_groups, max_lag=k,
                                       max_inflight_groups=inflight)
    try:
      batches = await _train(sched, servers, rng, 0, num_prompts + 2, k)
    finally:
      await sched.close()
    return batches, sched.stats

  batches, stats = asyncio.run(run())
  sizes = [len(b) for b in batches]
  full, rest = divmod(num_prompts, batch_groups)
  assert sizes[:full] == [batch_groups] * full and sum(sizes) == num_prompts
  ids = [g.example["id"] for b in batches for g in b]
  assert sorted(ids) == list(range(num_prompts))  # none lost, none duplicated
  assert all(len(g.samples) == n for b in batches for g in b)
  assert stats.get("lag_violations", 0) == 0 and stats["max_lag_seen"] <= k
  assert sum(stats["lag_hist"].values()) == num_prompts * n


@pytest.mark.parametrize("k", [0, 1, 3])
def test_instant_generation_reaches_exactly_lag_k_in_steady_state(k):
  """The bound is tight: with free generation the scheduler runs k versions ahead, no more."""
  servers = SimulatedServers(random.Random(0), max_tokens=0)  # empty outputs: lag counts from start_version

  async def run():
    sched = sched_lib.RolloutScheduler(servers.generate, _prompts(40), sampling_params={"max_new_tokens": 1},
                                       group_size=2, batch_groups=2, max_lag=k)
    batches = await _train(sched, servers, random.Random(1), 0, 12, k, train_turns=20, min_turns=20)
    await sched.close()
    return batches

  batches = asyncio.run(run())
  lags = [[lag for g in b for lag in g.sample_lags] for b in batches]
  assert all(max(lag) == k for lag in lags[k:])
  if k == 0:  # synchronous: every group is generated with the version that consumes it
    assert all(version == i // 2 for i, (_, _, version) in enumerate(servers.calls[:24]))


def _feasible_brute_force(deadlines, next_step, batch_groups):
  """Tries every assignment of groups to consumption steps next_step..max(deadline)."""
  if not deadlines:
    return True
  steps = range(next_step, max(deadlines) + 1)
  for assign in itertools.product(steps, repeat=len(deadlines)):
    if all(s <= d for s, d in zip(assign, deadlines)):
      if all(assign.count(s) <= batch_groups for s in steps):
        return True
  return False


@settings(max_examples=200, deadline=None)
@given(deadlines=st.lists(st.integers(0, 4), max_size=6), next_step=st.integers(0, 3), b=st.integers(1, 3))
def test_feasibility_check_matches_brute_force(deadlines, next_step, b):
  assert sched_lib.batch_is_feasible(deadlines, next_step, b) == _feasible_brute_force(deadlines, next_step, b)


def test_checkpoint_reissues_unconsumed_prompts_and_loses_none():
  rng = random.Random(3)
  servers = SimulatedServers(rng)
  params = {"max_new_tokens": 4, "sampling_seed": 100}

  async def first_run():
    sched = sched_lib.RolloutScheduler(servers.generate, _prompts(30), sampling_params=params, group_size=2,
                                       batch_groups=3, max_lag=2)
    batches = await _train(sched, servers, rng, 0, 3, 2)
    await _yield(50)  # let some prefetched groups complete, others stay in flight
    state = sched.state_dict()
    await sched.close()
    return batches, state

  batches, state = asyncio.run(first_run())
  state = json.loads(json.dumps(state))  # it travels in the checkpoint's JSON host state
  assert state["next_step"] == 3 and len(state["pending"]) == 6  # B * k groups prefetched
  pulled = state["next_index"]

  async def second_run():
    prompts = _prompts(30)
    for _ in range(pulled):  # the prompt iterator restored to its checkpointed position
      next(prompts)
    sched = sched_lib.RolloutScheduler(servers.generate, prompts, sampling_params=params, group_size=2,
                                       batch_groups=3, max_lag=2)
    sched.load_state_dict(state)
    with pytest.raises(ValueError, match="learner_version must be 3"):
      await sched.next_batch(0)
    out = await _train(sched, servers, rng, 3, 20, 2)
    stats = sched.stats
    await sched.close()
    return out, stats

  more, stats = asyncio.run(second_run())
  ids = [g.example["id"] for b in batches + more for g in b]
  assert sorted(ids) == list(range(30)) and stats["groups_reissued"] == 6
  seeds = {tuple(p): sp["sampling_seed"] for p, sp, _ in servers.calls}
  assert all(seeds[(i + 1,)] == 100 + 2 * i for i in range(30))  # group i: seed + i * group_size


def test_generation_failure_and_bad_arguments_are_reported():
  async def failing(prompt_ids, sampling_params, n):
    raise ConnectionError("all servers gone")

  async def run():
    sched = sched_lib.RolloutScheduler(failing, _prompts(4), sampling_params={}, group_size=1, batch_groups=1,
                                       max_lag=0)
    with pytest.raises(RuntimeError, match="all servers gone"):
      await sched.next_batch(0)
    await sched.close()
    sched = sched_lib.RolloutScheduler(failing, iter([{"text": "x"}]), sampling_params={}, group_size=1,
                                       batch_groups=1, max_lag=0)
    with pytest.raises(ValueError, match="prompt_ids"):
      await sched.next_batch(0)
    await sched.close()

  asyncio.run(run())
  for kwargs, field in [({"group_size": 0}, "group_size"), ({"batch_groups": 0}, "batch_groups"),
                        ({"max_lag": -1}, "max_lag"), ({"max_inflight_groups": 1}, "max_inflight_groups")]:
    args = dict(sampling_params={}, group_size=1, batch_groups=2, max_lag=0) | kwargs
    with pytest.raises(ValueError, match=field):
      sched_lib.RolloutScheduler(failing, _prompts(1), **args)


def test_groups_are_scored_as_they_complete_while_the_trainer_is_busy():
  """on_complete (the backends' reward scoring) runs when a group's samples arrive, not when the trainer asks:
  with lag 1 the next batch is generated and scored during the current step."""
  servers = SimulatedServers(random.Random(0), max_tokens=2, max_token_turns=2)
  scored = []

  async def run():
    sched = sched_lib.RolloutScheduler(servers.generate, _prompts(20), sampling_params={"max_new_tokens": 2},
                                       group_size=2, batch_groups=2, max_lag=1,
                                       on_complete=lambda g: scored.append(g.index))
    await sched.next_batch(0)
    await _yield(200)  # the trainer's step 0
    scored_before_asking = list(scored)
    batch = await sched.next_batch(1)
    await sched.close()
    return scored_before_asking, batch

  scored_before_asking, batch = asyncio.run(run())
  assert {g.index for g in batch} <= set(scored_before_asking)

  async def failing_score():
    def boom(group):
      raise KeyError("no verifier")
    sched = sched_lib.RolloutScheduler(servers.generate, _prompts(4), sampling_params={"max_new_tokens": 2},
                                       group_size=1, batch_groups=1, max_lag=0, on_complete=boom)
    with pytest.raises(RuntimeError, match="no verifier"):
      await sched.next_batch(0)
    await sched.close()

  asyncio.run(failing_score())


@dataclasses.dataclass
class _Row:
  output_ids: list
  logprobs: list
  finish_reason: str = "length"


@pytest.mark.parametrize("k", [0, 3])
def test_lag_emulator_generates_step_t_with_the_params_of_step_t_minus_k(k):
  from vcpo_jax.rollout.emulation import emulator
  used = []

  def generate(params, prompts, seeds):  # "params" is the version tag itself: outputs reveal which was used
    used.append(params)
    return [_Row([params % 50, seed % 7], [-0.5, -0.25]) for seed in seeds]

  emu = emulator.LagEmulator(generate, max_lag=k, group_size=2, seed=0)
  examples = [{"prompt_ids": [1, 2], "index": i} for i in range(3)]
  seeds_by_step = []
  for t in range(8):
    emu.push(t, t)
    groups = emu.rollout(t, examples)
    assert used[-1] == max(0, t - k) and len(emu._ring) <= k + 1
    for g in groups:
      assert g.consumed_version == t and g.sample_lags == [min(t, k)] * 2
      assert all(list(s.token_versions) == [max(0, t - k)] * 2 for s in g.samples)
    seeds_by_step.append([s.output_ids[1] for g in groups for s in g.samples])
  assert all(seeds == seeds_by_step[0] for seeds in seeds_by_step)  # per-example streams, stable over steps
  with pytest.raises(ValueError, match="in order"):
    emu.push(10, 10)


def test_emulated_backend_scores_groups_where_it_generates():
  from vcpo_jax.rollout import backend
  from vcpo_jax.rollout.emulation import emulator
  scored = []

  def score(example, output_ids):
    scored.append(example["index"])
    return float(output_ids[0] % 2)

  def generate(params, prompts, seeds):
    return [_Row([params % 50, seed % 7], [-0.5, -0.25]) for seed in seeds]

  ctx = backend.RolloutContext(model_cfg=None, tokenizer=None, prompts=iter(
      {"prompt_ids": [1, 2], "index": i} for i in range(100)), rewarder=rewards.inline(score, decode=list),
      workdir="", batch_rows=4)
  rollouts = emulator.EmulatedBackend(emulator.LagEmulator(generate, max_lag=1, group_size=2, seed=0), ctx,
                                       batch_groups=2)

  async def run():
    await rollouts.start(0, 0)
    first = await rollouts.next_groups(0)
    await rollouts.publish(1, 1)
    second = await rollouts.next_groups(1)
    await rollouts.close()
    return first, second

  first, second = asyncio.run(run())
  assert scored == [0, 0, 1, 1, 2, 2, 3, 3]  # every sample scored inside next_groups, as generated
  for g in first + second:
    assert g.rewards == [float(s.output_ids[0] % 2) for s in g.samples]
  assert [g.sample_lags for g in second] == [[1, 1], [1, 1]]
