"""Named choices (estimators, losses, rollout backends, tasks, environments, verifiers) registered with their facts and a typed options dataclass."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable, Mapping, Union

# A fact is a bool, or a function of the (typed) options when it depends on them (OPOB's scope). Each registry
# names the facts its entries may declare; these are the estimators' and losses'.
Fact = Union[bool, Callable[[Any], bool]]
FACTS = {
    "seq_coefficient": "d loss / d log pi_t is one stop-gradient constant per sequence on its response tokens, "
                       "so the book-keeping path gives norms and the gradient from one backward",
    "batch_global": "a statistic over the whole batch (not exact in micro-batches)",
    "group_local": "a statistic over each prompt group (needs >= 2 samples per group; chunks of whole groups "
                   "are exact)",
    "needs_grad_norms": "needs per-sequence squared gradient norms (the learner's extra pass)",
    "uses_tau": "its option 'tau' defaults to the shared truncation threshold (algo.tis_threshold)",
}


@dataclasses.dataclass(frozen=True)
class NoOptions:
  """For choices without options."""


@dataclasses.dataclass(frozen=True)
class Entry:
  """One registered choice: its function, options dataclass and facts."""
  kind: str
  name: str
  fn: Callable
  options: type
  facts: Mapping[str, Fact]
  known_facts: Mapping[str, str] = dataclasses.field(default_factory=lambda: FACTS)

  def fact(self, name: str, options: Any = None) -> bool:
    """The fact's value (evaluated on `options`, default options when None, if it depends on them)."""
    if name not in self.known_facts:
      raise ValueError(f"unknown fact {name!r}; known facts: {sorted(self.known_facts)}")
    value = self.facts.get(name, False)
    if callable(value):
      return bool(value(self.options() if options is None else options))
    return bool(value)

  def option_names(self) -> list[str]:
    return [f.name for f in dataclasses.fields(self.options)]

  def make_options(self, options: Union[Mapping[str, Any], Any, None] = None, **defaults):
    """Typed options from a mapping (unknown keys are errors listing the known ones); `defaults` fill keys
    the mapping leaves out. An instance of the options class passes through."""
    if isinstance(options, self.options):
      return options
    given = dict(options or {})
    known = self.option_names()
    unknown = sorted(set(given) - set(known))
    if unknown:
      raise ValueError(f"{self.kind} {self.name!r} got unknown option(s) {unknown}; known options: {known}")
    for key, value in defaults.items():
      if key in known:
        given.setdefault(key, value)
    # Lists (from JSON or a ConfigDict) become the tuples the frozen, hashable dataclasses hold.
    return self.options(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})


def options_from_signature(fn: Callable, name: str, skip: tuple[str, ...] = ()) -> type:
  """A frozen options dataclass whose fields are `fn`'s keyword parameters with their defaults and types
  (for choices configured by their constructor, such as tasks); `skip` names parameters that are not options
  (objects the job passes in, such as a task's tool pool)."""
  fields = []
  for p in list(inspect.signature(fn).parameters.values())[1:]:  # after self / the positional input
    if p.name in skip:
      continue
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is p.empty:
      raise TypeError(f"{name}: parameter {p.name!r} needs a default to be an option")
    fields.append((p.name, Any if p.annotation is p.empty else p.annotation, dataclasses.field(default=p.default)))
  return dataclasses.make_dataclass(f"{name.title().replace('_', '')}Options", fields, frozen=True,
                                    namespace={"__module__": fn.__module__})


def parse_value(text: str) -> Any:
  """An option's value written on a command line: true/false, an int, a float, else the text itself."""
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text


def parse_options(text: str | Mapping[str, Any], field: str) -> dict[str, Any]:
  """'wall_seconds=2,exact_prints=true' (or a mapping, passed through) -> {'wall_seconds': 2, ...}."""
  if isinstance(text, Mapping):
    return dict(text)
  out = {}
  for item in filter(None, (s.strip() for s in (text or "").split(","))):
    key, eq, value = item.partition("=")
    if not eq or not key.strip():
      raise ValueError(f"{field}={text!r}: item {item!r} is not <option>=<value>")
    out[key.strip()] = parse_value(value.strip())
  return out


def _resolve(target: str) -> Callable:
  module, _, attr = target.partition(":")
  out = importlib.import_module(module)
  for part in attr.split("."):
    out = getattr(out, part)
  return out


class Registry:
  """name -> Entry, filled by the `register` decorator where each choice is defined (or by `register_lazy`
  with a "module:attribute" path, so a heavy implementation is imported only when chosen)."""

  def __init__(self, kind: str, facts: Mapping[str, str] = FACTS):
    self.kind = kind
    self.facts = dict(facts)
    self._entries: dict[str, Entry] = {}

  def register(self, name: str, *, options: type = NoOptions, **facts: Fact) -> Callable:
    unknown = sorted(set(facts) - set(self.facts))
    if unknown:
      raise ValueError(f"{self.kind} {name!r}: unknown fact(s) {unknown}; known facts: {sorted(self.facts)}")
    if not dataclasses.is_dataclass(options):
      raise TypeError(f"{self.kind} {name!r}: options must be a dataclass, got {options!r}")

    def decorate(fn: Callable) -> Callable:
      if name in self._entries:
        raise ValueError(f"{self.kind} {name!r} is registered twice")
      self._entries[name] = Entry(self.kind, name, fn, options, dict(facts), self.facts)
      return fn
    return decorate

  def register_lazy(self, name: str, target: str, *, options: type = NoOptions, **facts: Fact) -> None:
    """Registers the callable at "module:attribute", imported on first call."""
    self.register(name, options=options, **facts)(lambda *args, **kwargs: _resolve(target)(*args, **kwargs))

  def alias(self, name: str, existing: str):
    """`name` is another name for a registered choice (same function, options and facts)."""
    self._entries[name] = dataclasses.replace(self.get(existing), name=name)

  def unregister(self, name: str) -> None:
    """Removes a choice (a test or a notebook that registered one for a while); unknown names are errors."""
    self.get(name)
    del self._entries[name]

  def get(self, name: str) -> Entry:
    if name not in self._entries:
      raise ValueError(f"unknown {self.kind} name={name!r}; known names: {sorted(self._entries)}")
    return self._entries[name]

  def names(self) -> list[str]:
    return sorted(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def __iter__(self):
    return iter(self.names())
