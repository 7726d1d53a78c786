"""Exact evaluator for `+ - * / ( )` arithmetic over decimal literals: own parser, never `eval`."""
from __future__ import annotations

import re
from fractions import Fraction

ALLOWED_RE = re.compile(r"[0-9+\-*/().\s]*")
_TOKEN_RE = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([-+*/()]))")

MAX_DIGITS = 15        # per literal: longer literals are rejected before any arithmetic
MAX_ABS = 10 ** 12     # any literal or intermediate beyond this is rejected (no huge powers via chains)
MAX_DEPTH = 64         # parenthesis nesting; keeps the recursive parser far from Python's recursion limit
MAX_CHARS = 256


class EvalError(ValueError):
  """The expression is malformed, unsafe or undefined (e.g. division by zero)."""


def tokenize(expr: str) -> list[str]:
  if len(expr) > MAX_CHARS:
    raise EvalError(f"expression longer than {MAX_CHARS} chars: {len(expr)}")
  if ALLOWED_RE.fullmatch(expr) is None:
    bad = next(c for c in expr if ALLOWED_RE.fullmatch(c) is None)
    raise EvalError(f"character {bad!r} is not allowed")
  tokens, pos = [], 0
  expr = expr.rstrip()
  while pos < len(expr):
    m = _TOKEN_RE.match(expr, pos)
    if m is None:
      raise EvalError(f"cannot parse at position {pos}: {expr[pos:pos + 10]!r}")
    tokens.append(m.group(1) or m.group(2))
    pos = m.end()
  return tokens


def literals(expr: str) -> list[str]:
  """The number literals in `expr`, in order (raises EvalError on disallowed characters)."""
  return [t for t in tokenize(expr) if t[0].isdigit()]


def _check(x: Fraction) -> Fraction:
  if abs(x) > MAX_ABS:
    raise EvalError(f"intermediate value magnitude exceeds {MAX_ABS}")
  return x


class _Parser:
  """expr := term (('+'|'-') term)*; term := unary (('*'|'/') unary)*; unary := '-' unary | atom."""

  def __init__(self, tokens: list[str]):
    self.tokens = tokens
    self.pos = 0
    self.depth = 0

  def peek(self) -> str | None:
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self) -> str:
    tok = self.peek()
    if tok is None:
      raise EvalError("unexpected end of expression")
    self.pos += 1
    return tok

  # expr and term look alike: they are the grammar's two precedence levels, and only term's "/" checks for zero.
  def expr(self) -> Fraction:
    value = self.term()
    while self.peek() in ("+", "-"):
      op = self.take()
      rhs = self.term()
      value = _check(value + rhs if op == "+" else value - rhs)
    return value

  def term(self) -> Fraction:
    value = self.unary()
    while self.peek() in ("*", "/"):
      op = self.take()
      rhs = self.unary()
      if op == "*":
        value = _check(value * rhs)
      elif rhs == 0:
        raise EvalError("division by zero")
      else:
        value = _check(value / rhs)
    return value

  def unary(self) -> Fraction:
    # Unary minus chains ("--3") are iterated, not recursed, so they cannot exhaust the stack.
    sign = 1
    while self.peek() == "-":
      self.take()
      sign = -sign
    return sign * self.atom()

  def atom(self) -> Fraction:
    tok = self.take()
    if tok == "(":
      self.depth += 1
      if self.depth > MAX_DEPTH:
        raise EvalError(f"parentheses nested deeper than {MAX_DEPTH}")
      value = self.expr()
      if self.take() != ")":
        raise EvalError("expected ')'")
      self.depth -= 1
      return value
    if tok[0].isdigit():
      if sum(c.isdigit() for c in tok) > MAX_DIGITS:
        raise EvalError(f"number literal with more than {MAX_DIGITS} digits")
      return _check(Fraction(tok))
    raise EvalError(f"unexpected token {tok!r}")


def evaluate(expr: str) -> Fraction:
  """Exact rational value of `expr`; raises EvalError for anything malformed, unsafe or undefined."""
  tokens = tokenize(expr)
  if not tokens:
    raise EvalError("empty expression")
  parser = _Parser(tokens)
  value = parser.expr()
  if parser.pos != len(tokens):
    raise EvalError(f"unexpected token {tokens[parser.pos]!r} after a complete expression")
  return value
