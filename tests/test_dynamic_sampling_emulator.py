"""The group filter in the lag emulator: deterministic refills, resumed counters and data order, no-op equality."""
import asyncio
import dataclasses
import json

import numpy as np
import pytest

from test_dynamic_sampling import _filter
from vcpo_jax.rollout import dynamic_sampling as ds, rewards
from vcpo_jax.rollout.emulation import emulator


@dataclasses.dataclass
class _Row:
  output_ids: list
  logprobs: list
  finish_reason: str = "stop"


def _emulated(tmp_path, prompts, *, k=1, group_filter=None, reward=None):
  def generate(params, prompts_, seeds):  # params hold the version tag: outputs reveal which was used
    # [version, a coin of the sample's seed, the sample's place in its group]
    return [_Row([int(params["v"]) % 50, seed % 7, i % 2], [-0.5, -0.25, -1.0]) for i, seed in enumerate(seeds)]

  reward = reward or (lambda example, ids: float(ids[1] % 2))
  ctx = types_ctx(prompts, reward, str(tmp_path))
  return emulator.EmulatedBackend(emulator.LagEmulator(generate, max_lag=k, group_size=2, seed=0), ctx,
                                  batch_groups=2, group_filter=group_filter)


def types_ctx(prompts, reward, workdir):
  from vcpo_jax.rollout import backend
  return backend.RolloutContext(model_cfg=None, tokenizer=None, prompts=prompts,
                                rewarder=rewards.inline(reward, decode=list), workdir=workdir, batch_rows=4)


class _Prompts:
  """A prompt iterator with a position, as the job's (its state is checkpointed with the backend's)."""

  def __init__(self, start=0):
    self.pulled = start

  def __iter__(self):
    return self

  def __next__(self):
    self.pulled += 1
    return {"prompt_ids": [1, 2], "index": self.pulled - 1}


def _params(version):
  return {"v": np.asarray(version, np.int32)}


def _steps(backend, first, last, params_of=_params):
  async def run():
    await backend.start(first, params_of(first))
    out = []
    for v in range(first, last):
      groups = await backend.next_groups(v)
      out.append(([(g.index, g.rewards, g.sample_lags, [list(s.output_ids) for s in g.samples]) for g in groups],
                  backend.stats()))
      await backend.publish(v + 1, params_of(v + 1))
    return out
  return asyncio.run(run())


def test_emulator_refills_deterministically_and_resumes_the_filter_and_the_data_order(tmp_path):
  k = 2
  straight = _steps(_emulated(tmp_path / "a", _Prompts(), k=k, group_filter=_filter(max_drops_per_step=50)), 0, 6)
  again = _steps(_emulated(tmp_path / "b", _Prompts(), k=k, group_filter=_filter(max_drops_per_step=50)), 0, 6)
  assert again == straight  # deterministic
  for t, (groups, stats) in enumerate(straight):
    assert len(groups) == 2 and all(ds.verdict(r, 1e-6) == "keep" for _, r, _, _ in groups)
    assert all(lags == [min(t, k)] * 2 for _, _, lags, _ in groups)  # a refill samples with its slot's version
  assert sum(s["dynamic_sampling/dropped_all_fail"] + s["dynamic_sampling/dropped_all_pass"]
             for _, s in straight) > 0
  # Killed after step 3's checkpoint: a new backend from the checkpoint's state and the iterator's position.
  prompts, first = _Prompts(), _emulated(tmp_path / "c", None, k=k, group_filter=_filter(max_drops_per_step=50))
  first.ctx = dataclasses.replace(first.ctx, prompts=prompts)
  head = _steps(first, 0, 3)
  state, pulled = json.loads(json.dumps(first.state_dict())), prompts.pulled
  resumed = _emulated(tmp_path / "c", _Prompts(pulled), k=k, group_filter=_filter(max_drops_per_step=50))
  resumed.load_state_dict(state)
  tail = _steps(resumed, 3, 6)
  assert head + tail == straight  # same groups, lags, rewards and the filter's counters, step by step


def test_emulator_with_nothing_to_drop_equals_no_filter(tmp_path):
  spread = lambda example, ids: float(ids[2])  # noqa: E731  (sample 0 fails, sample 1 passes)
  always = lambda example, ids: 1.0  # noqa: E731
  off = _steps(_emulated(tmp_path / "a", _Prompts(), reward=spread), 0, 4)
  on = _steps(_emulated(tmp_path / "b", _Prompts(), reward=spread, group_filter=_filter(tolerance=0.0)), 0, 4)
  kept = [groups for groups, _ in on]
  assert all(ds.verdict(r, 0.0) == "keep" for groups in kept for _, r, _, _ in groups)
  assert kept == [groups for groups, _ in off]
  assert all(s["dynamic_sampling/dropped_total"] == 0 for _, s in on)
  with pytest.raises(ds.DropCapExceeded, match="max_drops_per_step=3"):
    _steps(_emulated(tmp_path / "c", _Prompts(), reward=always, group_filter=_filter(max_drops_per_step=3)), 0, 1)
