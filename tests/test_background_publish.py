"""The background publish: one at a time, versions while in flight, in the RL loop (order, refusal, close, time)."""
import asyncio
import random

import ml_collections
import pytest

from tests.test_scheduler import SimulatedServers, _prompts
from vcpo_jax.job import batching, train
from vcpo_jax.rollout import backend as backend_lib
from vcpo_jax.rollout.client import scheduler as sched_lib
from vcpo_jax.rollout.servers import background
from vcpo_jax.rollout.servers.publisher import PublishError


def test_background_publish_runs_one_at_a_time_and_raises_at_the_next_wait():
  async def run():
    pending, log = background.BackgroundPublish(), []

    async def publish(version, fail=False):
      log.append(("start", version))
      await asyncio.sleep(0.01)
      if fail:
        raise PublishError(f"v{version} refused")
      log.append(("done", version))

    pending.start(lambda: publish(1))
    with pytest.raises(RuntimeError, match="still pending"):
      pending.start(lambda: publish(2))
    assert pending.in_flight
    await pending.wait()
    assert pending.last_seconds > 0 and not pending.in_flight
    pending.start(lambda: publish(2, fail=True))
    with pytest.raises(PublishError, match="v2 refused"):
      await pending.wait()
    pending.start(lambda: publish(3))
    await asyncio.sleep(0)  # it has started
    await pending.cancel()  # shutdown: the pending publish is stopped, nothing raised
    await pending.wait()  # and forgotten
    return log

  assert asyncio.run(run()) == [("start", 1), ("done", 1), ("start", 2), ("start", 3)]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_groups_start_at_the_served_version_while_a_publish_is_in_flight(k):
  """The trainer publishes in the background: batch v is asked for before v is live. No group may be
  tagged newer than the servers' version, so the bound k still holds for every sample."""
  rng = random.Random(k)
  servers = SimulatedServers(rng)
  num_prompts, batch_groups = 24, 2

  async def run():
    sched = sched_lib.RolloutScheduler(servers.generate, _prompts(num_prompts), sampling_params={},
                                       group_size=2, batch_groups=batch_groups, max_lag=k)
    sched.set_served_version(0)
    publish, consumed = None, []

    async def land(v):  # the install takes a while; then every server serves v
      await asyncio.sleep(0)
      for _ in range(rng.randint(0, 40)):
        await asyncio.sleep(0)
      servers.version = v
      sched.set_served_version(v)

    try:
      for v in range(num_prompts // batch_groups):
        batch = await sched.next_batch(v)  # v may not be live yet
        for g in batch:
          assert g.start_version <= servers.version
        consumed += batch
        if publish is not None:
          await publish  # the previous publish first (versions in order)
        publish = asyncio.create_task(land(v + 1))  # v + 1 is published in the background
        for _ in range(rng.randint(0, 30)):  # the learner step
          await asyncio.sleep(0)
      await publish
    finally:
      await sched.close()
    return consumed, sched.stats

  consumed, stats = asyncio.run(run())
  assert len(consumed) == num_prompts and stats.get("lag_violations", 0) == 0 and stats["max_lag_seen"] <= k


# -- the RL loop ---------------------------------------------------------------------------------------------
class BackgroundBackend(backend_lib.RolloutBackend):
  """HttpBackend's publish pipeline (BackgroundPublish) over a publisher that refuses `refuse` or holds
  `hold` until released; the loop's view of it."""

  def __init__(self, refuse=None, hold=None):
    self.pending, self.refuse, self.hold = background.BackgroundPublish(), refuse, hold
    self.log, self.released, self.closed = [], asyncio.Event(), False

  async def start(self, version, params):
    self.log.append(("live", version))

  async def next_groups(self, version):
    return []

  async def _install(self, version):
    self.log.append(("start", version))
    if version == self.hold:
      await self.released.wait()
    await asyncio.sleep(0.01)
    if version == self.refuse:
      raise PublishError(f"v{version}: config.json intermediate_size=128, the served model has 64")
    self.log.append(("live", version))

  async def publish(self, version, params):
    await self.pending.wait()
    self.pending.start(lambda: self._install(version))

  async def wait_published(self):
    await self.pending.wait()

  def last_publish_seconds(self):
    return self.pending.last_seconds

  def stats(self):
    return {}

  async def close(self):
    await self.pending.cancel()
    self.closed = True


class Run:
  """RLRun's surface that rl_loop uses."""

  def __init__(self, steps):
    self.config = ml_collections.ConfigDict({"rl": {"steps": steps}})
    self.layout = batching.BatchLayout(seq_len=4, pad_id=0, num_rows=1)
    self.step, self.rollout_state, self.written = 0, {}, []

  def rollout_params(self):
    return None

  def learn(self, batch):
    return {"loss": 1.0}

  def after_step(self, groups, step_metrics, extra, seconds, rollout_state_fn):
    self.step += 1
    self.written.append((self.step, extra))


def test_background_publishes_go_live_in_order_and_the_last_before_close():
  run, backend = Run(steps=4), BackgroundBackend()
  asyncio.run(train.rl_loop(run, backend))
  assert backend.log == [("live", 0)] + [e for v in (1, 2, 3, 4) for e in (("start", v), ("live", v))]
  assert backend.closed and [s for s, _ in run.written] == [1, 2, 3, 4]
  for step, extra in run.written:
    assert extra["throughput/publish_blocked_seconds"] >= 0
    if step > 1:  # the previous publish's own duration (>= its 0.01 s sleep)
      assert extra["throughput/publish_seconds"] >= 0.01


@pytest.mark.parametrize("refuse,written", [(2, [1, 2, 3]), (4, [1, 2, 3, 4])])
def test_a_refused_background_publish_stops_the_job_after_the_steps_metrics(refuse, written):
  """v2 is refused while step 3 trains: step 3's metrics are written, then the job stops; the last version's
  refusal is awaited after the loop."""
  run, backend = Run(steps=4), BackgroundBackend(refuse=refuse)
  with pytest.raises(SystemExit) as stopped:
    train.run_rl_loop(_Made(run, backend))
  assert [s for s, _ in run.written] == written and backend.closed
  assert ("live", refuse) not in backend.log and ("start", refuse + 1) not in backend.log
  assert "intermediate_size=128" in str(stopped.value.code) and "\n" not in str(stopped.value.code)


class _Made:
  """A Run whose make_backend gives this backend (run_rl_loop's entry)."""

  def __init__(self, run, backend):
    self.run, self.backend = run, backend

  def make_backend(self):
    return self.backend

  def __getattr__(self, name):
    return getattr(self.run, name)


def test_close_during_an_in_flight_publish_cancels_it_cleanly():
  """The learner fails while v2 is still being installed: the loop's close cancels it without raising."""
  run, backend = Run(steps=5), BackgroundBackend(hold=2)

  def learn(batch):
    if run.step == 2:
      raise RuntimeError("learner failed")
    return {"loss": 1.0}

  run.learn = learn
  with pytest.raises(RuntimeError, match="learner failed"):
    asyncio.run(train.rl_loop(run, backend))
  assert backend.closed and ("start", 2) in backend.log and ("live", 2) not in backend.log
  assert not backend.pending.in_flight


def test_wallclock_counts_the_learners_wait_for_a_background_publish():
  from experiments.studies.wallclock import page as wallclock
  new = {"throughput/publish_seconds": {1: 9.0}, "throughput/publish_blocked_seconds": {1: 0.5}}
  assert wallclock._phase_series(new, "publish") == {1: 0.5}
  assert wallclock._phase_series({"throughput/publish_seconds": {1: 9.0}}, "publish") == {1: 9.0}  # older runs
  assert wallclock._phase_series(new, "wait") is None
