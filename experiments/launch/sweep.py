"""Sweeps as data: sweep / fixed / product / zipit / chain over dicts of `config.<field>` overrides and labels.

A sweep is a list of work-unit dicts. Keys starting with `config.` override the job's config (as the
`--config.<field>=value` flag would); every other key is a label the report groups by (e.g. `arm`).
Example (vmoe / scenic style):

    product(chain(arm("sync", {"rl.max_lag": 0}), arm("vcpo", {"rl.max_lag": 64})), seeds(3))
"""
from __future__ import annotations

import itertools
import re
from typing import Any, Iterable, Mapping, Sequence

CONFIG_PREFIX = "config."
# Short names used in work-unit names (the full key is always in the unit's record).
ALIASES = {"config.rl.max_lag": "k", "config.seed": "s", "config.optim.learning_rate": "lr"}
ALWAYS_NAMED = ("config.rl.max_lag", "config.seed")

Unit = dict[str, Any]
Sweep = list[Unit]


def sweep(key: str, values: Iterable[Any]) -> Sweep:
  """One unit per value of `key`."""
  values = list(values)
  if not values:
    raise ValueError(f"sweep({key!r}) got no values")
  return [{key: v} for v in values]


def fixed(overrides: Mapping[str, Any] | None = None, **labels) -> Sweep:
  """A single unit: `config.`-prefixed overrides given without the prefix, plus labels."""
  return [{**{CONFIG_PREFIX + k: v for k, v in (overrides or {}).items()}, **labels}]


def arm(name: str, overrides: Mapping[str, Any] | None = None) -> Sweep:
  """A named experimental arm: `fixed(overrides, arm=name)`."""
  return fixed(overrides, arm=name)


def seeds(n: int, key: str = "config.seed") -> Sweep:
  return sweep(key, range(n))


def _merge(units: Sequence[Unit]) -> Unit:
  out: Unit = {}
  for unit in units:
    for key, value in unit.items():
      if key in out and out[key] != value:
        raise ValueError(f"combined sweeps disagree on {key!r}: {out[key]!r} vs {value!r}")
      out[key] = value
  return out


def product(*sweeps: Sweep) -> Sweep:
  """Cartesian product; the last sweep varies fastest. Keys set by two factors must agree."""
  return [_merge(combo) for combo in itertools.product(*sweeps)]


def zipit(*sweeps: Sweep) -> Sweep:
  """Element-wise merge of equally long sweeps."""
  lengths = {len(s) for s in sweeps}
  if len(lengths) > 1:
    raise ValueError(f"zipit needs sweeps of one length, got lengths {[len(s) for s in sweeps]}")
  return [_merge(combo) for combo in zip(*sweeps)]


def chain(*sweeps: Sweep) -> Sweep:
  """Concatenation (the union of several sweeps)."""
  return [dict(u) for s in sweeps for u in s]


def overrides(unit: Mapping[str, Any]) -> dict[str, Any]:
  """{config field path: value} of a unit (the `config.` prefix removed)."""
  return {k[len(CONFIG_PREFIX):]: v for k, v in unit.items() if k.startswith(CONFIG_PREFIX)}


def labels(unit: Mapping[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in unit.items() if not k.startswith(CONFIG_PREFIX) and k != "name"}


def _token(key: str, value: Any) -> str:
  if key == "arm":
    return str(value)
  short = ALIASES.get(key, key.rsplit(".", 1)[-1])
  return f"{short}{value}"


def _set_by_arm(units: Sweep, key: str) -> bool:
  """True when the arm label alone determines `key` (e.g. an arm's learning rate): no need to name it."""
  seen: dict = {}
  return all("arm" in u and seen.setdefault(u["arm"], repr(u.get(key))) == repr(u.get(key)) for u in units)


def name_units(units: Sweep) -> Sweep:
  """Adds a unique, filesystem-safe name (unless given): arm, lag, seed, then other keys that vary and that
  the arm does not determine, e.g. 'vcpo-k64-s0'."""
  keys = list(dict.fromkeys(k for u in units for k in u if k != "name"))
  # Always named: the arm, the lag and the seed (so adding seeds or lags later keeps existing names).
  always = ["arm", *ALWAYS_NAMED]
  varying = [k for k in keys if k in always or (len({repr(u.get(k)) for u in units}) > 1
                                                  and not _set_by_arm(units, k))]
  varying.sort(key=lambda k: always.index(k) if k in always else len(always))
  named = []
  for i, unit in enumerate(units):
    name = unit.get("name") or "-".join(_token(k, unit[k]) for k in varying if k in unit) or f"unit{i}"
    named.append({**unit, "name": re.sub(r"[^A-Za-z0-9_.=+-]+", "_", str(name))})
  names = [u["name"] for u in named]
  duplicates = sorted({n for n in names if names.count(n) > 1})
  if duplicates:
    raise ValueError(f"work-unit names are not unique: {duplicates}; give the units a 'name' or an 'arm' label")
  return named


def parse_arg(arg: str, **defaults: Any) -> dict[str, Any]:
  """`"k=64,seeds=3,lags=0+4+16"` -> dict typed like `defaults` (lists/tuples split on '+')."""
  out = dict(defaults)
  for item in filter(None, (s.strip() for s in arg.split(","))):
    key, sep, raw = item.partition("=")
    if not sep or key not in defaults:
      raise ValueError(f"sweep argument {item!r}: expected key=value with key in {sorted(defaults)}")
    default = defaults[key]
    if isinstance(default, (list, tuple)):
      kind = type(default[0]) if default else str
      out[key] = type(default)(kind(v) for v in raw.split("+") if v)
    elif isinstance(default, bool):
      out[key] = raw.lower() in ("1", "true", "yes")
    else:
      out[key] = type(default)(raw)
  return out
