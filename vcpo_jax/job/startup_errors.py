"""Config and data errors as one line a person can read (`error: <field>: <reason>`, exit status 2)."""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Mapping, Sequence

from absl import flags

EXIT_STATUS = 2  # a usage error, as a shell tool reports one; unexpected failures keep Python's 1
PREFIX = "invalid config: "  # how every config check's ValueError begins, wherever it is raised
TRACEBACK_VAR = "VCPO_TRACEBACK"  # set (or --verbosity=1) to see the traceback of a config error too
# `field=value: why` with a field like rollout.server_devices or a.b['c']; the value's repr is the shortest match.
_FIELD_VALUE_WHY = re.compile(r"(?P<field>[A-Za-z_][\w.\[\]'-]*)(?:=(?P<value>.*?))?: (?P<why>.*)", re.S)


class ConfigError(ValueError):
  """A config field (or a data file it names) is wrong; str() keeps the `invalid config: field=value: why` form."""

  def __init__(self, field: str, value: Any, reason: str):
    super().__init__(f"{PREFIX}{field}={value!r}: {reason}")
    self.field, self.value, self.reason = field, value, reason


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def _refine(field: str, section: Any, reason: str) -> tuple[str, str]:
  """A section's error whose reason names a field in it (`task.options.dataset.train_files: ...`, or just
  `schema='csv': ...`): that field."""
  m = _FIELD_VALUE_WHY.fullmatch(reason)
  if m is None:
    return field, reason
  why = m["why"] if m["value"] is None else f"{m['why']} (got {m['value']})"
  if m["field"].startswith(field + "."):
    return m["field"], why
  if m["field"] in section:
    return f"{field}.{m['field']}", why
  return field, reason


def one_line(e: BaseException) -> str | None:
  """`error: <field>: <reason>` for a config or data error, None for anything else. A whole section's value
  (a dict) is never printed: the field inside it that is wrong, or the reason, says what to change."""
  if isinstance(e, ConfigError):
    mapping = isinstance(e.value, Mapping) or hasattr(e.value, "to_dict")
    field, reason = _refine(e.field, e.value, e.reason) if mapping else (e.field, f"{e.reason} (got {_short(e.value)})")
  elif isinstance(e, ValueError) and str(e).startswith(PREFIX):
    text = str(e)[len(PREFIX):]
    m = _FIELD_VALUE_WHY.fullmatch(text)
    if m is None:
      field, reason = "config", text
    else:
      field, reason = m["field"], m["why"] if m["value"] is None else f"{m['why']} (got {m['value']})"
  else:
    return None
  return " ".join(f"error: {field}: {reason}".splitlines())


def exit_if_config_error(e: BaseException, traceback_wanted: bool) -> None:
  """Prints the one line and exits with EXIT_STATUS if `e` is a config error and no traceback is wanted."""
  line = one_line(e)
  if line is not None and not traceback_wanted:
    print(line, file=sys.stderr)
    raise SystemExit(EXIT_STATUS)


def _exit(line: str) -> None:
  print(" ".join(line.splitlines()), file=sys.stderr)
  raise SystemExit(EXIT_STATUS)


def _override_named(key: str, argv: Sequence[str]) -> str | None:
  """The `--config.<path>` override whose path has the component `key`, as `<path>`."""
  for arg in argv:
    path = arg.split("=", 1)[0].removeprefix("--config.")
    if arg.startswith("--config.") and key in path.split("."):
      return path
  return None


def _section_hint(path: str, value: str) -> str:
  """What to write instead of a value for a whole section (`--config.rl.dynamic_sampling=true`): its fields."""
  try:
    section = flags.FLAGS["config"].value
    for key in path.split("."):
      section = section[key]
    fields = sorted(section.keys())
  except (KeyError, AttributeError, TypeError):
    fields = []
  text = f"a section, not a value (got {value!r})"
  if "enabled" in fields and value.strip().lower() in ("true", "false", "1", "0"):
    on = value.strip().lower() in ("true", "1")
    return f"{text}: to switch it {'on' if on else 'off'}, --config.{path}.enabled={str(on).lower()}"
  return f"{text}: set its fields ({', '.join(fields)})" if fields else f"{text}: set its fields"


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (app.run's flags_parser) with its errors as one line and exit status 2: a value of
  the wrong type, an unknown or missing flag, an override that names no config field."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # `flag --config.rl.max_lag=abc: invalid literal ...`, unknown or missing flags
    m = re.match(r"flag --(?:config\.)?([\w.-]+)=.*?: (.*)", str(e), re.S)
    section = m and re.match(r"Failed to parse '(.*)' as a ConfigDict", m[2], re.S)
    if section:
      _exit(f"error: {m[1]}: {_section_hint(m[1], section[1])}")
    _exit(f"error: {m[1]}: {m[2]}" if m else f"error: flags: {e}")
  except (AttributeError, KeyError) as e:  # ml_collections: an override naming no field ("Did you mean ...")
    text = str(e.args[0]) if e.args else str(e)
    key = re.match(r"""\W*(\w+)""", text)
    path = key and _override_named(key[1], argv)
    if path is None or os.environ.get(TRACEBACK_VAR):
      raise
    hint = re.search(r'Did you mean "(\w+)"', text)
    _exit(f"error: {path}: not a config field" + (f'; did you mean "{hint[1]}"?' if hint else ""))
  return []  # not reached


def exit_if_config_file_error(e: OSError, traceback_wanted: bool) -> None:
  """The --config file could not be loaded (ml_collections reports it when the config is first read)."""
  if not traceback_wanted:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    _exit(f"error: config: cannot load the config file: {lines[-1] if lines else e}")
