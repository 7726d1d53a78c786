"""Arithmetic with a Python tool: products too large to compute unaided, where `print(a*b)` in a `python` call is easy.

Same problems, keys and reward as Arithmetic (the exact integer in the last answer block), with larger operands
(4-6 digits) and the `python` environment (tasks.environments.python_tool) declared to the chat template. Warm-start traces
call the tool in the template's format, read its reply and answer it: `<tool_call>{"name": "python",
"arguments": {"code": "print(1234*56789)"}}</tool_call>`, the tool message `70077626`, `<answer>70077626</answer>`.
Wrong traces (sft.error_rate) are the mistakes RL can remove, of the kinds in `wrong_kinds`: an operand
miscopied into the code at a random digit (the reply is then a wrong product, answered faithfully), the reply
misread (one digit of the answer changed), no call and a guess (the leading digits right), or `slip`: one
systematic miscopy, the second operand's first digit one higher in the code (9 -> 1). Random mistakes spread
the sampled mass but leave the greedy answer right; a systematic one competes with the right token at one
place, so the warm start's greedy answer follows it on many problems and RL on the reward can remove it.
"""
from __future__ import annotations

import numpy as np

from vcpo_jax.tasks import arithmetic, base
from vcpo_jax.tasks.environments import python_tool

# Kinds of wrong warm-start traces, and the default shares.
WRONG_KINDS = "miscopy:0.5,misread:0.25,guess:0.25"
KINDS = ("miscopy", "misread", "guess", "slip")


def parse_wrong_kinds(spec: str) -> tuple[tuple[str, float], ...]:
  """'miscopy:0.5,slip:0.5' -> ((kind, share), ...), shares normalised; a bare kind has share 1."""
  kinds = []
  for item in filter(None, (x.strip() for x in spec.split(","))):
    name, _, share = item.partition(":")
    if name not in KINDS:
      raise ValueError(f"wrong_kinds: unknown kind {name!r} in {spec!r}; known: {', '.join(KINDS)}")
    try:
      value = float(share) if share else 1.0
    except ValueError:
      raise ValueError(f"wrong_kinds: share of {name!r} is not a number: {share!r}") from None
    if not value > 0:
      raise ValueError(f"wrong_kinds: share of {name!r} must be > 0, got {value!r}")
    kinds.append((name, value))
  if not kinds:
    raise ValueError(f"wrong_kinds: no kinds in {spec!r}")
  total = sum(v for _, v in kinds)
  return tuple((k, v / total) for k, v in kinds)


def _slip(b: int) -> int:
  """b with its first digit one higher (9 -> 1): the warm start's one systematic miscopy."""
  digits = str(abs(b))
  first = int(digits[0]) % 9 + 1
  return int(str(first) + digits[1:]) * (-1 if b < 0 else 1)


def _change_digit(n: int, rng: np.random.Generator, keep_leading: int = 1) -> int:
  """n with one digit (not among its first keep_leading) replaced by another: a different number, same length."""
  digits = list(str(abs(n)))
  if len(digits) <= keep_leading:
    return n + 1
  i = int(rng.integers(keep_leading, len(digits)))
  digits[i] = str((int(digits[i]) + int(rng.integers(1, 10))) % 10)
  return int("".join(digits)) * (-1 if n < 0 else 1)


@base.register_task
class ArithmeticCode(arithmetic.Arithmetic):
  """Arithmetic knobs (operand digits, ops), max_turns (model turns per episode, so max_turns - 1 calls),
  and the python environment's options: wall_seconds, cpu_seconds, memory_mb per call, exact_prints
  (tasks.environments.python_tool.PythonTool); wrong_kinds, the warm start's wrong traces ('kind:share,...', of KINDS)."""

  name = "arithmetic_code"

  def __init__(self, min_digits: int = 4, max_digits: int = 6, ops: str = "*", eval_fraction: float = 0.1,
               max_turns: int = 3, wall_seconds: float = 2.0, cpu_seconds: int = 1, memory_mb: int = 256,
               exact_prints: bool = False, wrong_kinds: str = WRONG_KINDS, tool_pool=None):
    self.wrong_kinds = parse_wrong_kinds(wrong_kinds)
    super().__init__(min_digits=min_digits, max_digits=max_digits, ops=ops, eval_fraction=eval_fraction,
                     environment="python", max_turns=max_turns, tool_pool=tool_pool,
                     environment_options=dict(wall_seconds=wall_seconds, cpu_seconds=cpu_seconds,
                                              memory_mb=memory_mb, exact_prints=exact_prints))

  def _run(self, a: int, op: str, b: int) -> tuple[str, int]:
    """A call printing `a op b` and the tool's reply to it, as an episode holds them; and the printed value.
    The reply is what the python tool answers (the episodes' rule, rollout.multiturn.trace_segments, checks it)."""
    value = arithmetic._apply(a, op, b)
    content = python_tool.stdout_content(f"{value}\n", 1 << 20)
    return python_tool.call(f"print({a}{op}{b})") + self.tools.render_reply(content), value

  def reference_solution(self, example: base.Example, rng: base.RngLike | None = None) -> str:
    del rng  # one correct trace
    text, value = self._run(example["a"], example["op"], example["b"])
    return f"{text}<answer>{value}</answer>"

  def wrong_completion(self, example: base.Example, rng: np.random.Generator) -> str:
    a, op, b = example["a"], example["op"], example["b"]
    truth = arithmetic._apply(a, op, b)
    kinds = self.wrong_kinds
    kind = kinds[int(rng.choice(len(kinds), p=[p for _, p in kinds]))][0]
    if kind == "slip":
      text, value = self._run(a, op, _slip(b))
      if value != truth:
        return f"{text}<answer>{value}</answer>"
      kind = "misread"  # a zero operand: the slip gives the same product
    if kind == "miscopy":
      for _ in range(100):
        a2, b2 = (_change_digit(a, rng), b) if rng.random() < 0.5 else (a, _change_digit(b, rng))
        text, value = self._run(a2, op, b2)
        if value != truth:
          return f"{text}<answer>{value}</answer>"
      kind = "misread"  # every miscopy gives the same value (e.g. a zero operand)
    if kind == "misread":
      text, _ = self._run(a, op, b)
      return f"{text}<answer>{_change_digit(truth, rng)}</answer>"
    guess = _change_digit(_change_digit(truth, rng, keep_leading=2), rng, keep_leading=2)
    return f"<answer>{guess if guess != truth else truth + 1}</answer>"
