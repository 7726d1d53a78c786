"""Verifiable tasks (Countdown, arithmetic, both with tools, the user's files) and tool environments, registered
by name."""
from __future__ import annotations

import dataclasses

# Each built-in task and environment module registers its class (base.register_task,
# environment.register_environment) when imported here.
from vcpo_jax.tasks.environments.calculator import Calculator
from vcpo_jax.tasks.arithmetic import Arithmetic
from vcpo_jax.tasks.arithmetic_code import ArithmeticCode
from vcpo_jax.tasks.base import TASKS, Example, GeneratedTask, SPLITS, Task, extract_answer, register_task
from vcpo_jax.tasks.countdown import Countdown, countdown_reward
from vcpo_jax.tasks.countdown_tools import CountdownTools
from vcpo_jax.tasks.dataset import Dataset
from vcpo_jax.tasks.environments.base import ENVIRONMENTS, Environment, register_environment
from vcpo_jax.tasks.environments.python_tool import PythonTool
from vcpo_jax.tasks.environments.tool_calls import ToolError


def get_task(name: str, *, render_prompt=None, tool_pool=None, **options) -> Task:
  """The task `name` built with `options`; unknown names or options raise ValueError listing the known ones.
  render_prompt (user text -> prompt text, e.g. a pretrained Tokenizer.chat_prompt) replaces the default
  chat format; tool_pool (a calls.offload.CallPool) runs an environment's calls (None: inline)."""
  if name not in TASKS:
    raise ValueError(f"unknown task name {name!r}; known: {TASKS.names()}")
  entry = TASKS.get(name)
  kwargs = dataclasses.asdict(entry.make_options(options))
  if tool_pool is not None:
    kwargs["tool_pool"] = tool_pool
  task = entry.fn(**kwargs)
  return task if render_prompt is None else task.use_chat_template(render_prompt)


def sft_completion(example: Example, rng, error_rate: float) -> str:
  """Supervised target for `example`: correct, or with probability error_rate a plausible wrong answer."""
  return get_task(example["task"]).sft_completion(example, rng, error_rate)


def reward(example: Example, completion: str) -> float:
  """Reward of `completion` for `example` (reward only reads the example's own fields, not task knobs)."""
  return get_task(example["task"]).reward(example, completion)


__all__ = ["Arithmetic", "ArithmeticCode", "Calculator", "Countdown", "CountdownTools", "Dataset", "ENVIRONMENTS",
           "Environment", "Example", "GeneratedTask", "PythonTool", "SPLITS", "TASKS", "Task", "ToolError",
           "countdown_reward", "extract_answer", "get_task", "register_environment", "register_task", "reward",
           "sft_completion"]
