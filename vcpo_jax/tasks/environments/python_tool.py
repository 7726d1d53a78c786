"""Python code environment: a `python` call with `code` runs it in the sandbox and replies its stdout.

`<tool_call>{"name": "python", "arguments": {"code": "print(123*456)"}}</tool_call>` is answered by the tool
message `56088`: the code ran in its own process under tasks.environments.sandbox's limits (time, memory, output, processes,
an empty directory, no network where the host allows it). A failure is the reply `error: <kind>: <the last
line of stderr>` with the sandbox's kind (`syntax_error`, `nonzero_exit`, `timeout`, `cpu_limit`, `memory`,
`output_limit`, ...), counted per kind as `tool/<kind>`. Output is the model's own text, so a reply keeps only
printable ASCII and newlines (what the task tokenizer encodes) and drops chat markup (`<|...|>`, tool-call and
tool-response tags, answer tags), then is capped: code cannot end the tool turn, open a turn or write an answer.
"""
from __future__ import annotations

import ast
import re
import string
import warnings
from typing import Optional

from vcpo_jax.tasks.environments import base as environment, sandbox, tool_calls

# Markup a reply must not carry: the chat's special tokens, the tool format's tags and the answer's.
_MARKUP_RE = re.compile(r"<\|[^<>|]{0,64}\|>|</?tool_call>|</?tool_response>|</?answer>|\\boxed\{")
_PRINTABLE = frozenset(string.digits + string.ascii_letters + string.punctuation + " \n")
NO_OUTPUT = "(no output)"
TRUNCATED = "..."
_MAX_TAIL_CHARS = 120   # of stderr's last line in an error reply
_MAX_EXACT_CHARS = 512  # longer code always runs in the sandbox


def clean(text: str) -> str:
  """Printable ASCII and newlines only (others become '?'), chat and tool markup removed until none is left."""
  text = "".join(c if c in _PRINTABLE else " " if c == "\t" else "?" for c in text)
  while True:
    stripped = _MARKUP_RE.sub("", text)
    if stripped == text:
      return text
    text = stripped


def stdout_content(stdout: str, max_chars: int) -> str:
  """The reply's content for a run's stdout: cleaned, less its final newline, capped at max_chars."""
  text = clean(stdout)
  text = text[:-1] if text.endswith("\n") else text
  if len(text) > max_chars:
    text = text[:max_chars] + TRUNCATED
  return text or NO_OUTPUT


def error_message(result: sandbox.SandboxResult) -> str:
  """`<kind>` and, when stderr has one, `: <its last line>` (cleaned, capped)."""
  lines = [line for line in clean(result.stderr).splitlines() if line.strip()]
  if not lines:
    return result.kind
  tail = lines[-1].strip()
  return f"{result.kind}: {tail[:_MAX_TAIL_CHARS]}{TRUNCATED if len(tail) > _MAX_TAIL_CHARS else ''}"


# The compiler's warnings about model-written code ("invalid decimal literal") carry the filename it was parsed
# under, and one filter for that name keeps them out of the training log. A catch_warnings() around the parse
# would swap the process-wide filter list, which races with the tool pool's other threads and the learner's.
MODEL_CODE = "<model code>"
_MODULE_RE = re.escape(MODEL_CODE)


def _quiet_model_code() -> None:
  """Adds the filter unless the filter list has it (an exited catch_warnings() or resetwarnings() drops it)."""
  if not any(f[0] == "ignore" and f[3] is not None and f[3].pattern == _MODULE_RE for f in warnings.filters):
    warnings.filterwarnings("ignore", module=_MODULE_RE)


def exact_print(code: str) -> Optional[str]:
  """What Python prints for `code` when it is one `print(<integer literals with + - * and parentheses>)` call,
  read off its syntax tree (nothing runs); None for any other code. Its size is bounded (no powers, at most
  _MAX_EXACT_CHARS characters), so the value has at most that many digits."""
  if len(code) > _MAX_EXACT_CHARS:
    return None
  try:
    _quiet_model_code()
    tree = ast.parse(code, filename=MODEL_CODE, mode="exec")
    body = tree.body
    if (len(body) != 1 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call)):
      return None
    call = body[0].value
    if (not isinstance(call.func, ast.Name) or call.func.id != "print" or len(call.args) != 1
        or call.keywords):
      return None
    value = _integer(call.args[0])
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return None
  return None if value is None else f"{value}\n"


def _integer(node: ast.AST) -> Optional[int]:
  if isinstance(node, ast.Constant):
    return node.value if type(node.value) is int else None  # noqa: E721 - bool is not an integer literal here
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    x = _integer(node.operand)
    return None if x is None else (-x if isinstance(node.op, ast.USub) else x)
  if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
    x, y = _integer(node.left), _integer(node.right)
    if x is None or y is None:
      return None
    return x + y if isinstance(node.op, ast.Add) else x - y if isinstance(node.op, ast.Sub) else x * y
  return None


@environment.register_environment
class PythonTool(environment.Environment):
  """One tool, `python(code: string)`. Options: the sandbox's wall_seconds, cpu_seconds and memory_mb per call
  (defaults sized for small arithmetic scripts), max_reply_chars (a longer stdout is cut, ending '...'), and
  exact_prints: code that is one print of integer + - * arithmetic on literals is answered from its syntax
  tree (exact_print: the same text Python prints) instead of two interpreter start-ups in the sandbox (about
  65 ms of CPU each); every other call runs in the sandbox either way. It keeps no state between calls."""

  name = "python"

  def __init__(self, wall_seconds: float = 2.0, cpu_seconds: int = 1, memory_mb: int = 256,
               max_reply_chars: int = 200, exact_prints: bool = False):
    for field, value in (("cpu_seconds", cpu_seconds), ("memory_mb", memory_mb),
                         ("max_reply_chars", max_reply_chars)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"python environment: {field} must be a positive int, got {value!r}")
    if isinstance(wall_seconds, bool) or not isinstance(wall_seconds, (int, float)) or not wall_seconds > 0:
      raise ValueError(f"python environment: wall_seconds must be a positive number, got {wall_seconds!r}")
    if not isinstance(exact_prints, bool):
      raise ValueError(f"python environment: exact_prints must be a bool, got {exact_prints!r}")
    self.limits = sandbox.SandboxLimits(wall_seconds=float(wall_seconds), cpu_seconds=cpu_seconds,
                                        memory_bytes=memory_mb << 20)
    self.max_reply_chars, self.exact_prints = max_reply_chars, exact_prints

  def python(self, code: str) -> str:
    """Runs Python code in a sandbox and returns what it prints.

    Args:
      code: a Python program; print the result.
    """
    if self.exact_prints:
      printed = exact_print(code)
      if printed is not None:
        return stdout_content(printed, self.max_reply_chars)
    result = sandbox.run_python(code, self.limits)
    if result.kind != "ok":
      raise tool_calls.ToolError(error_message(result), kind=result.kind)
    return stdout_content(result.stdout, self.max_reply_chars)


def call(code: str) -> str:
  """The text of a python call, as the chat template renders one (what warm-start traces write)."""
  return tool_calls.call_text("python", code=code)
