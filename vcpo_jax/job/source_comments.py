"""Comments in Python source as documentation: a config file's fields, a dataclass's fields, a registration's."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize


def _comments(source: str) -> dict[int, str]:
  """line number -> the comment text on that line."""
  out = {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      out[tok.start[0]] = tok.string.lstrip("#").strip()
  return out


def _comment_for(node: ast.AST, lines: list[str], comments: dict[int, str], last_line: int | None = None) -> str:
  """The comment beside a node (on its lines up to `last_line`) after the full-line comments just above it."""
  above = []
  n = node.lineno - 1
  first_on_line = not lines[node.lineno - 1][:node.col_offset].strip(" (")  # a comment above is its own
  while first_on_line and n >= 1 and lines[n - 1].strip().startswith("#"):
    above.insert(0, comments[n])
    n -= 1
  beside = [comments[i] for i in range(node.lineno, (last_line or node.end_lineno) + 1) if i in comments
            and not lines[i - 1].strip().startswith("#")]
  return " ".join(above + beside)


def _dict_call(node: ast.AST):
  """The `dict(...)` call inside `ml_collections.ConfigDict(dict(...))`, or None."""
  if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Call):
    inner = node.args[0]
    if isinstance(inner.func, ast.Name) and inner.func.id == "dict":
      return inner
  return None


def _dotted(node: ast.AST) -> str | None:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    head = _dotted(node.value)
    return None if head is None else f"{head}.{node.attr}"
  return None


def config_comments(source: str) -> dict[str, tuple[int, str]]:
  """Dotted config field -> (line, comment), from `c.x = ...` assignments and `ConfigDict(dict(k=...))` keywords."""
  lines, comments, out = source.splitlines(), _comments(source), {}

  def visit_dict(prefix: str, call: ast.Call):
    for kw in call.keywords:
      path = f"{prefix}.{kw.arg}"
      inner = _dict_call(kw.value)
      out[path] = (kw.lineno, _comment_for(kw, lines, comments, kw.lineno if inner else None))
      if inner is not None:
        visit_dict(path, inner)

  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      path = _dotted(node.targets[0])
      if path and "." in path:
        path = path.split(".", 1)[1]  # drop the ConfigDict's variable name
        inner = _dict_call(node.value)
        out.setdefault(path, (node.lineno, _comment_for(node, lines, comments, node.lineno if inner else None)))
        if inner is not None:
          visit_dict(path, inner)
  return out


def dataclass_comments(cls: type) -> dict[str, str]:
  """Field -> the comment beside it in the dataclass's source (inherited fields included)."""
  out = {}
  for klass in reversed(cls.__mro__):
    if not dataclasses.is_dataclass(klass):
      continue
    try:
      source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
      continue
    lines, comments = source.splitlines(), _comments(source)
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        out[node.target.id] = _comment_for(node, lines, comments)
  return out


def registration_comments(source: str) -> dict[str, str]:
  """Name -> the comment above (or beside) its `X.register...("name", ...)` call in `source`."""
  out, lines, comments = {}, source.splitlines(), _comments(source)
  for node in ast.walk(ast.parse(source)):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith("register") and node.args and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)):
      comment = _comment_for(node, lines, comments)
      if comment:
        out.setdefault(node.args[0].value, comment)
  return out
