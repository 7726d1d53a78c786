"""Countdown: combine a multiset of integers with + - * / into an expression equal to a target."""
from __future__ import annotations

from fractions import Fraction
from typing import Union

import numpy as np

from vcpo_jax.tasks import base, safe_eval

ALL_OPS = "+-*/"
MAX_ANSWER_CHARS = 256
MAX_TRACE_CHECKS = 16
TOLERANCE = Fraction(1, 10 ** 5)

# An expression tree: a leaf int, or (op, left, right).
Expr = Union[int, tuple]
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def render(e: Expr, parent_prec: int = 0, right_of: str = "") -> str:
  """Infix text with only the parentheses precedence and (non-)associativity need."""
  if isinstance(e, int):
    return str(e)
  op, a, b = e
  prec = _PREC[op]
  text = f"{render(a, prec)} {op} {render(b, prec, right_of=op)}"
  # a - (b + c) and a / (b * c) keep their parentheses; a + (b - c) and a * (b / c) need none.
  needs = prec < parent_prec or (prec == parent_prec and right_of in ("-", "/"))
  return f"({text})" if needs else text


def value(e: Expr) -> Fraction | None:
  """Exact value of a tree; None if it divides by zero."""
  if isinstance(e, int):
    return Fraction(e)
  x, y = value(e[1]), value(e[2])
  return None if x is None or y is None else _combine(x, y, e[0])


def _combine(x: Fraction, y: Fraction, op: str) -> Fraction | None:
  if op == "+":
    return x + y
  if op == "-":
    return x - y
  if op == "*":
    return x * y
  return x / y if y != 0 else None


def solve(numbers: list[int], target: int, ops: str = ALL_OPS,
          rng: np.random.Generator | None = None) -> Expr | None:
  """An expression using every number exactly once that equals target (search order shuffled by rng)."""
  target = Fraction(target)

  def rec(items: list[tuple[Fraction, Expr]]) -> Expr | None:
    if len(items) == 1:
      return items[0][1] if items[0][0] == target else None
    pairs = [(i, j) for i in range(len(items)) for j in range(len(items)) if i != j]
    op_order = list(ops)
    if rng is not None:
      rng.shuffle(pairs)
      rng.shuffle(op_order)
    for i, j in pairs:
      (x, ex), (y, ey) = items[i], items[j]
      rest = [it for k, it in enumerate(items) if k not in (i, j)]
      for op in op_order:
        if op in "+*" and i > j:
          continue  # commutative: the (j, i) order covers it
        v = _combine(x, y, op)
        if v is None:
          continue
        found = rec(rest + [(v, (op, ex, ey))])
        if found is not None:
          return found
    return None

  return rec([(Fraction(n), int(n)) for n in numbers])


@base.register_task
class Countdown(base.GeneratedTask):
  """Knobs: how many numbers (num_numbers, or a min/max_numbers range), their range, max target, ops, and
  trace_checks: warm-start solutions first check that many other candidates, one `expr = value` line each,
  then state the answer's own line (longer responses: a sequence's log-weight sums many token log-ratios)."""

  name = "countdown"

  def __init__(self, min_numbers: int = 3, max_numbers: int = 4, min_number: int = 1,
               max_number: int = 99, max_target: int = 999, ops: str = ALL_OPS,
               num_numbers: int | None = None, eval_fraction: float = 0.1, trace_checks: int = 0,
               environment: str = "", environment_options: str = "", max_turns: int = 4, tool_pool=None):
    super().__init__(eval_fraction, environment=environment, environment_options=environment_options, max_turns=max_turns, tool_pool=tool_pool)
    if isinstance(trace_checks, bool) or not isinstance(trace_checks, int) or not (
        0 <= trace_checks <= MAX_TRACE_CHECKS):
      raise ValueError(f"trace_checks must be an int in [0, {MAX_TRACE_CHECKS}], got {trace_checks!r}")
    self.trace_checks = trace_checks
    if num_numbers is not None:
      min_numbers = max_numbers = num_numbers
    if not 2 <= min_numbers <= max_numbers <= 5:  # the exhaustive solver is slow beyond 5 numbers
      raise ValueError(f"need 2 <= min_numbers <= max_numbers <= 5, got min_numbers={min_numbers!r}, "
                       f"max_numbers={max_numbers!r}")
    if not 0 <= min_number <= max_number <= 10 ** 6:
      raise ValueError(f"need 0 <= min_number <= max_number <= 1e6, got min_number={min_number!r}, "
                       f"max_number={max_number!r}")
    if not 1 <= max_target <= 10 ** 9:
      raise ValueError(f"max_target must be in [1, 1e9], got {max_target!r}")
    if not ops or set(ops) - set(ALL_OPS) or len(set(ops)) != len(ops):
      raise ValueError(f"ops must be distinct characters from {ALL_OPS!r}, got {ops!r}")
    self.min_numbers, self.max_numbers = int(min_numbers), int(max_numbers)
    self.min_number, self.max_number = int(min_number), int(max_number)
    self.max_target = int(max_target)
    self.ops = "".join(o for o in ALL_OPS if o in ops)

  def _random_expression(self, numbers: list[int], rng: np.random.Generator) -> Expr | None:
    """Combines random pairs with random ops, keeping every intermediate a non-negative integer."""
    items = [(Fraction(n), n) for n in numbers]
    while len(items) > 1:
      i, j = rng.choice(len(items), size=2, replace=False)
      (x, ex), (y, ey) = items[i], items[j]
      items = [it for k, it in enumerate(items) if k not in (i, j)]
      for op in rng.permutation(list(self.ops)):
        if op == "-" and x < y:
          (x, ex), (y, ey) = (y, ey), (x, ex)
        v = _combine(x, y, op)
        if v is not None and v.denominator == 1 and v >= 0:
          items.append((v, (str(op), ex, ey)))
          break
      else:
        return None
    return items[0][1]

  def _draw(self, rng: np.random.Generator) -> base.Example:
    for _ in range(1000):
      count = int(rng.integers(self.min_numbers, self.max_numbers + 1))
      numbers = [int(n) for n in rng.integers(self.min_number, self.max_number + 1, size=count)]
      expr = self._random_expression(numbers, rng)
      if expr is None:
        continue
      target = value(expr)
      if 1 <= target <= self.max_target:
        return self.make_example(numbers, int(target))
    raise ValueError(f"countdown knobs admit no target in [1, max_target={self.max_target}]")

  def make_example(self, numbers: list[int], target: int) -> base.Example:
    numbers = [int(n) for n in numbers]
    key = f"countdown:{','.join(map(str, sorted(numbers)))}:{int(target)}"
    return {"task": self.name, "key": key, "numbers": numbers, "target": int(target), "ops": self.ops,
            "prompt": self.render_prompt(self.user_text(numbers, int(target)))}

  def user_text(self, numbers: list[int], target: int) -> str:
    """The user message of a problem (a subclass may add instructions)."""
    return (f"Using the numbers [{', '.join(map(str, numbers))}], make an equation that equals {target}. "
            f"Use each number exactly once, with {' '.join(self.ops)} and parentheses. "
            f"Put the final answer in <answer></answer>.")

  def reward(self, example: base.Example, completion: str) -> float:
    return countdown_reward(completion, example["numbers"], example["target"])

  def _solution(self, example: base.Example, rng: np.random.Generator | None) -> Expr:
    expr = solve(example["numbers"], example["target"], example.get("ops", self.ops), rng)
    if expr is None:
      raise ValueError(f"countdown example has no solution: numbers={example['numbers']!r}, "
                       f"target={example['target']!r}")
    return expr

  def reference_solution(self, example: base.Example, rng: base.RngLike | None = None) -> str:
    rng = None if rng is None else base.as_rng(rng)
    expr = self._solution(example, rng)
    return self._trace(example, rng, expr, example["target"]) + f"<answer>{render(expr)}</answer>"

  def wrong_completion(self, example: base.Example, rng: np.random.Generator) -> str:
    expr = self._solution(example, rng)
    wrong = _bump_leaf(expr, 0, 1)[0]  # off by one on a literal: the multiset is broken by construction
    for _ in range(100):
      candidate = _mutate(expr, rng, example.get("ops", self.ops))
      if self.reward(example, f"<answer>{render(candidate)}</answer>") == 0.0:
        wrong = candidate
        break
    # A wrong trace ends in a miscalculation: the wrong answer's line claims the target.
    return self._trace(example, rng, wrong, example["target"]) + f"<answer>{render(wrong)}</answer>"

  def _trace(self, example: base.Example, rng: np.random.Generator | None, last: Expr, claim: int) -> str:
    """Up to `trace_checks` lines `expr = value` for distinct random other candidates over the same numbers
    (exact values, none equal to the target), then `last = claim`; '' when trace_checks is 0."""
    if not self.trace_checks:
      return ""
    rng = rng if rng is not None else np.random.default_rng(list(example["key"].encode()))
    seen, lines = {render(last)}, []
    for _ in range(20 * self.trace_checks):  # few distinct candidates exist for two numbers: stop trying
      e = self._random_expression(list(example["numbers"]), rng)
      v = None if e is None else value(e)
      if v is not None and v != example["target"] and render(e) not in seen:
        seen.add(render(e))
        lines.append(f"{render(e)} = {_fraction_text(v)}")
        if len(lines) == self.trace_checks:
          break
    return "".join(line + "\n" for line in lines + [f"{render(last)} = {claim}"])


def _fraction_text(v: Fraction) -> str:
  return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


def _mutate(e: Expr, rng: np.random.Generator, ops: str) -> Expr:
  """A plausible near miss: one operator swapped, or one number off by one."""
  leaves = _count_leaves(e)
  if rng.random() < 0.5 and not isinstance(e, int):
    return _swap_op(e, int(rng.integers(leaves - 1)), rng, ops)[0]
  delta = 1 if rng.random() < 0.5 else -1
  return _bump_leaf(e, int(rng.integers(leaves)), delta)[0]


def _count_leaves(e: Expr) -> int:
  return 1 if isinstance(e, int) else _count_leaves(e[1]) + _count_leaves(e[2])


def _bump_leaf(e: Expr, index: int, delta: int) -> tuple[Expr, int]:
  """Adds delta to the index-th leaf (in-order); returns (new tree, leaves still to skip)."""
  if isinstance(e, int):
    return (abs(e + delta) if index == 0 else e), index - 1
  op, a, b = e
  a, index = _bump_leaf(a, index, delta)
  b, index = _bump_leaf(b, index, delta)
  return (op, a, b), index


def _swap_op(e: Expr, index: int, rng: np.random.Generator, ops: str) -> tuple[Expr, int]:
  """Replaces the index-th operator (pre-order) with another allowed (or any) operator."""
  if isinstance(e, int):
    return e, index
  op, a, b = e
  if index == 0:
    others = [o for o in (ops if len(ops) > 1 else ALL_OPS) if o != op]
    return (str(rng.choice(others)), a, b), -1
  a, index = _swap_op(a, index - 1, rng, ops)
  b, index = _swap_op(b, index, rng, ops)
  return (op, a, b), index


def countdown_reward(completion: str, numbers: list[int], target: int) -> float:
  """The paper's rule: last boxed (else last answer block), exact multiset, safe exact evaluation."""
  answer = base.extract_answer(completion)
  if answer is None or len(answer) > MAX_ANSWER_CHARS:
    return 0.0
  try:
    used = sorted(Fraction(lit) for lit in safe_eval.literals(answer))
    if used != sorted(Fraction(int(n)) for n in numbers):
      return 0.0
    result = safe_eval.evaluate(answer)
  except safe_eval.EvalError:
    return 0.0
  return 1.0 if abs(result - Fraction(int(target))) < TOLERANCE else 0.0
