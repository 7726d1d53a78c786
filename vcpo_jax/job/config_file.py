"""A Python file named by path (a config or sweep file, as --config=path[:arg] names one) loaded as a module."""
from __future__ import annotations

import importlib.util
import os
import re
import types


def load(path: str | os.PathLike) -> types.ModuleType:
  """The file's module (run afresh on every call; not put in sys.modules); the caller checks that it exists."""
  path = os.fspath(path)
  spec = importlib.util.spec_from_file_location("config_file_" + re.sub(r"\W", "_", path), path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
