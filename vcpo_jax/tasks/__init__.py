"""Verifiable tasks (Countdown, arithmetic, Countdown with a calculator tool) registered by name."""
from __future__ import annotations

import inspect

from vcpo_jax.tasks.arithmetic import Arithmetic
from vcpo_jax.tasks.base import Example, SPLITS, Task, extract_answer
from vcpo_jax.tasks.countdown import Countdown, countdown_reward
from vcpo_jax.tasks.countdown_tools import CountdownTools

TASKS: dict[str, type[Task]] = {Countdown.name: Countdown, Arithmetic.name: Arithmetic,
                                CountdownTools.name: CountdownTools}


def get_task(name: str, *, render_prompt=None, **knobs) -> Task:
  """The task `name` built with `knobs`; unknown names or knobs raise ValueError listing the options.
  render_prompt (user text -> prompt text, e.g. a pretrained Tokenizer.chat_prompt) replaces the default
  chat format."""
  if name not in TASKS:
    raise ValueError(f"unknown task name {name!r}; known: {sorted(TASKS)}")
  cls = TASKS[name]
  allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
  for knob in knobs:
    if knob not in allowed:
      raise ValueError(f"unknown knob {knob!r} for task {name!r}; known: {allowed}")
  task = cls(**knobs)
  return task if render_prompt is None else task.use_chat_template(render_prompt)


def sft_completion(example: Example, rng, error_rate: float) -> str:
  """Supervised target for `example`: correct, or with probability error_rate a plausible wrong answer."""
  return get_task(example["task"]).sft_completion(example, rng, error_rate)


def reward(example: Example, completion: str) -> float:
  """Reward of `completion` for `example` (reward only reads the example's own fields, not task knobs)."""
  return get_task(example["task"]).reward(example, completion)


__all__ = ["Arithmetic", "Countdown", "CountdownTools", "Example", "SPLITS", "TASKS", "Task", "countdown_reward",
           "extract_answer", "get_task", "reward", "sft_completion"]
