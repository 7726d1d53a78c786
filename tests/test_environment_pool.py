"""Environment calls in the tools pool, off the event loop: a slow tool, a timed-out call, a failing reward."""
import asyncio
import threading

from tests.scripted_policy import ScriptedPolicy
from test_environment import C, END, PROMPT, _replies, _runner
from vcpo_jax.calls import offload
from vcpo_jax.rollout import group_metrics, types
from vcpo_jax.tasks.environments import base as environment, tool_calls


class Blocker(environment.Environment):
  """`hold` blocks its thread until the test releases it (a slow tool without a timing assumption)."""
  started, release = threading.Event(), threading.Event()

  def hold(self) -> str:
    """Blocks."""
    Blocker.started.set()
    Blocker.release.wait(30)
    return "released"

  def quick(self) -> str:
    """Answers at once."""
    return "quick"


def test_a_slow_tool_does_not_hold_up_other_episodes_or_a_publish():
  Blocker.started.clear()
  Blocker.release.clear()
  env = environment.EnvironmentFactory(Blocker, max_turns=4)
  pool = offload.CallPool("thread", workers=4, timeout_s=60, name="tools")
  runner = _runner(env, pool)

  async def run():
    slow = asyncio.create_task(runner.run(ScriptedPolicy([C("hold"), "<answer>1</answer>" + END]), PROMPT,
                                          {"max_new_tokens": 1}))
    while not Blocker.started.is_set():
      await asyncio.sleep(0.001)
    published = []

    async def publish():
      for _ in range(5):
        await asyncio.sleep(0.001)  # awaited I/O of an export and an HTTP update
      published.append(True)

    others = [runner.run(ScriptedPolicy([C("quick"), C("quick"), "<answer>2</answer>" + END], delay=0.001),
                         PROMPT, {"max_new_tokens": 1}) for _ in range(6)]
    done = await asyncio.gather(publish(), *others)
    still_running = not slow.done() and not Blocker.release.is_set()
    Blocker.release.set()
    return still_running, published, done[1:], await slow

  try:
    still_running, published, others, slow = asyncio.run(run())
  finally:
    Blocker.release.set()
    pool.close()
  assert still_running and published == [True]  # everything else finished while the slow call ran
  assert all(_replies(ep.to_sample(PROMPT)) == ["quick", "quick"] and ep.turns == 3 for ep in others)
  assert _replies(slow.to_sample(PROMPT)) == ["released"]


def test_a_timed_out_call_is_a_counted_error_reply_and_the_episode_goes_on():
  Blocker.started.clear()
  Blocker.release.clear()
  env = environment.EnvironmentFactory(Blocker, max_turns=4)
  pool = offload.CallPool("thread", workers=2, timeout_s=0.2, name="tools")
  try:
    (s,) = asyncio.run(_runner(env, pool).generate(
        ScriptedPolicy([C("hold"), C("quick"), "<answer>1</answer>" + END]), PROMPT, {"max_new_tokens": 1}))
    assert Blocker.started.is_set() and not Blocker.release.is_set()  # the tool was still blocked
  finally:
    Blocker.release.set()
    pool.close()
  assert _replies(s) == [tool_calls.ERROR_KINDS["timeout"], "quick"]
  assert (s.num_turns, s.tool_calls, s.tool_errors, s.tool_error_kinds) == (3, 2, 1, {"timeout": 1})
  assert pool.stats["errors/timeout"] == 1
  metrics = group_metrics.episode_metrics([types.Group(0, {}, 0, 0, samples=[s])])
  assert metrics["tools/errors/timeout"] == 1 and metrics["tools/errors/reward"] == 0


def test_a_failing_episode_reward_scores_zero_and_is_counted():
  class BadReward(environment.Environment):
    def ping(self) -> str:
      """Answers pong."""
      return "pong"

    def reward(self, completion):
      return float("nan") if "nan" in completion else 1 / 0

  env = environment.EnvironmentFactory(BadReward)
  for answer in ("nan", "x"):
    (s,) = asyncio.run(_runner(env).generate(ScriptedPolicy([answer + END]), PROMPT, {"max_new_tokens": 1}))
    assert s.env_reward == 0.0 and s.tool_error_kinds == {"reward": 1}
