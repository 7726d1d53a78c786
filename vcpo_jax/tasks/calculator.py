"""Calculator tool environment: `<calc>expr</calc>` in a model turn is answered by `<result>value</result>`.

The expression runs through the project's own exact evaluator (safe_eval: a parser, never eval/exec). A reply
is built only from the value's digits or from a fixed error phrase, never from the model's text, so a call
cannot inject markup (`</result>`, chat tokens) into the context; replies and the number of turns are capped.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Optional

from vcpo_jax.tasks import safe_eval

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"

# EvalError message fragment -> the fixed phrase the model sees (first match wins; anything else: malformed).
_ERROR_PHRASES = (("longer than", "too long"), ("not allowed", "bad character"), ("division by zero",
                  "division by zero"), ("exceeds", "too large"), ("more than", "too large"),
                  ("nested deeper", "too deep"), ("empty", "empty"))


@dataclasses.dataclass(frozen=True)
class ToolReply:
  """What the environment appends after a call (as tokens with mask 0); error=True for a failed call."""
  text: str
  error: bool


def format_value(x: Fraction) -> str:
  """An integer as itself, else the exact fraction `p/q` (itself an expression the calculator accepts)."""
  return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def error_phrase(e: safe_eval.EvalError) -> str:
  message = str(e)
  return next((phrase for fragment, phrase in _ERROR_PHRASES if fragment in message), "malformed")


class Calculator:
  """A turn that ends with a complete `<calc>...</calc>` is a call; any other turn ends the episode.

  max_turns: model turns per episode (so at most max_turns - 1 calls are answered); max_result_chars caps a
  reply's value (a longer one is the error "too long").
  """

  stop_strings = (CALL_CLOSE,)

  def __init__(self, max_turns: int = 4, max_result_chars: int = 24):
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or not 1 <= max_turns <= 64:
      raise ValueError(f"max_turns must be an int in [1, 64], got {max_turns!r}")
    if isinstance(max_result_chars, bool) or not isinstance(max_result_chars, int) or max_result_chars < 1:
      raise ValueError(f"max_result_chars must be a positive int, got {max_result_chars!r}")
    self.max_turns, self.max_result_chars = max_turns, max_result_chars

  @staticmethod
  def find_call(turn_text: str) -> Optional[str]:
    """The expression of the turn's first complete call (text between the last `<calc>` before the first
    `</calc>` and it; '' when `</calc>` has no opener), or None when the turn makes no call."""
    end = turn_text.find(CALL_CLOSE)
    if end < 0:
      return None
    start = turn_text.rfind(CALL_OPEN, 0, end)
    return "" if start < 0 else turn_text[start + len(CALL_OPEN):end]

  def run(self, expression: str) -> ToolReply:
    """Evaluates one call; every failure is a reply (error=True), never an exception."""
    try:
      value = format_value(safe_eval.evaluate(expression))
    except safe_eval.EvalError as e:
      return self._reply(f"error: {error_phrase(e)}", error=True)
    except (ValueError, ArithmeticError, RecursionError):  # belt and braces: a call never stops the job
      return self._reply("error: malformed", error=True)
    if len(value) > self.max_result_chars:
      return self._reply("error: too long", error=True)
    return self._reply(value, error=False)

  def respond(self, turn_text: str) -> Optional[ToolReply]:
    """The reply to the turn's call, or None when the turn makes none (the episode ends)."""
    expression = self.find_call(turn_text)
    if expression is None:
      return None
    if not expression.strip():
      return self._reply("error: empty", error=True)
    return self.run(expression)

  @staticmethod
  def _reply(body: str, *, error: bool) -> ToolReply:
    return ToolReply(f"{RESULT_OPEN}{body}{RESULT_CLOSE}", error)
