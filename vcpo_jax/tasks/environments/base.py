"""Multi-turn environments as plug-ins: a class whose typed public methods are tools, one instance per episode.

Write one by subclassing `Environment` (the shape of TRL's environment_factory):
- `reset(example)` starts an episode from its prompt example; the instance may keep per-episode state;
- every public method defined on the subclass is a tool: its parameters must be annotated (str, int, float,
  bool, list, dict), its JSON schema is derived from the signature and the docstring (first paragraph: the
  description; an `Args:` section: the parameters' descriptions), or given as written in `tool_schemas`;
  it returns the reply's content, or raises `tool_calls.ToolError` for a failure the model may read;
- `reward(completion)` may return the episode's reward (None: the task's reward applies);
- constructor keyword parameters (with defaults) are the environment's options.
Register it with `@register_environment`, or name it as 'module:Class' (the task option `environment`);
`make(name, ...)` gives the `EnvironmentFactory` a task and the episode runner use: it declares the tools, and
`start(example)` makes each episode's environment.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from typing import Any, Callable, Mapping, Optional

from vcpo_jax import registry
from vcpo_jax.tasks.environments import tool_calls


_JSON_OF = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
# name -> Environment subclass; options are its constructor's keyword parameters.
ENVIRONMENTS = registry.Registry("environment", facts={})


class Environment:
  """One episode's environment. Subclass it: see the module docstring."""

  name: str = ""
  # tool name -> its declaration's "function" object without the name ({"description": ..., "parameters":
  # {JSON schema}}), declared exactly so; the calls are still checked against the method's signature.
  tool_schemas: Mapping[str, Mapping[str, Any]] = {}

  def reset(self, example: dict) -> None:
    """Starts an episode from its prompt example (fields: 'prompt', 'key', the task's own)."""

  def reward(self, completion: str) -> Optional[float]:
    """The episode's reward from the whole completion text and this episode's state; None: the task's."""
    return None


def _doc_parts(fn: Callable) -> tuple[str, dict[str, str]]:
  """(description, {parameter: description}) from a Google-style docstring: the first paragraph, and the
  `Args:` section's `name: text` entries (deeper-indented lines continue an entry)."""
  doc = inspect.getdoc(fn) or ""
  head, _, args = doc.partition("\nArgs:\n")
  description = " ".join(head.split("\n\n")[0].split())
  docs, name, indent = {}, None, None
  for line in args.splitlines():
    m = re.match(r"^(\s+)(\w+)(?: \([^)]*\))?:(.*)$", line)
    if m and (indent is None or len(m.group(1)) == indent):
      indent, name = len(m.group(1)), m.group(2)
      docs[name] = m.group(3).strip()
    elif name is not None and line.strip() and len(line) - len(line.lstrip()) > indent:
      docs[name] = f"{docs[name]} {line.strip()}".strip()
    else:
      break  # the end of the Args section
  return description, docs


def _tool_of(cls: type, name: str, fn: Callable) -> tool_calls.Tool:
  hints = typing.get_type_hints(fn)
  parameters, required = {}, []
  for p in list(inspect.signature(fn).parameters.values())[1:]:  # after self
    if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
      raise TypeError(f"environment {cls.__name__}: tool {name}() takes *args or **kwargs ({p.name}); declare "
                      f"each parameter")
    if hints.get(p.name) not in _JSON_OF:
      raise TypeError(f"environment {cls.__name__}: tool {name}() parameter {p.name!r} needs an annotation, one "
                      f"of {[t.__name__ for t in _JSON_OF]}; got {hints.get(p.name)!r}")
    parameters[p.name] = _JSON_OF[hints[p.name]]
    if p.default is p.empty:
      required.append(p.name)
  description, docs = _doc_parts(fn)
  schema = cls.tool_schemas.get(name)
  return tool_calls.Tool(name, description, parameters, run=fn, required=tuple(required),
                         docs={k: v for k, v in docs.items() if k in parameters},
                         schema=None if schema is None else dict(schema))


@functools.cache
def tools_of(cls: type) -> tuple[tool_calls.Tool, ...]:
  """The tools of an Environment subclass, in definition order (base classes' first); `run` is unbound."""
  if not (isinstance(cls, type) and issubclass(cls, Environment)):
    raise TypeError(f"{cls!r} is not an Environment subclass")
  found: dict[str, Callable] = {}
  for klass in reversed(cls.__mro__):
    if klass is object or klass is Environment:
      continue
    for name, value in vars(klass).items():
      if not name.startswith("_") and name not in vars(Environment) and inspect.isfunction(value):
        found[name] = value
  unknown = sorted(set(cls.tool_schemas) - set(found))
  if unknown:
    raise TypeError(f"environment {cls.__name__}: tool_schemas names {unknown}, which are not its tools "
                    f"{sorted(found)}")
  if not found:
    raise TypeError(f"environment {cls.__name__} has no tools (public methods with annotated parameters)")
  return tuple(_tool_of(cls, name, fn) for name, fn in found.items())


def register_environment(cls: type) -> type:
  """Class decorator: registers an Environment subclass under its `name` (its tools are checked now)."""
  if not cls.name:
    raise ValueError(f"environment {cls.__name__} needs a `name` to be registered")
  tools_of(cls)
  ENVIRONMENTS.register(cls.name, options=registry.options_from_signature(cls.__init__, cls.name))(cls)
  return cls


class EnvironmentFactory:
  """An environment as a task and the episode runner use it: the tools' declarations and the call format
  (declarations, call_text, stop_strings, max_turns), and `start(example)`: a fresh instance, reset from the
  example, wrapped in a tool_calls.ToolEnvironment that parses, checks and answers its calls. `pool` (a
  calls.offload.CallPool, thread or inline: the instances live in this process; None: inline) runs starts,
  calls and episode rewards off the rollout event loop (the job builds it from the config section `tools` and
  passes it to the task, which passes it here)."""

  stop_strings = tool_calls.ToolEnvironment.stop_strings

  def __init__(self, cls: type, options: Optional[Mapping[str, Any]] = None, *, max_turns: int = 4,
               max_call_chars: int = 256, render_reply: Optional[Callable[[str], str]] = None, pool=None):
    self.cls, self.options = cls, dict(options or {})
    self.tools = tools_of(cls)
    cls(**self.options)  # a bad option fails now, not in the first episode
    self._checker = tool_calls.ToolEnvironment(list(self.tools), max_turns=max_turns, max_call_chars=max_call_chars,
                                               render_reply=render_reply)
    self.max_turns, self.max_call_chars = max_turns, max_call_chars
    self.render_reply = self._checker.render_reply
    self.pool = pool
    self.has_reward = cls.reward is not Environment.reward

  def declarations(self) -> list[dict]:
    return self._checker.declarations()

  def call_text(self, name: str, **arguments) -> str:
    return self._checker.call_text(name, **arguments)

  def start(self, example: Optional[dict] = None) -> tool_calls.ToolEnvironment:
    """One episode's environment: its tools are the new instance's methods."""
    env = self.cls(**self.options)
    env.reset(dict(example or {}))
    tools = [dataclasses.replace(t, run=getattr(env, t.name)) for t in self.tools]
    episode = tool_calls.ToolEnvironment(tools, max_turns=self.max_turns, max_call_chars=self.max_call_chars,
                                         render_reply=self.render_reply)
    if self.has_reward:
      episode.reward = env.reward
    return episode

  def respond(self, turn_text: str) -> Optional[tool_calls.ToolReply]:
    """The reply to a turn in a fresh episode (warm-start traces of an environment whose first reply needs no
    state, e.g. the calculator's)."""
    return self.start().respond(turn_text)


def environment_class(spec: str, *, field: str = "environment") -> type:
  """A registered environment's class by name, or the user's 'module:Class' (an Environment subclass, imported
  now: a missing module or class is an error naming `field` and `spec`)."""
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"{field}={spec!r}: name an environment ({ENVIRONMENTS.names()}) or a 'module:Class'")
  spec = spec.strip()
  if ":" not in spec:
    if spec not in ENVIRONMENTS:
      raise ValueError(f"{field}={spec!r}: unknown environment; known: {ENVIRONMENTS.names()} or a "
                       f"'module:Class'")
    return ENVIRONMENTS.get(spec).fn
  module_name, _, attr = spec.partition(":")
  try:
    cls = registry._resolve(spec)
  except ImportError as e:
    raise ValueError(f"{field}={spec!r}: cannot import module {module_name!r} ({e}); it must be importable "
                     f"(on PYTHONPATH) in the job") from None
  except AttributeError:
    raise ValueError(f"{field}={spec!r}: module {module_name!r} has no attribute {attr!r}") from None
  if not (isinstance(cls, type) and issubclass(cls, Environment)):
    raise ValueError(f"{field}={spec!r}: {attr!r} is not a subclass of {__name__}.Environment")
  try:
    tools_of(cls)
  except TypeError as e:
    raise ValueError(f"{field}={spec!r}: {e}") from None
  return cls


def make(name: str, *, max_turns: int = 4, max_call_chars: int = 256,
         render_reply: Optional[Callable[[str], str]] = None, pool=None, field: str = "environment",
         **options) -> EnvironmentFactory:
  """The environment `name` (registered, or a user's 'module:Class') with its options, its calls run in `pool`
  (a calls.offload.CallPool; None: inline); unknown names or options are errors listing the known ones."""
  cls = environment_class(name, field=field)
  entry = ENVIRONMENTS.get(name) if name in ENVIRONMENTS else registry.Entry(
      "environment", name, cls, registry.options_from_signature(cls.__init__, name), {})
  return EnvironmentFactory(cls, dataclasses.asdict(entry.make_options(options)), max_turns=max_turns,
                            max_call_chars=max_call_chars, render_reply=render_reply, pool=pool)


def tool_prompt(task_name: str, tools: "EnvironmentFactory", render_prompt: Callable) -> Callable[[str], str]:
  """user text -> a prompt that declares `tools` to the chat template, whose tool messages then become the tools'
  replies. render_prompt is a Tokenizer.chat_prompt (model.chat.ChatFormat: called with tools=[...], with a
  tool_reply); anything else is an error naming the task."""
  if not callable(getattr(render_prompt, "tool_reply", None)):
    raise ValueError(f"{task_name} needs a chat format with tool support (Tokenizer.chat_prompt), got "
                     f"render_prompt={render_prompt!r}")
  declared = tools.declarations()
  tools.render_reply = render_prompt.tool_reply
  return lambda user_text: render_prompt(user_text, tools=declared)
