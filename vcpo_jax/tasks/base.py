"""Task base class: seeded sampling, hash-based train/eval split, answer extraction."""
from __future__ import annotations

import abc
import hashlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from vcpo_jax import registry
from vcpo_jax.model import tokenizer as tokenizer_lib
from vcpo_jax.tasks.environments import base as environment_lib

SPLITS = ("train", "eval")
_HASH_BUCKETS = 1 << 20
_MAX_TRIES_PER_EXAMPLE = 10_000
# A boxed answer longer than this is treated as unclosed: bounds the scan on adversarial "\\boxed{" spam.
MAX_BOXED_CHARS = 1024

Example = dict[str, Any]
RngLike = int | Sequence[int] | np.random.Generator


def as_rng(rng_or_seed: RngLike) -> np.random.Generator:
  """A numpy Generator from a Generator, an int seed or a sequence of ints (e.g. (seed, index))."""
  if isinstance(rng_or_seed, np.random.Generator):
    return rng_or_seed
  if isinstance(rng_or_seed, (bool, float)) or rng_or_seed is None:
    raise ValueError(f"rng_or_seed must be a Generator, an int or a sequence of ints, got {rng_or_seed!r}")
  return np.random.default_rng(rng_or_seed)


def split_of_key(key: str, eval_fraction: float) -> str:
  """'eval' for a fixed pseudo-random fraction of canonical problem keys, else 'train'."""
  digest = hashlib.sha256(key.encode()).digest()
  bucket = int.from_bytes(digest[:8], "little") % _HASH_BUCKETS
  return "eval" if bucket < eval_fraction * _HASH_BUCKETS else "train"


def extract_answer(text: str) -> str | None:
  """Content of the last complete `\\boxed{...}`, else of the last `<answer>...</answer>`, else None."""
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed
  end = text.rfind("</answer>")
  if end < 0:
    return None
  start = text.rfind("<answer>", 0, end)
  if start < 0:
    return None
  return text[start + len("<answer>"):end]


def _last_boxed(text: str) -> str | None:
  marker = "\\boxed{"
  start = text.rfind(marker)
  while start >= 0:
    depth, i = 1, start + len(marker)
    stop = min(len(text), i + MAX_BOXED_CHARS + 1)
    while i < stop and depth:
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      i += 1
    if depth == 0:
      return text[start + len(marker):i - 1]
    start = text.rfind(marker, 0, start)  # unclosed (e.g. truncated): try the one before
  return None


# name -> task class; options are the constructor's keyword parameters (--config.task.options.<name>.<field>),
# less the objects the job passes in (NOT_OPTIONS).
TASKS = registry.Registry("task", facts={})
NOT_OPTIONS = ("tool_pool",)


def register_task(cls):
  """Class decorator: registers a Task subclass under its `name`, its options taken from its constructor."""
  TASKS.register(cls.name, options=registry.options_from_signature(cls.__init__, cls.name, skip=NOT_OPTIONS))(cls)
  return cls


class Task(abc.ABC):
  """A verifiable task, as the job uses one: problems (sample, eval_set; a file task's train_examples), their
  reward, warm-start targets (sft_completion) and an optional tool environment. Examples are JSON-serialisable
  dicts with at least 'task', 'key' and 'prompt'. Two implementations: GeneratedTask (problems drawn from a
  seeded generator, split by a hash) and the file task (tasks/dataset.py: the user's rows, split by file).

  Every task may have a tool environment, set by its options `environment` (a registered name or a user's
  'module:Class'; '' for none: single turn), `environment_options` ('option=value,...') and `max_turns` (model
  turns per episode), and run its calls in `tool_pool` (a calls.offload.CallPool the job passes in; None:
  inline). The base builds the environment, declares its tools in the chat template and gives the episode
  runner its factory (environment()): a subclass only passes these arguments on."""

  name: str = ""
  # File-backed tasks (tasks/dataset.py) list their examples (train_examples) instead of drawing them.
  from_files: bool = False

  def __init__(self, *, environment: str = "", environment_options: str | Mapping[str, Any] = "",
               max_turns: int = 4, tool_pool=None):
    self.tools: environment_lib.EnvironmentFactory | None = None
    if environment:
      if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
      options = registry.parse_options(environment_options, "environment_options")
      self.tools = environment_lib.make(environment, max_turns=max_turns, pool=tool_pool, **options)
    elif environment_options:
      raise ValueError(f"environment_options={environment_options!r} needs an environment (environment='')")
    # user message -> prompt text; a pretrained model's tokenizer replaces it with its own chat template (one
    # with tool support, model.chat.ChatFormat, when the task has an environment).
    self.use_chat_template(tokenizer_lib.TASK_CHAT if self.tools else tokenizer_lib.chat_prompt)

  def use_chat_template(self, render_prompt: Callable[[str], str]) -> "Task":
    """Renders every later example's prompt with `render_prompt` (e.g. Tokenizer.chat_prompt); with an
    environment, prompts declare its tools to the template and replies are its tool messages. Returns self."""
    self.chat = render_prompt
    self.render_prompt = (render_prompt if self.tools is None
                          else environment_lib.tool_prompt(self.name, self.tools, render_prompt))
    return self

  def tool_declarations(self) -> list[dict] | None:
    """The environment's tools as the chat template declares them (None: no environment)."""
    return None if self.tools is None else self.tools.declarations()

  @abc.abstractmethod
  def reward(self, example: Example, completion: str) -> float:
    """1.0 if the completion's final answer is correct, else 0.0."""

  @abc.abstractmethod
  def reference_solution(self, example: Example, rng: RngLike | None = None) -> str:
    """A completion text with reward 1 (no stop token)."""

  @abc.abstractmethod
  def wrong_completion(self, example: Example, rng: np.random.Generator) -> str:
    """A plausible completion with reward 0."""

  def reward_function(self) -> Callable[[Example, str], float]:
    """(example, completion) -> reward, as the job's reward pool calls it (config section `reward`). A task
    whose reward may run in worker processes (reward.pool='process') returns a picklable function here."""
    return self.reward

  def reward_initializer(self) -> Callable[[], Any] | None:
    """A picklable no-argument function each reward worker process runs once before its first call (e.g. to
    import a verifier's heavy dependencies outside the per-call timeout), or None."""
    return None

  def environment(self) -> environment_lib.EnvironmentFactory | None:
    """The environment of a multi-turn task (its factory: the tools, the pool, one instance per episode), or
    None: single turn."""
    return self.tools

  def train_examples(self) -> list[Example] | None:
    """A file-backed task's train problems in order (job/data.py shuffles them by epoch); None: drawn by
    sample() from an index."""
    return None

  @abc.abstractmethod
  def sample(self, rng_or_seed: RngLike, n: int, split: str = "train") -> list[Example]:
    """n problems of `split` ('train' or 'eval')."""

  @abc.abstractmethod
  def eval_set(self, n: int, seed: int = 0) -> list[Example]:
    """The held-out problems the job evaluates on, a pure function of (the task, n, seed)."""

  def sft_examples(self) -> list[Example] | None:
    """A file-backed task's warm-start problems (None: drawn by sample())."""
    return self.train_examples()

  def fit_context(self, tok, max_seq_len: int, max_new_tokens: int) -> dict[str, int]:
    """Drops problems too long for the context and returns how many (file-backed tasks; generated ones fit by
    their knobs)."""
    del tok, max_seq_len, max_new_tokens
    return {}

  def sft_completion(self, example: Example, rng: RngLike, error_rate: float) -> str:
    """Reference solution, or with probability error_rate a plausible wrong one (reward 0)."""
    if not 0.0 <= error_rate <= 1.0:
      raise ValueError(f"error_rate must be in [0, 1], got {error_rate!r}")
    rng = as_rng(rng)
    if rng.random() < error_rate:
      return self.wrong_completion(example, rng)
    return self.reference_solution(example, rng)


class GeneratedTask(Task):
  """Problems drawn from a seeded generator (_draw), split into train and eval by a hash of each problem's
  canonical key (a fixed eval_fraction of all problems), so the two never share one."""

  def __init__(self, eval_fraction: float = 0.1, **environment):
    if not 0.0 < eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    self.eval_fraction = float(eval_fraction)
    super().__init__(**environment)

  @abc.abstractmethod
  def _draw(self, rng: np.random.Generator) -> Example:
    """One random problem (any split), with its canonical 'key' and 'prompt'."""

  def split_of(self, example: Example) -> str:
    return split_of_key(example["key"], self.eval_fraction)

  def sample(self, rng_or_seed: RngLike, n: int, split: str = "train") -> list[Example]:
    """n problems of `split`, drawn by rejection on the hash split so train and eval never share one."""
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(n, (int, np.integer)) or n < 0:
      raise ValueError(f"n must be a non-negative int, got {n!r}")
    rng = as_rng(rng_or_seed)
    out = []
    for _ in range(n):
      for _ in range(_MAX_TRIES_PER_EXAMPLE):
        ex = self._draw(rng)
        if split_of_key(ex["key"], self.eval_fraction) == split:
          out.append(ex)
          break
      else:
        raise ValueError(f"could not draw a {split!r} example of task {self.name!r} in "
                         f"{_MAX_TRIES_PER_EXAMPLE} tries: knobs leave too few problems in that split")
    return out

  def eval_set(self, n: int, seed: int = 0) -> list[Example]:
    """n distinct eval-split problems, a pure function of (knobs, n, seed)."""
    rng = as_rng([seed, 0xE7A1])
    seen, out, since_new = set(), [], 0
    # Small problem spaces run out of new eval problems: give up after a long run of duplicates.
    while len(out) < n and since_new < 200 + 5 * n:
      ex = self.sample(rng, 1, split="eval")[0]
      since_new += 1
      if ex["key"] not in seen:
        seen.add(ex["key"])
        out.append(ex)
        since_new = 0
    if len(out) < n:
      raise ValueError(f"n={n} exceeds the distinct eval problems found for task {self.name!r} "
                       f"({len(out)}); raise eval_fraction={self.eval_fraction} or widen the knobs")
    return out
