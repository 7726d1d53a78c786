"""Countdown with a calculator tool: the model may check an expression with a `calculator` call before answering.

Same problems, keys and reward as Countdown (the last answer block, exact multiset, exact value); the prompt
declares the tool to the chat template (tools=[...]), the episode is multi-turn (environment(): the calculator,
or another registered environment named by the task option `environment`),
and the warm-start traces use the tool in the template's format: check a candidate, and when the result misses
the target (deliberately wrong first tries), correct it and check again. With `search=True` (two numbers) the
traces check the problem's candidates in a fixed order (`candidates`) until the calculator's reply equals the
target and answer that one; wrong traces answer the first miss: the reply alone says whether to go on.
"""
from __future__ import annotations

import numpy as np

from vcpo_jax import registry
from vcpo_jax.tasks import base, countdown
from vcpo_jax.tasks.environments import calculator


def compact(e: countdown.Expr) -> str:
  """Infix text without spaces (every character is a token for the task tokenizer)."""
  return countdown.render(e).replace(" ", "")


@base.register_task
class CountdownTools(countdown.Countdown):
  """Countdown knobs, plus max_turns (model turns per episode), the calculator's max_result_chars,
  correction_rate: the fraction of correct warm-start traces that first check a wrong candidate, see the miss,
  and correct it, search: the traces enumerate `candidates` instead (two numbers; correction_rate is then
  unused), and environment: the registered environment whose tools the prompts declare and the episodes call
  (the warm-start traces call the calculator: another environment answers them with its own replies)."""

  name = "countdown_tools"

  def __init__(self, min_numbers: int = 3, max_numbers: int = 4, min_number: int = 1, max_number: int = 99,
               max_target: int = 999, ops: str = countdown.ALL_OPS, num_numbers: int | None = None,
               eval_fraction: float = 0.1, max_turns: int = 4, max_result_chars: int = 24,
               correction_rate: float = 0.5, search: bool = False, environment: str = "calculator",
               environment_options: str = "", tool_pool=None):
    options = registry.parse_options(environment_options, "environment_options")
    if environment == "calculator":
      options.setdefault("max_result_chars", max_result_chars)
    super().__init__(min_numbers=min_numbers, max_numbers=max_numbers, min_number=min_number,
                     max_number=max_number, max_target=max_target, ops=ops, num_numbers=num_numbers,
                     eval_fraction=eval_fraction, environment=environment, environment_options=options,
                     max_turns=max_turns, tool_pool=tool_pool)
    if self.tools is None:
      raise ValueError("countdown_tools needs an environment (its warm-start traces call the calculator)")
    if not 0.0 <= correction_rate <= 1.0:
      raise ValueError(f"correction_rate must be in [0, 1], got {correction_rate!r}")
    self.correction_rate = float(correction_rate)
    if not isinstance(search, bool):
      raise ValueError(f"search must be a bool, got {search!r}")
    if search and not self.min_numbers == self.max_numbers == 2:
      raise ValueError(f"search=True enumerates the candidates of two numbers; needs num_numbers=2, got "
                       f"min_numbers={self.min_numbers}, max_numbers={self.max_numbers}")
    if search and max_turns < len(self.ops) + 1:
      raise ValueError(f"search=True checks up to {len(self.ops)} candidates (one per op) and then answers: "
                       f"needs max_turns >= {len(self.ops) + 1}, got max_turns={max_turns}")
    self.search = search

  def _check(self, text: str) -> str:
    """A calculator call and the environment's real reply to it, as an episode holds them."""
    call = calculator.call(text)
    return call + self.tools.respond(call).text

  def _miss(self, example: base.Example, expr: countdown.Expr, rng: np.random.Generator) -> countdown.Expr:
    """A wrong candidate with the problem's own numbers, each once, whose value misses the target: only the
    calculator's reply shows it is wrong (a near miss by a swapped operator, else another random expression)."""
    ops = example.get("ops", self.ops)
    for _ in range(100):
      wrong = countdown._swap_op(expr, int(rng.integers(countdown._count_leaves(expr) - 1)), rng, ops)[0]
      if rng.random() < 0.5:
        wrong = self._random_expression(list(example["numbers"]), rng)
      if wrong is not None and countdown.value(wrong) not in (None, example["target"]):
        return wrong
    return countdown._bump_leaf(expr, 0, 1)[0]  # every expression of these numbers hits the target

  def candidates(self, example: base.Example) -> list[countdown.Expr]:
    """The search order: one expression per op in `ops` order (+ - * /), the larger number first for - and /
    (every target of two numbers is one of them: the problems keep values non-negative integers)."""
    a, b = example["numbers"]
    big, small = max(a, b), min(a, b)
    return [(op, a, b) if op in "+*" else (op, big, small) for op in example.get("ops", self.ops)]

  def _search(self, example: base.Example, stop_at_miss: bool) -> str:
    """Checks in search order up to the first hit (or, stop_at_miss, the first miss) and answers it."""
    lines = []
    for e in self.candidates(example):
      hit = countdown.value(e) == example["target"]
      if hit and stop_at_miss:
        continue  # a wrong trace skips the hit: it stops only after a miss
      lines.append(self._check(compact(e)))
      if hit or stop_at_miss:
        return f"{''.join(lines)}<answer>{compact(e)}</answer>"
    raise ValueError(f"countdown_tools search: no candidate {'misses' if stop_at_miss else 'hits'} "
                     f"numbers={example['numbers']!r}, target={example['target']!r}")

  def reference_solution(self, example: base.Example, rng: base.RngLike | None = None) -> str:
    if self.search:
      return self._search(example, stop_at_miss=False)
    rng = None if rng is None else base.as_rng(rng)
    expr = self._solution(example, rng)
    first = ""
    if rng is not None and rng.random() < self.correction_rate:
      first = self._check(compact(self._miss(example, expr, rng)))
    return f"{first}{self._check(compact(expr))}<answer>{compact(expr)}</answer>"

  def wrong_completion(self, example: base.Example, rng: np.random.Generator) -> str:
    # A wrong candidate, checked, and answered although the calculator's reply misses the target: the warm
    # start always calls the tool, and what it does with the reply (retry or answer) is left for RL to learn.
    if self.search:
      return self._search(example, stop_at_miss=True)
    wrong = compact(self._miss(example, self._solution(example, rng), rng))
    return f"{self._check(wrong)}<answer>{wrong}</answer>"
