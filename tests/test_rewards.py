"""The reward pool: rewards and tool calls off the event loop, a timeout per call, every failure counted by kind."""
import asyncio
import math
import os
import signal
import time

import numpy as np
import pytest

from vcpo_jax import tasks
from vcpo_jax.model.tokenizer import build_tokenizer
from vcpo_jax.calls import offload
from vcpo_jax.rollout import rewards, types


# Module-level so a worker process can import them by reference.
def double(x):
  return 2 * x


def fail(x):
  raise ZeroDivisionError(f"cannot score {x}")


def sleep_then(x, seconds):
  time.sleep(seconds)
  return x


def spin(x):
  while True:
    pass


def die(x):
  os._exit(3)


def chatty(x):
  print("a reward that prints", x)  # must not corrupt the worker's reply stream
  return x + 1


def alarm_guarded(x):
  """What math-verify does: a SIGALRM timeout, which Python allows only in a process's main thread."""
  signal.signal(signal.SIGALRM, lambda *_: None)
  signal.alarm(0)
  return x


def length_reward(example, text):
  return float(len(text) == example["want"])


def bad_values(example, text):
  return {"nan": float("nan"), "str": "1.0", "inf": math.inf, "ok": 0.5}[text]


async def _gather_while_ticking(*calls):
  """The calls' outcomes and how often a 10 ms ticker on the same event loop ran meanwhile."""
  ticks = 0

  async def ticker():
    nonlocal ticks
    while True:
      await asyncio.sleep(0.01)
      ticks += 1

  t = asyncio.create_task(ticker())
  outcomes = await asyncio.gather(*calls)
  t.cancel()
  return outcomes, ticks


def test_inline_and_thread_pools_return_values_and_count_exceptions():
  for kind in ("inline", "thread"):
    pool = offload.CallPool(kind, workers=2, timeout_s=5)
    assert pool.call_blocking(double, 21) == offload.Outcome(value=42)
    bad = pool.call_blocking(fail, 7)
    assert bad.error == "exception" and "ZeroDivisionError: cannot score 7" in bad.detail
    assert asyncio.run(pool.call(double, 2)).value == 4
    assert pool.stats == {"calls": 3, "errors/timeout": 0, "errors/exception": 1, "errors/crash": 0}
    pool.close()


def test_a_thread_call_past_its_timeout_is_a_counted_timeout_and_the_loop_runs_on():
  pool = offload.CallPool("thread", workers=2, timeout_s=0.3)

  (slow, fast), ticks = asyncio.run(_gather_while_ticking(pool.call(sleep_then, 1, 1.0), pool.call(double, 5)))
  assert slow.error == "timeout" and fast.value == 10
  assert ticks >= 5  # a call computed on the event loop would have held every tick for its whole duration
  assert pool.stats["errors/timeout"] == 1
  pool.close()


@pytest.mark.parametrize("kind,workers,timeout_s", [("pool", 2, 1.0), ("thread", 0, 1.0), ("thread", 2, 0),
                                                    ("thread", 2, True)])
def test_bad_pool_settings_name_the_field(kind, workers, timeout_s):
  with pytest.raises(ValueError, match=r"reward\.(pool|workers|timeout_s)"):
    offload.CallPool(kind, workers=workers, timeout_s=timeout_s, name="reward")


@pytest.mark.integration
def test_process_pool_contains_hangs_crashes_and_exceptions_and_replaces_workers():
  pool = offload.CallPool("process", workers=2, timeout_s=1.0)
  try:
    assert pool.call_blocking(double, 4).value == 8
    assert pool.call_blocking(chatty, 1).value == 2
    assert pool.call_blocking(alarm_guarded, 3).value == 3  # signals work: the call runs in a main thread
    assert pool.call_blocking(fail, 1).error == "exception"
    hung = pool.call_blocking(spin, 1)
    assert hung.error == "timeout" and "worker replaced" in hung.detail
    assert pool.call_blocking(die, 1).error == "crash"
    # Every worker still answers after its neighbours were killed.
    assert [o.value for o in pool.map_blocking(double, [(i,) for i in range(6)])] == [0, 2, 4, 6, 8, 10]
    assert pool.stats == {"calls": 12, "errors/timeout": 1, "errors/exception": 1, "errors/crash": 1}
    unsendable = pool.call_blocking(double, lambda: 1)  # arguments travel pickled
    assert unsendable.error == "exception" and "cannot send" in unsendable.detail
  finally:
    pool.close()


@pytest.mark.integration
def test_process_pool_keeps_the_event_loop_free_while_a_call_hangs():
  pool = offload.CallPool("process", workers=2, timeout_s=1.0)

  try:
    (hung, fine), ticks = asyncio.run(_gather_while_ticking(pool.call(spin, 0), pool.call(sleep_then, 7, 0.2)))
  finally:
    pool.close()
  assert hung.error == "timeout" and fine.value == 7 and ticks >= 5


def _group(outputs, example):
  samples = [types.Sample(prompt_ids=[1], output_ids=ids, output_logprobs=np.zeros(len(ids), np.float32),
                          token_versions=np.zeros(len(ids), np.int64), finish_reason="stop", server_url="")
             for ids in outputs]
  return types.Group(index=0, example=example, start_version=0, deadline=0, samples=samples)


def test_rewarder_scores_a_group_and_counts_bad_values_as_errors():
  rewarder = rewards.inline(length_reward, decode=lambda ids: "x" * len(ids))
  group = asyncio.run(rewarder.score_group(_group([[1, 2], [1, 2, 3]], {"want": 3})))
  assert group.rewards == [0.0, 1.0] and group.completions == ["xx", "xxx"]
  words = {1: "nan", 2: "str", 3: "inf", 4: "ok"}
  bad = rewards.inline(bad_values, decode=lambda ids: words[ids[0]])
  assert bad.score_blocking([{}] * 4, [[1], [2], [3], [4]]) == [0.0, 0.0, 0.0, 0.5]
  assert bad.stats()["reward/errors/bad_value"] == 3 and bad.stats()["reward/calls"] == 4


def test_rewarder_for_task_takes_the_reward_section_and_names_a_bad_field():
  tok, task = build_tokenizer(), tasks.get_task("countdown", num_numbers=2, max_number=25)
  ex = task.eval_set(1, seed=0)[0]
  rewarder = rewards.Rewarder.for_task(task, tok, rewards.reward_config({"pool": "thread", "workers": 1}))
  try:
    ids = tok.encode(task.reference_solution(ex))
    assert rewarder.score_blocking([ex, ex], [ids, tok.encode("<answer>0</answer>")]) == [1.0, 0.0]
  finally:
    rewarder.close()
  with pytest.raises(TypeError, match="must be a RewardConfig"):
    rewards.Rewarder.for_task(task, tok, {"workers": 1})  # a plain dict would skip the section's checks
  with pytest.raises(ValueError, match=r"reward\.pool='process' needs a picklable reward function"):
    rewards.Rewarder(lambda e, t: 1.0, str, offload.CallPool("process", workers=1))


@pytest.mark.integration
def test_a_dataset_tasks_verifiers_score_in_worker_processes(tmp_path):
  """The dataset task's reward is one picklable function: math-verify runs in a process pool's workers."""
  import json
  rows = [{"prompt": [{"role": "user", "content": "1/2 + 1/4?"}], "data_source": "m",
           "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"}, "extra_info": {}},
          {"prompt": [{"role": "user", "content": "2 + 2?"}], "data_source": "g",
           "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {}}]
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  task = tasks.get_task("dataset", train_files=str(path), eval_files=str(path), verifier="math",
                        verifier_by_source="g=gsm8k")
  ex_m, ex_g = task.eval_set(2)
  rewarder = rewards.Rewarder(task.reward_function(), "".join,
                              offload.CallPool("process", workers=1, timeout_s=30,
                                               initializer=task.reward_initializer()))
  try:
    got = rewarder.score_blocking([ex_m, ex_m, ex_g, ex_g],
                                  ["so \\boxed{0.75}", "\\boxed{2/3}", "#### 4", "#### 5"])
  finally:
    rewarder.close()
  assert got == [1.0, 0.0, 1.0, 0.0]
  assert rewarder.stats()["reward/calls"] == 4 and rewarder.stats()["reward/errors/exception"] == 0
