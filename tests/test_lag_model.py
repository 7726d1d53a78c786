"""Lag models of the emulator: the pipeline model against the real scheduler, its determinism and config errors;
the lag histogram metrics; the emulator sampling each group from its own version; the real http backend."""
import asyncio
import heapq
import time

import numpy as np
import pytest

from configs import tiny
from vcpo_jax.job import configuration
from vcpo_jax.rollout import group_metrics
from vcpo_jax.rollout.client.scheduler import RolloutScheduler
from vcpo_jax.rollout.emulation import emulator, lag_model


def _lags(model, steps):
  return [model.lags(t) for t in range(steps)]


def _model(k=3, B=4, n=2, seed=0, **options):
  return lag_model.make_lag_model("pipeline", max_lag=k, batch_groups=B, group_size=n, seed=seed, options=options)


def test_fixed_is_the_emulators_min_t_k_and_pipeline_is_deterministic_and_bounded():
  assert lag_model.make_lag_model("fixed", max_lag=2, batch_groups=4, group_size=2, seed=0) is None
  kw = dict(speed_ratio=0.5, server_rows=8)
  a, b = _lags(_model(**kw), 40), _lags(_model(**kw), 40)
  assert a == b                                     # the same seed, the same lags
  assert _lags(_model(seed=1, **kw), 40) != a       # durations are drawn from the seed
  for t, lags in enumerate(a):
    assert len(lags) == 4 and all(0 <= lag <= min(t, 3) for lag in lags)
  # Unbounded servers: every admitted group starts at once, so batch v holds exactly the groups admitted at
  # v - k (B per version) and the lags are those of the fixed model.
  assert _lags(_model(server_rows=0, speed_ratio=0.3), 30) == [[min(t, 3)] * 4 for t in range(30)]


def test_slower_generation_gives_fresher_samples():
  means = [np.mean(sum(_lags(_model(k=4, B=8, n=4, speed_ratio=r, server_rows=32), 200), []))
           for r in (0.3, 0.7, 1.0, 3.0)]
  assert means == sorted(means) and means[0] < 2.5 and means[-1] > 3.9


def test_pipeline_model_matches_the_real_scheduler_driven_by_the_same_durations():
  """The model's event simulation and RolloutScheduler in a virtual-time event loop give the same lags when
  groups take the same (model-drawn) times, the servers run `concurrency` groups at once, a learner step takes
  one time unit and each group's version is the one published when its generation starts."""
  k, B, n, steps = 2, 3, 2, 25
  model = _model(k=k, B=B, n=n, seed=3, speed_ratio=0.8, server_rows=4, duration_cv=0.7)
  want = _lags(model, steps)
  durations = iter(np.random.default_rng([3, 0x1A6]).gamma(1 / 0.7**2, model.mean_duration * 0.7**2, 10_000))
  clock = {"now": 0.0, "published": 0}

  async def main():
    loop = asyncio.get_running_loop()
    loop.time = lambda: clock["now"]  # virtual time: sleeps complete in order of their virtual deadlines
    slots = asyncio.Semaphore(model.concurrency)
    timers = []

    async def vsleep(dt):
      fut = loop.create_future()
      heapq.heappush(timers, (clock["now"] + dt, id(fut), fut))
      await fut

    async def generate(prompt_ids, params, n):
      duration = next(durations)
      async with slots:
        version = clock["published"]
        await vsleep(duration)
      return [type("S", (), {"token_versions": np.full(3, version, np.int64), "output_mask": None})()] * n

    async def ticker():
      # Bounded in real time (the loop's own clock is virtual here, so asyncio timeouts cannot bound it).
      deadline = time.monotonic() + 300
      while time.monotonic() < deadline:
        await asyncio.sleep(0)
        for _ in range(50):
          await asyncio.sleep(0)
        if timers:
          clock["now"], _, fut = heapq.heappop(timers)
          fut.set_result(None)
      raise AssertionError(f"timed out after 300 s (real time) waiting for {steps} batches from the scheduler")

    async def learner():
      got = []
      for v in range(steps):
        clock["published"] = v
        batch = await sched.next_batch(v)
        got.append([g.sample_lags[0] for g in batch])
        await vsleep(1.0)   # the learner step
      return got

    prompts = ({"prompt_ids": [1, 2]} for _ in range(10_000))
    sched = RolloutScheduler(generate, prompts, sampling_params={}, group_size=n, batch_groups=B, max_lag=k)
    tick, body = asyncio.create_task(ticker()), asyncio.create_task(learner())
    done, _ = await asyncio.wait({tick, body}, return_when=asyncio.FIRST_COMPLETED)
    if body not in done:
      body.cancel()
      tick.result()  # the ticker's timeout
    tick.cancel()
    await sched.close()
    return body.result()

  got = asyncio.run(main())
  assert [sorted(x) for x in got] == [sorted(x) for x in want]


def test_histogram_metrics_and_distance():
  groups = [type("G", (), {"sample_lags": [0, 2]})(), type("G", (), {"sample_lags": [2, 1]})()]
  assert group_metrics.lag_metrics(groups, 2) == {"lag/frac_0": 0.25, "lag/frac_1": 0.25, "lag/frac_2": 0.5}
  assert group_metrics.lag_metrics([], 2) == {}
  assert lag_model.total_variation(np.array([1.0, 0.0]), np.array([0.25, 0.75])) == 0.75


def test_emulator_samples_each_group_from_its_version():
  model = _model(k=2, B=3, n=2, seed=0, speed_ratio=0.4, server_rows=2)
  calls = []

  def generate(params, prompts, seeds):
    calls.append((params, len(prompts)))
    return [type("R", (), {"output_ids": [5, 6], "logprobs": [-1.0, -1.0], "finish_reason": "stop"})()
            for _ in prompts]

  em = emulator.LagEmulator(generate, max_lag=2, group_size=2, seed=0, lag_model=model)
  examples = [{"prompt_ids": [1, 2], "index": i} for i in range(3)]
  for v in range(12):
    em.push(v, f"params{v}")
    calls.clear()
    groups = em.rollout(v, examples)
    lags = model.lags(v)
    assert [g.sample_lags for g in groups] == [[lag, lag] for lag in lags]
    assert [g.start_version for g in groups] == [v - lag for lag in lags]
    assert sorted(p for p, _ in calls) == sorted({f"params{v - lag}" for lag in lags})  # one call per version


@pytest.mark.parametrize("field,value,match", [
    ("lag_model", "poisson", "rl.emulation.lag_model='poisson'"),
    ("speed_ratio", 0.0, "rl.emulation.speed_ratio=0.0"),
    ("duration_cv", -1.0, "rl.emulation.duration_cv=-1.0"),
    ("server_rows", -2, "rl.emulation.server_rows=-2"),
])
def test_invalid_emulation_fields_are_errors_naming_field_and_value(field, value, match):
  c = tiny.get_config("emulate")
  c.rl.emulation[field] = value
  with pytest.raises(ValueError, match=match.replace(".", r"\.").replace("(", r"\(")):
    configuration.validate_config(c)
  if field != "lag_model":
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
      lag_model.PipelineOptions(**{field: value})


@pytest.mark.integration
@pytest.mark.slow
def test_pipeline_model_against_the_real_http_backend(tmp_path):
  """configs/tiny.py over the http backend with an embedded server (k=2, 5 steps): the comparison of its
  per-sample lag histogram with the pipeline model's runs end to end on real lags. How close the two are is a
  measurement, not a property of the code: it moves with the machine's load (20 samples; a fitted distance of
  0.4 was seen with the suite's other worker running, <= 0.25 alone), so it is reported by
  `python -m benchmarks.cpu.lag_model_validation` (docs/results/lag_model.md), not asserted here."""
  from benchmarks.cpu import lag_model_validation as v
  record, config = v.real_run(steps=5, max_lag=2, workdir=str(tmp_path))
  result = v.compare(record, config)
  assert result["samples"] == 5 * config.rl.prompts_per_step * config.rl.group_size
  assert all(lag <= 2 for step in result["lags_real_by_step"] for lag in step)
  assert abs(sum(result["hist_real"]) - 1) < 1e-9 and abs(sum(result["hist_pipeline"]) - 1) < 1e-9
  assert 0 <= result["tv_pipeline"] <= 1 and 0 <= result["tv_fixed"] <= 1
  assert result["tv_pipeline_fitted"] <= result["tv_pipeline"]  # the fitted fraction is the grid's best
