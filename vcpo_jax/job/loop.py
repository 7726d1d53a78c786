"""The RL loop over a train.RLRun: batches from the rollout backend, the learner step beside it, publishes."""
from __future__ import annotations

import asyncio
import logging
import time

from vcpo_jax.job import batching
from vcpo_jax.rollout import backend as backend_lib, dynamic_sampling
from vcpo_jax.rollout.servers.publisher import PublishError


async def rl_loop(run, rollouts: backend_lib.RolloutBackend) -> None:
  """Learner version v trains on groups the backend generated within the staleness bound, then publishes v+1.
  The step runs in a worker thread so an asynchronous backend keeps generating (and scoring) meanwhile."""
  try:
    if run.rollout_state:
      rollouts.load_state_dict(run.rollout_state)
    await rollouts.start(run.step, run.rollout_params())
    while run.step < run.config.rl.steps:
      t0 = time.perf_counter()
      groups, batch = await batching.next_batch(rollouts, run.step, run.layout)
      t1, cpu1 = time.perf_counter(), time.thread_time()
      step_metrics = await asyncio.to_thread(run.learn, batch)
      # This coroutine runs on the event loop's thread, so its thread CPU time over the update is the loop's
      # work meanwhile (rollout client, scheduler; not a reward pool's threads or processes): with the learner
      # pinned to a core, that work competes with it.
      t2, loop_cpu = time.perf_counter(), time.thread_time() - cpu1
      refused = None
      try:  # may return before the version is live: the export and the install then overlap the next step
        await rollouts.publish(run.step + 1, run.rollout_params())
      except PublishError as e:  # the step is done: its metrics (with the refusal counter) are written first
        refused = e
      t3 = time.perf_counter()
      # Where the step's time went: waiting for rollouts is what asynchrony can hide behind the update.
      # publish_blocked: the learner's wait (the previous publish, the copy); publish: the latest publish's own
      # duration, which a background publish spends beside the next step.
      own = rollouts.last_publish_seconds()
      phases = {"throughput/wait_seconds": t1 - t0, "throughput/learn_seconds": t2 - t1,
                "throughput/publish_blocked_seconds": t3 - t2,
                "throughput/publish_seconds": t3 - t2 if own is None else own,
                "throughput/learn_loop_cpu_seconds": loop_cpu}
      run.after_step(groups, step_metrics, {**rollouts.stats(), **phases}, t3 - t0, rollouts.state_dict)
      if refused is not None:
        raise refused
    await rollouts.wait_published()  # the last version is live (or its refusal ends the job) before close
  finally:
    await rollouts.close()


def run_rl_loop(run) -> None:
  """Runs rl_loop; a refused weight update ends the job with one line (the field or tensor, both values), as
  does dynamic sampling past its cap."""
  try:
    asyncio.run(rl_loop(run, run.make_backend()))
  except dynamic_sampling.DropCapExceeded as e:
    logging.error("dynamic sampling stopped the job after step %d: %s", run.step, e)
    raise SystemExit(f"error: {e}") from None
  except PublishError as e:
    reason = " ".join(str(e).split())
    logging.error("weight update refused after step %d: %s", run.step, reason)
    raise SystemExit(f"error: weight update refused after step {run.step}: {reason}") from None
