"""Multi-digit integer arithmetic: `a + b`, `a - b`, `a * b`, answered as an exact integer."""
from __future__ import annotations

import re

import numpy as np

from vcpo_jax.tasks import base

ALL_OPS = "+-*"
_INT_RE = re.compile(r"\s*(-?\d{1,64})\s*")


def _apply(a: int, op: str, b: int) -> int:
  return a + b if op == "+" else a - b if op == "-" else a * b


def parse_int_answer(completion: str) -> int | None:
  """The integer in the final answer (last boxed, else last answer block), or None if it is not one."""
  answer = base.extract_answer(completion)
  if answer is None:
    return None
  m = _INT_RE.fullmatch(answer)
  return int(m.group(1)) if m else None


@base.register_task
class Arithmetic(base.GeneratedTask):
  """Knobs: operand digit counts in [min_digits, max_digits] (drawn per operand) and the allowed ops."""

  name = "arithmetic"

  def __init__(self, min_digits: int = 1, max_digits: int = 3, ops: str = ALL_OPS,
               eval_fraction: float = 0.1, environment: str = "", environment_options: str = "", max_turns: int = 4, tool_pool=None):
    super().__init__(eval_fraction, environment=environment, environment_options=environment_options, max_turns=max_turns, tool_pool=tool_pool)
    if not 1 <= min_digits <= max_digits <= 18:
      raise ValueError(f"need 1 <= min_digits <= max_digits <= 18, got min_digits={min_digits!r}, "
                       f"max_digits={max_digits!r}")
    if not ops or set(ops) - set(ALL_OPS) or len(set(ops)) != len(ops):
      raise ValueError(f"ops must be distinct characters from {ALL_OPS!r}, got {ops!r}")
    self.min_digits, self.max_digits = int(min_digits), int(max_digits)
    self.ops = "".join(o for o in ALL_OPS if o in ops)

  def _operand(self, rng: np.random.Generator) -> int:
    digits = int(rng.integers(self.min_digits, self.max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10 ** digits))

  def _draw(self, rng: np.random.Generator) -> base.Example:
    a, b = self._operand(rng), self._operand(rng)
    op = str(self.ops[int(rng.integers(len(self.ops)))])
    return self.make_example(a, op, b)

  def make_example(self, a: int, op: str, b: int) -> base.Example:
    if op not in ALL_OPS:
      raise ValueError(f"op must be one of {ALL_OPS!r}, got {op!r}")
    a, b = int(a), int(b)
    return {"task": self.name, "key": f"arithmetic:{a}{op}{b}", "a": a, "b": b, "op": op,
            "answer": _apply(a, op, b), "prompt": self.render_prompt(
                f"Compute {a} {op} {b}. Put the final answer in <answer></answer>.")}

  def reward(self, example: base.Example, completion: str) -> float:
    got = parse_int_answer(completion)
    return 1.0 if got is not None and got == _apply(example["a"], example["op"], example["b"]) else 0.0

  def reference_solution(self, example: base.Example, rng: base.RngLike | None = None) -> str:
    del rng  # one correct answer
    return f"<answer>{_apply(example['a'], example['op'], example['b'])}</answer>"

  def wrong_completion(self, example: base.Example, rng: np.random.Generator) -> str:
    a, op, b = example["a"], example["op"], example["b"]
    truth = _apply(a, op, b)
    candidates = [truth + 1, truth - 1, truth + 10, truth - 10]
    candidates += [_apply(a, other, b) for other in ALL_OPS if other != op]
    candidates = [c for c in candidates if c != truth]
    return f"<answer>{int(rng.choice(candidates))}</answer>"
