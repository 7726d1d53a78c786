"""Dynamic sampling and overlong shaping: the filter's verdict and counters, its invariants inside the scheduler (no
group lost or consumed twice, kept samples within lag k, resumable, a no-op when nothing is dropped), the cap's
message, and DAPO's length penalty against a float64 reference."""
import asyncio
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from vcpo_jax.job import batching
from vcpo_jax.rollout import dynamic_sampling as ds, group_metrics, overlong, types
from vcpo_jax.rollout.client import scheduler as sched_lib
from tests.test_scheduler import SimulatedServers, _prompts, _yield


def _filter(**section):
  return ds.GroupFilter.from_section({"enabled": True, **section}, batch_groups=2)


def _group(index, outcomes, lengths=None, finish="stop"):
  lengths = lengths or [2] * len(outcomes)
  samples = [types.Sample(prompt_ids=[1], output_ids=[3] * n, output_logprobs=np.full((n,), -0.5, np.float32),
                          token_versions=np.zeros((n,), np.int64), finish_reason=finish, server_url="x")
             for n in lengths]
  g = types.Group(index=index, example={"prompt_ids": [1], "index": index}, start_version=0, deadline=0,
                  samples=samples, consumed_version=0, sample_lags=[0] * len(samples))
  g.rewards = [float(o) for o in outcomes]
  return g


def test_verdict_judges_the_outcomes_spread_with_a_tolerance():
  assert ds.verdict([1, 1, 1], 1e-6) == "all_pass" and ds.verdict([0, 0], 1e-6) == "all_fail"
  assert ds.verdict([1, 0, 0], 1e-6) == "keep"
  assert ds.verdict([0.0, 1e-9], 1e-6) == "all_fail"  # within the tolerance: no spread
  assert ds.verdict([0.0, 1e-9], 0.0) == "keep"
  # float64: a spread float32 would round away is still seen.
  assert ds.verdict([1.0, 1.0 + 1e-7], 1e-9) == "keep"


def test_the_filter_counts_drops_by_kind_per_prompt_and_in_total():
  f = _filter()
  kept = [f.judge(_group(i, o)) for i, o in enumerate([[1, 0], [1, 1], [0, 0], [0, 0]])]
  assert kept == [True, False, False, False]
  f.judge(_group(2, [0, 0]))  # prompt 2 again (a later epoch)
  m = f.close_step()
  assert (m["dynamic_sampling/dropped_all_pass"], m["dynamic_sampling/dropped_all_fail"]) == (1, 3)
  assert m["dynamic_sampling/samples_per_kept_sample"] == 5.0 and m["dynamic_sampling/tokens_dropped_total"] == 16
  assert m["dynamic_sampling/prompt_drops_max"] == 2 and m["dynamic_sampling/prompts_dropped_1"] == 2
  assert m["dynamic_sampling/prompts_dropped_2"] == 1 and f.top_prompts(1) == [("2", 2)]
  assert f.close_step()["dynamic_sampling/dropped_all_fail"] == 0  # a new step's window
  assert f.close_step()["dynamic_sampling/dropped_total"] == 4  # totals carry on


def test_the_cap_stops_with_one_line_naming_the_field():
  f = _filter(max_drops_per_step=2)
  for i in range(3):
    f.judge(_group(i, [0, 0]))
  with pytest.raises(ds.DropCapExceeded, match=r"^rl\.dynamic_sampling\.max_drops_per_step=2: 3 groups dropped "
                                               r"while filling the batch of step 7 \(0 all-pass, 3 all-fail\)") as e:
    f.check_cap(7)
  assert "\n" not in str(e.value)
  assert "(20 = 10 x 2)" in ds.GroupFilter(ds.DynamicSamplingConfig(), batch_groups=2).cap_field


@pytest.mark.parametrize("section,field", [({"tolerance": -1.0}, "rl.dynamic_sampling.tolerance=-1.0"),
                                           ({"enabled": 1}, "rl.dynamic_sampling.enabled=1"),
                                           ({"max_drops_per_step": -1}, "rl.dynamic_sampling.max_drops_per_step=-1"),
                                           ({"tolerence": 0.1}, "rl.dynamic_sampling.tolerence=0.1: not a field")])
def test_bad_dynamic_sampling_fields_are_named(section, field):
  with pytest.raises(ValueError, match="invalid config: " + field.replace(".", r"\.")):
    ds.dynamic_sampling_config(section)


def test_bad_overlong_fields_are_named():
  with pytest.raises(ValueError, match=r"rl\.overlong\.cache_length=30: must be <= max_length \(24 = rl\.max_new"):
    overlong.shaping({"penalty": True, "cache_length": 30}, max_new_tokens=24)
  with pytest.raises(ValueError, match=r"rl\.overlong\.penalty='yes'"):
    overlong.shaping({"penalty": "yes"}, max_new_tokens=24)
  assert overlong.shaping({}, 24) is None
  assert overlong.shaping({"penalty": True}, 24) == overlong.Shaping(True, 24, 4, False)


def _dapo_reference(length: int, l_max: int, l_cache: int) -> float:
  """DAPO eq. 13, one response at a time, in Python floats (float64)."""
  if length <= l_max - l_cache:
    return 0.0
  if length <= l_max:
    return ((l_max - l_cache) - length) / l_cache
  return -1.0


@pytest.mark.parametrize("l_max,l_cache", [(24, 4), (20480, 4096), (10, 10), (7, 1)])
def test_length_penalty_is_dapos_formula(l_max, l_cache):
  lengths = sorted(set(range(0, l_max + 3)) | {l_max - l_cache, l_max - l_cache + 1, l_max, l_max + 1}
                   if l_max < 100 else {0, 16383, 16384, 16385, 18000, 20479, 20480, 20481, 30000})
  got = overlong.length_penalty(lengths, l_max, l_cache)
  assert got.dtype == np.float64
  np.testing.assert_array_equal(got, [_dapo_reference(n, l_max, l_cache) for n in lengths])
  assert got.max() <= 0.0 and got.min() >= -1.0


def test_shaping_adds_the_penalty_to_kept_rows_and_masks_truncated_ones():
  """The penalty counts generated tokens only (tool tokens excluded) and leaves the groups' outcomes alone; a
  truncated row keeps its reward (the group's statistics) and leaves the loss."""
  g = _group(0, [1, 0], lengths=[6, 8])
  g.samples[1].output_mask = np.asarray([1, 1, 0, 0, 0, 1, 1, 1], np.float32)  # 5 generated, 3 tool tokens
  g.samples[0].finish_reason = "length"
  shaping = overlong.Shaping(penalty=True, max_length=8, cache_length=4, mask_truncated=True)
  rows = batching.groups_to_batch([g], seq_len=12, pad_id=0, shaping=shaping)
  np.testing.assert_allclose(rows.rewards_B, [1.0 - 0.5, 0.0 - 0.25])  # lengths 6 and 5: (4 - n) / 4
  assert g.rewards == [1.0, 0.0]
  assert rows.mask_BxT[0].sum() == 0 and rows.valid_B[0] == 1 and rows.mask_BxT[1].sum() == 5
  m = group_metrics.batch_metrics([g], 1.0, shaping)
  assert m["reward/overlong_penalty_mean"] == pytest.approx(-0.375)
  assert m["response_length/truncated_fraction"] == 0.5 and m["reward/zero_spread_groups"] == 0.0


def test_a_shaped_score_never_decides_the_drop():
  """The phantom gradient: an all-fail group whose samples differ only by length would spread once shaped; the
  filter judges the outcomes, so it is dropped, whatever the penalty would have made of it."""
  g = _group(0, [0, 0], lengths=[4, 8])
  shaped = batching.groups_to_batch([g], seq_len=12, pad_id=0,
                                    shaping=overlong.Shaping(True, 8, 4, False)).rewards_B
  assert np.std(shaped) > 0.4  # normalised by its std, a full-size advantage
  assert not _filter().judge(g)


# -------------------------------------------------------------------------------------------- scheduler
def _outcomes(group):
  """A seeded coin per (prompt, sample): about half the groups of 2 do not spread."""
  rng = np.random.default_rng([7, group.index])
  group.rewards = [float(x) for x in rng.integers(0, 2, len(group.samples))]


async def _drive(sched, servers, rng, steps, k):
  out = []
  for v in range(steps):
    servers.version = v
    batch = await sched.next_batch(v)
    out.append(batch)
    if not batch:
      break
    await _yield(rng.randint(0, 30))
  return out


@settings(max_examples=25, deadline=None)
@given(batch_groups=st.integers(1, 3), k=st.integers(0, 3), seed=st.integers(0, 2**31), extra=st.integers(0, 5))
def test_scheduler_drops_lose_no_group_and_keep_the_lag_bound(batch_groups, k, seed, extra):
  rng, num_prompts = random.Random(seed), batch_groups * 6 + extra
  servers = SimulatedServers(rng)
  group_filter = ds.GroupFilter.from_section({"enabled": True, "max_drops_per_step": 1000}, batch_groups=batch_groups)

  async def run():
    sched = sched_lib.RolloutScheduler(servers.generate, _prompts(num_prompts), sampling_params={}, group_size=2,
                                       batch_groups=batch_groups, max_lag=k, on_complete=_outcomes,
                                       group_filter=group_filter)
    try:
      return await _drive(sched, servers, rng, num_prompts + 2, k), sched.stats
    finally:
      await sched.close()

  batches, stats = asyncio.run(run())
  consumed = [g.example["id"] for b in batches for g in b]
  dropped = [int(p) for p in group_filter.prompt_drops]
  assert sorted(consumed + dropped) == list(range(num_prompts))  # none lost, none consumed twice or both
  assert all(n == 1 for n in group_filter.prompt_drops.values())
  assert all(ds.verdict(g.rewards, 1e-6) == "keep" for b in batches for g in b)  # zero-advantage groups: 0
  assert all(0 <= lag <= k for b in batches for g in b for lag in g.sample_lags)
  assert all(len(b) == batch_groups for b in batches[:len(consumed) // batch_groups])
  assert stats.get("lag_violations", 0) == 0 and stats["groups_admitted"] == len(consumed) + len(dropped)
  assert group_filter.totals["groups_kept"] == len(consumed)


def test_scheduler_at_the_cap_fails_the_next_batch_with_the_filters_line():
  servers = SimulatedServers(random.Random(0))

  async def run():
    sched = sched_lib.RolloutScheduler(servers.generate, _prompts(50), sampling_params={}, group_size=2,
                                       batch_groups=2, max_lag=1, on_complete=lambda g: setattr(g, "rewards", [0, 0]),
                                       group_filter=_filter(max_drops_per_step=3))
    try:
      with pytest.raises(ds.DropCapExceeded, match=r"max_drops_per_step=3: 4 groups dropped .*step 0"):
        await sched.next_batch(0)
    finally:
      await sched.close()

  asyncio.run(run())


@pytest.mark.parametrize("with_filter", [False, True])
def test_scheduler_with_nothing_to_drop_equals_no_filter_and_resumes_its_counters(with_filter):
  """Every group spreads: the same batches as without a filter; its counters travel in state_dict."""
  def spread(group):
    group.rewards = [float(i % 2) for i in range(len(group.samples))]

  def run(group_filter):
    servers = SimulatedServers(random.Random(5))

    async def go():
      sched = sched_lib.RolloutScheduler(servers.generate, _prompts(20), sampling_params={}, group_size=2,
                                         batch_groups=2, max_lag=2, on_complete=spread, group_filter=group_filter)
      batches = await _drive(sched, servers, random.Random(6), 4, 2)
      state = json.loads(json.dumps(sched.state_dict()))
      await sched.close()
      return [[(g.index, g.sample_lags) for g in b] for b in batches], state
    return asyncio.run(go())

  off, _ = run(None)
  on, state = run(_filter() if with_filter else None)
  assert on == off
  if with_filter:
    restored = _filter()
    sched = sched_lib.RolloutScheduler(None, iter([]), sampling_params={}, group_size=2, batch_groups=2, max_lag=2,
                                       group_filter=restored)
    sched.load_state_dict(state)
    assert restored.totals["groups_kept"] >= 8 and restored.state_dict() == state["dynamic_sampling"]
