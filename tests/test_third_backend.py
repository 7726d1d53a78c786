"""A test-only third rollout backend, registered by name, drives the RL loop; its rewards are the ones used."""
import asyncio
import time

import numpy as np
import pytest

from test_train import _jsonl, tiny_config
from vcpo_jax import tasks
from vcpo_jax.job import train
from vcpo_jax.model import config as model_config
from vcpo_jax.rollout import backend, types


class FixedBackend(backend.RolloutBackend):
  """A test double behind the seam: every step, the next prompts with the same made-up, pre-scored outputs."""

  def __init__(self, ctx, groups_per_step, group_size, rewards):
    self.ctx, self.groups_per_step, self.group_size, self.rewards = ctx, groups_per_step, group_size, rewards
    self.calls, self.served = [], 0
    self.ticks, self.ticks_at = 0, {}  # event-loop turns of a background task, seen at each call
    self.busy, self.busy_at = 0.0, {}  # the CPU seconds those turns spent, seen at each call

  async def _tick(self):  # stands in for the client's work on the event loop (parsing responses, scheduling)
    while True:
      self.ticks += 1
      start = time.thread_time()
      while time.thread_time() - start < 0.002:
        pass
      self.busy += time.thread_time() - start
      await asyncio.sleep(0.005)

  async def start(self, version, params):
    self.calls.append(("start", version))
    self._ticker = asyncio.create_task(self._tick())

  async def next_groups(self, version):
    groups = []
    for _ in range(self.groups_per_step):
      example = next(self.ctx.prompts)
      samples = [types.Sample(prompt_ids=list(example["prompt_ids"]), output_ids=[5, 6, 7],
                              output_logprobs=np.full((3,), -1.0, np.float32),
                              token_versions=np.full((3,), version, np.int64), finish_reason="length",
                              server_url="fixed") for _ in range(self.group_size)]
      groups.append(types.Group(index=example["index"], example=example, start_version=version, deadline=version,
                                samples=samples, consumed_version=version, sample_lags=[0] * self.group_size,
                                rewards=list(self.rewards), completions=[""] * self.group_size))
    self.served += len(groups)
    self.calls.append(("next_groups", version))
    self.ticks_at[("next_groups", version)] = self.ticks
    self.busy_at[("next_groups", version)] = self.busy
    return groups

  async def publish(self, version, params):
    self.calls.append(("publish", version))
    self.ticks_at[("publish", version)] = self.ticks
    self.busy_at[("publish", version)] = self.busy

  def stats(self):
    return {"rollout/fixed_groups_served": float(self.served)}

  def state_dict(self):
    return {"served": self.served}

  async def close(self):
    self._ticker.cancel()
    self.calls.append(("close",))


@tasks.register_task
class CountingCountdown(tasks.Countdown):
  """A test-only task, registered like any other: the real Countdown, counting reward calls."""
  name = "test_counting_countdown"
  reward_calls = 0

  def reward(self, example, text):
    type(self).reward_calls += 1
    return super().reward(example, text)


BUILT: list = []  # the FixedBackend instances the registry built (the test inspects them)


@backend.BACKENDS.register("test_fixed", host_params=True)
def _fixed_backend(config, ctx):
  """A test-only backend, registered like any other: one module (here, a class above) plus this line."""
  BUILT.append(FixedBackend(ctx, config.rl.prompts_per_step, config.rl.group_size, [0.25, 0.75]))
  return BUILT[-1]


def test_a_third_backend_drives_the_loop_and_its_rewards_are_used(tmp_path):
  """The seam: a backend train.py has never heard of runs the whole loop (publish, stats, checkpoint state),
  the learner trains on the rewards the backend scored (the loop itself never calls task.reward), and the
  backend's event-loop work goes on while the learner step runs (the async overlap)."""
  import jax
  from vcpo_jax.job import checkpointing, configuration
  from vcpo_jax.model import hf_export
  from vcpo_jax.model import tokenizer
  from vcpo_jax.model import transformer as model_lib
  from vcpo_jax.rollout.rewards import Rewarder
  # Both chosen by name from the config, as a user would: the registries are the only seams.
  config = tiny_config(**{"rl.steps": 2, "eval_every": 100, "rl.mode": "test_fixed"})
  config.task.name = CountingCountdown.name
  config.task.options[CountingCountdown.name] = dict(config.task.options.countdown)
  configuration.validate_config(config)
  cfg = model_config.ModelConfig.from_dict(config.model)
  tok = tokenizer.build_tokenizer()
  base_dir = hf_export.export_hf(model_lib.init_params(cfg, jax.random.PRNGKey(0)), cfg, str(tmp_path / "base"), tok)
  task = configuration.build_task(config)
  assert isinstance(task, CountingCountdown)
  CountingCountdown.reward_calls = 0
  eval_examples = task.eval_set(config.task.eval_size, seed=config.seed)
  rewarder = Rewarder.for_task(task, tok, configuration.reward_config(config))
  run = train.RLRun(config, str(tmp_path), cfg, tok, task, base_dir, eval_examples,
                    {"eval/greedy_accuracy": 0.0, "eval/sampled_accuracy": 0.0}, rewarder)
  rewards = [0.25, 0.75]  # no countdown verifier gives these
  try:
    asyncio.run(train.rl_loop(run, run.make_backend()))
  finally:
    run.close()
    rewarder.close()
  rollouts = BUILT[-1]
  assert rollouts.ctx.task is task  # the backend's context carries the task
  assert rollouts.calls == [("start", 0), ("next_groups", 0), ("publish", 1), ("next_groups", 1), ("publish", 2),
                            ("close",)]
  # The first step compiles for seconds: a learner blocking the event loop would leave the ticker still.
  assert rollouts.ticks_at[("publish", 1)] - rollouts.ticks_at[("next_groups", 0)] >= 10
  scalars = _jsonl(tmp_path / "metrics.jsonl")
  assert [s["step"] for s in scalars] == [1, 2]
  # The loop's CPU during each update is the background work it did meanwhile, not the learner's compile.
  for step, s in enumerate(scalars):
    busy = rollouts.busy_at[("publish", step + 1)] - rollouts.busy_at[("next_groups", step)]
    assert busy - 0.02 <= s["throughput/learn_loop_cpu_seconds"] <= busy + 0.25
  for s in scalars:
    assert s["reward/mean"] == pytest.approx(np.mean(rewards))
  assert scalars[-1]["rollout/fixed_groups_served"] == 2 * config.rl.prompts_per_step
  # Only the final evaluation scored anything (greedy + sampled over the eval set): not the learner path.
  assert CountingCountdown.reward_calls == 2 * len(eval_examples)
  ckpt = checkpointing.Checkpointer(str(tmp_path / "checkpoints"))
  _, _, host = ckpt.restore(checkpointing.abstract_like(run.state))
  ckpt.close()
  assert host["rollout"] == {"served": 2 * config.rl.prompts_per_step}
