"""Tool calls in the format Qwen2.5/Qwen3 templates teach: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

A ToolEnvironment declares its tools to the chat template (`declarations()`, the `tools=[...]` JSON schemas),
parses a turn's call, checks it against the called tool's schema and answers with the template's tool message
(`render_reply`). Model-written garbage never raises: every failure is a fixed error reply, counted by kind.
The tools are functions (`Tool.run`); tasks.environments.base derives them from an environment's typed methods.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping, Optional

from vcpo_jax.model import chat
from vcpo_jax.model import tokenizer as tokenizer_lib

CALL_OPEN, CALL_CLOSE = "<tool_call>", chat.CALL_CLOSE
# JSON schema type -> the Python types json.loads gives it (bool is an int in Python: excluded explicitly).
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,)}
# Failure kinds, in the order a call is checked; the reply's fixed text (never the model's text: no injection).
ERROR_KINDS = {
    "too_long": "error: call too long",
    "json": "error: the call is not valid JSON",
    "malformed": 'error: a call is {"name": <tool>, "arguments": {...}}',
    "unknown_tool": "error: unknown tool",            # + the declared names
    "bad_arguments": "error: bad arguments",          # + the expected parameters and types
    "tool": "error",                                  # the tool's own failure, e.g. "error: division by zero"
    "timeout": "error: the tool did not answer in time",  # past the tools pool's per-call timeout
}
TOOL_FAILED = "error: tool failed"  # a tool that raised anything but ToolError (its message is never shown)


class ToolError(Exception):
  """Raised by a tool for a failure the model may read: the reply is "error: <message>" (kind 'tool', or
  'tool/<kind>' when the tool names its own failure kind, e.g. the code sandbox's 'syntax_error'). Any
  other exception is the fixed "error: tool failed". Build the message from fixed phrases, not the call's
  arguments, or the model's text flows back into its context."""

  def __init__(self, message: str = "", kind: Optional[str] = None):
    super().__init__(message)
    self.kind = kind


@dataclasses.dataclass(frozen=True)
class ToolReply:
  """What the environment appends after a call (as tokens with mask 0). content: what the tool message holds;
  text: the template's rendering (end of the call's turn, tool message, next generation prompt); kind: the
  failure kind (an ERROR_KINDS key, or 'tool/<the tool's own kind>') or None for an answered call."""
  text: str
  error: bool
  content: str = ""
  kind: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Tool:
  """One function: its declared JSON schema and run(**arguments) -> the reply's content (a str; any other value
  is sent as JSON), raising ToolError for a failure the model may read. parameters: name -> JSON type;
  required: the names a call must give (None: all); docs: name -> description; schema: an explicit
  declaration's "function" object, declared as given (the checks still use parameters and required)."""
  name: str
  description: str
  parameters: Mapping[str, str]
  run: Optional[Callable[..., Any]] = None
  required: Optional[tuple[str, ...]] = None
  docs: Mapping[str, str] = dataclasses.field(default_factory=dict)
  schema: Optional[Mapping[str, Any]] = None

  def __post_init__(self):
    unknown = sorted({t for t in self.parameters.values() if t not in _JSON_TYPES})
    if unknown:
      raise ValueError(f"tool {self.name!r}: parameter types {unknown} are not JSON types {sorted(_JSON_TYPES)}")

  @property
  def required_names(self) -> tuple[str, ...]:
    return tuple(self.parameters) if self.required is None else tuple(self.required)

  def declaration(self) -> dict:
    if self.schema is not None:
      return {"type": "function", "function": {"name": self.name, **self.schema}}
    props = {k: {"type": t, **({"description": self.docs[k]} if k in self.docs else {})}
             for k, t in self.parameters.items()}
    return {"type": "function", "function": {
        "name": self.name, "description": self.description,
        "parameters": {"type": "object", "properties": props, "required": list(self.required_names)}}}

  def signature(self) -> str:
    optional = set(self.parameters) - set(self.required_names)
    return ", ".join(f"{k} ({t}{', optional' if k in optional else ''})" for k, t in self.parameters.items())

  def accepts(self, args: Mapping[str, Any]) -> bool:
    return (set(self.required_names) <= set(args) <= set(self.parameters)
            and all(_is_type(v, self.parameters[k]) for k, v in args.items()))


def call_text(name: str, **arguments) -> str:
  """A call as the template renders one (what warm-start traces write; ends at the stop string)."""
  return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def find_call(turn_text: str) -> Optional[str]:
  """The body of the turn's first complete call: the text between the last `<tool_call>` before the first
  `</tool_call>` and it ('' when that closer has no opener: a malformed call), or None when the turn makes no
  call (no `</tool_call>`)."""
  end = turn_text.find(CALL_CLOSE)
  if end < 0:
    return None
  start = turn_text.rfind(CALL_OPEN, 0, end)
  return "" if start < 0 else turn_text[start + len(CALL_OPEN):end]


def _is_type(value: Any, json_type: str) -> bool:
  return isinstance(value, _JSON_TYPES[json_type]) and (json_type == "boolean" or not isinstance(value, bool))


def _content(value: Any) -> str:
  return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolEnvironment:
  """A turn whose text holds `</tool_call>` is a call (generation stops there: stop_strings); any other turn
  ends the episode. max_turns: model turns per episode (at most max_turns - 1 calls are answered);
  max_call_chars caps a call's body; render_reply(content) is the chat template's tool turn
  (model.chat.ChatFormat.tool_reply), set by the task from the tokenizer it renders prompts with.
  reward: an episode-level reward (completion text -> float) or None (the task's reward applies).
  Its tools keep no state, so one object serves every episode (`start` returns it); an environment with
  per-episode state is a tasks.environments.base.EnvironmentFactory, whose `start` makes one of these per episode."""

  stop_strings = (CALL_CLOSE,)
  reward: Optional[Callable[[str], Optional[float]]] = None

  def __init__(self, tools: list[Tool], *, max_turns: int = 4, max_call_chars: int = 256,
               render_reply: Optional[Callable[[str], str]] = None):
    for field, value, low in (("max_turns", max_turns, 1), ("max_call_chars", max_call_chars, 16)):
      if isinstance(value, bool) or not isinstance(value, int) or value < low or (field == "max_turns"
                                                                                   and value > 64):
        raise ValueError(f"{field} must be an int in [{low}, {64 if field == 'max_turns' else 'inf'}), "
                         f"got {value!r}")
    if not tools or len({t.name for t in tools}) != len(tools):
      raise ValueError(f"tools must be non-empty with distinct names, got {[t.name for t in tools]}")
    self.tools = {t.name: t for t in tools}
    self.max_turns, self.max_call_chars = max_turns, max_call_chars
    self.render_reply = render_reply or tokenizer_lib.TASK_CHAT.tool_reply

  def start(self, example: Optional[dict] = None) -> "ToolEnvironment":
    """The environment of one episode: this one (its tools keep no state)."""
    return self

  def declarations(self) -> list[dict]:
    """The tools=[...] a chat template declares in the prompt."""
    return [t.declaration() for t in self.tools.values()]

  def call_text(self, name: str, **arguments) -> str:
    return call_text(name, **arguments)

  def respond(self, turn_text: str) -> Optional[ToolReply]:
    """The reply to the turn's call, or None when the turn makes none (the episode ends)."""
    body = find_call(turn_text)
    return None if body is None else self.answer(body)

  def answer(self, body: str) -> ToolReply:
    """Parses, checks and runs one call body; every failure is an error reply, never an exception."""
    if len(body) > self.max_call_chars:
      return self._error("too_long")
    try:
      call = json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; deep nesting may recurse
      return self._error("json")
    if (not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["name"], str)
        or not isinstance(call["arguments"], dict)):
      return self._error("malformed")
    tool = self.tools.get(call["name"])
    if tool is None:
      return self._error("unknown_tool", f"; tools: {', '.join(self.tools)}")
    args = call["arguments"]
    if not tool.accepts(args):
      return self._error("bad_arguments", f"; {tool.name} takes {tool.signature()}")
    try:
      content, failed = _content(tool.run(**args)), False
    except ToolError as e:
      content, failed, kind = f"error: {e}", True, "tool" if e.kind is None else f"tool/{e.kind}"
    except Exception:  # noqa: BLE001 - a tool's bug must not stop the job; the model sees a fixed phrase
      content, failed, kind = TOOL_FAILED, True, "tool"
    return ToolReply(self.render_reply(content), failed, content, kind if failed else None)

  def error_reply(self, kind: str) -> ToolReply:
    """The fixed reply of a failure found outside the call's checks (kind 'timeout', or 'tool' for a crash)."""
    return self._error(kind) if kind != "tool" else ToolReply(self.render_reply(TOOL_FAILED), True, TOOL_FAILED,
                                                              "tool")

  def _error(self, kind: str, detail: str = "") -> ToolReply:
    content = ERROR_KINDS[kind] + detail
    return ToolReply(self.render_reply(content), True, content, kind)
