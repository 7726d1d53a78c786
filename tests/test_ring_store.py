"""The lag emulator's ring on disk: exact round trips (bfloat16 included), errors naming the parameter, and a
resumed EmulatedBackend sampling from the same past versions as an uninterrupted one."""
import asyncio
import os

import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.rollout import backend, rewards
from vcpo_jax.rollout.emulation import emulator, ring_store


def _params(v):
  return {"params": {"w": np.full((2, 3), v, np.float32) + np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
                     "b": np.asarray(jnp.full((3,), v + 0.5, jnp.bfloat16))}}


def test_round_trip_is_exact_with_dtypes(tmp_path):
  store = ring_store.RingStore(str(tmp_path))
  store.save(4, _params(4))
  back = store.load(4, like=_params(0))
  for key in ("w", "b"):
    assert back["params"][key].dtype == _params(4)["params"][key].dtype
    np.testing.assert_array_equal(back["params"][key], _params(4)["params"][key])


def test_load_names_the_parameter_that_does_not_fit(tmp_path):
  store = ring_store.RingStore(str(tmp_path))
  store.save(1, _params(1))
  wider = {"params": {"w": np.zeros((2, 4), np.float32), "b": _params(1)["params"]["b"]}}
  with pytest.raises(ValueError, match=r"\['params'\]\['w'\] has shape \(2, 3\).*\(2, 4\)"):
    store.load(1, like=wider)
  other = {"params": {"w": np.zeros((2, 3), np.float32), "c": np.zeros((3,), np.float32)}}
  with pytest.raises(ValueError, match=r"no parameter \['params'\]\['c'\]"):
    store.load(1, like=other)


def test_available_is_the_newest_consecutive_run_and_prune_keeps_only_what_it_is_told(tmp_path):
  store = ring_store.RingStore(str(tmp_path))
  for v in (3, 5, 6):
    store.save(v, _params(v))
  assert store.available([3, 4, 5, 6]) == [5, 6]  # 4 is missing: only what follows it is usable
  store.prune([5, 6])
  assert sorted(os.listdir(tmp_path)) == ["v5.npz", "v6.npz"]
  store.prune([6])
  assert sorted(os.listdir(tmp_path)) == ["v6.npz"]


class _Row:
  def __init__(self, output_ids, logprobs):
    self.output_ids, self.logprobs, self.finish_reason = output_ids, logprobs, "stop"


def _backend(workdir, used):
  def generate(params, prompts, seeds):  # the params' w[0, 0] is the version: outputs reveal which was used
    version = int(round(float(params["params"]["w"][0, 0])))
    used.append(version)
    return [_Row([version, seed % 7], [-0.5, -0.25]) for seed in seeds]

  ctx = backend.RolloutContext(model_cfg=None, tokenizer=None, prompts=iter(
      {"prompt_ids": [1, 2], "index": i} for i in range(1000)), rewarder=rewards.inline(lambda e, t: 0.0), workdir=workdir,
      batch_rows=4)
  return emulator.EmulatedBackend(emulator.LagEmulator(generate, max_lag=3, group_size=2, seed=0), ctx,
                                   batch_groups=2)


def test_resumed_backend_samples_from_the_same_past_versions(tmp_path):
  async def run(rollouts, first, last, state=None):
    if state is not None:
      rollouts.load_state_dict(state)
    await rollouts.start(first, _params(first))
    lags = []
    for t in range(first, last):
      lags.append([g.sample_lags for g in await rollouts.next_groups(t)])
      await rollouts.publish(t + 1, _params(t + 1))
    return lags, rollouts.state_dict()

  straight_used, resumed_used = [], []
  straight, _ = asyncio.run(run(_backend(str(tmp_path / "a"), straight_used), 0, 10))
  before, state = asyncio.run(run(_backend(str(tmp_path / "b"), resumed_used), 0, 6))
  assert state == {"ring_versions": [3, 4, 5]}  # 6 is the train state's own
  assert sorted(os.listdir(tmp_path / "b" / "emulation_ring")) == ["v3.npz", "v4.npz", "v5.npz"]
  after, state = asyncio.run(run(_backend(str(tmp_path / "b"), resumed_used), 6, 10, state))
  assert before + after == straight
  assert resumed_used == straight_used == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6]
  # The resumed run's first checkpoint keeps the one it resumed from (a failed write would fall back to it);
  # the next one drops it.
  assert state == {"ring_versions": [7, 8, 9]}
  assert sorted(os.listdir(tmp_path / "b" / "emulation_ring")) == [f"v{v}.npz" for v in (3, 4, 5, 7, 8, 9)]


def test_the_previous_checkpoints_versions_survive_until_the_next_one(tmp_path):
  rollouts = _backend(str(tmp_path), [])

  async def to(version):
    await rollouts.publish(version, _params(version))

  async def run():
    await rollouts.start(0, _params(0))
    for v in range(1, 7):
      await to(v)
    first = rollouts.state_dict()  # past versions 3, 4, 5
    await to(7)
    second = rollouts.state_dict()  # 4, 5, 6; 3 is the previous checkpoint's: kept
    await to(8)
    third = rollouts.state_dict()  # 5, 6, 7; the previous is 4, 5, 6: 3 goes
    return first, second, third

  first, second, third = asyncio.run(run())
  assert [s["ring_versions"] for s in (first, second, third)] == [[3, 4, 5], [4, 5, 6], [5, 6, 7]]
  assert sorted(os.listdir(tmp_path / "emulation_ring")) == [f"v{v}.npz" for v in (4, 5, 6, 7)]
