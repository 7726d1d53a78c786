"""Calculator environment: a `calculator` call with an `expression` is answered by its exact value.

Calls and replies use the chat template's tool format (tasks.environments.tool_calls): `<tool_call>{"name": "calculator",
"arguments": {"expression": "6*5-3"}}</tool_call>` is answered by the tool message `27`. The expression runs
through the project's own exact evaluator (safe_eval: a parser, never eval/exec). A reply is built only from
the value's digits or from a fixed error phrase, never from the model's text, so a call cannot inject markup
(`</tool_response>`, chat tokens) into the context; replies, calls and the number of turns are capped.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable, Optional

from vcpo_jax.tasks import safe_eval
from vcpo_jax.tasks.environments import base as environment, tool_calls

# EvalError message fragment -> the fixed phrase the model sees (first match wins; anything else: malformed).
_ERROR_PHRASES = (("longer than", "too long"), ("not allowed", "bad character"), ("division by zero",
                  "division by zero"), ("exceeds", "too large"), ("more than", "too large"),
                  ("nested deeper", "too deep"), ("empty", "empty"))


def format_value(x: Fraction) -> str:
  """An integer as itself, else the exact fraction `p/q` (itself an expression the calculator accepts)."""
  return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def error_phrase(e: safe_eval.EvalError) -> str:
  message = str(e)
  return next((phrase for fragment, phrase in _ERROR_PHRASES if fragment in message), "malformed")


@environment.register_environment
class Calculator(environment.Environment):
  """One tool, `calculator(expression: string)`; option max_result_chars caps a reply's value (a longer one
  is the error "too long"). It keeps no state between calls."""

  name = "calculator"

  def __init__(self, max_result_chars: int = 24):
    if isinstance(max_result_chars, bool) or not isinstance(max_result_chars, int) or max_result_chars < 1:
      raise ValueError(f"max_result_chars must be a positive int, got {max_result_chars!r}")
    self.max_result_chars = max_result_chars

  def calculator(self, expression: str) -> str:
    """Evaluates an arithmetic expression (+ - * / and parentheses) exactly."""
    if not expression.strip():
      raise tool_calls.ToolError("empty")
    try:
      value = format_value(safe_eval.evaluate(expression))
    except safe_eval.EvalError as e:
      raise tool_calls.ToolError(error_phrase(e)) from None
    except (ValueError, ArithmeticError, RecursionError):  # belt and braces: a call never stops the job
      raise tool_calls.ToolError("malformed") from None
    if len(value) > self.max_result_chars:
      raise tool_calls.ToolError("too long")
    return value


def environment_of(max_turns: int = 4, max_result_chars: int = 24, max_call_chars: int = 256,
                   render_reply: Optional[Callable[[str], str]] = None) -> environment.EnvironmentFactory:
  """The calculator as a task uses it: max_turns model turns per episode (so at most max_turns - 1 calls are
  answered); max_call_chars caps a call's JSON body."""
  return environment.make("calculator", max_turns=max_turns, max_call_chars=max_call_chars,
                          render_reply=render_reply, max_result_chars=max_result_chars)


def call(expression: str) -> str:
  """The text of a calculator call, as the chat template renders one (what warm-start traces write)."""
  return tool_calls.call_text("calculator", expression=expression)
