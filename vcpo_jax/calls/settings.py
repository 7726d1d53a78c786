"""A pool's config section (`reward`, `tools`) as a frozen dataclass: typed fields, each checked by its rule."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, TypeVar

SettingsT = TypeVar("SettingsT")


class Rule(NamedTuple):
  """What a field accepts, and the requirement in words (the error's and the configuration reference's)."""
  accepts: Callable[[Any], bool]
  requirement: str


def one_of(*names: str, why: str = "") -> Rule:
  listed = ", ".join(repr(n) for n in names)
  return Rule(lambda v: isinstance(v, str) and v in names, f"must be one of {listed}{why}")


def is_int_at_least(low: int) -> Callable[[Any], bool]:
  """An int (not a bool) >= low: the predicate of every int field's check (these sections' and the job's)."""
  return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def is_number(ok: Callable[[float], bool]) -> Callable[[Any], bool]:
  """A finite int or float (not a bool) that `ok` accepts: the predicate of every number field's check."""
  return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok(v)


def int_at_least(low: int, why: str = "") -> Rule:
  return Rule(is_int_at_least(low), f"must be an int >= {low}{why}")


def number_above(low: float, why: str = "") -> Rule:
  return Rule(is_number(lambda v: v > low), f"must be a number > {low:g}{why}")


def setting(default: Any, rule: Rule) -> Any:
  """A section's field: its default and its rule."""
  return dataclasses.field(default=default, metadata={"rule": rule})


def rule_of(cls: type, name: str) -> Rule:
  return next(f.metadata["rule"] for f in dataclasses.fields(cls) if f.name == name)


def read_section(cls: type[SettingsT], section: str, values: Optional[Mapping[str, Any]]) -> SettingsT:
  """`cls` from the config section named `section` (None, or a field left out: the defaults). An unknown field,
  or a value its rule refuses, is a ValueError `invalid config: <section>.<field>=<value>: <why>`."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  given = {key: values[key] for key in (values.keys() if values is not None else ())}
  for key, value in given.items():
    if key not in fields:
      raise ValueError(f"invalid config: {section}.{key}={value!r}: not a field of {section}; "
                       f"its fields: {sorted(fields)}")
    rule = fields[key].metadata["rule"]
    if not rule.accepts(value):
      raise ValueError(f"invalid config: {section}.{key}={value!r}: {rule.requirement}")
    if isinstance(fields[key].default, float):  # an int where a float is meant (timeout_s=10) is stored as one
      given[key] = float(value)
  return cls(**given)
