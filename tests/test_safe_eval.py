"""tasks/safe_eval.py against an independent tree oracle: values, precedence, and every rejected input."""
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from vcpo_jax.tasks import countdown, safe_eval


def _oracle(tree):
  """Exact value of a test-side expression tree; ZeroDivisionError / OverflowError mirror the spec."""
  if isinstance(tree, int):
    return Fraction(tree)
  if tree[0] == "neg":
    return -_oracle(tree[1])
  op, a, b = tree
  x, y = _oracle(a), _oracle(b)
  v = {"+": lambda: x + y, "-": lambda: x - y, "*": lambda: x * y, "/": lambda: x / y}[op]()
  if abs(v) > safe_eval.MAX_ABS:
    raise OverflowError
  return v


_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def _text(tree, draw_bool):
  """Renders with parentheses wherever precedence needs them (and randomly elsewhere), random spaces."""
  sp = " " if draw_bool() else ""
  if isinstance(tree, int):
    return str(tree)
  if tree[0] == "neg":
    inner = tree[1]
    body = _text(inner, draw_bool)
    return f"-{body}" if isinstance(inner, int) else f"-({body})"
  op, a, b = tree
  parts = []
  for child, is_right in ((a, False), (b, True)):
    body = _text(child, draw_bool)
    if not isinstance(child, int) and child[0] != "neg":
      child_prec = _PREC[child[0]]
      if child_prec < _PREC[op] or (is_right and child_prec == _PREC[op]) or draw_bool():
        body = f"({body})"
    parts.append(body)
  return f"{parts[0]}{sp}{op}{sp}{parts[1]}"


TREES = st.recursive(
    st.integers(0, 30),
    lambda kids: st.one_of(
        st.tuples(st.sampled_from("+-*/"), kids, kids),
        st.tuples(st.just("neg"), kids)),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(TREES, st.data())
def test_evaluate_matches_tree_oracle(tree, data):
  text = _text(tree, lambda: data.draw(st.booleans()))
  try:
    expected = _oracle(tree)
  except (ZeroDivisionError, OverflowError):
    with pytest.raises(safe_eval.EvalError):
      safe_eval.evaluate(text)
    return
  assert safe_eval.evaluate(text) == expected


BINARY_TREES = st.recursive(st.integers(0, 30), lambda kids: st.tuples(st.sampled_from("+-*/"), kids, kids),
                            max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(BINARY_TREES)
def test_countdown_render_keeps_the_value_with_minimal_parentheses(tree):
  try:
    expected = _oracle(tree)
  except (ZeroDivisionError, OverflowError):
    return
  text = countdown.render(tree)
  assert safe_eval.evaluate(text) == expected
  assert countdown.value(tree) == expected


@pytest.mark.parametrize("tree,text", [
    (("+", 1, ("-", 2, 3)), "1 + 2 - 3"), (("-", 1, ("+", 2, 3)), "1 - (2 + 3)"),
    (("-", ("-", 9, 2), 3), "9 - 2 - 3"), (("*", ("+", 1, 2), 3), "(1 + 2) * 3"),
    (("/", 8, ("*", 2, 2)), "8 / (2 * 2)"), (("*", 8, ("/", 4, 2)), "8 * 4 / 2")])
def test_countdown_render_examples(tree, text):
  assert countdown.render(tree) == text


@pytest.mark.parametrize("expr,value", [
    ("1 - 2 - 3", -4), ("8 / 4 / 2", 1), ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("--3", 3),
    ("-2 * 3", -6), ("10 / 4", Fraction(5, 2)), (" 1\n+\n2 ", 3), ("2.5 * 2", 5)])
def test_evaluate_precedence_and_associativity(expr, value):
  assert safe_eval.evaluate(expr) == value


@pytest.mark.parametrize("expr", [
    "", "   ", "2 ** 3", "1 +", "(1 + 2", "1 + 2)", "2(3)", "+3", "1 2", "1..2", ".5", "5.", "()",
    "1 / 0", "1 / (2 - 2)", "9" * 16, "999999 * 999999 * 9", "(" * 70 + "1" + ")" * 70,
    "__import__('os')", "1;2", "lambda: 1", "a + b", "1e5", "0x10", "1_000"])
def test_evaluate_rejects_bad_expressions(expr):
  with pytest.raises(safe_eval.EvalError):
    safe_eval.evaluate(expr)


def test_evaluate_accepts_the_limits_exactly():
  assert safe_eval.evaluate("9" * 12 + " + 1") == 10 ** 12
  assert safe_eval.evaluate("(" * 64 + "1" + ")" * 64) == 1
  assert safe_eval.evaluate("-" * 200 + "1") == 1  # long unary chains do not recurse
